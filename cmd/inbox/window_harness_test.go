package main

// An inbox table made by "inbox schema -apply", rows of a chosen age in a
// table of one of the test databases, and a Kafka cluster (kfake) holding a
// topic of a chosen retention.

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jmoiron/sqlx"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// insertAged adds n rows of consumer billing to table, processed ago before
// the database's now, on the database db of dsns(t)[name].
func insertAged(t *testing.T, db *sqlx.DB, name, table string, n int, ago time.Duration) {
	t.Helper()
	insertAgedOf(t, db, name, table, "billing", n, ago)
}

// insertAgedOf is insertAged for consumer's rows.
func insertAgedOf(t *testing.T, db *sqlx.DB, name, table, consumer string, n int, ago time.Duration) {
	t.Helper()
	us := ago.Microseconds()
	expr := map[string]string{
		"sqlite":   fmt.Sprintf("CAST(unixepoch('subsec') * 1000000 AS INTEGER) - %d", us),
		"postgres": fmt.Sprintf("now() - interval '%d microseconds'", us),
		"mysql":    fmt.Sprintf("UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND", us),
	}[name]
	for i := range n {
		if _, err := db.Exec(db.Rebind("INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES (?, ?, "+expr+")"), consumer, fmt.Sprintf("%s-%d", ago, i)); err != nil {
			t.Fatal(err)
		}
	}
}

// kafkaTopic starts a kfake cluster, stopped when t ends, with the topic
// orders of the given retention.ms and segment.ms, its records stamped by
// the broker (LogAppendTime: none ahead of its clock), and returns its
// bootstrap addresses, comma-separated.
func kafkaTopic(t *testing.T, retention, segment time.Duration) string {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(cluster.ListenAddrs(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	r, s, stamps := fmt.Sprint(retention.Milliseconds()), fmt.Sprint(segment.Milliseconds()), "LogAppendTime"
	if err := admin.CreateTopic("orders", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"retention.ms": &r, "segment.ms": &s, "message.timestamp.type": &stamps}}, false); err != nil {
		t.Fatal(err)
	}
	return strings.Join(cluster.ListenAddrs(), ",")
}

// appliedTable creates an inbox table of a name of its own with "inbox
// schema -apply" on the database dsn (db's), dropped when t ends, and
// returns its name.
func appliedTable(t *testing.T, dsn string, db *sqlx.DB) string {
	t.Helper()
	table := "cli_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	return table
}

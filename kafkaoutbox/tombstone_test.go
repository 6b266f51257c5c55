package kafkaoutbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
)

// recordsFromStart reads the first n records of topic.
func recordsFromStart(t *testing.T, brokers []string, topic string, n int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("only %d of %d records arrived", len(got), n)
		}
		fs.EachRecord(func(r *kgo.Record) { got = append(got, r) })
	}
	return got
}

// A Kafka tombstone (a keyed message with a nil payload: a null record value,
// which log compaction takes as "delete this key") published through the
// outbox reaches Kafka as a tombstone, as the same message published straight
// through kafkaoutbox does: the outbox stored nil as empty bytes and the relay
// sent a non-null value of 0 bytes, so compaction kept the key's last value.
func TestRelayThroughKafkaPublisher_KeepsATombstoneATombstone(t *testing.T) {
	const topic = "tombstones"
	brokers, _ := startCluster(t, 0, topic)
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, kafkaoutbox.DefaultSaramaConfig()), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })

	direct := message.NewMessage("direct", nil)
	direct.Metadata.Set("key", "customer-1")
	if err := pub.Publish(topic, direct); err != nil {
		t.Fatal(err)
	}

	db := testdb.OpenPostgres(t, "")
	table := "outbox_tombstones_" + testdb.RandomSuffix()
	for _, tb := range []string{table, table + "_dead"} {
		tb := tb
		_, _ = db.Exec("DROP TABLE IF EXISTS " + tb)
		t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + tb) })
	}
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: pub})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	viaOutbox := message.NewMessage("via-outbox", nil)
	viaOutbox.Metadata.Set("key", "customer-1")
	writeOutputs(t, db, ob, topic, viaOutbox)
	if r := ob.RelayOnce(context.Background()); r.Relayed != 1 {
		t.Fatalf("relay round: %+v", r)
	}

	for _, r := range recordsFromStart(t, brokers, topic, 2) {
		var uuid string
		for _, h := range r.Headers {
			if h.Key == "_watermill_message_uuid" {
				uuid = string(h.Value)
			}
		}
		t.Logf("record %s: key %q, value nil: %v, len %d", uuid, r.Key, r.Value == nil, len(r.Value))
		if r.Value != nil {
			t.Errorf("record %s reached Kafka with a non-null value (%d bytes): not a tombstone any more, compaction keeps key %q", uuid, len(r.Value), r.Key)
		}
	}
}

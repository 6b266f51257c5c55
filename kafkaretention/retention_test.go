package kafkaretention_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaretention"
)

// cluster starts an in-process Kafka (kfake) and returns an admin client.
func cluster(t *testing.T) (sarama.ClusterAdmin, []string) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(c.ListenAddrs(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	return admin, c.ListenAddrs()
}

func createTopic(t *testing.T, admin sarama.ClusterAdmin, name string, configs map[string]string) {
	t.Helper()
	entries := map[string]*string{}
	for k, v := range configs {
		entries[k] = &v
	}
	if err := admin.CreateTopic(name, &sarama.TopicDetail{NumPartitions: 3, ReplicationFactor: 1, ConfigEntries: entries}, false); err != nil {
		t.Fatal(err)
	}
}

func TestSafeWindow(t *testing.T) {
	admin, brokers := cluster(t)
	createTopic(t, admin, "defaults", nil)
	createTopic(t, admin, "one_day", map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"})
	createTopic(t, admin, "forever", map[string]string{"retention.ms": "-1"})
	createTopic(t, admin, "compacted", map[string]string{"cleanup.policy": "compact"})
	createTopic(t, admin, "compact_delete", map[string]string{"cleanup.policy": "compact,delete"})

	cases := []struct {
		topics []string
		margin time.Duration
		want   time.Duration
		err    error
	}{
		{topics: []string{"one_day"}, margin: time.Hour, want: 24*time.Hour + time.Hour + time.Hour},
		{topics: []string{"defaults"}, want: 7*24*time.Hour + 7*24*time.Hour + kafkaretention.DefaultMargin},
		{topics: []string{"one_day", "defaults"}, margin: time.Minute, want: 14*24*time.Hour + time.Minute},
		{topics: []string{"one_day", "forever"}, err: kafkaretention.ErrNoSafeWindow},
		{topics: []string{"compacted"}, err: kafkaretention.ErrNoSafeWindow},
		{topics: []string{"compact_delete"}, err: kafkaretention.ErrNoSafeWindow},
	}
	for _, tc := range cases {
		src, err := kafkaretention.New(kafkaretention.Config{Brokers: brokers, Topics: tc.topics, Margin: tc.margin})
		if err != nil {
			t.Fatal(err)
		}
		got, err := src.SafeWindow(context.Background())
		if cerr := src.Close(); cerr != nil {
			t.Errorf("Close: %v", cerr)
		}
		if cerr := src.Close(); cerr != nil { // a second Close is harmless
			t.Errorf("second Close: %v", cerr)
		}
		if tc.err != nil {
			if !errors.Is(err, tc.err) {
				t.Errorf("%v: err = %v, want %v", tc.topics, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%v: SafeWindow = %v, %v; want %v", tc.topics, got, err, tc.want)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := kafkaretention.New(kafkaretention.Config{Brokers: []string{"127.0.0.1:1"}}); err == nil {
		t.Error("no topics: want an error")
	}
	if _, err := kafkaretention.New(kafkaretention.Config{Topics: []string{"x"}}); err == nil {
		t.Error("no brokers and no admin: want an error")
	}
	if _, err := kafkaretention.New(kafkaretention.Config{Topics: []string{"x"}, Brokers: []string{"127.0.0.1:1"}, Margin: -time.Hour}); err == nil {
		t.Error("negative margin: want an error")
	}
}

// Wired into inbox.Purge: a window shorter than the topic's retention is
// refused, a zero one takes the safe window, and a topic without a safe
// window stops the purge.
func TestPurgeWithRetentionSource(t *testing.T) {
	admin, _ := cluster(t)
	createTopic(t, admin, "orders", map[string]string{"retention.ms": "3600000", "segment.ms": "600000"}) // 1h + 10m
	createTopic(t, admin, "ledger", map[string]string{"cleanup.policy": "compact"})
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	ib, err := inbox.New(inbox.Config{DB: db})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i, ago := range []time.Duration{3 * time.Hour, 2 * time.Hour, 80 * time.Minute, time.Hour} {
		if _, err := db.Exec("INSERT INTO watermill_inbox VALUES ('billing', ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
			i, ago.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"orders"}, Margin: 20 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	// Safe window: 1h + 10m + 20m = 1h30m.
	if _, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, OlderThan: time.Hour, Window: src}); !errors.Is(err, inbox.ErrWindowTooShort) {
		t.Errorf("1h window: err = %v, want ErrWindowTooShort", err)
	}
	n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Window: src})
	if err != nil || n != 2 {
		t.Errorf("safe window: deleted %d, %v; want the 2 rows older than 1h30m", n, err)
	}
	compacted, _ := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"orders", "ledger"}})
	if _, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, OlderThan: 1000 * time.Hour, Window: compacted}); !errors.Is(err, kafkaretention.ErrNoSafeWindow) {
		t.Errorf("compacted topic: err = %v, want ErrNoSafeWindow", err)
	}
}

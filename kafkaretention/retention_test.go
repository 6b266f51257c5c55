package kafkaretention_test

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
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
	// An empty list (Kafka 3.x accepts it): no segment is deleted by age.
	createTopic(t, admin, "no_cleanup", map[string]string{"cleanup.policy": "", "retention.ms": "3600000", "segment.ms": "3600000"})
	createTopic(t, admin, "delete_listed", map[string]string{"cleanup.policy": " delete", "retention.ms": "3600000", "segment.ms": "3600000"})
	createTopic(t, admin, "log_append_time", map[string]string{"retention.ms": "86400000", "segment.ms": "3600000", "message.timestamp.type": "LogAppendTime"})
	// Records of a CreateTime topic (Kafka's default) may be stamped up to
	// DefaultFutureTimestamps ahead where the topic sets no bound.
	const future = kafkaretention.DefaultFutureTimestamps

	cases := []struct {
		topics []string
		margin time.Duration
		want   time.Duration
		err    error
	}{
		{topics: []string{"one_day"}, margin: time.Hour, want: 24*time.Hour + time.Hour + future + time.Hour},
		{topics: []string{"defaults"}, want: 7*24*time.Hour + 7*24*time.Hour + future + kafkaretention.DefaultMargin},
		{topics: []string{"one_day", "defaults"}, margin: time.Minute, want: 14*24*time.Hour + future + time.Minute},
		{topics: []string{"one_day", "one_day"}, margin: time.Hour, want: 24*time.Hour + time.Hour + future + time.Hour},
		{topics: []string{"one_day", "forever"}, err: kafkaretention.ErrNoSafeWindow},
		{topics: []string{"compacted"}, err: kafkaretention.ErrNoSafeWindow},
		{topics: []string{"compact_delete"}, err: kafkaretention.ErrNoSafeWindow},
		{topics: []string{"no_cleanup"}, err: kafkaretention.ErrNoSafeWindow},
		{topics: []string{"delete_listed"}, margin: time.Hour, want: 3*time.Hour + future},
		// The broker stamps the records: none is ahead of its clock.
		{topics: []string{"log_append_time"}, margin: time.Hour, want: 24*time.Hour + time.Hour + time.Hour},
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
	// 1h + 10m; the broker stamps the records, so none is ahead of its clock.
	createTopic(t, admin, "orders", map[string]string{"retention.ms": "3600000", "segment.ms": "600000", "message.timestamp.type": "LogAppendTime"})
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
		if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
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

// A topic the cluster does not have gives the broker's error, naming the
// topic, never a window from the broker's defaults, even beside a topic
// that has one.
func TestSafeWindow_UnknownTopicIsAnError(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	createTopic(t, admin, "one_day", map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"})
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"one_day", "no_such_topic"}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := src.SafeWindow(context.Background())
	var describeErr *sarama.DescribeConfigError
	if !errors.As(err, &describeErr) || !strings.Contains(err.Error(), "no_such_topic") || got != 0 {
		t.Errorf("SafeWindow = %v, %v; want a *sarama.DescribeConfigError naming no_such_topic", got, err)
	}
}

// years is n years of 365 days in milliseconds, as a topic config value.
func years(n int64) string { return strconv.FormatInt(n*365*24*3600*1000, 10) }

// A retention.ms or segment.ms beyond what a time.Duration holds (Kafka's
// Long.MAX_VALUE, 300 or 1,000 years), or a window beyond
// inbox.MaxSafeWindow (150 years; two values that would wrap when added; a
// margin that takes a 99-year window past 100 years), keeps records forever:
// ErrNoSafeWindow, never a shorter window, even beside a topic with a short
// one. A segment.ms Kafka would refuse (negative) is an error, not a
// shorter window.
func TestSafeWindow_RetentionBeyondADurationMeansForever(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	const longMax = "9223372036854775807"
	createTopic(t, admin, "one_day", map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"})
	createTopic(t, admin, "long_max_retention", map[string]string{"retention.ms": longMax})
	createTopic(t, admin, "long_max_segment", map[string]string{"retention.ms": "86400000", "segment.ms": longMax})
	createTopic(t, admin, "300_years", map[string]string{"retention.ms": years(300)})
	createTopic(t, admin, "1000_years", map[string]string{"retention.ms": years(1000)})
	createTopic(t, admin, "150_years", map[string]string{"retention.ms": years(150)})
	createTopic(t, admin, "sum_wraps", map[string]string{"retention.ms": years(200), "segment.ms": years(200)})
	createTopic(t, admin, "99_years", map[string]string{"retention.ms": years(99), "segment.ms": "3600000"})
	createTopic(t, admin, "negative_segment", map[string]string{"retention.ms": "86400000", "segment.ms": "-86400000"})

	cases := []struct {
		topic  string
		margin time.Duration
		want   time.Duration // 0: ErrNoSafeWindow
	}{
		{topic: "long_max_retention"},
		{topic: "long_max_segment"},
		{topic: "300_years"},
		{topic: "1000_years"},
		{topic: "150_years"},
		{topic: "sum_wraps"},
		{topic: "99_years", margin: 2 * 365 * 24 * time.Hour},
		{topic: "99_years", margin: time.Hour, want: 99*365*24*time.Hour + 2*time.Hour + kafkaretention.DefaultFutureTimestamps}, // within MaxSafeWindow: a window
	}
	for _, tc := range cases {
		src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"one_day", tc.topic}, Margin: tc.margin})
		if err != nil {
			t.Fatal(err)
		}
		got, err := src.SafeWindow(context.Background())
		if tc.want != 0 {
			if err != nil || got != tc.want {
				t.Errorf("%s, margin %v: SafeWindow = %v, %v; want %v", tc.topic, tc.margin, got, err, tc.want)
			}
			continue
		}
		if !errors.Is(err, kafkaretention.ErrNoSafeWindow) || !strings.Contains(err.Error(), tc.topic) || got != 0 {
			t.Errorf("%s, margin %v: SafeWindow = %v, %v; want ErrNoSafeWindow naming the topic", tc.topic, tc.margin, got, err)
		}
	}
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"one_day", "negative_segment"}})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := src.SafeWindow(context.Background()); err == nil || errors.Is(err, kafkaretention.ErrNoSafeWindow) || !strings.Contains(err.Error(), "segment.ms=-86400000") {
		t.Errorf("negative segment.ms: SafeWindow = %v, %v; want an error naming segment.ms", got, err)
	}
	if _, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"one_day"}, Margin: inbox.MaxSafeWindow + 1}); err == nil {
		t.Error("a margin beyond inbox.MaxSafeWindow: want an error")
	}
}

// A purge under a topic that keeps its records forever in practice
// (retention.ms = Long.MAX_VALUE, 1,000 years) stops with ErrNoSafeWindow
// and deletes nothing, however old the rows are.
func TestPurge_TopicKeptForeverDeletesNothing(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	createTopic(t, admin, "ledger", map[string]string{"retention.ms": "9223372036854775807"})
	createTopic(t, admin, "archive", map[string]string{"retention.ms": years(1000)})
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	ib, err := inbox.New(inbox.Config{DB: db})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i, ago := range []time.Duration{400 * 24 * time.Hour, 30 * 24 * time.Hour, 10 * 24 * time.Hour, 3 * 24 * time.Hour} {
		if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
			i, ago.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	for _, topic := range []string{"ledger", "archive"} {
		src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{topic}})
		if err != nil {
			t.Fatal(err)
		}
		n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Window: src})
		var left int
		if err := db.Get(&left, "SELECT COUNT(*) FROM watermill_inbox"); err != nil {
			t.Fatal(err)
		}
		if !errors.Is(err, kafkaretention.ErrNoSafeWindow) || n != 0 || left != 4 {
			t.Errorf("topic %s: deleted %d, %v, %d rows left; want ErrNoSafeWindow and all 4 rows", topic, n, err, left)
		}
	}
}

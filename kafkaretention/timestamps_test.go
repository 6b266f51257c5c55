package kafkaretention_test

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaretention"
)

// reportingAdmin is a kfake cluster's admin client whose DescribeConfigs
// answers also carry extra, the entries a Kafka 3.6+ broker reports and
// kfake does not know (message.timestamp.after.max.ms).
type reportingAdmin struct {
	sarama.ClusterAdmin
	extra map[string][]sarama.ConfigEntry // by topic
}

func (a reportingAdmin) DescribeConfigs(resources []*sarama.ConfigResource, opts sarama.DescribeConfigsOptions) ([]*sarama.ConfigResourceResult, error) {
	results, err := a.ClusterAdmin.DescribeConfigs(resources, opts)
	for _, r := range results {
		r.Configs = append(r.Configs, a.extra[r.Name]...)
	}
	return results, err
}

// A record's timestamp under CreateTime is the producer's: Kafka deletes a
// segment once its newest timestamp is older than retention.ms, so a record
// stamped ahead keeps its segment readable for as much longer. The window
// adds the bound the broker checks: the topic's
// message.timestamp.after.max.ms, or message.timestamp.difference.max.ms
// where after.max.ms is absent (before Kafka 3.6) or Long.MAX_VALUE (Kafka
// 3.6 to 3.9 then check difference.max.ms: a topic that set it to 2 days was
// given 1 hour, and the row of a record stamped a day ahead purged);
// Config.FutureTimestamps where the topic sets no bound (Long.MAX_VALUE:
// Kafka's default before 4.0), and nothing under LogAppendTime. A producer
// stamping a record 5 days ahead on a 1-day topic had its row purged while
// Kafka kept it, and the replay processed it twice.
func TestSafeWindow_AddsHowFarAheadARecordMayBeStamped(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	day := map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"}
	for _, topic := range []string{"unbounded", "after_max", "difference_max", "after_max_long_max", "after_max_long_max_difference_max", "after_max_and_difference_max", "configured"} {
		createTopic(t, admin, topic, day)
	}
	createTopic(t, admin, "log_append_time", map[string]string{"retention.ms": "86400000", "segment.ms": "3600000", "message.timestamp.type": "LogAppendTime"})
	reporting := reportingAdmin{ClusterAdmin: admin, extra: map[string][]sarama.ConfigEntry{
		"after_max":          {{Name: "message.timestamp.after.max.ms", Value: "7200000"}, {Name: "message.timestamp.difference.max.ms", Value: "9223372036854775807"}},
		"difference_max":     {{Name: "message.timestamp.difference.max.ms", Value: "10800000"}},
		"after_max_long_max": {{Name: "message.timestamp.after.max.ms", Value: "9223372036854775807"}},
		// What Kafka 3.6 to 3.9 report for a topic that set only the
		// deprecated difference.max.ms (2 days): after.max.ms at its
		// default, which makes the broker check difference.max.ms.
		"after_max_long_max_difference_max": {{Name: "message.timestamp.after.max.ms", Value: "9223372036854775807"}, {Name: "message.timestamp.difference.max.ms", Value: "172800000"}},
		// Both set: the broker checks after.max.ms.
		"after_max_and_difference_max": {{Name: "message.timestamp.after.max.ms", Value: "7200000"}, {Name: "message.timestamp.difference.max.ms", Value: "172800000"}},
	}}
	const window = 25 * time.Hour // retention.ms + segment.ms
	cases := []struct {
		topic  string
		future time.Duration // Config.FutureTimestamps
		want   time.Duration
	}{
		{topic: "unbounded", want: window + kafkaretention.DefaultFutureTimestamps + time.Hour},
		{topic: "configured", future: 5 * 24 * time.Hour, want: window + 5*24*time.Hour + time.Hour},
		{topic: "after_max", want: window + 2*time.Hour + time.Hour},
		{topic: "difference_max", want: window + 3*time.Hour + time.Hour},
		{topic: "after_max_long_max", future: 4 * time.Hour, want: window + 4*time.Hour + time.Hour},
		{topic: "after_max_long_max_difference_max", want: window + 2*24*time.Hour + time.Hour},
		{topic: "after_max_and_difference_max", want: window + 2*time.Hour + time.Hour},
		{topic: "log_append_time", future: 5 * 24 * time.Hour, want: window + time.Hour},
	}
	for _, tc := range cases {
		src, err := kafkaretention.New(kafkaretention.Config{Admin: reporting, Topics: []string{tc.topic}, Margin: time.Hour, FutureTimestamps: tc.future})
		if err != nil {
			t.Fatal(err)
		}
		if got, err := src.SafeWindow(context.Background()); err != nil || got != tc.want {
			t.Errorf("%s: SafeWindow = %v, %v; want %v", tc.topic, got, err, tc.want)
		}
	}
	if _, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"unbounded"}, FutureTimestamps: -time.Hour}); err == nil {
		t.Error("a negative FutureTimestamps: want an error")
	}
}

// An operator who lowers a topic's segment.ms leaves the segments already
// written as they are: a record written a day ago can sit in a segment whose
// newest record is recent, readable for the old window. SafeWindow keeps the
// longer window it saw until one such window has passed since it last saw
// it, then takes the shorter one; a new Source (a restart) knows only the
// shorter one. A purge on the shorter window at once deleted the row of a
// 6-day-old record Kafka still held, and its replay was processed twice.
func TestSafeWindow_ShrinksOnlyOnceTheLongerWindowsRecordsAreGone(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	createTopic(t, admin, "lowered", map[string]string{"retention.ms": "86400000", "segment.ms": "604800000"})
	now := time.Now()
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"lowered"}, Margin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	kafkaretention.SetClock(src, func() time.Time { return now })
	const future = kafkaretention.DefaultFutureTimestamps
	long := 24*time.Hour + 7*24*time.Hour + future
	if got, err := src.SafeWindow(context.Background()); err != nil || got != long+time.Hour {
		t.Fatalf("before: SafeWindow = %v, %v; want %v", got, err, long+time.Hour)
	}
	if err := admin.AlterConfig(sarama.TopicResource, "lowered", map[string]*string{
		"retention.ms": ptr("86400000"), "segment.ms": ptr("3600000"),
	}, false); err != nil {
		t.Fatal(err)
	}
	short := 24*time.Hour + time.Hour + future
	for _, after := range []time.Duration{0, time.Hour, long - time.Second} {
		now = now.Add(after)
		if got, err := src.SafeWindow(context.Background()); err != nil || got != long+time.Hour {
			t.Errorf("%v after segment.ms was lowered: SafeWindow = %v, %v; want the longer window %v", after, got, err, long+time.Hour)
		}
		now = now.Add(-after)
	}
	now = now.Add(long)
	if got, err := src.SafeWindow(context.Background()); err != nil || got != short+time.Hour {
		t.Errorf("once the longer window passed: SafeWindow = %v, %v; want %v", got, err, short+time.Hour)
	}
	restarted, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"lowered"}, Margin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := restarted.SafeWindow(context.Background()); err != nil || got != short+time.Hour {
		t.Errorf("a new Source: SafeWindow = %v, %v; want %v (it has not seen the longer one)", got, err, short+time.Hour)
	}
}

func ptr(s string) *string { return &s }

// Kafka applies a topic's current retention.ms to the segments already
// written, which keep the span of the segment.ms they were written under.
// Changed from retention 1 day / segment 7 days to 7 days / 1 hour, a
// record written at the start of the segment that was active at the change
// stays readable for 7 + 7 days (and the hour of timestamps ahead): longer
// than either whole window. SafeWindow kept the longer whole window (8 days)
// and a purge six days later deleted the row of a 13-day-old record Kafka
// still held. It now keeps the longest of each setting until the records
// stored under the old ones are gone.
func TestSafeWindow_KeepsTheOldSegmentSpanUnderARaisedRetention(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	createTopic(t, admin, "raised", map[string]string{"retention.ms": "86400000", "segment.ms": "604800000"})
	change := time.Now()
	now := change
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"raised"}, Margin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	kafkaretention.SetClock(src, func() time.Time { return now })
	const day, future = 24 * time.Hour, kafkaretention.DefaultFutureTimestamps
	if got, err := src.SafeWindow(context.Background()); err != nil || got != day+7*day+future+time.Hour {
		t.Fatalf("before: SafeWindow = %v, %v; want %v", got, err, day+7*day+future+time.Hour)
	}
	if err := admin.AlterConfig(sarama.TopicResource, "raised", map[string]*string{
		"retention.ms": ptr("604800000"), "segment.ms": ptr("3600000"),
	}, false); err != nil {
		t.Fatal(err)
	}
	mixed := 7*day + 7*day + future // the new retention over the old span
	for _, after := range []time.Duration{0, 6 * day, mixed - time.Second} {
		now = change.Add(after)
		if got, err := src.SafeWindow(context.Background()); err != nil || got != mixed+time.Hour {
			t.Errorf("%v after the change: SafeWindow = %v, %v; want %v", after, got, err, mixed+time.Hour)
		}
	}

	// What a purge six days after the change does with it: the row of a
	// record written 7 days before the change, 13 days old, stays.
	now = change.Add(6 * day)
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	ib, err := inbox.New(inbox.Config{DB: db})
	if err != nil {
		t.Fatal(err)
	}
	defer ib.Close()
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', 'm13d', CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
		(13 * day).Microseconds()); err != nil {
		t.Fatal(err)
	}
	if deleted, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Window: src}); err != nil || deleted != 0 {
		t.Errorf("purge six days after the change: deleted %d, %v; want the 13-day-old row kept", deleted, err)
	}

	now = change.Add(mixed)
	if got, err := src.SafeWindow(context.Background()); err != nil || got != 7*day+time.Hour+future+time.Hour {
		t.Errorf("once the old segments are gone: SafeWindow = %v, %v; want %v", got, err, 7*day+time.Hour+future+time.Hour)
	}
}

// The settings a call reads are remembered even when a topic fails that
// call. While topic "forever" kept its records forever for six days (every
// SafeWindow call returned ErrNoSafeWindow: the purge paused), it and topic
// "widened" had their segment.ms raised to 7 days, and then both went back.
// The records they took in those days sit in 7-day segments Kafka keeps
// one retention past their newest record, but no call had remembered the 7
// days (only calls that returned a window did; then only the topics that
// did not fail), and the first window after was 1 day / 1 hour.
func TestSafeWindow_RemembersSettingsReadWhileATopicHadNoSafeWindow(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	dayHour := map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"}
	createTopic(t, admin, "widened", dayHour)
	createTopic(t, admin, "forever", dayHour)
	start := time.Now()
	now := start
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"widened", "forever"}, Margin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	kafkaretention.SetClock(src, func() time.Time { return now })
	const day, future = 24 * time.Hour, kafkaretention.DefaultFutureTimestamps
	alter := func(topic, retention, segment string) {
		t.Helper()
		if err := admin.AlterConfig(sarama.TopicResource, topic, map[string]*string{"retention.ms": ptr(retention), "segment.ms": ptr(segment)}, false); err != nil {
			t.Fatal(err)
		}
	}
	alter("forever", "-1", "604800000") // its own segment.ms widened too
	alter("widened", "86400000", "604800000")
	for h := time.Duration(0); h <= 6*day; h += 12 * time.Hour { // the Purger's rounds
		now = start.Add(h)
		if _, err := src.SafeWindow(context.Background()); !errors.Is(err, kafkaretention.ErrNoSafeWindow) {
			t.Fatalf("while %q keeps its records forever: %v, want ErrNoSafeWindow", "forever", err)
		}
	}
	alter("widened", "86400000", "3600000")
	alter("forever", "86400000", "3600000")
	want := day + 7*day + future + time.Hour
	if got, err := src.SafeWindow(context.Background()); err != nil || got != want {
		t.Errorf("after both went back: SafeWindow = %v, %v; want %v (the 7-day segments read while a topic failed)", got, err, want)
	}

	// The same with the failing topic alone.
	src, err = kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"forever"}, Margin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	kafkaretention.SetClock(src, func() time.Time { return now })
	alter("forever", "-1", "604800000")
	if _, err := src.SafeWindow(context.Background()); !errors.Is(err, kafkaretention.ErrNoSafeWindow) {
		t.Fatalf("while it keeps its records forever: %v, want ErrNoSafeWindow", err)
	}
	alter("forever", "86400000", "3600000")
	if got, err := src.SafeWindow(context.Background()); err != nil || got != want {
		t.Errorf("the failing topic alone, after it went back: SafeWindow = %v, %v; want %v", got, err, want)
	}
}

// Kafka applies a topic's current retention.ms to every segment, so a
// retention that was in force for a while is not remembered: a topic set to
// keep records forever, or for 200 years, and set back to a day has the
// day's window at once (with the segment spans it had meanwhile). Once the
// failing topic's settings were remembered, the 200 years kept SafeWindow
// refusing for as long, and the purge paused until a restart.
func TestSafeWindow_ForgetsARetentionThatWasForeverOnceItIsFiniteAgain(t *testing.T) {
	t.Parallel()
	admin, _ := cluster(t)
	createTopic(t, admin, "briefly_forever", map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"})
	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{"briefly_forever"}, Margin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	const day, future = 24 * time.Hour, kafkaretention.DefaultFutureTimestamps
	for _, retention := range []string{"-1", strconv.FormatInt((200 * 365 * day).Milliseconds(), 10)} {
		// AlterConfig sets the whole configuration: segment.ms stays 1 hour.
		if err := admin.AlterConfig(sarama.TopicResource, "briefly_forever", map[string]*string{"retention.ms": ptr(retention), "segment.ms": ptr("3600000")}, false); err != nil {
			t.Fatal(err)
		}
		if _, err := src.SafeWindow(context.Background()); !errors.Is(err, kafkaretention.ErrNoSafeWindow) {
			t.Fatalf("retention.ms=%s: %v, want ErrNoSafeWindow", retention, err)
		}
		if err := admin.AlterConfig(sarama.TopicResource, "briefly_forever", map[string]*string{"retention.ms": ptr("86400000"), "segment.ms": ptr("3600000")}, false); err != nil {
			t.Fatal(err)
		}
		if got, err := src.SafeWindow(context.Background()); err != nil || got != day+time.Hour+future+time.Hour {
			t.Errorf("back from retention.ms=%s: SafeWindow = %v, %v; want %v", retention, got, err, day+time.Hour+future+time.Hour)
		}
	}
}

// A retention lowered by mistake and put back before Kafka's retention
// check ran (log.retention.check.interval.ms) deletes nothing, so the
// segment spans remembered from before stay: forgetting them by the lowered
// retention gave a window 7 days short. And while a topic deletes nothing by
// age (retention -1, a compacting policy), the settings superseded before do
// not age: forgetting them meanwhile did the same once it deleted by age
// again.
func TestSafeWindow_KeepsOldSegmentSpansThroughALoweredRetentionAndAPause(t *testing.T) {
	t.Parallel()
	const day, future = 24 * time.Hour, kafkaretention.DefaultFutureTimestamps
	admin, _ := cluster(t)
	createTopic(t, admin, "lowered_once", map[string]string{"retention.ms": "2592000000", "segment.ms": "604800000"})
	createTopic(t, admin, "paused", map[string]string{"retention.ms": "86400000", "segment.ms": "604800000"})
	change := time.Now()
	now := change
	alter := func(topic string, cfg map[string]string) {
		t.Helper()
		set := map[string]*string{}
		for k, v := range cfg {
			set[k] = ptr(v)
		}
		if err := admin.AlterConfig(sarama.TopicResource, topic, set, false); err != nil {
			t.Fatal(err)
		}
	}
	window := func(src *kafkaretention.Source) (time.Duration, error) {
		return src.SafeWindow(context.Background())
	}
	newSource := func(topic string) *kafkaretention.Source {
		src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{topic}, Margin: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		kafkaretention.SetClock(src, func() time.Time { return now })
		if _, err := window(src); err != nil {
			t.Fatal(err)
		}
		return src
	}

	lowered := newSource("lowered_once")
	alter("lowered_once", map[string]string{"retention.ms": "2592000000", "segment.ms": "3600000"})
	if got, err := window(lowered); err != nil || got != 30*day+7*day+future+time.Hour {
		t.Fatalf("segment.ms lowered: SafeWindow = %v, %v; want %v", got, err, 30*day+7*day+future+time.Hour)
	}
	now = change.Add(8 * day)
	alter("lowered_once", map[string]string{"retention.ms": "3600000", "segment.ms": "3600000"}) // the mistake
	if _, err := window(lowered); err != nil {
		t.Fatal(err)
	}
	now = now.Add(time.Minute)
	alter("lowered_once", map[string]string{"retention.ms": "2592000000", "segment.ms": "3600000"}) // put back
	if got, err := window(lowered); err != nil || got != 30*day+7*day+future+time.Hour {
		t.Errorf("retention put back: SafeWindow = %v, %v; want %v", got, err, 30*day+7*day+future+time.Hour)
	}

	now = change
	paused := newSource("paused")
	for _, keep := range []map[string]string{
		{"retention.ms": "-1", "segment.ms": "3600000"},
		{"retention.ms": "86400000", "segment.ms": "3600000", "cleanup.policy": "compact"},
	} {
		alter("paused", keep)
		for _, at := range []time.Duration{0, 4 * day, 9 * day} {
			now = change.Add(at)
			if _, err := window(paused); !errors.Is(err, kafkaretention.ErrNoSafeWindow) {
				t.Fatalf("%v while it deletes nothing by age: %v, want ErrNoSafeWindow", keep, err)
			}
		}
		alter("paused", map[string]string{"retention.ms": "2592000000", "segment.ms": "3600000"})
		if got, err := window(paused); err != nil || got != 30*day+7*day+future+time.Hour {
			t.Errorf("after %v for 9 days: SafeWindow = %v, %v; want %v", keep, got, err, 30*day+7*day+future+time.Hour)
		}
		change = now
	}
}

// A segment.ms beyond inbox.MaxSafeWindow (Long.MAX_VALUE: "never roll by
// time") keeps the active segment open for as long as it is in force, and
// once set back Kafka rolls it at its next write: the span to remember is
// how long it was seen. Long.MAX_VALUE for 30 days was remembered as the
// default 7 days (a window 23 days short), and 200 years for a minute as 200
// years (SafeWindow refused for as long).
func TestSafeWindow_RemembersASegmentThatNeverRolledByHowLongItWasSeen(t *testing.T) {
	t.Parallel()
	const day, future = 24 * time.Hour, kafkaretention.DefaultFutureTimestamps
	admin, _ := cluster(t)
	for name, c := range map[string]struct {
		segment string
		lasted  time.Duration
	}{
		"long_max_30d":  {"9223372036854775807", 30 * day},
		"200y_a_minute": {strconv.FormatInt((200 * 365 * day).Milliseconds(), 10), time.Minute},
	} {
		createTopic(t, admin, name, map[string]string{"retention.ms": "86400000", "segment.ms": "3600000"})
		start := time.Now()
		now := start
		src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{name}, Margin: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		kafkaretention.SetClock(src, func() time.Time { return now })
		if _, err := src.SafeWindow(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := admin.AlterConfig(sarama.TopicResource, name, map[string]*string{"retention.ms": ptr("86400000"), "segment.ms": ptr(c.segment)}, false); err != nil {
			t.Fatal(err)
		}
		for at := time.Duration(0); at <= c.lasted; at += max(c.lasted/4, time.Second) {
			now = start.Add(at)
			if _, err := src.SafeWindow(context.Background()); !errors.Is(err, kafkaretention.ErrNoSafeWindow) {
				t.Fatalf("%s: segment.ms=%s: %v, want ErrNoSafeWindow", name, c.segment, err)
			}
		}
		if err := admin.AlterConfig(sarama.TopicResource, name, map[string]*string{"retention.ms": ptr("86400000"), "segment.ms": ptr("3600000")}, false); err != nil {
			t.Fatal(err)
		}
		// Seen from start to start+lasted: the segment active then spans
		// that, or the hour of the segment.ms now, whichever is longer.
		want := day + max(c.lasted, time.Hour) + future + time.Hour
		if got, err := src.SafeWindow(context.Background()); err != nil || got != want {
			t.Errorf("%s, set back: SafeWindow = %v, %v; want %v", name, got, err, want)
		}
	}
}

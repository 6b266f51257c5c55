package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/kafkaretention"
)

// windowFlags are the flags that give the purge window, shared by "inbox
// purge" and "inbox stats": -older-than, and one window source with its
// -margin: the Kafka topics' retention (-brokers, -topics) or JetStream
// streams' (-nats-url, -nats-stream).
type windowFlags struct {
	olderThan       time.Duration
	brokers, topics string
	margin          time.Duration
	future          time.Duration
	js              *jetStreamFlags
}

func addWindowFlags(fs *flag.FlagSet, olderThanUsage string) *windowFlags {
	w := &windowFlags{}
	fs.DurationVar(&w.olderThan, "older-than", 0, olderThanUsage)
	fs.StringVar(&w.brokers, "brokers", "", "Kafka bootstrap addresses, comma-separated: derive the safe window from -topics")
	fs.StringVar(&w.topics, "topics", "", "the Kafka topics the consumer reads, comma-separated (with -brokers)")
	fs.DurationVar(&w.margin, "margin", kafkaretention.DefaultMargin, "added to the topics' retention.ms + segment.ms (with -brokers) or the streams' window (with -nats-url)")
	fs.DurationVar(&w.future, "future-timestamps", kafkaretention.DefaultFutureTimestamps,
		"how far ahead of the brokers' clocks producers may stamp records of CreateTime topics that do not bound it (message.timestamp.after.max.ms; with -brokers)")
	w.js = addJetStreamFlags(fs)
	return w
}

// check reports the usage errors of the flags: -brokers and -topics go
// together, as -nats-url and -nats-stream do, and one source at most; a
// negative -older-than; a -margin or -future-timestamps that is not
// positive; and, when
// required, no window at all.
func (w *windowFlags) check(required bool) error {
	brokerList, topicList := splitList(w.brokers), splitList(w.topics)
	if (len(brokerList) == 0) != (len(topicList) == 0) {
		return fmt.Errorf("%w: -brokers and -topics go together, each a comma-separated list of at least one name", errUsage)
	}
	if err := w.js.check(w.kafka()); err != nil {
		return err
	}
	if w.olderThan < 0 {
		return fmt.Errorf("%w: -older-than must be a positive duration, got %v", errUsage, w.olderThan)
	}
	if w.future <= 0 {
		// kafkaretention reads 0 as its default (1h), as it does -margin.
		return fmt.Errorf("%w: -future-timestamps must be a positive duration (how far ahead of the brokers' clocks producers"+
			" may stamp records), got %v", errUsage, w.future)
	}
	if w.margin <= 0 {
		// kafkaretention and jetstreamretention read a zero margin as
		// their default (24h): -margin 0 was that, silently.
		return fmt.Errorf("%w: -margin must be a positive duration (it covers a consumer that falls behind), got %v", errUsage, w.margin)
	}
	if required && !w.given() {
		return fmt.Errorf("%w: -older-than is required (a positive duration) unless -brokers and -topics (or -nats-url and -nats-stream) give the window", errUsage)
	}
	return nil
}

func (w *windowFlags) kafka() bool { return len(splitList(w.brokers)) > 0 }

// given reports whether the flags give a window: -older-than or a source.
func (w *windowFlags) given() bool { return w.olderThan > 0 || w.kafka() || w.js.set() }

// source returns the window source the flags name, with what to call it in
// the output ("Kafka (orders)") and a function that closes it; a nil source
// when they name none.
func (w *windowFlags) source() (src inbox.WindowSource, from string, closeSource func(), err error) {
	switch {
	case w.kafka():
		topicList := splitList(w.topics)
		k, err := kafkaretention.New(kafkaretention.Config{Brokers: splitList(w.brokers), Topics: topicList, Margin: w.margin, FutureTimestamps: w.future})
		if err != nil {
			return nil, "", nil, err
		}
		return k, "Kafka (" + strings.Join(topicList, ",") + ")", func() { k.Close() }, nil
	case w.js.set():
		j, err := w.js.source(w.margin)
		if err != nil {
			return nil, "", nil, err
		}
		return j, "JetStream (" + w.js.streams.String() + ")", func() { j.Close() }, nil
	}
	return nil, "", func() {}, nil
}

// useWindow asks src for the safe window, prints it, and makes it cfg's
// Window (and its OlderThan when none was given), for the Kafka flags and
// the JetStream ones alike.
func useWindow(ctx context.Context, stdout io.Writer, cfg *inbox.PurgeConfig, src inbox.WindowSource, from string) error {
	safe, err := src.SafeWindow(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "safe window from %s: %s\n", from, safe)
	if cfg.OlderThan == 0 {
		cfg.OlderThan = safe
	}
	cfg.Window = src
	return nil
}

// purgeWindow is the window a purge with the flags uses, and where it comes
// from: "-older-than", "Kafka (orders)", "-older-than (the safe window from
// Kafka (orders): 1h30m0s)".
type purgeWindow struct {
	window time.Duration
	from   string
}

// resolve asks the flags' source, if any, for its safe window and returns
// the window a purge would use, as the purge decides it: -older-than when
// given, which must not be shorter than the safe window
// (inbox.ErrWindowTooShort), otherwise the safe window; a safe window out
// of range is inbox.ErrWindowOutOfRange. The source's error is returned as
// is.
func (w *windowFlags) resolve(ctx context.Context) (purgeWindow, error) {
	src, from, closeSource, err := w.source()
	if err != nil {
		return purgeWindow{}, err
	}
	defer closeSource()
	if src == nil {
		return purgeWindow{window: w.olderThan, from: "-older-than"}, nil
	}
	safe, err := src.SafeWindow(ctx)
	if err != nil {
		return purgeWindow{}, err
	}
	switch {
	case safe < time.Microsecond || safe > inbox.MaxSafeWindow:
		return purgeWindow{}, fmt.Errorf("%w: the safe window from %s is %v, outside 1µs to %v: inbox purge refuses it",
			inbox.ErrWindowOutOfRange, from, safe, inbox.MaxSafeWindow)
	case w.olderThan == 0:
		return purgeWindow{window: safe, from: from}, nil
	case w.olderThan < safe:
		return purgeWindow{}, fmt.Errorf("%w: -older-than %v is shorter than the safe window %v from %s: inbox purge refuses it",
			inbox.ErrWindowTooShort, w.olderThan, safe, from)
	}
	return purgeWindow{window: w.olderThan, from: fmt.Sprintf("-older-than (the safe window from %s: %v)", from, safe)}, nil
}

// defaultPurgeLag is the default of "inbox stats -purge-lag": three purge
// rounds of the default interval (inbox.DefaultPurgeInterval), the margin
// of the InboxPurgeFallingBehind alert.
const defaultPurgeLag = 3 * inbox.DefaultPurgeInterval

// headroom is what "inbox stats" shows of the purge window: the oldest
// row's age against it.
type headroom struct {
	purgeWindow
	consumer  string        // the consumer whose rows it measures (-consumer); "" for every consumer's
	oldestAge time.Duration // 0 when empty
	empty     bool
	lag       time.Duration // how far past the window the oldest row may be before it is a warning
	// partitioned: a PostgreSQL partitioned table, whose purge drops a
	// partition once all of it is past the window; partitionAge is how
	// long ago the oldest partition holding rows ended
	// (inbox.OldestPartitionAge), which the warning goes by.
	partitioned  bool
	partitionAge time.Duration
}

// readHeadroom returns the headroom of the table whose stats are st, under
// window, of consumer's rows when consumer is not "" (a purge limited to
// it: on a table that consumers with different windows share, another's
// older rows are not its purge's to delete); on a PostgreSQL partitioned
// table it also reads when the oldest partition holding such rows ended:
// the purge keeps its rows until then plus the window, however wide the
// partition (a day, a week, a month of pg_partman's, one made by hand).
func readHeadroom(ctx context.Context, db *sqlx.DB, d inbox.Dialect, table, consumer string, st inbox.TableStats, window purgeWindow, lag time.Duration) (headroom, error) {
	h := headroom{purgeWindow: window, consumer: consumer, empty: st.Rows == 0, lag: lag}
	switch {
	case consumer != "":
		age, ok, err := inbox.OldestRowAge(ctx, db, d, table, consumer)
		if err != nil {
			return h, err
		}
		h.oldestAge, h.empty = age, !ok
	case !h.empty:
		h.oldestAge = max(st.ReadAt.Sub(st.Oldest), 0) // by the database clock, as the purge's cutoff
	}
	// A purge limited to a consumer deletes its rows one by one, in any
	// partition: its oldest row's age says whether it is behind.
	if db.DriverName() == "pgx" && !h.empty && consumer == "" {
		age, partitioned, err := inbox.OldestPartitionAge(ctx, db, table, consumer)
		if err != nil {
			return h, err
		}
		h.partitioned, h.partitionAge = partitioned, age
	}
	return h, nil
}

// behind reports whether the purge is falling behind or not running: the
// oldest row is past the window by more than the lag or, on a partitioned
// table, the partition that holds it ended longer ago than the window and
// the lag (a partition is dropped once all of it is past the window).
func (h headroom) behind() bool {
	if h.partitioned {
		return !h.empty && h.partitionAge > h.window+h.lag
	}
	return !h.empty && h.oldestAge > h.window+h.lag
}

// print writes the window, the headroom and, when the purge is behind, a
// warning.
func (h headroom) print(w io.Writer) {
	fmt.Fprintf(w, "window:   %s%s from %s\n", h.window, inDays(h.window), h.from)
	empty, oldest := "the table is empty", "the oldest row"
	if h.consumer != "" {
		empty, oldest = "consumer "+h.consumer+" has no rows", "the oldest row of consumer "+h.consumer
	}
	if h.empty {
		fmt.Fprintf(w, "headroom: %s, the whole window: %s\n", h.window, empty)
		return
	}
	age := h.oldestAge.Round(time.Second)
	left := (h.window - h.oldestAge).Round(time.Second)
	fmt.Fprintf(w, "headroom: %s: %s is %s old, the window %s\n", left, oldest, age, h.window)
	const behind = ": the purge is falling behind or not running (is the purger running, and with this window? see docs/operations.md#alerts)"
	switch {
	case h.partitioned && h.behind():
		fmt.Fprintf(w, "warning:  the partition that holds %s ended %s ago, past the window by %s, more than -purge-lag %s"+behind+"\n",
			oldest, h.partitionAge.Round(time.Second), (h.partitionAge - h.window).Round(time.Second), h.lag)
	case h.behind():
		fmt.Fprintf(w, "warning:  %s is %s past the window, more than -purge-lag %s"+behind+"\n", oldest, -left, h.lag)
	case left < 0 && h.partitioned:
		// A partition is dropped once all of it is past the window.
		ended := "that has not ended yet"
		if h.partitionAge > 0 {
			ended = fmt.Sprintf("that ended %s ago", h.partitionAge.Round(time.Second))
		}
		fmt.Fprintf(w, "          past the window by %s, in a partition %s: dropped once all of the partition is past the window"+
			" (a partitioned table keeps a row up to its partition's width longer)\n", -left, ended)
	case left < 0:
		fmt.Fprintf(w, "          past the window by %s, within -purge-lag %s: normal between two purge rounds\n", -left, h.lag)
	}
}

// inDays returns " (15d)" for a window of whole days, " (7.5d)" for one of
// at least a day, and "" for a shorter one.
func inDays(d time.Duration) string {
	if d < 24*time.Hour {
		return ""
	}
	return fmt.Sprintf(" (%sd)", strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.2f", d.Hours()/24), "0"), "."))
}

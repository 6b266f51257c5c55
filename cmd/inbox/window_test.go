package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox stats" with -older-than shows the window and the headroom (the
// window minus the oldest row's age); a row past the window by less than
// -purge-lag is normal between two rounds, one past it by more is a
// warning that the purge is falling behind; an empty table has the whole
// window; without a window flag, stats says how to get the headroom.
func TestStatsShowsTheHeadroomAgainstThePurgeWindow(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table := appliedTable(t, c.dsn, c.db)
			stats := func(args ...string) string {
				t.Helper()
				code, out, errOut := cli(t, append([]string{"stats", "-db", c.dsn, "-table", table}, args...)...)
				if code != 0 {
					t.Fatalf("stats %q: exit %d, stderr %q", args, code, errOut)
				}
				return out
			}
			if out := stats("-older-than", "360h"); !strings.Contains(out, "window:   360h0m0s (15d) from -older-than\n") ||
				!strings.Contains(out, "headroom: 360h0m0s, the whole window: the table is empty\n") {
				t.Errorf("empty table: stdout\n%s\nwant the whole 360h window as headroom", out)
			}
			insertAged(t, c.db, name, table, 2, 2*time.Hour)
			insertAged(t, c.db, name, table, 1, time.Minute)

			for _, tc := range []struct {
				name string
				args []string
				want []*regexp.Regexp // every one must match
				warn bool
			}{
				{"inside the window", []string{"-older-than", "168h"}, []*regexp.Regexp{
					regexp.MustCompile(`(?m)^window:   168h0m0s \(7d\) from -older-than$`),
					regexp.MustCompile(`(?m)^headroom: 16[56]h\d+m\d+s: the oldest row is (1h59m5\ds|2h0m\d+s) old, the window 168h0m0s$`),
				}, false},
				{"past the window, within the lag", []string{"-older-than", "90m"}, []*regexp.Regexp{
					regexp.MustCompile(`(?m)^headroom: -(29m5\ds|30m\d+s): the oldest row is`),
					regexp.MustCompile(`(?m)^ +past the window by (29m5\ds|30m\d+s), within -purge-lag 3h0m0s: normal between two purge rounds$`),
				}, false},
				{"past the window and the lag", []string{"-older-than", "1h", "-purge-lag", "30m"}, []*regexp.Regexp{
					regexp.MustCompile(`(?m)^warning:  the oldest row is (59m5\ds|1h0m\d+s) past the window, more than -purge-lag 30m0s: the purge is falling behind or not running`),
				}, true},
			} {
				out := stats(tc.args...)
				for _, re := range tc.want {
					if !re.MatchString(out) {
						t.Errorf("%s: stdout\n%s\nwant a line matching %s", tc.name, out, re)
					}
				}
				if strings.Contains(out, "warning:") != tc.warn {
					t.Errorf("%s: stdout\n%s\nwant a warning: %v", tc.name, out, tc.warn)
				}
			}
			if out := stats(); !strings.Contains(out, "window:   not given (-older-than, -brokers/-topics or -nats-url/-nats-stream show the headroom)\n") ||
				strings.Contains(out, "headroom:") {
				t.Errorf("no window flag: stdout\n%s\nwant a hint and no headroom", out)
			}
		})
	}
}

// With -brokers and -topics, "inbox stats" takes the window the purge
// would: the topics' safe window, or -older-than when it is not shorter;
// a shorter -older-than, which the purge refuses, fails the command with
// nothing on stdout.
func TestStatsTakesThePurgeWindowFromKafka(t *testing.T) {
	brokers := kafkaTopic(t, time.Hour, 10*time.Minute) // + margin 20m = 1h30m
	path := filepath.Join(t.TempDir(), "k.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	insertAged(t, db, "sqlite", "watermill_inbox", 1, 2*time.Hour)
	kafka := []string{"-brokers", brokers, "-topics", "orders", "-margin", "20m", "-purge-lag", "10m"}

	code, out, errOut := cli(t, append([]string{"stats", "-db", dsn}, kafka...)...)
	if code != 0 || !strings.Contains(out, "window:   1h30m0s from Kafka (orders)\n") ||
		!strings.Contains(out, "warning:  the oldest row is 30m") {
		t.Errorf("window from Kafka: exit %d, stderr %q, stdout\n%s\nwant the 1h30m window and a warning for the 2h-old row", code, errOut, out)
	}
	code, out, errOut = cli(t, append([]string{"stats", "-db", dsn, "-older-than", "3h"}, kafka...)...)
	if code != 0 || !strings.Contains(out, "window:   3h0m0s from -older-than (the safe window from Kafka (orders): 1h30m0s)\n") ||
		strings.Contains(out, "warning:") {
		t.Errorf("-older-than above the safe window: exit %d, stderr %q, stdout\n%s\nwant the 3h window and no warning", code, errOut, out)
	}
	code, out, errOut = cli(t, append([]string{"stats", "-db", dsn, "-older-than", "1h"}, kafka...)...)
	if code != 1 || out != "" || !strings.Contains(errOut, "-older-than 1h0m0s is shorter than the safe window 1h30m0s from Kafka (orders): inbox purge refuses it") {
		t.Errorf("-older-than under the safe window: exit %d, stdout %q, stderr %q; want 1, nothing on stdout and the refusal", code, out, errOut)
	}
}

// With -nats-url and -nats-stream, "inbox stats" takes the window from the
// streams, as the purge does.
func TestStatsTakesThePurgeWindowFromJetStream(t *testing.T) {
	t.Parallel()
	js, url := jetStreamOrSkip(t)
	hour := jetStreamStream(t, js, time.Hour)
	path := filepath.Join(t.TempDir(), "js.db")
	testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	code, out, errOut := cli(t, "stats", "-db", dsn, "-nats-url", url, "-nats-stream", hour, "-margin", "20m")
	if code != 0 || !strings.Contains(out, "window:   1h20m0s from JetStream ("+hour+")\n") {
		t.Errorf("window from JetStream: exit %d, stderr %q, stdout\n%s\nwant the 1h20m window", code, errOut, out)
	}
}

// A partitioned table drops a partition once all of it is past the window,
// so its oldest row may be past the window by up to its partition's width:
// stats warns only when that partition's end is past the window by more
// than -purge-lag, and says why a row past the window is normal there; the
// same row in a plain table is a warning.
func TestStatsAllowsAPartitionedTableItsPartitionInterval(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	for _, dialect := range []string{"postgres", "postgres-partitioned"} {
		table := "cli_" + testdb.RandomSuffix()
		testdb.DropLater(t, db, table)
		if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", dialect, "-table", table, "-apply"); code != 0 {
			t.Fatalf("schema -apply %s: %d %q %q", dialect, code, out, errOut)
		}
		insertAged(t, db, "postgres", table, 1, 20*time.Hour) // inside the partitions made: yesterday on
		code, out, errOut := cli(t, "stats", "-db", testdb.PostgresDSN(), "-table", table, "-older-than", "10h", "-purge-lag", "1h")
		if code != 0 {
			t.Fatalf("stats of %s: exit %d, stderr %q", dialect, code, errOut)
		}
		partitioned := dialect == "postgres-partitioned"
		if strings.Contains(out, "warning:") == partitioned ||
			strings.Contains(out, "in a partition that has not ended yet: dropped once all of the partition is past the window") != partitioned {
			t.Errorf("%s table, oldest row 10h past a 10h window, -purge-lag 1h: stdout\n%s\nwant a warning only when not partitioned, and why not when partitioned", dialect, out)
		}
	}
}

// The window flags of "inbox stats" have the usage errors of "inbox
// purge"'s, and -purge-lag must not be negative: exit status 2.
func TestStatsWindowFlagsUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"-older-than", "-1h"},
		{"-purge-lag", "-1h"},
		{"-older-than", "1h", "-margin", "0"},
		{"-nats-url", "nats://127.0.0.1:4222", "-nats-stream", "ORDERS", "-margin", "0"},
		{"-brokers", "127.0.0.1:9092"},
		{"-nats-url", "nats://127.0.0.1:4222"},
		{"-nats-url", "nats://127.0.0.1:4222", "-nats-stream", "ORDERS", "-brokers", "127.0.0.1:9092", "-topics", "orders"},
	} {
		if code, _, errOut := cli(t, append([]string{"stats", "-db", "sqlite:///tmp/x.db"}, args...)...); code != 2 {
			t.Errorf("stats %q: exit %d (%s), want 2", args, code, errOut)
		}
	}
}

// "inbox stats -consumer" measures the headroom by that consumer's rows,
// as a purge limited to it does: on a table that consumers with other
// windows share, another consumer's older rows made stats warn that a
// healthy purge was falling behind.
func TestStatsMeasuresTheHeadroomOfOneConsumer(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table := appliedTable(t, c.dsn, c.db)
			insertAgedOf(t, c.db, name, table, "orders", 1, 30*time.Minute)
			insertAgedOf(t, c.db, name, table, "ledger", 1, 5*24*time.Hour)
			code, out, errOut := cli(t, "stats", "-db", c.dsn, "-table", table, "-older-than", "1h", "-purge-lag", "10m", "-consumer", "orders")
			if code != 0 || !regexp.MustCompile(`(?m)^headroom: (29m|30m)\d*s?: the oldest row of consumer orders is (29m5\ds|30m\d*s?) old, the window 1h0m0s$`).MatchString(out) ||
				strings.Contains(out, "warning:") {
				t.Errorf("stats -consumer orders: exit %d, stderr %q, stdout\n%s\nwant orders' 30m-old row against the 1h window, no warning", code, errOut, out)
			}
			code, out, _ = cli(t, "stats", "-db", c.dsn, "-table", table, "-older-than", "1h", "-consumer", "shipping")
			if code != 0 || !strings.Contains(out, "headroom: 1h0m0s, the whole window: consumer shipping has no rows\n") {
				t.Errorf("stats -consumer shipping: exit %d, stdout\n%s\nwant the whole window", code, out)
			}
			if code, out, _ := cli(t, "stats", "-db", c.dsn, "-table", table, "-older-than", "1h", "-purge-lag", "10m"); code != 0 || !strings.Contains(out, "warning:  the oldest row is ") {
				t.Errorf("stats of every consumer: exit %d, stdout\n%s\nwant ledger's 5-day-old row to warn", code, out)
			}
			if code, out, errOut := cli(t, "stats", "-db", c.dsn, "-table", table, "-consumer", "orders"); code != 2 || out != "" || !strings.Contains(errOut, "-consumer measures the headroom, which needs a window") {
				t.Errorf("stats -consumer without a window: exit %d, stdout %q, stderr %q; want a usage error", code, out, errOut)
			}
		})
	}
}

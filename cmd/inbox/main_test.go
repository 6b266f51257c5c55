package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// cli runs the command in-process and returns its exit status and output.
func cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// dsns are the three databases, in the CLI's DSN forms.
func dsns(t *testing.T) map[string]struct {
	dsn string
	db  *sqlx.DB
} {
	sqlitePath := filepath.Join(t.TempDir(), "cli.db")
	return map[string]struct {
		dsn string
		db  *sqlx.DB
	}{
		"sqlite":   {"sqlite://" + sqlitePath + "?" + testdb.SQLiteParams, testdb.OpenSQLite(t, sqlitePath)},
		"postgres": {testdb.PostgresDSN(), testdb.OpenPostgres(t, "")},
		"mysql":    {"mysql://" + testdb.MySQLDSN(), testdb.OpenMySQL(t, "")},
	}
}

func TestSchemaApplyPurgeStats(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table := "cli_" + testdb.RandomSuffix()
			testdb.DropLater(t, c.db, table)
			if code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-apply"); code != 0 || !strings.Contains(out, "is ready") {
				t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
			}
			ago := map[string]string{
				"sqlite":   "CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000",
				"postgres": "now() - interval '2 hours'",
				"mysql":    "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR",
			}[name]
			for i := range 5 {
				if _, err := c.db.Exec(c.db.Rebind("INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES (?, ?, "+ago+")"), "billing", fmt.Sprint(i)); err != nil {
					t.Fatal(err)
				}
			}
			ib, err := inbox.New(inbox.Config{DB: c.db, Table: table, Consumer: "shipping"})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ib.Middleware(noop)(newMsg()); err != nil {
				t.Fatal(err)
			}

			code, out, _ := cli(t, "stats", "-db", c.dsn, "-table", table)
			if code != 0 || !strings.Contains(out, "rows:     6") || !strings.Contains(out, "consumer: billing 5") ||
				!strings.Contains(out, "consumer: shipping 1") || !strings.Contains(out, "size:") {
				t.Errorf("stats: %d\n%s", code, out)
			}
			code, out, _ = cli(t, "purge", "-db", c.dsn, "-table", table, "-older-than", "1h", "-dry-run")
			if code != 0 || !strings.Contains(out, "would delete 5 rows") {
				t.Errorf("purge -dry-run: %d %q", code, out)
			}
			code, out, _ = cli(t, "purge", "-db", c.dsn, "-table", table, "-older-than", "1h", "-batch", "2",
				"-duty-cycle", "0.5", "-max-pause", "50ms")
			if code != 0 || !strings.Contains(out, "deleted 5 rows") ||
				!strings.Contains(out, "(batches of 2, duty cycle 0.5, pauses up to 50ms)") {
				t.Errorf("purge: %d %q", code, out)
			}
			if code, out, _ := cli(t, "stats", "-db", c.dsn, "-table", table); code != 0 || !strings.Contains(out, "rows:     1") {
				t.Errorf("stats after purge: %d\n%s", code, out)
			}
		})
	}
}

func TestUsageErrors(t *testing.T) {
	cases := [][]string{
		{},
		{"frobnicate"},
		{"purge", "-db", "sqlite:///tmp/x.db"}, // no -older-than
		{"purge", "-older-than", "1h"},         // no -db
		{"stats", "-db", "oracle://x"},         // unknown DSN form
		{"schema"},                             // no dialect, no db
		{"schema", "-dialect", "db2"},          // unknown dialect
		{"schema", "-dialect", "postgres", "-table", "x; DROP TABLE y"}, // hostile name
		{"stats", "-db", "sqlite:///tmp/x.db", "extra"},
		{"schema", "-db", "sqlite:///tmp/x.db", "-apply", "-verify"}, // exclusive
		{"schema", "-verify"}, // no -db
		{"purge", "-db", "sqlite:///tmp/x.db", "-older-than", "1h", "-duty-cycle", "0"},
		{"purge", "-db", "sqlite:///tmp/x.db", "-older-than", "1h", "-duty-cycle", "1.5"},
		{"purge", "-db", "sqlite:///tmp/x.db", "-older-than", "1h", "-duty-cycle", "NaN"},
		{"purge", "-db", "sqlite:///tmp/x.db", "-older-than", "1h", "-max-pause", "0s"},
	}
	for _, args := range cases {
		if code, _, errOut := cli(t, args...); code != 2 {
			t.Errorf("%q: exit %d (%s), want 2", args, code, errOut)
		}
	}
	// A negative -older-than says so, not that the flag is missing (stats
	// needs none).
	if code, _, errOut := cli(t, "stats", "-db", "sqlite:///tmp/x.db", "-older-than", "-5h"); code != 2 ||
		!strings.Contains(errOut, "-older-than must be a positive duration, got -5h") {
		t.Errorf("stats -older-than -5h: exit %d, stderr %q; want 2 and that it must be positive", code, errOut)
	}
	if code, out, _ := cli(t, "-h"); code != 0 || !strings.Contains(out, "Usage:") {
		t.Errorf("-h: %d", code)
	}
	if code, _, _ := cli(t, "stats", "-db", "postgres://nobody@127.0.0.1:1/x?connect_timeout=1"); code != 1 {
		t.Errorf("unreachable database: exit %d, want 1", code)
	}
	path := filepath.Join(t.TempDir(), "e.db")
	testdb.OpenSQLite(t, path) // the file exists; the table does not
	dsn := "sqlite://" + path
	code, out, errOut := cli(t, "purge", "-db", dsn, "-table", "no_such_table", "-older-than", "1h")
	if code != 1 || out != "" || !strings.HasPrefix(errOut, "inbox: purge no_such_table") || strings.Contains(errOut, "inbox: inbox:") {
		t.Errorf("failed purge: exit %d, stdout %q, stderr %q; want 1, nothing on stdout, one prefix", code, out, errOut)
	}
}

// The installed binary, end to end: go build, then run it.
// The help states the duty cycle a purge uses by default.
func TestUsageStatesTheDefaultDutyCycle(t *testing.T) {
	code, out, _ := cli(t, "-h")
	want := fmt.Sprintf("to spend the share F of its time in batches (%v)", inbox.DefaultPurgeDutyCycle)
	if code != 0 || !strings.Contains(out, want) {
		t.Errorf("inbox -h: exit %d, help without %q:\n%s", code, want, out)
	}
}

func TestBinary(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "inbox")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "schema", "-dialect", "sqlite").Output()
	if err != nil || !strings.Contains(string(out), `CREATE TABLE IF NOT EXISTS "watermill_inbox"`) {
		t.Errorf("schema: %v\n%s", err, out)
	}
	err = exec.Command(bin, "purge").Run()
	if exit, ok := err.(*exec.ExitError); !ok || exit.ExitCode() != 2 {
		t.Errorf("purge without flags: %v, want exit status 2", err)
	}
}

func noop(*message.Message) ([]*message.Message, error) { return nil, nil }

func newMsg() *message.Message { return message.NewMessage(watermill.NewUUID(), nil) }

// With -brokers and -topics the window comes from the topics' retention, and
// a shorter -older-than is refused before anything is deleted.
func TestPurgeWindowFromKafka(t *testing.T) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(cluster.ListenAddrs(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	// 1h + 10m, + margin 20m = 1h30m; the broker stamps the records, so
	// none is ahead of its clock.
	retention, segment, stamps := "3600000", "600000", "LogAppendTime"
	if err := admin.CreateTopic("orders", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"retention.ms": &retention, "segment.ms": &segment, "message.timestamp.type": &stamps}}, false); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "k.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	for i, ago := range []int64{3 * 3600, 2 * 3600, 80 * 60} {
		if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
			fmt.Sprint(i), ago*1_000_000); err != nil {
			t.Fatal(err)
		}
	}
	kafka := []string{"-brokers", strings.Join(cluster.ListenAddrs(), ","), "-topics", "orders", "-margin", "20m"}
	code, out, errOut := cli(t, append([]string{"purge", "-db", dsn, "-older-than", "1h"}, kafka...)...)
	if code != 1 || !strings.Contains(errOut, "shorter than the safe window") {
		t.Errorf("1h under a 1h30m safe window: exit %d %q %q, want 1 and a refusal", code, out, errOut)
	}
	// The items of -brokers and -topics are trimmed, and empty ones dropped:
	// " orders" is the topic orders.
	spaced := []string{"-brokers", " " + strings.Join(cluster.ListenAddrs(), " , ") + " ,", "-topics", " orders, ,", "-margin", "20m"}
	code, out, errOut = cli(t, append([]string{"purge", "-db", dsn, "-dry-run"}, spaced...)...)
	if code != 0 || !strings.Contains(out, "safe window from Kafka (orders): 1h30m0s") || !strings.Contains(out, "would delete 2 rows") {
		t.Errorf("spaced -brokers and -topics: exit %d %q %q, want the window of orders and 2 rows", code, out, errOut)
	}
	if code, _, errOut := cli(t, "purge", "-db", dsn, "-brokers", cluster.ListenAddrs()[0], "-topics", " , "); code != 2 {
		t.Errorf("-topics without a name: exit %d %q, want 2", code, errOut)
	}
	code, out, errOut = cli(t, append([]string{"purge", "-db", dsn}, kafka...)...)
	if code != 0 || !strings.Contains(out, "safe window from Kafka (orders): 1h30m0s") || !strings.Contains(out, "deleted 2 rows") {
		t.Errorf("window from Kafka: exit %d %q %q, want the 2 rows older than 1h30m deleted", code, out, errOut)
	}
	if code, _, _ := cli(t, "purge", "-db", dsn, "-brokers", "127.0.0.1:1"); code != 2 {
		t.Errorf("-brokers without -topics: exit %d, want 2", code)
	}
}

// Every command but "schema -apply" refuses a SQLite file that does not
// exist, names it and says what creates it, and leaves no file behind;
// "schema -apply" creates it.
func TestMissingSQLiteFileIsRefused(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "mistyped.db")
	dsns := []string{
		"sqlite://" + path,
		"sqlite://" + path + "?" + testdb.SQLiteParams,
		"file:" + path,
		"file://" + path + "?mode=rwc",
	}
	commands := [][]string{
		{"stats"},
		{"purge", "-older-than", "1h"},
		{"purge", "-older-than", "1h", "-dry-run"},
		{"schema"},
		{"schema", "-verify"},
	}
	for _, dsn := range dsns {
		for _, command := range commands {
			args := append(append([]string(nil), command...), "-db", dsn)
			code, out, errOut := cli(t, args...)
			if code != 1 || out != "" || !strings.Contains(errOut, fmt.Sprintf("%q", path)) ||
				!strings.Contains(errOut, `"inbox schema -apply"`) {
				t.Errorf("%q: exit %d, stdout %q, stderr %q; want 1, nothing on stdout, the path and how to create it", args, code, out, errOut)
			}
			if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("%q created %s (%v)", args, path, err)
			}
		}
	}
	if code, out, errOut := cli(t, "schema", "-db", "sqlite://"+path, "-apply"); code != 0 || !strings.Contains(out, "is ready") {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	if code, out, errOut := cli(t, "stats", "-db", "sqlite://"+path); code != 0 || !strings.Contains(out, "rows:     0") {
		t.Errorf("stats on the file schema -apply created: %d %q %q", code, out, errOut)
	}
}

// existingSQLite checks the file a DSN names (its path, without the query)
// and opens it with mode=rw; in-memory databases are not files.
func TestSQLiteDSNMustNameAnExistingFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a b.db")
	testdb.OpenSQLite(t, path)
	missing := filepath.Join(dir, "missing.db")
	for _, c := range []struct {
		dsn, want string // want "": an error naming the missing file
	}{
		{"file:" + path, "file:" + path + "?mode=rw"},
		{"file:" + path + "?_txlock=immediate", "file:" + path + "?_txlock=immediate&mode=rw"},
		{"file:" + path + "?mode=rwc&_txlock=immediate", "file:" + path + "?mode=rw&_txlock=immediate"},
		{"file:" + path + "?mode=ro", "file:" + path + "?mode=ro"},
		{"file://" + path, "file://" + path + "?mode=rw"},
		{"file://localhost" + path, "file://localhost" + path + "?mode=rw"},
		{"file:" + strings.ReplaceAll(path, " ", "%20"), "file:" + strings.ReplaceAll(path, " ", "%20") + "?mode=rw"},
		{"file::memory:", "file::memory:"},
		{"file::memory:?cache=shared", "file::memory:?cache=shared"},
		{"file:" + missing + "?mode=memory", "file:" + missing + "?mode=memory"},
		{"file:" + missing, ""},
		{"file:" + missing + "?mode=rw", ""},
		{"file://" + missing + "?_txlock=immediate", ""},
	} {
		got, err := existingSQLite(c.dsn)
		switch {
		case c.want == "" && (err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q does not exist", missing))):
			t.Errorf("%s: %q, %v; want an error naming %q", c.dsn, got, err, missing)
		case c.want != "" && (err != nil || got != c.want):
			t.Errorf("%s: %q, %v; want %q", c.dsn, got, err, c.want)
		}
	}
}

// Messages with a count use the singular for one: "1 row", "2 rows".
func TestCountsInSingularAndPlural(t *testing.T) {
	for n, want := range map[int64]string{0: "0 rows", 1: "1 row", 2: "2 rows", 1000: "1000 rows"} {
		if got := count(n, "row"); got != want {
			t.Errorf("count(%d) = %q, want %q", n, got, want)
		}
	}
	path := filepath.Join(t.TempDir(), "one.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', 'm1', CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000)"); err != nil {
		t.Fatal(err)
	}
	code, out, _ := cli(t, "purge", "-db", dsn, "-older-than", "1h", "-dry-run")
	if code != 0 || !strings.Contains(out, "would delete 1 row older") {
		t.Errorf("purge -dry-run: %d %q, want \"would delete 1 row older\"", code, out)
	}
	if !strings.Contains(out, "(every consumer)") {
		t.Errorf("purge -dry-run without -consumer: %q does not say it purges every consumer's rows", out)
	}
	// A log line of a purge restricted to one consumer says which.
	code, out, _ = cli(t, "purge", "-db", dsn, "-older-than", "1h", "-consumer", "shipping", "-dry-run")
	if code != 0 || !strings.Contains(out, "would delete 0 rows older") || !strings.Contains(out, `(consumer "shipping")`) {
		t.Errorf("purge -consumer shipping -dry-run: %d %q, want 0 rows of consumer \"shipping\"", code, out)
	}
	code, out, _ = cli(t, "purge", "-db", dsn, "-older-than", "1h")
	if code != 0 || !strings.Contains(out, "deleted 1 row older") {
		t.Errorf("purge: %d %q, want \"deleted 1 row older\"", code, out)
	}
	code, out, _ = cli(t, "purge", "-db", dsn, "-older-than", "1h", "-dry-run")
	if code != 0 || !strings.Contains(out, "would delete 0 rows older") {
		t.Errorf("purge -dry-run on an empty table: %d %q, want \"would delete 0 rows older\"", code, out)
	}
}

// schema -verify exits 0 on a table that schema -apply made, and 1 with
// the error on stderr on a missing or incompatible table.
func TestSchemaVerifyRefusesMissingAndIncompatibleTables(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table := appliedTable(t, c.dsn, c.db)
			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-verify")
			if want := "inbox table " + table + " is verified\n"; code != 0 || out != want || errOut != "" {
				t.Errorf("verify a table schema -apply made: exit %d, stdout %q, stderr %q; want 0 and %q", code, out, errOut, want)
			}

			// A table made before the fingerprint column: verified, with the
			// statement that adds the column.
			if _, err := c.db.Exec("ALTER TABLE " + table + " DROP COLUMN fingerprint"); err != nil {
				t.Fatal(err)
			}
			code, out, errOut = cli(t, "schema", "-db", c.dsn, "-table", table, "-verify")
			if code != 0 || !strings.Contains(out, "no fingerprint column") || !strings.Contains(out, "ALTER TABLE") {
				t.Errorf("verify a table without the fingerprint column: exit %d, stdout %q, stderr %q; want 0 and the ALTER TABLE", code, out, errOut)
			}
			if pg := name == "postgres"; strings.Contains(out, "lock_timeout") != pg {
				t.Errorf("verify a table without the fingerprint column on %s: stdout %q; want PostgreSQL's lock_timeout advice on PostgreSQL only", name, out)
			}

			// A missing table wraps ErrTableNotFound, and the CLI says how
			// to create it from the CLI.
			missing := "cli_missing_" + testdb.RandomSuffix()
			verifyFails(t, c.dsn, missing, inbox.ErrTableNotFound)
			if _, _, errOut := cli(t, "stats", "-db", c.dsn, "-table", missing); !strings.Contains(errOut, "inbox schema -apply") {
				t.Errorf("stats on a missing table: stderr %q; want it to name inbox schema -apply", errOut)
			}
			for _, dry := range []bool{false, true} {
				args := []string{"purge", "-db", c.dsn, "-table", missing, "-older-than", "1h"}
				if dry {
					args = append(args, "-dry-run")
				}
				if code, _, errOut := cli(t, args...); code != 1 || !strings.Contains(errOut, "inbox schema -apply") {
					t.Errorf("%q on a missing table: exit %d, stderr %q; want 1 and the error that names inbox schema -apply", args, code, errOut)
				}
			}

			// A primary key on message_id alone would merge two consumers'
			// rows: ErrIncompatibleTable.
			wrong := "cli_wrong_" + testdb.RandomSuffix()
			testdb.DropLater(t, c.db, wrong)
			ddl := map[string]string{
				"sqlite":   "CREATE TABLE " + wrong + " (consumer TEXT NOT NULL, message_id TEXT NOT NULL PRIMARY KEY, processed_at INTEGER NOT NULL)",
				"postgres": "CREATE TABLE " + wrong + " (consumer text NOT NULL, message_id text NOT NULL PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now())",
				"mysql":    "CREATE TABLE " + wrong + " (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL PRIMARY KEY, processed_at datetime(6) NOT NULL)",
			}[name]
			if _, err := c.db.Exec(ddl); err != nil {
				t.Fatal(err)
			}
			verifyFails(t, c.dsn, wrong, inbox.ErrIncompatibleTable)
		})
	}
}

// verifyFails runs schema -verify on table and, when the command reports a
// problem, checks that it wraps want and that the CLI prints it on stderr
// alone and exits 1. Verify (verify.go) accepts every table until its
// checks are implemented: then a nil error is only logged.
func verifyFails(t *testing.T, dsn, table string, want error) {
	t.Helper()
	args := []string{"-db", dsn, "-table", table, "-verify"}
	err := schemaCmd(context.Background(), args, io.Discard, io.Discard)
	if err == nil {
		t.Logf("schema -verify accepts %s: Verify does not implement this check yet (want an error wrapping %v)", table, want)
		return
	}
	if !errors.Is(err, want) {
		t.Errorf("schema -verify %s: %v, want an error wrapping %v", table, err, want)
	}
	code, out, errOut := cli(t, append([]string{"schema"}, args...)...)
	if code != 1 || out != "" || !strings.HasPrefix(errOut, prefixed(err)+"\n") {
		t.Errorf("schema -verify %s: exit %d, stdout %q, stderr %q; want 1, nothing on stdout, the error on stderr", table, code, out, errOut)
	}
}

// jetStreamOrSkip connects to the NATS server with JetStream that the
// JetStream tests use (INBOX_TEST_NATS_URL, default 127.0.0.1:4222); a
// missing one skips the test locally and fails it under CI=true.
func jetStreamOrSkip(t *testing.T) (jetstream.JetStream, string) {
	t.Helper()
	url := testdb.Env("INBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
	if err == nil {
		t.Cleanup(nc.Close)
		var js jetstream.JetStream
		if js, err = jetstream.New(nc); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if _, err = js.AccountInfo(ctx); err == nil {
				return js, url
			}
		}
	}
	msg := fmt.Sprintf("NATS JetStream not reachable at %s (%v): start it with "+
		"`nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server &`, or point INBOX_TEST_NATS_URL at a server", url, err)
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return nil, ""
}

// jetStreamStream creates a memory stream with a name of its own and the
// given MaxAge (0: none), deleted when t ends, and returns its name.
func jetStreamStream(t *testing.T, js jetstream.JetStream, maxAge time.Duration) string {
	t.Helper()
	name := "INBOX_CLI_" + strings.ToUpper(testdb.RandomSuffix())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".orders"},
		Storage: jetstream.MemoryStorage, MaxAge: maxAge}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, name); err != nil {
			t.Logf("delete stream %s: %v", name, err)
		}
	})
	return name
}

// With -nats-url and -nats-stream (repeated or comma-separated) the window
// comes from the streams' MaxAge plus -margin: a shorter -older-than is
// refused before anything is deleted, no -older-than takes the safe window,
// and a stream without MaxAge or one that does not exist stops the purge.
func TestPurgeWindowFromJetStream(t *testing.T) {
	t.Parallel()
	js, url := jetStreamOrSkip(t)
	hour, halfHour := jetStreamStream(t, js, time.Hour), jetStreamStream(t, js, 30*time.Minute)
	forever := jetStreamStream(t, js, 0)
	path := filepath.Join(t.TempDir(), "js.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	for i, ago := range []time.Duration{3 * time.Hour, 2 * time.Hour, 70 * time.Minute} {
		if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
			fmt.Sprint(i), ago.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	rows := func() int {
		var n int
		if err := db.Get(&n, "SELECT count(*) FROM watermill_inbox"); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// 1h (the longest MaxAge) + 20m = 1h20m.
	fromStreams := []string{"-nats-url", url, "-nats-stream", hour + "," + halfHour, "-margin", "20m"}
	code, out, errOut := cli(t, append([]string{"purge", "-db", dsn, "-older-than", "1h"}, fromStreams...)...)
	if code != 1 || !strings.Contains(errOut, "shorter than the safe window") || rows() != 3 {
		t.Errorf("1h under a 1h20m safe window: exit %d %q %q, %d rows; want 1, a refusal and all 3 rows", code, out, errOut, rows())
	}
	for _, tc := range []struct {
		streams []string
		want    string
	}{
		{[]string{"-nats-stream", hour, "-nats-stream", forever}, "no safe purge window"},
		{[]string{"-nats-stream", "INBOX_CLI_NO_SUCH_STREAM"}, `"INBOX_CLI_NO_SUCH_STREAM" does not exist`},
	} {
		code, out, errOut := cli(t, append([]string{"purge", "-db", dsn, "-older-than", "1000h", "-nats-url", url}, tc.streams...)...)
		if code != 1 || out != "" || !strings.Contains(errOut, tc.want) || rows() != 3 {
			t.Errorf("%q: exit %d %q %q, %d rows; want 1, nothing on stdout, %q and all 3 rows", tc.streams, code, out, errOut, rows(), tc.want)
		}
	}
	code, out, errOut = cli(t, "purge", "-db", dsn, "-nats-url", url, "-nats-stream", hour, "-nats-stream", halfHour, "-margin", "20m")
	if code != 0 || !strings.Contains(out, "safe window from JetStream ("+hour+","+halfHour+"): 1h20m0s") ||
		!strings.Contains(out, "deleted 2 rows") || rows() != 1 {
		t.Errorf("window from JetStream: exit %d %q %q, %d rows; want the 2 rows older than 1h20m deleted", code, out, errOut, rows())
	}
}

// The JetStream flags go together and exclude the Kafka ones: usage
// errors, exit status 2.
func TestJetStreamFlagsUsageErrors(t *testing.T) {
	t.Parallel()
	cases := [][]string{
		{"purge", "-db", "sqlite:///tmp/x.db", "-nats-url", "nats://127.0.0.1:4222"},
		{"purge", "-db", "sqlite:///tmp/x.db", "-nats-stream", "ORDERS"},
		{"purge", "-db", "sqlite:///tmp/x.db", "-nats-url", "nats://127.0.0.1:4222", "-nats-stream", "ORDERS",
			"-brokers", "127.0.0.1:9092", "-topics", "orders"},
	}
	for _, args := range cases {
		if code, _, errOut := cli(t, args...); code != 2 {
			t.Errorf("%q: exit %d (%s), want 2", args, code, errOut)
		}
	}
}

// "inbox partitions": a new table gets daily partitions on request, the
// listing shows them and their interval, asking for weeks is refused
// (exit 1) until -migrate, after which the interval is week.
func TestPartitionsCommand(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "") // skips locally without PostgreSQL
	dsn := struct{ dsn string }{testdb.PostgresDSN()}
	table := "cli_parts_" + strings.ToLower(watermill.NewShortUUID())
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	code, out, errOut := cli(t, "partitions", "-db", dsn.dsn, "-table", table, "-interval", "day")
	if code != 0 || !strings.Contains(out, "partition interval day, 9 partitions") || !strings.Contains(out, table+"_p") {
		t.Fatalf("-interval day: exit %d %q %q; want 9 daily partitions", code, out, errOut)
	}
	code, _, errOut = cli(t, "partitions", "-db", dsn.dsn, "-table", table, "-interval", "week")
	if code != 1 || !strings.Contains(errOut, "-migrate") {
		t.Errorf("-interval week on a daily table: exit %d %q; want 1 and a hint to -migrate", code, errOut)
	}
	code, out, errOut = cli(t, "partitions", "-db", dsn.dsn, "-table", table, "-interval", "week", "-migrate")
	if code != 0 || !strings.Contains(out, "partition interval week") || !strings.Contains(out, table+"_w") {
		t.Errorf("-migrate: exit %d %q %q; want interval week", code, out, errOut)
	}
	for _, args := range [][]string{{"-migrate"}, {"-interval", "month"}} {
		if code, _, errOut := cli(t, append([]string{"partitions", "-db", dsn.dsn, "-table", table}, args...)...); code != 2 {
			t.Errorf("%q: exit %d (%s), want 2", args, code, errOut)
		}
	}
	// A missing table (a mistyped -table) and a plain inbox table are
	// errors, not tables with no partitions yet.
	plain := "cli_plain_" + strings.ToLower(watermill.NewShortUUID())
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + plain) })
	if code, out, errOut := cli(t, "schema", "-db", dsn.dsn, "-table", plain, "-apply"); code != 0 {
		t.Fatalf("schema -apply: exit %d %q %q", code, out, errOut)
	}
	// A name with capitals, which the library quotes: listed as the
	// table it is (to_regclass folded it to another name).
	mixed := "Cli_Parts_" + strings.ToLower(watermill.NewShortUUID())
	t.Cleanup(func() { db.Exec(`DROP TABLE IF EXISTS "` + mixed + `" CASCADE`) })
	if code, out, errOut := cli(t, "partitions", "-db", dsn.dsn, "-table", mixed, "-interval", "day"); code != 0 || !strings.Contains(out, "9 partitions") {
		t.Errorf("partitions -table %s -interval day: exit %d, stdout %q, stderr %q; want its 9 partitions", mixed, code, out, errOut)
	}
	for name, want := range map[string]string{table + "_typo": "does not exist", plain: "is not a partitioned table"} {
		if code, out, errOut := cli(t, "partitions", "-db", dsn.dsn, "-table", name); code != 1 || out != "" || !strings.Contains(errOut, want) {
			t.Errorf("partitions -table %s: exit %d, stdout %q, stderr %q; want 1 saying %q", name, code, out, errOut, want)
		}
	}
}

// A MySQL DSN in the URL form most tools write (mysql://user@host:port/db)
// works as the go-sql-driver form does, mariadb:// too: the driver took
// "host:port" for a network name, and the CLI failed with "default addr
// for network ... unknown", saying nothing of the form it wants.
func TestMySQLDSNInTheURLForm(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	table := "cli_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	cfg, err := mysql.ParseDSN(testdb.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	u := url.URL{Scheme: "mysql", User: url.UserPassword(cfg.User, cfg.Passwd), Host: cfg.Addr, Path: "/" + cfg.DBName, RawQuery: "parseTime=true"}
	if cfg.Passwd == "" {
		u.User = url.User(cfg.User)
	}
	for _, dsn := range []string{u.String(), "mariadb" + strings.TrimPrefix(u.String(), "mysql")} {
		if code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-apply"); code != 0 || !strings.Contains(out, "is ready") {
			t.Fatalf("schema -apply -db %s: %d %q %q", dsn, code, out, errOut)
		}
		if code, out, errOut := cli(t, "stats", "-db", dsn, "-table", table); code != 0 || !strings.Contains(out, "rows:") {
			t.Fatalf("stats -db %s: %d %q %q", dsn, code, out, errOut)
		}
	}
	// A raw '/' in a query value, legal in a URL, is the driver's database
	// separator: encoded again.
	withLoc := u
	withLoc.RawQuery = "parseTime=true&loc=Europe/Paris&charset=utf8mb4,utf8" // the driver splits charset on ',' unescaped
	if code, out, errOut := cli(t, "stats", "-db", withLoc.String(), "-table", table); code != 0 || !strings.Contains(out, "rows:") {
		t.Errorf("stats -db %s: %d %q %q", withLoc.String(), code, out, errOut)
	}
	// A user name with ':' cannot be passed to the driver: refused, not
	// cut into a user and a password.
	if code, _, errOut := cli(t, "stats", "-db", "mysql://app%3Aro:secret@127.0.0.1:3306/test", "-table", table); code != 2 || !strings.Contains(errOut, "user name") {
		t.Errorf("a user name with ':': exit %d %q; want a usage error", code, errOut)
	}
	if code, _, errOut := cli(t, "stats", "-db", "mysql://no slash", "-table", table); code != 2 || !strings.Contains(errOut, "nor a URL") {
		t.Errorf("stats -db mysql://no slash: exit %d %q; want a usage error naming both forms", code, errOut)
	}
}

// A -dialect for another server than the DSN's is refused before anything
// runs (ErrDialectMismatch, exit 2, naming both), by every command that
// connects: requeue, stats and purge printed the driver's syntax error of
// their first statement.
func TestCommandsRefuseADialectForAnotherServersDSN(t *testing.T) {
	c := dsns(t)
	for _, tc := range []struct{ dsn, dialect, says string }{
		{c["postgres"].dsn, "mysql", "-dialect mysql is for MySQL/MariaDB, but -db is a PostgreSQL DSN"},
		{c["mysql"].dsn, "postgres-partitioned", "-dialect postgres-partitioned is for PostgreSQL, but -db is a MySQL/MariaDB DSN"},
		{c["sqlite"].dsn, "postgres", "-dialect postgres is for PostgreSQL, but -db is a SQLite DSN"},
	} {
		for _, args := range [][]string{
			{"requeue", "-all"},
			{"stats"},
			{"purge", "-older-than", "24h", "-dry-run"},
			{"schema", "-verify"},
		} {
			if args[0] == "schema" {
				err := schemaCmd(context.Background(), append(args[1:], "-db", tc.dsn, "-dialect", tc.dialect), io.Discard, io.Discard)
				if !errors.Is(err, inbox.ErrDialectMismatch) {
					t.Errorf("schema -dialect %s -verify: %v, want ErrDialectMismatch", tc.dialect, err)
				}
			}
			code, out, errOut := cli(t, append(args, "-db", tc.dsn, "-dialect", tc.dialect)...)
			if code != 2 || out != "" || !strings.Contains(errOut, tc.says) {
				t.Errorf("%v -dialect %s on %s: exit %d, stdout %q, stderr %q; want 2 saying %q", args, tc.dialect, tc.dsn, code, out, errOut, tc.says)
			}
		}
	}
}

// A postgres:// DSN whose query ends in '?' or '&', or that already sets
// the exec mode, connects as pgx would connect it: the exec mode the CLI
// adds joins the query as one more parameter, never after an empty one
// ("?&", "&&"), which pgx refuses.
func TestPostgresDSNWithAnEmptyQueryParameterConnects(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "cli_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	base := testdb.PostgresDSN()
	if i := strings.IndexByte(base, '?'); i >= 0 {
		base = base[:i]
	}
	if code, out, errOut := cli(t, "schema", "-db", base, "-table", table, "-apply"); code != 0 || !strings.Contains(out, "is ready") {
		t.Fatalf("schema -apply -db %s: %d %q %q", base, code, out, errOut)
	}
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	// The server as parameters, the URL without a host or a path (the
	// form for a unix socket: host=/run/postgresql).
	params := url.Values{"host": {u.Hostname()}, "port": {u.Port()}, "dbname": {strings.TrimPrefix(u.Path, "/")}, "sslmode": {"disable"}}
	if u.User != nil {
		params.Set("user", u.User.Username())
		if pw, ok := u.User.Password(); ok {
			params.Set("password", pw)
		}
	}
	for _, dsn := range []string{
		base + "?",
		base + "?sslmode=disable&",
		base + "?&sslmode=disable",
		base + "?sslmode=disable&default_query_exec_mode=simple_protocol",
		"postgres://?" + params.Encode(),
		"postgresql://?" + params.Encode(),
	} {
		if code, out, errOut := cli(t, "stats", "-db", dsn, "-table", table); code != 0 || !strings.Contains(out, "rows:") {
			t.Errorf("stats -db %s: %d %q %q", dsn, code, out, errOut)
		}
	}
}

// schema -verify on a partitioned table whose claim function's overload
// for the fingerprint is missing (the column added by hand, as the upgrade
// was once documented) prints the CREATE FUNCTION, since every claim takes
// one round trip more without it; on a table without the column, the
// statements it prints add both. The lock_timeout advice is PostgreSQL's
// alone.
func TestSchemaVerifyPrintsAPartitionedTablesMissingClaimFunction(t *testing.T) {
	dsn, db := testdb.PostgresDSN(), testdb.OpenPostgres(t, "")
	table := "cli_" + testdb.RandomSuffix()
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		db.Exec("DROP FUNCTION IF EXISTS " + table + "_claim(text, text, bigint), " + table + "_claim(text, text, bigint, bytea)")
	})
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-dialect", "postgres-partitioned", "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	if _, err := db.Exec("DROP FUNCTION " + table + "_claim(text, text, bigint, bytea)"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "schema", "-db", dsn, "-dialect", "postgres-partitioned", "-table", table, "-verify")
	if code != 0 || !strings.Contains(out, "claim function is missing") || !strings.Contains(out, `_claim"(text, text, bigint, bytea)`) {
		t.Errorf("verify without the claim function's overload: exit %d, stdout %q, stderr %q; want 0 and its CREATE FUNCTION", code, out, errOut)
	}
	if _, err := db.Exec("ALTER TABLE " + table + " DROP COLUMN fingerprint"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = cli(t, "schema", "-db", dsn, "-dialect", "postgres-partitioned", "-table", table, "-verify")
	if code != 0 || !strings.Contains(out, "ADD COLUMN fingerprint") || !strings.Contains(out, `_claim"(text, text, bigint, bytea)`) ||
		!strings.Contains(out, "lock_timeout") {
		t.Errorf("verify without the column: exit %d, stdout %q, stderr %q; want 0, the ALTER TABLE and the CREATE FUNCTION, and the lock_timeout advice", code, out, errOut)
	}
}

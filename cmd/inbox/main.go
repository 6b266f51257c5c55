// Command inbox manages the inbox table of github.com/watermill-inbox/inbox
// from a shell: print, apply or verify its schema, purge it, and show its
// state.
//
//	go install github.com/watermill-inbox/inbox/cmd/inbox@latest
//	inbox schema -dialect postgres -table billing.inbox
//	inbox schema -db "$DATABASE_URL" -verify
//	inbox purge -db "$DATABASE_URL" -older-than 360h -dry-run
//	inbox stats -db "$DATABASE_URL"
//	inbox stats -db "$DATABASE_URL" -outbox-table billing_outbox
//	inbox stats -db "$DATABASE_URL" -older-than 360h
//	inbox requeue -db "$DATABASE_URL" -topic payments
//
// "inbox schema -verify" checks a table that your migrations made with
// (*inbox.Inbox).Verify: it exits 0 when the inbox can use the table, and 1
// with the problems and the DDL that fixes them when the table is missing or
// could merge, truncate or reject message ids; with -outbox-table (repeated
// for several) it also checks the outbox tables the service writes: an
// inbox.Outbox's as its relay uses it (Outbox.Verify: its dead-letter table,
// its columns, its id sequence), another outbox's (watermill-sql's,
// inbox.Config.OutboxTables) only that it exists. Without -verify, -outbox-table prints
// (or, with -apply, creates) an inbox.Outbox's table and its dead-letter
// table beside the inbox's, no broker needed.
//
// "inbox stats" with the purge window (-older-than, or the Kafka or JetStream
// flags of "inbox purge") shows the headroom: the oldest row's age against
// the window, with a warning when the oldest row is past it by more than
// -purge-lag (3h), the purge then falling behind or not running.
//
// "inbox stats" also shows the outbox of inbox.Outbox (messages pending, the
// age of the oldest, dead letters): of the table -outbox-table names, which
// must exist, or without it of the default outbox table when that exists.
//
// "inbox requeue" moves the dead letters of an inbox.Outbox (the messages
// its relay set aside after the broker refused them MaxAttempts times)
// back to the outbox table once the cause is fixed: by id (-id), by topic
// (-topic) or all (-all), with inbox.RequeueDeadLetters.
//
// Only "inbox schema -apply" creates anything: every other command refuses a
// SQLite database file that does not exist (a mistyped path would otherwise
// become a new, empty database) and opens an existing one with mode=rw.
//
// Exit status: 0 on success, 1 when the database or the operation fails, 2 on
// a usage error.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
)

// usage is the command's help. The defaults it states come from the
// library's constants, so that the text cannot drift from them.
var usage = `inbox manages the inbox table of github.com/watermill-inbox/inbox.

Usage:
  inbox schema -dialect D [-table T] [-outbox-table O ...]
                                                print the DDL (or -db DSN instead of -dialect), with
                                                that of inbox.Outbox's table O and its dead letters
  inbox schema -db DSN [-dialect D] [-table T] [-outbox-table O ...] -apply
                                                create the tables (and partitions) if missing
  inbox schema -db DSN [-dialect D] [-table T] -verify [-outbox-table O ...]
                                                check that the existing table is one the inbox
                                                can use (exit 1 with the problems if not)
  inbox purge  -db DSN -older-than DURATION [-table T] [-consumer C] [-batch N] [-dry-run]
               [-duty-cycle F] [-max-pause D] [-pause D]
                                                delete rows processed longer ago than DURATION, paced
                                                to spend the share F of its time in batches (` + fmt.Sprint(inbox.DefaultPurgeDutyCycle) + `)
  inbox purge  -db DSN -brokers B -topics T [-margin D] [-older-than DURATION] ...
                                                the same, with the window checked against (or, without
                                                -older-than, taken from) the Kafka topics' retention
  inbox purge  -db DSN -nats-url URL -nats-stream S [-nats-stream S2] [-margin D] [-older-than DURATION] ...
                                                the same, from the JetStream streams' MaxAge (and their
                                                consumers' AckWait x MaxDeliver when longer)
  inbox stats  -db DSN [-table T] [-outbox-table O] [-older-than DURATION] [-purge-lag D]
                                                rows per consumer, oldest and newest row, size; the
                                                headroom: the oldest row's age against the purge window,
                                                with a warning past the window + D (3h); and the outbox:
                                                messages pending, the oldest's age, dead letters (of O,
                                                or of ` + inbox.DefaultOutboxTable + ` when it exists)
  inbox stats  -db DSN -brokers B -topics T [-margin D] [-older-than DURATION] ...
  inbox stats  -db DSN -nats-url URL -nats-stream S [-margin D] [-older-than DURATION] ...
                                                the same, with the window the purge takes from Kafka
                                                or JetStream
  inbox partitions -db DSN [-table T] [-interval day|week [-migrate]]
                                                postgres-partitioned: list the partitions and their
                                                interval; -interval gives a new table that interval,
                                                -migrate switches an existing one (default: week)
  inbox requeue -db DSN [-outbox-table O] (-id N[,N...] | -topic T | -all)
                                                move dead letters of inbox.Outbox's table O (default
                                                ` + inbox.DefaultOutboxTable + `) from O_dead back to O, once the
                                                broker takes them: the relay sends them with their UUIDs

DSN forms:
  postgres://user@host:5432/db?sslmode=disable  PostgreSQL (pgx)
  mysql://user:pass@tcp(host:3306)/db           MySQL / MariaDB (go-sql-driver DSN after mysql://),
  mysql://user:pass@host:3306/db                or the URL form; mariadb:// alike
  sqlite:///path/to/file.db  or  file:path.db   SQLite (modernc.org/sqlite); the file must exist,
                                                except for "schema -apply", which creates it

Dialects: postgres, postgres-partitioned, mysql, sqlite (default: from the DSN).
Durations use Go syntax: 360h, 15m, 90s. Choose -older-than longer than your broker
can redeliver (Kafka: retention.ms + segment.ms + a margin; JetStream: MaxAge + a margin);
with -brokers and -topics, or -nats-url and -nats-stream, the command reads those settings
and refuses a shorter window (exit 1), or a stream that has none (no MaxAge, compacted).

Run "inbox <command> -h" for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// errUsage marks usage errors (exit status 2).
var errUsage = errors.New("usage")

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "-help" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stdout, usage)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	var err error
	switch args[0] {
	case "schema":
		err = schemaCmd(ctx, args[1:], stdout, stderr)
	case "purge":
		err = purgeCmd(ctx, args[1:], stdout, stderr)
	case "stats":
		err = statsCmd(ctx, args[1:], stdout, stderr)
	case "partitions":
		err = partitionsCmd(ctx, args[1:], stdout, stderr)
	case "requeue":
		err = requeueCmd(ctx, args[1:], stdout, stderr)
	default:
		err = fmt.Errorf("%w: unknown command %q", errUsage, args[0])
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage) || errors.Is(err, inbox.ErrInvalidConfig) || errors.Is(err, inbox.ErrInvalidTableName) ||
		errors.Is(err, inbox.ErrInvalidConsumer):
		fmt.Fprintf(stderr, "%s\nRun \"inbox -h\" for usage.\n", prefixed(err))
		return 2
	case errors.Is(err, inbox.ErrTableNotFound):
		fmt.Fprintf(stderr, "%s\nName the inbox table with -table (default %s), the outbox's with -outbox-table;"+
			" from here, \"inbox schema -apply\" with the same -db and names creates them, an outbox table and its"+
			" dead-letter table only when -outbox-table names it (-h for its options).\n",
			prefixed(err), inbox.DefaultTable)
		return 1
	default:
		fmt.Fprintln(stderr, prefixed(err))
		return 1
	}
}

// prefixed returns the error's text starting with "inbox: " once: the
// library's errors already do.
func prefixed(err error) string {
	if s := err.Error(); strings.HasPrefix(s, "inbox: ") {
		return s
	}
	return "inbox: " + err.Error()
}

// common are the flags every command shares.
type common struct {
	dsn, dialect, table string
}

func newFlags(name string, stderr io.Writer, c *common, withDB bool) *flag.FlagSet {
	fs := flag.NewFlagSet("inbox "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	if withDB {
		fs.StringVar(&c.dsn, "db", os.Getenv("INBOX_DB"), "database DSN (default $INBOX_DB); see \"inbox -h\"")
	}
	fs.StringVar(&c.dialect, "dialect", "", "postgres, postgres-partitioned, mysql or sqlite (default: from the DSN)")
	fs.StringVar(&c.table, "table", inbox.DefaultTable, "inbox table, optionally schema-qualified")
	return fs
}

func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	// A script's unset variable gives a string flag an empty value, which
	// the command took for the flag left out: -table "$INBOX_TABLE" ran on
	// the default table, -consumer "$CONSUMER" purged every consumer's rows
	// by one consumer's window, -brokers "$KAFKA" -topics "$TOPICS" purged
	// by -older-than unchecked against the topics' retention. Every
	// string flag given empty is refused; left out, it takes its default.
	var empty error
	fs.Visit(func(f *flag.Flag) {
		g, ok := f.Value.(flag.Getter) // a Func flag checks its own value
		if !ok || empty != nil {
			return
		}
		if v, isString := g.Get().(string); isString && v == "" {
			what := "give it a value"
			if strings.HasSuffix(f.Name, "table") {
				what = "name a table"
			}
			empty = fmt.Errorf("%w: -%s is empty (an unset variable?): %s, or leave the flag out for its default", errUsage, f.Name, what)
		}
	})
	return empty
}

var dialects = map[string]inbox.Dialect{
	"postgres": inbox.PostgreSQL, "postgres-partitioned": inbox.PostgreSQLPartitioned,
	"mysql": inbox.MySQL, "sqlite": inbox.SQLite,
}

// driverDialect is the plain dialect of the database/sql driver this tool
// opens (pgx, mysql, sqlite); nil for another.
func driverDialect(driverName string) inbox.Dialect {
	return map[string]inbox.Dialect{"pgx": inbox.PostgreSQL, "mysql": inbox.MySQL, "sqlite": inbox.SQLite}[driverName]
}

// driverFamily is the driver open chooses for the DSNs of each dialect's
// server; familyName names that server.
var (
	driverFamily = map[string]string{"postgres": "pgx", "postgres-partitioned": "pgx", "mysql": "mysql", "sqlite": "sqlite"}
	familyName   = map[string]string{"pgx": "PostgreSQL", "mysql": "MySQL/MariaDB", "sqlite": "SQLite"}
)

func (c common) dialectOrNil() (inbox.Dialect, error) {
	if c.dialect == "" {
		return nil, nil
	}
	d, ok := dialects[c.dialect]
	if !ok {
		return nil, fmt.Errorf("%w: unknown dialect %q (postgres, postgres-partitioned, mysql, sqlite)", errUsage, c.dialect)
	}
	return d, nil
}

// pgxExecModeDSN returns the postgres:// URL dsn with
// default_query_exec_mode=exec added to its query unless the query sets that
// parameter already. The rest of dsn is kept as written, as text (a URL
// rebuilt by net/url loses the "//" of one without a host or path, such as
// "postgres://?host=/run/postgresql", which pgx then reads as key=value
// pairs), without the empty parameters that a trailing '?' or '&' leaves
// (pgx skips them, but a parameter appended after them would read "?&" or
// "&&", which pgx refuses). A query net/url cannot parse is a usage error.
func pgxExecModeDSN(dsn string) (string, error) {
	base, query, _ := strings.Cut(dsn, "?")
	q, err := url.ParseQuery(query)
	if err != nil {
		return "", fmt.Errorf("%w: the query of -db: %w", errUsage, err)
	}
	if q.Has("default_query_exec_mode") {
		return dsn, nil
	}
	if query = strings.Trim(query, "&"); query != "" {
		query += "&"
	}
	return base + "?" + query + "default_query_exec_mode=exec", nil
}

// open connects to c.dsn, choosing the driver from its form. Unless create
// is set (schema -apply), a SQLite database file must exist already: it is
// checked before the driver sees the DSN, and opened with mode=rw so that the
// driver cannot create it either.
func (c common) open(ctx context.Context, create bool) (*sqlx.DB, inbox.Dialect, error) {
	d, err := c.dialectOrNil()
	if err != nil {
		return nil, nil, err
	}
	if c.dsn == "" {
		return nil, nil, fmt.Errorf("%w: -db is required", errUsage)
	}
	driver, dsn := "", c.dsn
	switch {
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"):
		// Unless the DSN says otherwise, pgx's exec mode (unnamed
		// statements, one round trip): it works directly and behind a
		// transaction-mode pooler, where pgx's default statement cache
		// fails with 42P05/26000. A command runs few statements, so the
		// cache would save nothing.
		driver = "pgx"
		if dsn, err = pgxExecModeDSN(dsn); err != nil {
			return nil, nil, err
		}
	case strings.HasPrefix(dsn, "mysql://"), strings.HasPrefix(dsn, "mariadb://"):
		driver = "mysql"
		if dsn, err = mysqlDSN(dsn); err != nil {
			return nil, nil, err
		}
	case strings.HasPrefix(dsn, "sqlite://"):
		driver, dsn = "sqlite", "file:"+strings.TrimPrefix(dsn, "sqlite://")
	case strings.HasPrefix(dsn, "file:"):
		driver = "sqlite"
	default:
		return nil, nil, fmt.Errorf("%w: cannot tell the database from -db %q (use postgres://, mysql:// or sqlite://)", errUsage, c.dsn)
	}
	if d != nil && driverFamily[d.String()] != driver {
		// A -dialect for another server than the DSN's: each statement
		// would fail with a syntax error of its own (inbox requeue, stats
		// and purge printed the driver's).
		return nil, nil, fmt.Errorf("%w: %w: -dialect %s is for %s, but -db is a %s DSN: leave -dialect out (it follows the DSN) or give the"+
			" DSN of the database the table is on", errUsage, inbox.ErrDialectMismatch, d, familyName[driverFamily[d.String()]], familyName[driver])
	}
	if driver == "sqlite" && !create {
		if dsn, err = existingSQLite(dsn); err != nil {
			return nil, nil, err
		}
	}
	if driver == "sqlite" && !strings.Contains(dsn, "busy_timeout") {
		// Beside a running service, which holds the write lock for each
		// message: wait for it as the service's own connections do (the
		// README's DSN), rather than fail at once with SQLITE_BUSY.
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + "_busy_timeout=" + strconv.Itoa(defaultSQLiteBusyTimeoutMillis)
	}
	db, err := sqlx.Open(driver, dsn)
	if err != nil {
		return nil, nil, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		db.Close()
		if driver == "sqlite" && errors.Is(err, context.DeadlineExceeded) {
			// A local file, not a network: say what holds it.
			return nil, nil, fmt.Errorf("connect: %w (the SQLite database stayed locked: another connection holds an exclusive"+
				" lock or a long write on it)", withCause(ctx, err))
		}
		return nil, nil, fmt.Errorf("connect: %w", withCause(ctx, err))
	}
	return db, d, nil
}

// defaultSQLiteBusyTimeoutMillis is the busy timeout the command gives a
// SQLite DSN that sets none: 10 s, the README's.
const defaultSQLiteBusyTimeoutMillis = 10000

// mysqlDSN returns the go-sql-driver/mysql DSN of -db s (mysql:// or
// mariadb://): what follows the scheme when it is one
// (user:pass@tcp(host:3306)/db?params), or a URL's parts in that form
// (mysql://user:pass@host:3306/db?params, as most tools write it), which
// the driver took for a network named "host:3306" and refused at connect
// time ("default addr for network ... unknown").
func mysqlDSN(s string) (string, error) {
	_, rest, _ := strings.Cut(s, "://")
	if cfg, err := mysql.ParseDSN(rest); err == nil && (cfg.Net == "tcp" || cfg.Net == "unix" || cfg.Addr != "") {
		return rest, nil
	}
	u, err := url.Parse(s)
	if err != nil || u.Host == "" || u.Opaque != "" {
		return "", fmt.Errorf("%w: -db %q is neither a go-sql-driver DSN after mysql:// (mysql://user:pass@tcp(host:3306)/db)"+
			" nor a URL (mysql://user:pass@host:3306/db)", errUsage, s)
	}
	cfg := mysql.NewConfig()
	if strings.Contains(u.User.Username(), ":") {
		// go-sql-driver/mysql's DSN cannot carry it: the first ':' ends the
		// user name.
		return "", fmt.Errorf("%w: -db %q: a MySQL user name with ':' cannot be passed; use another user", errUsage, s)
	}
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	cfg.Net, cfg.Addr = "tcp", u.Host
	if u.Port() == "" {
		cfg.Addr += ":3306"
	}
	cfg.DBName = strings.TrimPrefix(u.Path, "/")
	dsn := cfg.FormatDSN()
	if u.RawQuery != "" {
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		// As written, but for a '/' a URL may leave raw in a value
		// (loc=Europe/Paris), which is the driver's database separator (the
		// driver unescapes values; encoding them all would also encode the
		// ',' of charset=utf8mb4,utf8, which it splits unescaped).
		dsn += sep + strings.ReplaceAll(u.RawQuery, "/", "%2F")
	}
	if _, err := mysql.ParseDSN(dsn); err != nil {
		return "", fmt.Errorf("%w: -db %q: %w", errUsage, s, err)
	}
	return dsn, nil
}

// existingSQLite checks that the file a SQLite URI (file:...) names exists,
// and returns the URI with mode=rw (in place of none or rwc), which makes
// SQLite fail instead of creating a missing file. An in-memory database
// (:memory:, mode=memory) and the empty name (SQLite's private temporary
// database) are not files and pass unchanged.
func existingSQLite(dsn string) (string, error) {
	uri, fragment, hasFragment := strings.Cut(dsn, "#")
	rawName, rawQuery, _ := strings.Cut(strings.TrimPrefix(uri, "file:"), "?")
	name := rawName
	var params []string
	if rawQuery != "" {
		params = strings.Split(rawQuery, "&")
	}
	mode := -1 // index of the mode parameter in params
	for i, p := range params {
		if k, _, _ := strings.Cut(p, "="); k == "mode" {
			mode = i
		}
	}
	if name == ":memory:" || name == "" || mode >= 0 && params[mode] == "mode=memory" {
		return dsn, nil
	}
	if rest, ok := strings.CutPrefix(name, "//"); ok {
		// file://authority/path: SQLite accepts only an empty authority or
		// localhost, and reports any other itself.
		authority, path, _ := strings.Cut(rest, "/")
		if authority != "" && authority != "localhost" {
			return dsn, nil
		}
		name = "/" + path
	}
	if unescaped, err := url.PathUnescape(name); err == nil {
		name = unescaped // SQLite decodes %HH in a URI's path
	}
	if _, err := os.Stat(name); errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("SQLite database %q does not exist: check -db, or run \"inbox schema -apply\", which creates it with the inbox table", name)
	} else if err != nil {
		return "", fmt.Errorf("SQLite database %q: %w", name, err)
	}
	switch {
	case mode < 0:
		params = append(params, "mode=rw")
	case params[mode] == "mode=rwc":
		params[mode] = "mode=rw"
	}
	uri = "file:" + rawName + "?" + strings.Join(params, "&")
	if hasFragment {
		uri += "#" + fragment
	}
	return uri, nil
}

func schemaCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("schema", stderr, &c, true)
	apply := fs.Bool("apply", false, "create the table (and, partitioned, the partitions) in -db if missing, instead of printing")
	verify := fs.Bool("verify", false, "check that the table in -db exists and is one the inbox can use, instead of printing")
	var outboxTables []string
	fs.Func("outbox-table", "also print the DDL of this outbox table and its dead-letter table (inbox.Outbox's), with -apply create them,"+
		" with -verify check it as the relay uses it (an inbox.Outbox's) or that it exists (another outbox's, Config.OutboxTables); repeat for several", func(v string) error {
		if v == "" {
			return errors.New("empty: name a table, or leave the flag out") // a script's unset variable
		}
		outboxTables = append(outboxTables, v)
		return nil
	})
	if err := parse(fs, args); err != nil {
		return err
	}
	if *apply && *verify {
		return fmt.Errorf("%w: -apply and -verify exclude each other", errUsage)
	}
	for _, t := range append([]string{c.table}, outboxTables...) {
		if *apply && isTemporaryTable(c.dsn, t) {
			// The command's own session's: gone when it ends, and -verify
			// then sent the operator back to -apply.
			return fmt.Errorf("%w: %s is a temporary table, which goes with the command's connection: name a table of a"+
				" schema (or database) that lasts", errUsage, t)
		}
	}
	if !*apply && !*verify {
		d, err := c.dialectOrNil()
		if err != nil {
			return err
		}
		if d == nil {
			if c.dsn == "" {
				return fmt.Errorf("%w: -dialect or -db is required", errUsage)
			}
			db, dd, err := c.open(ctx, false)
			if err != nil {
				return err
			}
			db.Close()
			if d = dd; d == nil {
				d = driverDialect(db.DriverName())
			}
		}
		ddl, err := inbox.SchemaSQL(d, c.table)
		if err != nil {
			return err
		}
		for _, t := range outboxTables {
			outbox, err := inbox.OutboxSchemaSQL(d, t)
			if err != nil {
				return err
			}
			ddl += "\n-- Outbox table " + t + " and its dead-letter table (inbox.Outbox).\n" + outbox
		}
		_, err = io.WriteString(stdout, ddl)
		return err
	}
	db, d, err := c.open(ctx, *apply)
	if err != nil {
		return err
	}
	defer db.Close()
	partitionedFound := false // the table told the dialect, not -dialect
	if c.dialect == "" && db.DriverName() == "pgx" && isPartitionedTable(ctx, db, c.table) {
		// As stats and purge find it: the plain dialect's check told a
		// shell user to set Config.Dialect, beside a plain table's DDL
		// (-verify, and -apply run again on the table, a deploy step).
		d = inbox.PostgreSQLPartitioned
		partitionedFound = true
	}
	notes := &claimFunctionNotes{}
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: d, Table: c.table, OutboxTables: outboxTables, Logger: notes})
	if err != nil {
		return err
	}
	defer ib.Close()
	if *verify {
		if err := ib.Verify(ctx); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "inbox table %s is verified\n", c.table)
		if partitionedFound {
			// inbox.New infers the plain dialect from the driver, and
			// refuses this table at startup (ErrIncompatibleTable).
			fmt.Fprintf(stdout, "it is partitioned: the service's inbox needs Config.Dialect: inbox.PostgreSQLPartitioned"+
				" (pgxinbox.Config too), which the driver does not tell\n")
		}
		if !ib.ReusedIDsDetected() {
			if d == nil {
				d = driverDialect(db.DriverName())
			}
			lockTimeout := ""
			if d == inbox.PostgreSQL || d == inbox.PostgreSQLPartitioned {
				lockTimeout = "; run it with SET lock_timeout = '2s' and retry, as it waits for every running transaction" +
					" on the table and holds the claims back meanwhile"
			}
			fmt.Fprintf(stdout, "it has no fingerprint column, so a message id reused for other content is skipped as a duplicate;"+
				" add the column to detect it (Config.ReusedIDs%s):\n    %s;\n", lockTimeout,
				strings.ReplaceAll(inbox.AddFingerprintColumnSQL(d, c.table), "\n", "\n    ")) // each statement indented
		}
		for _, note := range notes.lines {
			fmt.Fprintf(stdout, "%s\n", note)
		}
		for _, t := range outboxTables {
			relayed, err := isRelayedOutbox(ctx, db, t)
			if isPrivilegeRefusal(err) {
				// A service that only writes another outbox's table (the
				// relay reads it as another user) may not read it.
				fmt.Fprintf(stdout, "outbox table %s exists (this user may not read it, so it is not checked as an inbox.Outbox table)\n", t)
				continue
			}
			if err != nil {
				return err
			}
			if !relayed {
				fmt.Fprintf(stdout, "outbox table %s exists\n", t)
				continue
			}
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: d, Table: t, Publisher: noPublisher{}})
			if err != nil {
				return err
			}
			if err := ob.Verify(ctx); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "outbox table %s and its dead-letter table %s are verified (inbox.Outbox)\n", t, ob.DeadLetterTable())
		}
		return nil
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "inbox table %s is ready\n", c.table)
	for _, t := range outboxTables {
		// An Outbox needs a publisher to be made, and creating its
		// tables never calls it.
		ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: d, Table: t, Publisher: noPublisher{}})
		if err != nil {
			return err
		}
		if err := ob.InitializeSchema(ctx); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "outbox table %s and its dead-letter table %s are ready\n", t, ob.DeadLetterTable())
	}
	return nil
}

// isRelayedOutbox reports whether table, which exists, is an inbox.Outbox
// table (it has the relay's topic and attempts columns), which "schema
// -verify" then checks as the relay uses it (Outbox.Verify). A table of
// another outbox (watermill-sql's, Config.OutboxTables) has neither, and
// is only checked to exist: how it is relayed is not the inbox's to know.
// The name is one Config.OutboxTables accepted (letters, digits and
// underscores, an optional schema), quoted as the library quotes it.
func isRelayedOutbox(ctx context.Context, db *sqlx.DB, table string) (bool, error) {
	quote := func(s string) string { return `"` + s + `"` }
	if db.DriverName() == "mysql" {
		quote = func(s string) string { return "`" + s + "`" }
	}
	parts := strings.Split(table, ".")
	for i, p := range parts {
		parts[i] = quote(p)
	}
	rows, err := db.QueryContext(ctx, "SELECT * FROM "+strings.Join(parts, ".")+" WHERE 1 = 0")
	if err != nil {
		return false, fmt.Errorf("inbox command: read the columns of outbox table %s: %w", table, err)
	}
	defer rows.Close() //nolint:errcheck // closed again below, with its error
	columns, err := rows.Columns()
	if err != nil {
		return false, fmt.Errorf("inbox command: read the columns of outbox table %s: %w", table, err)
	}
	var topic, attempts bool
	for _, c := range columns {
		topic = topic || strings.EqualFold(c, "topic")
		attempts = attempts || strings.EqualFold(c, "attempts")
	}
	return topic && attempts, rows.Close()
}

// isPrivilegeRefusal reports whether err is the database's refusal of a
// statement for a privilege the user lacks: PostgreSQL's 42501,
// MySQL/MariaDB's 1142 (table) and 1143 (column).
func isPrivilegeRefusal(err error) bool {
	var pg *pgconn.PgError
	var my *mysql.MySQLError
	return errors.As(err, &pg) && pg.Code == "42501" || errors.As(err, &my) && (my.Number == 1142 || my.Number == 1143)
}

// noPublisher is the publisher of an Outbox made only to create its tables.
type noPublisher struct{}

func (noPublisher) Publish(string, ...*message.Message) error {
	return errors.New("inbox command: this outbox only creates its tables")
}
func (noPublisher) Close() error { return nil }

func purgeCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("purge", stderr, &c, true)
	win := addWindowFlags(fs, "delete rows processed longer ago than this (e.g. 360h); required unless -brokers/-topics or -nats-url/-nats-stream give the safe window, which it then defaults to")
	consumer := fs.String("consumer", "", "only this consumer's rows (default: all)")
	batch := fs.Int("batch", inbox.DefaultPurgeBatchSize, "rows per DELETE, each its own transaction")
	duty := fs.Float64("duty-cycle", inbox.DefaultPurgeDutyCycle, "share of the purge's time spent in batches, above 0 and at most 1: after a batch of d it pauses d*(1-duty)/duty, longer when batches slow down; 1 runs them back to back")
	maxPause := fs.Duration("max-pause", inbox.DefaultPurgeMaxPause, "longest pacing pause between two batches")
	pause := fs.Duration("pause", 0, "fixed sleep between batches, added to the pacing pause (-duty-cycle 1 -pause D: a fixed pause alone)")
	dryRun := fs.Bool("dry-run", false, "count the rows that would go; delete nothing")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := win.check(true); err != nil {
		return err
	}
	// 0 would mean "the default" to PurgeConfig; here the default is
	// spelled out, so 0 is a mistake (a purge that never runs a batch).
	if !(*duty > 0 && *duty <= 1) {
		return fmt.Errorf("%w: -duty-cycle must be above 0 and at most 1, got %v", errUsage, *duty)
	}
	if *maxPause <= 0 {
		return fmt.Errorf("%w: -max-pause must be positive, got %v", errUsage, *maxPause)
	}
	if *batch <= 0 {
		// The library reads 0 as its default, and the last line said
		// "batches of 0".
		return fmt.Errorf("%w: -batch must be positive, got %d", errUsage, *batch)
	}
	db, d, err := c.open(ctx, false)
	if err != nil {
		return err
	}
	defer db.Close()
	cfg := inbox.PurgeConfig{DB: db, Dialect: d, Table: c.table, OlderThan: win.olderThan, BatchSize: *batch,
		DutyCycle: *duty, MaxPause: *maxPause, Pause: *pause, Consumer: *consumer}
	src, from, closeSource, err := win.source()
	if err != nil {
		return err
	}
	defer closeSource()
	if src != nil {
		if err := useWindow(ctx, stdout, &cfg, src, from); err != nil {
			return err
		}
	}
	if *dryRun {
		n, err := inbox.CountExpired(ctx, cfg)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "dry run: would delete %s older than %s from %s%s\n", count(n, "row"), cfg.OlderThan, c.table, ofConsumer(cfg.Consumer))
		return nil
	}
	start := time.Now()
	n, err := inbox.Purge(ctx, cfg)
	if err != nil {
		// Nothing on stdout: a script reading it must not see success.
		return fmt.Errorf("%w (%s deleted before the error)", err, count(n, "row"))
	}
	fmt.Fprintf(stdout, "deleted %s older than %s from %s%s in %s (batches of %d, duty cycle %v, pauses up to %s)\n",
		count(n, "row"), cfg.OlderThan, c.table, ofConsumer(cfg.Consumer), time.Since(start).Round(time.Millisecond), cfg.BatchSize,
		cfg.DutyCycle, cfg.MaxPause)
	return nil
}

// ofConsumer is how purge's last line names the consumer of a purge
// restricted to one (-consumer): a log then tells it from a purge of the
// whole table.
func ofConsumer(consumer string) string {
	if consumer == "" {
		return " (every consumer)"
	}
	return fmt.Sprintf(" (consumer %q)", consumer)
}

func statsCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("stats", stderr, &c, true)
	outboxTable := fs.String("outbox-table", "", "also show this outbox table: messages pending, the oldest's age, dead letters; it must exist"+
		" (default: "+inbox.DefaultOutboxTable+", shown when it exists)")
	win := addWindowFlags(fs, "the window the purge uses (e.g. 360h): show the oldest row's age against it (the headroom);"+
		" with -brokers/-topics or -nats-url/-nats-stream, checked against the safe window (or, without it, taken from it) as inbox purge does")
	lag := fs.Duration("purge-lag", defaultPurgeLag, "how far past the window the oldest row may be before stats warns that the purge is falling behind"+
		" (on a partitioned table, how long ago the partition that holds it may have ended past the window)")
	consumer := fs.String("consumer", "", "measure the headroom by this consumer's rows: a purge limited to it (inbox purge -consumer,"+
		" PurgeConfig.Consumer) on a table that consumers with other windows share; default: every consumer's")
	timeout := fs.Duration("timeout", defaultStatsTimeout, "give up when the reads take longer: a table another session holds a lock on"+
		" (a migration, an operator's LOCK TABLE) made stats wait for as long as it was held; the error says which read")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *timeout <= 0 {
		return fmt.Errorf("%w: -timeout must be positive, got %v", errUsage, *timeout)
	}
	if *consumer != "" && !win.given() {
		return fmt.Errorf("%w: -consumer measures the headroom, which needs a window: -older-than, -brokers/-topics or -nats-url/-nats-stream", errUsage)
	}
	if err := win.check(false); err != nil {
		return err
	}
	if *lag < 0 {
		return fmt.Errorf("%w: -purge-lag must not be negative, got %v", errUsage, *lag)
	}
	// Before the connection: its first one waits for a SQLite file
	// another connection holds locked.
	ctx, cancel := context.WithTimeoutCause(ctx, *timeout, fmt.Errorf("the reads took longer than -timeout %v (is a table locked?)", *timeout))
	defer cancel()
	db, d, err := c.open(ctx, false)
	if err != nil {
		return err
	}
	defer db.Close()
	st, err := inbox.Stats(ctx, db, d, c.table)
	if err != nil {
		return withCause(ctx, err)
	}
	// Read before printing anything: a failed command prints nothing on
	// stdout, where a script must not see success.
	ob, err := readOutbox(ctx, db, d, *outboxTable)
	if err != nil {
		return withCause(ctx, err)
	}
	var room *headroom
	if win.given() {
		w, err := win.resolve(ctx)
		if err != nil {
			return withCause(ctx, err)
		}
		h, err := readHeadroom(ctx, db, d, c.table, *consumer, st, w, *lag)
		if err != nil {
			return withCause(ctx, err)
		}
		room = &h
	}
	fmt.Fprintf(stdout, "table:    %s\n", c.table)
	fmt.Fprintf(stdout, "rows:     %d\n", st.Rows)
	if st.Rows > 0 {
		fmt.Fprintf(stdout, "oldest:   %s (%s ago)\n", st.Oldest.Format(time.RFC3339), st.ReadAt.Sub(st.Oldest).Round(time.Second))
		fmt.Fprintf(stdout, "newest:   %s (%s ago)\n", st.Newest.Format(time.RFC3339), st.ReadAt.Sub(st.Newest).Round(time.Second))
	}
	if st.SizeBytes >= 0 {
		fmt.Fprintf(stdout, "size:     %s\n", count(st.SizeBytes, "byte"))
	}
	consumers := make([]string, 0, len(st.Consumers))
	for name := range st.Consumers {
		consumers = append(consumers, name)
	}
	sort.Strings(consumers)
	for _, name := range consumers {
		fmt.Fprintf(stdout, "consumer: %s %d\n", name, st.Consumers[name])
	}
	if room != nil {
		room.print(stdout)
	} else {
		fmt.Fprintln(stdout, "window:   not given (-older-than, -brokers/-topics or -nats-url/-nats-stream show the headroom)")
	}
	if ob != nil {
		fmt.Fprintf(stdout, "outbox:   %s\n", ob.table)
		fmt.Fprintf(stdout, "pending:  %s", count(ob.Pending, "message"))
		if ob.Pending > 0 {
			fmt.Fprintf(stdout, ", the oldest written %s ago", ob.OldestAge.Round(time.Second))
		}
		if ob.FirstLastError != "" {
			fmt.Fprintf(stdout, "\nrefused:  the first in line, last refused with: %s", firstLineOf(ob.FirstLastError, 300))
		}
		fmt.Fprintf(stdout, "\ndead:     %s in the dead-letter table\n", count(ob.DeadLettered, "message"))
	}
	return nil
}

// isPartitionedTable reports whether table is a partitioned PostgreSQL
// table; false when it is not, or cannot be told.
func isPartitionedTable(ctx context.Context, db *sqlx.DB, table string) bool {
	// Quoted as the library quotes it: to_regclass folds an unquoted
	// Billing_Inbox to billing_inbox, another table.
	regclass := pgx.Identifier(strings.Split(table, ".")).Sanitize()
	var partitioned bool
	err := db.GetContext(ctx, &partitioned, "SELECT COALESCE((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)", regclass)
	return err == nil && partitioned
}

// isTemporaryTable reports whether table, on the database of the DSN dsn,
// is in the session's temporary schema: PostgreSQL's pg_temp (pg_temp_N),
// SQLite's temp. Elsewhere (MySQL, and PostgreSQL's own schema named temp)
// such a name is an ordinary database or schema.
func isTemporaryTable(dsn, table string) bool {
	schema, _, qualified := strings.Cut(strings.ToLower(table), ".")
	if !qualified {
		return false
	}
	switch {
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"):
		return schema == "pg_temp" || strings.HasPrefix(schema, "pg_temp_")
	case strings.HasPrefix(dsn, "sqlite://"), strings.HasPrefix(dsn, "file:"):
		return schema == "temp"
	}
	return false
}

// defaultStatsTimeout bounds inbox stats' reads (-timeout).
const defaultStatsTimeout = 30 * time.Second

// withCause returns err, with the cause of ctx's end added when ctx has
// ended (a -timeout says so, where the driver says only that the context
// ended).
func withCause(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); cause != nil && !errors.Is(err, cause) && cause != ctx.Err() {
		return fmt.Errorf("%w: %w", err, cause)
	}
	return err
}

// firstLineOf returns the first line of s, cut at max bytes (with "...").
func firstLineOf(s string, max int) string {
	line, _, more := strings.Cut(s, "\n")
	if len(line) > max {
		// On a character's boundary: cut inside one, the output was no
		// longer UTF-8, and grep called it a binary file.
		cut := max
		for cut > 0 && !utf8.RuneStart(line[cut]) {
			cut--
		}
		return line[:cut] + "..."
	}
	if more {
		return line + " ..."
	}
	return line
}

// outboxState is what "inbox stats" shows of an outbox table.
type outboxState struct {
	table string
	inbox.OutboxStats
}

// readOutbox reads the outbox table named, which must exist, or with table
// "" the default one; nil when that does not exist.
func readOutbox(ctx context.Context, db *sqlx.DB, d inbox.Dialect, table string) (*outboxState, error) {
	named := table != ""
	if !named {
		table = inbox.DefaultOutboxTable
	}
	st, err := inbox.ReadOutboxStats(ctx, db, d, table)
	switch {
	case errors.Is(err, inbox.ErrTableNotFound) && !named && !tableExists(ctx, db, table):
		return nil, nil // no outbox, or one under another name (-outbox-table)
	case err != nil:
		// The default outbox table exists and its dead-letter table does
		// not: an outbox whose relay cannot set a message aside, whose
		// messages may be waiting; silent, it looked like no outbox.
		return nil, err
	}
	return &outboxState{table: table, OutboxStats: st}, nil
}

// tableExists reports whether a statement can read table (an unquoted
// name) on db: the default outbox table, whose dead-letter table
// ReadOutboxStats may have found missing.
func tableExists(ctx context.Context, db *sqlx.DB, table string) bool {
	rows, err := db.QueryContext(ctx, "SELECT 1 FROM "+table+" WHERE 1 = 0")
	if err != nil {
		return false
	}
	return rows.Close() == nil
}

// count returns n and the noun, in the plural unless n is 1: "1 row", "2 rows".
func count(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// claimFunctionNotes is the logger of the Inbox that inbox schema -verify
// makes: it keeps the Info lines that say the table's claim function
// (PostgreSQLPartitioned) is missing, with the statement that creates it,
// to print them, and drops everything else.
type claimFunctionNotes struct {
	watermill.NopLogger
	lines []string
}

func (n *claimFunctionNotes) Info(msg string, fields watermill.LogFields) {
	if _, ok := fields["claim_function"]; ok {
		n.lines = append(n.lines, strings.TrimPrefix(msg, "Inbox: "))
	}
}

func (n *claimFunctionNotes) With(watermill.LogFields) watermill.LoggerAdapter { return n }

package inbox_test

// A database server under test: a pool whose sessions can be told apart
// from everybody else's, and a control pool that observes, kills and
// checks them.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// faultDB is a database under test: pool is what the inbox uses, and its
// server sessions can be told apart from everybody else's (PostgreSQL:
// application_name; MySQL: the local TCP ports of its connections); ctl is a
// separate pool for killing, observing and checking.
type faultDB struct {
	dialect inbox.Dialect
	pool    *sqlx.DB
	ctl     *sqlx.DB
	app     string     // PostgreSQL application_name of pool's sessions
	ports   *portsSeen // MySQL: local ports of pool's connections
}

func (d *faultDB) postgres() bool {
	return d.dialect == inbox.PostgreSQL || d.dialect == inbox.PostgreSQLPartitioned
}

// openFaultDB opens kind ("postgres", "postgres-partitioned", "mysql",
// "mysql-clientFoundRows") with the given extra DSN parameter. A server that
// is not reachable skips (fails in CI), as in testdb.
func openFaultDB(t *testing.T, kind, param string) *faultDB {
	t.Helper()
	sfx := randomSuffix()
	switch kind {
	case "postgres", "postgres-partitioned":
		d := &faultDB{dialect: inbox.PostgreSQL, app: "inbox_faults_" + sfx}
		if kind == "postgres-partitioned" {
			d.dialect = inbox.PostgreSQLPartitioned
		}
		d.ctl = testdb.OpenPostgres(t, "application_name=inbox_faults_ctl_"+sfx)
		d.pool = testdb.OpenPostgres(t, joinParams("application_name="+d.app, param))
		return d
	case "mysql", "mysql-clientFoundRows":
		if kind == "mysql-clientFoundRows" {
			param = joinParams("clientFoundRows=true", param)
		}
		d := &faultDB{dialect: inbox.MySQL, ports: &portsSeen{}}
		d.ctl = testdb.OpenMySQL(t, "")
		d.pool = openTrackedMySQL(t, testdb.WithParam(testdb.MySQLDSN(), param), "inbox_faults_"+sfx, d.ports)
		return d
	}
	t.Fatalf("unknown database kind %q", kind)
	return nil
}

func joinParams(a, b string) string {
	if a == "" || b == "" {
		return a + b
	}
	return a + "&" + b
}

// portsSeen records the local ports of the connections a MySQL pool opened.
type portsSeen struct {
	mu    sync.Mutex
	ports []string
}

func (p *portsSeen) add(c net.Conn) {
	if a, ok := c.LocalAddr().(*net.TCPAddr); ok {
		p.mu.Lock()
		p.ports = append(p.ports, strconv.Itoa(a.Port))
		p.mu.Unlock()
	}
}

func (p *portsSeen) list() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.ports...)
}

// openTrackedMySQL opens a pool whose connections are dialled through a
// network registered under netName, which records their local ports: the
// server shows them in information_schema.processlist.HOST.
func openTrackedMySQL(t *testing.T, dsn, netName string, ports *portsSeen) *sqlx.DB {
	t.Helper()
	return openWrappedMySQL(t, dsn, netName, ports, nil)
}

// openWrappedMySQL is openTrackedMySQL whose connections are wrap(c) when
// wrap is not nil.
func openWrappedMySQL(t *testing.T, dsn, netName string, ports *portsSeen, wrap func(net.Conn) net.Conn) *sqlx.DB {
	t.Helper()
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Net != "tcp" {
		t.Skipf("the MySQL fault tests need a TCP DSN, got net %q", cfg.Net)
	}
	if wrap != nil && (cfg.TLS != nil || (cfg.TLSConfig != "" && cfg.TLSConfig != "false") || strings.Contains(cfg.FormatDSN(), "compress=true")) {
		t.Skip("this fault test reads the client's packets on the wire: it needs a DSN without TLS and compression")
	}
	mysql.RegisterDialContext(netName, func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			ports.add(c)
			if wrap != nil {
				c = wrap(c)
			}
		}
		return c, err
	})
	cfg.Net = netName
	db, err := sqlx.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(8)
	return db
}

// checkNoLeaks checks that no connection of the pool is checked out and that
// no session of the pool is idle in a transaction on the server. Both are
// polled (bounded): a connection database/sql just closed may take a moment
// to disappear on the server.
func (d *faultDB) checkNoLeaks(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := poll(ctx, d.every(), func() (bool, error) {
		n, err := d.idleInTransaction(ctx)
		return d.pool.Stats().InUse == 0 && n == 0, err
	})
	if err != nil {
		n, idleErr := d.idleInTransaction(context.Background())
		t.Errorf("leaks (%v): connections in use %d, sessions idle in transaction %d (%v)", err, d.pool.Stats().InUse, n, idleErr)
	}
}

// idleInTransaction counts the pool's sessions that are idle in an open
// transaction. On MySQL, the transactions InnoDB lists: every inbox
// transaction is one from its claim on.
func (d *faultDB) idleInTransaction(ctx context.Context) (int, error) {
	var n int
	if d.postgres() {
		err := d.ctl.GetContext(ctx, &n, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state IN ('idle in transaction', 'idle in transaction (aborted)')`, d.app)
		return n, err
	}
	ports := d.ports.list()
	if len(ports) == 0 {
		return 0, nil
	}
	q, args, err := sqlx.In(`SELECT ID FROM information_schema.processlist
		WHERE COMMAND = 'Sleep' AND SUBSTRING_INDEX(HOST, ':', -1) IN (?)`, ports)
	if err != nil {
		return 0, err
	}
	var sleeping []int64
	if err := d.ctl.SelectContext(ctx, &sleeping, q, args...); err != nil {
		return 0, err
	}
	trxs, err := d.innodbTransactions(ctx)
	for _, x := range trxs {
		if x.active && slices.Contains(sleeping, x.thread) {
			n++
		}
	}
	return n, err
}

// innodbTrx is one transaction of SHOW ENGINE INNODB STATUS.
type innodbTrx struct {
	active   bool  // started, not yet committed or rolled back
	lockWait bool  // waiting for a lock
	thread   int64 // the session's id (processlist ID)
	text     string
}

var innodbThreadID = regexp.MustCompile(`(?:MySQL|MariaDB) thread id (\d+)`)

// innodbTransactions lists InnoDB's transactions. It reads SHOW ENGINE
// INNODB STATUS rather than information_schema.innodb_trx, which InnoDB
// refreshes only when nobody read it in the last 100 ms: with several tests
// (or other users of the server) polling it, it can stay stale for seconds.
func (d *faultDB) innodbTransactions(ctx context.Context) ([]innodbTrx, error) {
	return innodbTransactions(ctx, d.ctl)
}

// innodbTransactions lists InnoDB's transactions from SHOW ENGINE INNODB
// STATUS, read through q (see faultDB.innodbTransactions).
func innodbTransactions(ctx context.Context, q sqlx.QueryerContext) ([]innodbTrx, error) {
	var typ, name, status string
	if err := q.QueryRowxContext(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status); err != nil {
		return nil, err
	}
	_, section, ok := strings.Cut(status, "\nTRANSACTIONS\n")
	if !ok {
		return nil, errors.New("SHOW ENGINE INNODB STATUS: no TRANSACTIONS section")
	}
	section, _, _ = strings.Cut(section, "\nFILE I/O\n")
	blocks := strings.Split(section, "\n---TRANSACTION ")
	var out []innodbTrx
	for _, b := range blocks[1:] {
		x := innodbTrx{text: b}
		first, _, _ := strings.Cut(b, "\n")
		x.active = strings.Contains(first, "ACTIVE")
		x.lockWait = strings.Contains(b, "\nLOCK WAIT ")
		if m := innodbThreadID.FindStringSubmatch(b); m != nil {
			x.thread, _ = strconv.ParseInt(m[1], 10, 64)
		}
		out = append(out, x)
	}
	return out, nil
}

// lockWaiters counts the sessions waiting for a lock in a statement that
// names table.
func (d *faultDB) lockWaiters(ctx context.Context, table string) (int, error) {
	var n int
	if d.postgres() {
		err := d.ctl.GetContext(ctx, &n, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND strpos(query, $2) > 0`, d.app, table)
		return n, err
	}
	trxs, err := d.innodbTransactions(ctx)
	for _, x := range trxs {
		if x.lockWait && strings.Contains(x.text, table) {
			n++
		}
	}
	return n, err
}

// sessionID returns the server's id of tx's session: the PostgreSQL
// backend pid, the MySQL connection id.
func (d *faultDB) sessionID(ctx context.Context, tx *sqlx.Tx) (int64, error) {
	q := "SELECT CONNECTION_ID()"
	if d.postgres() {
		q = "SELECT pg_backend_pid()"
	}
	var id int64
	err := tx.GetContext(ctx, &id, q)
	return id, err
}

// kill ends the pool's session id from another session (terminate,
// killMySQL) and waits until the server has let it go.
func (d *faultDB) kill(ctx context.Context, id int64) error {
	if d.postgres() {
		return d.terminate(ctx, id)
	}
	return d.killMySQL(ctx, id)
}

// terminate kills the PostgreSQL backend pid, which must be a session of
// the pool (checked by application_name, so the test can never kill anybody
// else's), and waits until it is gone.
func (d *faultDB) terminate(ctx context.Context, pid int64) error {
	var killed []bool
	if err := d.ctl.SelectContext(ctx, &killed, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE pid = $1 AND application_name = $2`, pid, d.app); err != nil {
		return err
	}
	if len(killed) != 1 || !killed[0] {
		return fmt.Errorf("pg_terminate_backend(%d): %v", pid, killed)
	}
	return poll(ctx, d.every(), func() (bool, error) {
		var n int
		err := d.ctl.GetContext(ctx, &n, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid)
		return n == 0, err
	})
}

// killMySQL kills the MySQL/MariaDB session id with KILL CONNECTION, which
// must be a session of the pool (checked by the local port of its TCP
// connection, so the test can never kill anybody else's), and waits until
// the server has let it go.
func (d *faultDB) killMySQL(ctx context.Context, id int64) error {
	ports := d.ports.list()
	if len(ports) == 0 {
		return errors.New("the pool has opened no connection")
	}
	q, args, err := sqlx.In(`SELECT COUNT(*) FROM information_schema.processlist
		WHERE ID = ? AND SUBSTRING_INDEX(HOST, ':', -1) IN (?)`, id, ports)
	if err != nil {
		return err
	}
	var n int
	if err := d.ctl.GetContext(ctx, &n, q, args...); err != nil {
		return err
	}
	if n != 1 {
		return fmt.Errorf("session %d is not one of the pool's (ports %v)", id, ports)
	}
	if _, err := d.ctl.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10)); err != nil {
		return err
	}
	return poll(ctx, d.every(), func() (bool, error) {
		var n int
		err := d.ctl.GetContext(ctx, &n, "SELECT COUNT(*) FROM information_schema.processlist WHERE ID = ?", id)
		return n == 0, err
	})
}

// poll calls cond every `every` until it reports true, fails, or ctx ends.
func poll(ctx context.Context, every time.Duration, cond func() (bool, error)) error {
	for {
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("condition not met: %w", ctx.Err())
		case <-time.After(every):
		}
	}
}

// every is how often to poll d's server: SHOW ENGINE INNODB STATUS is
// heavier than a pg_stat_activity query.
func (d *faultDB) every() time.Duration {
	if d.postgres() {
		return 2 * time.Millisecond
	}
	return 10 * time.Millisecond
}

// waitCh waits for ch to be closed, or fails when ctx ends first.
func waitCh(ctx context.Context, ch <-chan struct{}, what string) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
	}
}

// inboxKey is one (consumer, message id) key of the inbox table.
type inboxKey struct{ consumer, id string }

// leftInTransaction returns how many sessions of a pool are still in a
// transaction that a handler left open. PostgreSQL: the sessions whose
// pg_backend_pid() the handlers recorded, in any transaction state ("idle
// in transaction" included). MySQL/MariaDB: the keys the handlers claimed
// that are still locked, probed with SELECT ... FOR UPDATE NOWAIT (an open
// claim locks its key; innodb_trx is a cache that InnoDB refreshes only
// after 100 ms unread, so it can show a transaction that already ended).
// SQLite has no sessions: a transaction left open would hold the write lock
// and the next message would wait for it.
func leftInTransaction(t *testing.T, d inbox.Dialect, probe *sqlx.DB, table string, pids []int64, keys []inboxKey) int {
	t.Helper()
	ctx := context.Background()
	n := 0
	switch {
	case isPostgres(d):
		if err := probe.GetContext(ctx, &n, "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ANY($1) AND xact_start IS NOT NULL", pids); err != nil {
			t.Fatal(err)
		}
	case d == inbox.MySQL:
		for _, k := range keys {
			tx, err := probe.BeginTxx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var rows []int
			err = tx.SelectContext(ctx, &rows, "SELECT 1 FROM "+table+" WHERE consumer = ? AND message_id = ? FOR UPDATE NOWAIT", k.consumer, k.id)
			tx.Rollback()
			if err != nil {
				t.Logf("key %s/%s: %v", k.consumer, k.id, err)
				n++
			}
		}
	}
	return n
}

// lockWaiters returns a function that counts the sessions of db waiting for
// a lock on table's keys: on PostgreSQL the pool's sessions (by
// application_name, which db must set) waiting on a lock, the advisory key
// lock of the partitioned dialect included; on MySQL/MariaDB the
// transactions in LOCK WAIT on a statement that names table, read from SHOW
// ENGINE INNODB STATUS (see innodbTransactions). Only sessions this test
// opened are counted.
func lockWaiters(d inbox.Dialect, probe *sqlx.DB, appName, table string) func(ctx context.Context) (int, error) {
	return func(ctx context.Context) (int, error) {
		var n int
		var err error
		switch {
		case isPostgres(d):
			err = probe.GetContext(ctx, &n, "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'", appName)
		case d == inbox.MySQL:
			var trxs []innodbTrx
			trxs, err = innodbTransactions(ctx, probe)
			for _, x := range trxs {
				if x.lockWait && strings.Contains(x.text, table) {
					n++
				}
			}
		}
		return n, err
	}
}

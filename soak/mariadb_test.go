//go:build unix

package soak

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"
)

// openDB opens a pool on driver and dsn. On MariaDB each new connection's
// session id (CONNECTION_ID()) goes to onSession first: MariaDB has no
// application_name to tell the run's sessions apart from those of other
// tests on the same server, so the parent checks these ids instead.
func openDB(driverName, dsn string, onSession func(id int64)) (*sqlx.DB, error) {
	if driverName != "mysql" {
		return sqlx.Open(driverName, dsn)
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, err
	}
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	return sqlx.NewDb(sql.OpenDB(sessionConnector{connector, onSession}), "mysql"), nil
}

// sessionConnector reports the session id of every connection it opens
// before database/sql can use it.
type sessionConnector struct {
	driver.Connector
	onSession func(id int64)
}

func (c sessionConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	id, err := connectionID(ctx, conn)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("soak: read CONNECTION_ID(): %w", err)
	}
	c.onSession(id)
	return conn, nil
}

func connectionID(ctx context.Context, conn driver.Conn) (int64, error) {
	q, ok := conn.(driver.QueryerContext)
	if !ok {
		return 0, errors.New("connection cannot query")
	}
	rows, err := q.QueryContext(ctx, "SELECT CONNECTION_ID()", nil)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	dest := make([]driver.Value, 1)
	if err := rows.Next(dest); err != nil {
		return 0, err
	}
	switch v := dest[0].(type) {
	case int64:
		return v, nil
	case uint64:
		return int64(v), nil
	case []byte:
		return strconv.ParseInt(string(v), 10, 64)
	default:
		return 0, fmt.Errorf("CONNECTION_ID() returned %T", v)
	}
}

// checkMariaDBSessions asserts what checkSessions asserts on PostgreSQL: no
// session of the workers is left on the server (a SIGKILLed worker's
// sessions end when the server sees the socket close), and no session of the
// run, the test's own included, is left in a transaction.
func (s *soak) checkMariaDBSessions() {
	s.mu.Lock()
	workers := make([]any, 0, len(s.workerSessions))
	for id := range s.workerSessions {
		workers = append(workers, id)
	}
	all := append(make([]any, 0, len(workers)+len(s.ownSessions)), workers...)
	for id := range s.ownSessions {
		all = append(all, id)
	}
	s.mu.Unlock()
	if len(workers) == 0 {
		s.t.Errorf("no worker reported a MariaDB session: the session check has nothing to check")
		return
	}
	in := func(ids []any) string { return "(" + strings.TrimSuffix(strings.Repeat("?,", len(ids)), ",") + ")" }
	var left []string
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		var sessions, inTx []string
		if err := s.db.Select(&sessions, `SELECT CONCAT('session ', ID, ': ', COMMAND, ': ', COALESCE(STATE, ''), ': ', COALESCE(INFO, ''))
			FROM information_schema.PROCESSLIST WHERE ID IN `+in(workers), workers...); err != nil {
			s.t.Fatal(err)
		}
		// INNODB_TRX needs the PROCESS privilege (root has it).
		if err := s.db.Select(&inTx, `SELECT CONCAT('session ', trx_mysql_thread_id, ': in a transaction since ', trx_started, ': ',
			trx_state, ': ', COALESCE(trx_query, ''))
			FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id IN `+in(all), all...); err != nil {
			s.t.Fatal(err)
		}
		left = append(sessions, inTx...)
		if len(left) == 0 || time.Now().After(end) {
			break
		}
	}
	if len(left) > 0 {
		s.t.Errorf("sessions left on MariaDB after every worker exited:\n%s", strings.Join(left, "\n"))
	}
}

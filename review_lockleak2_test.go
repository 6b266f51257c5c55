package inbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

func TestReviewPurgerLockLeaksOnUnluckyCancel(t *testing.T) {
	for _, tc := range []struct {
		name, driverName, dsn string
		drv                   driver.Driver
		dialect               inbox.Dialect
	}{
		{"postgres", "pgx", testdb.PostgresDSN(), stdlib.GetDefaultDriver(), inbox.PostgreSQL},
		{"mysql", "mysql", testdb.MySQLDSN(), &mysql.MySQLDriver{}, inbox.MySQL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := sqlx.NewDb(sql.OpenDB(hookConnector{tc.drv, tc.dsn}), tc.driverName)
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			var probe *sqlx.DB
			if tc.dialect == inbox.MySQL {
				probe = testdb.OpenMySQL(t, "")
			} else {
				probe = testdb.OpenPostgres(t, "")
			}
			f := newFixture(t, probe)
			f.newInbox(inbox.Config{})
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			fn := func() { cancel() }
			afterLock.Store(&fn)
			r := p.RunOnce(ctx)
			afterLock.Store(nil)
			t.Logf("round: %+v", r)
			// The round is over: its connection is back in the pool, or
			// closed. A closed session's locks go when the server has
			// noticed the closed socket, which is soon but not at once:
			// wait for that, boundedly. A pooled session holding the lock
			// would keep it for the whole wait.
			if !eventuallyLockFree(t, probe, tc.dialect, f.inbox) {
				other, _ := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: probe, Table: f.inbox, OlderThan: time.Hour}})
				t.Errorf("round ended with %v, but the purge lock stays held by the pooled connection; "+
					"another instance: skipped=%v; same purger's next round unlocks once: lock free after it = %v",
					r.Err, other.RunOnce(context.Background()).Skipped,
					func() bool { p.RunOnce(context.Background()); return lockFree(t, probe, tc.dialect, f.inbox) }())
			}
		})
	}
}

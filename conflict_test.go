package inbox_test

// Errors of conflicting transactions (isolation errors, serialization
// failures, deadlocks) are transient nacks, and every message ends processed
// exactly once.

import (
	"context"
	"database/sql"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// An isolation error in the handler at REPEATABLE READ is a transient nack:
// two workers process two messages at once, and both handlers read a shared
// row and then update it. The second update fails with the database's
// isolation error (PostgreSQL 40001; MariaDB with
// innodb_snapshot_isolation=ON, the default since 11.6, 1020 "Record has
// changed since last read"). It must be a nack, kept from the poison queue by
// IsTransient, and its redelivery is processed: the counter ends at 2.
// Databases that report no such error at REPEATABLE READ (SQLite, MySQL
// without snapshot isolation) and the partitioned dialect (READ COMMITTED
// only) do not apply.
func TestIsolationError_InTheHandlerIsATransientNack(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		switch tdb.Dialect {
		case inbox.SQLite, inbox.PostgreSQLPartitioned:
			t.Skip("no isolation error at REPEATABLE READ here")
		case inbox.MySQL:
			var on string
			if err := db.Get(&on, "SELECT @@innodb_snapshot_isolation"); err != nil {
				t.Skipf("no innodb_snapshot_isolation on this server: %v", err)
			}
			param := "innodb_snapshot_isolation=ON"
			if tdb.Name == "mysql-clientFoundRows" {
				param += "&clientFoundRows=true"
			}
			db = testdb.OpenMySQL(t, param)
		}
		f := newFixture(t, db)
		counter := "counter_" + randomSuffix()
		exec(t, db, "CREATE TABLE "+counter+" (id INT NOT NULL PRIMARY KEY, n INT NOT NULL)")
		dropLater(t, db, counter)
		exec(t, db, "INSERT INTO "+counter+" (id, n) VALUES (1, 0)")
		ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
		defer cancel()

		var hooks hookCounts
		ib := f.newInbox(hooks.config(inbox.Config{TxOptions: &sql.TxOptions{Isolation: sql.LevelRepeatableRead}}))
		poison, sink := poisonUnlessTransient(t)
		out := &outcomes{}
		bothRead := newBarrier(ctx, 2)
		handler := func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			var n int
			if err := tx.GetContext(msg.Context(), &n, "SELECT n FROM "+counter+" WHERE id = 1"); err != nil {
				return err
			}
			bothRead.arrive()
			if _, err := tx.ExecContext(msg.Context(), tx.Rebind("UPDATE "+counter+" SET n = ? WHERE id = 1"), n+1); err != nil {
				return err
			}
			return f.writeBusinessRow(msg)
		}
		workers := map[string]*feed{"A": newFeed(), "B": newFeed()}
		for _, in := range workers {
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(poison, out.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, handler)
			})
		}
		msgs := map[string]*message.Message{
			"A": message.NewMessage(watermill.NewUUID(), nil),
			"B": message.NewMessage(watermill.NewUUID(), nil),
		}
		var mu sync.Mutex
		acked := map[string]bool{}
		var wg sync.WaitGroup
		for label, in := range workers {
			wg.Go(func() {
				a, err := in.send(ctx, delivery(msgs[label], label))
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				acked[label] = a
				mu.Unlock()
			})
		}
		wg.Wait()
		if t.Failed() {
			return
		}
		if p := sink.poisoned(); len(p) != 0 {
			t.Fatalf("the isolation error went to the poison queue: %s", p[0].Metadata.Get(middleware.ReasonForPoisonedKey))
		}
		var loser string
		for label := range workers {
			if !acked[label] {
				loser = label
			}
		}
		if loser == "" || acked["A"] == acked["B"] {
			t.Fatalf("acked A %v, B %v; want one commit and one isolation error (nack)", acked["A"], acked["B"])
		}
		err := out.last(loser)
		t.Logf("loser %s: %v", loser, err)
		if !inbox.IsTransient(err) {
			t.Errorf("loser's error %v is not transient", err)
		}
		if a, err := workers[loser].send(ctx, delivery(msgs[loser], loser+"-redelivery")); err != nil || !a {
			t.Fatalf("redelivery: acked %v (%v), last error %v", a, err, out.last(loser+"-redelivery"))
		}
		var n int
		if err := db.Get(&n, "SELECT n FROM "+counter+" WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		if n != 2 || f.businessRows() != 2 || f.inboxRows() != 2 || hooks.processed.Load() != 2 {
			t.Errorf("counter %d, business rows %d, inbox rows %d, commits %d; want 2 each",
				n, f.businessRows(), f.inboxRows(), hooks.processed.Load())
		}
	})
}

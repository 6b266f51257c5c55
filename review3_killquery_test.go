package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestReview3KillQueryIsTransient: KILL QUERY (an operator, pt-kill, a
// proxy's query timeout) interrupts a handler's statement with MySQL error
// 1317 (ER_QUERY_INTERRUPTED). It is MySQL's pg_cancel_backend, whose 57014
// IsTransient already accepts: nothing about the message, the redelivery
// succeeds. Not transient, the README's poison queue takes the message.
func TestReview3KillQueryIsTransient(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	table := "killquery_" + testdb.RandomSuffix()
	exec(t, db, `CREATE TABLE `+table+` (id int PRIMARY KEY, v int) ENGINE=InnoDB`)
	testdb.DropLater(t, db, table)
	exec(t, db, `INSERT INTO `+table+` VALUES (1, 0)`)
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()

	holder, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	if _, err := holder.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	victim, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Rollback()
	var id int
	if err := victim.Get(&id, `SELECT CONNECTION_ID()`); err != nil {
		t.Fatal(err)
	}
	go func() {
		for ctx.Err() == nil { // until the victim waits for the row lock
			var n int
			_ = db.GetContext(ctx, &n, `SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'UPDATE%'`, id)
			if n == 1 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		_, _ = db.ExecContext(ctx, `KILL QUERY `+fmt.Sprint(id))
	}()
	_, err = victim.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`)
	wantTransient(t, "KILL QUERY (1317)", err, true)
}

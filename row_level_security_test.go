package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A row-level security policy that applies to the service's role can hide
// processed rows from the claim: the partitioned dialect finds a processed
// key with a NOT EXISTS read (its primary key holds processed_at too), so a
// SELECT policy that hides rows (here consumer = current_user, the consumer
// not named as the role) had every redelivery insert another row of the
// key and run its handler again, after Verify had accepted the table; the
// plain dialect's ON CONFLICT then fails every claim with 42501. Verify, and
// the middleware's check of the table before its first claim, refuse such a
// table with ErrIncompatibleTable and the DDL that fixes it; the table's
// owner, to whom the policies do not apply, may use it.
func TestClaimRefusesATableWhoseRowLevelSecurityAppliesToTheService(t *testing.T) {
	for _, dialect := range []inbox.Dialect{inbox.PostgreSQL, inbox.PostgreSQLPartitioned} {
		t.Run(dialect.String(), func(t *testing.T) {
			owner := testdb.OpenPostgres(t, "")
			table := "rls_inbox_" + randomSuffix()
			dropLater(t, owner, table)
			setup, err := inbox.New(inbox.Config{DB: owner, Dialect: dialect, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := setup.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			role := "rls_svc_" + randomSuffix()
			exec(t, owner, "CREATE ROLE "+role+" NOLOGIN")
			t.Cleanup(func() {
				_, _ = owner.Exec("DROP TABLE IF EXISTS " + table)
				_, _ = owner.Exec("DROP FUNCTION IF EXISTS " + table + "_claim(text, text, bigint)")
				_, _ = owner.Exec("DROP FUNCTION IF EXISTS " + table + "_claim(text, text, bigint, bytea)")
				_, _ = owner.Exec("DROP ROLE " + role)
			})
			exec(t, owner, "GRANT SELECT, INSERT, DELETE ON "+table+" TO "+role)
			exec(t, owner, "ALTER TABLE "+table+" ENABLE ROW LEVEL SECURITY")
			exec(t, owner, "CREATE POLICY own_rows ON "+table+" FOR SELECT USING (consumer = current_user)")
			exec(t, owner, "CREATE POLICY may_insert ON "+table+" FOR INSERT WITH CHECK (true)")
			if err := setup.Verify(context.Background()); err != nil {
				t.Errorf("Verify by the table's owner, to whom no policy applies: %v; want nil", err)
			}

			db := testdb.OpenPostgres(t, "role="+role)
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: dialect, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			err = ib.Verify(context.Background())
			if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "DISABLE ROW LEVEL SECURITY") {
				t.Errorf("Verify of a table whose row-level security applies to the service: %v; want ErrIncompatibleTable with the fix", err)
			}
			var c calls
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					c.inc(msg.UUID)
					return nil
				})
			})
			msg := message.NewMessage("rls-"+randomSuffix(), []byte("x"))
			acked := 0
			for range 3 {
				if in.deliver(t, msg) {
					acked++
				}
			}
			if n := c.get(msg.UUID); n > 1 || acked > 0 {
				var rows int
				_ = owner.Get(&rows, "SELECT count(*) FROM "+table+" WHERE message_id = $1", msg.UUID)
				t.Errorf("one message delivered 3 times: acked %d times, the handler ran %d times (%d inbox rows of its key); want none acked, at most one run",
					acked, n, rows)
			}
		})
	}
}

package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The fixes Verify prints for a hand-made MySQL/MariaDB table keep what its
// rows say: after them, a message processed before is still a duplicate,
// and each row is purged when its own window ends, not earlier. Each case
// is a table refused for one column, rows processed before the fix, the
// printed fixes applied as printed (one session per script), then a
// redelivery through the router and a purge.
func TestVerifyFixesOfAMySQLTableKeepItsProcessedRows(t *testing.T) {
	t.Parallel()
	const key = "consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL"
	const at = "processed_at datetime(6) NOT NULL"
	cases := []struct {
		name, columns, insert string
		// operator: DSN parameters of the session that applies the fixes
		operator string
		// purged: rows a purge of rows older than 240h deletes after the fixes
		purged int64
	}{
		{name: "latin1 key columns", // made varbinary at once, they kept latin1's bytes
			columns: "consumer varchar(255) CHARACTER SET latin1 COLLATE latin1_bin NOT NULL," +
				" message_id varchar(255) CHARACTER SET latin1 COLLATE latin1_bin NOT NULL, " + at,
			insert: "INSERT INTO {t} VALUES ('billing', 'café-1', UTC_TIMESTAMP(6))"},
		{name: "binary key columns", // made varbinary, they kept their zero padding
			columns: "consumer binary(64) NOT NULL, message_id binary(64) NOT NULL, " + at,
			insert:  "INSERT INTO {t} VALUES ('billing', 'café-1', UTC_TIMESTAMP(6))"},
		{name: "no processed_at", // added NOT NULL, every row got the zero date and was purged at once
			columns: key,
			insert:  "INSERT INTO {t} VALUES ('billing', 'café-1')"},
		{name: "TIMESTAMP processed_at, fixed from a session at +05:00", // converted by the operator's time zone
			columns: key + ", processed_at timestamp(6) NOT NULL", operator: "time_zone=%27%2B05%3A00%27",
			insert: "INSERT INTO {t} VALUES ('billing', 'café-1', CURRENT_TIMESTAMP(6) - INTERVAL 238 HOUR)," +
				" ('billing', 'old', CURRENT_TIMESTAMP(6) - INTERVAL 242 HOUR)",
			purged: 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			db := testdb.OpenMySQL(t, "")
			table := "inbox_" + randomSuffix()
			dropLater(t, db, table)
			exec(t, db, expand("CREATE TABLE {t} ("+c.columns+", PRIMARY KEY (consumer, message_id)) ENGINE=InnoDB", table))
			exec(t, db, expand(c.insert, table))
			ib := verifyInbox(t, db, inbox.MySQL, table)
			err := ib.Verify(context.Background())
			if !errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Fatalf("Verify: %v, want ErrIncompatibleTable", err)
			}
			applyFixes(t, testdb.OpenMySQL(t, c.operator), err)
			if err := ib.Verify(context.Background()); err != nil {
				t.Fatalf("Verify after the printed fixes: %v", err)
			}
			deleted, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Dialect: inbox.MySQL, Table: table, OlderThan: 240 * time.Hour})
			if err != nil || deleted != c.purged {
				t.Errorf("purge of rows older than 240h after the fixes: deleted %d, %v; want %d", deleted, err, c.purged)
			}

			var calls calls
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					calls.inc(msg.UUID)
					return nil
				})
			})
			for _, id := range []string{"café-1", "café-2"} {
				if !in.deliver(t, message.NewMessage(id, nil)) {
					t.Fatalf("message %q nacked", id)
				}
			}
			if got := calls.get("café-1"); got != 0 {
				t.Errorf("handler calls for café-1, processed before the fixes: %d, want 0 (a duplicate)", got)
			}
			if got := calls.get("café-2"); got != 1 {
				t.Errorf("handler calls for café-2, new: %d, want 1", got)
			}
		})
	}
}

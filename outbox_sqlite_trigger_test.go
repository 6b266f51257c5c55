package inbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// A SQLite outbox table with an AFTER INSERT trigger (an audit copy) whose
// statement fails a constraint: the handler's Publish fails and the row it
// inserted goes with the failed statement, so that a handler that ignores
// the error and returns nil commits no output. Its one-output INSERT once ran
// OR FAIL (no statement journal), which keeps the rows a statement wrote
// before its failure, the outbox row among them: sent although Publish had
// returned an error.
func TestSQLiteOutboxTriggerFailureLeavesNoRow(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
	audit := "audit_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+audit+" (v TEXT NOT NULL)")
	exec(t, db, "CREATE TRIGGER "+audit+"_t AFTER INSERT ON "+ob.Table()+" BEGIN INSERT INTO "+audit+" (v) VALUES (NULL); END")
	ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
	in := newFeed()
	var pubErr error
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			pub, _ := inbox.OutboxFromContext(msg.Context())
			pubErr = pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)) // error ignored
			return nil
		})
	})
	in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))
	if n := count(t, db, ob.Table(), ""); pubErr == nil || n != 0 {
		t.Errorf("Publish returned %v and %d outbox rows committed; want an error and none", pubErr, n)
	}
}

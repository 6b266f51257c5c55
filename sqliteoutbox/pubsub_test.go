package sqliteoutbox_test

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox/internal/closewait"
	"github.com/watermill-inbox/inbox/sqliteoutbox"
)

// subscriberParams are the recommended SQLite settings without
// _txlock=immediate, as subscribers need, and with a busy_timeout of 60 s
// (see the package doc: SQLite does not queue writers).
const subscriberParams = "_journal_mode=WAL&_busy_timeout=60000&_synchronous=NORMAL"

// testDBs holds one database file per test of the suite, keyed by the name
// of the *testing.T that Watermill's suite passes to every constructor call
// of one test: its publishers and subscribers meet there, and no other test
// writes to it. SQLite has one write lock per file; with one file for the
// whole suite, twenty parallel tests competed for it, and a schema creation
// (which watermill-sql does not retry) could fail with SQLITE_BUSY on a
// loaded CI machine. Applications give each SQLite database to one
// process's outbox for the same reason (package doc).
var (
	testDBsMu sync.Mutex
	testDBs   = map[string]*sqlx.DB{}
)

func testDB(t *testing.T) *sqlx.DB {
	testDBsMu.Lock()
	defer testDBsMu.Unlock()
	if db, ok := testDBs[t.Name()]; ok {
		return db
	}
	// Deferred transactions for the subscribers (see the package doc).
	db, err := sqlx.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "pubsub.db")+"?"+subscriberParams)
	if err != nil {
		t.Fatal(err)
	}
	// The first connection switches the new file to WAL; connections that
	// open during that switch fail with SQLITE_BUSY, busy_timeout or not.
	if err := db.Ping(); err != nil {
		db.Close()
		t.Fatal(err)
	}
	testDBs[t.Name()] = db
	// Registered before the publishers' and subscribers' cleanups, so it
	// runs after them.
	t.Cleanup(func() {
		testDBsMu.Lock()
		delete(testDBs, t.Name())
		testDBsMu.Unlock()
		if err := db.Close(); err != nil {
			t.Errorf("closing the test database: %v", err)
		}
	})
	return db
}

func newPubSub(t *testing.T, consumerGroup string) (message.Publisher, message.Subscriber) {
	db := testDB(t)
	logger := watermill.NopLogger{}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{
		SchemaAdapter:        sqliteoutbox.SchemaAdapter{},
		AutoInitializeSchema: true,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    consumerGroup,
		PollInterval:     time.Millisecond,
		ResendInterval:   5 * time.Millisecond,
		SchemaAdapter:    sqliteoutbox.SchemaAdapter{},
		OffsetsAdapter:   sqliteoutbox.OffsetsAdapter{},
		InitializeSchema: true,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	// Close waits for the channels Subscribe returned (see closewait).
	closing := closewait.Wrap(sub)
	// Watermill's suite does not close every subscriber it makes (its
	// multiplied subscribers are closed before they subscribe): close them
	// when the test ends. Close is idempotent.
	t.Cleanup(func() {
		closing.Close()
		pub.Close()
	})
	return pub, closing
}

// Watermill's universal pub/sub suite, as watermill-sql runs it for its
// MySQL and PostgreSQL adapters. Each test gets its own database file
// (testDB).
func TestPublishSubscribe(t *testing.T) {
	tests.TestPubSub(t,
		tests.Features{
			ConsumerGroups:      true,
			ExactlyOnceDelivery: false, // at least once: see the package doc
			GuaranteedOrder:     true,
			Persistent:          true,
			// Under the race detector, SQLite (in this process) takes
			// minutes over the suite's 5,000 messages to 50
			// subscribers: the same tests with its short sizes.
			ForceShort: raceEnabled,
		},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "") },
		newPubSub,
	)
}

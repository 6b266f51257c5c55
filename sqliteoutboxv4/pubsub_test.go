package sqliteoutboxv4_test

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox/internal/closewait"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
)

// suiteParams are the recommended SQLite settings without
// _txlock=immediate (Watermill's suite leaves messages unacked while others
// publish: see the package doc), and with a busy_timeout of 60 s (SQLite
// does not queue writers).
const suiteParams = "_journal_mode=WAL&_busy_timeout=60000&_synchronous=NORMAL"

// suiteDBs holds one database file per test of the suite, keyed by the name
// of the *testing.T that Watermill's suite passes to every constructor call
// of one test: its publishers and subscribers meet there, and no other test
// writes to it (one write lock per file; a schema creation, which
// watermill-sql does not retry, could otherwise fail with SQLITE_BUSY on a
// loaded machine).
var (
	suiteDBsMu sync.Mutex
	suiteDBs   = map[string]*sqlx.DB{}
)

func suiteDB(t *testing.T) *sqlx.DB {
	suiteDBsMu.Lock()
	defer suiteDBsMu.Unlock()
	if db, ok := suiteDBs[t.Name()]; ok {
		return db
	}
	db, err := sqlx.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "pubsub.db")+"?"+suiteParams)
	if err != nil {
		t.Fatal(err)
	}
	// The first connection switches the new file to WAL; connections that
	// open during that switch fail with SQLITE_BUSY, busy_timeout or not.
	if err := db.Ping(); err != nil {
		db.Close()
		t.Fatal(err)
	}
	suiteDBs[t.Name()] = db
	// Registered before the publishers' and subscribers' cleanups, so it
	// runs after them.
	t.Cleanup(func() {
		suiteDBsMu.Lock()
		delete(suiteDBs, t.Name())
		suiteDBsMu.Unlock()
		if err := db.Close(); err != nil {
			t.Errorf("closing the test database: %v", err)
		}
	})
	return db
}

// newPubSub makes a publisher and a subscriber on the test's database with
// the given adapters, configured as watermill-sql v4 configures its own
// adapters for this suite (pubsub_test.go), plus schema initialisation.
func newPubSub(t *testing.T, consumerGroup string, schema wsql.SchemaAdapter, offsets wsql.OffsetsAdapter) (message.Publisher, message.Subscriber) {
	db := wsql.BeginnerFromStdSQL(suiteDB(t))
	logger := watermill.NopLogger{}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: schema, AutoInitializeSchema: true}, logger)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    consumerGroup,
		PollInterval:     time.Millisecond,
		ResendInterval:   5 * time.Millisecond,
		SchemaAdapter:    schema,
		OffsetsAdapter:   offsets,
		InitializeSchema: true,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	// Close waits for the channels Subscribe returned (see closewait).
	closing := closewait.Wrap(sub)
	// Watermill's suite does not close every subscriber it makes: close
	// them when the test ends. Close is idempotent.
	t.Cleanup(func() {
		closing.Close()
		pub.Close()
	})
	return pub, closing
}

// Watermill's universal pub/sub suite, as watermill-sql v4 runs it for its
// own adapters (consumer groups for the offsets schema, none for the queue
// schema), for each pair of adapters; the queue schema both keeping acked
// rows and deleting them. Each test of the suite gets its own database file.
func TestPublishSubscribe(t *testing.T) {
	t.Run("Offsets", func(t *testing.T) {
		t.Parallel()
		schema, offsets := sqliteoutboxv4.SchemaAdapter{}, sqliteoutboxv4.OffsetsAdapter{}
		tests.TestPubSub(t,
			tests.Features{
				ConsumerGroups:      true,
				ExactlyOnceDelivery: false, // at least once with deferred transactions: see the package doc
				GuaranteedOrder:     true,
				Persistent:          true,
				// Under the race detector, SQLite (in this process) takes
				// minutes over the suite's 5,000 messages to 50
				// subscribers: the same tests with its short sizes.
				ForceShort: raceEnabled,
			},
			func(t *testing.T) (message.Publisher, message.Subscriber) {
				return newPubSub(t, "", schema, offsets)
			},
			func(t *testing.T, consumerGroup string) (message.Publisher, message.Subscriber) {
				return newPubSub(t, consumerGroup, schema, offsets)
			},
		)
	})
	for _, deleteOnAck := range []bool{false, true} {
		name := "Queue"
		if deleteOnAck {
			name = "QueueDeleteOnAck"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			schema := sqliteoutboxv4.QueueSchema{}
			offsets := sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: deleteOnAck}
			tests.TestPubSub(t,
				tests.Features{
					ConsumerGroups:      false,
					ExactlyOnceDelivery: false,
					GuaranteedOrder:     true,
					Persistent:          true,
					// Under the race detector, SQLite (in this process) takes
					// minutes over the suite's 5,000 messages to 50
					// subscribers: the same tests with its short sizes.
					ForceShort: raceEnabled,
				},
				func(t *testing.T) (message.Publisher, message.Subscriber) {
					return newPubSub(t, "", schema, offsets)
				},
				nil,
			)
		})
	}
}

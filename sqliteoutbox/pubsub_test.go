package sqliteoutbox_test

import (
	"os"
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

	"github.com/watermill-inbox/inbox/sqliteoutbox"
)

// subscriberParams are the recommended SQLite settings without
// _txlock=immediate, as subscribers need, and with a busy_timeout of 60 s:
// the suite's concurrent tests (20 topics published and subscribed at once)
// keep SQLite's only write lock so busy that, on a loaded machine, a schema
// creation lost every poll for 10 s and failed with SQLITE_BUSY (see the
// package doc). SQLite does not queue writers.
const subscriberParams = "_journal_mode=WAL&_busy_timeout=60000&_synchronous=NORMAL"

// shared is one database for the whole suite: its tests make publishers and
// subscribers with separate constructor calls and expect them to meet (each
// test uses its own topics).
var (
	sharedOnce sync.Once
	shared     *sqlx.DB
)

func sharedDB(t *testing.T) *sqlx.DB {
	sharedOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sqliteoutbox")
		if err != nil {
			t.Fatal(err)
		}
		// Deferred transactions for the subscribers (see the package doc).
		db, err := sqlx.Open("sqlite", "file:"+filepath.Join(dir, "pubsub.db")+"?"+subscriberParams)
		if err != nil {
			t.Fatal(err)
		}
		shared = db
	})
	return shared
}

func newPubSub(t *testing.T, consumerGroup string) (message.Publisher, message.Subscriber) {
	db := sharedDB(t)
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
	// Watermill's suite does not close every subscriber it makes (its
	// multiplied subscribers are closed before they subscribe): close them
	// when the test ends. Close is idempotent.
	t.Cleanup(func() {
		sub.Close()
		pub.Close()
	})
	return pub, sub
}

// Watermill's universal pub/sub suite, as watermill-sql runs it for its
// MySQL and PostgreSQL adapters. Each test gets its own database file.
func TestPublishSubscribe(t *testing.T) {
	tests.TestPubSub(t,
		tests.Features{
			ConsumerGroups:      true,
			ExactlyOnceDelivery: false, // at least once: see the package doc
			GuaranteedOrder:     true,
			Persistent:          true,
		},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "") },
		newPubSub,
	)
}

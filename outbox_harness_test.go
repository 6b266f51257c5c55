package inbox_test

// Real watermill-sql outboxes (v3, v4, v4's bounded queue schema) on
// PostgreSQL and MariaDB, the forwarder that relays them, what it forwarded,
// and a COMMIT that fails after the outbox rows were written.

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql3 "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// outboxKind is one watermill-sql outbox setup.
type outboxKind struct {
	name string
	// bounded: the relay deletes a row once it is forwarded.
	bounded bool
	v3      bool
	// adapters returns the publisher factory for Config.Outbox and the
	// forwarder's subscriber on db (PostgreSQL when pg), for the SQL topic.
	adapters func(db *sqlx.DB, pg bool) (factory func(tx *sqlx.Tx) (message.Publisher, error), sub func() (message.Subscriber, func(topic string) error, error))
}

// outboxV4 is watermill-sql v4's default schema and offsets (rows stay).
var outboxV4 = outboxKind{name: "v4", adapters: func(db *sqlx.DB, pg bool) (func(*sqlx.Tx) (message.Publisher, error), func() (message.Subscriber, func(string) error, error)) {
	var schema wsql.SchemaAdapter = wsql.DefaultMySQLSchema{}
	var offsets wsql.OffsetsAdapter = wsql.DefaultMySQLOffsetsAdapter{}
	if pg {
		schema, offsets = wsql.DefaultPostgreSQLSchema{}, wsql.DefaultPostgreSQLOffsetsAdapter{}
	}
	return v4Adapters(db, schema, offsets)
}}

// outboxV4Queue is v4's queue schema with delete-on-ack: the bounded outbox.
// SubscribeBatchSize 1: watermill-sql v4.1.2 acks (deletes) every row it
// read in a batch once it stops early, delivered or not.
var outboxV4Queue = outboxKind{name: "v4 queue", bounded: true, adapters: func(db *sqlx.DB, pg bool) (func(*sqlx.Tx) (message.Publisher, error), func() (message.Subscriber, func(string) error, error)) {
	var schema wsql.SchemaAdapter = wsql.MySQLQueueSchema{SubscribeBatchSize: 1}
	var offsets wsql.OffsetsAdapter = wsql.MySQLQueueOffsetsAdapter{DeleteOnAck: true}
	if pg {
		schema, offsets = wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1}, wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}
	}
	return v4Adapters(db, schema, offsets)
}}

func v4Adapters(db *sqlx.DB, schema wsql.SchemaAdapter, offsets wsql.OffsetsAdapter) (func(*sqlx.Tx) (message.Publisher, error), func() (message.Subscriber, func(string) error, error)) {
	factory := func(tx *sqlx.Tx) (message.Publisher, error) {
		return wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
	}
	sub := func() (message.Subscriber, func(string) error, error) {
		s, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
			SchemaAdapter: schema, OffsetsAdapter: offsets, InitializeSchema: true, PollInterval: 20 * time.Millisecond,
		}, watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		return s, s.SubscribeInitialize, nil
	}
	return factory, sub
}

// outboxV3 is watermill-sql v3's default schema and offsets.
var outboxV3 = outboxKind{name: "v3", v3: true, adapters: func(db *sqlx.DB, pg bool) (func(*sqlx.Tx) (message.Publisher, error), func() (message.Subscriber, func(string) error, error)) {
	var schema wsql3.SchemaAdapter = wsql3.DefaultMySQLSchema{}
	var offsets wsql3.OffsetsAdapter = wsql3.DefaultMySQLOffsetsAdapter{}
	if pg {
		schema, offsets = wsql3.DefaultPostgreSQLSchema{}, wsql3.DefaultPostgreSQLOffsetsAdapter{}
	}
	factory := func(tx *sqlx.Tx) (message.Publisher, error) {
		return wsql3.NewPublisher(tx, wsql3.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
	}
	sub := func() (message.Subscriber, func(string) error, error) {
		s, err := wsql3.NewSubscriber(db, wsql3.SubscriberConfig{
			SchemaAdapter: schema, OffsetsAdapter: offsets, InitializeSchema: true, PollInterval: 20 * time.Millisecond,
		}, watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		return s, s.SubscribeInitialize, nil
	}
	return factory, sub
}}

// sqlOutbox is one test's outbox: the inbox's factory, publishing through
// Watermill's forwarder envelope to the SQL topic, and its table.
type sqlOutbox struct {
	kind    outboxKind
	db      *sqlx.DB
	topic   string // the SQL topic the forwarder reads
	table   string // the outbox table of that topic
	factory func(tx *sqlx.Tx) (message.Publisher, error)
	newSub  func() (message.Subscriber, func(string) error, error)
}

// newSQLOutbox creates the outbox tables of kind on db up front (a
// publisher on a transaction cannot) and drops them when the test ends.
func newSQLOutbox(t *testing.T, kind outboxKind, db *sqlx.DB, pg bool) *sqlOutbox {
	t.Helper()
	o := &sqlOutbox{kind: kind, db: db, topic: "outbox_" + randomSuffix()}
	o.table = "watermill_" + o.topic
	dropLater(t, db, o.table)
	dropLater(t, db, "watermill_offsets_"+o.topic)
	factory, newSub := kind.adapters(db, pg)
	o.newSub = newSub
	o.factory = func(tx *sqlx.Tx) (message.Publisher, error) {
		pub, err := factory(tx)
		if err != nil {
			return nil, err
		}
		return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: o.topic}), nil
	}
	sub, initialize, err := newSub()
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := initialize(o.topic); err != nil {
		t.Fatal(err)
	}
	return o
}

// rows is how many rows the outbox table holds.
func (o *sqlOutbox) rows(t testing.TB) int { return count(t, o.db, o.table, "") }

// runForwarder relays the outbox to dest until the test ends.
func (o *sqlOutbox) runForwarder(t *testing.T, dest message.Publisher) {
	t.Helper()
	sub, _, err := o.newSub()
	if err != nil {
		t.Fatal(err)
	}
	fwd, err := forwarder.NewForwarder(sub, dest, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: o.topic, CloseTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- fwd.Run(context.Background()) }()
	select {
	case <-fwd.Running():
	case err := <-errc:
		t.Fatalf("forwarder stopped: %v", err)
	}
	t.Cleanup(func() {
		if err := fwd.Close(); err != nil {
			t.Errorf("close forwarder: %v", err)
		}
		if err := <-errc; err != nil {
			t.Errorf("forwarder: %v", err)
		}
		// The forwarder's router closes its subscriber too, maybe still
		// doing so: v4's Close is safe to call twice at once, v3.1.0's is
		// not (an unsynchronised flag), so v3's is left to the router.
		if !o.kind.v3 {
			if err := sub.Close(); err != nil {
				t.Errorf("close outbox subscriber: %v", err)
			}
		}
	})
}

// forwardedSink is the broker the forwarder publishes to: it counts what
// arrives by destination topic and by the "of" metadata (the inbox message
// the outbox message was published for).
type forwardedSink struct {
	mu    sync.Mutex
	count map[[2]string]int // {topic, of}
	total int
}

func newForwardedSink() *forwardedSink { return &forwardedSink{count: map[[2]string]int{}} }

func (s *forwardedSink) Publish(topic string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.count[[2]string{topic, m.Metadata.Get("of")}]++
		s.total++
	}
	return nil
}

func (s *forwardedSink) Close() error { return nil }

func (s *forwardedSink) get(topic, of string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.count[[2]string{topic, of}]
}

func (s *forwardedSink) sum() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.total
}

// outboxDB is one server the outbox tests run on: a pool, and a function
// that the handler calls last so that the COMMIT after its outbox writes
// fails without taking effect.
type outboxDB struct {
	name       string
	pg         bool
	db         *sqlx.DB
	failCommit func(msg *message.Message) error
}

// outboxServers are the servers of the outbox tests, by testdb name.
var outboxServers = []string{"postgres", "mysql"}

// openOutboxDB opens server. PostgreSQL: the COMMIT fails on a deferred
// foreign key (SQLSTATE 23503 at COMMIT). MariaDB has no deferred
// constraints: the pool's connections close their socket instead of sending
// the COMMIT that follows an armed statement, so the server never commits
// and the client's COMMIT fails.
func openOutboxDB(t *testing.T, server string) *outboxDB {
	t.Helper()
	if server == "postgres" {
		db := testdb.OpenPostgres(t, "")
		parent, child := "parent_"+randomSuffix(), "child_"+randomSuffix()
		exec(t, db, "CREATE TABLE "+parent+" (id INTEGER PRIMARY KEY)")
		exec(t, db, "CREATE TABLE "+child+" (parent_id INTEGER REFERENCES "+parent+"(id) DEFERRABLE INITIALLY DEFERRED)")
		dropLater(t, db, parent) // cleanups run last first: child, then parent
		dropLater(t, db, child)
		return &outboxDB{name: server, pg: true, db: db, failCommit: func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+child+" (parent_id) VALUES (42)")
			return err
		}}
	}
	testdb.OpenMySQL(t, "") // skips, or fails in CI, when the server is missing
	db := openWrappedMySQL(t, testdb.MySQLDSN(), "inbox_outbox_"+randomSuffix(), &portsSeen{}, func(c net.Conn) net.Conn {
		return &dropBeforeCommitConn{Conn: c}
	})
	db.SetMaxOpenConns(16)
	return &outboxDB{name: server, db: db, failCommit: func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), "SELECT 1 /* "+dropMarker+" */")
		return err
	}}
}

// commitPacket is go-sql-driver/mysql's COMMIT: COM_QUERY "COMMIT".
var commitPacket = append([]byte{0x03}, "COMMIT"...)

// dropBeforeCommitConn is a MySQL client connection that, once a query
// containing dropMarker went through it, closes its socket instead of
// sending the next COMMIT, and fails that write: the server sees the
// connection end and rolls the transaction back.
type dropBeforeCommitConn struct {
	net.Conn
	armed atomic.Bool
}

func (c *dropBeforeCommitConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(dropMarker)) {
		c.armed.Store(true)
	}
	if len(p) == 4+len(commitPacket) && bytes.Equal(p[4:], commitPacket) && c.armed.CompareAndSwap(true, false) {
		c.Conn.Close()
		return 0, errors.New("inbox-fault: connection closed instead of sending COMMIT")
	}
	return c.Conn.Write(p)
}

// ofMessage returns a new message published for the inbox message of.
func ofMessage(of string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	m.Metadata.Set("of", of)
	return m
}

// testOutboxPublishesIffCommitted drives kind's outbox through a real router
// with Recoverer and the inbox: each message's handler writes its business
// row, publishes one "audit" message through OutboxFromContext and returns
// one "invoices" message. A delivery whose handler fails, panics or whose
// COMMIT fails leaves no outbox row; its redelivery (the fault gone), a
// plain message and a last one are each forwarded exactly once per topic;
// a duplicate delivery of a processed message is acked and forwards
// nothing. The forwarder relays in commit order, so once the last message
// has arrived, anything the earlier deliveries could have sent would have
// arrived too.
func testOutboxPublishesIffCommitted(t *testing.T, kind outboxKind) {
	for _, server := range outboxServers {
		t.Run(server, func(t *testing.T) {
			t.Parallel()
			odb := openOutboxDB(t, server)
			o := newSQLOutbox(t, kind, odb.db, odb.pg)
			f := newFixture(t, odb.db)
			ib := f.newInbox(inbox.Config{Outbox: o.factory})
			sink := newForwardedSink()
			o.runForwarder(t, sink)

			var mu sync.Mutex
			fault := map[string]string{} // message UUID -> "error", "panic", "commit"
			in := newFeed()
			routerPub := &recordingPublisher{fail: true} // with an outbox the router publishes nothing
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(middleware.Recoverer, ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", routerPub, func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeBusinessRow(msg); err != nil {
						return nil, err
					}
					pub, ok := inbox.OutboxFromContext(msg.Context())
					if !ok {
						return nil, errors.New("no outbox in context")
					}
					if err := pub.Publish("audit", ofMessage(msg.UUID)); err != nil {
						return nil, err
					}
					mu.Lock()
					mode := fault[msg.UUID]
					mu.Unlock()
					switch mode {
					case "error":
						return nil, errors.New("handler failed after publishing")
					case "panic":
						panic("handler bug after publishing")
					case "commit":
						if err := odb.failCommit(msg); err != nil {
							return nil, err
						}
					}
					return []*message.Message{ofMessage(msg.UUID)}, nil
				})
			})

			var failed []*message.Message
			for _, mode := range []string{"error", "panic", "commit"} {
				m := message.NewMessage(watermill.NewUUID(), nil)
				mu.Lock()
				fault[m.UUID] = mode
				mu.Unlock()
				if in.deliver(t, m) {
					t.Fatalf("%s: acked", mode)
				}
				if n := o.rows(t); n != 0 {
					t.Fatalf("%s: the outbox holds %d rows of a transaction that did not commit", mode, n)
				}
				failed = append(failed, m)
			}
			if f.inboxRows() != 0 || f.businessRows() != 0 {
				t.Fatalf("failed deliveries left inbox rows %d, business rows %d", f.inboxRows(), f.businessRows())
			}

			plain := message.NewMessage(watermill.NewUUID(), nil)
			if !in.deliver(t, plain) {
				t.Fatal("plain message nacked")
			}
			waitFor(t, func() bool { return sink.get("audit", plain.UUID) == 1 && sink.get("invoices", plain.UUID) == 1 })
			if !in.deliver(t, plain) {
				t.Fatal("duplicate delivery nacked")
			}
			mu.Lock()
			clear(fault)
			mu.Unlock()
			for _, m := range failed {
				if !in.deliver(t, m) {
					t.Fatalf("redelivery of %s nacked with the fault gone", m.UUID)
				}
			}
			last := message.NewMessage(watermill.NewUUID(), nil)
			if !in.deliver(t, last) {
				t.Fatal("last message nacked")
			}
			waitFor(t, func() bool { return sink.get("audit", last.UUID) == 1 && sink.get("invoices", last.UUID) == 1 })

			for _, m := range append(failed, plain, last) {
				if a, i := sink.get("audit", m.UUID), sink.get("invoices", m.UUID); a != 1 || i != 1 {
					t.Errorf("message %s: forwarded audit %d, invoices %d; want 1 and 1", m.UUID, a, i)
				}
			}
			if got := sink.sum(); got != 10 {
				t.Errorf("forwarded %d messages, want 10 (2 for each of 5 messages)", got)
			}
			if f.inboxRows() != 5 || f.businessRows() != 5 {
				t.Errorf("inbox rows %d, business rows %d; want 5 and 5", f.inboxRows(), f.businessRows())
			}
			if routerPub.published != 0 {
				t.Errorf("the router published %d messages, want 0", routerPub.published)
			}
			if kind.bounded {
				waitFor(t, func() bool { return o.rows(t) == 0 })
			}
		})
	}
}

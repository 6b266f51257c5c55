package mysqloutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql3 "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/mysqloutbox"
)

// relay is one watermill-sql outbox setup on MySQL: a publisher bound to a
// transaction, the subscriber that relays the table, and the tables the
// topic creates.
type relay struct {
	name       string
	publisher  func(tx *sql.Tx) (message.Publisher, error)
	subscriber func(db *sql.DB) (message.Subscriber, func(topic string) error, error)
	tables     func(topic string) []string
}

var relays = []relay{
	{
		name: "v4 DefaultMySQLSchema",
		publisher: func(tx *sql.Tx) (message.Publisher, error) {
			return wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultMySQLSchema{}}, nil)
		},
		subscriber: func(db *sql.DB) (message.Subscriber, func(string) error, error) {
			sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
				SchemaAdapter:  wsql.DefaultMySQLSchema{},
				OffsetsAdapter: wsql.DefaultMySQLOffsetsAdapter{},
				PollInterval:   10 * time.Millisecond, InitializeSchema: true,
			}, nil)
			if err != nil {
				return nil, nil, err
			}
			return sub, sub.SubscribeInitialize, nil
		},
		tables: func(topic string) []string { return []string{"watermill_" + topic, "watermill_offsets_" + topic} },
	},
	{
		name: "v4 MySQLQueueSchema, DeleteOnAck",
		publisher: func(tx *sql.Tx) (message.Publisher, error) {
			return wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: wsql.MySQLQueueSchema{}}, nil)
		},
		subscriber: func(db *sql.DB) (message.Subscriber, func(string) error, error) {
			sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
				SchemaAdapter:  wsql.MySQLQueueSchema{},
				OffsetsAdapter: wsql.MySQLQueueOffsetsAdapter{DeleteOnAck: true},
				PollInterval:   10 * time.Millisecond, InitializeSchema: true,
			}, nil)
			if err != nil {
				return nil, nil, err
			}
			return sub, sub.SubscribeInitialize, nil
		},
		tables: func(topic string) []string { return []string{"watermill_" + topic} },
	},
	{
		name: "v3 DefaultMySQLSchema",
		publisher: func(tx *sql.Tx) (message.Publisher, error) {
			return wsql3.NewPublisher(tx, wsql3.PublisherConfig{SchemaAdapter: wsql3.DefaultMySQLSchema{}}, nil)
		},
		subscriber: func(db *sql.DB) (message.Subscriber, func(string) error, error) {
			sub, err := wsql3.NewSubscriber(db, wsql3.SubscriberConfig{
				SchemaAdapter:  wsql3.DefaultMySQLSchema{},
				OffsetsAdapter: wsql3.DefaultMySQLOffsetsAdapter{},
				PollInterval:   10 * time.Millisecond, InitializeSchema: true,
			}, nil)
			if err != nil {
				return nil, nil, err
			}
			return sub, sub.SubscribeInitialize, nil
		},
		tables: func(topic string) []string { return []string{"watermill_" + topic, "watermill_offsets_" + topic} },
	},
}

const (
	orderingRuns       = 5
	orderingPublishers = 16  // concurrent publishing transactions
	orderingMessages   = 800 // per run, one per transaction
)

// TestRelayOrdering measures, as the billing example did, how many
// committed outbox messages each MySQL relay never delivers when
// concurrent transactions commit out of AUTO_INCREMENT order, without and
// with the Lock: 5 runs each, 16 publishing transactions at a time, one
// message per transaction, one relaying subscriber. With the Lock no
// message is lost on any relay; without it the offset-based relays may lose
// some (the numbers are logged; they vary from run to run). A run ends with
// a sentinel message committed after every other: the relays read in
// offset order, so a message not delivered before the sentinel is skipped
// for good.
func TestRelayOrdering(t *testing.T) {
	if testing.Short() {
		t.Skip("measurement: 30 runs of 800 transactions each")
	}
	db := testdb.OpenMySQL(t, "")
	db.SetMaxOpenConns(orderingPublishers + 4)
	lock := newLock(t, db.DB)
	for _, r := range relays {
		for _, locked := range []bool{false, true} {
			name := r.name + "/no lock"
			if locked {
				name = r.name + "/Lock"
			}
			t.Run(name, func(t *testing.T) {
				var lost []string
				total := 0
				for range orderingRuns {
					n := relayRun(t, db.DB, r, lock, locked)
					lost = append(lost, fmt.Sprint(n))
					total += n
					if locked && n != 0 {
						t.Errorf("with the Lock, the relay lost %d of %d messages", n, orderingMessages)
					}
				}
				t.Logf("%s: lost per run of %d messages: %s (total %d)", name, orderingMessages, strings.Join(lost, ", "), total)
			})
		}
	}
}

// relayRun publishes orderingMessages messages from concurrent transactions
// while r's subscriber relays them, and returns how many it never
// delivered.
func relayRun(t *testing.T, db *sql.DB, r relay, lock *mysqloutbox.Lock, locked bool) int {
	t.Helper()
	topic := "relay_" + testdb.RandomSuffix()
	for _, table := range r.tables(topic) {
		dropLater(t, db, table)
	}
	sub, initialize, err := r.subscriber(db)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := initialize(topic); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	publish := func(uuid string) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // harmless after Commit
		pub, err := r.publisher(tx)
		if err != nil {
			return err
		}
		if locked {
			pub = lock.Publisher(tx, pub)
		}
		if err := pub.Publish(topic, message.NewMessage(uuid, []byte(`{}`))); err != nil {
			return err
		}
		return tx.Commit()
	}

	received := map[string]bool{}
	sentinel := watermill.NewUUID()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range msgs {
			m.Ack()
			if m.UUID == sentinel {
				return
			}
			received[m.UUID] = true
		}
	}()

	var wg sync.WaitGroup
	var mu sync.Mutex
	var published []string
	next := make(chan int)
	for range orderingPublishers {
		wg.Go(func() {
			for range next {
				id := watermill.NewUUID()
				if err := publish(id); err != nil {
					t.Errorf("publish: %v", err)
					continue
				}
				mu.Lock()
				published = append(published, id)
				mu.Unlock()
			}
		})
	}
	for i := range orderingMessages {
		next <- i
	}
	close(next)
	wg.Wait()
	if err := publish(sentinel); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatalf("the sentinel was not relayed: %v", ctx.Err())
	}
	lost := 0
	for _, id := range published {
		if !received[id] {
			lost++
		}
	}
	return lost
}

package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// databases are the three the suite compares; MySQL means MariaDB here.
func databases() []testdb.DB {
	var dbs []testdb.DB
	for _, d := range testdb.All {
		if d.Name != "mysql-clientFoundRows" {
			dbs = append(dbs, d)
		}
	}
	return dbs
}

// businessTable creates the handler's table, shaped like a real one (an
// invoices table): a generated primary key, one row per handled message, and
// no unique key on the message, so that the baseline really writes a
// duplicate twice.
func businessTable(b *testing.B, db *sqlx.DB) string {
	table := "bench_business_" + testdb.RandomSuffix()
	id := map[string]string{
		"pgx":      "id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
		"postgres": "id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", // lib/pq
		"mysql":    "id BIGINT AUTO_INCREMENT PRIMARY KEY",
		"sqlite":   "id INTEGER PRIMARY KEY",
	}[db.DriverName()]
	if _, err := db.Exec("CREATE TABLE " + table + " (" + id + ", message_id VARCHAR(255) NOT NULL, amount INTEGER NOT NULL)"); err != nil {
		b.Fatal(err)
	}
	testdb.DropLater(b, db, table)
	return table
}

// messages returns n messages in which dup percent are redeliveries of a
// message handled 64 positions earlier (so, already committed at conc=8).
func messages(n, dup int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		id := watermill.NewUUID()
		if i >= 64 && i%100 < dup {
			id = msgs[i-64].UUID
		}
		msgs[i] = message.NewMessage(id, []byte(`{"amount":100}`))
	}
	return msgs
}

// variant builds the handler under test on db, writing to business.
type variant struct {
	name  string
	build func(b *testing.B, db *sqlx.DB, d inbox.Dialect, business string) message.HandlerFunc
}

// insertSQL is the business write every variant makes, built once.
func insertSQL(db *sqlx.DB, business string) string {
	return db.Rebind("INSERT INTO " + business + " (message_id, amount) VALUES (?, ?)")
}

// baseline is the handler in its own transaction, with no deduplication.
func baseline(b *testing.B, db *sqlx.DB, _ inbox.Dialect, business string) message.HandlerFunc {
	query := insertSQL(db, business)
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, query, msg.UUID, 100); err != nil {
			tx.Rollback()
			return nil, err
		}
		return nil, tx.Commit()
	}
}

// newInbox creates an inbox on a new table (dropped when b ends) with its
// schema, and returns it with the table's name. consumer "" means the
// handler name.
func newInbox(b *testing.B, db *sqlx.DB, d inbox.Dialect, consumer string) (*inbox.Inbox, string) {
	return newInboxWith(b, inbox.Config{DB: db, Dialect: d, Consumer: consumer})
}

// newInboxWith is newInbox with the rest of cfg as given; cfg.Table is
// replaced by the new table's name.
func newInboxWith(b *testing.B, cfg inbox.Config) (*inbox.Inbox, string) {
	db := cfg.DB
	table := "bench_inbox_" + testdb.RandomSuffix()
	b.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	cfg.Table = table
	ib, err := inbox.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		b.Fatal(err)
	}
	return ib, table
}

// inboxHandler is the baseline's write, behind the inbox middleware.
func inboxHandler(ib *inbox.Inbox, query string) message.HandlerFunc {
	return ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), query, msg.UUID, 100)
		return nil, err
	})
}

var variants = []variant{
	{"baseline", baseline},
	{"inbox", func(b *testing.B, db *sqlx.DB, d inbox.Dialect, business string) message.HandlerFunc {
		ib, _ := newInbox(b, db, d, "bench")
		return inboxHandler(ib, insertSQL(db, business))
	}},
	{"deduplicator", func(b *testing.B, db *sqlx.DB, d inbox.Dialect, business string) message.HandlerFunc {
		repo, err := middleware.NewMapExpiringKeyRepository(time.Hour)
		if err != nil {
			b.Fatal(err)
		}
		dedup := middleware.Deduplicator{
			KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
			Repository: repo,
			Timeout:    time.Minute,
		}
		return dedup.Middleware(baseline(b, db, d, business))
	}},
}

// run feeds b.N messages to h from conc goroutines and reports msgs/s and
// the p50 and p99 latency of one message, in microseconds.
func run(b *testing.B, h message.HandlerFunc, msgs []*message.Message, conc int) {
	latencies := make([]time.Duration, len(msgs))
	b.ReportAllocs()
	b.ResetTimer()
	elapsed, err := feed(h, msgs, conc, latencies)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	report(b, len(msgs), elapsed, latencies)
}

// feed hands msgs to h from conc goroutines, stores each message's latency
// at its index in latencies, and returns the time it took and an error h
// returned, if any.
func feed(h message.HandlerFunc, msgs []*message.Message, conc int, latencies []time.Duration) (time.Duration, error) {
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(msgs) {
					return
				}
				t0 := time.Now()
				if _, err := h(msgs[i]); err != nil {
					failed.Store(err)
				}
				latencies[i] = time.Since(t0)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	err, _ := failed.Load().(error)
	return elapsed, err
}

func report(b *testing.B, n int, elapsed time.Duration, latencies []time.Duration) {
	slices.Sort(latencies)
	pct := func(p float64) float64 {
		return float64(latencies[min(len(latencies)-1, int(float64(len(latencies))*p))].Microseconds())
	}
	b.ReportMetric(float64(n)/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(pct(0.50), "p50-us")
	b.ReportMetric(pct(0.99), "p99-us")
}

// BenchmarkThroughput/<db>/<variant>/dup=<pct>/conc=<n>: one message is one
// handler call that inserts one business row in a transaction. <db>
// postgres-pgx is package pgxinbox against a bare pgx transaction
// (pgx_test.go).
func BenchmarkThroughput(b *testing.B) {
	b.Run("postgres-pgx", benchmarkThroughputPgx)
	for _, d := range databases() {
		b.Run(d.Name, func(b *testing.B) {
			db := d.Open(b)
			db.SetMaxOpenConns(16)
			db.SetMaxIdleConns(16)
			for _, v := range variants {
				for _, dup := range []int{0, 10, 50} {
					for _, conc := range []int{1, 8} {
						b.Run(fmt.Sprintf("%s/dup=%d/conc=%d", v.name, dup, conc), func(b *testing.B) {
							h := v.build(b, db, d.Dialect, businessTable(b, db))
							run(b, h, messages(b.N, dup), conc)
						})
					}
				}
			}
		})
	}
}

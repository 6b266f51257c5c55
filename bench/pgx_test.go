package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// This file holds the postgres-pgx cases: the pgx-native inbox (package
// pgxinbox, BEGIN and the claim in one batch) against the same handler in a
// bare pgx.Tx from the same pgxpool. BenchmarkThroughput and
// BenchmarkMiddlewareAllocs run them as their "postgres-pgx" database;
// BenchmarkPgxRoundTrips counts what each kind of message sends.

// wire counts the round trips of a pool's connections: a round trip is a
// turn from the client writing to the client reading, however many writes
// and reads the turn takes. It counts the connections' start-up too: take
// the difference over a span of messages.
type wire struct{ roundTrips atomic.Int64 }

// wireConn is one connection counted by its pool's wire.
type wireConn struct {
	net.Conn
	w    *wire
	sent atomic.Bool // written since the last read
}

func (c *wireConn) Write(p []byte) (int, error) {
	c.sent.Store(true)
	return c.Conn.Write(p)
}

func (c *wireConn) Read(p []byte) (int, error) {
	if c.sent.Swap(false) {
		c.w.roundTrips.Add(1)
	}
	return c.Conn.Read(p)
}

// pgxPool is a pgx pool on the test PostgreSQL whose round trips are
// counted, with the *sqlx.DB over it that the shared helpers take
// (businessTable, insertSQL).
type pgxPool struct {
	pool *pgxpool.Pool
	db   *sqlx.DB
	wire *wire
}

// openPgxPool opens a pool of maxConns connections in pgx's default query
// exec mode (statements prepared and cached per connection) with tracer
// (may be nil), and opens every connection up front, as warm does for
// database/sql. An unreachable server skips the benchmark, or fails it
// under CI=true (testdb.OpenPgxPool's rule). Everything is closed when b
// ends.
func openPgxPool(b *testing.B, maxConns int32, tracer pgx.QueryTracer) pgxPool {
	probe := testdb.OpenPgxPool(b, "") // skips or fails when unreachable
	cfg := probe.Config()
	probe.Close()
	w := &wire{}
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &wireConn{Conn: c, w: w}, nil
	}
	cfg.ConnConfig.Tracer = tracer
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	conns := make([]*pgxpool.Conn, 0, maxConns)
	for range maxConns {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	db := pgxinbox.DB(pool)
	b.Cleanup(func() { db.Close() }) // after the tables' drops, registered later
	return pgxPool{pool: pool, db: db, wire: w}
}

// pgxBaseline is the handler in a bare pgx transaction from the pool
// (pool.Begin, the insert, Commit), with no deduplication.
func pgxBaseline(b *testing.B, p pgxPool) message.HandlerFunc {
	return pgxBaselineOn(p, insertSQL(p.db, businessTable(b, p.db)))
}

// pgxBaselineOn is pgxBaseline writing with query (insertSQL's insert).
func pgxBaselineOn(p pgxPool, query string) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, err := p.pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, query, msg.UUID, 100); err != nil {
			return nil, errors.Join(err, tx.Rollback(ctx))
		}
		return nil, tx.Commit(ctx)
	}
}

// pgxInbox is the baseline's write behind the pgxinbox middleware, on an
// inbox table of its own (consumer "bench"), dropped when b ends.
func pgxInbox(b *testing.B, p pgxPool) message.HandlerFunc {
	ib, _ := newPgxInbox(b, p)
	return pgxInboxOn(ib, insertSQL(p.db, businessTable(b, p.db)))
}

// pgxInboxOn is the write query (insertSQL's insert) behind ib's middleware.
func pgxInboxOn(ib *pgxinbox.Inbox, query string) message.HandlerFunc {
	return ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := pgxinbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no pgx transaction in the message context")
		}
		_, err := tx.Exec(msg.Context(), query, msg.UUID, 100)
		return nil, err
	})
}

// newPgxInbox returns a pgxinbox.Inbox (consumer "bench") on a new table
// with its schema, dropped when b ends, and the table's name.
func newPgxInbox(b *testing.B, p pgxPool) (*pgxinbox.Inbox, string) {
	table := "bench_inbox_" + testdb.RandomSuffix()
	testdb.DropLater(b, p.db, table)
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: p.pool, Table: table, Consumer: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(context.Background()); err != nil {
		b.Fatal(err)
	}
	return ib, table
}

// pgxBareClaim is what the pgxinbox middleware sends, written out by hand
// with no middleware: BEGIN and the claim (the inbox's statement, on an
// inbox table) in one batch, then the baseline's insert and COMMIT, or
// ROLLBACK when the claim found the message. Against the baseline it
// measures the claim (its work on the server and pgx's batch); against the
// inbox, the middleware's own work.
func pgxBareClaim(b *testing.B, p pgxPool) message.HandlerFunc {
	_, table := newPgxInbox(b, p)
	claim := "INSERT INTO " + table + " (consumer, message_id) VALUES ($1, $2) ON CONFLICT (consumer, message_id) DO NOTHING"
	query := insertSQL(p.db, businessTable(b, p.db))
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		batch := &pgx.Batch{}
		batch.BeginTx(pgx.TxOptions{})
		batch.Queue(claim, "bench", msg.UUID)
		br := p.pool.SendBatch(ctx, batch)
		tx := br.Tx()
		_, err := br.Exec()
		var tag pgconn.CommandTag
		if err == nil {
			tag, err = br.Exec()
		}
		if err = errors.Join(err, br.Close()); err != nil {
			return nil, errors.Join(err, tx.Rollback(ctx))
		}
		if tag.RowsAffected() == 0 {
			return nil, tx.Rollback(ctx)
		}
		if _, err := tx.Exec(ctx, query, msg.UUID, 100); err != nil {
			return nil, errors.Join(err, tx.Rollback(ctx))
		}
		return nil, tx.Commit(ctx)
	}
}

// pgxVariant builds a postgres-pgx handler under test on a pool.
type pgxVariant struct {
	name  string
	build func(b *testing.B, p pgxPool) message.HandlerFunc
}

var pgxVariants = []pgxVariant{{"baseline", pgxBaseline}, {"inbox", pgxInbox}}

// benchmarkThroughputPgx is BenchmarkThroughput/postgres-pgx: the same
// dup and conc cases as the other databases, with a pool of 16
// connections (their database/sql pools' size), and the round trips per
// message on the wire as "round-trips/msg".
func benchmarkThroughputPgx(b *testing.B) {
	p := openPgxPool(b, 16, nil)
	for _, v := range pgxVariants {
		for _, dup := range []int{0, 10, 50} {
			for _, conc := range []int{1, 8} {
				b.Run(fmt.Sprintf("%s/dup=%d/conc=%d", v.name, dup, conc), func(b *testing.B) {
					h := v.build(b, p)
					msgs := messages(b.N, dup)
					before := p.wire.roundTrips.Load()
					run(b, h, msgs, conc)
					b.ReportMetric(float64(p.wire.roundTrips.Load()-before)/float64(b.N), "round-trips/msg")
				})
			}
		}
	}
}

// benchmarkMiddlewareAllocsPgx is BenchmarkMiddlewareAllocs/postgres-pgx,
// with the same metrics: what pgxinbox's middleware adds per message to
// the bare pgx transaction, with Background and with cancellable message
// contexts.
func benchmarkMiddlewareAllocsPgx(b *testing.B) {
	p := openPgxPool(b, 8, nil)
	perMessage := func(h message.HandlerFunc, cancellable bool) float64 {
		msgs := messages(b.N+1, 0)
		if cancellable {
			for _, msg := range msgs {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				msg.SetContext(ctx)
			}
		}
		i := 0
		return testing.AllocsPerRun(b.N, func() {
			if _, err := h(msgs[i]); err != nil {
				b.Fatal(err)
			}
			i++
		})
	}
	base := perMessage(pgxBaseline(b, p), false)
	withInbox := perMessage(pgxInbox(b, p), false)
	b.ReportMetric(withInbox-base, "middleware-allocs/msg")
	b.ReportMetric(withInbox, "inbox-allocs/msg")
	b.ReportMetric(base, "baseline-allocs/msg")
	base = perMessage(pgxBaseline(b, p), true)
	withInbox = perMessage(pgxInbox(b, p), true)
	b.ReportMetric(withInbox-base, "router-ctx-middleware-allocs/msg")
}

// statements counts what a pool's connections send, as pgx's tracers see
// it: statements sent on their own (Exec, Query, QueryRow; BEGIN, COMMIT
// and ROLLBACK included), batches, statements sent in batches, and
// statements prepared (pgx's statement cache prepares each statement once
// per connection, before its first use).
type statements struct {
	single, batches, batched, prepared atomic.Int64
}

func (s *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	s.single.Add(1)
	return ctx
}

func (s *statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (s *statements) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	s.batches.Add(1)
	return ctx
}

func (s *statements) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	s.batched.Add(1)
}

func (s *statements) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (s *statements) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	s.prepared.Add(1)
	return ctx
}

func (s *statements) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

var (
	_ pgx.BatchTracer   = (*statements)(nil)
	_ pgx.PrepareTracer = (*statements)(nil)
)

// BenchmarkPgxRoundTrips/<variant>/<path> counts what one message sends to
// PostgreSQL in the postgres-pgx cases of BenchmarkThroughput, on one
// connection whose statement cache is warm: "round-trips/msg" on the wire
// (turns from writing to reading), and as pgx's tracers see them
// "statements/msg" (sent on their own), "batches/msg", "batched/msg"
// (statements inside batches) and "prepared/msg". path "processed" is b.N
// new messages; "duplicate" is b.N redeliveries of messages already
// processed (the baseline writes them again).
func BenchmarkPgxRoundTrips(b *testing.B) {
	for _, v := range pgxVariants {
		for _, path := range []string{"processed", "duplicate"} {
			b.Run(v.name+"/"+path, func(b *testing.B) {
				s := &statements{}
				p := openPgxPool(b, 1, s)
				h := v.build(b, p)
				handle := func(msgs []*message.Message) {
					for _, msg := range msgs {
						if _, err := h(msg); err != nil {
							b.Fatal(err)
						}
					}
				}
				handle(messages(2, 0)) // prepares the statements on the one connection
				msgs := messages(b.N, 0)
				if path == "duplicate" {
					handle(msgs)
				}
				rt, single, batches, batched, prepared := p.wire.roundTrips.Load(), s.single.Load(), s.batches.Load(), s.batched.Load(), s.prepared.Load()
				b.ResetTimer()
				handle(msgs)
				b.StopTimer()
				n := float64(b.N)
				b.ReportMetric(float64(p.wire.roundTrips.Load()-rt)/n, "round-trips/msg")
				b.ReportMetric(float64(s.single.Load()-single)/n, "statements/msg")
				b.ReportMetric(float64(s.batches.Load()-batches)/n, "batches/msg")
				b.ReportMetric(float64(s.batched.Load()-batched)/n, "batched/msg")
				b.ReportMetric(float64(s.prepared.Load()-prepared)/n, "prepared/msg")
			})
		}
	}
}

// BenchmarkPgxInboxVsBaseline/conc=<n> is BenchmarkThroughput's
// postgres-pgx inbox against its baseline at dup=0, taking turns on the
// same pool (compare: b.N messages per side in compareRounds rounds), with
// two more sides for reference: "bare-claim" (pgxBareClaim: the inbox's
// statements without the middleware, on the same pool) and "sql-inbox"
// (the database/sql inbox over pgx's stdlib driver, its own pool of 16
// connections). It reports each side's msgs/s and p50, and x-baseline,
// bare-claim-x-baseline and sql-inbox-x-baseline: the median over the
// rounds of that side's rate over the baseline's. The turns make the
// ratios stand a load on the machine that comes and goes, which a table of
// separate runs does not.
func BenchmarkPgxInboxVsBaseline(b *testing.B) {
	p := openPgxPool(b, 16, nil)
	db := testdb.OpenPostgres(b, "")
	warm(b, db)
	for _, conc := range []int{1, 8} {
		b.Run(fmt.Sprintf("conc=%d", conc), func(b *testing.B) {
			ib, _ := newInbox(b, db, inbox.PostgreSQL, "bench")
			x := compare(b, conc,
				side{"baseline", pgxBaseline(b, p)},
				side{"inbox", pgxInbox(b, p)},
				side{"bare-claim", pgxBareClaim(b, p)},
				side{"sql-inbox", inboxHandler(ib, insertSQL(db, businessTable(b, db)))})
			b.ReportMetric(x[1], "x-baseline")
			b.ReportMetric(x[2], "bare-claim-x-baseline")
			b.ReportMetric(x[3], "sql-inbox-x-baseline")
		})
	}
}

package bench

import (
	"context"
	"errors"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// ackRecorder is the relay's publisher (kafkaoutbox's) that records when
// the broker acked each message.
type ackRecorder struct {
	message.Publisher
	acked func(uuid string, at time.Time)
}

func (p *ackRecorder) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	now := time.Now()
	for _, m := range msgs {
		p.acked(m.UUID, now)
	}
	return nil
}

// unusedPublisher is the router's publisher of BenchmarkOutboxEndToEnd's
// handler, whose returned messages go to the outbox instead: it refuses
// everything, so that a message that reached it fails the run.
type unusedPublisher struct{}

func (unusedPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the router's publisher got a message that should have gone to the outbox")
}

func (unusedPublisher) Close() error { return nil }

// BenchmarkOutboxEndToEnd/<db>: kfake with 8 partitions → a Watermill
// router → the inbox → a handler that writes one row and, in the "outbox"
// pipeline, returns one message, which the inbox writes to the outbox → the outbox relay
// (inbox.Outbox, woken by the commits) → kafkaoutbox's publisher → a
// kfake topic. The "no-output"
// pipeline is the same whose handler emits nothing. The two take turns,
// e2eRounds rounds of b.N/e2eRounds messages each at full speed (each
// round on a fresh cluster and tables), so that the machine's drift
// reaches both alike. Reports each pipeline's msgs/s (the median of its
// rounds; for "outbox" delivered to the downstream topic, from the first
// message handled to the last relayed), their ratio outbox/no-output,
// outbox-max-rows (largest outbox depth over the rounds, sampled every
// 10 ms) and relay-p99-ms (commit to broker ack, over every round); and
// each pipeline's CPU time per message, this process's (kfake's included)
// and the database server's over all its rounds (cpuClock), with their
// ratio no-output/outbox-cpu, which says where the machine's time went
// when the msgs/s ratio misses.
//
// "postgres-pgx" is the pgx-native inbox (pgxinbox, its outputs through
// pgxinbox.OutboxPublisher) with the relay on the pool's *sqlx.DB.
func BenchmarkOutboxEndToEnd(b *testing.B) {
	dbs := databases()
	for i, tdb := range dbs {
		if tdb.Name == "postgres" {
			pgx := tdb
			pgx.Name = "postgres-pgx"
			dbs = slices.Insert(dbs, i+1, pgx)
			break
		}
	}
	for _, tdb := range dbs {
		if tdb.Name == "postgres-partitioned" {
			continue
		}
		b.Run(tdb.Name, func(b *testing.B) { runOutboxEndToEndRounds(b, tdb) })
	}
}

// e2eRounds is how many turns each pipeline of BenchmarkOutboxEndToEnd
// takes (one when b.N is too small to split).
const e2eRounds = 5

func runOutboxEndToEndRounds(b *testing.B, tdb testdb.DB) {
	rounds := e2eRounds
	if b.N < 100*rounds {
		rounds = 1
	}
	n := b.N / rounds
	var db *sqlx.DB
	var pool *pgxpool.Pool
	if tdb.Name == "postgres-pgx" {
		p := openPgxPool(b, kafkaPartitions+4, nil)
		db, pool = p.db, p.pool
	} else {
		db = tdb.Open(b)
	}
	db.SetMaxOpenConns(kafkaPartitions + 4)
	db.SetMaxIdleConns(kafkaPartitions + 4)
	var plain, emitting []float64
	var plainCPU, emittingCPU time.Duration
	var maxRows int64
	var latencies []time.Duration
	for r := range rounds {
		// Alternate which pipeline goes first.
		for i := range 2 {
			emit := (r+i)%2 == 1
			pipeline := map[bool]string{false: "no-output", true: "outbox"}[emit]
			var res e2eResult
			// Labelled by pipeline, so that a CPU profile of the run tells
			// the two apart (go tool pprof -tagfocus pipeline=outbox).
			pprof.Do(b.Context(), pprof.Labels("pipeline", pipeline), func(context.Context) {
				res = runOutboxEndToEnd(b, tdb, db, pool, n, emit)
			})
			if !emit {
				plain = append(plain, res.rate)
				plainCPU += res.cpu
				continue
			}
			emitting = append(emitting, res.rate)
			emittingCPU += res.cpu
			maxRows = max(maxRows, res.maxRows)
			latencies = append(latencies, res.latencies...)
		}
	}
	median := func(xs []float64) float64 {
		slices.Sort(xs)
		return xs[len(xs)/2]
	}
	b.ReportMetric(median(plain), "no-output-msgs/s")
	b.ReportMetric(median(emitting), "outbox-msgs/s")
	b.ReportMetric(median(emitting)/median(plain), "outbox/no-output")
	b.ReportMetric(float64(maxRows), "outbox-max-rows")
	perMsg := func(cpu time.Duration) float64 { return float64(cpu.Microseconds()) / float64(n*rounds) }
	b.ReportMetric(perMsg(plainCPU), "no-output-cpu-µs/msg")
	b.ReportMetric(perMsg(emittingCPU), "outbox-cpu-µs/msg")
	b.ReportMetric(perMsg(plainCPU)/perMsg(emittingCPU), "no-output/outbox-cpu")
	slices.Sort(latencies)
	if len(latencies) > 0 {
		b.ReportMetric(float64(latencies[len(latencies)*99/100].Microseconds())/1000, "relay-p99-ms")
	}
}

// e2eResult is one round of one pipeline: its msgs/s and, for "outbox",
// the outbox's largest depth and each output's commit-to-ack latency.
type e2eResult struct {
	rate      float64
	cpu       time.Duration // this process's and the database server's, from the router's start to the last message
	maxRows   int64
	latencies []time.Duration
}

// e2eInbox is the inbox of BenchmarkOutboxEndToEnd on one backend: its
// middleware, and the handler's insert of its business row through the
// message's inbox transaction.
type e2eInbox struct {
	middleware message.HandlerMiddleware
	insert     func(msg *message.Message) error
}

// newE2EInbox returns the inbox of tdb (database/sql, or pgxinbox for
// "postgres-pgx") on db, writing its outputs to ob when emit.
func newE2EInbox(b *testing.B, tdb testdb.DB, db *sqlx.DB, pool *pgxpool.Pool, ob *inbox.Outbox, emit bool) e2eInbox {
	query := insertSQL(db, businessTable(b, db))
	if pool != nil {
		cfg := pgxinbox.Config{Pool: pool, Table: "bench_inbox_" + testdb.RandomSuffix()}
		testdb.DropLater(b, db, cfg.Table)
		if emit {
			cfg.Outbox = pgxinbox.OutboxPublisher(ob)
		}
		ib, err := pgxinbox.New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { ib.Close() })
		if err := ib.InitializeSchema(context.Background()); err != nil {
			b.Fatal(err)
		}
		return e2eInbox{middleware: ib.Middleware, insert: func(msg *message.Message) error {
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), query, msg.UUID, 100)
			return err
		}}
	}
	cfg := inbox.Config{DB: db, Dialect: tdb.Dialect}
	if emit {
		cfg.Outbox = ob.Publisher
	}
	ib, _ := newInboxWith(b, cfg)
	return e2eInbox{middleware: ib.Middleware, insert: func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), query, msg.UUID, 100)
		return err
	}}
}

// runOutboxEndToEnd runs one pipeline (emit: "outbox") over n messages.
// On db (and pool, for "postgres-pgx"): the benchmark's, shared by the
// rounds.
func runOutboxEndToEnd(b *testing.B, tdb testdb.DB, db *sqlx.DB, pool *pgxpool.Pool, n int, emit bool) e2eResult {

	topic, downstream := "orders_"+testdb.RandomSuffix(), "invoices_"+testdb.RandomSuffix()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(kafkaPartitions, topic, downstream))
	if err != nil {
		b.Fatal(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	logger := watermill.NopLogger{}
	produce(b, brokers, topic, n)

	// Commit and ack times per output, for relay-p99-ms.
	var mu sync.Mutex
	committed := make(map[string]time.Time, n)
	var latencies []time.Duration
	var relayed, handled atomic.Int64
	var first, last atomic.Int64
	done := make(chan struct{})
	var once sync.Once
	finish := func(got int64) {
		if got == int64(n) {
			last.Store(time.Now().UnixNano())
			once.Do(func() { close(done) })
		}
	}

	pcfg := kafkaoutbox.DefaultSaramaConfig()
	pcfg.Version = sarama.V2_8_0_0
	pub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}, OverwriteSaramaConfig: pcfg}, logger)
	if err != nil {
		b.Fatal(err)
	}
	broker := &ackRecorder{Publisher: pub, acked: func(uuid string, at time.Time) {
		mu.Lock()
		if c, ok := committed[uuid]; ok {
			latencies = append(latencies, at.Sub(c))
		}
		mu.Unlock()
		finish(relayed.Add(1))
	}}
	defer broker.Close()

	ob := newBenchOutbox(b, db, tdb.Dialect, broker)
	ib := newE2EInbox(b, tdb, db, pool, ob, emit)

	saramaCfg := kafka.DefaultSaramaSubscriberConfig()
	saramaCfg.Version = sarama.V2_8_0_0
	saramaCfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	saramaCfg.Consumer.MaxWaitTime = 10 * time.Millisecond
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{}, OverwriteSaramaConfig: saramaCfg, ConsumerGroup: "billing",
	}, logger)
	if err != nil {
		b.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		b.Fatal(err)
	}
	if emit {
		router.AddPlugin(ob.RouterPlugin)
	}
	router.AddMiddleware(ib.middleware)
	// The handler returns its output, as Watermill handlers do; the inbox
	// writes it to the outbox in the message's transaction (the router's
	// publisher is not used).
	router.AddHandler("billing", topic, sub, downstream, unusedPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
		first.CompareAndSwap(0, time.Now().UnixNano())
		if err := ib.insert(msg); err != nil {
			return nil, err
		}
		if emit {
			out := message.NewMessage(msg.UUID+"-invoice", msg.Payload)
			inbox.AfterCommit(msg.Context(), func() {
				mu.Lock()
				committed[out.UUID] = time.Now()
				mu.Unlock()
			})
			return []*message.Message{out}, nil
		}
		inbox.AfterCommit(msg.Context(), func() { finish(handled.Add(1)) })
		return nil, nil
	})

	maxRows := sampleOutboxDepth(ob)
	clock := serverFor(tdb.Name)
	process, server := clock.now()
	go func() { _ = router.Run(context.Background()) }()
	select {
	case <-done:
	case <-time.After(10 * time.Minute):
		b.Fatalf("handled %d, relayed %d of %d messages in 10 minutes", handled.Load(), relayed.Load(), n)
	}
	process2, server2 := clock.now()
	deepest := maxRows()
	router.Close()
	res := e2eResult{cpu: process2 - process + server2 - server}
	if elapsed := time.Duration(last.Load() - first.Load()); n > 1 && elapsed > 0 {
		res.rate = float64(n-1) / elapsed.Seconds()
	}
	if emit {
		res.maxRows = deepest
		mu.Lock()
		res.latencies = latencies
		mu.Unlock()
	}
	return res
}

// sampleOutboxDepth samples ob's depth every 10 ms until the returned
// function is called, which returns the largest depth seen.
func sampleOutboxDepth(ob *inbox.Outbox) func() int64 {
	var maxRows atomic.Int64
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if s, err := ob.Stats(context.Background()); err == nil && s.Pending > maxRows.Load() {
					maxRows.Store(s.Pending)
				}
			}
		}
	}()
	return func() int64 {
		close(stop)
		<-stopped
		return maxRows.Load()
	}
}

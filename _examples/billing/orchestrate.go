package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
)

func orchestrate() error {
	ctx := context.Background()
	run := fmt.Sprintf("%d", time.Now().UnixNano()%1_000_000_000)
	os.Setenv("BILLING_RUN", run)
	if err := checkInbox(*dsn, *inboxImpl); err != nil { // before starting anything
		return err
	}

	if *brokers == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, ordersTopic, invoicesTopic))
		if err != nil {
			return err
		}
		defer cluster.Close()
		*brokers = strings.Join(cluster.ListenAddrs(), ",")
		fmt.Printf("kafka: in-process kfake broker at %s (topics with %d partitions)\n", *brokers, partitions)
	}
	if *dsn == "" {
		dir, err := os.MkdirTemp("", "billing")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		*dsn = "sqlite:" + filepath.Join(dir, "billing.db")
		fmt.Printf("database: SQLite at %s\n", strings.TrimPrefix(*dsn, "sqlite:"))
	}
	d, err := openDB(ctx, *dsn, *inboxImpl)
	if err != nil {
		return err
	}
	defer d.Close()
	fmt.Printf("inbox: %s; outbox: watermill-sql v4 queue schema, delete on ack\n", *inboxImpl)
	if err := tables(d, run); err != nil {
		return err
	}
	// The table is the same for both inboxes (pgxinbox's is package inbox's).
	ib, err := inbox.New(inbox.Config{DB: d.db, Dialect: d.dialect, Table: "inbox_" + run})
	if err != nil {
		return err
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		return err
	}
	defer dropTables(d, run)

	// The forwarder: outbox table -> Kafka. Its subscriber creates the
	// outbox table (watermill-sql cannot on a transaction). No consumer
	// group: queue schemas have none, the forwarder is their one reader.
	logger := watermill.NopLogger{}
	outboxSub, err := wsql.NewSubscriber(d.beginner(), wsql.SubscriberConfig{
		SchemaAdapter: d.subscribe, OffsetsAdapter: d.offsets, InitializeSchema: true,
		PollInterval: 20 * time.Millisecond,
	}, logger)
	if err != nil {
		return err
	}
	if err := outboxSub.SubscribeInitialize(outboxTopic + "_" + run); err != nil {
		return err
	}
	kafkaPub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: strings.Split(*brokers, ","), Marshaler: kafka.NewWithPartitioningMarshaler(orderKey),
		OverwriteSaramaConfig: publisherConfig(),
	}, logger)
	if err != nil {
		return err
	}
	defer kafkaPub.Close()
	fwd, err := forwarder.NewForwarder(outboxSub, kafkaPub, logger, forwarder.Config{ForwarderTopic: outboxTopic + "_" + run})
	if err != nil {
		return err
	}
	go fwd.Run(ctx)
	defer fwd.Close()

	// Orders: N events, 5 % published twice (a relay retry): same UUID.
	published := 0
	for i := 1; i <= *orders; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
		msg.Metadata.Set("order_id", fmt.Sprintf("order-%05d", i))
		copies := 1
		if rand.Float64() < *resend {
			copies = 2
		}
		for range copies {
			if err := kafkaPub.Publish(ordersTopic, msg.Copy()); err != nil {
				return err
			}
			published++
		}
	}
	fmt.Printf("orders: %d published as %d events (%d producer re-sends)\n", *orders, published, published-*orders)

	s := &stats{d: d, run: run}
	mailer := start("mailer", "mailer-1", 0)
	defer mailer.stop()
	// billing-1 runs alone until its SIGKILL, so that it owns every
	// partition and surely reaches its kill-after commit (with a second
	// member from the start, the partitions it got could hold fewer
	// orders, and it would never die).
	fmt.Println("billing-1: starts alone, will be SIGKILLed after a commit and before its ack")
	b1 := start("billing", "billing-1", max(1, *orders/4))
	if !b1.waitFor(3 * time.Minute) {
		b1.stop()
		return fmt.Errorf("billing-1 did not reach its SIGKILL within 3 minutes")
	}
	b2 := start("billing", "billing-2", 0)
	defer b2.stop()
	s.progress("billing-1 died; billing-2 joins and gets its partitions once billing-1's session times out")

	fmt.Println("billing-3: joins the group (rebalance)")
	b3 := start("billing", "billing-3", 0)
	s.waitFor(func(c counts) bool { return c.invoices >= *orders/2 }, 2*time.Minute)
	b3.stop()
	s.progress("billing-3 left the group (rebalance)")

	if !s.waitFor(func(c counts) bool { return c.invoices == *orders && c.emails == *orders }, 5*time.Minute) {
		return fmt.Errorf("timed out before every order was invoiced and mailed")
	}
	before := s.read()
	fmt.Println("rewind: stop billing, delete the group's offsets, replay the topic from the start")
	b2.stop()
	if err := deleteGroup(*brokers, "billing_"+run); err != nil {
		return err
	}
	b4 := start("billing", "billing-4", 0)
	defer b4.stop()
	if !s.waitFor(func(c counts) bool { return c.billingDeliveries >= before.billingDeliveries+published }, 5*time.Minute) {
		return fmt.Errorf("timed out replaying the topic")
	}
	time.Sleep(2 * time.Second) // let the mailer see anything the replay could (wrongly) have emitted
	c := s.read()
	fmt.Printf("billing: deliveries=%d processed=%d duplicates_skipped=%d\n", c.billingDeliveries, c.billingProcessed, c.billingDuplicates)
	fmt.Printf("mailer:  deliveries=%d processed=%d duplicates_skipped=%d\n", c.mailerDeliveries, c.mailerProcessed, c.mailerDuplicates)
	fmt.Printf("effectively-once: orders=%d invoices=%d emails=%d deliveries=%d duplicates_skipped=%d\n",
		*orders, c.invoices, c.emails, c.billingDeliveries, c.billingDuplicates)
	if c.invoices != *orders || c.emails != *orders {
		return fmt.Errorf("invoices or emails differ from orders")
	}

	// The bound: 0 rows. By now every invoice transaction has committed
	// (invoices == orders, and the replay only met duplicates, which write
	// no outbox row) and every invoice event reached the mailer, so nothing
	// is left to forward and nothing is in flight. The forwarder deletes a
	// row in its subscriber's transaction after Kafka acked the publish, a
	// moment after the mailer may already have seen the event: wait for the
	// last delete, then demand an empty table. A default (append-only)
	// schema would hold one row per invoice here.
	rows := -1
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if rows, err = s.outboxRows(); err != nil {
			return err
		}
		if rows == 0 || time.Now().After(deadline) {
			break
		}
	}
	fmt.Printf("outbox_rows=%d (most seen while running: %d)\n", rows, s.maxOutbox)
	if rows != 0 {
		return fmt.Errorf("the outbox holds %d rows after everything was forwarded: not bounded", rows)
	}
	return nil
}

func orderKey(_ string, msg *message.Message) (string, error) {
	return msg.Metadata.Get("order_id"), nil
}

func publisherConfig() *sarama.Config {
	c := kafka.DefaultSaramaSyncPublisherConfig()
	c.Version = sarama.V2_8_0_0
	return c
}

func deleteGroup(brokers, group string) error {
	admin, err := sarama.NewClusterAdmin(strings.Split(brokers, ","), saramaConfig())
	if err != nil {
		return err
	}
	defer admin.Close()
	deadline := time.Now().Add(time.Minute)
	for { // the group must be empty: wait for the stopped member to leave
		if err = admin.DeleteConsumerGroup(group); err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// worker is a child process of this program.
type worker struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func start(role, name string, killAfter int) *worker {
	cmd := exec.Command(os.Args[0], "-role", role, "-instance", name, "-brokers", *brokers, "-db", *dsn,
		"-kill-after", fmt.Sprint(killAfter), "-inbox", *inboxImpl)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	w := &worker{name: name, cmd: cmd, done: make(chan struct{})}
	if err := cmd.Start(); err != nil {
		panic(err)
	}
	go func() { cmd.Wait(); close(w.done) }()
	return w
}

// waitFor waits for the worker to exit, at most d; it reports whether it did.
func (w *worker) waitFor(d time.Duration) bool {
	select {
	case <-w.done:
		return true
	case <-time.After(d):
		return false
	}
}

func (w *worker) stop() {
	select {
	case <-w.done:
		return
	default:
	}
	w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
	case <-time.After(30 * time.Second):
		w.cmd.Process.Kill()
		<-w.done
	}
}

type counts struct {
	invoices, emails                                       int
	billingDeliveries, billingProcessed, billingDuplicates int
	mailerDeliveries, mailerProcessed, mailerDuplicates    int
}

type stats struct {
	d         *database
	run       string
	maxOutbox int // the most outbox rows a progress line saw
}

// outboxRows counts the rows of the run's outbox table.
func (s *stats) outboxRows() (int, error) {
	var n int
	err := s.d.db.Get(&n, "SELECT COUNT(*) FROM "+s.d.outboxTable(s.run))
	return n, err
}

func (s *stats) read() counts {
	var c counts
	s.d.db.Get(&c.invoices, "SELECT COUNT(*) FROM invoices_"+s.run)
	s.d.db.Get(&c.emails, "SELECT COUNT(*) FROM emails_sent_"+s.run)
	rows, err := s.d.db.Query("SELECT consumer, outcome, COUNT(*) FROM deliveries_" + s.run + " GROUP BY consumer, outcome")
	if err != nil {
		return c
	}
	defer rows.Close()
	for rows.Next() {
		var consumer, outcome string
		var n int
		rows.Scan(&consumer, &outcome, &n)
		switch consumer + "/" + outcome {
		case "billing/processed":
			c.billingProcessed = n
		case "billing/duplicate":
			c.billingDuplicates = n
		case "mailer/processed":
			c.mailerProcessed = n
		case "mailer/duplicate":
			c.mailerDuplicates = n
		}
	}
	c.billingDeliveries = c.billingProcessed + c.billingDuplicates
	c.mailerDeliveries = c.mailerProcessed + c.mailerDuplicates
	return c
}

func (s *stats) progress(event string) {
	c := s.read()
	rows, err := s.outboxRows()
	if err != nil {
		rows = -1
	}
	s.maxOutbox = max(s.maxOutbox, rows)
	fmt.Printf("  %-60s invoices=%d emails=%d billing deliveries=%d (dup %d) mailer deliveries=%d (dup %d) outbox_rows=%d\n",
		event, c.invoices, c.emails, c.billingDeliveries, c.billingDuplicates, c.mailerDeliveries, c.mailerDuplicates, rows)
}

// waitFor prints progress every 2 s until cond holds or timeout passes.
func (s *stats) waitFor(cond func(counts) bool, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond(s.read()) {
			return true
		}
		if time.Now().After(deadline) {
			s.progress("timed out")
			return false
		}
		s.progress("progress")
		time.Sleep(2 * time.Second)
	}
}

func dropTables(d *database, run string) {
	for _, t := range []string{"invoices_", "emails_sent_", "deliveries_", "inbox_"} {
		d.db.Exec("DROP TABLE IF EXISTS " + t + run)
	}
	d.db.Exec("DROP TABLE IF EXISTS " + d.outboxTable(run)) // queue schemas have no offsets table
}

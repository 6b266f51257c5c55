package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
)

// orchestrate runs the whole demonstration: it starts a broker and a
// database unless given, publishes the orders, runs the workers through a
// SIGKILL, a rebalance and a replay, and checks that every order got
// exactly one invoice and one email.
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
	fmt.Printf("inbox: %s; outbox: inbox.Outbox, its relay in each Billing worker\n", *inboxImpl)
	if err := createTables(ctx, d, run); err != nil {
		return err
	}
	defer dropTables(d, run)

	logger := watermill.NopLogger{}
	kafkaPub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: strings.Split(*brokers, ","), Marshaler: kafka.NewWithPartitioningMarshaler(orderKey),
		OverwriteSaramaConfig: publisherConfig(),
	}, logger)
	if err != nil {
		return err
	}
	defer kafkaPub.Close()
	// The outbox the Billing workers write and relay; here it only creates
	// the tables and reads Stats (its relay does not run in this process).
	ob, err := d.newOutbox(run, kafkaPub, logger)
	if err != nil {
		return err
	}
	if err := ob.InitializeSchema(ctx); err != nil {
		return err
	}

	published, err := publishOrders(kafkaPub)
	if err != nil {
		return err
	}
	s := &stats{d: d, ob: ob, run: run}
	var workers crew
	defer workers.stop() // the last ones run until the checks are done
	if err := runWorkers(s, &workers, run, published); err != nil {
		return err
	}
	return checkEffectivelyOnce(ctx, s)
}

// createTables creates the business tables and the inbox table of run.
func createTables(ctx context.Context, d *database, run string) error {
	if err := tables(d, run); err != nil {
		return err
	}
	// The table is the same for both inboxes (pgxinbox's is package inbox's).
	ib, err := inbox.New(inbox.Config{DB: d.db, Dialect: d.dialect, Table: "inbox_" + run})
	if err != nil {
		return err
	}
	return ib.InitializeSchema(ctx)
}

// publishOrders publishes the orders, a share of them twice (a producer
// retry: the same UUID), and returns how many events it published.
func publishOrders(pub message.Publisher) (int, error) {
	published := 0
	for i := 1; i <= *orders; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
		msg.Metadata.Set("order_id", fmt.Sprintf("order-%05d", i))
		copies := 1
		if rand.Float64() < *resend {
			copies = 2
		}
		for range copies {
			if err := pub.Publish(ordersTopic, msg.Copy()); err != nil {
				return published, err
			}
			published++
		}
	}
	fmt.Printf("orders: %d published as %d events (%d producer re-sends)\n", *orders, published, published-*orders)
	return published, nil
}

// runWorkers starts the mailer and the Billing workers: billing-1 is
// SIGKILLed, billing-3 joins and leaves (two rebalances), then the topic
// is replayed from the start to billing-4. It returns once billing-4 has
// had all published events again; the mailer and billing-4 keep running,
// in workers.
func runWorkers(s *stats, workers *crew, run string, published int) error {
	workers.start("mailer", "mailer-1", 0)
	// billing-1 runs alone until its SIGKILL, so that it owns every
	// partition and surely reaches its kill-after commit (with a second
	// member from the start, the partitions it got could hold fewer
	// orders, and it would never die).
	fmt.Println("billing-1: starts alone, will be SIGKILLed after a commit before its ack, and after a relay publish before its delete")
	b1 := workers.start("billing", "billing-1", max(1, *orders/4))
	if !b1.waitFor(3 * time.Minute) {
		b1.stop()
		return fmt.Errorf("billing-1 did not reach its SIGKILL within 3 minutes")
	}
	b2 := workers.start("billing", "billing-2", 0)
	s.progress("billing-1 died; billing-2 joins and gets its partitions once billing-1's session times out")

	fmt.Println("billing-3: joins the group (rebalance)")
	// SQLite has no row locks: one relay per database, so billing-3, which
	// overlaps billing-2, runs none there.
	b3 := workers.start("billing", "billing-3", 0, "-relay="+fmt.Sprint(s.d.dialect != inbox.SQLite))
	s.waitFor(func(c counts) bool { return c.invoices >= *orders/2 }, 2*time.Minute)
	b3.stop()
	s.progress("billing-3 left the group (rebalance)")

	if !s.waitFor(func(c counts) bool { return c.invoiceOrders == *orders && c.emailOrders == *orders }, 5*time.Minute) {
		return fmt.Errorf("timed out before every order was invoiced and mailed")
	}
	before := s.read()
	fmt.Println("rewind: stop billing, delete the group's offsets, replay the topic from the start")
	b2.stop()
	if err := deleteGroup(*brokers, "billing_"+run); err != nil {
		return err
	}
	workers.start("billing", "billing-4", 0)
	if !s.waitFor(func(c counts) bool { return c.billingDeliveries >= before.billingDeliveries+published }, 5*time.Minute) {
		return fmt.Errorf("timed out replaying the topic")
	}
	return nil
}

// checkEffectivelyOnce waits until the mailer has had every invoice event
// Kafka holds and the outbox is empty, prints the counts, and reports every
// order without exactly one invoice and one email, an invoice event the
// mailer's inbox did not skip when it came again, and a run in which no
// event was relayed twice (the relay crash it shows did not happen).
func checkEffectivelyOnce(ctx context.Context, s *stats) error {
	// Every invoice event Kafka holds, counted by message UUID: the relay
	// sent a batch again after billing-1's SIGKILL.
	inKafka, records, err := countByUUID(*brokers, invoicesTopic)
	if err != nil {
		return err
	}
	// Wait until the mailer has had every record delivered (its inbox
	// records each delivery, processed or skipped), and the relay has
	// deleted the last rows: by now every invoice transaction has committed
	// (invoices == orders, and the replay only met duplicates, which write
	// no outbox row).
	if !s.waitFor(func(c counts) bool { return c.mailerDeliveries >= records && c.outboxPending == 0 }, time.Minute) {
		return fmt.Errorf("timed out waiting for the mailer to receive the %d invoice events in Kafka and the outbox to empty", records)
	}
	c := s.read()
	fmt.Printf("billing: deliveries=%d processed=%d duplicates_skipped=%d\n", c.billingDeliveries, c.billingProcessed, c.billingDuplicates)
	if c.billingProcessed < c.invoices {
		// The workers record an outcome after the commit; the one killed
		// there committed its order and recorded nothing, and the
		// redelivery of that order was a duplicate.
		fmt.Printf("  (processed counts the outcomes the workers recorded: %d invoice(s) committed by the worker SIGKILLed before it recorded)\n",
			c.invoices-c.billingProcessed)
	}
	fmt.Printf("mailer:  deliveries=%d processed=%d duplicates_skipped=%d\n", c.mailerDeliveries, c.mailerProcessed, c.mailerDuplicates)
	seen, err := s.mailerOutcomes()
	if err != nil {
		return err
	}
	relayedTwice, skipped, errs := checkRepeatsSkipped(inKafka, seen)
	secondEffects := (c.invoices - c.invoiceOrders) + (c.emails - c.emailOrders)
	fmt.Printf("outputs relayed twice: %d (Kafka holds %d invoice events for %d invoices), skipped by the mailer's inbox: %d, second effects: %d\n",
		relayedTwice, records, len(inKafka), skipped, secondEffects)
	fmt.Printf("effectively-once: orders=%d invoices=%d emails=%d deliveries=%d duplicates_skipped=%d\n",
		*orders, c.invoices, c.emails, c.billingDeliveries, c.billingDuplicates)
	st, err := s.ob.Stats(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("outbox: pending=%d dead_lettered=%d (most pending seen while running: %d)\n", st.Pending, st.DeadLettered, s.maxOutbox)

	if c.invoices != *orders || c.emails != *orders || len(inKafka) != *orders {
		errs = append(errs, fmt.Errorf("invoices (%d), emails (%d) or distinct invoice events in Kafka (%d) differ from orders (%d)",
			c.invoices, c.emails, len(inKafka), *orders))
	}
	if secondEffects != 0 {
		errs = append(errs, fmt.Errorf("%d orders got a second invoice or email", secondEffects))
	}
	if relayedTwice == 0 {
		errs = append(errs, errors.New("no invoice event was relayed twice: the injected relay crash did not happen"))
	}
	if st.Pending != 0 || st.DeadLettered != 0 {
		errs = append(errs, fmt.Errorf("the outbox holds %d rows and %d dead letters after everything was relayed", st.Pending, st.DeadLettered))
	}
	return errors.Join(errs...)
}

// checkRepeatsSkipped compares the invoice events Kafka holds more than once
// (inKafka, counts by UUID) with what the mailer's inbox did with them
// (seen): each must have been processed once and skipped every other time.
// It returns how many were relayed twice, how many of those were skipped as
// they must be, and an error for each that was not.
func checkRepeatsSkipped(inKafka map[string]int, seen map[string]outcomes) (relayedTwice, skipped int, errs []error) {
	for uuid, n := range inKafka {
		if n < 2 {
			continue
		}
		relayedTwice++
		o := seen[uuid]
		if o.processed != 1 || o.duplicates < n-1 {
			errs = append(errs, fmt.Errorf("invoice event %s: in Kafka %d times, processed by the mailer %d times, skipped %d times; want once, and every repeat skipped",
				uuid, n, o.processed, o.duplicates))
			continue
		}
		skipped++
	}
	return relayedTwice, skipped, errs
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

// countByUUID reads every record of topic and counts them by Watermill
// message UUID; it returns the counts and the number of records.
func countByUUID(brokers, topic string) (map[string]int, int, error) {
	client, err := sarama.NewClient(strings.Split(brokers, ","), saramaConfig())
	if err != nil {
		return nil, 0, err
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, 0, err
	}
	defer consumer.Close()
	partitions, err := client.Partitions(topic)
	if err != nil {
		return nil, 0, err
	}
	counts, records := map[string]int{}, 0
	for _, p := range partitions {
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, 0, err
		}
		next, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, 0, err
		}
		if oldest >= next {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, oldest)
		if err != nil {
			return nil, 0, err
		}
		for done := false; !done; {
			select {
			case m := <-pc.Messages():
				for _, h := range m.Headers {
					if string(h.Key) == kafka.UUIDHeaderKey {
						counts[string(h.Value)]++
					}
				}
				records++
				done = m.Offset >= next-1
			case <-time.After(30 * time.Second):
				pc.Close()
				return nil, 0, fmt.Errorf("reading %s partition %d: nothing for 30 s before offset %d", topic, p, next)
			}
		}
		pc.Close()
	}
	return counts, records, nil
}

// crew is the workers started so far, stopped together.
type crew []*worker

// start starts a worker (see start) and keeps it in c.
func (c *crew) start(role, name string, killAfter int, args ...string) *worker {
	w := start(role, name, killAfter, args...)
	*c = append(*c, w)
	return w
}

// stop stops every worker still running, the last started first. Its
// pointer receiver lets a deferred call see the workers started after the
// defer.
func (c *crew) stop() {
	for _, w := range slices.Backward(*c) {
		w.stop()
	}
}

// worker is a child process of this program.
type worker struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func start(role, name string, killAfter int, args ...string) *worker {
	cmd := exec.Command(os.Args[0], append([]string{"-role", role, "-instance", name, "-brokers", *brokers, "-db", *dsn,
		"-kill-after", fmt.Sprint(killAfter), "-inbox", *inboxImpl}, args...)...)
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
	invoiceOrders, emailOrders                             int // distinct order ids
	billingDeliveries, billingProcessed, billingDuplicates int
	mailerDeliveries, mailerProcessed, mailerDuplicates    int
	outboxPending                                          int
}

type stats struct {
	d         *database
	ob        *inbox.Outbox
	run       string
	maxOutbox int // the most outbox rows a progress line saw
}

func (s *stats) read() counts {
	c := counts{outboxPending: -1}
	s.d.db.Get(&c.invoices, "SELECT COUNT(*) FROM invoices_"+s.run)
	s.d.db.Get(&c.invoiceOrders, "SELECT COUNT(DISTINCT order_id) FROM invoices_"+s.run)
	s.d.db.Get(&c.emails, "SELECT COUNT(*) FROM emails_sent_"+s.run)
	s.d.db.Get(&c.emailOrders, "SELECT COUNT(DISTINCT order_id) FROM emails_sent_"+s.run)
	if st, err := s.ob.Stats(context.Background()); err == nil {
		c.outboxPending = int(st.Pending)
	}
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

// outcomes is what the mailer's inbox did with one invoice event.
type outcomes struct{ processed, duplicates int }

// mailerOutcomes reads the mailer's deliveries by message UUID.
func (s *stats) mailerOutcomes() (map[string]outcomes, error) {
	rows, err := s.d.db.Query("SELECT message_id, outcome, COUNT(*) FROM deliveries_" + s.run + " WHERE consumer = 'mailer' GROUP BY message_id, outcome")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]outcomes{}
	for rows.Next() {
		var id, outcome string
		var n int
		if err := rows.Scan(&id, &outcome, &n); err != nil {
			return nil, err
		}
		o := m[id]
		if outcome == "processed" {
			o.processed += n
		} else {
			o.duplicates += n
		}
		m[id] = o
	}
	return m, rows.Err()
}

func (s *stats) progress(event string) {
	c := s.read()
	s.maxOutbox = max(s.maxOutbox, c.outboxPending)
	fmt.Printf("  %-60s invoices=%d emails=%d billing deliveries=%d (dup %d) mailer deliveries=%d (dup %d) outbox pending=%d\n",
		event, c.invoices, c.emails, c.billingDeliveries, c.billingDuplicates, c.mailerDeliveries, c.mailerDuplicates, c.outboxPending)
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
	for _, t := range []string{"invoices_" + run, "emails_sent_" + run, "deliveries_" + run, "inbox_" + run, "outbox_" + run, "outbox_" + run + "_dead"} {
		d.db.Exec("DROP TABLE IF EXISTS " + t)
	}
}

package metrics_test

// The outbox's series: what the relay did, counted from its rounds, and the
// outbox's state, read at scrape time without letting a stalled database
// hold the scrape.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
)

// Four handlers' messages reach the outbox through a real router (a fifth
// handler fails and writes nothing); the broker keeps refusing the first.
// Before the relay runs, a scrape shows 4 pending messages, a positive age
// of the oldest and no dead letter, with every relay counter at 0. The
// relay (MaxAttempts 2) then refuses it twice, sets it aside once the
// second is accepted, and sends the other three: the scrape shows 3
// relayed, 2 refused publishes, 1 dead-lettered, 2 failed rounds, 3 rounds
// timed, an empty outbox and 1 dead letter.
func TestOutboxMetricsCountWhatTheRelayDid(t *testing.T) {
	for _, tdb := range outboxDBs() {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			broker := &refusingBroker{refuse: map[string]bool{}}
			ob := newOutbox(t, db, tdb.Dialect, m.InstrumentOutbox(inbox.OutboxConfig{
				Table: "outbox_" + testdb.RandomSuffix(), Publisher: broker, MaxAttempts: 2}))
			table := ob.Table()
			if err := m.WatchOutbox(ob); err != nil {
				t.Fatal(err)
			}
			var already prometheus.AlreadyRegisteredError
			if err := m.WatchOutbox(ob); !errors.As(err, &already) || !strings.Contains(err.Error(), "UnwatchOutbox") {
				t.Errorf("WatchOutbox of the same table twice: %v, want AlreadyRegisteredError that names UnwatchOutbox", err)
			}
			inboxTable := "inbox_" + testdb.RandomSuffix()
			testdb.DropLater(t, db, inboxTable)
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: tdb.Dialect, Table: inboxTable, Outbox: ob.Publisher})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}

			deliver := runInvoicing(t, ib, broker)
			var want []string
			for i := range 4 {
				in := message.NewMessage(watermill.NewUUID(), nil)
				if i == 0 {
					broker.refuse[in.UUID+"-invoice"] = true // before the relay runs
				} else {
					want = append(want, in.UUID+"-invoice")
				}
				if !deliver(in) {
					t.Fatalf("delivery %d nacked", i)
				}
			}
			failing := message.NewMessage(watermill.NewUUID(), []byte("fail"))
			if deliver(failing) {
				t.Fatal("a failing handler's message was acked")
			}

			if n, ok := scraped(t, reg, "inbox_outbox_pending_messages", table); !ok || n != 4 {
				t.Errorf("pending before the relay: %v (present %v), want 4", n, ok)
			}
			if age, ok := scraped(t, reg, "inbox_outbox_oldest_pending_age_seconds", table); !ok || age <= 0 || age > 120 {
				t.Errorf("oldest pending age before the relay: %v s (present %v), want a fresh message's (> 0, < 2 min)", age, ok)
			}
			for _, name := range []string{"inbox_outbox_messages_relayed_total", "inbox_outbox_publish_failures_total",
				"inbox_outbox_messages_dead_lettered_total", "inbox_outbox_relay_errors_total", "inbox_outbox_dead_letters"} {
				if n, ok := scraped(t, reg, name, table); !ok || n != 0 {
					t.Errorf("%s before the relay: %v (present %v), want 0", name, n, ok)
				}
			}

			rounds := relayUntilEmpty(t, ob)
			if got := broker.sent(); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("the broker accepted %v, want %v", got, want)
			}
			if rounds != 3 {
				t.Fatalf("the relay reported %d rounds, want 3 (refused; refused and set aside; the rest)", rounds)
			}

			expected := strings.ReplaceAll(`
# HELP inbox_outbox_dead_letters Messages in the outbox's dead-letter table, read at scrape time.
# TYPE inbox_outbox_dead_letters gauge
inbox_outbox_dead_letters{table="TABLE"} 1
# HELP inbox_outbox_messages_dead_lettered_total Outbox messages set aside in the dead-letter table after their last attempt.
# TYPE inbox_outbox_messages_dead_lettered_total counter
inbox_outbox_messages_dead_lettered_total{table="TABLE"} 1
# HELP inbox_outbox_messages_relayed_total Outbox messages the broker accepted and whose rows the relay deleted.
# TYPE inbox_outbox_messages_relayed_total counter
inbox_outbox_messages_relayed_total{table="TABLE"} 3
# HELP inbox_outbox_oldest_pending_age_seconds Age of the oldest outbox message not yet relayed, by the database clock, read at scrape time; 0 when none is pending.
# TYPE inbox_outbox_oldest_pending_age_seconds gauge
inbox_outbox_oldest_pending_age_seconds{table="TABLE"} 0
# HELP inbox_outbox_pending_messages Outbox messages not yet relayed (the outbox's depth), read at scrape time.
# TYPE inbox_outbox_pending_messages gauge
inbox_outbox_pending_messages{table="TABLE"} 0
# HELP inbox_outbox_publish_failures_total Outbox messages the broker refused, each counted once per relay round that tried it (refusals as the broker's state, which use none of OutboxConfig.MaxAttempts, included).
# TYPE inbox_outbox_publish_failures_total counter
inbox_outbox_publish_failures_total{table="TABLE"} 2
# HELP inbox_outbox_relay_errors_total Outbox relay rounds that failed: the broker refused a message, or a database statement failed.
# TYPE inbox_outbox_relay_errors_total counter
inbox_outbox_relay_errors_total{table="TABLE"} 2
# HELP inbox_outbox_stats_errors_total Scrape-time reads of the outbox's stats that failed or did not answer within the timeout; the outbox gauges are absent from those scrapes.
# TYPE inbox_outbox_stats_errors_total counter
inbox_outbox_stats_errors_total{table="TABLE"} 0
`, "TABLE", table)
			if err := testutil.GatherAndCompare(reg, strings.NewReader(expected),
				"inbox_outbox_dead_letters", "inbox_outbox_messages_dead_lettered_total", "inbox_outbox_messages_relayed_total",
				"inbox_outbox_oldest_pending_age_seconds", "inbox_outbox_pending_messages", "inbox_outbox_publish_failures_total",
				"inbox_outbox_relay_errors_total", "inbox_outbox_stats_errors_total"); err != nil {
				t.Error(err)
			}
			if n, ok := scraped(t, reg, "inbox_outbox_relay_round_seconds", table); !ok || n != 3 {
				t.Errorf("relay rounds timed: %v (present %v), want 3", n, ok)
			}
		})
	}
}

// A database that does not answer (PostgreSQL and MariaDB: the outbox table
// locked by another session; SQLite: its only connection taken) does not
// hold a scrape: the scrape returns without error, with every other series,
// without the outbox gauges and with inbox_outbox_stats_errors_total at 1.
// Once the database answers again, the gauges are back.
func TestOutboxGaugesDoNotHoldAScrapeWhileTheDatabaseStalls(t *testing.T) {
	for _, tdb := range outboxDBs() {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			ob := newOutbox(t, db, tdb.Dialect, m.InstrumentOutbox(inbox.OutboxConfig{
				Table: "outbox_" + testdb.RandomSuffix(), Publisher: &refusingBroker{}}))
			table := ob.Table()
			if err := m.WatchOutbox(ob); err != nil {
				t.Fatal(err)
			}
			writeOutbox(t, db, ob, 2)

			release := stall(t, tdb.Name, db, table)
			type scrape struct {
				pending, errs     float64
				hasPending, hasRe bool
				err               error
			}
			done := make(chan scrape, 1)
			go func() {
				mfs, err := reg.Gather()
				var s scrape
				s.err = err
				s.pending, s.hasPending = seriesValue(mfs, "inbox_outbox_pending_messages", table)
				s.errs, _ = seriesValue(mfs, "inbox_outbox_stats_errors_total", table)
				_, s.hasRe = seriesValue(mfs, "inbox_outbox_messages_relayed_total", table)
				done <- s
			}()
			var s scrape
			select {
			case s = <-done:
			case <-time.After(time.Minute): // a hang guard, far above OutboxStatsTimeout
				release()
				t.Fatal("the scrape did not return while the database stalled")
			}
			release()
			if s.err != nil || s.hasPending || s.errs != 1 || !s.hasRe {
				t.Errorf("scrape while the database stalls: error %v, pending gauge present %v, stats errors %v, relay counter present %v;"+
					" want no error, no gauge, 1 stats error and the relay's counters", s.err, s.hasPending, s.errs, s.hasRe)
			}

			deadline := time.Now().Add(time.Minute)
			for {
				if n, ok := scraped(t, reg, "inbox_outbox_pending_messages", table); ok {
					if n != 2 {
						t.Errorf("pending once the database answers: %v, want 2", n)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the outbox gauges did not come back once the database answered")
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// stall makes the outbox table's stats query of db wait until release is
// called: PostgreSQL and MariaDB lock the table in another session; SQLite
// (whose readers a writer does not block) has its pool's only connection
// taken.
func stall(t *testing.T, dbName string, db *sqlx.DB, table string) (release func()) {
	t.Helper()
	ctx := context.Background()
	switch dbName {
	case "sqlite":
		db.SetMaxOpenConns(1)
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return func() { conn.Close() }
	case "postgres":
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec("LOCK TABLE " + table + " IN ACCESS EXCLUSIVE MODE"); err != nil {
			t.Fatal(err)
		}
		return func() { tx.Rollback() }
	default:
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.ExecContext(ctx, "LOCK TABLES "+table+" WRITE"); err != nil {
			t.Fatal(err)
		}
		return func() {
			conn.ExecContext(ctx, "UNLOCK TABLES") //nolint:errcheck // closing the session unlocks too
			conn.Close()
		}
	}
}

// runInvoicing runs a router whose "billing" handler, behind ib's
// middleware, returns one invoice (UUID "<input>-invoice") to the topic
// "invoices", or fails for a message whose payload is "fail"; it returns
// the function that delivers a message and tells whether it was acked.
func runInvoicing(t *testing.T, ib *inbox.Inbox, broker message.Publisher) func(*message.Message) bool {
	t.Helper()
	feed := &chanSubscriber{ch: make(chan *message.Message)}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(ib.Middleware)
	router.AddHandler("billing", "orders", feed, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Payload) == "fail" {
			return nil, errors.New("payment service unavailable")
		}
		return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
	})
	go router.Run(context.Background())
	<-router.Running()
	t.Cleanup(func() { router.Close() })
	return func(msg *message.Message) bool {
		t.Helper()
		feed.ch <- msg
		select {
		case <-msg.Acked():
			return true
		case <-msg.Nacked():
			return false
		case <-time.After(time.Minute):
			t.Fatal("message not handled")
			return false
		}
	}
}

// writeOutbox commits n messages to the topic "invoices" through ob's
// publisher, in one transaction.
func writeOutbox(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, n int) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	pub, err := ob.Publisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	for range n {
		if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		t.Fatal(err)
	}
}

// relayUntilEmpty runs relay rounds until one finds nothing, and returns
// how many rounds the relay reported (found messages or failed).
func relayUntilEmpty(t *testing.T, ob *inbox.Outbox) int {
	t.Helper()
	for n := range 100 {
		r := ob.RelayOnce(context.Background())
		if r.Err == nil && r.Relayed+r.Failed+r.DeadLettered == 0 {
			return n
		}
	}
	t.Fatal("the relay did not empty the outbox in 100 rounds")
	return 0
}

// A relay round cut short by the relay's own stop (its context cancelled,
// as when the router closes) is timed but not counted as a failed round:
// a deploy does not look like a relay error.
func TestOutboxRelayStoppedMidRoundIsNotAnError(t *testing.T) {
	for _, tdb := range outboxDBs() {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			var reported []inbox.OutboxRound
			ob := newOutbox(t, db, tdb.Dialect, m.InstrumentOutbox(inbox.OutboxConfig{
				Table: "outbox_" + testdb.RandomSuffix(), Publisher: &refusingBroker{},
				OnRound: func(r inbox.OutboxRound) { reported = append(reported, r) }}))
			writeOutbox(t, db, ob, 1)
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if r := ob.RelayOnce(ctx); !errors.Is(r.Err, context.Canceled) || len(reported) != 1 {
				t.Fatalf("round on a cancelled context: %+v, %d reported; want one reported, wrapping context.Canceled", r, len(reported))
			}
			if n, ok := scraped(t, reg, "inbox_outbox_relay_errors_total", ob.Table()); !ok || n != 0 {
				t.Errorf("relay errors after a stopped round: %v (present %v), want 0", n, ok)
			}
			if n, ok := scraped(t, reg, "inbox_outbox_relay_round_seconds", ob.Table()); !ok || n != 1 {
				t.Errorf("rounds timed: %v (present %v), want 1", n, ok)
			}
		})
	}
}

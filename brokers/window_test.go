//go:build unix

package brokers

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/jetstreamretention"
)

// purgeWithJetStreamWindow deletes the inbox rows of messages that the
// stream can no longer deliver: the window is the stream's MaxAge (or a
// consumer's redelivery span, if longer) plus the margin.
func purgeWithJetStreamWindow(ctx context.Context, db *sqlx.DB, table, url, stream string) (int64, error) {
	src, err := jetstreamretention.New(jetstreamretention.Config{
		URL:     url,
		Streams: []string{stream},
		Margin:  time.Hour, // a late expiry, clock skew, producers re-publishing after the Duplicates window
	})
	if err != nil {
		return 0, err
	}
	defer src.Close()
	return inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, Window: src}) // OlderThan 0: the safe window
}

// windowInbox creates an inbox table of the test's own on PostgreSQL with
// one row per age given, processed that long ago by the database clock.
func windowInbox(t *testing.T, ages ...time.Duration) (*sqlx.DB, string) {
	t.Helper()
	db := openPostgres(t, env(postgresDSNEnv, defaultPostgresDSN))
	table := "inbox_window_" + randomSuffix()
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer ib.Close()
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := db.Exec("DROP TABLE IF EXISTS " + table); err != nil {
			t.Logf("drop %s: %v", table, err)
		}
	})
	for i, age := range ages {
		if _, err := db.Exec("INSERT INTO "+table+" VALUES ('billing', $1, now() - $2 * interval '1 microsecond')",
			fmt.Sprint("m", i), age.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	return db, table
}

// With the window from a JetStream stream with MaxAge 1h and a margin of
// 1h, a purge deletes the row processed 3h ago and keeps the one processed
// 90 minutes ago, whose message a new consumer could still replay.
func TestJetStream_purgeWindowFromStream(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	url := env(natsURLEnv, defaultNATSURL)
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		unreachable(t, "NATS", err, fmt.Sprintf("start it with `%s`, or point %s at a server", startNATS, natsURLEnv))
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	stream := "INBOX_BROKERS_WINDOW_" + strings.ToUpper(randomSuffix())
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{stream + ".orders"},
		Storage: jetstream.MemoryStorage, MaxAge: time.Hour}); err != nil {
		unreachable(t, "NATS JetStream", err, "run nats-server with -js")
	}
	t.Cleanup(func() {
		if err := js.DeleteStream(context.Background(), stream); err != nil {
			t.Logf("delete stream %s: %v", stream, err)
		}
	})
	db, table := windowInbox(t, 3*time.Hour, 90*time.Minute)
	deleted, err := purgeWithJetStreamWindow(ctx, db, table, url, stream)
	var left []string
	if err := db.Select(&left, "SELECT message_id FROM "+table); err != nil {
		t.Fatal(err)
	}
	if err != nil || deleted != 1 || len(left) != 1 || left[0] != "m1" {
		t.Errorf("purge under a 2h safe window: deleted %d, %v, left %v; want the 3h-old row deleted and m1 kept", deleted, err, left)
	}
}

// Classic and quorum queues never deliver an acked message again: only an
// unacked one comes back (when its channel closes), marked redelivered. So
// their purge window is the longest a processed message can stay unacked or
// wait in the queue before it comes back, which the broker does not report:
// a FixedWindow states it.
func TestRabbitMQ_onlyUnackedMessagesComeBack(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	url := env(amqpURLEnv, defaultAMQPURL)
	conn, err := amqp091.Dial(url)
	if err != nil {
		unreachable(t, "RabbitMQ", err, fmt.Sprintf("start it with `%s`, or point %s at a server", startRabbitMQ, amqpURLEnv))
	}
	t.Cleanup(func() { conn.Close() })
	ctx := context.Background()
	for _, queueType := range []string{"classic", "quorum"} {
		t.Run(queueType, func(t *testing.T) {
			setup, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			defer setup.Close()
			queue := "inbox_brokers_window_" + queueType + "_" + randomSuffix()
			if _, err := setup.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": queueType}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				ch, err := conn.Channel()
				if err == nil {
					defer ch.Close()
					_, err = ch.QueueDelete(queue, false, false, false)
				}
				if err != nil {
					t.Logf("delete queue %s: %v", queue, err)
				}
			})
			if err := setup.Confirm(false); err != nil {
				t.Fatal(err)
			}
			for _, body := range []string{"acked", "unacked"} {
				dc, err := setup.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp091.Publishing{Body: []byte(body)})
				if err != nil {
					t.Fatal(err)
				}
				if ok, err := dc.WaitContext(ctx); !ok || err != nil {
					t.Fatalf("publish %s: confirmed %v, %v", body, ok, err)
				}
			}

			first, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			deliveries, err := first.Consume(queue, "", false, false, false, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			for i := range 2 {
				var d amqp091.Delivery
				select {
				case d = <-deliveries:
				case <-time.After(time.Minute): // a bound, not a measurement
					t.Fatalf("%d of 2 messages delivered within a minute", i)
				}
				if string(d.Body) == "acked" {
					if err := d.Ack(false); err != nil {
						t.Fatal(err)
					}
				}
			}
			if err := first.Close(); err != nil { // the unacked delivery is requeued
				t.Fatal(err)
			}

			second, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			defer second.Close()
			var got []string
			for {
				d, ok, err := second.Get(queue, false)
				if err != nil {
					t.Fatal(err)
				}
				if !ok {
					break
				}
				got = append(got, fmt.Sprintf("%s redelivered=%v", d.Body, d.Redelivered))
				if err := d.Ack(false); err != nil {
					t.Fatal(err)
				}
			}
			if len(got) != 1 || got[0] != "unacked redelivered=true" {
				t.Errorf("after the first channel closed: %q; want only the unacked message, redelivered", got)
			}
		})
	}

	// The window stated for a quorum queue whose consumers are down for at
	// most 2 days, with delivery-limit 20 and consumer_timeout 30 min.
	db, table := windowInbox(t, 4*24*time.Hour, 24*time.Hour)
	window := inbox.FixedWindow(2*24*time.Hour + 20*30*time.Minute + 24*time.Hour) // + a margin of a day
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, Window: window})
	if err != nil || deleted != 1 {
		t.Errorf("purge under a FixedWindow of 3d10h: deleted %d, %v; want the 4-day-old row", deleted, err)
	}
}

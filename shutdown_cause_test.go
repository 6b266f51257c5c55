package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
)

// The router runs under errgroup.WithContext; another component of the
// process fails with a plain error, and the group cancels the router's
// context with it as the cause. The in-flight handler watches its context
// the Go 1.20+ way and returns context.Cause(ctx) (bare or wrapped): the
// inbox adds the context's end, so the message is not poisoned by a poison
// queue with the documented filter !IsTransient (docs/errors.md's order,
// without Retry). The cause alone carried no context.Canceled, and every
// message in flight at such a shutdown was poisoned.
func TestHandlerReturningTheContextsCauseAtAShutdownIsNotPoisoned(t *testing.T) {
	for _, c := range []struct {
		broker string
		wrap   bool
	}{{"gochannel", false}, {"gochannel", true}} {
		wrap := c.wrap
		t.Run(fmt.Sprintf("%s/wrapped=%v", c.broker, wrap), func(t *testing.T) {
			shutdownCase(t, c.broker, func(ib *inbox.Inbox, poison message.Publisher) []message.HandlerMiddleware {
				pq, err := middleware.PoisonQueueWithFilter(poison, "poison", func(err error) bool { return !inbox.IsTransient(err) })
				if err != nil {
					t.Fatal(err)
				}
				return []message.HandlerMiddleware{pq, middleware.Timeout(30 * time.Second), middleware.Recoverer, ib.Middleware}
			}, func(ctx context.Context) error {
				<-ctx.Done() // e.g. a call that returns when ctx ends
				if wrap {
					return fmt.Errorf("charge card: %w", context.Cause(ctx))
				}
				return context.Cause(ctx)
			})
		})
	}
}

// The same shutdown, with the stack of Inbox.Middlewares and a handler that
// does not watch its context and returns nil. The inbox returns a transient
// error (context.Canceled and the cause), but the Retry of
// Inbox.Middlewares (cenkalti/backoff's) returns context.Cause(ctx) alone
// once the context has ended: the stack adds the end back, and its poison
// queue no longer poisons the message.
func TestInboxMiddlewaresDoNotPoisonAShutdownWithACause(t *testing.T) {
	for _, broker := range []string{"gochannel"} {
		t.Run(broker, func(t *testing.T) { inboxMiddlewaresShutdown(t, broker) })
	}
}

func inboxMiddlewaresShutdown(t *testing.T, broker string) {
	shutdownCase(t, broker, func(ib *inbox.Inbox, poison message.Publisher) []message.HandlerMiddleware {
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison, PoisonTopic: "poison"})
		if err != nil {
			t.Fatal(err)
		}
		return mws
	}, func(ctx context.Context) error {
		time.Sleep(300 * time.Millisecond) // a remote call that does not watch ctx
		return nil
	})
}

// shutdownBroker returns the subscriber of "orders", the publisher (also
// of the poison topic "poison") and a reader of the poisoned messages.
func shutdownBroker(t *testing.T, broker string) (message.Subscriber, message.Publisher, func() []*message.Message) {
	logger := watermill.NopLogger{}
	read := func(sub message.Subscriber) []*message.Message {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		ch, err := sub.Subscribe(ctx, "poison")
		if err != nil {
			t.Fatal(err)
		}
		var out []*message.Message
		for {
			select {
			case m, ok := <-ch:
				if !ok {
					return out
				}
				m.Ack()
				out = append(out, m)
			case <-ctx.Done():
				return out
			}
		}
	}
	if broker == "gochannel" {
		ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
		t.Cleanup(func() { ps.Close() })
		return ps, ps, func() []*message.Message { return read(ps) }
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders", "poison"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	subConfig := func(group string) kafka.SubscriberConfig {
		c := kafka.DefaultSaramaSubscriberConfig()
		c.Version = sarama.V2_8_0_0
		c.Consumer.Offsets.Initial = sarama.OffsetOldest
		return kafka.SubscriberConfig{Brokers: cluster.ListenAddrs(), Unmarshaler: kafka.DefaultMarshaler{},
			OverwriteSaramaConfig: c, ConsumerGroup: group, NackResendSleep: 10 * time.Millisecond}
	}
	sub, err := kafka.NewSubscriber(subConfig("billing"), logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	pc := kafka.DefaultSaramaSyncPublisherConfig()
	pc.Version = sarama.V2_8_0_0
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: cluster.ListenAddrs(), Marshaler: kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: pc}, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return sub, pub, func() []*message.Message {
		ps, err := kafka.NewSubscriber(subConfig("poison_reader"), logger)
		if err != nil {
			t.Fatal(err)
		}
		defer ps.Close()
		return read(ps)
	}
}

func shutdownCase(t *testing.T, broker string, stack func(*inbox.Inbox, message.Publisher) []message.HandlerMiddleware, work func(context.Context) error) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	logger := watermill.NopLogger{}
	sub, pub, poisoned := shutdownBroker(t, broker)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	mws := stack(ib, pub)
	var inboxErr atomic.Pointer[error] // errors of different types: atomic.Value panicked on the second
	last := len(mws) - 1
	router.AddMiddleware(mws[:last]...)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err != nil {
				inboxErr.Store(&err)
			}
			return out, err
		}
	}, mws[last])
	var calls atomic.Int32
	started := make(chan struct{}, 10)
	router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
		calls.Add(1)
		if err := f.writeBusinessRow(msg); err != nil {
			return err
		}
		started <- struct{}{}
		return work(msg.Context())
	})

	// What errgroup.WithContext does when another component of the group
	// fails: it cancels the group's context with that failure as its cause.
	group, shutdown := context.WithCancelCause(context.Background())
	defer shutdown(nil)
	ran := make(chan struct{})
	go func() { defer close(ran); _ = router.Run(group) }()
	<-router.Running()
	if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	<-started
	shutdown(errors.New("metrics exporter: invalid configuration"))
	<-ran

	if p := inboxErr.Load(); p != nil {
		e := *p
		t.Logf("the inbox returned: %v (IsTransient %v)", e, inbox.IsTransient(e))
	}
	for _, p := range poisoned() {
		t.Errorf("message poisoned at a shutdown (reason %q); business rows %d, inbox rows %d, calls %d: acked, never processed",
			p.Metadata.Get(middleware.ReasonForPoisonedKey), f.businessRows(), f.inboxRows(), calls.Load())
	}
}

// A deadline set with a cause (context.WithTimeoutCause) by a middleware of
// the user's that goes before Inbox.Middlewares ("Middlewares of your own
// that must see every attempt go before these"): Retry returns the cause
// alone, the stack adds DeadlineExceeded back, and the message is not
// poisoned for a deadline.
func TestInboxMiddlewaresDoNotPoisonADeadlineWithACause(t *testing.T) {
	f := newFixture(t, sqliteDB(t))
	var calls atomic.Int32
	if p := poisonedBehindADeadline(t, f, middleware.Retry{}, 2*time.Second, func(msg *message.Message) error {
		if calls.Add(1) == 1 {
			time.Sleep(300 * time.Millisecond) // slow once
		}
		return f.writeBusinessRow(msg)
	}); p != nil {
		t.Errorf("message poisoned for a deadline (reason %q); business rows %d, inbox rows %d, calls %d: acked, never processed",
			p.Metadata.Get(middleware.ReasonForPoisonedKey), f.businessRows(), f.inboxRows(), calls.Load())
	}
}

// A per-message deadline set with a cause by a middleware of the user's
// before Inbox.Middlewares (the documented place). The handler refuses the
// message at once, for good (its own error, which the poison queue's
// default filter poisons), and Retry's backoff outlasts the deadline:
// cenkalti/backoff returns the deadline's cause instead of the handler's
// error, and the stack gives the poison queue the last attempt's error, so
// the message is poisoned. It was nacked and redelivered for ever.
func TestInboxMiddlewaresPoisonARefusalWhoseRetryOutlastedADeadline(t *testing.T) {
	f := newFixture(t, sqliteDB(t))
	if p := poisonedBehindADeadline(t, f, middleware.Retry{}, 3*time.Second, func(*message.Message) error {
		return errors.New("order refers to an unknown customer") // permanent, returned at once
	}); p == nil {
		t.Errorf("a message its handler refuses for good was not poisoned in 3 s: nacked and redelivered for ever")
	}
}

// An errgroup-style shutdown while a handler's remote call runs; the call
// returns an error of its own that does not wrap context.Canceled (gRPC's
// status.Error(codes.Canceled, ...) does so). An attempt the context's end
// cut short says nothing of the message: it is not poisoned (a first
// version of the last-attempt rule gave the poison queue that attempt's
// error, and poisoned it).
func TestInboxMiddlewaresDoNotPoisonAShutdownThatCutAnAttemptShort(t *testing.T) {
	shutdownCase(t, "gochannel", func(ib *inbox.Inbox, poison message.Publisher) []message.HandlerMiddleware {
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison, PoisonTopic: "poison"})
		if err != nil {
			t.Fatal(err)
		}
		return mws
	}, func(ctx context.Context) error {
		<-ctx.Done()                                            // a call that watches ctx
		return errors.New("payment service: request cancelled") // its own error, like gRPC's codes.Canceled
	})
}

// The same with a per-message deadline with a cause (timeoutWithCause, 100
// ms, before Inbox.Middlewares as documented) that cuts the attempt short:
// redelivered, not poisoned.
func TestInboxMiddlewaresDoNotPoisonADeadlineThatCutAnAttemptShort(t *testing.T) {
	f := newFixture(t, sqliteDB(t))
	if p := poisonedBehindADeadline(t, f, middleware.Retry{}, time.Second, func(msg *message.Message) error {
		<-msg.Context().Done()
		return errors.New("payment service: request cancelled")
	}); p != nil {
		t.Errorf("poisoned at a deadline: %q", p.Metadata.Get(middleware.ReasonForPoisonedKey))
	}
}

// A handler that refuses the message for good, at once, except that its
// lookup is slow on Retry's 4th attempt, which the per-message deadline
// (timeoutWithCause, 100 ms, cause) cuts; Retry InitialInterval 1 ms. The
// poison queue gets the last refusal made before the deadline, and poisons
// the message: with the last attempt's error (the deadline) it was nacked,
// the same on every redelivery, never poisoned.
func TestInboxMiddlewaresPoisonARefusalWhoseLastAttemptADeadlineCutShort(t *testing.T) {
	f := newFixture(t, sqliteDB(t))
	var attempts atomic.Int32
	if p := poisonedBehindADeadline(t, f, middleware.Retry{InitialInterval: time.Millisecond}, 3*time.Second, func(msg *message.Message) error {
		if attempts.Add(1)%4 == 0 { // Retry's 4th attempt: the lookup is slow this time
			<-msg.Context().Done()
			return msg.Context().Err()
		}
		return errors.New("order refers to an unknown customer") // permanent, at once
	}); p == nil {
		t.Errorf("a message its handler refuses for good was not poisoned in 3 s (%d attempts): nacked and redelivered for ever", attempts.Load())
	}
}

// poisonedBehindADeadline runs handler on a router with f's inbox through
// Inbox.Middlewares (poison queue on a gochannel, retry its Retry) behind
// timeoutWithCause (100 ms, a cause), publishes one message, and returns
// what the poison queue got within wait, or nil.
func poisonedBehindADeadline(t *testing.T, f *fixture, retry middleware.Retry, wait time.Duration, handler message.NoPublishHandlerFunc) *message.Message {
	t.Helper()
	ib := f.newInbox(inbox.Config{})
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	defer ps.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: ps, PoisonTopic: "poison", Retry: retry})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(timeoutWithCause) // 100 ms, cause errHandlerDeadline
	router.AddMiddleware(mws...)
	router.AddConsumerHandler("billing", "orders", ps, handler)
	poisoned, err := ps.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-router.Running()
	if err := ps.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-poisoned:
		p.Ack()
		t.Logf("poisoned: %q", p.Metadata.Get(middleware.ReasonForPoisonedKey))
		return p
	case <-time.After(wait):
		return nil
	}
}

// A shutdown while Retry waits before its next attempt, after an attempt
// failed with the handler's own error (a dependency's 503 that the next
// attempt would get past): the message is nacked for the next instance, not
// poisoned. The stack gave the poison queue that attempt's error in place of
// the shutdown, which it does for a deadline (a refusal whose retries outlast
// the message's deadline must still be poisoned), and a deploy poisoned
// every message waiting between attempts.
func TestInboxMiddlewaresDoNotPoisonAShutdownDuringRetrysWait(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	failed := make(chan struct{}, 10)
	ib := f.newInbox(inbox.Config{OnFailed: func(inbox.Event) { failed <- struct{}{} }})
	sub, pub, poisoned := shutdownBroker(t, "gochannel")
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: pub, PoisonTopic: "poison",
		Retry: middleware.Retry{InitialInterval: 5 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(mws...)
	router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
		if err := f.writeBusinessRow(msg); err != nil {
			return err
		}
		return errors.New("payment service: 503 Service Unavailable")
	})
	ctx, shutdown := context.WithCancel(context.Background())
	defer shutdown()
	ran := make(chan struct{})
	go func() { defer close(ran); _ = router.Run(ctx) }()
	<-router.Running()
	if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	<-failed                           // the first attempt failed and rolled back
	time.Sleep(100 * time.Millisecond) // Retry waits 5 s before the next
	shutdown()
	<-ran
	for _, p := range poisoned() {
		t.Errorf("message poisoned at a shutdown during Retry's wait (reason %q)", p.Metadata.Get(middleware.ReasonForPoisonedKey))
	}
}

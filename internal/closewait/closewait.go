// Package closewait wraps a Watermill subscriber so that its Close returns
// only once every channel its Subscribe calls returned is closed, as
// Watermill's universal pub/sub suite asserts right after Close.
//
// watermill-sql's Subscriber (v3.1.0 and v4.1.2) does not guarantee it: its
// Close waits for the consume loops to return, but each loop's deferred
// subscribeWg.Done runs before the goroutine around it closes the channel,
// so Close can return while the channel is still open (seen in CI under
// load: "messages channel is not closed (blocked)"). That race is the
// subscriber's, not the SQLite adapters' this repository tests with the
// suite; a router is not affected, as it waits for the channel to close.
package closewait

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Subscriber forwards the messages of the subscriber it wraps unchanged;
// once Close is called none is forwarded any more (the subscriber is
// closing, and redelivers what was not acked). Safe for concurrent use.
type Subscriber struct {
	message.Subscriber
	closing   chan struct{}
	closeOnce sync.Once
	forwards  sync.WaitGroup
}

// Wrap returns sub with a Close that waits for the channels it returned.
func Wrap(sub message.Subscriber) *Subscriber {
	return &Subscriber{Subscriber: sub, closing: make(chan struct{})}
}

// Subscribe subscribes the wrapped subscriber to topic and forwards what it
// delivers on a channel of its own, closed once the wrapped one is.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.forwards.Add(1)
	go func() {
		defer s.forwards.Done()
		defer close(out)
		for m := range in {
			select {
			case out <- m:
			case <-s.closing:
				for range in { // until the subscriber closes it
				}
				return
			}
		}
	}()
	return out, nil
}

// Close closes the wrapped subscriber and returns once every channel
// Subscribe returned is closed. Idempotent as far as the wrapped Close is.
func (s *Subscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	err := s.Subscriber.Close()
	s.forwards.Wait()
	return err
}

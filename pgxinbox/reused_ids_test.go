package pgxinbox_test

import (
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A message id processed once comes again through the pgx backend: the same
// payload is a duplicate; another payload is refused (an error wrapping
// inbox.ErrMessageIDReused, not transient, OnReusedID and OnFailed), and
// nothing is written.
func TestReusedIDWithOtherContentIsRefused(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		f := newFixture(t, openPool(t, "", "pgx-reused-ids", nil))
		var reused, failed atomic.Int32
		ib := f.newInbox(pgxinbox.Config{Dialect: d,
			OnReusedID: func(inbox.Event) { reused.Add(1) },
			OnFailed:   func(inbox.Event) { failed.Add(1) },
		})
		rec := &recorder{}
		in := consume(t, ib, f.writeEffect, rec.Middleware)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) || !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatalf("first delivery or its duplicate nacked: %v", rec.last())
		}
		if in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
			t.Fatal("another payload under a processed id acked, want refused")
		}
		if err := rec.last(); !errors.Is(err, inbox.ErrMessageIDReused) || inbox.IsTransient(err) {
			t.Errorf("error %v (transient %v), want a permanent one wrapping ErrMessageIDReused", err, inbox.IsTransient(err))
		}
		if reused.Load() != 1 || failed.Load() != 1 {
			t.Errorf("OnReusedID %d, OnFailed %d, want 1 each", reused.Load(), failed.Load())
		}
		f.expectRows(1, 1)
	})
}

// With inbox.ReusedIDsWarn a reused id is logged and skipped as a
// duplicate; on a table without the fingerprint column the check is off and
// the inbox logs the ALTER TABLE that adds it.
func TestReusedIDWarningAndTableWithoutTheColumn(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := openPool(t, "", "pgx-reused-ids", nil)
		for _, tc := range []struct {
			name      string
			dropFirst bool
			check     inbox.ReusedIDCheck
			wantLog   string
		}{
			{"warn", false, inbox.ReusedIDsWarn, "message id reused for other content"},
			{"no column", true, inbox.ReusedIDsRefuse, inbox.AddFingerprintColumnSQL(d, "x")[:len("ALTER TABLE")]},
		} {
			t.Run(tc.name, func(t *testing.T) {
				f := newFixture(t, pool)
				if tc.dropFirst {
					f.newInbox(pgxinbox.Config{Dialect: d})
					f.exec("ALTER TABLE " + f.table + " DROP COLUMN fingerprint")
				}
				logs := &infoLog{}
				var reused atomic.Int32
				ib := f.newInbox(pgxinbox.Config{Dialect: d, ReusedIDs: tc.check, Logger: logs,
					OnReusedID: func(inbox.Event) { reused.Add(1) }})
				in := consume(t, ib, f.writeEffect)
				id := watermill.NewUUID()
				if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) || !in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
					t.Fatal("a delivery nacked")
				}
				f.expectRows(1, 1)
				if !logs.has(tc.wantLog) {
					t.Errorf("no Info line with %q; logged %q", tc.wantLog, logs.lines)
				}
				if want := map[bool]int32{true: 0, false: 1}[tc.dropFirst]; reused.Load() != want {
					t.Errorf("OnReusedID called %d times, want %d", reused.Load(), want)
				}
			})
		}
	})
}

// infoLog keeps the Info lines it is given.
type infoLog struct {
	watermill.NopLogger
	mu    sync.Mutex
	lines []string
}

func (l *infoLog) Info(msg string, _ watermill.LogFields) {
	l.mu.Lock()
	l.lines = append(l.lines, msg)
	l.mu.Unlock()
}

func (l *infoLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *infoLog) has(part string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, part) {
			return true
		}
	}
	return false
}

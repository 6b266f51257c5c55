package inbox_test

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// messageIDSeeds are the ids the seed corpus is made of: the edges of what
// the inbox accepts (1 to 255 bytes of valid UTF-8 without NUL) and text
// that would do harm if it ever became SQL.
var messageIDSeeds = []string{
	"",
	"order-1",
	"order-1 ", // trailing space: a distinct key (MySQL PAD SPACE collations would fold it)
	"ORDER-1",
	strings.Repeat("a", 255),
	strings.Repeat("a", 256),
	strings.Repeat("a", 253) + "é",      // 255 bytes
	strings.Repeat("a", 254) + "é",      // 256 bytes: too long, though 255 characters
	strings.Repeat("🚀", 63) + "abc",     // 255 bytes of 4-byte runes
	"\xff\xfe",                          // not UTF-8
	"abc\xc3",                           // a cut multi-byte rune
	"\xed\xa0\x80",                      // a UTF-16 surrogate, invalid in UTF-8
	"a\x00b",                            // NUL
	"\x00",                              //
	"'; DROP TABLE watermill_inbox; --", // SQL injection
	`" OR "1"="1`,                       //
	"`backtick` ) ; DELETE FROM x",      //
	`\' \" \\ ?1 $1 :name @p1 %s %_`,    // escapes, placeholders, LIKE wildcards
	"ünïcödé \u2028\u2029\ufeff\u200b 漢字", // non-ASCII, separators, zero-width
	"\t\r\n",
}

// Arbitrary bytes as message id and metadata, through a real router on
// SQLite, for two consumers: "by-uuid" deduplicates on msg.UUID (the
// default), "by-event-id" on the metadata value "event_id" (a Config.MessageID
// of the kind users write). For each, either the id is valid (1 to 255 bytes
// of UTF-8 without NUL) and the handler ran exactly once, the message was
// acked, and the inbox row and the handler's business row hold exactly the
// id's bytes; or the message was nacked with an error wrapping
// ErrInvalidMessageID, the handler did not run and nothing was written.
// Never a panic, and never an SQL text that depends on the message: every
// statement the pool sees is one it saw for a fixed id before fuzzing
// (statements recorded between database/sql and the real driver).
//
//	go test -run '^$' -fuzz FuzzMessageID -fuzztime 60s .
func FuzzMessageID(f *testing.F) {
	for i, id := range messageIDSeeds {
		event := messageIDSeeds[(i+3)%len(messageIDSeeds)]
		key, value := []string{"x", "", "'; --", "event_id"}[i%4], messageIDSeeds[(i+7)%len(messageIDSeeds)]
		f.Add([]byte(id), []byte(event), []byte(key), []byte(value))
	}

	path := filepath.Join(f.TempDir(), "fuzz.db")
	plain := openSQLite(f, path) // checks and cleanup, unrecorded
	queries := &queryLog{}
	db := openRecording(f, plain.Driver(), "file:"+path+"?"+testdb.SQLiteParams, "sqlite", queries)
	table, business := "inbox_"+randomSuffix(), "business_"+randomSuffix()
	exec(f, plain, "CREATE TABLE "+business+" (consumer TEXT NOT NULL, id BLOB NOT NULL)")
	schema, err := inbox.New(inbox.Config{DB: plain, Table: table})
	if err != nil {
		f.Fatal(err)
	}
	if err := schema.InitializeSchema(context.Background()); err != nil {
		f.Fatal(err)
	}
	byUUID, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		f.Fatal(err)
	}
	byEventID, err := inbox.New(inbox.Config{DB: db, Table: table,
		MessageID: func(msg *message.Message) (string, error) { return msg.Metadata.Get("event_id"), nil }})
	if err != nil {
		f.Fatal(err)
	}

	var mu sync.Mutex
	var seen []*message.Message // what the handler got, this iteration
	handler := func(msg *message.Message) error {
		mu.Lock()
		seen = append(seen, msg)
		mu.Unlock()
		consumer := message.HandlerNameFromCtx(msg.Context())
		id := msg.UUID
		if consumer == "by-event-id" {
			id = msg.Metadata.Get("event_id")
		}
		tx, ok := inbox.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no inbox transaction")
		}
		_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+business+" (consumer, id) VALUES (?, ?)", consumer, []byte(id))
		return err
	}
	feeds := map[string]*feed{"by-uuid": newFeed(), "by-event-id": newFeed()}
	var rec recorder
	runRouter(f, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware)
		r.AddConsumerHandler("by-uuid", "orders", feeds["by-uuid"], handler).AddMiddleware(byUUID.Middleware)
		r.AddConsumerHandler("by-event-id", "orders", feeds["by-event-id"], handler).AddMiddleware(byEventID.Middleware)
	})

	// deliver runs one message through both consumers and checks each.
	deliver := func(t *testing.T, uuid, eventID, key, value []byte) {
		exec(t, plain, "DELETE FROM "+table) // each input starts from empty tables
		exec(t, plain, "DELETE FROM "+business)
		msg := message.NewMessage(string(uuid), []byte("payload"))
		msg.Metadata.Set("event_id", string(eventID))
		msg.Metadata.Set(string(key), string(value))
		sent := maps.Clone(msg.Metadata)
		for _, consumer := range []string{"by-uuid", "by-event-id"} {
			id := msg.UUID
			if consumer == "by-event-id" {
				id = msg.Metadata.Get("event_id")
			}
			mu.Lock()
			seen = nil
			mu.Unlock()
			acked := feeds[consumer].deliver(t, msg)
			mu.Lock()
			got := seen
			mu.Unlock()
			var stored, written [][]byte
			if err := plain.Select(&stored, "SELECT message_id FROM "+table+" WHERE consumer = ?", consumer); err != nil {
				t.Fatal(err)
			}
			if err := plain.Select(&written, "SELECT id FROM "+business+" WHERE consumer = ?", consumer); err != nil {
				t.Fatal(err)
			}
			if validMessageID(id) {
				if !acked || rec.last() != nil || len(got) != 1 {
					t.Fatalf("%s, valid id %q: acked %v, error %v, handler calls %d; want acked, nil, 1", consumer, id, acked, rec.last(), len(got))
				}
				if got[0].UUID != msg.UUID || !maps.Equal(got[0].Metadata, sent) || !bytes.Equal(got[0].Payload, msg.Payload) {
					t.Fatalf("%s: the handler got message %q %v %q, want %q %v %q", consumer,
						got[0].UUID, got[0].Metadata, got[0].Payload, msg.UUID, sent, msg.Payload)
				}
				if len(stored) != 1 || !bytes.Equal(stored[0], []byte(id)) {
					t.Fatalf("%s: inbox rows %q, want exactly one holding %q", consumer, stored, id)
				}
				if len(written) != 1 || !bytes.Equal(written[0], []byte(id)) {
					t.Fatalf("%s: business rows %q, want exactly one holding %q", consumer, written, id)
				}
			} else {
				if acked || !errors.Is(rec.last(), inbox.ErrInvalidMessageID) || len(got) != 0 {
					t.Fatalf("%s, invalid id %q: acked %v, error %v, handler calls %d; want a nack wrapping ErrInvalidMessageID, 0 calls",
						consumer, id, acked, rec.last(), len(got))
				}
				if len(stored) != 0 || len(written) != 0 {
					t.Fatalf("%s, invalid id %q: inbox rows %q, business rows %q; want nothing written", consumer, id, stored, written)
				}
			}
		}
	}

	// The statements a fixed message makes, accepted ones and refused ones;
	// nothing else may ever run.
	queries.freeze(func() {
		for _, id := range []string{"warm-up", ""} {
			msg := message.NewMessage(id, nil)
			msg.Metadata.Set("event_id", id)
			for _, consumer := range []string{"by-uuid", "by-event-id"} {
				feeds[consumer].deliver(f, msg)
			}
		}
	})

	f.Fuzz(func(t *testing.T, uuid, eventID, key, value []byte) {
		deliver(t, uuid, eventID, key, value)
		if q := queries.unexpected(); q != nil {
			t.Fatalf("statements that did not run for a fixed id: %q: SQL text depends on the message", q)
		}
	})
}

// validMessageID is the contract of DESIGN.md, rule 7, and the README FAQ:
// 1 to 255 bytes of valid UTF-8 without NUL.
func validMessageID(id string) bool {
	return id != "" && len(id) <= inbox.MaxKeyLength && utf8.ValidString(id) && !strings.ContainsRune(id, 0)
}

// queryLog is an sqlObserver that learns the statement texts a pool runs
// while frozen is being set up, and then reports any other.
type queryLog struct {
	mu      sync.Mutex
	known   map[string]bool
	learned bool
	others  []string
}

// freeze records the statements that run during f as the known ones.
func (l *queryLog) freeze(f func()) {
	f()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.learned = true
}

// unexpected returns, and forgets, the statements not known.
func (l *queryLog) unexpected() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	others := l.others
	l.others = nil
	return others
}

func (l *queryLog) statement(_ any, query string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.learned {
		if l.known == nil {
			l.known = map[string]bool{}
		}
		l.known[query] = true
		return
	}
	if !l.known[query] {
		l.others = append(l.others, query)
	}
}

func (l *queryLog) executed(any, string, int64) {}
func (l *queryLog) failed(any, string, error)   {}
func (l *queryLog) began(any)                   {}
func (l *queryLog) ended(any, bool)             {}

var _ sqlObserver = (*queryLog)(nil)

// errorTextSeeds are UUIDs and ids that forge log lines if printed raw.
var errorTextSeeds = []string{
	"order-1\nlevel=INFO msg=\"message acked\" message_uuid=forged",
	"\r\n[watermill] 2026/12/01 INFO forged",
	"a\x00b",
	"\x1b[31mred\x1b[0m",
	"\u2028line separator",
	"",
	"\xff\n",
}

// Hostile message UUIDs and ids never reach an error's text raw: every
// error the middleware returns about a message quotes what came from it,
// so no error (which the router logs) holds a newline, a carriage return or
// a NUL byte from the message. Covered: a refused id (each way it can be
// refused), a table that is missing (the key appears in the error), a
// nested inbox, a handler name missing outside a router.
//
//	go test -run '^$' -fuzz FuzzErrorText -fuzztime 60s .
func FuzzErrorText(f *testing.F) {
	for i, s := range errorTextSeeds {
		f.Add([]byte(s), []byte(errorTextSeeds[(i+1)%len(errorTextSeeds)]))
	}
	db := openSQLite(f, filepath.Join(f.TempDir(), "errors.db"))
	missing, err := inbox.New(inbox.Config{DB: db, Table: "missing_" + randomSuffix(),
		MessageID: func(msg *message.Message) (string, error) { return msg.Metadata.Get("id"), nil }})
	if err != nil {
		f.Fatal(err)
	}
	nested, err := inbox.New(inbox.Config{DB: db, Table: "inbox_" + randomSuffix()})
	if err != nil {
		f.Fatal(err)
	}
	if err := nested.InitializeSchema(context.Background()); err != nil {
		f.Fatal(err)
	}
	feeds := map[string]*feed{"missing-table": newFeed(), "nested": newFeed()}
	var rec recorder
	ok := func(*message.Message) error { return nil }
	runRouter(f, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware)
		r.AddConsumerHandler("missing-table", "orders", feeds["missing-table"], ok).AddMiddleware(missing.Middleware)
		r.AddConsumerHandler("nested", "orders", feeds["nested"], ok).AddMiddleware(nested.Middleware, nested.Middleware)
	})
	checkText := func(t *testing.T, what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: no error", what)
		}
		if strings.ContainsAny(err.Error(), "\n\r\x00") {
			t.Fatalf("%s: error text holds a raw newline, carriage return or NUL: %q", what, err.Error())
		}
	}
	f.Fuzz(func(t *testing.T, uuid, id []byte) {
		msg := message.NewMessage(string(uuid), nil)
		msg.Metadata.Set("id", string(id))
		for _, consumer := range []string{"missing-table", "nested"} {
			if feeds[consumer].deliver(t, msg) {
				t.Fatalf("%s: acked", consumer)
			}
			checkText(t, consumer, rec.last())
		}
		// Outside a router: no handler name, so no consumer.
		_, err := nested.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg.Copy())
		checkText(t, "outside a router", err)
	})
}

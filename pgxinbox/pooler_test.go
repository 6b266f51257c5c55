package pgxinbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// bouncerModes are the pgx query exec modes that work behind a
// transaction-mode PgBouncer (before 1.21).
var bouncerModes = []string{"exec", "simple_protocol"}

// Behind PgBouncer in transaction mode, with pgx's exec or simple_protocol
// mode, messages are processed once and duplicates skipped, while two
// services share the pooler (and its server connections), each writing its
// own tables: no statement of one runs for the other.
func TestPooler_TwoServicesBehindPgBouncer(t *testing.T) {
	t.Parallel()
	for _, mode := range bouncerModes {
		for _, dd := range dialects {
			t.Run(mode+"/"+dd.name, func(t *testing.T) {
				t.Parallel()
				type service struct {
					pool *pgxpool.Pool
					f    *fixture
					in   *feed
					c    *calls
				}
				var services []service
				for range 2 {
					pool := testdb.OpenPgxPoolBouncer(t, "default_query_exec_mode="+mode)
					f := newFixture(t, pool)
					ib := f.newInbox(pgxinbox.Config{Dialect: dd.dialect})
					c := &calls{}
					in := consume(t, ib, func(msg *message.Message) error { c.inc(msg); return f.writeEffect(msg) })
					services = append(services, service{pool, f, in, c})
				}
				var msgs []*message.Message
				for range 20 {
					msgs = append(msgs, message.NewMessage(watermill.NewUUID(), nil))
				}
				// Each service gets every message twice, the services and the
				// messages at once.
				var wg sync.WaitGroup
				for _, s := range services {
					for _, m := range msgs {
						wg.Go(func() {
							for range 2 {
								if !s.in.deliver(t, m) {
									t.Errorf("message %s nacked", m.UUID)
								}
							}
						})
					}
				}
				wg.Wait()
				for i, s := range services {
					if n := s.c.get(""); n != len(msgs) {
						t.Errorf("service %d: handler calls %d, want %d", i, n, len(msgs))
					}
					s.f.expectRows(len(msgs), len(msgs))
					expectNoConnHeld(t, s.pool)
				}
			})
		}
	}
}

// With pgx's default mode (cache_statement) behind a transaction-mode
// PgBouncer, pgx's prepared statements do not survive the change of server
// connection: deliveries fail with 42P05 (already exists) or 26000 (does not
// exist), claims with the pooler hint; no message is acked without its
// effect, and none is processed twice.
func TestPooler_CachedStatementsBehindPgBouncerFailClearly(t *testing.T) {
	t.Parallel()
	direct := testdb.OpenPgxPool(t, "")
	type service struct {
		f   *fixture
		in  *feed
		rec *recorder
	}
	var services []service
	for range 2 {
		f := newFixture(t, direct)
		f.newInbox(pgxinbox.Config{}) // the table, made without the pooler
		ib, err := pgxinbox.New(pgxinbox.Config{Pool: testdb.OpenPgxPoolBouncer(t, ""), Table: f.table})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ib.Close() })
		rec := &recorder{}
		services = append(services, service{f, consume(t, ib, f.writeEffect, rec.Middleware), rec})
	}
	msgs := make([]*message.Message, 20)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), nil)
	}
	acked := make([]map[string]bool, len(services))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, s := range services {
		acked[i] = map[string]bool{}
		for _, m := range msgs {
			wg.Go(func() {
				for range 2 {
					if s.in.deliver(t, m) {
						mu.Lock()
						acked[i][m.UUID] = true
						mu.Unlock()
					}
				}
			})
		}
	}
	wg.Wait()
	failures := 0
	for i, s := range services {
		var effects, rows int
		err := direct.QueryRow(context.Background(), "SELECT (SELECT count(*) FROM "+s.f.effect+"), (SELECT count(*) FROM "+s.f.table+")").Scan(&effects, &rows)
		if err != nil {
			t.Fatal(err)
		}
		if effects != rows || effects < len(acked[i]) {
			t.Errorf("service %d: %d messages acked, %d business rows, %d inbox rows", i, len(acked[i]), effects, rows)
		}
		for _, err := range s.rec.Failures() {
			failures++
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || (pgErr.Code != "42P05" && pgErr.Code != "26000") {
				t.Errorf("service %d: %v, want a prepared-statement error (42P05 or 26000)", i, err)
			} else if strings.Contains(err.Error(), "inbox: claim") && !strings.Contains(err.Error(), "default_query_exec_mode=exec or simple_protocol") {
				t.Errorf("service %d: claim error without the pooler hint: %v", i, err)
			}
		}
	}
	t.Logf("%d of %d deliveries failed with prepared-statement errors", failures, 4*len(msgs))
}

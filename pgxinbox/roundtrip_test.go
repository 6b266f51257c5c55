package pgxinbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// sqlTracer is a pgx tracer (pgx.QueryTracer and pgx.BatchTracer) that
// records what a pool sends: "query: <sql>" for each Query/Exec and
// "batch: <sql>; <sql>..." for each SendBatch.
type sqlTracer struct {
	mu   sync.Mutex
	sent []string
}

func (r *sqlTracer) add(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, s)
}

func (r *sqlTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.add("query: " + d.SQL)
	return ctx
}
func (r *sqlTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *sqlTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	var qs []string
	for _, q := range d.Batch.QueuedQueries {
		qs = append(qs, q.SQL)
	}
	r.add("batch: " + strings.Join(qs, "; "))
	return ctx
}
func (r *sqlTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *sqlTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// take returns what was sent since the last take.
func (r *sqlTracer) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.sent
	r.sent = nil
	return s
}

// BEGIN, the key lock (partitioned dialect) and the claim go to the server
// in one batch, with no BEGIN of their own: a processed message costs that
// batch, the handler's statements and COMMIT; a duplicate costs the batch
// and the ROLLBACK: two round trips, as before the fingerprints. A
// duplicate that reaches another inbox (another process, which did not
// commit the key and so does not remember its fingerprint) sends the read
// of its stored fingerprint (Config.ReusedIDs) in one batch with the
// ROLLBACK.
func TestRoundTrip_ClaimGoesOutWithBegin(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		tracer := &sqlTracer{}
		pool := openPool(t, "", "pgxinbox_rt_"+d.String(), func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
		f := newFixture(t, pool)
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		in := consume(t, ib, f.writeEffect)
		otherIn := consume(t, f.newInbox(pgxinbox.Config{Dialect: d}), f.writeEffect) // another process
		msg := message.NewMessage(watermill.NewUUID(), nil)
		// The partitioned dialect resolves the table's schema for its key
		// lock once, on the first message (a catalog read of its own): the
		// rule holds from the second message on.
		for _, feed := range []*feed{in, otherIn} {
			if !feed.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("first message nacked")
			}
		}
		claim := `insert into "` + f.table + `"`
		wantBatch := []string{"begin", claim}
		if d == inbox.PostgreSQLPartitioned {
			wantBatch = []string{"begin", "select pg_advisory_xact_lock", claim}
		}
		for _, tc := range []struct {
			name  string
			in    *feed
			after []string // what follows the batch
		}{
			{"Processed", in, []string{"query: insert into " + f.effect, "query: commit"}},
			{"Duplicate", in, []string{"query: rollback"}},
			{"Duplicate in another process", otherIn,
				[]string{"batch: select fingerprint from " + `"` + f.table + `" where consumer = $1 and message_id = $2 and (select set_config('bytea_output', 'hex', true)) is not null; rollback`}},
		} {
			tracer.take()
			if !tc.in.deliver(t, msg) {
				t.Fatalf("%s: nacked", tc.name)
			}
			sent := tracer.take()
			if len(sent) != 1+len(tc.after) {
				t.Errorf("%s: sent %q, want one batch then %q", tc.name, sent, tc.after)
				continue
			}
			batch := strings.Split(strings.TrimPrefix(sent[0], "batch: "), "; ")
			if !strings.HasPrefix(sent[0], "batch: ") || len(batch) != len(wantBatch) {
				t.Errorf("%s: first sent %q, want a batch of %q", tc.name, sent[0], wantBatch)
				continue
			}
			for i, q := range batch {
				if !strings.HasPrefix(strings.ToLower(q), wantBatch[i]) {
					t.Errorf("%s: batch query %d is %q, want %q...", tc.name, i, q, wantBatch[i])
				}
			}
			for i, want := range tc.after {
				if !strings.HasPrefix(strings.ToLower(sent[1+i]), want) {
					t.Errorf("%s: sent %q after the batch, want %q...", tc.name, sent[1+i], want)
				}
			}
		}
		f.expectRows(3, 3)
	})
}

package metrics_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
)

// counterSum is the sum of the counter name's series in reg.
func counterSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.Metric {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// A purge round that deletes rows in committed batches and then fails (a
// later batch refused, a deploy's stop) has removed those rows for good:
// inbox_purge_rows_deleted_total counts them. It counted only rounds without
// error, so a backlog purged by rounds that a rolling deploy cut short every
// time showed no purge at all while the table shrank.
func TestPurgeRowsDeletedByARoundThatFailsLaterAreCounted(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "metrics_purge_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		if _, err := db.Exec("INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('c', $1, now() - interval '3 hours' + $2 * interval '1 second')", fmt.Sprint(i), i); err != nil {
			t.Fatal(err)
		}
	}
	// The newest expired row cannot be deleted: the last batch fails.
	fn := table + "_refuse"
	if _, err := db.Exec(`CREATE FUNCTION ` + fn + `() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
		IF OLD.message_id = '49' THEN RAISE EXCEPTION 'refused'; END IF; RETURN OLD; END $$`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Exec("DROP FUNCTION IF EXISTS " + fn + "() CASCADE") })
	if _, err := db.Exec("CREATE TRIGGER refuse BEFORE DELETE ON " + table + " FOR EACH ROW EXECUTE FUNCTION " + fn + "()"); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	p, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table,
		OlderThan: time.Hour, BatchSize: 10, DutyCycle: 1}}))
	if err != nil {
		t.Fatal(err)
	}
	r := p.RunOnce(context.Background())
	if r.Err == nil {
		t.Fatal("the round did not fail")
	}
	var left int
	if err := db.Get(&left, "SELECT count(*) FROM "+table); err != nil {
		t.Fatal(err)
	}
	removed := 50 - left
	if removed == 0 || r.Deleted != int64(removed) {
		t.Fatalf("the round removed %d rows and reported %d; want some, reported", removed, r.Deleted)
	}
	if got := counterSum(t, reg, "inbox_purge_rows_deleted_total"); got != float64(removed) {
		t.Errorf("inbox_purge_rows_deleted_total = %v after a failed round removed %d rows", got, removed)
	}
	if got := counterSum(t, reg, "inbox_purge_rounds_total"); got != 1 {
		t.Errorf("inbox_purge_rounds_total = %v, want the failed round", got)
	}
}

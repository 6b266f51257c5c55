package metrics_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// gaugeValue is the value of the gauge name's one series in reg, and
// whether there is one.
func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.Metric) == 1 {
			return mf.Metric[0].GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// inbox_reused_ids_detected says whether the inbox detects reused ids: 0 on
// a table without the fingerprint column (made before it existed), where
// inbox_reused_ids_total reads 0 whatever comes and nothing else exported
// said that it could not see; 1 on a table with it.
func TestReusedIDsDetectedSaysWhetherTheCountCanSeeAnything(t *testing.T) {
	for _, column := range []bool{true, false} {
		t.Run(map[bool]string{true: "with the column", false: "without the column"}[column], func(t *testing.T) {
			db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
			setup, err := inbox.New(inbox.Config{DB: db})
			if err != nil {
				t.Fatal(err)
			}
			if err := setup.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			if !column {
				if _, err := db.Exec("ALTER TABLE " + inbox.DefaultTable + " DROP COLUMN fingerprint"); err != nil {
					t.Fatal(err)
				}
			}
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			ib, err := inbox.New(m.Instrument(inbox.Config{DB: db}))
			if err != nil {
				t.Fatal(err)
			}
			routeThroughInbox(t, ib)(message.NewMessage(watermill.NewUUID(), []byte("order")))
			want := map[bool]float64{true: 1, false: 0}[column]
			var got float64
			var ok bool
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
				if got, ok = gaugeValue(t, reg, "inbox_reused_ids_detected"); ok {
					break
				}
			}
			if !ok || got != want {
				t.Errorf("inbox_reused_ids_detected = %v (exported %v), want %v", got, ok, want)
			}
		})
	}
}

// An inbox configured with ReusedIDsOff does not export
// inbox_reused_ids_detected: turning the check off is a choice, and the
// gauge at 0 had InboxReusedIDsNotDetected page for it after an hour. Nor
// inbox_reused_ids_total, whose series at 0 read as "checked, none
// reused" on a dashboard. The messages are still counted.
func TestReusedIDsDetectedIsNotExportedWhenTheCheckIsOff(t *testing.T) {
	reg, _, ib, _ := sqliteInbox(t, inbox.Config{ReusedIDs: inbox.ReusedIDsOff}, true)
	routeThroughInbox(t, ib)(message.NewMessage(watermill.NewUUID(), []byte("order")))
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if counterSum(t, reg, "inbox_messages_total") > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the processed message was not counted")
		}
	}
	if got, ok := gaugeValue(t, reg, "inbox_reused_ids_detected"); ok {
		t.Errorf("inbox_reused_ids_detected = %v under ReusedIDsOff, want no series", got)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "inbox_reused_ids_total" {
			t.Errorf("inbox_reused_ids_total has %d series under ReusedIDsOff, want none", len(mf.Metric))
		}
	}
}

// The same for a pgxinbox instrumented as docs/operations.md shows
// (pgxinbox.Config{…}.Instrument(m.Instrument)): its Instrument handed
// m.Instrument an inbox.Config without ReusedIDs, read as ReusedIDsRefuse,
// and the gauge was exported at 0.
func TestReusedIDsDetectedIsNotExportedWhenThePgxinboxCheckIsOff(t *testing.T) {
	pool := testdb.OpenPgxPool(t, "")
	table := "inbox_ids_" + testdb.RandomSuffix()
	testdb.DropLater(t, testdb.OpenPostgres(t, ""), table)
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: table, ReusedIDs: inbox.ReusedIDsOff}.Instrument(m.Instrument))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	routeThroughInbox(t, ib.Inbox)(message.NewMessage(watermill.NewUUID(), []byte("order")))
	for deadline := time.Now().Add(5 * time.Second); counterSum(t, reg, "inbox_messages_total") < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the processed message was not counted")
		}
	}
	if got, ok := gaugeValue(t, reg, "inbox_reused_ids_detected"); ok {
		t.Errorf("inbox_reused_ids_detected = %v for a pgxinbox with ReusedIDsOff, want no series", got)
	}
}

// Every outcome of inbox_messages_total exists at 0 from a consumer's first
// message, as the reused-id series do: a failed series born at 1 was a
// first failure that rate() and increase() did not see.
func TestMessagesTotalHasEveryOutcomeFromTheFirstMessage(t *testing.T) {
	reg, _, ib, _ := sqliteInbox(t, inbox.Config{}, true)
	routeThroughInbox(t, ib)(message.NewMessage(watermill.NewUUID(), []byte("order")))
	for deadline := time.Now().Add(5 * time.Second); counterSum(t, reg, "inbox_messages_total") < 1 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "inbox_messages_total" {
			continue
		}
		for _, s := range mf.Metric {
			for _, l := range s.Label {
				if l.GetName() == "outcome" {
					got[l.GetValue()] = s.GetCounter().GetValue()
				}
			}
		}
	}
	want := map[string]float64{metrics.OutcomeProcessed: 1, metrics.OutcomeDuplicate: 0, metrics.OutcomeFailed: 0}
	if len(got) != len(want) || got[metrics.OutcomeProcessed] != 1 || got[metrics.OutcomeDuplicate] != 0 || got[metrics.OutcomeFailed] != 0 {
		t.Errorf("inbox_messages_total by outcome %v, want %v", got, want)
	}
}

package inbox_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The check of an SQLite inbox table's processed_at values reads its oldest
// and newest value by the processed_at index in two seeks, not by a walk of
// the whole index (SQLite's min/max optimisation takes one min() or max() a
// query): it runs at each startup.
func TestVerifyReadsSQLiteProcessedAtRangeByIndexSeeks(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "chk_inbox.db")
	plain := testdb.OpenSQLite(t, path)
	log := &statementLog{}
	db := openRecording(t, plain.Driver(), "file:"+path+"?"+testdb.SQLiteParams, "sqlite", log)
	ctx := context.Background()
	table := "chk_range_" + randomSuffix()
	ib, err := inbox.New(inbox.Config{DB: db, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	log.take()
	if err := ib.Verify(ctx); err != nil {
		t.Fatal(err)
	}
	var reads int
	for _, q := range log.take() {
		if !strings.Contains(strings.ToLower(q), "(processed_at)") || !strings.HasPrefix(strings.TrimSpace(strings.ToUpper(q)), "SELECT") {
			continue
		}
		reads++
		rows, err := plain.QueryContext(ctx, "EXPLAIN QUERY PLAN "+q)
		if err != nil {
			t.Fatal(err)
		}
		var plan []string
		for rows.Next() {
			var id, parent, notused int
			var detail string
			if err := rows.Scan(&id, &parent, &notused, &detail); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, detail)
		}
		rows.Close()
		for _, step := range plan {
			if strings.HasPrefix(step, "SCAN") && step != "SCAN CONSTANT ROW" {
				t.Errorf("Verify's read %q walks the whole table or index (plan %q); want seeks by the processed_at index", q, plan)
			}
		}
	}
	if reads == 0 {
		t.Fatal("Verify read no min/max of processed_at")
	}
}

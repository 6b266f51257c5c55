package entinbox

import (
	"context"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The guards of the inbox transactions (one per message) go once their
// transactions are garbage: the map did not grow with every message.
func TestTxGuardsGoWithTheirTransactions(t *testing.T) {
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "guards.db"))
	size := func() (n int) {
		txGuards.Range(func(any, any) bool { n++; return true })
		return n
	}
	before := size()
	for range 100 {
		tx, err := db.BeginTx(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		first, again := guardOf(tx), guardOf(tx)
		if first != again {
			t.Fatal("two guards for one transaction")
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for size() > before && time.Now().Before(deadline) {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if n := size(); n > before {
		t.Errorf("%d guards left after their 100 transactions were garbage, want %d", n, before)
	}
}

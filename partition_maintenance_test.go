package inbox_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// acceptsAt reports whether a partition of table takes a row at instant at
// (an insert tried in a transaction that is rolled back).
func acceptsAt(t *testing.T, db *sqlx.DB, table string, at time.Time) bool {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, err = tx.Exec("INSERT INTO "+table+" VALUES ('probe', 'probe', $1)", at)
	return err == nil
}

// A partition made by hand inside a day leaves two free ranges of that
// day: both got the library's name for the day, the second CREATE found the
// first, and every CreatePartitions, InitializeSchema and Purger round
// failed with ErrIncompatibleTable; no day got a partition any more and
// claims failed once the partitions made before ran out.
func TestCreatePartitionsFillsBothFreeRangesOfADayAroundAPartitionMadeByHand(t *testing.T) {
	// A table name of 53 bytes, the longest a partitioned table takes, as
	// well: its partitions' names have 63, no room for _2.
	for _, table := range []string{"inbox_" + randomSuffix(), "inbox_" + randomSuffix() + strings.Repeat("x", 53-len("inbox_"+randomSuffix()))} {
		t.Run(strconv.Itoa(len(table))+"-byte-name", func(t *testing.T) { fillsBothFreeRanges(t, table) })
	}
}

func fillsBothFreeRanges(t *testing.T, table string) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ddl, err := inbox.SchemaSQL(inbox.PostgreSQLPartitioned, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(ddl) {
		exec(t, db, stmt)
	}
	day := dbNow(t, db).UTC().Truncate(24*time.Hour).AddDate(0, 0, 2)
	exec(t, db, "CREATE TABLE "+table+"_ops PARTITION OF "+table+" FOR VALUES FROM ('"+day.Add(6*time.Hour).Format(time.RFC3339)+
		"') TO ('"+day.Add(8*time.Hour).Format(time.RFC3339)+"')")

	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -1), 9); err != nil {
		t.Fatalf("CreatePartitions around a partition made by hand from 06:00 to 08:00: %v", err)
	}
	for _, at := range []time.Time{day.Add(3 * time.Hour), day.Add(7 * time.Hour), day.Add(10 * time.Hour)} {
		if !acceptsAt(t, db, table, at) {
			t.Errorf("no partition takes a row at %s", at.Format(time.RFC3339))
		}
	}
	if gaps := uncovered(t, db, table, -1, 7); len(gaps) > 0 {
		t.Errorf("days without a partition: %v", gaps)
	}
	names := strings.Join(partitionNames(t, db, table), " ")
	second := partitionOf(table, inbox.PartitionDay, day) + "_2"
	if len(second) > 63 {
		second = table + day.Format("_p060102") + "_2"
	}
	if !strings.Contains(names, second) {
		t.Errorf("the second free range of %s is not %s: %s", day.Format("2006-01-02"), second, names)
	}

	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatalf("InitializeSchema: %v", err)
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 48 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(ctx); round.Err != nil {
		t.Fatalf("Purger round: %v", round.Err)
	}
	calls := 0
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { calls++; return nil, nil })
	if _, err := h(message.NewMessage("now-1", nil)); err != nil || calls != 1 {
		t.Fatalf("a message now: %v, %d handler calls; want it processed once", err, calls)
	}
}

// An operator renamed a partition to the library's name of a later day:
// the day the library reached that name, its CREATE found the renamed one,
// and every round failed with ErrIncompatibleTable, whose text said the
// table was not one of the inbox table's partitions (it was). Partitions
// go by the catalog's bounds, never by their names.
func TestCreatePartitionsGoesOnPastAPartitionRenamedToALaterDaysName(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	today := dbNow(t, db).UTC().Truncate(24 * time.Hour)
	last := today.AddDate(0, 0, inbox.DefaultPartitionsAhead)
	next := last.AddDate(0, 0, 1)
	exec(t, db, "ALTER TABLE "+partitionOf(table, inbox.PartitionDay, last)+" RENAME TO "+partitionOf(table, inbox.PartitionDay, next))
	if err := inbox.CreatePartitions(ctx, db, table, today, inbox.DefaultPartitionsAhead+3); err != nil {
		t.Fatalf("CreatePartitions past the renamed partition: %v", err)
	}
	if gaps := uncovered(t, db, table, 0, inbox.DefaultPartitionsAhead+2); len(gaps) > 0 {
		t.Errorf("days without a partition: %v", gaps)
	}
	if !acceptsAt(t, db, table, last.Add(time.Hour)) {
		t.Errorf("the renamed partition's own day (%s) takes no row", last.Format("2006-01-02"))
	}
}

// The names the library tries for a range are bounded: with the day's name
// and its _2 to _9 all taken by other tables, the round fails with
// ErrIncompatibleTable, and says which tables are in the way.
func TestCreatePartitionsRefusesWhenEveryNameForARangeIsTaken(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, db)
	day := dbNow(t, db).UTC().Truncate(24*time.Hour).AddDate(0, 0, inbox.DefaultPartitionsAhead+1)
	name := partitionOf(table, inbox.PartitionDay, day)
	for _, suffix := range []string{"", "_2", "_3", "_4", "_5", "_6", "_7", "_8", "_9"} {
		exec(t, db, "CREATE TABLE "+name+suffix+" (x int)")
		t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + name + suffix) })
	}
	err := inbox.CreatePartitions(context.Background(), db, table, day, 1)
	if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), name+"_9") {
		t.Fatalf("CreatePartitions with every name taken: %v; want ErrIncompatibleTable naming %s_9", err, name)
	}
	if acceptsAt(t, db, table, day.Add(12*time.Hour)) {
		t.Errorf("a partition takes rows of %s", day.Format("2006-01-02"))
	}
}

// A generated column added to the partitioned table passes Verify, but a
// partition created as CREATE TABLE ... (LIKE parent) without INCLUDING
// GENERATED has it as a plain column, which PostgreSQL refuses to attach
// (42804): no partition was created any more, and claims failed once the
// partitions made before ran out.
func TestCreatePartitionsOfATableWithAGeneratedColumn(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	exec(t, db, "ALTER TABLE "+table+" ADD COLUMN tenant text GENERATED ALWAYS AS (split_part(consumer, '.', 1)) STORED")
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "acme.billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	today := dbNow(t, db).UTC().Truncate(24 * time.Hour)
	if err := inbox.CreatePartitions(ctx, db, table, today, inbox.DefaultPartitionsAhead+2); err != nil {
		t.Fatalf("CreatePartitions: %v", err)
	}
	exec(t, db, "DROP TABLE "+partitionOf(table, inbox.PartitionDay, today.AddDate(0, 0, 1)))
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(ctx); round.Err != nil {
		t.Fatalf("Purger round: %v", round.Err)
	}
	if gaps := uncovered(t, db, table, 0, inbox.DefaultPartitionsAhead+1); len(gaps) > 0 {
		t.Errorf("days without a partition: %v", gaps)
	}
	var tenant string
	if _, err := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, nil
	})(message.NewMessage("m-1", nil)); err != nil {
		t.Fatalf("claim: %v", err)
	}
	if err := db.Get(&tenant, "SELECT tenant FROM "+table+" WHERE message_id = 'm-1'"); err != nil || tenant != "acme" {
		t.Fatalf("the generated column of the claim: %q, %v; want acme", tenant, err)
	}
}

// refusedWindow is a WindowSource whose every answer is an error.
type refusedWindow struct{ err error }

func (w refusedWindow) SafeWindow(context.Context) (time.Duration, error) { return 0, w.err }

// A Purger round of a partitioned table whose window is refused (a topic
// kept for ever, a broker out of reach) deletes nothing, but it still
// creates the coming partitions: it returned before creating them, and a
// long-running process, which gets partitions only from its rounds, failed
// every claim once those made before ran out.
func TestPartitionedPurgerRoundCreatesPartitionsWhileItsWindowIsRefused(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	today := dbNow(t, db).UTC().Truncate(24 * time.Hour)
	for d := 1; d <= inbox.DefaultPartitionsAhead; d++ {
		exec(t, db, "DROP TABLE "+partitionOf(table, inbox.PartitionDay, today.AddDate(0, 0, d)))
	}
	old := today.AddDate(0, 0, -20)
	if err := inbox.CreatePartitions(ctx, db, table, old, 1); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', $1)", old.Add(12*time.Hour))
	refusal := errors.New("the broker cannot be reached")
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, Window: refusedWindow{refusal}}})
	if err != nil {
		t.Fatal(err)
	}
	round := p.RunOnce(ctx)
	if !errors.Is(round.Err, refusal) {
		t.Fatalf("round error %v; want the window's", round.Err)
	}
	var kept int
	if err := db.Get(&kept, "SELECT count(*) FROM "+table+" WHERE message_id = 'old'"); err != nil || kept != 1 {
		t.Errorf("the row of 20 days ago: %d left (%v), dropped %v; want it kept while the window is refused", kept, err, round.DroppedPartitions)
	}
	if gaps := uncovered(t, db, table, 1, inbox.DefaultPartitionsAhead); len(gaps) > 0 {
		t.Errorf("days without a partition after the round: %v", gaps)
	}
}

//go:build unix

package soak

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/workerproc"
)

var (
	flagLong     = flag.Bool("soak.long", false, "the long soak: 20,000 messages, more kills, leaves and resets")
	flagMessages = flag.Int("soak.messages", 0, "messages to produce (default 2,000; 20,000 with -soak.long)")
	flagTimeout  = flag.Duration("soak.timeout", 0, "deadline per database (default 3m; 30m with -soak.long)")
)

const (
	partitions = 6
	instances  = 3    // worker processes running at once
	resendRate = 0.05 // messages the producer sends twice
	failRate   = 0.05 // handler attempts that fail after writing

	// Copied from internal/testdb (another module's internal package).
	postgresDSNEnv     = "INBOX_TEST_POSTGRES_DSN"
	defaultPostgresDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	startPostgres      = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
	mysqlDSNEnv        = "INBOX_TEST_MYSQL_DSN"
	defaultMySQLDSN    = "root@tcp(127.0.0.1:3306)/test?parseTime=true"
	startMariaDB       = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"
	sqliteParams       = "_journal_mode=WAL&_busy_timeout=10000&_synchronous=NORMAL&_txlock=immediate&_foreign_keys=1"
)

var consumers = []string{"billing", "shipping"}

// uuidPattern groups failures that differ only by message id.
var uuidPattern = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

// plan is the size of a run and when each injection happens. Progress is
// the share of messages that the slower consumer has processed.
type plan struct {
	messages       int
	timeout        time.Duration
	kills          int // at most this many workers SIGKILL themselves
	killLo, killHi int // a doomed worker dies after a random number of commits in [killLo, killHi]
	leaves         []float64
	resets         []float64
}

func newPlan() plan {
	p := plan{messages: 2000, timeout: 3 * time.Minute, kills: 4,
		leaves: []float64{0.2, 0.8}, resets: []float64{0.5}}
	if *flagLong {
		p = plan{messages: 20000, timeout: 30 * time.Minute, kills: 12,
			leaves: []float64{0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.9}, resets: []float64{0.35, 0.7}}
	}
	if *flagMessages > 0 {
		p.messages = *flagMessages
	}
	if *flagTimeout > 0 {
		p.timeout = *flagTimeout
	}
	// Each worker commits for two consumers, and three share the work.
	p.killLo, p.killHi = max(1, p.messages/40), max(2, p.messages/10)
	return p
}

// TestSoak runs the soak (see the package documentation) on SQLite,
// PostgreSQL and MariaDB, one after the other.
func TestSoak(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	t.Run("sqlite", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "soak.db")
		dsn := "file:" + path + "?" + sqliteParams
		runSoak(t, randomSuffix(), "sqlite", dsn, dsn, 4)
	})
	t.Run("postgres", func(t *testing.T) {
		base := os.Getenv(postgresDSNEnv)
		if base == "" {
			base = defaultPostgresDSN
		}
		run := randomSuffix()
		// application_name tells the run's sessions apart from everyone
		// else's in pg_stat_activity.
		runSoak(t, run, "pgx", withParam(base, "application_name=soak_"+run),
			withParam(base, "application_name=soak_"+run+"_check"), 6)
	})
	t.Run("mariadb", func(t *testing.T) {
		dsn := os.Getenv(mysqlDSNEnv)
		if dsn == "" {
			dsn = defaultMySQLDSN
		}
		// The workers report their session ids instead of an
		// application_name (see openDB).
		runSoak(t, randomSuffix(), "mysql", dsn, dsn, 6)
	})
}

// soak is one run on one database.
type soak struct {
	t         *testing.T
	p         plan
	run       string
	driver    string
	workerDSN string
	maxConns  int
	db        *sqlx.DB // the test's own pool, for setup and checks
	deadline  time.Time
	began     time.Time

	brokers  []string
	topic    string
	inbox    string
	business map[string]string
	groups   map[string]string
	expected string
	admin    sarama.ClusterAdmin
	client   sarama.Client

	mu       sync.Mutex // guards tally, failures, the session sets (event readers, connector) and resent (producer)
	tally    map[string]*consumerTally
	failures map[string]int // failures not injected, by kind, consumer and error text

	// MariaDB session ids (CONNECTION_ID()) of the workers and of db.
	workerSessions map[int64]string // id -> worker name
	ownSessions    map[int64]bool

	workers  []*worker // every worker started
	live     []*worker // running, oldest first
	kills    int
	leaves   int
	resets   int
	maxLive  int
	resent   int
	produced chan error
}

type consumerTally struct {
	processed, duplicates, killed int
	injected                      int // the handler's injected failures
	transient                     int // other failures that inbox.IsTransient reports as transient
	failed                        int // failures that are neither
}

func (c consumerTally) deliveries() int {
	return c.processed + c.duplicates + c.injected + c.transient + c.failed + c.killed
}

func runSoak(t *testing.T, run, driver, workerDSN, checkDSN string, maxConns int) {
	p := newPlan()
	s := &soak{
		t: t, p: p, run: run, driver: driver, workerDSN: workerDSN, maxConns: maxConns,
		began: time.Now(), deadline: time.Now().Add(p.timeout),
		topic: "soak_" + run, inbox: "soak_inbox_" + run, expected: "soak_expected_" + run,
		business: map[string]string{}, groups: map[string]string{},
		tally: map[string]*consumerTally{}, failures: map[string]int{},
		workerSessions: map[int64]string{}, ownSessions: map[int64]bool{},
		produced: make(chan error, 1),
	}
	for _, c := range consumers {
		s.business[c] = "soak_" + c + "_" + run
		s.groups[c] = c + "_" + run
		s.tally[c] = &consumerTally{}
	}
	s.db = s.openChecked(checkDSN)
	s.createTables()

	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, s.topic),
		kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	s.brokers = cluster.ListenAddrs()
	if s.client, err = sarama.NewClient(s.brokers, consumerConfig("soak-admin")); err != nil {
		t.Fatal(err)
	}
	if s.admin, err = sarama.NewClusterAdminFromClient(s.client); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.admin.Close() })
	t.Cleanup(s.killAll) // runs first: no worker outlives the test

	ids := make([]string, p.messages)
	for i := range ids {
		ids[i] = watermill.NewUUID()
	}
	s.insertExpected(ids)
	go func() { s.produced <- s.produce(ids) }()
	for range instances {
		s.start()
	}
	s.supervise()
	s.stopAll()
	elapsed := time.Since(s.began)
	s.check()
	s.report(elapsed)
}

// supervise keeps three workers running, injects the leaves and resets at
// their points of progress, and returns once every message is processed by
// every consumer and both groups have committed the end of every partition.
func (s *soak) supervise() {
	t := s.t
	produced := false
	nextLeave, nextReset := 0, 0
	lastLog := time.Now()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		if time.Now().After(s.deadline) {
			s.fail("deadline of %v passed", s.p.timeout)
		}
		if !produced {
			select {
			case err := <-s.produced:
				if err != nil {
					t.Fatalf("produce: %v", err)
				}
				produced = true
			default:
			}
		}
		s.reap()
		counts := s.progress()
		done := produced
		slowest := s.p.messages
		for _, c := range consumers {
			slowest = min(slowest, counts[c])
			done = done && counts[c] == s.p.messages
		}
		progress := float64(slowest) / float64(s.p.messages)
		if done {
			if lag, _ := s.lag(); lag == 0 {
				return
			}
		}
		if time.Since(lastLog) > 10*time.Second {
			lastLog = time.Now()
			s.logf("progress %v", counts)
		}
		switch {
		case nextReset < len(s.p.resets) && progress >= s.p.resets[nextReset]:
			nextReset++
			s.reset()
		case nextLeave < len(s.p.leaves) && progress >= s.p.leaves[nextLeave]:
			nextLeave++
			if len(s.live) == 0 {
				break
			}
			// Not the doomed worker, when another is live: it was the
			// oldest one, and leaving it took the run's SIGKILL after a
			// commit away (a run injected none).
			w := s.live[0]
			for _, l := range s.live {
				if l.killAfter == 0 {
					w = l
					break
				}
			}
			s.logf("%s leaves the groups (graceful stop), a new worker joins", w.Name)
			s.stop(w)
			s.leaves++
			s.start()
		}
	}
}

// reset stops every worker, deletes both consumer groups (their committed
// offsets) and starts new workers, which begin at the oldest offset again.
func (s *soak) reset() {
	s.logf("reset: stop all workers, delete the groups' offsets, replay from the start")
	s.stopAll()
	for _, c := range consumers {
		for {
			// A killed member stays in the group until its session expires.
			err := s.admin.DeleteConsumerGroup(s.groups[c])
			if err == nil {
				break
			}
			if time.Now().After(s.deadline) {
				s.fail("delete consumer group %s: %v", s.groups[c], err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	s.resets++
	for range instances {
		s.start()
	}
}

// worker is one worker process.
type worker struct {
	*workerproc.Process
	killAfter  int
	killedSelf bool // set before Done is closed
}

func (s *soak) start() *worker {
	w := &worker{}
	pending := 0
	for _, l := range s.live {
		if l.killAfter > 0 {
			pending++
		}
	}
	// One doomed worker at a time, so that the kills spread over the run.
	if pending == 0 && s.kills < s.p.kills {
		w.killAfter = s.p.killLo + mrand.IntN(s.p.killHi-s.p.killLo+1)
	}
	name := fmt.Sprintf("worker-%d", len(s.workers)+1)
	cfg := workerConfig{
		Name: name, Brokers: s.brokers, Topic: s.topic, Driver: s.driver, DSN: s.workerDSN,
		MaxConns: s.maxConns, Inbox: s.inbox, Business: s.business, Groups: s.groups,
		KillAfter: w.killAfter, FailRate: failRate, ParentPID: os.Getpid(),
	}
	w.Process = workerproc.Start(s.t, name, "TestSoakWorker", workerEnv, cfg, s.p.timeout+2*time.Minute,
		func(kind, detail string) { s.event(w, name, kind, detail) })
	s.workers = append(s.workers, w)
	s.live = append(s.live, w)
	s.maxLive = max(s.maxLive, len(s.live))
	if w.killAfter > 0 {
		s.logf("%s joins; it will SIGKILL itself after its commit #%d", w.Name, w.killAfter)
	} else {
		s.logf("%s joins", w.Name)
	}
	return w
}

// event counts one event of worker w (name).
func (s *soak) event(w *worker, name, kind, detail string) {
	consumer, rest, _ := strings.Cut(detail, " ")
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.tally[consumer]
	switch {
	case kind == evSession:
		var id int64
		fmt.Sscan(detail, &id)
		s.workerSessions[id] = name
	case c == nil:
		s.failures["unknown event: "+kind+" "+detail]++
	case kind == evProcessed:
		c.processed++
	case kind == evDuplicate:
		c.duplicates++
	case kind == evInjected:
		c.injected++
	case kind == evKill:
		c.killed++
		w.killedSelf = true
	case kind == evTransient:
		c.transient++
		s.failures["transient "+consumer+": "+uuidPattern.ReplaceAllString(rest, "<id>")]++
	case kind == evFailed:
		c.failed++
		s.failures["NOT TRANSIENT "+consumer+": "+uuidPattern.ReplaceAllString(rest, "<id>")]++
	}
}

// reap handles the workers that exited while running: one that killed
// itself is counted and replaced; any other exit fails the test.
func (s *soak) reap() {
	for _, w := range slices.Clone(s.live) {
		select {
		case <-w.Done:
		default:
			continue
		}
		s.remove(w)
		if !w.killedSelf {
			s.fail("%s exited on its own (%v):\n%s", w.Name, w.State, w.Out)
		}
		s.kills++
		s.logf("%s was SIGKILLed after commit #%d, before its ack", w.Name, w.killAfter)
		s.start()
	}
}

func (s *soak) remove(w *worker) {
	s.live = slices.DeleteFunc(s.live, func(l *worker) bool { return l == w })
}

// stop asks one worker to stop and waits for it.
func (s *soak) stop(w *worker) {
	s.terminate(w)
	s.await(w)
}

// stopAll asks every running worker to stop, and waits for them.
func (s *soak) stopAll() {
	for _, w := range s.live {
		s.terminate(w)
	}
	for _, w := range slices.Clone(s.live) {
		s.await(w)
	}
}

// terminate sends SIGTERM once the worker handles it.
func (s *soak) terminate(w *worker) {
	if err := w.Terminate(time.Minute); err != nil {
		s.fail("%v", err)
	}
}

// await waits for a worker asked to stop, checks that it stopped cleanly
// with no connection in use, and removes it from s.live.
func (s *soak) await(w *worker) {
	if err := w.Await(time.Minute); err != nil { // its router's CloseTimeout is 45 s
		s.fail("%v", err)
	}
	s.remove(w)
	if w.killedSelf { // before or while it stopped
		s.kills++
		s.logf("%s was SIGKILLed after commit #%d, before its ack", w.Name, w.killAfter)
	} else if err := w.CleanExit(); err != nil {
		s.t.Error(err)
	}
}

// killAll kills what is still running, at the end of a failed test.
func (s *soak) killAll() {
	for _, w := range s.workers {
		w.Kill()
	}
}

// fail reports where the run stands and fails the test.
func (s *soak) fail(format string, args ...any) {
	s.t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, format, args...)
	fmt.Fprintf(&b, "\nafter %v: distinct messages processed per consumer %v of %d",
		time.Since(s.began).Round(time.Millisecond), s.progress(), s.p.messages)
	for _, c := range consumers {
		var missing []string
		s.db.Select(&missing, s.db.Rebind("SELECT e.message_id FROM "+s.expected+" e WHERE NOT EXISTS (SELECT 1 FROM "+
			s.business[c]+" b WHERE b.message_id = e.message_id) ORDER BY e.message_id LIMIT 5"))
		fmt.Fprintf(&b, "\n%s: first missing message ids %v", c, missing)
	}
	if _, detail := s.lag(); detail != "" {
		fmt.Fprintf(&b, "\nconsumer group lag: %s", detail)
	}
	fmt.Fprintf(&b, "\n%s", s.counts())
	for _, w := range s.live {
		fmt.Fprintf(&b, "\n--- %s (running), last output:\n%s", w.Name, w.Out)
	}
	s.t.Fatal(b.String())
}

// progress returns the distinct messages each consumer has committed.
func (s *soak) progress() map[string]int {
	counts := map[string]int{}
	for _, c := range consumers {
		var n int
		if err := s.db.Get(&n, "SELECT COUNT(DISTINCT message_id) FROM "+s.business[c]); err != nil {
			s.t.Fatalf("count %s: %v", s.business[c], err)
		}
		counts[c] = n
	}
	return counts
}

// lag returns the records of the topic that the consumer groups have not
// committed yet, in total and per group and partition.
func (s *soak) lag() (int64, string) {
	parts := make([]int32, partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	var total int64
	var detail []string
	for _, c := range consumers {
		resp, err := s.admin.ListConsumerGroupOffsets(s.groups[c], map[string][]int32{s.topic: parts})
		if err != nil {
			return -1, fmt.Sprintf("%s: %v", c, err)
		}
		var lags []string
		for _, p := range parts {
			end, err := s.client.GetOffset(s.topic, p, sarama.OffsetNewest)
			if err != nil {
				return -1, fmt.Sprintf("%s/%d: %v", c, p, err)
			}
			committed := int64(0)
			if b := resp.GetBlock(s.topic, p); b != nil && b.Offset > 0 {
				committed = b.Offset
			}
			total += end - committed
			lags = append(lags, fmt.Sprint(end-committed))
		}
		detail = append(detail, c+" ["+strings.Join(lags, " ")+"]")
	}
	return total, strings.Join(detail, ", ")
}

// produce publishes every message once and 5 % of them a second time (same
// UUID), later in the stream and keyed differently, so that the copy usually
// lands on another partition and may be handled at the same moment by
// another worker.
func (s *soak) produce(ids []string) error {
	cfg := kafka.DefaultSaramaSyncPublisherConfig()
	cfg.Version = sarama.V2_8_0_0
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: s.brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
			return msg.Metadata.Get("soak_key"), nil
		}),
		OverwriteSaramaConfig: cfg,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer pub.Close()
	n := len(ids)
	later := make([][]int, n+1) // later[j]: messages re-sent just before message j (n: at the end)
	resends := 0
	for i := range n {
		if mrand.Float64() < resendRate || (i == n-1 && resends == 0) {
			j := i + 1 + mrand.IntN(n-i)
			later[j] = append(later[j], i)
			resends++
		}
	}
	var batch []*message.Message
	flush := func() error {
		err := pub.Publish(s.topic, batch...)
		batch = batch[:0]
		return err
	}
	add := func(i int, key string) error {
		msg := message.NewMessage(ids[i], []byte(fmt.Sprintf(`{"n":%d}`, i)))
		msg.Metadata.Set("soak_key", key)
		batch = append(batch, msg)
		if len(batch) == 200 {
			return flush()
		}
		return nil
	}
	for j := 0; j <= n; j++ {
		for _, i := range later[j] {
			if err := add(i, ids[i]+"/resend"); err != nil {
				return err
			}
		}
		if j < n {
			if err := add(j, ids[j]); err != nil {
				return err
			}
		}
	}
	if err := flush(); err != nil {
		return err
	}
	s.mu.Lock()
	s.resent = resends
	s.mu.Unlock()
	return nil
}

func (s *soak) createTables() {
	t := s.t
	ib, err := inbox.New(inbox.Config{DB: s.db, Table: s.inbox})
	if err != nil {
		t.Fatal(err)
	}
	s.dropLater(s.inbox)
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	ib.Close()
	stmts := []string{"CREATE TABLE " + s.expected + " (message_id VARCHAR(255) NOT NULL PRIMARY KEY)"}
	s.dropLater(s.expected)
	for _, c := range consumers {
		// No unique key on message_id: processing a message twice must show
		// as two rows, not as a constraint error that hides it.
		b := s.business[c]
		stmts = append(stmts,
			"CREATE TABLE "+b+" (message_id VARCHAR(255) NOT NULL, worker VARCHAR(64) NOT NULL)",
			"CREATE INDEX "+b+"_message_id ON "+b+" (message_id)")
		s.dropLater(b)
	}
	for _, q := range stmts {
		if _, err := s.db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
}

func (s *soak) insertExpected(ids []string) {
	for lo := 0; lo < len(ids); lo += 500 {
		chunk := ids[lo:min(len(ids), lo+500)]
		q := "INSERT INTO " + s.expected + " (message_id) VALUES " + strings.TrimSuffix(strings.Repeat("(?),", len(chunk)), ",")
		args := make([]any, len(chunk))
		for i, id := range chunk {
			args[i] = id
		}
		if _, err := s.db.Exec(s.db.Rebind(q), args...); err != nil {
			s.t.Fatal(err)
		}
	}
}

func (s *soak) dropLater(table string) {
	s.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := s.db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table); err != nil {
			s.t.Logf("drop %s: %v", table, err)
		}
	})
}

// check asserts the invariants once every worker has stopped.
func (s *soak) check() {
	t := s.t
	n := s.p.messages
	for _, c := range consumers {
		b := s.business[c]
		for _, q := range []struct {
			what  string
			query string
			want  int
		}{
			{"business rows", "SELECT COUNT(*) FROM " + b, n},
			{"distinct messages with a business row", "SELECT COUNT(DISTINCT message_id) FROM " + b, n},
			{"messages produced without a business row",
				"SELECT COUNT(*) FROM " + s.expected + " e WHERE NOT EXISTS (SELECT 1 FROM " + b + " b WHERE b.message_id = e.message_id)", 0},
			{"business rows of no message produced",
				"SELECT COUNT(*) FROM " + b + " b WHERE NOT EXISTS (SELECT 1 FROM " + s.expected + " e WHERE e.message_id = b.message_id)", 0},
			{"inbox rows", "SELECT COUNT(*) FROM " + s.inbox + " WHERE consumer = '" + c + "'", n},
			{"inbox rows without their business row",
				"SELECT COUNT(*) FROM " + s.inbox + " i WHERE i.consumer = '" + c + "' AND NOT EXISTS (SELECT 1 FROM " + b + " b WHERE b.message_id = i.message_id)", 0},
			{"business rows without their inbox row",
				"SELECT COUNT(*) FROM " + b + " b WHERE NOT EXISTS (SELECT 1 FROM " + s.inbox + " i WHERE i.consumer = '" + c + "' AND i.message_id = b.message_id)", 0},
		} {
			var got int
			if err := s.db.Get(&got, q.query); err != nil {
				t.Fatalf("%s: %v", q.query, err)
			}
			if got != q.want {
				t.Errorf("%s: %s = %d, want %d", c, q.what, got, q.want)
			}
		}
		var twice []string
		s.db.Select(&twice, "SELECT message_id FROM "+b+" GROUP BY message_id HAVING COUNT(*) > 1 ORDER BY message_id LIMIT 5")
		if len(twice) > 0 {
			t.Errorf("%s: messages processed more than once, e.g. %v", c, twice)
		}
	}
	var others int
	if err := s.db.Get(&others, "SELECT COUNT(*) FROM "+s.inbox+" WHERE consumer NOT IN ('billing', 'shipping')"); err != nil {
		t.Fatal(err)
	}
	if others != 0 {
		t.Errorf("%d inbox rows of other consumers, want 0", others)
	}
	for _, w := range s.workers {
		if strings.Contains(w.Out.String(), "WARNING: DATA RACE") {
			t.Errorf("%s: data race:\n%s", w.Name, w.Out)
		}
	}
	switch s.driver {
	case "pgx":
		s.checkSessions()
	case "mysql":
		s.checkMariaDBSessions()
	}
	if n := s.db.Stats().InUse; n != 0 {
		t.Errorf("the test's own pool has %d connections in use, want 0", n)
	}

	// Every failure but the injected ones is one that inbox.IsTransient
	// reports as transient (a deadlock, a lost connection, a context ended
	// by a graceful stop): a PoisonQueue filtered on IsTransient, as the
	// README advises, would have set any other aside, its effect lost.
	for _, c := range consumers {
		if n := s.tally[c].failed; n > 0 {
			t.Errorf("%s: %d failures that inbox.IsTransient does not report as transient (see NOT TRANSIENT below)", c, n)
		}
	}

	// Every injected cause happened.
	for _, c := range consumers {
		tl := s.tally[c]
		if tl.duplicates == 0 {
			t.Errorf("%s: no duplicate was skipped: redelivery did not happen", c)
		}
		if tl.injected == 0 {
			t.Errorf("%s: no handler failure was injected", c)
		}
	}
	for _, x := range []struct {
		what string
		n    int
	}{{"producer re-sends", s.resendCount()}, {"workers SIGKILLed after a commit", s.kills},
		{"workers that left the groups", s.leaves}, {"offset resets", s.resets}} {
		if x.n == 0 {
			t.Errorf("no %s: the soak did not inject them", x.what)
		}
	}
	if s.maxLive != instances {
		t.Errorf("at most %d workers ran at once, want %d", s.maxLive, instances)
	}
}

// checkSessions asserts that no session of the workers is left on the
// server: a SIGKILLed worker's sessions end when the server sees the socket
// close, and none of ours may be idle in a transaction.
func (s *soak) checkSessions() {
	app := "soak_" + s.run
	var left []string
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		left = left[:0]
		if err := s.db.Select(&left, `SELECT application_name || ' pid ' || pid || ': ' || COALESCE(state, '') || ': ' || COALESCE(query, '')
			FROM pg_stat_activity WHERE application_name IN ($1, $2) AND (application_name = $1 OR state LIKE 'idle in transaction%')`,
			app, app+"_check"); err != nil {
			s.t.Fatal(err)
		}
		if len(left) == 0 || time.Now().After(end) {
			break
		}
	}
	if len(left) > 0 {
		s.t.Errorf("sessions left on PostgreSQL after every worker exited:\n%s", strings.Join(left, "\n"))
	}
}

func (s *soak) resendCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resent
}

func (s *soak) counts() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "messages=%d producer_resends=%d workers_started=%d killed_after_commit=%d left=%d resets=%d",
		s.p.messages, s.resent, len(s.workers), s.kills, s.leaves, s.resets)
	for _, c := range consumers {
		tl := s.tally[c]
		fmt.Fprintf(&b, "\n%-8s deliveries=%d processed=%d duplicates_skipped=%d injected_failures=%d transient_failures=%d other_failures=%d killed_before_ack=%d",
			c, tl.deliveries(), tl.processed, tl.duplicates, tl.injected, tl.transient, tl.failed, tl.killed)
	}
	if len(s.failures) > 0 {
		var fs []string
		for f, n := range s.failures {
			fs = append(fs, fmt.Sprintf("%dx %s", n, f))
		}
		sort.Strings(fs)
		if len(fs) > 10 {
			fs = append(fs[:10], fmt.Sprintf("... %d more kinds", len(fs)-10))
		}
		fmt.Fprintf(&b, "\nfailures not injected (nacked and redelivered):\n  %s", strings.Join(fs, "\n  "))
	}
	return b.String()
}

func (s *soak) report(elapsed time.Duration) {
	s.t.Logf("soak on %s: %d messages over %d partitions in %v\n%s", s.t.Name(), s.p.messages, partitions,
		elapsed.Round(time.Millisecond), s.counts())
}

func (s *soak) logf(format string, args ...any) {
	s.t.Helper()
	s.t.Logf("%7.1fs "+format, append([]any{time.Since(s.began).Seconds()}, args...)...)
}

// openChecked opens the test's pool. A PostgreSQL or MariaDB server that
// cannot be reached skips the test locally and fails it when CI=true, as
// internal/testdb does.
func (s *soak) openChecked(dsn string) *sqlx.DB {
	t := s.t
	db, err := openDB(s.driver, dsn, func(id int64) {
		s.mu.Lock()
		s.ownSessions[id] = true
		s.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(4)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		server, ok := map[string]struct{ what, start, env string }{
			"pgx":   {"PostgreSQL", startPostgres, postgresDSNEnv},
			"mysql": {"MariaDB", startMariaDB, mysqlDSNEnv},
		}[s.driver]
		var netErr *net.OpError
		if !ok || !errors.As(err, &netErr) {
			t.Fatal(err) // reachable, but refused us: a real failure
		}
		msg := fmt.Sprintf("%s not reachable (%v): start it with `%s`, or point %s at a server", server.what, err, server.start, server.env)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return db
}

func withParam(dsn, param string) string {
	if strings.Contains(dsn, "?") {
		return dsn + "&" + param
	}
	return dsn + "?" + param
}

func randomSuffix() string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

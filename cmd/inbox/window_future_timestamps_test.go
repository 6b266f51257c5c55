package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "-future-timestamps 0" (producers stamp no record ahead of the brokers'
// clocks) gives the window without that allowance, or is a usage error as
// "-margin 0" is: it must not silently become the 1h default, a window
// other than the one the operator asked for.
func TestStatsFutureTimestampsZeroIsNotTheDefault(t *testing.T) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(cluster.ListenAddrs(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	r, s, stamps := fmt.Sprint(time.Hour.Milliseconds()), fmt.Sprint((10 * time.Minute).Milliseconds()), "CreateTime"
	if err := admin.CreateTopic("orders", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"retention.ms": &r, "segment.ms": &s, "message.timestamp.type": &stamps}}, false); err != nil {
		t.Fatal(err)
	}
	admin.Close()
	path := filepath.Join(t.TempDir(), "k.db")
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	testdb.OpenSQLite(t, path)
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-table", "inbox_table", "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	window := func(future string) (int, string) {
		code, out, errOut := cli(t, "stats", "-db", dsn, "-table", "inbox_table", "-brokers", strings.Join(cluster.ListenAddrs(), ","),
			"-topics", "orders", "-margin", "20m", "-future-timestamps", future)
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "window:") {
				return code, line
			}
		}
		return code, out + errOut
	}
	_, oneMs := window("1ms")
	_, hour := window("1h")
	code, zero := window("0")
	if code != 2 && zero == hour && zero != oneMs {
		t.Errorf("stats -future-timestamps 0: exit %d, %q: the window of -future-timestamps 1h (%q), not of 1ms (%q); want that window, or a usage error",
			code, zero, hour, oneMs)
	}
}

package jetstreamretention_test

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/watermill-inbox/inbox/jetstreamretention"
)

// ownNATSServer starts a nats-server with JetStream on a free port, storing
// in dir, and returns its URL and a function that stops it.
func ownNATSServer(t *testing.T, dir string, port int) (string, func()) {
	t.Helper()
	cmd := exec.Command("nats-server", "-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", dir)
	if err := cmd.Start(); err != nil {
		t.Skipf("nats-server: %v", err)
	}
	stop := func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() }
	url := "nats://127.0.0.1:" + strconv.Itoa(port)
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(50 * time.Millisecond) {
		nc, err := nats.Connect(url, nats.NoReconnect())
		if err == nil {
			nc.Close()
			return url, stop
		}
		if time.Now().After(deadline) {
			stop()
			t.Fatalf("nats-server on port %d did not start: %v", port, err)
		}
	}
}

// A Source that New connected lives as long as its Purger. After an outage
// longer than nats.go's reconnect budget (60 tries; 2 s apart by default,
// 20 ms here to keep the test short) its connection was closed for good,
// and every purge round failed until the process restarted, the server long
// back. It reconnects for ever unless its Options say otherwise.
func TestSourceFindsTheWindowAgainAfterAnOutageLongerThanNATSReconnects(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := t.TempDir()
	url, stop := ownNATSServer(t, dir, port)
	defer func() { stop() }()
	nc, err := nats.Connect(url, nats.NoReconnect())
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTAGE", Subjects: []string{"outage.orders"}, MaxAge: time.Hour})
	nc.Close()
	if err != nil {
		t.Fatal(err)
	}
	src, err := jetstreamretention.New(jetstreamretention.Config{URL: url, Streams: []string{"OUTAGE"},
		Options: []nats.Option{nats.ReconnectWait(20 * time.Millisecond), nats.ReconnectJitter(0, 0)}})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := src.SafeWindow(ctx); err != nil {
		t.Fatalf("SafeWindow before the outage: %v", err)
	}
	stop()
	time.Sleep(3 * time.Second)           // 60 reconnects 20 ms apart took 1.2 s
	_, stop = ownNATSServer(t, dir, port) // the same URL
	var last error
	for deadline := time.Now().Add(waitTimeout); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
		_, last = src.SafeWindow(wctx)
		wcancel()
		if last == nil {
			return
		}
	}
	t.Fatalf("SafeWindow after the server came back: %v (every purge round fails until the process restarts)", last)
}

package main

import (
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/watermill-inbox/inbox/jetstreamretention"
)

// jetStreamFlags are the purge flags that take the safe window from NATS
// JetStream streams, as -brokers and -topics take it from Kafka topics.
type jetStreamFlags struct {
	url     string
	streams listFlag
}

func addJetStreamFlags(fs *flag.FlagSet) *jetStreamFlags {
	f := &jetStreamFlags{}
	fs.StringVar(&f.url, "nats-url", "", "NATS server URL (several comma-separated): derive the safe window from the -nats-stream streams")
	fs.Var(&f.streams, "nats-stream", "a JetStream `stream` the consumer reads (with -nats-url); repeat the flag or separate names with commas")
	return f
}

// set reports whether the window is to come from JetStream.
func (f *jetStreamFlags) set() bool { return f.url != "" }

// check reports the usage errors of the JetStream flags: -nats-url and
// -nats-stream go together, and exclude Kafka's -brokers (a purge has one
// window source).
func (f *jetStreamFlags) check(kafka bool) error {
	if (f.url == "") != (len(f.streams) == 0) {
		return fmt.Errorf("%w: -nats-url and -nats-stream go together", errUsage)
	}
	if f.set() && kafka {
		return fmt.Errorf("%w: -brokers and -nats-url exclude each other (one window source per purge)", errUsage)
	}
	return nil
}

// source connects to the server and returns the window source of the
// streams; the caller closes it.
func (f *jetStreamFlags) source(margin time.Duration) (*jetstreamretention.Source, error) {
	return jetstreamretention.New(jetstreamretention.Config{
		URL: f.url, Streams: f.streams, Margin: margin,
		Options: []nats.Option{nats.Name("inbox purge"), nats.Timeout(10 * time.Second), nats.NoReconnect()},
	})
}

// splitList splits a comma-separated flag value into its items, each
// trimmed of spaces, the empty ones dropped: " orders, payments," is
// [orders payments].
func splitList(v string) []string {
	var l listFlag
	l.Set(v) // never fails
	return l
}

// listFlag is a flag that may be repeated, each value a comma-separated
// list; empty items are dropped, and a value with none is refused (a
// script's unset variable, as for every flag: see parse).
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	if strings.Trim(v, ", \t") == "" {
		return errors.New("empty (an unset variable?): give it a value, or leave the flag out")
	}
	for _, item := range strings.Split(v, ",") {
		if item = strings.TrimSpace(item); item != "" {
			*l = append(*l, item)
		}
	}
	return nil
}

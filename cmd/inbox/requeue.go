package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/watermill-inbox/inbox"
)

// idList is a flag of outbox ids: repeated, or comma-separated.
type idList []int64

func (l *idList) String() string {
	s := make([]string, len(*l))
	for i, id := range *l {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ",")
}

func (l *idList) Set(v string) error {
	for _, part := range strings.Split(v, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
		if err != nil {
			return fmt.Errorf("not an outbox id: %q", part)
		}
		*l = append(*l, id)
	}
	return nil
}

// requeueCmd moves dead letters of an inbox.Outbox back to its outbox
// table (inbox.RequeueDeadLetters), where the service's relay sends them
// again with their UUIDs.
func requeueCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := flag.NewFlagSet("inbox requeue", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.dsn, "db", os.Getenv("INBOX_DB"), "database DSN (default $INBOX_DB); see \"inbox -h\"")
	fs.StringVar(&c.dialect, "dialect", "", "postgres, postgres-partitioned, mysql or sqlite (default: from the DSN)")
	table := fs.String("outbox-table", inbox.DefaultOutboxTable, "the outbox table, optionally schema-qualified; its dead letters are in its dead-letter table (<table>_dead, or that name shortened with a hash past 58 bytes: Outbox.DeadLetterTable)")
	var ids idList
	fs.Var(&ids, "id", "a dead letter's id (its outbox id: the id column of the dead-letter table); repeat it or separate ids with commas")
	topic := fs.String("topic", "", "the dead letters of this topic (with -id: those of the ids that are on it)")
	all := fs.Bool("all", false, "every dead letter")
	if err := parse(fs, args); err != nil {
		return err
	}
	sel := inbox.DeadLetterSelection{IDs: ids, Topic: *topic, All: *all}
	switch {
	case sel.All && (len(sel.IDs) > 0 || sel.Topic != ""):
		return fmt.Errorf("%w: -all moves every dead letter: give it without -id and -topic", errUsage)
	case !sel.All && len(sel.IDs) == 0 && sel.Topic == "":
		return fmt.Errorf("%w: choose the dead letters to move: -id, -topic or -all", errUsage)
	}
	db, d, err := c.open(ctx, false)
	if err != nil {
		return err
	}
	defer db.Close()
	moved, err := inbox.RequeueDeadLetters(ctx, db, d, *table, sel)
	if err != nil {
		if moved > 0 {
			return fmt.Errorf("%w (%s moved back before it, committed)", err, count(int64(moved), "dead letter"))
		}
		return err
	}
	fmt.Fprintf(stdout, "moved %s back to %s: its relay sends them at its next round\n", count(int64(moved), "dead letter"), *table)
	return nil
}

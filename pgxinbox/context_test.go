package pgxinbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A handler that asks the wrong package for its transaction gets false, and
// the MissingTxError it returns (wrapping inbox.ErrNoTx) names the package
// whose TxFromContext returns it; the message is nacked and nothing is
// written. The right package's MissingTxError is nil. Both backends run
// through a real router on the same PostgreSQL.
func TestMissingTxError_namesTheOtherBackendsTxFromContext(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx-missing-tx", nil)
	for _, tc := range []struct {
		name string
		// middleware returns the Inbox's middleware on the fixture's table.
		middleware func(t *testing.T, f *fixture) message.HandlerMiddleware
		// wrong and right are the TxFromContext and MissingTxError of the
		// package the handler asks by mistake, and of the right one.
		wrong, right func(ctx context.Context) (bool, error)
		want         string // what the wrong package's error tells the user to call
	}{
		{
			name: "pgxinbox asked through inbox",
			middleware: func(t *testing.T, f *fixture) message.HandlerMiddleware {
				return f.newInbox(pgxinbox.Config{}).Middleware
			},
			wrong: sqlTx,
			right: pgxTx,
			want:  "call pgxinbox.TxFromContext",
		},
		{
			name: "inbox asked through pgxinbox",
			middleware: func(t *testing.T, f *fixture) message.HandlerMiddleware {
				ib, err := inbox.New(inbox.Config{DB: pgxinbox.DB(f.pool), Table: f.table})
				if err != nil {
					t.Fatal(err)
				}
				if err := ib.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
				return ib.Middleware
			},
			wrong: pgxTx,
			right: sqlTx,
			want:  "call inbox.TxFromContext",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, pool)
			mw := tc.middleware(t, f)
			var rightOK bool
			var rightErr error
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, mw)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					rightOK, rightErr = tc.right(msg.Context())
					if ok, err := tc.wrong(msg.Context()); !ok {
						return err
					}
					return errors.New("the wrong package's TxFromContext returned a transaction")
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked")
			}
			err := rec.last()
			if !errors.Is(err, inbox.ErrNoTx) {
				t.Fatalf("handler returned %v, want inbox.ErrNoTx", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%q does not say %q", err, tc.want)
			}
			if !inbox.IsTransient(err) {
				t.Errorf("IsTransient(%v) = false: a poison filter would drain the topic for a setup mistake", err)
			}
			if !rightOK || rightErr != nil {
				t.Errorf("the right package: TxFromContext ok=%v, MissingTxError %v; want true, nil", rightOK, rightErr)
			}
			if n := f.inboxRows(); n != 0 {
				t.Errorf("%d inbox rows after the nack, want 0", n)
			}
		})
	}

	// Without any inbox middleware, both say to add one.
	t.Run("no middleware", func(t *testing.T) {
		t.Parallel()
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				_, sqlErr := sqlTx(msg.Context())
				_, pgxErr := pgxTx(msg.Context())
				return errors.Join(sqlErr, pgxErr)
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked")
		}
		err := rec.last()
		if !errors.Is(err, inbox.ErrNoTx) {
			t.Fatalf("handler returned %v, want inbox.ErrNoTx", err)
		}
		if n := strings.Count(err.Error(), "Middleware runs around this handler"); n != 2 {
			t.Errorf("%q: want both errors to say that no inbox middleware runs", err)
		}
	})
}

// sqlTx and pgxTx are each package's TxFromContext and MissingTxError.
func sqlTx(ctx context.Context) (bool, error) {
	_, ok := inbox.TxFromContext(ctx)
	return ok, inbox.MissingTxError(ctx)
}

func pgxTx(ctx context.Context) (bool, error) {
	_, ok := pgxinbox.TxFromContext(ctx)
	return ok, pgxinbox.MissingTxError(ctx)
}

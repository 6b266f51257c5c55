package inbox_test

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A PostgreSQL database whose encoding is SQL_ASCII converts nothing: every
// session stores and reads the bytes it sends, whatever its client_encoding.
// pgx sends no client_encoding, so its sessions there read
// current_setting('client_encoding') = SQL_ASCII, and the session check
// refuses them (ErrInvalidConfig, "converts every string between it and the
// database's UTF8") although an id they store is byte for byte the id a
// UTF8 session (lib/pq) stores and finds. A setup that works must not be
// refused at startup, nor at each Purge and Stats.
func TestPostgresSQLASCIIDatabaseSessionsOfPgxAreAccepted(t *testing.T) {
	plain := testdb.OpenPostgres(t, "")
	name := "chk_ascii_" + randomSuffix()
	exec(t, plain, "CREATE DATABASE "+name+" ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
	t.Cleanup(func() { _, _ = plain.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)") })
	u, err := url.Parse(testdb.PostgresDSN())
	if err != nil {
		t.Skip(err)
	}
	u.Path = "/" + name
	open := func(driver, dsn string) *sqlx.DB {
		db, err := sqlx.Open(driver, dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		return db
	}
	pgx := open("pgx", u.String())
	pq := open("postgres", u.String())
	ctx := context.Background()
	table := "chk_ascii_inbox"

	// The setup works: an id stored by a pgx session (SQL_ASCII) is the id a
	// lib/pq session (UTF8) finds, byte for byte.
	exec(t, pgx, "CREATE TABLE chk_probe (id text PRIMARY KEY)")
	exec(t, pgx, "INSERT INTO chk_probe VALUES ($1)", "ünï-id")
	var n int
	if err := pq.Get(&n, "SELECT count(*) FROM chk_probe WHERE id = $1", "ünï-id"); err != nil || n != 1 {
		t.Fatalf("a lib/pq session found %d row(s) (%v) of the id a pgx session stored; the premise fails", n, err)
	}

	ib, err := inbox.New(inbox.Config{DB: pgx, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("InitializeSchema refused pgx's sessions on a SQL_ASCII database, which convert nothing: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	if _, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: pgx, Table: table, OlderThan: time.Hour}); err != nil {
		t.Fatalf("Purge: %v", err)
	}
}

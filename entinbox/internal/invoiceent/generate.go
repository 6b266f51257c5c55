// Package invoiceent is the ent client the entinbox tests use, generated
// from ./schema by ent v0.14.5 with the sql/execquery feature (the client's
// and the Tx's ExecContext and QueryContext, which entinbox must guard as
// it guards the builders' statements; run `go generate ./...` in entinbox
// after changing the schema, and commit the result).
package invoiceent

//go:generate go run entgo.io/ent/cmd/ent@v0.14.5 generate --feature sql/execquery ./schema

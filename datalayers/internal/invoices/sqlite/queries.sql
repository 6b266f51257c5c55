-- name: CreateInvoice :exec
INSERT INTO invoices (order_id, amount_cents) VALUES (?, ?);

-- name: GetInvoice :one
SELECT order_id, amount_cents FROM invoices WHERE order_id = ?;

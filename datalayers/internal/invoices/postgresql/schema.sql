-- The invoices table of the data-layer tests, on PostgreSQL.
CREATE TABLE invoices (
    order_id     text   NOT NULL PRIMARY KEY,
    amount_cents bigint NOT NULL
);

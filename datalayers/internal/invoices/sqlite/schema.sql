-- The invoices table of the data-layer tests, on SQLite.
CREATE TABLE invoices (
    order_id     TEXT    NOT NULL PRIMARY KEY,
    amount_cents INTEGER NOT NULL
);

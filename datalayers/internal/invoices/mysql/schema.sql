-- The invoices table of the data-layer tests, on MySQL/MariaDB.
CREATE TABLE invoices (
    order_id     varchar(255) NOT NULL PRIMARY KEY,
    amount_cents bigint       NOT NULL
);

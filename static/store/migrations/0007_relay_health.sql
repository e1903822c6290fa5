-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The relay's readiness probe (docs/design.md "Observability"): the gRPC health service's
-- writer writes this row, so a store that cannot write is seen. A table of the relay's own
-- (not 0006's `static_health`): on SQLite the relay's tables live in a file of their own.
-- One row per relay part, overwritten: the table never grows.
CREATE TABLE relay_health (
    part TEXT PRIMARY KEY,
    checked_at BIGINT NOT NULL
);

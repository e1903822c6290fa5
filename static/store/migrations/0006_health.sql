-- Readiness probes (docs/design.md "Observability"): `/readyz` writes the API's row, so a store
-- that cannot write is seen, not only one that cannot be read (the relay's probe has a table of
-- its own, 0007). One row per part, overwritten: the table never grows.
CREATE TABLE static_health (
    part TEXT PRIMARY KEY,
    checked_at BIGINT NOT NULL
);

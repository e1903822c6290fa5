-- Readiness probes (docs/design.md "Observability"): `/readyz` and the relay's gRPC health
-- service each write their own row, so a store that cannot write is seen, not only one that
-- cannot be read. One row per part (`api`, `relay`), overwritten: the table never grows.
CREATE TABLE static_health (
    part TEXT PRIMARY KEY,
    checked_at BIGINT NOT NULL
);

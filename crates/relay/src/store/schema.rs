//! The one list of the relay's migrations (`static/store/migrations/`), per database, each
//! file included once: what the stores' tests and the service tests make their databases from.
//!
//! The Python store runs these migrations before the relay opens a database; the relay itself
//! never does. Public (hidden, `static_relay::schema`) so that the integration tests reach it.

/// Where the migrations are, from this file.
macro_rules! migration {
    ($file:literal) => {
        include_str!(concat!("../../../../static/store/migrations/", $file))
    };
}

// Files both databases run.
const RELAY_HEALTH: &str = migration!("0007_relay_health.sql");
const ORG_KEYS: &str = migration!("0009_org_keys.sql");
const CONSOLE_READS: &str = migration!("0014_console_reads.sql");

/// The relay's tables on SQLite, in order.
pub const SQLITE: &[&str] = &[
    migration!("0002_relay.sqlite.sql"),
    migration!("0003_membership.sqlite.sql"),
    migration!("0004_retention.sqlite.sql"),
    // Key generations are SQLite's alone (`store/keys.rs`).
    migration!("0005_key_generations.sqlite.sql"),
    RELAY_HEALTH,
    migration!("0008_departures.sqlite.sql"),
    ORG_KEYS,
    migration!("0010_directory.sqlite.sql"),
    migration!("0012_relay_audit.sqlite.sql"),
    migration!("0013_external_sender.sqlite.sql"),
    CONSOLE_READS,
];

/// The relay's tables on PostgreSQL, in order.
pub const POSTGRESQL: &[&str] = &[
    migration!("0002_relay.postgresql.sql"),
    migration!("0003_membership.postgresql.sql"),
    migration!("0004_retention.postgresql.sql"),
    RELAY_HEALTH,
    migration!("0008_departures.postgresql.sql"),
    ORG_KEYS,
    migration!("0010_directory.postgresql.sql"),
    migration!("0012_relay_audit.postgresql.sql"),
    migration!("0013_external_sender.postgresql.sql"),
    CONSOLE_READS,
];

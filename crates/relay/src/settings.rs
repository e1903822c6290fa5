//! The relay's configuration: [`RelayConfig`], and the one table of its tunable settings (name,
//! `static serve` flag, default, bounds, help) that everything else reads: the defaults here, the
//! Python binding (`static._native.relay.relay_settings()`), the CLI's flags and the docs' `--help`.
//!
//! A setting is added in one place, the `settings!` invocation below; the binding, the CLI and
//! `RelayConfig::set` pick it up by name.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::retention::{Policy, RetentionSettings};
use crate::store::Database;

/// A setting the table refuses.
#[derive(Debug, Error, PartialEq)]
pub enum SettingError {
    #[error("unknown relay setting {0:?}")]
    Unknown(String),
    #[error("{flag} must be {bounds}, got {value}")]
    OutOfBounds {
        flag: &'static str,
        bounds: String,
        value: f64,
    },
}

/// How a setting's value is written on the command line and held in [`RelayConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole number.
    Count,
    /// A real number.
    Real,
    /// A duration, written in seconds.
    Seconds,
}

/// A setting's value type in [`RelayConfig`]; the table carries every value as `f64`.
pub trait Value: Copy {
    const KIND: Kind;
    fn from_f64(value: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! count_value {
    ($($t:ty),*) => {$(
        impl Value for $t {
            const KIND: Kind = Kind::Count;
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            fn from_f64(value: f64) -> Self {
                // In bounds already (checked by `set`), so the cast is exact.
                value as $t
            }
            #[allow(clippy::cast_precision_loss)]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}
count_value!(u32, u64, usize);

impl Value for f64 {
    const KIND: Kind = Kind::Real;
    fn from_f64(value: f64) -> Self {
        value
    }
    fn to_f64(self) -> f64 {
        self
    }
}

impl Value for Duration {
    const KIND: Kind = Kind::Seconds;
    fn from_f64(value: f64) -> Self {
        Duration::from_secs_f64(value)
    }
    fn to_f64(self) -> f64 {
        self.as_secs_f64()
    }
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// The [`RelayConfig`] field (and the name the Python binding takes).
    pub name: &'static str,
    /// `static serve`'s flag; its environment variable is `STATIC_` + the flag's name in capitals.
    pub flag: &'static str,
    pub kind: Kind,
    pub default: f64,
    pub low: f64,
    /// `f64::INFINITY` for no upper bound.
    pub high: f64,
    pub help: &'static str,
}

impl Setting {
    fn check(&self, value: f64) -> Result<f64, SettingError> {
        let whole = self.kind != Kind::Count || value.fract() == 0.0;
        if whole && value >= self.low && value <= self.high {
            return Ok(value);
        }
        let bounds = if self.high.is_infinite() {
            format!(">= {}", self.low)
        } else {
            format!("between {} and {}", self.low, self.high)
        };
        let bounds = if self.kind == Kind::Count {
            format!("a whole number {bounds}")
        } else {
            bounds
        };
        Err(SettingError::OutOfBounds {
            flag: self.flag,
            bounds,
            value,
        })
    }
}

macro_rules! settings {
    (
        $(#[$meta:meta])*
        pub struct $config:ident {
            $( $(#[doc = $fdoc:literal])* pub $fixed:ident : $fty:ty, )*
        }
        tunable {
            $(
                $(#[doc = $doc:literal])*
                $name:ident : $ty:ty = $default:expr,
                    $flag:literal, $low:expr, $high:expr, $help:literal;
            )*
        }
    ) => {
        $(#[$meta])*
        pub struct $config {
            $( $(#[doc = $fdoc])* pub $fixed: $fty, )*
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        impl $config {
            /// Every tunable setting, with its default.
            pub fn table() -> Vec<Setting> {
                vec![$(
                    Setting {
                        name: stringify!($name),
                        flag: $flag,
                        kind: <$ty as Value>::KIND,
                        default: Value::to_f64({ let d: $ty = $default; d }),
                        low: $low,
                        high: $high,
                        help: $help,
                    },
                )*]
            }

            /// Set the tunable setting `name` to `value` (in the table's unit), within its bounds.
            pub fn set(&mut self, name: &str, value: f64) -> Result<(), SettingError> {
                let table = Self::table();
                let Some(setting) = table.iter().find(|s| s.name == name) else {
                    return Err(SettingError::Unknown(name.to_owned()));
                };
                let value = setting.check(value)?;
                match name {
                    $( stringify!($name) => self.$name = <$ty as Value>::from_f64(value), )*
                    _ => return Err(SettingError::Unknown(name.to_owned())),
                }
                Ok(())
            }

            fn with_defaults($( $fixed: $fty, )*) -> $config {
                $config {
                    $( $fixed, )*
                    $( $name: $default, )*
                }
            }
        }
    };
}

const MIB: usize = 1024 * 1024;

settings! {
    /// The relay's knobs. Build one with [`RelayConfig::new`] (every tunable at its default),
    /// then change fields, or [`RelayConfig::set`] them by name.
    #[derive(Debug, Clone)]
    pub struct RelayConfig {
        /// The host to bind (the configured one only, no SO_REUSEPORT). `static serve` passes
        /// its own default (`static._settings.ServerSettings.relay`).
        pub host: String,
        /// 0 picks a free port.
        pub port: u16,
        /// A SQLite file or a PostgreSQL URL (its relay tables exist already).
        pub database: Database,
        pub allow_anonymous: bool,
        /// TLS on the port (`tls::server_config`); None serves plaintext HTTP/2.
        pub tls: Option<Arc<rustls::ServerConfig>>,
    }
    tunable {
        /// Largest MLS message accepted on Publish.
        max_message_bytes: usize = MIB,
            "--relay-max-message-bytes", 1024.0, 16.0 * 1024.0 * 1024.0,
            "largest MLS message the relay accepts, in bytes";
        /// How long in-flight calls may take to finish after a shutdown signal.
        graceful_timeout: Duration = Duration::from_secs(5),
            "--relay-graceful-timeout", 0.0, 3600.0,
            "seconds in-flight relay calls may take to finish at shutdown";
        /// Application messages are accepted at the channel's epoch or this many before it.
        application_window: u64 = 5,
            "--relay-application-window", 0.0, 1000.0,
            "epochs before the current one at which application messages are still accepted";
        /// A subscription without traffic gets a keep-alive this often (a gone peer shows).
        keepalive_interval: Duration = Duration::from_secs(2),
            "--relay-keepalive", 0.05, 300.0,
            "keep-alive interval of relay subscriptions, in seconds";
        /// How often the gRPC health service's status is refreshed by a write to the store
        /// (one small transaction of the log's writer: ~0.1-1 ms, so every 5 s is nothing).
        health_interval: Duration = Duration::from_secs(5),
            "--relay-health-interval", 0.1, 3600.0,
            "seconds between the relay's store write probes (its gRPC health status)";
        /// Concurrent streams (calls) per connection; more get RESOURCE_EXHAUSTED.
        max_streams_per_connection: u32 = 100,
            "--relay-max-streams", 1.0, 10_000.0,
            "concurrent relay streams per connection";
        /// Channels one SubscribeMany stream may follow at once.
        max_subscriptions_per_stream: usize = 10_000,
            "--relay-max-subscriptions", 1.0, 1_000_000.0,
            "channels one relay SubscribeMany stream may follow";
        /// Follows one account may hold on all its SubscribeMany streams together (~650 bytes
        /// of relay memory each).
        max_follows_per_account: usize = 100_000,
            "--relay-max-follows", 1.0, 100_000_000.0,
            "channels one account may follow on all its relay SubscribeMany streams together";
        /// Stream resets a connection may make at once (HTTP/2 rapid reset)...
        reset_burst: u32 = 200,
            "--relay-reset-burst", 1.0, 100_000.0,
            "stream resets a relay connection may make in a burst before it is closed";
        /// ...and then this many a second.
        reset_rate_per_second: f64 = 50.0,
            "--relay-reset-rate", 0.0, f64::INFINITY,
            "stream resets a relay connection may make per second after its burst";
        /// What the rings of recent entries (read by live subscribers without the store) hold,
        /// all channels together, each entry charged its message and 128 bytes; past it the
        /// oldest go first, whichever their channel. A subscriber that keeps up reads each
        /// entry right after its commit, so the rings only need the last moments of traffic:
        /// 64 MiB is ~16,000 entries of 4 KiB (or 64 of 1 MiB) and fits a small server. Each
        /// channel kept up to 8 MiB before: with 4 KiB messages the relay grew from 159 MiB at
        /// 10 busy channels to 926 MiB at 100 (issue 20).
        cache_bytes: usize = 64 * MIB,
            "--relay-cache-bytes", 0.0, 1024.0 * 1024.0 * 1024.0 * 1024.0,
            "bytes of recent entries the relay keeps in memory for live subscribers, all channels together";
        /// A channel with no publish, no subscriber and no call for this long is unloaded (its
        /// ring, group state and bindings) and read again from the store when next named; 0
        /// never unloads. A minute keeps a channel with sparse traffic loaded between its
        /// messages, while one that went quiet gives its memory back soon.
        idle_unload: Duration = Duration::from_secs(60),
            "--relay-idle-unload", 0.0, 86_400.0,
            "seconds without traffic after which a relay channel is unloaded from memory, 0 for never";
        /// Publishes per second per agent (API key, or peer address when anonymous); 0 = no
        /// limit.
        publish_rate_per_agent: f64 = 10_000.0,
            "--relay-publish-rate", 0.0, f64::INFINITY,
            "relay publishes per second per agent, 0 for no limit";
        /// The default retention of channels that set none (docs/design.md §5.3): entries
        /// older than this go; 0 = no limit. Keeping everything is the default: what to drop
        /// is the operator's decision.
        retention_max_age: Duration = Duration::ZERO,
            "--relay-retention-max-age", 0.0, 1e12,
            "default retention of relay channels: entries older than this many seconds are \
             pruned, 0 for no limit";
        /// The default retention: only the newest this many entries stay; 0 = no limit.
        retention_max_entries: u64 = 0,
            "--relay-retention-max-entries", 0.0, 1e15,
            "default retention of relay channels: the newest N entries are kept, 0 for no limit";
        /// The default retention: only the newest entries holding this many message bytes
        /// stay; 0 = no limit.
        retention_max_bytes: u64 = 0,
            "--relay-retention-max-bytes", 0.0, 1e15,
            "default retention of relay channels: the newest entries holding at most this many \
             message bytes are kept, 0 for no limit";
        /// Welcomes go this long after they were stored; 0 = only once used.
        welcome_ttl: Duration = Duration::from_secs(7 * 24 * 3600),
            "--relay-welcome-ttl", 0.0, 1e10,
            "seconds a relay keeps a Welcome, 0 to keep it until used";
        /// A Welcome whose every joiner bound its leaf (used) goes this long after: the joiner
        /// reads the log from its commit meanwhile.
        used_welcome_grace: Duration = Duration::from_secs(3600),
            "--relay-used-welcome-grace", 0.0, 1e10,
            "seconds a relay keeps a Welcome after its last joiner bound its leaf";
        /// Entries younger than this are never pruned: a retry within it gets its original seq.
        idempotency_window: Duration = Duration::from_secs(15 * 60),
            "--relay-idempotency-window", 0.0, 1e10,
            "seconds during which relay entries are never pruned (a retry gets its original seq)";
        /// Time between two passes of the pruner; 0 = no background pruning.
        prune_interval: Duration = Duration::from_secs(60),
            "--relay-prune-interval", 0.0, 86_400.0,
            "seconds between two passes of the relay's pruner, 0 for none";
        /// Most entries (or Welcomes) one prune transaction deletes (bench/retention.py).
        prune_batch: usize = 256,
            "--relay-prune-batch", 1.0, 1_000_000.0,
            "entries one relay prune transaction deletes at most";
        /// A connection without a call for this long is closed: one that never sent anything,
        /// or only the HTTP/2 preface, or whose calls are done (measured at e879e1d: 20 such
        /// connections were all still open after 75 s).
        idle_timeout: Duration = Duration::from_secs(60),
            "--relay-idle-timeout", 0.05, 86_400.0,
            "close a relay connection without a call for this many seconds (also one that \
             sent nothing, or only the HTTP/2 preface)";
        /// With TLS, how long a connection may take to complete its handshake: one that never
        /// does (a peer that opens TCP and stalls) holds its place in the connection caps only
        /// this long. A handshake takes 2 round trips and 0.3 ms of the relay's CPU (measured
        /// with an ECDSA P-256 certificate on the 2-core VM), so 10 s leaves room for a slow
        /// mobile link while a stalled peer is gone well before `idle_timeout`.
        tls_handshake_timeout: Duration = Duration::from_secs(10),
            "--relay-tls-handshake-timeout", 0.05, 3600.0,
            "with --tls-cert, close a relay connection that has not completed its TLS handshake \
             within this many seconds";
        /// Connections served at once; more are closed as soon as they are accepted. `static
        /// serve` fits it in its open-file limit with the HTTP port's (`static.cli`).
        max_connections: usize = 10_000,
            "--relay-max-connections", 1.0, 10_000_000.0,
            "relay connections served at once; more are closed as they come (lowered to fit \
             the open-file limit when unset)";
        /// Connections served at once per client address (an IPv6 client's /64).
        max_connections_per_address: usize = 1_000,
            "--relay-max-connections-per-address", 1.0, 10_000_000.0,
            "relay connections served at once per client address (an IPv6 client's /64)";
        /// What one streaming call may hold ahead of its peer: its page of the log and its
        /// queue of responses, half each (each may exceed its half by one message). Measured
        /// at e879e1d, without it: ~256 MiB per subscriber that stopped reading 1 MiB messages.
        stream_buffer_bytes: usize = 512 * 1024,
            "--relay-stream-buffer", 1024.0, 1024.0 * 1024.0 * 1024.0,
            "bytes one relay stream may hold ahead of a slow peer (its page of the log and its \
             queue of responses; each may exceed its half by one message)";
        /// Streaming calls (Subscribe, SubscribeMany, PublishStream, PublishBatches) one account
        /// holds at once, over all its keys and connections; anonymous callers are one account.
        /// A stream that stops reading holds up to ~1 MiB (`stream_buffer_bytes` and the
        /// transport's buffer, on 1 MiB messages): measured at 9b2be07, 400 never-reading
        /// Subscribe streams of one account pinned 406 MiB. 256 bounds an account at ~260 MiB
        /// while leaving room for ~100 SDK clients (each holds two streams).
        max_streams_per_account: usize = 256,
            "--relay-max-streams-per-account", 1.0, 1_000_000.0,
            "streaming relay calls one account may hold at once (over all its keys and \
             connections; anonymous callers count as one account)";
        /// Members a channel's group may have: a commit past it is refused (INVALID_ARGUMENT),
        /// counted once staged, before the next state is made. Checking a commit costs ~0.6 ms
        /// at 128 members and 2-3 ms at 512 (docs/design.md §5.2), so 4,096 bounds one check at
        /// some 20 ms of a pool worker. (A new channel's group holds its creator alone.)
        max_group_size: usize = 4096,
            "--relay-max-group-size", 1.0, 1_000_000.0,
            "members a relay channel's group may have; a commit past it is refused";
        /// Channels one account (the anonymous callers together) may create per second, with
        /// a burst of 10 s of it; 0 = no limit. A create costs one store transaction.
        create_rate_per_account: f64 = 100.0,
            "--relay-create-rate", 0.0, f64::INFINITY,
            "relay channels one account may create per second (a burst of 10 s of it), 0 for \
             no limit";
        /// New orgs one account may claim per minute, and at once; 0 = no limit. At 9b2be07
        /// one account claimed 114 orgs a second.
        org_claims_per_minute: f64 = 10.0,
            "--relay-org-claim-rate", 0.0, f64::INFINITY,
            "new orgs one account may claim per minute (and at once), 0 for no limit";
        /// Costly group checks (a new channel's group, a handshake) one account may have
        /// running or waiting in the relay's pool (one worker per core; an account's run one
        /// at a time, so the rest only wait); past it, RESOURCE_EXHAUSTED with a retry-after.
        /// 16: an account's agents racing commits on one epoch (6 in the relay's tests) wait
        /// their turn and lose the race as stale, rather than being refused; a waiting check
        /// holds its message (at most 1 MiB).
        group_checks_per_account: usize = 16,
            "--relay-group-checks-per-account", 1.0, 10_000.0,
            "costly MLS checks (group creation, handshakes) one account may have running or \
             waiting on the relay";
        /// Key packages one account may claim from the directory per second, with a burst of
        /// 4 s of it; 0 = no limit. A claim costs a few store statements.
        claim_rate_per_account: f64 = 50.0,
            "--relay-claim-rate", 0.0, f64::INFINITY,
            "key packages one account may claim from the relay's directory per second (a \
             burst of 4 s of it), 0 for no limit";
        /// Key packages of one address that may be claimed per second, with a burst of 20 s
        /// of it; 0 = no limit. Counted only for callers its policy lets claim.
        claim_rate_per_address: f64 = 1.0,
            "--relay-address-claim-rate", 0.0, f64::INFINITY,
            "key packages of one directory address that may be claimed per second (a burst of \
             20 s of it), 0 for no limit";
        /// Pending invitations an address may have; past it claims of its packages are
        /// refused.
        max_pending_invitations: usize = 100,
            "--relay-max-pending-invitations", 1.0, 1_000_000.0,
            "pending invitations one directory address may have before claims of its key \
             packages are refused";
    }
}

impl RelayConfig {
    /// Every tunable at its default, over `database`, on 127.0.0.1 and a free port.
    pub fn new(database: impl Into<Database>) -> RelayConfig {
        RelayConfig::with_defaults("127.0.0.1".to_owned(), 0, database.into(), false, None)
    }
}

impl From<&RelayConfig> for RetentionSettings {
    /// The relay's settings (`crates/relay/src/settings.rs`, where the defaults are).
    fn from(config: &RelayConfig) -> Self {
        let limit = |v: u64| Some(v).filter(|v| *v > 0);
        RetentionSettings {
            default_policy: Policy {
                // Whole seconds, rounded up: a limit is never shorter than asked.
                max_age_seconds: limit(
                    config.retention_max_age.as_secs()
                        + u64::from(config.retention_max_age.subsec_nanos() > 0),
                ),
                max_entries: limit(config.retention_max_entries),
                max_bytes: limit(config.retention_max_bytes),
            },
            welcome_ttl: Some(config.welcome_ttl).filter(|ttl| !ttl.is_zero()),
            used_welcome_grace: config.used_welcome_grace,
            idempotency_window: config.idempotency_window,
            prune_interval: config.prune_interval,
            prune_batch: config.prune_batch,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_within_their_own_bounds() {
        let table = RelayConfig::table();
        let mut config = RelayConfig::new(std::path::PathBuf::from("x.db"));
        for setting in &table {
            assert!(setting.flag.starts_with("--relay-"), "{}", setting.name);
            config.set(setting.name, setting.default).unwrap();
        }
        let names: std::collections::HashSet<_> = table.iter().map(|s| s.flag).collect();
        assert_eq!(names.len(), table.len(), "flags are unique");
    }

    #[test]
    fn set_checks_name_bounds_and_wholeness() {
        let mut config = RelayConfig::new(std::path::PathBuf::from("x.db"));
        config.set("keepalive_interval", 0.5).unwrap();
        assert_eq!(config.keepalive_interval, Duration::from_millis(500));
        config.set("max_streams_per_connection", 7.0).unwrap();
        assert_eq!(config.max_streams_per_connection, 7);
        assert_eq!(
            config.set("nope", 1.0),
            Err(SettingError::Unknown("nope".into()))
        );
        let err = config.set("max_streams_per_connection", 0.0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--relay-max-streams must be a whole number between 1 and 10000, got 0"
        );
        assert!(config.set("max_streams_per_connection", 1.5).is_err());
        assert!(config.set("keepalive_interval", f64::NAN).is_err());
        assert!(config.set("publish_rate_per_agent", f64::INFINITY).is_ok());
        assert!(config.set("publish_rate_per_agent", -1.0).is_err());
    }
}

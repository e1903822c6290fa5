//! The log on PostgreSQL (`static/store/migrations/0002_relay.postgresql.sql`): any number of
//! relays (`static serve` processes) on one database serve the same channels.
//!
//! * **Exact across relays, in one round trip when nobody else writes.** A group commit is one
//!   transaction, its statements pipelined (tokio-postgres sends every request of a join before
//!   reading the first answer). First try: decide from the heads in memory (the same [`decide`]
//!   as SQLite) and send BEGIN, the entries, heads, epoch starts, Welcomes, NOTIFY and COMMIT
//!   at once. If another relay appended meanwhile, memory was behind and the INSERT hits the
//!   primary key (channel, seq); a retry hits the idempotency index: the transaction aborts,
//!   its COMMIT rolls back, nothing is stored. Then (and for any batch the fence would refuse
//!   in part, since memory may be behind) the locked path: lock the channels' rows (`SELECT
//!   ... FOR UPDATE`, in id order so two relays never deadlock), read their heads and the
//!   batch's keys already logged, decide from those, write and commit: a second round trip.
//!   Whoever holds a channel's row lock (or inserted its next seq) is its only writer until
//!   COMMIT, so seqs stay gap-free and the epoch fence is exact whichever relay a message
//!   arrives at. The writer drives its own connection on a current-thread runtime of its own,
//!   on the writer thread: nothing hops threads in between.
//! * **Wake-ups.** Each commit NOTIFYs `static_relay` with `"<channel id> <head> <epoch>"` per
//!   channel it appended to; delivered only once committed. Every relay LISTENs on a
//!   connection of its own and moves its loaded channels forward, which wakes their
//!   subscribers; they read what they missed from the database. After (re)connecting the
//!   listener reads the heads of every loaded channel, so a lost connection loses no wake-up.
//! * **Reads** are async, on a few pooled connections of the relay's runtime.
//!
//! No TLS: the relay reaches PostgreSQL over loopback or a trusted network (as the Python API
//! does through asyncpg with the same URL).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::connect::{connect, describe, store_error};
use bytes::Bytes;
use futures_util::future::{try_join3, try_join_all};
use sha2::{Digest, Sha256};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, Client, Config, NoTls, Statement};

use crate::clock::now_ms;
use crate::error::{RelayError, Result};
use crate::store::sql::{
    ACCOUNT_CHANNELS, ACCOUNT_RATE, BIND, BOUND_KEYS, BOUND_WELCOME_LEAF, BYTES_CUT, CLAIM_ORG,
    DELETE_WELCOME, DELETE_WELCOME_LEAVES, DELETE_WELCOME_REFS, EPOCH_START, EXPIRED_WELCOMES,
    EXTERNAL_SENDER, FIRST_SINCE, INSERT_AUDIT, INSERT_EPOCH, INSERT_EXTERNAL_SENDER, INSERT_GROUP,
    INSERT_PROPOSAL, INSERT_WELCOME, INSERT_WELCOME_REF, LEAVES_OF_KEY, LOAD_CHANNEL, LOAD_GROUP,
    MARK_USED, ORG_OWNER, PROBE, PROPOSALS, PRUNE_ENTRIES, PRUNE_EPOCHS, PRUNE_HORIZON,
    PRUNE_PROPOSALS, RETENTION_ROW, RETENTION_ROWS, SET_RETENTION, SHADOWED, UPDATE_GROUP,
    WELCOMES_DUE, WELCOME_BY_DIGEST, WELCOME_FLOOR,
};
use crate::store::AuditRow;
use crate::store::{
    decide, in_memory, new_entries, AccountChannelRow, Append, Binding, ChannelRow, Creation,
    Entry, Heads, LogReader, LogWriter, NewChannel, Opened, Policy, PruneStep, RetentionRow,
    SenderKey, StoreFuture, StoredBinding, StoredGroup, WelcomeKey, WelcomeRecord,
};
use crate::wire::fence::{Decision, Plan};
use crate::wire::rules::org_key;

/// The NOTIFY channel of commits.
const NOTIFY_CHANNEL: &str = "static_relay";
/// Read connections (each pipelines concurrent reads).
const READ_CONNECTIONS: usize = 4;
/// A group commit that lost a race (deadlock, serialization) is tried again this many times.
const COMMIT_ATTEMPTS: usize = 3;
/// The listener's wait before reconnecting.
const LISTEN_RETRY: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

// PostgreSQL's own statements; the shared ones are in `store/sql.rs`. Its writes take a
// batch's rows at once (UNNEST of arrays, which SQLite lacks), its locked paths lock rows
// (`FOR UPDATE`), and its reads decide more in one statement: each is a round trip.

const LOCK: &str = "SELECT id, head_seq, epoch FROM relay_channels WHERE id = ANY($1) \
     ORDER BY id FOR UPDATE";
const FIND_KEYS: &str = "SELECT e.channel_id, e.idempotency_key, e.seq, e.channel_epoch \
     FROM UNNEST($1::bigint[], $2::bytea[]) AS k (channel_id, idempotency_key) \
     JOIN relay_entries e USING (channel_id, idempotency_key)";
const INSERT_ENTRIES: &str = "INSERT INTO relay_entries (channel_id, seq, epoch, content_type, \
     channel_epoch, idempotency_key, message, account, appended_at) SELECT u.*, $9::bigint \
     FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[], $4::smallint[], $5::bigint[], \
     $6::bytea[], $7::bytea[], $8::text[]) AS u";
const UPDATE_HEADS: &str = "UPDATE relay_channels c SET head_seq = u.head_seq, epoch = u.epoch \
     FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[]) AS u (id, head_seq, epoch) \
     WHERE c.id = u.id";
const INSERT_EPOCHS: &str = "INSERT INTO relay_epochs (channel_id, epoch, start_seq) \
     SELECT * FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[])";
const INSERT_WELCOME_LEAVES: &str = "INSERT INTO relay_welcome_leaves (channel_id, leaf_index, \
     digest) SELECT $1, l, $3 FROM UNNEST($2::integer[]) AS l \
     ON CONFLICT (channel_id, leaf_index) DO UPDATE SET digest = excluded.digest";
const NOTIFY: &str = "SELECT pg_notify('static_relay', p) FROM UNNEST($1::text[]) AS p";
/// A plain batch in one statement (its own transaction): entries, heads, NOTIFY. A failed
/// INSERT fails it whole.
const APPEND_PLAIN: &str = "WITH entries AS (INSERT INTO relay_entries (channel_id, seq, \
     epoch, content_type, channel_epoch, idempotency_key, message, account, appended_at) \
     SELECT e.*, $9::bigint FROM \
     UNNEST($1::bigint[], $2::bigint[], $3::bigint[], $4::smallint[], $5::bigint[], \
     $6::bytea[], $7::bytea[], $8::text[]) AS e), \
     heads AS (UPDATE relay_channels c SET head_seq = u.head_seq, epoch = u.epoch \
     FROM UNNEST($10::bigint[], $11::bigint[], $12::bigint[]) AS u (id, head_seq, epoch) \
     WHERE c.id = u.id) \
     SELECT pg_notify('static_relay', p) FROM UNNEST($13::text[]) AS p";
/// Removed leaves' bindings go; their accounts' departures are kept apart (migration 0008),
/// where no later binding of the same leaf index overwrites them.
const UNBIND: &str = "WITH gone AS (DELETE FROM relay_members \
     WHERE channel_id = $1 AND leaf_index = ANY($2) AND removed_seq IS NULL \
     RETURNING leaf_index, account) \
     INSERT INTO relay_departures (channel_id, account, leaf_index, removed_seq) \
     SELECT DISTINCT ON (account) $1, account, leaf_index, $3 FROM gone \
     ORDER BY account, leaf_index \
     ON CONFLICT (channel_id, account) DO UPDATE \
     SET leaf_index = excluded.leaf_index, removed_seq = excluded.removed_seq \
     WHERE excluded.removed_seq > relay_departures.removed_seq";
/// Creating a channel, in one transaction (rare: not prepared): the org's owner is read under a
/// row lock. SQLite has no `FOR UPDATE`: its IMMEDIATE transaction holds the database's lock.
const ORG_OWNER_LOCKED: &str = "SELECT account FROM relay_orgs WHERE org = $1 FOR UPDATE";
/// A name taken skips the row (no id): a failed statement would abort the whole transaction,
/// where SQLite's form fails and its caller rolls back.
const CREATE_CHANNEL: &str = "INSERT INTO relay_channels (scope, name) VALUES ('', $1) \
     ON CONFLICT (scope, name) DO NOTHING RETURNING id";
/// The channel's epoch under a row lock (SQLite has no `FOR UPDATE`; see `ORG_OWNER_LOCKED`).
const LOCK_CHANNEL: &str = "SELECT epoch FROM relay_channels WHERE id = $1 FOR UPDATE";
/// A typed NULL (`::bytea`, a cast SQLite cannot parse): tokio-postgres checks the column's type.
const LOAD_GROUP_EPOCH: &str = "SELECT epoch, NULL::bytea FROM relay_groups WHERE channel_id = $1";
/// The bound leaves, then each departed account's last removal (a typed NULL, as above).
const LOAD_BINDINGS: &str = "SELECT leaf_index, account, NULL::bigint FROM relay_members \
     WHERE channel_id = $1 UNION ALL SELECT leaf_index, account, removed_seq \
     FROM relay_departures WHERE channel_id = $1";
const HEADS: &str = "SELECT id, head_seq, epoch FROM relay_channels WHERE id = ANY($1)";
/// A page: up to $3 entries, and none more once their messages reach $4 bytes (the first
/// always comes), decided by the database so that no row past the page is sent.
const READ: &str = "SELECT seq, epoch, content_type, message, account FROM \
     (SELECT seq, epoch, content_type, message, account, \
      sum(octet_length(message)) OVER (ORDER BY seq) - octet_length(message) AS before \
      FROM relay_entries WHERE channel_id = $1 AND seq > $2 ORDER BY seq LIMIT $3) page \
     WHERE before < $4 ORDER BY seq";
/// The Welcome by its key package's ref in one round trip (SQLite looks up the digest first).
const WELCOME_BY_REF: &str = "SELECT w.welcome, w.commit_seq, w.epoch \
     FROM relay_welcome_refs r JOIN relay_welcomes w \
     ON w.channel_id = r.channel_id AND w.digest = r.digest \
     WHERE r.channel_id = $1 AND r.key_package_ref = $2";

/// Seqs and epochs are u64 in the relay, BIGINT in the database. Both grow by one per entry
/// (or commit) from 0, so they never reach i64::MAX; saturate rather than wrap.
fn to_db(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn from_db(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// Opens the listener, the read pool and the writer on the database at `url`.
pub(crate) async fn open(url: &str, heads: Arc<dyn Heads>) -> Result<Opened> {
    let mut config = Config::from_str(url)
        .map_err(|e| RelayError::store(format!("invalid PostgreSQL URL: {e}")))?;
    config.application_name("static-relay");
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    let reader = Arc::new(ReadPool {
        config: config.clone(),
        slots: (0..READ_CONNECTIONS)
            .map(|_| tokio::sync::Mutex::new(None))
            .collect(),
        next: AtomicUsize::new(0),
        listener: Mutex::new(None),
    });
    // A first read connection now: a wrong URL or a missing schema fails the start.
    let first = reader.connection().await.map_err(store_error)?;
    let external_sender = external_sender(&first.client, &SenderKey::generate()?)
        .await
        .map_err(store_error)?;
    drop(first);
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let listener = tokio::spawn(listen(config.clone(), heads, ready_tx));
    *reader
        .listener
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(listener);
    let listening = ready
        .await
        .unwrap_or_else(|_| Err("the listener stopped".into()));
    let writer = match listening {
        Ok(()) => tokio::task::spawn_blocking(move || PgWriter::connect(config))
            .await
            .unwrap_or_else(|_| Err(RelayError::store("the writer's connection failed"))),
        Err(err) => Err(RelayError::store(err)),
    };
    match writer {
        Ok(writer) => Ok(Opened {
            writer: Box::new(writer),
            directory: Arc::new(super::directory::postgres::PgDirectory::new(
                reader.config.clone(),
            )),
            reader: Arc::new(PgReader(reader)),
            external_sender,
        }),
        Err(err) => {
            PgReader(reader).close();
            Err(err)
        }
    }
}

/// The relay's external sender key pair: the one stored, or `offered` stored now (every relay
/// of the database offers its own at start; the first one stored is everyone's).
async fn external_sender(client: &Client, offered: &SenderKey) -> PgResult<SenderKey> {
    client
        .execute(
            INSERT_EXTERNAL_SENDER,
            &[&offered.public, &offered.private, &now_ms()],
        )
        .await?;
    let row = client.query_one(EXTERNAL_SENDER, &[]).await?;
    Ok(SenderKey {
        public: row.get(0),
        private: row.get(1),
    })
}

// -- the writer -------------------------------------------------------------------------------

struct PgWriter {
    config: Config,
    /// Drives the writer's connection, on the writer's thread (a current-thread runtime only
    /// runs while its owner waits in `block_on`). None once dropped.
    runtime: Option<Runtime>,
    /// None after a broken connection: reconnect before the next commit.
    conn: Option<WriteConnection>,
}

struct WriteConnection {
    client: Client,
    lock: Statement,
    find_keys: Statement,
    insert_entries: Statement,
    update_heads: Statement,
    insert_epochs: Statement,
    insert_welcome: Statement,
    insert_welcome_ref: Statement,
    notify: Statement,
    append_plain: Statement,
    insert_proposal: Statement,
    update_group: Statement,
    unbind: Statement,
}

impl PgWriter {
    /// Blocking: on a thread that is not a runtime's worker.
    fn connect(config: Config) -> Result<PgWriter> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(RelayError::store)?;
        let mut writer = PgWriter {
            config,
            runtime: Some(runtime),
            conn: None,
        };
        writer.connected()?;
        Ok(writer)
    }

    /// The runtime and a live connection, reconnecting when the last one broke.
    fn connected(&mut self) -> Result<(&Runtime, &WriteConnection)> {
        if self.conn.as_ref().is_some_and(|c| c.client.is_closed()) {
            self.conn = None;
        }
        let runtime = self.runtime.as_ref().ok_or(RelayError::Internal)?;
        if self.conn.is_none() {
            let config = self.config.clone();
            let conn = runtime
                // The connection's task is spawned on this runtime: it runs whenever the writer
                // waits on it.
                .block_on(async move { WriteConnection::prepare(connect(&config).await?).await })
                .map_err(store_error)?;
            self.conn = Some(conn);
        }
        let conn = self.conn.as_ref().ok_or(RelayError::Internal)?;
        Ok((runtime, conn))
    }
}

type PgResult<T> = std::result::Result<T, tokio_postgres::Error>;

impl Drop for PgWriter {
    fn drop(&mut self) {
        self.conn = None;
        // Without waiting: the writer may be dropped on a runtime's thread (a failed start).
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A statement failed because of a concurrent transaction: trying again may succeed.
fn lost_a_race(err: &tokio_postgres::Error) -> bool {
    matches!(
        err.code(),
        Some(code) if *code == SqlState::T_R_DEADLOCK_DETECTED
            || *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::UNIQUE_VIOLATION
    )
}

impl LogWriter for PgWriter {
    fn commits_inline(&self) -> bool {
        false
    }

    fn create_channel(&mut self, channel: &NewChannel<'_>) -> Result<Creation> {
        let (runtime, conn) = self.connected()?;
        runtime
            .block_on(in_transaction(&conn.client, conn.create(channel)))
            .map_err(store_error)
    }

    fn bind(&mut self, binding: &Binding<'_>) -> Result<bool> {
        let (runtime, conn) = self.connected()?;
        runtime
            .block_on(in_transaction(&conn.client, conn.bind(binding)))
            .map_err(store_error)
    }

    fn prune(&mut self, step: &PruneStep) -> Result<()> {
        let (runtime, conn) = self.connected()?;
        runtime
            .block_on(in_transaction(&conn.client, conn.prune(step)))
            .map_err(store_error)
    }

    fn expire_welcomes(
        &mut self,
        created_before: i64,
        used_before: i64,
        limit: usize,
    ) -> Result<usize> {
        let (runtime, conn) = self.connected()?;
        runtime
            .block_on(in_transaction(
                &conn.client,
                conn.expire_welcomes(created_before, used_before, limit),
            ))
            .map_err(store_error)
    }

    fn set_retention(
        &mut self,
        channel_id: i64,
        policy: &Policy,
        audit: Option<&AuditRow>,
    ) -> Result<()> {
        let (runtime, conn) = self.connected()?;
        let db = |v: Option<u64>| v.map(to_db);
        let (age, entries, bytes) = (
            db(policy.max_age_seconds),
            db(policy.max_entries),
            db(policy.max_bytes),
        );
        let client = &conn.client;
        let set = async {
            client
                .execute(SET_RETENTION, &[&channel_id, &age, &entries, &bytes])
                .await?;
            insert_audit(client, audit).await?;
            PgResult::Ok(((), true))
        };
        runtime
            .block_on(in_transaction(client, set))
            .map_err(store_error)
    }

    fn probe(&mut self, now_ms: i64) -> Result<()> {
        let (runtime, conn) = self.connected()?;
        runtime
            .block_on(conn.client.execute(PROBE, &[&now_ms]))
            .map(|_| ())
            .map_err(store_error)
    }

    fn append(&mut self, batch: &[Append<'_>], window: u64) -> Result<Plan> {
        let (runtime, conn) = self.connected()?;
        match runtime.block_on(conn.append_optimistically(batch, window)) {
            Ok(Some(plan)) => return Ok(plan),
            // Not for the fast path, or another relay (or a retry) got in the way.
            Ok(None) => {}
            Err(err) if lost_a_race(&err) => {}
            Err(err) => return Err(store_error(err)),
        }
        let mut attempt = 1;
        loop {
            // A broken connection is reopened here, for the retry or the next batch.
            let (runtime, conn) = self.connected()?;
            match runtime.block_on(conn.append(batch, window)) {
                Ok(plan) => return Ok(plan),
                Err(err) if lost_a_race(&err) && attempt < COMMIT_ATTEMPTS => attempt += 1,
                Err(err) => return Err(store_error(err)),
            }
        }
    }
}

/// Audit rows, in the caller's transaction (rare: not prepared ahead).
async fn insert_audit<'a>(
    client: &Client,
    rows: impl IntoIterator<Item = &'a AuditRow>,
) -> PgResult<()> {
    for row in rows {
        client
            .execute(
                INSERT_AUDIT,
                &[
                    &row.account,
                    &row.at_ms,
                    &row.kind,
                    &row.key_id,
                    &row.channel,
                    &row.detail,
                ],
            )
            .await?;
    }
    Ok(())
}

/// Runs `work` between BEGIN and COMMIT, or ROLLBACK on error; `Ok((value, false))` from
/// `work` rolls back too (nothing to keep).
async fn in_transaction<T>(
    client: &Client,
    work: impl Future<Output = PgResult<(T, bool)>>,
) -> PgResult<T> {
    client.batch_execute("BEGIN").await?;
    match work.await {
        Ok((value, true)) => {
            client.batch_execute("COMMIT").await?;
            Ok(value)
        }
        Ok((value, false)) => {
            client.batch_execute("ROLLBACK").await?;
            Ok(value)
        }
        Err(err) => {
            // Best effort: a broken connection ends the transaction anyway.
            let _ = client.batch_execute("ROLLBACK").await;
            Err(err)
        }
    }
}

impl WriteConnection {
    /// A channel's creation (see `LogWriter::create_channel`); the bool: keep it.
    async fn create(&self, new: &NewChannel<'_>) -> PgResult<(Creation, bool)> {
        let client = &self.client;
        // Orgs are owned by their key: look-alikes are one org (migration 0009).
        let org = org_key(new.org);
        let claimed = client.execute(CLAIM_ORG, &[&org, &new.account]).await? > 0;
        let owner: String = client.query_one(ORG_OWNER_LOCKED, &[&org]).await?.get(0);
        if owner != new.account {
            return Ok((Creation::OrgTaken, false));
        }
        let Some(row) = client.query_opt(CREATE_CHANNEL, &[&new.name]).await? else {
            return Ok((Creation::NameTaken, false));
        };
        let id: i64 = row.get(0);
        let leaf = i32::try_from(new.leaf).unwrap_or(i32::MAX);
        client.execute(INSERT_EPOCH, &[&id, &0i64, &0i64]).await?;
        client
            .execute(INSERT_GROUP, &[&id, &0i64, &new.state])
            .await?;
        client
            .execute(BIND, &[&id, &leaf, &new.account, &new.key_id])
            .await?;
        let claim = new.claimed.filter(|_| claimed);
        insert_audit(client, new.audit.iter().chain(claim)).await?;
        Ok((Creation::Done(id), true))
    }

    /// A binding, if the channel (its row locked) is still at the proof's epoch.
    async fn bind(&self, binding: &Binding<'_>) -> PgResult<(bool, bool)> {
        let client = &self.client;
        let epoch: i64 = client
            .query_one(LOCK_CHANNEL, &[&binding.channel_id])
            .await?
            .get(0);
        if from_db(epoch) != binding.epoch {
            return Ok((false, false));
        }
        let leaf = i32::try_from(binding.leaf).unwrap_or(i32::MAX);
        client
            .execute(
                BIND,
                &[
                    &binding.channel_id,
                    &leaf,
                    &binding.account,
                    &binding.key_id,
                ],
            )
            .await?;
        let awaited = client
            .query_opt(BOUND_WELCOME_LEAF, &[&binding.channel_id, &leaf])
            .await?;
        if let Some(row) = awaited {
            let digest: Vec<u8> = row.get(0);
            client
                .execute(MARK_USED, &[&binding.channel_id, &digest, &binding.now_ms])
                .await?;
        }
        Ok((true, true))
    }

    /// One prune step (see `LogWriter::prune`).
    async fn prune(&self, step: &PruneStep) -> PgResult<((), bool)> {
        let client = &self.client;
        let (id, horizon, to) = (step.channel_id, to_db(step.horizon), to_db(step.to));
        client.execute(PRUNE_ENTRIES, &[&id, &horizon, &to]).await?;
        client.execute(PRUNE_HORIZON, &[&id, &to]).await?;
        client.execute(PRUNE_EPOCHS, &[&id, &to]).await?;
        client.execute(PRUNE_PROPOSALS, &[&id]).await?;
        Ok(((), true))
    }

    /// Up to `limit` expired or used Welcomes deleted.
    async fn expire_welcomes(
        &self,
        created_before: i64,
        used_before: i64,
        limit: usize,
    ) -> PgResult<(usize, bool)> {
        let client = &self.client;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = client
            .query(EXPIRED_WELCOMES, &[&created_before, &used_before, &limit])
            .await?;
        for row in &rows {
            let (channel_id, digest): (i64, Vec<u8>) = (row.get(0), row.get(1));
            for sql in [DELETE_WELCOME_REFS, DELETE_WELCOME_LEAVES, DELETE_WELCOME] {
                client.execute(sql, &[&channel_id, &digest]).await?;
            }
        }
        Ok((rows.len(), !rows.is_empty()))
    }

    async fn prepare(client: Client) -> PgResult<WriteConnection> {
        let (lock, find_keys, insert_entries) = try_join3(
            client.prepare(LOCK),
            client.prepare(FIND_KEYS),
            client.prepare(INSERT_ENTRIES),
        )
        .await?;
        let (update_heads, insert_epochs, insert_welcome) = try_join3(
            client.prepare(UPDATE_HEADS),
            client.prepare(INSERT_EPOCHS),
            client.prepare(INSERT_WELCOME),
        )
        .await?;
        let (insert_welcome_ref, notify, append_plain) = try_join3(
            client.prepare(INSERT_WELCOME_REF),
            client.prepare(NOTIFY),
            client.prepare(APPEND_PLAIN),
        )
        .await?;
        let (insert_proposal, update_group, unbind) = try_join3(
            client.prepare(INSERT_PROPOSAL),
            client.prepare(UPDATE_GROUP),
            client.prepare(UNBIND),
        )
        .await?;
        Ok(WriteConnection {
            client,
            lock,
            find_keys,
            insert_entries,
            update_heads,
            insert_epochs,
            insert_welcome,
            insert_welcome_ref,
            notify,
            append_plain,
            insert_proposal,
            update_group,
            unbind,
        })
    }

    /// The fast path, one round trip: decide from the heads in memory and write, trusting the
    /// log's unique indexes to refuse the transaction when that was wrong. A seq taken
    /// meanwhile (by another relay: memory was behind) or a key already logged (a retry) fails
    /// the INSERT, which aborts everything pipelined after it, COMMIT included: nothing is
    /// stored, and the locked path decides again. None (nothing sent) when the plan refuses
    /// anything, since a refusal decided from memory may be wrong when memory is behind, or
    /// when it appends nothing.
    async fn append_optimistically(
        &self,
        batch: &[Append<'_>],
        window: u64,
    ) -> PgResult<Option<Plan>> {
        let plan = decide(batch, in_memory, None, window);
        let refuses = plan
            .decisions
            .iter()
            .any(|d| matches!(d, Decision::Refused(_)));
        if refuses || !plan.appends() {
            return Ok(None);
        }
        if let Err(err) = self.write(batch, &plan, Transaction::Begin).await {
            // The COMMIT, if it ran, rolled back; this only ends a transaction still open.
            let _ = self.client.batch_execute("ROLLBACK").await;
            return Err(err);
        }
        Ok(Some(plan))
    }

    /// The locked path: lock and read, decide, write, NOTIFY, COMMIT (rolled back on error).
    async fn append(&self, batch: &[Append<'_>], window: u64) -> PgResult<Plan> {
        let result = self.decide_and_write(batch, window).await;
        if result.is_err() {
            // Best effort: a broken connection ends the transaction anyway.
            let _ = self.client.batch_execute("ROLLBACK").await;
        }
        result
    }

    async fn decide_and_write(&self, batch: &[Append<'_>], window: u64) -> PgResult<Plan> {
        let mut ids: Vec<i64> = batch.iter().map(|p| p.channel_id).collect();
        ids.sort_unstable();
        ids.dedup();
        let key_channels: Vec<i64> = batch.iter().map(|p| p.channel_id).collect();
        let keys: Vec<&[u8]> = batch.iter().map(|p| p.key).collect();
        let (_, locked, logged) = try_join3(
            self.client.batch_execute("BEGIN"),
            self.client.query(&self.lock, &[&ids]),
            self.client.query(&self.find_keys, &[&key_channels, &keys]),
        )
        .await?;

        let heads: HashMap<i64, (u64, u64)> = locked
            .iter()
            .map(|row| {
                let (id, head, epoch): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
                (id, (from_db(head), from_db(epoch)))
            })
            .collect();
        let logged: HashMap<(i64, &[u8]), (u64, u64)> = logged
            .iter()
            .map(|row| {
                let (channel, key, seq, epoch): (i64, &[u8], i64, i64) =
                    (row.get(0), row.get(1), row.get(2), row.get(3));
                ((channel, key), (from_db(seq), from_db(epoch)))
            })
            .collect();
        let found: Vec<Option<(u64, u64)>> = batch
            .iter()
            .map(|p| logged.get(&(p.channel_id, p.key)).copied())
            .collect();
        // Every channel of the batch has its row (rows are never deleted).
        let base = |p: &Append<'_>| {
            heads
                .get(&p.channel_id)
                .copied()
                .unwrap_or_else(|| p.memory.heads())
        };
        let plan = decide(batch, base, Some(&found), window);
        if !plan.appends() {
            self.client.batch_execute("COMMIT").await?;
            return Ok(plan);
        }
        self.write(batch, &plan, Transaction::Open).await?;
        Ok(plan)
    }

    /// The plan's writes, NOTIFY and COMMIT, pipelined. A plain batch (no epoch starts, no
    /// Welcomes: most batches) outside a transaction is one statement, its own transaction.
    async fn write(
        &self,
        batch: &[Append<'_>],
        plan: &Plan,
        transaction: Transaction,
    ) -> PgResult<()> {
        let entries = new_entries(batch, plan);
        let mut columns = EntryColumns {
            appended_at: now_ms(),
            ..EntryColumns::default()
        };
        let mut epochs = EpochColumns::default();
        let mut welcomes = Vec::new();
        let mut proposals = Vec::new();
        let mut changes = Vec::new();
        for e in &entries {
            columns.channel_id.push(e.channel_id);
            columns.seq.push(to_db(e.seq));
            columns.epoch.push(to_db(e.epoch));
            columns
                .content_type
                .push(i16::try_from(e.content_type).unwrap_or(i16::MAX));
            columns.channel_epoch.push(to_db(e.channel_epoch));
            columns.key.push(e.key);
            columns.message.push(e.message);
            columns.account.push(e.account);
            if e.keep_proposal {
                proposals.push((e.channel_id, to_db(e.epoch), to_db(e.seq), e.message));
            }
            if let Some(change) = e.change {
                let removed: Vec<i32> = change
                    .removed
                    .iter()
                    .map(|leaf| i32::try_from(*leaf).unwrap_or(i32::MAX))
                    .collect();
                changes.push((
                    e.channel_id,
                    to_db(change.epoch),
                    change.state,
                    removed,
                    to_db(e.seq),
                    change.audit,
                ));
            }
            if e.starts_epoch {
                epochs.channel_id.push(e.channel_id);
                epochs.epoch.push(to_db(e.channel_epoch));
                epochs.start_seq.push(to_db(e.seq));
            }
            if !e.welcome.is_empty() {
                let digest = Sha256::digest(e.welcome).to_vec();
                let leaves: Vec<i32> = e
                    .welcome_leaves
                    .iter()
                    .map(|leaf| i32::try_from(*leaf).unwrap_or(i32::MAX))
                    .collect();
                welcomes.push((
                    e.channel_id,
                    digest,
                    to_db(e.seq),
                    to_db(e.channel_epoch),
                    e,
                    leaves,
                ));
            }
        }
        let mut heads = HeadColumns::default();
        let mut notices = Vec::new();
        let mut changed: Vec<_> = plan.changed().collect();
        // Rows locked in id order, as the locked path does: two relays never deadlock.
        changed.sort_unstable_by_key(|(id, _)| *id);
        for (id, t) in changed {
            heads.channel_id.push(id);
            heads.head_seq.push(to_db(t.head));
            heads.epoch.push(to_db(t.epoch));
            notices.push(format!("{} {} {}", id, t.head, t.epoch));
        }

        let client = &self.client;
        if transaction == Transaction::Begin
            && epochs.channel_id.is_empty()
            && welcomes.is_empty()
            && proposals.is_empty()
            && changes.is_empty()
        {
            let mut params = columns.params().to_vec();
            params.extend::<[&(dyn ToSql + Sync); 4]>([
                &heads.channel_id,
                &heads.head_seq,
                &heads.epoch,
                &notices,
            ]);
            return client.query(&self.append_plain, &params).await.map(|_| ());
        }
        type Step<'a> = Pin<Box<dyn Future<Output = PgResult<u64>> + 'a>>;
        let mut steps: Vec<Step<'_>> = Vec::new();
        if transaction == Transaction::Begin {
            steps.push(Box::pin(async {
                client.batch_execute("BEGIN").await.map(|()| 0)
            }));
        }
        steps.extend::<[Step<'_>; 2]>([
            Box::pin(async {
                client
                    .execute(&self.insert_entries, &columns.params())
                    .await
            }),
            Box::pin(async {
                let params: [&(dyn ToSql + Sync); 3] =
                    [&heads.channel_id, &heads.head_seq, &heads.epoch];
                client.execute(&self.update_heads, &params).await
            }),
        ]);
        if !epochs.channel_id.is_empty() {
            steps.push(Box::pin(async {
                let params: [&(dyn ToSql + Sync); 3] =
                    [&epochs.channel_id, &epochs.epoch, &epochs.start_seq];
                client.execute(&self.insert_epochs, &params).await
            }));
        }
        let created_at = &columns.appended_at;
        for (channel_id, digest, seq, epoch, e, leaves) in &welcomes {
            steps.push(Box::pin(async move {
                let params: [&(dyn ToSql + Sync); 6] =
                    [channel_id, digest, seq, epoch, &e.welcome, created_at];
                client.execute(&self.insert_welcome, &params).await
            }));
            if !leaves.is_empty() {
                steps.push(Box::pin(async move {
                    let params: [&(dyn ToSql + Sync); 3] = [channel_id, leaves, digest];
                    client.execute(INSERT_WELCOME_LEAVES, &params).await
                }));
            }
            for r in e.welcome_refs {
                steps.push(Box::pin(async move {
                    let params: [&(dyn ToSql + Sync); 3] = [channel_id, r, digest];
                    client.execute(&self.insert_welcome_ref, &params).await
                }));
            }
        }
        for (channel_id, epoch, seq, message) in &proposals {
            steps.push(Box::pin(async move {
                let params: [&(dyn ToSql + Sync); 4] = [channel_id, epoch, seq, message];
                client.execute(&self.insert_proposal, &params).await
            }));
        }
        for (channel_id, epoch, state, removed, seq, audit) in &changes {
            steps.push(Box::pin(async move {
                let params: [&(dyn ToSql + Sync); 3] = [channel_id, epoch, state];
                client.execute(&self.update_group, &params).await
            }));
            if !removed.is_empty() {
                steps.push(Box::pin(async move {
                    let params: [&(dyn ToSql + Sync); 3] = [channel_id, removed, seq];
                    client.execute(&self.unbind, &params).await
                }));
            }
            // Commits only (an application message has no change): the audit's rows.
            for row in *audit {
                steps.push(Box::pin(async move {
                    let params: [&(dyn ToSql + Sync); 6] = [
                        &row.account,
                        &row.at_ms,
                        &row.kind,
                        &row.key_id,
                        &row.channel,
                        &row.detail,
                    ];
                    client.execute(INSERT_AUDIT, &params).await
                }));
            }
        }
        steps.push(Box::pin(async {
            client.query(&self.notify, &[&notices]).await.map(|_| 0)
        }));
        steps.push(Box::pin(async {
            client.batch_execute("COMMIT").await.map(|()| 0)
        }));
        try_join_all(steps).await.map(|_| ())
    }
}

/// Whether [`WriteConnection::write`] runs in a transaction already open or begins its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transaction {
    Open,
    Begin,
}

#[derive(Default)]
struct EntryColumns<'a> {
    channel_id: Vec<i64>,
    seq: Vec<i64>,
    epoch: Vec<i64>,
    content_type: Vec<i16>,
    channel_epoch: Vec<i64>,
    key: Vec<&'a [u8]>,
    message: Vec<&'a [u8]>,
    account: Vec<&'a str>,
    /// When they are appended (unix ms): `$9`.
    appended_at: i64,
}

impl EntryColumns<'_> {
    /// The parameters of the entries' UNNEST, in column order, then their time.
    fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        [
            &self.channel_id,
            &self.seq,
            &self.epoch,
            &self.content_type,
            &self.channel_epoch,
            &self.key,
            &self.message,
            &self.account,
            &self.appended_at,
        ]
    }
}

#[derive(Default)]
struct EpochColumns {
    channel_id: Vec<i64>,
    epoch: Vec<i64>,
    start_seq: Vec<i64>,
}

#[derive(Default)]
struct HeadColumns {
    channel_id: Vec<i64>,
    head_seq: Vec<i64>,
    epoch: Vec<i64>,
}

// -- reads ------------------------------------------------------------------------------------

struct PgReader(Arc<ReadPool>);

/// A few connections on the relay's runtime, opened when first needed, reopened when broken.
struct ReadPool {
    config: Config,
    slots: Vec<tokio::sync::Mutex<Option<Arc<ReadConnection>>>>,
    next: AtomicUsize,
    /// The LISTEN task, stopped at close.
    listener: Mutex<Option<JoinHandle<()>>>,
}

struct ReadConnection {
    client: Client,
    load_channel: Statement,
    read: Statement,
    epoch_start: Statement,
    welcome_by_ref: Statement,
    welcome_by_digest: Statement,
}

impl ReadPool {
    /// The next connection in turn (concurrent reads share it, pipelined).
    async fn connection(&self) -> PgResult<Arc<ReadConnection>> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % READ_CONNECTIONS;
        let mut slot = self.slots[index].lock().await;
        if let Some(conn) = slot.as_ref().filter(|c| !c.client.is_closed()) {
            return Ok(Arc::clone(conn));
        }
        let client = connect(&self.config).await?;
        let (load_channel, read, epoch_start) = try_join3(
            client.prepare(LOAD_CHANNEL),
            client.prepare(READ),
            client.prepare(EPOCH_START),
        )
        .await?;
        let (welcome_by_ref, welcome_by_digest) = futures_util::future::try_join(
            client.prepare(WELCOME_BY_REF),
            client.prepare(WELCOME_BY_DIGEST),
        )
        .await?;
        let conn = Arc::new(ReadConnection {
            client,
            load_channel,
            read,
            epoch_start,
            welcome_by_ref,
            welcome_by_digest,
        });
        *slot = Some(Arc::clone(&conn));
        Ok(conn)
    }
}

impl PgReader {
    /// Runs `read` on a pooled connection; once more on a new one when that connection was
    /// found broken (PostgreSQL restarted: the first read after it must not fail a stream).
    ///
    /// The read is a task of its own, which always runs to its end: its caller may stop
    /// polling half-way. A streaming call's producer runs only while HTTP/2 lets the call send
    /// (`service::Driven`), and the connections are shared, pipelined: a response left unread
    /// stops the connection's every later one. Reads in the caller's own future let a peer
    /// that stopped reading wedge one pooled connection, and so every fourth read of everyone
    /// (a fair subscriber stalled at ~320 of 2,000 entries beside such a peer). A page is
    /// bounded (`read_page`'s bytes), so what a finished, unclaimed read holds is too.
    fn run<T, F, Fut>(&self, read: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: Fn(Arc<ReadConnection>) -> Fut + Send + 'static,
        Fut: Future<Output = PgResult<T>> + Send + 'static,
    {
        let pool = Arc::clone(&self.0);
        let read = async move {
            let conn = pool.connection().await.map_err(store_error)?;
            match read(Arc::clone(&conn)).await {
                Err(_) if conn.client.is_closed() => {
                    let conn = pool.connection().await.map_err(store_error)?;
                    read(conn).await.map_err(store_error)
                }
                result => result.map_err(store_error),
            }
        };
        Box::pin(async move {
            tokio::spawn(read)
                .await
                .unwrap_or_else(|_| Err(RelayError::store("a PostgreSQL read ended abruptly")))
        })
    }
}

fn stored_binding(row: &tokio_postgres::Row) -> StoredBinding {
    let leaf: i32 = row.get(0);
    StoredBinding {
        leaf: u32::try_from(leaf).unwrap_or(u32::MAX),
        account: row.get(1),
        removed_seq: row.get::<_, Option<i64>>(2).map(from_db),
    }
}

fn retention_row(row: &tokio_postgres::Row) -> RetentionRow {
    let limit = |i: usize| row.get::<_, Option<i64>>(i).map(from_db);
    RetentionRow {
        id: row.get(0),
        head_seq: from_db(row.get(1)),
        horizon: from_db(row.get(2)),
        policy: Policy {
            max_age_seconds: limit(3),
            max_entries: limit(4),
            max_bytes: limit(5),
        },
    }
}

fn welcome_record(row: &tokio_postgres::Row) -> WelcomeRecord {
    WelcomeRecord {
        welcome: Bytes::from(row.get::<_, Vec<u8>>(0)),
        commit_seq: from_db(row.get(1)),
        epoch: from_db(row.get(2)),
    }
}

impl LogReader for PgReader {
    fn load_channel(&self, account: &str, name: &str) -> StoreFuture<Option<ChannelRow>> {
        let (account, name) = (account.to_owned(), name.to_owned());
        self.run(move |conn| {
            let (account, name) = (account.clone(), name.clone());
            async move {
                let row = conn
                    .client
                    .query_opt(&conn.load_channel, &[&account, &name])
                    .await?;
                Ok(row.map(|row| {
                    let legacy: i32 = row.get(5);
                    ChannelRow {
                        id: row.get(0),
                        epoch: from_db(row.get(1)),
                        head_seq: from_db(row.get(2)),
                        scope: row.get(3),
                        legacy_owner: (legacy != 0)
                            .then(|| row.get::<_, Option<String>>(4).unwrap_or_default()),
                        horizon: from_db(row.get(6)),
                    }
                }))
            }
        })
    }

    fn load_group(&self, channel_id: i64, with_state: bool) -> StoreFuture<Option<StoredGroup>> {
        let sql = if with_state {
            LOAD_GROUP
        } else {
            LOAD_GROUP_EPOCH
        };
        self.run(move |conn| async move {
            let (group, bindings) = futures_util::future::try_join(
                conn.client.query_opt(sql, &[&channel_id]),
                conn.client.query(LOAD_BINDINGS, &[&channel_id]),
            )
            .await?;
            Ok(group.map(|row| StoredGroup {
                epoch: from_db(row.get(0)),
                state: row.get(1),
                bindings: bindings.iter().map(stored_binding).collect(),
            }))
        })
    }

    fn bindings(&self, channel_id: i64) -> StoreFuture<Vec<StoredBinding>> {
        self.run(move |conn| async move {
            let rows = conn.client.query(LOAD_BINDINGS, &[&channel_id]).await?;
            Ok(rows.iter().map(stored_binding).collect())
        })
    }

    fn proposals(&self, channel_id: i64, epoch: u64) -> StoreFuture<Vec<Bytes>> {
        self.run(move |conn| async move {
            let rows = conn
                .client
                .query(PROPOSALS, &[&channel_id, &to_db(epoch)])
                .await?;
            Ok(rows
                .iter()
                .map(|row| Bytes::from(row.get::<_, Vec<u8>>(0)))
                .collect())
        })
    }

    fn shadowed_names(&self) -> StoreFuture<Vec<String>> {
        self.run(move |conn| async move {
            let rows = conn.client.query(SHADOWED, &[]).await?;
            Ok(rows.iter().map(|row| row.get(0)).collect())
        })
    }

    fn read(
        &self,
        channel_id: i64,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> StoreFuture<Vec<Entry>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        self.run(move |conn| async move {
            let rows = conn
                .client
                .query(
                    &conn.read,
                    &[&channel_id, &to_db(after_seq), &limit, &max_bytes],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|row| Entry {
                    seq: from_db(row.get(0)),
                    epoch: from_db(row.get(1)),
                    content_type: u32::try_from(row.get::<_, i16>(2)).unwrap_or(0),
                    message: Bytes::from(row.get::<_, Vec<u8>>(3)),
                    account: Arc::from(row.get::<_, &str>(4)),
                })
                .collect())
        })
    }

    fn epoch_start(&self, channel_id: i64, epoch: u64) -> StoreFuture<Option<u64>> {
        self.run(move |conn| async move {
            let row = conn
                .client
                .query_opt(&conn.epoch_start, &[&channel_id, &to_db(epoch)])
                .await?;
            Ok(row.map(|row| from_db(row.get(0))))
        })
    }

    fn fetch_welcome(
        &self,
        channel_id: i64,
        key: WelcomeKey,
    ) -> StoreFuture<Option<WelcomeRecord>> {
        let key = Arc::new(key);
        self.run(move |conn| {
            let key = Arc::clone(&key);
            async move {
                let row = match &*key {
                    WelcomeKey::Digest(digest) => {
                        conn.client
                            .query_opt(&conn.welcome_by_digest, &[&channel_id, digest])
                            .await?
                    }
                    WelcomeKey::KeyPackageRef(key_package_ref) => {
                        conn.client
                            .query_opt(&conn.welcome_by_ref, &[&channel_id, key_package_ref])
                            .await?
                    }
                };
                Ok(row.as_ref().map(welcome_record))
            }
        })
    }

    fn retention_rows(&self, after_id: i64, limit: usize) -> StoreFuture<Vec<RetentionRow>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(move |conn| async move {
            let rows = conn
                .client
                .query(RETENTION_ROWS, &[&after_id, &limit])
                .await?;
            Ok(rows.iter().map(retention_row).collect())
        })
    }

    fn retention_row(&self, channel_id: i64) -> StoreFuture<Option<RetentionRow>> {
        self.run(move |conn| async move {
            let row = conn.client.query_opt(RETENTION_ROW, &[&channel_id]).await?;
            Ok(row.as_ref().map(retention_row))
        })
    }

    fn first_since(
        &self,
        channel_id: i64,
        after_seq: u64,
        up_to: u64,
        since_ms: i64,
    ) -> StoreFuture<Option<u64>> {
        let (after, up_to) = (to_db(after_seq), to_db(up_to));
        self.run(move |conn| async move {
            let row = conn
                .client
                .query_opt(FIRST_SINCE, &[&channel_id, &after, &up_to, &since_ms])
                .await?;
            Ok(row.map(|row| from_db(row.get(0))))
        })
    }

    fn bytes_cut(
        &self,
        channel_id: i64,
        after_seq: u64,
        max_bytes: u64,
    ) -> StoreFuture<Option<u64>> {
        let (after, max) = (to_db(after_seq), to_db(max_bytes));
        self.run(move |conn| async move {
            let row = conn
                .client
                .query_opt(BYTES_CUT, &[&channel_id, &after, &max])
                .await?;
            Ok(row.map(|row| from_db(row.get(0))))
        })
    }

    fn welcome_floor(&self, channel_id: i64) -> StoreFuture<Option<u64>> {
        self.run(move |conn| async move {
            let row = conn.client.query_one(WELCOME_FLOOR, &[&channel_id]).await?;
            Ok(row.get::<_, Option<i64>>(0).map(from_db))
        })
    }

    fn welcomes_due(&self, created_before: i64, used_before: i64) -> StoreFuture<bool> {
        self.run(move |conn| async move {
            let row = conn
                .client
                .query_one(WELCOMES_DUE, &[&created_before, &used_before])
                .await?;
            Ok(row.get(0))
        })
    }

    fn bound_keys(&self, after: String, limit: usize) -> StoreFuture<Vec<String>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(move |conn| {
            let after = after.clone();
            async move {
                let rows = conn.client.query(BOUND_KEYS, &[&after, &limit]).await?;
                Ok(rows.iter().map(|row| row.get(0)).collect())
            }
        })
    }

    fn leaves_of_key(&self, key_id: String, limit: usize) -> StoreFuture<Vec<(String, u32)>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(move |conn| {
            let key_id = key_id.clone();
            async move {
                let rows = conn.client.query(LEAVES_OF_KEY, &[&key_id, &limit]).await?;
                Ok(rows
                    .iter()
                    .map(|row| {
                        let leaf: i32 = row.get(1);
                        (row.get(0), u32::try_from(leaf).unwrap_or(u32::MAX))
                    })
                    .collect())
            }
        })
    }

    fn account_channels(
        &self,
        account: String,
        after_id: i64,
        limit: usize,
    ) -> StoreFuture<Vec<AccountChannelRow>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(move |conn| {
            let account = account.clone();
            async move {
                let rows = conn
                    .client
                    .query(ACCOUNT_CHANNELS, &[&account, &after_id, &limit])
                    .await?;
                Ok(rows
                    .iter()
                    .map(|row| {
                        let limit = |i: usize| row.get::<_, Option<i64>>(i).map(from_db);
                        AccountChannelRow {
                            id: row.get(0),
                            name: row.get(1),
                            epoch: from_db(row.get(2)),
                            head_seq: from_db(row.get(3)),
                            policy: Policy {
                                max_age_seconds: limit(4),
                                max_entries: limit(5),
                                max_bytes: limit(6),
                            },
                            // 0: appended before the time was recorded (migration 0004).
                            last_activity_ms: row.get::<_, Option<i64>>(7).filter(|at| *at > 0),
                        }
                    })
                    .collect())
            }
        })
    }

    fn account_rate(
        &self,
        account: String,
        since_ms: i64,
        content_type: u32,
        limit: usize,
    ) -> StoreFuture<Vec<(String, i64, u64)>> {
        // The column is a SMALLINT: a content type beyond it matches nothing.
        let Ok(content_type) = i16::try_from(content_type) else {
            return Box::pin(async { Ok(Vec::new()) });
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(move |conn| {
            let account = account.clone();
            async move {
                let rows = conn
                    .client
                    .query(ACCOUNT_RATE, &[&account, &since_ms, &content_type, &limit])
                    .await?;
                Ok(rows
                    .iter()
                    .map(|row| (row.get(0), row.get::<_, i64>(1), from_db(row.get(2))))
                    .collect())
            }
        })
    }

    fn org_owner(&self, org: &str) -> StoreFuture<Option<String>> {
        let org = org_key(org);
        self.run(move |conn| {
            let org = org.clone();
            async move {
                let row = conn.client.query_opt(ORG_OWNER, &[&org]).await?;
                Ok(row.map(|row| row.get(0)))
            }
        })
    }

    fn close(&self) {
        if let Some(listener) = self
            .0
            .listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            listener.abort();
        }
        // Dropping the clients ends their connections' tasks.
        for slot in &self.0.slots {
            if let Ok(mut slot) = slot.try_lock() {
                slot.take();
            }
        }
    }
}

// -- wake-ups ---------------------------------------------------------------------------------

/// LISTENs for commits (of every relay on the database) and moves the loaded channels
/// forward; reconnects for as long as the relay runs. `ready` hears how the first LISTEN went.
async fn listen(
    config: Config,
    heads: Arc<dyn Heads>,
    ready: tokio::sync::oneshot::Sender<std::result::Result<(), String>>,
) {
    let mut ready = Some(ready);
    // Said once per outage, not at every attempt.
    let mut down = false;
    loop {
        let outcome = listen_once(&config, &*heads, &mut ready, &mut down).await;
        if let Some(ready) = ready.take() {
            // The first connection failed: the start fails.
            let _ = ready.send(Err(match outcome {
                Err(err) => describe(&err),
                Ok(()) => "the listener's connection closed".to_owned(),
            }));
            return;
        }
        if !down {
            down = true;
            let why = match outcome {
                Err(err) => describe(&err),
                Ok(()) => "the connection closed".to_owned(),
            };
            ::log::error!(target: "static.relay", "store failure: lost PostgreSQL ({why}); reconnecting");
        }
        tokio::time::sleep(LISTEN_RETRY).await;
    }
}

/// One connection's worth of LISTEN: until it breaks.
async fn listen_once(
    config: &Config,
    heads: &dyn Heads,
    ready: &mut Option<tokio::sync::oneshot::Sender<std::result::Result<(), String>>>,
    down: &mut bool,
) -> PgResult<()> {
    let (client, mut connection) = config.connect(NoTls).await?;
    let (notices, mut received) = tokio::sync::mpsc::unbounded_channel();
    // The connection delivers notifications only while polled: its own task.
    let driver = tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    if notices.send(n.payload().to_owned()).is_err() {
                        return Ok(());
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            }
        }
    });
    let listening = async {
        client
            .batch_execute(&format!("LISTEN {NOTIFY_CHANNEL}"))
            .await?;
        // Whatever was committed before LISTEN took effect: read it.
        let ids = heads.loaded_ids();
        if !ids.is_empty() {
            for row in client.query(HEADS, &[&ids]).await? {
                heads.advance(row.get(0), from_db(row.get(1)), from_db(row.get(2)));
            }
        }
        PgResult::Ok(())
    };
    if let Err(err) = listening.await {
        driver.abort();
        return Err(err);
    }
    if let Some(ready) = ready.take() {
        let _ = ready.send(Ok(()));
    }
    if std::mem::replace(down, false) {
        ::log::info!(target: "static.relay", "PostgreSQL is back");
    }
    while let Some(payload) = received.recv().await {
        let mut fields = payload.split(' ').map(str::parse::<u64>);
        if let (Some(Ok(id)), Some(Ok(head)), Some(Ok(epoch))) =
            (fields.next(), fields.next(), fields.next())
        {
            heads.advance(to_db(id), head, epoch);
        }
    }
    drop(client);
    match driver.await {
        Ok(result) => result,
        Err(_) => Ok(()),
    }
}

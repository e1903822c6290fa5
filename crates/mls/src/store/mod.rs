//! Persistence of an [`Engine`](crate::Engine) under its data directory.
//!
//! # Design
//!
//! One SQLite database per data directory (`<data_dir>/mls.sqlite3`, rusqlite with the bundled
//! SQLite), used as OpenMLS's storage provider through `openmls_sqlite_storage`, plus three small
//! tables of our own (the identity, the list of groups, the bytes of each group's pending
//! commit). Why SQLite rather than our own files:
//!
//! * **Atomic, durable calls.** One public call of the engine is one SQLite transaction
//!   (`BEGIN IMMEDIATE` ... `COMMIT`): the dozen storage writes OpenMLS makes while merging a
//!   commit land together or not at all. A call that fails rolls back, and the in-memory group
//!   is reloaded from the database, so memory and disk never disagree. `journal_mode=WAL` and a
//!   sync of the WAL right after the commit (what `synchronous=FULL` does inside it; the
//!   connection runs at `NORMAL`) make the commit durable before the call returns:
//!   killing the process at any moment, or losing power, leaves the last committed state, which
//!   loads. Applying the relay's log (and taking from the inbox) commits without that sync
//!   ([`Db::light_transaction`]): still atomic and safe against a
//!   killed process; a power loss may take back such commits, which are redone from the log.
//!   Encrypting application messages too, where the kernel has a boot id: a power loss may
//!   then take back ratchet advances of messages already sent, which the next opening detects
//!   (another boot, not closed cleanly: `static_session`) and answers by requiring a commit of
//!   ours in each group before encrypting there again (`static_fresh_epoch_needed`), so no key
//!   and nonce is ever used twice. Commits and proposals stay durable. A hand-written "write temp + fsync + rename" scheme would have to rewrite the whole
//!   group state per message and would still need a journal across the several keys OpenMLS
//!   writes per operation.
//! * **Deleted secrets are gone.** `secure_delete=ON` overwrites deleted rows (used message keys,
//!   past-epoch secrets, consumed key packages) with zeros, and after every epoch change and on
//!   close the WAL is checkpointed and truncated so no older page images linger in it.
//! * **Checkpoints beside the calls.** Between those, a background thread copies the WAL into
//!   the database file after a few dozen commits, in a pause of the conversation where there is
//!   one (`Checkpointer`), so that no call pays for a checkpoint (SQLite's own, inside a
//!   commit, remains as a backstop). The WAL then restarts from its beginning, and is cut back
//!   to `journal_size_limit` (1 MiB) if a run of large commits had grown it; a WAL that a long
//!   run of commits kept from restarting is truncated by that thread in the next pause.
//! * **One process at a time.** The directory is locked with an exclusive `flock`-style file
//!   lock (`<data_dir>/lock`, held for the life of the engine); a second opener, in this process
//!   or another, gets a clear `runtime error:` instead of a corrupt state.
//! * **Private, and checked at opening.** The directory is created 0700 and every file in it
//!   0600 (SQLite gives the `-wal` and `-shm` files the database file's mode, so that one is
//!   created first). A damaged database must never pass for a fresh one, which would silently
//!   make a new identity: before SQLite opens it, its header is checked (magic, and a length
//!   at least the page count it records, when no write-ahead log is pending), and the identity
//!   is recorded beside it ([`IDENTITY_FILE`]) once created, so a database that lost it (cut
//!   to nothing, replaced, deleted) is refused. Both checks cost a few reads whatever the size
//!   (`PRAGMA quick_check` reads every page). SQLite's own corruption errors met while
//!   opening name the file too ([`StoreError::Damaged`]).
//!
//! Layout: this file opens the database (`Db`) and is the engine's OpenMLS provider
//! (`Provider`); `storage` is the provider's storage (OpenMLS's SQLite one, with the message
//! secrets deferred and split); `schema` every table of ours; `rows` the reads and writes of
//! those tables; `files` the data directory's files and their checks; `checkpoint` the WAL's
//! background checkpoints and sync.

pub(crate) mod checkpoint;
pub(crate) mod files;
pub(crate) mod rows;
pub(crate) mod schema;
pub mod storage;

use std::fs::File;
use std::path::{Path, PathBuf};

use openmls_rust_crypto::RustCrypto;
use openmls_sqlite_storage::SqliteStorageProvider;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::random::OpenMlsRand;
use openmls_traits::OpenMlsProvider;
use rusqlite::Connection;

/// File name of the database inside the data directory.
pub const DB_FILE: &str = "mls.sqlite3";
/// File name of the lock file inside the data directory.
pub const LOCK_FILE: &str = "lock";
/// File name of the record of the identity inside the data directory (its identity and
/// signature public key, in hex), written once the identity is stored.
pub const IDENTITY_FILE: &str = "identity";
/// Mode of the data directory, and of every file in it: its owner's only.
pub const DIR_MODE: u32 = 0o700;
pub const FILE_MODE: u32 = 0o600;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot use data_dir {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("data_dir {0} is in use by another StaticClient (another process or an open client in this one); close it first")]
    Locked(PathBuf),
    #[error("storage failure: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("internal panic: {0}")]
    Panic(String),
    #[error("the store could not be synced to disk earlier ({0}); reopen the client")]
    Unsynced(String),
    #[error("storage migration failed: {0}")]
    Migration(String),
    #[error("data_dir {path} belongs to identity {stored:?}, not {requested:?}")]
    WrongIdentity {
        path: PathBuf,
        stored: String,
        requested: String,
    },
    #[error(
        "{} is damaged: {detail}; restore the data directory from a backup (all its files \
         together), or use a new one (a new identity, to be added to its channels again)",
        path.display()
    )]
    Damaged { path: PathBuf, detail: String },
}

impl StoreError {
    /// Whether SQLite found the database damaged (not a database, malformed pages).
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            Self::Sqlite(rusqlite::Error::SqliteFailure(e, _))
                if matches!(
                    e.code,
                    rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt
                )
        )
    }

    /// [`StoreError::Damaged`] for the database at `path` if SQLite found it damaged.
    pub fn naming_damage(self, path: &Path) -> Self {
        if self.is_damage() {
            Self::Damaged {
                path: path.to_owned(),
                detail: self.to_string(),
            }
        } else {
            self
        }
    }
}

use checkpoint::{sync_wal, Checkpointer, BACKSTOP_AUTOCHECKPOINT, JOURNAL_SIZE_LIMIT};
use files::{check_database_file, check_identity_file, create_private_dir, private_file};
use rows::read_identity;
pub use rows::{Cursor, InboxMessage, StoredCommit};
pub use storage::{JsonCodec, Storage};

/// An OpenMLS provider over one borrowed connection, built per call (cheap). `C` is the crypto
/// (and randomness) provider: the engine's [`crate::crypto::StaticCrypto`], or plain
/// `RustCrypto`.
pub struct Provider<'a, C = RustCrypto> {
    crypto: &'a C,
    storage: Storage<'a>,
}

impl<'a, C> Provider<'a, C> {
    pub fn new(crypto: &'a C, conn: &'a Connection) -> Self {
        Self {
            crypto,
            storage: Storage::new(conn),
        }
    }
}

impl<'a, C: OpenMlsCrypto + OpenMlsRand> OpenMlsProvider for Provider<'a, C> {
    type CryptoProvider = C;
    type RandProvider = C;
    type StorageProvider = Storage<'a>;

    fn storage(&self) -> &Self::StorageProvider {
        &self.storage
    }

    fn crypto(&self) -> &Self::CryptoProvider {
        self.crypto
    }

    fn rand(&self) -> &Self::RandProvider {
        self.crypto
    }
}

/// The open database and the held directory lock.
pub struct Db {
    pub conn: Connection,
    checkpointer: Checkpointer,
    /// Why a durable commit could not be synced, if one could not: the store is unusable from
    /// then on (see [`Db::transaction`]).
    sync_failed: std::cell::RefCell<Option<String>>,
    /// Makes the next [`Db::sync_log`] fail, for the tests of what follows.
    #[cfg(test)]
    fail_next_sync: std::cell::Cell<bool>,
    _lock: File,
    pub path: PathBuf,
}

/// Maps an I/O error on `path` to the store's error naming it.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

impl Db {
    /// Opens (creating if needed) the store under `data_dir` and takes its lock.
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        create_private_dir(data_dir)?;
        let lock_path = data_dir.join(LOCK_FILE);
        let lock = private_file(&lock_path)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Locked(data_dir.to_owned()))
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&lock_path)(e)),
        }
        let path = data_dir.join(DB_FILE);
        check_database_file(&path)?;
        Self::open_checked(data_dir, path.clone(), lock).map_err(|e| e.naming_damage(&path))
    }

    fn open_checked(data_dir: &Path, path: PathBuf, lock: File) -> Result<Self, StoreError> {
        let mut conn = Connection::open(&path)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous=NORMAL;
             PRAGMA secure_delete=ON;
             PRAGMA foreign_keys=ON;",
        )?;
        conn.pragma_update(None, "wal_autocheckpoint", BACKSTOP_AUTOCHECKPOINT)?;
        conn.pragma_update(None, "journal_size_limit", JOURNAL_SIZE_LIMIT)?;
        let mut storage: SqliteStorageProvider<JsonCodec, &mut Connection> =
            SqliteStorageProvider::new(&mut conn);
        storage
            .run_migrations()
            .map_err(|e| StoreError::Migration(e.to_string()))?;
        crate::store::schema::create_tables(&conn)?;
        check_identity_file(data_dir, &path, read_identity(&conn)?)?;
        // After the schema exists: the checkpointer's connection needs the database in WAL mode.
        let checkpointer = Checkpointer::start(&path)?;
        Ok(Self {
            conn,
            checkpointer,
            sync_failed: std::cell::RefCell::new(None),
            #[cfg(test)]
            fail_next_sync: std::cell::Cell::new(false),
            _lock: lock,
            path,
        })
    }

    /// Runs `f` inside one immediate transaction: committed if it returns `Ok`, rolled back
    /// otherwise (also when the commit itself fails, and if `f` panics: the panic becomes an
    /// error, so a library bug never crashes the caller nor leaves a transaction open). Durable:
    /// the log is on disk before this returns.
    ///
    /// The connection runs at `synchronous=NORMAL` and this syncs the log itself after the
    /// commit (what `FULL` would do inside it): switching the pragma per transaction instead
    /// re-parsed two statements on every light transaction, the hot path. If that sync fails the
    /// commit may or may not be on disk, so the store refuses all further use (as PostgreSQL
    /// does on a failed fsync): the caller must reopen it.
    pub fn transaction<T, E: From<StoreError>>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, E>,
    ) -> Result<T, E> {
        let value = self.light_transaction(f)?;
        if let Err(e) = self.sync_log() {
            *self.sync_failed.borrow_mut() = Some(e.to_string());
            return Err(E::from(e));
        }
        Ok(value)
    }

    /// Like [`Db::transaction`] but without waiting for the disk: the commit is atomic and
    /// survives the process being killed (it is in the OS's WAL file), but not a power loss until
    /// the next durable commit or [`Db::sync_log`]. Used for applying the relay's log (entries
    /// lost to a power loss are applied again from it), for sends that are synced separately or
    /// covered by the boot-id check (see `Engine::open`), and for taking messages out of the
    /// inbox, where the worst a power loss can do is hand a message out twice.
    pub fn light_transaction<T, E: From<StoreError>>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, E>,
    ) -> Result<T, E> {
        if let Some(reason) = self.sync_failed.borrow().as_ref() {
            return Err(E::from(StoreError::Unsynced(reason.clone())));
        }
        self.conn
            .exec_cached("BEGIN IMMEDIATE")
            .map_err(|e| E::from(e.into()))?;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&self.conn)))
            .unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown".to_owned());
                Err(E::from(StoreError::Panic(what)))
            });
        match outcome {
            Ok(value) => match self.conn.exec_cached("COMMIT") {
                Ok(()) => {
                    self.committed();
                    Ok(value)
                }
                Err(e) => {
                    let _ = self.conn.execute_batch("ROLLBACK");
                    Err(E::from(e.into()))
                }
            },
            Err(err) => {
                // A failed rollback leaves the transaction to be rolled back when the connection
                // closes; nothing of it was committed either way.
                let _ = self.conn.execute_batch("ROLLBACK");
                Err(err)
            }
        }
    }

    /// Puts everything committed so far on disk (see [`sync_wal`]).
    pub fn sync_log(&self) -> Result<(), StoreError> {
        #[cfg(test)]
        if self.fail_next_sync.take() {
            return Err(io(&self.path)(std::io::Error::other(
                "injected sync failure",
            )));
        }
        sync_wal(&self.path)
    }

    fn committed(&self) {
        self.checkpointer.committed();
    }

    /// Checkpoints the WAL into the database and truncates it, so no page images of deleted
    /// secrets survive in the WAL file.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(())
    }
}

/// Runs one statement without output from the connection's statement cache: the statements
/// every call runs (transaction control, pragmas, savepoints) are parsed once, not per call.
pub(crate) trait ExecCached {
    fn exec_cached(&self, sql: &str) -> rusqlite::Result<()>;
}

impl ExecCached for Connection {
    fn exec_cached(&self, sql: &str) -> rusqlite::Result<()> {
        self.prepare_cached(sql)?.execute([])?;
        Ok(())
    }
}

/// Room for every statement of a call (ours, the inbox's) in the statement cache.
const STATEMENT_CACHE: usize = 64;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::checkpoint::*;

    use super::rows::*;
    use super::*;

    fn count(db: &Db) -> i64 {
        db.conn
            .query_row("SELECT COUNT(*) FROM static_groups", [], |row| row.get(0))
            .unwrap()
    }

    #[test]
    fn durable_and_light_transactions_commit_at_normal_synchronous() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path()).unwrap();
        db.transaction(|conn| insert_group(conn, "a/b/c")).unwrap();
        db.light_transaction(|conn| insert_group(conn, "a/b/d"))
            .unwrap();
        assert_eq!(count(&db), 2);
        // No per-transaction pragma switch: the connection stays at NORMAL (1), durable
        // transactions sync the log themselves.
        let level: i64 = db
            .conn
            .query_row("PRAGMA synchronous", [], |row| row.get(0))
            .unwrap();
        assert_eq!(level, 1);
        db.sync_log().unwrap();
    }

    #[test]
    fn the_background_checkpoint_waits_for_enough_commits_and_a_pause() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path()).unwrap();
        let before = db.checkpointer.runs();
        for i in 0..CHECKPOINT_EVERY - 1 {
            db.light_transaction(|conn| insert_group(conn, &format!("a/b/{i}")))
                .unwrap();
        }
        std::thread::sleep(CHECKPOINT_PAUSE * 5);
        assert_eq!(
            db.checkpointer.runs(),
            before,
            "too few commits for a checkpoint"
        );
        db.light_transaction(|conn| insert_group(conn, "a/b/last"))
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while db.checkpointer.runs() == before {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint after a pause"
            );
            std::thread::sleep(CHECKPOINT_PAUSE);
        }
    }

    /// A store in a new directory with a table `big` of blobs, and the path of its WAL.
    fn db_with_big_table() -> (tempfile::TempDir, Db, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path()).unwrap();
        let wal = dir.path().join(format!("{DB_FILE}-wal"));
        db.light_transaction(|conn| {
            conn.execute_batch("CREATE TABLE big (data BLOB)")?;
            Ok::<_, StoreError>(())
        })
        .unwrap();
        (dir, db, wal)
    }

    /// `count` commits of one zeroed blob of `bytes` each.
    fn insert_blobs(db: &Db, count: u32, bytes: usize) {
        for _ in 0..count {
            db.light_transaction(|conn| {
                conn.execute("INSERT INTO big (data) VALUES (zeroblob(?1))", [bytes])?;
                Ok::<_, StoreError>(())
            })
            .unwrap();
        }
    }

    #[test]
    fn the_wal_is_cut_back_once_a_checkpoint_lets_it_restart() {
        let (_dir, db, wal) = db_with_big_table();
        // A few MiB of commits between two checkpoints...
        insert_blobs(&db, 4, 1024 * 1024);
        let grown = std::fs::metadata(&wal).unwrap().len();
        assert!(grown > 4 * 1024 * 1024, "{grown}");
        // ...then a checkpoint like the background one (PASSIVE), and the next commit, which
        // restarts the WAL: the file is cut back to the limit.
        db.conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
            .unwrap();
        db.light_transaction(|conn| insert_group(conn, "a/b/c"))
            .unwrap();
        let kept = std::fs::metadata(&wal).unwrap().len();
        assert!(kept <= JOURNAL_SIZE_LIMIT as u64, "{kept}");
    }

    #[test]
    fn a_wal_grown_past_the_limit_is_truncated_in_the_next_pause() {
        let (_dir, db, wal) = db_with_big_table();
        // Enough commits for a background checkpoint, growing the WAL past the limit, then a
        // pause.
        insert_blobs(&db, CHECKPOINT_EVERY, 65536);
        assert!(wal_len(&wal) > JOURNAL_SIZE_LIMIT_BYTES);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while db.checkpointer.truncations() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no truncation in the pause"
            );
            std::thread::sleep(CHECKPOINT_PAUSE);
        }
        assert_eq!(wal_len(&wal), 0);
        // And the store goes on.
        db.light_transaction(|conn| insert_group(conn, "a/b/c"))
            .unwrap();
        assert_eq!(count(&db), 1);
    }

    #[test]
    fn after_a_run_of_commits_without_a_pause_the_wal_is_truncated_in_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path()).unwrap();
        let wal = dir.path().join(format!("{DB_FILE}-wal"));
        db.light_transaction(|conn| {
            conn.execute_batch("CREATE TABLE big (data BLOB)")?;
            Ok::<_, StoreError>(())
        })
        .unwrap();
        // More than CHECKPOINT_LATEST commits back to back, and a tail of a few (fewer than
        // CHECKPOINT_EVERY since the forced checkpoint).
        for _ in 0..CHECKPOINT_LATEST + 5 {
            db.light_transaction(|conn| {
                conn.execute("INSERT INTO big (data) VALUES (zeroblob(32768))", [])?;
                Ok::<_, StoreError>(())
            })
            .unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while wal_len(&wal) > JOURNAL_SIZE_LIMIT_BYTES {
            assert!(
                std::time::Instant::now() < deadline,
                "the WAL is still {} bytes after {} checkpoints, {} truncations",
                wal_len(&wal),
                db.checkpointer.runs(),
                db.checkpointer.truncations()
            );
            std::thread::sleep(CHECKPOINT_PAUSE);
        }
    }

    #[test]
    fn a_failed_sync_makes_the_store_refuse_further_use() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path()).unwrap();
        db.fail_next_sync.set(true);
        let failed = db.transaction(|conn| insert_group(conn, "a/b/c"));
        assert!(matches!(failed, Err(StoreError::Io { .. })), "{failed:?}");
        // Committed or not on disk, nobody can tell: nothing more is written.
        for attempt in [
            db.light_transaction(|conn| insert_group(conn, "a/b/d")),
            db.transaction(|conn| insert_group(conn, "a/b/e")),
        ] {
            assert!(
                matches!(attempt, Err(StoreError::Unsynced(_))),
                "{attempt:?}"
            );
        }
        assert_eq!(count(&db), 1);
    }

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_directory_and_its_files_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().join("new/data");
        let engine = crate::Engine::open(&data_dir, b"alice").unwrap();
        engine.create_group("a/b/c").unwrap();
        assert_eq!(mode(&data_dir), DIR_MODE);
        for name in [
            DB_FILE,
            "mls.sqlite3-wal",
            "mls.sqlite3-shm",
            LOCK_FILE,
            IDENTITY_FILE,
        ] {
            assert_eq!(mode(&data_dir.join(name)), FILE_MODE, "{name}");
        }
        drop(engine);
        // Files an older version made with the umask's mode are made private at opening.
        use std::os::unix::fs::PermissionsExt;
        for name in [DB_FILE, LOCK_FILE] {
            std::fs::set_permissions(data_dir.join(name), std::fs::Permissions::from_mode(0o644))
                .unwrap();
        }
        drop(crate::Engine::open(&data_dir, b"alice").unwrap());
        for name in [DB_FILE, LOCK_FILE] {
            assert_eq!(mode(&data_dir.join(name)), FILE_MODE, "{name}");
        }
    }

    /// What opening `data_dir` says, as a string (or "opened").
    fn opening(data_dir: &Path) -> String {
        match crate::Engine::open(data_dir, b"alice") {
            Ok(_) => "opened".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_damaged_database_is_refused_never_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path();
        let engine = crate::Engine::open(data_dir, b"alice").unwrap();
        for i in 0..20 {
            engine.create_group(&format!("a/b/c{i}")).unwrap();
        }
        drop(engine);
        let db = data_dir.join(DB_FILE);
        let good = std::fs::read(&db).unwrap();
        assert!(good.len() > 8 * 4096, "{}", good.len());
        assert!(!data_dir.join("mls.sqlite3-wal").exists() || wal_len(&wal_path(&db)) == 0);
        let cases: [(&str, Option<Vec<u8>>); 5] = [
            ("holds no identity", Some(Vec::new())),
            ("cut short", Some(good[..good.len() / 2].to_vec())),
            ("cut short", Some(good[..4096].to_vec())),
            ("not a SQLite database", Some(vec![7u8; good.len()])),
            ("holds no identity", None),
        ];
        for (what, bytes) in cases {
            match bytes {
                Some(bytes) => std::fs::write(&db, bytes).unwrap(),
                None => std::fs::remove_file(&db).unwrap(),
            }
            let said = opening(data_dir);
            assert!(said.starts_with("runtime error: "), "{said}");
            assert!(
                said.contains(&format!("{} is damaged", db.display())),
                "{said}"
            );
            assert!(said.contains(what), "{what}: {said}");
            // Still refused: nothing was made in its place.
            let again = opening(data_dir);
            assert!(again.contains(what), "{what}: {again}");
            let _ = std::fs::remove_file(wal_path(&db));
            let _ = std::fs::remove_file(format!("{}-shm", db.display()));
        }
        std::fs::write(&db, &good).unwrap();
        assert_eq!(opening(data_dir), "opened");
    }

    #[test]
    fn a_directory_of_an_older_version_gets_its_identity_recorded() {
        let dir = tempfile::tempdir().unwrap();
        drop(crate::Engine::open(dir.path(), b"alice").unwrap());
        std::fs::remove_file(dir.path().join(IDENTITY_FILE)).unwrap();
        assert_eq!(opening(dir.path()), "opened");
        assert!(dir.path().join(IDENTITY_FILE).exists());
        std::fs::remove_file(dir.path().join(DB_FILE)).unwrap();
        assert!(opening(dir.path()).contains("holds no identity"));
    }
}

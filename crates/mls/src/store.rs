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

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use openmls_rust_crypto::RustCrypto;
use openmls_sqlite_storage::SqliteStorageProvider;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::random::OpenMlsRand;
use openmls_traits::OpenMlsProvider;
use rusqlite::{Connection, OptionalExtension};

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

pub use crate::storage::{JsonCodec, Storage};

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

/// Commits before a background checkpoint is worth it: a few dozen pages of WAL.
const CHECKPOINT_EVERY: u32 = 32;

/// The background checkpoint waits for a pause this long in the commits (its fsyncs would
/// otherwise share the disk with those of the conversation going on, the relay's included)...
const CHECKPOINT_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// ...unless this many commits went by without one: still well below
/// [`BACKSTOP_AUTOCHECKPOINT`] (a commit writes a few pages).
const CHECKPOINT_LATEST: u32 = 64;

/// SQLite's own checkpoint inside a commit (pages of WAL), only reached if the background
/// checkpoints fall behind (their connection failed, or a long burst).
const BACKSTOP_AUTOCHECKPOINT: u32 = 4096;

/// Bytes of WAL file kept once a checkpoint let it restart (SQLite then truncates it to this):
/// the background checkpoints are PASSIVE and never shrink the file, so without a limit it kept
/// the size of the largest run of commits between two of them until the next epoch change
/// (7.8 MB for the creator of a 512-member group, when every message rewrote 218 KB of message
/// secrets). A run of messages now writes a few pages each, well under this.
const JOURNAL_SIZE_LIMIT: i64 = 1024 * 1024;
const JOURNAL_SIZE_LIMIT_BYTES: u64 = JOURNAL_SIZE_LIMIT as u64;

/// How long the background checkpoint's connection waits for a lock.
const CHECKPOINT_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn wal_path(db_path: &Path) -> PathBuf {
    PathBuf::from(format!("{}-wal", db_path.display()))
}

/// The WAL file's length (0 when there is none).
fn wal_len(wal: &Path) -> u64 {
    std::fs::metadata(wal).map_or(0, |m| m.len())
}

/// Copies the WAL into the database file on its own thread and connection (a PASSIVE
/// checkpoint: it neither waits for nor blocks the engine's writes), once
/// [`CHECKPOINT_EVERY`] commits have gone by and the commits pause ([`CHECKPOINT_PAUSE`]), or
/// after [`CHECKPOINT_LATEST`] commits without a pause; then at the next pause whatever the
/// count (a checkpoint racing a run of commits cannot let the WAL restart), truncating the WAL
/// there if it grew past [`JOURNAL_SIZE_LIMIT`]. Left to SQLite, the checkpoint runs
/// inside whichever commit crosses the threshold, and that call then waits for two extra
/// fsyncs and the page copies (milliseconds on a slow disk) in the middle of a conversation.
struct Checkpointer {
    shared: std::sync::Arc<(std::sync::Mutex<CheckpointState>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct CheckpointState {
    /// Commits since the last checkpoint, and when the latest was.
    commits: u32,
    last_commit: Option<std::time::Instant>,
    /// Checkpoints run so far, and how many of them also truncated the WAL.
    runs: u32,
    truncations: u32,
    /// Whether the last checkpoint was forced in a run of commits (no pause came), or raced
    /// commits.
    after_busy: bool,
    stop: bool,
}

impl Checkpointer {
    fn start(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(CHECKPOINT_BUSY_TIMEOUT)?;
        // The checkpoint syncs the database file before the WAL may be reused.
        conn.execute_batch("PRAGMA synchronous=FULL;")?;
        let shared = std::sync::Arc::new((
            std::sync::Mutex::new(CheckpointState::default()),
            std::sync::Condvar::new(),
        ));
        let theirs = shared.clone();
        let wal = wal_path(path);
        let thread = std::thread::Builder::new()
            .name("static-mls-checkpoint".into())
            .spawn(move || Self::run(&conn, &wal, &theirs))
            .map_err(|e| StoreError::Io {
                path: path.to_owned(),
                source: e,
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    fn run(
        conn: &Connection,
        wal: &Path,
        shared: &(std::sync::Mutex<CheckpointState>, std::sync::Condvar),
    ) {
        let (state, wake) = shared;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if state.stop {
                return;
            }
            // After a checkpoint forced in a run of commits, the next pause gets one too,
            // however few commits came since, if any (see below).
            let follow_up = state.after_busy;
            if state.commits < CHECKPOINT_EVERY && !follow_up {
                state = wake.wait(state).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let quiet = state
                .last_commit
                .map_or(CHECKPOINT_PAUSE, |at| at.elapsed());
            if quiet < CHECKPOINT_PAUSE && state.commits < CHECKPOINT_LATEST {
                state = wake
                    .wait_timeout(state, CHECKPOINT_PAUSE - quiet)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            }
            let busy = quiet < CHECKPOINT_PAUSE;
            state.commits = 0;
            drop(state);
            // Best effort: a failure leaves the WAL to the next run or SQLite's backstop.
            let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
            state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
            state.runs += 1;
            // Commits during the checkpoint kept it from letting the WAL restart, as a run of
            // them does: the next pause gets a checkpoint too.
            state.after_busy = busy || state.commits > 0;
            if !busy && state.commits == 0 && wal_len(wal) > JOURNAL_SIZE_LIMIT_BYTES {
                // Still quiet, and a run of commits that never paused long enough for a
                // checkpoint to let the WAL restart has grown it past the limit (200 sends at
                // N=2 left 6.4 MB, kept until the next epoch change): cut it back now. Not
                // waiting for a writer (the engine's next commit would wait for us): if one
                // came, a later pause does it.
                drop(state);
                let _ = conn.busy_timeout(std::time::Duration::ZERO);
                let _ = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
                let _ = conn.busy_timeout(CHECKPOINT_BUSY_TIMEOUT);
                state = shared.0.lock().unwrap_or_else(|e| e.into_inner());
                state.truncations += 1;
            }
        }
    }

    /// Counts a commit (see [`Checkpointer`]).
    fn committed(&self) {
        let (state, wake) = &*self.shared;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.commits = state.commits.saturating_add(1);
        state.last_commit = Some(std::time::Instant::now());
        if state.commits == CHECKPOINT_EVERY
            || state.commits == CHECKPOINT_LATEST
            || (state.after_busy && state.commits == 1)
        {
            wake.notify_one();
        }
    }

    #[cfg(test)]
    fn runs(&self) -> u32 {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).runs
    }

    #[cfg(test)]
    fn truncations(&self) -> u32 {
        self.shared
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .truncations
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (state, wake) = &*self.shared;
        state.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Syncs the write-ahead log of the database at `db_path`, where every commit since the last
/// checkpoint is (a checkpoint syncs the database file before it lets the log go). Needs no
/// connection: a sender syncs while others go on using the store.
pub(crate) fn sync_wal(db_path: &Path) -> Result<(), StoreError> {
    let wal = wal_path(db_path);
    match File::open(&wal) {
        Ok(file) => file.sync_data().map_err(io(&wal)),
        // No log: everything is in the (synced) database file.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(&wal)(e)),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Creates `dir` (and its missing parents) with [`DIR_MODE`]; an existing one is left as it is
/// (the SDK warns when others may read it).
fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(io(dir))
}

/// Opens (creating if needed) a file of the data directory for reading and writing, with
/// [`FILE_MODE`] (also an existing file of an older version, made with the umask's mode).
pub(crate) fn private_file(path: &Path) -> Result<File, StoreError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .open(path)
        .map_err(io(path))?;
    let mode = file.metadata().map_err(io(path))?.permissions().mode();
    if mode & 0o777 != FILE_MODE {
        file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
            .map_err(io(path))?;
    }
    Ok(file)
}

/// SQLite's file header: its magic and length (it records the page size at 16, the change
/// counter at 24, the page count at 28 and the change the page count is valid for at 92).
const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";
const SQLITE_HEADER_LEN: usize = 100;

/// Cheap checks of the database file before SQLite opens it (see the module docs), and the
/// mode of its files: an empty or missing file is a new database (the identity record tells
/// whether it may be); a file that is not a database, or shorter than the pages its header
/// counts while no write-ahead log holds newer pages, is damaged.
fn check_database_file(path: &Path) -> Result<(), StoreError> {
    use std::io::Read;
    let damaged = |detail: String| StoreError::Damaged {
        path: path.to_owned(),
        detail,
    };
    let wal = wal_len(&wal_path(path));
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if wal > 0 {
                return Err(damaged(
                    "it is missing, but its write-ahead log (-wal) is there".into(),
                ));
            }
            // Made with our mode: SQLite gives its -wal and -shm files the same.
            drop(private_file(path)?);
            return Ok(());
        }
        Err(e) => return Err(io(path)(e)),
    };
    let len = file.metadata().map_err(io(path))?.len();
    for suffix in ["", "-wal", "-shm"] {
        let own = PathBuf::from(format!("{}{suffix}", path.display()));
        if own.exists() {
            drop(private_file(&own)?);
        }
    }
    if len == 0 {
        return Ok(());
    }
    let mut header = [0u8; SQLITE_HEADER_LEN];
    if file.read_exact(&mut header).is_err() || &header[..16] != SQLITE_MAGIC {
        return Err(damaged("it is not a SQLite database".into()));
    }
    let be32 = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let page_size = match u16::from_be_bytes([header[16], header[17]]) {
        1 => 65_536,
        n => u64::from(n),
    };
    let expected = u64::from(be32(28)).saturating_mul(page_size);
    // The page count is valid only if written by the same change as the counter (SQLite's
    // rule); a pending log may hold pages a crashed checkpoint had not copied yet.
    if be32(24) == be32(92) && wal == 0 && len < expected {
        return Err(damaged(format!(
            "it was cut short: {len} bytes of the {expected} its header counts"
        )));
    }
    Ok(())
}

/// The record of an identity in [`IDENTITY_FILE`].
fn identity_record(identity: &[u8], public: &[u8]) -> String {
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!("static identity v1 {} {}\n", hex(identity), hex(public))
}

/// A database holding no identity, or another one, where [`IDENTITY_FILE`] records that one
/// was created is damaged or replaced: refused, rather than silently becoming a new identity.
fn check_identity_file(
    data_dir: &Path,
    db_path: &Path,
    stored: Option<IdentityRow>,
) -> Result<(), StoreError> {
    let record_path = data_dir.join(IDENTITY_FILE);
    let recorded = match std::fs::read_to_string(&record_path) {
        Ok(text) => text,
        // Never recorded: a new directory, or one of a version before the record.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(&record_path)(e)),
    };
    let detail = match stored {
        None => format!(
            "it holds no identity, but {} records that one was made here: the database was \
             cut short, replaced or deleted",
            record_path.display()
        ),
        Some((identity, public)) if identity_record(&identity, &public) != recorded => format!(
            "it holds another identity than {} records: it was replaced",
            record_path.display()
        ),
        Some(_) => return Ok(()),
    };
    Err(StoreError::Damaged {
        path: db_path.to_owned(),
        detail,
    })
}

/// Records the identity the database holds (see [`check_identity_file`]) unless it is
/// recorded already: once it is made, and in a directory of an older version. Written to a
/// temporary file, synced and renamed, so a crash leaves it whole or absent (then written at
/// the next opening).
pub(crate) fn record_identity(
    data_dir: &Path,
    identity: &[u8],
    public: &[u8],
) -> Result<(), StoreError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join(IDENTITY_FILE);
    if path.exists() {
        return Ok(());
    }
    let temporary = data_dir.join(format!("{IDENTITY_FILE}.tmp"));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .open(&temporary)
        .map_err(io(&temporary))?;
    file.write_all(identity_record(identity, public).as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io(&temporary))?;
    std::fs::rename(&temporary, &path).map_err(io(&path))?;
    File::open(data_dir)
        .and_then(|dir| dir.sync_all())
        .map_err(io(data_dir))
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
        crate::schema::create_tables(&conn)?;
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

/// The stored identity row: (identity, signature public key).
pub(crate) type IdentityRow = (Vec<u8>, Vec<u8>);

pub(crate) fn read_identity(conn: &Connection) -> Result<Option<IdentityRow>, StoreError> {
    Ok(conn
        .query_row(
            "SELECT identity, signature_public_key FROM static_identity WHERE id = 0",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?)
}

pub(crate) fn write_identity(
    conn: &Connection,
    identity: &[u8],
    public: &[u8],
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT INTO static_identity (id, identity, signature_public_key) VALUES (0, ?1, ?2)",
        (identity, public),
    )?;
    Ok(())
}

pub(crate) fn group_names(conn: &Connection) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare("SELECT name FROM static_groups ORDER BY name")?;
    let names = stmt
        .query_map([], |row| row.get(0))?
        .collect::<Result<Vec<String>, _>>()?;
    Ok(names)
}

pub(crate) fn insert_group(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute("INSERT INTO static_groups (name) VALUES (?1)", [name])?;
    Ok(())
}

pub(crate) fn delete_group(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute("DELETE FROM static_groups WHERE name = ?1", [name])?;
    Ok(())
}

pub(crate) fn set_pending_commit(
    conn: &Connection,
    name: &str,
    bytes: &[u8],
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR REPLACE INTO static_pending_commits (name, commit_bytes) VALUES (?1, ?2)",
        (name, bytes),
    )?;
    Ok(())
}

pub(crate) fn pending_commit(conn: &Connection, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT commit_bytes FROM static_pending_commits WHERE name = ?1")?
        .query_row([name], |row| row.get(0))
        .optional()?)
}

pub(crate) fn clear_pending_commit(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute("DELETE FROM static_pending_commits WHERE name = ?1", [name])?;
    Ok(())
}

/// The engine's last opening: (boot id, closed cleanly).
pub(crate) fn read_session(
    conn: &Connection,
) -> Result<Option<(Option<String>, bool)>, StoreError> {
    Ok(conn
        .query_row(
            "SELECT boot_id, clean FROM static_session WHERE id = 0",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?)
}

pub(crate) fn write_session(
    conn: &Connection,
    boot_id: Option<&str>,
    clean: bool,
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR REPLACE INTO static_session (id, boot_id, clean) VALUES (0, ?1, ?2)",
        (boot_id, clean),
    )?;
    Ok(())
}

pub(crate) fn require_fresh_epoch(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR IGNORE INTO static_fresh_epoch_needed (name) VALUES (?1)",
        [name],
    )?;
    Ok(())
}

pub(crate) fn fresh_epoch_needed(conn: &Connection, name: &str) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM static_fresh_epoch_needed WHERE name = ?1")?
        .query_row([name], |_| Ok(()))
        .optional()?
        .is_some())
}

pub(crate) fn any_fresh_epoch_needed(conn: &Connection) -> Result<bool, StoreError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM static_fresh_epoch_needed LIMIT 1",
            [],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// Our pending commit was merged: it is gone, and the group is at an epoch of its own making.
pub(crate) fn own_commit_merged(conn: &Connection, name: &str) -> Result<(), StoreError> {
    clear_pending_commit(conn, name)?;
    conn.prepare_cached("DELETE FROM static_fresh_epoch_needed WHERE name = ?1")?
        .execute([name])?;
    Ok(())
}

/// Where a channel's processing resumes in the relay's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cursor {
    /// Entries after this seq (0: from the beginning).
    After(u64),
    /// No entry applied yet since joining at this epoch: entries from the start of the epoch.
    FromEpoch(u64),
}

/// A count or seq as SQLite's INTEGER stores it (saturating: none comes near 2^63).
pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A stored INTEGER back as a count or seq (a negative one, never written, reads as 0).
pub(crate) fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

pub(crate) fn set_cursor(conn: &Connection, name: &str, cursor: Cursor) -> Result<(), StoreError> {
    let (seq, epoch) = match cursor {
        Cursor::After(seq) => (Some(to_i64(seq)), 0),
        Cursor::FromEpoch(epoch) => (None, to_i64(epoch)),
    };
    conn.prepare_cached(
        "INSERT OR REPLACE INTO static_cursors (name, seq, join_epoch) VALUES (?1, ?2, ?3)",
    )?
    .execute((name, seq, epoch))?;
    Ok(())
}

pub(crate) fn cursor(conn: &Connection, name: &str) -> Result<Cursor, StoreError> {
    let row: Option<(Option<i64>, i64)> = conn
        .query_row(
            "SELECT seq, join_epoch FROM static_cursors WHERE name = ?1",
            [name],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    Ok(match row {
        Some((Some(seq), _)) => Cursor::After(to_u64(seq)),
        Some((None, epoch)) => Cursor::FromEpoch(to_u64(epoch)),
        // A group created before cursors existed: replay the whole log (what cannot be
        // decrypted any more is skipped).
        None => Cursor::After(0),
    })
}

pub(crate) fn inbox_push(
    conn: &Connection,
    name: &str,
    message: &InboxMessage,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO static_inbox (name, seq, sender, payload, epoch, account)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute((
        name,
        to_i64(message.seq),
        &message.sender,
        &message.payload,
        to_i64(message.epoch),
        message.account.as_deref(),
    ))?;
    Ok(())
}

/// One received message waiting in the inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxMessage {
    /// The row's id: increasing in arrival order, never reused (0 before it is stored).
    pub id: i64,
    /// Its place in the channel's log.
    pub seq: u64,
    /// The sender's identity (its credential), as MLS authenticated it.
    pub sender: Vec<u8>,
    pub payload: Vec<u8>,
    /// The epoch it was sent in.
    pub epoch: u64,
    /// The account that published it, as the relay attests it ("" when anonymous); None when
    /// unknown (a relay of an older release, a row stored by an older version).
    pub account: Option<String>,
}

fn inbox_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<InboxMessage> {
    Ok(InboxMessage {
        id: row.get(0)?,
        seq: to_u64(row.get(1)?),
        sender: row.get(2)?,
        payload: row.get(3)?,
        epoch: to_u64(row.get(4)?),
        account: row.get(5)?,
    })
}

/// Up to `limit` messages of the channel's inbox after row `after_id`, oldest first (a read:
/// no transaction needed).
pub(crate) fn inbox_after(
    conn: &Connection,
    name: &str,
    after_id: i64,
    limit: usize,
) -> Result<Vec<InboxMessage>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, seq, sender, payload, epoch, account FROM static_inbox
         WHERE name = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
    )?;
    let rows = stmt
        .query_map(
            (name, after_id, i64::try_from(limit).unwrap_or(i64::MAX)),
            inbox_row,
        )?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Removes and returns the oldest message of the channel's inbox (for users of the engine
/// alone; the SDK's client hands messages out through [`inbox_after`] and its marks).
pub(crate) fn inbox_take(
    conn: &Connection,
    name: &str,
) -> Result<Option<InboxMessage>, StoreError> {
    Ok(conn
        .prepare_cached(
            "DELETE FROM static_inbox WHERE id = (
                 SELECT id FROM static_inbox WHERE name = ?1 ORDER BY id LIMIT 1
             ) RETURNING id, seq, sender, payload, epoch, account",
        )?
        .query_row([name], inbox_row)
        .optional()?)
}

/// Deletes the channel's inbox rows up to `upto_id` (messages already handed out).
pub(crate) fn inbox_prune(
    conn: &Connection,
    name: &str,
    upto_id: i64,
) -> Result<usize, StoreError> {
    Ok(conn
        .prepare_cached("DELETE FROM static_inbox WHERE name = ?1 AND id <= ?2")?
        .execute((name, upto_id))?)
}

/// How many messages of the channel's inbox come after row `after_id`.
pub(crate) fn inbox_count_after(
    conn: &Connection,
    name: &str,
    after_id: i64,
) -> Result<u64, StoreError> {
    let n: i64 = conn.query_row(
        "SELECT count(*) FROM static_inbox WHERE name = ?1 AND id > ?2",
        (name, after_id),
        |row| row.get(0),
    )?;
    Ok(to_u64(n))
}

/// The channel's slot in the hand-out marks file (see `static-client`), assigned on first use
/// and kept for good. A new slot is given to `init` (which writes its first mark) before it is
/// recorded, so every recorded slot has a mark: a slot of the file without one is damage.
pub(crate) fn inbox_slot(
    conn: &Connection,
    name: &str,
    init: impl FnOnce(u64) -> Result<(), StoreError>,
) -> Result<u64, StoreError> {
    conn.execute_batch(crate::schema::INBOX_SLOTS_TABLE)?;
    let known: Option<i64> = conn
        .query_row(
            "SELECT slot FROM static_inbox_slots WHERE name = ?1",
            [name],
            |row| row.get(0),
        )
        .optional()?;
    if let Some(slot) = known {
        return Ok(to_u64(slot));
    }
    let slot: i64 = conn.query_row(
        "SELECT COALESCE(MAX(slot) + 1, 0) FROM static_inbox_slots",
        [],
        |row| row.get(0),
    )?;
    init(to_u64(slot))?;
    conn.execute(
        "INSERT INTO static_inbox_slots (name, slot) VALUES (?1, ?2)",
        (name, slot),
    )?;
    Ok(to_u64(slot))
}

/// How many slots the hand-out marks file has (see [`inbox_slot`]), and the file's id if the
/// client recorded one ([`record_inbox_marks`]).
pub(crate) fn inbox_marks(conn: &Connection) -> Result<(u64, Option<Vec<u8>>), StoreError> {
    conn.execute_batch(crate::schema::INBOX_SLOTS_TABLE)?;
    let slots: i64 = conn.query_row(
        "SELECT COALESCE(MAX(slot) + 1, 0) FROM static_inbox_slots",
        [],
        |row| row.get(0),
    )?;
    let file_id = conn
        .query_row(
            "SELECT file_id FROM static_inbox_marks WHERE id = 0",
            [],
            |row| row.get(0),
        )
        .optional()?;
    Ok((to_u64(slots), file_id))
}

/// Records the id of the hand-out marks file (see [`inbox_marks`]).
pub(crate) fn record_inbox_marks(conn: &Connection, file_id: &[u8]) -> Result<(), StoreError> {
    conn.execute_batch(crate::schema::INBOX_SLOTS_TABLE)?;
    conn.execute(
        "INSERT OR REPLACE INTO static_inbox_marks (id, file_id) VALUES (0, ?1)",
        [file_id],
    )?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
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

//! The WAL's background checkpoints (beside the calls, in a pause of the conversation) and its
//! sync after a commit.

use std::fs::File;
use std::path::{Path, PathBuf};

use rusqlite::Connection;

use super::{io, StoreError};

/// Commits before a background checkpoint is worth it: a few dozen pages of WAL.
pub(super) const CHECKPOINT_EVERY: u32 = 32;

/// The background checkpoint waits for a pause this long in the commits (its fsyncs would
/// otherwise share the disk with those of the conversation going on, the relay's included)...
pub(super) const CHECKPOINT_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// ...unless this many commits went by without one: still well below
/// [`BACKSTOP_AUTOCHECKPOINT`] (a commit writes a few pages).
pub(super) const CHECKPOINT_LATEST: u32 = 64;

/// SQLite's own checkpoint inside a commit (pages of WAL), only reached if the background
/// checkpoints fall behind (their connection failed, or a long burst).
pub(super) const BACKSTOP_AUTOCHECKPOINT: u32 = 4096;

/// Bytes of WAL file kept once a checkpoint let it restart (SQLite then truncates it to this):
/// the background checkpoints are PASSIVE and never shrink the file, so without a limit it kept
/// the size of the largest run of commits between two of them until the next epoch change
/// (7.8 MB for the creator of a 512-member group, when every message rewrote 218 KB of message
/// secrets). A run of messages now writes a few pages each, well under this.
pub(super) const JOURNAL_SIZE_LIMIT: i64 = 1024 * 1024;
pub(super) const JOURNAL_SIZE_LIMIT_BYTES: u64 = JOURNAL_SIZE_LIMIT as u64;

/// How long the background checkpoint's connection waits for a lock.
const CHECKPOINT_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

pub(super) fn wal_path(db_path: &Path) -> PathBuf {
    PathBuf::from(format!("{}-wal", db_path.display()))
}

/// The WAL file's length (0 when there is none).
pub(super) fn wal_len(wal: &Path) -> u64 {
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
pub(super) struct Checkpointer {
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
    pub(super) fn start(path: &Path) -> Result<Self, StoreError> {
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
    pub(super) fn committed(&self) {
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
    pub(super) fn runs(&self) -> u32 {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).runs
    }

    #[cfg(test)]
    pub(super) fn truncations(&self) -> u32 {
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

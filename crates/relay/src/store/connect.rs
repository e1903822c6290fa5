//! Opening the stores' connections, for the log's store and the directory's alike: an SQLite
//! connection with the relay's settings, a PostgreSQL session, and PostgreSQL's errors as the
//! relay's.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio_postgres::{Client, Config, NoTls};

use crate::error::RelayError;

type PgResult<T> = std::result::Result<T, tokio_postgres::Error>;

/// The Python API writes accounts and keys into the same database file: wait for it.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
const STATEMENT_CACHE: usize = 32;

/// An SQLite connection to the relay's database file.
pub(in crate::store) fn open_connection(
    path: &Path,
    access: OpenFlags,
) -> rusqlite::Result<Connection> {
    // No CREATE: the Python store's migrations made the file; a wrong path fails here.
    let flags = access | OpenFlags::SQLITE_OPEN_URI | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    conn.execute_batch("PRAGMA foreign_keys=ON;")?;
    Ok(conn)
}

/// Run on every connection before its statements are prepared. Every statement here is an
/// index lookup, but a prepared statement's generic plan is made from the statistics of the
/// moment: chosen while the log was empty it scans the whole table, and a publish then costs
/// time in proportion to the log (13 ms at 20,000 entries, measured). Planning each execution
/// instead (`plan_cache_mode`) cost ~0.3 ms a commit. Without sequential scans and hash or
/// merge joins, the generic plans are the index plans whatever the table's size.
const SESSION: &str =
    "SET enable_seqscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off";

/// A connection for statements (not notifications), its task spawned on the current runtime,
/// its session set up.
pub(in crate::store) async fn connect(config: &Config) -> PgResult<Client> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        // Ends when the client is dropped, or with the connection's error, which the client's
        // next statement reports.
        let _ = connection.await;
    });
    client.batch_execute(SESSION).await?;
    Ok(client)
}

/// What went wrong, in PostgreSQL's words where it has some (tokio-postgres's own text is
/// only "db error" or "error connecting to server", the detail being its source).
pub(in crate::store) fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    match std::error::Error::source(err) {
        Some(source) => format!("{err}: {source}"),
        None => err.to_string(),
    }
}

/// A store failure, as the relay answers it.
pub(in crate::store) fn store_error(err: tokio_postgres::Error) -> RelayError {
    RelayError::store(describe(&err))
}

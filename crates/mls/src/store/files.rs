//! The data directory's files: private modes, the database file's header checked before SQLite
//! opens it, and the record of the identity it holds.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use super::checkpoint::{wal_len, wal_path};
use super::rows::IdentityRow;
use super::{io, StoreError, DIR_MODE, FILE_MODE, IDENTITY_FILE};

/// Creates `dir` (and its missing parents) with [`DIR_MODE`]; an existing one is left as it is
/// (the SDK warns when others may read it).
pub(super) fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
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
pub(super) fn check_database_file(path: &Path) -> Result<(), StoreError> {
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
pub(super) fn check_identity_file(
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

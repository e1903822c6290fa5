//! The directory on SQLite: one connection of its own, its calls serialized on it (each an
//! IMMEDIATE transaction on the blocking pool: one relay per file, so holding SQLite's write
//! lock makes each offer's cap and each claim's hand-out exact). It shares the write lock with
//! the log's writer for the moment of one short transaction (`busy_timeout` waits).

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{
    stock_of, to_db, Address, Claim, Claimed, Directory, DirectoryPrune, InvitationRow, Invited,
    NewInvitation, Offer, Offered, OpenedInvitation, Stock, ACCEPTED, DECLINED,
};
use crate::error::{RelayError, Result};
use crate::store::sql::sqlite::{
    ALLOW, CLAIM_OF, CLEAR_POLICY, CONSENTS, DROP_LAST_RESORT, DROP_UNCLAIMED, INSERT_INVITATION,
    INVITATIONS, INVITATION_EXISTS, INVITATION_OF, LAST_RESORT, LIST_PACKAGE, ONE_TIME_STOCK,
    OPEN_INVITATION, PACKAGE_LISTED, PENDING_INVITATIONS, PRUNE_CLAIMS, PRUNE_INVITATIONS,
    PRUNE_PACKAGES, RECORD_CLAIM, SETTLE, STOCK, WELCOME_CREATED,
};
use crate::store::StoreFuture;

/// The oldest one-time package of the address, marked claimed (no row locks in SQLite: the
/// IMMEDIATE transaction holds the write lock).
const TAKE_ONE_TIME: &str = "UPDATE relay_key_packages SET claimed_at = ?3 WHERE id = \
     (SELECT id FROM relay_key_packages WHERE account = ?1 AND identity = ?2 \
     AND last_resort = 0 AND claimed_at IS NULL AND not_after > ?3 ORDER BY id LIMIT 1) \
     RETURNING key_package_ref, key_package";

/// The directory's connection.
pub(crate) struct SqliteDirectory(Arc<Mutex<Connection>>);

impl SqliteDirectory {
    pub(crate) fn open(path: &Path) -> Result<SqliteDirectory> {
        let conn = crate::store::connect::open_connection(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE,
        )
        .map_err(RelayError::store)?;
        // Fail at open rather than at the first call when the tables are missing.
        conn.prepare_cached(TAKE_ONE_TIME)
            .map_err(RelayError::store)?;
        Ok(SqliteDirectory(Arc::new(Mutex::new(conn))))
    }

    fn run<T, F>(&self, work: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let conn = Arc::clone(&self.0);
        Box::pin(async move {
            let done = tokio::task::spawn_blocking(move || {
                let mut conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
                work(&mut conn)
            })
            .await;
            match done {
                Ok(result) => result.map_err(RelayError::store),
                Err(err) if err.is_cancelled() => Err(crate::error::shutting_down()),
                Err(_) => Err(RelayError::Internal),
            }
        })
    }
}

fn stock(conn: &Connection, address: &Address, now_ms: i64) -> rusqlite::Result<Stock> {
    let mut statement = conn.prepare_cached(STOCK)?;
    let rows = statement
        .query_map(params![address.account, address.identity, now_ms], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(stock_of(rows))
}

fn offer(conn: &mut Connection, offer: &Offer) -> rusqlite::Result<Offered> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let (account, identity) = (&offer.address.account, &offer.address.identity);
    if offer.replace {
        tx.prepare_cached(DROP_UNCLAIMED)?
            .execute(params![account, identity])?;
    }
    let mut new = Vec::new();
    for package in &offer.packages {
        let listed = tx
            .prepare_cached(PACKAGE_LISTED)?
            .query_row(params![package.key_package_ref], |_| Ok(()))
            .optional()?
            .is_some();
        let repeated = new
            .iter()
            .any(|p: &&super::NewPackage| p.key_package_ref == package.key_package_ref);
        if !listed && !repeated {
            new.push(package);
        }
    }
    let held: i64 = tx
        .prepare_cached(ONE_TIME_STOCK)?
        .query_row(params![account, identity, false, offer.now_ms], |row| {
            row.get(0)
        })?;
    let adding = new.iter().filter(|p| !p.last_resort).count();
    let held_count = usize::try_from(held).unwrap_or(usize::MAX);
    if held_count.saturating_add(adding) > offer.max_one_time {
        return Ok(Offered::Full {
            held: u32::try_from(held).unwrap_or(u32::MAX),
        });
    }
    // The last last-resort package of the request is the one kept.
    let last_resort = new.iter().rev().find(|p| p.last_resort).copied();
    if let Some(kept) = last_resort {
        tx.prepare_cached(DROP_LAST_RESORT)?.execute(params![
            account,
            identity,
            true,
            kept.key_package_ref
        ])?;
    }
    for package in new {
        if package.last_resort && last_resort.is_some_and(|kept| !std::ptr::eq(kept, package)) {
            continue;
        }
        tx.prepare_cached(LIST_PACKAGE)?.execute(params![
            package.key_package_ref,
            account,
            identity,
            package.last_resort,
            package.key_package,
            package.not_after_ms,
            offer.now_ms
        ])?;
    }
    let stock = stock(&tx, &offer.address, offer.now_ms)?;
    tx.commit()?;
    Ok(Offered::Listed(stock))
}

fn claim(conn: &mut Connection, claim: &Claim) -> rusqlite::Result<Claimed> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let (account, identity) = (&claim.address.account, &claim.address.identity);
    let pending: i64 = tx
        .prepare_cached(PENDING_INVITATIONS)?
        .query_row(params![account, identity, claim.now_ms], |row| row.get(0))?;
    if usize::try_from(pending).unwrap_or(usize::MAX) >= claim.max_pending {
        return Ok(Claimed::TooManyPending);
    }
    let one_time: Option<(Vec<u8>, Vec<u8>)> = tx
        .prepare_cached(TAKE_ONE_TIME)?
        .query_row(params![account, identity, claim.now_ms], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .optional()?;
    let (taken, last_resort) = match one_time {
        Some(taken) => (taken, false),
        None => {
            let kept: Option<(Vec<u8>, Vec<u8>)> = tx
                .prepare_cached(LAST_RESORT)?
                .query_row(params![account, identity, true, claim.now_ms], |row| {
                    Ok((row.get(0)?, row.get(1)?))
                })
                .optional()?;
            match kept {
                Some(kept) => (kept, true),
                None => return Ok(Claimed::NoPackage),
            }
        }
    };
    let (key_package_ref, key_package) = taken;
    tx.prepare_cached(RECORD_CLAIM)?.execute(params![
        key_package_ref,
        claim.channel_id,
        claim.claimer,
        account,
        identity,
        last_resort,
        claim.now_ms
    ])?;
    tx.commit()?;
    Ok(Claimed::Package {
        key_package,
        key_package_ref,
        last_resort,
    })
}

fn invite(conn: &mut Connection, new: &NewInvitation) -> rusqlite::Result<Invited> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let claimed: Option<(String, Vec<u8>, bool)> = tx
        .prepare_cached(CLAIM_OF)?
        .query_row(
            params![new.key_package_ref, new.channel_id, new.inviter_account],
            |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
        )
        .optional()?;
    let Some((account, identity, last_resort)) = claimed else {
        return Ok(Invited::NoClaim);
    };
    let existing: Option<i64> = tx
        .prepare_cached(INVITATION_OF)?
        .query_row(params![new.key_package_ref, new.channel_id], |row| {
            row.get(0)
        })
        .optional()?;
    if let Some(id) = existing {
        return Ok(Invited::Recorded(id, Address { account, identity }));
    }
    let created: Option<i64> = tx
        .prepare_cached(WELCOME_CREATED)?
        .query_row(params![new.channel_id, new.key_package_ref], |row| {
            row.get(0)
        })
        .optional()?;
    let Some(created) = created else {
        return Ok(Invited::NoWelcome);
    };
    let expires_at = new.welcome_ttl_ms.map(|ttl| created.saturating_add(ttl));
    let id: i64 = tx.prepare_cached(INSERT_INVITATION)?.query_row(
        params![
            account,
            identity,
            new.channel_id,
            new.channel,
            new.key_package_ref,
            new.inviter_account,
            new.inviter_identity,
            last_resort,
            new.now_ms,
            expires_at
        ],
        |row| row.get(0),
    )?;
    tx.commit()?;
    Ok(Invited::Recorded(id, Address { account, identity }))
}

fn invitation_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<InvitationRow> {
    Ok(InvitationRow {
        id: row.get(0)?,
        channel: row.get(1)?,
        inviter_identity: row.get(2)?,
        inviter_account: row.get(3)?,
        created_at_ms: row.get(4)?,
        expires_at_ms: row.get(5)?,
        last_resort: row.get(6)?,
    })
}

fn settle(
    conn: &Connection,
    address: &Address,
    id: i64,
    accept: bool,
    now_ms: i64,
) -> rusqlite::Result<bool> {
    let state = if accept { ACCEPTED } else { DECLINED };
    let (account, identity) = (&address.account, &address.identity);
    let settled = conn
        .prepare_cached(SETTLE)?
        .execute(params![id, account, identity, state, now_ms])?;
    if settled > 0 {
        return Ok(true);
    }
    Ok(conn
        .prepare_cached(INVITATION_EXISTS)?
        .query_row(params![id, account, identity], |_| Ok(()))
        .optional()?
        .is_some())
}

fn prune(conn: &mut Connection, prune: &DirectoryPrune) -> rusqlite::Result<usize> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let limit = to_db(prune.limit as u64);
    let mut gone = tx
        .prepare_cached(PRUNE_PACKAGES)?
        .execute(params![prune.now_ms, limit])?;
    gone += tx
        .prepare_cached(PRUNE_CLAIMS)?
        .execute(params![prune.claims_before_ms, limit])?;
    gone += tx.prepare_cached(PRUNE_INVITATIONS)?.execute(params![
        prune.settled_before_ms,
        prune.now_ms,
        limit
    ])?;
    tx.commit()?;
    Ok(gone)
}

impl Directory for SqliteDirectory {
    fn offer(&self, offer: Offer) -> StoreFuture<Offered> {
        self.run(move |conn| self::offer(conn, &offer))
    }

    fn listed(
        &self,
        address: Address,
        refs: Vec<Vec<u8>>,
        now_ms: i64,
    ) -> StoreFuture<(u32, usize)> {
        self.run(move |conn| {
            let held: i64 = conn.prepare_cached(ONE_TIME_STOCK)?.query_row(
                params![address.account, address.identity, false, now_ms],
                |row| row.get(0),
            )?;
            let mut listed = 0;
            for key_package_ref in &refs {
                if conn
                    .prepare_cached(PACKAGE_LISTED)?
                    .query_row(params![key_package_ref], |_| Ok(()))
                    .optional()?
                    .is_some()
                {
                    listed += 1;
                }
            }
            Ok((u32::try_from(held).unwrap_or(u32::MAX), listed))
        })
    }

    fn stock(&self, address: Address, now_ms: i64) -> StoreFuture<Stock> {
        self.run(move |conn| self::stock(conn, &address, now_ms))
    }

    fn set_policy(&self, address: Address, allowed: Vec<String>) -> StoreFuture<()> {
        self.run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.prepare_cached(CLEAR_POLICY)?
                .execute(params![address.account, address.identity])?;
            for account in &allowed {
                tx.prepare_cached(ALLOW)?.execute(params![
                    address.account,
                    address.identity,
                    account
                ])?;
            }
            tx.commit()
        })
    }

    fn consents(&self, address: Address, claimer: String, now_ms: i64) -> StoreFuture<bool> {
        self.run(move |conn| {
            conn.prepare_cached(CONSENTS)?.query_row(
                params![address.account, address.identity, claimer, now_ms],
                |row| row.get(0),
            )
        })
    }

    fn claim(&self, claim: Claim) -> StoreFuture<Claimed> {
        self.run(move |conn| self::claim(conn, &claim))
    }

    fn invite(&self, invitation: NewInvitation) -> StoreFuture<Invited> {
        self.run(move |conn| self::invite(conn, &invitation))
    }

    fn invitations(
        &self,
        address: Address,
        after_id: i64,
        limit: usize,
        now_ms: i64,
    ) -> StoreFuture<Vec<InvitationRow>> {
        self.run(move |conn| {
            let mut statement = conn.prepare_cached(INVITATIONS)?;
            let rows = statement.query_map(
                params![
                    address.account,
                    address.identity,
                    after_id,
                    now_ms,
                    to_db(limit as u64)
                ],
                invitation_row,
            )?;
            rows.collect()
        })
    }

    fn open_invitation(
        &self,
        address: Address,
        id: i64,
        now_ms: i64,
    ) -> StoreFuture<Option<OpenedInvitation>> {
        self.run(move |conn| {
            conn.prepare_cached(OPEN_INVITATION)?
                .query_row(
                    params![id, address.account, address.identity, now_ms],
                    |row| {
                        Ok(OpenedInvitation {
                            channel: row.get(0)?,
                            welcome: row.get(1)?,
                            epoch: u64::try_from(row.get::<_, i64>(2)?).unwrap_or(0),
                        })
                    },
                )
                .optional()
        })
    }

    fn settle(&self, address: Address, id: i64, accept: bool, now_ms: i64) -> StoreFuture<bool> {
        self.run(move |conn| self::settle(conn, &address, id, accept, now_ms))
    }

    fn prune(&self, prune: DirectoryPrune) -> StoreFuture<usize> {
        self.run(move |conn| self::prune(conn, &prune))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn directory() -> (tempfile::TempDir, SqliteDirectory, i64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.db");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(&crate::store::schema::SQLITE.concat())
            .unwrap();
        conn.execute(
            "INSERT INTO relay_channels (scope, name) VALUES ('', 'acme/a/b')",
            [],
        )
        .unwrap();
        let channel_id = conn.last_insert_rowid();
        (dir, SqliteDirectory::open(&path).unwrap(), channel_id)
    }

    fn address() -> Address {
        Address {
            account: "bob".to_owned(),
            identity: b"bob".to_vec(),
        }
    }

    fn package(name: &str, last_resort: bool, not_after_ms: i64) -> super::super::NewPackage {
        super::super::NewPackage {
            key_package_ref: name.as_bytes().to_vec(),
            key_package: name.as_bytes().to_vec(),
            last_resort,
            not_after_ms,
        }
    }

    /// Expired packages are never handed out (nor counted, nor consented on) and the pruner
    /// deletes them; a claim row and a settled invitation go after their time.
    #[tokio::test]
    async fn expired_packages_are_not_handed_out_and_are_pruned() {
        let (_dir, directory, channel_id) = directory();
        let now = 1_000_000_000;
        let offered = directory
            .offer(Offer {
                address: address(),
                packages: vec![
                    package("old", false, now - 1),
                    package("old-lr", true, now - 1),
                    package("new", false, now + 60_000),
                ],
                replace: false,
                max_one_time: 64,
                now_ms: now,
            })
            .await
            .unwrap();
        // The old last-resort package was listed and is expired: none counts.
        assert_eq!(
            offered,
            Offered::Listed(Stock {
                one_time: 1,
                last_resort: false,
                earliest_expiry_ms: now + 60_000,
            })
        );
        let claim = |now_ms| Claim {
            address: address(),
            claimer: "bob".to_owned(),
            channel_id,
            max_pending: 100,
            now_ms,
        };
        match directory.claim(claim(now)).await.unwrap() {
            Claimed::Package {
                key_package_ref, ..
            } => assert_eq!(key_package_ref, b"new"),
            other => panic!("{other:?}"),
        }
        assert!(!directory
            .consents(address(), "bob".to_owned(), now)
            .await
            .unwrap());
        assert_eq!(
            directory.claim(claim(now)).await.unwrap(),
            Claimed::NoPackage
        );
        // Pruned: the two expired packages now; later the claimed one (past its lifetime)
        // and the claim.
        let prune = |now_ms| DirectoryPrune {
            now_ms,
            claims_before_ms: now_ms - 1_000,
            settled_before_ms: now_ms - 1_000,
            limit: 10,
        };
        assert_eq!(directory.prune(prune(now)).await.unwrap(), 2);
        assert_eq!(directory.prune(prune(now + 120_000)).await.unwrap(), 2);
        assert_eq!(directory.prune(prune(now + 240_000)).await.unwrap(), 0);
    }
}

//! The directory on PostgreSQL, shared by every relay on the database: a few connections of
//! its own, one call at a time on each (a transaction needs its connection alone). An offer
//! holds a transaction-level advisory lock on its address, so concurrent offers of one
//! address (on any relay) run one after the other and the cap is exact; a claim takes the
//! oldest one-time package with `FOR UPDATE SKIP LOCKED`, so each is handed out once even
//! when several relays claim at once.

use std::sync::{Arc, Mutex, PoisonError};

use sha2::{Digest, Sha256};
use tokio_postgres::{Client, Config, GenericClient};

use super::{
    stock_of, to_db, Address, Claim, Claimed, Directory, DirectoryPrune, InvitationRow, Invited,
    NewInvitation, NewPackage, Offer, Offered, OpenedInvitation, Stock, ACCEPTED, DECLINED,
};
use crate::store::connect::{connect, store_error};
use crate::store::sql::{
    ALLOW, CLAIM_OF, CLEAR_POLICY, CONSENTS, DROP_LAST_RESORT, DROP_UNCLAIMED, INSERT_INVITATION,
    INVITATIONS, INVITATION_EXISTS, INVITATION_OF, LAST_RESORT, LIST_PACKAGE, ONE_TIME_STOCK,
    OPEN_INVITATION, PACKAGE_LISTED, PENDING_INVITATIONS, PRUNE_CLAIMS, PRUNE_INVITATIONS,
    PRUNE_PACKAGES, RECORD_CLAIM, SETTLE, STOCK, WELCOME_CREATED,
};
use crate::store::StoreFuture;

type PgResult<T> = std::result::Result<T, tokio_postgres::Error>;

/// Idle connections kept for the next call.
const IDLE: usize = 4;

/// The oldest one-time package of the address, locked (skipping those another transaction
/// holds) and marked claimed.
const TAKE_ONE_TIME: &str = "UPDATE relay_key_packages SET claimed_at = $3 WHERE id = \
     (SELECT id FROM relay_key_packages WHERE account = $1 AND identity = $2 \
     AND last_resort = FALSE AND claimed_at IS NULL AND not_after > $3 ORDER BY id LIMIT 1 \
     FOR UPDATE SKIP LOCKED) RETURNING key_package_ref, key_package";
/// How many of the refs are listed (one statement where SQLite looks each up).
const ANY_LISTED: &str = "SELECT count(*) FROM relay_key_packages WHERE key_package_ref = ANY($1)";
/// Offers of one address wait for each other (until COMMIT).
const LOCK_ADDRESS: &str = "SELECT pg_advisory_xact_lock($1)";

pub(crate) struct PgDirectory(Arc<Pool>);

struct Pool {
    config: Config,
    idle: Mutex<Vec<Client>>,
}

impl PgDirectory {
    pub(crate) fn new(config: Config) -> PgDirectory {
        PgDirectory(Arc::new(Pool {
            config,
            idle: Mutex::new(Vec::new()),
        }))
    }

    fn run<T, F>(&self, work: F) -> StoreFuture<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(
                &'c mut Client,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = PgResult<T>> + Send + 'c>,
            > + Send
            + 'static,
    {
        let pool = Arc::clone(&self.0);
        Box::pin(async move {
            let idle = pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let mut client = match idle {
                Some(client) if !client.is_closed() => client,
                _ => connect(&pool.config).await.map_err(store_error)?,
            };
            let result = work(&mut client).await;
            if !client.is_closed() {
                let mut idle = pool.idle.lock().unwrap_or_else(PoisonError::into_inner);
                if idle.len() < IDLE {
                    idle.push(client);
                }
            }
            result.map_err(store_error)
        })
    }
}

/// The advisory lock key of an address.
fn address_key(address: &Address) -> i64 {
    let mut hash = Sha256::new();
    hash.update((address.account.len() as u64).to_be_bytes());
    hash.update(address.account.as_bytes());
    hash.update(&address.identity);
    let digest = hash.finalize();
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

async fn stock(conn: &impl GenericClient, address: &Address, now_ms: i64) -> PgResult<Stock> {
    let rows = conn
        .query(STOCK, &[&address.account, &address.identity, &now_ms])
        .await?;
    Ok(stock_of(rows.iter().map(|row| {
        (
            row.get::<_, bool>(0),
            row.get::<_, i64>(1),
            row.get::<_, Option<i64>>(2),
        )
    })))
}

async fn offer(client: &mut Client, offer: Offer) -> PgResult<Offered> {
    let tx = client.transaction().await?;
    let (account, identity) = (&offer.address.account, &offer.address.identity);
    tx.execute(LOCK_ADDRESS, &[&address_key(&offer.address)])
        .await?;
    if offer.replace {
        tx.execute(DROP_UNCLAIMED, &[account, identity]).await?;
    }
    let mut new: Vec<&NewPackage> = Vec::new();
    for package in &offer.packages {
        let listed = tx
            .query_opt(PACKAGE_LISTED, &[&package.key_package_ref])
            .await?
            .is_some();
        let repeated = new
            .iter()
            .any(|p| p.key_package_ref == package.key_package_ref);
        if !listed && !repeated {
            new.push(package);
        }
    }
    let held: i64 = tx
        .query_one(ONE_TIME_STOCK, &[account, identity, &false, &offer.now_ms])
        .await?
        .get(0);
    let adding = new.iter().filter(|p| !p.last_resort).count();
    if usize::try_from(held)
        .unwrap_or(usize::MAX)
        .saturating_add(adding)
        > offer.max_one_time
    {
        return Ok(Offered::Full {
            held: u32::try_from(held).unwrap_or(u32::MAX),
        });
    }
    let last_resort = new.iter().rev().find(|p| p.last_resort).copied();
    if let Some(kept) = last_resort {
        tx.execute(
            DROP_LAST_RESORT,
            &[account, identity, &true, &kept.key_package_ref],
        )
        .await?;
    }
    for package in new {
        if package.last_resort && last_resort.is_some_and(|kept| !std::ptr::eq(kept, package)) {
            continue;
        }
        tx.execute(
            LIST_PACKAGE,
            &[
                &package.key_package_ref,
                account,
                identity,
                &package.last_resort,
                &package.key_package,
                &package.not_after_ms,
                &offer.now_ms,
            ],
        )
        .await?;
    }
    let stock = stock(&tx, &offer.address, offer.now_ms).await?;
    tx.commit().await?;
    Ok(Offered::Listed(stock))
}

async fn claim(client: &mut Client, claim: Claim) -> PgResult<Claimed> {
    let tx = client.transaction().await?;
    let (account, identity) = (&claim.address.account, &claim.address.identity);
    let pending: i64 = tx
        .query_one(PENDING_INVITATIONS, &[account, identity, &claim.now_ms])
        .await?
        .get(0);
    if usize::try_from(pending).unwrap_or(usize::MAX) >= claim.max_pending {
        return Ok(Claimed::TooManyPending);
    }
    let one_time = tx
        .query_opt(TAKE_ONE_TIME, &[account, identity, &claim.now_ms])
        .await?;
    let (row, last_resort) = match one_time {
        Some(row) => (row, false),
        None => match tx
            .query_opt(LAST_RESORT, &[account, identity, &true, &claim.now_ms])
            .await?
        {
            Some(row) => (row, true),
            None => return Ok(Claimed::NoPackage),
        },
    };
    let key_package_ref: Vec<u8> = row.get(0);
    let key_package: Vec<u8> = row.get(1);
    tx.execute(
        RECORD_CLAIM,
        &[
            &key_package_ref,
            &claim.channel_id,
            &claim.claimer,
            account,
            identity,
            &last_resort,
            &claim.now_ms,
        ],
    )
    .await?;
    tx.commit().await?;
    Ok(Claimed::Package {
        key_package,
        key_package_ref,
        last_resort,
    })
}

async fn invite(client: &mut Client, new: NewInvitation) -> PgResult<Invited> {
    let tx = client.transaction().await?;
    let Some(claimed) = tx
        .query_opt(
            CLAIM_OF,
            &[&new.key_package_ref, &new.channel_id, &new.inviter_account],
        )
        .await?
    else {
        return Ok(Invited::NoClaim);
    };
    let (account, identity, last_resort): (String, Vec<u8>, bool) =
        (claimed.get(0), claimed.get(1), claimed.get(2));
    if let Some(row) = tx
        .query_opt(INVITATION_OF, &[&new.key_package_ref, &new.channel_id])
        .await?
    {
        return Ok(Invited::Recorded(row.get(0), Address { account, identity }));
    }
    let Some(created) = tx
        .query_opt(WELCOME_CREATED, &[&new.channel_id, &new.key_package_ref])
        .await?
    else {
        return Ok(Invited::NoWelcome);
    };
    let created: i64 = created.get(0);
    let expires_at = new.welcome_ttl_ms.map(|ttl| created.saturating_add(ttl));
    let inserted = tx
        .query_opt(
            INSERT_INVITATION,
            &[
                &account,
                &identity,
                &new.channel_id,
                &new.channel,
                &new.key_package_ref,
                &new.inviter_account,
                &new.inviter_identity,
                &last_resort,
                &new.now_ms,
                &expires_at,
            ],
        )
        .await?;
    let id: i64 = match inserted {
        Some(row) => row.get(0),
        // Another relay recorded it meanwhile.
        None => tx
            .query_one(INVITATION_OF, &[&new.key_package_ref, &new.channel_id])
            .await?
            .get(0),
    };
    tx.commit().await?;
    Ok(Invited::Recorded(id, Address { account, identity }))
}

async fn settle(
    client: &mut Client,
    address: Address,
    id: i64,
    accept: bool,
    now_ms: i64,
) -> PgResult<bool> {
    let state = if accept { ACCEPTED } else { DECLINED };
    let (account, identity) = (&address.account, &address.identity);
    let settled = client
        .execute(SETTLE, &[&id, account, identity, &state, &now_ms])
        .await?;
    if settled > 0 {
        return Ok(true);
    }
    Ok(client
        .query_opt(INVITATION_EXISTS, &[&id, account, identity])
        .await?
        .is_some())
}

async fn prune(client: &mut Client, prune: DirectoryPrune) -> PgResult<usize> {
    let limit = to_db(prune.limit as u64);
    let tx = client.transaction().await?;
    let mut gone = tx.execute(PRUNE_PACKAGES, &[&prune.now_ms, &limit]).await?;
    gone += tx
        .execute(PRUNE_CLAIMS, &[&prune.claims_before_ms, &limit])
        .await?;
    gone += tx
        .execute(
            PRUNE_INVITATIONS,
            &[&prune.settled_before_ms, &prune.now_ms, &limit],
        )
        .await?;
    tx.commit().await?;
    Ok(usize::try_from(gone).unwrap_or(usize::MAX))
}

impl Directory for PgDirectory {
    fn offer(&self, offer: Offer) -> StoreFuture<Offered> {
        self.run(move |client| Box::pin(self::offer(client, offer)))
    }

    fn listed(
        &self,
        address: Address,
        refs: Vec<Vec<u8>>,
        now_ms: i64,
    ) -> StoreFuture<(u32, usize)> {
        self.run(move |client| {
            Box::pin(async move {
                let held: i64 = client
                    .query_one(
                        ONE_TIME_STOCK,
                        &[&address.account, &address.identity, &false, &now_ms],
                    )
                    .await?
                    .get(0);
                let listed: i64 = client.query_one(ANY_LISTED, &[&refs]).await?.get(0);
                Ok((
                    u32::try_from(held).unwrap_or(u32::MAX),
                    usize::try_from(listed).unwrap_or(0),
                ))
            })
        })
    }

    fn stock(&self, address: Address, now_ms: i64) -> StoreFuture<Stock> {
        self.run(move |client| Box::pin(async move { stock(&*client, &address, now_ms).await }))
    }

    fn set_policy(&self, address: Address, allowed: Vec<String>) -> StoreFuture<()> {
        self.run(move |client| {
            Box::pin(async move {
                let tx = client.transaction().await?;
                tx.execute(CLEAR_POLICY, &[&address.account, &address.identity])
                    .await?;
                for account in &allowed {
                    tx.execute(ALLOW, &[&address.account, &address.identity, account])
                        .await?;
                }
                tx.commit().await
            })
        })
    }

    fn consents(&self, address: Address, claimer: String, now_ms: i64) -> StoreFuture<bool> {
        self.run(move |client| {
            Box::pin(async move {
                Ok(client
                    .query_one(
                        CONSENTS,
                        &[&address.account, &address.identity, &claimer, &now_ms],
                    )
                    .await?
                    .get(0))
            })
        })
    }

    fn claim(&self, claim: Claim) -> StoreFuture<Claimed> {
        self.run(move |client| Box::pin(self::claim(client, claim)))
    }

    fn invite(&self, invitation: NewInvitation) -> StoreFuture<Invited> {
        self.run(move |client| Box::pin(self::invite(client, invitation)))
    }

    fn invitations(
        &self,
        address: Address,
        after_id: i64,
        limit: usize,
        now_ms: i64,
    ) -> StoreFuture<Vec<InvitationRow>> {
        self.run(move |client| {
            Box::pin(async move {
                let limit = to_db(limit as u64);
                let rows = client
                    .query(
                        INVITATIONS,
                        &[
                            &address.account,
                            &address.identity,
                            &after_id,
                            &now_ms,
                            &limit,
                        ],
                    )
                    .await?;
                Ok(rows
                    .iter()
                    .map(|row| InvitationRow {
                        id: row.get(0),
                        channel: row.get(1),
                        inviter_identity: row.get(2),
                        inviter_account: row.get(3),
                        created_at_ms: row.get(4),
                        expires_at_ms: row.get(5),
                        last_resort: row.get(6),
                    })
                    .collect())
            })
        })
    }

    fn open_invitation(
        &self,
        address: Address,
        id: i64,
        now_ms: i64,
    ) -> StoreFuture<Option<OpenedInvitation>> {
        self.run(move |client| {
            Box::pin(async move {
                let row = client
                    .query_opt(
                        OPEN_INVITATION,
                        &[&id, &address.account, &address.identity, &now_ms],
                    )
                    .await?;
                Ok(row.map(|row| OpenedInvitation {
                    channel: row.get(0),
                    welcome: row.get(1),
                    epoch: u64::try_from(row.get::<_, i64>(2)).unwrap_or(0),
                }))
            })
        })
    }

    fn settle(&self, address: Address, id: i64, accept: bool, now_ms: i64) -> StoreFuture<bool> {
        self.run(move |client| Box::pin(self::settle(client, address, id, accept, now_ms)))
    }

    fn prune(&self, prune: DirectoryPrune) -> StoreFuture<usize> {
        self.run(move |client| Box::pin(self::prune(client, prune)))
    }
}

//! The relay's audit rows (issue 30, `relay_audit`, migration 0012): a create (and the org it
//! claims), the adds and removes of commits (into the committer's account and the removed
//! member's), a retention change; none for updates and application messages. On SQLite, and
//! on PostgreSQL when it is installed. Tokens are [`FakeVerify`]'s (`account.key`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;

use serde_json::{json, Value};
use static_relay::pb::relay_client::RelayClient;
use static_relay::{pb, Database};
use tonic::transport::Channel;

use service_support::postgres::{connect, Cluster};
use service_support::*;

const CHAT: &str = "acme/ops/chat";
const OTHER: &str = "acme/ops/other";

/// One audit row: (account, type, key_id, channel, detail).
type Row = (String, String, Option<String>, String, Value);

fn row(account: &str, kind: &str, key: &str, channel: &str, detail: Value) -> Row {
    (
        account.to_owned(),
        kind.to_owned(),
        Some(key.to_owned()),
        channel.to_owned(),
        detail,
    )
}

/// What each step of [`scenario`] wrote, as the test reads the table (in `seq` order).
async fn scenario(client: &mut RelayClient<Channel>, rows: impl AsyncRows) {
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k7");

    alice.create(client, CHAT).await;
    assert_eq!(
        rows.read().await,
        vec![
            row(
                "alice",
                "channel.created",
                "k1",
                CHAT,
                json!({"identity": "alice"})
            ),
            row("alice", "org.claimed", "k1", CHAT, json!({"org": "acme"})),
        ]
    );
    // The org is claimed already: no second claim.
    alice.create(client, OTHER).await;
    let created = row(
        "alice",
        "channel.created",
        "k1",
        OTHER,
        json!({"identity": "alice"}),
    );
    assert_eq!(rows.read().await[2..], [created]);

    alice.add(client, CHAT, &[&bob]).await;
    let added = json!({"identity": "bob", "by_identity": "alice", "member_account": null});
    assert_eq!(
        rows.read().await[3..],
        [row("alice", "member.added", "k1", CHAT, added)]
    );

    // An update and application messages write nothing.
    let (_, update) = alice.commit(client, CHAT).await;
    bob.apply(CHAT, &update);
    alice
        .publish(client, CHAT, alice.encrypt(CHAT, b"hello"))
        .await
        .unwrap();
    assert_eq!(rows.read().await.len(), 4);

    let remove = alice.remove(CHAT, "bob");
    alice.publish(client, CHAT, remove.clone()).await.unwrap();
    alice.apply(CHAT, &remove);
    let removed = json!({"identity": "bob", "by_identity": "alice", "member_account": "bob"});
    assert_eq!(
        rows.read().await[4..],
        [
            row("alice", "member.removed", "k1", CHAT, removed.clone()),
            row("bob", "member.removed", "k1", CHAT, removed),
        ]
    );

    let policy = pb::RetentionPolicy {
        max_entries: Some(10),
        ..Default::default()
    };
    let set = pb::SetRetentionRequest {
        channel: CHAT.to_owned(),
        policy: Some(policy),
    };
    client.set_retention(alice.request(set)).await.unwrap();
    let retention = json!({"retention": {
        "max_age_seconds": null, "max_entries": 10, "max_bytes": null,
    }});
    assert_eq!(
        rows.read().await[6..],
        [row("alice", "retention.changed", "k1", CHAT, retention)]
    );
}

/// Reads the whole table.
trait AsyncRows {
    async fn read(&self) -> Vec<Row>;
}

struct SqliteRows(std::path::PathBuf);

impl AsyncRows for SqliteRows {
    async fn read(&self) -> Vec<Row> {
        let conn = rusqlite::Connection::open(&self.0).unwrap();
        let mut statement = conn
            .prepare(
                "SELECT account, type, key_id, channel, detail, at_ms FROM relay_audit \
                 ORDER BY seq",
            )
            .unwrap();
        let rows = statement
            .query_map([], |r| {
                let at_ms: i64 = r.get(5)?;
                assert!(at_ms > 1_600_000_000_000, "{at_ms}");
                let detail: String = r.get(4)?;
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    serde_json::from_str(&detail).unwrap(),
                ))
            })
            .unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    }
}

struct PostgresRows(tokio_postgres::Client);

impl AsyncRows for PostgresRows {
    async fn read(&self) -> Vec<Row> {
        let rows = self
            .0
            .query(
                "SELECT account, type, key_id, channel, detail FROM relay_audit ORDER BY seq",
                &[],
            )
            .await
            .unwrap();
        rows.iter()
            .map(|r| {
                let detail: String = r.get(4);
                (
                    r.get(0),
                    r.get(1),
                    r.get(2),
                    r.get(3),
                    serde_json::from_str(&detail).unwrap(),
                )
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_commits_and_retention_leave_audit_rows_on_sqlite() {
    let relay = Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    let rows = SqliteRows(relay.dir.path().join("static.db"));
    scenario(&mut client, rows).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_commits_and_retention_leave_audit_rows_on_postgresql() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let url = cluster.database("audit").await;
    let relay = Relay::on_database(
        Database::parse(&url),
        tempfile::tempdir().unwrap(),
        |_| {},
        Some(Arc::new(FakeVerify)),
    )
    .await;
    let mut client = relay.client().await;
    let rows = PostgresRows(connect(&url).await);
    scenario(&mut client, rows).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_callers_leave_no_rows() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let alice = Member::anonymous("alice");
    alice.create(&mut client, CHAT).await;
    let rows = SqliteRows(relay.dir.path().join("static.db"));
    assert!(rows.read().await.is_empty());
}

//! The channel log over a real SQLite database (the relay schema of the Python store's
//! migrations) in a temporary directory. Channels are created from real groups (a static-mls
//! engine's), and commits are real ones checked against the channel's group as the service
//! checks them; application messages are hand-framed (the log never reads their content).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use static_relay::group::{GroupState, Handshake};
use static_relay::log::{
    Accepted, Channel, ChannelLog, Checked, Entry, GroupCheck, LogSettings, WelcomeKey,
    WelcomeRecord,
};
use static_relay::members::{GroupChange, Reach};
use static_relay::wire::framing::parse_message;
use static_relay::wire::rules::idempotency_key;
use static_relay::{RelayConfig, RelayError};

/// The relay's defaults.
fn defaults() -> RelayConfig {
    RelayConfig::new(PathBuf::from("unused.db"))
}

use service_support::{key_package_ref, public_message, Member, SCHEMA};

/// The account that creates and publishes (names are global: any account reaches a channel
/// by its name; the log leaves access to the service).
const ACCOUNT: &str = "acct-1";
const NAME: &str = "org/ns/service";

const APPLICATION: u8 = 1;
const PROPOSAL: u8 = 2;

struct Db {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn new_db() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("static.sqlite3");
    let conn = rusqlite::Connection::open(&path).unwrap();
    for schema in SCHEMA {
        conn.execute_batch(schema).unwrap();
    }
    Db { _dir: dir, path }
}

async fn open(path: &Path, application_window: u64) -> ChannelLog {
    open_with(
        path,
        application_window,
        defaults().cache_bytes,
        defaults().idle_unload,
    )
    .await
}

/// [`open`] with the rings' budget and the idle time given.
async fn open_with(
    path: &Path,
    application_window: u64,
    cache_bytes: usize,
    idle_unload: Duration,
) -> ChannelLog {
    ChannelLog::open(LogSettings {
        database: path.into(),
        application_window,
        cache_bytes,
        idle_unload,
    })
    .await
    .unwrap()
}

/// `name` created for `account` from `member`'s new group (its leaf 0 bound to `account`).
async fn create(
    log: &ChannelLog,
    member: &Member,
    name: &str,
    account: &str,
) -> Result<Arc<Channel>, RelayError> {
    member.engine.create_group(name).unwrap();
    let public = member.engine.public_state(name).unwrap();
    let state = GroupState::create(name, &public.group_info, &public.ratchet_tree).unwrap();
    log.create(name, account, state, 0, None).await
}

/// A new member "alice" and NAME created from her group for ACCOUNT.
async fn alices_channel(log: &ChannelLog) -> (Member, Arc<Channel>) {
    let alice = Member::anonymous("alice");
    let channel = create(log, &alice, NAME, ACCOUNT).await.unwrap();
    (alice, channel)
}

fn vector(body: &[u8]) -> Vec<u8> {
    let n = body.len();
    let mut out = if n < 0x40 {
        vec![n as u8]
    } else {
        assert!(n < 0x4000);
        vec![0x40 | (n >> 8) as u8, n as u8]
    };
    out.extend_from_slice(body);
    out
}

/// A private MLS message (the relay reads only its header).
fn private(epoch: u64, content_type: u8, body: &[u8]) -> Bytes {
    let mut m = vec![0, 1, 0, 2];
    m.extend(vector(NAME.as_bytes()));
    m.extend(epoch.to_be_bytes());
    m.push(content_type);
    m.extend(vector(b""));
    m.extend(vector(b"sender"));
    m.extend(vector(body));
    Bytes::from(m)
}

/// `message` as the service hands it to the log, with the group's verdict.
fn checked_message(message: Bytes, group: GroupCheck) -> Checked {
    Checked {
        header: parse_message(&message).unwrap(),
        key: idempotency_key(b"", &message).unwrap(),
        message,
        welcome: Bytes::new(),
        welcome_refs: Vec::new(),
        account: Arc::from(ACCOUNT),
        group,
    }
}

/// A hand-framed message the group does not check (an application message).
fn checked(epoch: u64, content_type: u8, body: &[u8]) -> Checked {
    checked_message(private(epoch, content_type, body), GroupCheck::Unchecked)
}

/// A real handshake checked against the channel's group as the service checks it: a commit
/// carries its change.
async fn check(log: &ChannelLog, channel: &Channel, message: &Bytes) -> Checked {
    let state = log.group(channel).await.unwrap().unwrap();
    let group = match state.check_handshake(message, &[]).unwrap() {
        Handshake::Proposal { .. } => GroupCheck::Valid(None),
        Handshake::Commit(outcome) => GroupCheck::Valid(Some(Arc::new(
            GroupChange::new(outcome.next, outcome.removed, outcome.added).unwrap(),
        ))),
    };
    checked_message(message.clone(), group)
}

/// A commit of `member`'s (pending in its engine), checked.
async fn commit_of(log: &ChannelLog, channel: &Channel, member: &Member) -> Checked {
    let commit = member.update(channel.name());
    check(log, channel, &commit).await
}

/// The same publish as the service sees it once its epoch is past: not checked again.
fn retried(checked: &Checked) -> Checked {
    Checked {
        group: GroupCheck::OtherEpoch,
        ..checked.clone()
    }
}

async fn publish_all(
    log: &ChannelLog,
    channel: &Arc<Channel>,
    items: Vec<Checked>,
) -> Vec<Result<Accepted, RelayError>> {
    let outcomes = log.submit(items.into_iter().map(|c| (channel.clone(), c)).collect());
    let mut answers = Vec::new();
    for outcome in outcomes {
        answers.push(outcome.await.unwrap());
    }
    answers
}

async fn publish(
    log: &ChannelLog,
    channel: &Arc<Channel>,
    item: Checked,
) -> Result<Accepted, RelayError> {
    publish_all(log, channel, vec![item]).await.pop().unwrap()
}

fn accepted(seq: u64, epoch: u64, duplicate: bool) -> Result<Accepted, RelayError> {
    Ok(Accepted {
        seq,
        epoch,
        duplicate,
    })
}

fn stale(message_epoch: u64, current_epoch: u64) -> Result<Accepted, RelayError> {
    Err(RelayError::StaleEpoch {
        message_epoch,
        current_epoch,
    })
}

/// `member` (the channel's only member) commits the channel from its epoch up to `epoch`.
async fn commit_to(log: &ChannelLog, channel: &Arc<Channel>, member: &Member, epoch: u64) {
    while channel.epoch() < epoch {
        let at = channel.epoch();
        let commit = commit_of(log, channel, member).await;
        let answer = publish(log, channel, commit.clone()).await;
        assert_eq!(answer.unwrap().epoch, at + 1);
        member.apply(channel.name(), &commit.message);
    }
}

fn assert_consecutive(entries: &[Entry], first: u64) {
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e.seq, first + i as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_load_not_found_already_exists() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    assert!(log.loaded(ACCOUNT, NAME).is_none());
    let (alice, channel) = alices_channel(&log).await;
    assert_eq!(
        (
            channel.name(),
            channel.is_legacy(),
            channel.head_seq(),
            channel.epoch()
        ),
        (NAME, false, 0, 0)
    );
    assert!(Arc::ptr_eq(&log.loaded(ACCOUNT, NAME).unwrap(), &channel));
    assert!(Arc::ptr_eq(
        &log.channel(ACCOUNT, NAME).await.unwrap(),
        &channel
    ));
    // The creator's leaf is bound to its account, and nobody else's.
    assert_eq!(log.reach(&channel, ACCOUNT).await.unwrap(), Reach::Member);
    assert_eq!(log.reach(&channel, "acct-2").await.unwrap(), Reach::None);
    let bob = Member::anonymous("bob");
    assert_eq!(
        create(&log, &bob, NAME, ACCOUNT).await.unwrap_err(),
        RelayError::AlreadyExists(format!("channel '{NAME}' already exists"))
    );
    assert_eq!(
        log.channel(ACCOUNT, "org/ns/missing").await.unwrap_err(),
        RelayError::NotFound("no channel 'org/ns/missing'".into())
    );
    // Names were per account before membership; now they are global (the same channel for
    // every account), and an org is the account's that first created under it.
    assert!(Arc::ptr_eq(
        &log.channel("acct-2", NAME).await.unwrap(),
        &channel
    ));
    let carol = Member::anonymous("carol");
    assert_eq!(
        create(&log, &carol, "org/ns/carols", "acct-2")
            .await
            .unwrap_err(),
        RelayError::PermissionDenied("org 'org' belongs to another account".into())
    );
    let other = create(&log, &carol, "other/ns/service", "acct-2")
        .await
        .unwrap();
    assert!(!Arc::ptr_eq(&other, &channel));
    assert_eq!(
        create(&log, &alice, "other/ns/alices", ACCOUNT)
            .await
            .unwrap_err(),
        RelayError::PermissionDenied("org 'other' belongs to another account".into())
    );
    publish(&log, &channel, checked(0, APPLICATION, b"one"))
        .await
        .unwrap();
    log.close().await;

    // Loaded from the store by another log; its epoch 0 row and its group exist.
    let log = open(&db.path, 4).await;
    assert!(log.loaded(ACCOUNT, NAME).is_none());
    let loaded = log.channel(ACCOUNT, NAME).await.unwrap();
    assert_eq!((loaded.head_seq(), loaded.epoch()), (1, 0));
    assert_eq!(log.start_of_epoch(&loaded, 0).await.unwrap(), 0);
    assert_eq!(log.group(&loaded).await.unwrap().unwrap().epoch(), 0);
    assert_eq!(log.reach(&loaded, ACCOUNT).await.unwrap(), Reach::Member);
    assert_eq!(log.reach(&loaded, "acct-2").await.unwrap(), Reach::None);
    let dave = Member::anonymous("dave");
    assert_eq!(
        create(&log, &dave, NAME, ACCOUNT).await.unwrap_err(),
        RelayError::AlreadyExists(format!("channel '{NAME}' already exists"))
    );
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_loads_share_one_channel() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    alices_channel(&log).await;
    log.close().await;
    let log = open(&db.path, 4).await;
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let log = log.clone();
            tokio::spawn(async move { log.channel(ACCOUNT, NAME).await.unwrap() })
        })
        .collect();
    let mut channels = Vec::new();
    for task in tasks {
        channels.push(task.await.unwrap());
    }
    for channel in &channels {
        assert!(Arc::ptr_eq(channel, &channels[0]));
    }
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_submitters_get_gap_free_seqs() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (log, channel) = (log.clone(), channel.clone());
            tokio::spawn(async move {
                let mut seqs = Vec::new();
                for i in 0..50 {
                    let body = format!("task {task} message {i}");
                    let item = checked(0, APPLICATION, body.as_bytes());
                    // Some one by one, some several at once.
                    if i % 5 == 0 {
                        let more = checked(0, APPLICATION, format!("{body} bis").as_bytes());
                        for answer in publish_all(&log, &channel, vec![item, more]).await {
                            seqs.push((answer.unwrap().seq, body.clone()));
                        }
                    } else {
                        seqs.push((publish(&log, &channel, item).await.unwrap().seq, body));
                    }
                }
                seqs
            })
        })
        .collect();
    let mut seqs = Vec::new();
    for task in tasks {
        seqs.extend(task.await.unwrap().into_iter().map(|(seq, _)| seq));
    }
    seqs.sort_unstable();
    let total = 8 * 60;
    assert_eq!(seqs, (1..=total).collect::<Vec<u64>>());
    assert_eq!(channel.head_seq(), total);
    let entries = log.read_after(&channel, 0, 1000).await.unwrap();
    assert_eq!(entries.len() as u64, total);
    assert_consecutive(&entries, 1);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_one_commit_batch_submitted_at_once_is_all_decided() {
    // A free writer commits one batch on the submitter's thread; the rest must reach the
    // writer thread (it once stayed queued until the next submit woke it).
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;
    let items = (0..1300)
        .map(|i| checked(0, APPLICATION, format!("message {i}").as_bytes()))
        .collect();
    let answers = tokio::time::timeout(Duration::from_secs(10), publish_all(&log, &channel, items))
        .await
        .expect("every publish is decided without another submit");
    let seqs: Vec<u64> = answers.into_iter().map(|a| a.unwrap().seq).collect();
    assert_eq!(seqs, (1..=1300).collect::<Vec<u64>>());
    log.close().await;
}

/// Alice adds bob and carol (epoch 1); then they commit at one epoch, in one batch and from
/// concurrent tasks, 19 epochs over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_lets_one_commit_per_epoch_win() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (alice, channel) = alices_channel(&log).await;
    let (bob, carol) = (Member::anonymous("bob"), Member::anonymous("carol"));
    let (bob_kp, carol_kp) = (bob.key_package(), carol.key_package());
    let added = alice
        .engine
        .add_members(NAME, &[&bob_kp, &carol_kp])
        .unwrap();
    let add = check(&log, &channel, &added.commit.into()).await;
    assert_eq!(publish(&log, &channel, add).await, accepted(1, 1, false));
    alice.engine.merge_pending_commit(NAME).unwrap();
    for joiner in [&bob, &carol] {
        joiner.engine.join_group(NAME, &added.welcome).unwrap();
    }
    let members = [alice, bob, carol];
    // In one batch.
    let a = commit_of(&log, &channel, &members[0]).await;
    let b = commit_of(&log, &channel, &members[1]).await;
    let answers = publish_all(&log, &channel, vec![a.clone(), b]).await;
    assert_eq!(answers, vec![accepted(2, 2, false), stale(1, 2)]);
    assert_eq!((channel.head_seq(), channel.epoch()), (2, 2));
    // The group moved with the commit that won.
    assert_eq!(log.group(&channel).await.unwrap().unwrap().epoch(), 2);
    for member in &members {
        member.apply(NAME, &a.message);
    }
    // From concurrent tasks, many times over.
    for epoch in 2..21u64 {
        let mut commits = Vec::new();
        for member in &members {
            commits.push(commit_of(&log, &channel, member).await);
        }
        let tasks: Vec<_> = commits
            .iter()
            .cloned()
            .map(|commit| {
                let (log, channel) = (log.clone(), channel.clone());
                tokio::spawn(async move { publish(&log, &channel, commit).await })
            })
            .collect();
        let mut won = Vec::new();
        for (i, task) in tasks.into_iter().enumerate() {
            match task.await.unwrap() {
                Ok(a) => {
                    assert_eq!(a.epoch, epoch + 1);
                    assert!(!a.duplicate);
                    won.push(i);
                }
                Err(err) => assert_eq!(err, stale(epoch, epoch + 1).unwrap_err()),
            }
        }
        assert_eq!(won.len(), 1, "epoch {epoch}");
        assert_eq!(channel.epoch(), epoch + 1);
        assert_eq!(
            log.group(&channel).await.unwrap().unwrap().epoch(),
            epoch + 1
        );
        for member in &members {
            member.apply(NAME, &commits[won[0]].message);
        }
    }
    // Proposals need the current epoch too (one at another epoch is not checked by the
    // service, whatever it holds: the fence decides).
    let now = channel.epoch();
    let old = checked_message(
        public_message(NAME, now - 1, PROPOSAL, b"p"),
        GroupCheck::OtherEpoch,
    );
    assert_eq!(publish(&log, &channel, old).await, stale(now - 1, now));
    let head = channel.head_seq();
    let proposal = Bytes::from(members[2].engine.leave(NAME).unwrap());
    let proposal = check(&log, &channel, &proposal).await;
    assert_eq!(
        publish(&log, &channel, proposal.clone()).await,
        accepted(head + 1, now, false)
    );
    // Kept for the commits of its epoch.
    assert_eq!(
        log.proposals(&channel, now).await.unwrap(),
        [proposal.message]
    );
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_messages_within_the_window() {
    let db = new_db();
    let log = open(&db.path, 2).await;
    let (alice, channel) = alices_channel(&log).await;
    commit_to(&log, &channel, &alice, 3).await;
    assert_eq!(
        publish(&log, &channel, checked(3, APPLICATION, b"now")).await,
        accepted(4, 3, false)
    );
    assert_eq!(
        publish(&log, &channel, checked(1, APPLICATION, b"two back")).await,
        accepted(5, 3, false)
    );
    assert_eq!(
        publish(&log, &channel, checked(0, APPLICATION, b"three back")).await,
        stale(0, 3)
    );
    assert_eq!(
        publish(&log, &channel, checked(4, APPLICATION, b"ahead")).await,
        stale(4, 3)
    );
    let entries = log.read_after(&channel, 3, 10).await.unwrap();
    let epochs: Vec<_> = entries.iter().map(|e| (e.seq, e.epoch)).collect();
    assert_eq!(epochs, vec![(4, 3), (5, 1)]);
    assert_eq!(entries[0].content_type, 1);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_get_their_original_answer() {
    let db = new_db();
    let log = open(&db.path, 1).await;
    let (alice, channel) = alices_channel(&log).await;
    let first = checked(0, APPLICATION, b"hello");
    assert_eq!(
        publish(&log, &channel, first.clone()).await,
        accepted(1, 0, false)
    );
    assert_eq!(
        publish(&log, &channel, first.clone()).await,
        accepted(1, 0, true)
    );
    let commit = commit_of(&log, &channel, &alice).await;
    assert_eq!(
        publish(&log, &channel, commit.clone()).await,
        accepted(2, 1, false)
    );
    alice.apply(NAME, &commit.message);
    commit_to(&log, &channel, &alice, 5).await;
    let head = channel.head_seq();
    // Now stale by epoch: still the original answer, never a refusal.
    assert_eq!(
        publish(&log, &channel, first.clone()).await,
        accepted(1, 0, true)
    );
    assert_eq!(
        publish(&log, &channel, retried(&commit)).await,
        accepted(2, 1, true)
    );
    // A client-given key: the same key is the same publish, whatever the bytes.
    let mut keyed = checked(5, APPLICATION, b"keyed");
    keyed.key = idempotency_key(b"my-key", &keyed.message).unwrap();
    let mut keyed_again = checked(5, APPLICATION, b"other bytes");
    keyed_again.key = keyed.key.clone();
    assert_eq!(
        publish(&log, &channel, keyed).await,
        accepted(head + 1, 5, false)
    );
    assert_eq!(
        publish(&log, &channel, keyed_again).await,
        accepted(head + 1, 5, true)
    );
    // A retry at the current epoch among new messages (the unique index refuses the batch's
    // first attempt) and a duplicate within the batch.
    let retry = checked(5, APPLICATION, b"retried");
    let base = publish(&log, &channel, retry.clone()).await.unwrap().seq;
    let new_1 = checked(5, APPLICATION, b"new 1");
    let new_2 = checked(5, APPLICATION, b"new 2");
    let answers = publish_all(
        &log,
        &channel,
        vec![
            new_1.clone(),
            retry,
            new_1,
            first,
            checked(3, APPLICATION, b"stale"),
            new_2,
        ],
    )
    .await;
    assert_eq!(
        answers,
        vec![
            accepted(base + 1, 5, false),
            accepted(base, 5, true),
            accepted(base + 1, 5, true),
            accepted(1, 0, true),
            stale(3, 5),
            accepted(base + 2, 5, false),
        ]
    );
    assert_eq!(channel.head_seq(), base + 2);
    let entries = log.read_after(&channel, 0, 100).await.unwrap();
    assert_consecutive(&entries, 1);
    assert_eq!(entries.len() as u64, base + 2);
    log.close().await;
}

/// Alice adds bob and carol with one Welcome; later she removes bob and adds him again with
/// the same key package (a retried invitation): its ref then names the later Welcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn welcomes_are_kept_with_their_commit() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (alice, channel) = alices_channel(&log).await;
    publish(&log, &channel, checked(0, APPLICATION, b"before"))
        .await
        .unwrap();
    let (bob, carol) = (Member::anonymous("bob"), Member::anonymous("carol"));
    let (bob_kp, carol_kp) = (bob.key_package(), carol.key_package());
    let (ref_b, ref_c) = (key_package_ref(&bob_kp), key_package_ref(&carol_kp));
    let added = alice
        .engine
        .add_members(NAME, &[&bob_kp, &carol_kp])
        .unwrap();
    let welcome = Bytes::from(added.welcome);
    let mut commit = check(&log, &channel, &added.commit.into()).await;
    commit.welcome = welcome.clone();
    commit.welcome_refs = vec![ref_b.clone(), ref_c.clone()];
    assert_eq!(publish(&log, &channel, commit).await, accepted(2, 1, false));
    alice.engine.merge_pending_commit(NAME).unwrap();
    let record = Some(WelcomeRecord {
        welcome: welcome.clone(),
        commit_seq: 2,
        epoch: 1,
    });
    let digest = Sha256::digest(&welcome).to_vec();
    assert_eq!(
        log.fetch_welcome(&channel, WelcomeKey::Digest(digest))
            .await
            .unwrap(),
        record
    );
    for r in [&ref_b, &ref_c] {
        let key = WelcomeKey::KeyPackageRef(r.clone());
        assert_eq!(log.fetch_welcome(&channel, key).await.unwrap(), record);
    }
    let unknown = WelcomeKey::KeyPackageRef(b"ref-c".to_vec());
    assert_eq!(log.fetch_welcome(&channel, unknown).await.unwrap(), None);
    let unknown = WelcomeKey::Digest(vec![0; 32]);
    assert_eq!(log.fetch_welcome(&channel, unknown).await.unwrap(), None);
    // Another channel does not see it.
    let other = create(&log, &alice, "org/ns/other", ACCOUNT).await.unwrap();
    let key = WelcomeKey::KeyPackageRef(ref_b.clone());
    assert_eq!(log.fetch_welcome(&other, key).await.unwrap(), None);
    // Bob removed, then added again with the same key package: the ref now points at the
    // later Welcome.
    let remove = check(&log, &channel, &alice.remove(NAME, "bob")).await;
    assert_eq!(
        publish(&log, &channel, remove.clone()).await,
        accepted(3, 2, false)
    );
    alice.apply(NAME, &remove.message);
    let readded = alice.engine.add_member(NAME, &bob_kp).unwrap();
    let later = Bytes::from(readded.welcome);
    let mut commit = check(&log, &channel, &readded.commit.into()).await;
    commit.welcome = later.clone();
    commit.welcome_refs = vec![ref_b.clone()];
    assert_eq!(publish(&log, &channel, commit).await, accepted(4, 3, false));
    let key = WelcomeKey::KeyPackageRef(ref_b);
    assert_eq!(
        log.fetch_welcome(&channel, key).await.unwrap(),
        Some(WelcomeRecord {
            welcome: later,
            commit_seq: 4,
            epoch: 3
        })
    );
    let key = WelcomeKey::KeyPackageRef(ref_c);
    assert_eq!(log.fetch_welcome(&channel, key).await.unwrap(), record);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_start_at_their_commit() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (alice, channel) = alices_channel(&log).await;
    assert_eq!(log.start_of_epoch(&channel, 0).await.unwrap(), 0);
    for body in [b"a", b"b"] {
        publish(&log, &channel, checked(0, APPLICATION, body))
            .await
            .unwrap();
    }
    commit_to(&log, &channel, &alice, 1).await;
    publish(&log, &channel, checked(1, APPLICATION, b"d"))
        .await
        .unwrap();
    commit_to(&log, &channel, &alice, 2).await;
    assert_eq!(log.start_of_epoch(&channel, 0).await.unwrap(), 0);
    assert_eq!(log.start_of_epoch(&channel, 1).await.unwrap(), 3);
    assert_eq!(log.start_of_epoch(&channel, 2).await.unwrap(), 5);
    for epoch in [3, u64::MAX] {
        assert_eq!(
            log.start_of_epoch(&channel, epoch).await.unwrap_err(),
            RelayError::NotFound(format!(
                "channel '{NAME}' has no epoch {epoch} (it is at 2)"
            ))
        );
    }
    log.close().await;
    // From the store alone.
    let log = open(&db.path, 4).await;
    let channel = log.channel(ACCOUNT, NAME).await.unwrap();
    assert_eq!(log.start_of_epoch(&channel, 2).await.unwrap(), 5);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_after_from_memory_and_from_the_store() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;
    let items: Vec<_> = (0..5)
        .map(|i| checked(0, APPLICATION, format!("m{i}").as_bytes()))
        .collect();
    let messages: Vec<Bytes> = items.iter().map(|c| c.message.clone()).collect();
    publish_all(&log, &channel, items).await;
    let from_memory = log.read_after(&channel, 0, 10).await.unwrap();
    assert_eq!(from_memory.len(), 5);
    assert_consecutive(&from_memory, 1);
    let got: Vec<_> = from_memory.iter().map(|e| e.message.clone()).collect();
    assert_eq!(got, messages);
    let page = log.read_after(&channel, 2, 2).await.unwrap();
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4]);
    assert!(log.read_after(&channel, 5, 10).await.unwrap().is_empty());
    assert!(log.read_after(&channel, 50, 10).await.unwrap().is_empty());
    assert!(log.read_after(&channel, 0, 0).await.unwrap().is_empty());
    log.close().await;

    // Reopened: nothing in memory, the same entries from the store.
    let log = open(&db.path, 4).await;
    let channel = log.channel(ACCOUNT, NAME).await.unwrap();
    assert_eq!((channel.head_seq(), channel.epoch()), (5, 0));
    assert_eq!(log.read_after(&channel, 0, 10).await.unwrap(), from_memory);
    assert_eq!(
        log.read_after(&channel, 3, 10).await.unwrap(),
        from_memory[3..]
    );
    // New entries continue the log; the ring has them, the store the rest.
    let answer = publish(&log, &channel, checked(0, APPLICATION, b"m5")).await;
    assert_eq!(answer, accepted(6, 0, false));
    let all = log.read_after(&channel, 0, 10).await.unwrap();
    assert_eq!(all.len(), 6);
    assert_consecutive(&all, 1);
    assert_eq!(log.read_after(&channel, 5, 10).await.unwrap(), all[5..]);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_after_past_the_ring() {
    let db = new_db();
    // Room for about 500 of these entries (~50 bytes each, plus their bookkeeping).
    let log = open_with(&db.path, 4, 500 * 180, defaults().idle_unload).await;
    let (_alice, channel) = alices_channel(&log).await;
    let total = 2300u64;
    for chunk in 0..(total / 100) {
        let items = (0..100)
            .map(|i| checked(0, APPLICATION, format!("{chunk}/{i}").as_bytes()))
            .collect();
        for answer in publish_all(&log, &channel, items).await {
            answer.unwrap();
        }
    }
    assert_eq!(channel.head_seq(), total);
    // The rings keep the last ~500: older cursors read the store, in pages.
    assert!(log.cached_bytes() <= 500 * 180);
    assert!(
        log.read_after(&channel, total - 10, 10)
            .await
            .unwrap()
            .len()
            == 10
    );
    let mut cursor = 0;
    let mut count = 0;
    loop {
        let page = log.read_after(&channel, cursor, 256).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 256);
        assert_consecutive(&page, cursor + 1);
        count += page.len() as u64;
        cursor = page.last().unwrap().seq;
    }
    assert_eq!((cursor, count), (total, total));
    let first = log.read_after(&channel, 0, 1).await.unwrap();
    assert_eq!(first[0].message, private(0, APPLICATION, b"0/0"));
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_entries_survive_close_and_reopen() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (alice, channel) = alices_channel(&log).await;
    publish(&log, &channel, checked(0, APPLICATION, b"a"))
        .await
        .unwrap();
    commit_to(&log, &channel, &alice, 1).await;
    let c = checked(1, APPLICATION, b"c");
    publish(&log, &channel, c.clone()).await.unwrap();
    let before = log.read_after(&channel, 0, 10).await.unwrap();
    log.close().await;
    drop(log);

    let log = open(&db.path, 4).await;
    let channel = log.channel(ACCOUNT, NAME).await.unwrap();
    assert_eq!((channel.head_seq(), channel.epoch()), (3, 1));
    assert_eq!(log.read_after(&channel, 0, 10).await.unwrap(), before);
    // Idempotency holds across restarts, and the log goes on from its head, with the group
    // as the last commit left it (the next commit checks against it).
    assert_eq!(publish(&log, &channel, c).await, accepted(3, 1, true));
    assert_eq!(log.group(&channel).await.unwrap().unwrap().epoch(), 1);
    let d = commit_of(&log, &channel, &alice).await;
    assert_eq!(publish(&log, &channel, d).await, accepted(4, 2, false));
    log.close().await;
    let conn = rusqlite::Connection::open(&db.path).unwrap();
    let row: (i64, i64, i64) = conn
        .query_row(
            "SELECT head_seq, c.epoch, g.epoch FROM relay_channels c \
             JOIN relay_groups g ON g.channel_id = c.id WHERE name = ?1",
            [NAME],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(row, (4, 2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_head_wakes_a_waiting_reader() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;
    let reader = {
        let (log, channel) = (log.clone(), channel.clone());
        tokio::spawn(async move {
            // Subscribe, then read; wait only when caught up.
            let mut head = channel.watch_head();
            let mut cursor = 0;
            let mut got = Vec::new();
            while got.len() < 3 {
                let page = log.read_after(&channel, cursor, 256).await.unwrap();
                if page.is_empty() {
                    head.changed().await.unwrap();
                    continue;
                }
                cursor = page.last().unwrap().seq;
                got.extend(page);
            }
            got
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    publish(&log, &channel, checked(0, APPLICATION, b"1"))
        .await
        .unwrap();
    publish_all(
        &log,
        &channel,
        vec![checked(0, APPLICATION, b"2"), checked(0, APPLICATION, b"3")],
    )
    .await;
    let got = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .unwrap()
        .unwrap();
    assert_consecutive(&got, 1);
    assert_eq!(got.len(), 3);
    let mut head = channel.watch_head();
    assert_eq!(*head.borrow_and_update(), 3);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_answers_everything_submitted_before_it() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;
    let mut outcomes = Vec::new();
    for round in 0..10 {
        let items = (0..50)
            .map(|i| {
                (
                    channel.clone(),
                    checked(0, APPLICATION, format!("{round}/{i}").as_bytes()),
                )
            })
            .collect();
        outcomes.extend(log.submit(items));
    }
    log.close().await;
    let mut seqs = Vec::new();
    for outcome in outcomes {
        seqs.push(outcome.await.unwrap().unwrap().seq);
    }
    assert_eq!(seqs, (1..=500).collect::<Vec<u64>>());
    let shutting_down = RelayError::Unavailable("relay is shutting down".into());
    let late = log.submit(vec![(channel.clone(), checked(0, APPLICATION, b"late"))]);
    for outcome in late {
        assert_eq!(outcome.await.unwrap(), Err(shutting_down.clone()));
    }
    let alice = Member::anonymous("alice");
    assert_eq!(
        create(&log, &alice, "org/ns/late", ACCOUNT)
            .await
            .unwrap_err(),
        shutting_down
    );
    assert_eq!(channel.head_seq(), 500);
    // Closing twice is fine.
    log.close().await;

    let log = open(&db.path, 4).await;
    let channel = log.channel(ACCOUNT, NAME).await.unwrap();
    assert_eq!(channel.head_seq(), 500);
    log.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_changes_nothing() {
    let db = new_db();
    // A publish the database refuses (by its key): its whole group commit fails.
    rusqlite::Connection::open(&db.path)
        .unwrap()
        .execute_batch(
            "CREATE TRIGGER refuse BEFORE INSERT ON relay_entries
             WHEN NEW.idempotency_key = CAST('k:refuse-me' AS BLOB)
             BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END;",
        )
        .unwrap();
    let log = open(&db.path, 4).await;
    let (alice, channel) = alices_channel(&log).await;
    let mut bad = commit_of(&log, &channel, &alice).await;
    bad.key = idempotency_key(b"refuse-me", &bad.message).unwrap();
    let good = checked(0, APPLICATION, b"good");
    let answers = publish_all(&log, &channel, vec![good.clone(), bad.clone()]).await;
    for answer in answers {
        match answer {
            Err(RelayError::Unavailable(text)) => {
                assert!(text.starts_with("store unavailable: "), "{text}");
                assert!(text.contains("refused by a trigger"), "{text}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Nothing in memory moved (the commit would have bumped the epoch and the group).
    assert_eq!((channel.head_seq(), channel.epoch()), (0, 0));
    assert_eq!(log.group(&channel).await.unwrap().unwrap().epoch(), 0);
    assert!(log.read_after(&channel, 0, 10).await.unwrap().is_empty());
    assert_eq!(publish(&log, &channel, good).await, accepted(1, 0, false));
    // The same commit, checked again, under its own key.
    let fine = check(&log, &channel, &bad.message).await;
    assert_eq!(publish(&log, &channel, fine).await, accepted(2, 1, false));
    assert_eq!(log.group(&channel).await.unwrap().unwrap().epoch(), 1);
    log.close().await;
}

#[tokio::test]
async fn open_needs_the_relay_tables() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.sqlite3");
    let err = ChannelLog::open(LogSettings {
        database: missing.into(),
        application_window: 4,
        cache_bytes: defaults().cache_bytes,
        idle_unload: defaults().idle_unload,
    })
    .await
    .err()
    .unwrap();
    assert!(matches!(&err, RelayError::Unavailable(t) if t.starts_with("store unavailable: ")));
    let empty = dir.path().join("empty.sqlite3");
    rusqlite::Connection::open(&empty)
        .unwrap()
        .execute_batch("CREATE TABLE other (id INTEGER);")
        .unwrap();
    let err = ChannelLog::open(LogSettings {
        database: empty.into(),
        application_window: 4,
        cache_bytes: defaults().cache_bytes,
        idle_unload: defaults().idle_unload,
    })
    .await
    .err()
    .unwrap();
    assert!(
        matches!(&err, RelayError::Unavailable(t) if t.contains("no such table")),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_writer_commits_in_the_submitter_a_busy_one_on_its_thread() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;

    // Free: committed (and answered) before submit returns.
    let mut outcomes = log.submit(vec![(channel.clone(), checked(0, APPLICATION, b"one"))]);
    assert_eq!(outcomes[0].try_recv().unwrap(), accepted(1, 0, false));

    // Busy: another connection holds the database's write lock, so the first submitter waits
    // inside its commit; a second submit meanwhile returns at once, and the writer thread
    // commits it after the first, in order.
    let other = rusqlite::Connection::open(&db.path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let first = {
        let (log, channel) = (log.clone(), channel.clone());
        tokio::task::spawn_blocking(move || {
            log.submit(vec![(channel, checked(0, APPLICATION, b"two"))])
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !first.is_finished(),
        "the first commit waits for the write lock"
    );
    let started = std::time::Instant::now();
    let second = log.submit(vec![(channel.clone(), checked(0, APPLICATION, b"three"))]);
    assert!(started.elapsed() < Duration::from_millis(100));
    other.execute_batch("COMMIT").unwrap();
    let mut first = first.await.unwrap();
    assert_eq!(first.pop().unwrap().await.unwrap(), accepted(2, 0, false));
    let answers: Vec<_> = futures_util::future::join_all(second).await;
    assert_eq!(
        answers.into_iter().next().unwrap().unwrap(),
        accepted(3, 0, false)
    );
    log.close().await;
}

/// Unloads `name`'s channel (nobody may hold it) and loads it again from the store.
async fn reloaded(log: &ChannelLog, name: &str) -> Arc<Channel> {
    assert_eq!(log.unload_idle(Duration::ZERO), 1);
    assert!(log.loaded(ACCOUNT, name).is_none());
    assert_eq!(log.loaded_channels(), 0);
    log.channel(ACCOUNT, name).await.unwrap()
}

/// A channel unloaded and loaded again is the same channel: head, epoch, the fence, retries
/// (their original seq), its group and who reaches it (a member, a removed one up to its
/// removal, an outsider), and a reader's cursor carries on. Not unloaded while held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unloaded_channel_reloads_exactly() {
    let db = new_db();
    let log = open(&db.path, 1).await;
    let (alice, channel) = alices_channel(&log).await;
    let first = checked(0, APPLICATION, b"first");
    assert_eq!(
        publish(&log, &channel, first.clone()).await,
        accepted(1, 0, false)
    );
    // Bob is added (epoch 1) and binds his leaf.
    let bob = Member::anonymous("bob");
    let added = alice
        .engine
        .add_members(NAME, &[&bob.key_package()])
        .unwrap();
    let add = check(&log, &channel, &added.commit.into()).await;
    assert_eq!(
        publish(&log, &channel, add.clone()).await,
        accepted(2, 1, false)
    );
    alice.engine.merge_pending_commit(NAME).unwrap();
    assert!(log.bind(&channel, 1, 1, "acct-bob", None).await.unwrap());
    assert_eq!(
        log.reach(&channel, "acct-bob").await.unwrap(),
        Reach::Member
    );
    let second = checked(1, APPLICATION, b"second");
    assert_eq!(
        publish(&log, &channel, second.clone()).await,
        accepted(3, 1, false)
    );
    let read_before = log.read_after(&channel, 0, 10).await.unwrap();

    // Held (a call, a stream, a publish in flight): never unloaded.
    assert_eq!(log.unload_idle(Duration::ZERO), 0);
    assert_eq!(log.loaded_channels(), 1);
    drop(channel);
    let channel = reloaded(&log, NAME).await;
    assert_eq!((channel.head_seq(), channel.epoch()), (3, 1));
    assert_eq!(log.read_after(&channel, 0, 10).await.unwrap(), read_before);
    assert_eq!(
        log.read_after(&channel, 2, 10).await.unwrap(),
        read_before[2..]
    );
    assert_eq!(log.reach(&channel, ACCOUNT).await.unwrap(), Reach::Member);
    assert_eq!(
        log.reach(&channel, "acct-bob").await.unwrap(),
        Reach::Member
    );
    assert_eq!(log.reach(&channel, "acct-3").await.unwrap(), Reach::None);
    assert_eq!(log.group(&channel).await.unwrap().unwrap().epoch(), 1);
    // Retries get their original answer; the fence holds at the reloaded epoch.
    assert_eq!(publish(&log, &channel, first).await, accepted(1, 0, true));
    assert_eq!(
        publish(&log, &channel, retried(&add)).await,
        accepted(2, 1, true)
    );
    assert_eq!(
        publish(&log, &channel, checked(0, PROPOSAL, b"stale")).await,
        stale(0, 1)
    );

    // Alice removes bob (epoch 2); reloaded, bob reaches up to that commit only.
    let removal = check(&log, &channel, &alice.remove(NAME, "bob")).await;
    assert_eq!(
        publish(&log, &channel, removal.clone()).await,
        accepted(4, 2, false)
    );
    alice.apply(NAME, &removal.message);
    drop(channel);
    let channel = reloaded(&log, NAME).await;
    assert_eq!((channel.head_seq(), channel.epoch()), (4, 2));
    assert_eq!(
        log.reach(&channel, "acct-bob").await.unwrap(),
        Reach::Until(4)
    );
    assert_eq!(
        publish(&log, &channel, retried(&removal)).await,
        accepted(4, 2, true)
    );
    // A stale commit is refused, the next one is checked against the reloaded group.
    assert_eq!(
        publish(&log, &channel, retried(&add)).await,
        accepted(2, 1, true)
    );
    let next = commit_of(&log, &channel, &alice).await;
    assert_eq!(
        publish(&log, &channel, next.clone()).await,
        accepted(5, 3, false)
    );
    alice.apply(NAME, &next.message);
    assert_eq!(publish(&log, &channel, second).await, accepted(3, 1, true));
    let all = log.read_after(&channel, 0, 10).await.unwrap();
    assert_consecutive(&all, 1);
    assert_eq!(all.len(), 5);
    log.close().await;
}

/// Loads, publishes and unloads of one channel racing each other: every publish is answered
/// once, seqs stay gap-free (a load that read its row before a commit the unload outlived
/// takes the unloaded channel's head).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unloads_race_loads_and_publishes() {
    let db = new_db();
    let log = open(&db.path, 4).await;
    let (_alice, channel) = alices_channel(&log).await;
    drop(channel);
    // A round may run without any unload at all when the publishers always hold the channel
    // (a loaded 2-core machine): rounds go on, up to 10, until unloads raced the publishes.
    let mut seqs = Vec::new();
    let mut unloads = 0;
    let mut rounds = 0;
    while unloads == 0 && rounds < 10 {
        rounds += 1;
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let unloader = {
            let (log, done) = (log.clone(), Arc::clone(&done));
            tokio::spawn(async move {
                let mut unloads = 0;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    unloads += log.unload_idle(Duration::ZERO);
                    tokio::task::yield_now().await;
                }
                unloads
            })
        };
        let publishers: Vec<_> = (0..4)
            .map(|p| {
                let log = log.clone();
                tokio::spawn(async move {
                    let mut seqs = Vec::new();
                    for i in 0..50 {
                        let channel = log.channel(ACCOUNT, NAME).await.unwrap();
                        let item = checked(0, APPLICATION, format!("{rounds}/{p}/{i}").as_bytes());
                        let answer = publish(&log, &channel, item).await.unwrap();
                        assert!(!answer.duplicate);
                        seqs.push(answer.seq);
                    }
                    seqs
                })
            })
            .collect();
        for publisher in publishers {
            seqs.extend(publisher.await.unwrap());
        }
        done.store(true, std::sync::atomic::Ordering::Release);
        unloads += unloader.await.unwrap();
    }
    assert!(
        unloads > 0,
        "never unloaded in {rounds} rounds: the race was not run"
    );
    let published = 200 * rounds;
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=published).collect::<Vec<u64>>());
    let channel = log.channel(ACCOUNT, NAME).await.unwrap();
    assert_eq!(channel.head_seq(), published);
    let mut all = log
        .read_after(&channel, 0, usize::try_from(published).unwrap() + 56)
        .await
        .unwrap();
    assert_consecutive(&all, 1);
    assert_eq!(all.len(), usize::try_from(published).unwrap());
    all.sort_by(|a, b| a.message.cmp(&b.message));
    all.dedup_by(|a, b| a.message == b.message);
    assert_eq!(all.len(), usize::try_from(published).unwrap());
    log.close().await;
}

/// The rings of many channels together stay within the budget, whichever channel publishes;
/// what fell out is read from the store; unloaded channels give theirs back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_budget_holds_across_many_channels() {
    let db = new_db();
    let budget = 64 * 1024;
    let log = open_with(&db.path, 4, budget, defaults().idle_unload).await;
    let alice = Member::anonymous("alice");
    let mut channels = Vec::new();
    for c in 0..12 {
        let name = format!("org/many/c{c}");
        channels.push(create(&log, &alice, &name, ACCOUNT).await.unwrap());
    }
    let body = |c: usize, i: usize| format!("{c}/{i}").into_bytes().repeat(700);
    for i in 0..8 {
        for (c, channel) in channels.iter().enumerate() {
            publish(&log, channel, checked(0, APPLICATION, &body(c, i)))
                .await
                .unwrap();
            assert!(log.cached_bytes() <= budget, "{}", log.cached_bytes());
        }
    }
    assert!(log.cached_bytes() > budget / 2);
    for (c, channel) in channels.iter().enumerate() {
        let entries = log.read_after(channel, 0, 100).await.unwrap();
        assert_consecutive(&entries, 1);
        let expected: Vec<Bytes> = (0..8)
            .map(|i| private(0, APPLICATION, &body(c, i)))
            .collect();
        let messages: Vec<Bytes> = entries.into_iter().map(|e| e.message).collect();
        assert_eq!(messages, expected);
    }
    drop(channels);
    assert_eq!(log.unload_idle(Duration::ZERO), 12);
    assert_eq!(log.cached_bytes(), 0);
    log.close().await;
}

/// The log unloads idle channels by itself, and never one that something holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_channels_are_unloaded_by_themselves() {
    let db = new_db();
    let log = open_with(
        &db.path,
        4,
        defaults().cache_bytes,
        Duration::from_millis(100),
    )
    .await;
    let alice = Member::anonymous("alice");
    let held = create(&log, &alice, "org/idle/held", ACCOUNT)
        .await
        .unwrap();
    let idle = create(&log, &alice, "org/idle/idle", ACCOUNT)
        .await
        .unwrap();
    publish(&log, &idle, checked(0, APPLICATION, b"once"))
        .await
        .unwrap();
    drop(idle);
    let started = std::time::Instant::now();
    while log.loaded_channels() > 1 {
        assert!(started.elapsed() < Duration::from_secs(5), "not unloaded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Idle since its publish, 100 ms at least.
    assert!(started.elapsed() >= Duration::from_millis(75));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(log.loaded_channels(), 1);
    assert!(log.loaded(ACCOUNT, "org/idle/idle").is_none());
    assert_eq!(held.head_seq(), 0);
    let idle = log.channel(ACCOUNT, "org/idle/idle").await.unwrap();
    assert_eq!(idle.head_seq(), 1);
    assert_eq!(log.read_after(&idle, 0, 10).await.unwrap().len(), 1);
    log.close().await;
}

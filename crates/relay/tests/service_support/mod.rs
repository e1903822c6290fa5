//! What the service tests share: a relay on 127.0.0.1:0 over a fresh SQLite database, a
//! tonic client, MLS members (a static-mls engine each, or an OpenMLS client for what the
//! engine refuses to do) that create channels, join, bind and commit for real, hand-built MLS
//! framing for application messages (the relay never reads their content; the framing of
//! `tests/relay/mls_vectors.py`), a fake token verifier, a SubscribeMany reader.
#![allow(clippy::unwrap_used, dead_code)]

pub mod postgres;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::{
    BasicCredential, CredentialWithKey, GroupId, KeyPackage, LeafNodeIndex, LeafNodeParameters,
    MlsGroup, MlsGroupJoinConfig, MlsMessageBodyIn, MlsMessageIn, MlsMessageOut,
    ProcessedMessageContent, ProtocolVersion, StagedWelcome, WireFormatPolicy,
};
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::{OpenMlsRustCrypto, RustCrypto};
use openmls_traits::signatures::Signer as _;
use openmls_traits::OpenMlsProvider as _;
use static_mls::binding::leaf_binding_tbs;
use static_mls::{Engine, Incoming, CIPHERSUITE};
use static_relay::pb::relay_client::RelayClient;
use static_relay::pb::{self, subscribe_response::Item};
use static_relay::{
    ChannelPatterns, Database, Principal, RelayConfig, RelayError, RelayServer, Verify,
};
use tempfile::TempDir;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

pub const CHANNEL: &str = "acme/agents/chat";
pub const APPLICATION: u8 = 1;
pub const PROPOSAL: u8 = 2;
pub const COMMIT: u8 = 3;
/// How long any wait of these helpers lasts before it fails the test (no wait is unbounded: a
/// relay that skips an entry or never answers fails the test, it does not hang it).
pub const WAIT: Duration = Duration::from_secs(10);

/// The relay's tables, as the Python store's migrations make them (the crate's one list).
pub const SCHEMA: &[&str] = static_relay::schema::SQLITE;

/// A relay serving a database of its own.
pub struct Relay {
    pub server: Option<RelayServer>,
    pub addr: SocketAddr,
    pub dir: TempDir,
}

impl Relay {
    pub async fn start(configure: impl FnOnce(&mut RelayConfig)) -> Relay {
        Relay::start_with(configure, None).await
    }

    /// Anonymous callers allowed: most tests are not about tokens.
    pub async fn anonymous() -> Relay {
        Relay::start(|c| c.allow_anonymous = true).await
    }

    pub async fn start_with(
        configure: impl FnOnce(&mut RelayConfig),
        verifier: Option<Arc<dyn Verify>>,
    ) -> Relay {
        let dir = tempfile::tempdir().unwrap();
        let db_path = dir.path().join("static.db");
        let connection = rusqlite::Connection::open(&db_path).unwrap();
        for schema in SCHEMA {
            connection.execute_batch(schema).unwrap();
        }
        Relay::on_database(Database::from(db_path.as_path()), dir, configure, verifier).await
    }

    /// A relay over `database` (its relay tables made); `dir` lives as long as the relay.
    pub async fn on_database(
        database: Database,
        dir: TempDir,
        configure: impl FnOnce(&mut RelayConfig),
        verifier: Option<Arc<dyn Verify>>,
    ) -> Relay {
        let mut config = RelayConfig::new(database);
        config.port = 0;
        configure(&mut config);
        let server = RelayServer::start(config, verifier).await.unwrap();
        let addr = server.local_addr();
        Relay {
            server: Some(server),
            addr,
            dir,
        }
    }

    pub fn server(&self) -> &RelayServer {
        self.server.as_ref().unwrap()
    }

    /// A client on a connection of its own.
    pub async fn client(&self) -> RelayClient<Channel> {
        RelayClient::new(self.connect().await)
    }

    pub async fn connect(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn shutdown(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
    }

    /// Unloads every channel (within `WAIT`): the next call reads them from the store.
    pub async fn unload_all(&self) {
        let log = self.server().log();
        let started = Instant::now();
        loop {
            log.unload_idle(Duration::ZERO);
            if log.loaded_channels() == 0 {
                return;
            }
            assert!(started.elapsed() < WAIT, "channels still loaded");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A request with a bearer token.
pub fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

fn varint(n: usize) -> Vec<u8> {
    if n < 1 << 6 {
        vec![n as u8]
    } else if n < 1 << 14 {
        ((n as u16) | 0x4000).to_be_bytes().to_vec()
    } else {
        ((n as u32) | 0x8000_0000).to_be_bytes().to_vec()
    }
}

fn vec(data: &[u8]) -> Vec<u8> {
    let mut out = varint(data.len());
    out.extend_from_slice(data);
    out
}

fn preamble(wire_format: u16) -> Vec<u8> {
    let mut out = 1u16.to_be_bytes().to_vec();
    out.extend_from_slice(&wire_format.to_be_bytes());
    out
}

pub fn private_message(group: &str, epoch: u64, content_type: u8, ciphertext: &[u8]) -> Bytes {
    let mut out = preamble(2);
    out.extend(vec(group.as_bytes()));
    out.extend_from_slice(&epoch.to_be_bytes());
    out.push(content_type);
    out.extend(vec(b""));
    out.extend(vec(b"encrypted sender data"));
    out.extend(vec(ciphertext));
    Bytes::from(out)
}

pub fn public_message(group: &str, epoch: u64, content_type: u8, body: &[u8]) -> Bytes {
    let mut out = preamble(1);
    out.extend(vec(group.as_bytes()));
    out.extend_from_slice(&epoch.to_be_bytes());
    out.push(1); // sender: member, leaf 1
    out.extend_from_slice(&[0, 0, 0, 1]);
    out.extend(vec(b""));
    out.push(content_type);
    out.extend(vec(body));
    out.extend(vec(b"signature"));
    out.extend(vec(b"tag"));
    Bytes::from(out)
}

pub fn application(group: &str, epoch: u64, payload: &[u8]) -> Bytes {
    private_message(group, epoch, APPLICATION, payload)
}

pub fn welcome(key_package_refs: &[&[u8]]) -> Bytes {
    let mut secrets = Vec::new();
    for r in key_package_refs {
        secrets.extend(vec(r));
        secrets.extend(vec(b"kem output"));
        secrets.extend(vec(b"secrets"));
    }
    let mut out = preamble(3);
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend(vec(&secrets));
    out.extend(vec(b"encrypted group info"));
    Bytes::from(out)
}

pub fn request(channel: &str, message: Bytes) -> pb::PublishRequest {
    pb::PublishRequest {
        channel: channel.to_owned(),
        message,
        ..Default::default()
    }
}

/// `channel` created by a new anonymous member, "alice" (the member, to commit as the group).
pub async fn create(client: &mut RelayClient<Channel>, channel: &str) -> Member {
    let alice = Member::anonymous("alice");
    alice.create(client, channel).await;
    alice
}

/// `create`, by a new member "alice" acting as the holder of `token`.
pub async fn create_as(client: &mut RelayClient<Channel>, channel: &str, token: &str) -> Member {
    let alice = Member::with_token("alice", token);
    alice.create(client, channel).await;
    alice
}

pub async fn publish(
    client: &mut RelayClient<Channel>,
    channel: &str,
    message: Bytes,
) -> Result<pb::PublishResponse, Status> {
    client
        .publish(request(channel, message))
        .await
        .map(tonic::Response::into_inner)
}

pub fn subscribe_request(channel: &str, after_seq: u64) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        channel: channel.to_owned(),
        start: Some(pb::subscribe_request::Start::AfterSeq(after_seq)),
        max_batch: 0,
    }
}

/// A Subscribe call being read.
pub struct Subscription {
    pub stream: Streaming<pb::SubscribeResponse>,
    pub entries: Vec<pb::Entry>,
    pub keepalives: usize,
    pub batch_sizes: Vec<usize>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Subscription({})", self.seen())
    }
}

impl Subscription {
    pub async fn open(client: &mut RelayClient<Channel>, request: pb::SubscribeRequest) -> Self {
        Subscription::of(client.subscribe(request).await.unwrap().into_inner())
    }

    /// `n` subscriptions to `channel` from its start, each live (its first keep-alive read).
    pub async fn open_live(
        client: &mut RelayClient<Channel>,
        channel: &str,
        n: usize,
    ) -> Vec<Subscription> {
        let mut subs = Vec::with_capacity(n);
        for _ in 0..n {
            let mut sub = Subscription::open(client, subscribe_request(channel, 0)).await;
            sub.wait_keepalives(1).await;
            subs.push(sub);
        }
        subs
    }

    pub fn of(stream: Streaming<pb::SubscribeResponse>) -> Self {
        Subscription {
            stream,
            entries: Vec::new(),
            keepalives: 0,
            batch_sizes: Vec::new(),
        }
    }

    /// The next response; Err: the call ended (with its status, or OK as `Code::Ok`). Panics
    /// at `deadline`, saying it was waiting for `what` and what had arrived.
    async fn next(&mut self, deadline: Instant, what: &str) -> Result<(), Status> {
        let response = match tokio::time::timeout_at(deadline, self.stream.message()).await {
            Ok(response) => response?,
            Err(_) => panic!(
                "waited for {what}, nothing new for {WAIT:?}; the subscription had {}",
                self.seen()
            ),
        };
        match response.and_then(|r| r.item) {
            Some(Item::Entry(entry)) => self.entries.push(entry),
            Some(Item::Entries(batch)) => {
                self.batch_sizes.push(batch.entries.len());
                self.entries.extend(batch.entries);
            }
            Some(Item::KeepAlive(_)) => self.keepalives += 1,
            None => return Err(Status::new(Code::Ok, "ended")),
        }
        Ok(())
    }

    /// Until `count` entries arrived in all. Fails the test when no new entry came for
    /// `WAIT` (keep-alives alone do not count: a relay that skips an entry fails, not hangs).
    pub async fn wait_for(&mut self, count: usize) -> &[pb::Entry] {
        let what = format!("{count} entries");
        let mut deadline = Instant::now() + WAIT;
        while self.entries.len() < count {
            let had = self.entries.len();
            if let Err(status) = self.next(deadline, &what).await {
                panic!("ended with {} of {what}: {status:?}", self.seen());
            }
            if self.entries.len() > had {
                deadline = Instant::now() + WAIT;
            }
        }
        &self.entries
    }

    /// Until `count` keep-alives arrived in all; fails the test when none came for `WAIT`.
    pub async fn wait_keepalives(&mut self, count: usize) {
        let what = format!("{count} keep-alives");
        let mut deadline = Instant::now() + WAIT;
        while self.keepalives < count {
            let had = self.keepalives;
            if let Err(status) = self.next(deadline, &what).await {
                panic!("ended with {} of {what}: {status:?}", self.seen());
            }
            if self.keepalives > had {
                deadline = Instant::now() + WAIT;
            }
        }
    }

    /// Until the call ends (within `WAIT`): its status.
    pub async fn wait_end(&mut self) -> Status {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Err(status) = self.next(deadline, "the call to end").await {
                return status;
            }
        }
    }

    /// What arrived so far, for failure messages: the entries' seqs as runs, the keep-alives.
    pub fn seen(&self) -> String {
        format!(
            "{} entries (seqs {}) and {} keep-alives",
            self.entries.len(),
            runs(&self.seqs()),
            self.keepalives
        )
    }

    pub fn seqs(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.seq).collect()
    }
}

/// `seqs` as consecutive runs, `[]`, or like `[1..=300, 302]` (a gap shows at a glance).
pub fn runs(seqs: &[u64]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < seqs.len() {
        let mut j = i;
        while j + 1 < seqs.len() && seqs[j + 1] == seqs[j] + 1 {
            j += 1;
        }
        runs.push(if i == j {
            seqs[i].to_string()
        } else {
            format!("{}..={}", seqs[i], seqs[j])
        });
        i = j + 1;
    }
    format!("[{}]", runs.join(", "))
}

/// `future`, or a panic naming `what` was awaited if it takes longer than `WAIT`.
pub async fn within<F: Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(WAIT, future).await {
        Ok(output) => output,
        Err(_) => panic!("waited {WAIT:?} for {what}"),
    }
}

/// The next answer of a response stream (at most `WAIT`).
pub async fn next_answer<T>(answers: &mut Streaming<T>) -> Result<Option<T>, Status> {
    within("the next answer of the call", answers.message()).await
}

/// Sends `batches` on one PublishBatches call; every answer, as [`all_answers`].
pub async fn publish_batches(
    client: &mut RelayClient<Channel>,
    batches: Vec<pb::PublishBatchRequest>,
) -> Vec<pb::PublishBatchResponse> {
    let mut answers = client
        .publish_batches(tokio_stream::iter(batches))
        .await
        .unwrap()
        .into_inner();
    all_answers(&mut answers).await
}

/// Every answer of a response stream until it ends OK; panics on an error status, or when
/// nothing came for `WAIT`, saying how many answers came.
pub async fn all_answers<T>(answers: &mut Streaming<T>) -> Vec<T> {
    let mut got = Vec::new();
    loop {
        match tokio::time::timeout(WAIT, answers.message()).await {
            Ok(Ok(Some(answer))) => got.push(answer),
            Ok(Ok(None)) => return got,
            Ok(Err(status)) => panic!("the call failed after {} answers: {status:?}", got.len()),
            Err(_) => panic!(
                "waited for the call to end, nothing new for {WAIT:?}; it had {} answers",
                got.len()
            ),
        }
    }
}

/// Tokens `account.key`, or `account.key.ttl_ms` (expiring), anything else refused. A key
/// `id+p1+p2..` carries channel patterns (`~` standing for `*`, which no token may hold):
/// `alice.k1+acme/ops/~` is key `k1` of alice, restricted to `acme/ops/*`; `alice.k1+` to none.
pub struct FakeVerify;

/// The key id and channel patterns of a [`FakeVerify`] token's key part.
fn key_and_channels(key: &str) -> (&str, Option<Arc<ChannelPatterns>>) {
    let Some((id, patterns)) = key.split_once('+') else {
        return (key, None);
    };
    let patterns: Vec<String> = patterns
        .split('+')
        .filter(|p| !p.is_empty())
        .map(|p| p.replace('~', "*"))
        .collect();
    (
        id,
        Some(Arc::new(ChannelPatterns::parse(&patterns).unwrap())),
    )
}

impl Verify for FakeVerify {
    fn verify(
        &self,
        token: String,
        _peer: String,
    ) -> Pin<Box<dyn Future<Output = Result<Principal, RelayError>> + Send>> {
        Box::pin(async move {
            let parts: Vec<&str> = token.split('.').collect();
            let (account, key, ttl) = match parts[..] {
                [account, key] => (account, key, None),
                [account, key, ms] => match ms.parse::<u64>() {
                    Ok(ms) => (account, key, Some(Duration::from_millis(ms))),
                    Err(_) => return Err(RelayError::Unauthenticated("invalid token".into())),
                },
                _ => return Err(RelayError::Unauthenticated("invalid token".into())),
            };
            let (key, channels) = key_and_channels(key);
            Ok(Principal {
                account_id: account.to_owned(),
                key_id: key.to_owned(),
                expires_at: ttl.map(|ttl| SystemTime::now() + ttl),
                channels,
            })
        })
    }
}

/// The call was refused with `code` and exactly `message`.
#[track_caller]
pub fn assert_status(status: &Status, code: Code, message: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(status.message(), message);
}

pub fn trailer(status: &Status, name: &str) -> Option<String> {
    status
        .metadata()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

// --- members ----------------------------------------------------------------------------------

/// The account a [`FakeVerify`] token names.
pub fn account_of(token: &str) -> &str {
    token.split('.').next().unwrap()
}

/// An MLS member as the SDK is one: a static-mls engine in a directory of its own, calling the
/// relay for an account (the one its token names, or "" when anonymous). Engine calls block
/// for a moment (a SQLite transaction): fine on the tests' multi-threaded runtimes.
pub struct Member {
    pub engine: Engine,
    pub name: String,
    /// The account its calls act for ("" when anonymous).
    pub account: String,
    pub token: Option<String>,
    _dir: TempDir,
}

impl Member {
    /// A member calling without a token (the account "").
    pub fn anonymous(name: &str) -> Member {
        Member::open(name, None)
    }

    /// A member calling with `token` (a [`FakeVerify`] token: `account.key`).
    pub fn with_token(name: &str, token: &str) -> Member {
        Member::open(name, Some(token.to_owned()))
    }

    fn open(name: &str, token: Option<String>) -> Member {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), name.as_bytes()).unwrap();
        Member {
            engine,
            name: name.to_owned(),
            account: token.as_deref().map(account_of).unwrap_or("").to_owned(),
            token,
            _dir: dir,
        }
    }

    /// `message` as this member sends it (with its token, if it has one).
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        match &self.token {
            Some(token) => authed(message, token),
            None => tonic::Request::new(message),
        }
    }

    /// Creates the group of `channel` in the engine: the CreateChannel request for it.
    pub fn create_request(&self, channel: &str) -> pb::CreateChannelRequest {
        self.engine.create_group(channel).unwrap();
        let state = self.engine.public_state(channel).unwrap();
        pb::CreateChannelRequest {
            channel: channel.to_owned(),
            group_info: state.group_info.into(),
            ratchet_tree: state.ratchet_tree.into(),
            binding: Some(self.binding(channel)),
        }
    }

    /// Creates `channel` (its group here, then on the relay); panics if the relay refuses.
    pub async fn create(&self, client: &mut RelayClient<Channel>, channel: &str) {
        let created = self.try_create(client, channel).await.unwrap();
        assert_eq!((created.channel.as_str(), created.epoch), (channel, 0));
    }

    pub async fn try_create(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
    ) -> Result<pb::CreateChannelResponse, Status> {
        let request = self.create_request(channel);
        client
            .create_channel(self.request(request))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Our leaf's binding to our account.
    pub fn binding(&self, channel: &str) -> pb::LeafBinding {
        self.binding_for(channel, &self.account)
    }

    /// Our leaf's binding to `account`.
    pub fn binding_for(&self, channel: &str, account: &str) -> pb::LeafBinding {
        let binding = self.engine.leaf_binding(channel, account).unwrap();
        pb::LeafBinding {
            leaf_index: binding.leaf_index,
            signature: binding.signature.into(),
        }
    }

    /// BindLeaf of `binding`, sent as this member.
    pub async fn send_binding(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
        binding: pb::LeafBinding,
    ) -> Result<pb::BindLeafResponse, Status> {
        let request = pb::BindLeafRequest {
            channel: channel.to_owned(),
            binding: Some(binding),
        };
        client
            .bind_leaf(self.request(request))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Binds our leaf to our account.
    pub async fn bind(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
    ) -> Result<pb::BindLeafResponse, Status> {
        self.send_binding(client, channel, self.binding(channel))
            .await
    }

    pub fn key_package(&self) -> Vec<u8> {
        self.engine.generate_key_package().unwrap()
    }

    /// Joins `channel` from `welcome` and binds our leaf (as the SDK does); panics on a refusal.
    pub async fn join(&self, client: &mut RelayClient<Channel>, channel: &str, welcome: &[u8]) {
        self.engine.join_group(channel, welcome).unwrap();
        self.bind(client, channel).await.unwrap();
    }

    /// Adds `joiners` in one commit (with its Welcome), published and merged; each joiner joins
    /// and binds. The relay's answer, the commit (for the other members to apply) and the
    /// Welcome.
    pub async fn add(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
        joiners: &[&Member],
    ) -> (pb::PublishResponse, Bytes, Bytes) {
        let added = self.add_unjoined(client, channel, joiners).await;
        for joiner in joiners {
            joiner.join(client, channel, &added.2).await;
        }
        added
    }

    /// [`Member::add`] without the joins: the commit and its Welcome published and merged;
    /// (answer, commit, Welcome).
    pub async fn add_unjoined(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
        joiners: &[&Member],
    ) -> (pb::PublishResponse, Bytes, Bytes) {
        let key_packages: Vec<Vec<u8>> = joiners.iter().map(|j| j.key_package()).collect();
        let key_packages: Vec<&[u8]> = key_packages.iter().map(Vec::as_slice).collect();
        let added = self.engine.add_members(channel, &key_packages).unwrap();
        let commit = Bytes::from(added.commit);
        let request = pb::PublishRequest {
            welcome: added.welcome.clone().into(),
            ..request(channel, commit.clone())
        };
        let answer = client
            .publish(self.request(request))
            .await
            .unwrap()
            .into_inner();
        self.engine.merge_pending_commit(channel).unwrap();
        (answer, commit, added.welcome.into())
    }

    /// A commit of ours at our epoch (a self-update), pending until [`Member::apply`]ed.
    pub fn update(&self, channel: &str) -> Bytes {
        self.engine.self_update(channel).unwrap().into()
    }

    /// A commit removing the member named `name`, pending until applied.
    pub fn remove(&self, channel: &str, name: &str) -> Bytes {
        self.engine
            .remove_member(channel, name.as_bytes())
            .unwrap()
            .into()
    }

    /// Applies a handshake of the log: our own pending commit (merged), another member's
    /// commit (ours, if any, void) or proposal.
    pub fn apply(&self, channel: &str, message: &[u8]) -> Incoming {
        self.engine.process_incoming(channel, message).unwrap()
    }

    pub async fn publish(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
        message: Bytes,
    ) -> Result<pb::PublishResponse, Status> {
        client
            .publish(self.request(request(channel, message)))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Commits (a self-update) and merges it once the relay accepted it; panics on a refusal.
    /// The answer and the commit (for the other members to apply).
    pub async fn commit(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
    ) -> (pb::PublishResponse, Bytes) {
        let commit = self.update(channel);
        let answer = self.publish(client, channel, commit.clone()).await.unwrap();
        self.apply(channel, &commit);
        (answer, commit)
    }

    /// Our leave: a Remove proposal of our own leaf (not published).
    pub fn leave(&self, channel: &str) -> Bytes {
        Bytes::from(self.engine.leave(channel).unwrap())
    }

    /// Commits the proposals we hold, by reference: published on `client`, merged once
    /// accepted.
    pub async fn commit_proposals(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
    ) -> (pb::PublishResponse, Bytes) {
        let commit = Bytes::from(
            self.engine
                .commit_pending_proposals(channel)
                .unwrap()
                .unwrap(),
        );
        let answer = self.publish(client, channel, commit.clone()).await.unwrap();
        self.apply(channel, &commit);
        (answer, commit)
    }

    /// An application message (a real PrivateMessage).
    pub fn encrypt(&self, channel: &str, payload: &[u8]) -> Bytes {
        self.engine.encrypt(channel, payload).unwrap().into()
    }

    pub fn epoch(&self, channel: &str) -> u64 {
        self.engine.epoch(channel).unwrap()
    }

    pub async fn subscribe(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
        after_seq: u64,
    ) -> Result<Subscription, Status> {
        let stream = client
            .subscribe(self.request(subscribe_request(channel, after_seq)))
            .await?;
        Ok(Subscription::of(stream.into_inner()))
    }

    pub async fn list_members(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
    ) -> Result<pb::ListMembersResponse, Status> {
        let request = pb::ListMembersRequest {
            channel: channel.to_owned(),
        };
        client
            .list_members(self.request(request))
            .await
            .map(tonic::Response::into_inner)
    }

    pub async fn fetch_welcome(
        &self,
        client: &mut RelayClient<Channel>,
        channel: &str,
        key: pb::fetch_welcome_request::Key,
    ) -> Result<pb::FetchWelcomeResponse, Status> {
        let request = pb::FetchWelcomeRequest {
            channel: channel.to_owned(),
            key: Some(key),
        };
        client
            .fetch_welcome(self.request(request))
            .await
            .map(tonic::Response::into_inner)
    }
}

/// Creates `channel` by `members[0]`, who adds the others in one commit (they join and bind):
/// everyone at epoch 1, the add at seq 1; its Welcome. With one member: just created (epoch 0,
/// no Welcome).
pub async fn group_of(
    client: &mut RelayClient<Channel>,
    channel: &str,
    members: &[&Member],
) -> Option<Bytes> {
    let (creator, joiners) = members.split_first().unwrap();
    creator.create(client, channel).await;
    if joiners.is_empty() {
        return None;
    }
    let (added, _, welcome) = creator.add(client, channel, joiners).await;
    assert_eq!((added.seq, added.epoch), (1, 1));
    Some(welcome)
}

/// Alice and bob in `channel` (seq 1), alice's message (seq 2), bob removed while offline (seq
/// 3), then dave added (seq 4): he takes bob's leaf index, 1, and binds it. Bob's account may
/// still read seqs 1 to 3 (docs/design.md §5.2).
pub async fn reuse_a_departed_leaf(
    client: &mut RelayClient<Channel>,
    channel: &str,
    alice: &Member,
    bob: &Member,
    dave: &Member,
) {
    group_of(client, channel, &[alice, bob]).await;
    let hello = alice.encrypt(channel, b"before");
    assert_eq!(alice.publish(client, channel, hello).await.unwrap().seq, 2);
    let removal = alice.remove(channel, &bob.name);
    let removed = alice
        .publish(client, channel, removal.clone())
        .await
        .unwrap();
    assert_eq!((removed.seq, removed.epoch), (3, 2));
    alice.apply(channel, &removal);
    let (added, _, _) = alice.add(client, channel, &[dave]).await;
    assert_eq!((added.seq, added.epoch), (4, 3));
    assert_eq!(dave.binding(channel).leaf_index, 1, "dave took bob's leaf");
}

/// Bob's reach after [`reuse_a_departed_leaf`]: seqs 1 to 3, then PERMISSION_DENIED.
pub async fn assert_reads_up_to_its_removal(
    client: &mut RelayClient<Channel>,
    channel: &str,
    bob: &Member,
) {
    let mut bobs = bob.subscribe(client, channel, 0).await.unwrap();
    let status = bobs.wait_end().await;
    assert_eq!(bobs.seqs(), [1, 2, 3], "bob's stream ended with {status:?}");
    assert_status(&status, Code::PermissionDenied, &not_a_member(channel));
}

/// The channel's epoch as its members' list says.
pub async fn epoch_of(client: &mut RelayClient<Channel>, member: &Member, channel: &str) -> u64 {
    member.list_members(client, channel).await.unwrap().epoch
}

/// The KeyPackageRef of a key package (an MLSMessage): what a Welcome names it by.
pub fn key_package_ref(key_package: &[u8]) -> Vec<u8> {
    let MlsMessageBodyIn::KeyPackage(key_package) =
        MlsMessageIn::tls_deserialize_exact(key_package)
            .unwrap()
            .extract()
    else {
        panic!("not a key package");
    };
    let crypto = RustCrypto::default();
    let key_package: KeyPackage = key_package
        .validate(&crypto, ProtocolVersion::Mls10)
        .unwrap();
    key_package.hash_ref(&crypto).unwrap().as_slice().to_vec()
}

/// An MLS client on OpenMLS directly, for what the engine will not do: send handshakes as
/// PrivateMessages, add a second leaf with an identity already in the group, sign a group of
/// its own under a channel's name.
pub struct RawMember {
    provider: OpenMlsRustCrypto,
    signer: SignatureKeyPair,
    credential: CredentialWithKey,
    pub group: Option<MlsGroup>,
}

fn mls_bytes(message: &MlsMessageOut) -> Bytes {
    message.tls_serialize_detached().unwrap().into()
}

impl RawMember {
    pub fn new(identity: &str) -> RawMember {
        let signer = SignatureKeyPair::new(CIPHERSUITE.signature_algorithm()).unwrap();
        let credential = CredentialWithKey {
            credential: BasicCredential::new(identity.as_bytes().to_vec()).into(),
            signature_key: signer.public().into(),
        };
        RawMember {
            provider: OpenMlsRustCrypto::default(),
            signer,
            credential,
            group: None,
        }
    }

    /// A key package (an MLSMessage).
    pub fn key_package(&self) -> Vec<u8> {
        let bundle = KeyPackage::builder()
            .build(
                CIPHERSUITE,
                &self.provider,
                &self.signer,
                self.credential.clone(),
            )
            .unwrap();
        mls_bytes(&MlsMessageOut::from(bundle.key_package().clone())).to_vec()
    }

    /// Joins from `welcome`, sending handshakes as `policy` says.
    pub fn join(&mut self, welcome: &[u8], policy: WireFormatPolicy) {
        let MlsMessageBodyIn::Welcome(welcome) = MlsMessageIn::tls_deserialize_exact(welcome)
            .unwrap()
            .extract()
        else {
            panic!("not a welcome");
        };
        let config = MlsGroupJoinConfig::builder()
            .use_ratchet_tree_extension(true)
            .wire_format_policy(policy)
            .build();
        let group = StagedWelcome::new_from_welcome(&self.provider, &config, welcome, None)
            .unwrap()
            .into_group(&self.provider)
            .unwrap();
        self.group = Some(group);
    }

    /// A group of our own with `channel`'s group id (a look-alike: we are its leaf 0).
    pub fn create_look_alike(&mut self, channel: &str) {
        let group = MlsGroup::builder()
            .with_group_id(GroupId::from_slice(channel.as_bytes()))
            .ciphersuite(CIPHERSUITE)
            .use_ratchet_tree_extension(true)
            .with_wire_format_policy(openmls::prelude::MIXED_PLAINTEXT_WIRE_FORMAT_POLICY)
            .build(&self.provider, &self.signer, self.credential.clone())
            .unwrap();
        self.group = Some(group);
    }

    pub fn epoch(&self) -> u64 {
        self.group.as_ref().unwrap().epoch().as_u64()
    }

    pub fn leaf_index(&self) -> u32 {
        self.group.as_ref().unwrap().own_leaf_index().u32()
    }

    /// A self-update commit, left pending (drop it with [`RawMember::clear`]) or merged here.
    pub fn self_update(&mut self, merge: bool) -> Bytes {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let bundle = group
            .self_update(provider, signer, LeafNodeParameters::default())
            .unwrap();
        if merge {
            group.merge_pending_commit(provider).unwrap();
        }
        mls_bytes(bundle.commit())
    }

    /// Drops our pending commit.
    pub fn clear(&mut self) {
        let storage = self.provider.storage();
        let group = self.group.as_mut().unwrap();
        group.clear_pending_commit(storage).unwrap();
    }

    /// A commit adding `key_packages` (MLSMessages) and its Welcome, left pending.
    pub fn add(&mut self, key_packages: &[&[u8]]) -> (Bytes, Bytes) {
        let crypto = RustCrypto::default();
        let key_packages: Vec<KeyPackage> = key_packages
            .iter()
            .map(|kp| {
                let MlsMessageBodyIn::KeyPackage(kp) =
                    MlsMessageIn::tls_deserialize_exact(kp).unwrap().extract()
                else {
                    panic!("not a key package");
                };
                kp.validate(&crypto, ProtocolVersion::Mls10).unwrap()
            })
            .collect();
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let (commit, welcome, _) = group.add_members(provider, signer, &key_packages).unwrap();
        (mls_bytes(&commit), mls_bytes(&welcome))
    }

    /// A commit removing leaf `leaf`, left pending.
    pub fn remove(&mut self, leaf: u32) -> Bytes {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let (commit, _, _) = group
            .remove_members(provider, signer, &[LeafNodeIndex::new(leaf)])
            .unwrap();
        mls_bytes(&commit)
    }

    /// Processes another member's handshake (merging a commit).
    pub fn receive(&mut self, message: &[u8]) {
        let message = MlsMessageIn::tls_deserialize_exact(message)
            .unwrap()
            .try_into_protocol_message()
            .unwrap();
        let provider = &self.provider;
        let group = self.group.as_mut().unwrap();
        match group
            .process_message(provider, message)
            .unwrap()
            .into_content()
        {
            ProcessedMessageContent::StagedCommitMessage(staged) => {
                group.merge_staged_commit(provider, *staged).unwrap();
            }
            ProcessedMessageContent::ProposalMessage(proposal) => {
                group
                    .store_pending_proposal(provider.storage(), *proposal)
                    .unwrap();
            }
            _ => panic!("not a handshake"),
        }
    }

    /// Our leaf's binding to `account` in `channel` (over our current encryption key).
    pub fn binding(&self, channel: &str, account: &str) -> pb::LeafBinding {
        let group = self.group.as_ref().unwrap();
        let own = group.own_leaf_index();
        let encryption_key = group
            .members()
            .find(|m| m.index == own)
            .unwrap()
            .encryption_key;
        let tbs = leaf_binding_tbs(channel.as_bytes(), account, &encryption_key);
        pb::LeafBinding {
            leaf_index: own.u32(),
            signature: self.signer.sign(&tbs).unwrap().into(),
        }
    }
}

// --- SubscribeMany ------------------------------------------------------------------------------

/// How long a [`Many`] waits for its next response before it fails the test.
pub const MANY_WAIT: Duration = Duration::from_secs(20);

/// A SubscribeMany call: requests sent through `tx`, responses sorted by channel as read.
pub struct Many {
    pub tx: mpsc::UnboundedSender<pb::SubscribeManyRequest>,
    pub stream: Streaming<pb::SubscribeManyResponse>,
    pub entries: HashMap<String, Vec<pb::Entry>>,
    /// Answers to adds, per channel: Ok(head_seq) for a live follow, Err for `ended`.
    pub answers: HashMap<String, Vec<Result<u64, pb::Refusal>>>,
    /// The channel of every `entries` response, in order.
    pub order: Vec<String>,
    pub keepalives: usize,
}

impl Many {
    pub async fn open(client: &mut RelayClient<Channel>, token: Option<&str>) -> Many {
        let (tx, rx) = mpsc::unbounded_channel();
        let requests = UnboundedReceiverStream::new(rx);
        let stream = match token {
            Some(token) => client.subscribe_many(authed(requests, token)).await,
            None => client.subscribe_many(requests).await,
        };
        Many {
            tx,
            stream: stream.unwrap().into_inner(),
            entries: HashMap::new(),
            answers: HashMap::new(),
            order: Vec::new(),
            keepalives: 0,
        }
    }

    pub fn send(&self, op: pb::subscribe_many_request::Op) {
        self.tx
            .send(pb::SubscribeManyRequest { op: Some(op) })
            .unwrap();
    }

    /// Sends `op` unless the call has ended and no longer reads its requests: false then.
    pub fn offer(&self, op: pb::subscribe_many_request::Op) -> bool {
        self.tx
            .send(pb::SubscribeManyRequest { op: Some(op) })
            .is_ok()
    }

    pub fn add(&self, request: pb::SubscribeRequest) {
        self.send(pb::subscribe_many_request::Op::Add(request));
    }

    pub fn remove(&self, channel: &str) {
        self.send(pb::subscribe_many_request::Op::Remove(channel.to_owned()));
    }

    /// The next response; Err: the call ended (with its status, or OK as `Code::Ok`).
    pub async fn next(&mut self) -> Result<(), Status> {
        use pb::subscribe_many_response::Item;
        let response = tokio::time::timeout(MANY_WAIT, self.stream.message())
            .await
            .expect("the stream went silent")?
            .ok_or_else(|| Status::new(Code::Ok, "ended"))?;
        let channel = response.channel;
        match response.item {
            Some(Item::Entries(batch)) => {
                assert!(!batch.entries.is_empty());
                self.order.push(channel.clone());
                self.entries
                    .entry(channel)
                    .or_default()
                    .extend(batch.entries);
            }
            Some(Item::KeepAlive(_)) if channel.is_empty() => self.keepalives += 1,
            Some(Item::KeepAlive(k)) => self
                .answers
                .entry(channel)
                .or_default()
                .push(Ok(k.head_seq)),
            Some(Item::Ended(refusal)) => {
                self.answers.entry(channel).or_default().push(Err(refusal))
            }
            None => panic!("a response without an item"),
        }
        Ok(())
    }

    pub async fn until(&mut self, mut done: impl FnMut(&Many) -> bool) {
        while !done(self) {
            if let Err(status) = self.next().await {
                panic!("the stream ended: {status:?}");
            }
        }
    }

    /// The answer to the `n`th add of `channel` (from 1).
    pub async fn answer(&mut self, channel: &str, n: usize) -> Result<u64, pb::Refusal> {
        self.until(|m| m.answers.get(channel).map_or(0, Vec::len) >= n)
            .await;
        self.answers[channel][n - 1].clone()
    }

    pub async fn live(&mut self, channel: &str) -> u64 {
        self.answer(channel, 1).await.unwrap()
    }

    pub async fn wait_for(&mut self, channel: &str, count: usize) -> Vec<u64> {
        self.until(|m| m.seqs(channel).len() >= count).await;
        self.seqs(channel)
    }

    pub fn seqs(&self, channel: &str) -> Vec<u64> {
        self.entries
            .get(channel)
            .map_or_else(Vec::new, |e| e.iter().map(|e| e.seq).collect())
    }

    pub async fn wait_end(&mut self) -> Status {
        loop {
            if let Err(status) = self.next().await {
                return status;
            }
        }
    }
}

#[track_caller]
pub fn assert_refusal(answer: Result<u64, pb::Refusal>, code: Code, message: &str) {
    let refusal = answer.unwrap_err();
    assert_eq!(
        (Code::from(refusal.code as i32), refusal.message.as_str()),
        (code, message)
    );
}

/// What the relay says to an account with no bound leaf in `channel`.
pub fn not_a_member(channel: &str) -> String {
    format!(
        "this account is not a member of channel '{channel}' (no leaf of its group is bound to \
         it)"
    )
}

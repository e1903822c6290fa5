//! What the service tests share: a relay on 127.0.0.1:0 over a fresh SQLite database, a
//! tonic client, hand-built MLS messages (the framing of `tests/relay/mls_vectors.py`), a
//! fake token verifier.
#![allow(clippy::unwrap_used, dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use static_relay::pb::relay_client::RelayClient;
use static_relay::pb::{self, subscribe_response::Item};
use static_relay::{Principal, RelayConfig, RelayError, RelayServer, Verify};
use tempfile::TempDir;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

pub const CHANNEL: &str = "acme/agents/chat";
pub const APPLICATION: u8 = 1;
pub const PROPOSAL: u8 = 2;
pub const COMMIT: u8 = 3;
/// How long any wait of these helpers lasts before it fails the test (no wait is unbounded: a
/// relay that skips an entry or never answers fails the test, it does not hang it).
pub const WAIT: Duration = Duration::from_secs(10);

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
        let schema = include_str!("../../../../static/store/migrations/0002_relay.sqlite.sql");
        rusqlite::Connection::open(&db_path)
            .unwrap()
            .execute_batch(schema)
            .unwrap();
        let mut config = RelayConfig::new(db_path.as_path());
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

pub fn commit(group: &str, epoch: u64, salt: &[u8]) -> Bytes {
    let mut body = b"commit".to_vec();
    body.extend_from_slice(salt);
    public_message(group, epoch, COMMIT, &body)
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

pub async fn create(client: &mut RelayClient<Channel>, channel: &str) {
    let created = client
        .create_channel(pb::CreateChannelRequest {
            channel: channel.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((created.channel.as_str(), created.epoch), (channel, 0));
}

/// `create`, as the holder of `token`.
pub async fn create_as(client: &mut RelayClient<Channel>, channel: &str, token: &str) {
    let request = pb::CreateChannelRequest {
        channel: channel.to_owned(),
    };
    client.create_channel(authed(request, token)).await.unwrap();
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

/// Tokens `account.key`, or `account.key.ttl_ms` (expiring), anything else refused.
pub struct FakeVerify;

impl Verify for FakeVerify {
    fn verify(
        &self,
        token: String,
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
            Ok(Principal {
                account_id: account.to_owned(),
                key_id: key.to_owned(),
                expires_at: ttl.map(|ttl| SystemTime::now() + ttl),
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

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
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

pub const CHANNEL: &str = "acme/agents/chat";
pub const APPLICATION: u8 = 1;
pub const PROPOSAL: u8 = 2;
pub const COMMIT: u8 = 3;
const WAIT: Duration = Duration::from_secs(10);

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

    /// The next response; Err: the call ended (with its status, or OK as `Code::Ok`).
    async fn next(&mut self) -> Result<(), Status> {
        let response = tokio::time::timeout(WAIT, self.stream.message())
            .await
            .expect("the subscription went silent")?;
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

    /// Until `count` entries arrived in all.
    pub async fn wait_for(&mut self, count: usize) -> &[pb::Entry] {
        while self.entries.len() < count {
            if let Err(status) = self.next().await {
                panic!(
                    "ended after {} of {count} entries: {status:?}",
                    self.entries.len()
                );
            }
        }
        &self.entries
    }

    pub async fn wait_keepalives(&mut self, count: usize) {
        while self.keepalives < count {
            self.next().await.unwrap();
        }
    }

    /// Until the call ends: its status.
    pub async fn wait_end(&mut self) -> Status {
        loop {
            if let Err(status) = self.next().await {
                return status;
            }
        }
    }

    pub fn seqs(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.seq).collect()
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

//! Who calls the relay, and keeping live streams honest about it (revocation, expiry, shutdown).
//!
//! Token checks themselves belong to the server's authority (Python: `static.auth`), reached
//! through [`Verify`] once per call, never per message. Every streaming call (Subscribe,
//! SubscribeMany, PublishStream, PublishBatches) holds a [`StreamGuard`]: the service cannot
//! build a streaming response without one (`service::Driven::new` takes it), so a new RPC
//! cannot forget it. The server ends guarded calls by key ([`Authenticator::end_streams_of_key`],
//! driven by the revocation checks) or all at once (shutdown), and a guard ends by itself when
//! its token expires. The registry of guards also bounds the streams one account holds
//! (`--relay-max-streams-per-account`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;
use tonic::metadata::MetadataMap;

use crate::error::{RelayError, Result};
use crate::lockout::{self, address_of, Lockouts};
use static_proto::patterns::ChannelPatterns;

/// The account of anonymous callers (`--allow-anonymous`): they are one principal.
pub const ANONYMOUS_ACCOUNT: &str = "";
const MAX_HEADER: usize = 8192;

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub account_id: String,
    pub key_id: String,
    pub expires_at: Option<SystemTime>,
    /// The channels the token's key may name (its `channels` claim); None: every channel.
    pub channels: Option<Arc<ChannelPatterns>>,
}

/// Checks a bearer token: signature, audience, expiry and that the key behind it is active.
/// Refusals are [`RelayError::Unauthenticated`] (or `Unavailable` when the store is down, or
/// `ResourceExhausted` when `peer`, the caller's `ip:port`, failed too often lately).
pub trait Verify: Send + Sync + 'static {
    fn verify(
        &self,
        token: String,
        peer: String,
    ) -> Pin<Box<dyn Future<Output = Result<Principal>> + Send>>;
}

/// An authenticated (or, with `--allow-anonymous`, anonymous) caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The principal: the account id, or "" for anonymous callers.
    pub account: Arc<str>,
    /// Whom rate limits count against: `key:<id>`, or `anonymous:<address>` (the peer's
    /// address, an IPv6 peer's /64: not its port, which a new connection changes; measured
    /// at 9b2be07, per connection: 450 publishes got through in one burst against 50/s).
    pub agent: String,
    pub key_id: Option<String>,
    pub expires_at: Option<SystemTime>,
    /// The channels this caller may name (its key's patterns); None: every channel (and
    /// anonymous callers).
    pub channels: Option<Arc<ChannelPatterns>>,
}

impl Caller {
    /// PERMISSION_DENIED, naming the patterns, unless the caller's key reaches `channel`.
    /// Costs at most 100 pattern comparisons: no store read, no signature, so every call
    /// naming a channel makes it first, right after the name's shape.
    pub fn may_name(&self, channel: &str) -> Result<()> {
        match &self.channels {
            Some(patterns) if !patterns.matches(channel) => {
                Err(RelayError::PermissionDenied(patterns.refusal(channel)))
            }
            _ => Ok(()),
        }
    }
}

/// The token of the `authorization` metadata, None when absent; checks the header value
/// (the rules and texts of `tests/relay/test_auth.py`).
pub fn bearer_token(metadata: &MetadataMap) -> Result<Option<String>> {
    let values: Vec<_> = metadata.get_all("authorization").iter().collect();
    let value = match values.as_slice() {
        [] => return Ok(None),
        [one] => *one,
        _ => return Err(unauthenticated("more than one authorization header")),
    };
    let bytes = value.as_bytes();
    if bytes.len() > MAX_HEADER {
        return Err(unauthenticated("malformed authorization header"));
    }
    if !bytes
        .iter()
        .all(|b| (0x20..=0x7e).contains(b) || *b == b'\t')
    {
        return Err(unauthenticated(
            "illegal characters in the authorization header",
        ));
    }
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim_matches(|c: char| c.is_ascii_whitespace());
    let expected = || unauthenticated("expected 'authorization: Bearer <token>'");
    if text.len() < 7 || !text[..7].eq_ignore_ascii_case("bearer ") {
        return Err(expected());
    }
    let token = &text[7..];
    let body = token.trim_end_matches('=');
    let token_chars = |c: char| c.is_ascii_alphanumeric() || "-_.~+/".contains(c);
    if body.is_empty() || !body.chars().all(token_chars) {
        return Err(expected());
    }
    Ok(Some(token.to_owned()))
}

fn unauthenticated(message: &str) -> RelayError {
    RelayError::Unauthenticated(message.to_owned())
}

struct Registered {
    account: Arc<str>,
    key_id: Option<String>,
    end: watch::Sender<Option<RelayError>>,
}

/// The live guards, and how many each account holds.
#[derive(Default)]
struct Registry {
    streams: HashMap<u64, Registered>,
    per_account: HashMap<Arc<str>, usize>,
}

/// Authenticates calls through the injected [`Verify`]; keeps the registry of live streams.
pub struct Authenticator {
    verifier: Option<Arc<dyn Verify>>,
    allow_anonymous: bool,
    next_id: AtomicU64,
    /// Streams one account may hold at once (all its keys, all connections).
    max_streams_per_account: usize,
    registry: Mutex<Registry>,
    /// Addresses the verifier locked out lately: refused without asking it again.
    lockouts: Lockouts,
}

impl Authenticator {
    pub fn new(
        verifier: Option<Arc<dyn Verify>>,
        allow_anonymous: bool,
        max_streams_per_account: usize,
    ) -> Arc<Self> {
        Arc::new(Authenticator {
            verifier,
            allow_anonymous,
            next_id: AtomicU64::new(0),
            max_streams_per_account,
            registry: Mutex::new(Registry::default()),
            lockouts: Lockouts::default(),
        })
    }

    /// The caller behind a call's metadata.
    pub async fn authenticate(&self, metadata: &MetadataMap, peer: &str) -> Result<Caller> {
        let Some(token) = bearer_token(metadata)? else {
            if self.allow_anonymous {
                return Ok(Caller {
                    account: Arc::from(ANONYMOUS_ACCOUNT),
                    agent: format!("anonymous:{}", address_of(peer)),
                    key_id: None,
                    expires_at: None,
                    channels: None,
                });
            }
            return Err(unauthenticated(
                "missing authorization metadata ('Bearer <token>')",
            ));
        };
        let Some(verifier) = &self.verifier else {
            return Err(unauthenticated(
                "this relay has no token verifier: tokens cannot be checked",
            ));
        };
        // A locked-out address is refused here, before its token crosses into the verifier.
        let address = address_of(peer);
        let digest = lockout::digest(&token);
        if let Some(refusal) = self.lockouts.check(&address, &digest, Instant::now()) {
            return Err(refusal);
        }
        let verified = verifier.verify(token, peer.to_owned()).await;
        self.lockouts.answered(
            &address,
            &digest,
            &verified.as_ref().map(|_| ()),
            Instant::now(),
        );
        let principal = verified?;
        if let Some(expires_at) = principal.expires_at {
            if expires_at <= SystemTime::now() {
                return Err(unauthenticated("token expired"));
            }
        }
        Ok(Caller {
            account: Arc::from(principal.account_id),
            agent: format!("key:{}", principal.key_id),
            key_id: Some(principal.key_id),
            expires_at: principal.expires_at,
            channels: principal.channels,
        })
    }

    /// Whether calls without a token are served (anonymous scope).
    pub fn allows_anonymous(&self) -> bool {
        self.allow_anonymous
    }

    /// The guard of a streaming call of `caller`: ended on revocation, expiry or shutdown.
    /// RESOURCE_EXHAUSTED when the caller's account holds `--relay-max-streams-per-account`
    /// streams already (counted and taken under one lock: concurrent callers cannot overshoot).
    pub fn watch(self: &Arc<Self>, caller: &Caller) -> Result<StreamGuard> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (end, ended) = watch::channel(None);
        {
            let mut registry = self.lock();
            let held = registry
                .per_account
                .entry(Arc::clone(&caller.account))
                .or_insert(0);
            if *held >= self.max_streams_per_account {
                return Err(RelayError::resource_exhausted(format!(
                    "this account holds {} relay streams already (the relay's limit per \
                     account): end one first",
                    self.max_streams_per_account
                )));
            }
            *held += 1;
            registry.streams.insert(
                id,
                Registered {
                    account: Arc::clone(&caller.account),
                    key_id: caller.key_id.clone(),
                    end,
                },
            );
        }
        let deadline = caller.expires_at.map(|at| {
            let left = at
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            tokio::time::Instant::now() + left
        });
        Ok(StreamGuard {
            id,
            ended,
            deadline,
            registry: Arc::clone(self),
        })
    }

    /// The streams `account` holds now.
    pub fn streams_of(&self, account: &str) -> usize {
        self.lock().per_account.get(account).copied().unwrap_or(0)
    }

    /// The API keys behind live streams (the revocation checks look at these).
    pub fn live_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .lock()
            .streams
            .values()
            .filter_map(|r| r.key_id.clone())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// End every live stream of `key_id` with `reason`; returns how many there were.
    pub fn end_streams_of_key(&self, key_id: &str, reason: &RelayError) -> usize {
        let registry = self.lock();
        let mut ended = 0;
        for r in registry
            .streams
            .values()
            .filter(|r| r.key_id.as_deref() == Some(key_id))
        {
            r.end.send_replace(Some(reason.clone()));
            ended += 1;
        }
        ended
    }

    /// End every live stream with `reason` (shutdown).
    pub fn end_all(&self, reason: &RelayError) {
        for r in self.lock().streams.values() {
            r.end.send_replace(Some(reason.clone()));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        // The maps stay consistent even if a holder panicked: each operation is one call.
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A live stream's watch; unregisters itself when dropped.
pub struct StreamGuard {
    id: u64,
    ended: watch::Receiver<Option<RelayError>>,
    deadline: Option<tokio::time::Instant>,
    registry: Arc<Authenticator>,
}

impl StreamGuard {
    /// Resolves with the reason once the stream must end: revoked key, shutdown, or expiry
    /// (`token expired`). Cancel-safe: use it in `select!` beside the stream's work.
    pub async fn ended(&mut self) -> RelayError {
        let expiry = async {
            match self.deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let ended = &mut self.ended;
        let ending = async {
            // The watch's read guard is dropped before any further await (the future must
            // be Send: streams run it on the runtime's workers).
            let reason = match ended.wait_for(Option::is_some).await {
                Ok(reason) => Some(reason.clone().unwrap_or(RelayError::Internal)),
                Err(_) => None,
            };
            match reason {
                Some(reason) => reason,
                // The registry is gone with the relay: nothing ends this stream but expiry.
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            reason = ending => reason,
            () = expiry => unauthenticated("token expired"),
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut registry = self.registry.lock();
        let Some(gone) = registry.streams.remove(&self.id) else {
            return;
        };
        if let Some(held) = registry.per_account.get_mut(&gone.account) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                registry.per_account.remove(&gone.account);
            }
        }
    }
}

/// What rate limits count an anonymous caller by: the address of `peer` (`ip:port`), an IPv6
/// peer's /64 (as the connection caps and the HTTP port's limits count it); `peer` itself when
/// it is no socket address.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn metadata(values: &[&str]) -> MetadataMap {
        let mut map = MetadataMap::new();
        for v in values {
            map.append("authorization", v.parse().unwrap());
        }
        map
    }

    #[test]
    fn bearer_tokens_are_read_and_checked() {
        assert_eq!(bearer_token(&MetadataMap::new()).unwrap(), None);
        assert_eq!(
            bearer_token(&metadata(&["Bearer abc.def-_"]))
                .unwrap()
                .as_deref(),
            Some("abc.def-_")
        );
        assert_eq!(
            bearer_token(&metadata(&["bearer x=="])).unwrap().as_deref(),
            Some("x==")
        );
        for bad in ["Basic abc", "Bearer", "Bearer a b", "Bearer =="] {
            assert_eq!(
                bearer_token(&metadata(&[bad])).unwrap_err().to_string(),
                "expected 'authorization: Bearer <token>'",
                "{bad}"
            );
        }
        assert_eq!(
            bearer_token(&metadata(&["Bearer a", "Bearer b"]))
                .unwrap_err()
                .to_string(),
            "more than one authorization header"
        );
    }
}

//! Relay tokens: where they come from ([`TokenProvider`]) and the cached one ([`Tokens`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sync::lock;

/// A bearer token for the relay and its lifetime.
#[derive(Debug, Clone)]
pub struct Token {
    pub value: String,
    pub expires_in: Duration,
}

/// Why a [`TokenProvider`] has no token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The key was refused (invalid, revoked): final.
    #[error("{0}")]
    Refused(String),
    /// The token endpoint could not be reached or answered oddly: retried.
    #[error("{0}")]
    Unavailable(String),
}

impl From<TokenError> for Error {
    fn from(e: TokenError) -> Self {
        match e {
            TokenError::Refused(why) => Error::Auth(why),
            TokenError::Unavailable(why) => Error::Unreachable(why),
        }
    }
}

/// Supplies relay tokens (the Python layer exchanges the API key at `POST /v1/tokens`).
/// `fetch` blocks; it is called from a blocking thread.
pub trait TokenProvider: Send + Sync + 'static {
    fn fetch(&self) -> Result<Token, TokenError>;
}

struct CachedToken {
    value: String,
    refresh_at: Instant,
}

pub(crate) struct Tokens {
    provider: Option<Arc<dyn TokenProvider>>,
    cached: Mutex<Option<CachedToken>>,
    refreshing: tokio::sync::Mutex<()>,
}

impl Tokens {
    pub(crate) fn new(provider: Option<Arc<dyn TokenProvider>>, initial: Option<Token>) -> Self {
        Self {
            provider,
            cached: Mutex::new(initial.map(Self::cache)),
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    fn cache(token: Token) -> CachedToken {
        // Refresh ahead of expiry: 30 s early, or 10% of the lifetime for short-lived tokens.
        let margin = std::cmp::min(Duration::from_secs(30), token.expires_in / 10);
        CachedToken {
            value: token.value,
            refresh_at: Instant::now() + token.expires_in.saturating_sub(margin),
        }
    }

    fn current(&self) -> Option<String> {
        lock(&self.cached)
            .as_ref()
            .filter(|t| Instant::now() < t.refresh_at)
            .map(|t| t.value.clone())
    }

    /// The token to send, refreshed if it is close to expiry; `None` for anonymous access.
    pub(crate) async fn get(&self) -> Result<Option<String>> {
        let Some(provider) = &self.provider else {
            return Ok(None);
        };
        if let Some(value) = self.current() {
            return Ok(Some(value));
        }
        let _one_at_a_time = self.refreshing.lock().await;
        if let Some(value) = self.current() {
            return Ok(Some(value));
        }
        let provider = Arc::clone(provider);
        let token = tokio::task::spawn_blocking(move || provider.fetch())
            .await
            .map_err(|e| Error::task("the token refresh failed", e))??;
        let value = token.value.clone();
        *lock(&self.cached) = Some(Self::cache(token));
        Ok(Some(value))
    }

    /// The relay refused `token`: the next [`Tokens::get`] fetches a new one.
    pub(crate) fn invalidate(&self, token: Option<&str>) {
        let mut cached = lock(&self.cached);
        if cached.as_ref().map(|t| t.value.as_str()) == token {
            *cached = None;
        }
    }

    pub(crate) fn anonymous(&self) -> bool {
        self.provider.is_none()
    }

    /// The account the relay knows us as: the `sub` claim of our token, "" when anonymous.
    /// (The token is the relay's to verify; we only read whom it names.)
    pub(crate) async fn account(&self) -> Result<String> {
        match self.get().await? {
            None => Ok(String::new()),
            Some(token) => account_of(&token),
        }
    }
}

impl Tokens {
    /// The API key our token was minted from (its `key_id` claim), None when anonymous or
    /// when the token names none.
    pub(crate) async fn key_id(&self) -> Result<Option<String>> {
        Ok(self.get().await?.and_then(|token| claim(&token, "key_id")))
    }
}

/// A string claim of a JWT (read, not verified).
fn claim(token: &str, name: &str) -> Option<String> {
    use base64::Engine as _;
    let payload = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    claims.get(name)?.as_str().map(str::to_owned)
}

/// The `sub` claim of a JWT (read, not verified).
fn account_of(token: &str) -> Result<String> {
    use base64::Engine as _;
    let invalid = || Error::Auth("the relay token is not a JWT naming an account (sub)".into());
    let payload = token.split('.').nth(1).ok_or_else(invalid)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| invalid())?;
    let claims: serde_json::Value = serde_json::from_slice(&json).map_err(|_| invalid())?;
    claims
        .get("sub")
        .and_then(|sub| sub.as_str())
        .map(str::to_owned)
        .ok_or_else(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_account_is_the_tokens_subject() {
        // {"alg":"EdDSA"}.{"sub":"acct-1","aud":"static-relay"}.sig
        let token = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJhY2N0LTEiLCJhdWQiOiJzdGF0aWMtcmVsYXkifQ.c2ln";
        assert_eq!(account_of(token).ok().as_deref(), Some("acct-1"));
        for bad in [
            "",
            "a.b",
            "a.!!!.c",
            "eyJhbGciOiJFZERTQSJ9.eyJhdWQiOiJ4In0.c2ln",
        ] {
            assert!(matches!(account_of(bad), Err(Error::Auth(_))), "{bad}");
        }
    }
}

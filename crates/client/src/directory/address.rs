//! An agent's address: its account and identity, printed `static:<account>:<identity>` with the
//! identity in unpadded base64url (`proto/relay.proto`, the directory's preamble).

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use static_proto::directory::{ADDRESS_SCHEME, MAX_ACCOUNT_BYTES, MAX_IDENTITY_BYTES};

/// Why a string is not an address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid address {text:?}: {why} (expected {ADDRESS_SCHEME}:<account>:<identity in base64url>)"
)]
pub struct AddressError {
    text: String,
    why: &'static str,
}

/// Where invitations to an agent go: the account its token names ("" for an anonymous
/// client) and its identity (its MLS credential).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Address {
    pub account: String,
    pub identity: Vec<u8>,
}

impl Address {
    /// Parses the printed form. The account may not contain `:` (account ids are UUIDs);
    /// whitespace around the address is ignored.
    pub fn parse(text: &str) -> Result<Self, AddressError> {
        let fail = |why| AddressError {
            // Bounded: an error message never carries a huge input.
            text: text.chars().take(128).collect(),
            why,
        };
        let trimmed = text.trim();
        let rest = trimmed
            .strip_prefix(ADDRESS_SCHEME)
            .and_then(|r| r.strip_prefix(':'))
            .ok_or_else(|| fail("it does not start with the scheme"))?;
        let (account, encoded) = rest
            .split_once(':')
            .ok_or_else(|| fail("it has no identity"))?;
        if account.len() > MAX_ACCOUNT_BYTES {
            return Err(fail("its account is too long"));
        }
        let identity = URL_SAFE_NO_PAD
            .decode(encoded)
            .map_err(|_| fail("its identity is not base64url"))?;
        if identity.is_empty() || identity.len() > MAX_IDENTITY_BYTES {
            return Err(fail("its identity is empty or longer than 255 bytes"));
        }
        Ok(Self {
            account: account.to_owned(),
            identity,
        })
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{ADDRESS_SCHEME}:{}:{}",
            self.account,
            URL_SAFE_NO_PAD.encode(&self.identity)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_prints_and_parses_back() {
        let address = Address {
            account: "0b6f4c2e-7a1d-4e55-9c1b-3f1e2d4c5b6a".into(),
            identity: b"agent/\xff\x00b".to_vec(),
        };
        let text = address.to_string();
        assert!(text.starts_with("static:0b6f4c2e-7a1d-4e55-9c1b-3f1e2d4c5b6a:"));
        assert_eq!(Address::parse(&text), Ok(address.clone()));
        assert_eq!(Address::parse(&format!(" {text}\n")), Ok(address));
        let anonymous = Address {
            account: String::new(),
            identity: b"bob".to_vec(),
        };
        assert_eq!(anonymous.to_string(), "static::Ym9i");
        assert_eq!(Address::parse("static::Ym9i"), Ok(anonymous));
    }

    #[test]
    fn malformed_addresses_are_refused() {
        for text in [
            "",
            "static:",
            "static:acct",
            "other:acct:Ym9i",
            "static:acct:",
            "static:acct:Ym9i=",
            "static:acct:***",
            "static:acct:a:b",
        ] {
            assert!(Address::parse(text).is_err(), "{text:?}");
        }
        let long = format!("static:{}:Ym9i", "a".repeat(65));
        assert!(Address::parse(&long).is_err());
        let big = format!("static:a:{}", URL_SAFE_NO_PAD.encode([1u8; 256]));
        assert!(Address::parse(&big).is_err());
        let err = Address::parse(&"x".repeat(10_000))
            .expect_err("not an address")
            .to_string();
        assert!(err.len() < 400, "{err}");
    }
}

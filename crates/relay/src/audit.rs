//! The relay's audit rows (migration 0012, `relay_audit`; issue 30): membership events of the
//! handshakes the relay checks, never content. GET /v1/audit (the Python server) merges them
//! with the accounts' own events.
//!
//! Rows are made here, before the write, and stored by the store in the same transaction as
//! the change they record (a crash keeps both or neither; no extra round trip). Only creates,
//! commits and retention changes make rows: application messages never do, so the publish
//! path of messages is untouched. Anonymous callers (the account "") get no rows: no one can
//! read them.
//!
//! | type | account | detail |
//! |---|---|---|
//! | `channel.created` | creator | `{"identity"}` (the creator's leaf) |
//! | `org.claimed` | creator | `{"org"}` (written only when the create claimed it) |
//! | `member.added` / `member.removed` | committer, and the member's bound account when known and another | `{"identity", "by_identity", "member_account"}` |
//! | `retention.changed` | the org's owner | `{"retention": {"max_age_seconds", "max_entries", "max_bytes"}}` |

use base64::Engine as _;
use serde_json::{json, Value};

use crate::store::{AuditRow, Policy};

pub const CHANNEL_CREATED: &str = "channel.created";
pub const ORG_CLAIMED: &str = "org.claimed";
pub const MEMBER_ADDED: &str = "member.added";
pub const MEMBER_REMOVED: &str = "member.removed";
pub const RETENTION_CHANGED: &str = "retention.changed";

/// Who makes a change: the account (its rows) and the key it called with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Actor {
    pub account: String,
    pub key_id: Option<String>,
    pub at_ms: i64,
}

impl Actor {
    /// A row of this actor's account, None for an anonymous one.
    fn row(&self, kind: &'static str, channel: &str, detail: &Value) -> Option<AuditRow> {
        self.row_for(&self.account, kind, channel, detail)
    }

    fn row_for(
        &self,
        account: &str,
        kind: &'static str,
        channel: &str,
        detail: &Value,
    ) -> Option<AuditRow> {
        if account.is_empty() {
            return None;
        }
        Some(AuditRow {
            account: account.to_owned(),
            at_ms: self.at_ms,
            kind,
            key_id: self.key_id.clone(),
            channel: channel.to_owned(),
            detail: detail.to_string(),
        })
    }

    /// `channel.created` by the creator's leaf of `identity`.
    pub fn created(&self, channel: &str, identity: &[u8]) -> Option<AuditRow> {
        let detail = json!({ "identity": identity_text(identity) });
        self.row(CHANNEL_CREATED, channel, &detail)
    }

    /// `org.claimed`: the create of `channel` claimed its org.
    pub fn claimed(&self, channel: &str) -> Option<AuditRow> {
        let org = channel.split('/').next().unwrap_or_default();
        self.row(ORG_CLAIMED, channel, &json!({ "org": org }))
    }

    /// `retention.changed` to `policy` (as the channel sets it: null follows the default).
    pub fn retention(&self, channel: &str, policy: &Policy) -> Option<AuditRow> {
        let detail = json!({ "retention": {
            "max_age_seconds": policy.max_age_seconds,
            "max_entries": policy.max_entries,
            "max_bytes": policy.max_bytes,
        }});
        self.row(RETENTION_CHANGED, channel, &detail)
    }

    /// A commit's `member.added` and `member.removed` rows: each into the committer's account
    /// (its leaf `by_identity`), and into the member's bound account when known and another.
    /// `removed`: identities and bound accounts; `added`: identities (not bound yet).
    pub fn membership(
        &self,
        channel: &str,
        by_identity: &[u8],
        removed: &[(Vec<u8>, Option<String>)],
        added: &[Vec<u8>],
    ) -> Vec<AuditRow> {
        let by = identity_text(by_identity);
        let changes = removed
            .iter()
            .map(|(identity, account)| (MEMBER_REMOVED, identity, account.as_deref()))
            .chain(added.iter().map(|identity| (MEMBER_ADDED, identity, None)));
        let mut rows = Vec::new();
        for (kind, identity, member_account) in changes {
            let detail = json!({
                "identity": identity_text(identity),
                "by_identity": by,
                "member_account": member_account,
            });
            rows.extend(self.row(kind, channel, &detail));
            if let Some(member) = member_account.filter(|m| *m != self.account) {
                rows.extend(self.row_for(member, kind, channel, &detail));
            }
        }
        rows
    }
}

/// An MLS identity as audit rows show it: its UTF-8 text, else `base64:` and its unpadded
/// base64url.
pub fn identity_text(identity: &[u8]) -> String {
    match std::str::from_utf8(identity) {
        Ok(text) => text.to_owned(),
        Err(_) => format!(
            "base64:{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(identity)
        ),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn actor(account: &str) -> Actor {
        Actor {
            account: account.to_owned(),
            key_id: Some("k1".to_owned()),
            at_ms: 5,
        }
    }

    #[test]
    fn identities_are_text_or_base64url() {
        assert_eq!(identity_text(b"alice"), "alice");
        assert_eq!(identity_text(&[0xff, 0xfe, 0x00]), "base64:__4A");
    }

    #[test]
    fn membership_rows_go_to_the_committer_and_the_member() {
        let rows = actor("alice").membership(
            "a/b/c",
            b"alice",
            &[
                (b"bob".to_vec(), Some("bob".to_owned())),
                (b"alice-2".to_vec(), Some("alice".to_owned())),
                (b"eve".to_vec(), None),
            ],
            &[b"carol".to_vec()],
        );
        let seen: Vec<(&str, &str)> = rows.iter().map(|r| (r.account.as_str(), r.kind)).collect();
        assert_eq!(
            seen,
            vec![
                ("alice", MEMBER_REMOVED),
                ("bob", MEMBER_REMOVED),
                ("alice", MEMBER_REMOVED),
                ("alice", MEMBER_REMOVED),
                ("alice", MEMBER_ADDED),
            ]
        );
        let detail: Value = serde_json::from_str(&rows[1].detail).unwrap();
        assert_eq!(
            detail,
            json!({"identity": "bob", "by_identity": "alice", "member_account": "bob"})
        );
        let added: Value = serde_json::from_str(&rows[4].detail).unwrap();
        assert_eq!(added["member_account"], Value::Null);
        assert!(actor("")
            .membership("a/b/c", b"x", &[], &[b"y".to_vec()])
            .is_empty());
    }
}

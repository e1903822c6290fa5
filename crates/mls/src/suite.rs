//! The protocol choices every group of ours shares: the one ciphersuite, the wire-format
//! policy, how many past epochs keep their secrets, and the limits on inputs.

use std::time::Duration;

use openmls::prelude::{Ciphersuite, WireFormatPolicy, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY};

/// The one ciphersuite Static speaks.
pub const CIPHERSUITE: Ciphersuite = Ciphersuite::MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519;

/// How many past epochs keep their message secrets, so that application messages sent just
/// before a commit still decrypt after it.
pub const PAST_EPOCHS: usize = 5;

/// How far in the future a key package's `not_before` may be (clock skew, or implementations
/// that set it to "now" with sub-second precision lost): such a key package is accepted once
/// that moment has passed, waiting at most this long.
pub const MAX_KEY_PACKAGE_SKEW: Duration = Duration::from_secs(2);

/// Largest input accepted by any call (a Welcome for a 512-member group is ~150 KiB).
pub const MAX_INPUT_LEN: usize = 16 * 1024 * 1024;

/// Commits and proposals go out as PublicMessages, so that the relay (an RFC 9750 delivery
/// service) can validate them and keep the channel's public state; application messages are
/// PrivateMessages whatever the policy (OpenMLS always encrypts them, and refuses them
/// unencrypted). Incoming handshakes may be either: groups of earlier versions sent them
/// encrypted, and their commits may still be in the log.
pub const WIRE_FORMAT_POLICY: WireFormatPolicy = MIXED_PLAINTEXT_WIRE_FORMAT_POLICY;

/// The credential identity of the relay as an external sender of our groups (RFC 9420
/// §12.1.8.1): the one entry of a channel's `external_senders` extension names the relay's
/// signature key with a BasicCredential of this identity (docs/design.md §5.2, "Removal on
/// revocation").
pub const RELAY_SENDER_IDENTITY: &[u8] = b"static relay";

/// The `external_senders` entry naming the relay whose signature key is `signature_key`.
pub fn relay_external_sender(signature_key: &[u8]) -> openmls::prelude::ExternalSender {
    openmls::prelude::ExternalSender::new(
        signature_key.to_vec().into(),
        openmls::prelude::BasicCredential::new(RELAY_SENDER_IDENTITY.to_vec()).into(),
    )
}

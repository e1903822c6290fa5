//! How the service words and counts its refusals: tonic's own statuses in the relay's words,
//! the refusals several RPCs share, and the counted, logged refusals of calls that go on.

use tonic::{Code, Status};

use super::Inner;
use crate::auth::Caller;
use crate::error::RelayError;
use crate::group::GroupError;
use crate::observe::access::{line_budget, Suppressed, ACCESS_LOG};
use crate::observe::metrics;
use crate::pb;

/// The statuses tonic produces itself while reading a request, worded as the relay words its
/// own (clients and tests read these texts). None: leave the status as it is.
pub(crate) fn transport_error(status: &Status, limit: usize) -> Option<RelayError> {
    let message = status.message();
    match status.code() {
        Code::OutOfRange if message.starts_with("Error, decoded message length too large") => {
            Some(RelayError::resource_exhausted(format!(
                "request larger than the transport limit of {limit} bytes"
            )))
        }
        Code::Internal if message.starts_with("failed to decode Protobuf message") => Some(
            RelayError::InvalidArgument("request is not a valid protobuf message".to_owned()),
        ),
        Code::Internal if message == "Missing request message." => Some(
            RelayError::InvalidArgument("expected a request message".to_owned()),
        ),
        _ => None,
    }
}

/// A bug: logged here, the caller sees only "internal error".
pub(super) fn internal(what: &str) -> RelayError {
    ::log::error!(target: "static.relay", "internal error: {what}");
    RelayError::Internal
}

impl Inner {
    /// The status a streaming call ends with when reading its requests failed.
    pub(super) fn request_failed(&self, status: Status) -> Status {
        match transport_error(&status, self.settings.transport_limit()) {
            Some(e) => e.to_status(),
            None => status,
        }
    }
}

/// The refusal of a caller whose account has no bound leaf in the channel.
pub(super) fn not_a_member(channel: &str) -> RelayError {
    RelayError::PermissionDenied(format!(
        "this account is not a member of channel '{channel}' (no leaf of its group is bound to \
         it)"
    ))
}

/// A handshake or group state the channel's group refused, as a status.
pub(super) fn group_refusal(e: GroupError) -> RelayError {
    if e.is_permission_denied() {
        RelayError::PermissionDenied(e.to_string())
    } else if e.is_internal() {
        ::log::error!(target: "static.relay", "internal error: {e}");
        RelayError::Internal
    } else {
        RelayError::InvalidArgument(e.to_string())
    }
}

pub(super) fn refusal_label(refusal: &pb::Refusal) -> &'static str {
    metrics::code_label(Code::from_i32(i32::try_from(refusal.code).unwrap_or(2)))
}

/// One refusal inside a call that goes on (a SubscribeMany follow ended): counted, and logged
/// within the account's budget of lines ([`line_budget`]).
pub(crate) fn note_refusal(caller: &Caller, what: &str, refusal: &pb::Refusal) {
    let label = refusal_label(refusal);
    metrics::metrics()
        .refusals
        .with_label_values(&[label])
        .inc();
    if !::log::log_enabled!(target: ACCESS_LOG, ::log::Level::Info) {
        return;
    }
    let Some(suppressed) = line_budget().admit(&format!("account:{}", caller.account)) else {
        return;
    };
    ::log::info!(
        target: ACCESS_LOG,
        "{what} {label} account={} key={} message={}{}",
        if caller.account.is_empty() { "anonymous" } else { &caller.account },
        caller.key_id.as_deref().unwrap_or("-"),
        refusal.message.chars().take(200).collect::<String>(),
        Suppressed(suppressed),
    );
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn transport_statuses_get_the_relay_texts() {
        let too_large = Status::out_of_range(
            "Error, decoded message length too large: found 9 bytes, the limit is: 8 bytes",
        );
        assert_eq!(
            transport_error(&too_large, 8).unwrap().to_string(),
            "request larger than the transport limit of 8 bytes"
        );
        let garbage = Status::internal("failed to decode Protobuf message: invalid varint");
        assert_eq!(
            transport_error(&garbage, 8).unwrap().code(),
            Code::InvalidArgument
        );
        assert!(transport_error(&Status::internal("other"), 8).is_none());
    }
}

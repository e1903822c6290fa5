//! One entry of a channel's log as the client received it from the relay.

/// The relay's content type of application messages.
pub(crate) use static_proto::content_type::APPLICATION;

/// One entry of a channel's log as the client received it.
pub(crate) struct LogItem {
    pub(crate) seq: u64,
    /// Its content type (1 application, 2 proposal, 3 commit).
    pub(crate) kind: u32,
    pub(crate) message: Vec<u8>,
    /// Who published it, as the relay attests it.
    pub(crate) account: String,
}

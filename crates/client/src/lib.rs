//! Static's SDK client (`static-client`): an [`Engine`](static_mls::Engine) (`static-mls`)
//! plus the relay, on a tokio runtime the client owns. No Python here: `static-native` is the
//! thin PyO3 layer.
//!
//! # Architecture
//!
//! * One [`Client`] per agent process and data directory (`client`): it owns a small
//!   multi-thread tokio runtime, the engine, a lazily connecting tonic client of the relay, a
//!   token source (`relay::tokens`), and what its channels share (`shared`): one **publisher**
//!   task (`send::publisher`) that keeps one `PublishBatches` call open for all channels, and a
//!   pool of **applier** threads (`receive::applier`).
//! * One [`Channel`] per open channel (`channel`, the façade) around a core (`channel::core`):
//!   the state its workers share (progress, shutdown, wake-ups, our own messages). The workers
//!   get the core and their own channel ends and never reach the façade:
//!   - the channel's **subscription** (`receive::subscriber`) follows its log (in batches of up
//!     to `SUBSCRIBE_BATCH` entries per response) after the last seq seen (or from the epoch we
//!     joined at), and feeds the channel's follower (`receive::reader`), which passes over our
//!     own messages (`receive::own`), applies a lone message itself when nothing is queued, and
//!     hands the rest to
//!   - the **appliers**, the one writer of a channel's group state: they apply its entries
//!     strictly in log order through `Engine::process_entries`, which stores the cursor and
//!     the decrypted messages (the inbox) in the same transaction as the MLS state change;
//!   - the **sender** thread (`send::sender`), only while the channel pipelines sends
//!     (`send::pipeline`, their payloads journaled in `send::journal`).
//! * Sending encrypts on the callers' threads (`send::encrypt`, concurrent callers sharing one
//!   transaction) and hands the messages to the publisher.
//! * Commits (`channel::commit`: `add_member`, `remove_member`, `rotate_keys`, committing
//!   members' proposals) belong to the façade: they take the channel's commit lock, publish
//!   with the epoch fence and return once the applier has merged the echo; a stale commit is
//!   dropped, the winner applied, and it is made again.
//! * Failures are typed ([`Error`]); the relay's refusals are classified once ([`Refusal`],
//!   `relay::refusal`) and every loop that talks to the relay follows one retry policy
//!   (`relay::retry`).
//! * Request/reply (`request`): requests and replies are application messages marked by their
//!   authenticated data, kept apart from the inbox, with idempotency keys of their own so that
//!   each request gets exactly one reply across retries and crashes.
//! * Readers of messages take them from the inbox (`receive::inbox`; blocking with a condition
//!   variable, or async through a readiness socket per waiter, see [`Waker`]).
//!
//! * Agents meet through the relay (`directory`): our address, the key packages we keep listed
//!   in its directory, the invitations it holds for us, and `Channel::invite`.
//!
//! Layout: `channel/` one open channel (the façade, its core, its commits); `send/` a message
//! from the caller to the relay; `receive/` the log from the relay to the readers; `relay/`
//! talking to the relay (gRPC client, tokens, refusals, retry); `directory/` addresses and
//! invitations; `request/` request/reply on a channel. At the top: `client`, `shared`
//! (what a client's channels share), `config`, `error`, `sync` (locks and watches, used by all).

#![forbid(unsafe_code)]

mod channel;
mod client;
mod config;
mod directory;
mod error;
mod receive;
mod relay;
mod request;
mod send;
mod shared;
mod sync;

pub use channel::core::{now_ns, End, Progress, Timings, Waker};
pub use channel::{Channel, Next, RosterMember};
pub use client::{Client, CLOSE_TIMEOUT};
pub use config::{ClientOptions, MAX_PAYLOAD};
pub use directory::{Address, AddressError, Invitation};
pub use error::{Error, ErrorKind, Result};
pub use receive::inbox::Message;
pub use relay::refusal::Refusal;
pub use relay::tokens::{Token, TokenError, TokenProvider};
pub use relay::transport;
pub use request::{NextRequest, Outstanding, Request, RequestId, MAX_REQUEST_PAYLOAD};
pub use send::pipeline::SendHandle;

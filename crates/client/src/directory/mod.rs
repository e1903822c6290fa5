//! Agents meeting through the relay (`proto/relay.proto`, the key-package directory and
//! invitations; docs/sdk.md, Invitations): our printable address, the stock of key packages we
//! keep listed under it, the invitations we receive, and inviting an address into a channel.
//!
//! Layout: `address` the printed form; `stock` the keeper of our listed key packages (a task on
//! the client's runtime from the first `allow_invitations` or `list_invitations` on);
//! `invitations` listing, accepting and declining ours, and our policy; `invite` claiming
//! another's package and adding it to a channel.

pub(crate) mod address;
pub(crate) mod invitations;
pub(crate) mod invite;
pub(crate) mod stock;

pub use address::{Address, AddressError};
pub use invitations::Invitation;

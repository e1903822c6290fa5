//! The [`Client`]: one agent's engine, relay connection and runtime, and its open channels.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tonic::Code;

use crate::channel::Channel;
use crate::config::{ClientOptions, PROGRESS_TIMEOUT};
use crate::directory::stock::Stock;
use crate::error::{Error, Result};
use crate::receive::applier::Pool;
use crate::receive::inbox::Marks;
use crate::receive::subscriber::Subscriptions;
use crate::relay::refusal::Refusal;
use crate::relay::retry::Retry;
use crate::relay::tokens::{Token, TokenProvider, Tokens};
use crate::relay::transport::{self, pb};
use crate::send::journal;
use crate::send::publisher::{publisher, Outbound};
use crate::shared::Shared;
use crate::sync::{join_within, lock};
use static_mls::engine::Engine;

/// The most [`Client::close`] waits in all, whatever other threads are doing.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Of which for the calls in progress to leave the runtime (they were told to at once).
const CALLS_TIMEOUT: Duration = Duration::from_secs(1);
/// And for the runtime's tasks and blocking work to stop.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(2);

/// One agent's client: see the crate docs.
pub struct Client {
    runtime: Mutex<Option<Runtime>>,
    pub(crate) shared: Arc<Shared>,
    /// Our key packages in the relay's directory (`directory::stock`), kept from the first
    /// call about invitations on.
    pub(crate) stock: Arc<Stock>,
    /// The newest invitation `list_invitations` has seen (a newer one nudges the stock).
    pub(crate) newest_invitation: std::sync::atomic::AtomicU64,
    channels: Mutex<HashMap<String, Arc<Channel>>>,
    /// The client's one publisher (see `publisher`), shared by its channels.
    outbound: mpsc::UnboundedSender<Vec<Outbound>>,
    appliers: Arc<Pool>,
    /// The client's subscriptions (see `subscriber`), shared by its channels.
    subscriptions: Subscriptions,
    applier_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    identity: Vec<u8>,
    data_dir: PathBuf,
}

impl Client {
    /// Opens the engine of `identity` under `data_dir` and prepares (lazily) the connection to
    /// the relay at `endpoint`. `tokens` is `None` for anonymous access; `initial_token` saves
    /// the first fetch when the caller has just exchanged the key; `options` (see
    /// [`ClientOptions::from_env`]) says how patient calls are with the relay.
    pub fn open(
        endpoint: &str,
        data_dir: impl AsRef<Path>,
        identity: &[u8],
        tokens: Option<Arc<dyn TokenProvider>>,
        initial_token: Option<Token>,
        options: ClientOptions,
    ) -> Result<Self> {
        let endpoint = transport::endpoint(endpoint, options.ca_file.as_deref())?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            // One worker: the connection, the subscriptions and the publisher are light async
            // work, and on one thread they hand over to each other without waking another
            // thread (measured: a lower round trip than two workers on a 2-core machine).
            // Encryption runs on the senders' threads, decryption on the applier pool.
            .worker_threads(1)
            // Token fetches and commits only.
            .max_blocking_threads(8)
            .thread_name("static-sdk")
            .enable_all()
            .build()
            .map_err(|e| Error::task("cannot start the runtime", e))?;
        let data_dir = data_dir.as_ref().to_owned();
        let engine = Arc::new(Engine::open(&data_dir, identity)?);
        // Opened under the engine's directory lock.
        let marks = Marks::open(&data_dir, &engine)?;
        journal::adopt_old_directory(&data_dir)?;
        // connect_lazy spawns onto the current runtime.
        let relay = {
            let _guard = runtime.enter();
            transport::connect_lazy(&endpoint)
        };
        let shared = Arc::new(Shared::new(
            engine,
            relay,
            Tokens::new(tokens, initial_token),
            runtime.handle().clone(),
            endpoint.uri().to_string(),
            options,
            marks,
        ));
        let (outbound, outbound_rx) = mpsc::unbounded_channel();
        runtime.spawn(publisher(Arc::clone(&shared), outbound_rx));
        let (appliers, applier_threads) = Pool::start()?;
        Ok(Self {
            runtime: Mutex::new(Some(runtime)),
            subscriptions: Subscriptions::new(Arc::clone(&shared)),
            shared,
            stock: Arc::new(Stock::new()),
            newest_invitation: std::sync::atomic::AtomicU64::new(0),
            channels: Mutex::new(HashMap::new()),
            outbound,
            appliers,
            applier_threads: Mutex::new(applier_threads),
            identity: identity.to_vec(),
            data_dir,
        })
    }

    pub fn identity(&self) -> &[u8] {
        &self.identity
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    fn block_on<T>(&self, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.shared.block_on(fut)
    }

    /// A fresh key package for a member to add us with.
    pub fn generate_key_package(&self) -> Result<Vec<u8>> {
        self.shared.check_open()?;
        Ok(self.shared.engine()?.generate_key_package()?)
    }

    /// The channels this identity is a member of under its data directory.
    pub fn channels(&self) -> Result<Vec<String>> {
        self.shared.check_open()?;
        Ok(self.shared.engine()?.group_names())
    }

    /// Creates `name` on the relay and its MLS group with us as the only member.
    pub fn create_channel(&self, name: &str) -> Result<Arc<Channel>> {
        static_mls::validate_channel_name(name)?;
        if self.shared.engine()?.has_group(name) {
            return Err(Error::Group(format!(
                "already a member of channel {name:?}; use open_channel to reopen it"
            )));
        }
        self.block_on(self.shared.reach())?;
        // The group first: the relay builds the channel's public group state from it, and
        // binds our leaf to our account.
        // The relay as the group's external sender: it proposes the removal of our members
        // whose API key is revoked (docs/design.md §5.2, "Removal on revocation").
        let relay_key = self.block_on(self.shared.relay_sender_key())?;
        let owned = name.to_owned();
        self.block_on(
            self.shared
                .blocking(move |e| Ok(e.create_group_with_relay(&owned, relay_key.as_deref())?)),
        )?;
        let shared = Arc::clone(&self.shared);
        let owned = name.to_owned();
        let created = self.block_on(async move {
            let mut retry = Retry::within(shared.options.retry_timeout);
            let account = shared.account(&mut retry, "CreateChannel").await?;
            let group = owned.clone();
            let (state, binding) = shared
                .blocking(move |e| Ok((e.public_state(&group)?, e.leaf_binding(&group, &account)?)))
                .await?;
            // Whether an attempt may have created it before its answer was lost.
            let retried = std::sync::atomic::AtomicBool::new(false);
            let answer = shared
                .call(
                    "CreateChannel",
                    &mut retry,
                    || pb::CreateChannelRequest {
                        channel: owned.clone(),
                        group_info: state.group_info.clone().into(),
                        ratchet_tree: state.ratchet_tree.clone().into(),
                        binding: Some(pb::LeafBinding {
                            leaf_index: binding.leaf_index,
                            signature: binding.signature.clone().into(),
                        }),
                    },
                    |mut relay, request| async move { relay.create_channel(request).await },
                    |refusal| {
                        let exists = refusal.code() == Code::AlreadyExists;
                        if matches!(refusal, Refusal::Transient { .. }) {
                            retried.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        exists
                    },
                )
                .await?;
            match answer {
                Ok(_) => Ok(()),
                // Our own earlier attempt created it.
                Err(_) if retried.load(std::sync::atomic::Ordering::Relaxed) => Ok(()),
                Err(_) => Err(Error::Group(format!(
                    "channel {owned:?} already exists on the relay; join it with a Welcome \
                     from one of its members"
                ))),
            }
        });
        if let Err(e) = created {
            // The relay has no such channel of ours: neither do we.
            self.shared.engine()?.forget_group(name)?;
            return Err(e);
        }
        self.block_on(async {
            self.shared.record_bound_key(name).await;
            Ok(())
        })?;
        self.start_channel(name)
    }

    /// Logs a warning when the group we joined does not name our relay as its external
    /// sender: the relay cannot remove members whose key is revoked from it (a channel created
    /// before, or by another relay's SDK). Not refused: the relay refuses every external
    /// sender's handshake but its own, so another key named there can propose nothing.
    fn warn_unless_relay_named(&self, name: &str) {
        let Ok(Some(key)) = self.block_on(self.shared.relay_sender_key()) else {
            return;
        };
        let Ok(engine) = self.shared.engine() else {
            return;
        };
        if let Ok(false) = engine.names_relay(name, &key) {
            log::warn!(
                "channel {name:?} does not name this relay as its external sender: members \
                 whose API key is revoked are not removed from it automatically"
            );
        }
    }

    /// Joins `name` from a Welcome produced by a member's `add_member`.
    pub fn join_channel(&self, name: &str, welcome: &[u8]) -> Result<Arc<Channel>> {
        static_mls::validate_channel_name(name)?;
        // Before the Welcome is used up: it cannot be processed twice.
        self.block_on(self.shared.reach())?;
        let owned = name.to_owned();
        let welcome = welcome.to_vec();
        self.block_on(
            self.shared
                .blocking(move |e| Ok(e.join_group(&owned, &welcome)?)),
        )?;
        self.warn_unless_relay_named(name);
        // Until our leaf is bound to our account, the relay gives the account no access.
        if let Err(e) = self.block_on(self.shared.bind_leaf(name)) {
            if !matches!(e, Error::Auth(_)) {
                self.shared.engine()?.forget_group(name)?;
            }
            return Err(e);
        }
        let channel = self.start_channel(name)?;
        // Surface a relay that refuses the channel (another account's, or no access) now
        // rather than on the first read.
        if let Err(e) = self.block_on(channel.wait_connected(Duration::from_secs(10))) {
            // A refused channel cannot be used: forget the group so that channels() does not
            // list it. An auth failure keeps it, to be reopened once the key is fixed, and so
            // does a close of the client meanwhile (the group is joined and bound).
            if !matches!(e, Error::Auth(_) | Error::Closed(_)) {
                channel.close();
                lock(&self.channels).remove(name);
                self.shared.engine()?.forget_group(name)?;
            }
            return Err(e);
        }
        Ok(channel)
    }

    /// Reopens a channel of ours (see [`Client::channels`]): processing resumes after the last
    /// entry applied before.
    pub fn open_channel(&self, name: &str) -> Result<Arc<Channel>> {
        static_mls::validate_channel_name(name)?;
        self.shared.check_open()?;
        if let Some(open) = lock(&self.channels).get(name) {
            if !open.is_closed() {
                return Ok(Arc::clone(open));
            }
        }
        if !self.shared.engine()?.has_group(name) {
            return Err(Error::Group(format!("not a member of channel {name:?}")));
        }
        // In the background: opening a channel needs neither the relay nor the token endpoint.
        let shared = Arc::clone(&self.shared);
        let owned = name.to_owned();
        self.shared
            .handle
            .spawn(async move { shared.rebind_if_key_changed(&owned).await });
        self.start_channel(name)
    }

    fn start_channel(&self, name: &str) -> Result<Arc<Channel>> {
        // A closed predecessor's work must be over before a successor applies the same log.
        // Waited for without the channels' lock, which `close` takes.
        let predecessor = lock(&self.channels).get(name).cloned();
        if let Some(open) = predecessor {
            if !open.is_closed() {
                return Ok(open);
            }
            open.close_and_settle();
            let tasks: Vec<_> = lock(&open.tasks).drain(..).collect();
            self.block_on(async move {
                for task in tasks {
                    let _ = tokio::time::timeout(PROGRESS_TIMEOUT, task).await;
                }
                Ok(())
            })?;
        }
        let mut channels = lock(&self.channels);
        if let Some(open) = channels.get(name) {
            // Opened by another call meanwhile.
            if !open.is_closed() {
                return Ok(Arc::clone(open));
            }
            open.close_and_settle();
        }
        let channel = Channel::start(
            Arc::clone(&self.shared),
            name,
            self.outbound.clone(),
            &self.appliers,
            &self.subscriptions,
        )?;
        channels.insert(name.to_owned(), Arc::clone(&channel));
        drop(channels);
        // A close that took the channels before this one was in: it is closed here instead.
        if let Err(e) = self.shared.check_open() {
            channel.close();
            return Err(e);
        }
        Ok(channel)
    }

    /// Stops every channel's background work, waits for it at most [`CLOSE_TIMEOUT`] in all,
    /// and releases the data directory (at once, or when the calls and threads still running
    /// after that bound end: each holds its own reference). Idempotent.
    ///
    /// Returns within the bound whatever other threads are doing: the calls they have in
    /// progress end with `runtime error:` (see `Shared::block_on`), or their own error.
    pub fn close(&self) {
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        let left = || deadline.saturating_duration_since(Instant::now());
        self.shared.close();
        let channels: Vec<_> = lock(&self.channels).drain().map(|(_, c)| c).collect();
        for channel in &channels {
            channel.close();
        }
        // The calls in progress were told to end: let them leave the runtime before it stops
        // (their futures are dropped on their own threads, the runtime still running).
        self.shared.wait_calls(left().min(CALLS_TIMEOUT));
        if let Some(runtime) = lock(&self.runtime).take() {
            runtime.shutdown_timeout(left().min(RUNTIME_TIMEOUT));
        }
        // The subscriptions are gone with the runtime, so the appliers end after the turns
        // already queued; they hold the engine, which must be released before this returns.
        self.appliers.stop();
        for thread in lock(&self.applier_threads).drain(..) {
            join_within(thread, deadline);
        }
        for channel in channels {
            channel.join_sender(deadline);
        }
        // Dropping the last reference checkpoints the store and releases the directory lock.
        lock(&self.shared.engine).take();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shared.close();
        for channel in lock(&self.channels).values() {
            channel.close();
        }
        self.appliers.stop();
        // Never wait here: a drop may run where waiting for the runtime would deadlock.
        if let Some(runtime) = lock(&self.runtime).take() {
            runtime.shutdown_background();
        }
        lock(&self.shared.engine).take();
    }
}

//! The `ChannelLog` façade: open (and close), load and create channels, their groups and
//! bindings as memory knows them, submit publishes, and the writer's other jobs. Its reads are
//! in [`super::reads`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{oneshot, watch};

use super::channel::Channel;
use super::queue::{publish_jobs, CreateJob, Job, Queue, QueueState, StopGuard};
use super::registry::{unload_idle_channels, Registry};
use super::writer::{run_writer, Writer};
use super::{Checked, LogSettings, Outcome, MAX_BATCH};
use crate::audit::Actor;
use crate::error::{shutting_down, RelayError, Result};
use crate::group::GroupState;
use crate::members::{Membership, Reach};
use crate::store::directory::Directory;
use crate::store::AuditRow;
use crate::store::{self, ChannelRow, LogReader, Policy, PruneStep, StoredGroup};

/// The relay's channels: load, create, publish (group-committed), read. Cheap to clone.
#[derive(Clone)]
pub struct ChannelLog {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    registry: Arc<Registry>,
    queue: Arc<Queue>,
    /// None once the writer thread stopped (closed).
    writer: Arc<Mutex<Option<Writer>>>,
    /// Whether submitters may commit on their own thread (see [`LogWriter::commits_inline`]).
    ///
    /// [`LogWriter::commits_inline`]: store::LogWriter::commits_inline
    commits_inline: bool,
    /// Several relays share the database (PostgreSQL): memory may be behind on bindings.
    shared: bool,
    pub(super) reader: Arc<dyn LogReader>,
    directory: Arc<dyn Directory>,
    /// The relay's key pair as an external sender of the groups (migration 0013).
    external_sender: store::SenderKey,
}

impl Drop for Inner {
    /// Dropped without [`ChannelLog::close`]: the writer still commits what was submitted,
    /// then stops (nobody waits for it).
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl ChannelLog {
    /// Open the database and start the writer.
    pub async fn open(settings: LogSettings) -> Result<ChannelLog> {
        let registry = Arc::new(Registry::new(settings.cache_bytes));
        let heads: Arc<dyn store::Heads> = Arc::clone(&registry) as Arc<dyn store::Heads>;
        let opened = store::open(&settings.database, heads).await?;
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            wake: Condvar::new(),
            stopped: watch::Sender::new(false),
        });
        let commits_inline = opened.writer.commits_inline();
        let writer = Arc::new(Mutex::new(Some(Writer {
            store: opened.writer,
            window: settings.application_window,
            publishes: Vec::with_capacity(MAX_BATCH),
            others: Vec::new(),
        })));
        let (their_queue, their_writer) = (Arc::clone(&queue), Arc::clone(&writer));
        let spawned = std::thread::Builder::new()
            .name("static-relay-writer".into())
            .spawn(move || {
                // Declared first, dropped last: signals the stop once the writer (and its
                // store) are gone, even if it panicked.
                let _stopped = StopGuard(Arc::clone(&their_queue));
                run_writer(&their_queue, &their_writer);
            });
        if let Err(err) = spawned {
            opened.reader.close();
            return Err(RelayError::store(err));
        }
        match opened.reader.shadowed_names().await {
            Ok(names) => registry.set_shadowed(names),
            Err(err) => {
                queue.close();
                opened.reader.close();
                return Err(err);
            }
        }
        if !settings.idle_unload.is_zero() {
            tokio::spawn(unload_idle_channels(
                Arc::clone(&registry),
                settings.idle_unload,
                queue.stopped.subscribe(),
            ));
        }
        Ok(ChannelLog {
            inner: Arc::new(Inner {
                registry,
                queue,
                writer,
                commits_inline,
                shared: !commits_inline,
                reader: opened.reader,
                directory: opened.directory,
                external_sender: opened.external_sender,
            }),
        })
    }

    /// The relay's key pair as an external sender of the groups, the same for every relay of
    /// the database (made by the first one).
    pub(crate) fn external_sender(&self) -> &store::SenderKey {
        &self.inner.external_sender
    }

    /// The relay's public signature key as an external sender (see
    /// [`ChannelLog::external_sender`]).
    pub fn external_sender_key(&self) -> &[u8] {
        &self.inner.external_sender.public
    }

    /// Up to `limit` distinct API keys behind bindings, in order, after `after`.
    pub async fn bound_keys(&self, after: &str, limit: usize) -> Result<Vec<String>> {
        self.inner.reader.bound_keys(after.to_owned(), limit).await
    }

    /// Up to `limit` leaves last bound by `key_id`: (channel name, leaf index).
    pub async fn leaves_of_key(&self, key_id: &str, limit: usize) -> Result<Vec<(String, u32)>> {
        self.inner
            .reader
            .leaves_of_key(key_id.to_owned(), limit)
            .await
    }

    /// Up to `limit` channels with a leaf bound to `account`, by id after `after_id`.
    pub(crate) async fn account_channels(
        &self,
        account: &str,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<store::AccountChannelRow>> {
        self.inner
            .reader
            .account_channels(account.to_owned(), after_id, limit)
            .await
    }

    /// `account`'s entries of `content_type` since `since_ms`, per channel and minute (at
    /// most `limit` rows).
    pub(crate) async fn account_rate(
        &self,
        account: &str,
        since_ms: i64,
        content_type: u32,
        limit: usize,
    ) -> Result<Vec<(String, i64, u64)>> {
        self.inner
            .reader
            .account_rate(account.to_owned(), since_ms, content_type, limit)
            .await
    }

    /// The key-package directory and invitations (`store/directory/`).
    pub(crate) fn directory(&self) -> &dyn Directory {
        self.inner.directory.as_ref()
    }

    /// Create channel `name` at epoch 0 for `account`, from the creator's group `state` whose
    /// leaf `leaf` is bound to `account`: AlreadyExists("channel 'NAME' already exists"),
    /// PermissionDenied("org 'ORG' belongs to another account").
    pub async fn create(
        &self,
        name: &str,
        account: &str,
        state: GroupState,
        leaf: u32,
        key_id: Option<&str>,
    ) -> Result<Arc<Channel>> {
        self.create_audited(name, account, state, leaf, key_id, None)
            .await
    }

    /// [`ChannelLog::create`], with its audit rows (`channel.created`, and `org.claimed` when
    /// it claims the org) written in its transaction: made by `actor`, with the creator's
    /// identity read from `state`.
    pub(crate) async fn create_audited(
        &self,
        name: &str,
        account: &str,
        state: GroupState,
        leaf: u32,
        key_id: Option<&str>,
        actor: Option<&Actor>,
    ) -> Result<Arc<Channel>> {
        let identity = state.leaf(leaf).map(|l| l.identity).unwrap_or_default();
        let audit: Vec<AuditRow> = actor
            .and_then(|a| a.created(name, &identity))
            .into_iter()
            .collect();
        let claimed = actor.and_then(|a| a.claimed(name));
        let org = name.split('/').next().unwrap_or(name);
        let stored = state.to_bytes().map_err(|e| {
            ::log::error!(target: "static.relay", "internal error: a group state could not be encoded: {e}");
            RelayError::Internal
        })?;
        let _loading = self.inner.registry.loading();
        let (tx, rx) = oneshot::channel();
        let job = Job::Create(CreateJob {
            name: name.to_owned(),
            org: org.to_owned(),
            account: account.to_owned(),
            state: stored,
            leaf,
            audit,
            claimed,
            key_id: key_id.map(str::to_owned),
            tx,
        });
        if let Err(refused) = self.push(vec![job]) {
            refused.into_iter().for_each(Job::refuse);
        }
        let id = rx.await.map_err(|_| shutting_down())??;
        let row = ChannelRow::created(id);
        let channel = self.inner.registry.remember(name, row);
        let mut membership = Membership::new(0);
        membership.bind(leaf, account);
        *channel.members() = Some(membership);
        Ok(channel)
    }

    /// The channel `name` as `account` reaches it (its own legacy channel of that name if
    /// another's shadows it): NotFound("no channel 'NAME'") when it does not exist.
    pub async fn channel(&self, account: &str, name: &str) -> Result<Arc<Channel>> {
        if let Some(channel) = self.loaded(account, name) {
            return Ok(channel);
        }
        let _loading = self.inner.registry.loading();
        let row = self
            .inner
            .reader
            .load_channel(account, name)
            .await?
            .ok_or_else(|| RelayError::NotFound(format!("no channel '{name}'")))?;
        Ok(self.inner.registry.remember(name, row))
    }

    /// The channel if it is in memory already (no store access).
    pub fn loaded(&self, account: &str, name: &str) -> Option<Arc<Channel>> {
        self.inner.registry.loaded(account, name)
    }

    /// Unloads now the channels nobody holds and nobody used for `idle` (what the log does
    /// by itself every so often, see [`LogSettings::idle_unload`]); returns how many.
    pub fn unload_idle(&self, idle: Duration) -> usize {
        self.inner.registry.unload_idle(idle)
    }

    /// How many channels are loaded.
    pub fn loaded_channels(&self) -> usize {
        self.inner.registry.loaded_count()
    }

    /// What the rings of recent entries hold now, all channels together (messages and
    /// bookkeeping, as charged against [`LogSettings::cache_bytes`]).
    pub fn cached_bytes(&self) -> usize {
        self.inner.registry.cache.charged.load(Ordering::Acquire)
    }

    /// Loads the channel's group from the store into memory when it was not loaded or is
    /// behind the channel's epoch; with `again` (another relay may have bound a leaf) the
    /// bindings of a current group are read again (a cheap query: the state is not).
    async fn load_members(&self, channel: &Channel, again: bool) -> Result<()> {
        let current = channel
            .members()
            .as_ref()
            .map(|m| m.epoch())
            .filter(|epoch| *epoch >= channel.epoch());
        if let Some(epoch) = current {
            if !again {
                return Ok(());
            }
            let bindings = self.inner.reader.bindings(channel.id).await?;
            if let Some(m) = channel.members().as_mut().filter(|m| m.epoch() == epoch) {
                m.rebind(bindings);
            }
            return Ok(());
        }
        let stored = self.stored_group(channel, false).await?;
        let loaded = Membership::from_stored(stored)?;
        let mut members = channel.members();
        // Another load or a commit may have got further meanwhile: keep the newest.
        if members.as_ref().is_none_or(|m| m.epoch() <= loaded.epoch()) {
            *members = Some(loaded);
        }
        Ok(())
    }

    /// How far `account` reaches `channel`: a legacy channel by its owner, any other by an
    /// account with a bound leaf. Memory answers; the store only when memory is behind (or,
    /// with several relays on one database, before a refusal: another relay may have bound a
    /// leaf since).
    pub async fn reach(&self, channel: &Channel, account: &str) -> Result<Reach> {
        match channel.reach_in_memory(account) {
            // A legacy channel's owner is in its row: there is nothing more to read.
            Some(reach) if channel.is_legacy() => return Ok(reach),
            Some(Reach::None) if self.inner.shared => {}
            Some(reach) => return Ok(reach),
            None => {}
        }
        self.load_members(channel, true).await?;
        // As just read: another relay's commit may have moved the epoch on meanwhile, and a
        // member must not be refused for that (the next look reloads).
        let members = channel.members();
        Ok(members.as_ref().map_or(Reach::None, |m| m.reach(account)))
    }

    async fn stored_group(&self, channel: &Channel, with_state: bool) -> Result<StoredGroup> {
        self.inner
            .reader
            .load_group(channel.id, with_state)
            .await?
            .ok_or_else(|| {
                RelayError::Unavailable(format!("channel '{}' has no group state", channel.name))
            })
    }

    /// The channel's group state at its current epoch (None for a legacy channel), read from
    /// the store the first time something needs it.
    pub async fn group(&self, channel: &Channel) -> Result<Option<Arc<GroupState>>> {
        if channel.is_legacy() {
            return Ok(None);
        }
        self.load_members(channel, false).await?;
        if let Some(state) = channel.members().as_ref().and_then(Membership::state) {
            return Ok(Some(state));
        }
        let stored = self.stored_group(channel, true).await?;
        let mut members = channel.members();
        match members.as_mut() {
            Some(m) if m.epoch() == stored.epoch => {
                let bytes = stored.state.unwrap_or_default();
                Ok(Some(m.set_state(&bytes)?))
            }
            // Memory moved on meanwhile (or was dropped): take what the store has.
            _ => {
                let loaded = Membership::from_stored(stored)?;
                let state = loaded.state();
                if members.as_ref().is_none_or(|m| m.epoch() <= loaded.epoch()) {
                    *members = Some(loaded);
                }
                Ok(state)
            }
        }
    }

    /// The channel's members with the accounts bound to them, and the epoch.
    pub async fn members_of(
        &self,
        channel: &Channel,
    ) -> Result<(u64, Vec<(crate::group::LeafInfo, Option<Arc<str>>)>)> {
        if self.inner.shared {
            self.load_members(channel, true).await?;
        }
        self.group(channel).await?;
        let members = channel.members();
        Ok(members
            .as_ref()
            .and_then(|m| Some((m.epoch(), m.members()?)))
            .unwrap_or_default())
    }

    /// The accounts memory has bound to `leaves` of `channel` (None: unbound, or not loaded).
    /// Memory only: what the audit rows of a commit name (docs: `audit`).
    pub(crate) fn bound_in_memory(&self, channel: &Channel, leaves: &[u32]) -> Vec<Option<String>> {
        let members = channel.members();
        leaves
            .iter()
            .map(|leaf| {
                let account = members.as_ref().and_then(|m| m.bound(*leaf));
                account.map(|a| a.to_string())
            })
            .collect()
    }

    /// The proposals accepted at `epoch` of `channel`, in log order.
    pub async fn proposals(&self, channel: &Channel, epoch: u64) -> Result<Vec<Bytes>> {
        self.inner.reader.proposals(channel.id, epoch).await
    }

    /// Binds `leaf` to `account` if `channel` is still at `epoch`; false when it moved on
    /// (check the proof against the new tree and try again).
    pub async fn bind(
        &self,
        channel: &Channel,
        epoch: u64,
        leaf: u32,
        account: &str,
        key_id: Option<&str>,
    ) -> Result<bool> {
        let (tx, rx) = oneshot::channel();
        let job = Job::Bind {
            channel_id: channel.id,
            epoch,
            leaf,
            account: account.to_owned(),
            key_id: key_id.map(str::to_owned),
            tx,
        };
        if let Err(refused) = self.push(vec![job]) {
            refused.into_iter().for_each(Job::refuse);
        }
        let bound = rx.await.map_err(|_| shutting_down())??;
        if bound {
            let mut members = channel.members();
            match members.as_mut() {
                Some(m) if m.epoch() == epoch => m.bind(leaf, account),
                // Memory moved on, or never loaded: read it again when next needed.
                _ => *members = None,
            }
        }
        Ok(bound)
    }

    /// Queue publishes (already checked, their channels loaded) for the next group commit,
    /// in order; one [`Outcome`] per item, in the same order. Items submitted together (and
    /// with others arriving meanwhile) share a durable commit; entries become visible to
    /// readers and are answered only after it.
    pub fn submit(&self, items: Vec<(Arc<Channel>, Checked)>) -> Vec<Outcome> {
        let (jobs, outcomes) = publish_jobs(items);
        if let Err(refused) = self.push(jobs) {
            refused.into_iter().for_each(Job::refuse);
        }
        outcomes
    }

    /// [`ChannelLog::submit`] for a caller that has more publishes at hand right away (the
    /// next requests of a pipelined call): these go to the writer thread, which commits them
    /// together with what follows, instead of a commit of their own on the caller's thread.
    pub fn submit_more(&self, items: Vec<(Arc<Channel>, Checked)>) -> Vec<Outcome> {
        let (jobs, outcomes) = publish_jobs(items);
        match self.inner.queue.push(jobs) {
            Ok(()) => self.inner.queue.notify_writer(),
            Err(refused) => refused.into_iter().for_each(Job::refuse),
        }
        outcomes
    }

    /// Queue `jobs`, then commit them right here if the writer is free (see the module's
    /// design notes), else leave them to the writer thread.
    fn push(&self, jobs: Vec<Job>) -> std::result::Result<(), Vec<Job>> {
        let queue = &self.inner.queue;
        queue.push(jobs)?;
        if !self.inner.commits_inline {
            queue.notify_writer();
            return Ok(());
        }
        match self.inner.writer.try_lock() {
            Ok(mut writer) => match writer.as_mut() {
                Some(writer) => {
                    let mut batch = Vec::new();
                    queue.take_now(&mut batch);
                    writer.commit(batch);
                    // More than one batch was queued (a large request): the rest is the
                    // writer thread's, which nobody else may wake.
                    if queue.has_jobs() {
                        queue.notify_writer();
                    }
                }
                // Stopped: the writer thread refused (or will refuse) what is queued.
                None => queue.notify_writer(),
            },
            // Busy (committing, here or on its thread): the writer thread takes them next.
            Err(_) => queue.notify_writer(),
        }
        Ok(())
    }

    /// Runs a writer job that is not a publish (on the writer thread: never on the caller's,
    /// so that a prune step does not block a runtime worker) and waits for its answer.
    async fn run_job<T>(&self, job: Job, rx: oneshot::Receiver<Result<T>>) -> Result<T> {
        match self.inner.queue.push(vec![job]) {
            Ok(()) => self.inner.queue.notify_writer(),
            Err(refused) => refused.into_iter().for_each(Job::refuse),
        }
        rx.await.map_err(|_| shutting_down())?
    }

    /// One prune step (see [`LogWriter::prune`]); the channel's horizon moves in memory too.
    ///
    /// [`LogWriter::prune`]: store::LogWriter::prune
    pub(crate) async fn prune(&self, step: PruneStep) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.run_job(Job::Prune { step, tx }, rx).await?;
        if let Some(channel) = self.inner.registry.by_id(step.channel_id) {
            channel.move_horizon(step.to);
        }
        Ok(())
    }

    /// Expires up to `limit` Welcomes (created before `created_before`, or used before
    /// `used_before`, unix ms): how many went.
    pub(crate) async fn expire_welcomes(
        &self,
        created_before: i64,
        used_before: i64,
        limit: usize,
    ) -> Result<usize> {
        let (tx, rx) = oneshot::channel();
        let job = Job::ExpireWelcomes {
            created_before,
            used_before,
            limit,
            tx,
        };
        self.run_job(job, rx).await
    }

    /// A readiness probe: one small write transaction by the log's writer (between two group
    /// commits), so that a store that cannot write is seen (the gRPC health service).
    pub(crate) async fn probe(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.run_job(Job::Probe { tx }, rx).await
    }

    /// Sets the channel's retention policy, with its `retention.changed` row by `actor`.
    pub(crate) async fn set_retention(
        &self,
        channel: &Channel,
        policy: Policy,
        actor: &Actor,
    ) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let job = Job::SetRetention {
            channel_id: channel.id,
            policy,
            audit: actor.retention(channel.name(), &policy),
            tx,
        };
        self.run_job(job, rx).await
    }

    /// Commit everything submitted so far, then stop the writer (shutdown). Publishes and
    /// creations submitted afterwards are refused: Unavailable("relay is shutting down").
    pub async fn close(&self) {
        self.inner.queue.close();
        let mut stopped = self.inner.queue.stopped.subscribe();
        // The sender lives in the queue, which we hold: this only ends once stopped.
        let _ = stopped.wait_for(|stopped| *stopped).await;
        self.inner.reader.close();
    }
}

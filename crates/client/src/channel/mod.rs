//! One open channel: its façade, the core its workers share, and its commits.
//!
//! Layout: this file is the façade, a [`Channel`]: it starts the channel's workers, reads its
//! inbox, sends (encrypting on the callers' threads), and owns the commit protocol; `core` is
//! the state the workers and the façade share; `commit` the commit protocol.

pub(crate) mod commit;
pub(crate) mod core;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::channel::commit::{CommitMaker, Committer};
use crate::channel::core::{stamp, ChannelCore, End, Progress, Timings, Waker};
use crate::config::MAX_PAYLOAD;
use crate::error::{Error, Result};
use crate::receive::applier::{ApplierQueue, Pool};
use crate::receive::inbox::Message;
use crate::receive::reader::Follower;
use crate::receive::subscriber::Subscriptions;
use crate::relay::retry::Retry;
use crate::relay::transport::pb;
use crate::send::encrypt::{Encryptor, Framing, Trouble};
use crate::send::journal::Journal;
use crate::send::pipeline::SendHandle;
use crate::send::publisher::{Destination, Outbound, Outcome};
use crate::send::sender::Sender;
use crate::shared::Shared;
use crate::sync::{lock, read, seen};
use static_mls::engine::{Engine, Member};

/// A member as the relay attests it (see [`Channel::roster`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RosterMember {
    pub leaf_index: u32,
    pub identity: Vec<u8>,
    /// The account its leaf is bound to; None while unbound.
    pub account: Option<String>,
}
use static_mls::store::Cursor;

/// What a wait for the next message found.
#[derive(Debug)]
pub enum Next {
    Message(Message),
    /// Nothing yet.
    Empty,
    /// The channel has ended and its inbox is empty.
    End,
}

/// Refuses a payload larger than [`MAX_PAYLOAD`].
fn check_payload(payload: &[u8]) -> Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(Error::Invalid(format!(
            "payload of {} bytes exceeds the maximum of {MAX_PAYLOAD} bytes per message",
            payload.len()
        )));
    }
    Ok(())
}

impl Destination for ChannelCore {
    fn name(&self) -> &str {
        &self.name
    }

    fn ended(&self) -> Option<Error> {
        self.is_closed().then(|| self.ended_error())
    }
}

/// One channel of ours, with its background work. See the module docs.
pub struct Channel {
    pub(crate) core: Arc<ChannelCore>,
    encryptor: Arc<Encryptor>,
    committer: Arc<Committer>,
    /// The channel's tasks (its commits of members' proposals; it is followed on the client's
    /// subscriptions).
    pub(crate) tasks: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Channel {
    pub(crate) fn start(
        shared: Arc<Shared>,
        name: &str,
        outbound: mpsc::UnboundedSender<Vec<Outbound>>,
        pool: &Arc<Pool>,
        subscriptions: &Subscriptions,
    ) -> Result<Arc<Self>> {
        let engine = shared.engine()?;
        let cursor = engine.cursor(name)?;
        let epoch = engine.epoch(name)?;
        let applied_seq = match cursor {
            Cursor::After(seq) => seq,
            Cursor::FromEpoch(_) => 0,
        };
        // What an earlier opening left goes first: the outbox's messages as they were, then
        // the journal's payloads it had not encrypted yet. Read before anything starts, so
        // that damage (refused, naming the file) leaves nothing running.
        let outbox = engine.outbox(name)?;
        let recorded = i64::try_from(engine.outbox_recorded(name)?).unwrap_or(i64::MAX);
        // Only what the outbox does not hold yet.
        let (journal, journaled) = Journal::open(engine.data_dir(), name, recorded)?;
        let core = Arc::new(ChannelCore::new(
            Arc::clone(&shared),
            name,
            applied_seq,
            epoch,
        ));
        let applier = ApplierQueue::new(Arc::clone(&core), Arc::clone(pool))?;
        let committer = Arc::new(Committer::new(Arc::clone(&core)));
        let channel = Arc::new(Self {
            encryptor: Arc::new(Encryptor::new(Arc::clone(&core), outbound)),
            committer: Arc::clone(&committer),
            core: Arc::clone(&core),
            tasks: std::sync::Mutex::new(Vec::new()),
        });
        let follower = Follower::new(Arc::clone(&core), applier, cursor);
        let proposals = {
            let core = Arc::clone(&core);
            async move {
                let mut shutdown = core.shutdown.subscribe();
                loop {
                    if seen(&mut shutdown, |down| *down) {
                        return;
                    }
                    tokio::select! {
                        changed = shutdown.changed() => if changed.is_err() { return },
                        () = core.proposals.notified() => committer.commit_proposals().await,
                    }
                }
            }
        };
        subscriptions.follow(follower);
        *lock(&channel.tasks) = vec![shared.handle.spawn(proposals)];
        let last_place = journaled.last().map_or(recorded, |(place, _)| *place);
        let _ = core.pipeline.journal.set(journal);
        let left = !outbox.is_empty() || !journaled.is_empty();
        core.pipeline.preload(outbox, journaled, last_place);
        if left {
            channel.sender().start()?;
        }
        Ok(channel)
    }

    fn sender(&self) -> Sender {
        Sender {
            core: Arc::clone(&self.core),
            encryptor: Arc::clone(&self.encryptor),
            committer: Arc::clone(&self.committer),
        }
    }

    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// What the channel shares with its client (its relay, engine and runtime).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.core.shared
    }

    /// When the latest message passed each stage (see [`Timings`]).
    pub fn timings(&self) -> &Timings {
        &self.core.timings
    }

    pub fn progress(&self) -> Progress {
        self.core.progress()
    }

    /// Closed, removed or failed (set before any waiter is woken).
    pub fn is_closed(&self) -> bool {
        self.core.is_closed()
    }

    /// Stops the background work; messages already received stay in the inbox for the next
    /// opening. Idempotent.
    pub fn close(&self) {
        self.core.end(End::Closed);
    }

    /// Closes the channel and waits until nothing applies its entries any more (what is
    /// being applied is finished), so that a successor may apply the same log.
    pub(crate) fn close_and_settle(&self) {
        self.close();
        drop(lock(&self.core.applying));
    }

    /// Waits until `deadline` for the channel's sender thread, if one runs (the channel has
    /// ended).
    pub(crate) fn join_sender(&self, deadline: Instant) {
        Sender::join(&self.core, deadline);
    }

    /// A readiness socket for one async waiter.
    pub fn waker(&self) -> Result<Waker> {
        self.core.waker()
    }

    /// Takes the next received message without waiting.
    pub fn poll_next(&self) -> Result<Next> {
        let core = &self.core;
        // A closed client ends its channels' iterators.
        let Ok(engine) = core.shared.engine() else {
            return Ok(Next::End);
        };
        if let Some(message) = core.shared.inbox_take(&engine, &core.name)? {
            stamp(&core.timings.handed_out);
            return Ok(Next::Message(message));
        }
        match core.ended() {
            None => Ok(Next::Empty),
            Some(end) => {
                // Messages stored before the end are still handed out.
                if let Some(message) = core.shared.inbox_take(&engine, &core.name)? {
                    return Ok(Next::Message(message));
                }
                match end {
                    End::Failed(_) => Err(core.ended_error()),
                    End::Closed | End::Removed => Ok(Next::End),
                }
            }
        }
    }

    /// Waits up to `timeout` for the next received message (blocking the calling thread).
    pub fn wait_next(&self, timeout: Duration) -> Result<Next> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.core.generation();
            match self.poll_next()? {
                Next::Empty => {}
                other => return Ok(other),
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Next::Empty);
            }
            self.core.wait_signal(seen, deadline - now);
        }
    }

    /// How many received messages wait to be read.
    pub fn pending(&self) -> Result<u64> {
        let core = &self.core;
        let engine = core.shared.engine()?;
        let inbox = core.shared.inbox(&engine, &core.name)?;
        let handed = lock(&inbox).handed;
        Ok(engine.inbox_count_after(&core.name, handed)?)
    }

    /// Makes sure the relay has answered this client once (see `Shared::reach`).
    fn reach(&self) -> Result<()> {
        if self.core.shared.reached() {
            return Ok(());
        }
        self.core.block_on(self.core.shared.reach())
    }

    /// Encrypts `payload` and publishes it; returns once the relay has it in the channel's log.
    ///
    /// Runs on the caller's thread up to the publishing: concurrent senders queue their
    /// payloads, and the one that gets the encryption lock encrypts everything queued in one
    /// transaction (flat combining) and hands the messages to the client's publisher task,
    /// which keeps one pipelined `PublishBatches` call open. Refusals are handled here (see
    /// [`Encryptor::recover`]): a stale epoch is caught up with and the payload encrypted
    /// again; a transient refusal (store unavailable, rate limit) is retried until the retry
    /// deadline, encrypted again too: a refused message is certainly not in the log, and
    /// resending its old bytes after later messages of ours were accepted could put it beyond
    /// the receivers' out-of-order tolerance. A message the relay did not answer for (it may be
    /// in the log) is resent with the same bytes, which the relay's idempotency makes safe.
    pub fn send(&self, payload: Vec<u8>) -> Result<()> {
        check_payload(&payload)?;
        self.send_framed(payload, Framing::default())
    }

    /// [`Channel::send`] of a message framed as `framing` says (a request or a reply: see
    /// `request`); the plain framing is exactly `send`'s.
    pub(crate) fn send_framed(&self, payload: Vec<u8>, framing: Framing) -> Result<()> {
        let core = &self.core;
        core.check_usable()?;
        stamp(&core.timings.send_started);
        self.reach()?;
        // Our own pipelined messages queued before this one go first.
        core.pipeline.wait_drained(|| core.check_usable())?;
        self.committer.ensure_fresh_epoch()?;
        // A wait for the epoch can end with the commit that removed us (the removal and its
        // epoch are one update, see `applier`): say so, rather than encrypt in a deleted group.
        core.check_usable()?;
        let payload = Arc::new(payload);
        let mut retry = Retry::within(core.shared.options.retry_timeout);
        let deadline = retry
            .deadline()
            .unwrap_or_else(|| Instant::now() + core.shared.options.retry_timeout);
        let mut answer = self
            .encryptor
            .encrypt_and_publish(&payload, &framing, deadline);
        let mut reencrypted = 0;
        loop {
            // On the runtime rather than `blocking_recv`, so that the client's close ends the
            // wait at once.
            let outcome = core.block_on(async { answer.await.map_err(|_| core.ended_error()) })?;
            let trouble = match outcome {
                Outcome::Accepted => {
                    stamp(&core.timings.send_acked);
                    return Ok(());
                }
                Outcome::Unanswered(message) => {
                    core.check_usable()?;
                    answer = self
                        .encryptor
                        .republish(vec![message], &framing.key, deadline)
                        .pop()
                        .ok_or_else(|| Error::Internal("a resend was lost".into()))?;
                    continue;
                }
                Outcome::Failed(e) => Trouble::Failed(e),
                Outcome::Refused(refusal) => Trouble::Refused(refusal),
            };
            self.encryptor
                .recover(trouble, &mut retry, &mut reencrypted)?;
            core.check_usable()?;
            answer = self
                .encryptor
                .encrypt_and_publish(&payload, &framing, deadline);
        }
    }

    /// Records `payload` in the channel's journal (in the OS's hands when this returns: a
    /// killed process loses nothing, see `journal`) and queues it to be encrypted into the
    /// outbox and published in order after what this channel's pipeline already holds (see
    /// `sender`). Waits while the pipeline is full, unless `block` is false: then `Ok(None)`
    /// (also while the relay has not answered this client yet, since reaching it may take up
    /// to the connect timeout).
    pub fn send_pipelined(&self, payload: Vec<u8>, block: bool) -> Result<Option<SendHandle>> {
        let core = &self.core;
        check_payload(&payload)?;
        core.check_usable()?;
        if !core.shared.reached() {
            if !block {
                return Ok(None);
            }
            self.reach()?;
        }
        if !core.pipeline.wait_for_room(block, || core.check_usable())? {
            return Ok(None);
        }
        let journal = core
            .pipeline
            .journal
            .get()
            .ok_or_else(|| Error::Internal("the channel has no outbox journal".into()))?;
        let handle = core
            .pipeline
            .submit(payload, |place, payload| journal.append(place, payload))?;
        self.sender().start()?;
        Ok(Some(handle))
    }

    /// How many messages [`Channel::send_pipelined`] ever accepted on this channel in this
    /// data directory (a count an application can resume from after a crash: every call that
    /// returned is in it).
    pub fn pipelined_count(&self) -> u64 {
        u64::try_from(self.core.pipeline.last_place()).unwrap_or(0)
    }

    /// How many messages were queued on the pipeline by this opening (the outbox an earlier
    /// opening left included).
    pub fn pipelined(&self) -> u64 {
        self.core.pipeline.submitted()
    }

    /// Waits up to `timeout` until the first `target` pipelined messages are settled:
    /// `Ok(true)` then, or the first of them that failed since the last flush; `Ok(false)` if
    /// some are still on their way.
    pub fn flush_until(&self, target: u64, timeout: Duration) -> Result<bool> {
        self.core.pipeline.flush_until(target, timeout)
    }

    fn commit(&self, make: Arc<CommitMaker>) -> Result<Option<Vec<u8>>> {
        self.core.block_on(self.committer.commit(make))
    }

    /// Adds the owner of `key_package`; returns the Welcome once the commit is in the log and
    /// merged.
    pub fn add_member(&self, key_package: Vec<u8>) -> Result<Vec<u8>> {
        let welcome = self.commit(Arc::new(move |e: &Engine, name: &str| {
            let out = e.add_member(name, &key_package)?;
            Ok(Some((out.commit, Some(out.welcome))))
        }))?;
        welcome.ok_or_else(|| Error::Internal("the commit produced no Welcome".into()))
    }

    /// Removes the member(s) with credential identity `identity`.
    pub fn remove_member(&self, identity: Vec<u8>) -> Result<()> {
        self.commit(Arc::new(move |e: &Engine, name: &str| {
            Ok(Some((e.remove_member(name, &identity)?, None)))
        }))?;
        Ok(())
    }

    /// Rotates our leaf keys (post-compromise security).
    pub fn rotate_keys(&self) -> Result<()> {
        self.commit(Arc::new(|e: &Engine, name: &str| {
            Ok(Some((e.self_update(name)?, None)))
        }))?;
        Ok(())
    }

    /// Proposes our removal and waits until a member commits it (the channel then ends).
    pub fn leave(&self) -> Result<()> {
        self.core.block_on(self.committer.leave())
    }

    /// The members' identities, by leaf index.
    pub fn members(&self) -> Result<Vec<Member>> {
        let shared = &self.core.shared;
        shared.check_open()?;
        match shared.engine()?.members(&self.core.name) {
            Ok(members) => Ok(members),
            // A commit removed us (the engine deleted the group): the roster it left.
            Err(e) => lock(&self.core.removed_roster).clone().ok_or(e.into()),
        }
    }

    /// The members as the relay attests them: each leaf's identity with the account it is
    /// bound to (None while unbound, e.g. added but not joined yet), and the relay's epoch.
    pub fn roster(&self) -> Result<(u64, Vec<RosterMember>)> {
        let shared = Arc::clone(&self.core.shared);
        let name = self.core.name.clone();
        let call = async move {
            let mut retry = Retry::within(shared.options.retry_timeout);
            let answer = shared
                .call(
                    "ListMembers",
                    &mut retry,
                    || pb::ListMembersRequest {
                        channel: name.clone(),
                    },
                    |mut relay, request| async move { relay.list_members(request).await },
                    |_| false,
                )
                .await?
                .map_err(|refusal| refusal.into_error("ListMembers"))?;
            let members = answer
                .members
                .into_iter()
                .map(|m| RosterMember {
                    leaf_index: m.leaf_index,
                    identity: m.identity.to_vec(),
                    account: m.bound.then_some(m.account),
                })
                .collect();
            Ok((answer.epoch, members))
        };
        self.core.block_on(call)
    }

    /// The group's epoch; once a commit removed us (the engine deleted the group), that
    /// commit's epoch.
    pub fn epoch(&self) -> Result<u64> {
        match self.core.shared.engine()?.epoch(&self.core.name) {
            Ok(epoch) => Ok(epoch),
            Err(e) => {
                let progress = read(&self.core.progress, Clone::clone);
                match progress.ended {
                    Some(End::Removed) => Ok(progress.epoch),
                    _ => Err(e.into()),
                }
            }
        }
    }

    pub fn epoch_authenticator(&self) -> Result<Vec<u8>> {
        Ok(self
            .core
            .shared
            .engine()?
            .epoch_authenticator(&self.core.name)?)
    }

    /// Waits until the first subscription is established (or the channel failed).
    pub(crate) async fn wait_connected(&self, timeout: Duration) -> Result<()> {
        self.core.wait_connected(timeout).await
    }
}

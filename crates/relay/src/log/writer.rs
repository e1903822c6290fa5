//! The writer: one group commit of what was queued, then memory (rings, heads, epochs, groups)
//! and the publishers' answers.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use bytes::Bytes;

use super::channel::Channel;
use super::queue::{CreateJob, Job, Publish, Queue};
use super::{Accepted, Entry, GroupCheck, MAX_BATCH};
use crate::clock::now_ms;
use crate::error::{RelayError, Result};
use crate::observe::metrics;
use crate::store::{Append, Binding, Change, Creation, LogWriter, NewChannel};
use crate::wire::fence::{Decision, Plan, Tentative};

/// The writer thread: commits what the submitters could not (the writer was busy), until
/// closed; then closes the writer (its connection and checkpointer).
pub(super) fn run_writer(queue: &Queue, writer: &Mutex<Option<Writer>>) {
    let lock = || writer.lock().unwrap_or_else(PoisonError::into_inner);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while queue.wait_for_jobs() {
        let mut held = lock();
        let Some(writer) = held.as_mut() else { break };
        // Possibly nothing: a submitter committed it meanwhile.
        queue.take_now(&mut batch);
        if !batch.is_empty() {
            writer.commit(batch.drain(..));
        }
    }
    lock().take();
}

pub(super) struct Writer {
    pub(super) store: Box<dyn LogWriter>,
    pub(super) window: u64,
    /// Scratch space of [`Writer::commit`], kept to reuse its allocations.
    pub(super) publishes: Vec<Publish>,
    pub(super) others: Vec<Job>,
}

impl Writer {
    /// Commit `jobs` (taken from the queue, in order): the publishes in one group commit.
    pub(super) fn commit(&mut self, jobs: impl IntoIterator<Item = Job>) {
        let mut publishes = std::mem::take(&mut self.publishes);
        let mut others = std::mem::take(&mut self.others);
        for job in jobs {
            match job {
                Job::Publish(p) => publishes.push(p),
                other => others.push(other),
            }
        }
        if !publishes.is_empty() {
            self.publish(&mut publishes);
        }
        // Rare, each in its own small transaction, after the publishes (which wait for
        // nothing else). A publish never depends on a create of its batch: a channel is
        // handed out only once created. A binding decided after the batch's commits sees
        // their epoch (and is refused if one moved the channel on).
        for job in others.drain(..) {
            match job {
                Job::Create(create) => {
                    let result = self.create(&create);
                    let _ = create.tx.send(result);
                }
                Job::Bind {
                    channel_id,
                    epoch,
                    leaf,
                    account,
                    key_id,
                    tx,
                } => {
                    let binding = Binding {
                        channel_id,
                        epoch,
                        leaf,
                        account: &account,
                        key_id: key_id.as_deref(),
                        now_ms: now_ms(),
                    };
                    let _ = tx.send(self.store.bind(&binding));
                }
                Job::Prune { step, tx } => {
                    let _ = tx.send(self.store.prune(&step));
                }
                Job::ExpireWelcomes {
                    created_before,
                    used_before,
                    limit,
                    tx,
                } => {
                    let _ = tx.send(
                        self.store
                            .expire_welcomes(created_before, used_before, limit),
                    );
                }
                Job::SetRetention {
                    channel_id,
                    policy,
                    audit,
                    tx,
                } => {
                    let set = self
                        .store
                        .set_retention(channel_id, &policy, audit.as_ref());
                    let _ = tx.send(set);
                }
                Job::Probe { tx } => {
                    let _ = tx.send(self.store.probe(now_ms()));
                }
                Job::Publish(_) => {}
            }
        }
        self.publishes = publishes;
        self.others = others;
    }

    fn create(&mut self, create: &CreateJob) -> Result<i64> {
        let channel = NewChannel {
            name: &create.name,
            org: &create.org,
            account: &create.account,
            state: &create.state,
            leaf: create.leaf,
            audit: &create.audit,
            claimed: create.claimed.as_ref(),
            key_id: create.key_id.as_deref(),
        };
        match self.store.create_channel(&channel)? {
            Creation::Done(id) => Ok(id),
            Creation::NameTaken => Err(RelayError::AlreadyExists(format!(
                "channel '{}' already exists",
                create.name
            ))),
            Creation::OrgTaken => Err(RelayError::PermissionDenied(format!(
                "org '{}' belongs to another account",
                create.org
            ))),
        }
    }

    /// One group commit of `batch` (emptied): decide and store, publish to memory, answer.
    fn publish(&mut self, batch: &mut Vec<Publish>) {
        let metrics = metrics::metrics();
        let started = Instant::now();
        let appended = self.store.append(&appends(batch), self.window);
        metrics
            .store_commit
            .observe(started.elapsed().as_secs_f64());
        let plan = match appended {
            Ok(plan) => plan,
            Err(err) => {
                // Once per failed group commit (each publisher's call is refused as well).
                metrics.store_failures.inc();
                ::log::error!(
                    target: "static.relay",
                    "store failure: a group commit of {} publishes failed: {err}",
                    batch.len()
                );
                // Nothing was stored and memory is untouched.
                for p in batch.drain(..) {
                    let _ = p.tx.send(Err(err.clone()));
                }
                return;
            }
        };
        committed(batch, &plan);
        // Answers before wake-ups: what a publisher was told is already readable (heads moved
        // above), and its answer does not wait behind the deliveries it causes.
        let changed: Vec<Arc<Channel>> = changed(batch, &plan)
            .map(|(channel, _)| Arc::clone(channel))
            .collect();
        for (p, decision) in batch.drain(..).zip(plan.decisions) {
            let answer = match decision {
                Decision::Append {
                    seq,
                    channel_epoch,
                    starts_epoch,
                } => {
                    let kind = if starts_epoch {
                        metrics.commits.inc();
                        "commit"
                    } else {
                        "application"
                    };
                    metrics.published.with_label_values(&[kind]).inc();
                    Ok(Accepted {
                        seq,
                        epoch: channel_epoch,
                        duplicate: false,
                    })
                }
                Decision::Duplicate { seq, channel_epoch } => {
                    metrics.published.with_label_values(&["duplicate"]).inc();
                    Ok(Accepted {
                        seq,
                        epoch: channel_epoch,
                        duplicate: true,
                    })
                }
                Decision::Refused(err) => Err(err),
            };
            metrics
                .publish_to_ack
                .observe(metrics::since_ns(p.submitted).as_secs_f64());
            let _ = p.tx.send(answer);
        }
        for channel in changed {
            channel.wake();
        }
    }
}

/// The channels `plan` appends to, with their new head and epoch.
fn changed<'a>(
    batch: &'a [Publish],
    plan: &'a Plan,
) -> impl Iterator<Item = (&'a Arc<Channel>, &'a Tentative)> + 'a {
    plan.changed()
        .filter_map(|(_, t)| Some((&batch.get(t.index)?.channel, t)))
}

/// The publishes of `batch` as the store decides and appends them.
fn appends(batch: &[Publish]) -> Vec<Append<'_>> {
    batch
        .iter()
        .map(|p| {
            let change = match &p.checked.group {
                GroupCheck::Valid(Some(change)) => Some(Change {
                    epoch: change.epoch,
                    state: &change.state,
                    removed: &change.removed,
                    added: &change.added,
                    audit: change.audit(),
                }),
                _ => None,
            };
            Append {
                channel_id: p.channel.id(),
                memory: &*p.channel,
                legacy: p.channel.is_legacy(),
                header: &p.checked.header,
                key: &p.checked.key,
                message: &p.checked.message,
                welcome: &p.checked.welcome,
                welcome_refs: &p.checked.welcome_refs,
                account: &p.checked.account,
                other_epoch: matches!(p.checked.group, GroupCheck::OtherEpoch),
                change,
            }
        })
        .collect()
}

/// The batch is durable: rings, heads and epochs (the subscribers are woken once the
/// publishers are answered).
fn committed(batch: &[Publish], plan: &Plan) {
    for (p, decision) in batch.iter().zip(&plan.decisions) {
        if let Decision::Append { seq, .. } = *decision {
            p.channel.ring().push(Entry {
                seq,
                epoch: p.checked.header.epoch,
                content_type: p.checked.header.content_type as u32,
                // A copy of its own: the request's bytes may be a slice of a larger receive
                // buffer, which the ring would otherwise keep whole (uncounted).
                message: Bytes::copy_from_slice(&p.checked.message),
                account: Arc::clone(&p.checked.account),
            });
            p.channel.cache().cached(&p.channel, seq);
            p.channel
                .head_submitted
                .store(p.submitted, Ordering::Release);
            p.channel.head_submitted_seq.store(seq, Ordering::Release);
            if let GroupCheck::Valid(Some(change)) = &p.checked.group {
                // Before the epoch moves (below): whoever sees the new epoch finds the group
                // that goes with it.
                let mut members = p.channel.members();
                let applied = members.as_mut().map(|m| m.apply(change, seq));
                if !matches!(applied, Some(Ok(()))) {
                    // Not loaded, or unreadable: the store has it.
                    *members = None;
                }
            }
        }
    }
    for (channel, t) in changed(batch, plan) {
        channel.move_forward(t.head, t.epoch);
        channel.touch(channel.cache().now());
    }
}

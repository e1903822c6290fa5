//! The loaded channels (by name and by id): loading them, and unloading the idle ones.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::cache::Cache;
use super::channel::Channel;
use crate::store::{self, ChannelRow};

/// The loaded channels, by name and by id; shared with the store (PostgreSQL moves their
/// heads on other relays' commits).
pub(crate) struct Registry {
    state: Mutex<RegistryState>,
    pub(super) cache: Arc<Cache>,
}

#[derive(Default)]
struct RegistryState {
    /// scope -> name -> channel (nested: looked up by `&str`, no key built per lookup). The
    /// scope is the row's: '' for the channel holding its name, 'legacy:<account>' for a
    /// legacy channel another one shadows.
    by_name: HashMap<String, HashMap<String, Arc<Channel>>>,
    /// The names a legacy channel shadows (read at open; no new ones are ever made).
    shadowed: HashSet<String>,
    by_id: HashMap<i64, Arc<Channel>>,
    /// Loads in flight (their rows read, their channels not yet here)...
    loading: usize,
    /// ...and the heads announced meanwhile for channels not here (by another relay's commit,
    /// or as they were when unloaded), so that none is missed between reading a row and
    /// remembering its channel. Emptied when no load is in flight.
    announced: HashMap<i64, (u64, u64)>,
}

impl store::Heads for Registry {
    fn loaded_ids(&self) -> Vec<i64> {
        Registry::loaded_ids(self)
    }

    fn advance(&self, id: i64, head: u64, epoch: u64) {
        Registry::advance(self, id, head, epoch);
    }
}

impl Registry {
    /// No channel loaded yet; their rings hold at most `cache_bytes` together.
    pub(super) fn new(cache_bytes: usize) -> Registry {
        Registry {
            state: Mutex::default(),
            cache: Arc::new(Cache::new(cache_bytes)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RegistryState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The channel `name` as `account` reaches it, if loaded. For a shadowed name only the
    /// account's own legacy channel is looked up here: whether it has one, the store knows.
    pub(super) fn loaded(&self, account: &str, name: &str) -> Option<Arc<Channel>> {
        let state = self.lock();
        let channel = if state.shadowed.contains(name) {
            let scope = legacy_scope(account);
            state.by_name.get(&scope)?.get(name)
        } else {
            state.by_name.get("")?.get(name)
        }?;
        channel.touch(self.cache.now());
        Some(Arc::clone(channel))
    }

    pub(super) fn set_shadowed(&self, names: Vec<String>) {
        self.lock().shadowed = names.into_iter().collect();
    }

    /// A committed head (and the epoch after it) of channel `id`, from any relay.
    pub(crate) fn advance(&self, id: i64, head: u64, epoch: u64) {
        let channel = {
            let mut state = self.lock();
            match state.by_id.get(&id) {
                Some(channel) => Arc::clone(channel),
                None => {
                    if state.loading > 0 {
                        state.announce(id, head, epoch);
                    }
                    return;
                }
            }
        };
        // Outside the registry's lock: waking the channel's subscribers takes its head watch's
        // lock, and no lock is held across another. Moving a head is monotonic (a max), so a
        // channel unloaded meanwhile is only moved forward, unseen.
        channel.advance(head, epoch);
    }

    /// Unloads the channels that nothing but the registry holds (no call, stream or publish
    /// in flight) and that nobody used for `idle`; returns how many. Their memory (ring, group
    /// state, bindings) is freed here, outside the registry's lock.
    ///
    /// Exact on both stores: a channel is only unloaded once no publish holds it, so whatever
    /// memory knew of it is durable (heads and group move in memory only after COMMIT), and a
    /// load reads its row again. A load in flight may have read its row before a commit that
    /// this unload outlived: it gets the unloaded channel's head and epoch (`announced`).
    pub(crate) fn unload_idle(&self, idle: Duration) -> usize {
        let now = self.cache.now();
        let idle = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let mut unloaded = Vec::new();
        {
            let mut guard = self.lock();
            let state = &mut *guard;
            state.by_id.retain(|_, channel| {
                // Two references, `by_name`'s and this one: nobody else holds it, and nobody
                // can take one meanwhile (they are only cloned from here, under this lock).
                if Arc::strong_count(channel) > 2 {
                    channel.touch(now);
                    return true;
                }
                if now.saturating_sub(channel.used.load(Ordering::Relaxed)) < idle {
                    return true;
                }
                unloaded.push(Arc::clone(channel));
                false
            });
            for channel in &unloaded {
                if let Some(names) = state.by_name.get_mut(&channel.scope) {
                    names.remove(&channel.name);
                    if names.is_empty() {
                        state.by_name.remove(&channel.scope);
                    }
                }
                if state.loading > 0 {
                    state.announce(channel.id, channel.head_seq(), channel.epoch());
                }
            }
            if !unloaded.is_empty() {
                shrink(&mut state.by_id);
                shrink(&mut state.by_name);
                if let Some(names) = state.by_name.get_mut("") {
                    shrink(names);
                }
            }
        }
        let count = unloaded.len();
        if count > 0 {
            drop(unloaded);
            self.cache.forget_unloaded();
        }
        count
    }

    /// How many channels are loaded.
    pub(super) fn loaded_count(&self) -> usize {
        self.lock().by_id.len()
    }

    /// The loaded channel `id`.
    pub(super) fn by_id(&self, id: i64) -> Option<Arc<Channel>> {
        self.lock().by_id.get(&id).cloned()
    }

    /// The ids of the loaded channels.
    pub(crate) fn loaded_ids(&self) -> Vec<i64> {
        self.lock().by_id.keys().copied().collect()
    }

    /// Marks a load in flight until the guard is dropped.
    pub(super) fn loading(self: &Arc<Self>) -> Loading {
        self.lock().loading += 1;
        Loading(Arc::clone(self))
    }

    /// The channel just loaded or created, unless another load got there first: then that
    /// one, so that each channel has one `Channel`. Heads announced since its row was read
    /// are applied.
    pub(super) fn remember(&self, name: &str, row: ChannelRow) -> Arc<Channel> {
        let mut state = self.lock();
        let id = row.id;
        let existing = state
            .by_name
            .get(&row.scope)
            .and_then(|names| names.get(name));
        let channel = match existing {
            Some(existing) => Arc::clone(existing),
            None => {
                let scope = row.scope.clone();
                let channel = Arc::new(Channel::new(name, row, &self.cache));
                state
                    .by_name
                    .entry(scope)
                    .or_default()
                    .insert(name.to_owned(), Arc::clone(&channel));
                state.by_id.insert(id, Arc::clone(&channel));
                channel
            }
        };
        if let Some((head, epoch)) = state.announced.remove(&id) {
            channel.advance(head, epoch);
        }
        channel.touch(self.cache.now());
        channel
    }
}

impl RegistryState {
    fn announce(&mut self, id: i64, head: u64, epoch: u64) {
        let seen = self.announced.entry(id).or_insert((head, epoch));
        *seen = (seen.0.max(head), seen.1.max(epoch));
    }
}

/// Gives back a map's room once it holds far fewer than it could (after an unload).
fn shrink<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() < map.capacity() / 4 {
        map.shrink_to_fit();
    }
}

/// The row scope of `account`'s legacy channels that another channel's name shadows.
fn legacy_scope(account: &str) -> String {
    format!("legacy:{account}")
}

/// A load in flight (see [`Registry::announced`]).
pub(super) struct Loading(Arc<Registry>);

impl Drop for Loading {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.loading -= 1;
        if state.loading == 0 {
            state.announced.clear();
        }
    }
}

/// Unloads the channels idle for `idle`, checking every quarter of it (so a channel goes at
/// most 1.25 `idle` after its last use), until the writer stops.
pub(super) async fn unload_idle_channels(
    registry: Arc<Registry>,
    idle: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let every = (idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(15));
    loop {
        tokio::select! {
            _ = stopped.wait_for(|stopped| *stopped) => return,
            () = tokio::time::sleep(every) => {}
        }
        if registry.unload_idle(idle) > 0 {
            // What they held is free but still resident (glibc's arenas): give it back, off
            // the runtime's workers, one trim at a time (see `crate::memory`).
            let _ = tokio::task::spawn_blocking(crate::memory::give_back).await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A load that read its row before a commit, while the channel was unloaded after that
    /// commit: it gets the unloaded channel's head and epoch, not its row's.
    #[test]
    fn a_load_in_flight_gets_the_head_of_a_channel_unloaded_meanwhile() {
        let registry = Arc::new(Registry::new(1024 * 1024));
        let row = |head_seq, epoch| ChannelRow {
            id: 7,
            epoch,
            head_seq,
            scope: String::new(),
            legacy_owner: None,
            horizon: 0,
        };
        let stale = row(3, 1);
        let loaded = registry.remember("org/ns/c", row(3, 1));
        loaded.advance(5, 2);
        drop(loaded);
        let loading = registry.loading();
        assert_eq!(registry.unload_idle(Duration::ZERO), 1);
        let again = registry.remember("org/ns/c", stale);
        assert_eq!((again.head_seq(), again.epoch()), (5, 2));
        drop((again, loading));
        // No load in flight: nothing is remembered of what was unloaded.
        assert_eq!(registry.unload_idle(Duration::ZERO), 1);
        assert!(registry.lock().announced.is_empty());
        let fresh = registry.remember("org/ns/c", row(9, 4));
        assert_eq!((fresh.head_seq(), fresh.epoch()), (9, 4));
    }
}

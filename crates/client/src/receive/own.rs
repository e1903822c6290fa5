//! Our own messages, remembered so that their echo from the relay (it sends everyone's
//! messages to every subscriber, ours included) is passed over without the engine.

use std::collections::HashMap;

use super::entry::{LogItem, APPLICATION};
/// Our own messages remembered for the applier to skip: at most this many, of at most
/// [`OWN_MESSAGE_BYTES`] each.
const OWN_MESSAGES: usize = 4096;
const OWN_MESSAGE_BYTES: usize = 16 * 1024;

/// The application messages we encrypted and that may still come back from the relay (it
/// sends everyone's messages to every subscriber, ours included), by the last 8 bytes of
/// their ciphertext (the end of the AEAD tag: random).
#[derive(Default)]
pub(crate) struct OwnMessages {
    by_tag: HashMap<[u8; 8], Vec<u8>>,
}

impl OwnMessages {
    fn key(message: &[u8]) -> Option<[u8; 8]> {
        message
            .len()
            .checked_sub(8)
            .and_then(|start| message.get(start..))
            .and_then(|tail| tail.try_into().ok())
    }

    pub(crate) fn remember(&mut self, message: &[u8]) {
        if message.len() > OWN_MESSAGE_BYTES {
            return;
        }
        if self.by_tag.len() >= OWN_MESSAGES {
            // Messages that never came back (refused, or sent while not subscribed): forget
            // them all; this only costs the engine's time.
            self.by_tag.clear();
        }
        if let Some(key) = Self::key(message) {
            self.by_tag.insert(key, message.to_vec());
        }
    }

    /// Whether every entry of `batch` is an application message of ours (byte for byte),
    /// forgetting them if so; otherwise nothing changes.
    pub(crate) fn take_all(&mut self, batch: &[LogItem]) -> bool {
        let ours = |item: &LogItem| {
            item.kind == APPLICATION
                && Self::key(&item.message)
                    .and_then(|key| self.by_tag.get(&key))
                    .is_some_and(|m| *m == item.message)
        };
        if self.by_tag.is_empty() || !batch.iter().all(ours) {
            return false;
        }
        for item in batch {
            self.take(&item.message);
        }
        true
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_tag.is_empty()
    }

    /// Whether `message` is one of ours (byte for byte), forgetting it.
    pub(crate) fn take(&mut self, message: &[u8]) -> bool {
        let Some(key) = Self::key(message) else {
            return false;
        };
        if self.by_tag.get(&key).is_some_and(|m| m == message) {
            self.by_tag.remove(&key);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_messages_are_recognised_byte_for_byte() {
        let mut own = OwnMessages::default();
        let ours: Vec<u8> = (0..100).collect();
        own.remember(&ours);
        own.remember(b"short");
        let mut same_tag = vec![7u8; 100];
        same_tag[92..].copy_from_slice(&ours[92..]);
        assert!(!own.take(&same_tag));
        assert!(!own.take(b"tiny"));
        assert!(own.take(&ours));
        assert!(!own.take(&ours));
        own.remember(&vec![0; OWN_MESSAGE_BYTES + 1]);
        assert!(own.by_tag.is_empty());
    }

    fn item(seq: u64, kind: u32, message: &[u8]) -> LogItem {
        LogItem {
            seq,
            kind,
            message: message.to_vec(),
            account: String::new(),
        }
    }

    #[test]
    fn a_batch_is_taken_as_ours_only_if_every_entry_is() {
        let mut own = OwnMessages::default();
        let (a, b) = (vec![1u8; 100], vec![2u8; 100]);
        own.remember(&a);
        own.remember(&b);
        let entry = |m: &Vec<u8>| item(1, APPLICATION, m);
        // One stranger (or a commit) in the batch: nothing is forgotten.
        assert!(!own.take_all(&[entry(&a), entry(&vec![3u8; 100])]));
        assert!(!own.take_all(&[entry(&a), item(2, APPLICATION + 1, &b)]));
        assert_eq!(own.by_tag.len(), 2);
        assert!(own.take_all(&[entry(&a), entry(&b)]));
        assert!(own.by_tag.is_empty());
        assert!(!own.take_all(&[entry(&a)]));
    }
}

//! Application messages out: encrypting one or a batch, syncing before a send, and the rule
//! that a group may need a new epoch first.

use super::*;

fn check_payload(payload: &[u8]) -> Result<(), EncryptError> {
    if payload.len() > MAX_INPUT_LEN {
        return Err(EncryptError::PayloadTooLarge { len: payload.len() });
    }
    Ok(())
}

/// One plaintext to encrypt: its authenticated data (empty for a plain message; a kind byte
/// for request/reply, see [`crate::request`]) and its payload.
pub type Framed<'a> = (&'a [u8], &'a [u8]);

/// One application message, serialized.
fn create_message(
    group: &mut MlsGroup,
    provider: &Provider<'_>,
    signer: &Ed25519Signer,
    channel: &str,
    (aad, payload): Framed<'_>,
) -> Result<Vec<u8>> {
    // Encrypting advances our ratchet of the current epoch and nothing else (OpenMLS's
    // `encrypt` takes `message_secrets_mut()`): the past epochs' part is not rewritten.
    let _scope = provider.storage().scoped(Scope::CurrentEpoch);
    // The AAD is the group's in memory, for the next message only (OpenMLS resets it after a
    // message; reset here too, so that a failure leaves none for the next plain message).
    group.set_aad(aad.to_vec());
    let msg = group.create_message(provider, signer, payload);
    if !aad.is_empty() {
        group.set_aad(Vec::new());
    }
    let msg = msg.map_err(|e| match e {
        CreateMessageError::GroupStateError(MlsGroupStateError::PendingProposal) => {
            EncryptError::PendingProposals {
                channel: channel.to_owned(),
            }
        }
        e => EncryptError::Create {
            channel: channel.to_owned(),
            detail: openmls_detail(&e),
        },
    })?;
    serialize(&msg)
}

impl Engine {
    /// Encrypts an application message (a PrivateMessage in an `MLSMessage`).
    pub fn encrypt(&self, channel: &str, payload: &[u8]) -> Result<Vec<u8>> {
        check_payload(payload)?;
        self.with_group(channel, |group, provider, conn| {
            self.check_may_encrypt(group, conn, channel)?;
            create_message(group, provider, &self.signer, channel, (&[], payload))
        })
    }

    /// Encrypts several application messages in one durable transaction (one disk sync for
    /// the batch): all or none.
    pub fn encrypt_many(&self, channel: &str, payloads: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        self.encrypt_with_durability(channel, payloads, true)
    }

    /// [`Engine::encrypt_many`] whose transaction does not wait for the disk: the caller MUST
    /// call [`Engine::sync_before_send`] before any returned message leaves the process (a
    /// message sent from a state a power loss could take back would let a later message reuse
    /// its generation, and so its key and nonce, unless that loss is detected). Lets a sender
    /// encrypt the next batch while the previous one is being synced.
    pub fn encrypt_many_unsynced(&self, channel: &str, payloads: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        self.encrypt_with_durability(channel, payloads, false)
    }

    /// [`Engine::encrypt_many_unsynced`] of plaintexts each with its authenticated data (an
    /// empty one gives exactly a plain message): the same rule about syncing before sending.
    pub fn encrypt_framed_unsynced(
        &self,
        channel: &str,
        items: &[Framed<'_>],
    ) -> Result<Vec<Vec<u8>>> {
        self.encrypt_framed_then(channel, items, false, |_, _, messages| Ok(messages))
    }

    /// Waits until every transaction committed so far is on disk: syncs the write-ahead log,
    /// which holds every commit not yet checkpointed (checkpoints sync the database file).
    pub fn sync(&self) -> Result<()> {
        store::checkpoint::sync_wal(&self.data_dir.join(store::DB_FILE)).map_err(Into::into)
    }

    /// What a sender calls between [`Engine::encrypt_many_unsynced`] and sending the
    /// messages. Where the machine has a boot id this does not wait for the disk: the messages
    /// are written (a killed process loses nothing) and a power loss or crash of the machine is
    /// detected at the next opening, which then requires a new epoch before encrypting again
    /// (see [`Engine::open`]). Elsewhere it is [`Engine::sync`].
    pub fn sync_before_send(&self) -> Result<()> {
        if self.boot_id.is_some() {
            Ok(())
        } else {
            self.sync()
        }
    }

    /// The API key that last bound our leaf of `channel` on the relay, as recorded by
    /// [`Engine::set_bound_key`] (None: never recorded, e.g. bound by an older version).
    pub fn bound_key(&self, channel: &str) -> Result<Option<String>> {
        let db = lock(&self.db);
        Ok(store::rows::bound_key(&db.conn, channel)?)
    }

    /// Records that `key_id` bound our leaf of `channel` on the relay (a channel we are not in
    /// records nothing).
    pub fn set_bound_key(&self, channel: &str, key_id: &str) -> Result<()> {
        if !self.has_group(channel) {
            return Ok(());
        }
        let db = lock(&self.db);
        store::rows::set_bound_key(&db.conn, channel, key_id)?;
        Ok(())
    }

    /// Whether we must commit (e.g. [`Engine::self_update`]) before encrypting in `channel`:
    /// only after the machine went down while the engine was open (see [`Engine::open`]).
    pub fn needs_fresh_epoch(&self, channel: &str) -> Result<bool> {
        if !self.fresh_epochs_needed.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let db = lock(&self.db);
        Ok(store::rows::fresh_epoch_needed(&db.conn, channel)?)
    }

    /// Refuses to encrypt where MLS forbids it (proposals pending: said here, in words the
    /// caller can match, rather than by OpenMLS's refusal) or where our sending generations of
    /// the epoch may have been lost.
    fn check_may_encrypt(
        &self,
        group: &MlsGroup,
        conn: &rusqlite::Connection,
        channel: &str,
    ) -> Result<()> {
        if group.has_pending_proposals() {
            return Err(EncryptError::PendingProposals {
                channel: channel.to_owned(),
            }
            .into());
        }
        if self.fresh_epochs_needed.load(Ordering::Relaxed)
            && store::rows::fresh_epoch_needed(conn, channel)?
        {
            return Err(EncryptError::FreshEpochNeeded {
                channel: channel.to_owned(),
            }
            .into());
        }
        Ok(())
    }

    fn encrypt_with_durability(
        &self,
        channel: &str,
        payloads: &[&[u8]],
        durable: bool,
    ) -> Result<Vec<Vec<u8>>> {
        self.encrypt_then(channel, payloads, durable, |_, _, messages| Ok(messages))
    }

    /// Encrypts `payloads` in one transaction and hands the messages, with their epoch, to
    /// `record`, inside that transaction (the outbox records them there: `crate::outbox`).
    pub(crate) fn encrypt_then<T>(
        &self,
        channel: &str,
        payloads: &[&[u8]],
        durable: bool,
        record: impl FnOnce(&rusqlite::Connection, u64, Vec<Vec<u8>>) -> Result<T>,
    ) -> Result<T> {
        let items: Vec<Framed<'_>> = payloads.iter().map(|p| (&[][..], *p)).collect();
        self.encrypt_framed_then(channel, &items, durable, record)
    }

    /// [`Engine::encrypt_then`] of plaintexts with their authenticated data.
    fn encrypt_framed_then<T>(
        &self,
        channel: &str,
        payloads: &[Framed<'_>],
        durable: bool,
        record: impl FnOnce(&rusqlite::Connection, u64, Vec<Vec<u8>>) -> Result<T>,
    ) -> Result<T> {
        for (_, payload) in payloads {
            check_payload(payload)?;
        }
        self.with_group_durability(channel, durable, |group, provider, conn| {
            self.check_may_encrypt(group, conn, channel)?;
            // One write of the ratchet state for the batch, not one per message (the
            // transaction commits it before any ciphertext is returned).
            if payloads.len() > 1 {
                provider.storage().defer_message_secrets();
            }
            let messages = payloads
                .iter()
                .map(|item| create_message(group, provider, &self.signer, channel, *item))
                .collect::<Result<Vec<_>>>()?;
            record(conn, group.epoch().as_u64(), messages)
        })
    }
}

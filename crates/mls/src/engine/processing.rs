//! The relay's log in: processing one message or a batch of entries, in log order.

use super::*;

impl Engine {
    /// Processes the next message of the channel's log (public or private framing).
    pub fn process_incoming(&self, channel: &str, message: &[u8]) -> Result<Incoming> {
        let protocol = parse_for_channel(channel, message)?;
        let mut removed = false;
        let result = self.with_group(channel, |group, provider, conn| {
            let incoming = apply_message(channel, group, provider, conn, protocol, message)?;
            removed = matches!(incoming, Incoming::Removed { .. });
            Ok(incoming)
        });
        self.after_processing(channel, removed, result.as_ref().is_ok_and(changes_epoch));
        result
    }

    /// Applies entries of the channel's log in order, in ONE transaction: each entry's
    /// MLS state change, the channel's cursor (the last seq applied) and, for application
    /// messages, the decrypted payload in the inbox land together, so a crash can neither lose
    /// a decrypted message nor apply an entry twice. An entry that cannot be processed (not
    /// decryptable for us, malformed, from before we joined) is skipped with its error (its
    /// partial effects rolled back); a storage failure fails the whole batch. Processing stops
    /// after a commit that removed us.
    pub fn process_entries(&self, channel: &str, entries: &[LogEntry<'_>]) -> Result<Vec<Applied>> {
        let mut removed = false;
        let mut epoch_changed = false;
        // Not synced to disk (synchronous=NORMAL): everything it writes (state, cursor, inbox)
        // commits atomically, survives a killed process, and after a power loss the entries it
        // lost are applied again from the relay's log.
        let result = self.with_group_durability(channel, false, |group, provider, conn| {
            if let Some(out) = apply_entries_fast(channel, group, provider, conn, entries)? {
                removed = out.removed;
                epoch_changed = out.epoch_changed;
                return Ok(out.applied);
            }
            let mut out = Vec::with_capacity(entries.len());
            for entry in entries {
                let (seq, message) = (entry.seq, entry.message);
                conn.exec_cached("SAVEPOINT entry")
                    .map_err(StoreError::from)?;
                let outcome = parse_for_channel(channel, message).and_then(|protocol| {
                    apply_message(channel, group, provider, conn, protocol, message)
                });
                match outcome {
                    Ok(mut incoming) => {
                        let inbox_id = keep_for_caller(conn, channel, entry, &mut incoming)?;
                        removed = matches!(incoming, Incoming::Removed { .. });
                        epoch_changed |= changes_epoch(&incoming);
                        if !removed {
                            store::rows::set_cursor(conn, channel, Cursor::After(seq))?;
                        }
                        conn.exec_cached("RELEASE entry")
                            .map_err(StoreError::from)?;
                        out.push(Applied {
                            seq,
                            outcome: Ok(incoming),
                            inbox_id,
                        });
                        if removed {
                            break;
                        }
                    }
                    Err(err) if err.kind() == crate::ErrorKind::Internal => return Err(err),
                    Err(err) => {
                        conn.execute_batch("ROLLBACK TO entry; RELEASE entry")
                            .map_err(StoreError::from)?;
                        // OpenMLS may have changed the in-memory group before failing: reload
                        // it from the rolled-back store.
                        *group = MlsGroup::load(provider.storage(), &group_id_of(channel))
                            .map_err(StoreError::from)?
                            .ok_or_else(|| missing_group_state(channel))?;
                        store::rows::set_cursor(conn, channel, Cursor::After(seq))?;
                        out.push(Applied {
                            seq,
                            outcome: Err(err),
                            inbox_id: None,
                        });
                    }
                }
            }
            Ok(out)
        });
        self.after_processing(channel, removed, epoch_changed && result.is_ok());
        result
    }

    fn after_processing(&self, channel: &str, removed: bool, epoch_changed: bool) {
        if removed {
            self.drop_group(channel);
        }
        if epoch_changed {
            self.checkpoint();
        }
    }
}

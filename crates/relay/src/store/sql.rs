//! Each statement the two stores share, written once, in PostgreSQL's `$N` form; [`sqlite`]
//! holds the same texts in SQLite's `?N` form, rewritten at compile time. A statement whose
//! dialects differ (row locks, arrays, casts, a different shape) stays in its store's file.

/// `sql` with each placeholder `$N` written `?N` (rusqlite takes `?NNN` positional
/// parameters). `$` and `?` are one byte each, so the text keeps its length `N` and the
/// rewrite runs in a const: SQLite's texts are `&'static str`s made once, at compile time, the
/// keys of rusqlite's statement cache. Only a `$` before a digit is a placeholder; the
/// statements hold no other `$` (the tests check).
const fn question_marks<const N: usize>(sql: &str) -> [u8; N] {
    let bytes = sql.as_bytes();
    assert!(bytes.len() == N, "the length given is not the statement's");
    let mut out = [0u8; N];
    let mut i = 0;
    while i < N {
        out[i] = if bytes[i] == b'$' && i + 1 < N && bytes[i + 1].is_ascii_digit() {
            b'?'
        } else {
            bytes[i]
        };
        i += 1;
    }
    out
}

/// Declares each statement once (`$N`), and its SQLite form in [`sqlite`] under the same name.
macro_rules! statements {
    ($($(#[$attr:meta])* $name:ident = $sql:expr;)+) => {
        $($(#[$attr])* pub(super) const $name: &str = $sql;)+

        /// The statements above in SQLite's `?N` form, under the same names.
        pub(super) mod sqlite {
            $(pub(in crate::store) const $name: &str = {
                const BYTES: [u8; super::$name.len()] = super::question_marks(super::$name);
                // Only ASCII bytes were replaced: still UTF-8.
                match std::str::from_utf8(&BYTES) {
                    Ok(sql) => sql,
                    Err(_) => panic!("a statement is not UTF-8"),
                }
            };)+

            /// Every statement, for the tests.
            #[cfg(test)]
            pub(super) const ALL: &[&str] = &[$($name),+];
        }

        /// Every statement, for the tests.
        #[cfg(test)]
        const ALL: &[&str] = &[$($name),+];
    };
}

statements! {
    /// One audit row (migration 0012), in the transaction of the change it records.
    INSERT_AUDIT = "INSERT INTO relay_audit (account, at_ms, type, key_id, channel, detail) \
         VALUES ($1, $2, $3, $4, $5, $6)";
    INSERT_WELCOME = "INSERT INTO relay_welcomes (channel_id, digest, commit_seq, \
         epoch, welcome, created_at) VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (channel_id, digest) DO NOTHING";
    INSERT_WELCOME_REF = "INSERT INTO relay_welcome_refs (channel_id, \
         key_package_ref, digest) VALUES ($1, $2, $3) ON CONFLICT (channel_id, key_package_ref) \
         DO UPDATE SET digest = excluded.digest";
    /// A bound leaf no longer awaited by its Welcome; the Welcome is used once none is awaited.
    BOUND_WELCOME_LEAF = "DELETE FROM relay_welcome_leaves \
         WHERE channel_id = $1 AND leaf_index = $2 RETURNING digest";
    MARK_USED = "UPDATE relay_welcomes SET used_at = $3 \
         WHERE channel_id = $1 AND digest = $2 AND used_at IS NULL AND NOT EXISTS \
         (SELECT 1 FROM relay_welcome_leaves l WHERE l.channel_id = $1 AND l.digest = $2)";
    EXPIRED_WELCOMES = "SELECT channel_id, digest FROM relay_welcomes \
         WHERE created_at < $1 UNION SELECT channel_id, digest FROM relay_welcomes \
         WHERE used_at < $2 LIMIT $3";
    DELETE_WELCOME = "DELETE FROM relay_welcomes WHERE channel_id = $1 AND digest = $2";
    DELETE_WELCOME_REFS = "DELETE FROM relay_welcome_refs WHERE channel_id = $1 AND digest = $2";
    DELETE_WELCOME_LEAVES =
        "DELETE FROM relay_welcome_leaves WHERE channel_id = $1 AND digest = $2";
    WELCOMES_DUE = "SELECT EXISTS (SELECT 1 FROM relay_welcomes WHERE created_at < $1) \
         OR EXISTS (SELECT 1 FROM relay_welcomes WHERE used_at < $2)";
    WELCOME_FLOOR = "SELECT MIN(commit_seq) FROM relay_welcomes WHERE channel_id = $1";
    WELCOME_BY_DIGEST = "SELECT welcome, commit_seq, epoch FROM relay_welcomes \
         WHERE channel_id = $1 AND digest = $2";

    PRUNE_ENTRIES = "DELETE FROM relay_entries WHERE channel_id = $1 AND seq > $2 AND seq <= $3";
    PRUNE_HORIZON = "UPDATE relay_channels SET horizon_seq = $2 WHERE id = $1 AND horizon_seq < $2";
    /// The starts of the epochs before the horizon: nobody can read from them any more.
    PRUNE_EPOCHS = "DELETE FROM relay_epochs WHERE channel_id = $1 AND start_seq < $2";
    /// Proposals of past epochs: only a commit of their own epoch may reference them.
    PRUNE_PROPOSALS = "DELETE FROM relay_proposals WHERE channel_id = $1 \
         AND epoch < (SELECT epoch FROM relay_channels WHERE id = $1)";
    SET_RETENTION = "UPDATE relay_channels SET retention_max_age = $2, \
         retention_max_entries = $3, retention_max_bytes = $4 WHERE id = $1";
    RETENTION_ROWS = "SELECT id, head_seq, horizon_seq, retention_max_age, \
         retention_max_entries, retention_max_bytes FROM relay_channels WHERE id > $1 \
         ORDER BY id LIMIT $2";
    RETENTION_ROW = "SELECT id, head_seq, horizon_seq, retention_max_age, \
         retention_max_entries, retention_max_bytes FROM relay_channels WHERE id = $1";
    FIRST_SINCE = "SELECT seq FROM relay_entries WHERE channel_id = $1 AND seq > $2 \
         AND seq <= $3 AND appended_at >= $4 ORDER BY seq LIMIT 1";
    /// The newest entry whose bytes, with those of the entries after it, pass the limit.
    /// `length` of a BLOB (SQLite) or a BYTEA (PostgreSQL, where it is `octet_length`) counts
    /// bytes; PostgreSQL wants the subquery named (`k`).
    BYTES_CUT = "SELECT seq FROM (SELECT seq, SUM(length(message)) OVER \
         (ORDER BY seq DESC) AS kept FROM relay_entries WHERE channel_id = $1 AND seq > $2) k \
         WHERE kept > $3 ORDER BY seq DESC LIMIT 1";
    /// The readiness probe's write (`static/store/migrations/0007_relay_health.sql`).
    PROBE = "INSERT INTO relay_health (part, checked_at) VALUES ('relay', $1) \
         ON CONFLICT (part) DO UPDATE SET checked_at = excluded.checked_at";

    /// An org is claimed if free (migration 0009: by its key).
    CLAIM_ORG =
        "INSERT INTO relay_orgs (org, account) VALUES ($1, $2) ON CONFLICT (org) DO NOTHING";
    ORG_OWNER = "SELECT account FROM relay_orgs WHERE org = $1";
    INSERT_EPOCH = "INSERT INTO relay_epochs (channel_id, epoch, start_seq) VALUES ($1, $2, $3)";
    INSERT_GROUP = "INSERT INTO relay_groups (channel_id, epoch, state) VALUES ($1, $2, $3)";
    UPDATE_GROUP = "UPDATE relay_groups SET epoch = $2, state = $3 WHERE channel_id = $1";
    /// `$4`: the API key that proved the binding (migration 0013; NULL when anonymous).
    BIND = "INSERT INTO relay_members (channel_id, leaf_index, account, key_id) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (channel_id, leaf_index) \
         DO UPDATE SET account = excluded.account, key_id = excluded.key_id, removed_seq = NULL";
    /// The relay's external sender key pair (migration 0013), made once per database.
    EXTERNAL_SENDER = "SELECT signature_key, private_key FROM relay_external_sender WHERE id = 1";
    INSERT_EXTERNAL_SENDER = "INSERT INTO relay_external_sender \
         (id, signature_key, private_key, created_at) VALUES (1, $1, $2, $3) \
         ON CONFLICT (id) DO NOTHING";
    /// The keys behind bindings, in order, after `$1` (a batch of at most `$2`).
    BOUND_KEYS = "SELECT DISTINCT key_id FROM relay_members WHERE key_id > $1 \
         ORDER BY key_id LIMIT $2";
    /// The leaves a key last proved, with their channels' names (at most `$2`).
    LEAVES_OF_KEY = "SELECT c.name, m.leaf_index FROM relay_members m \
         JOIN relay_channels c ON c.id = m.channel_id \
         WHERE m.key_id = $1 AND c.legacy = 0 ORDER BY m.channel_id, m.leaf_index LIMIT $2";
    /// The console's reads (migration 0014): up to `$3` channels with a leaf bound to account
    /// `$1`, by id after `$2` (the index on relay_members (account, channel_id)), with the
    /// time their newest entry was appended (one step of the entries' primary key each).
    ACCOUNT_CHANNELS = "SELECT c.id, c.name, c.epoch, c.head_seq, c.retention_max_age, \
         c.retention_max_entries, c.retention_max_bytes, \
         (SELECT e.appended_at FROM relay_entries e WHERE e.channel_id = c.id \
         ORDER BY e.seq DESC LIMIT 1) \
         FROM relay_channels c WHERE c.legacy = 0 AND c.id IN \
         (SELECT DISTINCT m.channel_id FROM relay_members m WHERE m.account = $1 \
         AND m.channel_id > $2 ORDER BY m.channel_id LIMIT $3) ORDER BY c.id";
    /// The account's entries of content type `$3` appended since `$2` (unix ms), counted per
    /// channel and minute, at most `$4` rows (the index on relay_entries (account,
    /// appended_at) finds them).
    ACCOUNT_RATE = "SELECT c.name, e.appended_at / 60000, count(*) FROM relay_entries e \
         JOIN relay_channels c ON c.id = e.channel_id \
         WHERE e.account = $1 AND e.appended_at >= $2 AND e.content_type = $3 \
         GROUP BY c.name, e.appended_at / 60000 LIMIT $4";
    INSERT_PROPOSAL =
        "INSERT INTO relay_proposals (channel_id, epoch, seq, message) VALUES ($1, $2, $3, $4)";

    /// The account's own legacy channel of that name first ('legacy:...' sorts after '').
    LOAD_CHANNEL = "SELECT id, epoch, head_seq, scope, owner, legacy, horizon_seq \
         FROM relay_channels \
         WHERE name = $2 AND (scope = '' OR scope = 'legacy:' || $1) ORDER BY scope DESC LIMIT 1";
    LOAD_GROUP = "SELECT epoch, state FROM relay_groups WHERE channel_id = $1";
    PROPOSALS = "SELECT message FROM relay_proposals WHERE channel_id = $1 AND epoch = $2 \
         ORDER BY seq";
    SHADOWED = "SELECT DISTINCT name FROM relay_channels WHERE scope <> ''";
    EPOCH_START = "SELECT start_seq FROM relay_epochs WHERE channel_id = $1 AND epoch = $2";

    // The key-package directory and invitations (`store/directory/`, migration 0010).
    /// `replace`: the address's packages not yet claimed go.
    DROP_UNCLAIMED = "DELETE FROM relay_key_packages \
         WHERE account = $1 AND identity = $2 AND claimed_at IS NULL";
    /// Whether a package is listed already (claimed or not): listing it again is a no-op.
    PACKAGE_LISTED = "SELECT 1 FROM relay_key_packages WHERE key_package_ref = $1";
    /// The address's one-time packages listed, not claimed and not expired.
    ONE_TIME_STOCK = "SELECT count(*) FROM relay_key_packages WHERE account = $1 \
         AND identity = $2 AND last_resort = $3 AND claimed_at IS NULL AND not_after > $4";
    /// A new last-resort package replaces the address's previous one.
    DROP_LAST_RESORT = "DELETE FROM relay_key_packages WHERE account = $1 AND identity = $2 \
         AND last_resort = $3 AND key_package_ref <> $4";
    LIST_PACKAGE = "INSERT INTO relay_key_packages (key_package_ref, account, identity, \
         last_resort, key_package, not_after, listed_at) VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (key_package_ref) DO NOTHING";
    /// Per kind (last resort or not): how many are listed unclaimed and unexpired, and the
    /// earliest end of their lifetimes.
    STOCK = "SELECT last_resort, count(*), min(not_after) FROM relay_key_packages \
         WHERE account = $1 AND identity = $2 AND claimed_at IS NULL AND not_after > $3 \
         GROUP BY last_resort";
    CLEAR_POLICY = "DELETE FROM relay_invitation_policies WHERE account = $1 AND identity = $2";
    ALLOW = "INSERT INTO relay_invitation_policies (account, identity, allowed) \
         VALUES ($1, $2, $3) ON CONFLICT (account, identity, allowed) DO NOTHING";
    /// Whether `$3` may claim a package of the address ($1, $2) and one is there: its own
    /// account, or one its policy names (or '*').
    CONSENTS = "SELECT EXISTS (SELECT 1 FROM relay_key_packages WHERE account = $1 \
         AND identity = $2 AND claimed_at IS NULL AND not_after > $4) \
         AND ($1 = $3 OR EXISTS (SELECT 1 FROM relay_invitation_policies \
         WHERE account = $1 AND identity = $2 AND allowed IN ($3, '*')))";
    PENDING_INVITATIONS = "SELECT count(*) FROM relay_invitations WHERE account = $1 \
         AND identity = $2 AND state = 0 AND (expires_at IS NULL OR expires_at > $3)";
    /// The address's newest last-resort package (kept when handed out).
    LAST_RESORT = "SELECT key_package_ref, key_package FROM relay_key_packages \
         WHERE account = $1 AND identity = $2 AND last_resort = $3 AND not_after > $4 \
         ORDER BY id DESC LIMIT 1";
    RECORD_CLAIM = "INSERT INTO relay_key_package_claims (key_package_ref, channel_id, \
         claimer, account, identity, last_resort, claimed_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (key_package_ref, channel_id, claimer) \
         DO UPDATE SET claimed_at = excluded.claimed_at";
    CLAIM_OF = "SELECT account, identity, last_resort FROM relay_key_package_claims \
         WHERE key_package_ref = $1 AND channel_id = $2 AND claimer = $3";
    INVITATION_OF = "SELECT id FROM relay_invitations \
         WHERE key_package_ref = $1 AND channel_id = $2";
    /// When the channel's Welcome naming the ref was stored.
    WELCOME_CREATED = "SELECT w.created_at FROM relay_welcome_refs r JOIN relay_welcomes w \
         ON w.channel_id = r.channel_id AND w.digest = r.digest \
         WHERE r.channel_id = $1 AND r.key_package_ref = $2";
    INSERT_INVITATION = "INSERT INTO relay_invitations (account, identity, channel_id, \
         channel, key_package_ref, inviter_account, inviter_identity, last_resort, created_at, \
         expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
         ON CONFLICT (key_package_ref, channel_id) DO NOTHING RETURNING id";
    INVITATIONS = "SELECT id, channel, inviter_identity, inviter_account, created_at, \
         expires_at, last_resort FROM relay_invitations WHERE account = $1 AND identity = $2 \
         AND state = 0 AND id > $3 AND (expires_at IS NULL OR expires_at > $4) \
         ORDER BY id LIMIT $5";
    OPEN_INVITATION = "SELECT i.channel, w.welcome, w.epoch FROM relay_invitations i \
         JOIN relay_welcome_refs r \
         ON r.channel_id = i.channel_id AND r.key_package_ref = i.key_package_ref \
         JOIN relay_welcomes w ON w.channel_id = r.channel_id AND w.digest = r.digest \
         WHERE i.id = $1 AND i.account = $2 AND i.identity = $3 AND i.state = 0 \
         AND (i.expires_at IS NULL OR i.expires_at > $4)";
    SETTLE = "UPDATE relay_invitations SET state = $4, settled_at = $5 \
         WHERE id = $1 AND account = $2 AND identity = $3 AND state = 0";
    INVITATION_EXISTS = "SELECT 1 FROM relay_invitations \
         WHERE id = $1 AND account = $2 AND identity = $3";
    /// The pruner's bounded deletes (at most `$2` / `$3` rows each).
    PRUNE_PACKAGES = "DELETE FROM relay_key_packages WHERE id IN \
         (SELECT id FROM relay_key_packages WHERE not_after <= $1 LIMIT $2)";
    PRUNE_CLAIMS = "DELETE FROM relay_key_package_claims \
         WHERE (key_package_ref, channel_id, claimer) IN \
         (SELECT key_package_ref, channel_id, claimer FROM relay_key_package_claims \
         WHERE claimed_at <= $1 LIMIT $2)";
    PRUNE_INVITATIONS = "DELETE FROM relay_invitations WHERE id IN \
         (SELECT id FROM relay_invitations WHERE settled_at <= $1 OR expires_at <= $2 \
         LIMIT $3)";
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn rewrite<const N: usize>(sql: &str) -> String {
        String::from_utf8(question_marks::<N>(sql).to_vec()).unwrap()
    }

    #[test]
    fn placeholders_become_question_marks() {
        let sql = "SELECT $1, $10, $2 WHERE a = $1";
        assert_eq!(
            rewrite::<{ "SELECT $1, $10, $2 WHERE a = $1".len() }>(sql),
            "SELECT ?1, ?10, ?2 WHERE a = ?1"
        );
        // A `$` before anything but a digit is no placeholder.
        assert_eq!(rewrite::<6>("a $ b$"), "a $ b$");
        assert_eq!(sqlite::PRUNE_HORIZON, PRUNE_HORIZON.replace('$', "?"));
    }

    /// No `$` but placeholders (none in a literal, no dollar quoting): the rewrite is exact,
    /// and each SQLite form is the `$N` text with `?` for `$`, nothing else.
    #[test]
    fn statements_hold_no_other_dollar() {
        assert_eq!(ALL.len(), sqlite::ALL.len());
        for (postgres, sqlite) in ALL.iter().zip(sqlite::ALL) {
            assert!(!postgres.contains("'$"), "{postgres}");
            let bytes = postgres.as_bytes();
            for (i, _) in postgres.match_indices('$') {
                assert!(
                    bytes.get(i + 1).is_some_and(u8::is_ascii_digit),
                    "{postgres}"
                );
            }
            assert_eq!(*sqlite, postgres.replace('$', "?"));
            assert!(!sqlite.contains('$'), "{sqlite}");
        }
    }

    /// Every SQLite form prepares on the relay's SQLite schema.
    #[test]
    fn sqlite_forms_prepare() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch(&crate::store::schema::SQLITE.concat())
            .unwrap();
        for sql in sqlite::ALL {
            conn.prepare(sql).unwrap();
        }
    }
}

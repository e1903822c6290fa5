-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- Orgs are owned by their key (docs/design.md §5.2; crates/relay/src/rules.rs `org_key`): the
-- org's name in lower case without '-', '.' and '_', so that `Acme`, `ACME`, `acme-` and
-- `acme.` are one org and nobody can claim a look-alike of another account's org. The relay
-- now writes and looks up `relay_orgs.org` by that key; existing rows are rewritten to it.
--
-- Where several existing orgs share a key (claimed before this migration), one row takes the
-- key: the one already in that form, else the first of them in byte order. The others stay as
-- they are, which no look-up reaches any more: their accounts keep every channel they have
-- (access follows the group's bound leaves, not the org), but creating a channel under that
-- org, or setting the retention of its channels, is now the key's owner's. An operator can
-- reassign the key's row in relay_orgs.
UPDATE relay_orgs
    SET org = replace(replace(replace(lower(org), '-', ''), '.', ''), '_', '')
    WHERE org <> replace(replace(replace(lower(org), '-', ''), '.', ''), '_', '')
    AND NOT EXISTS (
        SELECT 1 FROM relay_orgs p
        WHERE p.org = replace(replace(replace(lower(relay_orgs.org), '-', ''), '.', ''), '_', ''))
    AND org = (
        SELECT min(q.org) FROM relay_orgs q
        WHERE replace(replace(replace(lower(q.org), '-', ''), '.', ''), '_', '')
            = replace(replace(replace(lower(relay_orgs.org), '-', ''), '.', ''), '_', ''));

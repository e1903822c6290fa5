"""A database written by the previous release (before membership), served by this one, on both
stores (docs/design.md §5.2, "Migration (0003)").

The fixture (``tests/fixtures/previous_release/``, made by ``make_previous_release.py``): accounts
A and B (their API keys in ``keys.json``); A created ``acme/x/shared`` and ``acme/x/a-only``, B
created ``acme/x/shared`` too (names were per account) and ``beta/y/b-only``, two messages each;
the SDK data directories of both. SQLite serves a copy of its ``static.db``; PostgreSQL a
database made by the previous schema (migrations 0001 and 0002 only, marked as the Python store
marks them) holding the same rows. The current server migrates either at start (0003).

Each check fails if the migration did the wrong thing: channels lost or merged, the shared name
given to the wrong account (A's log then read B's messages), another account let in, an org given
to the wrong account or to nobody.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from static.store._migrations import load_migrations
from static_sdk import StaticClient
from tests.relay import mls_vectors as mls
from tests.relay.client import Member, Relay, account_of, status_of
from tests.support.api import Api
from tests.support.postgres import PostgresCluster, find_postgres_bin
from tests.support.server import ServerProcess

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "previous_release"
#: What each account created, as (scope, name) rows of the old relay_channels.
CHANNELS = {
    "a": ["acme/x/shared", "acme/x/a-only"],
    "b": ["acme/x/shared", "beta/y/b-only"],
}
#: The tables the previous release wrote, in an order their foreign keys accept.
TABLES = [
    "accounts",
    "api_keys",
    "signing_keys",
    "relay_channels",
    "relay_entries",
    "relay_epochs",
    "relay_welcomes",
    "relay_welcome_refs",
]
DENIED = grpc.StatusCode.PERMISSION_DENIED


def _fixture_rows(table: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    conn = sqlite3.connect(f"file:{FIXTURE / 'static.db'}?mode=ro&immutable=1", uri=True)
    try:
        cursor = conn.execute(f"SELECT * FROM {table}")
        return [d[0] for d in cursor.description], cursor.fetchall()
    finally:
        conn.close()


def _old_logs() -> dict[tuple[str, str], list[bytes]]:
    """(account, name) -> the messages of that channel's log, as the previous release kept it."""
    _, channels = _fixture_rows("relay_channels")
    _, entries = _fixture_rows("relay_entries")
    by_id = {row[0]: (row[1], row[2]) for row in channels}
    logs: dict[tuple[str, str], list[bytes]] = {key: [] for key in by_id.values()}
    for channel_id, _seq, *_, message in sorted(entries, key=lambda e: (e[0], e[1])):
        logs[by_id[channel_id]].append(message)
    return logs


def _literal(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"'\\x{value.hex()}'"
    if isinstance(value, int):
        return str(value)
    assert isinstance(value, str), value
    return "'" + value.replace("'", "''") + "'"


def _previous_release_postgres(cluster: PostgresCluster) -> str:
    """A PostgreSQL database as the previous release left it: its schema (0001, 0002) and the
    fixture's rows."""
    url = cluster.create_database()
    old = [m for m in load_migrations("postgresql") if m.version <= 2]
    assert [m.version for m in old] == [1, 2]
    script = [
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL);"
    ]
    for migration in old:
        script.append(migration.sql)
        script.append(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES "
            f"({migration.version}, {_literal(migration.name)}, CURRENT_TIMESTAMP);"
        )
    for table in TABLES:
        columns, rows = _fixture_rows(table)
        overriding = " OVERRIDING SYSTEM VALUE" if table == "api_keys" else ""
        for row in rows:
            values = ", ".join(_literal(v) for v in row)
            script.append(
                f"INSERT INTO {table} ({', '.join(columns)}){overriding} VALUES ({values});"
            )
    script.append("SELECT setval(pg_get_serial_sequence('relay_channels', 'id'), 4);")
    script.append("SELECT setval(pg_get_serial_sequence('api_keys', 'seq'), 2);")
    bindir = find_postgres_bin()
    assert bindir is not None
    subprocess.run(
        [str(bindir / "psql"), url, "-v", "ON_ERROR_STOP=1", "-q", "-1", "-f", "-"],
        input="\n".join(script),
        check=True,
        capture_output=True,
        text=True,
    )
    return url


@pytest.fixture
def migrated(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """The current server started on the previous release's database (which it migrates)."""
    if backend == "sqlite":
        (tmp_path / "db").mkdir()
        shutil.copy(FIXTURE / "static.db", tmp_path / "db" / "static.db")
        url = f"sqlite:///{tmp_path / 'db' / 'static.db'}"
    else:
        url = _previous_release_postgres(request.getfixturevalue("postgres_cluster"))
    server = ServerProcess(tmp_path / "server", url, ["--signup-rate", "off"]).start()
    yield server
    assert server.stop() == 0, server.stderr()


Keys = dict[str, dict[str, str]]


@pytest.fixture
def keys() -> Keys:
    loaded: Keys = json.loads((FIXTURE / "keys.json").read_text())
    return loaded


def _read(relay: Relay, channel: str, count: int) -> list[Any]:
    sub = relay.subscribe(channel)
    entries = sub.wait_for(count)
    sub.wait_keepalives(1)  # and nothing more
    sub.cancel()
    assert len(sub.entries) == count, [e.seq for e in sub.entries]
    return entries


def _refused(call: Callable[..., object], *args: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return status_of(info.value)[:2]


def _subscribe_refused(relay: Relay, channel: str) -> grpc.StatusCode:
    sub = relay.subscribe(channel)
    error = sub.wait_end()
    assert error is not None and sub.entries == []
    return status_of(error)[0]


def test_each_account_keeps_its_legacy_channels(migrated: ServerProcess, keys: Keys) -> None:
    """A and B each reach their own channels and read their old entries; A's ``acme/x/shared``
    and B's are two channels, each with its own account's log; neither reaches the other's
    channels, nor does a new account."""
    api = Api(migrated.http_url)
    old = _old_logs()
    relays = {who: Relay(migrated.relay_url, api.token(keys[who]["api_key"])) for who in "ab"}
    outsider = Relay(migrated.relay_url, api.token(api.signup().key))
    try:
        for who, relay in relays.items():
            assert relay.account == keys[who]["account"]  # the accounts and keys survived
            for name in CHANNELS[who]:
                log = old[(relay.account, name)]
                assert len(log) == 2
                entries = _read(relay, name, 2)
                assert [(e.seq, e.epoch, e.content_type) for e in entries] == [(1, 0, 1), (2, 0, 1)]
                assert [e.message for e in entries] == log
                assert {e.account for e in entries} == {""}  # logged before accounts were
        assert (
            old[(keys["a"]["account"], "acme/x/shared")]
            != old[(keys["b"]["account"], "acme/x/shared")]
        )
        # Each publishes on its own shared channel: the other's log does not move.
        shared = "acme/x/shared"
        assert relays["a"].publish(shared, mls.application(shared, 0, b"a new")).seq == 3
        assert relays["b"].publish(shared, mls.application(shared, 0, b"b new")).seq == 3
        assert _read(relays["a"], shared, 3)[2].account == keys["a"]["account"]
        assert _read(relays["b"], shared, 3)[2].message == mls.application(shared, 0, b"b new")
        # A legacy channel has no group: no leaf to bind, no members to list, even for its
        # owner.
        member = Member(relays["a"])
        member.engine.create_group("acme/x/a-only")
        code, details = _refused(relays["a"].bind, "acme/x/a-only", member.binding("acme/x/a-only"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "legacy" in details
        member.close()
        code, details = _refused(relays["a"].list_members, "acme/x/a-only")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "legacy" in details
        # Nobody else reaches them.
        others = {"a": [("b", "beta/y/b-only")], "b": [("a", "acme/x/a-only")]}
        for who, relay in relays.items():
            for _, name in others[who]:
                assert _refused(relay.publish, name, mls.application(name, 0))[0] == DENIED
                assert _subscribe_refused(relay, name) == DENIED
        for name in {n for names in CHANNELS.values() for n in names}:
            assert _refused(outsider.publish, name, mls.application(name, 0))[0] == DENIED
            assert _subscribe_refused(outsider, name) == DENIED
            assert _refused(outsider.list_members, name)[0] == DENIED
    finally:
        for relay in (*relays.values(), outsider):
            relay.close()
        api.close()


def test_orgs_belong_to_their_first_creators(migrated: ServerProcess, keys: Keys) -> None:
    """``acme`` is A's (A created under it first), ``beta`` is B's: each creates real channels
    under its own org and is refused under the other's; a new account under either."""
    api = Api(migrated.http_url)
    relays = {who: Relay(migrated.relay_url, api.token(keys[who]["api_key"])) for who in "ab"}
    outsider = Relay(migrated.relay_url, api.token(api.signup().key))
    try:
        owner = {"acme": "a", "beta": "b"}
        for org, who in owner.items():
            for relay in (relays["b" if who == "a" else "a"], outsider):
                member = Member(relay)
                member.engine.create_group(f"{org}/new/x")
                group_info, tree = member.engine.public_state(f"{org}/new/x")
                code, details = _refused(
                    relay.create_raw,
                    f"{org}/new/x",
                    group_info,
                    tree,
                    member.binding(f"{org}/new/x"),
                )
                assert code == DENIED and f"org '{org}' belongs to another account" in details
                member.close()
            assert relays[who].create(f"{org}/new/x").epoch == 0
            # A real group: its owner commits, checked against it.
            assert relays[who].commit(f"{org}/new/x").epoch == 1
        # The legacy names are taken: A holds acme/x/shared's global name.
        assert _refused(Member(relays["a"]).create, "acme/x/shared")[0] == (
            grpc.StatusCode.ALREADY_EXISTS
        )
        assert outsider.create("gamma/new/x").epoch == 0
    finally:
        for relay in (*relays.values(), outsider):
            relay.close()
        api.close()


def test_the_sdk_reopens_its_legacy_channels(
    migrated: ServerProcess, keys: Keys, tmp_path: Path
) -> None:
    """The previous release's SDK data, reopened: each client sends on its channels (the log
    gets a PrivateMessage at epoch 0 from its account), rotates its keys (a legacy channel's
    commit is fenced, not checked) and sends at the new epoch. Its files are made private
    (the directory, left as it is, gets a warning), its identity is recorded and its hand-out
    marks converted, so from now on damage to them is detected (``tests/sdk/test_state.py``)."""
    api = Api(migrated.http_url)
    try:
        for who in "ab":
            data_dir = tmp_path / f"client-{who}"
            shutil.copytree(FIXTURE / f"client-{who}", data_dir)
            data_dir.chmod(0o755)
            account = keys[who]["account"]
            with pytest.warns(UserWarning, match="open to other users"):
                client = StaticClient(
                    migrated.relay_url,
                    str(data_dir),
                    f"agent-{who}".encode(),
                    api_key=keys[who]["api_key"],
                    api_url=migrated.http_url,
                )
            assert (data_dir / "inbox.marks").read_bytes()[:8] == b"STMARKS2"
            assert (data_dir / "identity").read_text().startswith("static identity v1 ")
            modes = {p.name: p.stat().st_mode & 0o777 for p in data_dir.iterdir()}
            assert set(modes.values()) == {0o600}, modes
            try:
                assert sorted(client.channels()) == sorted(CHANNELS[who])
                relay = Relay(migrated.relay_url, api.token(keys[who]["api_key"]))
                assert account_of(relay.token) == account
                for name in CHANNELS[who]:
                    channel = client.open_channel(name)
                    channel.send(f"{who} {name} after the upgrade".encode())
                    channel.rotate_keys()
                    assert channel.epoch() == 1
                    channel.send(b"at epoch 1")
                    entries = _read(relay, name, 5)
                    new = entries[2:]
                    assert [(e.epoch, e.content_type, e.account) for e in new] == [
                        (0, mls.APPLICATION, account),
                        (0, mls.COMMIT, account),
                        (1, mls.APPLICATION, account),
                    ]
                    wire_formats = [int.from_bytes(e.message[2:4], "big") for e in new]
                    assert wire_formats == [mls.PRIVATE, mls.PUBLIC, mls.PRIVATE]
                    channel.close()
                relay.close()
            finally:
                client.close()
    finally:
        api.close()

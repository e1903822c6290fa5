"""The client commands (``static context|account|keys|audit|agent|channel|invitations``) run
as the user runs them, as subprocesses against one real server (SQLite)."""

from __future__ import annotations

import argparse
import json
import os
import pty
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from static.cli import _parser
from tests.support.server import ServerProcess

#: Bound of any one command (nothing may hang).
TIMEOUT = 60
_CLIENT_ENV = ("STATIC_API_URL", "STATIC_RELAY_URL", "STATIC_API_KEY", "STATIC_CA_FILE")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the module (starting one per test would double its time). Sign-ups
    are limited to 7 an hour: the last test meets that limit."""
    root = tmp_path_factory.mktemp("cli-server")
    started = ServerProcess(
        root / "server", f"sqlite:///{root / 'db' / 'static.db'}", ["--signup-rate", "7/3600"]
    ).start()
    yield started
    assert started.stop() == 0, started.stderr()


class Cli:
    """``python -m static ...`` with its own configuration and data directories (and HOME)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.config = home / "config"
        self.data = home / "data"
        self.env = {k: v for k, v in os.environ.items() if k not in _CLIENT_ENV}
        self.env.update(
            HOME=str(home), XDG_CONFIG_HOME=str(self.config), XDG_DATA_HOME=str(self.data)
        )

    def __call__(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "static", *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            env={**self.env, **(env or {})},
            timeout=timeout,
        )

    def ok(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = self(*args, env=env)
        assert done.returncode == 0, f"static {' '.join(args)}: {done.stderr}"
        return done.stdout

    def json(self, *args: str, env: dict[str, str] | None = None) -> Any:
        return json.loads(self.ok(*args, "--json", env=env))

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "static", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env,
        )


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


def one_line_error(done: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one line a failed command printed on stderr (and nothing on stdout)."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("static: "), done.stderr
    return lines[0]


def email() -> str:
    return f"u{uuid.uuid4().hex[:12]}@example.com"


def signup(cli: Cli, server: ServerProcess, context: str = "main") -> str:
    """A new account whose first key is saved in ``context`` (now current); its key."""
    made = cli.json(
        "account", "create", "--email", email(), "--save-context", context,
        "--api-url", server.http_url, "--relay-url", server.relay_url,
    )  # fmt: skip
    assert made["context"] == context and made["current"] is True
    key: str = made["api_key"]
    return key


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Any]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_client_command_has_an_example_in_its_help() -> None:
    commands = dict(_commands(_parser()))
    assert ("channel", "listen") in commands and ("keys", "roll") in commands
    for path, sub in commands.items():
        if path[0] == "serve":
            continue  # the server's own help
        assert "\nExample:\n  static " in sub.format_help(), path


def test_help_and_unknown_command(cli: Cli) -> None:
    assert "Example:\n  static keys roll" in cli.ok("keys", "roll", "--help")
    one_line = cli("frobnicate")
    assert one_line.returncode == 2 and "invalid choice: 'frobnicate'" in one_line.stderr


def test_without_any_configuration_it_says_what_to_set(cli: Cli) -> None:
    line = one_line_error(cli("keys", "list"))
    assert "STATIC_API_URL" in line and "--api-url" in line and "static context add" in line
    line = one_line_error(cli("account", "show", "--api-url", "http://127.0.0.1:1"))
    assert "STATIC_API_KEY" in line and "--api-key-file" in line
    line = one_line_error(cli("agent", "address", "--as", "alice"))
    assert "STATIC_RELAY_URL" in line


def test_contexts_add_use_list_show_rm_and_their_file_modes(cli: Cli, tmp_path: Path) -> None:
    secret = "sk_live_" + "A" * 43
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    add = ["--relay", "grpc://127.0.0.1:1", "--key-file", str(key_file)]
    cli.ok("context", "add", "dev", "--api-url", "http://127.0.0.1:2", *add)
    cli.ok("context", "add", "prod", "--api-url", "https://api.example.com", *add)
    listed = cli.json("context", "list")
    assert listed == {"contexts": ["dev", "prod"], "current": "dev"}  # the first is current
    cli.ok("context", "use", "prod")
    assert cli.json("context", "list")["current"] == "prod"
    shown = cli.ok("context", "show")
    assert "https://api.example.com" in shown and "sk_live_AAAAAAAA…" in shown
    assert secret not in shown
    dev = cli.json("context", "show", "dev")
    assert dev["api_url"] == "http://127.0.0.1:2" and dev["relay_url"] == "grpc://127.0.0.1:1"
    assert dev["api_key_prefix"] == "sk_live_AAAAAAAA…" and secret not in json.dumps(dev)

    root = cli.config / "static"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "context").stat().st_mode) == 0o700
    for path in [root / "context.txt", *(root / "context").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (root / "context.txt").read_text().strip() == "prod"

    cli.ok("context", "rm", "prod")
    assert cli.json("context", "list") == {"contexts": ["dev"], "current": None}
    line = one_line_error(cli("context", "use", "prod"))
    assert "no context 'prod'" in line
    one_line_error(cli("context", "add", "../evil", "--api-url", "http://x"))
    assert not (cli.config / "evil.json").exists()


def test_a_reader_that_went_away_ends_the_command_quietly(cli: Cli, tmp_path: Path) -> None:
    """``static context list | head -0``: the pipe's reader is gone before the first write."""
    cli.ok("context", "add", "dev", "--api-url", "http://127.0.0.1:2")
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "static", "context", "list"],
            stdout=write,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=cli.env,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""


def test_a_flag_beats_the_environment_which_beats_the_context(
    cli: Cli, server: ServerProcess, tmp_path: Path
) -> None:
    key = signup(cli, server)
    good, wrong = tmp_path / "good.key", tmp_path / "wrong.key"
    good.write_text(key)
    wrong.write_text("sk_live_" + "B" * 43)
    dead = "http://127.0.0.1:1"
    # The context (current) has the real URL and key.
    assert cli.json("account", "show")["id"]
    # The environment beats it: a dead URL, then a wrong key.
    line = one_line_error(cli("account", "show", env={"STATIC_API_URL": dead}))
    assert "connection refused" in line and dead in line
    line = one_line_error(cli("account", "show", env={"STATIC_API_KEY": wrong.read_text()}))
    assert "invalid or revoked api key" in line and "STATIC_API_KEY" in line
    # A flag beats the environment.
    env = {"STATIC_API_URL": dead, "STATIC_API_KEY": wrong.read_text()}
    assert cli.json("account", "show", "--api-url", server.http_url, "--api-key-file", str(good),
                    env=env)["id"]  # fmt: skip
    line = one_line_error(
        cli("--api-url", dead, "account", "show", env={"STATIC_API_URL": server.http_url})
    )
    assert "connection refused" in line
    # --context picks another context than the current one.
    cli.ok("context", "add", "other", "--api-url", dead)
    line = one_line_error(cli("account", "show", "--context", "other"))
    assert "STATIC_API_KEY" in line  # that context has no key


def test_account_keys_and_audit(cli: Cli, server: ServerProcess, tmp_path: Path) -> None:
    key = signup(cli, server)
    account = cli.json("account", "show")
    assert account["plan_tier"] == "free"
    assert account["id"] in cli.ok("account", "show")

    made = cli.json(
        "keys", "create", "--name", "agent", "--scopes", "channels",
        "--channels", "acme/*/chat", "acme/x/y", "--expires-in", "3600", "--save-context", "agent",
    )  # fmt: skip
    assert made["scopes"] == ["channels"] and made["channels"] == ["acme/*/chat", "acme/x/y"]
    assert made["key"].startswith(made["key_prefix"]) and made["expires_at"]
    saved = cli.json("context", "show", "agent")  # saved, not made current
    assert saved["api_key_prefix"] == made["key_prefix"] + "…" and not saved["current"]
    assert saved["api_url"] == server.http_url and saved["relay_url"] == server.relay_url
    text = cli.ok("keys", "create", "--name", "ci")
    assert "(the key is shown once" in text and "sk_live_" in text

    listed = cli.json("keys", "list")["keys"]
    assert {k["name"] for k in listed} == {"default", "agent", "ci"}
    assert all("key" not in k for k in listed)
    table = cli.ok("keys", "list")
    assert table.splitlines()[0].split() == [
        "ID", "PREFIX", "NAME", "SCOPES", "CREATED", "LAST", "USED", "EXPIRES",
    ]  # fmt: skip
    assert made["key_prefix"] in table and made["key"] not in table and key not in table

    # A key without the keys scope: 403, said so.
    agent_key = tmp_path / "agent.key"
    agent_key.write_text(made["key"])
    line = one_line_error(cli("keys", "list", "--api-key-file", str(agent_key)))
    assert "lacks the keys scope" in line and made["key"] not in line

    rolled = cli.json("keys", "roll", made["id"], "--grace", "0")
    assert rolled["id"] != made["id"] and rolled["name"] == "agent"
    assert rolled["channels"] == made["channels"]
    cli.ok("keys", "revoke", rolled["id"])
    names = {k["id"] for k in cli.json("keys", "list")["keys"]}
    assert rolled["id"] not in names and made["id"] not in names
    line = one_line_error(cli("keys", "revoke", rolled["id"]))
    assert "no working key" in line
    line = one_line_error(cli("keys", "revoke", "../../v1/accounts"))
    assert "is not a key id" in line

    # The sweep ends the rolled key's grace within 2 s: wait for its event, which comes on
    # top of the log, so that the pages below compare the same log.
    deadline = time.monotonic() + 10
    while not any(e.get("reason") == "rolled" for e in cli.json("audit")["events"]):
        assert time.monotonic() < deadline, "the rolled key was not swept"
        time.sleep(0.3)
    events = cli.json("audit")["events"]
    types = [e["type"] for e in events]
    assert {"key.created", "key.rolled", "key.revoked"} <= set(types)
    paged = cli.json("audit", "--limit", "1", "--all")
    assert [e["id"] for e in paged["events"]] == [e["id"] for e in events]
    assert paged["next_cursor"] is None
    first = cli.json("audit", "--limit", "2")
    assert len(first["events"]) == 2 and first["next_cursor"]
    rest = cli.json("audit", "--cursor", first["next_cursor"])["events"]
    assert [e["id"] for e in first["events"] + rest] == [e["id"] for e in events]
    assert "key.rolled" in cli.ok("audit")


def test_account_create_without_a_terminal_prints_the_key_and_asks_nothing(
    cli: Cli, server: ServerProcess
) -> None:
    done = cli("account", "create", "--email", email(), "--api-url", server.http_url)
    assert done.returncode == 0, done.stderr
    assert "API key  sk_live_" in done.stdout and "Save this key" not in done.stderr
    assert not (cli.config / "static").exists()


def test_account_create_on_a_terminal_offers_to_save_the_key(
    cli: Cli, server: ServerProcess
) -> None:
    primary, secondary = pty.openpty()
    try:
        os.write(primary, b"mine\n")  # the answer, waiting in the terminal's input
        done = subprocess.run(
            [sys.executable, "-m", "static", "account", "create", "--email", email(),
             "--api-url", server.http_url],
            stdin=secondary, capture_output=True, text=True, env=cli.env, timeout=TIMEOUT,
        )  # fmt: skip
    finally:
        os.close(primary)
        os.close(secondary)
    assert done.returncode == 0, done.stderr
    assert "Save this key in a context?" in done.stderr
    assert "saved in context 'mine'" in done.stdout
    assert cli.json("context", "show")["name"] == "mine"
    assert cli.json("account", "show")["email"].endswith("@example.com")


def test_a_bad_key_is_one_line_without_the_secret(
    cli: Cli, server: ServerProcess, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("hunter2 correct-horse-battery-staple\n")
    done = cli("account", "show", "--api-url", server.http_url, "--api-key-file", str(bad))
    line = one_line_error(done)
    assert "is not a key" in line and "hunter2" not in done.stderr + done.stdout
    wrong = "sk_live_" + "C" * 43
    done = cli("keys", "list", "--api-url", server.http_url, env={"STATIC_API_KEY": wrong})
    line = one_line_error(done)
    assert "invalid or revoked api key" in line and wrong not in done.stderr
    line = one_line_error(
        cli("context", "add", "x", "--api-url", "http://h", "--key-file", str(bad))
    )
    assert "hunter2" not in line
    line = one_line_error(cli("keys", "list", "--api-url", "ftp://h", "--api-key-file", str(bad)))
    assert "must start with http:// or https://" in line
    tls = "https://" + server.http_url.removeprefix("http://")
    line = one_line_error(cli("account", "show", "--api-url", tls, env={"STATIC_API_KEY": wrong}))
    assert "TLS handshake with the API" in line and "use http://" in line


def test_two_agents_meet_by_invitation(cli: Cli, server: ServerProcess) -> None:
    signup(cli, server)
    name = f"acme/t{uuid.uuid4().hex[:8]}/chat"
    # Carol waits for an invitation that never comes: Ctrl-C ends her quietly.
    carol = cli.popen("invitations", "--as", "carol", "--count", "1", "--timeout", "50")
    try:
        bob = cli.ok("agent", "address", "--as", "bob").strip()
        assert bob.startswith("static:") and bob.endswith(":Ym9i")  # base64url of b"bob"
        assert "created" in cli.ok("channel", "create", name, "--as", "alice")
        cli.ok("channel", "invite", name, bob, "--as", "alice")
        accepted = cli.json("invitations", "--as", "bob", "--accept", "--count", "1")
        assert accepted["channel"] == name and accepted["inviter"] == "alice"
        assert accepted["accepted"] is True
        # Options may come between the positionals.
        # What a peer sends is printed on one line, its control characters escaped (a
        # terminal must not run its escape sequences).
        cli.ok("channel", "send", name, "--as", "alice", "hello bob\x1b[2J\nbye")
        heard = cli.ok("channel", "listen", name, "--as", "bob", "--count", "1")
        assert heard == "alice: hello bob\\x1b[2J\\nbye\n"
        # From stdin, to a JSON listener.
        done = subprocess.run(
            [sys.executable, "-m", "static", "channel", "send", name, "--as", "bob"],
            input="hi alice\n", capture_output=True, text=True, env=cli.env, timeout=TIMEOUT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        message = cli.json("channel", "listen", name, "--as", "alice", "--count", "1")
        assert message["sender"] == "bob" and message["text"] == "hi alice"
        members = cli.json("channel", "members", name, "--as", "alice")["members"]
        assert [m["identity"] for m in members] == ["alice", "bob"]
        assert "bob" in cli.ok("channel", "members", name, "--as", "bob")

        # Bob leaves while Alice listens (her client commits his leave proposal); nothing
        # arrives for her, so her listen ends at its timeout, an error.
        alice = cli.popen("channel", "listen", name, "--as", "alice", "--timeout", "5")
        assert "left" in cli.ok("channel", "leave", name, "--as", "bob")
        _, err = alice.communicate(timeout=TIMEOUT)
        assert alice.returncode == 1 and err.strip() == f"static: no message on {name} within 5 s"
        members = cli.json("channel", "members", name, "--as", "alice")["members"]
        assert [m["identity"] for m in members] == ["alice"]

        assert carol.poll() is None
        carol.send_signal(signal.SIGINT)
        out, err = carol.communicate(timeout=TIMEOUT)
        assert carol.returncode == 130 and err == "" and out == ""
    finally:
        if carol.poll() is None:
            carol.kill()
            carol.communicate()
    line = one_line_error(cli("channel", "send", name, "hi", "--as", "../alice"))
    assert "invalid agent name" in line
    line = one_line_error(cli("channel", "send", "acme/no/such", "hi", "--as", "alice"))
    assert "not a member" in line


def test_rate_limited_sign_up_says_when_to_retry(cli: Cli, server: ServerProcess) -> None:
    """Last in the module: it spends the server's sign-ups."""
    for _ in range(8):
        done = cli("account", "create", "--email", email(), "--api-url", server.http_url)
        if done.returncode != 0:
            break
    line = one_line_error(done)
    assert "rate limited" in line and "retry in" in line

"""``static serve``'s configuration (docs/operators.md): grouped ``--help``, the ``--config``
TOML file, flag > environment > file > default, refusals naming the key and the file,
``--print-config`` (redacted, loadable back), and a server serving what its file says."""

from __future__ import annotations

import argparse
import os
import re
import selectors
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from static._serve_options import GROUPS, load, options, redact
from static._settings import Address, RateLimit
from tests.support.api import assert_error, unique_email
from tests.support.server import free_port

ROOT = Path(__file__).resolve().parents[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any ``STATIC_*`` variable, plus ``extra``."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("STATIC_")}
    return {**env, **extra}


def _static(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "static", "serve", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env if env is not None else _clean_env(),
    )


def _printed(*args: str | Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``--print-config``'s output, parsed."""
    result = _static(*args, "--print-config", env=env)
    assert result.returncode == 0, result.stderr
    return tomllib.loads(result.stdout)


def _config(tmp_path: Path, text: str, name: str = "static.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_help_lists_every_option_in_its_group() -> None:
    result = _static("--help")
    assert result.returncode == 0, result.stderr
    # The sections in order; each option's flag within its own.
    titles = [f"\n{group.title} ([{group.table}]):\n" for group in GROUPS]
    starts = [result.stdout.index(title) for title in titles]
    assert starts == sorted(starts)
    bounds = dict(
        zip([g.table for g in GROUPS], zip(starts, [*starts[1:], None], strict=True), strict=True)
    )
    for option in options():
        start, end = bounds[option.group]
        section = result.stdout[start:end]
        assert re.search(rf"^  {re.escape(option.flag)}\b", section, re.M), option.flag
        assert f"[{option.env}]" in section.replace("\n", " ").replace("  ", ""), option.env
    # The usage line is short; the groups are where the options are.
    assert result.stdout.splitlines()[0].startswith("usage: static serve [--config FILE]")
    assert len(options()) >= 40


def test_every_option_is_documented() -> None:
    text = (ROOT / "docs" / "operators.md").read_text()
    for group in GROUPS:
        assert f"[{group.table}]" in text, group.table
    for option in options():
        assert f"`{option.flag}`" in text and f"`{option.key}`" in text, option.flag
        assert f"`{option.env}`" in text, option.env


def test_the_documented_example_is_a_valid_config(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "operators.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    configuration = load(argparse.Namespace(config=_config(tmp_path, example)), {})
    assert configuration.values["http"] == Address("0.0.0.0", 8080)
    assert configuration.values["key_rate"] == RateLimit(600, 60)
    assert configuration.sources["log_format"] == str(tmp_path / "static.toml")


def test_file_values_are_used(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        """
        [network]
        http = "127.0.0.1:18080"
        [auth]
        token_ttl = 600
        allow_anonymous = true
        [rate_limits]
        key_rate = "7/60"
        signup_rate = "off"
        relay_publish_rate = 12
        [retention]
        audit_retention_days = 0.5
        [logging]
        log_format = "JSON"
        """,
    )
    printed = _printed("--config", config)
    assert printed["network"]["http"] == "127.0.0.1:18080"
    assert printed["auth"] == {"allow_anonymous": True, "token_ttl": 600}
    assert printed["rate_limits"]["key_rate"] == "7/60"
    assert printed["rate_limits"]["signup_rate"] == "off"
    assert printed["rate_limits"]["relay_publish_rate"] == 12.0
    assert printed["retention"]["audit_retention_days"] == 0.5
    assert printed["logging"]["log_format"] == "json"
    # What the file did not set keeps its default.
    assert printed["network"]["relay"] == "127.0.0.1:50051"
    assert printed["rate_limits"]["account_rate"] == "1200/60"
    # STATIC_CONFIG names the file as --config does.
    assert _printed(env=_clean_env(STATIC_CONFIG=str(config))) == printed


def test_a_flag_beats_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "[auth]\ntoken_ttl = 600\nallow_anonymous = true\n"
        '[rate_limits]\nkey_rate = "7/60"\nsignup_rate = "3/60"\n',
    )
    env = _clean_env(STATIC_TOKEN_TTL="700", STATIC_KEY_RATE="8/60", STATIC_ACCOUNT_RATE="9/60")
    printed = _printed("--config", config, "--token-ttl", "800", "--no-allow-anonymous", env=env)
    assert printed["auth"] == {"token_ttl": 800, "allow_anonymous": False}  # flags
    assert printed["rate_limits"]["key_rate"] == "8/60"  # the environment over the file
    assert printed["rate_limits"]["account_rate"] == "9/60"  # the environment over the default
    assert printed["rate_limits"]["signup_rate"] == "3/60"  # the file over the default
    # Each value says where it came from.
    out = _static("--config", config, "--token-ttl", "800", "--print-config", env=env).stdout
    assert "token_ttl = 800  # from --token-ttl" in out
    assert 'key_rate = "8/60"  # from STATIC_KEY_RATE' in out
    assert f'signup_rate = "3/60"  # from {config}' in out
    assert 'auth_failure_rate = "100/60"\n' in out
    # A bad value in the environment is refused even where the file has a good one.
    result = _static("--config", config, env=_clean_env(STATIC_TOKEN_TTL="soon"))
    assert result.returncode == 2
    assert result.stderr == "static: STATIC_TOKEN_TTL: expected a whole number, got 'soon'\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            '[network]\nhtpp = "127.0.0.1:1"\n',
            "unknown key 'htpp' in [network] (did you mean http?)",
        ),
        ('[netwrok]\nhttp = "127.0.0.1:1"\n', "unknown table [netwrok] (did you mean [network]?)"),
        ("[network]\ncolour = 3\n", "unknown key 'colour' in [network]"),
        ('[network]\nkey_rate = "1/1"\n', "[network] key_rate: it belongs in [rate_limits]"),
        ('http = "127.0.0.1:1"\n', "http belongs in its table: [network] http = ..."),
        ("[network]\nhttp = \n", "not valid TOML"),
    ],
)
def test_unknown_keys_and_tables_exit_2_naming_them(tmp_path: Path, text: str, says: str) -> None:
    config = _config(tmp_path, text)
    result = _static("--config", config, "--data-dir", tmp_path / "data")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"static: {config}: ") and says in line, line
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[auth]\ntoken_ttl = "600"\n', "[auth] token_ttl: expected a whole number, got a string"),
        ("[auth]\ntoken_ttl = 0\n", "[auth] token_ttl must be between 1 and 86400 seconds, got 0"),
        ("[auth]\nallow_anonymous = 1\n", "[auth] allow_anonymous: expected true or false"),
        ('[rate_limits]\nkey_rate = "lots"\n', "[rate_limits] key_rate: expected N/SECONDS or off"),
        ("[network]\nhttp = 8080\n", "[network] http: expected HOST:PORT, got an integer (8080)"),
        (
            "[relay_limits]\nrelay_keepalive = 0.01\n",
            "[relay_limits] relay_keepalive must be between 0.05 and 300, got 0.01",
        ),
        (
            "[connections]\nrelay_max_streams = 1.5\n",
            "[connections] relay_max_streams: expected a whole number, got a number (1.5)",
        ),
        ('[logging]\nlog_level = "loud"\n', "[logging] log_level: expected one of debug, info"),
        ("[tls]\ntls_cert = [1]\n", "[tls] tls_cert: expected a path, got an array"),
    ],
)
def test_a_wrong_type_or_bound_exits_2_naming_key_and_file(
    tmp_path: Path, text: str, says: str
) -> None:
    config = _config(tmp_path, text)
    result = _static("--config", config, "--data-dir", tmp_path / "data")
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line == f"static: {config}: {says}" or line.startswith(f"static: {config}: {says}"), line


def test_a_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = _static("--config", tmp_path / "nope.toml")
    assert result.returncode == 2
    assert "nope.toml" in result.stderr and "No such file" in result.stderr


def test_print_config_redacts_secrets_and_loads_back(tmp_path: Path) -> None:
    password = "hunter2-s3cret"
    url = f"postgresql://static:{password}@db.example:5432/static?sslpassword=k3y&sslmode=require"
    config = _config(
        tmp_path,
        f'[store]\ndatabase = "{url}"\ndata_dir = "{tmp_path / "data"}"\n'
        '[connections]\nhttp_max_connections = 500\n[rate_limits]\nkey_rate = "off"\n',
    )
    first = _static("--config", config, "--print-config")
    assert first.returncode == 0, first.stderr
    assert password not in first.stdout and "k3y" not in first.stdout
    printed = tomllib.loads(first.stdout)
    assert printed["store"]["database"] == (
        "postgresql://static:REDACTED@db.example:5432/static?sslpassword=REDACTED&sslmode=require"
    )
    # TLS file paths are no secret; unset options are comments, their default said.
    assert "# tls_cert = ...  (unset: none, plaintext)" in first.stdout
    # Nothing was started, and the password never reached stderr either.
    assert password not in first.stderr and not (tmp_path / "data").exists()

    # Round trip: what it printed is a config file giving the same configuration.
    again = _config(tmp_path, first.stdout, "printed.toml")
    second = _static("--config", again, "--print-config")
    assert second.returncode == 0, second.stderr
    assert tomllib.loads(second.stdout) == printed
    # Every option is in it, in its group's table, or a comment naming it when unset.
    for option in options():
        table = printed[option.group]
        assert option.key in table or f"# {option.key} = ..." in first.stdout, option.key

    # A path with quotes, backslashes and a newline survives as well.
    odd = tmp_path / 'we"ird\\dir\nx'
    printed = _printed("--data-dir", odd, "--log-level", "debug")
    assert printed["store"]["data_dir"] == str(odd)
    assert printed["logging"]["log_level"] == "debug"


def test_a_refused_database_url_is_not_echoed_with_its_password(tmp_path: Path) -> None:
    result = _static("--database", "mysql://static:hunter2@db/static", "--data-dir", tmp_path)
    assert result.returncode == 2
    assert "unsupported database URL" in result.stderr and "mysql://static:REDACTED@db/static" in (
        result.stderr
    )
    assert "hunter2" not in result.stderr


def test_redaction() -> None:
    assert redact("postgresql://u:pw@h/db") == "postgresql://u:REDACTED@h/db"
    assert redact("postgresql://u@h/db?password=pw&application_name=a") == (
        "postgresql://u@h/db?password=REDACTED&application_name=a"
    )
    assert redact("postgresql://u:p%40w@h:5/db") == "postgresql://u:REDACTED@h:5/db"
    assert redact("sqlite:///var/lib/static/static.db") == "sqlite:///var/lib/static/static.db"
    # Not a URL: all of it.
    assert redact("hunter2") == "REDACTED"


@pytest.fixture
def configured_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, int, Path]]:
    """``static serve --config FILE`` alone, its ports, data dir and limits from the file."""
    http, relay = free_port(), free_port()
    data = tmp_path / "data"
    config = _config(
        tmp_path,
        f'[network]\nhttp = "127.0.0.1:{http}"\nrelay = "127.0.0.1:{relay}"\n'
        f'[store]\ndata_dir = "{data}"\n[rate_limits]\nsignup_rate = "1/3600"\n',
    )
    stderr = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "static", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=_clean_env(),
    )
    stderr.close()
    try:
        yield proc, http, relay, data
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_server_serves_what_its_config_file_says(
    configured_server: tuple[subprocess.Popen[str], int, int, Path], tmp_path: Path
) -> None:
    proc, http, relay, data = configured_server
    assert proc.stdout is not None
    said = b""
    deadline = time.monotonic() + 60
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while b"relay: " not in said or not said.endswith(b"\n"):
            stderr = (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline and proc.poll() is None, stderr
            if selector.select(timeout=0.2):
                said += os.read(proc.stdout.fileno(), 4096)
    lines = said.decode().splitlines()
    assert f"http: http://127.0.0.1:{http}" in lines
    assert f"relay: grpc://127.0.0.1:{relay}" in lines
    assert (data / "static.db").exists()
    with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=10) as client:
        assert client.get("/healthz").status_code == 200
        # The file's signup limit: one signup an hour per address.
        assert client.post("/v1/accounts", json={"email": unique_email()}).status_code == 200
        assert_error(client.post("/v1/accounts", json={"email": unique_email()}), 429)
    proc.terminate()
    assert proc.wait(timeout=30) == 0

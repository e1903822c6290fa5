"""``static serve``'s options: one table (group, flag, environment variable, config-file key,
type, default, bounds, help, secret or not) from which the command line, the environment and the
``--config`` TOML file are read, their precedence applied, and ``--print-config`` written.

Precedence: a flag beats its environment variable, which beats the file, which beats the default.
The relay's tunables come from its own table (``static._native.relay.relay_settings()``); only
their group is chosen here. Everything here raises :class:`ConfigError` (a ``ValueError``);
``static.cli`` turns it into exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import ssl
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from static._settings import (
    MAX_TOKEN_TTL_SECONDS,
    Address,
    ApiSettings,
    LogSettings,
    RateLimit,
    RelaySettings,
    ServerSettings,
    TlsSettings,
)

__all__ = [
    "FILE_RESERVE",
    "GROUPS",
    "ConfigError",
    "Configuration",
    "Group",
    "Option",
    "add_arguments",
    "load",
    "options",
    "server_settings",
    "to_toml",
]

#: Open files kept beyond both ports' connection caps: the store's connections (SQLite's
#: database, WAL and shared-memory files per connection, or PostgreSQL sockets), the
#: listeners, the signing key, the runtimes' own descriptors. So that one port filling up
#: cannot starve the other or the store (measured at e879e1d: 20,000 idle relay connections
#: took every descriptor; /healthz and new relay calls timed out).
FILE_RESERVE: Final = 256
#: The environment variable naming the config file (``--config`` beats it).
CONFIG_ENV: Final = "STATIC_CONFIG"
#: A config file is a few kilobytes; anything this big is a mistake (bounded reading).
_MAX_CONFIG_BYTES: Final = 1024 * 1024
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})
#: What replaces a secret in ``--print-config``.
REDACTED: Final = "REDACTED"


class ConfigError(ValueError):
    """A configuration ``static serve`` refuses (exit code 2), its message naming where."""


@dataclass(frozen=True)
class Group:
    """A group of options: its ``--help`` section and its table in the config file."""

    table: str
    title: str
    description: str


GROUPS: Final = (
    Group("network", "network", "the addresses served"),
    Group("tls", "TLS", "TLS on both ports (give both files or neither)"),
    Group("store", "store", "where accounts, keys, channels and the signing key are kept"),
    Group(
        "auth", "keys and tokens", "who may call the relay, and for how long keys and tokens live"
    ),
    Group(
        "connections",
        "connections",
        "connections served at once and how long idle ones stay; the caps left unset are fitted "
        "to the open-file limit",
    ),
    Group("rate_limits", "rate limits", "requests, publishes and claims allowed per caller"),
    Group("relay_limits", "relay limits", "the relay's per-message, per-stream and memory limits"),
    Group("retention", "retention", "how long channels' entries, Welcomes and the audit log stay"),
    Group("logging", "logging", "log records written to stderr"),
)
_GROUP: Final = {group.table: group for group in GROUPS}

#: The relay's tunables outside :data:`GROUPS`' ``relay_limits`` (the default for a new one).
_RELAY_GROUPS: Final = {
    "tls_handshake_timeout": "tls",
    "max_connections": "connections",
    "max_connections_per_address": "connections",
    "idle_timeout": "connections",
    "max_streams_per_connection": "connections",
    "reset_burst": "connections",
    "reset_rate_per_second": "connections",
    "publish_rate_per_agent": "rate_limits",
    "create_rate_per_account": "rate_limits",
    "org_claims_per_minute": "rate_limits",
    "claim_rate_per_account": "rate_limits",
    "claim_rate_per_address": "rate_limits",
    "retention_max_age": "retention",
    "retention_max_entries": "retention",
    "retention_max_bytes": "retention",
    "welcome_ttl": "retention",
    "used_welcome_grace": "retention",
    "idempotency_window": "retention",
    "prune_interval": "retention",
    "prune_batch": "retention",
}
#: The relay's tunables left unset (None) until the open-file limit is known.
_FITTED: Final = {
    "max_connections": "{default:.10g}, lowered to fit the open-file limit",
    "max_connections_per_address": "{default:.10g}, at most --relay-max-connections",
}
#: The connection caps fitted to the open-file limit when unset (keys), each with its cap per
#: client address (at most the overall cap when unset).
_CAPS: Final = {
    "relay_max_connections": "relay_max_connections_per_address",
    "http_max_connections": "http_max_connections_per_address",
}

#: Kind -> (what a value is, in messages; its metavar).
_KINDS: Final = {
    "address": ("HOST:PORT", "HOST:PORT"),
    "path": ("a path", "PATH"),
    "url": ("a URL", "URL"),
    "bool": ("true or false", ""),
    "count": ("a whole number", "N"),
    "real": ("a number", "NUMBER"),
    "seconds": ("a number of seconds", "SECONDS"),
    "rate": ("N/SECONDS or off", "N/SECONDS"),
    "choice": ("one of", ""),
}
_RELAY_KINDS: Final = {"count": "count", "real": "real", "seconds": "seconds"}


@dataclass(frozen=True)
class Option:
    """One option of ``static serve``: ``--flag``, ``STATIC_FLAG`` and ``[group] flag`` in the
    config file (the flag's name with underscores), and what its values may be."""

    group: str
    flag: str
    kind: str
    #: The value when nothing sets it (None: unset, see ``default_text``).
    default: Any
    help: str
    #: ``--help``'s and the docs' words for the default, when not the value itself.
    default_text: str | None = None
    #: Inclusive bounds of a number (``low_open``: above ``low``), and their words if not
    #: the usual ones.
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    bounds_text: str | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    #: ``--print-config`` redacts it (a URL's password and secret parameters; anything else
    #: whole).
    secret: bool = False
    #: The relay tunable it sets (``relay_settings()``'s name), if one.
    relay_name: str | None = None
    #: A connection cap's default, lowered to fit the open-file limit (``default`` is None).
    fitted_from: int | None = None

    @property
    def key(self) -> str:
        """The config file's key (in table ``group``) and the argparse destination."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return "STATIC_" + self.key.upper()

    @property
    def what(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return _KINDS[self.kind][0]

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        return _text(self, self.default)

    def parse(self, text: str) -> Any:
        """The value of ``text`` (a flag's or an environment variable's); ValueError if not
        one of :attr:`what`."""
        stripped = text.strip()
        try:
            match self.kind:
                case "address":
                    return Address.parse(stripped)
                case "path":
                    if stripped:
                        return Path(text)
                case "url":
                    if stripped:
                        return text
                case "bool":
                    if stripped.lower() in _TRUE | _FALSE:
                        return stripped.lower() in _TRUE
                case "count":
                    return int(stripped)
                case "real" | "seconds":
                    return float(stripped)
                case "rate":
                    return RateLimit.parse(stripped)
                case "choice":
                    if stripped.lower() in self.choices:
                        return stripped.lower()
        except ValueError:
            pass
        raise ValueError(f"expected {self.what}, got {text!r}")

    def from_toml(self, value: Any) -> Any:
        """The value of a config file's ``value``; ValueError if not one of :attr:`what`."""
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
        elif self.kind == "count":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif self.kind in ("real", "seconds"):
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif isinstance(value, str):
            return self.parse(value)
        raise ValueError(f"expected {self.what}, got {_toml_value(value)}")

    def check(self, value: Any) -> None:
        """ValueError ``must be ...`` unless a number ``value`` is within the bounds."""
        if self.low is None or self.high is None or value is None:
            return
        above = self.low < value if self.low_open else self.low <= value
        if above and value <= self.high:  # NaN is neither
            return
        if self.bounds_text is not None:
            bounds = self.bounds_text
        elif math.isinf(self.high):
            bounds = f">= {self.low:,.10g}"
        else:
            bounds = f"between {self.low:,.10g} and {self.high:,.10g}"
        raise ValueError(f"must be {bounds}")


@functools.cache
def options() -> tuple[Option, ...]:
    """Every option of ``static serve``, in ``--help``'s order within each group."""
    from static._logging import LOG_FORMATS, LOG_LEVELS
    from static._native.relay import relay_settings

    defaults = ServerSettings()
    api = defaults.api
    rate = "; 'off' disables"
    ours = [
        Option(
            "network",
            "--http",
            "address",
            defaults.http,
            "HTTP API address; port 0 picks a free port",
        ),
        Option(
            "network",
            "--relay",
            "address",
            defaults.relay,
            "relay (gRPC) address; port 0 picks a free port",
        ),
        Option(
            "network",
            "--metrics",
            "address",
            defaults.metrics,
            "serve GET /metrics on this address alone (not on the HTTP port)",
            default_text="on the HTTP port",
        ),
        Option(
            "tls",
            "--tls-cert",
            "path",
            None,
            "PEM certificate chain (leaf first): both ports serve TLS (HTTP/1.1 and h2 on the "
            "API); give both --tls-cert and --tls-key, or neither",
            default_text="none, plaintext",
            metavar="FILE",
        ),
        Option(
            "tls",
            "--tls-key",
            "path",
            None,
            "PEM private key of that certificate",
            default_text="none, plaintext",
            metavar="FILE",
        ),
        Option(
            "store",
            "--database",
            "url",
            defaults.database_url,
            "sqlite:///PATH or postgresql://...",
            default_text="sqlite:///<data-dir>/static.db",
            secret=True,
        ),
        Option(
            "store",
            "--data-dir",
            "path",
            defaults.data_dir,
            "directory for the SQLite database and the signing key",
            metavar="DIR",
        ),
        Option(
            "auth",
            "--allow-anonymous",
            "bool",
            defaults.relay_settings.allow_anonymous,
            "accept relay calls without a token",
        ),
        Option(
            "auth",
            "--token-ttl",
            "count",
            api.token_ttl_seconds,
            "lifetime of the JWTs minted by POST /v1/tokens, in seconds",
            low=1,
            high=MAX_TOKEN_TTL_SECONDS,
            bounds_text=f"between 1 and {MAX_TOKEN_TTL_SECONDS} seconds",
            metavar="SECONDS",
        ),
        Option(
            "auth",
            "--max-key-lifetime",
            "count",
            api.max_key_lifetime_seconds,
            "the longest expires_in a new key may ask for, in seconds; then every new key must ask",
            default_text="none, keys may live forever",
            low=1,
            high=31_536_000,
            bounds_text="between 1 and 31536000 seconds",
            metavar="SECONDS",
        ),
        Option(
            "connections",
            "--http-max-connections",
            "count",
            None,
            "HTTP connections served at once; more are closed as they come",
            default_text=f"{api.max_connections}, lowered to fit the open-file limit",
            fitted_from=api.max_connections,
            low=1,
            high=10_000_000,
        ),
        Option(
            "connections",
            "--http-max-connections-per-address",
            "count",
            None,
            "HTTP connections served at once per client address (an IPv6 client's /64)",
            default_text=f"{api.max_connections_per_address}, at most --http-max-connections",
            fitted_from=api.max_connections_per_address,
            low=1,
            high=10_000_000,
        ),
        Option(
            "rate_limits",
            "--signup-rate",
            "rate",
            api.signup_rate_limit,
            "POST /v1/accounts allowed per client address: bursts of N, N per SECONDS" + rate,
        ),
        Option(
            "rate_limits",
            "--key-rate",
            "rate",
            api.key_rate_limit,
            "authenticated requests allowed per API key (JWTs count against their key)" + rate,
        ),
        Option(
            "rate_limits",
            "--account-rate",
            "rate",
            api.account_rate_limit,
            "authenticated requests allowed per account, all its keys and JWTs together "
            "(beside --key-rate)" + rate,
        ),
        Option(
            "rate_limits",
            "--auth-failure-rate",
            "rate",
            api.auth_failure_rate_limit,
            "failed authentications allowed per client address, on each port (then 429, or "
            "RESOURCE_EXHAUSTED on the relay): bursts of N, N per SECONDS" + rate,
        ),
        Option(
            "retention",
            "--audit-retention-days",
            "real",
            api.audit_retention_days,
            "days the audit log keeps its events (GET /v1/audit)",
            low=0,
            high=36_500,
            low_open=True,
            bounds_text="above 0 and at most 36500",
            metavar="DAYS",
        ),
        Option(
            "logging",
            "--log-level",
            "choice",
            defaults.log.level,
            "least severe log records written to stderr; the relay logs every call at debug",
            choices=tuple(LOG_LEVELS),
        ),
        Option(
            "logging",
            "--log-format",
            "choice",
            defaults.log.format,
            "log records as text or as JSON lines",
            choices=tuple(LOG_FORMATS),
        ),
    ]
    for name, flag, kind, default, low, high, text in relay_settings():
        fitted = name in _FITTED
        ours.append(
            Option(
                _RELAY_GROUPS.get(name, "relay_limits"),
                flag,
                _RELAY_KINDS[kind],
                None if fitted else (int(default) if kind == "count" else default),
                text,
                default_text=_FITTED.get(name, "").format(default=default) or None,
                low=low,
                high=high,
                relay_name=name,
                fitted_from=int(default) if fitted else None,
            )
        )
    order = {group.table: index for index, group in enumerate(GROUPS)}
    return tuple(sorted(ours, key=lambda option: order[option.group]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--print-config`` and every option of :func:`options`, in one argument
    group per :data:`GROUPS` entry. An option not given is absent from the parsed namespace
    (:func:`load` then looks further)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="read options from this TOML file, one table per group below (e.g. [network] "
        'http = "0.0.0.0:8080"); flags and environment variables beat it '
        f"[{CONFIG_ENV}] (docs/operators.md)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration as TOML (loadable by --config, secrets "
        "redacted) and exit",
    )
    sections = {
        group.table: parser.add_argument_group(
            f"{group.title} ([{group.table}])", group.description
        )
        for group in GROUPS
    }
    for option in options():
        section = sections[option.group]
        help = f"{option.help} [{option.env}] (default {option.shown_default})"
        help = help.replace("%", "%%")
        if option.kind == "bool":
            section.add_argument(
                option.flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help,
            )
            continue
        section.add_argument(
            option.flag,
            type=_argparse_type(option),
            default=argparse.SUPPRESS,
            metavar=option.metavar
            or ("{" + ",".join(option.choices) + "}" if option.choices else _KINDS[option.kind][1]),
            help=help,
        )


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


@dataclass(frozen=True)
class Configuration:
    """Every option's value (by key) and where it came from: its flag, its environment
    variable, the config file's path, or ``"default"``."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]


def load(args: argparse.Namespace, environ: Mapping[str, str]) -> Configuration:
    """Each option's value from, in this order, its flag in ``args``, its variable in
    ``environ`` (an empty one counts as unset), the config file (``--config`` or
    ``STATIC_CONFIG``), its default; checked against its bounds."""
    given = vars(args)
    config = given.get("config") or environ.get(CONFIG_ENV) or None
    path = Path(config) if config is not None else None
    in_file = _read(path) if path is not None else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in options():
        text = environ.get(option.env, "")
        if option.key in given:
            value, source, where = given[option.key], option.flag, option.flag
        elif text.strip():
            where = source = option.env
            try:
                value = option.parse(text)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        elif option.key in in_file:
            source, where = str(path), f"{path}: [{option.group}] {option.key}"
            try:
                value = option.from_toml(in_file[option.key])
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        else:
            values[option.key], sources[option.key] = option.default, "default"
            continue
        try:
            option.check(value)
        except ValueError as exc:
            raise ConfigError(f"{where} {exc}, got {_text(option, value)}") from None
        values[option.key], sources[option.key] = value, source
    return Configuration(values, sources)


def _read(path: Path) -> dict[str, Any]:
    """The config file's values by key: every table and key known, each key in its table."""
    try:
        with path.open("rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes: not a config file")
    try:
        document = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    by_key = {option.key: option for option in options()}
    found: dict[str, Any] = {}
    for table, body in document.items():
        if table not in _GROUP:
            if table in by_key:
                raise ConfigError(
                    f"{path}: {table} belongs in its table: [{by_key[table].group}] {table} = ..."
                )
            raise ConfigError(f"{path}: unknown table [{table}]{_near(table, list(_GROUP), '[]')}")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {table} must be a table: [{table}]")
        for key, value in body.items():
            option = by_key.get(key)
            if option is not None and option.group != table:
                raise ConfigError(
                    f"{path}: [{table}] {key}: it belongs in [{option.group}], not [{table}]"
                )
            if option is None:
                here = [o.key for o in options() if o.group == table]
                near = _near(key, here, "") or _near(key, list(by_key), "")
                raise ConfigError(f"{path}: unknown key {key!r} in [{table}]{near}")
            found[key] = value
    return found


def _near(word: str, known: list[str], brackets: str) -> str:
    """`` (did you mean X?)`` when ``word`` is close to one of ``known``, else nothing."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    if not close:
        return ""
    open_, close_ = (brackets[0], brackets[1]) if brackets else ("", "")
    return f" (did you mean {open_}{close[0]}{close_}?)"


def to_toml(configuration: Configuration) -> str:
    """``configuration`` as a config file (:func:`load` reads it back), secrets redacted; a
    value that is not the default says where it came from. Unset options are comments."""
    lines = [
        "# static serve: the effective configuration (static serve --print-config).",
        "# Load it with: static serve --config FILE. Secrets are redacted.",
    ]
    for group in GROUPS:
        lines += ["", f"[{group.table}]"]
        for option in options():
            if option.group != group.table:
                continue
            value = configuration.values[option.key]
            source = configuration.sources[option.key]
            if value is None and option.kind != "rate":
                lines.append(f"# {option.key} = ...  (unset: {option.shown_default})")
                continue
            line = f"{option.key} = {_toml(option, value)}"
            if source != "default":
                line += f"  # from {source}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def _toml(option: Option, value: Any) -> str:
    """``value`` written in TOML, redacted if secret."""
    match option.kind:
        case "bool":
            return "true" if value else "false"
        case "count":
            return str(int(value))
        case "real" | "seconds":
            return repr(float(value))  # nan is refused by the bounds
    text = _text(option, value)
    if option.secret:
        text = redact(text)
    return _toml_string(text)


def _text(option: Option, value: Any) -> str:
    """``value`` as its flag takes it."""
    if option.kind == "rate":
        return "off" if value is None else str(value)
    if option.kind in ("real", "seconds"):
        return f"{value:.10g}"
    return str(value)


def _toml_string(text: str) -> str:
    """A TOML basic string of ``text``."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char < " " or char == "\x7f":
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _toml_value(value: Any) -> str:
    """A config file's value as its type and text, for a message."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    if type(value) in kind:
        shown = repr(value).lower() if isinstance(value, bool) else repr(value)
        return f"{kind[type(value)]} ({shown[:80]})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return "a date or time"


def redact(value: str) -> str:
    """``value`` without its secrets: a URL keeps all but its password and its password-like
    query parameters (the rest as written); anything else is replaced whole."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return REDACTED
    if not parts.scheme or "://" not in value:
        return REDACTED
    head, sep, rest = value.partition("?")
    if parts.password is not None:
        user, _, host = parts.netloc.rpartition("@")
        head = head.replace(f"//{parts.netloc}", f"//{user.partition(':')[0]}:{REDACTED}@{host}", 1)
    query, hash_, fragment = rest.partition("#")
    pairs = []
    for pair in query.split("&") if sep else []:
        name = pair.partition("=")[0]
        pairs.append(f"{name}={REDACTED}" if _secret_param(unquote(name)) else pair)
    return head + sep + "&".join(pairs) + hash_ + fragment


def _secret_param(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in ("password", "secret", "token"))


def server_settings(configuration: Configuration, open_files: int) -> ServerSettings:
    """The settings ``static serve`` runs with: the connection caps left unset fitted to
    ``open_files``, the TLS files and the database checked as the server will use them."""
    values = dict(configuration.values)
    _fit_connections(values, open_files)
    settings = ServerSettings(
        http=values["http"],
        relay=values["relay"],
        data_dir=values["data_dir"],
        database_url=values["database"],
        api=ApiSettings(
            token_ttl_seconds=values["token_ttl"],
            signup_rate_limit=values["signup_rate"],
            key_rate_limit=values["key_rate"],
            account_rate_limit=values["account_rate"],
            max_key_lifetime_seconds=values["max_key_lifetime"],
            audit_retention_days=values["audit_retention_days"],
            auth_failure_rate_limit=values["auth_failure_rate"],
            max_connections=values["http_max_connections"],
            max_connections_per_address=values["http_max_connections_per_address"],
        ),
        relay_settings=RelaySettings(
            allow_anonymous=values["allow_anonymous"],
            tunables={o.relay_name: values[o.key] for o in options() if o.relay_name},
        ),
        metrics=values["metrics"],
        log=LogSettings(level=values["log_level"], format=values["log_format"]),
        tls=_tls(values["tls_cert"], values["tls_key"]),
    )
    from static.store import database_location

    # The relay opens the database itself: one it cannot share (SQLite in memory) is refused
    # here, as a configuration error, not once the HTTP API is already up.
    url = settings.resolved_database_url
    try:
        database_location(url)
    except ValueError as exc:
        raise ConfigError(str(exc).replace(url, redact(url))) from None  # never echo a password
    return settings


def _tls(cert: Path | None, key: Path | None) -> TlsSettings | None:
    """The TLS files, checked now as both ports will load them: a bad one is a configuration
    error naming the file, not a failure at the first handshake."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    from static._native.relay import check_tls_files

    tls = TlsSettings(cert, key)
    try:
        check_tls_files(tls.cert, tls.key)  # the relay's rustls; says which file
    except ValueError as exc:
        raise ConfigError(f"cannot serve TLS: {exc}") from None
    try:
        # The HTTP API's: Python's ssl (OpenSSL), which might refuse what rustls took.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert, tls.key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--tls-cert {tls.cert} and --tls-key {tls.key}: the HTTP API cannot serve TLS "
            f"with them: {exc}"
        ) from None
    return tls


def _fit_connections(values: dict[str, Any], open_files: int) -> None:
    """Fill in the connection caps left unset, so that the relay's and the HTTP API's caps
    and :data:`FILE_RESERVE` fit in ``open_files``: their defaults, or less in the same
    proportion when those do not fit. Caps that were set must fit as they are. A cap per
    address left unset is its default, or the overall cap if lower."""
    by_key = {option.key: option for option in options()}
    caps = {key: int(by_key[key].fitted_from or 1) for key in _CAPS}
    room = open_files - FILE_RESERVE
    unset = [key for key in caps if values[key] is None]
    left = room - sum(values[key] for key in caps if values[key] is not None)
    wanted = sum(caps[key] for key in unset)
    for key in unset:
        share = caps[key] if wanted <= left else left * caps[key] // max(wanted, 1)
        values[key] = max(1, share)
    total = sum(values[key] for key in caps)
    if total > room:
        said = " and ".join(f"{by_key[key].flag} ({values[key]})" for key in caps)
        raise ConfigError(
            f"{said} with {FILE_RESERVE} files kept for the store need {total + FILE_RESERVE} "
            f"open files; this process may open {open_files} (ulimit -n): raise that limit or "
            "lower the caps"
        )
    for key, cap in _CAPS.items():
        if values[cap] is None:
            values[cap] = min(int(by_key[cap].fitted_from or 1), values[key])

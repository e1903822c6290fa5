"""Server settings: frozen, built once by ``static serve`` (``static.cli``) and passed down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Address",
    "ApiSettings",
    "LogSettings",
    "RateLimit",
    "RelaySettings",
    "ServerSettings",
    "TlsSettings",
]


@dataclass(frozen=True, slots=True)
class Address:
    """A host and port to bind; port 0 picks a free port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``HOST:PORT`` (``[v6]:PORT`` for IPv6)."""
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A token bucket: bursts of ``requests``, refilled at ``requests`` per ``per_seconds``."""

    requests: int
    per_seconds: float

    @classmethod
    def parse(cls, text: str) -> RateLimit | None:
        """Parse ``N/SECONDS`` (e.g. ``10/60``); ``off`` disables the limit (None)."""
        if text.strip().lower() in {"off", "none", "0"}:
            return None
        count, sep, seconds = text.partition("/")
        try:
            limit = cls(int(count), float(seconds))
        except ValueError:
            limit = None
        if not sep or limit is None or limit.requests < 1 or not limit.per_seconds > 0:
            raise ValueError(f"expected N/SECONDS or off, got {text!r}")
        return limit

    def __str__(self) -> str:
        return f"{self.requests}/{self.per_seconds:g}"


#: The longest lifetime ``--token-ttl`` allows, and so the largest ``exp - iat`` a token may
#: carry to be accepted.
MAX_TOKEN_TTL_SECONDS = 86_400


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """The HTTP API's knobs."""

    #: Lifetime of the JWTs minted by POST /v1/tokens.
    token_ttl_seconds: int = 900
    #: The ``iss`` of the JWTs.
    token_issuer: str = "static"
    #: The ``aud`` of the JWTs (the relay accepts only this audience).
    token_audience: str = "static-relay"
    #: Largest request body accepted (413 past it).
    max_body_bytes: int = 64 * 1024
    #: Seconds an in-flight request may take to finish after a shutdown signal.
    graceful_timeout_seconds: float = 10.0
    #: Active keys an account may hold (409 past it).
    max_keys_per_account: int = 100
    #: POST /v1/accounts per client address; None disables.
    signup_rate_limit: RateLimit | None = field(default_factory=lambda: RateLimit(10, 60))
    #: Authenticated requests per API key (JWTs count against the key they came from).
    key_rate_limit: RateLimit | None = field(default_factory=lambda: RateLimit(600, 60))
    #: Authenticated requests per account, all its keys and JWTs together (beside the key's).
    account_rate_limit: RateLimit | None = field(default_factory=lambda: RateLimit(1200, 60))
    #: The longest lifetime a new key may ask for (``expires_in``); then it must ask. None: no
    #: maximum, and a key may never expire.
    max_key_lifetime_seconds: int | None = None
    #: Days the audit log keeps its events (both tables; pruned hourly and at start).
    audit_retention_days: float = 90.0
    #: Seconds between sweeps of ended keys (rolled past grace, newly expired).
    key_sweep_seconds: float = 2.0
    #: Failed authentications (401s of every authenticating route; refused tokens on the
    #: relay, a budget of its own) per client address (an IPv6 client's /64); past it, 429
    #: (RESOURCE_EXHAUSTED) until the bucket refills. None disables.
    auth_failure_rate_limit: RateLimit | None = field(default_factory=lambda: RateLimit(100, 60))
    #: Seconds between writes of the coalesced ``last_used_at`` updates.
    last_used_flush_seconds: float = 0.5
    #: Connections served at once, overall and per client address (an IPv6 client's /64);
    #: more are closed as soon as they are accepted (checked against the open-file limit at
    #: startup, ``static.cli``).
    max_connections: int = 1_000
    max_connections_per_address: int = 256
    #: With TLS, seconds a connection may take to complete its handshake; one that never does
    #: holds its place in the caps above only this long (the relay's own is its
    #: ``tls_handshake_timeout`` tunable; the same reasoning sets both to 10 s).
    tls_handshake_timeout_seconds: float = 10.0


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """The relay's knobs. Its tunable settings (limits, intervals, rates) are not repeated here:
    their names, defaults, bounds and flags are the relay's one table
    (``static._native.relay.relay_settings()``, ``crates/relay/src/settings.rs``)."""

    #: Accept relay calls without a token (``--allow-anonymous``).
    allow_anonymous: bool = False
    #: How often the API keys behind live streams are re-checked for revocation.
    revocation_check_seconds: float = 0.5
    #: How often the keys behind bound leaves are checked, and the leaves of inactive keys
    #: (revoked, expired, past a roll's grace) proposed for removal from their channels
    #: (docs/design.md §5.2, "Removal on revocation"); a revocation heard of wakes it at once.
    removal_check_seconds: float = 2.0
    #: Tunable settings by name, each replacing the relay's default (the rest keep theirs).
    tunables: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LogSettings:
    """Logging of ``static serve`` (set up by ``static.cli.main``, ``static._logging``)."""

    #: ``debug``, ``info``, ``warning`` or ``error``: the HTTP access log is at info, the
    #: relay's at info for refusals and debug for every call.
    level: str = "info"
    #: ``text`` or ``json`` (one object a line).
    format: str = "text"


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """The PEM certificate chain (leaf first) and private key both ports serve TLS with."""

    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Everything ``static serve`` needs."""

    http: Address = field(default_factory=lambda: Address("127.0.0.1", 8080))
    relay: Address = field(default_factory=lambda: Address("127.0.0.1", 50051))
    data_dir: Path = Path("static-data")
    #: ``sqlite:///PATH`` or ``postgresql://...``; None means SQLite in ``data_dir``.
    database_url: str | None = None
    api: ApiSettings = field(default_factory=ApiSettings)
    relay_settings: RelaySettings = field(default_factory=RelaySettings)
    #: Where ``GET /metrics`` is served alone (``--metrics``); None: on the HTTP port.
    metrics: Address | None = None
    log: LogSettings = field(default_factory=LogSettings)
    #: TLS on both ports (``--tls-cert``/``--tls-key``); None serves plaintext.
    tls: TlsSettings | None = None

    @property
    def resolved_database_url(self) -> str:
        """The database URL, defaulting to ``sqlite:///<data_dir>/static.db``."""
        if self.database_url is not None:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'static.db'}"

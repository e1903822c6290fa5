"""Where the client commands find the service: flags, then the environment, then a context
(files under ``$XDG_CONFIG_HOME/static/``, as ``nats`` keeps its contexts)."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from static._api_client import CA_FILE_ENV, KEY_CHARS
from static._commands._errors import CommandError

__all__ = [
    "API_KEY_ENV",
    "API_URL_ENV",
    "RELAY_URL_ENV",
    "Context",
    "Settings",
    "check_key",
    "config_dir",
    "current_context",
    "delete_context",
    "global_flags",
    "key_prefix",
    "list_contexts",
    "load_context",
    "read_key_file",
    "safe_name",
    "save_context",
    "settings",
    "use_context",
    "xdg_dir",
]

API_URL_ENV: Final = "STATIC_API_URL"
RELAY_URL_ENV: Final = "STATIC_RELAY_URL"
API_KEY_ENV: Final = "STATIC_API_KEY"

#: A context or agent name: a letter or digit, then letters, digits, ``.``, ``_``, ``-``,
#: ``@``, ``+``; no ``/`` (it names a file or directory) and no ``..``.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]*")
MAX_NAME: Final = 64
#: A key file or a context file is small; reading stops here (a wrong path such as a disk
#: image must not be read whole).
_MAX_FILE: Final = 64 * 1024
#: Shown of a key: its public prefix (``sk_live_`` + 8 characters, as GET /v1/keys lists it).
_PREFIX_LENGTH: Final = 16


def safe_name(kind: str, text: str) -> str:
    """``text`` if it may name a file (a context, an agent), else :class:`CommandError`."""
    if not 1 <= len(text) <= MAX_NAME or not _NAME.fullmatch(text) or ".." in text:
        raise CommandError(
            f"invalid {kind} name {text[: MAX_NAME + 1]!r}: 1 to {MAX_NAME} letters, digits, "
            "'.', '_', '-', '@' or '+', starting with a letter or digit, without '..'"
        )
    return text


def xdg_dir(variable: str, fallback: str) -> Path:
    """``$variable`` when it is an absolute path (the XDG rule), else ``~/fallback``."""
    value = os.environ.get(variable, "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / fallback


def config_dir() -> Path:
    return xdg_dir("XDG_CONFIG_HOME", ".config") / "static"


def _contexts_dir() -> Path:
    return config_dir() / "context"


def _current_file() -> Path:
    return config_dir() / "context.txt"


def _private_dir(path: Path) -> None:
    """``path`` and the ``static`` directory above it, owner-only (0700)."""
    for directory in (config_dir(), path):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a new owner-only file (0600), replacing it at once."""
    _private_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _read_small(path: Path, what: str) -> str:
    try:
        with path.open("rb") as file:
            raw = file.read(_MAX_FILE + 1)
    except OSError as exc:
        raise CommandError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_FILE:
        raise CommandError(f"{what} {path} is larger than {_MAX_FILE} bytes: not one")
    return raw.decode("utf-8", errors="replace")


def check_key(key: str, source: str) -> str:
    """``key`` without surrounding whitespace, if it can be an API key; else an error naming
    ``source``, never the value (it is a secret, or something pasted by mistake)."""
    key = key.strip()
    if not key:
        raise CommandError(f"the API key from {source} is empty")
    if not all(KEY_CHARS[0] <= ord(c) <= KEY_CHARS[1] for c in key):
        raise CommandError(
            f"the API key from {source} is not a key (whitespace, control or non-ASCII "
            "characters inside it); its value is not shown"
        )
    return key


def read_key_file(path: str | Path) -> str:
    return check_key(_read_small(Path(path), "API key file"), f"key file {path}")


def key_prefix(key: str) -> str:
    """What may be shown of ``key``."""
    return key[:_PREFIX_LENGTH] + "…"


@dataclass(frozen=True)
class Context:
    """A named set of addresses and a key: ``api_key_file`` (a path, from ``context add``)
    or ``api_key`` (the key itself, saved by ``account create``; the file is 0600)."""

    name: str
    api_url: str | None = None
    relay_url: str | None = None
    ca_file: str | None = None
    api_key_file: str | None = None
    api_key: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, str]:
        fields = {
            "api_url": self.api_url,
            "relay_url": self.relay_url,
            "ca_file": self.ca_file,
            "api_key_file": self.api_key_file,
            "api_key": self.api_key,
        }
        return {name: value for name, value in fields.items() if value is not None}


def _context_path(name: str) -> Path:
    return _contexts_dir() / f"{safe_name('context', name)}.json"


def load_context(name: str) -> Context:
    path = _context_path(name)
    if not path.exists():
        raise CommandError(f"no context {name!r} (static context list shows them)")
    try:
        data = json.loads(_read_small(path, "context file"))
    except ValueError:
        raise CommandError(f"context file {path} is damaged: not JSON") from None
    if not isinstance(data, dict):
        raise CommandError(f"context file {path} is damaged: not a JSON object")
    values: dict[str, str | None] = {}
    for key in ("api_url", "relay_url", "ca_file", "api_key_file", "api_key"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise CommandError(f"context file {path} is damaged: {key} is not a string")
        values[key] = value or None
    return Context(name, **values)


def save_context(context: Context) -> Path:
    path = _context_path(context.name)
    _write_private(path, json.dumps(context.to_json(), indent=2) + "\n")
    return path


def list_contexts() -> list[str]:
    directory = _contexts_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.json") if _NAME.fullmatch(p.stem))


def current_context() -> str | None:
    """The context ``static context use`` chose, if any."""
    path = _current_file()
    if not path.exists():
        return None
    name = _read_small(path, "file").strip()
    return name or None


def use_context(name: str | None) -> None:
    """Make ``name`` the current context (None: no current context)."""
    if name is None:
        _current_file().unlink(missing_ok=True)
        return
    load_context(name)
    _write_private(_current_file(), name + "\n")


def delete_context(name: str) -> None:
    path = _context_path(name)
    if not path.exists():
        raise CommandError(f"no context {name!r}")
    path.unlink()
    if current_context() == name:
        use_context(None)


def global_flags(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """The flags every client command takes, before or after the command's name."""
    default = None if top else argparse.SUPPRESS
    group = parser.add_argument_group(
        "service (a flag beats the environment, which beats the context)"
    )
    group.add_argument(
        "--api-url", default=default, metavar="URL", help=f"the HTTP API [{API_URL_ENV}]"
    )
    group.add_argument(
        "--relay-url", default=default, metavar="URL", help=f"the relay [{RELAY_URL_ENV}]"
    )
    group.add_argument(
        "--api-key-file",
        default=default,
        metavar="FILE",
        help=f"a file holding the API key (never the key itself on the command line) "
        f"[{API_KEY_ENV}: the key]",
    )
    group.add_argument(
        "--ca-file",
        default=default,
        metavar="FILE",
        help=f"PEM CA certificates to trust for https:// (a private CA) [{CA_FILE_ENV}]",
    )
    group.add_argument(
        "--context",
        default=default,
        metavar="NAME",
        help="use this context instead of the current one (static context use)",
    )


@dataclass(frozen=True)
class Settings:
    """Where a command goes and with which key, each resolved flag > environment > context."""

    api_url: str | None
    relay_url: str | None
    ca_file: str | None
    context: str | None
    #: Where the key comes from, for messages ("--api-key-file F", "STATIC_API_KEY", ...).
    key_source: str | None
    _key: str | None = field(default=None, repr=False)
    _key_file: str | None = None

    def need_api_url(self) -> str:
        if not self.api_url:
            raise CommandError(_missing("API URL", f"--api-url URL or {API_URL_ENV}"))
        return _check_url(self.api_url, "API URL", ("http", "https"))

    def need_relay_url(self) -> str:
        if not self.relay_url:
            raise CommandError(_missing("relay URL", f"--relay-url URL or {RELAY_URL_ENV}"))
        return _check_url(self.relay_url, "relay URL", ("grpc", "http", "https"))

    def key(self) -> str | None:
        """The API key, read now (None when none is configured)."""
        if self._key_file is not None:
            return read_key_file(self._key_file)
        if self._key is not None:
            return check_key(self._key, self.key_source or "")
        return None

    def need_key(self) -> str:
        key = self.key()
        if key is None:
            raise CommandError(_missing("API key", f"--api-key-file FILE or {API_KEY_ENV}"))
        return key


def _missing(what: str, flags: str) -> str:
    return (
        f"no {what} configured: pass {flags}, or add a context "
        "(static context add NAME --api-url URL --relay-url URL --key-file FILE; "
        "static context use NAME)"
    )


def _check_url(url: str, what: str, schemes: tuple[str, ...]) -> str:
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in schemes:
        raise CommandError(
            f"the {what} {url[:200]!r} must start with " + " or ".join(f"{s}://" for s in schemes)
        )
    return url


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def settings(args: argparse.Namespace) -> Settings:
    """The resolved configuration of a command's flags ``args``."""
    chosen = getattr(args, "context", None)
    name = chosen or current_context()
    context = load_context(name) if name else Context("")
    key_file: str | None = getattr(args, "api_key_file", None)
    key: str | None = None
    if key_file:
        source = f"--api-key-file {key_file}"
    elif _env(API_KEY_ENV):
        key, source = _env(API_KEY_ENV), API_KEY_ENV
    elif context.api_key:
        key, source = context.api_key, f"context {name!r}"
    elif context.api_key_file:
        key_file, source = (
            context.api_key_file,
            f"key file {context.api_key_file} (context {name!r})",
        )
    else:
        source = None
    return Settings(
        api_url=getattr(args, "api_url", None) or _env(API_URL_ENV) or context.api_url,
        relay_url=getattr(args, "relay_url", None) or _env(RELAY_URL_ENV) or context.relay_url,
        ca_file=getattr(args, "ca_file", None) or _env(CA_FILE_ENV) or context.ca_file,
        context=name,
        key_source=source,
        _key=key,
        _key_file=key_file or None,
    )

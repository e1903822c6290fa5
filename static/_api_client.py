"""The HTTP API seen from a client (stdlib only, so that neither the SDK nor the command line
depends on the server's packages): the key exchange for relay tokens at ``POST /v1/tokens``,
the CA file, and the API's refusals and TLS failures said for a person. Outside ``static.sdk``
so that the command line's account and key commands load without the SDK (and trio)."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Final

from static._errors import AuthError, TransportError

__all__ = [
    "CA_FILE_ENV",
    "KEY_CHARS",
    "TokenSource",
    "error_text",
    "resolve_ca_file",
    "tls_failure",
]

_TIMEOUT = 10.0
#: The characters an API key may hold: printable ASCII without space.
KEY_CHARS = (0x21, 0x7E)

#: The environment variable naming the CA file when ``StaticClient`` is given none.
CA_FILE_ENV: Final = "STATIC_CA_FILE"
_PRIVATE_CA_HINT: Final = f"for a private CA, pass its certificate as ca_file= (or {CA_FILE_ENV})"


def resolve_ca_file(ca_file: str | os.PathLike[str] | None) -> str | None:
    """The CA file (PEM) the SDK's TLS trusts, for the relay and the HTTP API alike:
    ``ca_file``, else ``$STATIC_CA_FILE``, else None (the system's roots)."""
    if ca_file is None:
        return os.environ.get(CA_FILE_ENV) or None
    path = os.fspath(ca_file)
    if not isinstance(path, str):
        raise TypeError("ca_file must be a str or a path, not bytes")
    return path


def tls_failure(url: str, reason: object) -> str | None:
    """What went wrong in a TLS handshake with the API, said for a person; None when
    ``reason`` is not a TLS failure."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (
            f"the API's TLS certificate at {url} was not trusted "
            f"({reason.verify_message}); {_PRIVATE_CA_HINT}"
        )
    if isinstance(reason, ssl.SSLError):
        return (
            f"the TLS handshake with the API at {url} failed ({reason.reason or reason}); is "
            "it serving TLS there? (use http:// for a plaintext API)"
        )
    return None


class TokenSource:
    """A callable returning ``(access_token, expires_in_seconds)`` for an API key.

    Raises :class:`AuthError` when the API refuses the key (invalid, revoked) and
    :class:`TransportError` when the API cannot be reached or answers unexpectedly; the native
    client treats the first as final and retries the second.
    """

    def __init__(self, api_url: str, api_key: str, ca_file: str | None = None) -> None:
        if not isinstance(api_key, str):
            raise AuthError(f"api_key must be a str, not {type(api_key).__name__}")
        # A key read from a file keeps its newline: surrounding whitespace is no part of a key.
        api_key = api_key.strip()
        if not api_key:
            raise AuthError("api_key must be a non-empty string")
        if not all(KEY_CHARS[0] <= ord(c) <= KEY_CHARS[1] for c in api_key):
            # Never shown: it is a secret, and probably a wrong value (two keys on a line...).
            raise AuthError(
                "api_key contains characters no API key has (whitespace or control "
                "characters inside it, or non-ASCII); its value is not shown"
            )
        self._url = api_url.rstrip("/") + "/v1/tokens"
        self._api_key = api_key
        self._context: ssl.SSLContext | None = None
        if ca_file is not None:
            try:
                self._context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise TransportError(f"ca_file {ca_file}: cannot load it: {exc}") from None

    def _redacted(self, text: str) -> str:
        """``text`` without the key (an HTTP library may quote the header it refused)."""
        return text.replace(self._api_key, "<api_key>")

    def __repr__(self) -> str:
        return f"TokenSource({self._url!r})"

    @property
    def url(self) -> str:
        return self._url

    def __call__(self) -> tuple[str, float]:
        request = urllib.request.Request(
            self._url,
            data=b"",
            method="POST",
            headers={
                "Authorization": f"Bearer {self._api_key}",
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(
                request, timeout=_TIMEOUT, context=self._context
            ) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            text = self._redacted(error_text(err))
            if err.code in (401, 403):
                raise AuthError(f"the API refused the key at {self._url}: {text}") from None
            raise TransportError(f"POST {self._url} answered {err.code}: {text}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            cause = getattr(err, "reason", err)
            tls = tls_failure(self._url, cause)
            if tls is not None:
                raise TransportError(tls) from None
            reason = self._redacted(str(cause))
            raise TransportError(f"cannot reach the API at {self._url}: {reason}") from None
        try:
            body = json.loads(raw)
            token = body["access_token"]
            expires_in = float(body["expires_in"])
        except (ValueError, KeyError, TypeError):
            raise TransportError(
                f"POST {self._url} answered something that is not a token: {raw[:200]!r}"
            ) from None
        if not isinstance(token, str) or not token:
            raise TransportError(f"POST {self._url} answered an empty token")
        return token, expires_in


def error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read())
    except (ValueError, OSError):
        return err.reason if isinstance(err.reason, str) else str(err.code)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return str(err.code)

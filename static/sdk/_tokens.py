"""Exchanging an API key for relay tokens at ``POST /v1/tokens`` (stdlib only: the SDK must not
depend on the server's packages)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from static._errors import AuthError, TransportError

__all__ = ["TokenSource"]

_TIMEOUT = 10.0
#: The characters an API key may hold: printable ASCII without space.
_KEY_CHARS = (0x21, 0x7E)


class TokenSource:
    """A callable returning ``(access_token, expires_in_seconds)`` for an API key.

    Raises :class:`AuthError` when the API refuses the key (invalid, revoked) and
    :class:`TransportError` when the API cannot be reached or answers unexpectedly; the native
    client treats the first as final and retries the second.
    """

    def __init__(self, api_url: str, api_key: str) -> None:
        if not isinstance(api_key, str):
            raise AuthError(f"api_key must be a str, not {type(api_key).__name__}")
        # A key read from a file keeps its newline: surrounding whitespace is no part of a key.
        api_key = api_key.strip()
        if not api_key:
            raise AuthError("api_key must be a non-empty string")
        if not all(_KEY_CHARS[0] <= ord(c) <= _KEY_CHARS[1] for c in api_key):
            # Never shown: it is a secret, and probably a wrong value (two keys on a line...).
            raise AuthError(
                "api_key contains characters no API key has (whitespace or control "
                "characters inside it, or non-ASCII); its value is not shown"
            )
        self._url = api_url.rstrip("/") + "/v1/tokens"
        self._api_key = api_key

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
            with urllib.request.urlopen(request, timeout=_TIMEOUT) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            text = self._redacted(_error_text(err))
            if err.code in (401, 403):
                raise AuthError(f"the API refused the key at {self._url}: {text}") from None
            raise TransportError(f"POST {self._url} answered {err.code}: {text}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = self._redacted(str(getattr(err, "reason", err)))
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


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read())
    except (ValueError, OSError):
        return err.reason if isinstance(err.reason, str) else str(err.code)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return str(err.code)

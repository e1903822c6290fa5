"""A small client of the HTTP API (stdlib ``urllib``, as the SDK's token exchange): one JSON
request, its failures said in one line for a person, never with the key in it."""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Final

from static._api_client import error_text, tls_failure
from static._commands._config import settings
from static._commands._errors import CommandError
from static._commands._output import printable

__all__ = ["Api", "keyed_api"]

#: Seconds one request may take (connect, send, answer).
TIMEOUT: Final = 15.0
#: The largest answer read (a page of 200 audit events is far less).
_MAX_ANSWER: Final = 4 * 1024 * 1024


class Api:
    """The HTTP API at ``url``, with ``key`` as the Bearer credential when given."""

    def __init__(
        self,
        url: str,
        key: str | None = None,
        *,
        ca_file: str | None = None,
        key_source: str | None = None,
    ) -> None:
        self._url = url.rstrip("/")
        self._key = key
        self._key_source = key_source
        self._context: ssl.SSLContext | None = None
        if ca_file is not None:
            try:
                self._context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise CommandError(f"CA file {ca_file}: cannot load it: {exc}") from None

    def _redacted(self, text: str) -> str:
        return text.replace(self._key, "<api key>") if self._key else text

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> Any:
        """The decoded JSON answer of ``method path`` (None for 204)."""
        url = self._url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": "application/json"}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        shown = f"{method} {self._url}{path}"
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT, context=self._context) as answer:
                status = answer.status
                raw = answer.read(_MAX_ANSWER + 1)
        except urllib.error.HTTPError as err:
            raise CommandError(self._refusal(err, shown)) from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise CommandError(self._unreachable(err)) from None
        if status == 204 or not raw:
            return None
        if len(raw) > _MAX_ANSWER:
            raise CommandError(f"{shown} answered more than {_MAX_ANSWER} bytes")
        try:
            return json.loads(raw)
        except ValueError:
            raise CommandError(f"{shown} answered something that is not JSON") from None

    def _unreachable(self, err: BaseException) -> str:
        cause = getattr(err, "reason", err)
        tls = tls_failure(self._url, cause)
        if tls is not None:
            return tls.replace("as ca_file=", "with --ca-file")
        if isinstance(cause, ConnectionRefusedError):
            return (
                f"cannot reach the API at {self._url}: connection refused "
                "(is the server running there?)"
            )
        if isinstance(cause, TimeoutError | socket.timeout):
            return f"the API at {self._url} did not answer within {TIMEOUT:g} s"
        if isinstance(cause, socket.gaierror):
            return f"cannot reach the API at {self._url}: unknown host ({cause.strerror})"
        return self._redacted(f"cannot reach the API at {self._url}: {cause}")

    def _refusal(self, err: urllib.error.HTTPError, shown: str) -> str:
        # The server's text, bounded and without control characters (a proxy may answer).
        text = printable(self._redacted(error_text(err)), 300)
        code = err.code
        source = f" (the key from {self._key_source})" if self._key_source else ""
        if code == 401:
            return f"the API refused the credential{source}: {text}"
        if code == 403:
            return f"the key{source} may not do this: {text}"
        if code == 404:
            return f"not found: {shown} answered 404 ({text})"
        if code == 429:
            after = err.headers.get("Retry-After", "")
            wait = f"retry in {after} s" if after.isdigit() else "retry later"
            return f"rate limited by the API ({text}): {wait}"
        return f"{shown} answered {code}: {text}"


def keyed_api(args: argparse.Namespace) -> Api:
    """The API a command's flags ``args`` name, with their API key (required)."""
    config = settings(args)
    return Api(
        config.need_api_url(),
        config.need_key(),
        ca_file=config.ca_file,
        key_source=config.key_source,
    )

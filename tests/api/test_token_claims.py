"""Tokens signed with the server's own key but carrying arbitrary claims, at both ports of a real
server: a bad one is 401 (HTTP) or UNAUTHENTICATED (relay) for that call only, never a 500 or
the end of the process (issue 21: a numeric-string ``exp`` did both)."""

from __future__ import annotations

import base64
import json
import math
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from static._settings import MAX_TOKEN_TTL_SECONDS
from static.auth import SigningKey
from tests.relay.client import Relay, pb, status_of
from tests.support.api import Api, assert_error, bearer
from tests.support.server import ServerProcess

#: Auth failures are what this test makes by the hundred: the per-address limit is off here
#: (test_auth_limit.py covers it).
ARGS = ("--signup-rate", "off", "--key-rate", "off", "--auth-failure-rate", "off")
CLAIMS = ("iss", "sub", "aud", "iat", "nbf", "exp", "jti", "key_id")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class Target:
    """The server, its signing key, and the claims of a token that is good right now."""

    def __init__(self, server: ServerProcess, db_path: Path) -> None:
        self.server = server
        self.api = Api(server.http_url)
        owner = self.api.signup()
        self.key = owner.key
        (key,) = self.api.keys(owner.key)
        with sqlite3.connect(db_path) as db:
            (pem,) = db.execute("SELECT private_key FROM signing_keys").fetchone()
        private = load_pem_private_key(pem.encode(), password=None)
        self.signing = SigningKey.from_private_key(private)  # type: ignore[arg-type]
        self.good = {
            "iss": "static",
            "sub": owner.id,
            "aud": "static-relay",
            "jti": "a" * 32,
            "key_id": key["id"],
        }
        self.relay = Relay(server.relay_url)

    def good_claims(self) -> dict[str, Any]:
        now = math.floor(time.time())
        return {**self.good, "iat": now - 120, "nbf": now - 120, "exp": now + 600}

    def is_good(self, name: str, value: Any) -> bool:
        """Whether ``value`` is acceptable for claim ``name`` now (a margin of a minute around
        the clock, so that an arbitrary value is never a near miss)."""
        now = time.time()
        if name in ("iat", "nbf"):
            return type(value) is int and value <= now - 60
        if name == "exp":
            return type(value) is int and value >= now + 60
        if name == "jti":
            return isinstance(value, str) and 0 < len(value) <= 128
        return bool(type(value) is str and value == self.good[name])

    def sign(self, claims: dict[str, Any]) -> str:
        """A compact JWS of ``claims`` as they are (pyjwt's encoder refuses some of them)."""
        header = {"alg": "EdDSA", "typ": "JWT", "kid": self.signing.kid}
        signed = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        signature = self.signing.private_key.sign(signed.encode("ascii"))
        return f"{signed}.{_b64(signature)}"

    def http_status(self, token: str) -> int:
        response = self.api.http.get("/v1/accounts/me", headers=bearer(token))
        if response.status_code != 200:
            # The only refusals: the generic token text, or the key's when sub and key_id
            # disagree.
            assert_error(response, 401)
            assert response.json()["error"] in {"invalid or expired token"}
        return response.status_code

    def relay_code(self, token: str) -> grpc.StatusCode:
        try:
            self.relay.stub.ListMembers(
                pb.ListMembersRequest(channel="nobody/has/this"),
                timeout=10,
                metadata=[("authorization", f"Bearer {token}")],
            )
        except grpc.RpcError as exc:
            return status_of(exc)[0]
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.relay.close()
        self.api.close()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    data = tmp_path_factory.mktemp("claims")
    db_path = data / "static.db"
    server = ServerProcess(data / "server", f"sqlite:///{db_path}", ARGS).start()
    target = Target(server, db_path)
    yield target
    target.close()
    assert server.proc is not None and server.proc.poll() is None, server.stderr()
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.stderr()}"
    assert "Traceback" not in server.stderr(), server.stderr()


# Arbitrary JSON: what a token's payload can hold (NaN and infinities included: Python's json
# writes and reads them), plus the shapes that once crashed the server.
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.integers().map(str)
    | st.floats(allow_nan=False, allow_infinity=False).map(str),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_NOW = math.floor(time.time())
# Never within 2 minutes of now, where the oracle's margins would call a good value bad.
_TIMES = st.integers(_NOW - 10**6, _NOW + 10**6).filter(
    lambda t: abs(t - time.time()) > 120
) | st.integers(min_value=2**31, max_value=2**80)


@st.composite
def _claims(draw: st.DrawFn, good: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Claims where each one is kept, replaced by arbitrary JSON, or dropped; plus extra
    claims. Returns them with the names of the claims changed."""
    claims: dict[str, Any] = {}
    changed = set()
    for name in CLAIMS:
        choice = draw(st.sampled_from(["keep", "keep", "arbitrary", "missing"]))
        if choice == "keep":
            claims[name] = good[name]
        elif choice == "arbitrary":
            # Times also near the real ones and far past them (an int overflow on the relay).
            values = _JSON | _TIMES if name in ("iat", "nbf", "exp") else _JSON
            claims[name] = draw(values)
            changed.add(name)
        else:
            changed.add(name)
    extra = draw(st.dictionaries(st.text(max_size=8), _JSON, max_size=3))
    for name, value in extra.items():
        if name not in CLAIMS:
            claims[name] = value
    return claims, changed


@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_arbitrary_claims_are_refused_at_both_ports(target: Target, data: st.DataObject) -> None:
    good = target.good_claims()
    claims, changed = data.draw(_claims(good))
    valid = all(name in claims and target.is_good(name, claims[name]) for name in CLAIMS)
    # And a lifetime no server mints is refused (an exp of 1e20 made the relay panic).
    valid = valid and claims["exp"] - claims["iat"] <= MAX_TOKEN_TTL_SECONDS
    # An arbitrary value may happen to be a good one (an old ``iat``): only then is it accepted.
    assert valid or changed
    token = target.sign(claims)
    assert target.http_status(token) == (200 if valid else 401)
    code = target.relay_code(token)
    if valid:
        assert code != grpc.StatusCode.UNAUTHENTICATED
    else:
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert target.server.proc is not None and target.server.proc.poll() is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("exp", "99999999999"),  # the case: pyjwt's int() accepts it, ``+`` did not
        ("exp", 10**20),  # overflowed the relay's clock (a panic in the extension: INTERNAL)
        ("exp", 2**63),
        ("exp", True),
        ("exp", 1e12),
        ("exp", math.nan),
        ("iat", "0"),
        ("nbf", False),
        ("aud", ["static-relay"]),
        ("iss", ["static"]),
        ("sub", 5),
        ("key_id", None),
        ("jti", ""),
        ("jti", "j" * 129),
    ],
)
def test_each_ill_typed_claim_is_refused(target: Target, name: str, value: Any) -> None:
    token = target.sign({**target.good_claims(), name: value})
    assert target.http_status(token) == 401
    assert target.relay_code(token) == grpc.StatusCode.UNAUTHENTICATED


def test_a_lifetime_over_the_longest_ttl_is_refused(target: Target) -> None:
    claims = target.good_claims()
    longest = {**claims, "exp": claims["iat"] + MAX_TOKEN_TTL_SECONDS}
    assert target.http_status(target.sign(longest)) == 200
    too_long = target.sign({**claims, "exp": claims["iat"] + MAX_TOKEN_TTL_SECONDS + 1})
    assert target.http_status(too_long) == 401
    assert target.relay_code(too_long) == grpc.StatusCode.UNAUTHENTICATED


def test_good_token_is_accepted_and_lives_exactly_its_ttl(target: Target) -> None:
    assert target.http_status(target.sign(target.good_claims())) == 200
    token = target.api.token(target.key)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["exp"] - claims["iat"] == 900
    assert target.http_status(token) == 200
    assert target.relay_code(token) == grpc.StatusCode.NOT_FOUND

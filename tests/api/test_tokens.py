"""POST /v1/tokens, GET /.well-known/jwks.json, and JWTs on GET /v1/accounts/me
(docs/design.md §4)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.api.conftest import NO_LIMITS
from tests.support.api import Api, SignedUp, assert_error, bearer, db_execute
from tests.support.server import ServerProcess

INVALID_TOKEN = "invalid or expired token"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _segment(value: dict[str, Any]) -> str:
    return _b64(json.dumps(value).encode())


def _server_key(server: ServerProcess) -> Ed25519PrivateKey:
    """The server's signing key, read from the store as an operator could."""
    assert server.database_url is not None
    pem = db_execute(server.database_url, "SELECT private_key FROM signing_keys")
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    assert isinstance(key, Ed25519PrivateKey)
    return key


def _claims(api: Api, signed: SignedUp, **changes: Any) -> dict[str, Any]:
    now = int(time.time())
    claims = {
        "iss": "static",
        "sub": signed.id,
        "aud": "static-relay",
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "jti": uuid.uuid4().hex,
        "key_id": api.keys(signed.key)[0]["id"],
    }
    claims.update(changes)
    return {k: v for k, v in claims.items() if v is not None}


def _kid(api: Api) -> str:
    kid: str = api.http.get("/.well-known/jwks.json").json()["keys"][0]["kid"]
    return kid


def test_token_exchange_response(api: Api) -> None:
    signed = api.signup()
    response = api.http.post("/v1/tokens", headers=bearer(signed.key))
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    body = response.json()
    assert set(body) == {"access_token", "token_type", "expires_in"}
    assert body["token_type"] == "Bearer"
    assert body["expires_in"] == 900
    assert body["access_token"].count(".") == 2


def test_token_header_and_claims(api: Api) -> None:
    signed = api.signup()
    key_id = api.keys(signed.key)[0]["id"]
    before = int(time.time())
    token = api.token(signed.key)
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "EdDSA"
    assert header["typ"] == "JWT"
    assert header["kid"] == _kid(api)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert set(claims) == {"iss", "sub", "aud", "iat", "nbf", "exp", "jti", "key_id"}
    assert claims["iss"] == "static"
    assert claims["sub"] == signed.id
    assert claims["aud"] == "static-relay"
    assert claims["key_id"] == key_id
    assert before <= claims["iat"] == claims["nbf"] <= time.time()
    assert claims["exp"] - claims["iat"] == 900
    assert claims["exp"] > before + 899  # iat is rounded down: up to 1 s less than 900 s left
    assert (
        claims["jti"]
        != jwt.decode(api.token(signed.key), options={"verify_signature": False})["jti"]
    )


def test_a_relay_can_verify_tokens_with_the_jwks_alone(api: Api) -> None:
    signed = api.signup()
    token = api.token(signed.key)
    response = api.http.get("/.well-known/jwks.json")
    assert response.status_code == 200
    assert "max-age" in response.headers["cache-control"]
    jwks = response.json()
    assert [set(k) for k in jwks["keys"]] == [{"kty", "crv", "x", "kid", "alg", "use"}]
    assert jwks["keys"][0]["kty"] == "OKP" and jwks["keys"][0]["crv"] == "Ed25519"
    assert "d" not in jwks["keys"][0]  # never the private part
    key = jwt.PyJWKSet.from_dict(jwks)[jwt.get_unverified_header(token)["kid"]]
    claims = jwt.decode(token, key, algorithms=["EdDSA"], audience="static-relay", issuer="static")
    assert claims["sub"] == signed.id


def test_token_exchange_uses_the_key(api: Api) -> None:
    signed = api.signup()
    api.token(signed.key)
    assert api.keys(signed.key)[0]["last_used_at"] is not None


def test_token_exchange_ignores_a_body(api: Api) -> None:
    signed = api.signup()
    response = api.http.post("/v1/tokens", headers=bearer(signed.key), json={"scope": "x"})
    assert response.status_code == 200


def test_revoking_the_key_voids_its_tokens_at_once(api: Api) -> None:
    signed = api.signup()
    other = api.create_key(signed.key)
    token = api.token(other["key"])
    sibling = api.token(signed.key)
    assert api.me(token).status_code == 200
    assert api.revoke(signed.key, other["id"]).status_code == 204
    assert_error(api.me(token), 401, "invalid or revoked api key")
    assert_error(
        api.http.post("/v1/tokens", headers=bearer(other["key"])),
        401,
        "invalid or revoked api key",
    )
    # Tokens of the account's other keys still work.
    assert api.me(sibling).status_code == 200


def test_tampered_tokens_are_refused(api: Api) -> None:
    alice, bob = api.signup(), api.signup()
    token = api.token(alice.key)
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    forged_payload = _segment({**claims, "sub": bob.id})
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    for bad in [
        f"{header}.{forged_payload}.{signature}",
        f"{header}.{payload}.{flipped}",
        f"{header}.{payload}.",
        f"{header}.{payload}",
        f"{header}.{payload}.{signature}x",
        token[:-4],
        "a.b.c",
        "eyJ.eyJ.sig",
    ]:
        response = api.me(bad)
        assert response.status_code == 401, bad
        assert response.json()["error"] in {INVALID_TOKEN, "invalid or revoked api key"}
    assert api.me(token).json()["id"] == alice.id


def test_alg_none_is_refused(api: Api) -> None:
    signed = api.signup()
    claims = _claims(api, signed)
    for alg in ["none", "None", "NONE"]:
        token = f"{_segment({'alg': alg, 'typ': 'JWT', 'kid': _kid(api)})}.{_segment(claims)}."
        assert_error(api.me(token), 401, INVALID_TOKEN)


def test_hmac_with_the_public_key_is_refused(api: Api) -> None:
    signed = api.signup()
    public = base64.urlsafe_b64decode(
        api.http.get("/.well-known/jwks.json").json()["keys"][0]["x"] + "=="
    )
    header = {"alg": "HS256", "typ": "JWT", "kid": _kid(api)}
    signing_input = f"{_segment(header)}.{_segment(_claims(api, signed))}"
    import hashlib
    import hmac

    for secret in [public, _b64(public).encode()]:
        mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
        assert_error(api.me(f"{signing_input}.{_b64(mac)}"), 401, INVALID_TOKEN)


def test_a_stranger_key_is_refused_even_with_our_kid(api: Api) -> None:
    signed = api.signup()
    stranger = Ed25519PrivateKey.generate()
    for kid in [_kid(api), "unknown-kid", None]:
        headers = {"kid": kid} if kid else {}
        token = jwt.encode(_claims(api, signed), stranger, algorithm="EdDSA", headers=headers)
        assert_error(api.me(token), 401, INVALID_TOKEN)


@pytest.mark.parametrize(
    "changes",
    [
        {"aud": "someone-else"},
        {"aud": ["someone-else"]},
        {"aud": None},
        {"iss": "evil"},
        {"iss": None},
        pytest.param({"exp": int(time.time()) - 10}, id="exp=past"),
        {"exp": None},
        pytest.param({"nbf": int(time.time()) + 600}, id="nbf=future"),
        pytest.param({"iat": int(time.time()) + 600}, id="iat=future"),
        {"sub": None},
        {"key_id": None},
        {"key_id": "not-a-uuid"},
        pytest.param({"key_id": str(uuid.uuid4())}, id="key_id=unknown"),
        pytest.param({"sub": str(uuid.uuid4())}, id="sub=unknown"),
        {"jti": None},
        {"exp": "tomorrow"},
    ],
    # Ids that are the same in every process (pytest-xdist's workers must agree on them).
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_claims_are_enforced(
    api: Api, shared_server: ServerProcess, changes: dict[str, Any]
) -> None:
    signed = api.signup()
    key = _server_key(shared_server)
    good = jwt.encode(_claims(api, signed), key, algorithm="EdDSA", headers={"kid": _kid(api)})
    assert api.me(good).status_code == 200  # the forging works when nothing is wrong
    # pyjwt refuses to encode a non-integer exp; build that one by hand.
    claims = _claims(api, signed, **changes)
    if changes.get("exp") == "tomorrow":
        signing_input = f"{_segment({'alg': 'EdDSA', 'kid': _kid(api)})}.{_segment(claims)}"
        bad = f"{signing_input}.{_b64(key.sign(signing_input.encode()))}"
    else:
        bad = jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": _kid(api)})
    response = api.me(bad)
    assert response.status_code == 401
    assert response.json()["error"] in {INVALID_TOKEN, "invalid or revoked api key"}


def test_a_token_of_one_account_with_anothers_key_is_refused(
    api: Api, shared_server: ServerProcess
) -> None:
    alice, bob = api.signup(), api.signup()
    key = _server_key(shared_server)
    claims = _claims(api, alice, key_id=api.keys(bob.key)[0]["id"])
    token = jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": _kid(api)})
    assert_error(api.me(token), 401)


def test_tokens_expire(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*NO_LIMITS, "--token-ttl", "1")
    api = Api(server.http_url)
    try:
        signed = api.signup()
        response = api.http.post("/v1/tokens", headers=bearer(signed.key))
        assert response.json()["expires_in"] == 1
        token = response.json()["access_token"]
        first = api.me(token)
        time.sleep(2.1)
        assert_error(api.me(token), 401, INVALID_TOKEN)
        # It was fine before it expired (unless this machine took a second to answer).
        assert first.status_code in {200, 401}
        assert api.me(api.token(signed.key)).status_code == 200
    finally:
        api.close()


def test_token_ttl_is_configurable_from_the_environment(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*NO_LIMITS, env={"STATIC_TOKEN_TTL": "120"})
    with httpx.Client(base_url=server.http_url) as http:
        key = http.post("/v1/accounts", json={"email": "ttl@example.com"}).json()["api_key"]
        assert http.post("/v1/tokens", headers=bearer(key)).json()["expires_in"] == 120

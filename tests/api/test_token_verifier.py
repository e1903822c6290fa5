"""The concrete TokenVerifier (``static.auth.Authority``) as the relay uses it, on both stores."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from static._settings import ApiSettings, RateLimit
from static.api import AuthFailureLimiter
from static.auth import (
    Authority,
    Principal,
    SigningKey,
    TokenClaims,
    TokenRules,
    TokenVerifier,
    Unauthenticated,
    generate_api_key,
    mint_token,
    open_authority,
)
from static.auth._tokens import TokenVerifierCore
from static.relay._verify import _check
from static.store import AccountStore, KeyOwner, NewKey, open_database


async def _owner(authority: Authority) -> tuple[KeyOwner, str]:
    key = generate_api_key()
    account_id, key_id = str(uuid.uuid4()), str(uuid.uuid4())
    await authority.store.create_account(
        account_id=account_id,
        email=f"{account_id}@example.com",
        name=None,
        first_key=NewKey(key_id, key.digest, key.key_prefix, "default"),
        now=datetime.now(UTC),
    )
    return await authority.authenticate_key(key.secret), key.secret


async def test_verify_token_and_revocation(database_url: str) -> None:
    async with open_database(database_url) as db, open_authority(db, ApiSettings()) as authority:
        verifier: TokenVerifier = authority  # the relay's port, satisfied structurally
        owner, _ = await _owner(authority)
        issued = authority.mint(owner)
        principal = await verifier.verify_token(issued.access_token)
        assert isinstance(principal, Principal)
        assert principal.account_id == owner.account_id
        assert principal.key_id == owner.key_id
        assert principal.expires_at is not None
        assert 0 < principal.expires_at - datetime.now(UTC).timestamp() <= 900
        assert await verifier.key_is_active(owner.key_id)

        store: AccountStore = authority.store
        assert await store.revoke_key(owner.account_id, owner.key_id, now=datetime.now(UTC))
        with pytest.raises(Unauthenticated, match="invalid or revoked api key"):
            await verifier.verify_token(issued.access_token)
        assert not await verifier.key_is_active(owner.key_id)


async def test_malformed_input(database_url: str) -> None:
    async with open_database(database_url) as db, open_authority(db, ApiSettings()) as authority:
        for token in ["", "garbage", "a.b.c", "sk_live_" + "A" * 43]:
            with pytest.raises(Unauthenticated, match="invalid or expired token"):
                await authority.verify_token(token)
        for key_id in ["", "not-a-uuid", str(uuid.uuid4()), "'; DROP TABLE api_keys; --"]:
            assert not await authority.key_is_active(key_id)


async def test_another_authority_on_the_same_store_verifies_the_tokens(database_url: str) -> None:
    async with open_database(database_url) as db:
        async with open_authority(db, ApiSettings()) as first:
            owner, _ = await _owner(first)
            token = first.mint(owner).access_token
            jwks = first.jwks()
        # A restarted server (or a second one on the same store) has the same signing key.
        async with open_authority(db, ApiSettings()) as second:
            assert second.jwks() == jwks
            assert (await second.verify_token(token)).key_id == owner.key_id


async def test_audience_is_enforced(database_url: str) -> None:
    async with open_database(database_url) as db:
        async with open_authority(db, ApiSettings(token_audience="elsewhere")) as other:
            owner, _ = await _owner(other)
            token = other.mint(owner).access_token
        async with open_authority(db, ApiSettings()) as relay_side:
            with pytest.raises(Unauthenticated, match="invalid or expired token"):
                await relay_side.verify_token(token)


class _Broken(TokenVerifierCore):
    """A verifier with a bug: what the safety net is for (no known input reaches it now)."""

    def _verify(self, token: str) -> TokenClaims:
        raise TypeError("unsupported operand type(s) for +: 'str' and 'float'")


def test_an_unexpected_error_refuses_the_token_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = SigningKey.generate()
    rules = TokenRules(issuer="static", audience="static-relay", ttl_seconds=900)
    token = mint_token(key, rules, account_id=str(uuid.uuid4()), key_id="k", now=time.time())
    with (
        caplog.at_level(logging.WARNING, logger="static.auth"),
        pytest.raises(Unauthenticated, match="invalid or expired token"),
    ):
        _Broken([key], rules).verify(token)
    (record,) = caplog.records
    assert "TypeError" in record.getMessage()
    assert key.kid in record.getMessage()  # the claimed kid, to find the token's issuer
    assert token not in caplog.text and token.split(".")[2] not in caplog.text


class _RaisingVerifier:
    async def verify_token(self, token: str) -> Principal:
        raise KeyError("exp")

    async def key_is_active(self, key_id: str) -> bool:
        return False

    async def inactive_keys(self, key_ids: Sequence[str]) -> set[str]:
        return set(key_ids)


async def test_the_relay_callback_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="static.auth"):
        assert await _check(_RaisingVerifier(), "a.b.c") == (16, "invalid or expired token")
    assert "KeyError" in caplog.text


class _Refusing:
    async def verify_token(self, token: str) -> Principal:
        raise Unauthenticated("invalid or expired token")

    async def key_is_active(self, key_id: str) -> bool:
        return False

    async def inactive_keys(self, key_ids: Sequence[str]) -> set[str]:
        return set(key_ids)


async def test_relay_failures_count_per_address_ipv6_per_64() -> None:
    limiter = AuthFailureLimiter(RateLimit(2, 60))
    # The extension names peers ip:port, IPv6 without brackets.
    for peer in ["2001:db8::1:5000", "2001:db8::2:6000"]:
        assert (await _check(_Refusing(), "t", peer, limiter))[0] == 16
    refused = await _check(_Refusing(), "t", "2001:db8::3:7000", limiter)
    assert refused[0] == 8 and refused[2] == 30  # type: ignore[misc]
    assert (await _check(_Refusing(), "t", "2001:db8:1::1:5000", limiter))[0] == 16
    assert (await _check(_Refusing(), "t", "127.0.0.1:5000", limiter))[0] == 16


@dataclasses.dataclass(frozen=True)
class _Scoped(Principal):
    # Principal gains `channels` with issue 30 (static.auth); declared here as well so that this
    # test stands on either side of that change.
    channels: tuple[str, ...] | None = None


class _ScopedVerifier:
    def __init__(self, channels: tuple[str, ...] | None) -> None:
        self.channels = channels

    async def verify_token(self, token: str) -> Principal:
        return _Scoped("acct", "key", 12.5, self.channels)

    async def key_is_active(self, key_id: str) -> bool:
        return True

    async def inactive_keys(self, key_ids: Sequence[str]) -> set[str]:
        return set()


async def test_the_relay_callback_hands_over_the_keys_channels() -> None:
    scoped = await _check(_ScopedVerifier(("acme/ops/*",)), "t")
    assert scoped == ("acct", "key", 12.5, ["acme/ops/*"])
    assert await _check(_ScopedVerifier(None), "t") == ("acct", "key", 12.5, None)

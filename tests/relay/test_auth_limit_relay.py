"""The relay port's limit on failed authentications holds under concurrency: 128 connections
presenting refused tokens at once get no more UNAUTHENTICATED answers than the budget; and at
the token callback itself, checks awaiting the store together are counted before they await."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
import trio
import trio.testing

from static._settings import RateLimit
from static.api import AuthFailureLimiter
from static.auth import Principal, Unauthenticated
from static.relay._verify import _check
from static.store import DatabaseError
from tests.api.test_auth_limit import DEFAULT_RATE, GUESSERS, GUESSES, bound, guess_at_once
from tests.relay._generated import relay_pb2_grpc as pb_grpc
from tests.relay.client import pb, status_of
from tests.support.api import Api
from tests.support.server import ServerProcess


def test_concurrent_refused_tokens_get_no_more_than_the_budget(
    start_server: Callable[..., ServerProcess],
) -> None:
    """Each call pays for its failure before its token's key is looked up. The tokens are
    well signed but their key is revoked, so each refusal awaits the store (a forged signature
    is refused before any await, and never raced): on 9b2be07 the calls in flight together all
    passed the budget's check."""
    requests, per_seconds = DEFAULT_RATE
    server = start_server(
        "--signup-rate", "off", "--key-rate", "off",
        "--auth-failure-rate", f"{requests}/{per_seconds}",
    )  # fmt: skip
    api = Api(server.http_url)
    try:
        owner = api.signup()
        revoked = api.create_key(owner.key, name="revoked")
        token = api.token(revoked["key"])
        assert api.revoke(owner.key, revoked["id"]).status_code == 204
    finally:
        api.close()

    target = server.relay_url.removeprefix("grpc://")
    channels = [
        grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(GUESSERS)
    ]
    # One connection per guesser (grpcio shares them across channels otherwise).
    stubs: list[Any] = [pb_grpc.RelayStub(channel) for channel in channels]  # type: ignore[no-untyped-call]
    metadata = [("authorization", f"Bearer {token}")]

    def call(n: int) -> str:
        try:
            request = pb.ListMembersRequest(channel="nobody/has/this")
            stubs[n].ListMembers(request, timeout=30, metadata=metadata)
        except grpc.RpcError as exc:
            code, _, _ = status_of(exc)
            return str(code.name)
        return "OK"

    try:
        outcomes, elapsed = guess_at_once(call)
    finally:
        for channel in channels:
            channel.close()
    assert set(outcomes) <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["UNAUTHENTICATED"] + outcomes["RESOURCE_EXHAUSTED"] == GUESSERS * GUESSES
    assert outcomes["UNAUTHENTICATED"] <= bound(elapsed), (outcomes, f"{elapsed:.1f} s")
    assert outcomes["UNAUTHENTICATED"] >= requests, outcomes


class _Lookup:
    """A verifier whose store lookup waits for ``answer``, then refuses (or fails)."""

    def __init__(self, failure: Exception) -> None:
        self.answer = trio.Event()
        self.failure = failure

    async def verify_token(self, token: str) -> Principal:
        await self.answer.wait()
        raise self.failure

    async def key_is_active(self, key_id: str) -> bool:
        return False

    async def inactive_keys(self, key_ids: Sequence[str]) -> set[str]:
        return set(key_ids)


async def _all_at_once(verifier: _Lookup, limiter: AuthFailureLimiter, count: int) -> list[int]:
    codes: list[int] = []

    async def one(n: int) -> None:
        answer = await _check(verifier, f"token{n}", f"10.0.0.1:{5000 + n}", limiter)
        assert isinstance(answer[0], int)
        codes.append(answer[0])

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(one, n)
        await trio.testing.wait_all_tasks_blocked()  # every check is awaiting the store
        verifier.answer.set()
    return sorted(codes)


async def test_checks_awaiting_the_store_together_are_counted_before_they_await() -> None:
    limiter = AuthFailureLimiter(RateLimit(3, 600))
    refused = _Lookup(Unauthenticated("invalid or revoked api key"))
    # On 9b2be07 all ten were looked up and refused: [16] * 10.
    assert await _all_at_once(refused, limiter, 10) == [8] * 7 + [16] * 3


async def test_a_store_failure_gives_the_failure_back() -> None:
    limiter = AuthFailureLimiter(RateLimit(3, 600))
    assert await _all_at_once(_Lookup(DatabaseError("gone")), limiter, 3) == [14] * 3
    refused = _Lookup(Unauthenticated("invalid or revoked api key"))
    assert await _all_at_once(refused, limiter, 4) == [8] + [16] * 3

"""Addresses and invitations: how agents meet through the relay (docs/sdk.md, Invitations).

The native client does the relay calls; this module gives them the SDK's shape: an
:class:`Address`, :class:`Invitation` objects, and the blocking and async iterators over them,
which poll the relay's list of pending invitations.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import anyio
import anyio.to_thread

from static._native import client as native_client

__all__ = ["Address", "AsyncInvitationIterator", "Invitation", "InvitationIterator"]

#: How long each of an iterator's calls waits for an invitation while none is pending (seconds):
#: the relay holds the call (a long poll) and answers it as soon as an invitation for this agent
#: is recorded; so a waiting agent costs the relay one call, one indexed read, a second. Also
#: how soon a blocking iterator answers Ctrl-C.
LONG_POLL: Final[float] = 1.0
#: A relay that answers at once (an older one) is asked at most this often.
_MIN_POLL: Final[float] = 0.5

_C = TypeVar("_C")


@dataclass(frozen=True, slots=True)
class Address:
    """Where invitations to an agent go: its account (``""`` for an anonymous client) and its
    identity. Printed ``static:<account>:<identity in unpadded base64url>``
    (:attr:`StaticClient.address <static.sdk.StaticClient.address>`)."""

    account: str
    identity: bytes

    @classmethod
    def parse(cls, text: str) -> Address:
        """The address printed as ``text``.

        :raises ValueError: ``text`` is not an address.
        """
        if not isinstance(text, str):
            raise TypeError(f"an address is a str, not {type(text).__name__}")
        account, identity = native_client.parse_address(text)
        return cls(account, identity)

    def __str__(self) -> str:
        return native_client.format_address(self.account, self.identity)


def as_address(address: str | Address) -> Address:
    """``address`` as an :class:`Address` (parsed when printed)."""
    if isinstance(address, Address):
        return address
    return Address.parse(address)


class Invitation(Generic[_C]):
    """An invitation into a channel, held by the relay until it is accepted, declined or its
    Welcome expires (7 days by default).

    ``inviter`` is the identity of the inviter's leaf in the channel, ``inviter_account`` its
    account as the relay authenticated it; ``expires_at`` is a Unix time in seconds.
    """

    __slots__ = (
        "_accept",
        "_decline",
        "channel",
        "created_at",
        "expires_at",
        "id",
        "inviter",
        "inviter_account",
    )

    def __init__(
        self,
        fields: native_client.InvitationFields,
        accept: Callable[[int, str], _C],
        decline: Callable[[int], None],
    ) -> None:
        ident, channel, inviter, inviter_account, created_ms, expires_ms = fields
        self.id: int = ident
        self.channel: str = channel
        self.inviter: bytes = inviter
        self.inviter_account: str = inviter_account
        self.created_at: float = created_ms / 1000
        self.expires_at: float = expires_ms / 1000
        self._accept = accept
        self._decline = decline

    def accept(self) -> _C:
        """Join the channel from the invitation's Welcome (binding our leaf to our account),
        and return it; the invitation is then settled. Safe to call again after a crash."""
        return self._accept(self.id, self.channel)

    def decline(self) -> None:
        """Decline: the invitation is not offered again. (The inviter's commit already added our
        leaf: it stays unbound, and members see it so in ``Channel.roster()``.)"""
        self._decline(self.id)

    async def accept_async(self) -> _C:
        """Async :meth:`accept`."""
        return await anyio.to_thread.run_sync(self.accept)

    async def decline_async(self) -> None:
        """Async :meth:`decline`."""
        await anyio.to_thread.run_sync(self.decline)

    def __repr__(self) -> str:
        return (
            f"<Invitation {self.id} to {self.channel!r} from {self.inviter!r} "
            f"of account {self.inviter_account!r}>"
        )


class _Invitations(Generic[_C]):
    """What both iterators share: a cursor over the relay's pending invitations."""

    def __init__(
        self,
        native: native_client.Client,
        wrap: Callable[[native_client.Channel], _C],
        closed: threading.Event,
    ) -> None:
        self._native = native
        self._wrap = wrap
        self._closed = closed
        self._after = 0
        self._ready: deque[Invitation[_C]] = deque()

    def _accept(self, ident: int, channel: str) -> _C:
        return self._wrap(self._native.accept_invitation(ident, channel))

    def _take(self, listed: list[native_client.InvitationFields]) -> None:
        for fields in listed:
            self._after = max(self._after, fields[0])
            self._ready.append(Invitation(fields, self._accept, self._native.decline_invitation))


class InvitationIterator(_Invitations[_C]):
    """Blocking iterator over the invitations the relay holds for this agent: those pending
    when it starts (received while the agent was offline), then new ones as they come, each
    once per iterator. Ends when the client is closed."""

    def __iter__(self) -> InvitationIterator[_C]:
        return self

    def __next__(self) -> Invitation[_C]:
        while not self._ready:
            if self._closed.is_set():
                raise StopIteration
            asked = time.monotonic()
            try:
                self._take(self._native.list_invitations(self._after, LONG_POLL))
            except RuntimeError:
                if self._closed.is_set():
                    raise StopIteration from None
                raise
            if not self._ready:
                # An Event wait answers close() at once.
                self._closed.wait(max(0.0, asked + _MIN_POLL - time.monotonic()))
        return self._ready.popleft()


class AsyncInvitationIterator(_Invitations[_C]):
    """Async :class:`InvitationIterator`, for trio and asyncio (each call runs in a worker
    thread; cancelling a wait loses nothing: an invitation not yielded stays pending)."""

    def __aiter__(self) -> AsyncInvitationIterator[_C]:
        return self

    async def __anext__(self) -> Invitation[_C]:
        while not self._ready:
            if self._closed.is_set():
                raise StopAsyncIteration
            asked = time.monotonic()
            try:
                # Cancelling abandons the call (what it lists stays pending for the next one).
                listed = await anyio.to_thread.run_sync(
                    self._native.list_invitations,
                    self._after,
                    LONG_POLL,
                    abandon_on_cancel=True,
                )
            except RuntimeError:
                if self._closed.is_set():
                    raise StopAsyncIteration from None
                raise
            self._take(listed)
            if not self._ready:
                await anyio.sleep(max(0.0, asked + _MIN_POLL - time.monotonic()))
        return self._ready.popleft()

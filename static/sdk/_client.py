"""``StaticClient``, ``Channel`` and the message iterators, over the native core.

The native extension does the work (MLS, the gRPC transport, persistence, background
processing on a tokio runtime it owns); this module shapes it into the spec's API and adds the
async variants. Blocking calls release the GIL. Async calls never block the event loop: waiting
for messages uses a readiness socket per iterator (no thread), other calls run the blocking call
in a worker thread for its duration.
"""

from __future__ import annotations

import functools
import math
import os
import stat
import threading
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Final, ParamSpec, Protocol, Self, TypeVar

import anyio
import anyio.to_thread

from static._api_client import TokenSource, resolve_ca_file
from static._channel_name import validate_channel_name
from static._errors import AuthError
from static._native import client as native_client
from static.sdk._invitations import (
    Address,
    AsyncInvitationIterator,
    InvitationIterator,
    as_address,
)
from static.sdk._requests import (
    AsyncRequestIterator,
    Request,
    RequestIterator,
    request,
    request_async,
)

__all__ = [
    "MAX_PAYLOAD",
    "AsyncMessageIterator",
    "AsyncRequestIterator",
    "AsyncSenderMessageIterator",
    "Channel",
    "Member",
    "Message",
    "MessageIterator",
    "Request",
    "RequestIterator",
    "SendHandle",
    "SenderMessageIterator",
    "StaticClient",
]

#: Largest payload ``Channel.send`` accepts, in bytes (the relay's 1 MiB message limit less room
#: for the MLS framing). Larger payloads raise ``TransportError`` before anything is sent.
MAX_PAYLOAD: Final[int] = native_client.MAX_PAYLOAD

_MESSAGE, _EMPTY, _END = 0, 1, 2
#: How long an async wait for pipelined sends holds a worker thread at a time (seconds).
_ASYNC_SLICE: Final[float] = 0.1

_P = ParamSpec("_P")
_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Message:
    """A message another member sent, with who sent it and where it stands in the channel.

    ``sender`` is the sender's identity as MLS authenticated it (its signature inside the
    encryption); ``account`` is the account that published it as the relay attests it (``""``
    for an anonymous caller, None when unknown: a message from a relay of an older release).
    """

    payload: bytes
    sender: bytes
    account: str | None
    #: Its place in the channel's log.
    seq: int
    #: The MLS epoch it was sent in.
    epoch: int


@dataclass(frozen=True, slots=True)
class Member:
    """A member of a channel as the relay attests it: its identity (the credential of its MLS
    leaf) and the account its leaf is bound to (None while unbound: added, not joined yet)."""

    identity: bytes
    account: str | None
    leaf_index: int


class _Waiting(Protocol[_T_co]):
    """An async message iterator (see :func:`_first`)."""

    def __anext__(self) -> Awaitable[_T_co]: ...
    def close(self) -> None: ...


async def _first(iterator: _Waiting[_T], channel: str) -> _T:
    """The next item of a fresh async iterator, which is then closed.

    :raises EOFError: the channel has ended and nothing is left to read.
    """
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        raise EOFError(f"channel {channel!r} has ended") from None
    finally:
        iterator.close()


def _message(fields: native_client.MessageFields) -> Message:
    payload, sender, account, seq, epoch = fields
    return Message(payload, sender, account, seq, epoch)


async def _in_thread(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run a blocking SDK call in a worker thread. Cancelling the caller waits for the call to
    finish (it is bounded by the SDK's own timeouts), so the channel's state is never left
    half-way and the outcome of a send or commit is never silently lost."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def _check_timeout(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    return float(value)


def _warn_if_open_to_others(data_dir: str) -> None:
    """Warn when an existing ``data_dir`` lets other users in: it holds the agent's group
    secrets and decrypted messages. (Its files are 0600 whatever the directory's mode, and a
    directory the SDK creates is 0700.)"""
    try:
        mode = stat.S_IMODE(os.stat(data_dir).st_mode)
    except OSError:
        return
    if mode & 0o077:
        warnings.warn(
            f"data_dir {data_dir!r} is open to other users (mode {mode:o}); it holds this "
            "agent's group secrets and messages: chmod 700 it",
            UserWarning,
            stacklevel=3,
        )


def _check_bytes(name: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{name} must be bytes, not {type(value).__name__}")


class _Closeable:
    """``with`` and ``async with`` over a class's own :meth:`close` / :meth:`close_async`."""

    def close(self) -> None:
        raise NotImplementedError

    async def close_async(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close_async()


class StaticClient(_Closeable):
    """One agent's connection to the relay and its MLS state under ``data_dir``.

    :param endpoint: the relay's URL: ``grpc://host:port``, ``http://host:port``,
        ``https://host:port`` (TLS: the system's roots, or ``ca_file``) or ``host:port``.
    :param data_dir: a directory holding this agent's MLS state (created if missing; keep it:
        without it the agent can no longer decrypt its channels). One open client per
        directory at a time.
    :param identity: this agent's unique identity (bytes), the credential other members see.
    :param api_key: an API key (``sk_live_...``); the client exchanges it at
        ``POST {api_url}/v1/tokens`` for a short-lived token now, and refreshes the token
        before it expires. Whitespace around it is ignored (a key read from a file keeps its
        newline); no error message shows it. Omit it for a relay started with
        ``--allow-anonymous``.
    :param api_url: the HTTP API's base URL; required with ``api_key``.
    :param connect_timeout: seconds a call keeps retrying while the relay has never answered
        this client (nothing listening, wrong port): it then fails with ``TransportError``.
        Default ``STATIC_SDK_CONNECT_TIMEOUT`` from the environment, else 1.
    :param retry_timeout: seconds a call keeps retrying a relay that answered before (it is
        restarting, or the network dropped). Default ``STATIC_SDK_RETRY_TIMEOUT``, else 30.
    :param ca_file: a PEM file of CA certificates (a private CA): ``https://`` relays and the
        ``https://`` API must present a certificate chaining to one of them (instead of the
        system's roots). Default ``STATIC_CA_FILE`` from the environment, else the system's
        roots. A certificate not trusted fails with a final ``TransportError`` saying so.
    :raises AuthError: the key is refused, or ``api_key`` is given without ``api_url``.
    :raises TransportError: the API cannot be reached, or the endpoint is malformed.
    :raises InternalError: ``data_dir`` is in use, belongs to another identity, or its state is
        damaged (``mls.sqlite3`` cut short or replaced, ``inbox.marks`` missing or damaged: the
        message names the file).

    ``data_dir`` is created with mode 0700 and its files 0600; an existing directory that
    other users may enter gets a ``UserWarning``.

    The relay itself is connected lazily: creating a client never fails because the relay is
    down. The first call that needs it (``create_channel``, ``join_channel``, a send) fails
    within ``connect_timeout`` if it cannot be reached; once it has answered, calls ride out
    restarts and network failures for up to ``retry_timeout``.
    """

    def __init__(
        self,
        endpoint: str,
        data_dir: str | os.PathLike[str],
        identity: bytes,
        api_key: str | None = None,
        api_url: str | None = None,
        *,
        connect_timeout: float | None = None,
        retry_timeout: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        identity = _check_bytes("identity", identity)
        ca_path = resolve_ca_file(ca_file)
        connect_timeout = _check_timeout("connect_timeout", connect_timeout)
        retry_timeout = _check_timeout("retry_timeout", retry_timeout)
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, not {type(endpoint).__name__}")
        provider: TokenSource | None = None
        first: tuple[str, float] | None = None
        if api_key is not None:
            if not api_url:
                raise AuthError(
                    "api_key was given without api_url: the key is exchanged for a relay token "
                    "at POST {api_url}/v1/tokens, so api_url (the HTTP API's URL) is required"
                )
            provider = TokenSource(api_url, api_key, ca_path)
            first = provider()
        _warn_if_open_to_others(os.fspath(data_dir))
        self._native = native_client.Client(
            endpoint,
            os.fspath(data_dir),
            identity,
            provider,
            first,
            connect_timeout,
            retry_timeout,
            ca_path,
        )
        self._endpoint = endpoint
        #: Set by close(): invitation iterators end on it.
        self._closed = threading.Event()

    @classmethod
    async def create_async(
        cls,
        endpoint: str,
        data_dir: str | os.PathLike[str],
        identity: bytes,
        api_key: str | None = None,
        api_url: str | None = None,
        *,
        connect_timeout: float | None = None,
        retry_timeout: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> StaticClient:
        """Like the constructor, without blocking the event loop (the token exchange and the
        opening of the state run in a worker thread)."""
        return await _in_thread(
            cls,
            endpoint,
            data_dir,
            identity,
            api_key,
            api_url,
            connect_timeout=connect_timeout,
            retry_timeout=retry_timeout,
            ca_file=ca_file,
        )

    @property
    def identity(self) -> bytes:
        """This agent's identity."""
        return self._native.identity

    @property
    def data_dir(self) -> str:
        """The directory holding this agent's MLS state."""
        return self._native.data_dir

    def generate_key_package(self) -> bytes:
        """A fresh MLS key package (bytes) to hand to a member, who adds us with it
        (:meth:`Channel.add_member`). Each key package is single-use."""
        return self._native.generate_key_package()

    def create_channel(self, name: str) -> Channel:
        """Create channel ``name`` (``org/namespace/service``) on the relay with us as the first
        member of its MLS group.

        :raises InvalidChannelNameError: the name is not of the form ``org/namespace/service``.
        :raises MLSEngineError: the channel already exists (on the relay, or locally).
        :raises TransportError: the relay cannot be reached.
        """
        validate_channel_name(name)
        return Channel(self._native.create_channel(name))

    def join_channel(self, name: str, welcome: bytes) -> Channel:
        """Join channel ``name`` from the Welcome a member's :meth:`Channel.add_member` returned.

        :raises InvalidChannelNameError: the name is malformed.
        :raises MLSEngineError: the Welcome is invalid, not for us, or for another channel.
        :raises TransportError: the relay cannot be reached or does not know the channel (channels
            are scoped to the account that created them).
        """
        validate_channel_name(name)
        return Channel(self._native.join_channel(name, _check_bytes("welcome", welcome)))

    def channels(self) -> list[str]:
        """The channels this identity is a member of in ``data_dir`` (to reopen after a
        restart with :meth:`open_channel`)."""
        return self._native.channels()

    def open_channel(self, name: str) -> Channel:
        """Reopen a channel of ours: background processing resumes after the last entry of the
        relay's log applied before, and messages received but not yet read are kept.

        :raises MLSEngineError: we are not a member of ``name``.
        """
        validate_channel_name(name)
        return Channel(self._native.open_channel(name))

    @property
    def address(self) -> str:
        """This agent's address, ``static:<account>:<identity>`` (the identity in unpadded
        base64url; the account ``""`` for an anonymous client): what another agent passes to
        :meth:`Channel.invite`. :meth:`Address.parse` splits it."""
        account, identity = self._native.address()
        return str(Address(account, identity))

    def allow_invitations(self, accounts: list[str]) -> None:
        """Let agents of ``accounts`` invite this one, besides agents of its own account (the
        default); ``["*"]`` lets any account. Replaces the list given before. The relay enforces
        it. Also starts keeping this agent's key packages in the relay's directory, as
        :meth:`invitations` does.

        :raises TransportError: more than 100 accounts, or one that is not an account id.
        """
        if isinstance(accounts, str) or not all(isinstance(a, str) for a in accounts):
            raise TypeError("accounts must be a list of account ids (str)")
        self._native.allow_invitations(list(accounts))

    def invitations(self) -> InvitationIterator[Channel]:
        """A blocking iterator over the invitations the relay holds for this agent: those
        received while it was offline first, then new ones as they come (within about a
        second). Each :class:`~static.sdk.Invitation` is accepted (:meth:`Invitation.accept`
        returns the joined :class:`Channel`) or declined. Ends when the client is closed.

        From the first call on, the client keeps a stock of this agent's key packages in the
        relay's directory, so that others can invite it.
        """
        self._native.keep_key_packages()
        return InvitationIterator(self._native, Channel, self._closed)

    def invitations_async(self) -> AsyncInvitationIterator[Channel]:
        """Async :meth:`invitations` (``async for invitation in client.invitations_async()``),
        for trio and asyncio. Its first wait lists the key packages (in a worker thread), so
        the agent can be invited from then on."""
        return AsyncInvitationIterator(self._native, Channel, self._closed)

    def close(self) -> None:
        """Stop every channel's background work and release ``data_dir``. Idempotent.
        Messages received but not read stay stored for the next opening."""
        self._closed.set()
        self._native.close()

    # --- async variants -------------------------------------------------------------------

    async def generate_key_package_async(self) -> bytes:
        """Async :meth:`generate_key_package`."""
        return await _in_thread(self.generate_key_package)

    async def create_channel_async(self, name: str) -> Channel:
        """Async :meth:`create_channel`."""
        return await _in_thread(self.create_channel, name)

    async def join_channel_async(self, name: str, welcome: bytes) -> Channel:
        """Async :meth:`join_channel`."""
        return await _in_thread(self.join_channel, name, welcome)

    async def channels_async(self) -> list[str]:
        """Async :meth:`channels`."""
        return await _in_thread(self.channels)

    async def open_channel_async(self, name: str) -> Channel:
        """Async :meth:`open_channel`."""
        return await _in_thread(self.open_channel, name)

    async def address_async(self) -> str:
        """Async :attr:`address`."""
        return await _in_thread(lambda: self.address)

    async def allow_invitations_async(self, accounts: list[str]) -> None:
        """Async :meth:`allow_invitations`."""
        await _in_thread(self.allow_invitations, accounts)

    async def close_async(self) -> None:
        """Async :meth:`close`."""
        await _in_thread(self.close)

    def __repr__(self) -> str:
        return f"StaticClient({self._endpoint!r}, {self.data_dir!r}, {self.identity!r})"


class Channel(_Closeable):
    """An MLS-encrypted channel we are a member of. Safe to use from many threads at once:
    ``send``, ``add_member`` and iteration may run concurrently.

    A background task applies the relay's log in order (commits are merged even when nobody
    iterates) and stores decrypted messages until they are read. We never receive our own
    messages.
    """

    def __init__(self, native: native_client.Channel) -> None:
        self._native = native

    @property
    def name(self) -> str:
        """The channel's name, ``org/namespace/service``."""
        return self._native.name

    @property
    def closed(self) -> bool:
        """Whether the channel was closed (or ended: we were removed, or it failed)."""
        return self._native.closed

    def add_member(self, key_package: bytes) -> bytes:
        """Add the owner of ``key_package`` (from their :meth:`StaticClient.generate_key_package`)
        and return the MLS Welcome (bytes) to hand them for :meth:`StaticClient.join_channel`.

        Returns once the commit is in the relay's log and merged here; if another member's
        commit won the epoch, it is applied and ours retried.

        :raises MLSEngineError: the key package is invalid.
        :raises TransportError: the relay cannot be reached.
        """
        return self._native.add_member(_check_bytes("key_package", key_package))

    def send(self, payload: bytes) -> None:
        """Encrypt ``payload`` and send it to every other member. Returns once the relay has
        it in the channel's log. Concurrent sends from several threads are batched.

        :raises TransportError: the relay cannot be reached (after retrying for 30 s), or the
            payload exceeds :data:`MAX_PAYLOAD` bytes.
        """
        self._native.send(_check_bytes("payload", payload))

    def send_pipelined(self, payload: bytes) -> SendHandle:
        """Queue ``payload`` to be encrypted and sent, and return at once with a
        :class:`SendHandle` (wait on it, or call :meth:`flush`, to learn the outcome).

        For high rates from one thread: the channel's sender thread encrypts what is queued
        in batches and publishes them in order, so pipelined messages reach the log (and the
        other members) in the order they were queued, none twice. Once this returns the
        message is in ``data_dir`` (the channel's outbox): if the process dies before the
        relay has it, the next opening of the channel sends it first (with the same bytes if
        it was encrypted), and the relay stores it once; :meth:`pipelined_count` tells a
        restarted program where it was. A lost
        connection or a relay restart is ridden out like :meth:`send` does; a message that
        cannot be sent fails its handle (and the next :meth:`flush`) and never overtakes an
        earlier one. Blocks only when 8,192 messages (or 64 MiB) are queued. A :meth:`send`
        from the same thread waits for what it queued before.

        :raises TransportError: the payload exceeds :data:`MAX_PAYLOAD` bytes.
        :raises RuntimeError: (a subclass) the channel has ended.
        """
        handle = self._native.send_pipelined(_check_bytes("payload", payload))
        assert handle is not None  # blocking: never None
        return SendHandle(handle)

    def pipelined_count(self) -> int:
        """How many messages :meth:`send_pipelined` ever accepted on this channel in this
        ``data_dir`` (every call that returned, across crashes and reopenings): a program that
        numbers its messages resumes from it after a crash, and resends nothing."""
        return self._native.pipelined_count()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message queued with :meth:`send_pipelined` so far is in the log
        (or has failed), waiting up to ``timeout`` seconds (forever if None).

        :raises TimeoutError: some are still on their way after ``timeout``.
        :raises RuntimeError: (a subclass) the first of them that failed since the last flush.
        """
        if not self._native.flush(_check_timeout("timeout", timeout)):
            raise TimeoutError(f"pipelined sends on {self.name!r} still pending after {timeout} s")

    def messages(self) -> MessageIterator:
        """A blocking iterator over the decrypted payloads (bytes) other members send, in the
        channel's order. It ends when the channel is closed or we are removed."""
        return MessageIterator(self._native)

    def receive(self, timeout: float | None = None) -> bytes:
        """The next message, waiting up to ``timeout`` seconds (forever if None).

        :raises TimeoutError: nothing arrived in time.
        :raises EOFError: the channel is closed or we were removed, and nothing is left to read.
        """
        code, payload = self._native.next_message(timeout)
        if code == _MESSAGE and payload is not None:
            return payload
        if code == _END:
            raise EOFError(f"channel {self.name!r} has ended")
        raise TimeoutError(f"no message on {self.name!r} within {timeout} s")

    def invite(self, address: str | Address) -> None:
        """Invite the agent at ``address`` (its :attr:`StaticClient.address`): claim one of its
        key packages from the relay's directory, commit its addition (as :meth:`add_member`
        does) and leave the invitation with the relay, where the agent's
        :meth:`StaticClient.invitations` finds it. Returns once the commit is accepted.

        :raises ValueError: ``address`` is not an address.
        :raises AuthError: the address is unknown, has no key package listed, or does not
            accept invitations from our account (one answer for all three, so that nobody can
            probe the directory).
        """
        target = as_address(address)
        self._native.invite(target.account, target.identity)

    def remove_member(self, identity: bytes) -> None:
        """Remove the member whose identity is ``identity`` (a commit, like ``add_member``)."""
        self._native.remove_member(_check_bytes("identity", identity))

    def rotate_keys(self) -> None:
        """Update our own leaf keys (an MLS self-update commit), for post-compromise security."""
        self._native.rotate_keys()

    def leave(self) -> None:
        """Leave the channel: propose our removal, which another member's client commits
        automatically; returns once it is committed (the channel then ends)."""
        self._native.leave()

    def members(self) -> list[bytes]:
        """The identities of the group's members, ourselves included."""
        return self._native.members()

    def roster(self) -> list[Member]:
        """The members as the relay attests them, in leaf order: each identity with the account
        its leaf is bound to. Two members never share an identity."""
        _, members = self._native.roster()
        return [Member(identity, account, leaf) for leaf, identity, account in members]

    def messages_with_sender(self) -> SenderMessageIterator:
        """Like :meth:`messages`, but each item is a :class:`Message`: the payload with its
        sender (identity and account), seq and epoch."""
        return SenderMessageIterator(self._native)

    def receive_message(self, timeout: float | None = None) -> Message:
        """Like :meth:`receive`, as a :class:`Message`."""
        code, fields = self._native.next_message(_check_timeout("timeout", timeout), True)
        if code == _MESSAGE and fields is not None:
            return _message(fields)
        if code == _END:
            raise EOFError(f"channel {self.name!r} has ended")
        raise TimeoutError(f"no message on {self.name!r} within {timeout} s")

    def request(self, payload: bytes, timeout: float) -> Message:
        """Send ``payload`` as a request and return the first reply another member sends to it
        (:meth:`requests`, :meth:`Request.reply`), waiting up to ``timeout`` seconds.

        Each request gets exactly one reply: after a timeout (or a crash of this process, the
        same ``data_dir`` reopened), calling again with the same payload takes the earlier
        request over (the responders see it once) and returns its reply. Requests and replies
        are encrypted like any message and never show up in :meth:`messages`.

        :raises TimeoutError: no reply within ``timeout``.
        :raises TransportError: the payload is over ``MAX_PAYLOAD - 16`` bytes, or the relay
            cannot be reached.
        :raises InternalError: the channel was closed meanwhile.
        """
        checked = _check_timeout("timeout", timeout)
        if checked is None:
            raise TypeError("timeout must be a number of seconds, not None")
        return _message(request(self._native, payload, checked))

    def requests(self) -> RequestIterator:
        """A blocking iterator over the requests other members send (:class:`Request`, to
        reply to with :meth:`Request.reply`), each once per opening of the channel; one not
        replied to comes again after the channel is reopened. Ends when the channel is closed
        or we are removed."""
        return RequestIterator(self._native)

    def epoch(self) -> int:
        """The MLS epoch our group state is at."""
        return self._native.epoch()

    def epoch_authenticator(self) -> bytes:
        """The epoch authenticator (RFC 9420 §8.7): equal for all members at the same epoch;
        compare it out of band to detect a fork."""
        return self._native.epoch_authenticator()

    def pending(self) -> int:
        """How many received messages wait to be read."""
        return self._native.pending()

    def close(self) -> None:
        """Stop this channel's background work (iterators end). Unread messages are kept for
        :meth:`StaticClient.open_channel`. Idempotent."""
        self._native.close()

    # --- async variants -------------------------------------------------------------------

    async def add_member_async(self, key_package: bytes) -> bytes:
        """Async :meth:`add_member`."""
        return await _in_thread(self.add_member, key_package)

    async def send_async(self, payload: bytes) -> None:
        """Async :meth:`send`."""
        await _in_thread(self.send, payload)

    async def send_pipelined_async(self, payload: bytes) -> SendHandle:
        """Async :meth:`send_pipelined`: returns at once unless the pipeline is full, then
        waits for room in a worker thread."""
        payload = _check_bytes("payload", payload)
        handle = self._native.send_pipelined(payload, False)
        if handle is None:
            handle = await _in_thread(self._native.send_pipelined, payload)
        assert handle is not None
        return SendHandle(handle)

    async def pipelined_count_async(self) -> int:
        """Async :meth:`pipelined_count` (it never waits)."""
        return self._native.pipelined_count()

    async def flush_async(self) -> None:
        """Async :meth:`flush` (bound the wait with ``anyio.fail_after`` or the like: it waits
        in a worker thread in slices of 0.1 s, so a cancellation takes effect within one)."""
        while not await _in_thread(self._native.flush, _ASYNC_SLICE):
            pass

    def messages_async(self) -> AsyncMessageIterator:
        """An async iterator over received messages (``async for msg in ch.messages_async()``),
        for trio or asyncio. Waiting uses no thread."""
        return AsyncMessageIterator(self._native)

    async def receive_async(self) -> bytes:
        """Async :meth:`receive` (bound the wait with ``anyio.fail_after``, ``trio.fail_after`` or
        ``asyncio.timeout``; cancelling it consumes nothing).

        :raises EOFError: the channel is closed or we were removed, and nothing is left to read.
        """
        return await _first(AsyncMessageIterator(self._native), self.name)

    async def invite_async(self, address: str | Address) -> None:
        """Async :meth:`invite`."""
        await _in_thread(self.invite, address)

    async def remove_member_async(self, identity: bytes) -> None:
        """Async :meth:`remove_member`."""
        await _in_thread(self.remove_member, identity)

    async def rotate_keys_async(self) -> None:
        """Async :meth:`rotate_keys`."""
        await _in_thread(self.rotate_keys)

    async def leave_async(self) -> None:
        """Async :meth:`leave`."""
        await _in_thread(self.leave)

    async def members_async(self) -> list[bytes]:
        """Async :meth:`members`."""
        return await _in_thread(self.members)

    async def roster_async(self) -> list[Member]:
        """Async :meth:`roster`."""
        return await _in_thread(self.roster)

    def messages_with_sender_async(self) -> AsyncSenderMessageIterator:
        """Async :meth:`messages_with_sender` (waiting uses no thread)."""
        return AsyncSenderMessageIterator(self._native)

    async def receive_message_async(self) -> Message:
        """Async :meth:`receive_message` (bound the wait as for :meth:`receive_async`).

        :raises EOFError: the channel is closed or we were removed, and nothing is left to read.
        """
        return await _first(AsyncSenderMessageIterator(self._native), self.name)

    async def request_async(self, payload: bytes, timeout: float) -> Message:  # noqa: ASYNC109 - the API's
        """Async :meth:`request` (the reply is awaited without a thread)."""
        checked = _check_timeout("timeout", timeout)
        if checked is None:
            raise TypeError("timeout must be a number of seconds, not None")
        return _message(await request_async(self._native, payload, checked))

    def requests_async(self) -> AsyncRequestIterator:
        """Async :meth:`requests` (``async for req in ch.requests_async()``), for trio or
        asyncio. Waiting uses no thread."""
        return AsyncRequestIterator(self._native)

    async def epoch_async(self) -> int:
        """Async :meth:`epoch`."""
        return await _in_thread(self.epoch)

    async def epoch_authenticator_async(self) -> bytes:
        """Async :meth:`epoch_authenticator`."""
        return await _in_thread(self.epoch_authenticator)

    async def pending_async(self) -> int:
        """Async :meth:`pending`."""
        return await _in_thread(self.pending)

    async def close_async(self) -> None:
        """Async :meth:`close`."""
        await _in_thread(self.close)

    def __repr__(self) -> str:
        return f"<Channel {self.name!r}>"


class SendHandle:
    """The outcome of one :meth:`Channel.send_pipelined`."""

    __slots__ = ("_native",)

    def __init__(self, native: native_client.SendHandle) -> None:
        self._native = native

    def done(self) -> bool:
        """Whether the message is in the log or has failed."""
        return self._native.done()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the message is in the channel's log, up to ``timeout`` seconds (forever if
        None; Ctrl-C still answers).

        :raises TimeoutError: it is still on its way.
        :raises RuntimeError: (a subclass) it could not be sent.
        """
        if not self._native.wait(_check_timeout("timeout", timeout)):
            raise TimeoutError(f"the message is still on its way after {timeout} s")

    async def wait_async(self) -> None:
        """Async :meth:`wait` (waits in a worker thread in slices of 0.1 s, so a cancellation
        takes effect within one)."""
        while not await _in_thread(self._native.wait, _ASYNC_SLICE):
            pass

    def __repr__(self) -> str:
        return f"<SendHandle {'done' if self.done() else 'pending'}>"


class MessageIterator:
    """Blocking iterator over a channel's incoming messages (decrypted payloads, ``bytes``).

    ``__next__`` blocks until a message arrives (with the GIL released, answering Ctrl-C within
    100 ms) and raises ``StopIteration`` once the channel is closed or we were removed and
    everything received was read. Several iterators (and threads) may share a channel: each
    message goes to exactly one of them.
    """

    def __init__(self, native: native_client.Channel) -> None:
        self._native = native

    def __iter__(self) -> MessageIterator:
        return self

    def __next__(self) -> bytes:
        payload = self._native.next_payload()
        if payload is None:
            raise StopIteration
        return payload


class SenderMessageIterator:
    """Blocking iterator over a channel's incoming messages as :class:`Message` (payload,
    sender, account, seq, epoch); otherwise exactly :class:`MessageIterator`."""

    def __init__(self, native: native_client.Channel) -> None:
        self._native = native

    def __iter__(self) -> SenderMessageIterator:
        return self

    def __next__(self) -> Message:
        fields = self._native.next_payload(True)
        if fields is None:
            raise StopIteration
        return _message(fields)


class _AsyncInbox:
    """Waits for a channel's next message without a thread: on a readiness socket the channel
    writes to when messages arrive. Cancelling a wait consumes nothing."""

    def __init__(self, native: native_client.Channel) -> None:
        self._native = native
        self._waker: native_client.Waker | None = native.waker()

    async def _next(self, poll: Callable[[], tuple[int, _T | None]]) -> _T | None:
        """The next item ``poll`` takes, or None once the channel has ended."""
        while True:
            code, item = poll()
            if code == _MESSAGE and item is not None:
                return item
            if code == _END:
                self.close()
                return None
            waker = self._waker
            if waker is None:
                return None
            # Drain, then look again, then sleep: a wake-up between the two looks is not lost.
            waker.drain()
            code, item = poll()
            if code == _MESSAGE and item is not None:
                return item
            if code == _END:
                self.close()
                return None
            await anyio.wait_readable(waker.fileno())

    def close(self) -> None:
        """Release the readiness socket (the iterator then ends)."""
        self._waker = None

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        self.close()


class AsyncMessageIterator(_AsyncInbox):
    """Async iterator over a channel's incoming messages, for trio and asyncio.

    Waiting costs no thread: the iterator waits for a readiness socket the channel writes to
    when messages arrive. Cancelling a waiting ``__anext__`` consumes nothing and leaves the
    channel and the iterator usable. Ends (``StopAsyncIteration``) like :class:`MessageIterator`.
    """

    def __aiter__(self) -> AsyncMessageIterator:
        return self

    async def __anext__(self) -> bytes:
        payload = await self._next(self._native.poll_next)
        if payload is None:
            raise StopAsyncIteration
        return payload


class AsyncSenderMessageIterator(_AsyncInbox):
    """:class:`AsyncMessageIterator` whose items are :class:`Message`."""

    def __aiter__(self) -> AsyncSenderMessageIterator:
        return self

    async def __anext__(self) -> Message:
        fields = await self._next(lambda: self._native.poll_next(True))
        if fields is None:
            raise StopAsyncIteration
        return _message(fields)

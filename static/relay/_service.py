"""The Relay service: one handler per gRPC stream, over purerpc's stream API.

Every refusal is a :class:`RelayError`, mapped to a gRPC status (and trailers) in one place,
:func:`_finish`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import anyio
import h2.exceptions
import trio
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from purerpc.grpclib.events import MessageReceived, RequestEnded
from purerpc.grpclib.exceptions import GRPCError
from purerpc.grpclib.status import Status, StatusCode

from static._channel_name import validate_channel_name
from static._errors import InvalidChannelNameError
from static._settings import RelaySettings
from static.relay import _proto as pb
from static.relay import _wire
from static.relay._auth import Authenticator, Caller, StreamGuard
from static.relay._errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    RelayError,
    ResourceExhausted,
    StaleEpoch,
    Unavailable,
    Unimplemented,
)
from static.relay._framing import (
    ContentType,
    MalformedMessage,
    MessageHeader,
    WelcomeHeader,
    parse_message,
    parse_welcome,
)
from static.relay._log import ChannelLog, ChannelState, Origin, PublishResult, Submitted
from static.relay._rules import TokenBucket, idempotency_key
from static.relay._transport import MessageTooLarge, RelayStream, StreamGone
from static.store import DatabaseError
from static.store._channels import ChannelExists, EntryRecord

__all__ = ["SERVICE_NAME", "Early", "RelayService"]

SERVICE_NAME = "static.relay.v1.Relay"
_OK = Status(StatusCode.OK)
_log = logging.getLogger("static.relay")
_MAX_BUCKETS = 10_000
#: Publishes of one PublishStream call queued ahead of their answers.
_PIPELINE_DEPTH = 256
#: Items of one PublishBatches request, and requests of one call read ahead of their answers.
_BATCH_ITEMS = 1024
_BATCHES_AHEAD = 64
#: Messages per Subscribe response when the subscriber asks for batches (and its max_batch).
_SUBSCRIBE_BATCH_BYTES = 1024 * 1024
_SUBSCRIBE_BATCH_ENTRIES = 1024
#: Bytes a connection may have queued for its socket before subscriptions on it wait.
_OUTBOUND_LIMIT = 1024 * 1024

# The stream or its connection is gone: there is nobody left to answer.
_GONE = (
    StreamGone,
    GRPCError,
    h2.exceptions.H2Error,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
)

_Handler = Callable[[RelayStream, Caller], Awaitable[None]]


class _Checked(NamedTuple):
    name: str
    header: MessageHeader
    message: bytes
    key: bytes
    welcome: bytes
    welcome_header: WelcomeHeader | None


class Early:
    """What the connection's reader did with a unary Publish before its handler ran: the
    submission (or the refusal) of its request, once it arrived."""

    __slots__ = ("caller", "outcome")

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.outcome: Submitted | RelayError | None = None


class RelayService:
    """The relay's RPCs. ``handle`` serves one stream from its first event to its trailers."""

    def __init__(self, log: ChannelLog, auth: Authenticator, settings: RelaySettings) -> None:
        self._log = log
        self._auth = auth
        self._settings = settings
        self._buckets: dict[str, TokenBucket] = {}
        self._subscriptions: set[StreamGuard] = set()
        self._draining = False
        self._methods: dict[str, _Handler] = {
            "CreateChannel": self._create_channel,
            "Publish": self._publish,
            "PublishStream": self._publish_stream,
            "PublishBatches": self._publish_batches,
            "Subscribe": self._subscribe,
            "FetchWelcome": self._fetch_welcome,
        }

    def drain(self) -> None:
        """Shutdown: refuse new calls, end live subscriptions with UNAVAILABLE."""
        self._draining = True
        for guard in list(self._subscriptions):
            guard.end(Unavailable("relay is shutting down"))

    def reading(self) -> None:
        """A connection's reader hands out a read; :meth:`commit_pending` follows it."""
        self._log.reader_will_commit()

    def commit_pending(self) -> None:
        """A connection's read is handed out: what it published goes to the store now."""
        self._log.commit_pending()

    def refuse(self, stream: RelayStream, error: RelayError) -> None:
        """Answer a stream with ``error`` without serving it."""
        _finish(stream, error)

    def prepare(self, stream: RelayStream, peer: str) -> Early | None:
        """Called by the connection's reader as a call arrives, before its handler starts: a
        unary Publish whose caller is known at once (anonymous) has its request checked and
        submitted by the reader as it arrives (a scheduling round before the handler could),
        when its channel is loaded; its answer leaves from the commit callback. The handler
        (:meth:`handle`, given what this returns) still runs, for the call's bookkeeping."""
        request = stream.request
        if (
            self._draining
            or request.method_name != "Publish"
            or request.service_name != SERVICE_NAME
        ):
            return None
        caller = self._auth.authenticate_now(request.custom_metadata, peer)
        if caller is None:
            return None
        early = Early(caller)

        def consume(event: Any) -> bool:
            stream.consumer = None
            if type(event) is not MessageReceived:
                return False
            try:
                request = pb.PublishRequest.FromString(event.data)
            except DecodeError:
                return False  # the handler refuses it
            state = self._log.loaded(caller.scope, request.channel)
            if state is None:
                return False  # the handler loads it
            try:
                submitted = self._submit_checked(
                    state, self._check(request, caller), stream.connection
                )
            except RelayError as exc:
                early.outcome = exc
                return True
            except Exception:  # noqa: BLE001  (a bug: logged, the call ends with INTERNAL)
                _log.exception("relay: unexpected error")
                early.outcome = RelayError("internal error")
                return True
            submitted.on_settled = _answer_now(stream, submitted)
            early.outcome = submitted
            return True

        stream.consumer = consume
        return early

    async def handle(self, stream: RelayStream, peer: str, early: Early | None = None) -> None:
        outcome: RelayError | None = None
        try:
            request = stream.request
            if early is not None:
                # The reader took the request only if it got here first; now it must not.
                stream.consumer = None
            handler = (
                self._methods.get(request.method_name)
                if request.service_name == SERVICE_NAME
                else None
            )
            if early is not None and early.outcome is not None:
                await self._publish_early(stream, early.outcome)
            elif self._draining:
                raise Unavailable("relay is shutting down")
            elif handler is None:
                outcome = Unimplemented(f"no method /{request.service_name}/{request.method_name}")
            else:
                caller = await self._auth.authenticate(request.custom_metadata, peer)
                # Response headers leave with the first answer (or as trailers-only), except on
                # streaming-request calls, which send them at once (``RelayStream.start``).
                await handler(stream, caller)
        except RelayError as exc:
            outcome = exc
        except DecodeError:
            outcome = InvalidArgument("request is not a valid protobuf message")
        except DatabaseError as exc:
            outcome = Unavailable(f"store unavailable: {exc}")
        except _GONE:
            return
        except Exception:  # noqa: BLE001  (logged; the caller gets INTERNAL, the relay goes on)
            _log.exception("relay: unexpected error")
            outcome = RelayError("internal error")
        _finish(stream, outcome)

    # -- requests -----------------------------------------------------------------------------

    async def _create_channel(self, stream: RelayStream, caller: Caller) -> None:
        request: Any = await _request(stream, pb.CreateChannelRequest)
        name = _channel_name(request.channel)
        try:
            await self._log.create(caller.scope, name)
        except ChannelExists:
            raise AlreadyExists(f"channel {name!r} already exists") from None
        # Not flushed: the trailers follow at once, all in one write.
        await stream.send(
            pb.CreateChannelResponse(channel=name, epoch=0).SerializeToString(), flush=False
        )

    async def _publish(self, stream: RelayStream, caller: Caller) -> None:
        request: Any = await _request(stream, pb.PublishRequest)
        submitted = await self._submit(request, caller, stream.connection)
        submitted.on_settled = _answer_now(stream, submitted)
        await self._publish_early(stream, submitted)

    async def _publish_early(self, stream: RelayStream, submitted: Submitted | RelayError) -> None:
        """Answer a unary Publish already submitted (unless the commit callback did)."""
        if isinstance(submitted, RelayError):
            raise submitted
        result = await self._log.outcome(submitted)
        if not stream.finished:
            await stream.send(_publish_response(result), flush=False)

    async def _publish_stream(self, stream: RelayStream, caller: Caller) -> None:
        """Pipelined: requests are read and queued while earlier ones are being committed (so a
        batch shares group commits); answers go out in request order. The first refusal ends
        the call after the answers before it."""
        stream.start()
        queue_in, queue_out = trio.open_memory_channel[Submitted | RelayError](_PIPELINE_DEPTH)
        failure: list[BaseException] = []

        async def read(nursery: trio.Nursery) -> None:
            async with queue_in:
                try:
                    while True:
                        event = await stream.receive()
                        if isinstance(event, MessageTooLarge):
                            raise _too_large(event.limit)
                        if isinstance(event, RequestEnded):
                            return
                        if isinstance(event, MessageReceived):
                            request = pb.PublishRequest.FromString(event.data)
                            await queue_in.send(
                                await self._submit(request, caller, stream.connection)
                            )
                except RelayError as exc:
                    await queue_in.send(exc)
                except DecodeError:
                    await queue_in.send(InvalidArgument("request is not a valid protobuf message"))
                except DatabaseError as exc:
                    await queue_in.send(Unavailable(f"store unavailable: {exc}"))

        async def answer(nursery: trio.Nursery) -> None:
            try:
                async for first in queue_out:
                    # Answer everything already queued without yielding in between, so that
                    # the answers of one group commit leave in one socket write.
                    items = [first]
                    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
                        while len(items) < _PIPELINE_DEPTH:
                            items.append(queue_out.receive_nowait())
                    try:
                        for item in items:
                            if isinstance(item, RelayError):
                                raise item
                            if not item.settled:
                                stream.connection.flush()
                            result = await self._log.outcome(item)
                            await stream.send(_publish_response(result), flush=False)
                    finally:
                        stream.connection.flush()
            except (RelayError, *_GONE) as exc:
                failure.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, nursery)
            nursery.start_soon(answer, nursery)
        if failure:
            raise failure[0]

    async def _publish_batches(self, stream: RelayStream, caller: Caller) -> None:
        """Pipelined batches: every item is submitted as it is read (so batches share group
        commits), each request is answered once all its items are decided, in request order.
        A refused item is answered as such; only a failure of the call itself ends it."""
        stream.start()
        queue_in, queue_out = trio.open_memory_channel[list[Submitted | RelayError] | RelayError](
            _BATCHES_AHEAD
        )
        failure: list[BaseException] = []
        # True while ``read`` holds a request it has not queued yet (the consumer must wait).
        reading = [False]
        answers = _Answers()

        def consume(event: Any) -> bool:
            """The connection's reader hands a request over as it arrives (saving a scheduling
            round before its commit) when it can be decided right away: well-formed, read-ahead
            room, every channel already loaded. Otherwise ``read`` takes it, in order."""
            if (
                reading[0]
                or type(event) is not MessageReceived
                or queue_in.statistics().current_buffer_used >= _BATCHES_AHEAD
            ):
                return False
            try:
                requests = pb.PublishBatchRequest.FromString(event.data).requests
            except DecodeError:
                return False
            if len(requests) > _BATCH_ITEMS:
                return False
            states = [self._log.loaded(caller.scope, r.channel) for r in requests]
            if any(state is None for state in states):
                return False
            batch: list[Submitted | RelayError] = []
            for request, state in zip(requests, states, strict=True):
                assert state is not None
                if _rate_limited(batch):
                    batch.append(batch[-1])
                    continue
                try:
                    batch.append(
                        self._submit_checked(state, self._check(request, caller), stream.connection)
                    )
                except RelayError as exc:
                    batch.append(exc)
                except Exception:  # noqa: BLE001  (a bug: logged, the item refused as INTERNAL)
                    _log.exception("relay: unexpected error")
                    batch.append(RelayError("internal error"))
            if not answers.take(stream, batch):
                answers.behind += 1
                queue_in.send_nowait(batch)
            return True

        async def read(nursery: trio.Nursery) -> None:
            async with queue_in:
                try:
                    while True:
                        reading[0] = False
                        event = await stream.receive()
                        reading[0] = True
                        if isinstance(event, MessageTooLarge):
                            raise _too_large(event.limit)
                        if isinstance(event, RequestEnded):
                            return
                        if isinstance(event, MessageReceived):
                            requests = pb.PublishBatchRequest.FromString(event.data).requests
                            if len(requests) > _BATCH_ITEMS:
                                raise InvalidArgument(
                                    f"{len(requests)} requests in one batch; at most {_BATCH_ITEMS}"
                                )
                            batch: list[Submitted | RelayError] = []
                            for r in requests:
                                batch.append(
                                    batch[-1]
                                    if _rate_limited(batch)
                                    else await self._try_submit(r, caller, stream.connection)
                                )
                            answers.behind += 1
                            try:
                                queue_in.send_nowait(batch)
                            except trio.WouldBlock:
                                await queue_in.send(batch)
                except RelayError as exc:
                    answers.behind += 1
                    await queue_in.send(exc)
                except DecodeError:
                    answers.behind += 1
                    await queue_in.send(InvalidArgument("request is not a valid protobuf message"))
                finally:
                    stream.consumer = None

        async def answer(nursery: trio.Nursery) -> None:
            """Answers in request order. A request whose items are being committed is left to
            its commit callback (``answers.pending``): this task is not woken for it, only for
            the next request, the end of the call, or when the callback could not send it.
            While this waits with nothing left to do, the consumer hands such requests to
            their callbacks itself, without queueing them (:meth:`_Answers.take`)."""
            connection = stream.connection
            try:
                while True:
                    with trio.CancelScope() as waiting:
                        if answers.pending is not None:
                            answers.pending.task_needed = waiting
                        answers.idle = waiting
                        try:
                            batches = [await queue_out.receive()]
                        except trio.EndOfChannel:
                            batches = []
                        finally:
                            answers.idle = None
                    # The consumer may have left one to a callback meanwhile.
                    pending = answers.pending
                    if waiting.cancelled_caught:
                        batches = []  # the callback could not answer: do it here
                    elif not batches:
                        if pending is not None:
                            await pending.resolve()
                            connection.flush()
                        return
                    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
                        while batches and len(batches) < _BATCHES_AHEAD:
                            batches.append(queue_out.receive_nowait())
                    try:
                        if pending is not None and (not batches or pending.last.settled):
                            await pending.resolve()
                            pending = None
                        for batch in batches:
                            if pending is not None:
                                # Answers ready so far leave before waiting for the next ones.
                                connection.flush()
                                await pending.resolve()
                                pending = None
                            if isinstance(batch, RelayError):
                                raise batch
                            last = _last_submitted(batch)
                            if last is not None and not last.settled:
                                pending = _PendingAnswer(stream, batch, last)
                                continue
                            await stream.send(_batch_response(batch), flush=False)
                    finally:
                        answers.pending = pending
                        connection.flush()
                    answers.behind -= len(batches)
            except (RelayError, *_GONE) as exc:
                failure.append(exc)
                nursery.cancel_scope.cancel()

        stream.consumer = consume
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, nursery)
                nursery.start_soon(answer, nursery)
        finally:
            stream.consumer = None
        if failure:
            raise failure[0]

    async def _try_submit(
        self, request: Any, caller: Caller, origin: Origin
    ) -> Submitted | RelayError:
        try:
            return await self._submit(request, caller, origin)
        except RelayError as exc:
            return exc
        except DatabaseError as exc:
            return Unavailable(f"store unavailable: {exc}")

    async def _submit(self, request: Any, caller: Caller, origin: Origin) -> Submitted:
        checked = self._check(request, caller)
        state = await self._log.channel(caller.scope, checked.name)
        return self._submit_checked(state, checked, origin)

    def _submit_checked(self, state: ChannelState, checked: _Checked, origin: Origin) -> Submitted:
        return self._log.submit(
            state,
            checked.header,
            checked.message,
            checked.key,
            checked.welcome,
            checked.welcome_header,
            origin,
        )

    def _check(self, request: Any, caller: Caller) -> _Checked:
        """Everything decided about a publish before its channel is looked up."""
        name = _channel_name(request.channel)
        message: bytes = request.message
        welcome: bytes = request.welcome
        limit = self._settings.max_message_bytes
        if len(message) > limit or len(welcome) > limit:
            raise ResourceExhausted(f"message larger than {limit} bytes")
        if not message:
            raise InvalidArgument("empty message")
        key = idempotency_key(request.idempotency_key, message)
        header = _parse(message)
        if header.group_id != name.encode():
            raise InvalidArgument(f"the message belongs to another group than channel {name!r}")
        welcome_header: WelcomeHeader | None = None
        if welcome:
            if header.content_type is not ContentType.COMMIT:
                raise InvalidArgument("a welcome can only be published with a commit")
            try:
                welcome_header = parse_welcome(welcome)
            except MalformedMessage as exc:
                raise InvalidArgument(f"malformed welcome: {exc}") from None
        self._rate_limit(caller)
        return _Checked(name, header, message, key, welcome, welcome_header)

    def _rate_limit(self, caller: Caller) -> None:
        rate = self._settings.publish_rate_per_agent
        if rate <= 0:
            return
        now = time.monotonic()
        bucket = self._buckets.get(caller.agent)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._buckets = {
                    agent: b for agent, b in self._buckets.items() if now - b.updated < 60
                }
            bucket = self._buckets[caller.agent] = TokenBucket.full(rate, rate, now)
        wait = bucket.take(now)
        if wait > 0:
            raise ResourceExhausted(
                f"publish rate limit of {rate:g} messages/s per agent exceeded", wait
            )

    async def _subscribe(self, stream: RelayStream, caller: Caller) -> None:
        request: Any = await _request(stream, pb.SubscribeRequest)
        name = _channel_name(request.channel)
        state = await self._log.channel(caller.scope, name)
        start = request.WhichOneof("start")
        after_seq = (
            await self._log.start_of_epoch(state, request.from_epoch)
            if start == "from_epoch"
            else int(request.after_seq)
        )
        with self._auth.watch(caller) as guard:
            self._subscriptions.add(guard)
            try:
                if self._draining:
                    guard.end(Unavailable("relay is shutting down"))
                with guard.scope:
                    await self._stream_entries(
                        stream,
                        state,
                        after_seq,
                        min(request.max_batch, _SUBSCRIBE_BATCH_ENTRIES),
                        guard,
                    )
            finally:
                self._subscriptions.discard(guard)
        outcome = guard.outcome()
        if outcome is not None:
            raise outcome

    async def _stream_entries(
        self,
        stream: RelayStream,
        state: ChannelState,
        after_seq: int,
        max_batch: int,
        guard: StreamGuard,
    ) -> None:
        keepalive = self._settings.keepalive_interval_seconds
        connection = stream.connection

        def deliver(page: list[EntryRecord]) -> int:
            """Live entries, sent from the writer's completion callback as far as they can go
            at once (the same bound on queued bytes as below); never raises."""
            if guard.scope.cancel_called:
                return 0
            sent = 0
            room = _OUTBOUND_LIMIT - connection.backlog
            try:
                chunks = _chunks(page, max_batch) if max_batch > 1 else [[e] for e in page]
                for chunk in chunks:
                    if room <= 0:
                        break
                    message = (
                        _wire.entries_response([_entry_wire(e) for e in chunk])
                        if max_batch > 1
                        else _entry_wire(chunk[0])
                    )
                    if not stream.send_now(message):
                        break
                    room -= len(message)
                    sent += len(chunk)
                connection.flush()
            except _GONE:
                pass  # the subscriber's task finds out by itself
            except Exception:  # noqa: BLE001  (logged; its task serves the subscriber instead)
                _log.exception("relay: delivering to a subscriber failed")
            return sent

        # A first keep-alive right away tells the client the subscription is live.
        await stream.send(_keepalive(state))
        async for page in self._log.follow(state, after_seq, keepalive, deliver, connection):
            # A peer that grants large HTTP/2 windows and then stops reading would otherwise
            # make the relay queue everything it is sent: such a subscriber simply falls
            # behind here and is served from the log later.
            await connection.wait_room(_OUTBOUND_LIMIT)
            if page is None:
                await stream.send(_keepalive(state))
            elif max_batch > 1:
                for chunk in _chunks(page, max_batch):
                    await connection.wait_room(_OUTBOUND_LIMIT)
                    await stream.send(_wire.entries_response([_entry_wire(e) for e in chunk]))
            else:
                try:
                    for entry in page:
                        await connection.wait_room(_OUTBOUND_LIMIT)
                        await stream.send(_entry_wire(entry), flush=False)
                finally:
                    connection.flush()

    async def _fetch_welcome(self, stream: RelayStream, caller: Caller) -> None:
        request: Any = await _request(stream, pb.FetchWelcomeRequest)
        name = _channel_name(request.channel)
        state = await self._log.channel(caller.scope, name)
        which = request.WhichOneof("key")
        if which == "welcome_sha256":
            found = await self._log.fetch_welcome(state, digest=bytes(request.welcome_sha256))
        elif which == "key_package_ref":
            found = await self._log.fetch_welcome(
                state, key_package_ref=bytes(request.key_package_ref)
            )
        else:
            raise InvalidArgument("set welcome_sha256 or key_package_ref")
        if found is None:
            raise NotFound("no such welcome")
        await stream.send(
            pb.FetchWelcomeResponse(
                welcome=found.welcome, commit_seq=found.commit_seq, epoch=found.epoch
            ).SerializeToString(),
            flush=False,
        )


def _keepalive(state: ChannelState) -> bytes:
    response = pb.SubscribeResponse(keep_alive=pb.KeepAlive(head_seq=state.head_seq))
    encoded: bytes = response.SerializeToString()
    return encoded


def _entry_wire(entry: EntryRecord) -> bytes:
    # Encoded per send rather than cached on the ring's entries: a cache doubles the ring's
    # memory (tests/relay/test_transport.py measures it) for a gain only with many subscribers.
    return _wire.entry_field(entry.seq, entry.epoch, entry.content_type, entry.message)


def _chunks(page: list[EntryRecord], max_entries: int) -> list[list[EntryRecord]]:
    """``page`` cut into runs of at most ``max_entries`` entries and about
    ``_SUBSCRIBE_BATCH_BYTES`` of messages (a larger entry travels alone)."""
    chunks: list[list[EntryRecord]] = []
    current: list[EntryRecord] = []
    size = 0
    for entry in page:
        if current and (
            len(current) >= max_entries or size + len(entry.message) > _SUBSCRIBE_BATCH_BYTES
        ):
            chunks.append(current)
            current, size = [], 0
        current.append(entry)
        size += len(entry.message)
    if current:
        chunks.append(current)
    return chunks


def _answer_now(stream: RelayStream, submitted: Submitted) -> Callable[[], None]:
    """A unary Publish's whole answer (headers, message, trailers) in one write as soon as its
    commit is known, a scheduling round before its handler could; refusals are left to it."""

    def answer_now() -> None:
        result = submitted.result
        if isinstance(result, PublishResult) and stream.send_now(_publish_response(result)):
            stream.finish(_OK)

    return answer_now


class _PendingAnswer:
    """A PublishBatches request answered from the commit callback as soon as ``last`` (its
    last submission; every answer before it is out) is settled, a scheduling round earlier
    than its task could; when flow control holds the answer back (or anything fails), the
    callback cancels ``task_needed`` so that the task sends it (:meth:`resolve`)."""

    __slots__ = ("answered", "batch", "last", "stream", "task_needed")

    def __init__(
        self, stream: RelayStream, batch: list[Submitted | RelayError], last: Submitted
    ) -> None:
        self.stream = stream
        self.batch = batch
        self.last = last
        self.answered = False
        self.task_needed: trio.CancelScope | None = None
        last.on_settled = self._answer_now

    def _answer_now(self) -> None:
        try:
            if self.stream.send_now(_batch_response(self.batch)):
                self.stream.connection.flush()
                self.answered = True
        finally:
            if not self.answered and self.task_needed is not None:
                self.task_needed.cancel()

    async def resolve(self) -> None:
        """Wait until it is settled; send the answer unless the callback did."""
        await ChannelLog.wait_settled(self.last)
        if not self.answered:
            await self.stream.send(_batch_response(self.batch), flush=False)


class _Answers:
    """Where a PublishBatches call's answers stand, shared by its consumer (the connection's
    reader) and its ``answer`` task."""

    __slots__ = ("behind", "idle", "pending")

    def __init__(self) -> None:
        #: Requests queued for the answer task and not yet answered or left to a callback.
        self.behind = 0
        #: The answer task's wait, while it waits for a request with nothing else to do.
        self.idle: trio.CancelScope | None = None
        #: The request left to its commit callback, the latest one.
        self.pending: _PendingAnswer | None = None

    def take(self, stream: RelayStream, batch: list[Submitted | RelayError]) -> bool:
        """Leave ``batch`` (just submitted) to its commit callback right away when every
        earlier answer is out and the answer task waits with nothing to do: the order holds,
        and that task is not woken for a request it would only pass on (~8% of the relay's
        CPU per single publish). False: queue it for the task."""
        last = _last_submitted(batch)
        if (
            last is None
            or self.behind
            or self.idle is None
            or (self.pending is not None and not self.pending.answered)
        ):
            return False
        self.pending = _PendingAnswer(stream, batch, last)
        # When the callback cannot send the answer, the task wakes up and sends it.
        self.pending.task_needed = self.idle
        return True


def _last_submitted(batch: list[Submitted | RelayError]) -> Submitted | None:
    for item in reversed(batch):
        if isinstance(item, Submitted):
            return item
    return None


def _rate_limited(batch: list[Submitted | RelayError]) -> bool:
    """Whether the rate limit refused the last item so far: it then refuses the rest of the
    request too (the bucket refills while items are checked, and a later item let through after
    an earlier one was refused would reorder a sender's pipelined messages)."""
    return bool(batch) and isinstance(batch[-1], ResourceExhausted) and batch[-1].retry_after_ms > 0


def _batch_response(batch: list[Submitted | RelayError]) -> bytes:
    """A PublishBatchResponse for ``batch``, whose items are all settled or refused."""
    results: list[bytes] = []
    for item in batch:
        if isinstance(item, Submitted):
            result = item.result
            if isinstance(result, PublishResult):
                results.append(
                    _wire.accepted_result(
                        _wire.publish_response(result.seq, result.epoch, result.duplicate)
                    )
                )
                continue
            assert isinstance(result, RelayError)
            item = result
        refusal = pb.Refusal(code=int(item.code), message=item.message)
        if isinstance(item, StaleEpoch):
            refusal.current_epoch = item.current_epoch
        elif isinstance(item, ResourceExhausted):
            refusal.retry_after_ms = item.retry_after_ms
        results.append(pb.PublishResult(refused=refusal).SerializeToString())
    return _wire.publish_results(results)


def _too_large(limit: int) -> ResourceExhausted:
    return ResourceExhausted(f"request larger than the transport limit of {limit} bytes")


async def _request(stream: RelayStream, request_type: type[ProtoMessage]) -> Any:
    """The one request message of a unary-request call."""
    while True:
        event = await stream.receive()
        if isinstance(event, MessageTooLarge):
            raise _too_large(event.limit)
        if isinstance(event, MessageReceived):
            return request_type.FromString(event.data)
        if isinstance(event, RequestEnded):
            raise InvalidArgument("expected a request message")


def _channel_name(name: str) -> str:
    try:
        return validate_channel_name(name)
    except InvalidChannelNameError as exc:
        raise InvalidArgument(str(exc)) from None


def _parse(message: bytes) -> MessageHeader:
    try:
        return parse_message(message)
    except MalformedMessage as exc:
        raise InvalidArgument(f"malformed MLS message: {exc}") from None


def _publish_response(result: PublishResult) -> bytes:
    return _wire.publish_response(result.seq, result.epoch, result.duplicate)


def _finish(stream: RelayStream, error: RelayError | None) -> None:
    """End the call with OK or ``error``'s status; quietly when the stream is already gone."""
    if error is None:
        status = Status(StatusCode.OK)
        trailers: tuple[tuple[str, str], ...] = ()
    else:
        status = Status(StatusCode(int(error.code)), status_message=error.message)
        trailers = error.trailers
    try:
        stream.finish(status, trailers)
    except _GONE:
        _log.debug("stream gone before its status was sent")

"""A grpcio client for the relay tests: another gRPC implementation than the server's (tonic)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tests.relay._generated import relay_pb2 as pb
from tests.relay._generated import relay_pb2_grpc as pb_grpc

__all__ = ["Relay", "Subscription", "pb", "race", "status_of"]

TIMEOUT = 10.0


def status_of(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(code, details, trailers) of a failed call (a ``grpc.RpcError``)."""
    trailers = {k: v for k, v in (call.trailing_metadata() or ()) if isinstance(v, str)}
    return call.code(), call.details() or "", trailers


def race(
    urls: list[str], count: int, channel: str, message: Callable[[int], bytes]
) -> tuple[list[Any], list[tuple[grpc.StatusCode, str, dict[str, str]]]]:
    """``count`` publishes at once, each on a connection of its own (publish ``n`` to
    ``urls[n % len(urls)]``, with ``message(n)``), released together: (the PublishResponses,
    the refusals as :func:`status_of` gives them)."""
    barrier = threading.Barrier(count)
    outcomes: list[Any] = []

    def publish(n: int) -> None:
        with Relay(urls[n % len(urls)]) as own:
            barrier.wait(10)
            try:
                outcomes.append(own.publish(channel, message(n)))
            except grpc.RpcError as exc:
                outcomes.append(status_of(exc))

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [o for o in outcomes if isinstance(o, pb.PublishResponse)]
    lost = [o for o in outcomes if isinstance(o, tuple)]
    assert len(won) + len(lost) == count, outcomes
    return won, lost


class Relay:
    """One connection (grpc channel) to the relay, with an optional bearer token."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        target = url.removeprefix("grpc://")
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", 8 * 1024 * 1024),
                # One connection per Relay object (grpcio shares them across channels otherwise).
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        self.stub: Any = pb_grpc.RelayStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, channel: str) -> Any:
        return self.stub.CreateChannel(
            pb.CreateChannelRequest(channel=channel), timeout=TIMEOUT, metadata=self.metadata
        )

    def publish(self, channel: str, message: bytes, welcome: bytes = b"", key: bytes = b"") -> Any:
        return self.stub.Publish(
            pb.PublishRequest(
                channel=channel, message=message, welcome=welcome, idempotency_key=key
            ),
            timeout=TIMEOUT,
            metadata=self.metadata,
        )

    def publish_stream(self, requests: list[Any]) -> list[Any]:
        return list(
            self.stub.PublishStream(iter(requests), timeout=TIMEOUT, metadata=self.metadata)
        )

    def publish_batches(self, batches: list[list[Any]]) -> list[Any]:
        """PublishBatches with these batches of PublishRequests; the responses."""
        requests = (pb.PublishBatchRequest(requests=batch) for batch in batches)
        return list(self.stub.PublishBatches(requests, timeout=TIMEOUT, metadata=self.metadata))

    def subscribe(
        self,
        channel: str,
        *,
        after_seq: int | None = None,
        from_epoch: int | None = None,
        max_batch: int = 0,
        timeout: float = 30.0,
    ) -> Subscription:
        request = (
            pb.SubscribeRequest(channel=channel, from_epoch=from_epoch, max_batch=max_batch)
            if from_epoch is not None
            else pb.SubscribeRequest(channel=channel, after_seq=after_seq or 0, max_batch=max_batch)
        )
        call = self.stub.Subscribe(request, timeout=timeout, metadata=self.metadata)
        return Subscription(call)


class StreamReader:
    """A response stream read by a background thread: subclasses say what each response adds
    (under the condition, which is notified after each); ``error`` and ``ended`` say how it
    ended."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.keepalives = 0
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _take(self, response: Any) -> None:
        raise NotImplementedError

    def _read(self) -> None:
        try:
            for response in self.call:
                with self._changed:
                    self._take(response)
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()
            with self._changed:
                self._changed.notify_all()

    def wait_end(self, timeout: float = 10.0) -> grpc.RpcError | None:
        assert self.ended.wait(timeout), "the stream did not end"
        return self.error


class Subscription(StreamReader):
    """A Subscribe call read by a background thread into a list."""

    def __init__(self, call: Any) -> None:
        self.entries: list[Any] = []
        #: How many entries each batched response (``entries``) carried.
        self.batch_sizes: list[int] = []
        super().__init__(call)

    def _take(self, response: Any) -> None:
        if response.HasField("entry"):
            self.entries.append(response.entry)
        elif response.HasField("entries"):
            self.entries.extend(response.entries.entries)
            self.batch_sizes.append(len(response.entries.entries))
        else:
            self.keepalives += 1

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Any]:
        """Wait until ``count`` entries arrived; return them all."""
        with self._changed:
            self._changed.wait_for(
                lambda: len(self.entries) >= count or self.ended.is_set(), timeout
            )
            assert len(self.entries) >= count, (
                f"got {len(self.entries)} of {count} entries (error: {self.error})"
            )
            return list(self.entries)

    def wait_keepalives(self, count: int, timeout: float = 10.0) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.keepalives >= count, timeout)

    def cancel(self) -> None:
        self.call.cancel()
        self.ended.wait(5)

    def seqs(self) -> list[int]:
        return [e.seq for e in self.entries]


def iter_requests(channel: str, messages: list[bytes]) -> Iterator[Any]:
    for message in messages:
        yield pb.PublishRequest(channel=channel, message=message)

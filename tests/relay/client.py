"""A grpcio client for the relay tests: another gRPC implementation than the server's (tonic),
and real MLS members (the native engine) acting through it.

The relay governs channels by MLS membership (docs/design.md §5.2): a channel is created from
its creator's group, access needs a leaf bound to the caller's account, and handshakes must be
PublicMessages that apply to the channel's group. :class:`Member` is one such MLS client (an
``Engine`` in a temporary directory) acting through a :class:`Relay` connection for that
connection's account; :class:`Group` keeps a channel's members in step. ``Relay.create`` creates
a channel through a member of its own, and ``Relay.commit`` makes that member's next commit.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from static._native.mls import Engine
from tests.relay._generated import relay_pb2 as pb
from tests.relay._generated import relay_pb2_grpc as pb_grpc

__all__ = [
    "Group",
    "Member",
    "Relay",
    "Subscription",
    "account_of",
    "pb",
    "race",
    "race_commits",
    "status_of",
]

TIMEOUT = 10.0


def account_of(token: str | None) -> str:
    """The account a token acts for, as the relay names it: the JWT's ``sub`` claim (read, not
    verified), or "" for an anonymous caller (and for what is not a JWT)."""
    parts = (token or "").split(".")
    if len(parts) != 3:
        return ""
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return ""
    return str(claims.get("sub", "")) if isinstance(claims, dict) else ""


def status_of(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(code, details, trailers) of a failed call (a ``grpc.RpcError``)."""
    trailers = {k: v for k, v in (call.trailing_metadata() or ()) if isinstance(v, str)}
    return call.code(), call.details() or "", trailers


def race(
    urls: list[str],
    count: int,
    channel: str,
    message: Callable[[int], bytes],
    tokens: Sequence[str | None] | None = None,
    winners: list[int] | None = None,
) -> tuple[list[Any], list[tuple[grpc.StatusCode, str, dict[str, str]]]]:
    """``count`` publishes at once, each on a connection of its own (publish ``n`` to
    ``urls[n % len(urls)]``, with ``message(n)``, with ``tokens[n]``: anonymous by default),
    released together: (the PublishResponses, the refusals as :func:`status_of` gives them).
    ``winners``, when given, gets the ``n`` of each accepted publish."""
    barrier = threading.Barrier(count)
    outcomes: list[Any] = []

    def publish(n: int) -> None:
        with Relay(urls[n % len(urls)], tokens[n] if tokens else None) as own:
            barrier.wait(10)
            try:
                outcomes.append(own.publish(channel, message(n)))
                if winners is not None:
                    winners.append(n)
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


def race_commits(
    urls: list[str], group: Group, members: Sequence[Member] | None = None
) -> tuple[list[Any], list[tuple[grpc.StatusCode, str, dict[str, str]]]]:
    """Each of ``members`` (default: all of ``group``'s) makes a real commit (an update) at the
    group's current epoch; they are published at once as :func:`race` does (the ``n``th member's
    to ``urls[n % len(urls)]``, with its own relay's token). Then the group is put in step: the
    winner merges its commit, the others drop theirs and apply the winner's. Returns what
    :func:`race` returns."""
    racers = list(members if members is not None else group.members)
    commits = [m.update(group.channel) for m in racers]
    winners: list[int] = []
    tokens = [m.relay.token for m in racers]
    won, lost = race(urls, len(racers), group.channel, commits.__getitem__, tokens, winners)
    for n, member in enumerate(racers):
        if n not in winners:
            member.engine.clear_pending_commit(group.channel)
    if winners:
        (winner,) = winners
        racers[winner].engine.merge_pending_commit(group.channel)
        group.deliver(commits[winner], racers[winner])
        group.last_commit, group.last_committer = commits[winner], racers[winner]
    return won, lost


class Relay:
    """One connection (grpc channel) to the relay, with an optional bearer token.

    It acts for ``account`` (the token's, "" when anonymous); :meth:`create` creates a channel
    through an MLS member of its own (:attr:`member`), whose group it remembers."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.token = token
        self.account = account_of(token)
        self._member: Member | None = None
        self.groups: dict[str, Group] = {}
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
        for group in self.groups.values():
            group.close()
        if self._member is not None:
            self._member.close()
        self.channel.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def member(self) -> Member:
        """This connection's own MLS member (made at first use)."""
        if self._member is None:
            self._member = Member(self, "creator")
        return self._member

    def create(self, channel: str) -> Any:
        """Create ``channel`` from a real group of :attr:`member`'s (remembered as
        ``groups[channel]``); the CreateChannelResponse."""
        group = Group(channel, self.member)
        self.groups[channel] = group
        return group.created

    def create_raw(
        self,
        channel: str,
        group_info: bytes = b"",
        ratchet_tree: bytes = b"",
        binding: Any = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> Any:
        """CreateChannel with exactly these fields (no group made): for refusals."""
        return self.stub.CreateChannel(
            pb.CreateChannelRequest(
                channel=channel, group_info=group_info, ratchet_tree=ratchet_tree, binding=binding
            ),
            timeout=TIMEOUT,
            metadata=self.metadata if metadata is None else list(metadata),
        )

    def commit(self, channel: str) -> Any:
        """A real commit (an update) by the group of ``channel`` made by :meth:`create`, as
        :meth:`Group.commit` makes it; the PublishResponse."""
        return self.groups[channel].commit()

    def bind(self, channel: str, binding: Any) -> Any:
        return self.stub.BindLeaf(
            pb.BindLeafRequest(channel=channel, binding=binding),
            timeout=TIMEOUT,
            metadata=self.metadata,
        )

    def list_members(self, channel: str) -> Any:
        return self.stub.ListMembers(
            pb.ListMembersRequest(channel=channel), timeout=TIMEOUT, metadata=self.metadata
        )

    def fetch_welcome(self, channel: str, *, ref: bytes = b"", digest: bytes = b"") -> Any:
        request = (
            pb.FetchWelcomeRequest(channel=channel, key_package_ref=ref)
            if ref
            else pb.FetchWelcomeRequest(channel=channel, welcome_sha256=digest)
        )
        return self.stub.FetchWelcome(request, timeout=TIMEOUT, metadata=self.metadata)

    def set_retention(
        self,
        channel: str,
        *,
        max_age_seconds: int | None = None,
        max_entries: int | None = None,
        max_bytes: int | None = None,
    ) -> Any:
        """SetRetention (the org's owner only): None leaves a limit to the server's default, 0
        lifts it; the RetentionResponse."""
        policy = pb.RetentionPolicy(
            max_age_seconds=max_age_seconds, max_entries=max_entries, max_bytes=max_bytes
        )
        return self.stub.SetRetention(
            pb.SetRetentionRequest(channel=channel, policy=policy),
            timeout=TIMEOUT,
            metadata=self.metadata,
        )

    def get_retention(self, channel: str) -> Any:
        """GetRetention: the channel's policy, the policy in effect, its horizon and head."""
        return self.stub.GetRetention(
            pb.GetRetentionRequest(channel=channel), timeout=TIMEOUT, metadata=self.metadata
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


class Member:
    """A real MLS client: an ``Engine`` in a temporary directory of its own, with an identity of
    its own, acting through ``relay`` for that connection's account (its leaf bindings name
    ``relay.account``). Its pending commits are merged only once the relay accepted them."""

    def __init__(self, relay: Relay, name: str = "member") -> None:
        self.relay = relay
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}".encode()
        self.dir = tempfile.mkdtemp(prefix="static-member-")
        self.engine = Engine(self.dir, self.identity)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def binding(self, channel: str, account: str | None = None) -> Any:
        """Our leaf's LeafBinding for ``account`` (default: our relay's)."""
        leaf, signature = self.engine.leaf_binding(
            channel, self.relay.account if account is None else account
        )
        return pb.LeafBinding(leaf_index=leaf, signature=signature)

    def create(self, channel: str) -> Any:
        """Create the group and the channel (binding our leaf); the CreateChannelResponse."""
        self.engine.create_group(channel)
        group_info, tree = self.engine.public_state(channel)
        return self.relay.create_raw(channel, group_info, tree, self.binding(channel))

    def bind(self, channel: str) -> Any:
        return self.relay.bind(channel, self.binding(channel))

    def join(self, channel: str, welcome: bytes) -> Any:
        """Join from ``welcome`` and bind our leaf; the BindLeafResponse."""
        self.engine.join_group(channel, welcome)
        return self.bind(channel)

    def update(self, channel: str) -> bytes:
        """A commit updating our leaf, pending until :meth:`settle`."""
        return self.engine.self_update(channel)

    def settle(self, channel: str, accepted: bool) -> None:
        """Merge our pending commit (accepted) or drop it (refused)."""
        if accepted:
            self.engine.merge_pending_commit(channel)
        else:
            self.engine.clear_pending_commit(channel)

    def publish_commit(self, channel: str, commit: bytes, welcome: bytes = b"") -> Any:
        """Publish our pending ``commit`` and settle it by the answer; the PublishResponse."""
        try:
            answer = self.relay.publish(channel, commit, welcome)
        except grpc.RpcError:
            self.settle(channel, accepted=False)
            raise
        self.settle(channel, accepted=True)
        return answer

    def send(self, channel: str, payload: bytes) -> Any:
        """An application message (a real PrivateMessage) published; the PublishResponse."""
        return self.relay.publish(channel, self.engine.encrypt(channel, payload))

    def apply(self, channel: str, message: bytes) -> Any:
        """Process one message of the channel's log; the ``Incoming``."""
        return self.engine.process_incoming(channel, message)


class Group:
    """A channel's real MLS group and its members, kept in step: what one member commits
    through the group, the others apply. Created at construction by ``creator``."""

    def __init__(self, channel: str, creator: Member) -> None:
        self.channel = channel
        self.members = [creator]
        #: What the group closes: the members it was given to add, and the connections it was
        #: given to add a member through (the creator is its relay's).
        self._owned: list[Member | Relay] = []
        #: The key packages and the Welcome of the latest add; the latest commit and its maker.
        self.key_packages: list[bytes] = []
        self.welcome = b""
        self.last_commit = b""
        self.last_committer = creator
        self.created = creator.create(channel)

    @property
    def creator(self) -> Member:
        return self.members[0]

    def close(self) -> None:
        for owned in self._owned:
            owned.close()

    def deliver(self, message: bytes, sender: Member | None) -> None:
        """Every member but ``sender`` applies ``message``."""
        for member in self.members:
            if member is not sender:
                member.apply(self.channel, message)

    def add(self, joiners: Sequence[Member | Relay], by: Member | None = None) -> Any:
        """``by`` (default: the creator) adds ``joiners`` in one commit with its Welcome; each
        joins from it and binds its leaf (a Relay stands for a new member acting through it). The
        group closes them (and those relays). The commit's PublishResponse; :attr:`welcome` keeps
        the Welcome."""
        by = by or self.creator
        new = [j if isinstance(j, Member) else Member(j, "joiner") for j in joiners]
        self._owned += [*joiners, *(m for m, j in zip(new, joiners, strict=True) if m is not j)]
        self.key_packages = [m.engine.generate_key_package() for m in new]
        commit, welcome = by.engine.add_members(self.channel, self.key_packages)
        answer = by.publish_commit(self.channel, commit, welcome)
        self.deliver(commit, by)
        for member in new:
            member.join(self.channel, welcome)
        self.members += new
        self.welcome = welcome
        self.last_commit, self.last_committer = commit, by
        return answer

    def commit(self, by: Member | None = None) -> Any:
        """``by`` (default: the creator) commits an update; the others apply it. The
        PublishResponse; :attr:`last_commit` keeps the commit."""
        by = by or self.creator
        commit = by.update(self.channel)
        answer = by.publish_commit(self.channel, commit)
        self.deliver(commit, by)
        self.last_commit, self.last_committer = commit, by
        return answer

    def remove(self, removed: Member, by: Member | None = None) -> Any:
        """``by`` (default: the creator) commits ``removed``'s removal; the others apply it
        (``removed`` too, which learns it was removed). The PublishResponse."""
        by = by or self.creator
        commit = by.engine.remove_member(self.channel, removed.identity)
        answer = by.publish_commit(self.channel, commit)
        self.deliver(commit, by)
        self.members.remove(removed)
        self.last_commit, self.last_committer = commit, by
        return answer


def anonymous_create_request(channel: str) -> Any:
    """A CreateChannelRequest for ``channel`` from a throwaway real MLS group, its creator's leaf
    bound to the anonymous account (the benchmarks' channels: the relay builds the channel's
    public group state from the GroupInfo)."""
    with tempfile.TemporaryDirectory(prefix="bench-creator-") as directory:
        engine = Engine(directory, b"bench-creator")
        try:
            engine.create_group(channel)
            group_info, ratchet_tree = engine.public_state(channel)
            leaf, signature = engine.leaf_binding(channel, "")
        finally:
            engine.close()
    return pb.CreateChannelRequest(
        channel=channel,
        group_info=group_info,
        ratchet_tree=ratchet_tree,
        binding=pb.LeafBinding(leaf_index=leaf, signature=signature),
    )

"""Attack benchmark (issue 27): one account's costly calls against another account's latency.
Prints figures, asserts nothing.

    .venv/bin/python bench/attack.py [--attack create|tokens] [--round-trips N] [--loops N]
                                     [--copies N] [--repeats N]

Starts a real ``static serve`` (SQLite, durable) on loopback and signs up two accounts. The
victim's SDK agent creates a channel and sends 1 KiB messages one at a time; a round trip is
one ``send`` (encrypted, published, durably acknowledged by the relay). The attacker's
processes (``--loops``, 2 as in the issue) each loop CreateChannel, with the attacker's token,
for a name under the attacker's own org and a ratchet tree of ``--copies`` copies of its one
self-signed leaf (by default as many as fit in 1 MiB: the issue's attack, 6,472 copies and
305-372 ms of relay CPU per call at 9b2be07, refused in the end). Prints the victim's round
trip p50/p99 at rest, under attack and at rest again, with the ratio under attack / at rest
(the target is under 2x), and the attackers' calls per second and how they were answered.
The attackers run on the same machine: on 2 cores their own CPU (and the bytes they send)
weighs on the victim too.

``--attack tokens``: the attackers instead loop ListMembers with junk JWTs (well formed, the
signature wrong), all from one address (issue 27: 1.4k/s took a new relay call's p50 from 3.6
to 38 ms, and the HTTP port's from 7 to 29 ms). Besides the SDK round trip, it prints the p50
of a new relay call (ListMembers with the victim's valid token: each call's token is checked)
and of the HTTP port's ``GET /v1/accounts/me``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http,
# which is why the imports below come after this (E402).
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import base64
import collections
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import grpc

from static._native.mls import Engine
from tests.relay._generated import relay_pb2 as pb
from tests.support.api import Api
from tests.support.server import ServerProcess

SERVICE = "/static.relay.v1.Relay/"
PAYLOAD = b"x" * 1024
#: The largest request the relay reads whole (its group state limit): the issue's 6,472 copies
#: of one leaf made 1 MiB; ours (the SDK's leaf) are a little larger, so fewer fit.
TREE_BYTES = 1024 * 1024 - 8


def _varint(n: int) -> bytes:
    """MLS's variable-length integer (RFC 9420 §2.1.2): a vector's length."""
    if n < 1 << 6:
        return bytes([n])
    if n < 1 << 14:
        return (n | 0x4000).to_bytes(2, "big")
    return (n | 0x8000_0000).to_bytes(4, "big")


def _read_varint(data: bytes) -> tuple[int, int]:
    """A varint's value and its length in bytes."""
    prefix = data[0] >> 6
    size = 1 << prefix
    value = int.from_bytes(data[:size], "big") & ((1 << (8 * size - 2)) - 1)
    return value, size


def crowded(tree: bytes, copies: int) -> bytes:
    """A one-leaf TLS ratchet tree with its leaf ``copies`` times (0: as many as fit in 1 MiB),
    a blank parent between each two."""
    length, at = _read_varint(tree)
    leaf = tree[at : at + length]
    if copies == 0:
        copies = TREE_BYTES // (len(leaf) + 1)
    nodes = b"\x00".join([leaf] * copies)
    return _varint(len(nodes)) + nodes


def _create_request(channel: str, account: str, copies: int) -> Any:
    """A CreateChannelRequest for ``channel`` from a real MLS group, its leaf bound to
    ``account``, its tree crowded to ``copies`` leaves (1: the real one)."""
    with tempfile.TemporaryDirectory(prefix="bench-attack-") as directory:
        engine = Engine(directory, b"attacker")
        try:
            engine.create_group(channel)
            group_info, tree = engine.public_state(channel)
            leaf, signature = engine.leaf_binding(channel, account)
        finally:
            engine.close()
    return pb.CreateChannelRequest(
        channel=channel,
        group_info=group_info,
        ratchet_tree=tree if copies == 1 else crowded(tree, copies),
        binding=pb.LeafBinding(leaf_index=leaf, signature=signature),
    )


def _create_stub(relay_url: str, *, raw: bool = False) -> Any:
    """CreateChannel on ``relay_url``; ``raw``: requests are already serialized."""
    target = relay_url.split("://", 1)[-1]
    channel = grpc.insecure_channel(
        target,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_send_message_length", 4 * 1024 * 1024),
        ],
    )
    return channel.unary_unary(
        SERVICE + "CreateChannel",
        request_serializer=None if raw else pb.CreateChannelRequest.SerializeToString,
        response_deserializer=pb.CreateChannelResponse.FromString,
    )


def junk_token() -> str:
    """A well-formed HS256 JWT whose signature is wrong: refused by the server's verifier."""

    def part(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = part(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    claims = {"sub": "acct_junk", "kid": "key_junk", "exp": int(time.time()) + 3600}
    return f"{header}.{part(json.dumps(claims).encode())}.{part(os.urandom(32))}"


def token_attacker(relay_url: str, _token: str, _request: bytes, stop: Any, out: Any) -> None:
    """Attacker process body: ListMembers with a fresh junk JWT in a loop until ``stop``."""
    target = relay_url.split("://", 1)[-1]
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    call = channel.unary_unary(
        SERVICE + "ListMembers",
        request_serializer=pb.ListMembersRequest.SerializeToString,
        response_deserializer=pb.ListMembersResponse.FromString,
    )
    request = pb.ListMembersRequest(channel="attackorg/flood/c")
    codes: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    while not stop.is_set():
        try:
            call(request, metadata=[("authorization", f"Bearer {junk_token()}")], timeout=30)
            codes["OK"] += 1
        except grpc.RpcError as error:
            codes[error.code().name] += 1
    out.put((dict(codes), time.monotonic() - started))


def attacker(relay_url: str, token: str, request: bytes, stop: Any, out: Any) -> None:
    """Attacker process body: CreateChannel (``request``, serialized) in a loop until ``stop``;
    reports its answers."""
    create = _create_stub(relay_url, raw=True)
    metadata = [("authorization", f"Bearer {token}")]
    codes: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    while not stop.is_set():
        try:
            create(request, metadata=metadata, timeout=30)
            codes["OK"] += 1
        except grpc.RpcError as error:
            codes[error.code().name] += 1
    out.put((dict(codes), time.monotonic() - started))


def round_trips(channel: Any, count: int) -> list[float]:
    """``count`` sends, one at a time, 2 ms apart: each one's time in ms."""
    spans = []
    for _ in range(count):
        began = time.perf_counter()
        channel.send(PAYLOAD)
        spans.append((time.perf_counter() - began) * 1000)
        time.sleep(0.002)
    return spans


def new_calls(relay_url: str, token: str, channel_name: str, count: int) -> list[float]:
    """``count`` ListMembers calls with a valid token, 2 ms apart: each one's time in ms."""
    target = relay_url.split("://", 1)[-1]
    channel = grpc.insecure_channel(target)
    call = channel.unary_unary(
        SERVICE + "ListMembers",
        request_serializer=pb.ListMembersRequest.SerializeToString,
        response_deserializer=pb.ListMembersResponse.FromString,
    )
    request = pb.ListMembersRequest(channel=channel_name)
    metadata = [("authorization", f"Bearer {token}")]
    spans = []
    try:
        for _ in range(count):
            began = time.perf_counter()
            call(request, metadata=metadata, timeout=30)
            spans.append((time.perf_counter() - began) * 1000)
            time.sleep(0.002)
    finally:
        channel.close()
    return spans


def http_calls(api: Api, key: str, count: int) -> list[float]:
    """``count`` ``GET /v1/accounts/me``, 2 ms apart: each one's time in ms."""
    spans = []
    for _ in range(count):
        began = time.perf_counter()
        api.me(key).raise_for_status()
        spans.append((time.perf_counter() - began) * 1000)
        time.sleep(0.002)
    return spans


def _p50_p99(spans: list[float]) -> tuple[float, float]:
    ordered = sorted(spans)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def measure(args: argparse.Namespace, tmp: str) -> dict[str, tuple[float, float]]:
    from static_sdk import StaticClient

    server = ServerProcess(Path(tmp) / "server", None, extra_args=[]).start()
    figures: dict[str, tuple[float, float]] = {}
    try:
        api = Api(server.http_url)
        victim, attack = api.signup(), api.signup()
        token = api.token(attack.key)
        # The attacker's own org, claimed by a real create: its flood is all under it.
        setup = _create_request("attackorg/setup/c", attack.id, 1)
        _create_stub(server.relay_url)(
            setup, metadata=[("authorization", f"Bearer {token}")], timeout=30
        )
        flood = _create_request("attackorg/flood/c", attack.id, args.copies)
        leaves = (len(flood.ratchet_tree) + 1) // (len(setup.ratchet_tree) - 1)
        print(f"attack request: {len(flood.ratchet_tree):,} bytes of tree, ~{leaves:,} leaves")
        with StaticClient(
            server.relay_url,
            f"{tmp}/victim",
            b"victim",
            api_key=victim.key,
            api_url=server.http_url,
        ) as client:
            channel = client.create_channel("victimorg/bench/rt")
            round_trips(channel, 50)  # warm-up
            victim_token = api.token(victim.key)

            def sample(label: str) -> None:
                figures[label] = _p50_p99(round_trips(channel, args.round_trips))
                if args.attack == "tokens":
                    figures[label + ", new call"] = _p50_p99(
                        new_calls(
                            server.relay_url,
                            victim_token,
                            "victimorg/bench/rt",
                            args.round_trips // 2,
                        )
                    )
                    figures[label + ", http"] = _p50_p99(
                        http_calls(api, victim.key, args.round_trips // 2)
                    )

            sample("at rest")
            ctx = mp.get_context("spawn")
            stop, out = ctx.Event(), ctx.Queue()
            procs = [
                ctx.Process(
                    target=token_attacker if args.attack == "tokens" else attacker,
                    args=(server.relay_url, token, flood.SerializeToString(), stop, out),
                )
                for _ in range(args.loops)
            ]
            for proc in procs:
                proc.start()
            time.sleep(2.0)  # the attack under way
            sample("under attack")
            stop.set()
            codes: collections.Counter[str] = collections.Counter()
            rate = 0.0
            for _ in procs:
                answered, seconds = out.get(timeout=120)
                codes.update(answered)
                rate += sum(answered.values()) / seconds
            for proc in procs:
                proc.join(timeout=60)
            print(f"attackers: {rate:,.0f} calls/s in all, answered {dict(codes)}")
            sample("at rest again")
        api.close()
    finally:
        server.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attack", choices=["create", "tokens"], default="create")
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--loops", type=int, default=2)
    parser.add_argument("--copies", type=int, default=0, help="leaves (0: fill 1 MiB)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    for run in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp:
            figures = measure(args, tmp)
        print(f"run {run + 1}: the victim's round trip (send, durable ack), new relay call and")
        print("HTTP call, ms; each against its own figure at rest")
        for label, (p50, p99) in figures.items():
            kind = label.partition(", ")[2]
            rest = figures["at rest" + (", " + kind if kind else "")][0]
            print(f"  {label:>24}: p50 {p50:7.2f}  p99 {p99:7.2f}  ({p50 / rest:.2f}x at rest)")


if __name__ == "__main__":
    main()

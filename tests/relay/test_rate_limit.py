"""The relay's publish rate limit within one PublishBatches request, on both store backends."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tests.relay import mls_vectors as mls
from tests.relay.client import Relay, pb
from tests.support.server import ServerProcess

CHANNEL = "acme/agents/chat"
Start = Callable[..., ServerProcess]

#: Tokens a second, and the burst: one comes back every 0.5 ms.
RATE = 2000
#: Items per request: the most a request may carry.
ITEMS = 1024
#: Enough to empty the bucket (``RATE`` items) twice over.
BATCHES = 6
#: Each item's padding: checking an item digests its message (the idempotency key), so a
#: request of ~2 MB (just under the transport limit) takes well over 0.5 ms to check, even on
#: a fast machine. Without the rule the bucket would refill meanwhile and let later items in.
PADDING = b"x" * 1900


def test_a_rate_limited_item_refuses_the_rest_of_its_request(start_server: Start) -> None:
    server = start_server("--allow-anonymous", "--relay-publish-rate", str(RATE))
    batches = [
        [
            pb.PublishRequest(
                channel=CHANNEL, message=mls.application(CHANNEL, 0, b"%d:%d:" % (b, i) + PADDING)
            )
            for i in range(ITEMS)
        ]
        for b in range(BATCHES)
    ]
    with Relay(server.relay_url) as relay:
        relay.create(CHANNEL)
        responses = relay.publish_batches(batches)
    assert len(responses) == BATCHES
    seqs: list[int] = []
    longest_refused_run = 0
    for b, response in enumerate(responses):
        kinds = [result.WhichOneof("outcome") for result in response.results]
        assert len(kinds) == ITEMS
        accepted = next((i for i, kind in enumerate(kinds) if kind != "accepted"), ITEMS)
        # Once an item is refused, every later item of its request is refused too.
        late = [i for i, kind in enumerate(kinds) if i > accepted and kind == "accepted"]
        assert not late, f"batch {b}: {len(late)} items accepted after item {accepted} was refused"
        seqs += [r.accepted.seq for r in response.results[:accepted]]
        for i, result in enumerate(response.results[accepted:], start=accepted):
            refusal = result.refused
            assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], (b, i, refusal)
            assert refusal.message == f"publish rate limit of {RATE} messages/s per agent exceeded"
            assert refusal.retry_after_ms > 0, (b, i, refusal)
        longest_refused_run = max(longest_refused_run, ITEMS - accepted)
    # The accepted items are each request's prefix, appended in order without gaps.
    assert seqs == list(range(1, len(seqs) + 1))
    # The case was met: many items checked after a refusal (the bucket refilling meanwhile).
    assert longest_refused_run >= ITEMS // 2, longest_refused_run

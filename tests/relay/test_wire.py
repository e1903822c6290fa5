"""The relay's hand-encoded answers are exactly what the generated protobuf classes produce."""

from __future__ import annotations

import pytest

from static.relay import _wire
from tests.relay.client import pb

VALUES = [0, 1, 127, 128, 300, 2**32, 2**64 - 1]


@pytest.mark.parametrize("value", VALUES)
def test_entries_and_single_entries(value: int) -> None:
    message = b"m" * (value % 3000)
    entry = pb.Entry(seq=value, epoch=value // 2, content_type=3, message=message)
    field = _wire.entry_field(value, value // 2, 3, message)
    assert field == pb.SubscribeResponse(entry=entry).SerializeToString()
    other = _wire.entry_field(1, 0, 1, b"x")
    assert (
        _wire.entries_response([field, other])
        == pb.SubscribeResponse(
            entries=pb.Entries(entries=[entry, pb.Entry(seq=1, content_type=1, message=b"x")])
        ).SerializeToString()
    )


@pytest.mark.parametrize("value", VALUES)
def test_publish_responses_and_batch_results(value: int) -> None:
    for duplicate in (False, True):
        response = pb.PublishResponse(seq=value, epoch=value // 3, duplicate=duplicate)
        encoded = _wire.publish_response(value, value // 3, duplicate)
        assert encoded == response.SerializeToString()
        refused = pb.PublishResult(refused=pb.Refusal(code=9, message="stale", current_epoch=4))
        assert (
            _wire.publish_results(
                [_wire.accepted_result(encoded), refused.SerializeToString(), b""]
            )
            == pb.PublishBatchResponse(
                results=[pb.PublishResult(accepted=response), refused, pb.PublishResult()]
            ).SerializeToString()
        )

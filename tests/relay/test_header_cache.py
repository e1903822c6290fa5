"""The relay's HPACK decoder and encoder that remember repeated all-indexed header blocks work
exactly as hpack's own, whatever the blocks change in the dynamic table in between."""

from __future__ import annotations

import random
from typing import Any

import hpack
import pytest

from static.relay._transport import _CachingDecoder, _CachingEncoder


def test_caching_decoder_decodes_as_hpack_does() -> None:
    rng = random.Random(7)
    encoder = hpack.Encoder()
    encoder.header_table_size = 256  # small: entries get evicted, indexes move
    plain = hpack.Decoder()
    plain.max_allowed_table_size = 4096
    caching = _CachingDecoder(plain.max_header_list_size, plain.max_allowed_table_size)
    hits = 0
    for _ in range(2000):
        headers = [
            (":method", "POST"),
            (":path", f"/static.relay.v1.Relay/{rng.choice(['Publish', 'Subscribe'])}"),
            ("content-type", "application/grpc"),
            ("x-agent", f"agent-{rng.randrange(12)}"),
        ]
        if rng.random() < 0.2:
            encoder.header_table_size = rng.choice([128, 256, 4096])
        block = encoder.encode(headers)
        hits += not block.translate(None, bytes(range(0x81, 0xFF)))
        expected = plain.decode(block, raw=True)
        assert caching.decode(block, raw=True) == expected
        assert caching.header_table_size == plain.header_table_size
        entries = caching.header_table.dynamic_entries
        assert list(entries) == list(plain.header_table.dynamic_entries)
    assert hits > 200  # the cached path was exercised


def test_caching_decoder_keeps_hpack_limits() -> None:
    encoder = hpack.Encoder()
    block = encoder.encode([("x-big", "v" * 100)])
    again = encoder.encode([("x-big", "v" * 100)])  # one indexed byte now
    caching = _CachingDecoder(1000, 4096)
    assert caching.decode(block, raw=True) == caching.decode(again, raw=True)
    caching.max_header_list_size = 50
    with pytest.raises(hpack.OversizedHeaderListError):
        caching.decode(again, raw=True)


def test_caching_encoder_encodes_as_hpack_does() -> None:
    rng = random.Random(11)
    plain = hpack.Encoder()
    caching = _CachingEncoder()
    decoder = hpack.Decoder()
    hits = 0
    for _ in range(2000):
        headers: list[Any] = [(":status", "200"), ("content-type", "application/grpc+proto")]
        if rng.random() < 0.5:
            headers = [("grpc-status", str(rng.randrange(3)))]
        if rng.random() < 0.1:
            headers.append(hpack.NeverIndexedHeaderTuple("x-secret", f"s{rng.randrange(3)}"))
        if rng.random() < 0.1:
            headers.append(("x-agent", f"agent-{rng.randrange(50)}"))
        if rng.random() < 0.05:
            size = rng.choice([64, 256, 4096])
            plain.header_table_size = size
            caching.header_table_size = size
        expected = plain.encode(iter(headers))
        block = caching.encode(iter(headers))
        assert block == expected
        hits += not block.translate(None, bytes(range(0x81, 0xFF)))
        assert [tuple(h) for h in decoder.decode(block)] == [tuple(h) for h in headers]
    assert hits > 200

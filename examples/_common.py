"""Command-line options shared by the examples (not part of the SDK)."""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Options:
    relay: str
    api_url: str | None
    api_key: str | None
    data_dir: Path
    channel: str
    rounds: int


def parse(description: str) -> Options:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--relay",
        default=os.environ.get("STATIC_RELAY_URL", "grpc://127.0.0.1:50051"),
        help="the relay's URL as printed by `static serve` [STATIC_RELAY_URL]",
    )
    parser.add_argument(
        "--api-url",
        default=os.environ.get("STATIC_API_URL", "http://127.0.0.1:8080"),
        help="the HTTP API's URL, used with an API key [STATIC_API_URL]",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the agents keep their MLS state (default: a temporary directory)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="question/answer rounds")
    args = parser.parse_args()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="static-example-"))
    api_key = os.environ.get("STATIC_API_KEY") or None
    return Options(
        relay=args.relay,
        api_url=args.api_url if api_key else None,
        api_key=api_key,
        data_dir=data_dir,
        # Channel names are global (one channel per name, whichever account), and a name's org
        # belongs to the account that first created a channel under it: a fresh name per run.
        channel=f"example/agents/run-{uuid.uuid4().hex[:8]}",
        rounds=args.rounds,
    )

"""The relay: Static's MLS delivery service (docs/design.md §5).

The protocol is ``proto/relay.proto``; :func:`serve_relay` runs it in the ``static serve`` nursery:
the Rust relay (``static._native.relay.RelayServer``), on SQLite and PostgreSQL alike.
"""

from static.relay._handle import RelayHandle
from static.relay._serve import serve_relay

__all__ = ["RelayHandle", "serve_relay"]

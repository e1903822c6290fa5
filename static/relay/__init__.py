"""The relay: Static's MLS delivery service (DESIGN §5), a purerpc gRPC server.

The protocol is ``proto/relay.proto``; :func:`serve_relay` runs it in the ``static serve`` nursery.
"""

from static.relay._serve import serve_relay

__all__ = ["serve_relay"]

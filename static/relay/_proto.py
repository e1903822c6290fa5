"""The relay protocol's protobuf messages (``static.relay.v1``), built at import from the
descriptor the native extension was compiled with: ``proto/relay.proto`` is compiled once, by
the Rust build, and nothing generated has to be shipped or produced at setup."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from static import _native

__all__ = [
    "CreateChannelRequest",
    "CreateChannelResponse",
    "Entries",
    "Entry",
    "FetchWelcomeRequest",
    "FetchWelcomeResponse",
    "KeepAlive",
    "PublishBatchRequest",
    "PublishBatchResponse",
    "PublishRequest",
    "PublishResponse",
    "PublishResult",
    "Refusal",
    "SubscribeRequest",
    "SubscribeResponse",
]

_PACKAGE = "static.relay.v1"


def _message_classes() -> dict[str, Any]:
    files = descriptor_pb2.FileDescriptorSet.FromString(_native.RELAY_PROTO_DESCRIPTOR).file
    # A pool of our own: the default one may hold the same file from generated stubs.
    pool = descriptor_pool.DescriptorPool()
    for file in files:
        pool.Add(file)
    classes = message_factory.GetMessageClassesForFiles([f.name for f in files], pool)
    return {
        name.removeprefix(_PACKAGE + "."): cls
        for name, cls in classes.items()
        if name.startswith(_PACKAGE + ".")
    }


_CLASSES = _message_classes()

CreateChannelRequest: Any = _CLASSES["CreateChannelRequest"]
CreateChannelResponse: Any = _CLASSES["CreateChannelResponse"]
Entries: Any = _CLASSES["Entries"]
Entry: Any = _CLASSES["Entry"]
FetchWelcomeRequest: Any = _CLASSES["FetchWelcomeRequest"]
FetchWelcomeResponse: Any = _CLASSES["FetchWelcomeResponse"]
KeepAlive: Any = _CLASSES["KeepAlive"]
PublishBatchRequest: Any = _CLASSES["PublishBatchRequest"]
PublishBatchResponse: Any = _CLASSES["PublishBatchResponse"]
PublishRequest: Any = _CLASSES["PublishRequest"]
PublishResponse: Any = _CLASSES["PublishResponse"]
PublishResult: Any = _CLASSES["PublishResult"]
Refusal: Any = _CLASSES["Refusal"]
SubscribeRequest: Any = _CLASSES["SubscribeRequest"]
SubscribeResponse: Any = _CLASSES["SubscribeResponse"]

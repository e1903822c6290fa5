"""The client error hierarchy and the channel-name rule (docs/sdk.md, Errors)."""

import pytest

import static_sdk
from static._channel_name import validate_channel_name
from static._errors import (
    AuthError,
    InternalError,
    InvalidChannelNameError,
    MLSEngineError,
    StaticError,
    TransportError,
)

PREFIXES = {
    MLSEngineError: "MLS engine error:",
    TransportError: "transport error:",
    InvalidChannelNameError: "invalid channel name:",
    AuthError: "auth error:",
    InternalError: "runtime error:",
}


@pytest.mark.parametrize(("cls", "prefix"), PREFIXES.items())
def test_every_error_is_a_runtime_error_with_its_prefix(
    cls: type[StaticError], prefix: str
) -> None:
    err = cls("something broke")
    assert isinstance(err, RuntimeError)
    assert str(err) == f"{prefix} something broke"
    assert err.detail == "something broke"
    # Re-raising with an already-prefixed message keeps one prefix.
    assert str(cls(str(err))) == str(err)


def test_sdk_exports_the_error_classes() -> None:
    for cls in PREFIXES:
        assert getattr(static_sdk, cls.__name__) is cls


@pytest.mark.parametrize(
    "name", ["acme/agents/planner", "a/b/c", "Org-1/ns.v2/svc_x", "0/1/2", "a" * 63 + "/b/c"]
)
def test_valid_channel_names(name: str) -> None:
    assert validate_channel_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a/b",
        "a/b/c/d",
        "/b/c",
        "a//c",
        "a/b/",
        "a b/c/d",
        "a/b/c\n",
        ".hidden/b/c",
        "a" * 64 + "/b/c",
        "é/b/c",
        "a/b/c/",
    ],
)
def test_invalid_channel_names_name_the_value_and_the_form(name: str) -> None:
    with pytest.raises(InvalidChannelNameError) as info:
        validate_channel_name(name)
    message = str(info.value)
    assert message.startswith("invalid channel name: ")
    assert repr(name) in message
    assert "org/namespace/service" in message


@pytest.mark.parametrize("value", [None, b"a/b/c", 3])
def test_non_string_channel_names(value: object) -> None:
    with pytest.raises(InvalidChannelNameError, match="org/namespace/service"):
        validate_channel_name(value)


def test_native_extension_loads() -> None:
    from static import _native

    assert _native.__version__ == "0.1.0"

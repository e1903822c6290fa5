"""Channel names: ``org/namespace/service``. One rule, the MLS crate's (``static-mls``), shared by
the SDK and the relay through the native extension."""

from typing import Final

from static._errors import InvalidChannelNameError
from static._native import mls

__all__ = ["MAX_CHANNEL_NAME_LENGTH", "validate_channel_name"]

MAX_CHANNEL_NAME_LENGTH: Final[int] = mls.MAX_CHANNEL_NAME_LENGTH


def validate_channel_name(name: object) -> str:
    """Return ``name`` if it is a valid channel name, else raise :class:`InvalidChannelNameError`.

    The message names the offending value and the expected form.
    """
    if not isinstance(name, str):
        raise InvalidChannelNameError(f"{name!r} is not a string; {mls.CHANNEL_NAME_FORM}")
    mls.validate_channel_name(name)
    return name

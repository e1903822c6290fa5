"""Channel names: ``org/namespace/service``. One rule, shared by the SDK and the relay."""

import re

from static._errors import InvalidChannelNameError

__all__ = ["MAX_CHANNEL_NAME_LENGTH", "validate_channel_name"]

MAX_CHANNEL_NAME_LENGTH = 191
_COMPONENT = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}"
_NAME = re.compile(rf"{_COMPONENT}/{_COMPONENT}/{_COMPONENT}")
_EXPECTED = (
    "expected the form 'org/namespace/service': three non-empty components separated by '/', "
    "each 1-63 characters of letters, digits, '_', '.', '-', starting with a letter or digit"
)


def validate_channel_name(name: object) -> str:
    """Return ``name`` if it is a valid channel name, else raise :class:`InvalidChannelNameError`.

    The message names the offending value and the expected form.
    """
    if not isinstance(name, str):
        raise InvalidChannelNameError(f"{name!r} is not a string; {_EXPECTED}")
    if len(name) > MAX_CHANNEL_NAME_LENGTH or _NAME.fullmatch(name) is None:
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidChannelNameError(f"{shown!r}; {_EXPECTED}")
    return name

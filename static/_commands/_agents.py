"""``static agent``, ``static channel``, ``static invitations``: an agent (``--as NAME``, its
MLS state in ``$XDG_DATA_HOME/static/agents/NAME/``) and its channels, through the SDK."""

from __future__ import annotations

import argparse
import base64
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from static._commands._common import IntermixedParser, Subparsers, add_command
from static._commands._config import safe_name, settings, xdg_dir
from static._commands._errors import CommandError
from static._commands._output import emit, printable, table, when
from static.sdk import (
    MAX_PAYLOAD,
    Address,
    Channel,
    Invitation,
    Message,
    StaticClient,
    StaticError,
)

__all__ = ["agent_dir", "register"]

#: Default bound of every command that waits (seconds).
DEFAULT_TIMEOUT: Final = 30.0
#: ``invitations`` without ``--count`` lists what is pending: it stops once none has come for
#: this long (the relay answers a first poll at once when some are pending).
QUIET: Final = 2.0


def agent_dir(identity: str) -> Path:
    """Where agent ``identity`` keeps its MLS state."""
    return xdg_dir("XDG_DATA_HOME", ".local/share") / "static" / "agents" / identity


def _agent_flags(parser: argparse.ArgumentParser, *, waits: bool = False) -> None:
    parser.add_argument(
        "--as",
        dest="identity",
        required=True,
        metavar="NAME",
        help="the agent: its identity (these bytes, in MLS) and its state in "
        "$XDG_DATA_HOME/static/agents/NAME/",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="the longest this command waits"
        + (" for what it waits for" if waits else " for the relay")
        + " (default %(default)g)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError("must be above 0 and at most 86400 seconds")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError("must be between 1 and 1000000")
    return value


def register(subparsers: Subparsers) -> None:
    agent = add_command(
        subparsers,
        "agent",
        "this machine's agents",
        ["static agent address --as bob"],
    )
    agents = agent.add_subparsers(dest="agent_command", required=True, metavar="COMMAND")
    address = add_command(
        agents,
        "address",
        "print the agent's address, and make it invitable",
        [
            "static agent address --as bob",
            "static agent address --as bob --allow 0b6c4a52-4f4e-4f7e-9a2b-3c1d2e3f4a5b",
        ],
        _address,
        description="Print the agent's address (static:<account>:<identity>), what another "
        "agent passes to 'static channel invite'. It also lists the agent's key packages in "
        "the relay's directory, so that it can be invited from now on: by agents of its own "
        "account, and of the accounts given with --allow.",
    )
    _agent_flags(address)
    address.add_argument(
        "--allow",
        nargs="+",
        metavar="ACCOUNT",
        help="also accept invitations from agents of these accounts ('*': any); replaces "
        "the list given before",
    )

    channel = add_command(
        subparsers,
        "channel",
        "create, invite to, send on, listen to and leave channels",
        [
            "static channel create acme/demo/chat --as alice",
            "static channel send acme/demo/chat 'hello' --as alice",
        ],
    )
    channels = channel.add_subparsers(
        dest="channel_command", required=True, metavar="COMMAND", parser_class=IntermixedParser
    )
    create = add_command(
        channels,
        "create",
        "create a channel, the agent its first member",
        ["static channel create acme/demo/chat --as alice"],
        _create,
    )
    _agent_flags(create)
    create.add_argument("name", metavar="NAME", help="org/namespace/service")
    invite = add_command(
        channels,
        "invite",
        "invite an agent by its address",
        ["static channel invite acme/demo/chat static:0b6c4a52-...:Ym9i --as alice"],
        _invite,
    )
    _agent_flags(invite)
    invite.add_argument("name", metavar="NAME")
    invite.add_argument("address", metavar="ADDRESS", help="as 'static agent address' prints it")
    send = add_command(
        channels,
        "send",
        "send a message",
        [
            "static channel send acme/demo/chat 'hello bob' --as alice",
            "echo hello | static channel send acme/demo/chat --as alice",
        ],
        _send,
    )
    _agent_flags(send)
    send.add_argument("name", metavar="NAME")
    send.add_argument(
        "text",
        nargs="?",
        default="-",
        metavar="TEXT",
        help="the message; '-' or absent: stdin (one trailing newline dropped)",
    )
    listen = add_command(
        channels,
        "listen",
        "print the messages others send, one line each",
        [
            "static channel listen acme/demo/chat --as bob --count 1 --timeout 60",
            "static channel listen acme/demo/chat --as bob --json",
        ],
        _listen,
        description="Print each message other members send, with its sender, one line each "
        "(--json: one JSON object per line). Ends after --count messages (an error if fewer "
        "came within --timeout), or without --count at --timeout (an error if none came).",
    )
    _agent_flags(listen, waits=True)
    listen.add_argument("name", metavar="NAME")
    listen.add_argument("--count", type=_count, metavar="N", help="stop after N messages")
    members = add_command(
        channels,
        "members",
        "the channel's members as the relay attests them",
        ["static channel members acme/demo/chat --as alice"],
        _members,
    )
    _agent_flags(members)
    members.add_argument("name", metavar="NAME")
    leave = add_command(
        channels,
        "leave",
        "leave the channel (another member's client must be running to commit it)",
        ["static channel leave acme/demo/chat --as bob"],
        _leave,
    )
    _agent_flags(leave)
    leave.add_argument("name", metavar="NAME")

    invitations = add_command(
        subparsers,
        "invitations",
        "the invitations waiting for the agent; --accept joins their channels",
        ["static invitations --as bob", "static invitations --as bob --accept --count 1"],
        _invitations,
        description="List the invitations the relay holds for the agent (with --accept, "
        "accept them and print the channels joined). Without --count it stops once none has "
        f"come for {QUIET:g} s; with --count N it waits for N (an error if fewer came within "
        "--timeout).",
    )
    _agent_flags(invitations, waits=True)
    invitations.add_argument("--accept", action="store_true", help="join their channels")
    invitations.add_argument("--count", type=_count, metavar="N", help="wait for N invitations")


@contextlib.contextmanager
def _client(args: argparse.Namespace) -> Iterator[StaticClient]:
    """The agent's client, closed at the end whatever happens; SDK errors as one line."""
    identity = safe_name("agent", args.identity)
    config = settings(args)
    relay = config.need_relay_url()
    key = config.key()
    api_url = config.need_api_url() if key is not None else config.api_url
    directory = agent_dir(identity)
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        client = StaticClient(
            relay,
            directory,
            identity.encode(),
            key,
            api_url if key is not None else None,
            retry_timeout=args.timeout,
            ca_file=config.ca_file,
        )
    except StaticError as exc:
        raise CommandError(_said(exc, key)) from None
    try:
        yield client
    except StaticError as exc:
        raise CommandError(_said(exc, key)) from None
    except (ValueError, TimeoutError, EOFError) as exc:
        raise CommandError(str(exc)) from None
    finally:
        client.close()


def _said(exc: StaticError, key: str | None) -> str:
    text = str(exc)
    return text.replace(key, "<api key>") if key else text


def _open(client: StaticClient, name: str) -> Channel:
    if name not in client.channels():
        raise CommandError(
            f"agent {client.identity.decode()!r} is not a member of {name!r} here "
            "(static channel create, or static invitations --accept)"
        )
    return client.open_channel(name)


def _address(args: argparse.Namespace) -> None:
    with _client(args) as client:
        if args.allow:
            client.allow_invitations(args.allow)
        else:
            client.invitations()  # lists the key packages before it returns
        address = client.address
    if args.json:
        emit(
            {"agent": args.identity, "address": address, "data_dir": str(agent_dir(args.identity))}
        )
    else:
        print(address)


def _create(args: argparse.Namespace) -> None:
    with _client(args) as client:
        client.create_channel(args.name).close()
    if args.json:
        emit({"channel": args.name, "created": True})
    else:
        print(f"created channel {args.name}")


def _invite(args: argparse.Namespace) -> None:
    try:
        address = Address.parse(args.address)
    except ValueError:
        raise CommandError(
            f"{printable(args.address[:200])!r} is not an address (static agent address prints one)"
        ) from None
    with _client(args) as client:
        _open(client, args.name).invite(address)
    if args.json:
        emit({"channel": args.name, "invited": str(address)})
    else:
        print(f"invited {address} to {args.name}")


def _payload(text: str) -> bytes:
    if text != "-":
        payload = text.encode()
    else:
        payload = sys.stdin.buffer.read(MAX_PAYLOAD + 2)
        payload = payload.removesuffix(b"\n")
    if len(payload) > MAX_PAYLOAD:
        raise CommandError(f"the message is larger than {MAX_PAYLOAD} bytes")
    return payload


def _send(args: argparse.Namespace) -> None:
    payload = _payload(args.text)
    with _client(args) as client:
        _open(client, args.name).send(payload)
    if args.json:
        emit({"channel": args.name, "sent": len(payload)})
    else:
        print(f"sent {len(payload)} bytes to {args.name}")


def _message_json(channel: str, message: Message) -> dict[str, object]:
    try:
        text: str | None = message.payload.decode()
    except UnicodeDecodeError:
        text = None
    return {
        "channel": channel,
        "sender": message.sender.decode("utf-8", errors="backslashreplace"),
        "account": message.account,
        "seq": message.seq,
        "epoch": message.epoch,
        "text": text,
        "payload_base64": base64.b64encode(message.payload).decode(),
    }


def _listen(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.timeout
    got = 0
    with _client(args) as client:
        channel = _open(client, args.name)
        while args.count is None or got < args.count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                message = channel.receive_message(left)
            except TimeoutError:
                break
            got += 1
            if args.json:
                emit(_message_json(args.name, message))
            else:
                print(f"{printable(message.sender)}: {printable(message.payload)}", flush=True)
    if got == 0 or (args.count is not None and got < args.count):
        wanted = f"{args.count} messages" if args.count is not None else "a message"
        raise CommandError(
            f"no message on {args.name} within {args.timeout:g} s"
            if got == 0
            else f"{got} of {wanted} on {args.name} within {args.timeout:g} s"
        )


def _members(args: argparse.Namespace) -> None:
    with _client(args) as client:
        roster = _open(client, args.name).roster()
    if args.json:
        emit(
            {
                "channel": args.name,
                "members": [
                    {
                        "identity": m.identity.decode("utf-8", errors="backslashreplace"),
                        "account": m.account,
                        "leaf": m.leaf_index,
                    }
                    for m in roster
                ],
            }
        )
        return
    table(
        ["IDENTITY", "ACCOUNT", "LEAF"],
        [
            [
                m.identity.decode("utf-8", errors="backslashreplace"),
                m.account if m.account is not None else "(not joined yet)",
                m.leaf_index,
            ]
            for m in roster
        ],
    )


def _leave(args: argparse.Namespace) -> None:
    with _client(args) as client:
        _open(client, args.name).leave()
    if args.json:
        emit({"channel": args.name, "left": True})
    else:
        print(f"left {args.name}")


def _invitations(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.timeout
    taken: list[Invitation[Channel]] = []
    joined: list[str] = []
    with _client(args) as client:
        pending = client.invitations()  # also lists our key packages: we can be invited
        found: queue.Queue[Invitation[Channel] | BaseException] = queue.Queue()

        def pump() -> None:
            # The iterator has no timeout of its own: it runs here, and ends when the
            # client is closed (at the end of this command, whatever happens).
            try:
                for invitation in pending:
                    found.put(invitation)
            except BaseException as exc:  # noqa: BLE001 - handed to the command's thread
                found.put(exc)

        thread = threading.Thread(target=pump, name="static invitations", daemon=True)
        thread.start()
        try:
            while args.count is None or len(taken) < args.count:
                left = deadline - time.monotonic()
                wait = left if args.count is not None else min(left, QUIET)
                if wait <= 0:
                    break
                try:
                    item = found.get(timeout=wait)
                except queue.Empty:
                    break
                if isinstance(item, BaseException):
                    raise item
                taken.append(item)
                if args.accept:
                    item.accept().close()
                    joined.append(item.channel)
                    _show_invitation(args, item, joined=True)
                else:
                    _show_invitation(args, item, joined=False)
        finally:
            client.close()
            thread.join(5)
    if not taken and not args.json and args.count is None:
        print("no invitations pending")
    if args.count is not None and len(taken) < args.count:
        raise CommandError(f"{len(taken)} of {args.count} invitations within {args.timeout:g} s")


def _show_invitation(
    args: argparse.Namespace, invitation: Invitation[Channel], *, joined: bool
) -> None:
    inviter = invitation.inviter.decode("utf-8", errors="backslashreplace")
    if args.json:
        emit(
            {
                "channel": invitation.channel,
                "inviter": inviter,
                "inviter_account": invitation.inviter_account,
                "id": invitation.id,
                "expires_at": invitation.expires_at,
                "accepted": joined,
            }
        )
    elif joined:
        print(
            f"joined {printable(invitation.channel)} (invited by {printable(inviter)} "
            f"of account {invitation.inviter_account})",
            flush=True,
        )
    else:
        print(
            f"{printable(invitation.channel)}  from {printable(inviter)} of account "
            f"{invitation.inviter_account}  expires {when(invitation.expires_at)}",
            flush=True,
        )

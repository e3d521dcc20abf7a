"""Wire format between trainers and the agent (version 3).

Every message is a 4-byte little-endian length followed by that many bytes of UTF-8
JSON (an object). Requests carry ``op``; replies carry ``ok`` and either the result
fields or ``error: {type, message}``. The reply to ``hello`` also carries the arena's
file descriptor (SCM_RIGHTS), and, to a ``hello`` with ``error_counts: true``, a second one:
the page of error counts (see error_counts.py), with ``error_slot``, the index of its
engine's 8-byte counter there. Messages that are not JSON objects (or nest deeper than
the JSON decoder can follow) are protocol errors: the agent answers with an error and
keeps serving. A length over MAX_MESSAGE is answered with an error too, and ends the
connection: the stream cannot be resynchronised. No reply exceeds MAX_MESSAGE either.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

VERSION = 3  # 3: the agent numbers commits (commit carries no seq; its reply does)
MAX_MESSAGE = 16 << 20
_LEN = struct.Struct("<I")


class ProtocolError(Exception):
    """A malformed or out-of-range message."""


class MessageTooLarge(ProtocolError):
    """A message over MAX_MESSAGE bytes. Raised before anything is sent; received, it
    leaves the rest of the stream unreadable."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def encode(message: dict[str, Any]) -> bytes:
    """The bytes of `message` on the wire; ProtocolError if it exceeds MAX_MESSAGE."""
    body = json.dumps(message).encode()
    if len(body) > MAX_MESSAGE:
        raise MessageTooLarge(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _LEN.pack(len(body)) + body


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = encode(message)
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv(sock: socket.socket, with_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, 4)
        if not head:
            raise ConnectionError("peer closed the connection")
        if len(head) < _LEN.size:
            head += _recv_exact(sock, _LEN.size - len(head))
    else:
        head = _recv_exact(sock, _LEN.size)
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise MessageTooLarge(f"message of {n} bytes exceeds {MAX_MESSAGE}")
    body = _recv_exact(sock, n)
    try:
        message = json.loads(body.decode("utf-8"))  # UTF-8 only (json.loads(bytes) takes UTF-16/32)
    except ValueError as e:  # UnicodeDecodeError included
        raise ProtocolError(f"message is not JSON: {e}") from None
    except RecursionError:  # the decoder recurses once per level of [ or {
        raise ProtocolError("message nests too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    return message, fds

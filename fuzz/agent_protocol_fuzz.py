"""libFuzzer target (atheris) for the node agent's control protocol.

Each input is the byte stream a trainer sends on one connection. It goes through the
real framing (``protocol.recv`` on one end of a socket pair) and the real request
dispatch of an in-process ``Agent`` (``Agent._serve``), with a temporary socket path and
store, a small memory budget and short timeouts. A finding is any of:

- an exception raised out of ``_serve`` (it must handle every request), or in any thread
  the agent starts;
- an error logged by the agent (it logs the exceptions a request raised that it did not
  expect, which it answers as an internal error);
- a reply that is not ``{"ok": true, ...}`` or an error naming one of nebulite's error
  types, or a reply the framing refuses (over ``MAX_MESSAGE``);
- a connection dropped before the end of the input: the agent answers every complete
  message, and only a length over ``MAX_MESSAGE`` (the stream cannot be resynchronised,
  answered with an error) or ``{"op": "bye"}`` ends it early.

Run it (``make fuzz`` does) as ``python fuzz/agent_protocol_fuzz.py [libFuzzer flags]
[corpus dirs]``, with nebulite installed; the seed corpus is fuzz/corpus/agent_protocol_fuzz.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time

import atheris

with atheris.instrument_imports(include=["nebulite.agent"]):
    from nebulite.agent import protocol, server

from nebulite import errors

_LEN = struct.Struct("<I")
_ERROR_TYPES = {name for name, cls in vars(errors).items()
                if isinstance(cls, type) and issubclass(cls, errors.NebuliteError)}
MEMORY = 4 << 20  # the agent's budget: small, so that inputs reach back-pressure and eviction
COMMIT_TIMEOUT = 1.0  # bounds how long a commit of a world of several ranks waits for the others


class _Findings(logging.Handler):
    """Errors the agent logged and exceptions its threads raised, for the current input."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.found.append(self.format(record))

    def thread_raised(self, args: threading.ExceptHookArgs) -> None:
        self.found.append(f"thread {args.thread.name if args.thread else '?'} raised "
                          f"{args.exc_type.__name__}: {args.exc_value}")


# A flush waits, up to the timeout the request names, for whatever the input asked to
# persist, which may never complete (say, a commit for a world of ranks that never come):
# here it waits no longer than such a commit does.
server._MAX_WAIT = COMMIT_TIMEOUT

_findings = _Findings()
logging.getLogger("nebulite.agent").addHandler(_findings)
logging.getLogger("nebulite.agent").setLevel(logging.WARNING)
threading.excepthook = _findings.thread_raised


def _expected_replies(data: bytes) -> int:
    """How many replies the agent owes for `data`, from the framing rules alone."""
    count, pos = 0, 0
    while pos + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if n > protocol.MAX_MESSAGE:
            return count + 1  # answered with an error, then the connection ends
        if pos + n > len(data):
            return count  # the input ends inside a message: nothing to answer
        body = data[pos:pos + n]
        pos += n
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            message = None
        if isinstance(message, dict) and message.get("op") == "bye":
            return count
        count += 1
    return count


def _read_replies(sock: socket.socket, replies: list, failures: list[str]) -> None:
    try:
        while True:
            reply, fds = protocol.recv(sock, with_fds=True)
            for fd in fds:
                os.close(fd)
            replies.append(reply)
    except ConnectionError:
        pass
    except (protocol.ProtocolError, OSError) as e:
        failures.append(f"reading the agent's replies: {type(e).__name__}: {e}")


def _write(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the agent hung up first (after a framing error): checked by the replies


def TestOneInput(data: bytes) -> None:
    _findings.found.clear()
    workdir = tempfile.mkdtemp(prefix="nbfz-")  # short: Unix socket paths are limited
    agent = server.Agent(os.path.join(workdir, "agent.sock"), os.path.join(workdir, "store"),
                         MEMORY, retention=2, commit_timeout=COMMIT_TIMEOUT, io_threads=1,
                         idle_exit=0, reserve_timeout=0.2)
    replies: list = []
    failures: list[str] = []
    try:
        trainer, end = socket.socketpair()
        with agent.lock:
            agent.clients += 1  # as serve_forever counts an accepted connection
        reader = threading.Thread(target=_read_replies, args=(trainer, replies, failures))
        writer = threading.Thread(target=_write, args=(trainer, data))
        reader.start()
        writer.start()
        agent._serve(end)  # an exception raised here is a finding
        writer.join()
        reader.join()
        trainer.close()
        deadline = time.monotonic() + COMMIT_TIMEOUT + 30
        while agent.cleanups and time.monotonic() < deadline:
            time.sleep(0.001)
        if agent.cleanups:
            failures.append("the clean-up after the connection did not finish")
    finally:
        agent.close()
        shutil.rmtree(workdir, ignore_errors=True)
    expected = _expected_replies(data)
    if len(replies) != expected:
        failures.append(f"{len(replies)} replies to {expected} messages: the agent dropped the "
                        "connection")
    for reply in replies:
        ok = reply.get("ok")
        error = reply.get("error")
        if not (ok is True or (ok is False and isinstance(error, dict)
                               and error.get("type") in _ERROR_TYPES
                               and isinstance(error.get("message"), str))):
            failures.append(f"malformed reply {reply!r:.300}")
    failures += _findings.found
    if failures:
        raise AssertionError("\n".join(failures))


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

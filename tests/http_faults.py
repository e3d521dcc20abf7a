"""A real HTTP reverse proxy that forwards to an emulator and injects faults.

    proxy = FaultProxy("http://127.0.0.1:PORT").start()
    proxy.fail_next(2, status=503, methods=("PUT",))   # the next 2 PUTs get a 503
    ...                                                # point a client at proxy.endpoint
    proxy.count                                        # requests forwarded upstream
    proxy.hold()                                       # requests wait here ...
    proxy.release()                                    # ... until this
    proxy.stop()

Thread-safety: every public method may be called from any thread while requests are in
flight; the rules and the counters are guarded by one lock. Each client connection is
served by its own thread with its own upstream connection, and bodies are streamed in
both directions in blocks (never held whole), so a multi-GiB upload costs a few MiB here.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from dataclasses import dataclass, field

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
}
_BLOCK = 1 << 20


@dataclass
class _Rule:
    remaining: int
    status: int
    methods: tuple[str, ...] | None
    path_contains: str | None
    retry_after: float | None
    reset: bool

    def matches(self, method: str, path: str) -> bool:
        return (
            self.remaining > 0
            and (self.methods is None or method in self.methods)
            and (self.path_contains is None or self.path_contains in path)
        )


@dataclass
class FaultProxy:
    upstream: str
    count: int = 0  #: requests forwarded upstream
    injected: int = 0  #: requests answered with an injected fault
    requests: list[tuple[str, str, int]] = field(default_factory=list)  #: (method, path, status)
    _rules: list[_Rule] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _open: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        u = urllib.parse.urlsplit(self.upstream)
        self._host, self._port = u.hostname or "127.0.0.1", u.port or 80
        self._server: http.server.ThreadingHTTPServer | None = None
        self._open.set()

    # --- control -------------------------------------------------------------------------
    def fail_next(
        self,
        n: int,
        status: int = 503,
        methods: tuple[str, ...] | None = None,
        path_contains: str | None = None,
        retry_after: float | None = 0,
    ) -> None:
        """Answers the next `n` matching requests with `status` (and a Retry-After header
        unless retry_after is None) without forwarding them."""
        with self._lock:
            self._rules.append(_Rule(n, status, methods, path_contains, retry_after, False))

    def fail_always(self, status: int = 503, methods: tuple[str, ...] | None = None) -> None:
        self.fail_next(1 << 62, status, methods)

    def reset_next(self, n: int, methods: tuple[str, ...] | None = None) -> None:
        """Closes the connection of the next `n` matching requests without an answer."""
        with self._lock:
            self._rules.append(_Rule(n, 0, methods, None, None, True))

    def hold(self) -> None:
        """Requests arriving from now on wait, unanswered, until release() (a store that
        hangs): whoever sends one waits too."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def reset_counters(self) -> None:
        with self._lock:
            self.count = self.injected = 0
            self.requests.clear()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- used by the handler -------------------------------------------------------------
    def _take_rule(self, method: str, path: str) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, path):
                    rule.remaining -= 1
                    self.injected += 1
                    return rule
            self.count += 1
            return None

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # Clients drop connections (on a timeout, an injected reset, at exit): not news.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass

    def _request_body_blocks(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            block = self.rfile.read(min(left, _BLOCK))
            if not block:
                raise ConnectionError("client closed mid-body")
            left -= len(block)
            yield block

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.owner._host, self.owner._port, timeout=600)
            self._conn = conn
        return conn

    def _handle(self) -> None:
        method, path = self.command, self.path
        self.owner._open.wait()
        rule = self.owner._take_rule(method, path)
        if rule is not None:
            for _ in self._request_body_blocks():
                pass
            if rule.reset:
                self.close_connection = True
                self.connection.shutdown(2)
                return
            # Recorded before the reply, so that it is there once the client has it (a
            # test counts the requests one call made).
            self.owner._record(method, path, rule.status)
            body = f"<Error><Code>Injected</Code><Message>{rule.status}</Message></Error>"
            self.send_response(rule.status)
            if rule.retry_after is not None:
                self.send_header("Retry-After", str(int(rule.retry_after)))
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body.encode())
            return

        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if chunked:  # re-sent with a length: no client here streams chunked uploads
            data = b"".join(self._request_body_blocks())
        for attempt in range(2):  # a kept-alive upstream connection may have gone stale
            conn = self._upstream()
            try:
                conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP_BY_HOP and not (chunked and k.lower() == "content-length"):
                        conn.putheader(k, v)
                if chunked:
                    conn.putheader("Content-Length", str(len(data)))
                conn.endheaders()
                if chunked:
                    conn.send(data)
                else:
                    for block in self._request_body_blocks():
                        conn.send(block)
                resp = conn.getresponse()
                break
            except (ConnectionError, http.client.RemoteDisconnected):
                conn.close()
                self._conn = None
                if attempt or method not in ("GET", "HEAD"):
                    raise
        self.owner._record(method, path, resp.status)  # before the reply, as a fault's
        self.send_response(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        body = None
        if length is None and method != "HEAD" and resp.status not in (204, 304):
            body = resp.read()  # upstream chunked: re-sent with a length
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP and not (body is not None and k.lower() == "content-length"):
                self.send_header(k, v)
        if body is not None:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body is not None:
            self.wfile.write(body)
        elif method != "HEAD":
            while True:
                block = resp.read(_BLOCK)
                if not block:
                    break
                self.wfile.write(block)
        resp.close()
        if resp.will_close:
            conn.close()
            self._conn = None

    def finish(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
        super().finish()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

"""A loopback S3 fault proxy: forwards every request to an S3 endpoint verbatim and, during an
outage, answers every request with S3's ``503 SlowDown`` instead.

    proxy = S3FaultProxy("http://127.0.0.1:8333").start()
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url})   # clients use the proxy
    proxy.outage(10.0)          # for the next 10 s every request is refused (503 SlowDown)
    proxy.counts()              # {"forwarded": …, "refused": …, "upstream_errors": …}
    proxy.stop()

The proxy listens on 127.0.0.1 only (a free port). A request is forwarded with its method, path,
query, headers and body unchanged, the ``Host`` header included: a client signs its requests
(SigV4) for the proxy's host, and the server checks the signature against the ``Host`` it
receives, so signatures verify through the proxy. A request whose upstream cannot be reached is
answered ``502`` and counted as an upstream error. Each request runs on its own thread
(``ThreadingHTTPServer``); a refused request's body is read before the answer, so a client's
kept-alive connection stays usable.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
_SLOW_DOWN = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
              "<Message>Please reduce your request rate.</Message><Resource>{resource}</Resource>"
              "<RequestId>{request_id}</RequestId></Error>")


class S3FaultProxy:
    """A threaded reverse proxy in front of the S3 endpoint ``upstream`` (module docstring).

    ``outage(seconds)`` opens a window in which every request is refused; windows are recorded
    (``outages``: ``(start, end)`` in ``time.monotonic()`` seconds), and so are the arrival times
    of the first request of each HTTP method (``first_request_at``) and of the last request
    (``last_request_at``). Counts are of requests:
    ``forwarded`` (an answer from the upstream, whatever its status), ``refused`` (503 in an
    outage) and ``upstream_errors`` (the upstream did not answer: 502)."""

    def __init__(self, upstream: str, *, upstream_timeout_s: float = 60.0):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"upstream {upstream!r} must be an http://host:port S3 endpoint (no path); "
                             "the proxy speaks plain HTTP on loopback")
        self.upstream = upstream
        self._host, self._port = parts.hostname, parts.port or 80
        self.upstream_timeout_s = upstream_timeout_s
        self.outages: list[tuple[float, float]] = []
        self._counts = {"forwarded": 0, "refused": 0, "upstream_errors": 0}
        self.first_request_at: dict[str, float] = {}  # HTTP method -> arrival of its first request
        self.last_request_at: float | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        assert self._server is not None, "start() the proxy first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> S3FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True, name="specray-s3-fault-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and close the socket; requests in flight finish on their daemon threads."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
        self._server = self._thread = None

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def outage(self, seconds: float) -> None:
        """Refuse every request from now for ``seconds`` (returns at once)."""
        if not seconds > 0:
            raise ValueError(f"an outage lasts > 0 seconds, got {seconds}")
        now = time.monotonic()
        with self._lock:
            self.outages.append((now, now + seconds))

    def in_outage(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return any(start <= now < end for start, end in self.outages)

    def _arrived(self, method: str) -> bool:
        """Record a request's arrival; whether it falls in an outage."""
        now = time.monotonic()
        with self._lock:
            self.first_request_at.setdefault(method, now)
            self.last_request_at = now
            return any(start <= now < end for start, end in self.outages)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that drops its kept-alive connection is routine; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """One client connection: each request forwarded to ``owner.upstream`` or refused."""

    owner: S3FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect; every answer carries its length

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's signature
        pass  # one line per request on stderr would drown a run's output

    def _handle(self) -> None:
        body = self._read_body()
        if self.owner._arrived(self.command):
            self.owner._count("refused")
            xml = _SLOW_DOWN.format(resource=self.path.split("?", 1)[0], request_id=uuid.uuid4().hex).encode()
            self._answer(503, [("Content-Type", "application/xml")], xml)
            return
        connection = http.client.HTTPConnection(self.owner._host, self.owner._port,
                                                timeout=self.owner.upstream_timeout_s)
        try:
            connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():  # Host included: the client signed it
                connection.putheader(name, value)
            connection.endheaders(body or None)
            response = connection.getresponse()
            data = response.read()
            headers = response.getheaders()
            status = response.status
        except OSError as e:
            self.owner._count("upstream_errors")
            self._answer(502, [("Content-Type", "text/plain")], f"upstream {self.owner.upstream}: {e}".encode())
            return
        finally:
            connection.close()
        self.owner._count("forwarded")
        self._answer(status, [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP], data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _read_body(self) -> bytes:
        """The request body as sent: ``Content-Length`` bytes, or the raw chunks of a chunked body
        (forwarded with its ``Transfer-Encoding`` header, so still chunked)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = bytearray()
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, up to the empty line
                        trailer = self.rfile.readline()
                        raw += trailer
                        if trailer in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                raw += self.rfile.read(size + 2)  # the chunk and its CRLF
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() != "content-length":
                self.send_header(name, value)
        # a HEAD answer's length is the object's (the upstream's header), not the empty body's
        length = next((v for k, v in headers if k.lower() == "content-length"), None) if self.command == "HEAD" else None
        self.send_header("Content-Length", length if length is not None else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

"""A loopback HTTP server for media-URL tests (nothing here reaches the network).

`MediaServer.serve(path, body)` publishes bytes; the fixed routes give every failure a fetch must bound:

* `/missing` -> 404;
* `/declared-huge` -> a `Content-Length` of 1 GB (the body never comes);
* `/endless` -> a body with no declared length that never ends (1 KB every millisecond while anyone reads);
* `/stall/KEY` -> headers, then nothing until `release(KEY)` (or 30 s pass), then 4 bytes that are no medium;
* `/trickle` -> one byte every 50 ms, for 30 s;
* `/redirect?to=URL` -> a 302 to URL; `/loop` -> a 302 to itself.

`requests` counts the requests per path, so a test can tell whether a URL was fetched at all.
"""

from __future__ import annotations

import collections
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class MediaServer:
    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, str]] = {}
        self.requests: collections.Counter = collections.Counter()
        self._stalls: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                owner._answer(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def serve(self, path: str, body: bytes, content_type: str = "application/octet-stream") -> str:
        self.files[path] = (body, content_type)
        return self.url(path)

    def release(self, key: str) -> None:
        self._stalls[key].set()

    def close(self) -> None:
        for stall in list(self._stalls.values()):
            stall.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        parsed = urlparse(h.path)
        self.requests[parsed.path] += 1
        try:
            if parsed.path in self.files:
                body, content_type = self.files[parsed.path]
                h.send_response(200)
                h.send_header("Content-Type", content_type)
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
            elif parsed.path == "/declared-huge":
                h.send_response(200)
                h.send_header("Content-Length", str(1 << 30))
                h.end_headers()
            elif parsed.path == "/endless":
                h.send_response(200)
                h.end_headers()  # HTTP/1.0: the body runs until the connection closes
                while True:
                    h.wfile.write(b"\0" * 1024)
                    time.sleep(0.001)
            elif parsed.path.startswith("/stall/"):
                h.send_response(200)
                h.send_header("Content-Length", "4")
                h.end_headers()
                h.wfile.flush()
                self._stalls[parsed.path.removeprefix("/stall/")].wait(30)
                h.wfile.write(b"late")
            elif parsed.path == "/trickle":
                h.send_response(200)
                h.end_headers()
                for _ in range(600):
                    h.wfile.write(b"x")
                    h.wfile.flush()
                    time.sleep(0.05)
            elif parsed.path == "/redirect":
                h.send_response(302)
                h.send_header("Location", parse_qs(parsed.query)["to"][0])
                h.end_headers()
            elif parsed.path == "/loop":
                h.send_response(302)
                h.send_header("Location", "/loop")
                h.end_headers()
            else:
                h.send_error(404)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up, as the fetch's bounds make it
            pass

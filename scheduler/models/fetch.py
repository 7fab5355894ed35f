"""Media at ``http(s)`` URLs: fetched under a policy, before any loader decodes them.

An image, video or audio clip may be given as an ``http://`` or ``https://`` URL (the reference, vllm-mlx,
takes image URLs; OpenAI clients send ``image_url`` parts with them). :func:`resolve` turns such an item into
its bytes, which the loaders in :mod:`scheduler.models.media` then decode like any other bytes; every other
item passes through unchanged. The engine calls it in ``VLMAdapter.prepare`` (on the thread that runs
``add_request``; ``AsyncEngine`` first, on its ``media_fetch_pool``), and the server in its message conversion
(on that same pool), with the same policy:
``EngineConfig.remote_media``, ``media_fetch_timeout_s``, ``media_fetch_max_bytes`` and
``allowed_media_domains`` (``Engine.media_fetch``).

What the policy bounds, since a URL is a request's input and may point anywhere:

* **time**: ``timeout_s`` bounds the connection and each wait for data; a deadline of the same length is also
  checked between reads, so a server that trickles bytes is cut off after at most about twice ``timeout_s``.
  Host names are looked up under that deadline too (``HostLookup``): ``socket.getaddrinfo`` takes no timeout
  and waits as long as the system's resolver retries (tens of seconds with a name server that does not answer),
  so a fetch would otherwise be held by DNS past every bound above;
* **size**: a declared ``Content-Length`` over ``max_bytes`` is refused before the body is read, and a body that
  grows past it is refused when it does;
* **where**: only ``http`` and ``https``, on every redirect hop too (a redirect to ``file:`` or ``ftp:`` is
  refused), at most ``max_redirects`` hops, and, when ``allowed_hosts`` is set, only those host names (exact,
  case-insensitive; checked on every hop, so a redirect cannot leave the list).

Every failure raises ``RemoteMedia`` (a ``MediaError``) naming the item's kind and index, which the engine
reports as ``UnreadableMedia`` for that request alone and the server as a 400 naming the content part.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import socket
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

from .media import RemoteMedia, describe_source

REMOTE_SCHEMES = ("http", "https")
READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class FetchPolicy:
    """How media URLs are fetched. ``allowed_hosts``: None fetches from any host."""

    timeout_s: float = 10.0
    max_bytes: int = 64 << 20
    allowed_hosts: tuple[str, ...] | None = None
    max_redirects: int = 5
    user_agent: str = "mlxsched"

    def host_allowed(self, host: str | None) -> bool:
        if self.allowed_hosts is None:
            return True
        return host is not None and host.lower() in {h.lower() for h in self.allowed_hosts}


def is_remote(source: Any) -> bool:
    """An ``http://`` / ``https://`` URL (what :func:`resolve` fetches). Reads the scheme only: a ``data:`` URL of
    megabytes is not parsed for it."""
    return isinstance(source, str) and source[:8].lower().startswith(tuple(f"{s}://" for s in REMOTE_SCHEMES))


def resolve(source: Any, policy: FetchPolicy | None, kind: str, index: int | None) -> Any:
    """``source`` itself, or the bytes at it when it is an http(s) URL. ``policy`` None: URLs are refused
    (``remote_media`` is off)."""
    if not is_remote(source):
        return source
    if policy is None:
        raise RemoteMedia(index, f"remote URLs are not fetched (remote_media is off; serve's --no-remote-media): "
                                 f"give the {kind} inline, as a data: URL or bytes", kind)
    return fetch(source, policy, kind, index)


def resolve_all(images: list, videos: list, audio: list, policy: FetchPolicy | None) -> tuple[list, list, list]:
    """A request's media lists with every URL in them resolved (`resolve`), each item named by its kind and
    index in its list."""
    def each(kind: str, items: list) -> list:
        return [resolve(src, policy, kind, i) for i, src in enumerate(items)]

    return each("image", images), each("video", videos), each("audio", audio)


class HostLookup:
    """Host name lookups a fetch waits for only until its deadline.

    ``socket.getaddrinfo`` cannot be given a timeout, so each lookup runs on a small pool shared by every fetch,
    and the fetch waits for its answer only as long as its deadline leaves. A lookup still running then finishes
    on its own thread and its answer is dropped: the pool's size bounds how many threads slow lookups can hold
    (further lookups queue behind them and time out at their own deadlines), and none outlives the system
    resolver's own timeout. ``lookup`` is ``socket.getaddrinfo``'s signature (tests pass a slow one)."""

    def __init__(self, lookup: Callable[..., list] = socket.getaddrinfo, workers: int = 4):
        self._lookup = lookup
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mlxsched-dns")

    def connect(self, address: tuple[str, int], timeout: float, deadline: float) -> socket.socket:
        """A TCP socket connected to ``address`` (host, port): the host looked up before ``deadline``, then each
        of its addresses tried in turn with ``timeout`` to connect (as ``socket.create_connection`` does)."""
        host, port = address
        answer = self._pool.submit(self._lookup, host, port, 0, socket.SOCK_STREAM)
        try:
            addresses = answer.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            answer.cancel()  # still queued behind slow lookups: never started
            raise _LookupTimeout(f"looking up host {host!r} took longer than the fetch's deadline") from None
        failure: OSError = OSError(f"no address for host {host!r}")
        for family, kind, proto, _, sockaddr in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                failure = exc
        raise failure

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _LookupTimeout(TimeoutError):
    """A host name lookup the fetch's deadline passed before."""


DEFAULT_LOOKUP = HostLookup()


class _DeadlineConnections(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's http and https handlers, making each connection's socket with ``HostLookup.connect`` under the
    fetch's deadline (every redirect hop's too). ``_create_connection`` is the attribute ``http.client``'s
    connections make their socket with (``HTTPConnection.connect``), set per connection here."""

    def __init__(self, lookup: HostLookup, deadline: float):
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self)
        self.lookup, self.deadline = lookup, deadline
        self.tls = ssl.create_default_context()  # what urllib's https handler verifies with by default

    def _connection(self, base: type) -> Callable[..., http.client.HTTPConnection]:
        def make(host: str, **kwargs: Any) -> http.client.HTTPConnection:
            connection = base(host, **kwargs)
            connection._create_connection = self._connect
            return connection
        return make

    def _connect(self, address: tuple[str, int], timeout: float, source_address: Any = None) -> socket.socket:
        return self.lookup.connect(address, timeout, self.deadline)  # timeout: the policy's (given to open)

    def http_open(self, req: Any) -> Any:
        return self.do_open(self._connection(http.client.HTTPConnection), req)

    def https_open(self, req: Any) -> Any:
        return self.do_open(self._connection(http.client.HTTPSConnection), req, context=self.tls)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, with each hop's scheme and host checked against the policy."""

    def __init__(self, policy: FetchPolicy, kind: str, index: int | None):
        super().__init__()
        self.policy, self.kind, self.index = policy, kind, index
        self.max_redirections = policy.max_redirects

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        target = urlparse(newurl)
        if target.scheme.lower() not in REMOTE_SCHEMES:
            raise RemoteMedia(self.index, f"redirected to a URL of scheme {target.scheme!r}, not followed (http and "
                                          "https only)", self.kind)
        if not self.policy.host_allowed(target.hostname):
            raise RemoteMedia(self.index, f"redirected to host {target.hostname!r}, which is not among the allowed "
                                          "media domains", self.kind)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, policy: FetchPolicy, kind: str, index: int | None, lookup: HostLookup = DEFAULT_LOOKUP) -> bytes:
    """The body at ``url`` under ``policy``; ``RemoteMedia`` naming the item for anything else. ``lookup``: how
    host names are looked up under the deadline."""
    where = describe_source(url)
    parsed = urlparse(url)
    if parsed.scheme.lower() not in REMOTE_SCHEMES or not parsed.hostname:
        raise RemoteMedia(index, f"not an http(s) URL with a host: {where}", kind)
    if not policy.host_allowed(parsed.hostname):
        raise RemoteMedia(index, f"host {parsed.hostname!r} is not among the allowed media domains", kind)
    deadline = time.monotonic() + policy.timeout_s
    opener = urllib.request.build_opener(_DeadlineConnections(lookup, deadline), _CheckedRedirects(policy, kind, index))
    request = urllib.request.Request(url, headers={"User-Agent": policy.user_agent})
    try:
        with opener.open(request, timeout=policy.timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
                raise RemoteMedia(index, f"{where} is {int(declared)} bytes, more than media_fetch_max_bytes "
                                         f"({policy.max_bytes})", kind)
            body = bytearray()
            while chunk := response.read1(READ_CHUNK):  # what has arrived: a trickle meets the deadline
                body += chunk
                if len(body) > policy.max_bytes:
                    raise RemoteMedia(index, f"{where} is more than media_fetch_max_bytes ({policy.max_bytes}) "
                                             "bytes", kind)
                if time.monotonic() > deadline:
                    raise RemoteMedia(index, f"fetching {where} took more than {policy.timeout_s:g} s", kind)
    except RemoteMedia:
        raise
    except urllib.error.HTTPError as exc:  # (before URLError: it is one)
        raise RemoteMedia(index, f"fetching {where} failed: HTTP {exc.code} {exc.reason}", kind) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, _LookupTimeout):
            raise RemoteMedia(index, f"fetching {where}: looking up its host took more than {policy.timeout_s:g} s",
                              kind) from None
        if isinstance(reason, TimeoutError):
            raise RemoteMedia(index, f"fetching {where} timed out after {policy.timeout_s:g} s", kind) from None
        raise RemoteMedia(index, f"cannot fetch {where}: {reason}", kind) from None
    except TimeoutError:  # a read that waited timeout_s for data
        raise RemoteMedia(index, f"fetching {where} timed out after {policy.timeout_s:g} s", kind) from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a reset or cut body, a malformed response
        raise RemoteMedia(index, f"fetching {where} failed: {type(exc).__name__}: {exc}", kind) from None
    return bytes(body)


__all__ = ["DEFAULT_LOOKUP", "REMOTE_SCHEMES", "FetchPolicy", "HostLookup", "fetch", "is_remote", "resolve",
           "resolve_all"]

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
  checked between reads, so a server that trickles bytes is cut off after at most about twice ``timeout_s``;
* **size**: a declared ``Content-Length`` over ``max_bytes`` is refused before the body is read, and a body that
  grows past it is refused when it does;
* **where**: only ``http`` and ``https``, on every redirect hop too (a redirect to ``file:`` or ``ftp:`` is
  refused), at most ``max_redirects`` hops, and, when ``allowed_hosts`` is set, only those host names (exact,
  case-insensitive; checked on every hop, so a redirect cannot leave the list).

Every failure raises ``RemoteMedia`` (a ``MediaError``) naming the item's kind and index, which the engine
reports as ``UnreadableMedia`` for that request alone and the server as a 400 naming the content part.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
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


def fetch(url: str, policy: FetchPolicy, kind: str, index: int | None) -> bytes:
    """The body at ``url`` under ``policy``; ``RemoteMedia`` naming the item for anything else."""
    where = describe_source(url)
    parsed = urlparse(url)
    if parsed.scheme.lower() not in REMOTE_SCHEMES or not parsed.hostname:
        raise RemoteMedia(index, f"not an http(s) URL with a host: {where}", kind)
    if not policy.host_allowed(parsed.hostname):
        raise RemoteMedia(index, f"host {parsed.hostname!r} is not among the allowed media domains", kind)
    opener = urllib.request.build_opener(_CheckedRedirects(policy, kind, index))
    request = urllib.request.Request(url, headers={"User-Agent": policy.user_agent})
    deadline = time.monotonic() + policy.timeout_s
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
        if isinstance(reason, TimeoutError):
            raise RemoteMedia(index, f"fetching {where} timed out after {policy.timeout_s:g} s", kind) from None
        raise RemoteMedia(index, f"cannot fetch {where}: {reason}", kind) from None
    except TimeoutError:  # a read that waited timeout_s for data
        raise RemoteMedia(index, f"fetching {where} timed out after {policy.timeout_s:g} s", kind) from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a reset or cut body, a malformed response
        raise RemoteMedia(index, f"fetching {where} failed: {type(exc).__name__}: {exc}", kind) from None
    return bytes(body)


__all__ = ["REMOTE_SCHEMES", "FetchPolicy", "fetch", "is_remote", "resolve", "resolve_all"]

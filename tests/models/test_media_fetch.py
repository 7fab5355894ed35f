"""Media given as http(s) URLs (scheduler/models/fetch.py), against a loopback HTTP server (tests/media_http.py).

The fetch itself: bytes come back as served; every bound holds and fails with `RemoteMedia` naming the item
(HTTP errors, a declared or streamed body over the byte limit, a stalled or trickling server, a host name
lookup that hangs, redirects to another scheme, to a host outside the allowed list, or in a loop, a closed
port). Through the engine (tiny Qwen2-VL): an image by URL is the same image as by path (same media key, same
greedy tokens as solo `mlx_vlm`), as `images=` or as an OpenAI content part, and a video by URL is the same clip
as by path; a URL that cannot be fetched fails its own request at `add_request` while the others finish, leaving
nothing behind; `remote_media=False` and `allowed_media_domains` refuse without touching the network;
`AsyncEngine` fetches each request on a pool of its own, so a stalled host holds no other request; the reference
surface (`MLLMBatchGenerator`) takes image URLs as the reference does."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.models.fetch import FetchPolicy, HostLookup, fetch, is_remote, resolve
from scheduler.models.media import MediaError, RemoteMedia
from scheduler.request import UnreadableMedia

from ..helpers import drive
from .test_vlm_media import MAX_TOKENS, noise_image, png_bytes, solo, user


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


POLICY = FetchPolicy(timeout_s=5.0, max_bytes=1 << 20)


# ------------------------------------------------------------------------------------------ the fetch itself
def test_the_body_comes_back_as_served_and_other_sources_pass_through(media_server):
    body = bytes(range(256)) * 300
    url = media_server.serve("/blob.bin", body)
    assert fetch(url, POLICY, "image", 0) == body
    assert resolve(url, POLICY, "image", 0) == body
    for other in ("data:image/png;base64,AAAA", "/tmp/a.png", b"raw", 42, None):
        assert resolve(other, POLICY, "image", 0) is other
    assert is_remote("HTTPS://example.com/a.png") and is_remote(url)
    assert not is_remote("file:///etc/passwd") and not is_remote("ftp://example.com/a.png")


def test_a_redirect_within_the_rules_is_followed(media_server):
    body = b"after a redirect"
    target = media_server.serve("/target.bin", body)
    assert fetch(media_server.url(f"/redirect?to={target}"), POLICY, "image", 0) == body
    assert fetch(media_server.url("/redirect?to=/target.bin"), POLICY, "image", 0) == body  # relative


@pytest.mark.parametrize("case, policy, match", [
    ("/missing", POLICY, "HTTP 404"),
    ("/declared-huge", POLICY, "1073741824 bytes, more than media_fetch_max_bytes"),
    ("/endless", POLICY, "more than media_fetch_max_bytes"),
    ("/stall/never", FetchPolicy(timeout_s=0.3), "timed out after 0.3 s"),
    ("/trickle", FetchPolicy(timeout_s=0.3), "took more than 0.3 s"),
    ("/redirect?to=ftp://127.0.0.1/a.png", POLICY, "redirected to a URL of scheme 'ftp', not followed"),
    ("/redirect?to=file:///etc/passwd", POLICY, "Redirection to url 'file:///etc/passwd' is not allowed"),  # urllib's
    ("/loop", POLICY, "HTTP 302"),
])
def test_every_bound_fails_with_remote_media_naming_the_item(media_server, case, policy, match):
    start = time.monotonic()
    with pytest.raises(RemoteMedia, match=match) as info:
        fetch(media_server.url(case), policy, "video", 3)
    assert info.value.kind == "video" and info.value.index == 3
    assert str(info.value).startswith("video 3:")
    assert isinstance(info.value, MediaError)
    assert time.monotonic() - start < 2 * policy.timeout_s + 2  # bounded by the policy, not by the server


def test_allowed_hosts_hold_up_front_and_on_every_redirect(media_server):
    body = b"allowed"
    media_server.serve("/allowed.bin", body)
    only_localhost = FetchPolicy(timeout_s=5.0, allowed_hosts=("LocalHost",))
    before = media_server.requests["/allowed.bin"]
    with pytest.raises(RemoteMedia, match="host '127.0.0.1' is not among the allowed media domains"):
        fetch(media_server.url("/allowed.bin"), only_localhost, "image", 0)
    assert media_server.requests["/allowed.bin"] == before  # refused before any connection
    assert fetch(media_server.url("/allowed.bin", host="localhost"), only_localhost, "image", 0) == body
    # allowed at first, then redirected off the list
    escape = media_server.url("/redirect?to=" + media_server.url("/allowed.bin"), host="localhost")
    with pytest.raises(RemoteMedia, match="redirected to host '127.0.0.1'"):
        fetch(escape, only_localhost, "image", 0)
    assert media_server.requests["/allowed.bin"] == before + 1


def test_a_closed_port_and_a_url_without_a_host_fail_cleanly():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteMedia, match="cannot fetch"):
        fetch(f"http://127.0.0.1:{port}/a.png", POLICY, "audio", 1)
    with pytest.raises(RemoteMedia, match="not an http"):
        fetch("http:///a.png", POLICY, "audio", 1)


class _SlowNames:
    """``socket.getaddrinfo`` that hangs on ``*.slow`` names until released, and records every host asked."""

    def __init__(self):
        self.asked: list[str] = []
        self.release = threading.Event()

    def __call__(self, host, port, *args):
        self.asked.append(host)
        if host.endswith(".slow"):
            self.release.wait(30)
            host = "127.0.0.1"
        return socket.getaddrinfo(host, port, *args)


def test_a_host_lookup_that_hangs_is_cut_off_at_the_deadline_and_holds_no_other_fetch(media_server):
    """``socket.getaddrinfo`` takes no timeout: a name server that does not answer held a fetch for as long as
    the system resolver retried, past every bound of the policy. The lookup is now waited for only until the
    fetch's deadline, on a bounded pool, and a fetch beside it (and each redirect hop's lookup) goes through."""
    names = _SlowNames()
    lookup = HostLookup(names, workers=2)
    body = b"beside a slow lookup"
    media_server.serve("/beside.bin", body)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteMedia, match=r"^image 2: .*looking up its host took more than 0.3 s"):
            fetch(f"http://media.slow:{media_server.port}/beside.bin", FetchPolicy(timeout_s=0.3), "image", 2,
                  lookup)
        assert time.monotonic() - start < 1.5
        hop = media_server.url("/redirect?to=" + media_server.url("/beside.bin", host="localhost"))
        assert fetch(hop, POLICY, "image", 0, lookup) == body
        # https connections are made the same way (this server speaks plain http: the TLS handshake fails)
        with pytest.raises(RemoteMedia, match="cannot fetch .*SSL"):
            fetch(media_server.url("/beside.bin").replace("http:", "https:"), POLICY, "image", 0, lookup)
        assert names.asked == ["media.slow", "127.0.0.1", "localhost", "127.0.0.1"]
    finally:
        names.release.set()
        lookup.close()


def test_a_lookup_queued_behind_slow_ones_times_out_at_its_own_deadline_without_running():
    """The pool's size bounds the threads slow lookups hold: with both busy, a third fetch waits in the queue
    until its deadline, fails, and its lookup never starts."""
    names = _SlowNames()
    lookup = HostLookup(names, workers=1)
    policy = FetchPolicy(timeout_s=0.2)
    try:
        for name in ("a.slow", "b.slow"):
            with pytest.raises(RemoteMedia, match="looking up its host took more than 0.2 s"):
                fetch(f"http://{name}/x.png", policy, "image", 0, lookup)
        assert names.asked == ["a.slow"]  # b.slow was cancelled in the queue
    finally:
        names.release.set()
        lookup.close()


def test_no_policy_refuses_every_url_without_fetching(media_server):
    url = media_server.serve("/never.bin", b"x")
    with pytest.raises(RemoteMedia, match="remote_media is off"):
        resolve(url, None, "image", 0)
    assert media_server.requests["/never.bin"] == 0


# ------------------------------------------------------------------------------------------ through the engine
def test_an_image_by_url_is_the_same_image_as_by_path(vlm, media_server, tmp_path):
    model, processor = vlm
    image = noise_image(84, 112, seed=11)
    data = png_bytes(image)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = media_server.serve("/a.png", data, "image/png")
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    assert engine.vlm.prepare(user("what?", 1), [url]).media_key == engine.vlm.prepare(user("what?", 1),
                                                                                        [path]).media_key
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "what?"}]}]
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    run = drive(engine, [(0, dict(prompt=user("what?", 1), images=[url], sampling=sampling)),
                         (0, dict(prompt=parts, sampling=sampling))])
    assert not run.errors
    want = solo(vlm, user("what?", 1), [image])
    assert list(run.tokens.values()) == [want, want]


def test_a_video_by_url_is_the_same_clip_as_by_path(vlm, media_server, tmp_path):
    from .test_video import video_messages, write_video

    model, processor = vlm
    path = write_video(tmp_path / "clip.avi")
    url = media_server.serve("/clip.avi", path.read_bytes(), "video/x-msvideo")
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    by_url = engine.vlm.prepare(video_messages("what happens?"), videos=[url])
    by_path = engine.vlm.prepare(video_messages("what happens?"), videos=[path])
    assert by_url.media_key == by_path.media_key
    assert list(by_url.input_ids) == list(by_path.input_ids)


def test_a_url_that_cannot_be_fetched_fails_its_request_alone(vlm, media_server):
    model, processor = vlm
    good = noise_image(56, 56, seed=12)
    good_url = media_server.serve("/good.png", png_bytes(good), "image/png")
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    first = engine.add_request(prompt=user("what?", 1), images=[good_url], sampling=sampling)
    second = engine.add_request(prompt="tell me something", sampling=sampling)
    tokens = {first: [], second: []}
    for out in engine.step():
        tokens[out.request_id].extend(out.token_ids)
    with pytest.raises(UnreadableMedia, match="image 1: fetching .* failed: HTTP 404") as info:
        engine.add_request(prompt=user("what?", 2), images=[good_url, media_server.url("/missing")], sampling=sampling)
    assert (info.value.kind, info.value.index, info.value.field) == ("image", 1, "images")
    while engine.has_pending():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    assert tokens[first] == solo(vlm, user("what?", 1), [good])
    assert len(tokens[second]) == MAX_TOKENS
    assert engine.kv_cache_stats()["bytes"] == 0
    assert engine.vision_cache_stats()["entries"] == 1  # the good image only


def test_remote_media_off_and_allowed_domains_refuse_without_fetching(vlm, media_server):
    model, processor = vlm
    url = media_server.serve("/refused.png", png_bytes(noise_image(56, 56, seed=13)), "image/png")
    for config, match in [(EngineConfig(remote_media=False), "remote_media is off"),
                          (EngineConfig(allowed_media_domains=["images.example"]), "not among the allowed")]:
        engine = Engine(model, processor, config)
        with pytest.raises(UnreadableMedia, match=match):
            engine.add_request(prompt=user("what?", 1), images=[url])
        assert not engine.has_pending()
    assert media_server.requests["/refused.png"] == 0
    engine = Engine(model, processor, EngineConfig(allowed_media_domains=["127.0.0.1"]))
    engine.add_request(prompt=user("what?", 1), images=[url], sampling=SamplingParams(max_tokens=1))
    assert media_server.requests["/refused.png"] == 1


@pytest.mark.parametrize("field, value", [
    ("remote_media", 1), ("media_fetch_timeout_s", 0), ("media_fetch_timeout_s", float("inf")),
    ("media_fetch_max_bytes", 0), ("media_fetch_max_bytes", True), ("allowed_media_domains", "example.com"),
    ("allowed_media_domains", ["a.example", ""]), ("allowed_media_domains", ["http://a.example/"]),
])
def test_bad_fetch_settings_are_refused_at_configuration(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
    assert EngineConfig(allowed_media_domains=["a.example"]).allowed_media_domains == ("a.example",)


def test_async_engine_fetches_each_request_in_a_thread_of_its_own(vlm, media_server):
    """A host that stalls holds only its own request: the next one, queued behind it, is fetched, prepared and
    finished meanwhile (before, both waited on the one worker that prepares requests)."""
    from scheduler.async_engine import AsyncEngine

    model, processor = vlm
    good = noise_image(56, 56, seed=14)
    good_url = media_server.serve("/async-good.png", png_bytes(good), "image/png")
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": good_url}},
                                          {"type": "text", "text": "what?"}]}]
    aengine = AsyncEngine(Engine(model, processor, EngineConfig(check_invariants=True, media_fetch_timeout_s=60)))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)

    async def main():
        stalled = asyncio.create_task(aengine.generate(prompt=user("what?", 1), images=[media_server.url("/stall/a")],
                                                       sampling=sampling))
        deadline = time.monotonic() + 30
        while media_server.requests["/stall/a"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        try:
            out = await asyncio.wait_for(aengine.generate(prompt=parts, sampling=sampling), 20)
            assert not stalled.done()
        finally:
            media_server.release("a")
        with pytest.raises(UnreadableMedia, match="image 0: not a readable image"):
            await stalled
        return out

    try:
        out = asyncio.run(main())
    finally:
        aengine.close()
    assert out.token_ids == solo(vlm, user("what?", 1), [good])
    assert not aengine.engine.has_pending()


def test_the_reference_surface_takes_image_urls_as_the_reference_does(vlm, media_server):
    """vllm-mlx's MLLMBatchGenerator fetches image URLs; ours, through the engine, does too."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    from scheduler.compat import MLLMBatchGenerator, MLLMBatchRequest

    model, processor = vlm
    image = noise_image(112, 84, seed=15)
    url = media_server.serve("/compat.png", png_bytes(image), "image/png")
    prompt = apply_chat_template(processor, model.config, "what?", num_images=1)
    gen = MLLMBatchGenerator(model, processor)
    (uid,) = gen.insert([MLLMBatchRequest(uid=-1, request_id="u", prompt=prompt, images=[url],
                                          max_tokens=MAX_TOKENS, temperature=0.0)])
    tokens, finish = [], None
    while gen.has_pending():
        for r in gen.next():
            if r.finish_reason in (None, "stop", "length"):
                tokens.append(r.token)
            finish = r.finish_reason or finish
    gen.close()
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=[image], max_tokens=MAX_TOKENS,
                                        temperature=0.0):
        pass
    assert finish == "length"
    assert tokens == list(last.token_ids)

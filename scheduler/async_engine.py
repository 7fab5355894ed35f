"""An asyncio front for `Engine`: the tick loop runs on one background thread, clients await their tokens.

`submit()` registers a queue for the request id *before* the request can reach the loop (so no output is
lost), fetches its media URLs on a pool of threads of their own (`media_fetch_pool`, `Engine.fetch_media`),
then runs `add_request` (tokenizing, media preprocessing) on the one worker thread that prepares requests, off
the event loop; it raises `InvalidRequest` with nothing queued, like `add_request`. The loop thread hands
outputs to the owning event loop with `call_soon_threadsafe`. A client that stops listening (its task is
cancelled, it closes the `RequestStream` or breaks out of `stream()`) aborts its request, so nothing keeps
computing for nobody. `tokenize()` runs `Engine.tokenize` the same way (fetch pool, then the worker).

`call(fn)` runs `fn` on the loop thread between two ticks, where the engine's state is consistent (a metrics
scrape reads cache sizes there). `error` is the exception that stopped the loop, if one did; after that, and
after `close()`, every waiting stream ends with a `RuntimeError` instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

from .engine import Engine, RequestOutput, prompt_scores
from .request import InvalidRequest, SamplingParams, UnknownRequest
from .scheduler import StepOutput


def _release_thread_streams() -> None:
    """MLX asks every thread that ran MLX work to destroy its streams before it ends (`mx.clear_streams`):
    otherwise the process may abort at exit ("terminate called without an active exception") once more than
    one thread has used MLX, as the loop thread and the preprocessing worker do."""
    import mlx.core as mx

    mx.clear_streams()


MEDIA_FETCH_WORKERS = 16  # requests whose media URLs are fetched at once


class EngineStopped(RuntimeError):
    """The engine loop is not running (it failed, or the AsyncEngine was closed)."""


class RequestStream:
    """The outputs of one submitted request, as an async iterator. Closing it before the request ended aborts
    the request (the engine frees its caches at the next tick)."""

    def __init__(self, aengine: "AsyncEngine", request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self._aengine = aengine
        self._queue = queue
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise EngineStopped(f"the engine loop stopped: {item}") from item
        if item.finished:
            self._done = True
        return item

    def close(self) -> None:
        """Stop listening; aborts the request if it has not ended. Idempotent."""
        if self._done:
            return
        self._done = True
        self._aengine._unregister(self.request_id)
        self._aengine.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.01):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        # One worker: requests are preprocessed in arrival order, and the processor is never called from two
        # threads at once (tokenizers are not all safe for that).
        self._prepare = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxsched-prepare")
        # Media URLs are fetched on threads of their own, a request per thread: a slow host holds at most this
        # pool (a server converts its requests that fetch here too), never the worker that prepares every request.
        self.media_fetch_pool = concurrent.futures.ThreadPoolExecutor(max_workers=MEDIA_FETCH_WORKERS,
                                                                      thread_name_prefix="mlxsched-media-fetch")
        self._thread = threading.Thread(target=self._run, name="mlxsched-engine", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine loop, or None while it runs (or after a clean close)."""
        return self._error

    @property
    def running(self) -> bool:
        return self._error is None and not self._stop.is_set() and self._thread.is_alive()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the engine loop has stopped (it failed: see `error`, or it was closed), or `timeout`
        seconds; returns whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_calls()
                if not self.engine.has_pending():
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    with self._lock:
                        target = self._queues.get(out.request_id)
                        if out.finished:
                            self._queues.pop(out.request_id, None)
                    if target is not None:
                        loop, queue = target
                        loop.call_soon_threadsafe(queue.put_nowait, out)
        except BaseException as exc:  # surface loop crashes to every waiting client
            self._error = exc
            self._end_waiters(exc)
        finally:
            _release_thread_streams()

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _end_waiters(self, exc: BaseException) -> None:
        with self._lock:
            targets, self._queues = list(self._queues.values()), {}
            calls, self._calls = self._calls, []
        for loop, queue in targets:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except RuntimeError:  # that event loop is already closed: nobody is waiting there
                pass
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped(str(exc)))

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineStopped(f"the engine loop failed: {self._error!r}") from self._error
        if self._stop.is_set():
            raise EngineStopped("the engine is closed")

    def _unregister(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the loop thread between two ticks and return its result (its exception is raised)."""
        self._check_running()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, future))
        self._wake.set()
        if not self.running:  # stopped meanwhile: the loop will not run it
            self._end_waiters(EngineStopped("the engine is not running"))
        return await asyncio.wrap_future(future)

    async def submit(self, prompt: Any = None, prompt_tokens: Sequence[int] | None = None,
                     sampling: SamplingParams | None = None, request_id: str | None = None,
                     images: Sequence[Any] | None = None, videos: Sequence[Any] | None = None,
                     audio: Sequence[Any] | None = None, priority: int = 0,
                     tools: Sequence[dict] | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None, lora: str | None = None,
                     cache_salt: str | None = None) -> RequestStream:
        """Queue a request (arguments as `Engine.add_request`) and return the stream of its outputs. Raises
        InvalidRequest (nothing queued) for bad input, EngineStopped when the loop is not running."""
        self._check_running()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if rid in self._queues:  # live here: registering would steal its outputs
                raise InvalidRequest("request_id", f"duplicate request id {rid!r}", rid)
            self._queues[rid] = (loop, queue)
        try:
            prompt, images, videos, audio = await self._fetched(prompt, images, videos, audio, rid)
        except BaseException:
            self._unregister(rid)
            raise
        add = functools.partial(self.engine.add_request, prompt=prompt, prompt_tokens=prompt_tokens,
                                sampling=sampling, request_id=rid, images=images, videos=videos, audio=audio,
                                priority=priority, tools=tools, chat_template_kwargs=chat_template_kwargs,
                                lora=lora, cache_salt=cache_salt)
        accepted = self._prepare.submit(add)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self._unregister(rid)
            # add_request may still be running on the worker: abort the request if it gets accepted
            accepted.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.engine.abort(rid))
            raise
        except BaseException:
            self._unregister(rid)
            raise
        self._wake.set()
        return RequestStream(self, rid, queue)

    async def _fetched(self, prompt: Any, images: Any, videos: Any, audio: Any, request_id: str | None) -> tuple:
        """(prompt, images, videos, audio) with media URLs fetched on `media_fetch_pool` (`Engine.fetch_media`)."""
        if self.engine.vlm is None or self.engine.media_fetch is None or not (
                images or videos or audio or isinstance(prompt, list)):
            return prompt, images, videos, audio
        prompt, media = await asyncio.get_running_loop().run_in_executor(
            self.media_fetch_pool, self.engine.fetch_media, prompt, images, videos, audio, request_id)
        return prompt, media.images or None, media.videos or None, media.audio or None

    async def tokenize(self, prompt: Any, images: Sequence[Any] | None = None, videos: Sequence[Any] | None = None,
                       audio: Sequence[Any] | None = None, tools: Sequence[dict] | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """`Engine.tokenize`, with media URLs fetched as `submit` fetches them and the rest on the worker that
        prepares requests (where the tokenizer and processor are used)."""
        self._check_running()
        prompt, images, videos, audio = await self._fetched(prompt, images, videos, audio, None)
        return await asyncio.wrap_future(self._prepare.submit(
            self.engine.tokenize, prompt, images, videos, audio, tools, chat_template_kwargs))

    async def stream(self, prompt: Any = None, prompt_tokens: Sequence[int] | None = None,
                     sampling: SamplingParams | None = None, request_id: str | None = None,
                     images: Sequence[Any] | None = None, videos: Sequence[Any] | None = None,
                     audio: Sequence[Any] | None = None, priority: int = 0,
                     lora: str | None = None) -> AsyncIterator[StepOutput]:
        """`Engine.add_request`'s arguments; bad input raises InvalidRequest at the first `__anext__`."""
        outputs = await self.submit(prompt, prompt_tokens, sampling, request_id, images, videos, audio, priority,
                                    lora=lora)
        try:
            async for out in outputs:
                yield out
        finally:  # cancelled or abandoned before the end: stop computing for nobody
            outputs.close()

    async def generate(self, prompt: Any = None, prompt_tokens: Any = None, sampling: SamplingParams | None = None,
                       request_id: str | None = None, images: Any = None, videos: Any = None, audio: Any = None,
                       priority: int = 0, lora: str | None = None) -> RequestOutput:
        tokens: list[int] = []
        logprobs: list[float] = []
        top_logprobs: list[list[tuple[int, float]]] = []
        first = None  # its first output: it brings the prompt (and its logprobs)
        last = None
        async for out in self.stream(prompt=prompt, prompt_tokens=prompt_tokens, sampling=sampling,
                                     request_id=request_id, images=images, videos=videos, audio=audio,
                                     priority=priority, lora=lora):
            tokens.extend(out.token_ids)
            logprobs.extend(out.logprobs)
            top_logprobs.extend(out.top_logprobs)
            if out.prompt_token_ids is not None:
                first = out
            last = out
        return RequestOutput(last.request_id, tokens, self.engine.tokenizer.decode(tokens), last.finish_reason,
                             last.error, logprobs, top_logprobs,
                             **prompt_scores(first))

    def close(self, drain_s: float = 0.0) -> None:
        """Stop the loop after the tick in progress; streams still waiting end with EngineStopped.

        `drain_s` > 0: first abort every request still listened to and let the loop run (up to that long) until
        the engine holds nothing, so no request's caches outlive the loop (a server shutting down)."""
        if drain_s > 0 and self.running:
            with self._lock:
                live = list(self._queues)
            for rid in live:
                try:
                    self.engine.abort(rid)
                except UnknownRequest:  # still being prepared: add_request has not accepted it yet
                    pass
            self._wake.set()
            deadline = time.monotonic() + drain_s
            while self.running and self.engine.has_pending() and time.monotonic() < deadline:
                time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._end_waiters(EngineStopped("the engine was closed"))
        self._prepare.submit(_release_thread_streams)  # on the worker thread, before it exits
        self._prepare.shutdown(wait=True)
        # a fetch still waiting on a slow host ends at its own timeout; nobody waits for it
        self.media_fetch_pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

"""An asyncio front for `Engine`: the tick loop runs on one background thread, clients await their tokens.

Each `stream()` registers a queue for its request id before the request can produce output; the loop thread
hands outputs to the owning event loop with `call_soon_threadsafe`. A client that stops listening (its task
is cancelled, or it breaks out of the iteration) aborts its request, so nothing keeps computing for nobody.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

from .engine import Engine, RequestOutput
from .request import SamplingParams
from .scheduler import StepOutput


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.01):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxsched-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
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
            with self._lock:
                targets, self._queues = list(self._queues.values()), {}
            for loop, queue in targets:
                loop.call_soon_threadsafe(queue.put_nowait, exc)

    async def stream(self, prompt: Any = None, prompt_tokens: Any = None, sampling: SamplingParams | None = None,
                     request_id: str | None = None, images: Any = None, videos: Any = None, audio: Any = None,
                     priority: int = 0) -> AsyncIterator[StepOutput]:
        """`Engine.add_request`'s arguments; bad input raises InvalidRequest at the first `__anext__`."""
        if self._error is not None:
            raise RuntimeError("the engine loop has stopped") from self._error
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        # Register under the lock before the id can reach the loop thread.
        with self._lock:
            rid = self.engine.add_request(prompt=prompt, prompt_tokens=prompt_tokens, sampling=sampling,
                                          request_id=request_id, images=images, videos=videos, audio=audio,
                                          priority=priority)
            self._queues[rid] = (loop, queue)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError("the engine loop failed") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # cancelled or abandoned: stop computing for nobody
                with self._lock:
                    self._queues.pop(rid, None)
                self.engine.abort(rid)

    async def generate(self, prompt: Any = None, prompt_tokens: Any = None, sampling: SamplingParams | None = None,
                       request_id: str | None = None, images: Any = None, videos: Any = None, audio: Any = None,
                       priority: int = 0) -> RequestOutput:
        tokens: list[int] = []
        logprobs: list[float] = []
        last = None
        async for out in self.stream(prompt=prompt, prompt_tokens=prompt_tokens, sampling=sampling,
                                     request_id=request_id, images=images, videos=videos, audio=audio,
                                     priority=priority):
            tokens.extend(out.token_ids)
            logprobs.extend(out.logprobs)
            last = out
        return RequestOutput(last.request_id, tokens, self.engine.tokenizer.decode(tokens), last.finish_reason,
                             last.error, logprobs)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

"""The OpenAI-compatible HTTP app (FastAPI) over an `AsyncEngine`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`: server-sent events in OpenAI's
chunk format, ending with `data: [DONE]`), POST /v1/responses (OpenAI's Responses API over the chat path,
`responses.py`; streamed as its typed events), GET /v1/models, GET /health, GET /metrics, and vLLM's tokenize and
LoRA routes.

A request is checked whole before anything is queued: the body (JSON, then the pydantic models), the model
name, the messages (images and audio decoded off the event loop), every choice's sampling parameters, the
queue bound; then the engine's own `add_request` checks (prompt length, vocabulary, ...). A refusal is an
OpenAI error body with a 4xx status naming the field, and nothing stays queued for it.

A client that goes away aborts its engine requests (the engine frees them at its next tick): a streaming one
cancels its response task, a non-streaming one is noticed by waiting for its `http.disconnect` next to the
answer; either way the choice streams are closed.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import AsyncEngine, EngineStopped, RequestStream
from ..models.lora import LoRAError, LoRAInUse, UnknownLoRA
from ..models.prompt import with_generation_prompt
from ..request import InvalidRequest, StructuredOutput
from .choices import (ChatChoices, ChatParsing, ChoiceSplitter, ChoiceText, TextChoices, prompt_logprobs_field,
                      tool_calling_of)
from .constraints import output_constraint
from .generation import Body, ChoiceFailed, Delta, bad_words_ids, choice_deltas, refusal, sampling_params
from .messages import EnginePrompt, convert_messages, fetches_media
from .metrics import EngineMetrics, engine_snapshot
from .protocol import (MAX_CHOICES, REQUEST_ID, APIError, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, LoadLoRARequest, TokenizeRequest, UnloadLoRARequest, usage,
                       validation_error)
from .reasoning import ReasoningFormat
from .responses import (ResponseBuilder, ResponsesRequest, ResponseStore, StoredResponse, in_responses_terms,
                        input_items, sse_event, to_chat)
from .token_bytes import TokenBytes
from .tool_calls import ToolCallFormat

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
          "/health", "/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
DEFAULT_MAX_REQUEST_BYTES = 64 << 20  # room for a few large base64 images or a short video


@dataclass
class ServerState:
    aengine: AsyncEngine
    metrics: EngineMetrics
    model_name: str
    max_queue: int | None = None  # refuse (429) beyond this many waiting requests; None: no bound
    local_media_dir: Path | None = None  # clients may name media files under it (resolved); None: none at all
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is a 413, read no further
    # clients may load and unload LoRA adapters (server paths) while it runs: vLLM's runtime LoRA updating, off
    # unless the operator turns it on (`--allow-runtime-lora`)
    allow_runtime_lora: bool = False
    # the responses kept for the Responses API's previous_response_id and GET /v1/responses/{id}
    # (`--responses-store N`); None: none are kept
    responses: ResponseStore | None = None

    @property
    def engine(self) -> Any:
        return self.aengine.engine

    @property
    def loras(self) -> tuple[str, ...]:
        """The engine's LoRA adapters: model names a request may send besides `model_name` (vLLM's
        `--lora-modules`)."""
        return self.engine.lora_names


class _CountResponses:
    """ASGI middleware counting answers by route and status (a pure ASGI wrapper: it does not buffer or
    re-task streaming responses, so a client's disconnect still reaches the stream)."""

    def __init__(self, app: Any, metrics: EngineMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it passes `limit` bytes: by its Content-Length before anything is read, or
    while a chunked one arrives, so an oversized body is never held whole."""
    too_large = APIError(413, f"body: larger than the server's limit of {limit} bytes (--max-request-mb)", "body")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[Body], limit: int) -> Body:
    raw = await _read_body(request, limit)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"body: malformed JSON: {exc}", "body") from None
    if not isinstance(data, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(data).__name__}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Call:
    """One HTTP completion call: its choices' engine requests, submitted together, and their merged deltas.
    `prompts`: how many prompts it has (a /v1/completions prompt list); each gets `n` choices, choice
    `p * n + j` being prompt p's j-th (OpenAI's order)."""

    def __init__(self, state: ServerState, body: Body, kind: str, prompts: int = 1, lora: str | None = None,
                 client_id: str | None = None):
        self.state = state
        self.body = body
        self.lora = lora  # the LoRA adapter its choices run on (`_check_model`)
        self.model = lora if lora is not None else state.model_name  # the model its answers name
        # the client's id where it sent one (`_client_id`); each choice's engine request is "<id>-<i>", so an id
        # still live or recently ended is refused as the engine refuses a duplicate
        self.id = f"{kind}-{client_id if client_id is not None else uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.request_ids = [f"{self.id}-{i}" for i in range(prompts * body.n)]
        self.echoes: list[str] | None = None  # per prompt, its text, which each of its choices echoes
        self.streams: list[RequestStream] = []
        self.completion_tokens = 0

    @property
    def choices(self) -> int:
        return len(self.request_ids)

    async def submit(self, prompts: list[dict[str, Any]],
                     part_of: Callable[[str, int | None], str | None] | None = None,
                     structured: StructuredOutput | None = None) -> None:
        """Submit the call's choices: `n` per entry of `prompts` (its engine arguments: prompt or prompt_tokens,
        media), each constrained by `structured`. `part_of` names the content part a refused medium came from."""
        state, body = self.state, self.body
        bad_words = bad_words_ids(state.engine.tokenizer, body.bad_words) if body.bad_words else ()
        samplings = [sampling_params(body, i % body.n, state.engine.max_model_len, structured, bad_words)
                     for i in range(self.choices)]
        if not state.aengine.running:  # before the queue bound: a dead loop's queue never drains
            raise APIError(503, f"the engine loop is not running: {state.aengine.error!r}", None, "server_error")
        if state.max_queue is not None and self.choices > state.max_queue:  # a retry could never fit: not a 429
            raise APIError(400, f"n: {self.choices} choices in one request, more than the server queues at once "
                                f"(--max-queue {state.max_queue})", "n")
        if not state.metrics.reserve(self.request_ids, state.max_queue):
            raise APIError(429, f"the queue is full ({state.max_queue} waiting requests): retry later", None,
                           "rate_limit_error", "queue_full")
        try:
            for i, (rid, sampling) in enumerate(zip(self.request_ids, samplings)):
                self.streams.append(await state.aengine.submit(request_id=rid, sampling=sampling,
                                                               priority=body.priority, lora=self.lora,
                                                               cache_salt=body.cache_salt, **prompts[i // body.n]))
        except BaseException as exc:
            for stream in self.streams:  # a later choice refused: the earlier ones are aborted
                stream.close()
            for rid in self.request_ids[len(self.streams):]:
                state.metrics.forget(rid)
            if isinstance(exc, InvalidRequest):
                error = refusal(body, exc, part_of)
                if len(prompts) > 1 and error.param == "prompt":  # which of the prompts
                    where = f"prompt.{len(self.streams) // body.n}"
                    error = APIError(400, f"{where}: {error.message.removeprefix('prompt: ')}", where)
                raise error from None
            if isinstance(exc, EngineStopped):
                raise APIError(503, f"the engine is not running: {exc}", None, "server_error") from None
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as the choices produce them; every choice's stream is closed on the way out."""
        tokenizer, stops, logprobs = self.state.engine.tokenizer, self.body.stop_rule(), self.body.wants_logprobs()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            echo = self.echoes[index // self.body.n] if self.echoes is not None else None
            scores_prompt = self.body.prompt_logprobs is not None and index % self.body.n == 0
            try:
                async for delta in choice_deltas(stream, tokenizer, stops, logprobs, echo, self.body.prompt_only(),
                                                 scores_prompt, self.body.skip_special_tokens):
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self.completion_tokens += len(item.token_ids)
                if item.finish_reason is not None:
                    self.state.metrics.choices.labels(item.finish_reason).inc()
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in self.streams:
                stream.close()

    def usage(self) -> dict[str, Any]:
        records = [self.state.metrics.claim(rid) for rid in self.request_ids]
        # each prompt once, not once per choice: its first choice's record
        firsts = [r for r in records[:: self.body.n] if r is not None]
        return usage(sum(r.prompt_tokens for r in firsts), self.completion_tokens,
                     sum(r.cached_tokens for r in firsts))


async def _until_done_or_disconnect(request: Request, task: asyncio.Task) -> bool:
    """Wait for `task`; True once it is done, False (task cancelled) if the client disconnected first. The body
    is already read, so the next ASGI message of this request can only be its `http.disconnect`."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return not task.cancelled()


def _failure(exc: BaseException) -> APIError:
    if isinstance(exc, EngineStopped):
        return APIError(503, f"the engine stopped: {exc}", None, "server_error")
    return APIError(500, f"the request failed: {exc}", None, "server_error")


def _installed_version() -> str:
    try:
        return importlib.metadata.version("mlxsched")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def _client_id(request: Request, body: Body) -> str | None:
    """The id the client gave its request (vLLM's: the X-Request-Id header, else the body's `request_id`)."""
    header = request.headers.get("x-request-id")
    if header is None:
        return body.request_id
    if not re.fullmatch(REQUEST_ID, header):
        raise APIError(400, "X-Request-Id: 1 to 128 printable ASCII characters without spaces", "X-Request-Id")
    return header


def _check_model(state: ServerState, body: Body) -> str | None:
    """The LoRA adapter the request's `model` names (None: the base model); 404 for a model not served."""
    if body.model is None or body.model == state.model_name:
        return None
    if body.model in state.loras:
        return body.model
    raise APIError(404, f"model: the model {body.model!r} does not exist here (serving "
                        f"{', '.join(map(repr, (state.model_name, *state.loras)))})", "model",
                   "invalid_request_error", "model_not_found")


def _opens_reasoning(engine: Any, reasoning: ReasoningFormat, prompt: EnginePrompt, tools: list | None,
                     template_kwargs: dict | None) -> bool:
    """Whether the prompt leaves the reasoning open (a Qwen3-thinking generation prompt ends with `<think>`): the
    chat template rendered as the engine renders it (a vision-language model's as mlx-vlm renders it). Arguments
    it fails on are the engine's to refuse (a 400 when the call is submitted), so they count as not opening it
    here."""
    kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        if engine.vlm is None:
            text = engine.tokenizer.apply_chat_template(prompt.messages, tokenize=False,
                                                        **with_generation_prompt(kwargs))
        else:
            text = engine.vlm.render_chat(prompt.messages, len(prompt.images), len(prompt.videos), len(prompt.audio),
                                          kwargs)
    except (TemplateError, TypeError, ValueError):
        return False
    return reasoning.opens_in(text)


def _chunk(call: _Call, obj: str, choices: list[dict], with_usage: bool) -> dict[str, Any]:
    out = {"id": call.id, "object": obj, "created": call.created, "model": call.model,
           "choices": choices}
    if with_usage:
        out["usage"] = None
    return out


async def _collect(request: Request, call: _Call) -> dict[int, list[Delta]] | None:
    """Every choice's deltas, once all are done (a non-streaming answer); None if the client went away first
    (the requests are aborted). A failed choice raises its APIError."""
    pieces: dict[int, list[Delta]] = {i: [] for i in range(call.choices)}

    async def collect() -> None:
        async for index, delta in call.deltas():
            pieces[index].append(delta)

    collecting = asyncio.create_task(collect())
    if not await _until_done_or_disconnect(request, collecting):
        call.usage()  # gone: the cancelled collection closed the streams (aborting the requests)
        return None
    try:
        collecting.result()
    except (ChoiceFailed, EngineStopped) as exc:
        raise _failure(exc) from None
    return pieces


async def _respond_response(request: Request, call: _Call, builder: ResponseBuilder,
                            splitter: "ChoiceSplitter | None", logprobs: "ChatChoices | None",
                            ended: Callable[[ResponseBuilder], None]) -> Response:
    """A Responses API answer (`scheduler/server/responses.py`): the response object once its one choice is done,
    or (`stream`) its typed events. Each delta goes through the chat path's splitter (reasoning, content, calls)
    into the builder, in both cases; `ended(builder)` once it has ended (not failed)."""

    def add(delta: Delta) -> list[dict[str, Any]]:
        split = (splitter.feed(delta.text, final=delta.finish_reason is not None) if splitter is not None
                 else ChoiceText(content=delta.text))
        entries = logprobs.content_logprobs([delta]) if logprobs is not None else None
        return builder.add(split.reasoning, split.content, split.calls, len(delta.token_ids), entries)

    if not call.body.stream:
        pieces = await _collect(request, call)
        if pieces is None:
            return Response(status_code=499)
        deltas = [d for d in pieces[0] if d.prompt_token_ids is None]
        for delta in deltas:
            add(delta)
        builder.finish(deltas[-1].finish_reason if deltas else None, call.usage())
        ended(builder)
        return JSONResponse(builder.response())

    async def events() -> AsyncIterator[str]:
        used = False
        try:
            for event in builder.start():
                yield sse_event(event)
            finish = None
            async for _index, delta in call.deltas():
                if delta.prompt_token_ids is not None:
                    continue
                finish = delta.finish_reason or finish
                for event in add(delta):
                    yield sse_event(event)
            used = True
            last = builder.finish(finish, call.usage())
            ended(builder)
            for event in last:
                yield sse_event(event)
        except (ChoiceFailed, EngineStopped) as exc:
            for event in builder.fail(_failure(exc)):
                yield sse_event(event)
        finally:
            if not used:
                call.usage()  # hands the requests' records back

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _respond(request: Request, call: _Call, choices: "ChatChoices | TextChoices") -> Response:
    """The call's answer: one JSON body once every choice is done, or (`stream`) server-sent chunks."""
    body = call.body
    if not body.stream:
        pieces = await _collect(request, call)
        if pieces is None:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        out = {"id": call.id, "object": choices.object, "created": call.created, "model": call.model,
               "choices": [choices.final(i, pieces[i]) for i in range(call.choices)], "usage": call.usage()}
        if body.prompt_logprobs is not None:
            # each prompt's first choice scored it (`engine_prompt_logprobs`)
            rendered = {i: prompt_logprobs_field(choices.tokenizer, next(d.prompt for d in pieces[i] if d.prompt),
                                                 body.prompt_logprobs) for i in range(0, call.choices, body.n)}
            if isinstance(choices, ChatChoices):  # one prompt: the request's
                out["prompt_logprobs"] = rendered[0]
            else:  # each choice its prompt's
                for choice in out["choices"]:
                    choice["prompt_logprobs"] = rendered[choice["index"] - choice["index"] % body.n]
        if body.return_token_ids and isinstance(choices, ChatChoices):  # (a completion's are its choices')
            out["prompt_token_ids"] = next(d.prompt_token_ids for d in pieces[0] if d.prompt_token_ids is not None)
        return JSONResponse(out)

    async def events() -> AsyncIterator[str]:
        with_usage = body.include_usage
        try:
            # each choice's first chunk at once, or (return_token_ids) each when its prompt is known
            firsts = [choices.first(i) for i in range(call.choices)]
            if firsts[0] is not None and not body.return_token_ids:
                yield _sse(_chunk(call, choices.object, firsts, with_usage))
            async for index, delta in call.deltas():
                if delta.prompt_token_ids is not None:
                    if body.return_token_ids:
                        opening, top = choices.opening(index, delta.prompt_token_ids)
                        yield _sse({**_chunk(call, choices.object, [opening], with_usage), **top})
                    continue
                rendered = choices.delta(index, delta)
                if rendered is not None:
                    yield _sse(_chunk(call, choices.object, [rendered], with_usage))
            if with_usage:
                yield _sse({**_chunk(call, choices.object, [], False), "usage": call.usage()})
        except (ChoiceFailed, EngineStopped) as exc:
            yield _sse(_failure(exc).body())
        finally:
            if not with_usage:
                call.usage()  # hands the requests' records back (nothing is kept for a finished call)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(state: ServerState) -> Any:
    app = FastAPI(title="mlxsched", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    engine = state.engine
    media = engine.vlm.media_kinds if engine.vlm is not None else frozenset()  # (some families take audio only)
    vision, video = "image" in media, "video" in media
    token_bytes = TokenBytes(engine.tokenizer)  # (built once: it reads the tokenizer's decoder)
    audio_rate = getattr(engine.vlm, "sample_rate", None) if engine.vlm is not None else None
    # a thinking model's reasoning goes to `reasoning_content` (the markers mlx-lm's tokenizer declares; a
    # vision-language model's by mlx-lm's same rule, `VLMAdapter.thinking`)
    reasoning = ReasoningFormat.of(engine.tokenizer if engine.vlm is None else engine.vlm.thinking)
    # how the model writes tool calls (None: no format mlx-lm infers), once: its shape and markers are asked of
    # its parser (`ToolCallFormat.shape`) and kept
    call_format = ToolCallFormat.of(engine.tokenizer if engine.vlm is None else engine.vlm.tool_calling)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail), None,
                                     "not_found_error" if exc.status_code == 404 else "invalid_request_error").body(),
                            status_code=exc.status_code)

    async def engine_prompt(messages: list) -> EnginePrompt:
        """The messages converted (`convert_messages`; APIError 400 naming a bad part). A request that fetches
        media URLs converts on the engine's fetch pool: a slow host can hold up to the pool's size of such
        requests, never the text and data: URL requests, which convert on asyncio's default pool."""
        convert = functools.partial(convert_messages, messages, vision, audio_rate, video, state.local_media_dir,
                                    engine.media_fetch)
        fetching = engine.media_fetch is not None and fetches_media(messages)
        return await asyncio.get_running_loop().run_in_executor(
            state.aengine.media_fetch_pool if fetching else None, convert)

    async def chat_call(request: Request, body: ChatCompletionRequest, kind: str,
                        lora: str | None) -> tuple[_Call, ChatParsing | None]:
        """A chat's choices submitted (its messages converted, its tools, reasoning and output format worked out),
        and how their text is split (None: as it comes)."""
        tool_calling = tool_calling_of(body, call_format)
        prompt = await engine_prompt(body.messages)
        tools = tool_calling.tools if tool_calling is not None else None
        template_kwargs = body.template_kwargs()
        parsing, opens = None, False
        if reasoning is not None or tool_calling is not None:
            opens = reasoning is not None and await asyncio.to_thread(
                _opens_reasoning, engine, reasoning, prompt, tools, template_kwargs)
            parsing = ChatParsing(reasoning, opens, tool_calling)
        structured = output_constraint(body, tool_calling.format if tool_calling is not None else None, tools,
                                       reasoning.end if opens else None)
        call = _Call(state, body, kind, lora=lora, client_id=_client_id(request, body))
        await call.submit([dict(prompt=prompt.messages, images=prompt.images or None, videos=prompt.videos or None,
                                audio=prompt.audio or None, tools=tools, chat_template_kwargs=template_kwargs)],
                          prompt.part_of, structured)
        return call, parsing

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest, state.max_request_bytes)
        call, parsing = await chat_call(request, body, "chatcmpl", _check_model(state, body))
        choices = ChatChoices(engine.tokenizer, token_bytes, body.wants_logprobs(), body.stream, parsing,
                               body.return_token_ids)
        return await _respond(request, call, choices)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await _parse(request, ResponsesRequest, state.max_request_bytes)
        lora = _check_model(state, body)
        store = state.responses
        history = None
        if body.previous_response_id is not None:
            if store is None:
                raise APIError(400, "previous_response_id: this server keeps no responses (start it with "
                                    "--responses-store N): send the whole conversation as input",
                               "previous_response_id")
            history = store.history(body.previous_response_id)
        try:  # the chat path's checks, their errors named in the Responses request's terms
            chat = to_chat(body, history)
            call, parsing = await chat_call(request, chat, "resp", lora)
        except APIError as error:
            raise in_responses_terms(error) from None
        logprobs = ChatChoices(engine.tokenizer, token_bytes, True, False) if chat.logprobs else None
        builder = ResponseBuilder(call.id, body, call.model, stored=store is not None and body.store is not False)

        def ended(done: ResponseBuilder) -> None:
            if done.stored:
                store.put(done.id, StoredResponse(body.previous_response_id, input_items(body),
                                                  json.loads(json.dumps(done.items)), done.response()))

        return await _respond_response(request, call, builder, parsing.splitter() if parsing is not None else None,
                                       logprobs, ended)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        stored = state.responses.get(response_id) if state.responses is not None else None
        if stored is None:
            raise APIError(404, f"response_id: no stored response {response_id!r}", "response_id",
                           "invalid_request_error", "not_found")
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if state.responses is None or not state.responses.delete(response_id):
            raise APIError(404, f"response_id: no stored response {response_id!r}", "response_id",
                           "invalid_request_error", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, state.max_request_bytes)
        lora = _check_model(state, body)
        prompts = body.prompt_list()
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} choices; at most {MAX_CHOICES} in one "
                                "request", "n")
        call = _Call(state, body, "cmpl", len(prompts), lora=lora, client_id=_client_id(request, body))
        if body.echo:  # a text prompt as sent; token ids as the tokenizer decodes them
            call.echoes = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]
        await call.submit([dict(prompt=p) if isinstance(p, str) else dict(prompt_tokens=p) for p in prompts],
                          structured=output_constraint(body, None, None, None))
        choices = TextChoices(engine.tokenizer, body.wants_logprobs(), body.alternatives(), body.return_token_ids)
        return await _respond(request, call, choices)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's: the prompt token ids a completion of this prompt or chat would run on (the engine's own
        rendering, media expanded by the processor), with their count and the context limit."""
        body = await _parse(request, TokenizeRequest, state.max_request_bytes)
        _check_model(state, body)
        part_of, args = None, {"prompt": body.prompt}
        if body.messages is not None:
            prompt = await engine_prompt(body.messages)
            part_of = prompt.part_of
            args = dict(prompt=prompt.messages, images=prompt.images or None, videos=prompt.videos or None,
                        audio=prompt.audio or None, tools=body.tool_list(), chat_template_kwargs=body.template_kwargs())
        try:
            tokens = await state.aengine.tokenize(**args)
        except InvalidRequest as exc:
            raise refusal(body, exc, part_of) from None
        except EngineStopped as exc:
            raise APIError(503, f"the engine is not running: {exc}", None, "server_error") from None
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                "token_strs": engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's: token ids -> their text, as the tokenizer decodes them."""
        body = await _parse(request, DetokenizeRequest, state.max_request_bytes)
        _check_model(state, body)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids outside the vocabulary [0, {engine.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    def model_cards() -> dict[str, dict[str, Any]]:
        """The served model, then each LoRA adapter loaded now as a model of its own whose parent is it (vLLM's
        cards)."""
        return {name: {"id": name, "object": "model", "created": 0, "owned_by": "mlxsched",
                       "max_model_len": engine.max_model_len,
                       **({"parent": state.model_name} if name != state.model_name else {})}
                for name in (state.model_name, *state.loras)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(model_cards().values())}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve (`client.models.retrieve`): a served model's card, or 404 for another name."""
        cards = model_cards()
        if model not in cards:
            raise APIError(404, f"model: the model {model!r} does not exist here (serving "
                                f"{', '.join(map(repr, cards))})", "model", "invalid_request_error",
                           "model_not_found")
        return cards[model]

    def runtime_lora() -> None:
        if not state.allow_runtime_lora:
            raise APIError(404, "loading LoRA adapters at run time is off (start the server with "
                                "--allow-runtime-lora)", None, "invalid_request_error", "not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: serve the adapter at `lora_path` (a directory on this machine) as model `lora_name`; 400
        naming why where it cannot be."""
        runtime_lora()
        body = await _parse(request, LoadLoRARequest, state.max_request_bytes)
        if body.lora_name == state.model_name:
            raise APIError(400, f"lora_name: {body.lora_name!r} is the served model's name", "lora_name")
        try:  # (reads the adapter: off the event loop)
            await asyncio.to_thread(engine.load_lora, body.lora_name, body.lora_path)
        except ValueError as exc:  # LoRAError (the adapter), a name already loaded
            raise APIError(400, f"lora_path: {exc}" if isinstance(exc, LoRAError) else f"lora_name: {exc}",
                           "lora_path" if isinstance(exc, LoRAError) else "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: stop serving adapter `lora_name` (404 for one not loaded; 400 while requests run on it)."""
        runtime_lora()
        body = await _parse(request, UnloadLoRARequest, state.max_request_bytes)
        try:
            engine.unload_lora(body.lora_name)
        except UnknownLoRA as exc:
            raise APIError(404, f"lora_name: {exc}", "lora_name", "invalid_request_error", "not_found") from None
        except LoRAInUse as exc:
            raise APIError(400, f"lora_name: {exc}", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's version (the installed mlxsched distribution's)."""
        return {"version": _installed_version()}

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.aengine.running:
            return JSONResponse({"status": "ok"})
        error = state.aengine.error
        return JSONResponse(APIError(503, f"the engine loop is not running: {error!r}" if error is not None
                                     else "the engine is closed", None, "server_error").body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.aengine.running:  # cache sizes are read on the loop thread, between two ticks
            try:
                state.metrics.set_snapshot(await state.aengine.call(lambda: engine_snapshot(engine)))
            except EngineStopped:
                pass  # the loop stopped meanwhile: the event-fed metrics are still worth answering
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return _CountResponses(app, state.metrics)

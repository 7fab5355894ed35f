"""OpenAI's Responses API (`POST /v1/responses`) over the chat-completions path: the request becomes a chat
completion, and what the choice generates becomes the Responses API's output items and stream events.

What a request may hold (`ResponsesRequest`), and how it maps (`to_chat`):

* `input`: a string (one user message), or a list of items: messages (`{"role", "content"}`, optionally
  `"type": "message"`; roles user, system, developer, assistant; content a string or parts `input_text`,
  `input_image` with an `image_url`, and, in assistant messages sent back, `output_text` / `refusal`), a model's
  `function_call` sent back (consecutive calls become one assistant message with `tool_calls`), a
  `function_call_output` (a tool message answering its `call_id`), and `reasoning` items sent back (dropped: the
  chat template renders the conversation without earlier reasoning, as a chat completion sent back without it).
* `instructions`: a system message before the input.
* `tools`: function tools (`{"type": "function", "name", "description", "parameters"}`); `tool_choice` "auto",
  "none", "required" or `{"type": "function", "name"}`; `parallel_tool_calls`.
* `text.format`: "text", "json_object" or "json_schema" (`name`, `schema`, `strict`): the chat's response_format.
* `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` with `include: ["message.output_text.logprobs"]`,
  `metadata` (echoed), `user`, and vLLM's extras (`seed`, `top_k`, `min_p`, the penalties, `chat_template_kwargs`,
  `priority`, `cache_salt`, `request_id`).

`reasoning.effort` goes to the chat template as `reasoning_effort` (gpt-oss's template reads it), and "none" also as
`enable_thinking: false` (Qwen3's and the other thinking templates read that); `chat_template_kwargs` given too take
precedence. `previous_response_id` continues a stored response (`ResponseStore`, `mlxsched serve --responses-store
N`: the last N responses, each its own input and output items and the response it continued; `store: false` keeps
one out), and is refused by a server that keeps none. Refused naming the field, because this server cannot do what
they ask: `conversation` objects, `background`, `truncation: "auto"`, reasoning summaries, `prompt` templates, other
tool kinds (web search, file search, ...), other input kinds (files, audio).

The output (`ResponseBuilder`): a thinking model's reasoning becomes a `reasoning` item (its text as
`reasoning_text` content), the answer a `message` item with one `output_text` part, each tool call a
`function_call` item, in the order the model wrote them. A response cut at `max_output_tokens` is "incomplete"
(`incomplete_details.reason`); `usage.output_tokens_details.reasoning_tokens` counts the tokens whose text went to
the reasoning. Streaming sends the Responses API's typed events (`event: <type>` then `data: {...}`, each with its
`sequence_number`): `response.created`, `response.in_progress`, per item `response.output_item.added`, its
content part's `added`, text deltas (`response.output_text.delta`, `response.reasoning_text.delta`) or a call's
arguments (`response.function_call_arguments.delta` / `.done`), the part's and the item's `done`, and at the end
`response.completed` (or `response.incomplete`, or `response.failed` with the error).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import Field, StrictBool, StrictInt, ValidationError, field_validator

from .protocol import REQUEST_ID, APIError, ChatCompletionRequest, Number, _Strict, validation_error

OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value this server fills
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_logprobs: StrictInt | None = None
    include: list[str] | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    store: StrictBool | None = None  # accepted: nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    previous_response_id: str | None = None  # a stored response this one continues (`ResponseStore`)
    # refused where given (`_given`): what this server cannot do
    conversation: Any = None
    background: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extras, as on chat completions
    seed: StrictInt | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: StrictInt = 0
    cache_salt: str | None = None
    request_id: Union[str, None] = Field(default=None, pattern=REQUEST_ID)

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: Any) -> Any:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for item in v or ():
            if item != OUTPUT_TEXT_LOGPROBS:
                raise ValueError(f"{item!r}: only {OUTPUT_TEXT_LOGPROBS!r} is filled here")
        return v

    def wants_logprobs(self) -> bool:
        return OUTPUT_TEXT_LOGPROBS in (self.include or ()) or bool(self.top_logprobs)


_REFUSED = {
    "conversation": "this server keeps no conversations: send the whole conversation as input",
    "background": "responses run in the foreground here",
    "prompt": "prompt templates are not stored here",
}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    return [{"role": "user", "content": body.input}] if isinstance(body.input, str) else list(body.input)


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat completion a Responses request runs as: `history` (the conversation of the stored response it
    continues, as items) then its input, after its own instructions (a continued response's are not carried
    over, as OpenAI's are not). APIError 400 naming the Responses field for what cannot be translated."""
    for name, why in _REFUSED.items():
        if _given(getattr(body, name)):
            raise APIError(400, f"{name}: {why}", name)
    if body.truncation == "auto":
        raise APIError(400, "truncation: 'auto' is not done here (an input longer than the context is refused)",
                       "truncation")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else [])
    messages += _messages([*(history or ()), *input_items(body)])
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "parallel_tool_calls", "user", "cache_salt", "request_id"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    template_kwargs = {**_reasoning_kwargs(body.reasoning), **(body.chat_template_kwargs or {})}
    if template_kwargs:
        chat["chat_template_kwargs"] = template_kwargs
    chat["priority"] = body.priority
    if body.wants_logprobs():
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    if body.tools is not None:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None:
        chat["response_format"] = _text_format(body.text)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # what the chat checks refuse, named in the Responses request's terms
        raise in_responses_terms(validation_error(exc)) from None


_CHAT_FIELDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "messages": "input", "logprobs": "top_logprobs"}


def in_responses_terms(error: APIError) -> APIError:
    """An error the chat path raised about its request, naming the Responses request's field instead (a message
    of the input is named as the input: instructions and merged calls shift the indices)."""
    if error.param is None:
        return error
    head = error.param.split(".")[0]
    if head not in _CHAT_FIELDS:
        return error
    param = _CHAT_FIELDS[head]
    detail = error.message.split(": ", 1)[1] if error.message.startswith(error.param + ": ") else error.message
    return APIError(error.status, f"{param}: {detail}", param, error.type, error.code)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning_kwargs(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """`reasoning` as the chat template's arguments: `effort` as `reasoning_effort` (what gpt-oss's template
    reads; a template that does not is unaffected), and effort "none" also as `enable_thinking: false` (what
    Qwen3's and the other thinking templates read). Reasoning summaries are not written here: `summary` may be
    null or "auto" (the best summary there is: none)."""
    if not _given(reasoning):
        return {}
    unknown = {k for k, v in reasoning.items() if v is not None} - {"effort", "summary", "generate_summary"}
    if unknown:
        raise APIError(400, f"reasoning: {sorted(unknown)} not taken here (effort is)", "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "auto"):
            raise APIError(400, f"reasoning.{key}: reasoning summaries are not written here (null or 'auto')",
                           f"reasoning.{key}")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"reasoning.effort: one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       "reasoning.effort")
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}


def _given(value: Any) -> bool:
    """Whether a field asks for something: not absent, null, false, or an object of nulls (what clients send for
    settings they leave unset)."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return value is not None and value is not False


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object (a message or an item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", where), "type": "function",
                    "function": {"name": _text_field(item, "name", where),
                                 "arguments": _text_field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # the text and calls of one turn: one assistant message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list) and output and all(
                    isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                    and isinstance(p.get("text"), str) for p in output):
                output = "".join(p["text"] for p in output)  # the answer as text parts
            if not isinstance(output, str):
                raise APIError(400, f"{where}.output: must be a string or text parts (the tool's answer)",
                               f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning sent back: the template renders the turn without it
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not taken here (messages, function_call, "
                                "function_call_output and reasoning are)", f"{where}.type")
    if not out:
        raise APIError(400, "input: holds no message", "input")
    return out


def _text_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and name != "arguments"):  # (a call may take no arguments)
        raise APIError(400, f"{where}.{name}: must be a {'' if name == 'arguments' else 'non-empty '}string",
                       f"{where}.{name}")
    return value


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    # (an output message sent back as it came carries its id, status and unset fields: taken as they are)
    unknown = {k for k, v in item.items() if v is not None} - {"type", "role", "content", "id", "status", "phase"}
    if unknown:
        raise APIError(400, f"{where}: unknown fields {sorted(unknown)}", where)
    if role not in _ROLES:
        raise APIError(400, f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise APIError(400, f"{where}.content: must be a string or a non-empty list of parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{at}.image_url: an image URL (http(s) or data:) is required (file ids are "
                                    "not stored here)", f"{at}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": url, **(
                {"detail": part["detail"]} if isinstance(part.get("detail"), str) else {})}})
        else:
            raise APIError(400, f"{at}: a part of type {kind!r} is not taken here (input_text, input_image, and "
                                "in assistant messages output_text and refusal, are)", at)
    if role == "assistant":  # the chat path takes an assistant's content as text
        if any(p["type"] != "text" for p in parts):
            raise APIError(400, f"{where}.content: an assistant message holds text only", f"{where}.content")
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    where = f"tools.{i}"
    if tool.get("type") != "function":
        raise APIError(400, f"{where}.type: only function tools are served here, not {tool.get('type')!r}",
                       f"{where}.type")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise APIError(400, f"{where}: unknown fields {sorted(unknown)}", where)
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                   "tool_choice")


def _text_format(text: dict[str, Any]) -> dict[str, Any]:
    unknown = set(text) - {"format"} - ({"verbosity"} if text.get("verbosity") is None else set())
    if unknown:
        raise APIError(400, f"text: {sorted(unknown)} not taken here (format is)", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    if kind == "json_schema" and set(fmt) <= {"type", "name", "schema", "strict", "description"}:
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise APIError(400, "text.format: {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                        "\"json_schema\", \"name\", \"schema\", \"strict\"}", "text.format")


class ResponseBuilder:
    """One response's output items and stream events, built from its choice's text as it arrives: `add` each
    piece of it (`reasoning`, `content`, complete tool calls, as the chat path splits them) with its tokens, then
    `finish`. Each returns the stream events it makes (a non-streaming answer ignores them and takes
    `response()`)."""

    def __init__(self, response_id: str, body: ResponsesRequest, model: str, stored: bool = False):
        self.id = response_id
        self.body = body
        self.model = model
        self.stored = stored  # the server keeps it once it ends (`ResponseStore`)
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.reasoning_tokens = 0
        self._open: dict[str, Any] | None = None  # the item whose text is still arriving
        self._sequence = 0
        self._incomplete: str | None = None
        self._pending: list[dict[str, Any]] = []  # logprob entries of answer tokens that showed no text yet

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def add(self, reasoning: str, content: str, calls: list[dict[str, Any]], tokens: int,
            logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """A piece of the output: `tokens` produced it (counted as reasoning tokens when all its text is
        reasoning); `logprobs`: the entries of its tokens, with `include` logprobs."""
        events: list[dict[str, Any]] = []
        if reasoning and not content and not calls:
            self.reasoning_tokens += tokens
        # a token's logprob goes with the answer's text: tokens that show no text yet (held back, a partial
        # character) wait for the text that follows them; the reasoning's are not listed (output_text's only)
        self._pending += logprobs or []
        if reasoning:
            self._pending = [] if not content else self._pending
            events += self._text("reasoning", reasoning, None)
        if content:
            events += self._text("message", content, self._pending)
            self._pending = []
        for call in calls:
            events += self._close()
            item = {"id": f"fc_{uuid.uuid4().hex[:24]}", "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
            index = len(self.items)
            self.items.append(item)
            arguments = call["function"]["arguments"]
            events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=arguments))
            item.update(arguments=arguments, status="completed")
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=arguments, name=item["name"]))
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The end: `finish_reason` the chat path's ("length": cut at max_output_tokens), `usage` the chat
        call's."""
        if finish_reason == "length":
            self._incomplete = "max_output_tokens"
        events = self._close()
        if not self.items:  # an empty answer is still a message
            events += self._text("message", "", None) + self._close()
        self.status = "incomplete" if self._incomplete else "completed"
        details = usage.get("prompt_tokens_details") or {}
        self.usage = {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0),
                                               "cache_write_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": usage["total_tokens"]}
        kind = "response.incomplete" if self._incomplete else "response.completed"
        return events + [self._event(kind, response=self.response())]

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        self.status = "failed"
        self.error = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=self.response())]

    def response(self) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": self.model, "output": [dict(item) for item in self.items], "error": self.error,
            "incomplete_details": {"reason": self._incomplete} if self._incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": body.top_logprobs,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": self.stored,
            "metadata": body.metadata or {}, "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning, "user": body.user, "usage": self.usage,
        }

    @property
    def output_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])

    # ---- items whose text arrives in pieces ----------------------------------------------------------------
    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        index = len(self.items) - 1
        item = self._open
        part = item["content"][0]
        part["text"] += text
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text))
        else:
            part["logprobs"] += logprobs or []
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=logprobs or []))
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"id": f"rs_{uuid.uuid4().hex[:24]}", "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "status": "in_progress",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=index, item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=index,
                            content_index=0, part=dict(item["content"][0]))]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        item["status"] = "incomplete" if self._incomplete else "completed"
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}


@dataclass(frozen=True)
class StoredResponse:
    """A response kept for `previous_response_id` and `GET /v1/responses/{id}`: its own input and output items
    and the response it continued, so a conversation is its chain of responses (each stored once)."""

    previous_id: str | None
    input: list[dict[str, Any]]
    output: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    """The last `capacity` stored responses, least recently used evicted first (`mlxsched serve
    --responses-store N`; OpenAI keeps them server-side, vLLM behind a flag too). Each holds its input as sent,
    images included: the bound is the operator's memory budget. Touched on the event loop's thread only."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a response store holds at least 1 response, not {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation up to and including stored response `response_id`, as input items (each response's
        input, then its output), oldest first. APIError 400 naming `previous_response_id` where it, or a response
        it continues, is not stored (never was, deleted, or evicted)."""
        chain: list[StoredResponse] = []
        at: str | None = response_id
        while at is not None:
            stored = self.get(at)
            if stored is None:
                which = "is" if at == response_id else f"continues {at!r}, which is"
                raise APIError(400, f"previous_response_id: response {response_id!r} {which} not stored here "
                                    f"(it holds the last {self.capacity} stored responses)", "previous_response_id")
            chain.append(stored)
            at = stored.previous_id
        return [item for stored in reversed(chain) for item in (*stored.input, *stored.output)]


def sse_event(event: dict[str, Any]) -> str:
    """One Responses stream event: its type as the SSE event name, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


__all__ = ["OUTPUT_TEXT_LOGPROBS", "ResponseBuilder", "ResponseStore", "ResponsesRequest", "StoredResponse",
           "in_responses_terms", "input_items", "sse_event", "to_chat"]

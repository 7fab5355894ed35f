"""The OpenAI request bodies the server accepts (pydantic), and the error shape it answers with.

Unknown fields are refused (a misspelt `max_token` must not silently mean "no limit"); OpenAI fields this server
does not implement are accepted only at their no-op value and refused otherwise, naming the field. Sampling
ranges are checked by `SamplingParams` itself, so the server and the library refuse the same values.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from typing import Annotated

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator,
                      model_validator)

from .stops import StopRule

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_PROMPTS = 64  # prompts of one /v1/completions request
MAX_CHOICES = 256  # prompts x n: engine requests of one HTTP request
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and response format) names
# a client's request id (the body's `request_id`, the X-Request-Id header): printable ASCII without spaces
REQUEST_ID = r"^[!-~]{1,128}$"


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str:
    """pydantic's error location as the request's field path: union members (`str`, `list[...]`) and a tagged
    union's tag (it repeats the field under it) are pydantic's bookkeeping, not the body's structure."""
    parts: list[str] = []
    for p in loc:
        name = str(p)
        if isinstance(p, str) and (name in _TYPE_NAMES or "[" in name):
            continue
        if parts and parts[-1] == name and not isinstance(p, int):
            continue
        parts.append(name)
    return ".".join(parts)


def validation_error(exc: Any) -> APIError:
    """A pydantic ValidationError as a 400 naming the offending field (dotted path). Of the errors of one field
    (one per union member) the deepest is the one that says what is wrong."""
    errors = exc.errors()
    first_field = _param(errors[0].get("loc", ()))[:1]
    chosen = max((e for e in errors if _param(e.get("loc", ()))[:1] == first_field),
                 key=lambda e: len(e.get("loc", ())))
    param = _param(chosen.get("loc", ())) or None
    message = str(chosen.get("msg")).removeprefix("Value error, ")
    if param is None:  # a whole-body check: its message begins with the field it names ("prompt: ...")
        head, sep, _ = message.partition(": ")
        return APIError(400, message, head if sep and head.isidentifier() else None)
    return APIError(400, f"{param}: {message}", param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


Number = Union[StrictInt, float]


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # (`schema` is a pydantic name)
    strict: StrictBool | None = None  # accepted: the output always keeps to the schema here


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: give it with type 'json_schema', and only then")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a choice of strings, a Lark grammar or
    any JSON object."""

    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")  # (`json` is a pydantic name)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got "
                             f"{', '.join(given) or 'none'})")
        return self


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # -1 means no limit (vLLM's convention), as 0 does
    min_p: Number | None = None
    presence_penalty: Number | None = None
    repetition_penalty: Number | None = None
    frequency_penalty: Number | None = None
    stop: Union[str, list[Union[str, StrictInt]], None] = None  # strings, or token ids
    stop_token_ids: list[StrictInt] | None = None  # vLLM's field
    ignore_eos: StrictBool = False  # vLLM's: the model's end-of-sequence tokens do not end the choice
    # vLLM's: the stop tokens are masked and the stop strings not matched until a choice has this many tokens
    min_tokens: StrictInt = 0
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: the only tokens a choice may sample
    include_stop_str_in_output: StrictBool = False  # vLLM's: the matched stop string ends the text, kept in it
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain (as the tokenizer encodes them)
    # vLLM's: only the last this many prompt tokens are kept (-1: as many as the context allows)
    truncate_prompt_tokens: StrictInt | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0  # ours: larger is served earlier under --policy priority
    user: str | None = None  # accepted and ignored (OpenAI's end-user id)
    logit_bias: dict[str, Number] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # OpenAI's (vLLM takes it on completions too)
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's: each prompt token's logprob and rank, and this many most likely tokens at its position (0..20), in
    # the answer's `prompt_logprobs` (each choice's on /v1/completions, the request's on chat); not when streaming
    prompt_logprobs: StrictInt | None = None
    # vLLM's: only requests with the same salt share prompt prefixes in the prefix cache (a tenant cannot learn
    # another's prompts from how fast its own are answered)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: the answer's id is "<kind>-<request_id>" (the X-Request-Id header, where sent, takes its place)
    request_id: Annotated[str, Field(pattern=REQUEST_ID)] | None = None
    # vLLM's: the answer carries token ids next to the text: each choice's `token_ids` (the tokens it produced, a
    # stop token included; per chunk when streaming) and its prompt's `prompt_token_ids` (chat: the answer's,
    # in the first chunk of each choice when streaming; completions: each choice's, in its first chunk)
    return_token_ids: StrictBool = False
    # vLLM's: the tokenizer's special tokens are left out of the text (the default, false, shows them as mlx-lm's
    # server does; vLLM's default is true). Their ids stay in token_ids and logprobs
    skip_special_tokens: StrictBool = False

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v is not None and v < 1 and v != -1:
            raise ValueError("must be an integer >= 1, or -1 (as many as the context allows)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not word.strip() for word in v):
            raise ValueError("words must not be empty")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None:
            if not 0 <= v <= 20:
                raise ValueError("must be in [0, 20]")
            if info.data.get("stream"):
                raise ValueError("is not available with stream: true (the answer's prompt_logprobs is not streamed)")
        return v

    def engine_prompt_logprobs(self, first_choice: bool) -> int | None:
        """A choice's `SamplingParams.prompt_logprobs`: what its echo reads (`prompt_alternatives`) and, for the
        first choice of a prompt, what `prompt_logprobs` asks (a prompt's choices share its scores); None: neither."""
        asked = [k for k in (self.prompt_alternatives(), self.prompt_logprobs if first_choice else None)
                 if k is not None]
        return max(asked) if asked else None

    @field_validator("structured_outputs")
    @classmethod
    def _one_output_format(cls, v: Any, info: ValidationInfo) -> Any:
        given = info.data.get("response_format")
        if v is not None and given is not None and given.type != "text":
            raise ValueError("give it or response_format, not both")
        return v

    def output_format_given(self) -> bool:
        """A response_format other than "text"."""
        return self.response_format is not None and self.response_format.type != "text"

    @field_validator("n")
    @classmethod
    def _n_range(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"must be in [1, {MAX_N}]")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for token {key}")
        return v

    def bias_by_id(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(isinstance(s, str) and not s for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_strings(self) -> list[str]:
        items = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in items if isinstance(s, str)]

    def stop_rule(self) -> StopRule:
        return StopRule(tuple(self.stop_strings()), self.include_stop_str_in_output, self.min_tokens)

    def stop_ids(self) -> list[int]:
        items = [] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in items if isinstance(s, int)] + list(self.stop_token_ids or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class VideoURL(_Strict):
    url: str


class InputAudio(_Strict):
    data: str  # base64
    format: str = "wav"


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[Union[TextPart, ImagePart, VideoPart, AudioPart], Field(discriminator="type")]




class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; the chat template renders it
    # accepted: a forced call (tool_choice "required" / named) keeps to `parameters` either way; "auto" calls are free
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(_Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: str  # JSON, as OpenAI returns it and clients send it back


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls (a chat sent back with them)
    tool_call_id: str | None = None  # a tool message's answer to this call

    @field_validator("content")
    @classmethod
    def _some_content(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        return v

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message answers a call: give its id")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message answers a call")
        return self


_ENDINGS = ("add_generation_prompt", "continue_final_message")


def _check_ending(body: Any) -> None:
    """vLLM's `add_generation_prompt` and `continue_final_message` of a chat: given as fields, not also in
    chat_template_kwargs; not both true; a continued final message is an assistant's. (`continue_final_message`
    alone turns the generation prompt off, as the engine's chat_template_kwargs do.)"""
    given = [name for name in _ENDINGS if name in body.model_fields_set]
    twice = [name for name in given if name in (body.chat_template_kwargs or {})]
    if twice:
        raise ValueError(f"{twice[0]}: given as a field and in chat_template_kwargs; give it once")
    if not body.continue_final_message:
        return
    if "add_generation_prompt" in given and body.add_generation_prompt:
        raise ValueError("continue_final_message: add_generation_prompt and continue_final_message exclude each "
                         "other: a continued message gets no generation prompt")
    if body.messages and body.messages[-1].role != "assistant":
        raise ValueError(f"continue_final_message: the last message must be the assistant's to continue, not "
                         f"{body.messages[-1].role!r}'s")


def _template_kwargs(body: Any) -> dict[str, Any] | None:
    """The chat template's extra arguments (None: none), with `enable_thinking` (vllm-mlx's field) and the ending
    fields (vLLM's) folded in where given."""
    ending = {name: getattr(body, name) for name in _ENDINGS if name in body.model_fields_set}
    if body.chat_template_kwargs is None and body.enable_thinking is None and not ending:
        return None
    return {**(body.chat_template_kwargs or {}), **ending,
            **({"enable_thinking": body.enable_thinking} if body.enable_thinking is not None else {})}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    # "auto" (the default with tools): the model may call them; "none": it is not offered them; "required": it
    # calls one or more; a named function: it calls that one, once (the last two constrain decoding to calls)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None  # false: only the first call is returned
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra arguments of the chat template
    enable_thinking: StrictBool | None = None  # vllm-mlx's: chat_template_kwargs {"enable_thinking": ...}
    # vLLM's: how the prompt ends: the generation prompt, or (continue_final_message) the last message, an
    # assistant's, left open for the model to go on (an assistant prefill); the answer is what follows it
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _ending(self) -> "ChatCompletionRequest":
        _check_ending(self)
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v == "none":
            return v
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("is only allowed when tools are given")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names {v.function.name!r}, which is not one of the tools")
        response_format = info.data.get("response_format")
        if v != "auto" and (info.data.get("structured_outputs") is not None or (
                response_format is not None and response_format.type != "text")):
            raise ValueError("a forced tool call and an output format cannot both hold; give one")
        return v

    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the output is tool calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def template_kwargs(self) -> dict[str, Any] | None:
        return _template_kwargs(self)

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools offered to the model (the chat template's `tools`), or None (none given, or tool_choice
        "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v: list) -> list:
        if not v:
            raise ValueError("must hold at least one message")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None:
            if not 0 <= v <= 20:
                raise ValueError("must be in [0, 20]")
            if v and not info.data.get("logprobs"):
                raise ValueError("needs logprobs: true")
        return v

    def token_limit(self) -> tuple[int | None, str]:
        """(max tokens, the field that set it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def alternatives(self) -> int:
        """How many most likely tokens to list next to each output token."""
        return self.top_logprobs or 0

    def prompt_alternatives(self) -> int | None:
        return None  # chat completions have no echo

    def prompt_only(self) -> bool:
        return False  # max_tokens 0 is refused here


class CompletionRequest(_Sampling):
    # one prompt (text or token ids) or several (a list of texts or of token-id lists): each gets `n` choices
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: StrictInt | None = None  # legacy: number of alternatives per token, 0..5
    # the prompt before the completion: in the text, and with `logprobs` in the logprobs too (each prompt token's
    # logprob given the ones before it, the first null: what lm-eval's loglikelihood tasks read)
    echo: StrictBool = False

    @model_validator(mode="after")
    def _echo_whole(self) -> "CompletionRequest":
        if self.echo and self.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens: not with echo, which shows the prompt as sent")
        return self

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v: Any) -> Any:
        if not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
            if any(not p for p in v):
                raise ValueError("no prompt of the list may be empty")
        return v

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one or several: texts or token-id lists."""
        one = isinstance(self.prompt, str) or not isinstance(self.prompt[0], (str, list))
        return [self.prompt] if one else list(self.prompt)

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 5:
            raise ValueError("must be in [0, 5]")
        return v

    def token_limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def alternatives(self) -> int:
        """How many most likely tokens to list next to each output token (the legacy `logprobs: N`)."""
        return self.logprobs or 0

    def prompt_alternatives(self) -> int | None:
        """With echo and logprobs, the engine's `prompt_logprobs` (alternatives per prompt token); else None."""
        return self.alternatives() if self.echo and self.wants_logprobs() else None

    def prompt_only(self) -> bool:
        """`max_tokens: 0`: no completion, only the prompt (with echo and logprobs: scoring it, the legacy API's
        way and older lm-eval's)."""
        return self.max_tokens == 0


class LoadLoRARequest(_Strict):
    """vLLM's `POST /v1/load_lora_adapter`: an adapter directory on the server, served under a name."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRARequest(_Strict):
    """vLLM's `POST /v1/unload_lora_adapter`."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: StrictInt | None = None  # vLLM's; accepted and ignored (names identify adapters here)


class TokenizeRequest(_Strict):
    """vLLM's `POST /tokenize`: a text prompt or chat messages (with media parts, tools, template arguments and
    the prompt's ending as a chat completion takes them) -> the prompt token ids the engine would run for them.
    Special tokens are added as the engine adds them, the only choice here."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # vLLM's; only the engine's choice (prompt: true, messages: false)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: StrictBool | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must hold at least one message")
        if self.prompt is not None and (self.tools is not None or self.chat_template_kwargs is not None
                                        or self.enable_thinking is not None):
            raise ValueError("tools: tools and chat template arguments go with messages, not with a text prompt")
        engine_adds = self.prompt is not None  # a text prompt is encoded with the tokenizer's special tokens
        if self.add_special_tokens is not None and self.add_special_tokens != engine_adds:
            raise ValueError(f"add_special_tokens: the engine encodes a {'prompt' if engine_adds else 'chat'} with "
                             f"add_special_tokens={str(engine_adds).lower()}, the only choice here")
        ending = [name for name in _ENDINGS if name in self.model_fields_set]
        if self.prompt is not None and ending:
            raise ValueError(f"{ending[0]}: how a chat prompt ends goes with messages, not with a text prompt")
        _check_ending(self)
        return self

    def template_kwargs(self) -> dict[str, Any] | None:
        return _template_kwargs(self)

    def tool_list(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize`: token ids -> their text."""

    model: str | None = None
    tokens: list[StrictInt]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}

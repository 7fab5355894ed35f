"""Typed request objects: sampling parameters (validated on construction), finish reasons, the request itself.

A request's progress is counters, not flags: `num_computed_tokens` catches up to the prompt length during
prefill (chunked or not), and output tokens accumulate during decoding.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .lifecycle import RequestState

if TYPE_CHECKING:  # pragma: no cover
    from .plan import NewRequest

LogitsProcessor = Callable[[Any, Any], Any]  # (tokens so far: mx.array, logits (1, V)) -> logits
Sampler = Callable[[Any], Any]  # (logprobs (1, V): mx.array) -> token (1,), as mlx-lm's make_sampler returns


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class InvalidRequest(ValueError):
    """A request the engine refuses; raised by `add_request`, nothing is queued. `field` names the culprit."""

    def __init__(self, field_name: str, message: str, request_id: str | None = None):
        self.field = field_name
        self.request_id = request_id
        super().__init__(f"{field_name}: {message}" if field_name else message)


def media_field(kind: str) -> str:
    """The add_request argument of a media kind: "image" -> "images", "video" -> "videos", "audio" -> "audio"."""
    return kind if kind == "audio" else f"{kind}s"


class UnreadableMedia(InvalidRequest):
    """An image, video or audio clip of the request cannot be used (it does not decode, or the model's processor
    refuses it). `kind` is "image", "video" or "audio"; `index` its position in the request's list of that kind
    (None when the failure cannot be pinned on one item); `field` the add_request argument ("images", ...)."""

    def __init__(self, kind: str, index: int | None, reason: str, request_id: str | None = None):
        self.kind, self.index, self.reason = kind, index, reason
        where = f"{kind} {index}" if index is not None else f"{kind}s"
        super().__init__(media_field(kind), f"unreadable {where}: {reason}", request_id)


class UnknownRequest(KeyError):
    """An id the engine never saw (abort / state_of)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__(request_id)

    def __str__(self) -> str:
        return f"unknown request id {self.request_id!r}"


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(field_name, message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class StructuredKind(str, enum.Enum):
    """What a `StructuredOutput` constrains the output to."""

    JSON = "json"  # a JSON value matching a JSON schema (`spec`: the schema as compact JSON text, key order kept)
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's `response_format: json_object`; `spec` unused)
    REGEX = "regex"  # text matching a regular expression (llguidance's syntax, close to Rust's `regex`)
    CHOICE = "choice"  # exactly one of some strings (`spec`: a JSON list of them)
    GRAMMAR = "grammar"  # a Lark grammar, as llguidance reads it (`%json {...}` embeds a schema)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (vLLM's `structured_outputs`, OpenAI's `response_format`): before each
    token is sampled, every token the constraint cannot continue with is masked out (`scheduler.execution.
    structured`), so greedy or sampled, the text stays within it, and once it is complete only an end-of-sequence
    token is allowed. A value, so traces record it and the shard wire carries it; build one with the class
    methods. A spec the engine cannot compile is refused on arrival (`InvalidRequest`, field
    `structured_output`).

    ``after``: the constraint starts once the output contains this text (a thinking model's end-of-reasoning
    marker, e.g. ``</think>``: the reasoning is free, the answer constrained; the server sets it when the prompt
    opens the reasoning); empty: from the first token."""

    kind: StructuredKind
    spec: str = ""
    after: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.kind, StructuredKind), "structured_output",
               f"kind must be a StructuredKind, got {self.kind!r}")
        _check(isinstance(self.spec, str), "structured_output", f"spec must be a str, got {type(self.spec).__name__}")
        _check(bool(self.spec) or self.kind is StructuredKind.JSON_OBJECT, "structured_output",
               f"a {self.kind.value} constraint needs a spec")
        _check(isinstance(self.after, str), "structured_output", f"after must be a str, got {self.after!r}")

    @classmethod
    def json(cls, schema: Mapping[str, Any] | str, after: str = "") -> "StructuredOutput":
        """A JSON value matching ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequest("structured_output", f"the JSON schema is not JSON: {exc}") from None
        _check(isinstance(schema, Mapping), "structured_output",
               f"a JSON schema must be an object, got {type(schema).__name__}")
        # key order kept: it is the output's
        return cls(StructuredKind.JSON, json.dumps(schema, separators=(",", ":")), after)

    @classmethod
    def json_object(cls, after: str = "") -> "StructuredOutput":
        return cls(StructuredKind.JSON_OBJECT, "", after)

    @classmethod
    def regex(cls, pattern: str, after: str = "") -> "StructuredOutput":
        return cls(StructuredKind.REGEX, pattern, after)

    @classmethod
    def choice(cls, choices: Sequence[str], after: str = "") -> "StructuredOutput":
        _check(isinstance(choices, (list, tuple)) and bool(choices) and all(isinstance(c, str) and c for c in choices),
               "structured_output", f"choices must be a non-empty list of non-empty strings, got {choices!r}")
        return cls(StructuredKind.CHOICE, json.dumps(list(choices)), after)

    @classmethod
    def grammar(cls, lark: str, after: str = "") -> "StructuredOutput":
        return cls(StructuredKind.GRAMMAR, lark, after)

    def to_record(self) -> dict[str, str]:
        return {"kind": self.kind.value, "spec": self.spec, **({"after": self.after} if self.after else {})}

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> "StructuredOutput":
        return cls(StructuredKind(record["kind"]), record.get("spec", ""), record.get("after", ""))


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults are greedy with no filters (temperature 0)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from a token's logit once per time it occurs among the last 20 tokens (mlx-lm's
    # `make_frequency_penalty`, after the repetition and presence penalties)
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's: the model's own end-of-sequence tokens do not end this request (it runs to max_tokens, the context
    # limit or one of stop_token_ids); what a load test asks for to fix each output's length
    ignore_eos: bool = False
    # vLLM's: until this many tokens are generated, the tokens that would end the request (the model's
    # end-of-sequence tokens unless ignore_eos, and stop_token_ids) are masked out of sampling, and the server
    # does not match stop strings. A row does not draft until it has them (its verify positions are unmasked).
    min_tokens: int = 0
    seed: int | None = None
    logprobs: bool = False
    # with logprobs: this many most likely tokens and their logprobs for each output token, from the same
    # log-softmax the chosen token's logprob comes from (OpenAI's `top_logprobs`, 0..20)
    top_logprobs: int = 0
    # the logprob of every prompt token given the ones before it (the first has none), and this many most likely
    # tokens at each position: vLLM's `prompt_logprobs` (None: off; 0..20). What `echo` + `logprobs` of the
    # completions API read. A request that asks is computed from its first token: the prefix cache is not
    # looked up for it.
    prompt_logprobs: int | None = None
    logits_processors: tuple[LogitsProcessor, ...] = ()
    # A custom sampling function (mlx-lm's `make_sampler(...)` shape) that picks this request's tokens instead of
    # the temperature / top_p / top_k / min_p fields; it is Python, so the row is sampled on its own and never
    # drafts. None: the fields decide (vectorised across the batch).
    sampler: Sampler | None = None
    # False keeps this request out of speculative decoding even when the engine drafts (vllm-mlx's mllm_draft)
    allow_drafts: bool = True
    # added to these tokens' logits before anything else (OpenAI's and mlx-lm's `logit_bias`): a {token id: bias}
    # mapping or (id, bias) pairs, kept as pairs sorted by id; ids are checked against the vocabulary on arrival
    logit_bias: Any = ()
    # a constraint on the output (JSON schema, regex, choice, grammar): tokens it rules out are masked before
    # sampling, after the logit bias and any processors; the row never drafts. None: unconstrained.
    structured_output: StructuredOutput | None = None
    # vLLM's: the only tokens this request may sample (every other is masked, after the logit bias and any
    # processors; list an end-of-sequence token for the request to be able to end on it); the row never drafts.
    # None: all. Kept sorted; ids are checked against the vocabulary on arrival.
    allowed_token_ids: tuple[int, ...] | None = None
    # token sequences the output may not contain (Hugging Face's `bad_words_ids`; vLLM's `bad_words` as the
    # tokenizer encodes them): a one-token sequence is masked at every step, a longer one's last token wherever the
    # output so far ends with the rest of it (the output only, as vLLM matches); the row never drafts
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's: only the last this many prompt tokens are kept (the prompt as rendered; one with media is refused,
    # which this would cut into). None: the whole prompt, refused when it leaves no room under max_model_len.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        # InvalidRequest is a ValueError whose message starts with the field name.
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
               f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p < 1, "min_p",
               f"must be in [0, 1), got {self.min_p!r}")
        _check(_is_real(self.presence_penalty), "presence_penalty",
               f"must be a finite number, got {self.presence_penalty!r}")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be a finite number > 0, got {self.repetition_penalty!r}")
        _check(_is_real(self.frequency_penalty), "frequency_penalty",
               f"must be a finite number, got {self.frequency_penalty!r}")
        stops = self.stop_token_ids
        _check(isinstance(stops, (tuple, list)) and all(_is_int(t) and t >= 0 for t in stops),
               "stop_token_ids", f"must be a sequence of non-negative token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**32), "seed",
               f"must be None or an integer in [0, 2**32), got {self.seed!r}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(isinstance(self.logprobs, bool), "logprobs", f"must be a bool, got {self.logprobs!r}")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        _check(self.logprobs or not self.top_logprobs, "top_logprobs", "needs logprobs=True")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
               "prompt_logprobs",
               f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        procs = self.logits_processors
        _check(isinstance(procs, (tuple, list)) and all(callable(p) for p in procs), "logits_processors",
               "must be a sequence of callables (tokens, logits) -> logits")
        object.__setattr__(self, "logits_processors", tuple(procs))
        _check(self.sampler is None or callable(self.sampler), "sampler",
               "must be None or a callable logprobs (1, V) -> token (1,)")
        _check(isinstance(self.allow_drafts, bool), "allow_drafts", f"must be a bool, got {self.allow_drafts!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        _check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
               "structured_output", f"must be None or a StructuredOutput, got {type(self.structured_output).__name__}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            _check(isinstance(allowed, (tuple, list)) and allowed and all(_is_int(t) and t >= 0 for t in allowed)
                   and len(set(allowed)) == len(allowed), "allowed_token_ids",
                   f"must be None or a non-empty sequence of distinct token ids (integers >= 0), got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(allowed)))
            _check(self.structured_output is None, "allowed_token_ids",
                   "cannot be combined with a structured output (the constraint decides the tokens)")
        bad = self.bad_words_ids
        _check(isinstance(bad, (tuple, list)) and all(
            isinstance(seq, (tuple, list)) and seq and all(_is_int(t) and t >= 0 for t in seq) for seq in bad),
            "bad_words_ids", f"must be a sequence of non-empty token-id sequences, got {bad!r}")
        object.__setattr__(self, "bad_words_ids", tuple(tuple(int(t) for t in seq) for seq in bad))
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                       and self.truncate_prompt_tokens >= 1),
               "truncate_prompt_tokens", f"must be None or an integer >= 1, got {self.truncate_prompt_tokens!r}")
        # a finished grammar allows only the end of the output, which min_tokens would mask: nothing left to sample
        _check(not (self.min_tokens and self.structured_output is not None), "min_tokens",
               "cannot be combined with a structured output (the constraint decides where the output ends)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalty(self) -> bool:
        """Whether a penalty rewrites the logits from the row's recent tokens (presence, repetition, frequency)."""
        return self.presence_penalty != 0 or self.repetition_penalty != 1 or self.frequency_penalty != 0

    def to_record(self) -> dict[str, Any]:
        """JSON-ready fields for the trace. Logits processors are code: only their count is recorded."""
        record = {f: getattr(self, f) for f in _RECORDED_SAMPLING_FIELDS}
        record["stop_token_ids"] = list(self.stop_token_ids)
        record["num_logits_processors"] = len(self.logits_processors)
        record["custom_sampler"] = self.sampler is not None
        if self.logit_bias:
            record["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if self.structured_output is not None:
            record["structured_output"] = self.structured_output.to_record()
        if self.allowed_token_ids is not None:
            record["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words_ids:
            record["bad_words_ids"] = [list(seq) for seq in self.bad_words_ids]
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "SamplingParams":
        # a field a trace predates takes its default (top_logprobs came after the first traces)
        return cls(**{f: record[f] for f in _RECORDED_SAMPLING_FIELDS if f in record},
                   stop_token_ids=tuple(record["stop_token_ids"]), logit_bias=record.get("logit_bias", ()),
                   structured_output=None if record.get("structured_output") is None
                   else StructuredOutput.from_record(record["structured_output"]),
                   allowed_token_ids=record.get("allowed_token_ids"), bad_words_ids=record.get("bad_words_ids", ()))


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """`SamplingParams.logit_bias` as (token id, bias) pairs sorted by id; InvalidRequest naming the field for a
    negative or non-integer id, a bias that is not a finite number, or an id given twice."""
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    ok = isinstance(pairs, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _is_real(p[1])
        for p in pairs)
    _check(ok, "logit_bias", f"must map token ids (integers >= 0) to finite numbers, got {value!r}")
    ids = [int(i) for i, _ in pairs]
    _check(len(set(ids)) == len(ids), "logit_bias", "a token id is given twice")
    return tuple(sorted((int(i), float(b)) for i, b in pairs))


_RECORDED_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                             "repetition_penalty", "frequency_penalty", "seed", "logprobs", "top_logprobs",
                             "prompt_logprobs", "ignore_eos", "min_tokens", "truncate_prompt_tokens")
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


@dataclass(frozen=True)
class MediaItemRef:
    """A media item of a request whose family keys media per item, as the scheduler and the traces see it: what
    the vision cache holds it under, and what encoding it costs (the what-if simulator counts a chat turn's
    earlier images as vision-cache hits by these keys)."""

    key: str  # its content key (the vision cache's)
    tokens: int  # the prompt positions it fills
    count: int  # encoder-budget units: 1 per image, the temporal patches of a video

    def to_record(self) -> list:
        return [self.key, self.tokens, self.count]

    @classmethod
    def from_record(cls, record: Sequence) -> "MediaItemRef":
        key, tokens, count = record
        return cls(str(key), int(tokens), int(count))


@dataclass(eq=False)  # identity semantics: the state machine keeps models in a list
class Request:
    """One request moving through the lifecycle. The `Lifecycle` machine owns `state`."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_tick: int = 0
    num_images: int = 0  # media items (encoder-budget units: `PreparedRequest.num_media_items`)
    num_media_tokens: int = 0  # prompt positions its media fill (`vision_token_budget` counts them)
    media: Any = None  # the model's preprocessed inputs (VLM: PreparedRequest); released once encoded
    media_key: str | None = None  # content key of the ordered media (the vision cache's key)
    # (first prompt position, key) per stretch of the prompt whose state depends on the media so far (one per
    # media item where the model layer tells them apart, else one for all: `PreparedRequest.media_marks`).
    # Prefix-cache keys carry them (`prefix_key`), so the text before the first is shared with any request.
    media_marks: tuple[tuple[int, str], ...] = ()
    media_items: tuple[MediaItemRef, ...] = ()  # per item where the model layer keys media per item, else ()
    media_encoded: bool = False
    # 0, or the prompt position its first prefill chunk must reach: that chunk starts at position 0 (a prefix hit
    # shorter than this is not taken) and feeds at least this far, in one forward of its own. A model whose media
    # tokens attend to each other both ways (Gemma 4's images: `FamilySpec.token_types_input`) computes them so only
    # in one forward that holds them all, as mlx_vlm.generate prefills such a prompt
    first_chunk_reach: int = 0
    # the LoRA adapter it runs on (`Engine(loras=...)` names them; None: the base model). Its KV depends on it, so
    # its prefix-cache keys carry it (`prefix_key`): only requests on the same adapter share a prefix
    lora: str | None = None
    # vLLM's cache_salt: only requests with the same salt share a prefix (a tenant's prompts cannot be probed by
    # another's cache hits); its prefix-cache keys carry it as they carry the adapter
    cache_salt: str | None = None
    seed: int = 0  # effective sampling seed (sampling.seed or derived from the engine seed and id)
    # the context limit: prompt + outputs never exceed it (Scheduler.add sets it; None: only max_tokens caps)
    max_model_len: int | None = None
    # progress counters
    num_computed_tokens: int = 0  # prompt tokens whose keys/values are in the KV cache
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # sampling.top_logprobs > 0
    # sampling.prompt_logprobs set: entry i is prompt token i's logprob (None for token 0), and its most likely
    # alternatives; filled as prefill computes them (a recompute after a preemption adds nothing new)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprob_ranks: list[int | None] = field(default_factory=list)  # each one's rank (PromptLogprobs.ranks)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    recompute_tokens: int = 0  # output tokens re-fed as prompt after a preemption
    # timestamps (measurements, never read by the planner)
    arrival_time: float = 0.0
    state_entered_time: float = 0.0
    state: RequestState = RequestState.QUEUED
    # May this row propose draft tokens? Not when its next tokens depend on per-position Python or history the
    # verifier does not replay (logits processors, logit bias, a structured output, allowed token ids, bad words,
    # a custom sampler, penalties, per-token logprobs), nor when it opted out (allow_drafts). A decision fact,
    # recorded in the trace (processors are code and cannot be), so replay rebuilds it; None: derived from
    # `sampling`.
    draft_eligible: bool | None = None

    def __post_init__(self) -> None:
        if self.draft_eligible is None:
            s = self.sampling
            self.draft_eligible = s.allow_drafts and not (
                s.logits_processors or s.sampler is not None or s.logprobs or s.has_penalty or s.logit_bias
                or s.structured_output is not None or s.allowed_token_ids is not None or s.bad_words_ids)

    @classmethod
    def from_new_request(cls, new: "NewRequest") -> "Request":
        """An executor's own copy of a request the plan brings (`TickPlan.new_requests`): the prompt, the
        outputs re-fed after a preemption, sampling, seed and media; never attached to a lifecycle."""
        return cls(new.request_id, list(new.prompt_tokens), new.sampling, seed=new.seed, media=new.media,
                   num_images=new.num_images, media_key=new.media_key, media_marks=new.media_marks,
                   first_chunk_reach=new.first_chunk_reach, recompute_tokens=new.recompute_tokens, lora=new.lora,
                   output_tokens=list(new.output_tokens))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)

    @property
    def prefill_len(self) -> int:
        """Tokens to compute before decoding: the prompt, plus the outputs so far after a preemption."""
        return self.prompt_len + self.recompute_tokens

    def prefill_tokens(self, start: int, end: int) -> list[int]:
        prompt = self.prompt_tokens
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_tokens[: self.recompute_tokens])[start:end]

    @property
    def media_offset(self) -> int | None:
        """The prompt position of its first media token (None: no media)."""
        return self.media_marks[0][0] if self.media_marks else None

    def prefix_key(self, n: int) -> tuple:
        """The prefix cache's key of the first `n` prefill tokens: the token ids up to the first media mark,
        then (key of the last mark so far, token id) pairs. KV state before the first media token depends on
        the text alone, so it is shared between text-only requests and requests with any media; from a mark on
        it depends on the media up to that mark, which the pairs carry (a match there needs the same media so
        far: a chat turn that adds an image shares the turns before it). On a LoRA adapter or with a cache salt
        every item is paired with (adapter, salt): the state depends on the adapter from the first token on, and
        a salt keeps its prefixes to requests with the same salt."""
        tokens = self.prefill_tokens(0, n)
        marks = self.media_marks
        key: list = tokens[: min(marks[0][0], n)] if marks else list(tokens)
        for (start, media), (end, _) in zip(marks, (*marks[1:], (n, None))):
            key += [(media, t) for t in tokens[start: max(start, min(end, n))]]
        if self.lora is not None or self.cache_salt is not None:
            namespace = (self.lora, self.cache_salt)
            return tuple((namespace, item) for item in key)
        return tuple(key)

    @property
    def num_prompt_remaining(self) -> int:
        return self.prefill_len - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_tokens)

    @property
    def before_min_tokens(self) -> bool:
        """Whether its next token is still among the first `min_tokens`: its stop tokens are masked out of that
        token's sampling, and it does not draft."""
        return len(self.output_tokens) < self.sampling.min_tokens

    @property
    def output_limit(self) -> int:
        """The most output tokens this request produces: `max_tokens`, capped so that prompt + outputs fit in
        `max_model_len` (vLLM's rule); reaching it ends the request with LENGTH."""
        if self.max_model_len is None:
            return self.sampling.max_tokens
        return min(self.sampling.max_tokens, self.max_model_len - self.prompt_len)

    def media_units(self) -> tuple[tuple[str | None, int, int], ...]:
        """Its encoder units, as the vision cache and the encoders see them: (key, media items, media tokens) per
        item where the model layer keys media per item, else one unit for all of its media (its media key)."""
        if self.media_items:
            return tuple((item.key, item.count, item.tokens) for item in self.media_items)
        return ((self.media_key, self.num_images, self.num_media_tokens),) if self.num_images else ()

    # guards named by the transition table
    def has_media(self) -> bool:
        return self.num_images > 0

    def media_ready(self) -> bool:
        return self.num_images == 0 or self.media_encoded

    def prefill_complete(self) -> bool:
        return self.num_computed_tokens >= self.prefill_len and self.num_output_tokens > self.recompute_tokens

    def has_finish_reason(self) -> bool:
        return self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)

    def has_error(self) -> bool:
        return self.error is not None


def as_token_ids(tokens: Any) -> list[int]:
    """Token ids as a fresh list of Python ints, from a sequence of integers or a 1-D integer array (numpy or
    mx: what tokenizers and mlx-lm hand out). Anything else (2-D, float or bool arrays, strings, scalars) is
    refused with InvalidRequest("prompt_tokens", "must be integers ...")."""
    ndim = getattr(tokens, "ndim", None)
    if ndim is not None and hasattr(tokens, "tolist"):  # an array (numpy, mx)
        _check(ndim == 1, "prompt_tokens", f"must be integers: a list or 1-D array of token ids, got a {ndim}-D array")
        tokens = tokens.tolist()
    elif isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InvalidRequest("prompt_tokens", "must be integers: a list or 1-D array of token ids, got "
                                              f"{type(tokens).__name__}")
    ids = []
    for t in tokens:
        # numbers.Integral takes numpy integer scalars; bools (Python's and numpy's) are not token ids
        _check(isinstance(t, numbers.Integral) and not isinstance(t, bool), "prompt_tokens",
               f"must be integers, got {t!r} ({type(t).__name__})")
        ids.append(int(t))
    return ids


def validate_prompt_tokens(tokens: Any, vocab_size: int, max_len: int, media_ids: frozenset[int] = frozenset()
                           ) -> list[int]:
    """Token ids a model can take, as a fresh list; InvalidRequest otherwise. ``media_ids``: ids outside the
    vocabulary that the request's media rows stand at (a spliced image's id, ``scheduler.models.splice``).

    The context rule: prompt + outputs never exceed `max_len` (the engine's max_model_len; generation is
    capped there, see `Request.output_limit`), so a prompt is refused only when it leaves no room for one
    output token.
    """
    tokens = as_token_ids(tokens)
    _check(len(tokens) > 0, "prompt", "is empty")
    bad = [t for t in tokens if not 0 <= t < vocab_size and t not in media_ids]
    _check(not bad, "prompt_tokens", f"ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    _check(len(tokens) < max_len, "prompt",
           f"has {len(tokens)} tokens; max_model_len is {max_len} and prompt + output must fit in it "
           f"(at most {max_len - 1} prompt tokens)")
    return tokens

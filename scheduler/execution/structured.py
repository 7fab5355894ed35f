"""Structured outputs: a request's `StructuredOutput` compiled to a grammar and enforced token by token.

llguidance (Microsoft's grammar engine, also behind vLLM's and llama.cpp's structured outputs) does the parsing:
`GrammarCompiler` turns a constraint into an llguidance grammar once per distinct spec and checks it against the
model's tokenizer on arrival, so a bad schema or regex is the request's own `InvalidRequest`; `GrammarProcessor`
is an mlx-lm logits processor (`(tokens so far, logits) -> logits`) that feeds the tokens it has not seen to its
matcher and masks every token the grammar cannot continue with to -inf. The executor keeps one per constrained
row and applies the rows' masks (`GrammarProcessor.allowed`, what its `__call__` applies) to the batch in one op;
the same class passed to `mlx_lm.generate` / `mlx_vlm.generate` alone gives the same tokens
(tests/surfaces/test_structured_output.py), which is the exactness claim.

JSON is generated without free whitespace: `", "` between items and `": "` after keys, nothing else (llguidance's
default allows any run of whitespace, which a model can keep emitting without ever closing the value). A schema
can choose otherwise with llguidance's own `"x-guidance"` key.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from ..request import InvalidRequest, StructuredKind, StructuredOutput

FIELD = "structured_output"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED_GRAMMARS = 256  # distinct specs kept compiled (agents reuse a few schemas)


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured`` (not yet checked: `GrammarCompiler.compile` does that)."""
    from llguidance import LLMatcher

    kind = structured.kind
    try:
        if kind is StructuredKind.JSON:
            return LLMatcher.grammar_from_json_schema(structured.spec, defaults=JSON_OPTIONS)
        if kind is StructuredKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind is StructuredKind.REGEX:
            return LLMatcher.grammar_from_regex(structured.spec)
        if kind is StructuredKind.CHOICE:  # Lark string literals take JSON's escapes
            choices = json.loads(structured.spec)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return LLMatcher.grammar_from_lark(structured.spec)
    except ValueError as exc:
        raise InvalidRequest(FIELD, f"cannot read the {kind.value} spec: {exc}") from None


class GrammarCompiler:
    """Compiles and checks constraints for one model's tokenizer. ``tokenizer``: a Hugging Face fast tokenizer
    (or mlx-lm's wrapper around one); ``vocab_size``: the model's logits width; ``eos_token_ids``: what ends a
    request, the only tokens a finished grammar allows. The llguidance tokenizer is built on first use (about a
    second for a 150k vocabulary) and kept. Thread-safe: the engine compiles on the caller's thread
    (`add_request`) while its loop builds matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        # compiled specs: the grammar text and a matcher at its start, which each request's processor copies
        # (`LLMatcher.deep_copy`, microseconds, where building a matcher re-reads the grammar: milliseconds, tens
        # for a forced call over many tools)
        self._grammars: OrderedDict[StructuredOutput, tuple[str, Any]] = OrderedDict()

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self) -> Any:
        """llguidance's tokenizer from the fast tokenizer's own serialisation (what ``llguidance.hf`` does, without
        its type check, which mlx-lm's wrapper would fail: the wrapper forwards ``backend_tokenizer``)."""
        from llguidance import LLTokenizer

        if not self.eos_token_ids:
            raise InvalidRequest(FIELD, "the tokenizer declares no end-of-sequence token, so a finished "
                                        "constraint could not end the output")
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequest(FIELD, f"needs a Hugging Face fast tokenizer, not {type(self._tokenizer).__name__}")
        backend = copy.copy(backend)  # (padding and truncation are settings of the copy, not of the model's)
        backend.no_padding()
        backend.no_truncation()
        size = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
        return LLTokenizer(backend.to_str(), n_vocab=size, eos_token=self.eos_token_ids)

    def compile(self, structured: StructuredOutput) -> str:
        """The checked grammar of ``structured``; `InvalidRequest` (field ``structured_output``) with
        llguidance's message when it does not compile against this tokenizer."""
        return self._compiled(structured)[0]

    def _compiled(self, structured: StructuredOutput) -> tuple[str, Any]:
        with self._lock:
            compiled = self._grammars.get(structured)
            if compiled is not None:
                self._grammars.move_to_end(structured)
                return compiled
        from llguidance import LLMatcher

        grammar = grammar_text(structured)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise InvalidRequest(FIELD, f"the {structured.kind.value} constraint does not compile: "
                                        f"{messages[0] if messages else 'no reason given'}")
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(FIELD, f"the {structured.kind.value} constraint is rejected: {matcher.get_error()}")
        with self._lock:
            self._grammars[structured] = compiled = (grammar, matcher)
            while len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return compiled

    def processor(self, structured: StructuredOutput, prompt_len: int | None = None) -> "GrammarProcessor":
        """A fresh processor enforcing ``structured`` (see `GrammarProcessor` for ``prompt_len``): a copy of the
        compiled spec's matcher at its start."""
        _, template = self._compiled(structured)
        with self._lock:  # (copies share the compiled grammar; one copy at a time)
            matcher = template.deep_copy()
        return GrammarProcessor(matcher, self.ll_tokenizer, self.eos_token_ids, prompt_len, structured.after)


class GrammarProcessor:
    """An mlx-lm logits processor that keeps the output inside a grammar.

    Called with every token so far (mlx-lm's and the engine's processor contract) and the next position's
    logits (1, V): the tokens after ``prompt_len`` that it has not seen are fed to the matcher, then the tokens
    the grammar rules out are set to -inf. ``prompt_len`` None: the first call's tokens are the prompt (what
    mlx-lm passes first). Once the grammar is complete only the end-of-sequence tokens remain; tokens after one
    (mlx-lm computes a step past the end) are not fed. A token the grammar rejects raises `ValueError`, which
    fails only that request in the engine.

    ``after``: the grammar starts with the token after the one that completes this text in the output (the end
    of a thinking model's reasoning); until then the logits pass unchanged."""

    def __init__(self, matcher: Any, ll_tokenizer: Any, eos_token_ids: Sequence[int], prompt_len: int | None = None,
                 after: str = ""):
        """``matcher``: an llguidance `LLMatcher` at the grammar's start, this processor's own."""
        self._matcher = matcher
        self._tokenizer = ll_tokenizer
        self._eos = frozenset(eos_token_ids)
        self._seen = prompt_len
        self._ended = False
        self._after = after.encode("utf-8")
        self._tail = b""  # the output's last bytes while waiting for `after`

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        allowed = self.allowed(tokens, logits.shape[-1])
        if allowed is None:
            return logits
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def allowed(self, tokens: mx.array | Sequence[int], width: int) -> np.ndarray | None:
        """Feed the unseen tokens of ``tokens`` (every token so far), then the (width,) bool mask of the tokens
        the grammar allows next; None before it starts (``after``). What `__call__` applies; the executor applies
        the masks of a batch's constrained rows in one op."""
        history = tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)
        if self._seen is None:
            self._seen = len(history)
        self._feed(history[self._seen:])
        self._seen = len(history)
        if self._after:  # not started yet
            return None
        allowed = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8) > 0
        if allowed.shape[0] < width:  # logits wider than the tokenizer: the extra ids are never text
            allowed = np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])
        allowed = allowed[:width]
        if not allowed.any():
            raise ValueError(f"the constraint allows no token here: {self._matcher.get_error() or 'dead end'}")
        return allowed

    def _feed(self, new: list[int]) -> None:
        for token in new:
            if self._ended:
                return
            if self._after:
                self._tail += self._tokenizer.decode_bytes([int(token)])
                if self._after in self._tail:
                    self._after = b""  # the grammar starts with the next token
                else:
                    self._tail = self._tail[-(len(self._after) - 1):] if len(self._after) > 1 else b""
                continue
            if token in self._eos and (self._matcher.is_accepting() or self._matcher.is_stopped()):
                self._ended = True  # the output ended here
                return
            if not self._matcher.consume_token(int(token)):
                raise ValueError(f"token {token} breaks the constraint: {self._matcher.get_error()}")

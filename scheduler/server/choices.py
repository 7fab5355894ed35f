"""How a completion's choices are rendered: a chat choice's text split into reasoning, content and tool calls
(`ChatParsing`, `ChoiceSplitter`), chat and text choices as OpenAI's deltas and final choices (`ChatChoices`,
`TextChoices`), and vLLM's `prompt_logprobs` field. `app.py` runs the calls; the Responses API renders the same
split text its own way (`responses.py`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from .generation import Delta, PromptScores, json_logprob
from .protocol import APIError, ChatCompletionRequest
from .reasoning import ReasoningFormat, ReasoningSplitter
from .token_bytes import TokenBytes
from .tool_calls import ToolCallFormat, ToolCallSplitter


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def prompt_logprobs_field(tokenizer: Any, scores: PromptScores, k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the token itself (its rank among the whole vocabulary) and its position's `k` most likely
    (ranks 1..k, most likely first). A prompt token among those k is listed once, first, with the rank of its
    place there, as vLLM's dictionary keeps it."""
    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        # a spliced image's id (-200: scheduler/models/splice.py) is no token: no text, logprob -inf as JSON has it
        text = token_text(tokenizer, token) if token >= 0 else ""
        return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": text}

    out: list[dict[str, Any] | None] = [None]
    for token, logprob, rank, top in zip(scores.token_ids[1:], scores.logprobs[1:], scores.ranks[1:],
                                         scores.top_logprobs[1:]):
        entries = {str(token): entry(token, logprob, rank)}
        for place, (t, lp) in enumerate(top[:k], 1):
            entries[str(t)] = entry(t, lp, place)
        out.append(entries)
    return out


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools and how its model writes calls (`tool_calls.ToolCallFormat`)."""

    format: ToolCallFormat
    tools: list[dict[str, Any]]
    first_call_only: bool  # parallel_tool_calls: false


def tool_calling_of(body: ChatCompletionRequest, fmt: ToolCallFormat | None) -> ToolCalling | None:
    """The request's tool calling, or None (no tools, or tool_choice "none"). Refused (400) where the calls could
    not be returned: a model whose chat template declares no tool-call format (``fmt`` None: mlx-lm infers none
    from it; a vision-language model's is inferred by the same rule, `VLMAdapter.tool_calling`)."""
    tools = body.tool_list()
    if tools is None:
        return None
    if fmt is None:
        raise APIError(400, "tools: this model's chat template declares no tool-call format that mlx-lm can parse, "
                            "so its calls could not be returned", "tools")
    return ToolCalling(fmt, tools, body.parallel_tool_calls is False)


@dataclass(frozen=True)
class ChatParsing:
    """How a chat choice's text is split: reasoning out first (a thinking model; `in_reasoning`: the prompt left
    it open), then tool calls out of the rest (a request with tools)."""

    reasoning: ReasoningFormat | None = None
    in_reasoning: bool = False
    tool_calling: ToolCalling | None = None

    def splitter(self) -> "ChoiceSplitter":
        tools = self.tool_calling
        return ChoiceSplitter(
            ReasoningSplitter(self.reasoning, self.in_reasoning) if self.reasoning is not None else None,
            ToolCallSplitter(tools.format, tools.tools, tools.first_call_only) if tools is not None else None)


@dataclass
class ChoiceText:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ChoiceSplitter:
    """One choice's text through its splitters, piece by piece (`final`: the last piece)."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallSplitter | None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def calls_made(self) -> int:
        return self.tools.calls_made if self.tools is not None else 0

    def feed(self, text: str, final: bool) -> ChoiceText:
        out = ChoiceText(content=text)
        if self.reasoning is not None:
            piece = self.reasoning.feed(text)
            if final:
                tail = self.reasoning.finish()
                piece.reasoning += tail.reasoning
                piece.content += tail.content
            out.reasoning, out.content = piece.reasoning, piece.content
        if self.tools is not None:
            piece = self.tools.feed(out.content)
            if final:
                tail = self.tools.finish()
                piece.content += tail.content
                piece.calls += tail.calls
            out.content, out.calls = piece.content, piece.calls
        return out

    def finish_reason(self, reason: str) -> str:
        """A choice that made a tool call and then stopped finishes with "tool_calls" (one cut at max_tokens keeps
        "length")."""
        return "tool_calls" if reason == "stop" and self.calls_made else reason


class ChatChoices:
    """How a chat completion renders its choices: a role delta first, content deltas, a message at the end.
    With a `ChatParsing`, each choice's text goes through its splitters: reasoning becomes `reasoning_content`
    (vLLM's field), calls become `tool_calls` (a delta each when streaming), and a choice that made a call and
    stopped finishes with "tool_calls"."""

    def __init__(self, tokenizer: Any, token_bytes: TokenBytes, wants_logprobs: bool, stream: bool,
                 parsing: ChatParsing | None = None, token_ids: bool = False):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.wants_logprobs = wants_logprobs
        self.token_ids = token_ids  # return_token_ids
        self.object = "chat.completion.chunk" if stream else "chat.completion"
        self.parsing = parsing
        self._splitters: dict[int, ChoiceSplitter] = {}  # streaming: each choice's, as its text arrives

    def first(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def opening(self, index: int, prompt_token_ids: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        """With return_token_ids, a choice's first chunk (once its prompt is known): its role delta, and the
        prompt at the chunk's top level."""
        return self.first(index), {"prompt_token_ids": prompt_token_ids}

    def delta(self, index: int, delta: Delta) -> dict[str, Any] | None:
        finish = delta.finish_reason
        split = ChoiceText(content=delta.text)
        if self.parsing is not None:
            splitter = self._splitters.setdefault(index, self.parsing.splitter())
            before = splitter.calls_made
            split = splitter.feed(delta.text, final=finish is not None)
            split.calls = [{"index": before + k, **call} for k, call in enumerate(split.calls)]
            if finish is not None:
                finish = splitter.finish_reason(finish)
        if not split.reasoning and not split.content and not split.calls and finish is None and not delta.logprobs \
                and not (self.token_ids and delta.token_ids):
            return None
        body: dict[str, Any] = {"reasoning_content": split.reasoning} if split.reasoning else {}
        if split.content:
            body["content"] = split.content
        if split.calls:
            body["tool_calls"] = split.calls
        out = {"index": index, "delta": body, "logprobs": self._logprobs([delta]), "finish_reason": finish}
        if self.token_ids:
            out["token_ids"] = list(delta.token_ids)
        return out

    def final(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        finish = deltas[-1].finish_reason if deltas else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.parsing is not None:
            splitter = self.parsing.splitter()
            split = splitter.feed(text, final=True)
            # null when the answer is calls or reasoning alone (a model cut off or stopping inside its reasoning),
            # as vLLM's reasoning parsers answer; "" for an answer that is empty
            message = {"role": "assistant",
                       "content": split.content or (None if split.calls or split.reasoning else "")}
            if split.reasoning:
                message["reasoning_content"] = split.reasoning
            if split.calls:
                message["tool_calls"] = split.calls
            finish = splitter.finish_reason(finish) if finish is not None else None
        out = {"index": index, "message": message, "logprobs": self._logprobs(deltas), "finish_reason": finish}
        if self.token_ids:
            out["token_ids"] = [t for d in deltas for t in d.token_ids]
        return out

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        return {"content": self.content_logprobs(deltas)} if self.wants_logprobs else None

    def content_logprobs(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """Each token's entry ({token, logprob, bytes, top_logprobs}): a chat choice's `logprobs.content`, and a
        Responses API output_text's `logprobs`."""
        entries = []
        for delta in deltas:
            for i, (token, logprob) in enumerate(delta.logprobs):
                alternatives = delta.top_logprobs[i] if i < len(delta.top_logprobs) else []
                entries.append({**self._entry(token, logprob),
                                "top_logprobs": [self._entry(t, lp) for t, lp in alternatives]})
        return entries

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(self.tokenizer, token), "logprob": logprob,
                "bytes": list(self.token_bytes(token))}


class TextChoices:
    """How a (legacy) text completion renders its choices: text deltas, the whole text at the end."""

    object = "text_completion"

    def __init__(self, tokenizer: Any, wants_logprobs: bool, alternatives: int, token_ids: bool = False):
        self.tokenizer = tokenizer
        self.wants_logprobs = wants_logprobs
        self.alternatives = alternatives  # the legacy `logprobs: N`: N most likely tokens listed per token
        self.token_ids = token_ids  # return_token_ids

    def first(self, index: int) -> dict[str, Any] | None:
        return None

    def opening(self, index: int, prompt_token_ids: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        """With return_token_ids, a choice's first chunk (once its prompt is known): its prompt, on the choice."""
        return {"index": index, "text": "", "logprobs": None, "finish_reason": None,
                "prompt_token_ids": prompt_token_ids, "token_ids": []}, {}

    def delta(self, index: int, delta: Delta) -> dict[str, Any] | None:
        if not delta.text and delta.finish_reason is None and not delta.logprobs and delta.echo is None \
                and not (self.token_ids and delta.token_ids):
            return None
        out = {"index": index, "text": self._text([delta]), "logprobs": self._logprobs([delta]),
               "finish_reason": delta.finish_reason}
        if self.token_ids:
            out["token_ids"] = list(delta.token_ids)
        return out

    def final(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        out = {"index": index, "text": self._text(deltas), "logprobs": self._logprobs(deltas),
               "finish_reason": deltas[-1].finish_reason if deltas else None}
        if self.token_ids:
            out["prompt_token_ids"] = next((d.prompt_token_ids for d in deltas if d.prompt_token_ids is not None),
                                           None)
            out["token_ids"] = [t for d in deltas for t in d.token_ids]
        return out

    @staticmethod
    def _text(deltas: list[Delta]) -> str:
        return "".join((d.echo.text if d.echo is not None else "") + d.text for d in deltas)

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        """The legacy shape: per token its text, its logprob and its alternatives {token text: logprob} (most likely
        first), and where its text starts. An echoed prompt's tokens come first, the first with null logprob and
        alternatives (nothing precedes it)."""
        if not self.wants_logprobs:
            return None
        tokens, values, alternatives = [], [], []
        for delta in deltas:
            echoed = delta.echo.logprobs if delta.echo is not None else []
            echoed_top = delta.echo.top_logprobs if delta.echo is not None else []
            for pairs, top in ((echoed, echoed_top), (delta.logprobs, delta.top_logprobs)):
                for i, (token, logprob) in enumerate(pairs):
                    tokens.append(token_text(self.tokenizer, token))
                    values.append(logprob)
                    if not self.alternatives:
                        continue
                    if logprob is None:  # an echoed prompt's first token
                        alternatives.append(None)
                        continue
                    listed: dict[str, float] = {}
                    # one text shares a key: the likelier keeps it. (An echo may carry more alternatives than
                    # asked here: the engine scored the prompt for `prompt_logprobs` too.)
                    for t, lp in (top[i][: self.alternatives] if i < len(top) else ()):
                        listed.setdefault(token_text(self.tokenizer, t), lp)
                    alternatives.append(listed)
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": alternatives or None,
                "text_offset": offsets}


__all__ = ["ChatChoices", "ChatParsing", "ChoiceSplitter", "ChoiceText", "TextChoices", "ToolCalling",
           "prompt_logprobs_field", "token_text", "tool_calling_of"]

"""One completion choice on the engine: its sampling parameters from the request body, and the text deltas of
its output stream (detokenized incrementally, stop strings held back until they are ruled out), ending with
OpenAI's finish reason.

A stop *token* (the model's eos or one of the request's stop ids) is ended by the engine (`FinishReason.STOP`);
it counts as a completion token but its text is not emitted. A stop *string* is found here, on the text: the
choice ends with "stop" and its engine request is aborted (nothing keeps computing for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ..async_engine import RequestStream
from ..request import FinishReason, InvalidRequest, SamplingParams, StructuredOutput, UnreadableMedia
from .detokenize import IncrementalDetokenizer
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, TokenizeRequest
from .stops import StopRule


@dataclass
class Delta:
    """What one engine output added to a choice."""

    text: str
    token_ids: list[int]  # every token the engine produced in this output (a stop token included)
    logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob) of the emitted tokens
    finish_reason: str | None = None  # "stop" / "length" on the last delta
    # per emitted token, its most likely alternatives (token id, logprob), most likely first (top_logprobs)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    echo: "EchoedPrompt | None" = None  # the first delta of a choice that echoes its prompt
    prompt: "PromptScores | None" = None  # a delta of its own, for a choice that scores its prompt
    # a delta of its own, a choice's first: its prompt as the engine ran it (templated, tokenized, truncated)
    prompt_token_ids: list[int] | None = None


@dataclass
class EchoedPrompt:
    """The prompt a completion echoes before its own text: the text, and with logprobs each prompt token's
    (token id, logprob; None for the first) and its position's alternatives (SamplingParams.prompt_logprobs)."""

    text: str
    logprobs: list[tuple[int, float | None]] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class PromptScores:
    """A prompt's scores (`prompt_logprobs` of the request body), from the engine's first output: per prompt token
    its id, its logprob given the tokens before it, its rank there, and its position's most likely (token,
    logprob)s; the first token's logprob and rank are None."""

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top_logprobs: list[list[tuple[int, float]]]


class ChoiceFailed(Exception):
    """The engine ended this choice with an error of its own (its work raised), or stopped."""


Body = ChatCompletionRequest | CompletionRequest


def engine_field(body: Body | TokenizeRequest, name: str) -> str:
    """The request field an engine-side InvalidRequest field stands for."""
    if name in ("prompt", "prompt_tokens", "images", "videos", "audio"):
        return "messages" if getattr(body, "messages", None) is not None else "prompt"
    if name == "max_tokens":
        return body.token_limit()[1]
    if name == "bad_words_ids":
        return "bad_words"
    if name == "lora":  # an adapter unloaded between the model check and the submission
        return "model"
    if name == "stop_token_ids":
        return "stop_token_ids" if body.stop_token_ids else "stop"
    if name == "structured_output":  # the field the constraint came from (`constraints.output_constraint`)
        if isinstance(body, ChatCompletionRequest) and body.forces_tool_call():
            return "tool_choice"
        return "structured_outputs" if body.structured_outputs is not None else "response_format"
    return name


def refusal(body: Body | TokenizeRequest, exc: InvalidRequest,
            part_of: Callable[[str, int | None], str | None] | None = None) -> APIError:
    """The 400 for what the engine refused. `part_of(kind, index)`: the content part a medium came from, so
    media the model's processor refused is named as the server's own decoding names it."""
    if isinstance(exc, UnreadableMedia) and part_of is not None:
        part = part_of(exc.kind, exc.index)
        if part is not None:
            return APIError(400, f"{part}: unreadable {exc.kind}: {exc.reason}", part)
    param = engine_field(body, exc.field)
    message = str(exc)
    if exc.field and message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2:]
    return APIError(400, f"{param}: {message}", param)


def bad_words_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token sequences, by vLLM's rule: each word as the tokenizer encodes it (no special
    tokens, leading spaces stripped) and, where a leading space makes it another word of as many tokens, that
    encoding too, so the word is kept out at the start of the text and in the middle of it."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(seq for seq in sequences if seq)


def sampling_params(body: Body, index: int, default_max_tokens: int,
                    structured: StructuredOutput | None = None,
                    bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    """Choice `index`'s SamplingParams (a seeded request gives choice i the seed + i, so the n choices differ
    and each is reproducible), with the request's output constraint (`constraints.output_constraint`) and its
    bad words as token sequences (`bad_words_ids`, encoded once per call). Values the engine refuses raise
    APIError naming the body's field."""
    limit, _ = body.token_limit()
    seed = None if body.seed is None else body.seed + index
    fields: dict[str, Any] = {
        "max_tokens": default_max_tokens if limit is None else limit,
        "temperature": 1.0 if body.temperature is None else body.temperature,  # OpenAI's default
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k in (None, -1) else body.top_k,
        "min_p": 0.0 if body.min_p is None else body.min_p,
        "presence_penalty": 0.0 if body.presence_penalty is None else body.presence_penalty,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "frequency_penalty": 0.0 if body.frequency_penalty is None else body.frequency_penalty,
        "stop_token_ids": tuple(body.stop_ids()),
        "ignore_eos": body.ignore_eos,
        "min_tokens": body.min_tokens,
        "allowed_token_ids": body.allowed_token_ids,
        "bad_words_ids": bad_words,
        # (-1: the longest prompt the context leaves room for one output token after)
        "truncate_prompt_tokens": (default_max_tokens - 1 if body.truncate_prompt_tokens == -1
                                   else body.truncate_prompt_tokens),
        "seed": seed,
        "logprobs": body.wants_logprobs(),
        "top_logprobs": body.alternatives(),
        "prompt_logprobs": body.engine_prompt_logprobs(first_choice=index == 0),
        "logit_bias": body.bias_by_id(),
        "structured_output": structured,
    }
    if body.prompt_only():  # the engine decodes the one token a finished prefill brings; the answer drops it
        if body.min_tokens:
            raise APIError(400, "min_tokens: must be at most max_tokens (0)", "min_tokens")
        fields["max_tokens"] = 1
    try:
        return SamplingParams(**fields)
    except InvalidRequest as exc:
        raise refusal(body, exc) from None


async def choice_deltas(stream: RequestStream, tokenizer: Any, stops: StopRule,
                        wants_logprobs: bool, echo: str | None = None, prompt_only: bool = False,
                        scores_prompt: bool = False, skip_special_tokens: bool = False) -> AsyncIterator[Delta]:
    """The deltas of one choice until it ends. Raises ChoiceFailed if the engine failed it. Closing the
    iterator early (the client went away) closes the stream, which aborts the request.

    `echo`: the prompt's text, which the first delta carries (`Delta.echo`) before any output text, with the
    prompt's logprobs when the request asked for them. An echoing choice's logprobs also list the stop token
    that ended it (its text is still left out), as vLLM's do: the logprobs then hold every token of prompt and
    completion, which is what lm-eval's `token_logprobs[ctxlen:-1]` slicing expects.

    `prompt_only` (`max_tokens: 0`): the choice ends at its first output with "length" and no completion: the
    token that output brings (the engine decodes one, `sampling_params`) is neither shown nor counted.

    `scores_prompt`: the choice's engine request computes its prompt's scores (`sampling_params`, the first
    choice of a prompt that asked `prompt_logprobs`): after the echo, a delta of its own carries them.

    `stops`: the text of the first `stops.unchecked_tokens` tokens (the request's min_tokens) is not matched
    against the stop strings (vLLM's rule; a stop string that ends after it counts). The engine masks the stop
    tokens over the same tokens."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    min_tokens, stops = stops.unchecked_tokens, stops.matcher()
    with_stop_token = echo is not None
    counted = 0  # output tokens so far
    try:
        async for out in stream:
            if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                raise ChoiceFailed(out.error or f"the request ended with {out.finish_reason.value}")
            if out.prompt_token_ids is not None:  # its first output
                yield Delta("", [], prompt_token_ids=out.prompt_token_ids)
            if echo is not None:
                yield Delta("", [], echo=_echoed(echo, out))
                echo = None
            if scores_prompt and out.prompt_logprobs is not None:
                yield Delta("", [], prompt=PromptScores(list(out.prompt_token_ids), list(out.prompt_logprobs),
                                                        list(out.prompt_logprob_ranks), list(out.prompt_top_logprobs)))
                scores_prompt = False
            if prompt_only:
                yield Delta("", [], finish_reason="length")
                return
            tokens = list(out.token_ids)
            # the stop token ends the text: it is counted, not shown
            shown = tokens[:-1] if out.finish_reason is FinishReason.STOP and tokens else tokens
            logprobs = (list(zip(tokens if with_stop_token else shown, map(json_logprob, out.logprobs)))
                        if wants_logprobs else [])
            top = [[(t, json_logprob(lp)) for t, lp in alternatives]
                   for alternatives in out.top_logprobs[: len(logprobs)]]
            within = min(len(shown), max(0, min_tokens - counted))  # of these, the tokens within min_tokens
            counted += len(tokens)
            early = stops.feed(detok.add(shown[:within]), checked=False).text if within else ""
            text = detok.add(shown[within:])
            if out.finished:
                text += detok.flush()
            matched = stops.feed(text)
            if matched.stopped:
                stream.close()  # aborts the engine request
                yield Delta(early + matched.text, tokens, logprobs, "stop", top)
                return
            if out.finished:
                tail = stops.flush()  # held text, cut if it holds a stop string
                reason = "length" if out.finish_reason is FinishReason.LENGTH and not tail.stopped else "stop"
                yield Delta(early + matched.text + tail.text, tokens, logprobs, reason, top)
                return
            if early or matched.text or logprobs:
                yield Delta(early + matched.text, tokens, logprobs, top_logprobs=top)
            elif tokens:  # held back (a partial character or a possible stop string): still counted
                yield Delta("", tokens)
    finally:
        stream.close()


LOGPROB_FLOOR = -9999.0  # vLLM's: what a masked token's -inf reads as in JSON


def json_logprob(logprob: float | None) -> float | None:
    """A logprob as JSON can carry it: a token a mask ruled out (a structured output's grammar, allowed token
    ids, min_tokens) has logprob -inf, which JSON has no number for; it reads as LOGPROB_FLOOR, as vLLM's do."""
    return logprob if logprob is None or logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _echoed(text: str, first: Any) -> EchoedPrompt:
    """The echo of a choice's prompt, from its first engine output (which carries the prompt logprobs when the
    request asked for them)."""
    if first.prompt_logprobs is None:
        return EchoedPrompt(text)
    return EchoedPrompt(text, list(zip(first.prompt_token_ids, first.prompt_logprobs)),
                        list(first.prompt_top_logprobs))

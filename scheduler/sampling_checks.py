"""The checks of a request's sampling parameters that need the model: token ids inside its vocabulary, and masks
that leave a token to sample. (`SamplingParams` checks itself for what needs no model, `scheduler/request.py`.)"""

from __future__ import annotations

from typing import AbstractSet

from .request import InvalidRequest, SamplingParams


def check_sampling(sampling: SamplingParams, vocab_size: int, model_stop_ids: AbstractSet[int]) -> None:
    """Raise InvalidRequest, naming the field, for token ids outside `[0, vocab_size)` and for masks that leave
    nothing to sample at the first step."""
    outside = {
        "stop_token_ids": list(sampling.stop_token_ids),
        "logit_bias": [t for t, _ in sampling.logit_bias],
        "bad_words_ids": sorted({t for seq in sampling.bad_words_ids for t in seq}),
        "allowed_token_ids": list(sampling.allowed_token_ids or ()),
    }
    for field, ids in outside.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            shown = bad if field in ("stop_token_ids", "logit_bias") else bad[:5]
            raise InvalidRequest(field, f"ids outside the vocabulary [0, {vocab_size}): {shown}")
    _check_sampleable(sampling, vocab_size, model_stop_ids)


def _check_sampleable(sampling: SamplingParams, vocab_size: int, model_stop_ids: AbstractSet[int]) -> None:
    """Refuse a request whose masks leave no token to sample at its first step: `allowed_token_ids` (or the whole
    vocabulary) all one-token `bad_words_ids`, or, within `min_tokens`, all stop tokens or such words. Sampling
    would otherwise pick from logits that are all -inf: token 0, which none of its constraints allows. (Masks
    that close later, a bad word the output leads into, fail the request when they do: the executor's check.)"""
    if not (sampling.bad_words_ids or sampling.min_tokens):
        return
    banned = {word[0] for word in sampling.bad_words_ids if len(word) == 1}
    field = "bad_words_ids"
    if sampling.min_tokens:
        banned |= set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            banned |= set(model_stop_ids)
        field = "min_tokens"
    allowed = set(sampling.allowed_token_ids) if sampling.allowed_token_ids is not None else None
    left = len(allowed - banned) if allowed is not None else vocab_size - len(banned)
    if not left:
        what = "allowed_token_ids" if allowed is not None else "the vocabulary"
        masks = "one-token bad_words_ids" + (" or stop tokens (min_tokens masks them)" if sampling.min_tokens else "")
        raise InvalidRequest(field, f"every token of {what} is one of its {masks}: nothing is left to sample")

"""Every public entry point gets the same matrix of bad inputs: each is refused with a typed error naming the
culprit field, a request already running next to it finishes with exactly its solo output, and nothing is left
behind (no live request, no cache). A new entry point is one more `Surface`; a new bad input one more case, and
every surface must either refuse it or declare that it cannot express it.

Also the good side: token ids as 1-D integer numpy and mx arrays (what tokenizers and mlx-lm hand out) are
accepted by every surface and give the same tokens as a list."""

from __future__ import annotations

import asyncio
import logging

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from scheduler import AsyncEngine, Engine, EngineConfig, FinishReason, SamplingParams
from scheduler.compat import MLLMBatchGenerator, MLLMBatchRequest
from scheduler.request import InvalidRequest

from ..helpers import mixed_prompts, solo_tokens

LIMIT = 64  # max_model_len of every engine here
VOCAB = 512  # the tiny text model's
BYSTANDER = mixed_prompts(2, 12, 12, seed=77)[0]
GOOD = mixed_prompts(2, 9, 9, seed=78)[0]
MAX_TOKENS = 4


class Inexpressible(Exception):
    """This surface has no way to pass that input (e.g. `generate` takes no request ids)."""


# case -> (add_request keyword arguments, the field the error must name)
CASES: dict[str, tuple[dict, str]] = {
    "neither prompt nor tokens": ({}, "prompt"),
    "both prompt and tokens": ({"prompt": "hi", "prompt_tokens": [7, 8]}, "prompt"),
    "empty tokens": ({"prompt_tokens": []}, "prompt"),
    "empty text": ({"prompt": ""}, "prompt"),
    "prompt of another type": ({"prompt": 123}, "prompt"),
    "token outside the vocabulary": ({"prompt_tokens": [7, VOCAB]}, "prompt_tokens"),
    "negative token": ({"prompt_tokens": [7, -1]}, "prompt_tokens"),
    "float tokens (list)": ({"prompt_tokens": [7.0, 8.0]}, "prompt_tokens"),
    "float tokens (numpy)": ({"prompt_tokens": np.array([7.0, 8.0])}, "prompt_tokens"),
    "float tokens (mx)": ({"prompt_tokens": mx.array([7.0, 8.0])}, "prompt_tokens"),
    "bool tokens (numpy)": ({"prompt_tokens": np.array([True, False])}, "prompt_tokens"),
    "bool tokens (list)": ({"prompt_tokens": [True, 8]}, "prompt_tokens"),
    "2-D tokens (numpy)": ({"prompt_tokens": np.array([[7, 8], [9, 10]])}, "prompt_tokens"),
    "2-D tokens (mx)": ({"prompt_tokens": mx.array([[7, 8], [9, 10]])}, "prompt_tokens"),
    "a string as tokens": ({"prompt_tokens": "7 8 9"}, "prompt_tokens"),
    "a scalar as tokens": ({"prompt_tokens": 7}, "prompt_tokens"),
    "prompt leaving no room for output": ({"prompt_tokens": [9] * LIMIT}, "prompt"),
    "sampling of another type": ({"prompt_tokens": GOOD, "sampling": {"max_tokens": 3}}, "sampling"),
    "stop id outside the vocabulary": ({"prompt_tokens": GOOD, "sampling": SamplingParams(stop_token_ids=(VOCAB,))},
                                       "stop_token_ids"),
    "max_tokens 0": ({"prompt_tokens": GOOD, "max_tokens": 0}, "max_tokens"),
    "negative temperature": ({"prompt_tokens": GOOD, "temperature": -1.0}, "temperature"),
    "images on a text-only model": ({"prompt": "hi", "images": [Image.new("RGB", (8, 8))]}, "images"),
    "duplicate request id": ({"prompt_tokens": GOOD, "request_id": "bystander"}, "request_id"),
    "empty request id": ({"prompt_tokens": GOOD, "request_id": ""}, "request_id"),
    "priority of another type": ({"prompt_tokens": GOOD, "priority": "high"}, "priority"),
}

# Sampling values are checked where SamplingParams is built: on the engine's surfaces that is the caller's code,
# before any entry point (tests/core/test_request.py covers it); the vllm-mlx surface builds it from its fields.
_SAMPLING_FIELDS = {"max_tokens 0", "negative temperature"}


def _sampling(kw: dict) -> dict:
    """The engine surfaces' form of a case: sampling fields can only arrive as a SamplingParams."""
    if set(kw) & {"max_tokens", "temperature"}:
        raise Inexpressible
    return kw


class Surface:
    name: str
    cannot_express: frozenset[str] = frozenset(_SAMPLING_FIELDS)

    fields: dict[str, str] = {}  # cases whose culprit this surface names differently

    def __init__(self, model, tokenizer):
        self.engine = Engine(model, tokenizer, EngineConfig(max_model_len=LIMIT, check_invariants=True))

    def add_bystander(self) -> None:
        self.engine.add_request(prompt_tokens=BYSTANDER, sampling=SamplingParams(max_tokens=MAX_TOKENS),
                                request_id="bystander")

    def refuse(self, kw: dict, bystander: str) -> tuple[str, list[int], object]:
        """Pass the bad input next to the running bystander; return the refused field, and the bystander's
        tokens and finish reason once everything has drained."""
        raise NotImplementedError

    def run_good(self, kw: dict) -> list[int]:
        raise NotImplementedError


def _drain(engine: Engine, rid: str) -> tuple[list[int], object]:
    tokens, finish = [], None
    while engine.has_pending():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.token_ids
                finish = out.finish_reason if out.finished else finish
            else:  # only the bystander may produce tokens: whatever was refused never ran
                assert not out.token_ids, out
    return tokens, finish


class AddRequest(Surface):
    name = "add_request"

    def refuse(self, kw, bystander):
        with pytest.raises(InvalidRequest) as err:
            self.engine.add_request(**_sampling(kw))
        return err.value.field, *_drain(self.engine, bystander)

    def run_good(self, kw):
        rid = self.engine.add_request(**kw)
        return _drain(self.engine, rid)[0]


class Generate(Surface):
    name = "generate"
    # a string item is a text prompt there, never token ids
    cannot_express = _SAMPLING_FIELDS | {"both prompt and tokens", "duplicate request id", "empty request id",
                                         "priority of another type", "a string as tokens"}
    # generate's items are text, chat messages or token ids: anything else is read as (bad) token ids
    fields = {"prompt of another type": "prompt_tokens"}

    @staticmethod
    def _args(kw):
        kw = dict(_sampling(kw))
        if (set(kw) & {"request_id", "priority"} or ("prompt" in kw and "prompt_tokens" in kw)
                or isinstance(kw.get("prompt_tokens"), str)):
            raise Inexpressible
        prompt = kw.pop("prompt", None) if "prompt" in kw else kw.pop("prompt_tokens", None)
        images = kw.pop("images", None)
        return prompt, images, kw.pop("sampling", None)

    def refuse(self, kw, bystander):
        prompt, images, sampling = self._args(kw)
        # a good prompt first: the refused batch must take it back, not leave it running for nobody
        with pytest.raises(InvalidRequest) as err:
            self.engine.generate([GOOD, prompt], sampling=[SamplingParams(max_tokens=MAX_TOKENS), sampling],
                                 images=[None, images])
        return err.value.field, *_drain(self.engine, bystander)

    def run_good(self, kw):
        prompt, images, sampling = self._args(kw)
        return self.engine.generate([prompt], sampling)[0].token_ids


class Stream(Surface):
    name = "stream"
    cannot_express = _SAMPLING_FIELDS | {"priority of another type"}

    def refuse(self, kw, bystander):
        kw = _sampling(kw)
        if "priority" in kw:
            raise Inexpressible
        with pytest.raises(InvalidRequest) as err:
            next(iter(self.engine.stream(**kw)))
        return err.value.field, *_drain(self.engine, bystander)

    def run_good(self, kw):
        return [t for out in self.engine.stream(**kw) for t in out.token_ids]


class AsyncStream(Surface):
    name = "AsyncEngine.stream"

    def add_bystander(self):
        pass  # it goes through the AsyncEngine (refuse), so that its outputs come back to it

    async def _bystander(self, aengine, rid):
        tokens, finish = [], None
        async for out in aengine.stream(prompt_tokens=BYSTANDER, sampling=SamplingParams(max_tokens=MAX_TOKENS),
                                        request_id=rid):
            tokens += out.token_ids
            finish = out.finish_reason if out.finished else finish
        return tokens, finish

    async def _call(self, aengine, kw):
        async for _ in aengine.stream(**kw):
            pass

    def refuse(self, kw, bystander):
        kw = _sampling(kw)

        async def main():
            async with AsyncEngine(self.engine) as aengine:
                task = asyncio.create_task(self._bystander(aengine, bystander))
                await asyncio.sleep(0)  # the bystander is queued first
                with pytest.raises(InvalidRequest) as err:
                    await self._call(aengine, kw)
                tokens, finish = await task
            assert not self.engine.has_pending()
            return err.value.field, tokens, finish

        return asyncio.run(main())

    def run_good(self, kw):
        async def main():
            async with AsyncEngine(self.engine) as aengine:
                out = await aengine.generate(**kw)
            return out.token_ids

        return asyncio.run(main())


class AsyncGenerate(AsyncStream):
    name = "AsyncEngine.generate"

    async def _call(self, aengine, kw):
        await aengine.generate(**kw)


class Insert(Surface):
    """vllm-mlx's MLLMBatchGenerator.insert: bad input never raises there, that request gets an "error"
    response (as in the reference) and the refusal, naming the field, is logged."""

    name = "MLLMBatchGenerator.insert"
    cannot_express = frozenset({"neither prompt nor tokens", "both prompt and tokens", "sampling of another type",
                                "stop id outside the vocabulary", "priority of another type"})

    def __init__(self, model, tokenizer):
        self.gen = MLLMBatchGenerator(model, tokenizer)
        self.gen._configure(max_model_len=LIMIT, check_invariants=True)
        self.caplog = None

    def add_bystander(self):
        pass  # inserted with the bad request, in one insert() call (refuse)

    @staticmethod
    def _request(kw, request_id):
        kw = dict(kw)
        if set(kw) & {"sampling", "priority"} or "prompt" in kw and "prompt_tokens" in kw or not (
                {"prompt", "prompt_tokens"} & set(kw)):
            raise Inexpressible
        fields = {"prompt": kw.pop("prompt", ""), "input_ids": kw.pop("prompt_tokens", None),
                  "request_id": kw.pop("request_id", request_id), "temperature": kw.pop("temperature", 0.0),
                  "max_tokens": kw.pop("max_tokens", MAX_TOKENS), **kw}
        return MLLMBatchRequest(uid=-1, **fields)

    def _run(self):
        tokens, finish = {}, {}
        while self.gen.has_pending():
            for r in self.gen.next():
                if r.finish_reason in (None, "stop", "length"):
                    tokens.setdefault(r.uid, []).append(r.token)
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
        return tokens, finish

    def refuse(self, kw, bystander):
        bad = self._request(kw, "bad")
        by = self._request({"prompt_tokens": BYSTANDER}, bystander)
        with self.caplog.at_level(logging.WARNING, logger="scheduler.compat"):
            self.caplog.clear()
            by_uid, bad_uid = self.gen.insert([by, bad])
            tokens, finish = self._run()
        assert finish[bad_uid] == "error" and bad_uid not in tokens
        refusals = [r.getMessage() for r in self.caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1, refusals
        field = refusals[0].split("refused: ", 1)[1].split(":", 1)[0]
        engine = self.gen.engine
        assert not engine.has_pending() and not engine.executor.live_request_ids()
        return field, tokens[by_uid], {"length": FinishReason.LENGTH}.get(finish[by_uid], finish[by_uid])

    def run_good(self, kw):
        uid, = self.gen.insert([self._request(kw, "good")])
        tokens, finish = self._run()
        assert finish[uid] == "length"
        return tokens[uid]


SURFACES = [AddRequest, Generate, Stream, AsyncStream, AsyncGenerate, Insert]


@pytest.fixture(scope="module")
def bystander_tokens(text_model):
    model, tokenizer = text_model
    return solo_tokens(model, tokenizer, BYSTANDER, MAX_TOKENS)


@pytest.mark.parametrize("surface", SURFACES, ids=lambda s: s.name)
@pytest.mark.parametrize("case", list(CASES))
def test_every_entry_point_refuses_every_bad_input(text_model, bystander_tokens, surface, case, caplog):
    model, tokenizer = text_model
    kw, field = CASES[case]
    s = surface(model, tokenizer)
    s.caplog = caplog
    s.add_bystander()
    try:
        refused, tokens, finish = s.refuse(kw, "bystander")
    except Inexpressible:
        assert case in surface.cannot_express, f"{surface.name} cannot pass {case!r}: declare it or support it"
        return
    assert case not in surface.cannot_express, f"{surface.name} can pass {case!r}: take it off cannot_express"
    assert refused == surface.fields.get(case, field)
    assert tokens == bystander_tokens and finish is FinishReason.LENGTH  # the request next to it is untouched
    engine = s.gen.engine if isinstance(s, Insert) else s.engine
    assert not engine.has_pending() and not engine.executor.live_request_ids()  # nothing leaks


def test_every_case_is_expressible_on_some_surface():
    """A case that no surface can express would test nothing."""
    expressible_somewhere = set(CASES) - set.intersection(*(set(s.cannot_express) for s in SURFACES))
    assert expressible_somewhere == set(CASES)


ARRAYS = {
    "list": lambda t: list(t),
    "tuple": lambda t: tuple(t),
    "numpy int64": lambda t: np.array(t, dtype=np.int64),
    "numpy int32": lambda t: np.array(t, dtype=np.int32),
    "numpy uint16": lambda t: np.array(t, dtype=np.uint16),
    "list of numpy ints": lambda t: [np.int64(x) for x in t],
    "mx int32": lambda t: mx.array(t, dtype=mx.int32),
    "mx uint32": lambda t: mx.array(t, dtype=mx.uint32),
}


@pytest.fixture(scope="module")
def good_tokens(text_model):
    model, tokenizer = text_model
    return solo_tokens(model, tokenizer, GOOD, MAX_TOKENS)


@pytest.mark.parametrize("surface", SURFACES, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", list(ARRAYS))
def test_integer_arrays_are_token_ids_on_every_entry_point(text_model, good_tokens, surface, kind):
    model, tokenizer = text_model
    s = surface(model, tokenizer)
    kw = {"prompt_tokens": ARRAYS[kind](GOOD)}
    if not isinstance(s, Insert):
        kw["sampling"] = SamplingParams(max_tokens=MAX_TOKENS)
    assert s.run_good(kw) == good_tokens


@pytest.mark.parametrize("batch", [np.array([GOOD]), mx.array([GOOD]), [GOOD]], ids=["numpy", "mx", "list"])
def test_insert_takes_vllm_mlx_one_row_batches(text_model, good_tokens, batch):
    """vllm-mlx hands input_ids as (1, L); more rows than one are refused (they were silently cut to one)."""
    model, tokenizer = text_model
    s = Insert(model, tokenizer)
    assert s.run_good({"prompt_tokens": batch}) == good_tokens

"""Seeded mixes of the engine's features in one run, each request checked against mlx-lm alone.

Every scenario draws its budgets (slots, chunk size, a KV budget of two rows or none, the prefix cache, drafting,
the tick mix, quantized KV), then requests arriving over the first ticks, each with a random mix of sampling
features: min_tokens, ignore_eos, stop ids, a logit bias, a penalty, allowed token ids, bad words, logprobs,
sampling at a temperature; some are aborted. Invariants are checked every tick. At the end every greedy request
that was not aborted equals mlx-lm's `generate_step` alone with the same features as logits processors (the mask of
min_tokens, bad words and allowed ids, `make_logits_processors` for the bias and penalties) and the same KV
quantization, cut where the request's stops end it; no cache bytes are held; the trace replays decision for
decision. A throwaway fuzz of this shape found the sliding-window admission bug of
`test_a_sliding_window_prompt_is_admitted_only_where_its_prefill_peak_fits`; these scenarios keep it covered on
the model with an end-of-sequence token and on the sliding-window one.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from scheduler import Engine, EngineConfig, FinishReason, SamplingParams
from scheduler.events import MemorySink, _jsonable
from scheduler.execution import library
from scheduler.tools.replay import load_trace, replay

from ..helpers import min_tokens_mask

SHARED = [random.Random(1).randrange(7, 512) for _ in range(40)]


@dataclasses.dataclass(frozen=True)
class Scenario:
    config: EngineConfig
    requests: tuple[tuple[int, tuple[int, ...], SamplingParams, bool], ...]  # (arrival tick, prompt, sampling, sampled)
    aborts: tuple[tuple[int, int], ...]  # (tick, index of the request to abort)


def _sampling(rng: random.Random, n: int, vocab: int, eos: set[int],
              words: random.Random) -> tuple[SamplingParams, bool]:
    kw: dict = {"max_tokens": n}
    if words.random() < 0.2:  # (its own stream: the draws below, and the scenarios they make, stay as they were)
        kw["bad_words_ids"] = ((words.randrange(7, 512),), (words.randrange(7, 512), words.randrange(7, 512)))
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, n)
    if rng.random() < 0.2:
        kw["ignore_eos"] = True
    if rng.random() < 0.2:
        kw["stop_token_ids"] = tuple(rng.sample(range(7, 512), 3))
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(7, 512): rng.uniform(-20, 20) for _ in range(3)}
    if rng.random() < 0.2:
        kw[rng.choice(["repetition_penalty", "presence_penalty", "frequency_penalty"])] = rng.choice([1.3, 0.7])
    if rng.random() < 0.15:
        kw["allowed_token_ids"] = sorted(set(rng.sample(range(vocab), 60)) | (eos if rng.random() < 0.5 else set()))
    if rng.random() < 0.2:
        kw["logprobs"], kw["top_logprobs"] = True, rng.choice([0, 3])
    sampled = rng.random() < 0.2
    if sampled:
        kw["temperature"], kw["seed"] = 0.8, rng.randrange(100)
    return SamplingParams(**kw), sampled


def _scenario(seed: int, model, tokenizer, quantize: bool) -> Scenario:
    rng = random.Random(seed)
    layout = library.kv_layout(model)
    chunk, draft = rng.choice([5, 16, 64]), rng.choice([0, 0, 3])
    quant = {}
    if quantize and rng.random() < 0.5:
        quant, draft = dict(kv_bits=rng.choice([4, 8]), kv_group_size=32,
                            quantized_kv_start=rng.choice([0, 5, 24, 60])), 0
    config = EngineConfig(max_seqs=rng.choice([2, 4, 8]), prefill_chunk=chunk,
                          max_batched_tokens=chunk + 16 + 8 * draft,
                          kv_memory_bytes=rng.choice([None, layout.batch_bytes([len(SHARED) + 60] * 2)]),
                          kv_headroom_tokens=4, prefix_cache_bytes=rng.choice([0, 150_000, 8 << 20]),
                          draft_tokens=draft, mix=rng.choice(["decode-first", "prefill-first"]),
                          check_invariants=True, **quant)
    eos, vocab = set(tokenizer.eos_token_ids), model.args.vocab_size
    requests, words = [], random.Random(f"bad-words-{seed}")
    for _ in range(rng.randint(3, 12)):
        body = tuple(rng.randrange(7, 512) for _ in range(rng.randint(1, 60)))
        prompt = (tuple(SHARED) + body) if rng.random() < 0.4 else body
        sampling, sampled = _sampling(rng, rng.randint(1, 16), vocab, eos, words)
        requests.append((rng.randint(0, 20), prompt, sampling, sampled))
    requests.sort(key=lambda r: r[0])
    aborts = tuple((rng.randint(0, 30), rng.randrange(len(requests))) for _ in range(rng.randint(0, 2)))
    return Scenario(config, tuple(requests), aborts)


def _solo(model, tokenizer, prompt, sampling: SamplingParams, config: EngineConfig) -> list[int]:
    """mlx-lm's own steps for the request alone, its features as logits processors, cut where its stops end it."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    vocab = model.args.vocab_size
    stops = (set() if sampling.ignore_eos else set(tokenizer.eos_token_ids)) | set(sampling.stop_token_ids)
    processors = [min_tokens_mask(len(prompt), sampling.min_tokens, stops, vocab)] if sampling.min_tokens else []
    processors += make_logits_processors(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=sampling.repetition_penalty if sampling.repetition_penalty != 1 else None,
        presence_penalty=sampling.presence_penalty or None, frequency_penalty=sampling.frequency_penalty or None)
    if sampling.bad_words_ids:
        processors.insert(0, _banning(len(prompt), sampling.bad_words_ids))
    if sampling.allowed_token_ids:
        keep = np.zeros(vocab, dtype=bool)
        keep[list(sampling.allowed_token_ids)] = True
        keep = mx.array(keep)
        processors.append(lambda _, logits: mx.where(keep, logits, -mx.inf))
    quant = ({"kv_bits": config.kv_bits, "kv_group_size": config.kv_group_size,
              "quantized_kv_start": config.quantized_kv_start} if config.kv_bits else {})
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=sampling.max_tokens,
                                  logits_processors=processors or None, **quant):
        out.append(int(token))
        if out[-1] in stops and len(out) > sampling.min_tokens:
            break
    return out


def _banning(prompt_len: int, words: tuple[tuple[int, ...], ...]):
    """An mlx-lm processor for `bad_words_ids`: each word's last token masked where the output so far (not the
    prompt) ends with the rest of it."""
    import mlx.core as mx

    def processor(tokens, logits):
        out = tokens.tolist()[prompt_len:]
        ends = [w[-1] for w in words if len(w) == 1 or out[len(out) - len(w) + 1:] == list(w[:-1])]
        return logits.at[:, mx.array(ends)].add(-mx.inf) if ends else logits
    return processor


def _run(model, tokenizer, scenario: Scenario) -> None:
    sink = MemorySink()
    engine = Engine(model, tokenizer, scenario.config, event_sinks=[sink])
    pending, ids, tokens, ended, aborted = list(scenario.requests), [], {}, {}, set()
    tick = 0
    while pending or engine.has_pending():
        while pending and pending[0][0] <= tick:
            _, prompt, sampling, _ = pending.pop(0)
            ids.append(engine.add_request(prompt_tokens=list(prompt), sampling=sampling))
            tokens[ids[-1]] = []
        for at, index in scenario.aborts:
            if at == tick and index < len(ids) and engine.abort(ids[index]):
                aborted.add(ids[index])
        for out in engine.step():
            assert out.request_id not in ended, "output after the end"
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                ended[out.request_id] = (out.finish_reason, out.error)
        tick += 1
    assert set(ended) == set(ids), "every request ended exactly once"
    for rid, (_, prompt, sampling, sampled) in zip(ids, scenario.requests):
        reason, error = ended[rid]
        if reason is FinishReason.ABORT:
            assert rid in aborted
            continue
        assert reason in (FinishReason.STOP, FinishReason.LENGTH), (rid, reason, error)
        if not sampled:
            assert tokens[rid] == _solo(model, tokenizer, prompt, sampling, scenario.config), (rid, sampling)
    assert engine.executor.cache_bytes() == 0 and not engine.executor.live_request_ids()
    report = replay(load_trace([json.loads(json.dumps(e, default=_jsonable)) for e in sink.events]))
    assert report.identical, report.format()


@pytest.mark.parametrize("seed", range(12))
def test_feature_mixes_on_a_model_that_stops(text_eos_model, seed):
    model, tokenizer = text_eos_model
    _run(model, tokenizer, _scenario(seed, model, tokenizer, quantize=True))


@pytest.mark.parametrize("seed", [5, 6, 17, 20, 29, 35])  # the seeds where the throwaway fuzz found the bug
def test_feature_mixes_on_a_sliding_window_model(sliding_model, seed):
    model, tokenizer = sliding_model
    _run(model, tokenizer, _scenario(seed, model, tokenizer, quantize=False))

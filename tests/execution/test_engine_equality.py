"""The main correctness test: batched greedy output equals mlx-lm run on each request alone, token for token,
under every schedule (all at once, staggered, chunked prefill interleaved with decode, fewer slots than
requests), on a plain-KV model and on a sliding-window (rotating cache) model."""

import pytest

from scheduler import Engine, EngineConfig, FinishReason

from ..helpers import drive, engine_with_log, greedy, min_tokens_mask, mixed_prompts, solo_tokens

MAX_TOKENS = 20
PROMPTS = mixed_prompts(16, 1, 300, seed=1)

CONFIGS = {
    "all-at-once": EngineConfig(max_batched_tokens=4096, max_seqs=32, prefill_chunk=512),
    "tiny-chunks": EngineConfig(max_batched_tokens=24, max_seqs=16, prefill_chunk=7),
    "few-slots": EngineConfig(max_batched_tokens=256, max_seqs=3, prefill_chunk=64),
}


@pytest.fixture(scope="module")
def text_reference(text_model):
    model, tokenizer = text_model
    return [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def text_eos_reference(text_eos_model):
    model, tokenizer = text_eos_model
    return [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def sliding_reference(sliding_model):
    model, tokenizer = sliding_model
    return [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]


def _check(model_and_tokenizer, reference, config, staggered):
    model, tokenizer = model_and_tokenizer
    config = EngineConfig(**{**config.__dict__, "check_invariants": True})
    engine, log = engine_with_log(model, tokenizer, config)
    arrivals = [(i if staggered else 0, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS)})
                for i, p in enumerate(PROMPTS)]
    run = drive(engine, arrivals)
    outputs = list(run.tokens.values())  # ids were issued in prompt order
    mismatches = [i for i, (got, want) in enumerate(zip(outputs, reference)) if got != want]
    assert not mismatches, f"requests {mismatches} differ from their solo mlx-lm output"
    for rid, tokens in run.tokens.items():  # (run.finish is in finishing order, not id order)
        reason = run.finish[rid]
        if reason is FinishReason.LENGTH:
            assert len(tokens) == MAX_TOKENS
            assert not set(tokens) & set(tokenizer.eos_token_ids)
        else:
            assert reason is FinishReason.STOP and len(tokens) <= MAX_TOKENS
            assert tokens[-1] in tokenizer.eos_token_ids and not set(tokens[:-1]) & set(tokenizer.eos_token_ids)
    for plan in log.of_kind("plan"):  # budgets hold on every plan
        assert plan["num_batched_tokens"] <= config.max_batched_tokens
        assert plan["num_seqs"] <= config.max_seqs
        assert all(end - start <= config.prefill_chunk for _, start, end, _ in plan["prefill"])
    return log, run


@pytest.mark.parametrize("staggered", [False, True], ids=["at-once", "staggered"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_text_model_matches_solo_mlx_lm(text_model, text_reference, name, staggered):
    log, _ = _check(text_model, text_reference, CONFIGS[name], staggered)
    if name == "tiny-chunks":
        # chunked prefill really interleaved with decode: some tick had both
        assert any(p["prefill"] and p["decode"] for p in log.of_kind("plan"))


@pytest.mark.parametrize("staggered", [False, True], ids=["at-once", "staggered"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_eos_model_stops_where_solo_mlx_lm_stops(text_eos_model, text_eos_reference, name, staggered):
    """The same schedules on a model that emits eos: both finish branches run, each compared with mlx-lm."""
    _, run = _check(text_eos_model, text_eos_reference, CONFIGS[name], staggered)
    reasons = list(run.finish.values())
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons
    assert sum(r is FinishReason.STOP for r in reasons) == sum(len(t) < MAX_TOKENS for t in text_eos_reference)


@pytest.mark.slow
@pytest.mark.parametrize("staggered", [False, True], ids=["at-once", "staggered"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sliding_window_model_matches_solo_mlx_lm(sliding_model, sliding_reference, name, staggered):
    _check(sliding_model, sliding_reference, CONFIGS[name], staggered)


def test_reference_prompts_cover_the_length_range():
    lengths = sorted(len(p) for p in PROMPTS)
    assert lengths[0] == 1 and lengths[-1] == 300 and len(PROMPTS) == 16


def _equal_length_prompts():
    return [p[:40] for p in mixed_prompts(8, 40, 60, seed=4)] + [p[:10] for p in mixed_prompts(3, 10, 30, seed=5)]


def test_fresh_prompts_of_equal_length_share_one_prefill_forward_and_stay_exact(text_model):
    model, tokenizer = text_model
    prompts = _equal_length_prompts()
    engine, log = engine_with_log(model, tokenizer, EngineConfig())
    outputs = engine.generate(prompts, greedy(MAX_TOKENS))
    # the fast path ran (counted after the batched forward returned, not before it was tried); padding even one
    # chunk of 9 to 39 would cost 30 pads for 321 tokens, more than PREFILL_PAD_RATIO allows: two groups
    assert engine.prefill_stats() == {"batched_groups": 2, "batched_rows": len(prompts), "cached_rows": 0,
                                      "padded_tokens": 0, "fallbacks": 0}
    assert not any("prefill_fallbacks" in e for e in log.of_kind("outcome"))
    assert [o.token_ids for o in outputs] == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


def test_a_failing_batched_prefill_falls_back_as_an_event_and_a_counter(text_model):
    from scheduler import Engine
    from scheduler.events import MemorySink
    from scheduler.execution.executor import MLXExecutor
    from scheduler.execution.runners import TextRunner

    model, tokenizer = text_model

    class BrokenBatchedPrefill(TextRunner):
        def prefill_many(self, chunks):
            raise RuntimeError("batched prefill is broken")

    prompts = _equal_length_prompts()
    log = MemorySink()
    engine = Engine(model, tokenizer, EngineConfig(), executor=MLXExecutor(BrokenBatchedPrefill(model)),
                    event_sinks=[log])
    outputs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    assert engine.prefill_stats() == {"batched_groups": 0, "batched_rows": 0, "cached_rows": 0,
                                      "padded_tokens": 0, "fallbacks": 2}
    fallbacks = [f for e in log.of_kind("outcome") for f in e.get("prefill_fallbacks", [])]
    assert sorted((len(ids), n) for ids, n, _ in fallbacks) == [(3, 10 - 1), (8, 40 - 1)]  # ids, group width
    assert all("batched prefill is broken" in error for _, _, error in fallbacks)


def test_a_bfloat16_model_is_exact_where_the_greedy_pick_needs_the_log_softmax(text_model_dir):
    """In bfloat16 the logits are coarse: the best and the runner-up are often closer than rounding `logits -
    logsumexp` could tell apart, so the greedy pick (`kernels.sampling.GreedyPick`) takes those positions'
    log-softmax (counted in `greedy_stats`), and the plain argmax elsewhere. Batched under chunked prefill, every
    request still equals mlx-lm alone on the same bfloat16 model, token for token."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(text_model_dir))  # its own instance: the session's float32 one stays as it is
    model.set_dtype(mx.bfloat16)
    prompts = mixed_prompts(6, 4, 60, seed=7)
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=48, max_seqs=6, prefill_chunk=16,
                                                   check_invariants=True))
    outs = engine.generate(prompts, greedy(24))
    stats = engine.greedy_stats()
    assert stats["positions"] >= 6 * 23 and 0 < stats["recomputed"] < stats["positions"]
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == solo_tokens(model, tokenizer, prompt, 24)


def test_ignore_eos_runs_on_past_eos_as_mlx_lms_own_steps_do(text_eos_model, text_eos_reference):
    """`ignore_eos` (vLLM's): a request whose greedy output reaches eos runs on to max_tokens, token for token
    what mlx-lm's `generate_step` yields (it does not stop at eos), batched with the same prompts without it,
    which stop where `stream_generate` stops."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from scheduler import SamplingParams

    model, tokenizer = text_eos_model
    eos = set(tokenizer.eos_token_ids)
    stopped = [i for i, want in enumerate(text_eos_reference) if len(want) < MAX_TOKENS]
    assert stopped  # the model does reach eos on some prompts
    past_eos = {i: [int(t) for t, _ in generate_step(mx.array(PROMPTS[i]), model, max_tokens=MAX_TOKENS)]
                for i in stopped}
    engine, _ = engine_with_log(model, tokenizer, EngineConfig(check_invariants=True, max_seqs=32))
    arrivals = [(0, {"prompt_tokens": PROMPTS[i], "sampling": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=flag)})
                for i in stopped for flag in (True, False)]
    run = drive(engine, arrivals)
    outputs, reasons = list(run.tokens.values()), [run.finish[rid] for rid in run.tokens]
    for n, i in enumerate(stopped):
        assert outputs[2 * n] == past_eos[i] and reasons[2 * n] is FinishReason.LENGTH
        assert outputs[2 * n + 1] == text_eos_reference[i] and reasons[2 * n + 1] is FinishReason.STOP
    assert any(set(past_eos[i][:-1]) & eos for i in stopped)  # eos came and was run past


def _held_solo(model, tokenizer, prompt, max_tokens, min_tokens, held, stops):
    """mlx-lm's `generate_step` alone with `_held_until(held)`, cut after the first of `stops` past min_tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    mask = min_tokens_mask(len(prompt), min_tokens, held, model.args.vocab_size)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[mask]):
        out.append(int(token))
        if out[-1] in stops:
            break
    return out


def test_min_tokens_masks_the_stop_tokens_until_then_as_an_mlx_lm_processor_does(text_eos_model, text_eos_reference):
    """vLLM's `min_tokens`: until a request has that many tokens, eos (and its stop_token_ids) cannot be sampled,
    so a greedy request that reached eos early takes the next best token instead and ends later. Batched with
    the same prompts without it and with a bound they pass anyway, and with a drafting engine (a row drafts only
    once its bound is reached), each output is what mlx-lm's own steps give with that mask as a logits
    processor, token for token; no stop token comes within the bound."""
    from scheduler import SamplingParams

    model, tokenizer = text_eos_model
    eos = set(tokenizer.eos_token_ids)
    stopped = [i for i, want in enumerate(text_eos_reference) if len(want) < MAX_TOKENS - 4]
    assert stopped
    # a stop id of its own: the reference's first token, which the bound then also holds back
    cases = []
    for i in stopped:
        n = len(text_eos_reference[i])
        first = text_eos_reference[i][0]
        cases += [(i, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=n + 3), eos),
                  (i, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=n - 1), eos),
                  (i, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=n + 3, stop_token_ids=(first,)), eos | {first}),
                  (i, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=5, ignore_eos=True, stop_token_ids=(first,)),
                   {first})]
    want = [_held_solo(model, tokenizer, PROMPTS[i], MAX_TOKENS, sp.min_tokens, held, held) for i, sp, held in cases]
    assert any(w != text_eos_reference[i][: len(w)] for w, (i, _, _) in zip(want, cases))  # the mask moved outputs
    for config in (EngineConfig(check_invariants=True, max_seqs=64),
                   EngineConfig(check_invariants=True, max_seqs=8, draft_tokens=3, max_batched_tokens=96,
                                prefill_chunk=32)):
        engine, log = engine_with_log(model, tokenizer, config)
        run = drive(engine, [(0, {"prompt_tokens": PROMPTS[i], "sampling": sp}) for i, sp, _ in cases])
        outputs = list(run.tokens.values())
        for (i, sp, held), got, wanted in zip(cases, outputs, want):
            assert got == wanted, (i, sp.min_tokens)
            assert not set(got[: sp.min_tokens]) & held
        if config.draft_tokens:
            plans = log.of_kind("plan")
            held_back = {rid for p in plans for rid, reason, _ in p.get("reasons", ()) if reason == "draft_min_tokens"}
            drafted = {rid for p in plans for rid, _ in p["draft"]}
            assert held_back & drafted  # rows held back while within their bound drafted after it


def test_min_tokens_allowed_token_ids_and_bad_words_are_checked_and_recorded():
    from scheduler import InvalidRequest, SamplingParams
    from scheduler.request import StructuredOutput

    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    for bad in (-1, 5, 1.5, True):
        with pytest.raises(InvalidRequest, match="^min_tokens"):
            SamplingParams(max_tokens=4, min_tokens=bad)
    with pytest.raises(InvalidRequest, match="^min_tokens: cannot be combined with a structured output"):
        SamplingParams(max_tokens=4, min_tokens=1, structured_output=StructuredOutput.regex("a+"))
    assert SamplingParams(allowed_token_ids=[9, 3]).allowed_token_ids == (3, 9)
    for bad in ([], [3, 3], [-1], [1.5], 7):
        with pytest.raises(InvalidRequest, match="^allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(InvalidRequest, match="^allowed_token_ids: cannot be combined with a structured output"):
        SamplingParams(allowed_token_ids=[3], structured_output=StructuredOutput.regex("a+"))
    for bad in ([[]], [[1.5]], [[-1]], [5], 5):
        with pytest.raises(InvalidRequest, match="^bad_words_ids"):
            SamplingParams(bad_words_ids=bad)
    record = SamplingParams(allowed_token_ids=[9, 3], min_tokens=2, bad_words_ids=[[4], [5, 6]]).to_record()
    assert SamplingParams.from_record(record) == SamplingParams(allowed_token_ids=[3, 9], min_tokens=2,
                                                                bad_words_ids=((4,), (5, 6)))


def test_allowed_token_ids_restrict_sampling_as_an_mlx_lm_mask_processor_does(text_eos_model, text_eos_reference):
    """vLLM's `allowed_token_ids`: a greedy request samples only among them (here the tokens its solo output
    ranks second best, and eos for half of them), token for token what mlx-lm's steps give with the rest masked
    by a processor, batched with requests without them and on a drafting engine, where the restricted rows never
    draft (the others do)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from scheduler import InvalidRequest, SamplingParams
    from scheduler.request import StructuredOutput

    model, tokenizer = text_eos_model
    vocab, eos = model.args.vocab_size, sorted(tokenizer.eos_token_ids)
    rng = np.random.default_rng(3)
    cases = []
    for i in range(6):
        allowed = sorted(set(rng.choice(vocab, 40, replace=False).tolist()) | (set(eos) if i % 2 else set()))
        cases.append((i, SamplingParams(max_tokens=MAX_TOKENS, allowed_token_ids=allowed)))
        cases.append((i + 6, SamplingParams(max_tokens=MAX_TOKENS)))

    def masked(prompt, allowed):
        keep = np.zeros(vocab, dtype=bool)
        keep[list(allowed)] = True
        keep = mx.array(keep)
        out = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                      logits_processors=[lambda _, logits: mx.where(keep, logits, -mx.inf)]):
            out.append(int(token))
            if out[-1] in eos:
                break
        return out

    want = [masked(PROMPTS[i], sp.allowed_token_ids) if sp.allowed_token_ids else text_eos_reference[i]
            for i, sp in cases]
    for config in (EngineConfig(check_invariants=True, max_seqs=16),
                   EngineConfig(check_invariants=True, max_seqs=12, draft_tokens=3, max_batched_tokens=96,
                                prefill_chunk=32)):
        engine, log = engine_with_log(model, tokenizer, config)
        run = drive(engine, [(0, {"prompt_tokens": PROMPTS[i], "sampling": sp}) for i, sp in cases])
        outputs = list(run.tokens.values())
        assert outputs == want
        for (_, sp), got in zip(cases, outputs):
            if sp.allowed_token_ids:
                assert set(got) <= set(sp.allowed_token_ids)
        if config.draft_tokens:
            ids = list(run.tokens)
            drafted = {rid for p in log.of_kind("plan") for rid, _ in p["draft"]}
            restricted = {ids[n] for n, (_, sp) in enumerate(cases) if sp.allowed_token_ids}
            assert drafted and not drafted & restricted
    with pytest.raises(Exception, match="allowed_token_ids: ids outside the vocabulary"):
        engine.add_request(prompt_tokens=PROMPTS[0], sampling=SamplingParams(allowed_token_ids=[vocab]))
    # masks that leave nothing to sample are refused, for that request only (sampling from logits that are all
    # -inf returned token 0, which none of them allows); eos is sampleable once min_tokens is reached
    nothing_left = [("bad_words_ids", {"allowed_token_ids": [5, 7], "bad_words_ids": [[7], [5], [5, 9]]}),
                    ("min_tokens", {"allowed_token_ids": eos, "min_tokens": 1}),
                    ("min_tokens", {"allowed_token_ids": [*eos, 5], "min_tokens": 2, "bad_words_ids": [[5]]})]
    for field, kwargs in nothing_left:
        with pytest.raises(InvalidRequest, match=f"^{field}: every token of allowed_token_ids is one of"):
            engine.add_request(prompt_tokens=PROMPTS[0], sampling=SamplingParams(max_tokens=4, **kwargs))
    with pytest.raises(InvalidRequest, match="^bad_words_ids: every token of the vocabulary"):
        engine.add_request(prompt_tokens=PROMPTS[0], sampling=SamplingParams(bad_words_ids=[[t] for t in range(vocab)]))
    ok = SamplingParams(max_tokens=4, allowed_token_ids=[*eos, 5], min_tokens=2, ignore_eos=True)
    run = drive(engine, [(0, {"prompt_tokens": PROMPTS[0], "sampling": ok})])
    assert set(next(iter(run.tokens.values()))) <= {*eos, 5}
    # masks that close later (a two-token bad word after the only allowed token) fail that request when they do,
    # after the tokens it had; the request beside it runs on
    trapped = SamplingParams(max_tokens=4, allowed_token_ids=[5], bad_words_ids=[[5, 5]])
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], [trapped, SamplingParams(max_tokens=MAX_TOKENS)])
    assert (outs[0].token_ids, outs[0].finish_reason) == ([5], FinishReason.ERROR)
    assert outs[0].error.startswith("nothing left to sample: every token its allowed_token_ids or structured")
    assert outs[1].token_ids == text_eos_reference[1]
    # the same for a structured output whose every allowed first token is a bad word
    spec = StructuredOutput.regex("[ab]c")
    first = np.flatnonzero(engine.grammars.processor(spec, prompt_len=0).allowed([], vocab)).tolist()
    boxed = SamplingParams(max_tokens=4, structured_output=spec, bad_words_ids=[[t] for t in first])
    out = engine.generate([PROMPTS[2]], boxed)[0]
    assert (out.token_ids, out.finish_reason) == ([], FinishReason.ERROR) and "nothing left to sample" in out.error


def test_bad_words_are_kept_out_of_the_output_as_an_mlx_lm_processor_keeps_them(text_model, text_reference):
    """`bad_words_ids` (Hugging Face's; vLLM's `bad_words` as token sequences): a one-token word is never
    sampled, a longer word's last token not where the output so far ends with the rest of it. Each request's
    words are taken from its own solo output (its second token; its fourth and fifth as a pair), so they change
    it; greedy output equals mlx-lm's steps with that rule as a processor, batched with requests without words."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from scheduler import SamplingParams

    model, tokenizer = text_model

    def banning(prompt_len, words):
        def processor(tokens, logits):
            out = tokens.tolist()[prompt_len:]
            ends = [w[-1] for w in words if len(w) == 1 or out[len(out) - len(w) + 1:] == list(w[:-1])]
            return logits.at[:, mx.array(ends)].add(-mx.inf) if ends else logits
        return processor

    cases = []
    for i in range(6):
        ref = text_reference[i]
        words = ((ref[1],), (ref[3], ref[4]))
        cases.append((i, SamplingParams(max_tokens=MAX_TOKENS, bad_words_ids=words)))
        cases.append((i + 6, SamplingParams(max_tokens=MAX_TOKENS)))
    want = []
    for i, sp in cases:
        if not sp.bad_words_ids:
            want.append(text_reference[i])
            continue
        steps = generate_step(mx.array(PROMPTS[i]), model, max_tokens=MAX_TOKENS,
                              logits_processors=[banning(len(PROMPTS[i]), sp.bad_words_ids)])
        want.append([int(t) for t, _ in steps])
    for (i, sp), got in zip(cases, want):
        if sp.bad_words_ids:
            assert got != text_reference[i] and sp.bad_words_ids[0][0] not in got
            assert not any(got[k:k + 2] == list(sp.bad_words_ids[1]) for k in range(len(got) - 1))
    engine, _ = engine_with_log(model, tokenizer, EngineConfig(check_invariants=True, max_seqs=16, draft_tokens=2,
                                                               max_batched_tokens=96, prefill_chunk=32))
    run = drive(engine, [(0, {"prompt_tokens": PROMPTS[i], "sampling": sp}) for i, sp in cases])
    assert list(run.tokens.values()) == want
    with pytest.raises(Exception, match="^bad_words_ids: ids outside the vocabulary"):
        engine.add_request(prompt_tokens=PROMPTS[0], sampling=SamplingParams(bad_words_ids=[[5, 10 ** 6]]))

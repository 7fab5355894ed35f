"""Engine behaviour on the tiny real model: bad input, aborts in every state, sampling paths against
mlx-lm, threads, streaming and asyncio."""

import asyncio
import threading

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from scheduler import (
    AsyncEngine,
    Engine,
    EngineConfig,
    FinishReason,
    InvalidRequest,
    RequestState,
    SamplingParams,
    UnknownRequest,
)

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

PROMPTS = mixed_prompts(6, 3, 120, seed=7)


@pytest.fixture
def engine(text_model):
    model, tokenizer = text_model
    return Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=8, prefill_chunk=16,
                                                 max_model_len=400, check_invariants=True))


@pytest.fixture(scope="module")
def reference(text_model):
    model, tokenizer = text_model
    return [solo_tokens(model, tokenizer, p, 12) for p in PROMPTS]


BAD_INPUTS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt_tokens": []}, "prompt"),
    ({"prompt_tokens": [5, 512]}, "prompt_tokens"),
    ({"prompt_tokens": [-1, 5]}, "prompt_tokens"),
    ({"prompt_tokens": [7] * 401}, "prompt"),
    ({"prompt": "hi", "prompt_tokens": [5]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt_tokens": [5], "sampling": {"temperature": 1}}, "sampling"),
    ({"prompt_tokens": [5], "sampling": SamplingParams(stop_token_ids=(600,))}, "stop_token_ids"),
    ({"prompt_tokens": [5], "images": ["x.png"]}, "images"),
    ({"prompt_tokens": [5], "request_id": ""}, "request_id"),
    ({"prompt_tokens": [5], "priority": "high"}, "priority"),
]


@pytest.mark.parametrize("kwargs,field", BAD_INPUTS)
def test_bad_input_is_refused_for_that_request_only(engine, reference, kwargs, field):
    good = engine.add_request(prompt_tokens=PROMPTS[0], sampling=greedy(12))
    tokens = []
    for out in engine.step():  # the good request is running when the bad one arrives
        tokens.extend(out.token_ids)
    with pytest.raises(InvalidRequest) as info:
        engine.add_request(**kwargs)
    assert info.value.field == field
    while engine.has_pending():
        for out in engine.step():
            assert out.request_id == good, "nothing of the refused request exists"
            tokens.extend(out.token_ids)
    assert tokens == reference[0]
    assert engine.state_of(good) is RequestState.FINISHED


def test_a_duplicate_live_id_is_refused_and_the_original_continues(engine, reference):
    engine.add_request(prompt_tokens=PROMPTS[0], sampling=greedy(12), request_id="a")
    with pytest.raises(InvalidRequest, match="duplicate"):
        engine.add_request(prompt_tokens=PROMPTS[1], request_id="a")
    tokens = []
    while engine.has_pending():
        for out in engine.step():
            tokens.extend(out.token_ids)
    assert tokens == reference[0]


def test_duplicate_id_of_an_ended_request_is_refused(engine):
    engine.add_request(prompt_tokens=[9, 10], sampling=greedy(2), request_id="done")
    while engine.has_pending():
        engine.step()
    with pytest.raises(InvalidRequest, match="duplicate"):
        engine.add_request(prompt_tokens=[9, 10], request_id="done")


def test_abort_unknown_raises_and_abort_finished_is_a_noop(engine):
    with pytest.raises(UnknownRequest):
        engine.abort("never-seen")
    rid = engine.add_request(prompt_tokens=[9, 10, 11], sampling=greedy(3))
    while engine.has_pending():
        engine.step()
    assert engine.abort(rid) is False
    assert engine.state_of(rid) is RequestState.FINISHED


@pytest.mark.parametrize("target_state", [RequestState.QUEUED, RequestState.CHUNK_PREFILLING, RequestState.DECODING])
def test_abort_in_every_live_state_frees_everything(engine, reference, target_state):
    others = [engine.add_request(prompt_tokens=p, sampling=greedy(12)) for p in PROMPTS[:3]]
    victim = engine.add_request(prompt_tokens=[11] * 200, sampling=greedy(50))
    tokens = {rid: [] for rid in others}
    victim_outputs = []

    def step():
        for out in engine.step():
            if out.request_id == victim:
                victim_outputs.append(out)
            else:
                tokens[out.request_id].extend(out.token_ids)

    while engine.state_of(victim) is not target_state:
        step()
    assert engine.abort(victim) is True
    step()
    assert engine.state_of(victim) is RequestState.ABORTED
    assert victim not in engine.executor.live_request_ids()
    while engine.has_pending():
        step()
    assert victim_outputs[-1].finished and victim_outputs[-1].finish_reason is FinishReason.ABORT
    assert sum(o.finished for o in victim_outputs) == 1
    assert [tokens[rid] for rid in others] == reference[:3]
    assert engine.executor.cache_bytes() == 0
    assert engine.abort(victim) is False


def test_aborted_neighbours_do_not_change_survivors(text_model, reference):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=8, prefill_chunk=16,
                                                   check_invariants=True))
    ids = [engine.add_request(prompt_tokens=p, sampling=greedy(12)) for p in PROMPTS]
    tokens = {rid: [] for rid in ids}
    tick = 0
    while engine.has_pending():
        if tick == 6:
            engine.abort(ids[1])
            engine.abort(ids[4])
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        tick += 1
    for i, rid in enumerate(ids):
        if i in (1, 4):
            assert engine.state_of(rid) is RequestState.ABORTED
        else:
            assert tokens[rid] == reference[i]
    assert engine.executor.cache_bytes() == 0


def test_stop_token_ids_end_the_request_with_stop(engine, reference):
    want = reference[2]
    stop = want[4]
    cut = want.index(stop) + 1
    run = drive(engine, [(0, {"prompt_tokens": PROMPTS[2], "sampling": SamplingParams(max_tokens=12, stop_token_ids=(stop,))})])
    (tokens,) = run.tokens.values()
    assert tokens == want[:cut]
    assert list(run.finish.values()) == [FinishReason.STOP]


def test_each_request_produces_exactly_max_tokens(engine):
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(n)}) for p, n in zip(PROMPTS, [1, 2, 3, 5, 8, 13])])
    for (rid, tokens), n, reason in zip(run.tokens.items(), [1, 2, 3, 5, 8, 13], run.finish.values()):
        assert len(tokens) == n or reason is FinishReason.STOP


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(text_model):
    model, tokenizer = text_model
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    def tokens_of(engine, rid_prompt, others):
        arrivals = [(0, {"prompt_tokens": p, "sampling": s}) for p, s in others]
        arrivals.insert(len(others) // 2, (0, {"prompt_tokens": rid_prompt, "sampling": sampled, "request_id": "x"}))
        run = drive(engine, arrivals)
        return run.tokens["x"]

    alone = tokens_of(Engine(model, tokenizer), PROMPTS[3], [])
    crowd = [(p, SamplingParams(max_tokens=10, temperature=t, seed=i)) for i, (p, t) in
             enumerate(zip(PROMPTS, [0.0, 1.3, 0.5, 0.0, 2.0, 0.7]))]
    batched = tokens_of(Engine(model, tokenizer, EngineConfig(max_batched_tokens=40, prefill_chunk=9)), PROMPTS[3], crowd)
    assert alone == batched
    assert len(set(alone)) > 1
    other_seed = drive(Engine(model, tokenizer), [(0, {"prompt_tokens": PROMPTS[3], "sampling": SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99)})])
    assert list(other_seed.tokens.values())[0] != alone


def test_a_mixed_batch_drawn_apart_gives_the_whole_batch_kernels_tokens_and_logprobs(text_model, reference):
    """Greedy rows beside sampled ones (with and without filters, one with a penalty), some asking for logprobs
    and top logprobs: a plain tick draws them apart (`kernels.sampling.draw_tokens`: no log-softmax for the greedy
    rows and the unfiltered sampled ones, and one only of the rows asking for logprobs). A row with a custom
    sampler sends the batch through the whole-batch kernel instead; every other row's tokens, logprobs and top
    logprobs are the same either way, and the greedy rows are mlx-lm's own."""
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = text_model
    kinds = [dict(logprobs=True, top_logprobs=3), dict(temperature=1.0, seed=5),
             dict(temperature=0.8, top_p=0.9, seed=6, logprobs=True), dict(),
             dict(temperature=1.3, repetition_penalty=1.2, seed=7, logprobs=True, top_logprobs=2),
             dict(temperature=0.6, min_p=0.05, seed=8)]

    def run(custom: bool):
        arrivals = [(0, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=12, **kw), "request_id": f"r{i}"})
                    for i, (p, kw) in enumerate(zip(PROMPTS, kinds))]
        if custom:  # mlx-lm's own greedy sampler as a custom one: the batch is no longer drawn apart
            arrivals.append((0, {"prompt_tokens": PROMPTS[5], "request_id": "custom",
                                 "sampling": SamplingParams(max_tokens=12, sampler=make_sampler(temp=0.0))}))
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=96, prefill_chunk=16))
        for _, kwargs in arrivals:
            engine.add_request(**kwargs)
        tokens, scores, top = {}, {}, {}
        while engine.has_pending():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
                scores.setdefault(out.request_id, []).extend(out.logprobs)
                top.setdefault(out.request_id, []).extend(out.top_logprobs)
        rids = [f"r{i}" for i in range(6)]
        return [tokens[r] for r in rids], [scores[r] for r in rids], [top[r] for r in rids], engine.greedy_stats()

    drawn, logprobs, top, stats = run(False)
    whole, whole_logprobs, whole_top, whole_stats = run(True)
    assert drawn == whole and logprobs == whole_logprobs and top == whole_top
    assert drawn[0] == reference[0] and drawn[3] == reference[3]
    # the split ran in every tick of the first run, and in the second only in ticks without the custom row
    assert stats["positions"] > whole_stats["positions"]
    assert all(len(logprobs[i]) == 12 for i in (0, 2, 4)) and not logprobs[1]
    assert len(top[0][0]) == 3 and len(top[4][0]) == 2
    assert len({t for row in drawn[1:3] for t in row}) > 1


def test_penalties_match_mlx_lm_processors(text_model):
    model, tokenizer = text_model
    plain = [solo_tokens(model, tokenizer, p, 14) for p in PROMPTS[:4]]
    for kwargs in ({"repetition_penalty": 1.3}, {"presence_penalty": 0.8}, {"frequency_penalty": 0.9},
                   {"repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.5}):
        procs = make_logits_processors(**kwargs)
        want = [solo_tokens(model, tokenizer, p, 14, logits_processors=procs) for p in PROMPTS[:4]]
        assert want != plain, kwargs  # the penalty changes what the model says
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=48, prefill_chunk=11))
        run = drive(engine, [(0, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=14, **kwargs)})
                             for p in PROMPTS[:4]])
        assert list(run.tokens.values()) == want, kwargs


def test_logit_bias_matches_mlx_lms_processor_and_bad_ids_are_refused(text_model, reference):
    """SamplingParams.logit_bias is mlx-lm's `make_logits_processors(logit_bias=...)`: greedy rows with biases
    (one mixed with a repetition penalty, which mlx-lm applies after the bias) batched with plain rows, under
    drafting (biased rows do not draft), each equal to mlx-lm alone with that processor; the biases change the
    output. An id outside the vocabulary or a bad value is refused naming `logit_bias`."""
    model, tokenizer = text_model
    boost = {t: 6.0 for t in reference[0][2:5]} | {reference[0][0]: -50.0}
    cases = [(PROMPTS[0], dict(logit_bias=boost)), (PROMPTS[1], {}),
             (PROMPTS[2], dict(logit_bias={reference[2][1]: -100.0, 7: 4.5}, repetition_penalty=1.3)),
             (PROMPTS[3], dict(logit_bias={reference[3][0]: 3.0}))]
    want = [solo_tokens(model, tokenizer, p, 12, logits_processors=make_logits_processors(**kw)) for p, kw in cases]
    assert want[0] != reference[0] and want[2] != reference[2]
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=48, prefill_chunk=11, draft_tokens=2,
                                                   check_invariants=True))
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=12, **kw)}) for p, kw in cases])
    assert list(run.tokens.values()) == want
    for bad in ({engine.vocab_size: 1.0}, {-3: 1.0}, {5: float("inf")}, [(5, 1.0), (5, 2.0)]):
        with pytest.raises(InvalidRequest) as info:  # (from SamplingParams, or from add_request for the vocabulary)
            engine.add_request(prompt_tokens=PROMPTS[0], sampling=SamplingParams(logit_bias=bad))
        assert info.value.field == "logit_bias"
    assert not engine.has_pending()


def test_logits_processors_match_mlx_lm_and_a_raising_one_fails_alone(text_model, reference):
    model, tokenizer = text_model
    banned = reference[0][1]

    def ban(tokens, logits):
        return mx.where(mx.arange(logits.shape[-1]) == banned, -mx.inf, logits)

    def explode(tokens, logits):
        if tokens.size > len(PROMPTS[2]) + 2:
            raise RuntimeError("processor bug")
        return logits

    want = solo_tokens(model, tokenizer, PROMPTS[0], 12, logits_processors=[ban])
    engine = Engine(model, tokenizer, EngineConfig(check_invariants=True))
    run = drive(engine, [
        (0, {"prompt_tokens": PROMPTS[0], "sampling": SamplingParams(max_tokens=12, logits_processors=(ban,))}),
        (0, {"prompt_tokens": PROMPTS[1], "sampling": greedy(12)}),
        (0, {"prompt_tokens": PROMPTS[2], "sampling": SamplingParams(max_tokens=12, logits_processors=(explode,))}),
    ])
    a, b, c = run.tokens
    assert run.tokens[a] == want and banned not in want
    assert run.tokens[b] == reference[1]
    assert run.finish[c] is FinishReason.ERROR and "processor bug" in run.errors[c]
    assert len(run.tokens[c]) == 3
    assert engine.state_of(c) is RequestState.ABORTED


def test_logprobs_match_mlx_lm(text_model):
    model, tokenizer = text_model
    from mlx_lm import stream_generate

    want = [(r.token, r.logprobs[r.token].item()) for r in stream_generate(model, tokenizer, PROMPTS[1], max_tokens=8)]
    engine = Engine(model, tokenizer)
    (out,) = engine.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=8, logprobs=True))[:1]
    assert out.token_ids == [t for t, _ in want]
    assert out.logprobs == pytest.approx([lp for _, lp in want], abs=1e-5)


def test_top_logprobs_are_the_most_likely_tokens_of_mlx_lms_own_distribution(text_model):
    """Each output token's `top_logprobs` alternatives are the k largest entries of the log-softmax mlx-lm's
    stream_generate reports for that step (the request runs batched next to others with other k): the values
    match mlx-lm's k largest in order, and each listed token has the value mlx-lm gives it (so a tie may list
    either token, never a wrong one). Greedy, so the first alternative is the chosen token."""
    model, tokenizer = text_model
    from mlx_lm import stream_generate

    steps = [r.logprobs for r in stream_generate(model, tokenizer, PROMPTS[1], max_tokens=8)]
    engine = Engine(model, tokenizer)
    k = 5
    outs = engine.generate([PROMPTS[1], PROMPTS[2], PROMPTS[3]],
                           [SamplingParams(max_tokens=8, logprobs=True, top_logprobs=k),
                            SamplingParams(max_tokens=8, logprobs=True, top_logprobs=2),
                            SamplingParams(max_tokens=8)])
    out = outs[0]
    assert len(out.top_logprobs) == len(out.token_ids) == len(steps)
    for token, chosen, alternatives, vector in zip(out.token_ids, out.logprobs, out.top_logprobs, steps):
        want = sorted(vector.tolist(), reverse=True)[:k]
        assert [lp for _, lp in alternatives] == pytest.approx(want, abs=1e-5)
        assert [lp for _, lp in alternatives] == sorted((lp for _, lp in alternatives), reverse=True)
        for alt, lp in alternatives:
            assert vector[alt].item() == pytest.approx(lp, abs=1e-5)
        assert alternatives[0] == (token, chosen)
    assert [len(a) for a in outs[1].top_logprobs] == [2] * len(outs[1].token_ids)
    assert outs[2].top_logprobs == [] and outs[2].logprobs == []


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_top_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequest, match="top_logprobs: must be an integer in"):
        SamplingParams(logprobs=True, top_logprobs=bad)


def test_top_logprobs_without_logprobs_is_refused():
    with pytest.raises(InvalidRequest, match="top_logprobs: needs logprobs=True"):
        SamplingParams(top_logprobs=3)


def test_threads_adding_and_aborting_while_the_engine_steps(text_model, reference):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=8, prefill_chunk=16,
                                                   check_invariants=True))
    kept, doomed, errors = {}, [], []

    def client(n):
        try:
            for i, p in enumerate(PROMPTS):
                rid = engine.add_request(prompt_tokens=p, sampling=greedy(12), request_id=f"t{n}-{i}")
                if i % 3 == 2:
                    engine.abort(rid)
                    doomed.append(rid)
                else:
                    kept[rid] = i
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    tokens, ended = {}, {}
    while any(t.is_alive() for t in threads) or engine.has_pending():
        for out in engine.step():
            assert out.request_id not in ended
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                ended[out.request_id] = out.finish_reason
    for t in threads:
        t.join()
    assert not errors
    for rid, i in kept.items():
        assert tokens[rid] == reference[i], rid
    for rid in doomed:
        assert engine.state_of(rid) is RequestState.ABORTED and ended[rid] is FinishReason.ABORT
    assert engine.executor.cache_bytes() == 0


def test_stream_yields_the_solo_tokens(engine, reference):
    tokens = []
    outs = list(engine.stream(prompt_tokens=PROMPTS[4], sampling=greedy(12)))
    for out in outs:
        tokens.extend(out.token_ids)
    assert tokens == reference[4]
    assert outs[-1].finished and sum(o.finished for o in outs) == 1


def test_asyncio_clients_and_a_cancelled_stream(text_model, reference):
    model, tokenizer = text_model

    async def main():
        async with AsyncEngine(Engine(model, tokenizer, EngineConfig(check_invariants=True))) as aengine:
            async def cancelled():
                async for _ in aengine.stream(prompt_tokens=[11] * 50, sampling=greedy(200), request_id="c"):
                    raise asyncio.CancelledError
            results = await asyncio.gather(*(aengine.generate(prompt_tokens=p, sampling=greedy(12)) for p in PROMPTS),
                                           cancelled(), return_exceptions=True)
            for _ in range(200):
                if aengine.engine.state_of("c") is RequestState.ABORTED:
                    break
                await asyncio.sleep(0.01)
            return results, aengine.engine.state_of("c")

    results, cancelled_state = asyncio.run(main())
    assert [r.token_ids for r in results[:-1]] == reference
    assert isinstance(results[-1], asyncio.CancelledError)
    assert cancelled_state is RequestState.ABORTED


def test_stats_count_tokens_once(engine):
    outs = engine.generate(PROMPTS[:3], greedy(5))
    stats = engine.stats()
    assert stats.generation_tokens == sum(len(o.token_ids) for o in outs)
    assert stats.prompt_tokens == sum(len(p) for p in PROMPTS[:3])
    assert stats.requests_finished == 3 and stats.generation_tps > 0
    assert set(stats.time_in_state) >= {"queued", "chunk_prefilling", "decoding"}


def test_a_chat_can_end_without_the_generation_prompt_or_continue_its_last_message(text_model):
    """chat_template_kwargs `continue_final_message` / `add_generation_prompt` (transformers' arguments, vLLM's
    fields): the prompt is what the tokenizer's chat template renders with them (the assistant's beginning left
    open, or no generation prompt), and the output is mlx-lm's alone on it, batched with the plain chat; a
    continued message must be the assistant's and excludes the generation prompt."""
    model, tokenizer = text_model
    ask = [{"role": "user", "content": "Tell me about the river"}]
    begun = ask + [{"role": "assistant", "content": "The river is"}]
    cases = {"continued": (begun, {"continue_final_message": True}),
             "ended": (ask, {"add_generation_prompt": False}), "plain": (ask, None)}
    engine = Engine(model, tokenizer, EngineConfig(check_invariants=True))
    rendered = {}
    for rid, (messages, kwargs) in cases.items():
        template = {"add_generation_prompt": True, **(kwargs or {})}
        if template.get("continue_final_message"):
            template["add_generation_prompt"] = False
        rendered[rid] = list(tokenizer.apply_chat_template(messages, **template))
        assert engine.tokenize(messages, chat_template_kwargs=kwargs) == rendered[rid], rid
    assert tokenizer.decode(rendered["continued"]).endswith("assistant\nThe river is")
    assert len({tuple(ids) for ids in rendered.values()}) == 3
    run = drive(engine, [(0, dict(prompt=messages, chat_template_kwargs=kwargs, request_id=rid,
                                  sampling=SamplingParams(max_tokens=10)))
                         for rid, (messages, kwargs) in cases.items()])
    for rid in cases:
        assert run.tokens[rid] == solo_tokens(model, tokenizer, rendered[rid], 10), rid
    for kwargs, messages in (({"continue_final_message": True}, ask),
                             ({"continue_final_message": True, "add_generation_prompt": True}, begun),
                             ({"continue_final_message": "yes"}, begun)):
        with pytest.raises(InvalidRequest, match="^chat_template_kwargs"):
            engine.add_request(prompt=messages, chat_template_kwargs=kwargs)


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_the_prompt(text_model, vlm_model_dir):
    """vLLM's `truncate_prompt_tokens`: only the last k prompt tokens are kept, so the output is mlx-lm's alone on
    them (the trace records the kept ids), and a prompt longer than max_model_len is accepted when truncated to
    fit; a vision-language prompt with media is refused by field (truncating would cut its media's tokens), one
    without is truncated like a text model's."""
    import mlx_vlm
    import numpy as np
    from PIL import Image

    from ..helpers import engine_with_log

    model, tokenizer = text_model
    long_prompt = mixed_prompts(1, 450, 450, seed=3)[0]
    engine, log = engine_with_log(model, tokenizer, EngineConfig(max_model_len=400, check_invariants=True))
    with pytest.raises(InvalidRequest, match="^prompt: has 450 tokens"):
        engine.add_request(prompt_tokens=long_prompt)
    run = drive(engine, [(0, {"prompt_tokens": long_prompt, "sampling": SamplingParams(max_tokens=8,
                                                                                        truncate_prompt_tokens=k)})
                         for k in (50, 390)])
    for k, tokens in zip((50, 390), run.tokens.values()):
        assert tokens == solo_tokens(model, tokenizer, long_prompt[-k:], 8), k
    assert [e["prompt_tokens"] for e in log.of_kind("arrival")] == [long_prompt[-50:], long_prompt[-390:]]
    for bad in (0, -1, 2.5):
        with pytest.raises(InvalidRequest, match="^truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)

    vlm = Engine(*mlx_vlm.load(str(vlm_model_dir)))
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    ask = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    with pytest.raises(InvalidRequest, match="^truncate_prompt_tokens: the prompt has .* media"):
        vlm.add_request(prompt=ask, images=[image], sampling=SamplingParams(truncate_prompt_tokens=5))
    text = [{"role": "user", "content": "Tell me a long story about the river and the garden"}]
    ids = vlm.tokenize(text)
    (cut,) = vlm.generate([text], [SamplingParams(max_tokens=6, truncate_prompt_tokens=7)])
    (given,) = vlm.generate([ids[-7:]], [SamplingParams(max_tokens=6)])
    assert cut.token_ids == given.token_ids and len(ids) > 7
    assert not vlm.has_pending()

"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the tokens before it,
equal to what one forward of the prompt alone gives, whatever the engine did around it: chunked prefill, other
requests batched beside it, a recurrent model's prefix checkpoints, a preemption and recompute, kv_bits. Every
text family: tests/execution/test_families.py; every VLM family, image prompts included:
tests/models/test_vlm_families.py. The request's output tokens do not change."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from scheduler import Engine, EngineConfig, InvalidRequest, SamplingParams
from scheduler.fixtures.families import build_family_model

from ..execution.family_conformance import preempting_config
from ..helpers import engine_with_log, greedy, mixed_prompts, solo_tokens

MAX_TOKENS = 5
TOLERANCE = 1e-4  # chunked forwards against one forward of the whole prompt: BLAS order only


def forward_logprobs(logits: mx.array, prompt: list[int]) -> tuple[list, list]:
    """(each prompt token's logprob, each position's log-softmax vector) from one (L, V) logits of the prompt."""
    logits = logits.astype(mx.float32)
    vectors = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    picked = [None] + [float(vectors[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    return picked, [None] + [vectors[i] for i in range(len(prompt) - 1)]


def alone(model, prompt: list[int]) -> tuple[list, list]:
    return forward_logprobs(model(mx.array(prompt)[None])[0], prompt)


def assert_prompt_logprobs(got_values, got_top, want_values, want_vectors, k, got_ranks):
    assert len(got_values) == len(want_values) == len(got_top) == len(got_ranks)
    assert got_values[0] is None and got_top[0] == [] and got_ranks[0] is None
    assert got_values[1:] == pytest.approx(want_values[1:], abs=TOLERANCE)
    assert_ranks(got_ranks[1:], want_values[1:], want_vectors[1:])
    for alternatives, vector in zip(got_top[1:], want_vectors[1:]):
        assert len(alternatives) == k
        # the k largest in order, each with the value the forward gives it (a tie may list either token)
        assert [lp for _, lp in alternatives] == pytest.approx(sorted(vector.tolist(), reverse=True)[:k],
                                                               abs=TOLERANCE)
        for token, lp in alternatives:
            assert vector[token] == pytest.approx(lp, abs=TOLERANCE)


def assert_ranks(got_ranks, want_values, want_vectors):
    """Each token's rank is how many entries of its position's log-softmax score at least as high as it, itself
    included (vLLM's): within the BLAS tolerance, between the count of entries clearly above it (+ 1) and the
    count of those not clearly below it."""
    for rank, value, vector in zip(got_ranks, want_values, want_vectors):
        assert isinstance(rank, int)
        assert int((vector > value + TOLERANCE).sum()) + 1 <= rank <= int((vector >= value - TOLERANCE).sum())


def run_collecting(engine, arrivals):
    """Step `engine` with `(tick, add_request kwargs)` arrivals until it drains. Returns (tokens, errors, carried):
    per request id its tokens, its error, and every (prompt_logprobs, prompt_top_logprobs, prompt_logprob_ranks)
    an output carried."""
    tokens, errors, carried, pending = {}, {}, {}, sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_pending():
        while pending and pending[0][0] <= engine.tick:
            tokens[engine.add_request(**pending.pop(0)[1])] = []
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.error:
                errors[out.request_id] = out.error
            if out.prompt_logprobs is not None:
                carried.setdefault(out.request_id, []).append((out.prompt_logprobs, out.prompt_top_logprobs,
                                                               out.prompt_logprob_ranks))
    return tokens, errors, carried


@pytest.mark.parametrize("chunk", [7, 64])
def test_prompt_logprobs_equal_one_forward_of_the_prompt_alone(text_model, chunk):
    """Requests with k = 3, 1 and 0 run beside requests that did not ask; chunked or not, each asking request's
    values match the prompt's own forward, it gets them once, with its first token, and every request's tokens
    are its solo greedy tokens."""
    model, tokenizer = text_model
    prompts = mixed_prompts(6, 2, 40, seed=31)
    asks = {0: 3, 2: 0, 5: 1}
    config = EngineConfig(max_batched_tokens=96, max_seqs=6, prefill_chunk=chunk, check_invariants=True)
    tokens, errors, carried = run_collecting(Engine(model, tokenizer, config), [
        (i // 2, {"prompt_tokens": p, "request_id": f"r{i}",
                  "sampling": SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=asks.get(i))})
        for i, p in enumerate(prompts)])
    assert not errors
    assert set(carried) == {f"r{i}" for i in asks}
    for i, k in asks.items():
        (values, top, ranks), = carried[f"r{i}"]
        want, vectors = alone(model, prompts[i])
        assert_prompt_logprobs(values, top, want, vectors, k, ranks)
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == solo_tokens(model, tokenizer, p, MAX_TOKENS)


def test_rows_of_a_shared_prefill_forward_read_their_own_positions(text_model):
    """Requests that all ask, arriving together: their chunks share right-padded forwards (counted in
    `prefill_stats`), and each row's values are its own prompt's, not its pads' or a neighbour's. The token
    budget (70) gives the third prompt a first chunk of 22 beside two of 24: its pads sit mid-prompt, where the
    logits past its 22 positions would score its next real tokens if they were read."""
    model, tokenizer = text_model
    prompts = mixed_prompts(3, 40, 40, seed=12)
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=70, prefill_chunk=24, check_invariants=True))
    outs = engine.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=2))
    stats = engine.executor.prefill_stats
    assert stats.batched_rows >= len(prompts) and stats.padded_tokens > 0
    for out, prompt in zip(outs, prompts):
        assert_prompt_logprobs(out.prompt_logprobs, out.prompt_top_logprobs, *alone(model, prompt), 2,
                           out.prompt_logprob_ranks)
        assert out.token_ids == solo_tokens(model, tokenizer, prompt, 2)


def test_a_feed_longer_than_one_log_softmax_block(text_model):
    """One 299-position feed is scored in blocks of PROMPT_LOGPROB_BLOCK positions; they join up."""
    from scheduler.execution.executor import PROMPT_LOGPROB_BLOCK

    model, tokenizer = text_model
    prompt = mixed_prompts(1, 300, 300, seed=13)[0]
    assert len(prompt) - 1 > PROMPT_LOGPROB_BLOCK
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=512, prefill_chunk=512))
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert_prompt_logprobs(out.prompt_logprobs, out.prompt_top_logprobs, *alone(model, prompt), 3,
                           out.prompt_logprob_ranks)


def test_generate_and_a_one_token_prompt(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer)
    one, many, none = engine.generate([[7], [7, 8, 9, 10], [7, 8]],
                                      [SamplingParams(max_tokens=2, prompt_logprobs=2),
                                       SamplingParams(max_tokens=2, prompt_logprobs=0),
                                       SamplingParams(max_tokens=2)])
    assert one.prompt_logprobs == [None] and one.prompt_top_logprobs == [[]] and one.prompt_logprob_ranks == [None]
    assert many.prompt_logprobs[1:] == pytest.approx(alone(model, [7, 8, 9, 10])[0][1:], abs=TOLERANCE)
    assert none.prompt_logprobs is None and none.prompt_top_logprobs is None and none.prompt_logprob_ranks is None


def test_the_prefix_cache_is_not_looked_up_for_a_request_that_asks(text_model):
    """A prompt whose blocks are cached is still computed from its first token when it asks for prompt
    logprobs (its logits are what it asked for), and that is neither a hit nor a miss; the same prompt without
    asking hits."""
    model, tokenizer = text_model
    prompt = mixed_prompts(1, 40, 40, seed=3)[0]
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=1 << 24, prefix_block_size=8))
    engine.generate([prompt], greedy(2))
    before = engine.prefix_cache_stats()
    asked, plain = engine.generate([prompt, prompt], [SamplingParams(max_tokens=2, prompt_logprobs=1), greedy(2)])
    after = engine.prefix_cache_stats()
    assert asked.prompt_logprobs[1:] == pytest.approx(alone(model, prompt)[0][1:], abs=TOLERANCE)
    assert asked.token_ids == plain.token_ids
    assert after["hits"] - before["hits"] == 1 and after["misses"] == before["misses"]


def test_a_preempted_request_gets_its_prompt_logprobs_once(text_model):
    """Under a KV budget the newest row is preempted and recomputed: it gets its prompt logprobs once, with its
    first token, and they are the prompt's own."""
    model, tokenizer = text_model
    prompts = mixed_prompts(3, 24, 24, seed=9)
    engine, sink = engine_with_log(model, tokenizer, preempting_config(model, prompts))
    tokens, errors, carried = run_collecting(engine, [
        (0, {"prompt_tokens": p, "request_id": f"r{i}", "sampling": SamplingParams(max_tokens=6, prompt_logprobs=2)})
        for i, p in enumerate(prompts)])
    assert not errors
    assert engine.scheduler.requests == {} and any(
        e["trigger"] == "preempt" for e in sink.of_kind("transition")), "the budget preempted a row"
    for i, p in enumerate(prompts):
        (values, top, ranks), = carried[f"r{i}"]
        assert_prompt_logprobs(values, top, *alone(model, p), 2, ranks)
        assert tokens[f"r{i}"] == solo_tokens(model, tokenizer, p, 6)


def test_a_recurrent_models_checkpointed_prefill(tmp_path):
    """lfm2 (convolution state) with the prefix cache on: its prefill stops at block boundaries to store
    checkpoints, and each piece's logprobs join up to the prompt's own forward."""
    model, tokenizer = load(str(build_family_model("lfm2", tmp_path / "lfm2")))
    prompt = mixed_prompts(1, 45, 45, seed=4)[0]
    engine = Engine(model, tokenizer, EngineConfig(prefill_chunk=20, prefix_cache_bytes=1 << 24,
                                                   prefix_block_size=8))
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=1))
    assert_prompt_logprobs(out.prompt_logprobs, out.prompt_top_logprobs, *alone(model, prompt), 1,
                           out.prompt_logprob_ranks)
    assert out.token_ids == solo_tokens(model, tokenizer, prompt, 3)


def test_with_kv_bits_the_prompt_is_scored_on_the_float_cache_as_mlx_lm_keeps_it(tmp_path):
    """kv_bits converts a request's cache where mlx-lm alone would (after the prompt's prefill for any prompt
    under its 2048-token prefill step): the prompt's positions are computed from float keys and values, so the
    values are the float forward's, and the tokens are mlx-lm's with the same kv_bits."""
    model, tokenizer = load(str(build_family_model("qwen3", tmp_path / "qwen3", overrides={"head_dim": 64})))
    prompt = mixed_prompts(1, 40, 40, seed=8)[0]
    quantized = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=16)
    engine = Engine(model, tokenizer, EngineConfig(prefill_chunk=12, **quantized))
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, prompt_logprobs=1))
    assert_prompt_logprobs(out.prompt_logprobs, out.prompt_top_logprobs, *alone(model, prompt), 1,
                           out.prompt_logprob_ranks)
    assert out.token_ids == solo_tokens(model, tokenizer, prompt, 6, **quantized)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequest, match="prompt_logprobs: must be None or an integer in"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_travel_in_the_trace_record():
    record = SamplingParams(prompt_logprobs=4).to_record()
    assert SamplingParams.from_record(record).prompt_logprobs == 4
    del record["prompt_logprobs"]  # a trace from before the field
    assert SamplingParams.from_record(record).prompt_logprobs is None


def test_explain_says_why_a_scoring_request_skipped_the_prefix_cache(text_model, tmp_path):
    """The decision not to look the prefix cache up has its reason in the story `explain` tells from the trace."""
    from scheduler.tools.explain import explain, format_story

    model, tokenizer = text_model
    trace = tmp_path / "trace.jsonl"
    prompt = mixed_prompts(1, 40, 40, seed=3)[0]
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=1 << 24, prefix_block_size=8,
                                                   trace_path=str(trace)))
    for rid, sampling in (("plain", greedy(2)), ("scored", SamplingParams(max_tokens=2, prompt_logprobs=3)),
                          ("again", greedy(2))):
        engine.add_request(prompt_tokens=prompt, sampling=sampling, request_id=rid)
        while engine.has_pending():
            engine.step()
    engine.close()
    stories = {s.request_id: format_story(s) for s in explain(str(trace))}
    assert "Prompt logprobs asked (3 alternatives a position)" in stories["scored"]
    assert "Prefix cache: 1 hit(s)" in stories["again"] and "Prompt logprobs" not in stories["again"]

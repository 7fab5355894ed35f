"""Conformance across mlx-lm text families, the tests themselves: tiny seeded builds of every family in the table
(and quantized ones), batched greedy == `mlx_lm.generate` alone, in every schedule: all at once; staggered with a
small token budget, small chunks and fewer slots than requests; the prefix cache on (trimmed hits, or exact
checkpoints for caches that cannot be trimmed); prompt lookup drafting (rows rolled back in place, or re-fed); a
KV budget that forces preemption (and, for a model whose state does not grow, limits the batch). Two test modules
run them, each on a share of the builds (`family_fixture`): test_families.py (plain KV caches),
test_families_state.py (sliding windows, recurrent state, several caches a layer)."""

from __future__ import annotations

import pytest
from mlx_lm import load

from scheduler import EngineConfig
from scheduler.families import FAMILIES, UnsupportedFeature
from scheduler.fixtures.families import FAMILY_CONFIGS, build_family_model
from caches import layers
from scheduler.execution import library

from ..helpers import drive, engine_with_log, greedy, mixed_prompts, solo_tokens

MAX_TOKENS = 6
_PLAIN_KV = ("KVCache",)
PLAIN_KV_BUILDS = [(f, None) for f in FAMILY_CONFIGS if FAMILIES[f].cache_kinds == _PLAIN_KV] + [
    ("llama", 4), ("qwen3", 8)]
STATE_BUILDS = [(f, None) for f in FAMILY_CONFIGS if FAMILIES[f].cache_kinds != _PLAIN_KV]


def family_fixture(builds: list[tuple[str, int | None]]):
    """The module-scoped `family` fixture over `builds` ((model type, quantized bits or None)): the loaded build,
    its prompts and each prompt's `mlx_lm.generate` output alone."""

    @pytest.fixture(scope="module", params=builds, ids=lambda b: b[0] + (f"-q{b[1]}" if b[1] else ""))
    def family(request, tmp_path_factory):
        model_type, bits = request.param
        model, tokenizer = load(str(build_family_model(model_type, tmp_path_factory.mktemp(model_type), bits=bits)))
        shared = mixed_prompts(1, 20, 20, seed=3)[0]
        shortest = FAMILIES[model_type].min_prompt[0] if FAMILIES[model_type].min_prompt else 1  # (recurrent_gemma: 2)
        prompts = mixed_prompts(5, shortest, 40, seed=1) + [shared + [9, 10, 11], shared + [12, 13]]
        reference = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
        return model_type, model, tokenizer, prompts, reference

    return family


def _run(model, tokenizer, config, prompts, stagger=0):
    engine, sink = engine_with_log(model, tokenizer, config)
    run = drive(engine, [(i * stagger, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    return [run.tokens[f"r{i}"] for i in range(len(prompts))], engine, sink


def kv_budget_forcing_preemption(model, prompts, rows: int = 3) -> tuple[int, bool]:
    """(budget, grows): `rows` rows of the longest prompt fit with two tokens to spare, so with no admission
    headroom the rows admitted together outgrow it a few decode steps later and the newest is preempted.
    A model whose caches stop growing before then (only recurrent state: mamba2; recurrent state and sliding
    windows shorter than the prompts: recurrent_gemma) cannot outgrow anything: its budget holds `rows` rows
    and a half, which limits how many run at once, exactly."""
    layout = library.kv_layout(model)
    longest = max(len(p) for p in prompts) + 2
    held = layout.batch_bytes([longest] * rows)
    if layout.batch_bytes([longest + MAX_TOKENS] * rows) > held:
        return held, True
    return held + (layout.batch_bytes([longest] * (rows + 1)) - held) // 2, False


def preempting_config(model, prompts, rows: int = 3) -> EngineConfig:
    """A config under which `rows` rows of `prompts` admitted together outgrow the KV budget a few decode steps
    later (`kv_budget_forcing_preemption`: no admission headroom), invariants checked."""
    budget, grows = kv_budget_forcing_preemption(model, prompts, rows)
    assert grows, "this model's caches do not grow with length: nothing outgrows the budget"
    return EngineConfig(max_batched_tokens=128, max_seqs=8, prefill_chunk=64, kv_memory_bytes=budget,
                        kv_headroom_tokens=0, check_invariants=True)


SCHEDULES = {
    "all-at-once": dict(max_batched_tokens=512, max_seqs=16, prefill_chunk=256),
    # three slots for seven requests: rows finish and queued ones join the running batch (what a schedule of its
    # own, `fewer-slots`, ran before: folded in here for CI's time, a run a family less)
    "staggered-small-chunks": dict(max_batched_tokens=24, max_seqs=3, prefill_chunk=8),
    "prefix-cache": dict(max_batched_tokens=64, max_seqs=4, prefill_chunk=16, prefix_cache_bytes=1 << 26),
    # prompt lookup, each request arriving as the one before ends and the longest prompt again last: its drafts,
    # from the finished request's history, are accepted; the others' are rejected, rolled back in place or re-fed
    # (`Family` capabilities)
    "drafting": dict(max_batched_tokens=64, max_seqs=8, prefill_chunk=16, draft_tokens=2,
                     prompt_lookup_scope="recent"),
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_family_matches_solo_mlx_lm(family, schedule):
    model_type, model, tokenizer, prompts, reference = family
    stagger = {"staggered-small-chunks": 2, "prefix-cache": 3, "drafting": 10}.get(schedule, 0)
    if schedule == "drafting":
        prompts, reference = prompts + [prompts[1]], reference + [reference[1]]
    got, engine, sink = _run(model, tokenizer, EngineConfig(**SCHEDULES[schedule]), prompts, stagger)
    assert got == reference, f"{model_type} / {schedule}"
    if schedule == "prefix-cache":
        # the shared-prefix prompt reuses a stored entry: cut to the shared tokens where the caches can be
        # trimmed, else the exact checkpoint its neighbour's prefill stored at a block boundary
        reuse = {e["reuse"] for e in sink.of_kind("prefix_hit")}
        assert reuse, "the shared-prefix prompt reuses a stored entry"
        assert (reuse == {"checkpoint"}) == (not FAMILIES[model_type].capabilities.trimmable), reuse
    if schedule == "drafting":
        assert engine.draft_stats()["accepted"] > 0, "the repeated prompt's drafts are accepted"


@pytest.mark.slow
def test_family_under_a_kv_budget_that_forces_preemption(family):
    model_type, model, tokenizer, prompts, reference = family
    budget, grows = kv_budget_forcing_preemption(model, prompts)
    config = EngineConfig(max_batched_tokens=128, max_seqs=8, prefill_chunk=64, kv_memory_bytes=budget,
                          kv_headroom_tokens=0, check_invariants=True)
    got, engine, sink = _run(model, tokenizer, config, prompts)
    assert got == reference, model_type
    plans = sink.of_kind("plan")
    assert all(p["kv_bytes_bound"] <= budget for p in plans)
    assert max(p["num_seqs"] for p in plans) == 3, "the budget holds three rows back from the seven"
    preempted = [e for e in sink.of_kind("transition") if e["trigger"] == "preempt"]
    assert bool(preempted) == grows, f"{model_type}: rows that grow outgrow the budget and are preempted"


def test_declared_cache_kinds_match_the_real_builds(family):
    model_type, model, *_ = family
    real = {c.kind for c in layers.capabilities(library.make_request_cache(model)).layers}
    assert tuple(sorted(real)) == tuple(sorted(set(FAMILIES[model_type].cache_kinds)))


def test_drafting_is_built_for_every_family(family):
    """Every family drafts: in place where its caches roll back per row, by a re-feed where they cannot
    (tests/execution/test_refeed_drafting.py), which needs draft_tokens >= 2 (k // 2 drafts per verify)."""
    model_type, model, tokenizer, *_ = family
    engine, _ = engine_with_log(model, tokenizer, EngineConfig(draft_tokens=2))
    assert engine.executor.drafter is not None
    if not FAMILIES[model_type].capabilities.rollback:
        with pytest.raises(UnsupportedFeature) as info:
            engine_with_log(model, tokenizer, EngineConfig(draft_tokens=1))
        assert info.value.model_type == model_type and info.value.feature == "draft_tokens"


def test_prompt_logprobs_equal_mlx_lms_own_prefill_of_each_prompt(family):
    """Prompt logprobs on every family, chunked small and batched: each prompt token's logprob equals what
    mlx-lm's own cache (`make_prompt_cache`: windows and recurrent state as mlx-lm keeps them) gives in one
    forward of the prompt alone, and the tokens stay mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from scheduler import Engine, SamplingParams

    model_type, model, tokenizer, prompts, reference = family
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=24, max_seqs=4, prefill_chunk=7,
                                                   check_invariants=True))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=2))
    for prompt, out, want_tokens in zip(prompts, outs, reference):
        logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want = [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt), model_type
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4), model_type
        assert all(top[0][1] >= lp - 1e-6 for top, lp in zip(out.prompt_top_logprobs[1:], out.prompt_logprobs[1:]))
        assert out.token_ids == want_tokens, model_type

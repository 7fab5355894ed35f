"""Rotary scaling options of real checkpoints, on tiny seeded builds (scheduler/fixtures/families.py with the
option set): the ones whose mlx-lm code takes a position per row batch exactly (Llama 3.1's `llama3`, `linear`,
`yarn`, Phi-3.5's `longrope`); `dynamic` (mlx-lm's DynamicNTKScalingRoPE, InternLM 2.5's and 3's configs) derives
its base from one position for the whole batch, so such a checkpoint is refused at load with the reason, where every
batched decode of it failed before (`library.check_rows_at_different_positions`)."""

from __future__ import annotations

import pytest
from mlx_lm import load

from scheduler import Engine, EngineConfig
from scheduler.families import UnsupportedModel
from scheduler.fixtures.families import build_family_model

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

MAX_TOKENS = 8
BATCHED = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "linear": {"type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "longrope": {"type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0] * 8,
                 "long_factor": [2.0] * 8},
}


def _build(model_type, scaling, tmp_path):
    return load(str(build_family_model(model_type, tmp_path, overrides={"rope_scaling": scaling})))


@pytest.mark.parametrize("scaling", list(BATCHED))
def test_rope_scaling_batches_exactly(scaling, tmp_path):
    """Prompts past the scaling's original length (16) and short ones, staggered in chunks of 8 with drafting on:
    each request's tokens are mlx_lm.generate's alone."""
    model, tokenizer = _build("llama", BATCHED[scaling], tmp_path)
    prompts = mixed_prompts(5, 1, 60, seed=1)
    config = EngineConfig(max_batched_tokens=24, max_seqs=8, prefill_chunk=8, draft_tokens=2, check_invariants=True)
    run = drive(Engine(model, tokenizer, config),
                [(2 * i, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": str(i)})
                 for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    assert run.tokens == {str(i): solo_tokens(model, tokenizer, p, MAX_TOKENS) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("model_type, scaling", [
    ("llama", {"type": "dynamic", "factor": 2.0}),
    ("internlm2", {"type": "dynamic", "factor": 2.0}),  # internlm2_5-7b-chat's
    ("internlm3", {"rope_type": "dynamic", "factor": 6.0}),  # internlm3-8b-instruct's
])
def test_dynamic_rope_scaling_is_refused_at_load_with_the_reason(model_type, scaling, tmp_path):
    """A request alone runs (mlx-lm's own path has one position), a batch of rows at two positions fails in the
    model's code: the engine refuses the checkpoint at construction naming both, and also as a draft model."""
    model, tokenizer = _build(model_type, scaling, tmp_path)
    assert len(solo_tokens(model, tokenizer, [1, 2, 3], MAX_TOKENS)) == MAX_TOKENS
    with pytest.raises(UnsupportedModel, match="fails on a batch of rows at different positions .*'dynamic'") as info:
        Engine(model, tokenizer, EngineConfig())
    assert info.value.model_type == model_type
    target, _ = _build("llama", None, tmp_path / "target")
    with pytest.raises(UnsupportedModel, match="rows at different positions"):
        Engine(target, tokenizer, EngineConfig(draft_tokens=2, drafter="draft-model"), draft_model=model)

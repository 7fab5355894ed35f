"""Rotary scaling `dynamic` (mlx-lm's DynamicNTKScalingRoPE, InternLM 2.5's and 3's configs), on tiny seeded builds
with the option set: it derives its base from one position for the whole batch, so such a checkpoint is refused at
load with the reason (`library.check_rows_at_different_positions`), where every batched decode of it failed before.
The scalings whose mlx-lm code takes a position per row (`llama3`, `linear`, `yarn`, `longrope`, and families' own)
batch exactly: tests/execution/test_real_checkpoint_options.py."""

from __future__ import annotations

import pytest
from mlx_lm import load

from scheduler import Engine, EngineConfig
from scheduler.families import UnsupportedModel
from scheduler.fixtures.families import build_family_model

from ..helpers import solo_tokens

MAX_TOKENS = 8


def _build(model_type, scaling, tmp_path):
    return load(str(build_family_model(model_type, tmp_path, overrides={"rope_scaling": scaling})))


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

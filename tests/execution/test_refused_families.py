"""Families the engine refuses at load (`Family.refused`), each on a real tiny build: the refusal names the model
type and the declared reason, before any request. Where the reason is mlx-lm's model code (it cannot take a batch
whose rows differ in length, which every engine batch has), the same model with the refusal lifted is shown to
fail or to differ from `mlx_lm.generate` alone, so the refusal keeps a wrong answer from being served; when
mlx-lm fixes the model, that test fails: lift the refusal then."""

from __future__ import annotations

import dataclasses

import pytest
from mlx_lm import load

from scheduler import Engine, EngineConfig
from scheduler.families import FAMILIES, UnsupportedModel
from scheduler.fixtures.families import REFUSED_CONFIGS, build_family_model

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

# refused for what mlx-lm's model code does with a batch (the others: a cache class with no batch form)
MODEL_CODE = ["gpt_bigcode", "afm7", "phi3small", "minimax_m3_vl"]


@pytest.mark.parametrize("model_type", sorted(REFUSED_CONFIGS))
def test_a_refused_family_is_refused_at_load_with_its_reason(model_type, tmp_path):
    assert FAMILIES[model_type].refused
    model, tokenizer = load(str(build_family_model(model_type, tmp_path)))
    with pytest.raises(UnsupportedModel) as info:
        Engine(model, tokenizer)
    assert info.value.model_type == model_type
    assert info.value.reason == FAMILIES[model_type].refused


@pytest.mark.parametrize("model_type", MODEL_CODE)
def test_without_the_refusal_a_batch_would_fail_or_differ_from_each_request_alone(model_type, tmp_path, monkeypatch):
    """(A model whose code raises on a batch of rows at different positions, gpt_bigcode's, is refused by the
    load-time probe of such a batch once the table's refusal is lifted: that is the failure, seen at load.)"""
    monkeypatch.setitem(FAMILIES, model_type, dataclasses.replace(FAMILIES[model_type], refused=None))
    model, tokenizer = load(str(build_family_model(model_type, tmp_path)))
    prompts = mixed_prompts(6, 3, 45, seed=11)
    try:
        engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=512, max_seqs=8))
    except UnsupportedModel as exc:
        assert "fails on a batch of rows at different positions" in exc.reason, exc
        return
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(6), "request_id": f"r{i}"})
                         for i, p in enumerate(prompts)])
    reference = [solo_tokens(model, tokenizer, p, 6) for p in prompts]
    assert len({tuple(r) for r in reference}) > 1, "the build's outputs depend on the prompt"
    assert run.errors or [run.tokens[f"r{i}"] for i in range(len(prompts))] != reference


def test_a_checkpoint_whose_first_cache_stores_nothing_is_refused_at_load(tmp_path):
    """nemotron-nas builds its batch's attention mask from its first cache. A checkpoint whose first attention
    layer is replaced by a linear map never writes that cache, so its rows' padding would not be masked: refused
    at load (this shape alone; the family's other checkpoints run, in the conformance suite)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    blocks = [{"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.5}},
              {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
              {"attention": {"n_heads_in_group": 4}, "ffn": {"no_op": True}}]
    path = build_family_model("nemotron-nas", tmp_path, overrides={"num_hidden_layers": 3, "block_configs": blocks})
    model, tokenizer = load(str(path))
    with pytest.raises(UnsupportedModel, match="first cache layer stores nothing") as info:
        Engine(model, tokenizer)
    assert info.value.model_type == "nemotron-nas"
    cache = make_prompt_cache(model)  # the premise: a forward writes every cache but the first
    model(mx.array([[7, 8, 9]]), cache=cache)
    assert cache[0].keys is None and all(c.keys is not None for c in cache[1:])

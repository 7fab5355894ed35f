"""A policy trade on a real model: `mix="prefill-first"` changes when tokens come, never which (the model-free
planning side of the trade: tests/core/test_policies.py)."""

from scheduler import Engine, EngineConfig, SamplingParams

from ..helpers import drive, mixed_prompts, solo_tokens


def test_prefill_first_keeps_outputs_exact(text_model):
    model, tokenizer = text_model
    prompts = mixed_prompts(6, 1, 120, seed=2)
    engine = Engine(model, tokenizer, EngineConfig(mix="prefill-first", max_batched_tokens=48, prefill_chunk=16,
                                                   check_invariants=True))
    run = drive(engine, [(i * 2, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=10)})
                         for i, p in enumerate(prompts)])
    assert list(run.tokens.values()) == [solo_tokens(model, tokenizer, p, 10) for p in prompts]

"""One `stats()` carries everything: the engine's counters and the KV cache, prefix cache, vision cache and
drafting stats, equal to what their own calls give."""

import json

import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, SamplingParams

from ..helpers import mixed_prompts


def test_stats_carry_the_kv_prefix_and_drafting_stats(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(prefix_cache_bytes=8 << 20, draft_tokens=2,
                                                   check_invariants=True))
    shared = mixed_prompts(2, 40, 40, seed=4)[0]
    engine.generate([shared + [9, 10]], SamplingParams(max_tokens=6))
    engine.generate([shared + [11, 12, 13]], SamplingParams(max_tokens=6))  # a prefix-cache hit
    stats = engine.stats()
    assert stats.prefix_cache == engine.prefix_cache_stats() and stats.prefix_cache["hits"] == 1
    assert stats.kv_cache == engine.kv_cache_stats() and stats.kv_cache["merges"] == 2
    assert stats.drafting == engine.draft_stats() and stats.drafting["verify_forwards"] > 0
    assert stats.vision_cache is None  # a text model has none
    record = json.loads(json.dumps(stats.to_dict()))  # one JSON-ready record
    assert record["prefix_cache"]["hits"] == 1 and record["generation_tokens"] == 12
    assert record["drafting"] == stats.drafting and record["kv_cache"]["budget_bytes"] is None


def test_stats_carry_the_vision_cache_stats(vlm_model_dir):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    prompt = apply_chat_template(processor, model.config, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], num_images=1)
    engine = Engine(model, processor, EngineConfig())
    engine.generate([prompt, prompt], SamplingParams(max_tokens=2), images=[[image], [image]])
    engine.generate([prompt], SamplingParams(max_tokens=2), images=[[image]])  # encoded before: a hit
    stats = engine.stats()
    assert stats.vision_cache == engine.vision_cache_stats()
    assert stats.vision_cache["hits"] >= 1 and stats.to_dict()["vision_cache"]["hits"] == stats.vision_cache["hits"]
    assert stats.prefix_cache is None  # off by default

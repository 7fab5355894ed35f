"""LoRA adapters (`Engine.from_pretrained(adapter_path=...)`, serve's `--adapter-path`): the adapter is applied by
the model's own loader (mlx-lm's for a text model, mlx-vlm's for a vision-language one), and batched greedy output
equals that loader's adapted model run alone, token for token. The adapters are seeded, not trained
(`scheduler.fixtures.lora`), so that their effect shows."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.fixtures.lora import write_lora_adapter

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

CONFIG = EngineConfig(max_batched_tokens=48, max_seqs=8, prefill_chunk=16, check_invariants=True)


def test_a_text_models_adapter_is_applied_as_mlx_lm_applies_it(text_model_dir, tmp_path):
    import mlx_lm

    adapter = write_lora_adapter(text_model_dir, tmp_path / "adapter")
    adapted, tokenizer = mlx_lm.load(str(text_model_dir), adapter_path=str(adapter))
    base, _ = mlx_lm.load(str(text_model_dir))
    prompts = mixed_prompts(6, 3, 80, seed=11)
    want = [solo_tokens(adapted, tokenizer, p, 12) for p in prompts]
    assert want != [solo_tokens(base, tokenizer, p, 12) for p in prompts]  # the adapter changes the output
    engine = Engine.from_pretrained(text_model_dir, CONFIG, adapter_path=adapter)
    run = drive(engine, [(i // 2, {"prompt_tokens": p, "sampling": greedy(12)}) for i, p in enumerate(prompts)])
    assert list(run.tokens.values()) == want


def test_a_vision_language_models_adapter_is_applied_as_mlx_vlm_applies_it(vlm_model_dir, tmp_path):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    adapter = write_lora_adapter(vlm_model_dir, tmp_path / "adapter")
    adapted, processor = mlx_vlm.load(str(vlm_model_dir), adapter_path=str(adapter))
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    cases = [(apply_chat_template(processor, adapted.config, "What is this?", num_images=1), [image]),
             (apply_chat_template(processor, adapted.config, "Tell me a story.", num_images=0), None)]

    def alone(model, prompt, images):
        last = None
        for last in mlx_vlm.stream_generate(model, processor, prompt, image=images, max_tokens=10, temperature=0.0):
            pass
        return list(last.token_ids)

    want = [alone(adapted, p, imgs) for p, imgs in cases]
    base, _ = mlx_vlm.load(str(vlm_model_dir))
    assert want != [alone(base, p, imgs) for p, imgs in cases]
    engine = Engine.from_pretrained(vlm_model_dir, CONFIG, adapter_path=adapter)
    outs = engine.generate([p for p, _ in cases], [SamplingParams(max_tokens=10)] * 2,
                           images=[imgs for _, imgs in cases])
    assert [out.token_ids for out in outs] == want


def test_a_missing_adapter_or_one_with_sharding_is_refused(text_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such adapter directory"):
        Engine.from_pretrained(text_model_dir, adapter_path=tmp_path / "none")
    adapter = write_lora_adapter(text_model_dir, tmp_path / "adapter")
    with pytest.raises(ValueError, match="^adapter_path: a sharded model loads without adapters"):
        Engine.from_pretrained(text_model_dir, adapter_path=adapter, tensor_group=object())

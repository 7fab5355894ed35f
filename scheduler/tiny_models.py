"""Tiny, real, randomly initialised models built offline for tests and benchmarks.

Every kind is written in the ordinary Hugging Face layout (``config.json``,
``model.safetensors``, tokenizer files, chat template) and loads through the same
``mlx_lm.load`` / ``mlx_vlm.load`` calls as a downloaded checkpoint, so the
scheduler is exercised against the real model, cache and tokenizer code paths.

Kinds:

* ``text``        -- qwen3, hidden 128 x 2 layers (~0.43M params). The fast default
                     for unit tests: plain ``KVCache`` per layer.
* ``sliding``     -- gemma3_text, 4 layers with ``sliding_window=16`` and
                     ``sliding_window_pattern=4``: ``make_cache`` gives three
                     ``RotatingKVCache`` layers and one ``KVCache``. Exercises
                     mixed cache types and window wrap-around with short prompts.
* ``text-medium`` -- qwen3, hidden 512 x 8 layers (~25.7M params). Big enough that
                     batching shows up in benchmarks.
* ``vlm``         -- Qwen2-VL, hidden 128 x 2 layers with a 2-block vision tower.
                     Exercises image inputs, mrope positions and the processor; a
                     112x140 image becomes 20 image tokens.
* ``granite``     -- granite, hidden 128 x 2 layers, ``logits_scaling=4``: its ``__call__`` divides the
                     output head's logits, so a path that skips it samples from the wrong distribution.
* ``text-eos`` / ``vlm-eos`` -- ``text`` / ``vlm`` whose ``<|im_end|>`` (an eos id) is not muted but
                     given a reachable logit (its lm_head row times EOS_GAIN): greedy decoding stops on
                     eos for some prompts and runs to max_tokens for others, so stop-on-eos is compared
                     with mlx-lm / mlx-vlm.
* ``audio``       -- Gemma 4 (``gemma4``) with a 1-block Conformer audio tower, hidden
                     64 x 2 layers (one sliding-window layer, window 64, one full),
                     per-layer inputs, tied embeddings, and a tiny vision tower the
                     family requires. Exercises audio inputs: one second of 16 kHz
                     audio becomes 25 audio tokens (40 ms each). Not in
                     ``MODEL_KINDS`` (which tests pin); see ``ALL_KINDS``.

Weights are float32 with untied embeddings (with tied random embeddings greedy
decoding collapses onto one token). Three adjustments to the random init (see
``_shape_random_weights``) make greedy decoding useful in tests: the output varies,
depends on the whole context (so a broken KV cache changes it), and never emits a
special token, so every generation runs to ``max_tokens`` (the ``-eos`` kinds do emit eos).

A build is deterministic: ``mx.random`` is seeded before the model is constructed
and the tokenizer is a byte-level BPE trained on a corpus this module generates
itself from a fixed word list, so two builds with the same seed are byte-identical.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import mlx.core as mx

MODEL_KINDS: tuple[str, ...] = ("text", "sliding", "text-medium", "vlm")
ALL_KINDS: tuple[str, ...] = MODEL_KINDS + ("audio", "text-mtp", "granite", "text-eos", "vlm-eos")
# Kinds that can stop on their own: `<|im_end|>` (an eos id) keeps a reachable logit (see _mute_special_tokens).
EOS_KINDS: dict[str, str] = {"text-eos": "text", "vlm-eos": "vlm"}  # kind -> the kind it otherwise equals

VOCAB_SIZE = 512

# ChatML specials first, then the Qwen-VL vision markers. Their ids are 0..6.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# ChatML. String content is emitted as is; list content (the multimodal form)
# renders {"type": "image"} / {"type": "video"} as vision placeholders and
# {"type": "text", "text": ...} as its text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# --------------------------------------------------------------------------- corpus

_SUBJECTS = (
    "the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird",
    "the river", "our team", "the machine", "a young girl", "the farmer", "the city",
    "his friend", "the scheduler", "a model", "the server", "every child", "the moon",
)
_VERBS = (
    "sees", "likes", "finds", "builds", "carries", "watches", "remembers", "follows",
    "opens", "paints", "counts", "writes", "reads", "moves", "holds", "brings",
    "answers", "loads", "sends", "keeps",
)
_OBJECTS = (
    "a red ball", "the green door", "three apples", "the long road", "a quiet song",
    "the blue sky", "many books", "a warm coat", "the last train", "two letters",
    "the open window", "a bright lamp", "some water", "the heavy box", "a new token",
    "the next batch", "a short story", "the garden",
)
_ADVERBS = (
    "slowly", "quickly", "today", "again", "at night", "in the morning", "with care",
    "every day", "before lunch", "after the rain", "near the house", "without a word",
)
_QUESTIONS = ("what", "where", "why", "when", "how", "who")


def _sentence(rng: random.Random) -> str:
    """One English-like sentence (statement, question or numbered fact)."""
    form = rng.randrange(4)
    subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    if form == 0:
        text = f"{subject} {verb} {obj} {rng.choice(_ADVERBS)}."
    elif form == 1:
        text = f"{rng.choice(_QUESTIONS)} does {subject} see {obj}?"
    elif form == 2:
        text = f"{subject} {verb} {rng.randrange(1000)} items, and {rng.choice(_OBJECTS)}!"
    else:
        text = f"{subject}, {rng.choice(_ADVERBS)}, {verb} {obj}; then {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} it."
    return text[0].upper() + text[1:]


def training_corpus(n_sentences: int = 4000, seed: int = 0) -> list[str]:
    """A deterministic list of short English-like lines to train the tokenizer on."""
    rng = random.Random(seed)
    return [
        " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        for _ in range(n_sentences)
    ]


# ------------------------------------------------------------------------ tokenizer


def _train_bpe(special_tokens: tuple[str, ...]):
    """A 512-entry byte-level BPE (``tokenizers.Tokenizer``) with ``special_tokens`` first (ids 0..n-1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # corpus too small to learn enough merges
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, want {VOCAB_SIZE}")
    return tok


def build_tokenizer():
    """Train a 512-entry byte-level BPE with ChatML + vision specials.

    Returns a ``transformers.PreTrainedTokenizerFast`` with the ChatML chat
    template and ``<|im_end|>`` as eos.
    """
    from transformers import PreTrainedTokenizerFast

    tok = _train_bpe(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def _special_id(tokenizer, token: str) -> int:
    return tokenizer.convert_tokens_to_ids(token)


# -------------------------------------------------------------------------- configs


def _eos_ids(tokenizer) -> list[int]:
    return [_special_id(tokenizer, "<|im_end|>"), _special_id(tokenizer, "<|endoftext|>")]


def _qwen3_config(tokenizer, hidden: int, layers: int, heads: int, kv_heads: int,
                  intermediate: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": _special_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": _eos_ids(tokenizer),
    }


def _sliding_config(tokenizer) -> dict[str, Any]:
    window, pattern, layers = 16, 4, 4
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": layers,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        # What transformers >= 4.53 reads instead of sliding_window_pattern.
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": _special_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": _eos_ids(tokenizer),
    }


def _granite_config(tokenizer) -> dict[str, Any]:
    hidden, heads = 128, 4
    return {
        "architectures": ["GraniteForCausalLM"],
        "model_type": "granite",
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "logits_scaling": 4.0,  # logits = lm_head(h) / 4: what a hidden-state path must not skip
        "attention_multiplier": (hidden // heads) ** -0.5,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": _special_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": _eos_ids(tokenizer),
    }


def text_config(kind: str, tokenizer) -> dict[str, Any]:
    """The config.json dict of a text kind."""
    if kind == "granite":
        return _granite_config(tokenizer)
    if kind == "text":
        return _qwen3_config(tokenizer, hidden=128, layers=2, heads=4, kv_heads=2,
                             intermediate=256)
    if kind == "text-medium":
        return _qwen3_config(tokenizer, hidden=512, layers=8, heads=8, kv_heads=4,
                             intermediate=1536)
    if kind == "sliding":
        return _sliding_config(tokenizer)
    raise ValueError(f"not a text kind: {kind!r}")


def vlm_config(tokenizer) -> dict[str, Any]:
    """The config.json dict of the tiny Qwen2-VL (text keys at the top level)."""
    hidden, heads = 128, 4
    head_dim = hidden // heads
    mrope_section = [4, 6, 6]  # temporal, height, width; sums to head_dim // 2
    assert sum(mrope_section) == head_dim // 2
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section},
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": _special_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": _eos_ids(tokenizer),
        "image_token_id": _special_id(tokenizer, "<|image_pad|>"),
        "video_token_id": _special_id(tokenizer, "<|video_pad|>"),
        "vision_start_token_id": _special_id(tokenizer, "<|vision_start|>"),
        "vision_end_token_id": _special_id(tokenizer, "<|vision_end|>"),
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": hidden,
            "num_heads": 4,
            "mlp_ratio": 4,  # must be an int: a float fails to load
            "in_channels": 3,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def _image_processor_config() -> dict[str, Any]:
    """Shared by preprocessor_config.json and video_preprocessor_config.json."""
    factor = 14 * 2  # patch * merge: one image token per 28x28 pixels
    return {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 4 * factor * factor,  # 4 tokens
        "max_pixels": 64 * factor * factor,  # 64 tokens
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # CLIP
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_resize": True,
    }


def preprocessor_config() -> dict[str, Any]:
    return {
        **_image_processor_config(),
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }


def video_preprocessor_config() -> dict[str, Any]:
    return {
        **_image_processor_config(),
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2VLProcessor",
        "fps": 2.0,
        "min_frames": 4,
        "max_frames": 16,
    }


# -------------------------------------------------------------------------- weights

# What random weights need so that greedy decoding behaves like a language model
# would in tests: varied output that depends on the whole context, of a known length.
EMBEDDING_STD = 0.5
ATTENTION_GAIN = 4.0


def _spread_embeddings(lm, model_type: str) -> None:
    """Give token embeddings std EMBEDDING_STD per element.

    mlx initialises embeddings with std 1/sqrt(hidden), below what each attention
    / MLP block adds to the residual stream. The blocks' near-constant output then
    dominates and greedy decoding repeats one token. gemma3 multiplies its
    embeddings by sqrt(hidden) in the forward pass (std 1) and is left alone.
    """
    if model_type == "gemma3_text":
        return
    embedding = lm.model.embed_tokens
    embedding.weight = embedding.weight * (EMBEDDING_STD * embedding.weight.shape[1] ** 0.5)


def _sharpen_attention(lm, model_type: str) -> None:
    """Multiply the attention logits by ATTENTION_GAIN.

    With random projections the logits have std <= 1, attention is nearly uniform
    and the output hardly depends on which earlier tokens are where: a broken KV
    cache would go unnoticed. Sharper attention makes every position matter.
    qwen3 / gemma3 normalise q per head (gemma's norm scales by 1 + weight);
    qwen2 has no q norm, so its q projection is scaled, with a further factor 3
    because its logits start at std ~1/3 rather than ~1.
    """
    for layer in lm.model.layers:
        attn = layer.self_attn
        if model_type == "qwen3":
            attn.q_norm.weight = attn.q_norm.weight * ATTENTION_GAIN
        elif model_type == "gemma3_text":
            attn.q_norm.weight = (1.0 + attn.q_norm.weight) * ATTENTION_GAIN - 1.0
        else:
            attn.q_proj.weight = attn.q_proj.weight * (3 * ATTENTION_GAIN)
            if "bias" in attn.q_proj:  # qwen2 has one, granite (attention_bias=False) none
                attn.q_proj.bias = attn.q_proj.bias * (3 * ATTENTION_GAIN)


# The -eos kinds scale <|im_end|>'s lm_head row by this: with the text weights of seed 0, greedy decoding of
# the main equality test's 16 prompts stops on eos within 20 tokens for 11 of them and runs to length for 5.
EOS_GAIN = 2.0


def _mute_special_tokens(lm, tokenizer, eos_gain: float | None = None) -> None:
    """Zero the lm_head rows of the special tokens.

    Their logit is then always 0 while the best of ~500 random logits is well
    above it, so greedy decoding never emits eos (or an image pad): generations
    run to max_tokens, whatever the seed. Tests of stop conditions should pick a
    token the model does generate as the stop token. With ``eos_gain``,
    ``<|im_end|>`` keeps its random row scaled by that gain instead: its logit
    then beats the others now and then, and generations stop on eos.
    """
    ids = mx.array([tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS])
    weight = lm.lm_head.weight
    keep = mx.ones((weight.shape[0], 1), dtype=weight.dtype)
    keep[ids] = 0
    if eos_gain is not None:
        keep[_special_id(tokenizer, "<|im_end|>")] = eos_gain
    lm.lm_head.weight = weight * keep


def _shape_random_weights(lm, model_type: str, tokenizer, eos_gain: float | None = None) -> None:
    """Adjust a freshly initialised language model (``lm.model``, ``lm.lm_head``)."""
    _spread_embeddings(lm, model_type)
    _sharpen_attention(lm, model_type)
    _mute_special_tokens(lm, tokenizer, eos_gain)


# -------------------------------------------------------------------------- writers


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_text_model(kind: str, out: Path, tokenizer, seed: int, eos_gain: float | None = None) -> None:
    import importlib

    from mlx_lm.utils import save_config, save_model

    config = text_config(kind, tokenizer)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    _shape_random_weights(model, config["model_type"], tokenizer, eos_gain)
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")


def _write_vlm_model(out: Path, tokenizer, seed: int, eos_gain: float | None = None) -> None:
    from mlx_vlm.models import qwen2_vl
    from mlx_vlm.utils import save_config, save_weights

    config = vlm_config(tokenizer)
    # Mirror mlx_vlm.utils.load_model: the text config is the top level of config.json.
    model_config = qwen2_vl.ModelConfig.from_dict(dict(config))
    model_config.text_config = qwen2_vl.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = qwen2_vl.Model(model_config)
    _shape_random_weights(model.language_model, config["model_type"], tokenizer, eos_gain)
    mx.eval(model.parameters())
    # Keys are already in mlx-vlm's layout (language_model.*, vision_tower.*, the
    # patch conv as [out, t, h, w, in]); its sanitize leaves them unchanged.
    save_weights(out, model)
    save_config(dict(config), out / "config.json")
    _write_json(out / "preprocessor_config.json", preprocessor_config())
    # Without it mlx-vlm / transformers try a hub download for the video processor.
    _write_json(out / "video_preprocessor_config.json", video_preprocessor_config())


# ---------------------------------------------------------------------------- audio (gemma4)

# Gemma-style specials first (ids 0..11); the multimodal ones are named to the
# processor through ``extra_special_tokens`` (``tokenizer.audio_token`` etc.).
GEMMA_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
    "<|image|>", "<|audio|>", "<|video|>", "<boi>", "<eoi>", "<boa>", "<eoa>",
)

# Gemma turns. List content renders {"type": "image" / "audio" / "video"} as the
# placeholder the processor expands and {"type": "text"} as its text.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<start_of_turn>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|video|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def build_gemma_tokenizer():
    """The same BPE as ``build_tokenizer`` with Gemma specials, chat template and multimodal token names."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(GEMMA_SPECIAL_TOKENS),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        chat_template=GEMMA_CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        extra_special_tokens={
            "image_token": "<|image|>", "boi_token": "<boi>", "eoi_token": "<eoi>",
            "audio_token": "<|audio|>", "boa_token": "<boa>", "eoa_token": "<eoa>",
            "video_token": "<|video|>",
        },
    )


def audio_config(tokenizer) -> dict[str, Any]:
    """The config.json dict of the tiny Gemma 4 with an audio tower."""
    ids = {t: _special_id(tokenizer, t) for t in GEMMA_SPECIAL_TOKENS}
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "head_dim": 32,
        "global_head_dim": 32,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 0,
        "vocab_size": VOCAB_SIZE,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "hidden_size_per_layer_input": 16,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 4096,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": 16,
        "position_embedding_size": 1024,
        "pooling_kernel_size": 3,
        "default_output_length": 16,
    }
    audio = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "subsampling_conv_channels": [8, 4],
        "conv_kernel_size": 5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "output_proj_dims": 32,
        "rms_norm_eps": 1e-6,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": text["hidden_size"],
        "image_token_id": ids["<|image|>"],
        "audio_token_id": ids["<|audio|>"],
        "video_token_id": ids["<|video|>"],
        "boi_token_id": ids["<boi>"],
        "eoi_token_id": ids["<eoi>"],
        "boa_token_id": ids["<boa>"],
        "eoa_token_id": ids["<eoa>"],
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "vision_soft_tokens_per_image": 16,
        "audio_ms_per_token": 40,
        "audio_soft_tokens_per_image": 750,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def audio_processor_config() -> dict[str, Any]:
    """processor_config.json: Gemma4Processor reads the image processor and audio feature extractor from it."""
    return {
        "processor_class": "Gemma4Processor",
        "audio_seq_length": 750,  # at most 30 s of audio per clip
        "audio_ms_per_token": 40,
        "image_processor": {"patch_size": 16, "max_soft_tokens": 16, "pooling_kernel_size": 3},
        "feature_extractor": {"feature_size": 128, "sampling_rate": 16000},
    }


# Gemma's post-norms normalise each block's output, so the block weights' scale
# does not matter: these scale the norms. See _shape_gemma4_weights.
GEMMA_BLOCK_GAIN = 3.0
GEMMA_AUDIO_GAIN = 30.0


def _shape_gemma4_weights(model) -> None:
    """What the random Gemma 4 needs for useful greedy tests (cf. ``_shape_random_weights``).

    Embeddings are tied (Gemma 4 always computes logits with ``embed_tokens``),
    so the input token's own logit dominates unless the blocks outweigh the
    embedding in the residual stream: the post-attention / post-feed-forward
    norms are scaled by GEMMA_BLOCK_GAIN and q_norm by ATTENTION_GAIN (sharp,
    position-dependent attention). The audio projection is scaled by
    GEMMA_AUDIO_GAIN so the audio features outweigh the text around them (else
    two different clips give the same tokens). The special tokens' embedding
    rows are zeroed: their logit is then always 0 and greedy decoding never
    emits eos, as with the other kinds.
    """
    lm = model.language_model
    for layer in lm.model.layers:
        layer.self_attn.q_norm.weight = layer.self_attn.q_norm.weight * ATTENTION_GAIN
        layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight * GEMMA_BLOCK_GAIN
        layer.post_feedforward_layernorm.weight = layer.post_feedforward_layernorm.weight * GEMMA_BLOCK_GAIN
    projection = model.embed_audio.embedding_projection
    projection.weight = projection.weight * GEMMA_AUDIO_GAIN
    embedding = lm.model.embed_tokens
    keep = mx.ones((embedding.weight.shape[0], 1), dtype=embedding.weight.dtype)
    keep[mx.arange(len(GEMMA_SPECIAL_TOKENS))] = 0
    embedding.weight = embedding.weight * keep


def _write_audio_model(out: Path, tokenizer, seed: int) -> None:
    from mlx_vlm.models import gemma4
    from mlx_vlm.utils import save_config, save_weights

    config = audio_config(tokenizer)
    # Mirror mlx_vlm.utils.load_model: ModelConfig from the whole dict, then each module config.
    model_config = gemma4.ModelConfig.from_dict(dict(config))
    model_config.text_config = gemma4.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = gemma4.VisionConfig.from_dict(config["vision_config"])
    model_config.audio_config = gemma4.AudioConfig.from_dict(config["audio_config"])
    mx.random.seed(seed)
    model = gemma4.Model(model_config)
    _shape_gemma4_weights(model)
    mx.eval(model.parameters())
    save_weights(out, model)
    save_config(dict(config), out / "config.json")
    _write_json(out / "processor_config.json", audio_processor_config())


def _write_tokenizer(out: Path, tokenizer) -> None:
    tokenizer.save_pretrained(str(out))


def build_model(kind: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny model of ``kind`` into ``out_dir`` (created) and return its path.

    Building twice with the same ``kind`` and ``seed`` gives byte-identical files.
    """
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; valid kinds: {', '.join(ALL_KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "audio":
        tokenizer = build_gemma_tokenizer()
        _write_audio_model(out, tokenizer, seed)
        _write_tokenizer(out, tokenizer)
        return out
    tokenizer = build_tokenizer()
    eos_gain = EOS_GAIN if kind in EOS_KINDS else None
    base = EOS_KINDS.get(kind, "text" if kind == "text-mtp" else kind)
    if base == "vlm":
        _write_vlm_model(out, tokenizer, seed, eos_gain)
    else:
        _write_text_model(base, out, tokenizer, seed, eos_gain)
    _write_tokenizer(out, tokenizer)
    if kind == "text-mtp":
        _write_mtp_head(out, seed)
    return out


def _write_mtp_head(out: Path, seed: int, steps: int = 50) -> None:
    """The tiny text model plus a multi-token-prediction head fitted (seeded, a few seconds) to predict the
    model's own greedy token after next from its hidden state and the next token, so drafting with it has
    something real to accept. Saved as mtp.safetensors / mtp_config.json next to the model."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from . import adapters
    from .mtp import MTPHead, save_mtp_head

    model, _ = load(str(out))
    mx.random.seed(seed + 1)
    batch, prompt_len, generated = 16, 8, 24
    seq = mx.random.randint(7, VOCAB_SIZE, (batch, prompt_len))
    cache = make_prompt_cache(model)
    logits = model(seq, cache=cache)
    for _ in range(generated):  # the model's own greedy continuations
        nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        seq = mx.concatenate([seq, nxt], axis=1)
        logits = model(nxt, cache=cache)
    hidden = model.model(seq)
    width = hidden.shape[-1]
    h = hidden[:, prompt_len - 1:-2, :].reshape(-1, width)
    next_tokens = seq[:, prompt_len:-1].reshape(-1)
    targets = seq[:, prompt_len + 1:].reshape(-1)
    head = MTPHead(width, 2 * width)
    embed, output = adapters.token_embedding(model), adapters.output_head(model)
    mx.eval(h, next_tokens, targets)

    def loss_fn(head):
        return nn.losses.cross_entropy(output(head(h, embed(next_tokens))), targets, reduction="mean")

    optimizer = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(head, loss_fn)
    for _ in range(steps):
        _, grads = step(head)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state)
    save_mtp_head(head, out)

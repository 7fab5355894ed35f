"""Model-family support as data: a table of mlx-lm model types and the few facts the engine needs about each.

Everything else follows from the cache-layer protocol (`caches.layers`): what a family supports (prefix
reuse of any prefix or of exact checkpoints only, drafting, `max_kv_size`, the KV budget) is derived from the
capabilities of the cache kinds its `make_cache` builds, never from a class per family. A model type that is
not in the table runs if its caches can be batched (it gets the default facts); a family mlx-lm itself cannot
batch is refused at load with `UnsupportedModel` naming the model type and the reason.

`cache_kinds` is declared here so the README table can be generated without building models; the conformance
suite checks it against each tiny build's real caches, so it cannot drift.
"""

from __future__ import annotations

import importlib
import textwrap
from dataclasses import dataclass
from typing import Any

from caches.layers import CacheCapabilities, MaskLayout, PrefillSharing, kind_capabilities


class UnsupportedModel(TypeError):
    """The engine cannot run this model family (raised at load, before any request)."""

    def __init__(self, model_type: str, reason: str):
        super().__init__(f"model type {model_type!r} is not supported: {reason}")
        self.model_type = model_type
        self.reason = reason


class UnsupportedFeature(ValueError):
    """A configured feature this model's caches cannot provide (raised when the engine is configured)."""

    def __init__(self, model_type: str, feature: str, reason: str):
        super().__init__(f"{feature}: not available for model type {model_type!r}: {reason}")
        self.model_type = model_type
        self.feature = feature
        self.reason = reason


@dataclass(frozen=True)
class Family:
    model_type: str
    cache_kinds: tuple[str, ...]  # the cache classes its make_cache builds (checked against real builds)
    mask: MaskLayout = MaskLayout.HEADS  # the shape its attention wants the batch mask in
    refused: str | None = None  # why the engine (and mlx-lm's BatchGenerator) cannot batch it
    # Its forward honors mlx-lm's padded-batch contract (the lengths `prepare` gives a batch cache): sliding-window
    # masks come from the cache, recurrent layers take the cache's mask and lengths (conv state from each row's
    # last real positions). Then rotating windows and recurrent state share prefill forwards of chunks of any
    # lengths (`caches.layers.PrefillSharing.ANY`); otherwise only chunks at one position of one length. Read
    # from mlx-lm's model code and proven per family by tests/execution/test_hybrids.py (and test_rotating.py for
    # max_kv_size); an undeclared family does not get it.
    honors_lengths: bool = False
    # (the fewest prompt tokens a request may have, why) where a one-token prompt cannot be exact, else None. Such a
    # prompt's only token is the first decode step's input, computed in the batched forward next to rows that hold
    # state; shorter prompts are refused at add_request with the reason
    min_prompt: tuple[int, str] | None = None
    note: str = ""

    @property
    def capabilities(self) -> CacheCapabilities:
        return CacheCapabilities(tuple(kind_capabilities(k) for k in self.cache_kinds))


_KV, _ROT, _ARR = ("KVCache",), ("KVCache", "RotatingKVCache"), ("ArraysCache", "KVCache")
_LIST_KV = ("CacheList[KVCache+KVCache]",)

RECURRENT_GEMMA_FIRST_TOKEN = (
    "recurrent_gemma's RG-LRU leaves a sequence's first input unscaled only when it runs with no recurrent state, and "
    "a one-token prompt's only token is computed in the batched decode step, where its row holds the batch's zero "
    "state: its output would differ from mlx_lm.generate alone")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", _KV),
    Family("qwen2", _KV),
    Family("qwen3", _KV, honors_lengths=True),
    Family("phi3", _KV),
    Family("olmo2", _KV),
    Family("mixtral", _KV, note="mixture of experts"),
    Family("qwen3_moe", _KV, note="mixture of experts"),
    # gemma2 reshapes queries to (B, kv_heads, repeats, L, D): its scores are 5-D and mlx-lm's batch mask
    # (B, 1, L, S) does not broadcast against them (mlx-lm's own BatchGenerator fails the same way).
    Family("gemma2", _KV, mask=MaskLayout.GROUPED, note="grouped-query scores, logit soft-capping"),
    Family("gemma3_text", _ROT, honors_lengths=True, note="sliding-window layers"),
    Family("gpt_oss", _ROT, honors_lengths=True, note="attention sinks, sliding-window layers, mixture of experts"),
    Family("lfm2", _ARR, honors_lengths=True, note="hybrid: short-conv layers + attention"),
    Family("qwen3_next", _ARR, honors_lengths=True,
           note="hybrid: gated delta-net linear attention + attention, mixture of experts"),
    Family("granitemoehybrid", _ARR, honors_lengths=True,
           note="hybrid: Mamba-2 layers + attention, mixture of experts"),
    # its Mamba-2 mixer gives `ssm_update` the padding mask but not the lengths: a padded row's state would lose
    # its chunk (tests/execution/test_hybrids.py shows it), so it shares only unpadded chunks
    Family("nemotron_h", _ARR, note="hybrid: Mamba-2 layers + attention + MLP"),
    Family("mamba2", ("ArraysCache",), honors_lengths=True, note="state-space model, no attention"),
    # ---- attention with a plain KV cache per layer
    *(Family(t, _KV) for t in (
        "gemma", "cohere", "starcoder2", "phi", "internlm2", "internlm3", "exaone", "ernie4_5", "glm", "helium",
        "seed_oss", "hunyuan_v1_dense", "mimo", "nanbeige", "laguna", "telechat3", "youtu_llm", "gpt2", "gptj")),
    Family("stablelm", _KV, note="partial rotary, parallel residual, per-head qk-norm"),
    Family("granite", _KV, note="embedding, attention, residual and logit multipliers"),
    Family("glm4", _KV, note="partial rotary, attention biases"),
    Family("apertus", _KV, note="qk-norm, xIELU"),
    Family("smollm3", _KV, note="NoPE layers"),
    Family("minicpm", _KV, note="scaled embeddings and residuals"),
    Family("gpt_neox", _KV, note="partial rotary, parallel residual"),
    Family("nemotron", _KV, note="partial rotary, relu2"),
    Family("qwen", _KV, note="Qwen 1"),
    Family("plamo", _KV, note="shared key-value heads"),
    Family("openelm", _KV, note="per-layer head counts and widths"),
    Family("lille-130m", _KV),
    Family("llama4_text", _KV, note="NoPE layers, qk-norm"),
    Family("nanochat", _KV),
    Family("nemotron-nas", _KV, note="per-layer blocks: attention or FFN skipped or replaced by a linear map"),
    Family("phixtral", _KV, note="mixture of experts"),
    Family("mistral3", _KV, note="the text model of a Mistral 3 checkpoint, position-scaled queries"),
    Family("qwen2_vl", _KV, note="the text model of a Qwen2-VL checkpoint"),
    Family("qwen3_vl", _KV, note="the text model of a Qwen3-VL checkpoint"),
    Family("pixtral", _KV, note="the text model of a Pixtral checkpoint"),
    # ---- multi-head latent attention
    Family("deepseek", _KV, note="mixture of experts"),
    Family("deepseek_v2", _KV, note="multi-head latent attention, grouped expert routing, YaRN"),
    Family("deepseek_v3", _KV, note="multi-head latent attention, mixture of experts"),
    Family("minicpm3", _KV, note="multi-head latent attention, LongRoPE"),
    Family("kimi_vl", _KV, note="the text model of a Kimi-VL checkpoint: multi-head latent attention"),
    Family("kimi_k25", _KV, note="the text model of a Kimi K2.5 checkpoint: multi-head latent attention"),
    Family("mistral4", _KV, note="multi-head latent attention, mixture of experts"),
    Family("glm4_moe_lite", _KV, note="multi-head latent attention, mixture of experts, grouped routing"),
    # ---- mixtures of experts
    *(Family(t, _KV, note="mixture of experts") for t in (
        "qwen2_moe", "olmoe", "granitemoe", "phimoe", "ernie4_5_moe", "minimax", "dots1", "bailing_moe_v3",
        "Klear", "solar_open")),
    Family("qwen3_vl_moe", _KV, note="the text model of a Qwen3-VL MoE checkpoint"),
    Family("dbrx", _KV, note="mixture of experts, clipped qkv"),
    Family("glm4_moe", _KV, note="mixture of experts, grouped routing, qk-norm, partial rotary"),
    Family("bailing_moe", _KV, note="mixture of experts, expert bias, grouped routing, qk-norm"),
    Family("hunyuan", _KV, note="mixture of experts, cross-layer attention (shared key-value projections)"),
    # ---- sliding-window layers next to global ones
    *(Family(t, _ROT, honors_lengths=True, note="sliding-window layers") for t in (
        "cohere2", "olmo3", "exaone4", "ministral3", "iquestloopcoder")),
    Family("gemma3", _ROT, honors_lengths=True, note="the text model of a Gemma 3 checkpoint: sliding-window layers"),
    Family("gemma4_text", _ROT, honors_lengths=True,
           note="sliding-window layers, key-value sharing across layers, per-layer inputs, mixture of experts"),
    Family("gemma4", _ROT, honors_lengths=True,
           note="the text model of a Gemma 4 checkpoint: sliding-window layers, key-value sharing, MoE"),
    # honors_lengths not declared where a padded shared forward leaves a row other state than its own forward
    # (the check of tests/execution/test_hybrids.py, probed per family): gemma3n, recurrent_gemma, mamba, rwkv7,
    # jamba, olmo_hybrid, bailing_moe_linear, baichuan_m1, longcat_flash_ngram
    Family("gemma3n", _ROT, note="sliding-window layers, key-value sharing across layers, AltUp, per-layer inputs"),
    Family("spark2_5", _ROT, honors_lengths=True, note="sliding-window layers, per-layer rotary, gated attention"),
    Family("step3p5", _ROT, honors_lengths=True, note="sliding-window layers with their own heads, mixture of experts"),
    Family("muse_glimmer", ("RotatingKVCache",), honors_lengths=True, note="sliding-window layers of 2048 positions"),
    Family("plamo3", ("RotatingKVCache",), honors_lengths=True, note="sliding-window layers of 2048 positions"),
    Family("exaone_moe", _ROT, honors_lengths=True, note="sliding-window layers, mixture of experts"),
    Family("mellum", _ROT, honors_lengths=True, note="sliding-window layers, mixture of experts"),
    Family("afmoe", _ROT, honors_lengths=True, note="sliding-window layers, gated attention, mixture of experts"),
    Family("mimo_v2_flash", _ROT, honors_lengths=True,
           note="sliding-window layers, attention sinks, mixture of experts"),
    # ---- several caches per layer
    Family("deepseek_v32", _LIST_KV, note="sparse attention: an indexer's keys next to latent attention"),
    Family("glm_moe_dsa", _LIST_KV, note="sparse attention: an indexer's keys next to latent attention, MoE"),
    Family("longcat_flash", _LIST_KV, note="two latent attentions a layer, zero experts"),
    Family("longcat_flash_ngram", ("ArraysCache", "CacheList[KVCache+KVCache]"),
           note="two latent attentions a layer, n-gram embeddings (token history as state)"),
    Family("falcon_h1", ("CacheList[ArraysCache+KVCache]",), honors_lengths=True,
           note="hybrid: Mamba-2 and attention in every layer"),
    Family("baichuan_m1", ("CacheList[ArraysCache+KVCache]", "CacheList[ArraysCache+RotatingKVCache]"),
           note="hybrid: short convolutions of keys and values, sliding-window layers"),
    # ---- recurrent state
    Family("mamba", ("ArraysCache",), note="state-space model, no attention"),
    Family("rwkv7", ("ArraysCache",), note="RWKV-7 recurrence, no attention"),
    # mlx-lm's RG-LRU leaves a sequence's first input unscaled only when it runs with no recurrent state
    # (`multiplier[:, 0, :] = 1.0` when its cache holds none); a row that joins a batch holds the batch's zeros
    Family("recurrent_gemma", ("ArraysCache", "RotatingKVCache"), min_prompt=(2, RECURRENT_GEMMA_FIRST_TOKEN),
           note="hybrid: RG-LRU layers + local attention"),
    Family("jamba", _ARR, note="hybrid: Mamba layers + attention, mixture of experts"),
    Family("plamo2", _ARR, honors_lengths=True, note="hybrid: Mamba layers + attention"),
    Family("kimi_linear", _ARR, honors_lengths=True,
           note="hybrid: delta-rule linear attention + latent attention, mixture of experts"),
    Family("kimi_k3", _ARR, honors_lengths=True,
           note="the text model of a Kimi K3 checkpoint: hybrid, delta-rule linear attention"),
    Family("olmo_hybrid", _ARR, note="hybrid: gated delta-net linear attention + attention"),
    Family("bailing_hybrid", _ARR, honors_lengths=True,
           note="hybrid: linear attention + latent attention, mixture of experts"),
    Family("bailing_moe_linear", _ARR, note="hybrid: linear attention + attention, mixture of experts"),
    Family("qwen3_5", _ARR, honors_lengths=True,
           note="the text model of a Qwen3.5 checkpoint: hybrid, gated delta-net linear attention + attention"),
    Family("qwen3_5_moe", _ARR, honors_lengths=True,
           note="the text model of a Qwen3.5 MoE checkpoint: hybrid, gated delta-net + attention, MoE"),
    Family("lfm2-vl", _ARR, honors_lengths=True,
           note="the text model of an LFM2-VL checkpoint: hybrid, short-conv layers + attention"),
    Family("lfm2_moe", _ARR, honors_lengths=True, note="hybrid: short-conv layers + attention, mixture of experts"),
    # ---- refused: mlx-lm's model code cannot take a batch whose rows differ in length
    Family("llama4", ("ChunkedKVCache", "KVCache"),
           refused="its chunked-attention layers (ChunkedKVCache) have no batch form in mlx-lm"),
    Family("deepseek_v41", ("LayerCache",),
           refused="its compressed, windowed layer cache (LayerCache) has no batch form in mlx-lm"),
    Family("gpt_bigcode", _KV, refused="mlx-lm's model takes its positions from a single offset (a batch cache "
                                       "holds one per row)"),
    Family("afm7", _KV, refused="mlx-lm's key-value-reuse layers rotate queries at the batch cache's padded "
                                "length, not each row's position: rows shorter than the longest get wrong positions"),
    Family("phi3small", _KV, refused="mlx-lm's block-sparse attention adds the batch's boolean mask to its scores, "
                                     "in a shape that does not broadcast over rows"),
    Family("minimax_m3_vl", ("CacheList[KVCache+KVCache]", "CacheList[KVCache]"),
           refused="mlx-lm's sparse attention cuts key blocks over cache slots, which a row's left padding shifts "
                   "off its positions: rows of a batch keep other blocks than alone"),
)}

# mlx-lm model types with no row (and no tiny build), each with why. Together with FAMILIES and SHARED_MODULES
# they must account for every module of the installed `mlx_lm.models` (tests/execution/test_families.py fails
# on an mlx-lm that adds a model type, naming it); README's sentence on them is generated from here.
LEFT_OUT: dict[str, str] = {
    "bitnet": "Metal kernels only, no CPU path",
    "muse_spark": "Metal kernels only, no CPU path",
    "gear": "transformers rejects its `conv_mixer` layer type while mlx-lm loads the tokenizer",
    "talkie": "a random build answers every prompt alike, so a test would prove nothing",
    "olmo": "needs the `ai2-olmo` package",
    "prism_hadamard_qwen35": "its packed 2-bit layers need hidden 512 and minutes a build on a CPU",
}

# Modules of `mlx_lm.models` that are model code shared between families, not a model type (no `Model` class).
SHARED_MODULES = frozenset({"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
                            "rope_utils", "ssm", "switch_layers"})


def model_type_of(model: Any) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def family_of(model_type: str) -> Family:
    """The declared facts of a model type; an undeclared type gets the defaults (its caches still decide)."""
    return FAMILIES.get(model_type) or Family(model_type, ())


def builds_own_caches(model_type: str) -> bool:
    """Whether mlx-lm's model class has its own `make_cache` (then `max_kv_size` is refused: mlx-lm would
    ignore it silently)."""
    return hasattr(importlib.import_module(f"mlx_lm.models.{model_type}").Model, "make_cache")


_BATCHED_PREFILL = {
    PrefillSharing.ANY: "any mix of chunks",
    PrefillSharing.ALIGNED: "chunks at one position of one length",
    PrefillSharing.NONE: "one request per forward",
}


def support_row(family: Family) -> dict[str, str]:
    """What the engine supports for a family, from its declared caches' capabilities (the README table)."""
    if family.refused:
        return {"model type": family.model_type, "caches": ", ".join(family.cache_kinds),
                "prefix cache": "-", "batched prefill": "-", "drafting": "-", "max_kv_size": "-", "KV budget": "-",
                "status": f"refused at load: {family.refused}"}
    caps = family.capabilities
    return {
        "model type": family.model_type,
        "caches": ", ".join(family.cache_kinds),
        "prefix cache": "any shared prefix" if caps.trimmable else "exact checkpoints at the block boundaries a prefill passed",
        "batched prefill": _BATCHED_PREFILL[caps.prefill_sharing(family.honors_lengths)],
        "drafting": "yes" if caps.rollback else "yes (re-fed: k // 2 drafts per verify, no MTP)",
        "max_kv_size": "no (builds its own caches)" if builds_own_caches(family.model_type) else "yes",
        "KV budget": "yes (fixed state counted)" if caps.has_fixed_state else "yes",
        "status": "exact in the conformance suite" + (f" ({family.note})" if family.note else ""),
    }


def support_table() -> str:
    """The Markdown table of `FAMILIES` written into README.md (a test fails if README's copy is stale)."""
    rows = [support_row(f) for f in FAMILIES.values()]
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines)


def left_out_text() -> str:
    """README's sentence on the mlx-lm model types with no row (`LEFT_OUT`; a test fails if README's copy is
    stale)."""
    why: dict[str, list[str]] = {}
    for model_type, reason in LEFT_OUT.items():
        why.setdefault(reason, []).append(f"`{model_type}`")
    parts = [" and ".join(types) + f" ({reason})" for reason, types in why.items()]
    return textwrap.fill("mlx-lm model types with no row: " + ", ".join(parts) + ".", width=120)

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
    note: str = ""

    @property
    def capabilities(self) -> CacheCapabilities:
        return CacheCapabilities(tuple(kind_capabilities(k) for k in self.cache_kinds))


_KV, _ROT, _ARR = ("KVCache",), ("KVCache", "RotatingKVCache"), ("ArraysCache", "KVCache")

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
    Family("llama4", ("ChunkedKVCache", "KVCache"),
           refused="its chunked-attention layers (ChunkedKVCache) have no batch form in mlx-lm"),
)}


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

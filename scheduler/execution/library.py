"""The one place that reaches into mlx-lm internals.

mlx-lm's batch-cache classes and model attributes move between minor releases (a refactor of the batch
classes broke wrappers before). Everything version-sensitive is here, and tests/test_adapters.py pins the
exact behaviour we rely on so an upgrade fails loudly in one spot.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

Cache = list[Any]  # one cache object per layer


def make_request_cache(model: Any, max_kv_size: int | None = None) -> Cache:
    """A fresh single-request cache: what `mlx_lm.generate` builds for a prompt.

    With `max_kv_size`, every layer is a `RotatingKVCache(max_kv_size, keep=0)`. mlx-lm's own single path
    keeps 4 attention-sink tokens (`keep=4`), but its batch cache has no `keep`, so batching with sinks
    would silently change results; we use no sinks on every path. Models that build their own caches
    (sliding-window models) ignore max_kv_size in mlx-lm; here that is an error, not a silent no-op.
    """
    if max_kv_size is None:
        return mlx_cache.make_prompt_cache(model)
    if supports_max_kv_size(model) is False:
        raise ValueError(f"max_kv_size: {type(model).__module__} builds its own caches; bound it with its "
                         "own sliding-window configuration instead")
    return [mlx_cache.RotatingKVCache(max_size=max_kv_size, keep=0) for _ in model.layers]


def supports_max_kv_size(model: Any) -> bool:
    return not hasattr(model, "make_cache")


def merge_caches(caches: Sequence[Cache]) -> Cache:
    """Single-request caches -> one left-padded batch cache per layer (BatchKVCache / BatchRotatingKVCache)."""
    layers = len(caches[0])
    merged = []
    for i in range(layers):
        layer = caches[0][i]
        if not hasattr(type(layer), "merge"):
            raise TypeError(f"{type(layer).__name__} cannot be batched (no merge)")
        merged.append(type(layer).merge([c[i] for c in caches]))
    return merged


def extend_batch(batch: Cache, other: Cache) -> Cache:
    """Append the rows of `other` to `batch` (in place where possible); returns the batch."""
    if not batch:
        return other
    for a, b in zip(batch, other):
        a.extend(b)
    return batch


def splittable(cache: Cache) -> bool:
    """Whether a batch of such caches can be split back into single-request caches (plain KV layers)."""
    return all(type(layer) is mlx_cache.KVCache for layer in cache)


def split_batch(batch: Cache, rows: int) -> list[Cache]:
    """One single-request cache per row of a plain-KV batch cache (mlx-lm's `extract`, which copies)."""
    return [[layer.extract(i) for layer in batch] for i in range(rows)]


def filter_batch(batch: Cache, keep: list[int]) -> Cache:
    """Keep only rows `keep` (in that order). An empty keep list drops the batch."""
    if not keep:
        return []
    for layer in batch:
        layer.filter(keep)
    return batch


def _plain_kv_classes() -> tuple[type, ...]:
    """mlx-lm's KVCache, and mlx-vlm's copy of it (same fields: keys, values, offset)."""
    classes: list[type] = [mlx_cache.KVCache]
    try:
        from mlx_vlm.models import cache as vlm_cache

        classes.append(vlm_cache.KVCache)
    except ImportError:  # mlx-vlm is optional for text-only use
        pass
    return tuple(classes)


_PLAIN_KV = _plain_kv_classes()


def snapshot_cache(cache: Cache) -> tuple[list[tuple[type, tuple]], int, bool]:
    """A prefix-cache payload from a single-request cache that is about to be dropped.

    Returns (payload, nbytes, whole_only). Plain KV layers are cut to their real length (the buffer grows in
    256-token steps); rotating layers keep their ring buffer as is and make the entry reusable only whole.
    """
    payload, nbytes, whole_only = [], 0, False
    for layer in cache:
        kind = type(layer)
        if kind in _PLAIN_KV:
            n = layer.offset
            keys, values = mx.contiguous(layer.keys[..., :n, :]), mx.contiguous(layer.values[..., :n, :])
            payload.append((kind, (keys, values, n)))
        elif kind is mlx_cache.RotatingKVCache:
            keys, values = layer.keys, layer.values
            payload.append((kind, layer.state))
            whole_only = True
        else:
            raise TypeError(f"{kind.__name__} layers cannot be stored in the prefix cache")
        nbytes += keys.nbytes + values.nbytes
    mx.eval([state[:2] for _, state in payload])
    return payload, nbytes, whole_only


def restore_cache(payload: list[tuple[type, tuple]], length: int) -> Cache:
    """A fresh single-request cache holding the first `length` tokens of a payload.

    Copy-on-restore: every array the new cache will write into is a distinct array object, so the request
    that reuses an entry can never change it.
    """
    cache = []
    for kind, state in payload:
        if kind in _PLAIN_KV:
            keys, values, n = state
            if length > n:
                raise ValueError(f"cannot restore {length} tokens from an entry of {n}")
            layer = kind()
            layer.keys, layer.values, layer.offset = keys[..., :length, :], values[..., :length, :], length
        else:
            layer = kind.from_state(tuple(mx.array(x) if isinstance(x, mx.array) else x for x in state))
            if layer.offset != length:
                raise ValueError(f"a rotating entry of {layer.offset} tokens cannot be cut to {length}")
        cache.append(layer)
    return cache


def kv_layout(model: Any, max_kv_size: int | None = None) -> "KVLayout":
    """Per-token KV bytes of each layer, measured on a one-token probe of the model's own cache."""
    from caches.kv import KVLayout, LayerLayout

    cache = make_request_cache(model, max_kv_size)
    model(mx.array([[0]]), cache=cache)
    mx.eval(cache_arrays(cache))
    layers = []
    for layer in cache:
        if type(layer) not in (mlx_cache.KVCache, mlx_cache.RotatingKVCache):
            raise TypeError(f"{type(layer).__name__} layers are not supported by the KV budget")
        per_token = (layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2]
        window = layer.max_size if type(layer) is mlx_cache.RotatingKVCache else None
        layers.append(LayerLayout(per_token, window))
    return KVLayout(tuple(layers))


def forward_with_hidden(model: Any, inputs: mx.array, cache: Cache) -> tuple[mx.array, mx.array]:
    """(logits, final hidden states) of an mlx-lm model whose `model.model` returns the normed hidden states
    and whose output head is `lm_head` or the tied embedding (llama, qwen3 and most decoder models)."""
    hidden = model.model(inputs, cache)
    return output_head(model)(hidden), hidden


def token_embedding(model: Any):
    return model.model.embed_tokens


def output_head(model: Any):
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear
    return model.lm_head


def cache_nbytes(cache: Cache) -> int:
    return sum(layer.nbytes for layer in cache)


def cache_arrays(cache: Cache) -> list[mx.array]:
    """The arrays to evaluate so a cache's pending writes are materialised."""
    return [layer.state for layer in cache]


def model_args(model: Any) -> Any:
    return getattr(model, "args", None)


def vocab_size(model: Any) -> int:
    args = model_args(model)
    if args is not None and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return int(model.model.embed_tokens.weight.shape[0])


def max_positions(model: Any) -> int | None:
    args = model_args(model)
    value = getattr(args, "max_position_embeddings", None) if args is not None else None
    return int(value) if value else None


def is_vision_language_model(model: Any) -> bool:
    """mlx-vlm models carry a vision tower next to their language model."""
    return hasattr(model, "vision_tower") and hasattr(model, "language_model")


def is_vision_language_dir(model_dir: Any) -> bool:
    import json
    from pathlib import Path

    config = Path(model_dir) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text(encoding="utf-8"))


def model_identity(model: Any) -> dict[str, Any]:
    """What identifies the model in a trace: its type and architecture numbers (not its weights)."""
    args = model_args(model)
    fields = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "sliding_window")
    identity = {f: getattr(args, f) for f in fields if args is not None and getattr(args, f, None) is not None}
    identity["class"] = f"{type(model).__module__}.{type(model).__name__}"
    return identity


def eos_token_ids(tokenizer: Any) -> frozenset[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eos is None else [eos]
    return frozenset(int(i) for i in ids)

"""The cache-layer protocol: everything the engine does with one layer's cache, for every cache class mlx-lm
builds, in one place.

A model's cache is a list with one object per layer (`Cache`). Each object is of a *kind* (`LayerKind`): plain
KV (`KVCache`, mlx-vlm's copy of it), rotating KV (`RotatingKVCache`, a sliding window or `max_kv_size`),
arrays (`ArraysCache` and its subclasses: SSM, conv and linear-attention state), pooled keys (mlx-vlm's
`PoolingCache`: GLM-5-Next's sparse-attention indexer), or a list of those (`CacheList`, mlx-lm's or mlx-vlm's).
A kind knows how to merge single-request caches into a batch, snapshot and restore a request's cache for the
prefix cache, measure its bytes, and what it can do: `LayerCapabilities` is plain data (can it be trimmed to a
shorter prefix? rolled back per row after draft verification? split back out of a batch? is its size fixed or
growing?). Callers read the capabilities; they never test cache classes. A layer's kind is found by its exact
class: a library's subclass of a known class keeps behaviour of its own and is refused (`_kind_of`).

Kinds mlx-lm cannot batch (`ChunkedKVCache`, `ConcatenateKVCache`, anything without `merge`) are refused by
`check_batchable` with `UnsupportedCache` naming the class and why. Quantized KV (`QuantizedKVCache`, what
mlx-lm's `kv_bits` converts a plain layer into) has no batch form in mlx-lm; its batch form here is mlx-vlm's
`BatchQuantizedKVCache` (left-padded like `BatchKVCache`; `mx.quantize` groups values along head_dim, never
along the sequence, so left padding cannot change a token's groups). `quantize_layers` is mlx-lm's
`maybe_quantize_kv_cache` conversion on one request's cache.

This module and the library seam (`scheduler/execution/library.py`) are the only places that know mlx-lm's cache internals; this one
imports nothing from `scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .kv import KVLayout, LayerLayout

Cache = list[Any]  # one cache object per layer


class Growth(str, Enum):
    PER_TOKEN = "per-token"  # a full-attention layer: every token stored
    WINDOW = "window"  # a sliding window: at most `window` tokens
    FIXED = "fixed"  # recurrent / conv state: the same bytes whatever the length


class MaskLayout(str, Enum):
    """How a batch cache's attention mask must be shaped for the family's score tensor.

    `HEADS`: (B, 1, L, S), for scores (B, heads, L, S) -- what mlx-lm's batch caches build. `GROUPED`:
    (B, 1, 1, L, S), for models that reshape queries to (B, kv_heads, repeats, L, D) before the score matmul
    (gemma2): mlx-lm's own batch mask does not broadcast against those five-dimensional scores."""

    HEADS = "heads"
    GROUPED = "grouped"


class UnsupportedCache(TypeError):
    """A cache class the engine (and mlx-lm's BatchGenerator) cannot batch."""

    def __init__(self, cache_class: str, reason: str):
        super().__init__(f"{cache_class}: {reason}")
        self.cache_class = cache_class
        self.reason = reason


@dataclass(frozen=True)
class LayerCapabilities:
    kind: str  # the cache class name
    growth: Growth
    trimmable: bool  # a stored prefix can be cut to a shorter one (otherwise reusable only whole)
    rollback: bool  # batch rows can drop their last tokens in place (speculative decoding)
    # a batch row can become a single-request cache again after a batched prefill forward of chunks of any
    # lengths, on its own: causal attention keeps every real position from the right pads, which are cut off
    splittable: bool
    # the same for a batch with no padding anywhere: rows that held as many tokens and each took a chunk of one
    # length (a rotating window or a recurrent state would take in pads, but a batch of equal rows has none)
    splittable_aligned: bool
    # the same for chunks of any lengths when the batch is first prepared with each row's length (mlx-lm's
    # padded-batch contract, what its BatchGenerator does for prompts of different lengths: `prepare(lengths=,
    # right_padding=)`, then `finalize()`, which rolls the pads into the row's left padding), provided the
    # model's forward honors it (a family fact: `scheduler.families.Family.honors_lengths`): windows take their
    # masks from the cache, recurrent layers read its mask and lengths, so the pads change no row's state
    splittable_prepared: bool
    # it keeps state of a fixed size per request (recurrent state), alone or next to KV in a CacheList
    fixed_state: bool = False

    def __and__(self, other: "LayerCapabilities") -> "LayerCapabilities":
        order = (Growth.FIXED, Growth.WINDOW, Growth.PER_TOKEN)
        return LayerCapabilities(f"{self.kind}+{other.kind}", max(self.growth, other.growth, key=order.index),
                                 self.trimmable and other.trimmable, self.rollback and other.rollback,
                                 self.splittable and other.splittable,
                                 self.splittable_aligned and other.splittable_aligned,
                                 self.splittable_prepared and other.splittable_prepared,
                                 self.fixed_state or other.fixed_state)


class PrefillSharing(Enum):
    """Which prefill chunks of several requests may share one forward, by what their caches split back from."""

    # any mix, right-padded: plain KV rows split back and the pads are cut off; windows and recurrent state
    # (of a family whose forward honors the lengths its batch cache is prepared with) skip the pads, which
    # `finalize` rolls into their left padding
    ANY = "any"
    # chunks that start at the same position and have one length, with no pads anywhere: a rotating window or a
    # recurrent state would take in right pads, and merging rows of different lengths left-pads them
    ALIGNED = "aligned"
    NONE = "none"  # one request per forward


@dataclass(frozen=True)
class CacheCapabilities:
    """What a whole model cache (every layer) supports: every layer must."""

    layers: tuple[LayerCapabilities, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({layer.kind for layer in self.layers}))

    @property
    def trimmable(self) -> bool:
        return all(layer.trimmable for layer in self.layers)

    @property
    def rollback(self) -> bool:
        return all(layer.rollback for layer in self.layers)

    @property
    def splittable(self) -> bool:
        return all(layer.splittable for layer in self.layers)

    @property
    def splittable_aligned(self) -> bool:
        return all(layer.splittable_aligned for layer in self.layers)

    @property
    def splittable_prepared(self) -> bool:
        return all(layer.splittable_prepared for layer in self.layers)

    def prefill_sharing(self, honors_lengths: bool) -> PrefillSharing:
        """What chunks share a forward, for a model whose forward does (``honors_lengths``) or does not honor the
        lengths a prepared batch cache carries (a family fact)."""
        if self.splittable or (honors_lengths and self.splittable_prepared):
            return PrefillSharing.ANY
        return PrefillSharing.ALIGNED if self.splittable_aligned else PrefillSharing.NONE

    @property
    def has_fixed_state(self) -> bool:
        return any(layer.fixed_state for layer in self.layers)

    @property
    def has_window(self) -> bool:
        return any(layer.growth is Growth.WINDOW for layer in self.layers)


# ---- the kinds ---------------------------------------------------------------------------------------------


def _library_extract(layer: Any, i: int) -> Any:
    """Row i of a batch layer as its own cache: mlx-lm's (or mlx-vlm's) `extract`, which copies the row's
    keys and values out of the batch."""
    return layer.extract(i)


def _plain_kv_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """mlx-lm's KVCache and BatchKVCache, and mlx-vlm's copies of them (same fields: keys, values, offset;
    the batch class also left_padding and _idx)."""
    classes: list[type] = [mlx_cache.KVCache]
    batch_classes: list[type] = [mlx_cache.BatchKVCache]
    try:
        from mlx_vlm.models import cache as vlm_cache

        classes.append(vlm_cache.KVCache)
        batch_classes.append(vlm_cache.BatchKVCache)
    except ImportError:  # mlx-vlm is optional for text-only use
        pass
    return tuple(classes), tuple(batch_classes)


_PLAIN_KV, _PLAIN_BATCH_KV = _plain_kv_classes()


# A batch row's dropped draft positions stay in place, masked, until they are this many (`_HoleBatchKVCache`).
HOLE_LIMIT = 32


class _HoleBatchKVCache(mlx_cache.BatchKVCache):
    """mlx-lm's BatchKVCache whose rows can drop their last positions without moving: the dropped positions
    become a *hole*, hidden by the attention mask exactly as left padding is, until the holes are squeezed
    out (`compact`).

    Why: after a verify forward the rows keep different numbers of positions, and re-aligning them (moving each
    row's kept positions right, `_shift_rows`) copies every layer's keys and values every verify tick; on the
    trained tiny model that was about a fifth of a batch-4 verify tick (bench/README.md, "A cheaper verify
    tick"). A hole costs the mask one `and` with a (B, length) array made on the host. The holes are squeezed
    out in one gather per array when they take more than `HOLE_LIMIT` positions (attention reads them), before
    a write that would grow the buffer (so the buffer grows exactly when a compact one would: the KV bound is
    unchanged; `_compact_before_growth`) and before rows change (filter, extend, extract), so mlx-lm's own code
    only ever sees its plain left-padded layout.

    `holes`: None, or a (B, capacity) numpy bool array, True at a hole (every layer of a batch holds the same
    one: the rollback sets them together)."""

    def __init__(self, left_padding):
        super().__init__(left_padding)
        self.holes: np.ndarray | None = None

    @classmethod
    def merge(cls, caches):
        if all(c.keys is None for c in caches):  # mlx-lm's merge returns its own class for empty caches
            return cls([0] * len(caches))
        return super().merge(caches)

    def _compact_before_growth(self, n: int) -> None:
        """A write of n positions that would grow the buffer compacts first, so the buffer grows from the
        compact layout as a batch without holes would (the KV bound holds). Every layer of a batch decides
        alike (same holes, write index and capacity): the one whose mask the model asks for compacts there,
        before the mask is built, the others before their own write, so the forward sees one layout."""
        if self.holes is not None and self.keys is not None and self._idx + n > self.keys.shape[2]:
            self.compact()

    def update_and_fetch(self, keys, values):
        self._compact_before_growth(keys.shape[2])
        return super().update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        self._compact_before_growth(N)
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None or not isinstance(mask, mx.array):
            return mask
        B = self.holes.shape[0]
        attended = np.concatenate([~self.holes[:, : self._idx], np.ones((B, N), dtype=bool)], axis=1)
        return mask & mx.array(attended)[:, None, None, :]

    def compact(self) -> None:
        """Squeeze the holes out: each row's attended positions, in order, right-aligned at the new write
        index (one gather per array, into a buffer of the same capacity)."""
        if self.holes is None:
            return
        holes, self.holes = self.holes, None
        if self.keys is None:
            return
        padding = np.asarray(self.left_padding.tolist(), dtype=np.int64)
        capacity = self.keys.shape[2]
        kept = [np.flatnonzero(~holes[b, padding[b] : self._idx]) + padding[b] for b in range(holes.shape[0])]
        new_idx = max((len(k) for k in kept), default=0)
        source = np.zeros((len(kept), capacity), dtype=np.int32)  # positions outside a row's span: left padding
        for b, k in enumerate(kept):
            source[b, new_idx - len(k) : new_idx] = k
        index = mx.array(source)[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, index, axis=2)
        self.values = mx.take_along_axis(self.values, index, axis=2)
        self.left_padding = mx.array([new_idx - len(k) for k in kept], dtype=self.left_padding.dtype)
        self._idx = new_idx

    def spare(self) -> int:
        """Positions of the write index that no row's tokens use: holes and padding every row shares."""
        return self._idx - int(max(self.offset.tolist(), default=0)) if self.holes is not None else 0

    def filter(self, batch_indices):
        self.compact()
        super().filter(batch_indices)

    def extend(self, other):
        self.compact()
        if isinstance(other, _HoleBatchKVCache):
            other.compact()
        super().extend(other)

    def extract(self, idx):
        if self.holes is None:
            return super().extract(idx)
        padding = self.left_padding.tolist()[idx]
        positions = mx.array(np.flatnonzero(~self.holes[idx, padding : self._idx]) + padding)
        cache = mlx_cache.KVCache()
        cache.keys = mx.contiguous(mx.take(self.keys[idx : idx + 1], positions, axis=2))
        cache.values = mx.contiguous(mx.take(self.values[idx : idx + 1], positions, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache


class _GroupedMaskBatchKVCache(_HoleBatchKVCache):
    """The batch cache whose mask has one more broadcast axis (MaskLayout.GROUPED)."""

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        return mask[:, None] if isinstance(mask, mx.array) and mask.ndim == 4 else mask


class PlainKV:
    classes = _PLAIN_KV
    batch_classes = _PLAIN_BATCH_KV
    caps = LayerCapabilities("KVCache", Growth.PER_TOKEN, trimmable=True, rollback=True, splittable=True,
                             splittable_aligned=True, splittable_prepared=True)

    @staticmethod
    def extract(layer: Any, i: int) -> Any:
        """Row i (`_library_extract`). A batch layer no forward has written yet has no row to copy: mlx-vlm's
        `BatchKVCache.extract` slices its missing keys. Such a row is an empty single-request cache (mlx-vlm's
        GLM-5-Next writes the keys it projects for its sparse attention only on forwards of more than 8
        positions)."""
        if layer.keys is None:
            return next(single for single, batch in zip(_PLAIN_KV, _PLAIN_BATCH_KV) if isinstance(layer, batch))()
        return _library_extract(layer, i)

    @staticmethod
    def merge(layers: Sequence[Any], mask: MaskLayout) -> Any:
        if mask is MaskLayout.GROUPED:
            return _GroupedMaskBatchKVCache.merge(layers)
        if type(layers[0]) is mlx_cache.KVCache:  # mlx-lm's own: rows roll back into masked holes
            return _HoleBatchKVCache.merge(layers)
        return type(layers[0]).merge(layers)

    @staticmethod
    def snapshot(layer: Any) -> tuple[tuple | None, list[mx.array]]:
        if layer.keys is None:  # a layer that stores nothing (see `layout`) is restored empty at any length
            return None, []
        n = layer.offset
        keys, values = mx.contiguous(layer.keys[..., :n, :]), mx.contiguous(layer.values[..., :n, :])
        return (keys, values, n), [keys, values]

    @staticmethod
    def restore(kind: type, state: tuple | None, length: int) -> Any:
        if state is None:
            return kind()
        keys, values, n = state
        if length > n:
            raise ValueError(f"cannot restore {length} tokens from an entry of {n}")
        layer = kind()
        layer.keys, layer.values, layer.offset = keys[..., :length, :], values[..., :length, :], length
        return layer

    @staticmethod
    def layout(layer: Any) -> LayerLayout:
        if layer.keys is None:  # a layer that stores nothing (nemotron-nas's attention replaced by a linear map)
            return LayerLayout(0, None)
        return LayerLayout((layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2], None)


def _vlm_cache_classes(*names: str) -> tuple[type, ...]:
    """mlx-vlm's cache classes of these names; none without mlx-vlm (it is optional for text-only use)."""
    try:
        from mlx_vlm.models import cache as vlm_cache
    except ImportError:
        return ()
    return tuple(getattr(vlm_cache, name) for name in names)


# mlx-vlm 0.7's own rotating caches (Gemma 4's language model builds them). They batch like mlx-lm's, but keep the
# pre-0.32 state contract: `state` is (keys, values) and `from_state(state, meta_state)`
_VLM_ROTATING, _VLM_BATCH_ROTATING = _vlm_cache_classes("RotatingKVCache"), _vlm_cache_classes("BatchRotatingKVCache")


class RotatingKV:
    classes = (mlx_cache.RotatingKVCache, *_VLM_ROTATING)
    batch_classes = (mlx_cache.BatchRotatingKVCache, *_VLM_BATCH_ROTATING)
    # A window that has wrapped has overwritten what a trim or a rollback would have to bring back.
    caps = LayerCapabilities("RotatingKVCache", Growth.WINDOW, trimmable=False, rollback=False, splittable=False,
                             splittable_aligned=True, splittable_prepared=True)
    # Not splittable on its own: a padded forward is prepared with the rows' lengths (`prepare_padded`), and
    # `finalize` rolls the pads into the row's left padding, so `extract` returns the window of its real tokens
    # (its offset and buffer are not one count, so a cut at the end would be the window's own bookkeeping, which
    # mlx-lm keeps).
    extract = staticmethod(_library_extract)

    @staticmethod
    def merge(layers: Sequence[Any], mask: MaskLayout) -> Any:
        return type(layers[0]).merge(layers)

    @staticmethod
    def snapshot(layer: Any) -> tuple[tuple, list[mx.array]]:
        if isinstance(layer, _VLM_ROTATING):
            keys, values = (mx.array(x) for x in layer.state)
            return (keys, values, layer.meta_state), [keys, values]
        return layer.state, [layer.keys, layer.values]

    @staticmethod
    def restore(kind: type, state: tuple, length: int) -> Any:
        if issubclass(kind, _VLM_ROTATING):
            keys, values, meta = state
            layer = kind.from_state((mx.array(keys), mx.array(values)), meta)
        else:
            layer = kind.from_state(tuple(mx.array(x) if isinstance(x, mx.array) else x for x in state))
        if layer.offset != length:
            raise ValueError(f"a rotating entry of {layer.offset} tokens cannot be cut to {length}")
        return layer

    @staticmethod
    def layout(layer: Any) -> LayerLayout:
        return LayerLayout((layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2], layer.max_size)


def _arrays_classes() -> tuple[type, ...]:
    """mlx-lm's ArraysCache, and mlx-vlm's own (hybrid VLMs such as Qwen3.5 build it; same merge / filter /
    extend and ``cache`` list)."""
    try:
        from mlx_vlm.models import cache as vlm_cache
    except ImportError:  # mlx-vlm is optional for text-only use
        return (mlx_cache.ArraysCache,)
    return (mlx_cache.ArraysCache, vlm_cache.ArraysCache)


class Arrays:
    """Recurrent state (SSM, conv, linear attention): fixed bytes per request, no notion of a token count.
    A state cannot be cut back to a shorter prefix, nor rewound after draft verification."""

    classes = _arrays_classes()
    batch_classes = classes
    caps = LayerCapabilities("ArraysCache", Growth.FIXED, trimmable=False, rollback=False, splittable=False,
                             splittable_aligned=True, splittable_prepared=True, fixed_state=True)

    @staticmethod
    def merge(layers: Sequence[Any], mask: MaskLayout) -> Any:
        Arrays.pad_histories(layers)
        return type(layers[0]).merge(layers)

    @staticmethod
    def pad_histories(layers: Sequence[Any]) -> None:
        """Make each state slot one shape across `layers` (in place) by zeros in front, before they are
        stacked. A slot's shape differs between requests only where the state is a history of the last tokens
        that has not filled yet (longcat_flash_ngram keeps its n-gram context of up to n - 1 tokens), and mlx-lm
        reads a missing token as zero there (its shifted n-gram ids start with zeros, and `ArraysCache.extend`
        fills a row without state with zeros): padded, a row's n-gram ids are the ones it has alone."""
        for slot in range(len(layers[0].cache)):
            arrays = [layer.cache[slot] for layer in layers if layer.cache[slot] is not None]
            if not arrays or all(a.shape[1:] == arrays[0].shape[1:] for a in arrays):
                continue
            widest = [max(a.shape[axis] for a in arrays) for axis in range(1, arrays[0].ndim)]
            for layer in layers:
                a = layer.cache[slot]
                if a is not None and list(a.shape[1:]) != widest:
                    layer.cache[slot] = mx.pad(a, [(0, 0)] + [(w - n, 0) for w, n in zip(widest, a.shape[1:])])

    @staticmethod
    def extract(layer: Any, i: int) -> Any:
        """Row i as its own cache, copied: mlx-lm's and mlx-vlm's `extract` slice the batch's arrays, and a slice
        keeps the whole batch buffer alive as long as the row lives (B rows' state for one row's bytes)."""
        row = layer.extract(i)
        row.cache = [mx.contiguous(a) if a is not None else None for a in row.cache]
        return row

    @staticmethod
    def snapshot(layer: Any) -> tuple[tuple, list[mx.array]]:
        arrays = [mx.array(a) if a is not None else None for a in layer.cache]
        return (len(layer.cache), arrays), [a for a in arrays if a is not None]

    @staticmethod
    def restore(kind: type, state: tuple, length: int) -> Any:
        size, arrays = state
        layer = kind(size)
        layer.cache = [mx.array(a) if a is not None else None for a in arrays]  # copy-on-restore
        return layer

    @staticmethod
    def layout(layer: Any) -> LayerLayout:
        return LayerLayout(0, None, fixed_bytes=layer.nbytes)


def _vlm_batch_quantized() -> tuple[type, ...]:
    """mlx-vlm 0.7's BatchQuantizedKVCache (mlx-lm 0.32 has none), with what the engine needs on top: exact
    bytes, and rows extracted as mlx-lm's own QuantizedKVCache. Empty without mlx-vlm (then kv_bits cannot
    batch: merging raises UnsupportedCache)."""
    try:
        from mlx_vlm.models import cache as vlm_cache
    except ImportError:  # mlx-vlm is optional for text-only use
        return ()

    class BatchQuantizedKV(vlm_cache.BatchQuantizedKVCache):
        @property
        def nbytes(self) -> int:
            if self.keys is None:
                return 0
            return sum(x.nbytes for x in (*self.keys, *self.values))

        def extract(self, idx: int) -> Any:
            layer = mlx_cache.QuantizedKVCache(group_size=self.group_size, bits=self.bits)
            if self.keys is None or self._idx == 0:
                return layer
            padding = int(self.left_padding[idx].item())
            layer.keys = tuple(mx.contiguous(k[idx : idx + 1, :, padding : self._idx]) for k in self.keys)
            layer.values = tuple(mx.contiguous(v[idx : idx + 1, :, padding : self._idx]) for v in self.values)
            layer.offset = self._idx - padding
            return layer

    return (BatchQuantizedKV,)


def _quantized_classes() -> tuple[type, ...]:
    classes: list[type] = [mlx_cache.QuantizedKVCache]
    try:
        from mlx_vlm.models import cache as vlm_cache

        classes.append(vlm_cache.QuantizedKVCache)
    except ImportError:  # mlx-vlm is optional for text-only use
        pass
    return tuple(classes)


class QuantizedKV:
    """Plain KV stored as `mx.quantize` triples (packed uint32, scales, biases) for keys and for values.
    Per-token storage like plain KV (trimmable, splittable); not rolled back per row (drafting is refused
    with kv_bits)."""

    classes = _quantized_classes()
    batch_classes = _vlm_batch_quantized()
    caps = LayerCapabilities("QuantizedKVCache", Growth.PER_TOKEN, trimmable=True, rollback=False, splittable=True,
                             splittable_aligned=True, splittable_prepared=True)
    extract = staticmethod(_library_extract)

    @staticmethod
    def merge(layers: Sequence[Any], mask: MaskLayout) -> Any:
        """Left-padded like mlx-lm's BatchKVCache.merge: row i's tokens end at the longest row's length."""
        if mask is not MaskLayout.HEADS or not QuantizedKV.batch_classes:
            raise UnsupportedCache("QuantizedKVCache", f"no batch form (mask layout {mask.value}; it is mlx-vlm's "
                                   "BatchQuantizedKVCache)")
        kind = QuantizedKV.batch_classes[0]
        first = layers[0]
        lengths = [layer.offset for layer in layers]
        longest = max(lengths)
        batch = kind([longest - n for n in lengths], group_size=first.group_size, bits=first.bits)
        if longest == 0:
            return batch
        ref = next(layer for layer in layers if layer.keys is not None)

        def stack(parts_of):
            out = []
            for j, part in enumerate(parts_of(ref)):
                shape = (len(layers), part.shape[1], longest, part.shape[3])
                buf = mx.zeros(shape, dtype=part.dtype)
                for i, (layer, n) in enumerate(zip(layers, lengths)):
                    if n:
                        buf[i : i + 1, :, longest - n :] = parts_of(layer)[j][..., :n, :]
                out.append(buf)
            return tuple(out)

        batch.keys, batch.values = stack(lambda c: c.keys), stack(lambda c: c.values)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @staticmethod
    def snapshot(layer: Any) -> tuple[tuple, list[mx.array]]:
        n = layer.offset
        keys = tuple(mx.contiguous(k[..., :n, :]) for k in layer.keys)
        values = tuple(mx.contiguous(v[..., :n, :]) for v in layer.values)
        return (keys, values, n, layer.group_size, layer.bits), [*keys, *values]

    @staticmethod
    def restore(kind: type, state: tuple, length: int) -> Any:
        keys, values, n, group_size, bits = state
        if length > n:
            raise ValueError(f"cannot restore {length} tokens from an entry of {n}")
        layer = mlx_cache.QuantizedKVCache(group_size=group_size, bits=bits)
        layer.keys = tuple(k[..., :length, :] for k in keys)  # fresh slices: the entry is never written
        layer.values = tuple(v[..., :length, :] for v in values)
        layer.offset = length
        return layer

    @staticmethod
    def layout(layer: Any) -> LayerLayout:
        return LayerLayout(sum(x.nbytes for x in (*layer.keys, *layer.values)) // layer.keys[0].shape[2], None)


# mlx-vlm 0.7's PoolingCache and its BatchPoolingCache (GLM-5-Next's sparse-attention indexer keeps its keys pooled
# in windows of `ratio` in one)
_VLM_POOLING, _VLM_BATCH_POOLING = _vlm_cache_classes("PoolingCache"), _vlm_cache_classes("BatchPoolingCache")


class Pooling:
    """mlx-vlm's PoolingCache: keys pooled (compressed) in windows of `ratio` tokens, and a buffer of the last
    window's tokens not yet pooled (`remainder` of them). It grows by one pooled row every `ratio` tokens. Its
    batch form (mlx-vlm's BatchPoolingCache) keeps each row's pooled length and remainder, merges, filters,
    extends and extracts rows, and takes mlx-lm's padded-batch contract (`prepare(lengths=)` / `finalize`).
    A pooled window cannot be cut back to a shorter prefix nor rewound: no trim, no rollback; and a right pad
    would enter a window unless the batch is prepared with the rows' lengths."""

    classes = _VLM_POOLING
    batch_classes = _VLM_BATCH_POOLING
    caps = LayerCapabilities("PoolingCache", Growth.PER_TOKEN, trimmable=False, rollback=False, splittable=False,
                             splittable_aligned=True, splittable_prepared=True)
    extract = staticmethod(_library_extract)

    @staticmethod
    def merge(layers: Sequence[Any], mask: MaskLayout) -> Any:
        return type(layers[0]).merge(layers)

    @staticmethod
    def snapshot(layer: Any) -> tuple[tuple, list[mx.array]]:
        r = layer.remainder
        buf = tuple(mx.array(b[:, :r]) for b in (layer.buf_kv, layer.buf_gate)) if r else (None, None)
        pooled = mx.array(layer.pooled) if layer.pooled is not None else None
        n = layer.size() * layer.ratio + r
        return (layer.ratio, *buf, pooled, r, n), [a for a in (*buf, pooled) if a is not None]

    @staticmethod
    def restore(kind: type, state: tuple, length: int) -> Any:
        ratio, buf_kv, buf_gate, pooled, r, n = state
        if length != n:
            raise ValueError(f"a pooled entry of {n} tokens cannot be cut to {length}")
        layer = kind(ratio)
        if r:  # copy-on-restore: the buffer is written in place by later tokens
            layer.buf_kv = mx.concatenate([buf_kv, mx.zeros((1, ratio - r, buf_kv.shape[2]), buf_kv.dtype)], axis=1)
            layer.buf_gate = mx.concatenate([buf_gate, mx.zeros((1, ratio - r, buf_gate.shape[2]), buf_gate.dtype)],
                                            axis=1)
            layer.remainder = r
        layer.pooled = mx.array(pooled) if pooled is not None else None
        return layer

    @staticmethod
    def layout(layer: Any) -> LayerLayout:
        """A pooled row (the width of the keys) every `ratio` tokens, rounded up; the window buffer is fixed."""
        buffers = [b for b in (layer.buf_kv, layer.buf_gate) if b is not None]
        if not buffers:
            return LayerLayout(0, None)
        row = layer.buf_kv.shape[2] * layer.buf_kv.dtype.size
        return LayerLayout(-(-row // layer.ratio), None, fixed_bytes=sum(b.nbytes for b in buffers))


# mlx-lm's CacheList and mlx-vlm's own (same ``caches`` tuple and constructor; Inkling's language model builds it, a
# KVCache and an ArraysCache of short-convolution states per layer, and GLM-5-Next's sparse attention): one model
# layer keeping several caches, each of a kind here
_CACHE_LISTS = (mlx_cache.CacheList, *_vlm_cache_classes("CacheList"))

_KINDS = (PlainKV, RotatingKV, Arrays, QuantizedKV, Pooling)
# every cache class a layer (or a CacheList's part) can be, single-request and batch forms
_LAYER_CLASSES = (*_CACHE_LISTS, *(c for kind in _KINDS for c in (*kind.classes, *kind.batch_classes)))

_REFUSED = {
    "ChunkedKVCache": "chunked attention caches have no batch form in mlx-lm (its BatchGenerator refuses them too)",
    "ConcatenateKVCache": "concatenating caches have no batch form in mlx-lm",
}


def _kind_of(layer: Any):
    """The kind whose classes hold this layer's class exactly. A library's subclass of a kind's class is refused:
    it keeps state, masks or positions of its own that the kind's merge, snapshot and rollback would drop or
    misread (mlx-vlm 0.7.10's QSAKVCache keeps a sparse indexer's keys beside its KVCache fields; Unlimited-OCR's
    RingSlidingKVCache is a window over a KVCache). This module's own subclasses (`_HoleBatchKVCache`, ...) are
    the kinds' batch forms."""
    cls = type(layer)
    for kind in _KINDS:
        if cls in kind.classes or cls in kind.batch_classes:
            return kind
        if isinstance(layer, kind.batch_classes) and cls.__module__ == __name__:
            return kind
    name = cls.__name__
    base = next((c for kind in _KINDS for c in (*kind.classes, *kind.batch_classes) if isinstance(layer, c)), None)
    if base is not None:
        raise UnsupportedCache(name, f"a subclass of {base.__module__}.{base.__name__} with behaviour of its own, "
                                     f"which the {base.__name__} batch form would not carry")
    raise UnsupportedCache(name, _REFUSED.get(name, "no batch form (no merge) in mlx-lm"))


# ---- the protocol, on whole caches ---------------------------------------------------------------------------


def layer_capabilities(layer: Any) -> LayerCapabilities:
    if isinstance(layer, _CACHE_LISTS):
        return _cache_list_capabilities([layer_capabilities(c) for c in layer.caches])
    return _kind_of(layer).caps


def _cache_list_capabilities(caps: Sequence[LayerCapabilities]) -> LayerCapabilities:
    """A `CacheList` (one model layer keeping several caches) supports what all of its caches do; its kind names
    them in order: `CacheList[KVCache+KVCache]`."""
    out = caps[0]
    for c in caps[1:]:
        out = out & c
    return replace(out, kind=f"CacheList[{out.kind}]")


def kind_capabilities(kind: str) -> LayerCapabilities:
    """The capabilities of a cache kind by the name `layer_capabilities` gives it (the family table declares
    kinds by name): a class name, or `CacheList[A+B]`."""
    if kind.startswith("CacheList[") and kind.endswith("]"):
        return _cache_list_capabilities([kind_capabilities(k) for k in kind[len("CacheList["):-1].split("+")])
    return KIND_CAPABILITIES[kind]


def capabilities(cache: Cache) -> CacheCapabilities:
    """Raises UnsupportedCache for a layer mlx-lm cannot batch."""
    return CacheCapabilities(tuple(layer_capabilities(layer) for layer in cache))


def check_batchable(cache: Cache) -> CacheCapabilities:
    return capabilities(cache)


def merge_caches(caches: Sequence[Cache], mask: MaskLayout = MaskLayout.HEADS) -> Cache:
    """Single-request caches -> one batch cache per layer (left-padded KV, stacked recurrent state)."""
    return [_merge_layer([c[i] for c in caches], mask) for i in range(len(caches[0]))]


def _merge_layer(layers: Sequence[Any], mask: MaskLayout) -> Any:
    if isinstance(layers[0], _CACHE_LISTS):
        merged = type(layers[0])()
        merged.caches = tuple(_merge_layer([layer.caches[j] for layer in layers], mask)
                              for j in range(len(layers[0].caches)))
        _drop_lagging_parts(merged)
        return merged
    return _kind_of(layers[0]).merge(layers, mask)


def _drop_lagging_parts(layer: Any) -> None:
    """Empty, for every row, a plain KV part of a batch `CacheList` that holds fewer positions than the list's
    first part in some row.

    Such a part is one that only some forwards write (see `PlainKV.extract`): mlx-vlm's GLM-5-Next keeps the keys
    it projects for its sparse attention there, written by forwards of more than 8 positions when the part holds
    as many positions as the latent cache (its first part), and recomputed from the latent otherwise. It compares
    the batch part's one length (`size()`, its write index) with the forward's start: in a batch where one row's
    part is complete and another's lags, the lagging row's projected keys sit left-padded under other positions,
    and the model reads them (a shared 9-position chunk gave that row logits 1.4 away from its own forward).
    Emptied, the part never matches a forward that starts past 0, and every row is recomputed from its latent, as
    a lagging row alone is."""
    reference = _row_lengths(layer.caches[0])
    if reference is None:
        return
    parts = list(layer.caches)
    for j, part in enumerate(parts[1:], 1):
        if isinstance(part, PlainKV.batch_classes) and part.keys is not None and _row_lengths(part) != reference:
            parts[j] = type(part)([0] * len(reference))
    layer.caches = type(layer.caches)(parts) if isinstance(layer.caches, (tuple, list)) else parts


def _row_lengths(layer: Any) -> list[int] | None:
    """Tokens each row of a plain batch KV layer holds, or None for another kind."""
    if not isinstance(layer, PlainKV.batch_classes):
        return None
    return [int(n) for n in layer.offset.tolist()]


def extend_batch(batch: Cache, other: Cache) -> Cache:
    """Append the rows of `other` to `batch` (in place where possible); returns the batch."""
    if not batch:
        return other
    for a, b in zip(batch, other):
        _extend_layer(a, b)
    return batch


def _extend_layer(layer: Any, other: Any) -> None:
    if isinstance(layer, _CACHE_LISTS):
        for sub, other_sub in zip(layer.caches, other.caches):
            _extend_layer(sub, other_sub)
        _drop_lagging_parts(layer)
        return
    if isinstance(layer, Arrays.classes):
        Arrays.pad_histories([layer, other])
    layer.extend(other)


def join_rows(batch: Cache, caches: list[Cache], merge: Any = None) -> tuple[Cache, int]:
    """Append the rows of the single-request `caches` to `batch`: merge and extend one layer at a time, each
    evaluated before the next, and drop the requests' layer as its merged form lands (this consumes `caches`:
    their entries become None). So only one layer is ever held in two forms at once, instead of the whole
    old batch, the requests' caches, the merged rows and mlx-lm's padded copies all together.

    `merge`: a family's merge (its mask layout), called with single-layer caches. Returns the new batch and the
    most bytes these arrays held at once: everything before, plus at the layer being merged its merged rows
    and, when a batch is extended, the padded copies `extend` concatenates (at most the new layer) and the new
    layer (`KVLayout.join_bytes` bounds this)."""
    merge = merge or merge_caches
    extending = bool(batch)
    new = list(batch)
    held = cache_nbytes(batch) + sum(cache_nbytes(c) for c in caches)
    peak = held
    for i in range(len(caches[0])):
        merged = merge([[c[i]] for c in caches])
        merged_bytes, old_bytes = cache_nbytes(merged), new[i].nbytes if extending else 0
        if extending:
            new[i] = extend_batch([new[i]], merged)[0]
        else:
            new.append(merged[0])
        mx.eval(cache_arrays([new[i]]))
        new_bytes = new[i].nbytes
        peak = max(peak, held + merged_bytes + (2 * new_bytes if extending else 0))
        requests_bytes = sum(c[i].nbytes for c in caches)
        for c in caches:
            c[i] = None  # freed now, not when the whole merge is done
        held += new_bytes - old_bytes - requests_bytes
    return new, peak


def filter_batch(batch: Cache, keep: list[int]) -> Cache:
    """Keep only rows `keep` (in that order). An empty keep list drops the batch."""
    if not keep:
        return []
    for layer in batch:
        _filter_layer(layer, keep)
    return batch


def _filter_layer(layer: Any, keep: list[int]) -> None:
    if isinstance(layer, _CACHE_LISTS):
        for sub in layer.caches:
            _filter_layer(sub, keep)
        return
    layer.filter(keep)
    if isinstance(layer, RotatingKV.batch_classes):
        _drop_shared_padding(layer)


def _drop_shared_padding(layer: Any) -> None:
    """Cut the leading positions that are padding in every row a rotating batch layer kept.

    mlx-lm's `BatchKVCache.filter` does this and `BatchRotatingKVCache.filter` does not: a window larger than
    the rows left behind by a long row that finished kept that row's length (or the whole window once it had
    wrapped) for as long as the batch lived, above the KV bound the planner keeps (`KVLayout`: a batch holds
    fewer than longest row + STEP positions a layer). The window is put in temporal order first (a wrapped one
    starts at its write index); the cache is then an unwrapped one of its kept positions, whose write index and
    position count are one number, as mlx-lm keeps them before a window wraps."""
    shared = min(layer.left_padding.tolist(), default=0)  # in temporal order, wrapped or not (as mlx-lm's mask)
    if layer.keys is None or shared <= 0:
        return
    layer._temporal_order()
    layer.keys = layer.keys[..., shared:, :]
    layer.values = layer.values[..., shared:, :]
    layer.left_padding = layer.left_padding - shared
    layer._idx -= shared
    layer._offset = layer._idx


def _prepared_for_pads(layer: Any) -> bool:
    """Whether a batch layer is told its rows' lengths around a padded forward: a kind whose rows do not split
    back on their own (rotating windows, recurrent state); plain and quantized KV have their pads cut off."""
    return not _kind_of(layer).caps.splittable


def prepare_padded(batch: Cache, lengths: Sequence[int], width: int) -> None:
    """Before a batched prefill forward of chunks of `lengths` right-padded to `width`: prepare each layer whose
    kind keeps its rows' pads out only when told the rows' lengths (rotating windows, recurrent state:
    mlx-lm's `prepare(lengths=, right_padding=)`); plain and quantized KV are left as they are (their pads are
    cut off the extracted rows). Nothing to do when no chunk is padded. `finalize_padded` after the forward."""
    padding = [width - n for n in lengths]
    if max(padding, default=0) == 0:
        return
    for layer in batch:
        _prepare_layer(layer, list(lengths), padding)


def _prepare_layer(layer: Any, lengths: list[int], padding: list[int]) -> None:
    if isinstance(layer, _CACHE_LISTS):
        for part in layer.caches:
            _prepare_layer(part, lengths, padding)
    elif _prepared_for_pads(layer):
        if isinstance(layer, Arrays.classes) and layer.left_padding is not None and not bool(
                mx.any(layer.left_padding).item()):
            # A merge of fresh recurrent caches sets a left padding of zeros. No padding at all says the same,
            # and mlx-vlm 0.7's Qwen3.5 reads a zero left padding as "no mask" even when lengths are set (its
            # `_create_qwen3_5_ssm_mask`), so the right pads would enter the state.
            layer.left_padding = None
        layer.prepare(lengths=lengths, right_padding=padding)


def finalize_padded(batch: Cache) -> None:
    """After the forward `prepare_padded` prepared for: the prepared layers roll each row's pads into its left
    padding (mlx-lm's `finalize`), so `split_batch` extracts exactly the row's tokens and state."""
    for layer in batch:
        parts = layer.caches if isinstance(layer, _CACHE_LISTS) else (layer,)
        for part in parts:
            if _prepared_for_pads(part):
                part.finalize()


def split_batch(batch: Cache, rows: int, trailing: Sequence[int] | None = None) -> list[Cache]:
    """One single-request cache per row of a batch cache (mlx-lm's `extract`, which copies).

    `trailing[i]`: positions at the end of row i that are right padding (a batched prefill of chunks of
    different lengths). Plain and quantized KV rows have them cut off; rotating and recurrent layers must have
    been through `prepare_padded` / `finalize_padded`, which moved them out already. So the request's cache
    holds exactly its own tokens and bytes."""
    trailing = trailing or [0] * rows
    return [[_extract_row(layer, i, t) for layer in batch] for i, t in zip(range(rows), trailing)]


def _extract_row(layer: Any, i: int, trailing: int) -> Any:
    if isinstance(layer, _CACHE_LISTS):
        return type(layer)(*(_extract_row(c, i, trailing) for c in layer.caches))
    kind = _kind_of(layer)
    row = kind.extract(layer, i)
    if trailing and kind.caps.splittable:  # the others were prepared: `finalize` moved their pads out already
        _cut_tail(row, trailing)
    return row


def _cut_tail(row: Any, n: int) -> None:
    """Drop the last `n` positions of a single-request plain or quantized KV layer, copying what is kept (a
    view would keep the whole buffer alive)."""
    keep = row.offset - n
    if isinstance(row.keys, tuple):  # quantized: (packed, scales, biases)
        row.keys = tuple(mx.contiguous(k[..., :keep, :]) for k in row.keys)
        row.values = tuple(mx.contiguous(v[..., :keep, :]) for v in row.values)
    else:
        row.keys = mx.contiguous(row.keys[..., :keep, :])
        row.values = mx.contiguous(row.values[..., :keep, :])
    row.offset = keep


def snapshot_cache(cache: Cache) -> tuple[list[tuple[type, Any]], int, bool]:
    """A prefix-cache payload from a single-request cache: (payload, nbytes, whole_only).

    Plain KV layers are cut to their real length (the buffer grows in 256-token steps). A layer that cannot
    be trimmed (a rotating window, recurrent state) makes the entry reusable only whole, as an exact
    checkpoint of the tokens it holds. The arrays are copies or fresh slices: later writes to `cache` never
    reach the payload."""
    payload, arrays, whole_only = [], [], False
    for layer in cache:
        state, layer_arrays = _snapshot_layer(layer)
        payload.append((type(layer), state))
        arrays += layer_arrays
        whole_only = whole_only or not layer_capabilities(layer).trimmable
    mx.eval(arrays)
    return payload, sum(a.nbytes for a in arrays), whole_only


def _snapshot_layer(layer: Any) -> tuple[Any, list[mx.array]]:
    if isinstance(layer, _CACHE_LISTS):
        parts = [(type(c), *_snapshot_layer(c)) for c in layer.caches]
        return [(kind, state) for kind, state, _ in parts], [a for *_, arrays in parts for a in arrays]
    return _kind_of(layer).snapshot(layer)


def restore_cache(payload: list[tuple[type, Any]], length: int) -> Cache:
    """A fresh single-request cache holding the first `length` tokens of a payload (copy-on-restore: the
    request that reuses an entry can never change it)."""
    return [_restore_layer(kind, state, length) for kind, state in payload]


def _restore_layer(kind: type, state: Any, length: int) -> Any:
    if issubclass(kind, _CACHE_LISTS):
        # a plain part that only some forwards write (see `PlainKV.extract`) can hold fewer positions than the
        # entry: restored as stored, as the request that stored it held it
        return kind(*(_restore_layer(k, s, min(length, s[2]) if issubclass(k, PlainKV.classes) and s else length)
                      for k, s in state))
    for strategy in _KINDS:
        if issubclass(kind, strategy.classes):
            return strategy.restore(kind, state, length)
    raise UnsupportedCache(kind.__name__, "cannot be restored from the prefix cache")


def probe_layout(cache: Cache) -> KVLayout:
    """The per-layer byte layout of a single-request cache that holds exactly one token."""
    layers = []
    for layer in cache:
        parts = layer.caches if isinstance(layer, _CACHE_LISTS) else (layer,)
        per_token, window, fixed = 0, None, 0
        for part in parts:
            one = _kind_of(part).layout(part)
            per_token += one.bytes_per_token
            fixed += one.fixed_bytes
            window = one.window if one.window is not None else window
        layers.append(LayerLayout(per_token, window, fixed_bytes=fixed))
    return KVLayout(tuple(layers))


def unwritten_kv(cache: Cache) -> bool:
    """Whether a single-request cache that a forward has run on holds a plain KV layer (or part of a layer) that
    forward did not write: one that only some forwards write (see `PlainKV.extract`), whose bytes per token a
    probe of that forward cannot measure."""
    for layer in cache:
        parts = layer.caches if isinstance(layer, _CACHE_LISTS) else (layer,)
        if any(isinstance(part, PlainKV.classes) and part.keys is None for part in parts):
            return True
    return False


def cache_nbytes(cache: Cache) -> int:
    return sum(layer.nbytes for layer in cache)


def cache_arrays(cache: Cache) -> list[Any]:
    """The arrays to evaluate so a cache's pending writes are materialised."""
    return [layer.state for layer in cache]


# ---- quantized KV (EngineConfig.kv_bits) ---------------------------------------------------------------


class QuantizationRefused(TypeError):
    """A cache kind mlx-lm cannot quantize (its `to_quantized` raises) in a model's cache."""

    def __init__(self, cache_class: str, reason: str):
        super().__init__(f"{cache_class}: {reason}")
        self.cache_class = cache_class
        self.reason = reason


def _quantizes(layer: Any) -> bool:
    """mlx-lm's rule (`maybe_quantize_kv_cache`): a layer converts if it has `to_quantized`; plain KV does,
    recurrent state (ArraysCache) and CacheList do not and stay as they are."""
    return isinstance(layer, PlainKV.classes) and hasattr(layer, "to_quantized")


def check_quantizable(cache: Cache) -> list[bool]:
    """Which layers of a fresh single-request cache quantize. Raises QuantizationRefused for a layer whose
    `to_quantized` mlx-lm 0.32 / mlx-vlm 0.7 do not implement (RotatingKVCache: sliding windows, max_kv_size)."""
    for layer in cache:
        parts = layer.caches if isinstance(layer, _CACHE_LISTS) else (layer,)
        for part in parts:
            if isinstance(part, RotatingKV.classes):
                raise QuantizationRefused(type(part).__name__, "mlx-lm 0.32 and mlx-vlm 0.7 cannot quantize a "
                                          "rotating (sliding window) cache: its to_quantized raises "
                                          "NotImplementedError")
    return [_quantizes(layer) for layer in cache]


def quantize_layers(cache: Cache, group_size: int, bits: int) -> Cache:
    """Convert a single-request cache's plain KV layers to quantized storage, in place (mlx-lm's
    `maybe_quantize_kv_cache` once its check passes); other layers are left as they are. Returns the cache."""
    for i, layer in enumerate(cache):
        if _quantizes(layer):
            cache[i] = layer.to_quantized(group_size=group_size, bits=bits)
    return cache


def is_quantized(cache: Cache) -> bool:
    return any(isinstance(layer, QuantizedKV.classes + QuantizedKV.batch_classes) for layer in cache)


def quantized_layout(cache: Cache, group_size: int, bits: int) -> list[int | None]:
    """Bytes per token of each layer once quantized (None for a layer that stays as it is), measured on a
    single-request cache holding one token (converted here, so `cache` is consumed)."""
    flags = [_quantizes(layer) for layer in cache]
    quantize_layers(cache, group_size, bits)
    mx.eval(cache_arrays(cache))
    return [QuantizedKV.layout(layer).bytes_per_token if flag else None for layer, flag in zip(cache, flags)]


def probe_quantized_layout(cache: Cache, forward: Any, group_size: int, bits: int) -> list[int | None]:
    """`quantized_layout` measured on a fresh single-request cache that `forward(cache)` (a one-token step of
    the model, returning its logits) has run once; the step then runs again on the converted cache, so a model
    whose attention cannot read a quantized cache (or whose head_dim the group does not divide) fails here, at
    configuration, as QuantizationRefused, as does one none of whose layers can be quantized."""
    check_quantizable(cache)
    forward(cache)
    mx.eval(cache_arrays(cache))
    try:
        quantized = quantized_layout(cache, group_size, bits)
        mx.eval(forward(cache))
    # e.g. head_dim not a multiple of the group; AttributeError: an attention that treats what a quantized cache
    # returns (packed arrays, scales and biases in a tuple) as an array (mlx-vlm's DeepSeek-V3 latent attention:
    # `k_pe.swapaxes`)
    except (ValueError, TypeError, NotImplementedError, AttributeError) as exc:
        raise QuantizationRefused("QuantizedKVCache", f"{type(exc).__name__}: {exc}") from exc
    if not any(q is not None for q in quantized):
        raise QuantizationRefused(", ".join(sorted({type(c).__name__ for c in cache})),
                                  "no layer of this model's cache can be quantized")
    return quantized


def cache_offset(cache: Cache) -> int:
    """Tokens a single-request cache holds (its first layer with a token count; recurrent layers have none)."""
    for layer in cache:
        if isinstance(layer, _CACHE_LISTS):
            layer = layer.caches[0]
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    raise ValueError("no layer of this cache counts tokens")


def take_rows(batch: Cache, rows: Sequence[int]) -> list[Cache]:
    """Single-request caches of some rows of a splittable batch cache (copies; the batch is unchanged)."""
    return [[_extract_row(layer, i, 0) for layer in batch] for i in rows]


# ---- per-row rollback (speculative decoding) --------------------------------------------------------------


def _shift_rows(x: mx.array, shift: np.ndarray) -> mx.array:
    """Row b of x (B, H, L, D) moved by shift[b] positions along axis 2 (right if > 0), into a fresh buffer of
    the same capacity; vacated positions are zero (they become left padding, or lie beyond ``_idx``).

    One slice copy per row (memcpy speed) rather than mlx-lm's ``dynamic_roll`` gather, which measured ~4x
    slower on the CPU backend (17 MB: 2.4 ms vs 9-11 ms)."""
    L = x.shape[2]
    y = mx.zeros_like(x)
    for b, s in enumerate(shift.tolist()):
        if s >= L or -s >= L:
            continue  # nothing of the row survives inside the buffer (only possible for an empty row)
        if s > 0:
            y[b : b + 1, :, s:] = x[b : b + 1, :, : L - s]
        elif s < 0:
            y[b : b + 1, :, : L + s] = x[b : b + 1, :, -s:]
        else:
            y[b : b + 1] = x[b : b + 1]
    return y


def _drop_into_holes(layers: list[Any], d: list[int], new_len: list[int]) -> None:
    """`rollback_rows` without moving a row: the positions every row drops are trimmed, the rest (row b's
    last d[b] - min(d)) become holes (`_HoleBatchKVCache`). No copy; the holes are squeezed out once they take
    more than HOLE_LIMIT positions."""
    first = layers[0]
    idx, shared = first._idx, min(d)
    new_idx = idx - shared
    before = first.holes
    for layer in layers:
        if layer._idx != idx or layer.holes is not before:
            raise ValueError("all layers of a batch cache must have the same rows, length and holes")
    # the layers' one holes array is updated in place (a new one only when there was none): no copy a tick
    holes = np.zeros((len(d), first.keys.shape[2]), dtype=bool) if before is None else before
    holes[:, new_idx:] = False
    dropping = [b for b, n in enumerate(d) if n > shared]
    for b in dropping:
        holes[b, idx - d[b] : new_idx] = True
    offset = mx.array(new_len, dtype=mx.int32)
    for layer in layers:
        layer._idx, layer.offset = new_idx, offset
        layer.holes = holes if dropping or (before is not None and holes[:, :new_idx].any()) else None
    if first.spare() > HOLE_LIMIT:
        for layer in layers:
            layer.compact()


def rollback_reads(batch_cache_layers: Sequence[Any]) -> list[mx.array]:
    """The arrays `rollback_rows` reads back to the host (each row's length, which the verify forward has just
    advanced lazily): evaluated with the verdict of a verify tick, the rollback needs no sync of its own."""
    layers = _flat_layers(batch_cache_layers)
    if not layers or not isinstance(layers[0], _PLAIN_BATCH_KV):
        return []
    holding = _holding([layer for layer in layers if isinstance(layer, _PLAIN_BATCH_KV)])
    return [holding[0].offset] if holding else []


def _flat_layers(layers: Sequence[Any]) -> list[Any]:
    """The layers of a batch cache with each `CacheList` replaced by its caches (one model layer keeping several
    caches of one length, as deepseek_v32's attention and its indexer's keys: they roll back together)."""
    flat = []
    for layer in layers:
        flat.extend(_flat_layers(layer.caches) if isinstance(layer, _CACHE_LISTS) else [layer])
    return flat


def _holding(layers: list[Any]) -> list[Any]:
    """The plain KV layers that hold positions: a layer no forward writes (nemotron-nas's attention replaced by a
    linear map) has nothing to roll back, and no length a forward reads."""
    return [layer for layer in layers if layer.keys is not None]


def rollback_rows(batch_cache_layers: Sequence[Any], drop: Sequence[int] | mx.array | np.ndarray) -> list[int]:
    """Drop the last ``drop[b]`` positions of row ``b`` from every layer of a left-padded batch cache.

    Only layers whose capabilities declare `rollback` (plain KV batch layers, those inside a `CacheList` too).
    In place. The engine's own batch (`_HoleBatchKVCache`, what `merge_caches` builds from mlx-lm's KVCache)
    moves nothing: the positions every row drops are trimmed and the rest become masked holes
    (`_drop_into_holes`). Other plain batches (mlx-lm's
    and mlx-vlm's BatchKVCache) are re-aligned: rows stay
    right-aligned at the cache's ``_idx``: row b's kept positions move right by ``drop[b]`` (its left padding
    grows) -- the mechanism of mlx-lm's ``BatchKVCache.prepare(right_padding=...)`` + ``finalize()`` -- and
    then the padding every row shares is removed, so ``_idx`` ends at the longest row and padding does not
    accumulate tick after tick. Both moves are one copy of each array (one slice copy per row into a buffer of
    the same capacity, so the next forward does not reallocate). When every row drops the same number and no
    shared padding appears, it is a plain ``trim`` (no copy).

    ``offset`` (per-row real length, the RoPE position) and ``left_padding`` are updated, so the next forward
    sees exactly a cache that never held the dropped tokens. Returns the new per-row lengths.

    Raises TypeError for a layer that cannot roll back: a sliding window that has wrapped has already
    overwritten the positions a rollback would have to restore, recurrent state cannot be rewound.
    Speculation must be off for such models (the engine refuses it at configuration time).
    """
    layers = _flat_layers(batch_cache_layers)
    for layer in layers:
        if not isinstance(layer, _PLAIN_BATCH_KV):
            why = "cannot be rolled back" if not _kind_of(layer).caps.rollback else "is not a batch cache"
            raise TypeError(f"rollback_rows: {type(layer).__name__} {why}")
    layers = _holding(layers)
    if not layers:
        return []
    # plain lists: a tick's few rows, where numpy's per-call costs dominated the rollback (bench/README.md)
    d = [int(n) for n in (drop.tolist() if isinstance(drop, (mx.array, np.ndarray)) else drop)]
    first = layers[0]
    offset = first.offset.tolist()
    lengths = offset if isinstance(offset, list) else [offset]
    if len(d) != len(lengths):
        raise ValueError(f"drop has {len(d)} rows, the cache has {len(lengths)}")
    if any(n < 0 for n in d):
        raise ValueError(f"drop must be >= 0, got {d}")
    if any(n > length for n, length in zip(d, lengths)):
        raise ValueError(f"cannot drop more positions than a row holds: drop {d}, lengths {lengths}")
    new_len = [length - n for length, n in zip(lengths, d)]
    if not any(d):
        return new_len
    if all(isinstance(layer, _HoleBatchKVCache) for layer in layers):
        _drop_into_holes(layers, d, new_len)
        return new_len
    d, new_len = np.array(d, dtype=np.int64), np.array(new_len, dtype=np.int64)
    idx = first._idx
    new_idx = int(new_len.max()) if new_len.size else 0
    shift = d - (idx - new_idx)  # >0: move right (row dropped more than the shared trim); <0: move left
    for layer in layers:
        if layer._idx != idx or layer.offset.shape[0] != d.shape[0]:
            raise ValueError("all layers of a batch cache must have the same rows and length")
        if not shift.any():
            layer.trim(idx - new_idx)
            continue
        if layer.keys is not None:
            layer.keys = _shift_rows(layer.keys, shift)
            layer.values = _shift_rows(layer.values, shift)
        layer._idx = new_idx
        layer.offset = mx.array(new_len.astype(np.int32))
        layer.left_padding = mx.array((new_idx - new_len).astype(np.int32))
    return new_len.tolist()



# ---- undoing a verify forward where rows cannot roll back ------------------------------------------------------
# Recurrent state and rotating windows cannot drop their last positions in place (`rollback_rows`): a verify
# forward over [input, d_1..d_w] is undone by putting the batch back as it was before that forward (these
# snapshots) and feeding the accepted positions again (`MLXExecutor`).


@dataclass(frozen=True)
class _HeldLayer:
    layer: Any
    fields: dict[str, Any]


@dataclass(frozen=True)
class BatchSnapshot:
    """A batch cache as it was before a verify forward: every layer object and its fields, arrays held as views
    (a forward's in-place update of a held buffer then writes a new one, so the view keeps what was there).
    Every layer, plain KV included, and the objects themselves: a model may replace a layer object of the list
    during a forward (mlx-vlm's Qwen3.5 runs a multi-position forward over padded rows row by row and merges
    new batch caches into the list)."""

    layers: tuple[_HeldLayer, ...]


def _hold(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value[...]  # a new array over the same buffer: no copy now, and immune to in-place updates
    if isinstance(value, np.ndarray):  # host arrays are updated in place (a hole batch's `holes`): a copy
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_hold(v) for v in value)
    if isinstance(value, _LAYER_CLASSES):  # a layer inside a CacheList (recurrent state has no update_and_fetch)
        return _hold_layer(value)
    return value


def _hold_layer(layer: Any) -> _HeldLayer:
    return _HeldLayer(layer, {name: _hold(v) for name, v in vars(layer).items()})


def _put_back(value: Any) -> Any:
    if isinstance(value, _HeldLayer):
        vars(value.layer).clear()
        vars(value.layer).update({name: _put_back(v) for name, v in value.fields.items()})
        return value.layer
    if isinstance(value, (list, tuple)):
        return type(value)(_put_back(v) for v in value)
    return value


def snapshot_batch(batch_cache_layers: Sequence[Any]) -> BatchSnapshot:
    """Before a verify forward of several positions. A batch rotating window that has wrapped is first put in
    temporal order (the same window, laid out from its oldest position): the batch mask mlx-lm (and mlx-vlm)
    build for a multi-position forward reads the write index as the window's length, which it is only in that
    order; from a wrapped layout the padding mask is off by the ring index (a batch of one has no padding,
    so only batches show it)."""
    for layer in _flat_layers(batch_cache_layers):
        if isinstance(layer, RotatingKV.batch_classes) and layer.rotated:
            layer._temporal_order()
    return BatchSnapshot(tuple(_hold_layer(layer) for layer in batch_cache_layers))


def restore_batch(batch_cache_layers: list[Any], snapshot: BatchSnapshot) -> None:
    """The batch (a list, changed in place) back to `snapshot`: its layer objects, with their fields."""
    if len(batch_cache_layers) != len(snapshot.layers):
        raise ValueError(f"the snapshot has {len(snapshot.layers)} layers, the batch {len(batch_cache_layers)}")
    for i, held in enumerate(snapshot.layers):
        batch_cache_layers[i] = _put_back(held)

# The capabilities of each cache class by name (the family table declares kinds by name).
KIND_CAPABILITIES: dict[str, LayerCapabilities] = {kind.caps.kind: kind.caps for kind in _KINDS}

"""KV memory accounting: the layout of a model's per-token KV cost, and the upper bound the planner keeps
under `EngineConfig.kv_memory_bytes`.

The executor keeps KV in mlx-lm's own caches: one single-request cache per prefilling request, one
left-padded batch cache (`BatchKVCache` / `BatchRotatingKVCache`) for the decoding rows. Their real bytes are
what `MLXExecutor.cache_bytes()` sums from the arrays. The planner never sees those arrays; it sees request
token counts and this layout, and bounds what the arrays can hold after a tick:

* a full-attention layer stores every token; buffers grow in `STEP`-token steps from whatever size they have,
  so a single-request cache of n tokens holds fewer than n + STEP and a batch of B rows at most
  B * (longest row + STEP) (rows are right-aligned to the longest one: the padding of short rows is real
  memory, which is why mixing one long row with many short ones is expensive);
* a sliding-window layer keeps at most `window` tokens once decoding, and `window + chunk` while a chunk is
  being added;
* a recurrent layer (SSM, conv, linear-attention state: `ArraysCache`) holds `fixed_bytes` per request
  whatever its length, and B times that in a batch of B rows;
* a merge (requests whose prefill completed joining the batch; `layers.join_rows`, one layer at a time)
  briefly holds, next to what the tick ends with, the joining requests' own caches and, at the layer being
  merged, its old form, the merged rows and the padded copies mlx-lm's `extend` concatenates (no bigger
  than the new layer): `join_bytes`;
* a draft model (speculative decoding) keeps its own batch cache with a row per decoding request: its layers
  are appended to the target's (`combined`), so every term above counts both models.

The bound is deliberately an upper bound: `real bytes <= bound <= budget` is what the invariant checker
verifies every tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

STEP = 256  # mlx-lm's KVCache / BatchKVCache allocation step


@dataclass(frozen=True)
class LayerLayout:
    bytes_per_token: int  # keys + values of one token in this layer
    window: int | None  # sliding-window size, None for full attention
    fixed_bytes: int = 0  # recurrent state held per request whatever its length


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerLayout, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    def request_bytes(self, n_tokens: int, chunk: int) -> int:
        """Upper bound of a single-request cache holding `n_tokens` (after a chunk of `chunk` tokens).

        Not round_up(n, STEP): a cache that starts exact-sized (restored from the prefix cache, or split out of
        a batched prefill) grows by whole STEPs from its exact size, so only `capacity < tokens + STEP` holds
        on every path."""
        total = 0
        for layer in self.layers:
            total += layer.fixed_bytes
            if layer.window is None:
                total += layer.bytes_per_token * (n_tokens + STEP)
            else:
                total += layer.bytes_per_token * min(n_tokens + STEP, layer.window + chunk + STEP)
        return total

    def batch_bytes(self, row_tokens: Sequence[int]) -> int:
        """Upper bound of a batch cache whose rows hold `row_tokens` tokens each."""
        return sum(_layer_batch_bytes(layer, row_tokens) for layer in self.layers)

    def footprint(self, row_tokens: Sequence[int], prefill_tokens: Sequence[tuple[int, int]]) -> int:
        """Batch rows plus single-request caches given as (tokens, last chunk)."""
        return self.batch_bytes(row_tokens) + sum(self.request_bytes(n, c) for n, c in prefill_tokens)

    def join_bytes(self, old_rows: Sequence[int], joining: Sequence[tuple[int, int]]) -> int:
        """Held on top of the footprint after a tick while its merge runs (`layers.join_rows`, layer by
        layer): the `joining` requests' own caches ((tokens, last chunk) each) and, when there is a batch of
        `old_rows` to extend, at the layer being merged its old form, the joiners merged and the padded copies
        `extend` concatenates (at most the new layer): the largest layer's sum. With no batch yet the merged
        rows are the new batch itself."""
        if not joining:
            return 0
        extra = sum(self.request_bytes(n, c) for n, c in joining)
        if old_rows:
            joined = [n for n, _ in joining]
            extra += max(_layer_batch_bytes(layer, old_rows) + _layer_batch_bytes(layer, joined)
                         + _layer_batch_bytes(layer, list(old_rows) + joined) for layer in self.layers)
        return extra

    def combined(self, other: "KVLayout") -> "KVLayout":
        """The layers of both (a target and its draft model: every row holds KV in each)."""
        return KVLayout(self.layers + other.layers)


def _layer_batch_bytes(layer: LayerLayout, row_tokens: Sequence[int]) -> int:
    """Upper bound of one layer of a batch cache whose rows hold `row_tokens` tokens each."""
    if not row_tokens:
        return 0
    rows, longest = len(row_tokens), max(row_tokens)
    length = longest + STEP if layer.window is None else min(longest + STEP, layer.window + STEP)
    return layer.bytes_per_token * rows * length + layer.fixed_bytes * rows


class KVCacheManager:
    """Owns the KV caches of running requests, in mlx-lm's own classes (plain and rotating layers alike):

    * one single-request cache per prefilling request (created on its first chunk, or restored from a
      prefix-cache payload), exactly the cache `mlx_lm.generate` would build;
    * one batch cache for the decoding rows (`BatchKVCache` / `BatchRotatingKVCache` per layer): request
      caches are merged into it on admission (`join`) and rows are filtered out on exit (`keep_rows`).

    Plain and sliding-window (rotating) layers live in the same request cache because a model mixes them per
    layer (gemma3: three rotating layers, one full); splitting one request's layers across two managers would
    make every merge and filter a two-step affair. What differs per cache kind (window bounds, fixed recurrent
    state, whole-only prefix reuse, rollback) is in `KVLayout` and the cache-layer protocol (`caches.layers`).

    Byte accounting is exact: `nbytes()` sums the arrays. The scheduler never sees this object, only the
    layout's bound and these summaries.
    """

    def __init__(self, make_cache, merge=None):
        from . import layers  # layers imports this module's layout types

        self._layers = layers
        self._make_cache = make_cache
        self._merge = merge or layers.merge_caches  # a family's merge (its mask layout), or the default
        self._requests: dict[str, list] = {}
        self.batch: list = []  # one batch cache per layer; rows in the executor's row order
        self.peak_bytes = 0  # the most held at once, merges' transients included
        self.tick_peak_bytes = 0  # the same since start_tick()
        self.merges = 0
        self.filters = 0

    # ---- single-request caches ------------------------------------------------------------------------
    def request_cache(self, request_id: str) -> list:
        cache = self._requests.get(request_id)
        if cache is None:
            cache = self._requests[request_id] = self._make_cache()
        return cache

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def adopt(self, request_id: str, cache: list) -> None:
        """Take a single-request cache built elsewhere (a row of a batched prefill)."""
        self._requests[request_id] = cache

    def restore(self, request_id: str, payload, length: int) -> None:
        self._requests[request_id] = self._layers.restore_cache(payload, length)

    def snapshot(self, request_id: str):
        return self._layers.snapshot_cache(self._requests[request_id])

    def drop_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---- the batch --------------------------------------------------------------------------------------
    def join(self, request_ids: Sequence[str]) -> None:
        """Move these requests' caches into the batch, appended as new rows in this order.

        The merge runs here, layer by layer (`layers.join_rows`), so it holds one layer twice at most and its
        inputs are freed before the next forward allocates. Its peak, from the arrays, is noted next to the
        other requests' caches (`KVLayout.join_bytes` bounds it)."""
        others = sum(self._layers.cache_nbytes(c) for rid, c in self._requests.items() if rid not in request_ids)
        caches = [self._requests.pop(rid) for rid in request_ids]
        self.batch, peak = self._layers.join_rows(self.batch, caches, self._merge)
        self.merges += 1
        self._note(others + peak)

    def keep_rows(self, keep: list[int]) -> None:
        self.batch = self._layers.filter_batch(self.batch, keep)
        self.filters += 1

    def clear_batch(self) -> None:
        self.batch = []

    # ---- summaries --------------------------------------------------------------------------------------
    def request_ids(self) -> set[str]:
        return set(self._requests)

    def nbytes(self) -> int:
        a = self._layers
        return a.cache_nbytes(self.batch) + sum(a.cache_nbytes(c) for c in self._requests.values())

    def start_tick(self) -> None:
        self.tick_peak_bytes = self.nbytes()

    def _note(self, held: int) -> None:
        held = max(held, self.nbytes())
        self.peak_bytes = max(self.peak_bytes, held)
        self.tick_peak_bytes = max(self.tick_peak_bytes, held)

    def stats(self) -> dict:
        return {"bytes": self.nbytes(), "peak_bytes": self.peak_bytes, "request_caches": len(self._requests),
                "merges": self.merges, "filters": self.filters}

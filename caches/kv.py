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
* with a quantized KV cache (`EngineConfig.kv_bits`), a full-attention layer that quantizes costs
  `quantized_bytes_per_token` once a cache has switched (`QuantizeRule`): a prefilling cache of n tokens has
  switched if n >= `KVLayout.quantized_prefill_from`, a batch row of n tokens if n >= `quantized_rows_from`
  (rows below it decode in their own float group: two groups, each padded to its own longest row);
* not in the bound (the budget bounds what is held after each tick): a merge (requests whose prefill
  completed joining the batch; `layers.join_rows`, one layer at a time) briefly holds, next to what the tick
  ends with, the joining requests' own caches and, at the layer being
  merged, its old form, the merged rows and the padded copies mlx-lm's `extend` concatenates (no bigger
  than the new layer): `join_bytes` (each row in the storage it has then);
* a draft model (speculative decoding) keeps its own batch cache with a row per decoding request: its layers
  are appended to the target's (`combined`), so every term above counts both models.

The bound is deliberately an upper bound: `real bytes <= bound <= budget` after the tick is what the invariant
checker verifies every tick; `join_bytes` is the margin a merge needs on top.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

STEP = 256  # mlx-lm's KVCache / BatchKVCache allocation step


@dataclass(frozen=True)
class QuantizeRule:
    """When a request's KV layers switch to quantized storage: mlx-lm's `generate_step(kv_bits, kv_group_size,
    quantized_kv_start)`, made independent of how the engine chunks a prompt.

    mlx-lm checks `offset >= quantized_kv_start` after each of its forwards: after each prefill step of
    `prefill_step` tokens (its `prefill_step_size`, 2048 by default), after the prompt's end (all but the last
    token), and after every decode step; the first check that passes converts the float cache (every layer
    that has `to_quantized`) and every later forward reads quantized keys and values. So a request converts
    at exactly one context length, `point(prompt_len)`; the executor splits any forward that would straddle it,
    which gives the same float/quantized history as mlx-lm alone whatever the engine's chunks are (a
    preempted request recomputes with the same point: it depends on the original prompt only)."""

    bits: int
    group_size: int
    start: int
    prefill_step: int  # mlx-lm generate_step's prefill_step_size default

    @property
    def first_prefill_check(self) -> int:
        """The first prefill-step boundary at which mlx-lm's check can pass (a multiple of prefill_step)."""
        return -(-max(self.start, 1) // self.prefill_step) * self.prefill_step

    def point(self, prompt_len: int) -> int:
        """The context length after which this request's cache is quantized."""
        if self.start <= prompt_len - 1:
            return min(self.first_prefill_check, max(prompt_len - 1, 1))
        return self.start

    def record(self) -> dict[str, int]:
        return {"bits": self.bits, "group_size": self.group_size, "start": self.start,
                "prefill_step": self.prefill_step}


@dataclass(frozen=True)
class LayerLayout:
    bytes_per_token: int  # keys + values of one token in this layer
    window: int | None  # sliding-window size, None for full attention
    fixed_bytes: int = 0  # recurrent state held per request whatever its length
    quantized_bytes_per_token: int | None = None  # once quantized (kv_bits); None: this layer stays as it is


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerLayout, ...]
    # With a QuantizeRule: a prefilling cache of n tokens is quantized if n >= quantized_prefill_from (it may
    # be earlier, which only makes the bound larger), a batch row of n tokens if n >= quantized_rows_from (one
    # more than the rule's start: a row paused by a prefill-first tick holds one token fewer than counted).
    quantized_prefill_from: int | None = None
    quantized_rows_from: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    def quantized(self, rule: QuantizeRule, quantized_bytes: Sequence[int | None]) -> "KVLayout":
        """This layout with quantized layers (`quantized_bytes[i]` per token for layer i, None: unchanged)."""
        layers = tuple(replace(layer, quantized_bytes_per_token=q) for layer, q in zip(self.layers, quantized_bytes))
        return KVLayout(layers, rule.first_prefill_check, rule.start + 1)

    def record(self) -> dict[str, Any]:
        """What a trace records (`engine_start.kv_layout`), read back by `from_record`."""
        return {"layers": [[layer.bytes_per_token, layer.window]
                           + ([layer.quantized_bytes_per_token] if layer.quantized_bytes_per_token is not None else [])
                           for layer in self.layers],
                "quantized_from": [self.quantized_prefill_from, self.quantized_rows_from],
                # recurrent state per request (hybrid / SSM layers): without it a replay bounds less memory
                "fixed_bytes": [layer.fixed_bytes for layer in self.layers]}

    @classmethod
    def from_record(cls, record: Any) -> "KVLayout":
        """A recorded layout: a list of [bytes_per_token, window] (traces before quantized KV) or `record()`
        (traces before fixed-state bytes were recorded hold none)."""
        layers, quantized_from = (record, [None, None]) if isinstance(record, list) else (
            record["layers"], record.get("quantized_from") or [None, None])
        fixed = ([] if isinstance(record, list) else record.get("fixed_bytes")) or [0] * len(layers)
        return cls(tuple(LayerLayout(int(b), None if w is None else int(w), int(f),
                                     quantized_bytes_per_token=int(q[0]) if q else None)
                         for (b, w, *q), f in zip(layers, fixed)), *quantized_from)

    def _per_token(self, layer: LayerLayout, quantized: bool) -> int:
        return layer.quantized_bytes_per_token if quantized and layer.quantized_bytes_per_token is not None \
            else layer.bytes_per_token

    def request_bytes(self, n_tokens: int, chunk: int) -> int:
        """Upper bound of a single-request cache holding `n_tokens` (after a chunk of `chunk` tokens).

        Not round_up(n, STEP): a cache that starts exact-sized (restored from the prefix cache, or split out of
        a batched prefill) grows by whole STEPs from its exact size, so only `capacity < tokens + STEP` holds
        on every path."""
        quantized = self.quantized_prefill_from is not None and n_tokens >= self.quantized_prefill_from
        total = 0
        for layer in self.layers:
            total += layer.fixed_bytes
            if layer.window is None:
                total += self._per_token(layer, quantized) * (n_tokens + STEP)
            else:
                total += layer.bytes_per_token * min(n_tokens + STEP, layer.window + chunk + STEP)
        return total

    def batch_bytes(self, row_tokens: Sequence[int]) -> int:
        """Upper bound of a batch cache whose rows hold `row_tokens` tokens each."""
        if not row_tokens:
            return 0
        if self.quantized_rows_from is None:
            return self._group_bytes(row_tokens, quantized=False)
        # two groups (caches/layers.py): rows not yet quantized, and quantized rows, each padded to its longest
        return (self._group_bytes([n for n in row_tokens if n < self.quantized_rows_from], quantized=False)
                + self._group_bytes([n for n in row_tokens if n >= self.quantized_rows_from], quantized=True))

    def _group_bytes(self, row_tokens: Sequence[int], quantized: bool) -> int:
        if not row_tokens:
            return 0
        rows, longest = len(row_tokens), max(row_tokens)
        total = 0
        for layer in self.layers:
            if layer.window is None:
                total += self._per_token(layer, quantized) * rows * (longest + STEP)
            else:
                total += layer.bytes_per_token * rows * min(longest + STEP, layer.window + STEP)
            total += layer.fixed_bytes * rows
        return total

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
            extra += max(self._layer_bytes(layer, old_rows) + self._layer_bytes(layer, joined)
                         + self._layer_bytes(layer, list(old_rows) + joined) for layer in self.layers)
        return extra

    def _layer_bytes(self, layer: LayerLayout, row_tokens: Sequence[int]) -> int:
        """One layer of a batch of these rows, in the storage each row has (float and quantized groups)."""
        if self.quantized_rows_from is None:
            return _layer_batch_bytes(layer, row_tokens, layer.bytes_per_token)
        cut = self.quantized_rows_from
        return (_layer_batch_bytes(layer, [n for n in row_tokens if n < cut], layer.bytes_per_token)
                + _layer_batch_bytes(layer, [n for n in row_tokens if n >= cut], self._per_token(layer, True)))

    def combined(self, other: "KVLayout") -> "KVLayout":
        """The layers of both (a target and its draft model: every row holds KV in each)."""
        return replace(self, layers=self.layers + other.layers)

    def footprint(self, row_tokens: Sequence[int], prefill_tokens: Sequence[tuple[int, int]]) -> int:
        """Batch rows plus single-request caches given as (tokens, last chunk)."""
        return self.batch_bytes(row_tokens) + sum(self.request_bytes(n, c) for n, c in prefill_tokens)

    def admit_alone_bytes(self, prompt_len: int, headroom: int, chunk: int) -> int:
        """What the planner's admission rule asks of a prompt with nothing else held: its row grown by
        `headroom`, and its prefill peak (all but its last token, in its own cache, after a chunk of at most
        `chunk` tokens: more than its row where a sliding window holds the chunk too, or rows are quantized). A
        prompt needing more than the budget here can never be admitted, so the engine refuses it on arrival
        instead of queueing it for ever."""
        return max(self.footprint([prompt_len + headroom], []), self.request_bytes(max(prompt_len - 1, 1), chunk))


def _layer_batch_bytes(layer: LayerLayout, row_tokens: Sequence[int], per_token: int) -> int:
    """Upper bound of one layer of a batch cache whose rows hold `row_tokens` tokens each."""
    if not row_tokens:
        return 0
    rows, longest = len(row_tokens), max(row_tokens)
    if layer.window is not None:
        return layer.bytes_per_token * rows * min(longest + STEP, layer.window + STEP) + layer.fixed_bytes * rows
    return per_token * rows * (longest + STEP) + layer.fixed_bytes * rows


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

    def __init__(self, make_cache, merge=None, quantize: QuantizeRule | None = None):
        from . import layers  # layers imports this module's layout types

        self._layers = layers
        self._make_cache = make_cache
        self._merge = merge or layers.merge_caches  # a family's merge (its mask layout), or the default
        self._requests: dict[str, list] = {}
        self.batch: list = []  # one batch cache per layer (with a QuantizeRule: the quantized rows)
        self._batch_rows: list[str] = []  # request ids of `batch`'s rows, in its row order
        self._order: list[str] = []  # request ids of every decoding row, in the executor's row order
        # With a QuantizeRule, rows whose context has not reached their conversion point yet decode from a
        # second, float batch cache (a batch layer is either quantized or not): `pending`.
        self.quantize = quantize
        self.pending: list = []
        self._pending_rows: list[str] = []
        self._pending_tokens: dict[str, int] = {}  # tokens each pending row holds
        self._points: dict[str, int] = {}  # each row's conversion point (QuantizeRule.point)
        self.peak_bytes = 0  # the most held at once, merges' transients included
        self.merges = 0
        self.filters = 0
        self.conversions = 0  # request caches converted to quantized storage

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

    # ---- quantized storage (QuantizeRule) --------------------------------------------------------------
    def is_quantized(self, request_id: str) -> bool:
        return self._layers.is_quantized(self._requests[request_id])

    def quantize_request(self, request_id: str) -> bool:
        """Convert a request's own cache to quantized storage (mlx-lm's conversion, once); False if it
        already was."""
        cache = self._requests[request_id]
        if self._layers.is_quantized(cache):
            return False
        self._layers.quantize_layers(cache, self.quantize.group_size, self.quantize.bits)
        self.conversions += 1
        return True

    # ---- the batch --------------------------------------------------------------------------------------
    def join(self, request_ids: Sequence[str], points: Sequence[int] | None = None) -> None:
        """Move these requests' caches into the batch, appended as new rows in this order. With a
        QuantizeRule, `points` are the rows' conversion points, and caches still in float storage join the
        pending (float) group."""
        caches = [self._requests.pop(rid) for rid in request_ids]
        self._joining = caches  # held until merged: counted in what the merges' peaks are noted against
        self._order += list(request_ids)
        if self.quantize is None:
            self._extend(list(request_ids), caches)
        else:
            floats = [i for i, c in enumerate(caches) if not self._layers.is_quantized(c)]
            quantized = [i for i in range(len(caches)) if i not in floats]
            if quantized:
                self._extend([request_ids[i] for i in quantized], [caches[i] for i in quantized])
            if floats:
                rids = [request_ids[i] for i in floats]
                for i, rid in zip(floats, rids):
                    self._pending_tokens[rid] = self._layers.cache_offset(caches[i])
                self.pending = self._join_into(self.pending, [caches[i] for i in floats])
                self._pending_rows += rids
            self._points.update(zip(request_ids, points))
        self._joining = []
        self.merges += 1
        self._note_peak()

    def _extend(self, request_ids: list[str], caches: list) -> None:
        self.batch = self._join_into(self.batch, caches)
        self._batch_rows += request_ids

    def _join_into(self, batch: list, caches: list) -> list:
        """`layers.join_rows` (layer by layer, evaluated): one layer is held twice at most. Its peak is noted
        next to everything else held (`KVLayout.join_bytes` bounds it)."""
        a = self._layers
        start = a.cache_nbytes(batch) + sum(a.cache_nbytes(c) for c in caches)
        held = self.nbytes() + sum(a.cache_nbytes(c) for c in getattr(self, "_joining", ()) if c is not None
                                   and all(layer is not None for layer in c))
        new, peak = a.join_rows(batch, caches, self._merge)
        self._note(held + peak - start)
        return new

    def groups(self) -> list[tuple[list[str], list]]:
        """The batch caches a decode runs, each with its rows' request ids in cache row order (one group
        unless some rows are still in float storage under a QuantizeRule)."""
        out = [(self._batch_rows, self.batch)] if self._batch_rows else []
        if self._pending_rows:
            out.append((self._pending_rows, self.pending))
        return out

    def after_decode(self) -> list[str]:
        """Every row got one more token: pending rows that reached their conversion point move to the
        quantized batch (extracted, converted exactly as a single-request cache is, merged). Returns them."""
        if not self._pending_rows:
            return []
        for rid in self._pending_rows:
            self._pending_tokens[rid] += 1
        due = [i for i, rid in enumerate(self._pending_rows) if self._pending_tokens[rid] >= self._points[rid]]
        if not due:
            return []
        moved = [self._pending_rows[i] for i in due]
        caches = [self._layers.quantize_layers(c, self.quantize.group_size, self.quantize.bits)
                  for c in self._layers.take_rows(self.pending, due)]
        self.conversions += len(caches)
        stay = [i for i in range(len(self._pending_rows)) if i not in due]
        self.pending = self._layers.filter_batch(self.pending, stay)
        self._pending_rows = [self._pending_rows[i] for i in stay]
        for rid in moved:
            self._pending_tokens.pop(rid)
        self._extend(moved, caches)
        self._note_peak()
        return moved

    def keep_rows(self, keep: list[int]) -> None:
        """Keep the rows at these positions of the executor's row order (in that order)."""
        kept = [self._order[i] for i in keep]
        self._order = kept
        if self.quantize is None:
            self.batch = self._layers.filter_batch(self.batch, keep)
            self._batch_rows = list(kept)  # its own list: join extends both in place
        else:
            alive = set(kept)
            for rid in set(self._points) - alive:
                self._points.pop(rid)
                self._pending_tokens.pop(rid, None)
            stay = [i for i, rid in enumerate(self._batch_rows) if rid in alive]
            if len(stay) != len(self._batch_rows):
                self.batch = self._layers.filter_batch(self.batch, stay)
                self._batch_rows = [self._batch_rows[i] for i in stay]
            stay = [i for i, rid in enumerate(self._pending_rows) if rid in alive]
            if len(stay) != len(self._pending_rows):
                self.pending = self._layers.filter_batch(self.pending, stay)
                self._pending_rows = [self._pending_rows[i] for i in stay]
        self.filters += 1

    def clear_batch(self) -> None:
        self.batch, self.pending = [], []
        self._batch_rows, self._pending_rows, self._order = [], [], []
        self._pending_tokens, self._points = {}, {}

    # ---- summaries --------------------------------------------------------------------------------------
    def request_ids(self) -> set[str]:
        return set(self._requests)

    def nbytes(self) -> int:
        a = self._layers
        return (a.cache_nbytes(self.batch) + a.cache_nbytes(self.pending)
                + sum(a.cache_nbytes(c) for c in self._requests.values()))

    def _note_peak(self) -> None:
        self._note(self.nbytes())

    def _note(self, held: int) -> None:
        held = max(held, self.nbytes())
        self.peak_bytes = max(self.peak_bytes, held)

    def stats(self) -> dict:
        stats = {"bytes": self.nbytes(), "peak_bytes": self.peak_bytes, "request_caches": len(self._requests),
                 "merges": self.merges, "filters": self.filters}
        if self.quantize is not None:
            stats.update(quantized_rows=len(self._batch_rows), float_rows=len(self._pending_rows),
                         conversions=self.conversions)
        return stats

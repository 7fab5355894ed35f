"""KV memory accounting: the layout of a model's per-token KV cost, and the upper bound the planner keeps
under `EngineConfig.kv_memory_bytes`.

The executor keeps KV in mlx-lm's own caches: one single-request cache per prefilling request, one
left-padded batch cache (`BatchKVCache` / `BatchRotatingKVCache`) for the decoding rows. Their real bytes are
what `MLXExecutor.cache_bytes()` sums from the arrays. The planner never sees those arrays; it sees request
token counts and this layout, and bounds what the arrays can hold after a tick:

* a full-attention layer stores every token; buffers grow in `STEP`-token steps, so a single-request cache of
  n tokens holds at most round_up(n, STEP) and a batch of B rows at most B * (longest row + STEP) (rows are
  right-aligned to the longest one: the padding of short rows is real memory, which is why mixing one long
  row with many short ones is expensive);
* a sliding-window layer keeps at most `window` tokens once decoding, and `window + chunk` while a chunk is
  being added.

The bound is deliberately an upper bound: `real bytes <= bound <= budget` is what the invariant checker
verifies every tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

STEP = 256  # mlx-lm's KVCache / BatchKVCache allocation step


def _round_up(n: int, step: int = STEP) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class LayerLayout:
    bytes_per_token: int  # keys + values of one token in this layer
    window: int | None  # sliding-window size, None for full attention


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerLayout, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    def request_bytes(self, n_tokens: int, chunk: int) -> int:
        """Upper bound of a single-request cache holding `n_tokens` (after a chunk of `chunk` tokens)."""
        total = 0
        for layer in self.layers:
            if layer.window is None:
                total += layer.bytes_per_token * _round_up(n_tokens)
            else:
                total += layer.bytes_per_token * min(_round_up(n_tokens), layer.window + chunk + STEP)
        return total

    def batch_bytes(self, row_tokens: Sequence[int]) -> int:
        """Upper bound of a batch cache whose rows hold `row_tokens` tokens each."""
        if not row_tokens:
            return 0
        rows, longest = len(row_tokens), max(row_tokens)
        total = 0
        for layer in self.layers:
            length = longest + STEP if layer.window is None else min(longest + STEP, layer.window + STEP)
            total += layer.bytes_per_token * rows * length
        return total

    def footprint(self, row_tokens: Sequence[int], prefill_tokens: Sequence[tuple[int, int]]) -> int:
        """Batch rows plus single-request caches given as (tokens, last chunk)."""
        return self.batch_bytes(row_tokens) + sum(self.request_bytes(n, c) for n, c in prefill_tokens)

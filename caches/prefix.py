"""PrefixCache: which token prefixes have reusable KV state, under a byte budget with LRU eviction.

The index is bookkeeping only (token blocks, sizes, recency, stats); the KV tensors are an opaque `payload`
the executor attaches to an entry. That split is what lets replay re-run the cache's decisions with no model:
the same stores, lookups and evictions give the same entry ids and the same plans.

Lookup is a block-hash chain (vLLM-style): an entry of n tokens is indexed under the chained hash of each of
its full `block_size`-token blocks, so a lookup hashes the prompt block by block (O(len / block) dict probes),
takes the deepest block both share, then extends the match token by token against the few candidate entries.
That finds exact matches, entries shorter than the prompt (a prefix of it), entries longer than the prompt
(trimmed to it) and entries that share only a longest common prefix. A token trie (mlx-lm's PromptTrie) finds
the same matches but costs a Python dict per token of every stored prompt; the chain costs one per block.

An entry with rotating (sliding-window) layers can only be reused whole: once a window has wrapped, the
tokens needed to trim it back are gone. Entries are namespaced (e.g. by the content hash of a request's
images) so a prefix with image tokens only matches a request with the same images.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

EventHook = Callable[..., None]  # (kind, **fields)


@dataclass
class PrefixEntry:
    entry_id: int
    tokens: tuple[int, ...]
    namespace: str | None
    nbytes: int
    whole_only: bool  # rotating layers: reusable only as a whole prefix, never trimmed
    payload: Any = None


@dataclass(frozen=True)
class PrefixMatch:
    entry_id: int
    length: int  # prompt tokens whose KV the entry provides
    kind: str  # "exact" | "shorter" | "longer" | "lcp"


def _chain(tokens: Sequence[int], block: int, limit: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (Python int/tuple hashing: stable across runs)."""
    n = len(tokens) // block if limit is None else min(len(tokens) // block, limit)
    out, h = [], 0
    for k in range(n):
        h = hash((h, tuple(tokens[k * block:(k + 1) * block])))
        out.append(h)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = 16, on_event: EventHook | None = None):
        if max_bytes < 0 or block_size < 1:
            raise ValueError("max_bytes must be >= 0 and block_size >= 1")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._on_event = on_event or (lambda kind, **fields: None)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU order: oldest first
        self._index: dict[tuple[str | None, int], dict[int, None]] = {}
        self._by_tokens: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self._next_id = 0
        self.bytes = 0
        self.version = 0  # changes whenever a lookup could answer differently
        self.hits = self.misses = self.evictions = self.tokens_saved = self.stores = 0

    # ---- lookup (pure) --------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], namespace: str | None = None, max_len: int | None = None) -> PrefixMatch | None:
        """The best reusable prefix for `tokens` (at most `max_len` tokens), or None. Changes nothing."""
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        if limit < self.block_size or not self._entries:
            return None
        chain = _chain(tokens, self.block_size)
        depth = 0
        for k, h in enumerate(chain):
            if (namespace, h) not in self._index:
                break
            depth = k + 1
        if depth == 0:
            return None
        best: PrefixMatch | None = None
        for entry_id in self._index[(namespace, chain[depth - 1])]:
            entry = self._entries[entry_id]
            shared = depth * self.block_size
            if tuple(tokens[:shared]) != entry.tokens[:shared]:  # hash collision guard
                continue
            lcp = _common_prefix(tokens, entry.tokens, shared)
            usable = min(lcp, limit)
            if entry.whole_only and usable < len(entry.tokens):
                continue
            if best is None or usable > best.length or (usable == best.length and entry_id > best.entry_id):
                best = PrefixMatch(entry_id, usable, self._kind(len(entry.tokens), lcp, limit))
        return best

    @staticmethod
    def _kind(n_entry: int, lcp: int, limit: int) -> str:
        if lcp >= n_entry:  # the whole entry is a prefix of the prompt
            return "exact" if n_entry == limit else "shorter"
        return "longer" if lcp >= limit else "lcp"

    # ---- decisions (recorded) -------------------------------------------------------------------------
    def record_hit(self, entry_id: int, length: int, request_id: str) -> None:
        entry = self._entries[entry_id]
        self._entries.move_to_end(entry_id)
        self.hits += 1
        self.tokens_saved += length
        self._on_event("prefix_hit", request_id=request_id, entry_id=entry_id, length=length,
                       entry_tokens=len(entry.tokens))

    def record_miss(self, request_id: str) -> None:
        self.misses += 1
        self._on_event("prefix_miss", request_id=request_id)

    def payload(self, entry_id: int) -> Any:
        return self._entries[entry_id].payload

    def store(self, tokens: Sequence[int], nbytes: int, payload: Any = None, namespace: str | None = None,
              whole_only: bool = False, request_id: str | None = None) -> int | None:
        """Index `tokens` with its KV payload; evict least recently used entries to fit. Returns the entry id,
        None when the prefix is too short to index or larger than the whole budget."""
        tokens = tuple(tokens)
        if len(tokens) < self.block_size or nbytes > self.max_bytes:
            return None
        existing = self._by_tokens.get((namespace, tokens))
        if existing is not None:  # same prefix already stored: keep the old tensors, refresh recency
            self._entries.move_to_end(existing)
            return existing
        while self.bytes + nbytes > self.max_bytes:
            self._evict_oldest()
        entry = PrefixEntry(self._next_id, tokens, namespace, nbytes, whole_only, payload)
        self._next_id += 1
        self._entries[entry.entry_id] = entry
        self._by_tokens[(namespace, tokens)] = entry.entry_id
        for h in _chain(tokens, self.block_size):
            self._index.setdefault((namespace, h), {})[entry.entry_id] = None
        self.bytes += nbytes
        self.stores += 1
        self.version += 1
        self._on_event("prefix_store", request_id=request_id, entry_id=entry.entry_id, tokens=len(tokens),
                       nbytes=nbytes)
        return entry.entry_id

    def _evict_oldest(self) -> None:
        entry_id, entry = next(iter(self._entries.items()))
        self._remove(entry)
        self.evictions += 1
        self._on_event("prefix_evict", entry_id=entry_id, tokens=len(entry.tokens), nbytes=entry.nbytes)

    def _remove(self, entry: PrefixEntry) -> None:
        del self._entries[entry.entry_id]
        del self._by_tokens[(entry.namespace, entry.tokens)]
        for h in _chain(entry.tokens, self.block_size):
            bucket = self._index[(entry.namespace, h)]
            del bucket[entry.entry_id]
            if not bucket:
                del self._index[(entry.namespace, h)]
        self.bytes -= entry.nbytes
        self.version += 1

    def clear(self) -> None:
        """Drop every entry (a decision: recorded as `prefix_clear`, with how many entries and bytes went)."""
        entries, nbytes = len(self._entries), self.bytes
        for entry in list(self._entries.values()):
            self._remove(entry)
        self._on_event("prefix_clear", entries=entries, nbytes=nbytes)

    # ---- summaries ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, Any]:
        """The reference's keys (vllm-mlx prefix cache stats), values from this cache's own counters."""
        lookups = self.hits + self.misses
        mb = 1024 * 1024
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "evictions": self.evictions,
            "tokens_saved": self.tokens_saved,
            "current_memory_mb": self.bytes / mb,
            "max_memory_mb": self.max_bytes / mb,
            "memory_utilization": self.bytes / self.max_bytes if self.max_bytes else 0.0,
            "entry_count": len(self._entries),
        }

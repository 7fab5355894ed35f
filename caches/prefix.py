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

An entry with layers that cannot be trimmed (a rotating window: once it has wrapped, the tokens needed to
trim it back are gone; recurrent state: it has no notion of a shorter prefix) can only be reused whole, as an
exact checkpoint. The executor stores such caches at the block boundaries their prefill passes, so a prompt
that shares only some blocks with a stored one still finds the deepest checkpoint it shares; a hit says how
it used its entry (`reuse`: whole, trimmed or checkpoint).

Keys are sequences of hashable items compared by equality, not only token ids: the scheduler keys a request
with media by its token ids up to its first media token and (content key of the media so far, token id) pairs
from there (`Request.prefix_key`), so a prefix through an image only matches a request with the same media up
to there, and the text before the first image matches any request that has it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

EventHook = Callable[..., None]  # (kind, **fields)


@dataclass
class PrefixEntry:
    entry_id: int
    tokens: tuple  # the key (Request.prefix_key) of the prefix whose state the payload holds
    nbytes: int
    # a cache that cannot be trimmed (a rotating window, recurrent state): the entry is an exact checkpoint of
    # its tokens, reusable only whole, never cut to a shorter prefix
    whole_only: bool
    payload: Any = None


@dataclass(frozen=True)
class PrefixMatch:
    entry_id: int
    length: int  # prompt tokens whose KV the entry provides
    kind: str  # "exact" | "shorter" | "longer" | "lcp"
    reuse: str = "whole"  # how the entry is used: one of REUSE_KINDS


# How a hit uses its entry (the `reuse` field of a prefix_hit event, which replay compares): a trimmable (KV)
# entry used in full ("whole") or cut to a shorter prefix ("trimmed"); an entry that cannot be trimmed used as
# the exact checkpoint it is ("checkpoint": recurrent state or a rotating window stored at a boundary the
# prefill passed).
REUSE_KINDS = ("whole", "trimmed", "checkpoint")


def reuse_kind(whole_only: bool, length: int, entry_tokens: int) -> str:
    if whole_only:
        if length != entry_tokens:
            raise ValueError(f"a checkpoint of {entry_tokens} tokens cannot provide {length}")
        return "checkpoint"
    return "whole" if length == entry_tokens else "trimmed"


def checkpoint_position(start: int, end: int, prefill_len: int, block: int,
                        media_offset: int | None = None) -> int | None:
    """Where a prefill feeding tokens [start, end) stores a checkpoint of a cache that cannot be trimmed (at most
    one per chunk), never the prefill end (`prefill_len - 1` tokens: that one is stored whole when the prefill
    completes): the last block boundary at or before the request's first media token when the feed passes it
    (the state every request with that text before its media, or with none, can restore), else the last block
    boundary in the feed."""
    if media_offset is not None:
        at = media_offset // block * block
        if start < at <= end and at < prefill_len - 1:
            return at
    at = end // block * block
    return at if start < at < prefill_len - 1 else None


def _chain(tokens: Sequence, block: int, limit: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `tokens`. In-process only: str hashing (the media keys in a key) is
    salted per process, and no decision depends on a hash value (buckets keep insertion order)."""
    n = len(tokens) // block if limit is None else min(len(tokens) // block, limit)
    out, h = [], 0
    for k in range(n):
        h = hash((h, tuple(tokens[k * block:(k + 1) * block])))
        out.append(h)
    return out


def _common_prefix(a: Sequence, b: Sequence, start: int) -> int:
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
        self._index: dict[int, dict[int, None]] = {}  # block-chain hash -> entries holding that block
        self._by_tokens: dict[tuple, int] = {}
        self._next_id = 0
        self.bytes = 0
        self.version = 0  # changes whenever a lookup could answer differently
        self.hits = self.misses = self.evictions = self.tokens_saved = self.stores = 0

    # ---- lookup (pure) --------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence, max_len: int | None = None) -> PrefixMatch | None:
        """The best reusable prefix for `tokens` (at most `max_len` tokens), or None. Changes nothing."""
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        if limit < self.block_size or not self._entries:
            return None
        chain = _chain(tokens, self.block_size)
        depth = 0
        for k, h in enumerate(chain):
            if h not in self._index:
                break
            depth = k + 1
        # The deepest shared block first. A checkpoint (whole-only entry) that does not fit there may have a
        # shorter one further up the chain: the prefill stored one at each block boundary it passed. The first
        # depth with a usable entry holds the best one: every usable entry found at depth d provides at least
        # min(d blocks, limit) tokens, and an entry indexed only above d shares fewer than d blocks.
        for d in range(depth, 0, -1):
            best = self._best_at(tokens, chain[d - 1], d * self.block_size, limit)
            if best is not None:
                return best
        return None

    def _best_at(self, tokens: Sequence, block_hash: int, shared: int, limit: int) -> PrefixMatch | None:
        best: PrefixMatch | None = None
        for entry_id in self._index[block_hash]:
            entry = self._entries[entry_id]
            if tuple(tokens[:shared]) != entry.tokens[:shared]:  # hash collision guard
                continue
            lcp = _common_prefix(tokens, entry.tokens, shared)
            usable = min(lcp, limit)
            if entry.whole_only and usable < len(entry.tokens):
                continue
            if best is None or usable > best.length or (usable == best.length and entry_id > best.entry_id):
                best = PrefixMatch(entry_id, usable, self._kind(len(entry.tokens), lcp, limit),
                                   reuse_kind(entry.whole_only, usable, len(entry.tokens)))
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
                       entry_tokens=len(entry.tokens), reuse=reuse_kind(entry.whole_only, length, len(entry.tokens)))

    def record_miss(self, request_id: str) -> None:
        self.misses += 1
        self._on_event("prefix_miss", request_id=request_id)

    def payload(self, entry_id: int) -> Any:
        return self._entries[entry_id].payload

    def store(self, tokens: Sequence, nbytes: int, payload: Any = None, whole_only: bool = False,
              request_id: str | None = None) -> int | None:
        """Index `tokens` with its KV payload; evict least recently used entries to fit. Returns the entry id,
        None when the prefix is too short to index or larger than the whole budget."""
        tokens = tuple(tokens)
        if len(tokens) < self.block_size or nbytes > self.max_bytes:
            return None
        existing = self._by_tokens.get(tokens)
        if existing is not None:  # same prefix already stored: keep the old tensors, refresh recency
            self._entries.move_to_end(existing)
            return existing
        while self.bytes + nbytes > self.max_bytes:
            self._evict_oldest()
        entry = PrefixEntry(self._next_id, tokens, nbytes, whole_only, payload)
        self._next_id += 1
        self._entries[entry.entry_id] = entry
        self._by_tokens[tokens] = entry.entry_id
        for h in _chain(tokens, self.block_size):
            self._index.setdefault(h, {})[entry.entry_id] = None
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
        del self._by_tokens[entry.tokens]
        for h in _chain(entry.tokens, self.block_size):
            bucket = self._index[h]
            del bucket[entry.entry_id]
            if not bucket:
                del self._index[h]
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

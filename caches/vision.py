"""VisionCache: encoder outputs keyed by image *content*, LRU under a byte budget.

What is stored: the vision tower's output for one image or video (the families whose media the model layer
splits per item, ``FamilySpec.item_split``: for Qwen2-VL the merged patch features, shape
``(num_image_tokens, hidden)``), or for one request's ordered media list (the others: gemma3, the audio
families), not the request's full input embeddings. The features depend only on
the pixels, the image grid and the model; the embeddings and M-RoPE positions also depend on the prompt text, so
caching features lets the same image be reused under any prompt (and, per item, in any request that has it)
while still skipping the expensive part (the vision tower) entirely. Re-merging features into the text embeddings and recomputing positions is
cheap and done per request by the adapter (``scheduler/models/adapter.py``).

Keys are built by the adapter from the preprocessed pixel values (the exact encoder input: after decode, EXIF
rotation, resize and normalisation), the image grid and a model/processor fingerprint; never from file names. Two
files with the same pixels share an entry; two different images never do (a SHA-256 digest, 128 bits of it). Use
``content_key`` to build one.

Values are ``mx.array``. MLX arrays are immutable values, but ``a[i] = x`` on a Python ``mx.array`` object
rebinds that object's contents, which would corrupt an entry if the caller held the stored object itself. So
``get`` returns a fresh array object each time (no data copy): callers may do anything with it and the entry
stays as stored.

Thread safety: every method takes one lock; ``on_event`` is called after the lock is released.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import mlx.core as mx
import numpy as np

EventCallback = Callable[[str, str, dict], None]

# numpy dtype strings -> mlx dtype names, so an np.ndarray and the mx.array of the same values hash alike
_NP_TO_MX = {np.dtype(t).str: n for t, n in [
    (np.bool_, "mlx.core.bool"), (np.uint8, "mlx.core.uint8"), (np.uint16, "mlx.core.uint16"),
    (np.uint32, "mlx.core.uint32"), (np.uint64, "mlx.core.uint64"), (np.int8, "mlx.core.int8"),
    (np.int16, "mlx.core.int16"), (np.int32, "mlx.core.int32"), (np.int64, "mlx.core.int64"),
    (np.float16, "mlx.core.float16"), (np.float32, "mlx.core.float32"), (np.float64, "mlx.core.float64"),
    (np.complex64, "mlx.core.complex64")]}


def content_key(parts: Iterable[Any], digest_size: int = 16) -> str:
    """A hex SHA-256 digest of ``parts`` in order, cut to ``digest_size`` bytes. SHA-256 rather than BLAKE2b
    because x86-64 and ARM CPUs run it in hardware (1.8 GB/s against 0.9 on the x86 VM of bench/README.md),
    and the pixel values of every image request pass through it (``python -m bench.vision_peer``: 4 of its
    120 ms were BLAKE2b).

    Each part is an ``mx.array`` / ``np.ndarray`` (hashed with its dtype and shape, so equal bytes of different
    shapes differ), ``bytes`` or anything else (hashed as ``repr``). Parts are length-framed, so no two different
    part lists give the same byte stream.
    """
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, mx.array):
            head = f"mx:{part.dtype}:{tuple(part.shape)}".encode()
            if part.dtype == mx.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
                part = part.view(mx.uint16)
            data = np.ascontiguousarray(np.asarray(part)).reshape(-1).view(np.uint8)  # no copy when contiguous
        elif isinstance(part, np.ndarray):
            arr = np.ascontiguousarray(part)
            head = f"mx:{_NP_TO_MX.get(arr.dtype.str, arr.dtype.str)}:{arr.shape}".encode()
            data = arr.reshape(-1).view(np.uint8)
        elif isinstance(part, (bytes, bytearray, memoryview)):
            head, data = b"b", bytes(part)
        else:
            head, data = b"r", repr(part).encode()
        h.update(len(head).to_bytes(8, "little") + head)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[: 2 * digest_size]


def _nbytes(value: Any) -> int:
    if isinstance(value, mx.array):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    raise TypeError(f"VisionCache stores mx.array or a list/tuple of them, got {type(value).__name__}")


def _fresh(value: Any) -> Any:
    """A new Python wrapper around the same (immutable) data, so item assignment by a caller cannot reach the
    stored object."""
    if isinstance(value, mx.array):
        return mx.array(value)
    return type(value)(_fresh(v) for v in value)


@dataclass
class _Entry:
    value: Any
    nbytes: int
    encode_time_s: float


class VisionCache:
    """LRU cache of vision-encoder outputs under ``max_bytes``.

    ``get(key)`` counts a hit or a miss and returns the features or ``None``; ``put(key, features,
    encode_time_s)`` stores them (evicting least-recently-used entries until the budget holds); an entry larger
    than the whole budget is not stored (``rejected``). ``encoder_time_saved_s`` adds up, per hit, the encoder time
    measured when that entry was stored.

    ``on_event(kind, key, info)`` is called with kind ``"hit"``, ``"miss"``, ``"store"`` or ``"evict"``; info
    holds ``bytes`` and, per kind, ``encode_time_s`` (hit, store), ``reason`` (evict: ``"lru"``, ``"too_large"``,
    or ``"removed"`` / ``"cleared"`` from ``remove`` / ``clear``), ``entries`` and ``total_bytes`` after the
    change. So the stores and evictions tell which keys the cache holds at any point (replay follows them). A
    callback that raises is reported with a warning and does not affect the cache.
    """

    def __init__(self, max_bytes: int, on_event: EventCallback | None = None):
        if int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.on_event = on_event
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()
        self._hits = 0
        self._misses = 0
        self._stores = 0
        self._evictions = 0
        self._rejected = 0
        self._saved_s = 0.0

    # ---- lookups ----------------------------------------------------------------------------------
    def get(self, key: str) -> Any | None:
        """The cached features for ``key`` (a fresh array object) or ``None``; counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                event = ("miss", key, {"entries": len(self._entries), "total_bytes": self._bytes})
                value = None
            else:
                self._entries.move_to_end(key)
                self._hits += 1
                self._saved_s += entry.encode_time_s
                event = ("hit", key, {"bytes": entry.nbytes, "encode_time_s": entry.encode_time_s})
                value = _fresh(entry.value)
        self._emit([event])
        return value

    def __contains__(self, key: str) -> bool:
        """Membership without touching stats or LRU order."""
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    # ---- updates ----------------------------------------------------------------------------------
    def put(self, key: str, features: Any, encode_time_s: float = 0.0) -> bool:
        """Store ``features`` (``mx.array`` or a list/tuple of them) under ``key``. Returns whether it is stored.

        The arrays are evaluated first so the cache never holds (or later triggers) pending encoder work.
        Storing an existing key replaces its entry.
        """
        size = _nbytes(features)
        mx.eval(features)
        events: list[tuple[str, str, dict]] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if size > self.max_bytes:
                self._rejected += 1
                events.append(("evict", key, {"bytes": size, "reason": "too_large",
                                              "entries": len(self._entries), "total_bytes": self._bytes}))
                stored = False
            else:
                while self._entries and self._bytes + size > self.max_bytes:
                    old_key, old_entry = self._entries.popitem(last=False)
                    self._bytes -= old_entry.nbytes
                    self._evictions += 1
                    events.append(("evict", old_key, {"bytes": old_entry.nbytes, "reason": "lru",
                                                      "entries": len(self._entries), "total_bytes": self._bytes}))
                self._entries[key] = _Entry(_fresh(features), size, float(encode_time_s))
                self._bytes += size
                self._stores += 1
                events.append(("store", key, {"bytes": size, "encode_time_s": float(encode_time_s),
                                              "entries": len(self._entries), "total_bytes": self._bytes}))
                stored = True
        self._emit(events)
        return stored

    def get_or_encode(self, key: str, encode: Callable[[], Any]) -> tuple[Any, bool]:
        """``(features, hit)``: the cached features, or ``encode()`` timed, stored and returned."""
        import time

        value = self.get(key)
        if value is not None:
            return value, True
        t0 = time.perf_counter()
        value = encode()
        mx.eval(value)
        self.put(key, value, time.perf_counter() - t0)
        return value, False

    def remove(self, key: str) -> bool:
        """Drop one entry (an ``"evict"`` event with reason ``"removed"``, not counted as an eviction). Returns
        whether it was there."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._bytes -= entry.nbytes
            event = ("evict", key, {"bytes": entry.nbytes, "reason": "removed", "entries": len(self._entries),
                                    "total_bytes": self._bytes})
        self._emit([event])
        return True

    def clear(self) -> None:
        """Drop every entry (an ``"evict"`` event each, reason ``"cleared"``, not counted as evictions: whoever
        follows the cache's contents from its events, as replay does, sees them go). Counters are kept; see
        ``reset_stats``."""
        with self._lock:
            events = [("evict", key, {"bytes": entry.nbytes, "reason": "cleared", "entries": 0, "total_bytes": 0})
                      for key, entry in self._entries.items()]
            self._entries.clear()
            self._bytes = 0
        self._emit(events)

    def reset_stats(self) -> None:
        with self._lock:
            self._hits = self._misses = self._stores = self._evictions = self._rejected = 0
            self._saved_s = 0.0

    # ---- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            lookups = self._hits + self._misses
            return {
                "hits": self._hits,
                "misses": self._misses,
                "hit_rate": self._hits / lookups if lookups else 0.0,
                "stores": self._stores,
                "evictions": self._evictions,
                "rejected": self._rejected,
                "entries": len(self._entries),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "encoder_time_saved_s": self._saved_s,
            }

    def _emit(self, events: list[tuple[str, str, dict]]) -> None:
        callback = self.on_event
        if callback is None:
            return
        for kind, key, info in events:
            try:
                callback(kind, key, info)
            except Exception as exc:  # logging must never break caching
                warnings.warn(f"VisionCache on_event callback failed on {kind!r}: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=3)

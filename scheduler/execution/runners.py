"""Model runners: how the executor calls a model family. The executor owns scheduling-side state (which
request is in which row, sampling); a runner owns how a chunk is prefilled and how a batch is decoded.

`TextRunner` runs an mlx-lm model. `VisionLanguageRunner` runs an mlx-vlm model through the generic adapter
(`scheduler/models/adapter.py`): every request, text-only included, is prefilled from input embeddings with its
family's positions, and every decode row gets its own position (tokens in its cache + its rope delta), so no
position state is ever kept on the model instance.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from caches import layers
from scheduler.execution import library
from scheduler.request import Request


class Runner(Protocol):
    has_vision: bool

    def make_cache(self) -> library.Cache: ...

    def encode(self, request: Request) -> Any: ...

    def encode_many(self, requests: list[Request], on_call: Any = None) -> list[Any]:
        """``encode`` of each request (its result or the exception that failed it), batched where the model
        allows; ``on_call(VisionCall)`` per encoder call."""

    def prefill(self, cache: library.Cache, request: Request, encoded: Any, start: int, end: int) -> mx.array:
        """Feed prefill positions [start, end) into `cache` (evaluated). Returns the chunk's (1, end - start, V)
        logits unevaluated: nothing computes the vocabulary projection unless a caller reads them."""

    # Runners whose `prefill_sharing` (`caches.layers.PrefillSharing`) is not NONE also have
    # `prefill_many([(request, encoded, cache, start, n), ...])` (one cache per chunk back, and the forward's
    # (B, width, V) logits unevaluated: row i's first n are its chunk's).

    def shares_prefill(self, encoded: Any, start: int, n: int) -> bool:
        """Whether prefill positions [start, start + n) may share a forward with other requests' chunks (within
        `prefill_sharing`); False for a chunk the model must see alone."""

    def decode(self, batch_cache: library.Cache, inputs: mx.array, rope_deltas: mx.array | None) -> mx.array: ...

    def verify(self, batch_cache: library.Cache, inputs: mx.array, rope_deltas: mx.array | None = None) -> mx.array:
        """(B, n) inputs -> (B, n, V) logits (draft verification); rope_deltas: each row's position offset."""


class TextRunner:
    has_vision = False

    def __init__(self, model: Any, max_kv_size: int | None = None):
        self.model = model
        self.max_kv_size = max_kv_size
        self.family = library.model_family(model)  # raises UnsupportedModel for a family that cannot batch
        self.capabilities = layers.capabilities(self.make_cache())
        # Prefill chunks share one forward where the rows of a batch cache split back into each request's own:
        # any mix for plain and quantized KV (the right pads are cut off), and for rotating windows and recurrent
        # state where the family's forward keeps the pads out of them (`Family.honors_lengths`); otherwise, for
        # those, only chunks at one position of one length (no pads at all).
        self.prefill_sharing = self.capabilities.prefill_sharing(self.family.honors_lengths)
        # A cache that cannot be trimmed (recurrent state, a rotating window) goes into the prefix cache as exact
        # checkpoints, stored at the block boundaries its prefill passes.
        self.prefix_checkpoints = not self.capabilities.trimmable

    def make_cache(self) -> library.Cache:
        return library.make_request_cache(self.model, self.max_kv_size)

    def merge(self, caches):
        """Single-request caches -> the batch cache, with the mask layout this family's attention needs."""
        return layers.merge_caches(caches, self.family.mask)

    def encode(self, request: Request) -> None:
        return None  # token ids are the model's input

    def encode_many(self, requests: list[Request], on_call: Any = None) -> list[None]:
        return [None for _ in requests]  # no encoders

    def shares_prefill(self, encoded, start, n):
        return True  # any chunk, within prefill_sharing

    def prefill(self, cache, request, encoded, start, end):
        logits = self.model(mx.array(request.prefill_tokens(start, end))[None], cache=cache)
        mx.eval(library.cache_arrays(cache))
        return logits

    def prefill_many(self, chunks):
        """Several requests' chunks in one forward; one cache per request back.

        `chunks`: (request, encoded, cache, start, n) each: feed prefill tokens [start, start + n) after what
        `cache` holds (None: a fresh request). The caches are merged left-padded (mlx-lm's BatchKVCache: each
        row keeps its own RoPE offset and the mask hides the padding), and chunks shorter than the widest are
        padded on the right: causal attention keeps every real position from seeing a pad, and the pads are cut
        from the caches after; windows and recurrent state are told each row's length (`prepare_padded`) and
        skip them. So each row computes what its own forward would. Returns (caches, the forward's (B, width, V)
        logits unevaluated: row i's first n positions are its chunk's)."""
        width = max(n for *_, n in chunks)
        batch = self.merge([cache if cache is not None else self.make_cache() for _, _, cache, _, _ in chunks])
        tokens = [request.prefill_tokens(start, start + n) + [0] * (width - n)
                  for request, _, _, start, n in chunks]
        library.prepare_padded(batch, [n for *_, n in chunks], width)
        logits = self.model(mx.array(tokens), cache=batch)
        library.finalize_padded(batch)
        mx.eval(library.cache_arrays(batch))
        return library.split_batch(batch, len(chunks), [width - n for *_, n in chunks]), logits

    def decode(self, batch_cache, inputs, rope_deltas):
        return self.model(inputs[:, None], cache=batch_cache)[:, -1, :]

    def verify(self, batch_cache, inputs, rope_deltas=None):
        """(B, n) inputs -> (B, n, V) logits: one forward over each row's last token and its drafts."""
        return self.model(inputs, cache=batch_cache)

    def forward_with_hidden(self, batch_cache, inputs, native: bool = False):
        """(B, n) inputs -> ((B, n, V) logits, (B, n, H) hidden states), for hidden-state drafters: the final
        normed hidden states of the seam, or (`native`) those of the model's own `return_hidden=True` call."""
        if native:
            return library.forward_with_native_hidden(self.model, inputs, batch_cache)
        return library.forward_with_hidden(self.model, inputs, batch_cache)


class VisionLanguageRunner:
    has_vision = True

    def __init__(self, adapter: Any):
        self.adapter = adapter
        self.capabilities = adapter.capabilities
        self.family = adapter.spec  # model_type, for typed refusals
        # as for text: caches that cannot be trimmed (gemma3's windows, qwen3_5's recurrent state) go into the
        # prefix cache as exact checkpoints
        self.prefix_checkpoints = not self.capabilities.trimmable

    def make_cache(self) -> library.Cache:
        return self.adapter.make_cache()

    def encode(self, request: Request) -> Any:
        """Encoders (or a vision-cache hit) + embedding merge + positions of the prefill sequence: the prompt,
        and after a preemption the outputs so far. The request's media tensors are kept until it ends: a
        preempted request whose features left the vision cache is encoded again from them."""
        return self.adapter.encode(request.media, request.output_tokens[: request.recompute_tokens])

    def encode_many(self, requests: list[Request], on_call: Any = None) -> list[Any]:
        """The tick's encode work in as few encoder calls as the family allows (``FamilySpec.vision_batch``)."""
        return self.adapter.encode_many([(r.media, r.output_tokens[: r.recompute_tokens]) for r in requests],
                                        on_call)

    @property
    def prefill_sharing(self) -> layers.PrefillSharing:
        return self.adapter.prefill_sharing

    def prefill(self, cache, request, encoded, start, end):
        return self.adapter.prefill(cache, encoded, start, end)

    def shares_prefill(self, encoded, start, n):
        return self.adapter.shares_prefill(encoded, start, n)

    def prefill_many(self, chunks):
        """`TextRunner.prefill_many` from each request's encoded embeddings and positions (the adapter's)."""
        return self.adapter.prefill_many([(cache, encoded, start, n) for _, encoded, cache, start, n in chunks])

    def decode(self, batch_cache, inputs, rope_deltas):
        return self.adapter.decode(batch_cache, inputs, rope_deltas)

    def verify(self, batch_cache, inputs, rope_deltas=None):
        return self.adapter.verify(batch_cache, inputs, rope_deltas)

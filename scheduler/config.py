"""Engine configuration: the per-tick budgets the planner obeys, and engine-wide switches."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

KV_BITS = (4, 8)  # quantized KV cache bits (kv_bits)
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports
CHECK_INVARIANTS_ENV = "MLXSCHED_CHECK_INVARIANTS"  # "1": check_invariants defaults to on (the test suite sets it)


@dataclass(frozen=True)
class EngineConfig:
    """Budgets are per tick unless said otherwise.

    max_batched_tokens: prefill-chunk tokens + decode tokens (+ draft tokens) computed in one tick.
    max_seqs: requests admitted at once (prefilling + decoding).
    prefill_chunk: the longest prefill chunk one request gets in one tick; a first chunk that must reach further
        in one forward (`Request.first_chunk_reach`: a Gemma 4 prompt's images) is as long as it must be.
    max_prefill_tokens: prefill tokens of all requests together in one tick (None: whatever
        max_batched_tokens leaves after decoding). Drafts are not capped by it: they use what prefill left of
        max_batched_tokens.
    max_model_len: the context limit: prompt + outputs never exceed it (generation ends with LENGTH there,
        drafts stay inside it; a prompt with no room for one output is refused). None means the model's
        `max_position_embeddings`. max_kv_size does not lift it.
    seed: engine seed; a request without its own seed samples with one derived from this and its id.
    draft_tokens: with k > 0, decoding rows may propose up to k draft tokens per tick, verified in the same
        batched forward (exact: greedy output is unchanged; a sampled row draws the tokens it draws without
        drafting, except from a sampling draft model, whose drafts keep the distribution only). Draft tokens
        count against max_batched_tokens, after prefill.
    drafter: "prompt-lookup" (n-gram match in the request's history, or the batch's: prompt_lookup_scope; no
        model), "draft-model" (a smaller model with the same vocabulary) or "mtp" (a multi-token-prediction
        head on the target's hidden states).
    prompt_lookup_scope: whose histories prompt lookup matches in. "batch": the request's own, and where another
        live request's holds a longer match (a template, schema or code the batch shares), that one. "recent":
        "batch", and the histories of the requests that finished last, up to prompt_lookup_pool_tokens tokens
        (requests one after another that share a template). "request": its own only, so one request's context
        never shapes another's drafts. The output is the same in every scope; what differs is how many drafts
        are accepted, hence speed, which is also all one request's context can reveal to another.
    prompt_lookup_pool_tokens: with "recent": how many tokens of finished requests' histories stay indexed.
    adaptive_drafting: each row's draft length follows its recent acceptance and a row whose drafts keep
        being rejected pauses until its context changes (prompt lookup, draft model; see
        `scheduler/execution/drafters.py`). False: every drafting row proposes up to draft_tokens each tick.
    draft_gate: with adaptive drafting, each tick's verify width is chosen for the whole batch: the drafts are
        cut to the width whose expected tokens (from each row's recent acceptance) per unit of tick time (a
        fixed cost model, `scheduler/execution/draft_gate.py`) is highest, or declined when a plain step
        pays more. False: every proposed draft is verified at full length.
    draft_cost: the gate's cost model as (verify, width, rows, shift) (`VerifyCost`), for a machine and model
        other than the ones its defaults were measured on (`python -m bench.verify_tick` prints a fit); None:
        the defaults.
    vision_budget: media items whose encoding runs in one tick (so much media cannot stall decoding): an image
        is one item, a video one per temporal patch of its selected frames (Qwen2-VL: 2 frames), an audio clip
        one. A request with more items than the whole budget is encoded alone in a tick.
    vision_token_budget: media tokens (the prompt positions the encoders fill) encoded per tick, next to
        vision_budget: encoder work grows with an image's size, which an item count does not see (a 56x56
        image is 4 tokens of Qwen2-VL, a 896x896 one 1024). A tick takes a request's media while both budgets
        hold; a request over either alone is encoded alone in a tick. None: items only. Both count encoder
        work only: media the vision cache holds, or that another request of the tick brings too, is free.
    video_fps: frames sampled per second of video, by timestamp (scheduler/models/media.py).
    video_max_frames: at most this many frames per video, spread evenly over the clip when fps would give more.
    vision_cache_bytes: byte budget of the vision-encoder output cache (VLMs; 0 turns it off).
    max_images_per_request: at most this many images in one request (more is refused with InvalidRequest).
    max_videos_per_request, max_audio_per_request: the same for videos (each up to video_max_frames frames) and
        audio clips: every kind of media a client sends is bounded per request.
    remote_media: fetch media given as http(s) URLs (scheduler/models/fetch.py), in `add_request` on the
        caller's thread (AsyncEngine and the server fetch on a thread pool of their own, under the same settings). False
        refuses them (UnreadableMedia). Each fetch is bounded by `media_fetch_timeout_s` (host name lookup,
        connection and each wait for data; a body still arriving after about twice that is cut off),
        `media_fetch_max_bytes`, and `allowed_media_domains` (host names, exact; None: any host), which holds on
        every redirect hop too.
    max_kv_size: keep only the last `max_kv_size` tokens of each request's context (rotating caches, no
        attention sinks), for models without their own cache layout; positions stay true (RoPE uses the real
        offset). None keeps everything.
    kv_memory_bytes: hard budget on the bytes of the KV caches of running requests (prefix-cache entries have
        their own budget). The planner admits only what fits and preempts when decoding outgrows it.
    kv_headroom_tokens: tokens of growth per row an admission must leave room for (prevents thrash).
    kv_bits: quantized KV cache (mlx-lm's `kv_bits`): 4 or 8 bits per value, or None (off). A request's
        plain KV layers switch to quantized storage once its context passes `quantized_kv_start`, at exactly
        the point mlx-lm's generate_step would switch that request alone (caches/kv.py QuantizeRule), so
        batched greedy output equals mlx-lm's with the same three settings; the KV budget counts the
        quantized bytes. Recurrent layers stay as they are (as in mlx-lm); sliding-window layers and
        max_kv_size are refused (mlx-lm 0.32 and mlx-vlm 0.7 cannot quantize a rotating cache), and so is
        drafting. Vision-language models follow mlx-vlm's generate_step (its uniform scheme, the same rule).
        The default start is 0; mlx-lm's and mlx-vlm's own default is 5000.
    kv_group_size: values per quantization group along head_dim (32, 64 or 128; must divide head_dim).
    quantized_kv_start: context length (tokens in the cache) from which a request's KV is quantized.
    prefix_cache_bytes: byte budget of the prefix cache (LRU); 0 turns it off.
    prefix_block_size: tokens per hashed block of the prefix index (the shortest reusable prefix).
    processor_history: the tokens a logits processor and the repetition / presence penalties see: "prompt+output"
        (mlx-lm's semantics: every token so far) or "output" (vllm-mlx's: generated tokens only, an empty array
        for the first token; the compat surface's setting).
    logprob_vectors: give every output token's full log-softmax vector in StepOutput.logprob_vectors
        (what vllm-mlx's MLLMBatchResponse.logprobs carries); off by default: it keeps a (V,) array per row.
    mix: "decode-first" (every running row decodes every tick; prefill gets what is left: steady streams,
        longer time to first token under load) or "prefill-first" (ticks with prefill work run prefill only and
        running rows pause: shortest time to first token, decode stalls while prompts arrive).
    trace_path: write every event as JSON lines to this file.
    shard_stall_timeout_s: with a model sharded across processes, a rank whose forward has run this long is
        taken to have lost a peer: MLX's ring backend can leave a forward blocked for good when a peer dies in
        the middle of it, so the rank reports `ShardLost` (stderr, the engine's `on_shard_lost` hooks) and
        its process exits with code 75 (scheduler/execution/stall_watchdog.py). None: no bound (such a rank
        hangs). Set it well above the longest forward a tick's budget allows.
    check_invariants: verify bookkeeping after every tick, raising InvariantViolation: the plan's budgets,
        computed token positions <= planned, real KV bytes <= the plan's bound <= kv_memory_bytes, no cache of an
        ended request. Defaults to on when the environment has MLXSCHED_CHECK_INVARIANTS=1 (tests/conftest.py
        sets it, so every engine a test builds checks them).
    """

    max_batched_tokens: int = 2048
    max_seqs: int = 32
    prefill_chunk: int = 512
    max_prefill_tokens: int | None = None  # cap on prefill tokens per tick (None: what decode leaves)
    max_model_len: int | None = None
    penalty_context: int = 20
    processor_history: str = "prompt+output"  # or "output" (vllm-mlx)
    seed: int = 0
    policy: str = "fcfs"
    mix: str = "decode-first"  # or "prefill-first"
    draft_tokens: int = 0  # speculative decoding: draft tokens per row per tick (0 = off)
    drafter: str = "prompt-lookup"  # or "draft-model" (Engine(draft_model=...)) or "mtp" (Engine(mtp_head=...))
    prompt_lookup_scope: str = "batch"  # or "recent", "request"
    prompt_lookup_pool_tokens: int = 32768
    adaptive_drafting: bool = True
    draft_gate: bool = True
    draft_cost: tuple[float, float, float, float] | None = None
    vision_budget: int = 16  # media items encoded per tick
    vision_token_budget: int | None = 1024  # media tokens encoded per tick (None: no token bound)
    video_fps: float = 2.0
    video_max_frames: int = 32
    vision_cache_bytes: int = 256 << 20
    max_images_per_request: int = 16
    max_videos_per_request: int = 4
    max_audio_per_request: int = 8
    remote_media: bool = True
    media_fetch_timeout_s: float = 10.0
    media_fetch_max_bytes: int = 64 << 20
    allowed_media_domains: tuple[str, ...] | None = None
    max_kv_size: int | None = None  # bounded context: rotating caches of this many tokens
    kv_memory_bytes: int | None = None  # hard budget for KV caches; None = unbounded
    kv_headroom_tokens: int = 32
    kv_bits: int | None = None  # quantized KV cache: 4 or 8 bits, None = off
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    prefix_cache_bytes: int = 0  # 0 disables the prefix cache
    prefix_block_size: int = 16
    logprob_vectors: bool = False
    trace_path: str | None = None
    shard_stall_timeout_s: float | None = 60.0
    check_invariants: bool = field(default_factory=lambda: os.environ.get(CHECK_INVARIANTS_ENV) == "1")

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "max_seqs", "prefill_chunk", "penalty_context", "vision_budget",
                     "max_images_per_request", "max_videos_per_request", "max_audio_per_request"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.vision_token_budget is not None and (not isinstance(self.vision_token_budget, int) or isinstance(
                self.vision_token_budget, bool) or self.vision_token_budget < 1):
            raise ValueError(f"vision_token_budget: must be None or an integer >= 1, got {self.vision_token_budget!r}")
        if (isinstance(self.video_fps, bool) or not isinstance(self.video_fps, (int, float))
                or not math.isfinite(self.video_fps) or self.video_fps <= 0):
            raise ValueError(f"video_fps: must be a finite number > 0, got {self.video_fps!r}")
        if (not isinstance(self.video_max_frames, int) or isinstance(self.video_max_frames, bool)
                or self.video_max_frames < 1):
            raise ValueError(f"video_max_frames: must be an integer >= 1, got {self.video_max_frames!r}")
        if not isinstance(self.remote_media, bool):
            raise ValueError(f"remote_media: must be True or False, got {self.remote_media!r}")
        if (isinstance(self.media_fetch_timeout_s, bool) or not isinstance(self.media_fetch_timeout_s, (int, float))
                or not math.isfinite(self.media_fetch_timeout_s) or self.media_fetch_timeout_s <= 0):
            raise ValueError(f"media_fetch_timeout_s: must be a finite number > 0, got {self.media_fetch_timeout_s!r}")
        if (not isinstance(self.media_fetch_max_bytes, int) or isinstance(self.media_fetch_max_bytes, bool)
                or self.media_fetch_max_bytes < 1):
            raise ValueError(f"media_fetch_max_bytes: must be an integer >= 1, got {self.media_fetch_max_bytes!r}")
        if self.allowed_media_domains is not None:
            domains = self.allowed_media_domains
            if not isinstance(domains, (list, tuple)) or not all(isinstance(d, str) and d and "/" not in d
                                                                 for d in domains):
                raise ValueError("allowed_media_domains: must be None or a list of host names, got "
                                 f"{self.allowed_media_domains!r}")
            object.__setattr__(self, "allowed_media_domains", tuple(domains))  # (a trace records a list)
        if self.max_batched_tokens <= self.max_seqs:
            # Every running request decodes one token per tick; prefill needs room on top of that or a
            # full batch would starve admission.
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must exceed max_seqs ({self.max_seqs}) "
                "so prefill always gets at least one token next to a full decode batch"
            )
        if not isinstance(self.draft_tokens, int) or not 0 <= self.draft_tokens <= 64:
            raise ValueError(f"draft_tokens: must be an integer in [0, 64], got {self.draft_tokens!r}")
        if self.mix not in ("decode-first", "prefill-first"):
            raise ValueError(f"mix: must be 'decode-first' or 'prefill-first', got {self.mix!r}")
        if self.processor_history not in ("prompt+output", "output"):
            raise ValueError(f"processor_history: must be 'prompt+output' or 'output', got {self.processor_history!r}")
        if self.drafter not in ("prompt-lookup", "draft-model", "mtp"):
            raise ValueError(f"drafter: must be 'prompt-lookup', 'draft-model' or 'mtp', got {self.drafter!r}")
        if self.draft_cost is not None:
            cost = tuple(self.draft_cost)
            if len(cost) != 4 or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                         and math.isfinite(c) and c >= 0 for c in cost):
                raise ValueError("draft_cost: must be four finite numbers >= 0 (verify, width, rows, shift), got "
                                 f"{self.draft_cost!r}")
            object.__setattr__(self, "draft_cost", tuple(float(c) for c in cost))  # (a trace records a list)
        if self.prompt_lookup_scope not in ("batch", "recent", "request"):
            raise ValueError("prompt_lookup_scope: must be 'batch', 'recent' or 'request', got "
                             f"{self.prompt_lookup_scope!r}")
        if not isinstance(self.prompt_lookup_pool_tokens, int) or self.prompt_lookup_pool_tokens < 0:
            raise ValueError("prompt_lookup_pool_tokens: must be an integer >= 0, got "
                             f"{self.prompt_lookup_pool_tokens!r}")
        if self.max_kv_size is not None and (not isinstance(self.max_kv_size, int) or self.max_kv_size < 2):
            raise ValueError(f"max_kv_size: must be an integer >= 2 or None, got {self.max_kv_size!r}")
        if self.kv_memory_bytes is not None and (not isinstance(self.kv_memory_bytes, int) or self.kv_memory_bytes < 1):
            raise ValueError(f"kv_memory_bytes: must be a positive integer or None, got {self.kv_memory_bytes!r}")
        if self.kv_bits is not None:
            if self.kv_bits not in KV_BITS or isinstance(self.kv_bits, bool):
                raise ValueError(f"kv_bits: must be one of {KV_BITS} or None, got {self.kv_bits!r}")
            if self.max_kv_size is not None:
                raise ValueError("kv_bits with max_kv_size: mlx-lm 0.32 cannot quantize the rotating caches "
                                 "max_kv_size builds (RotatingKVCache.to_quantized raises NotImplementedError)")
            if self.draft_tokens:
                raise ValueError("kv_bits with draft_tokens: a quantized batch cache cannot be rolled back per "
                                 "row after draft verification")
        if self.kv_group_size not in KV_GROUP_SIZES or isinstance(self.kv_group_size, bool):
            raise ValueError(f"kv_group_size: must be one of {KV_GROUP_SIZES}, got {self.kv_group_size!r}")
        if (not isinstance(self.quantized_kv_start, int) or isinstance(self.quantized_kv_start, bool)
                or self.quantized_kv_start < 0):
            raise ValueError(f"quantized_kv_start: must be an integer >= 0, got {self.quantized_kv_start!r}")
        if not isinstance(self.kv_headroom_tokens, int) or self.kv_headroom_tokens < 0:
            raise ValueError(f"kv_headroom_tokens: must be an integer >= 0, got {self.kv_headroom_tokens!r}")
        if not isinstance(self.vision_cache_bytes, int) or self.vision_cache_bytes < 0:
            raise ValueError(f"vision_cache_bytes: must be an integer >= 0, got {self.vision_cache_bytes!r}")
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: must be an integer >= 0, got {self.prefix_cache_bytes!r}")
        if not isinstance(self.prefix_block_size, int) or self.prefix_block_size < 1:
            raise ValueError(f"prefix_block_size: must be an integer >= 1, got {self.prefix_block_size!r}")
        if self.shard_stall_timeout_s is not None and (
                isinstance(self.shard_stall_timeout_s, bool) or not isinstance(self.shard_stall_timeout_s, (int, float))
                or not math.isfinite(self.shard_stall_timeout_s) or self.shard_stall_timeout_s <= 0):
            raise ValueError(f"shard_stall_timeout_s: must be a finite number > 0 or None, "
                             f"got {self.shard_stall_timeout_s!r}")
        if self.max_prefill_tokens is not None and (not isinstance(self.max_prefill_tokens, int)
                                                    or self.max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens: must be an integer >= 1 or None, got {self.max_prefill_tokens!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1 or None, got {self.max_model_len!r}")

    def one_forward_limit(self) -> tuple[int, str]:
        """The most prompt tokens a first chunk that must reach a position in one forward can hold, with the
        settings that bound it: a tick's prefill, at most max_batched_tokens (all of it once no row decodes) and
        max_prefill_tokens (prefill_chunk does not cut such a chunk: `chunk_cap`)."""
        limits = [(self.max_batched_tokens, "max_batched_tokens")]
        if self.max_prefill_tokens is not None:
            limits.append((self.max_prefill_tokens, "max_prefill_tokens"))
        most = min(n for n, _ in limits)
        return most, " and ".join(f"{name}={n}" for n, name in limits if n == most)


def chunk_cap(prefill_chunk: int, first_chunk_reach: int, start: int) -> int:
    """The longest chunk a request may get from `start`: prefill_chunk, or, for a first chunk that must reach
    `first_chunk_reach` in one forward, that far (a Gemma 4 prompt's images are not cut short: they would wait for
    ever). As vLLM schedules a multimodal item whole, bounded by the token budget alone."""
    return max(prefill_chunk, first_chunk_reach - start) if start < first_chunk_reach else prefill_chunk

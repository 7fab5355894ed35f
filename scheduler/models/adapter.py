"""The one vision-language adapter: every mlx-vlm family in ``families.FAMILIES`` through mlx-vlm's common model
interface, with the family differences declared as data (``FamilySpec``) and two position strategies.

It splits what ``mlx_vlm.generate`` does in one call into the pieces continuous batching needs:

``prepare``  CPU only: media -> PIL images / selected video frames / waveforms (``media.py``), the prompt
             (``prompt.py``), the processor call ``mlx_vlm.generate`` makes (expanded placeholders and the media
             tensors, whatever their names: ``pixel_values``, grids, ``pixel_attention_mask``, audio features,
             ...), the content key of the media for the vision cache and the prefix cache.
``encode``   ``Model.get_input_embeddings`` on the whole prefill sequence (the encoders and the merge, exactly
             as ``mlx_vlm.generate`` calls it), or on a vision-cache hit the text embeddings with the cached
             media rows put back at the media positions; the prompt's positions (``positions.py``) and the
             extra language-model inputs the family declares. ``encode_many``: the same for a tick's requests,
             the cache misses through the encoders in as few calls as ``FamilySpec.vision_batch`` allows.
``prefill``  the language model on ``embeddings[start:end]`` with that chunk's positions and extra inputs, into
             the request's own single-request cache (the one ``mlx_vlm.generate`` builds).
``decode`` / ``verify``  one batched step (or a draft verification of ``n`` tokens per row) over a left-padded
             batch cache, with each row's positions computed from its cache length and its own rope delta.

Per-row position state is never on the model: every call passes explicit positions (M-RoPE) or none (1-D RoPE,
where the language model derives them from each cache row's offset), and never ``rope_deltas`` /
``pixel_values``, the kwargs on which mlx-vlm's Qwen-VL language models read or write their per-instance state.

The first token. As in the text executor, the last prefill token is fed as the row's first decode input: a text
token's merged embedding is its token embedding, so this equals ``mlx_vlm.generate``'s first step; ``prepare``
refuses a prompt that ends in a media placeholder.

Recompute after preemption. ``encode`` takes the output tokens a preempted request had produced and embeds
``prompt + outputs`` in one ``get_input_embeddings`` call: M-RoPE positions of text after the last image continue
by one per token, so the rope delta (and every position) is the one the request had before; the media rows come
from the vision cache or the encoders run again on the request's kept media tensors.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from caches import layers
from caches.kv import QuantizeRule
from caches.vision import VisionCache, content_key

from scheduler.models import prompt as prompts
from scheduler.models import fetch, library, media_items, splice
from scheduler.models import positions as position_strategies
from scheduler.models.families import FamilySpec, UnsupportedFamily, VisionBatch, family_for
from scheduler.models.media import (AudioInput, ImageInput, MediaError, MediaLimit, VideoFrames, VideoInput,
                                    load_audio, load_image, load_video, validate_video_sampling)

DEFAULT_VIDEO_FPS = 2.0  # Qwen2-VL's own default sampling rate
DEFAULT_VIDEO_MAX_FRAMES = 32

_NOT_MEDIA = ("input_ids", "attention_mask")


def _named_parts(media_inputs: dict[str, Any]) -> list:
    """Every media tensor by name, in name order (a list of tensors as its items; a nested list, e.g. MiniCPM-V's
    per-prompt lists of differently sized slices, item by item with its length)."""
    parts: list[Any] = []
    for name in sorted(media_inputs):
        value = media_inputs[name]
        parts += [name, *_items(list(value) if isinstance(value, (list, tuple)) else [value])]
    return parts


def _items(values: list) -> list:
    parts: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            parts += [f"{len(v)} items", *_items(list(v))]
        else:
            parts.append(v if isinstance(v, mx.array) else mx.array(np.asarray(v)))
    return parts


# the tokens of the layout probe where one token leaves a cache layer unwritten (`VLMAdapter.kv_layout`)
LONG_LAYOUT_PROBE = 16


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a request whose family keys media per item (``VLMAdapter.media_keys``): what the
    encoders need to make its rows alone, and the key they are cached under."""

    key: str  # content key of this item alone (its tensors, the model / processor fingerprint)
    token: int  # its placeholder token id
    tokens: int  # prompt positions it fills
    inputs: dict[str, Any]  # its encoder inputs, by the processor's names (``media_items.ItemInputs``)
    count: int  # encoder-budget units: 1 per image, ``grid_t`` per video (``num_media_items``)


@dataclass
class PreparedRequest:
    """CPU-side preprocessing result; no model forward yet."""

    input_ids: list[int]  # the expanded prompt ids (placeholders repeated): what the LM's cache will hold
    media_inputs: dict[str, Any] = field(default_factory=dict)  # the processor's media tensors, by name
    mask: Any | None = None  # the processor's (1, L) attention mask
    media_key: str | None = None  # content key of the ordered media; None for text-only
    media_positions: tuple[int, ...] = ()  # the prompt positions of its media tokens (the encoders' rows go there)
    # (first prompt position, key) of each stretch whose state depends on the media so far (`media_marks`)
    media_marks: tuple[tuple[int, str], ...] = ()
    media_items: tuple[MediaItem, ...] = ()  # per media item, where the family keys media per item
    prompt: str = ""  # the templated prompt text given to the processor
    num_images: int = 0
    num_videos: int = 0
    num_audio: int = 0
    video_frame_indices: tuple[tuple[int, ...], ...] = ()  # per video: the source frames selected
    # the processor's (1, L) token types (``FamilySpec.token_types_input``) where the prompt is prefilled in one
    # forward through its last media token, else None
    token_types: mx.array | None = None
    # 0, or where the first prefill chunk must reach: it feeds [0, first_chunk_reach) or more in one forward of its
    # own, with the token types (``FamilySpec.token_types_input``; ``Request.first_chunk_reach``)
    first_chunk_reach: int = 0
    # per image, (its ids in the processor's prompt, the rows they became): ``input_ids`` holds that many image ids
    # (``FamilySpec.splice``, ``splice.py``); empty for the other families
    splice_runs: tuple[splice.Run, ...] = ()

    @property
    def has_media(self) -> bool:
        return bool(self.num_images or self.num_videos or self.num_audio)

    @property
    def num_media_tokens(self) -> int:
        return len(self.media_positions)

    @property
    def media_offset(self) -> int | None:
        """The position of the first media token; None for text-only."""
        return self.media_positions[0] if self.media_positions else None

    @property
    def num_media_items(self) -> int:
        """Encoder-budget units: one per image, one per temporal patch of each video (``grid_t``; one per video
        when the family has no video grid), one per audio clip."""
        items = self.num_images + self.num_audio
        grid = self.media_inputs.get("video_grid_thw")
        if self.num_videos and grid is not None:
            items += int(mx.sum(grid[:, 0]).item())
        else:
            items += self.num_videos
        return items

    # the processor's names, for callers that look at one tensor
    @property
    def pixel_values(self) -> Any:
        return self.media_inputs.get("pixel_values")

    @property
    def image_grid_thw(self) -> Any:
        return self.media_inputs.get("image_grid_thw")


@dataclass(frozen=True)
class VisionCall:
    """One encoder call of ``encode_many``: the requests (indices into its ``items``) whose units it took, the
    media items (``num_media_items``) it took, its wall time, and the error if it raised (a call over several
    units is then redone one unit at a time)."""

    items: tuple[int, ...]
    images: int
    seconds: float
    error: str | None = None


@dataclass
class EncodedRequest:
    """After the encoders: everything prefill needs, for the whole prefill sequence."""

    embeddings: mx.array  # (1, L, H) merged text + media input embeddings
    position_ids: mx.array | None  # (3, 1, L) int32 M-RoPE positions; None for 1-D RoPE families
    rope_delta: int  # decode position of a row = tokens in its cache + rope_delta (0 for 1-D RoPE)
    input_ids: mx.array  # (1, L) int32
    vision_cache_hit: bool | None = None  # None: no media; True: all of its media units were in the vision cache
    vision_time_s: float = 0.0  # encoder wall time (0 on a hit)
    encoded_items: int = 0  # media items (encoder-budget units) that went through the encoders for it
    encoded_media_tokens: int = 0  # their media tokens (a unit in the cache, or encoded for an earlier request
    # of the same call, is not counted: on the families keyed per item, a chat turn encodes only its new image)
    sequence_inputs: dict[str, mx.array] = field(default_factory=dict)  # (1, L, ...) sliced with each chunk
    media_mask: mx.array | None = None  # (1, L) bool: the media positions (families that declare the input)
    media_rows: dict[str, Any] = field(default_factory=dict)  # per media token rows (families that declare them)
    token_types: mx.array | None = None  # (1, L) PreparedRequest.token_types, zeros (text) over re-fed outputs
    first_chunk_reach: int = 0  # PreparedRequest.first_chunk_reach

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[1])


class VLMAdapter:
    """The generic adapter. ``vision_cache``: optional ``VisionCache`` of media rows by ``media_key``.
    ``media_encoder``: the callable ``(input_ids, media_inputs, mask) -> InputEmbeddingsFeatures`` that runs the
    encoders and the merge (``Model.get_input_embeddings``); replace it on the instance to instrument it (tests
    count its calls). ``max_kv_size``: rotating caches of that many tokens (``library.make_cache``).
    ``media_limits``: at most this many media items of a kind ("image", "video", "audio") in one request; more
    raise ``MediaLimit``. ``media_fetch``: how media given as http(s) URLs are fetched (``fetch.FetchPolicy``;
    None, the default here, refuses them; the engine passes ``Engine.media_fetch``)."""

    def __init__(self, model: Any, processor: Any, vision_cache: VisionCache | None = None,
                 video_fps: float = DEFAULT_VIDEO_FPS, video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
                 max_kv_size: int | None = None, media_limits: dict[str, int] | None = None,
                 media_fetch: fetch.FetchPolicy | None = None):
        self.spec: FamilySpec = family_for(getattr(getattr(model, "config", None), "model_type", None))
        if self.spec.refused:
            raise UnsupportedFamily(f"model_type {self.spec.model_type!r} cannot be batched: {self.spec.refused}")
        for option, reason in self.spec.refused_options:
            if _attribute(getattr(model, "config", None), option) is not None:
                raise UnsupportedFamily(f"model_type {self.spec.model_type!r} with {option} set cannot be batched: "
                                        f"{reason}")
        # the kinds of media this checkpoint's options turn off, each with why (FamilySpec.refused_media_options)
        self.refused_media: dict[str, str] = {}
        for kind, option, reason in self.spec.refused_media_options:
            value = _attribute(getattr(model, "config", None), option)
            if value not in (None, 0, False):
                self.refused_media[kind] = f"{option} is {value!r} in this checkpoint's config: {reason}"
        self.model, self.processor = model, processor
        self.language_model = model.language_model
        self.vision_cache = vision_cache
        self.max_kv_size = max_kv_size
        self.media_limits = dict(media_limits or {})
        self.media_fetch = media_fetch
        self.positions = position_strategies.for_family(self.spec)
        self.media_encoder: Callable[[mx.array, dict, Any], Any] = self._encode_media
        # the id a spliced family's processor writes for an image (``splice.py``), or None
        self.splice_marker = library.splice_marker(model) if self.spec.splice is not None else None
        self.media_token_ids = library.media_token_ids(model, processor, self.spec.media_token) | (
            {self.splice_marker} if self.splice_marker is not None else set())
        # the token between two units of one encoder call (``_run_encoders``): the smallest id that is no placeholder
        self._separator = min(set(range(len(self.media_token_ids) + 1)) - self.media_token_ids)
        # the ids a video's placeholders sit between (GLM's video_start_token_id / video_end_token_id), or None
        markers = tuple(getattr(model.config, f"video_{end}_token_id", None) for end in ("start", "end"))
        self._video_markers = markers if all(isinstance(m, int) and m >= 0 for m in markers) else None
        self.image_token = self.spec.placeholder_text or _placeholder(processor, self.spec.placeholder)
        self.video_token = _placeholder(processor, "video_token")
        self.audio_token = _placeholder(processor, "audio_token")
        self.video_fps, self.video_max_frames = validate_video_sampling(video_fps, video_max_frames)
        # the frames a video keeps in the processor (FamilySpec.video_rate: more are capped to it)
        self.frame_cap = library.processor_frame_cap(processor) if self.spec.video_rate else None
        if "audio" in self.spec.media and _attribute(model, self.spec.audio_encoder) is None:
            if not self.spec.media - {"audio"}:
                raise UnsupportedFamily(f"this {self.spec.model_type} checkpoint has no audio encoder "
                                        f"({self.spec.audio_encoder})")
            # a family that takes other media too: this checkpoint takes those (Gemma 4 26B-A4B and 31B ship
            # audio_config null, and mlx-vlm builds no audio tower for them; their images work as E2B's)
            self.refused_media["audio"] = f"it has no audio encoder ({self.spec.audio_encoder})"
        # the audio rate of a checkpoint that takes audio (None: no audio; the server reads it to accept audio parts)
        self.sample_rate = (int(getattr(getattr(processor, "feature_extractor", None), "sampling_rate", 16000))
                            if "audio" in self.media_kinds else None)
        try:
            self.capabilities = layers.check_batchable(self.make_cache())
        except layers.UnsupportedCache as exc:
            raise UnsupportedFamily(f"model_type {self.spec.model_type!r}: its language model's cache cannot be "
                                    f"batched ({exc})") from exc
        # model + processor identity in every media key: computed here, on the loading thread, so that no
        # request pays for it (its first media request did: about a millisecond of weight sampling and hashing)
        self.fingerprint = library.model_fingerprint(model, processor)
        # how the model writes tool calls (mlx-lm's rule on the chat template), or None: the server parses calls
        # out of the output with it
        self.tool_calling, self.thinking = library.processor_markups(processor)  # (its reasoning markers: likewise)

    # ---- family facts the engine needs ----------------------------------------------------------------
    @property
    def _lm_args(self) -> Any:
        return getattr(self.language_model, "args", None) or getattr(self.language_model, "config", None) \
            or self.model.config.text_config

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def vocab_size(self) -> int:
        value = getattr(self._lm_args, "vocab_size", None)
        if value:
            return int(value)
        return int(library.text_embedding_module(self.language_model).weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        value = getattr(self._lm_args, "max_position_embeddings", None)
        limit = self.position_limit
        if limit is not None:
            return min(int(value), limit[0]) if value else limit[0]
        return int(value) if value else None

    @property
    def position_limit(self) -> tuple[int, str] | None:
        """(positions, why) where this checkpoint's language model batches exactly only below a position, else
        None: the engine's context limit (``max_model_len``) is capped there and a larger one refused.

        Llama-4 attention scaling (``llama_4_scaling_beta`` in the text config's ``rope_parameters``: Ministral 3
        and Devstral Small 2 under mlx-vlm's mistral3, Mistral 4) multiplies the queries by 1 + beta * log(1 +
        floor(position / original_max_position_embeddings)), and mlx-vlm takes the positions of the whole batch
        from its first row's cache offset (``offset[0].item()``). Below ``original_max_position_embeddings`` the
        factor is exactly 1 for every row, so batches are exact there; past it a row whose position differs from
        the first row's gets another row's scale."""
        params = getattr(self._lm_args, "rope_parameters", None)
        if not isinstance(params, dict) or not params.get("llama_4_scaling_beta"):
            return None
        return int(params["original_max_position_embeddings"]), (
            "its llama_4_scaling_beta attention scaling is taken from the first row's position for every row of a "
            "batch, and it departs from 1 at original_max_position_embeddings")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """What ends generation in ``mlx_vlm.stream_generate`` (its ``StoppingCriteria``): the config's
        ``eos_token_id`` (int or list), the tokenizer's own eos (``eos_token_ids`` and ``eos_token_id``), and the
        processor's ``additional_eos_token_ids`` (the end-of-utterance token of Idefics3 / SmolVLM, Kimi-VL's
        end of the assistant's turn). tests/models/test_vlm_families.py holds it equal to the criteria's ids."""
        ids: set[int] = set()
        for source in (getattr(self.model.config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_ids", None),
                       getattr(self.tokenizer, "eos_token_id", None),
                       getattr(self.processor, "additional_eos_token_ids", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source if isinstance(i, int))
        return frozenset(ids)

    @property
    def media_kinds(self) -> frozenset[str]:
        """What this checkpoint takes: "image", "video", "audio" (its family's media, less ``refused_media``)."""
        return self.spec.media - self.refused_media.keys()

    def media_keys(self, media_inputs: dict[str, Any], ids: Sequence[int], positions: Sequence[int], num_items: int
                   ) -> tuple[tuple[tuple[int, str], ...], tuple[MediaItem, ...]]:
        """Content keys of a request's ordered media, from the preprocessed tensors (the exact encoder inputs)
        and the model / processor fingerprint, independent of file names and of the prompt text. Returns the
        media marks, (first prompt position, key) per media item in prompt order, each key a chain over the
        items up to it (the state of a prompt position depends on the media before it, not after), and the
        items, each with its own key (its rows depend on it alone). Where the family's tensors are not split
        per item (``FamilySpec.item_split``, ``media_items.py``): one mark at the first media token over all of
        them, and no items. The last mark's key covers every media tensor: it is the request's ``media_key``.
        ``positions``: the prompt's media positions; ``num_items``: the request's images and videos.

        Per item, the prefix cache shares a prompt up to a later item (a chat that adds an image), and the
        vision cache holds each item's rows, so a request encodes only the items it has not seen."""
        head = [self.spec.model_type, self.fingerprint]
        split = media_items.split_items(self.spec.item_split, self.model, media_inputs,
                                        media_items.RequestMedia(ids, positions, num_items, self.processor))
        if split is None:
            return ((positions[0], content_key(head + _named_parts(media_inputs))),), ()
        marks, items, chain, seen = [], [], content_key(head), 0
        for share in split:
            item = MediaItem(content_key(head + list(share.parts)), int(ids[positions[seen]]), share.tokens,
                             share.inputs, share.count)
            chain = content_key([chain, item.key])
            marks.append((positions[seen], chain))
            items.append(item)
            seen += share.tokens
        return tuple(marks), tuple(items)

    # ---- CPU side -------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], num_images: int = 0, num_videos: int = 0, num_audio: int = 0,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """Chat messages (media as placeholder parts) -> the prompt text `prepare` renders for them."""
        return prompts.render(self.processor, self.model.config, list(messages), num_images, num_videos, num_audio,
                              template_kwargs, video_on_tokenizer=self.spec.video_chat_on_tokenizer)

    def prepare(self, prompt: str | list[dict], images: Sequence[ImageInput] | None = (),
                videos: Sequence[VideoInput] | None = (), audio: Sequence[AudioInput] | None = (),
                fps: float | None = None, max_frames: int | None = None,
                template_kwargs: dict[str, Any] | None = None) -> PreparedRequest:
        """CPU-side preprocessing of one request. ``prompt``: templated text, or chat messages (rendered as
        ``mlx_vlm.generate`` renders them; see ``prompt.render``), whose media may also come as OpenAI-style
        content parts (``image_url`` / ``video_url`` / ``input_audio``; ``prompt.from_openai_messages``). An
        unusable medium raises ``MediaError`` naming it (``RemoteMedia`` for an http(s) URL that ``media_fetch``
        refuses or cannot fetch; None refuses every URL); too many images
        ``MediaLimit``; a bad prompt, mismatched placeholders or media the family does not take ``ValueError``.
        ``template_kwargs`` (``tools``, ``chat_template_kwargs``) go to the chat template of chat messages."""
        images = list(images) if images is not None else []
        videos = list(videos) if videos is not None else []
        clips_in = list(audio) if audio is not None else []
        if isinstance(prompt, (list, tuple)) and prompts.has_media_parts(list(prompt)):
            if images or videos or clips_in:
                raise ValueError("give media either as content parts of the messages or as images= / videos= / "
                                 "audio=, not both")
            prompt, parts = prompts.from_openai_messages(list(prompt))
            images, videos, clips_in = parts.images, parts.videos, parts.audio
        for kind, items in (("image", images), ("video", videos), ("audio", clips_in)):
            limit = self.media_limits.get(kind)
            if limit is not None and len(items) > limit:
                raise MediaLimit(kind, len(items), limit)
            if items and kind in self.refused_media:
                raise ValueError(f"{kind}s are not supported by this {self.spec.model_type} checkpoint: "
                                 f"{self.refused_media[kind]}")
            if items and kind not in self.spec.media:
                raise ValueError(f"{kind}s are not supported for {self.spec.model_type} (it takes "
                                 f"{', '.join(sorted(self.spec.media))})")
        most = self.spec.images_per_request
        if most is not None and len(images) > most:
            raise ValueError(f"{len(images)} images in one request: mlx-vlm's {self.spec.model_type} takes at most "
                             f"{most} a prompt")
        if images and videos and not self.spec.mixed_image_video:
            raise ValueError(f"a request with both images and videos is not supported: mlx-vlm's "
                             f"{self.spec.model_type} merges one kind of media per request")
        fps, max_frames = validate_video_sampling(self.video_fps if fps is None else fps,
                                                  self.video_max_frames if max_frames is None else max_frames)
        if self.frame_cap is not None:  # (FamilySpec.video_rate) the processor would thin more and misstamp them
            max_frames = min(max_frames, self.frame_cap)
        # media at http(s) URLs become their bytes first (refused where media_fetch is None)
        images, videos, clips_in = fetch.resolve_all(images, videos, clips_in, self.media_fetch)
        pil = [load_image(src, i) for i, src in enumerate(images)]
        clips: list[VideoFrames] = [load_video(src, i, fps, max_frames) for i, src in enumerate(videos)]
        waves = [load_audio(src, i, self.sample_rate) for i, src in enumerate(clips_in)]
        if isinstance(prompt, str):
            text = prompt  # already templated
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
            text = self.render_chat(list(prompt), len(pil), len(clips), len(waves), template_kwargs)
        else:
            raise TypeError(f"prompt must be a templated str or a list of chat messages, got {type(prompt).__name__}")
        if not text:
            raise ValueError("empty prompt")
        for token, n, kind in ((self.image_token, len(pil), "image"), (self.video_token, len(clips), "video"),
                               (self.audio_token, len(waves), "audio")):
            if token and text.count(token) != n:
                raise ValueError(f"prompt has {text.count(token)} {kind} placeholder(s) ({token}) for {n} {kind}(s)")
        frame_lists = [clip.frames for clip in clips]
        try:
            inputs = library.prepare_inputs(self.model, self.processor, text, pil, frame_lists or None, waves or None,
                                            [None if clip.source_fps is None else
                                             (clip.total_frames, clip.source_fps, clip.indices) for clip in clips],
                                            [clip.rate for clip in clips] if self.spec.video_rate else None,
                                            self.spec.video_channels_first)
        except Exception as exc:
            self._blame(pil, frame_lists, exc)
            raise
        ids = self._prompt_ids(inputs)
        has_media = bool(pil or clips or waves)
        kept_out = (*_NOT_MEDIA, *self.spec.dropped_inputs, self.spec.token_types_input)
        media_inputs = {k: v for k, v in inputs.items() if k not in kept_out and v is not None} if has_media else {}
        mask = inputs.get("attention_mask")
        splice_runs: tuple[splice.Run, ...] = ()
        if self.splice_marker is not None and pil:  # an image's ids: as many as the merge gives it rows
            splice_runs = splice.image_runs(self.spec.splice, self.model, media_inputs, ids, self.splice_marker,
                                            len(pil))
            if mask is not None:
                mask = mx.array(splice.expand_along(mask, ids, self.splice_marker, splice_runs))
            ids = splice.expand(ids, self.splice_marker, splice_runs)
        media_at = tuple(i for i, t in enumerate(ids) if t in self.media_token_ids) if has_media else ()
        if has_media and not media_at:
            raise ValueError("the processor put no media tokens in the prompt")
        marks, items = self.media_keys(media_inputs, ids, media_at, len(pil) + len(clips)) if has_media else ((), ())
        token_types = self._one_forward_types(inputs, ids) if has_media else None
        # Exact prefix sharing needs no key of its own for this mode: it follows from the media alone (Gemma 4:
        # images and no audio), and its media are keyed whole (one mark over every media tensor)
        return PreparedRequest(
            input_ids=ids, media_inputs=media_inputs, mask=mask, splice_runs=splice_runs,
            media_key=marks[-1][1] if marks else None, media_positions=media_at, media_marks=marks,
            media_items=items, prompt=text,
            num_images=len(pil), num_videos=len(clips), num_audio=len(waves),
            video_frame_indices=tuple(clip.indices for clip in clips),
            token_types=token_types, first_chunk_reach=media_at[-1] + 1 if token_types is not None else 0,
        )

    def _one_forward_types(self, inputs: dict, ids: list[int]) -> mx.array | None:
        """The prompt's token types where ``mlx_vlm.generate`` would prefill it in one forward (its chunked-prefill
        policy, asked with them), else None."""
        name = self.spec.token_types_input
        if name is None or inputs.get(name) is None:
            return None
        types = mx.array(np.asarray(inputs[name])).astype(mx.int32).reshape(1, -1)
        if types.shape[1] != len(ids):
            raise ValueError(f"the processor's {name} covers {types.shape[1]} positions of a {len(ids)}-token prompt")
        one_forward = library.prefills_in_one_forward(self.model, mx.array(ids)[None], {name: types})
        return types if one_forward else None

    def text_request(self, token_ids: Sequence[int]) -> PreparedRequest:
        """A request given as token ids (no media)."""
        return PreparedRequest(input_ids=list(token_ids))

    def _prompt_ids(self, inputs: dict) -> list[int]:
        input_ids = inputs["input_ids"]
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"processor returned input_ids of shape {tuple(input_ids.shape)}, want (1, L)")
        ids = [int(t) for t in input_ids[0].tolist()]
        if not ids:
            raise ValueError("prompt tokenizes to nothing")
        if ids[-1] in self.media_token_ids:
            raise ValueError("the prompt must not end with a media token: the first decode step feeds the last "
                             "prompt token as text (use the chat template, which ends with the generation prompt)")
        return ids

    def _blame(self, pil: list, frame_lists: list[list], exc: Exception) -> None:
        """The processor failed on the whole request: find the first medium it refuses alone and name it."""
        image_processor = getattr(self.processor, "image_processor", None)
        for i, image in enumerate(pil if image_processor is not None else ()):
            try:
                image_processor(images=[image])
            except Exception as one:
                raise MediaError(i, f"rejected by the image processor ({image.width}x{image.height}): "
                                    f"{type(one).__name__}: {one}") from exc
        video_processor = getattr(self.processor, "video_processor", None) or image_processor
        for i, frames in enumerate(frame_lists if video_processor is not None else ()):
            try:
                video_processor(videos=[library.video_array(frames, True) if self.spec.video_channels_first
                                        else frames])
            except Exception as one:
                h, w = frames[0].shape[:2]
                raise MediaError(i, f"rejected by the video processor ({len(frames)} frames of {w}x{h}): "
                                    f"{type(one).__name__}: {one}", "video") from exc

    # ---- device side ----------------------------------------------------------------------------------
    def _encode_media(self, input_ids: mx.array, media_inputs: dict, mask: Any) -> Any:
        return library.input_embeddings(self.model, input_ids, media_inputs, mask)

    def encode(self, prepared: PreparedRequest, extra_tokens: Sequence[int] = ()) -> EncodedRequest:
        """Embeddings, positions and extra inputs of ``prepared.input_ids + extra_tokens`` (``extra_tokens``: the
        outputs of a preempted request, recomputed). Media rows come from the vision cache or the encoders.
        Everything returned is evaluated. Raises what the encoders raise."""
        outcome = self.encode_many([(prepared, extra_tokens)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def encode_many(self, items: Sequence[tuple[PreparedRequest, Sequence[int]]],
                    on_call: Callable[[VisionCall], None] | None = None) -> list[EncodedRequest | Exception]:
        """``encode`` of several requests. Their media go through the encoders as units: each media item of the
        families that key media per item (``PreparedRequest.media_items``), else all of a request's media. A
        unit in the vision cache is not encoded again, nor is one that an earlier request of ``items`` has
        too; the others go through the encoders in as few calls as the family allows
        (``FamilySpec.vision_batch``). ``on_call`` hears of every encoder call. A call over several units that
        raises is redone one unit at a time, so an error fails only the requests with that unit (its
        ``VisionCall.error`` says why it was redone). Returns, per item, its ``EncodedRequest`` or the
        exception that failed it."""
        outcomes: list[EncodedRequest | Exception | None] = [None] * len(items)
        units: dict[int, list[_Unit]] = {}
        for i, (prepared, extra) in enumerate(items):
            if not prepared.has_media:
                continue
            if not prepared.media_inputs:
                outcomes[i] = ValueError("media tensors were released before encode")
            else:
                units[i] = self._units(i, prepared, extra)
        found: dict[str, _Media] = {}  # unit key -> its rows, from the cache or this call's encoders
        failed: dict[str, Exception] = {}
        first: dict[str, _Unit] = {}  # key -> the first unit with it (looked up, and encoded, once)
        misses: list[_Unit] = []
        for unit in (u for request_units in units.values() for u in request_units):
            if unit.key in first:
                continue
            first[unit.key] = unit
            cached = self._cached(unit.key)
            if cached is not None:
                found[unit.key] = cached
            else:
                misses.append(unit)
        for group in self._vision_groups(misses):
            self._encode_group(group, found, failed, on_call)
        missed = {u.key for u in misses}
        for i, request_units in units.items():
            error = next((failed[u.key] for u in request_units if u.key in failed), None)
            if error is not None:
                outcomes[i] = error
                continue
            media = [found[u.key] if first[u.key] is u else self._follower(u.key, found) for u in request_units]
            joined = outcomes[i] = self._joined(media)
            own = [u for u in request_units if first[u.key] is u and u.key in missed]  # what its encoders ran on
            joined.encoded_items, joined.encoded_tokens = sum(u.count for u in own), sum(len(u.positions) for u in own)
        # (ids, mask) of each request to assemble: prompt + re-fed outputs
        prompts = {i: self._prompt(*items[i]) for i, outcome in enumerate(outcomes)
                   if outcome is None or isinstance(outcome, _Media)}
        text_path = [i for i in prompts if outcomes[i] is None or outcomes[i].embeds is None]
        texts = dict(zip(text_path, self._text_inputs([self._text_prompt(items[i][0], *prompts[i])
                                                        for i in text_path])))
        for i, (ids, mask) in prompts.items():
            text = texts.get(i)
            if isinstance(text, Exception):
                outcomes[i] = text
                continue
            try:
                outcomes[i] = self._assemble(items[i][0], ids, mask, outcomes[i], text)
            except Exception as exc:  # a request whose rows do not fit its prompt fails alone
                outcomes[i] = exc
        return outcomes  # type: ignore[return-value]

    def _prompt(self, prepared: PreparedRequest, extra_tokens: Sequence[int]) -> tuple[mx.array, mx.array]:
        ids = self._ids(prepared, extra_tokens)
        return ids, self._mask(prepared, ids)

    def _text_prompt(self, prepared: PreparedRequest, ids: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        """What the text path embeds for a request: its prompt, with its media tokens replaced by a non-media one
        where the family declares ``media_free_text_path`` (its rows overwrite those positions after)."""
        if not (self.spec.media_free_text_path or prepared.splice_runs) or not prepared.media_positions:
            return ids, mask
        ids = mx.array(ids)
        ids[0, mx.array(prepared.media_positions)] = self._separator
        return ids, mask

    def _text_inputs(self, prompts: Sequence[tuple[mx.array, mx.array]]
                     ) -> list[tuple[mx.array, dict[str, mx.array]] | Exception]:
        """The text path's embeddings and sequence inputs of each request (its media rows go in after), from
        one call over the prompts side by side: every family's text path embeds token by token (an embedding
        lookup; Gemma 4's per-layer inputs too), so each prompt's slice is what its own call gives
        (tests/models/test_vision_batch.py compares with requests encoded alone), and the call's fixed cost
        (mlx-vlm's Qwen text path also works out positions, which the engine takes from ``self.positions``)
        is paid once per tick, not once per request. A call over several requests that raises is redone one
        request at a time, so an error is only its own request's (returned in its place)."""
        if not prompts:
            return []
        ids, masks = zip(*prompts)
        try:
            out = library.input_embeddings(self.model, mx.concatenate(ids, axis=1), {},
                                           mx.concatenate(masks, axis=1))
            sequence_inputs = {name: getattr(out, name) for name in self.spec.sequence_inputs
                               if getattr(out, name, None) is not None}
            mx.eval(out.inputs_embeds, *sequence_inputs.values())
        except Exception as exc:
            if len(prompts) == 1:
                return [exc]
            return [text for prompt in prompts for text in self._text_inputs([prompt])]
        texts, start = [], 0
        for i in ids:
            end = start + i.shape[1]
            texts.append((out.inputs_embeds[:, start:end], {k: v[:, start:end] for k, v in sequence_inputs.items()}))
            start = end
        return texts

    def _units(self, index: int, prepared: PreparedRequest, extra_tokens: Sequence[int]) -> list[_Unit]:
        """A request's encoder units: per media item (its placeholder tokens alone as the prompt the encoders
        see: the merge fills them with its rows), or all its media with its own prompt (whose merged
        embeddings then serve as the request's)."""
        if prepared.media_items:
            return [self._item_unit(index, item) for item in prepared.media_items]
        ids, mask = self._prompt(prepared, extra_tokens)
        length = ids.shape[1]
        if prepared.splice_runs:  # the encoders splice each image's rows in at its ids
            expanded = ids[0].tolist()
            mask = mx.array(splice.collapse_along(mask, expanded, self.splice_marker, prepared.splice_runs))
            ids = mx.array([splice.collapse(expanded, self.splice_marker, prepared.splice_runs)], dtype=ids.dtype)
        return [_Unit(index, prepared.media_key, ids, mask, prepared.media_inputs,
                      prepared.media_positions, prepared.num_media_items, whole=True, length=length)]

    def _item_unit(self, index: int, item: MediaItem) -> _Unit:
        """A media item's unit: its placeholders alone, and for a video of a family whose config names video
        markers, the placeholders between them: GLM-5-Next writes a video's frames with its image token and its
        merge tells them from an image's by the markers around them (without them it fills none of them)."""
        if item.token == self.splice_marker:  # the one id the merge splices the image's rows in at (the families
            # keyed per item write one an image)
            return _Unit(index, item.key, mx.array([[item.token]], dtype=mx.int32), mx.ones((1, 1), dtype=mx.int32),
                         item.inputs, tuple(range(item.tokens)), item.count, whole=False, length=item.tokens)
        ids = [item.token] * item.tokens
        lead = 0
        if self._video_markers is not None and "video_grid_thw" in item.inputs:
            ids, lead = [self._video_markers[0], *ids, self._video_markers[1]], 1
        return _Unit(index, item.key, mx.array([ids], dtype=mx.int32), mx.ones((1, len(ids)), dtype=mx.int32),
                     item.inputs, tuple(range(lead, lead + item.tokens)), item.count, whole=False, length=len(ids))

    def _follower(self, key: str, found: dict[str, _Media]) -> _Media:
        """A unit that another request of the call has too: the cache's entry (a counted hit), or the leader's
        rows when there is no cache to hold them."""
        cached = self._cached(key)
        if cached is not None:
            return cached
        return dataclasses.replace(found[key], embeds=None, sequence_inputs={}, seconds=0.0)

    @staticmethod
    def _joined(media: list[_Media]) -> _Media:
        """A request's rows from its units' rows, in order (a whole-request unit's are the request's: only an
        encoder call over a whole request makes merged ``embeds``)."""
        if len(media) == 1:
            return dataclasses.replace(media[0])
        row_inputs = [None if any(m.row_inputs[k] is None for m in media) else
                      mx.concatenate([m.row_inputs[k] for m in media], axis=1) for k in range(len(media[0].row_inputs))]
        return _Media(mx.concatenate([m.rows for m in media], axis=0), row_inputs, hit=all(m.hit for m in media),
                      seconds=sum(m.seconds for m in media))

    def _cached(self, key: str | None) -> _Media | None:
        if self.vision_cache is None or key is None:
            return None
        cached = self.vision_cache.get(key)
        if cached is None:
            return None
        rows, *row_inputs = (cached,) if not self.spec.media_row_inputs else cached
        return _Media(rows, list(row_inputs), hit=True)

    def _vision_groups(self, units: list[_Unit]) -> list[list[_Unit]]:
        """The encoder calls for ``units``: units with the same media tensors by name go together (a tick's
        images apart from its videos); ``EQUAL_SHAPE`` families also need every other axis of each tensor to
        agree; ``PER_REQUEST`` families encode alone (their media are one unit per request: ``ItemSplit.WHOLE``)."""
        if self.spec.vision_batch is VisionBatch.PER_REQUEST:
            return [[u] for u in units]
        groups: dict[tuple, list[_Unit]] = {}
        for unit in units:
            if self.spec.vision_batch is VisionBatch.ONE:
                key: tuple = tuple(sorted(unit.inputs))
            else:
                key = tuple(sorted((name, _shape_but(value, self._axis(name)), str(getattr(value, "dtype", "")))
                                   for name, value in unit.inputs.items()))
            groups.setdefault(key, []).append(unit)
        return list(groups.values())

    def _axis(self, name: str) -> int:
        return 0 if name.endswith("_grid_thw") else self.spec.media_axis

    def _encode_group(self, group: list[_Unit], found: dict[str, _Media], failed: dict[str, Exception],
                      on_call: Callable[[VisionCall], None] | None) -> None:
        """One encoder call over ``group`` (their prompts side by side in one sequence: the merge fills media
        positions in order, so each unit's slice of the merged embeddings is its own), the rows stored in the
        vision cache. A failing call of several units is redone one by one."""
        requests = tuple(sorted({u.request for u in group}))
        count = sum(u.count for u in group)
        t0 = time.perf_counter()
        try:
            media = self._run_encoders(group)
        except Exception as exc:
            if on_call is not None:
                on_call(VisionCall(requests, count, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"))
            if len(group) == 1:
                failed[group[0].key] = exc
                return
            for unit in group:
                self._encode_group([unit], found, failed, on_call)
            return
        seconds = time.perf_counter() - t0
        if on_call is not None:
            on_call(VisionCall(requests, count, seconds))
        for unit, m in zip(group, media):
            m.seconds = seconds * unit.count / max(count, 1)  # the call's time by share of media items
            if self.vision_cache is not None:
                value = m.rows if not self.spec.media_row_inputs else (m.rows, *m.row_inputs)
                self.vision_cache.put(unit.key, value, m.seconds)
            found[unit.key] = m

    def _run_encoders(self, group: Sequence[_Unit]) -> list[_Media]:
        # units side by side, one non-media token between two: an item unit's prompt is its placeholders alone, and
        # back to back they would read as one image to a merge or rope index that finds images as runs of
        # placeholders (GLM-OCR's get_rope_index raised on the joined run, and every such call was redone per unit)
        gap = 1 if len(group) > 1 else 0
        if len(group) == 1:
            ids, mask, media_inputs = group[0].ids, group[0].mask, group[0].inputs
        else:
            separator = mx.array([[self._separator]], dtype=group[0].ids.dtype)
            ids = mx.concatenate([piece for u in group for piece in (separator, u.ids)][1:], axis=1)
            mask = mx.concatenate([piece for u in group for piece in (mx.ones((1, 1), dtype=u.mask.dtype), u.mask)][1:],
                                  axis=1)
            media_inputs = {name: mx.concatenate([mx.array(u.inputs[name]) for u in group], axis=self._axis(name))
                            for name in group[0].inputs}
        out = self.media_encoder(ids, media_inputs, mask)
        embeds = out.inputs_embeds
        row_inputs = [_as_array(getattr(out, name, None)) for name in self.spec.media_row_inputs]
        sequence_inputs = {name: getattr(out, name) for name in self.spec.sequence_inputs
                           if getattr(out, name, None) is not None}
        media: list[_Media] = []
        start = media_start = 0
        for unit in group:
            length, positions = unit.length, unit.positions
            own = embeds[:, start: start + length]
            rows = own[0, mx.array(positions)]
            if self.spec.media_rows_whole_prompt:  # rows over the call's sequence: the unit's media positions'
                at = mx.array(positions) + start
                own_rows = [None if r is None else r[:, at] for r in row_inputs]
            elif self.spec.media_rows_dense:  # (1, L, layers, H) over the call's sequence: the unit's media
                at = mx.array(positions) + start  # positions' rows, kept (layers, n, H) as Qwen3-VL's come
                own_rows = [None if r is None else r[0, at].transpose(1, 0, 2) for r in row_inputs]
            else:
                own_rows = [None if r is None else r[:, media_start: media_start + len(positions)]
                            for r in row_inputs]
            media.append(_Media(rows, own_rows, hit=False, embeds=own if unit.whole else None,
                                sequence_inputs={k: v[:, start: start + length] for k, v in sequence_inputs.items()}
                                if unit.whole else {}))
            start, media_start = start + length + gap, media_start + len(positions)
        if start - gap != embeds.shape[1]:
            raise ValueError(f"the encoders gave {embeds.shape[1]} embeddings for {start - gap} tokens")
        mx.eval([m.embeds for m in media if m.embeds is not None], [m.rows for m in media],
                [r for m in media for r in m.row_inputs if r is not None])
        return media

    def _ids(self, prepared: PreparedRequest, extra_tokens: Sequence[int]) -> mx.array:
        return mx.array(list(prepared.input_ids) + list(extra_tokens), dtype=mx.int32)[None]

    def _mask(self, prepared: PreparedRequest, ids: mx.array) -> mx.array:
        mask = mx.ones(ids.shape, dtype=mx.int32)
        if prepared.mask is not None:
            mask[:, : len(prepared.input_ids)] = prepared.mask.astype(mx.int32)
        return mask

    def _assemble(self, prepared: PreparedRequest, ids: mx.array, mask: mx.array, media: _Media | None,
                  text: tuple[mx.array, dict[str, mx.array]] | None) -> EncodedRequest:
        """The request's inputs (``ids``, ``mask``: ``_prompt``) from its media rows: the encoders' own merged
        embeddings when this request's call made them, else its text embeddings (``text``, from
        ``_text_inputs``) with the rows put back at the media positions."""
        spec = self.spec
        media_positions = prepared.media_positions  # of the prompt: re-fed outputs are embedded as token ids
        row_inputs: list = [None] * len(spec.media_row_inputs)
        if media is not None and media.embeds is not None:
            embeds, sequence_inputs, row_inputs = media.embeds, media.sequence_inputs, media.row_inputs
        else:
            if text is None:
                raise ValueError("no text embeddings for a request its encoders did not embed")
            embeds, sequence_inputs = text
            if media is not None:
                embeds = mx.array(embeds)
                embeds[0, mx.array(media_positions)] = media.rows.astype(embeds.dtype)
                row_inputs = media.row_inputs
        if media is not None and media.rows.shape[0] != len(media_positions):
            raise ValueError(f"the encoders gave {media.rows.shape[0]} rows for {len(media_positions)} media tokens")
        positions, delta = self.positions.prompt(self.model, ids, prepared.media_inputs, mask)
        media_mask = None
        media_rows: dict[str, Any] = {}
        if spec.media_mask_input and len(media_positions):
            media_mask = mx.zeros(ids.shape, dtype=mx.bool_)
            media_mask[0, mx.array(media_positions)] = True
            media_rows = {name: r for name, r in zip(spec.media_row_inputs, row_inputs) if r is not None}
        mx.eval([a for a in (embeds, positions, media_mask, *sequence_inputs.values(), *media_rows.values())
                 if a is not None])
        return EncodedRequest(embeddings=embeds, position_ids=positions, rope_delta=delta, input_ids=ids,
                              vision_cache_hit=None if media is None else media.hit,
                              vision_time_s=0.0 if media is None else media.seconds,
                              encoded_items=0 if media is None else media.encoded_items,
                              encoded_media_tokens=0 if media is None else media.encoded_tokens,
                              sequence_inputs=sequence_inputs, media_mask=media_mask, media_rows=media_rows,
                              token_types=self._types_over(prepared, ids), first_chunk_reach=prepared.first_chunk_reach)

    @staticmethod
    def _types_over(prepared: PreparedRequest, ids: mx.array) -> mx.array | None:
        """The prompt's token types over ``ids`` (the prompt, then re-fed outputs: text, type 0)."""
        if prepared.token_types is None:
            return None
        extra = ids.shape[1] - prepared.token_types.shape[1]
        return mx.pad(prepared.token_types, [(0, 0), (0, extra)]) if extra else prepared.token_types

    def make_cache(self) -> list:
        return library.make_cache(self.language_model, self.max_kv_size)

    def prefill(self, cache: list, encoded: EncodedRequest, start: int, end: int) -> mx.array | None:
        """Run the language model on positions [start, end) into ``cache`` (which must hold exactly ``start``
        tokens). Only the cache is evaluated; the chunk's (1, end - start, V) logits are returned unevaluated
        (None for an empty range), so nothing computes them unless the caller reads them."""
        self._check_range(encoded, start, end)
        if end == start:
            return None
        held = int(library.row_offsets(cache)[0].item())
        if held != start:
            raise ValueError(f"prefill from {start} but the cache holds {held} tokens")
        kwargs = self.positions.prefill_kwargs(encoded.position_ids, start, end)
        kwargs.update({name: value[:, start:end] for name, value in encoded.sequence_inputs.items()})
        if start < encoded.first_chunk_reach:
            # the language model builds each image's two-way mask from these types over the whole forward, which
            # must start at 0 with an empty cache and hold every media token (else it falls back to causal)
            if start != 0 or end < encoded.first_chunk_reach:
                raise ValueError(f"this prompt's tokens [0, {encoded.first_chunk_reach}) are prefilled in one "
                                 f"forward (its media attend both ways), not [{start}, {end})")
            kwargs[self.spec.token_types_input] = encoded.token_types[:, :end]
        chunk_mask, chunk_rows = self._chunk_media(encoded, start, end)
        if chunk_mask is not None and self.spec.media_rows_whole_prompt:
            chunk_mask, chunk_rows = self._prompt_media(encoded, end)
        if chunk_mask is not None and self.spec.media_rows_dense:
            chunk_rows = {name: _dense_rows(chunk_mask, rows, end - start) for name, rows in chunk_rows.items()}
        if chunk_mask is not None:  # the language model adds the chunk's media rows at its media positions
            kwargs[self.spec.media_mask_input] = chunk_mask
            kwargs.update(chunk_rows)
        logits = self._lm_forward(encoded.input_ids[:, start:end], cache,
                                  inputs_embeds=encoded.embeddings[:, start:end], **kwargs)
        mx.eval([c.state for c in cache])
        return logits

    @property
    def prefill_sharing(self) -> layers.PrefillSharing:
        """Which chunks of several requests can share one prefill forward: what the caches split back from
        (`CacheCapabilities.prefill_sharing`: any mix for plain KV, and for windows and recurrent state where the
        language model honors the lengths a prepared batch cache carries (``FamilySpec.honors_lengths``), else
        chunks at one position of one length)."""
        return self.capabilities.prefill_sharing(self.spec.honors_lengths)

    @staticmethod
    def _chunk_media(encoded: EncodedRequest, start: int, end: int) -> tuple[mx.array | None, dict[str, Any]]:
        """For a family whose language model reads media rows per chunk (``FamilySpec.media_mask_input``, Qwen3-VL's
        ``visual_pos_masks`` and deepstack rows): the chunk's (1, end - start) media mask and its media rows (the
        rows of the media positions inside it, in order); (None, {}) when the chunk holds no media position."""
        if encoded.media_mask is None:
            return None, {}
        chunk_mask = encoded.media_mask[:, start:end]
        inside = int(chunk_mask.sum().item())
        if not inside:
            return None, {}
        before = int(encoded.media_mask[:, :start].sum().item())
        return chunk_mask, {name: rows[:, before: before + inside] for name, rows in encoded.media_rows.items()}

    @staticmethod
    def _prompt_media(encoded: EncodedRequest, end: int) -> tuple[mx.array, dict[str, Any]]:
        """``FamilySpec.media_rows_whole_prompt``: the (1, end) media mask and each media row input spread over the
        positions [0, end) ((layers, end, H), zeros off the media positions): the language model slices both at
        its cache's offset."""
        mask = encoded.media_mask[:, :end]
        at = np.flatnonzero(np.array(mask[0]))
        rows = {}
        for name, value in encoded.media_rows.items():
            full = mx.zeros((value.shape[0], end, value.shape[-1]), dtype=value.dtype)
            full[:, mx.array(at)] = value[:, : len(at)]
            rows[name] = full
        return mask, rows

    def shares_prefill(self, encoded: EncodedRequest, start: int, n: int) -> bool:
        """Whether positions [start, start + n) may share a forward with other requests' chunks: not a chunk
        holding media positions of a family whose language model adds one sequence's media rows to every row
        of a batch (``FamilySpec.media_rows_whole_prompt``), nor a prompt's first chunk that must reach past its
        media in one forward (``EncodedRequest.first_chunk_reach``)."""
        if start < encoded.first_chunk_reach:  # its first chunk: one forward of its own (token_types_input)
            return False
        if not self.spec.media_rows_whole_prompt or encoded.media_mask is None:
            return True
        return not bool(encoded.media_mask[:, start:start + n].any().item())

    def prefill_many(self, rows: Sequence[tuple[list | None, EncodedRequest, int, int]]
                     ) -> tuple[list[list], mx.array]:
        """Several requests' chunks in one forward; one cache per request back, and the forward's (B, width, V)
        logits unevaluated (row i's first n positions are its chunk's). ``rows``: (cache or None for a fresh
        request, encoded, start, n): feed positions [start, start + n) after what the cache holds.

        The same layout as the text runner's: caches merged left-padded (each row keeps its own offset, and its
        mask hides the padding), chunks shorter than the widest padded on the right with zero embeddings, and
        the pads cut from the caches after (windows and recurrent state skip them: ``prepare_padded``). Causal
        attention keeps every real position from seeing a pad, and each row gets its own positions (M-RoPE: its
        slice of the prompt's positions; 1-D RoPE: its cache row's offset), its per-chunk sequence inputs and
        media rows, so each row computes what its own forward would."""
        width = max(n for *_, n in rows)
        batch = layers.merge_caches([cache if cache is not None else self.make_cache() for cache, *_ in rows])
        ids, embeds, positions, masks, media_rows, sequences, any_media = [], [], [], [], {}, {}, False
        for _, encoded, start, n in rows:
            self._check_range(encoded, start, start + n)
            if not self.shares_prefill(encoded, start, n):
                raise ValueError(f"a {self.spec.model_type} chunk with media positions is prefilled alone")
            pad = width - n
            ids.append(mx.pad(encoded.input_ids[:, start:start + n], [(0, 0), (0, pad)]))
            embeds.append(mx.pad(encoded.embeddings[:, start:start + n], [(0, 0), (0, pad), (0, 0)]))
            kwargs = self.positions.prefill_kwargs(encoded.position_ids, start, start + n)
            if "position_ids" in kwargs:  # pads sit at position 0: no real position attends to them
                positions.append(mx.pad(kwargs["position_ids"], [(0, 0), (0, 0), (0, pad)]))
            for name, value in encoded.sequence_inputs.items():  # (1, L, ...) inputs: each row's slice, padded
                sequences.setdefault(name, []).append(
                    mx.pad(value[:, start:start + n], [(0, 0), (0, pad)] + [(0, 0)] * (value.ndim - 2)))
            chunk_mask, chunk_rows = self._chunk_media(encoded, start, start + n)
            any_media = any_media or chunk_mask is not None
            masks.append(mx.zeros((1, width), dtype=mx.bool_) if chunk_mask is None
                         else mx.pad(chunk_mask.astype(mx.bool_), [(0, 0), (0, pad)]))
            if self.spec.media_rows_dense:  # every row's rows over its chunk and pads (None: a row without media)
                for name in self.spec.media_row_inputs:
                    media_rows.setdefault(name, []).append(
                        _dense_rows(chunk_mask, chunk_rows[name], width) if name in chunk_rows else None)
                continue
            for name, part in chunk_rows.items():
                media_rows.setdefault(name, []).append(part)
        kwargs = {"position_ids": mx.concatenate(positions, axis=1)} if positions else {}
        kwargs.update({name: mx.concatenate(parts, axis=0) for name, parts in sequences.items()})
        if any_media:  # per row, its chunk's media positions (pads: none) and, in row order, their rows: the
            # language model scatters each row's rows at its own positions (Qwen3-VL's `_deepstack_process`); a
            # family with a mask and no rows reads the mask alone (found on ZAYA1-VL, not in the table)
            kwargs[self.spec.media_mask_input] = mx.concatenate(masks, axis=0)
            if self.spec.media_rows_dense:  # one (1, width, layers, H) a row, zeros for a row without media
                media_rows = {name: [mx.zeros_like(next(p for p in parts if p is not None)) if p is None else p
                                     for p in parts] for name, parts in media_rows.items()
                              if any(p is not None for p in parts)}
                kwargs.update({name: mx.concatenate(parts, axis=0) for name, parts in media_rows.items()})
            else:
                kwargs.update({name: mx.concatenate(parts, axis=1) for name, parts in media_rows.items()})
        layers.prepare_padded(batch, [n for *_, n in rows], width)
        logits = self._lm_forward(mx.concatenate(ids, axis=0), batch, inputs_embeds=mx.concatenate(embeds, axis=0),
                                  **kwargs)
        layers.finalize_padded(batch)
        mx.eval(layers.cache_arrays(batch))
        return layers.split_batch(batch, len(rows), [width - n for *_, n in rows]), logits

    @staticmethod
    def _check_range(encoded: EncodedRequest, start: int, end: int) -> None:
        if not 0 <= start <= end <= encoded.num_tokens:
            raise ValueError(f"bad prefill range [{start}, {end}) for a {encoded.num_tokens}-token prompt")

    def decode_positions(self, cache: list, rope_deltas: mx.array, width: int = 1) -> mx.array | None:
        """(3, B, width) positions of every row's next ``width`` tokens (M-RoPE), or None (1-D RoPE)."""
        return self.positions.decode_kwargs(cache, rope_deltas, width).get("position_ids")

    def decode(self, batch_cache: list, tokens: mx.array, rope_deltas: mx.array | None) -> mx.array:
        """One batched step: ``tokens`` (B,) are each row's input, ``rope_deltas`` (B,) each row's delta.
        Returns logits (B, V)."""
        return self.verify(batch_cache, mx.array(tokens).reshape(-1, 1), rope_deltas)[:, -1, :]

    def verify(self, batch_cache: list, inputs: mx.array, rope_deltas: mx.array | None) -> mx.array:
        """(B, n) inputs -> (B, n, V) logits: each row's next n tokens at its own positions."""
        kwargs = self.positions.decode_kwargs(batch_cache, _deltas(rope_deltas, inputs.shape[0]), inputs.shape[1])
        return self._lm_forward(inputs, batch_cache, **kwargs)

    def _lm_forward(self, inputs: mx.array, cache: list, **kwargs: Any) -> mx.array:
        """The language model on ``inputs``; M-RoPE positions (kept as (3, B, L) here) in the layout the family's
        language model reads (``FamilySpec.positions_last``: (B, L, 3))."""
        if self.spec.positions_last and kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"].transpose(1, 2, 0)
        return library.lm_forward(self.language_model, inputs, cache, **kwargs)

    def kv_layout(self) -> Any:
        """Bytes per token of each layer (and windows), measured on a one-token probe of the model's cache. Where
        that probe leaves a plain KV layer unwritten, on a probe of ``LONG_LAYOUT_PROBE`` tokens instead: mlx-vlm's
        GLM-5-Next writes the keys it projects for its sparse attention only on forwards of more than 8 positions
        (``mlx_vlm.models.linear.DECODE_BLOCK_SIZE``), and a prefill stores them for every prompt token."""
        for length in (1, LONG_LAYOUT_PROBE):
            cache = self.make_cache()
            probe = mx.zeros((1, length), dtype=mx.int32)
            self.verify(cache, probe, mx.zeros((1,), dtype=mx.int32))
            mx.eval(layers.cache_arrays(cache))
            if not layers.unwritten_kv(cache):
                break
        return layers.probe_layout(cache)

    def quantize_rule(self, bits: int, group_size: int, start: int) -> QuantizeRule:
        """When a request's cache converts under ``kv_bits``: the text engine's rule with mlx-vlm's prefill step
        (``library.quantized_kv_schedule``; ``layers.QuantizationRefused`` where mlx-vlm converts elsewhere)."""
        return QuantizeRule(bits, group_size, start, library.quantized_kv_schedule(self.model))

    def quantized_kv_layout(self, layout: Any, rule: QuantizeRule) -> Any:
        """``layout`` with each layer's bytes per token once quantized (``EngineConfig.kv_bits``), measured on a
        one-token probe converted as mlx-vlm converts (``layers.probe_quantized_layout``: a model whose attention
        cannot read a quantized cache, or whose head_dim the group does not divide, fails there, at configuration,
        with ``layers.QuantizationRefused``)."""
        probe, deltas = mx.array([[0]], dtype=mx.int32), mx.zeros((1,), dtype=mx.int32)
        quantized = layers.probe_quantized_layout(self.make_cache(), lambda cache: self.verify(cache, probe, deltas),
                                                  rule.group_size, rule.bits)
        return layout.quantized(rule, quantized)


@dataclass(frozen=True)
class _Unit:
    """One encoder input of ``encode_many``: a media item, or all of a request's media (``whole``)."""

    request: int  # index of its request in the call's items
    key: str  # the vision cache's key for its rows
    ids: mx.array  # (1, n) the prompt the encoders see
    mask: mx.array
    inputs: dict[str, Any]  # its media tensors, by name
    positions: tuple[int, ...]  # where in the encoders' embeddings of ``ids`` its rows are
    count: int  # encoder-budget units (``VisionCall.images``)
    whole: bool
    length: int  # the rows the encoders give for ``ids``: n, or more where they splice images in (``splice.py``)


@dataclass
class _Media:
    """The media rows (``(media tokens, H)``) and per-media-token extra inputs of an encoder unit, or of a request
    (its units' joined), from the vision cache (``hit``) or an encoder call (which, for a whole-request unit,
    also made the request's merged ``embeds`` and sequence inputs)."""

    rows: mx.array
    row_inputs: list
    hit: bool
    embeds: mx.array | None = None
    sequence_inputs: dict[str, mx.array] = field(default_factory=dict)
    seconds: float = 0.0
    encoded_items: int = 0  # of a request's: the media items its units put through the encoders in this call
    encoded_tokens: int = 0  # and their media tokens


def _shape_but(value: Any, axis: int) -> tuple:
    shape = tuple(getattr(value, "shape", ()))
    return shape[:axis] + shape[axis + 1:] if axis < len(shape) else shape


def _deltas(rope_deltas: Any, rows: int) -> mx.array:
    if rope_deltas is None:
        return mx.zeros((rows,), dtype=mx.int32)
    if isinstance(rope_deltas, mx.array) and rope_deltas.ndim == 1 and rope_deltas.dtype == mx.int32:
        return rope_deltas  # the executor's (B,) int32 deltas: no copy each decode tick
    return mx.array(rope_deltas).reshape(-1).astype(mx.int32)


def _attribute(obj: Any, path: str) -> Any:
    """``obj``'s attribute at a dotted ``path`` (None where any step is missing); a step into a dict reads its key
    (mlx-vlm keeps some configs' nested settings as dicts: Janus' ``vision_config.params``)."""
    for name in path.split("."):
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def _dense_rows(chunk_mask: mx.array, rows: mx.array, width: int) -> mx.array:
    """``FamilySpec.media_rows_dense``: a chunk's media rows ((layers, n, H), its n media positions' in order)
    spread over its ``width`` positions as (1, width, layers, H), zeros elsewhere (pads included)."""
    at = np.flatnonzero(np.array(chunk_mask[0]))
    dense = mx.zeros((width, rows.shape[0], rows.shape[-1]), dtype=rows.dtype)
    dense[mx.array(at)] = rows.transpose(1, 0, 2)
    return dense[None]


def _as_array(value: Any) -> Any:
    """Per-layer rows (Qwen3-VL's deepstack embeddings come as a list or a stacked array) as one array."""
    if value is None or isinstance(value, mx.array):
        return value
    return mx.stack(list(value))


def _placeholder(processor: Any, name: str) -> str | None:
    for holder in (processor, getattr(processor, "tokenizer", None)):
        value = getattr(holder, name, None) if holder is not None else None
        if isinstance(value, str) and value:
            return value
    return None


def adapter_for(model: Any, processor: Any, vision_cache: VisionCache | None = None, **options: Any) -> VLMAdapter:
    """The adapter for ``model``; ``UnsupportedFamily`` (a TypeError) for a family it does not batch."""
    return VLMAdapter(model, processor, vision_cache=vision_cache, **options)


__all__ = ["DEFAULT_VIDEO_FPS", "DEFAULT_VIDEO_MAX_FRAMES", "EncodedRequest", "MediaError", "PreparedRequest",
           "UnsupportedFamily", "VLMAdapter", "VisionCall", "adapter_for"]

"""Vision-language model adapters: the one place that reaches into mlx-vlm internals.

One adapter per model family (``Qwen2VLAdapter``: images and videos; ``Gemma4AudioAdapter``: audio, see its
docstring). It splits what ``mlx_vlm.generate`` does in one call into the pieces continuous batching needs:

``prepare``  CPU only: images -> PIL (validated), videos -> selected frames (``scheduler/models/media.py``), chat
             template, processor (expanded image / video pads, ``pixel_values`` + ``image_grid_thw`` or
             ``pixel_values_videos`` + ``video_grid_thw``), the content key for the vision cache.
``encode``   the vision tower (and only it; skipped on a ``VisionCache`` hit), the merge of image features into
             the text embeddings and the prompt's M-RoPE positions and rope delta.
``prefill``  the language model on ``embeddings[start:end]`` with their positions, into the request's own
             single-request cache (the cache ``mlx_vlm.generate`` builds).
``decode``   one batched step over a left-padded batch cache with explicit per-row positions.

Why explicit positions. Qwen2-VL's language model keeps M-RoPE state on the model instance
(``_position_ids``, ``_rope_deltas``) and, when called without ``position_ids``, derives decode positions from
that state and the cache offset. That state belongs to whichever request ran last, so a batch whose rows have
different rope deltas (each depends on that request's image grids; text-only is 0) decodes wrong. Every call
made here passes ``position_ids`` and never ``rope_deltas`` / ``pixel_values``, which is the path on which the
language model neither reads nor writes that state (pinned in tests/test_vlm_adapter.py).

Positions. ``get_rope_index`` gives a prompt (3, 1, L) positions (temporal, height, width); image tokens get
2-D grid positions, text tokens get the same value on all three axes, and the text after the last image
continues from the largest position so far. The rope delta is ``max_position + 1 - L``. mlx-vlm's own decode step
then uses ``cache_offset + rope_delta`` on all three axes. ``decode`` computes exactly that per row:
``offset[row]`` (real tokens in that row's cache; ``BatchKVCache.offset`` excludes left padding) +
``rope_deltas[row]``, broadcast to (3, B, 1).

The first token. As in the text executor, prefill everything but the last prompt token; feed the last prompt
token as the row's first decode input. That equals ``mlx_vlm.generate``'s first step (the merged embedding of a
text token is its token embedding, and its prompt position is ``(L - 1) + rope_delta``), which is why ``prepare``
refuses a prompt ending in an image/video pad token.

Videos. A video is decoded and its frames selected in ``scheduler/models/media.py`` (``fps`` by timestamp, capped at
``max_frames``), and the selected frames go to the processor as an already-sampled frame list: exactly what
``mlx_vlm.stream_generate(..., video=[frames])`` does with a frame list (its ``prepare_inputs`` samples only
file paths). The processor pads an odd frame count to the temporal patch (2) by repeating the last frame and
expands each ``<|video_pad|>`` to ``t*h*w / merge**2`` tokens. The vision tower takes
``(pixel_values_videos, video_grid_thw)`` the way it takes images, and ``get_rope_index`` gives video tokens 3-D
(t, h, w) grid positions, so the per-request rope delta (and every decode position) stays right for video rows
too. mlx-vlm's Qwen2-VL merges one kind of media per request (``get_input_embeddings`` takes the image pixels
when there are any and ignores the video pixels), so a request with both images and videos is refused. Chat
messages with videos are rendered with the model's own chat template (``processor.apply_chat_template``), which
puts each ``{"type": "video"}`` part where it is; mlx-vlm's ``apply_chat_template(video=...)`` puts the videos
at the start of *every* message, the system message included.

Internals touched (each behind one small function below, each pinned by a test):
``mlx_vlm.utils.prepare_inputs`` (+ ``should_add_special_tokens``), ``mlx_vlm.prompt_utils.apply_chat_template``,
``model.vision_tower(pixel_values, grid_thw, output_hidden_states=False)``,
``model.get_input_embeddings(..., cached_image_features=...)`` -> ``inputs_embeds / position_ids / rope_deltas``,
``model.language_model(inputs, inputs_embeds=, cache=, position_ids=)`` -> ``.logits``,
``mlx_vlm.models.cache.make_prompt_cache`` and the caches' ``offset``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
from PIL import Image, ImageOps

from caches.vision import VisionCache, content_key

from scheduler.models.media import (AudioInput, MediaError, VideoFrames, VideoInput, describe_source, load_audio, load_video,
                    validate_video_sampling)

ImageInput = Any  # PIL.Image.Image | str | os.PathLike | bytes | bytearray | memoryview

DEFAULT_VIDEO_FPS = 2.0  # Qwen2-VL's own default sampling rate
DEFAULT_VIDEO_MAX_FRAMES = 32


@dataclass
class PreparedRequest:
    """CPU-side preprocessing result; no model forward yet."""

    input_ids: list[int]  # the expanded prompt ids (image pads repeated): what the LM's cache will hold
    pixel_values: Any | None  # mx.array (num_patches, C*T*P*P) for all images in order, or None
    image_grid_thw: Any | None  # mx.array (num_images, 3) or None
    extras: dict  # model-specific kwargs from the processor (Qwen2-VL: attention_mask)
    media_key: str | None  # VisionCache key of the ordered image contents; None for text-only
    num_media_tokens: int
    prompt: str = ""  # the templated prompt text given to the processor
    num_images: int = 0
    pixel_values_videos: Any | None = None  # mx.array (num_patches, C*T*P*P) for all videos in order, or None
    video_grid_thw: Any | None = None  # mx.array (num_videos, 3) or None
    num_videos: int = 0
    video_frame_indices: tuple[tuple[int, ...], ...] = ()  # per video: the source frames selected
    audio_features: Any | None = None  # mx.array (num_audio, frames, mel bins): the feature extractor's output
    audio_features_mask: Any | None = None  # mx.array (num_audio, frames) bool, True = real frame
    num_audio: int = 0

    @property
    def num_media_items(self) -> int:
        """Encoder-budget units: one per image, one per temporal patch of each video (``grid_t``: two frames for
        Qwen2-VL), one per audio clip (at most 30 s for Gemma 4). An image is encoded as one temporal patch (its
        frame repeated), so a unit costs the vision tower about the same whatever its kind."""
        items = self.num_images + self.num_audio
        if self.num_videos and self.video_grid_thw is not None:
            items += int(mx.sum(self.video_grid_thw[:, 0]).item())
        return items

    def release_media(self) -> None:
        """Drop the pixel / audio arrays (after ``encode``; the features live in the cache / embeddings)."""
        self.pixel_values = None
        self.pixel_values_videos = None
        self.audio_features = None
        self.audio_features_mask = None


@dataclass
class EncodedRequest:
    """After the vision tower: everything prefill needs, for the whole prompt."""

    embeddings: mx.array  # (1, L, H) merged text + image input embeddings
    position_ids: mx.array  # (3, 1, L) int32 M-RoPE positions of the prompt
    rope_delta: int  # decode position of a row = tokens in its cache + rope_delta
    input_ids: mx.array | None = None  # (1, L) int32
    vision_cache_hit: bool | None = None  # None: no images / videos
    vision_time_s: float = 0.0  # vision tower wall time (0 on a hit)
    per_layer_inputs: mx.array | None = None  # Gemma 4: (1, L, layers, dim) per-layer token inputs

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[1])


# ================================================================================================
# mlx-vlm internals. Each function is the single place one internal is used; tests pin each one.
# ================================================================================================


def _vlm_chat_template(processor: Any, config: Any, messages: list[dict], num_images: int) -> str:
    """Chat messages -> prompt text with image placeholders rendered, exactly as mlx-vlm's CLI/server do it
    (``apply_chat_template`` adds the model family's placeholders and the generation prompt)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    return apply_chat_template(processor, config, messages, num_images=num_images)


def _vlm_video_chat_template(processor: Any, messages: list[dict]) -> str:
    """Chat messages holding ``{"type": "video"}`` parts -> prompt text, through the model's own chat template
    (each video placeholder where its part is, with the generation prompt)."""
    render = getattr(processor, "apply_chat_template", None)
    if render is None or not (getattr(processor, "chat_template", None)
                              or getattr(getattr(processor, "tokenizer", None), "chat_template", None)):
        raise ValueError("this model has no chat template for video messages; pass a templated prompt string")
    return render(messages, add_generation_prompt=True, tokenize=False)


def _vlm_prepare_inputs(model: Any, processor: Any, prompt: str, images: list | None,
                        videos: list | None = None, audio: list | None = None) -> dict:
    """The processor call ``mlx_vlm.stream_generate`` makes (``dispatch._prepare_generation_inputs``): same
    arguments, so the expanded ids and pixel values are identical to a solo run. ``videos`` is a list of frame
    lists (already sampled): ``prepare_inputs`` passes frame lists to the processor unchanged. ``audio`` is a
    list of float32 mono waveforms at the feature extractor's rate (``prepare_inputs`` passes arrays on as is)."""
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    return prepare_inputs(
        processor,
        images=images or None,
        videos=videos or None,
        audio=audio or None,
        prompts=prompt,
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
    )


def _vlm_vision_features(model: Any, pixel_values: mx.array, image_grid_thw: mx.array) -> mx.array:
    """The vision tower alone, as ``Model.get_input_embeddings`` calls it (cast to the tower's dtype first).
    Returns the merged patch features (num_image_tokens, hidden)."""
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixel_values.astype(dtype), image_grid_thw, output_hidden_states=False)


def _vlm_input_embeddings(model: Any, input_ids: mx.array, pixel_values: mx.array | None,
                          image_grid_thw: mx.array | None, mask: mx.array | None,
                          features: mx.array | None, videos: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """Embedding merge + prompt positions through ``Model.get_input_embeddings``.

    With ``cached_image_features`` it does not run the vision tower (the hook mlx-vlm's own vision cache uses),
    so the tower runs only in ``_vlm_vision_features``. Returns (inputs_embeds, position_ids, rope_deltas).
    ``get_rope_index`` is pure: it does not touch the language model's ``_position_ids`` / ``_rope_deltas``.
    ``videos=True``: ``pixel_values`` / ``image_grid_thw`` are the videos' (``pixel_values_videos`` /
    ``video_grid_thw``), which Qwen2-VL merges at the video tokens and positions with the video grids.
    """
    kwargs: dict[str, Any] = {"mask": mask}
    if pixel_values is not None and videos:
        kwargs["pixel_values_videos"] = pixel_values
        kwargs["video_grid_thw"] = image_grid_thw
        kwargs["cached_image_features"] = features
        pixel_values = None
    elif pixel_values is not None:
        kwargs["image_grid_thw"] = image_grid_thw
        kwargs["cached_image_features"] = features
    out = model.get_input_embeddings(input_ids, pixel_values, **kwargs)
    return out.inputs_embeds, out.position_ids, out.rope_deltas


def _vlm_make_cache(language_model: Any) -> list:
    """The cache ``mlx_vlm.stream_generate`` builds for one request (no ``max_kv_size``): one mlx-vlm
    ``KVCache`` per layer, which ``merge``s into mlx-vlm's left-padded ``BatchKVCache``."""
    from mlx_vlm.models import cache as vlm_cache

    return vlm_cache.make_prompt_cache(language_model)


def _vlm_lm_forward(language_model: Any, inputs: mx.array, cache: list, position_ids: mx.array,
                    inputs_embeds: mx.array | None = None) -> mx.array:
    """One language-model call with explicit ``position_ids`` (3, B, L). Given explicit positions (and no
    ``rope_deltas`` / ``pixel_values`` kwargs) Qwen2-VL's ``LanguageModel.__call__`` neither reads nor writes its
    per-instance rope state; it also does not re-slice positions whose length equals the input length."""
    out = language_model(inputs, inputs_embeds=inputs_embeds, cache=cache, position_ids=position_ids)
    return getattr(out, "logits", out)


def _cache_row_offsets(cache: list) -> mx.array:
    """(B,) tokens each row's cache holds. Single-request caches have an int ``offset``; mlx-vlm's
    ``BatchKVCache.offset`` is an array of real (non-padding) tokens per row."""
    offset = cache[0].offset
    if isinstance(offset, mx.array):
        return offset.reshape(-1).astype(mx.int32)
    return mx.array([int(offset)], dtype=mx.int32)


def _model_fingerprint(model: Any, processor: Any) -> str:
    """What besides the pixels decides the vision features: the model (class, config, vision weights) and the
    image processor's settings."""
    return _modules_fingerprint(model, ("vision_tower",), (getattr(processor, "image_processor", None),))


def _modules_fingerprint(model: Any, names: Sequence[str], components: Sequence[Any]) -> str:
    """Model class and config, the named submodules' weights (names, shapes and dtypes of all, a strided
    sample of each) and the settings of the given processor components.

    A strided sample (<= 1024 values) of every weight: any other checkpoint differs in it, and it costs
    milliseconds where hashing a real tower in full would take about a second."""
    from mlx.utils import tree_flatten

    def as_dict(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return dataclasses.asdict(obj)
        return getattr(obj, "__dict__", repr(obj))

    parts: list[Any] = [f"{type(model).__module__}.{type(model).__name__}",
                        json.dumps(as_dict(model.config), sort_keys=True, default=str)]
    for name in names:
        params = tree_flatten(getattr(model, name).parameters())
        parts.append(name)
        parts.append(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in params]))
        samples = [p.reshape(-1)[:: max(1, p.size // 1024)] for _, p in params]
        mx.eval(samples)
        parts += samples
    for component in components:
        if component is not None:
            parts += _processor_settings(component)
    return content_key(parts)


def _processor_settings(component: Any) -> list:
    settings = {k: v for k, v in vars(component).items()
                if isinstance(v, (int, float, str, bool, list, tuple, dict, type(None)))}
    return [type(component).__name__, json.dumps(settings, sort_keys=True, default=str)]


# ================================================================================================
# images
# ================================================================================================


_describe = describe_source


def load_image(source: ImageInput, index: int) -> Image.Image:
    """Decode one image fully (a truncated file fails here, not later) into RGB, with EXIF orientation applied
    the way ``mlx_vlm.utils.load_image`` does. Raises ``MediaError`` naming ``index``."""
    if isinstance(source, Image.Image):
        image = source
    else:
        data = _read_source(source, index)
        if not data:
            raise MediaError(index, f"empty image data ({_describe(source)})")
        try:
            image = Image.open(io.BytesIO(data))
        except Exception as exc:
            raise MediaError(index, f"not a readable image ({_describe(source)}): {type(exc).__name__}: {exc}") from exc
    try:
        image.load()  # force a full decode: truncated / corrupt data raises here
        width, height = image.size
        if width <= 0 or height <= 0:
            raise MediaError(index, f"zero-size image ({width}x{height})")
        image = ImageOps.exif_transpose(image)
        image = image.convert("RGB")
    except MediaError:
        raise
    except Exception as exc:
        raise MediaError(index, f"cannot decode image ({_describe(source)}): {type(exc).__name__}: {exc}") from exc
    if image.width <= 0 or image.height <= 0:
        raise MediaError(index, f"zero-size image ({image.width}x{image.height})")
    return image


def _read_source(source: Any, index: int) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        head, sep, payload = source.partition(",")
        if not sep or not head.startswith("data:image/") or ";base64" not in head:
            raise MediaError(index, "unsupported data URI (want data:image/...;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except Exception as exc:
            raise MediaError(index, f"bad base64 in data URI: {exc}") from exc
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise MediaError(index, "remote URLs are not fetched; pass the image bytes, a file path or a PIL image")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            if not path.exists():
                raise MediaError(index, f"file not found: {_describe(source)}")
            if not path.is_file():
                raise MediaError(index, f"not a regular file: {_describe(source)}")
            return path.read_bytes()
        except MediaError:
            raise
        except OSError as exc:
            raise MediaError(index, f"cannot read {_describe(source)}: {exc}") from exc
    raise MediaError(index, f"unsupported image type {type(source).__name__} "
                            "(want PIL.Image, a file path, bytes or a data:image URI)")


# ================================================================================================
# the adapter
# ================================================================================================


class _FamilyAdapter:
    """What every family adapter tells the engine about its model (the text helpers of scheduler/execution/library.py
    do not fit an mlx-vlm model). Subclasses set `model`, `processor`, `language_model`."""

    model: Any
    processor: Any
    language_model: Any

    @property
    def _lm_args(self) -> Any:
        return getattr(self.language_model, "args", None) or self.language_model.config

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def vocab_size(self) -> int:
        return int(self._lm_args.vocab_size)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self._lm_args, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """What ends generation in ``mlx_vlm.stream_generate``: the config's ``eos_token_id`` (int or list),
        plus the tokenizer's own eos."""
        ids: set[int] = set()
        for source in (getattr(self.model.config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return frozenset(ids)


    @staticmethod
    def _prefill_range_ok(cache: list, encoded: "EncodedRequest", start: int, end: int) -> bool:
        """Whether [start, end) has tokens to feed; ValueError if it is outside the prompt or the cache does not
        hold exactly `start` tokens."""
        length = encoded.num_tokens
        if not 0 <= start <= end <= length:
            raise ValueError(f"bad prefill range [{start}, {end}) for a {length}-token prompt")
        if end == start:
            return False
        held = int(_cache_row_offsets(cache)[0].item())
        if held != start:
            raise ValueError(f"prefill from {start} but the cache holds {held} tokens")
        return True

    def _prompt_ids(self, inputs: dict, media: str) -> list[int]:
        """The processor's (1, L) input ids as a list, checked: not empty, and not ending with a media token
        (the first decode step feeds the last prompt token as text)."""
        input_ids = inputs["input_ids"]
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"processor returned input_ids of shape {tuple(input_ids.shape)}, want (1, L)")
        ids = [int(t) for t in input_ids[0].tolist()]
        if not ids:
            raise ValueError("prompt tokenizes to nothing")
        if ids[-1] in self.media_token_ids:
            raise ValueError(f"the prompt must not end with {media} token: the first decode step feeds the last "
                             "prompt token as text (use the chat template, which ends with the generation prompt)")
        return ids


class Qwen2VLAdapter(_FamilyAdapter):
    """Qwen2-VL family adapter (``model_type`` in ``SUPPORTED_MODEL_TYPES``).

    ``vision_cache``: optional ``VisionCache``; ``encode`` consults it by ``PreparedRequest.media_key``.
    ``vision_encoder``: the callable ``(pixel_values, grid_thw) -> features`` that runs the vision tower (on
    images or on videos); replace it on the instance to instrument or offload it (tests wrap it to count calls).
    ``video_fps`` / ``video_max_frames``: the frame selection ``prepare`` uses when not given one
    (``scheduler/models/media.py``).
    """

    SUPPORTED_MODEL_TYPES = frozenset({"qwen2_vl"})

    def __init__(self, model: Any, processor: Any, vision_cache: VisionCache | None = None,
                 video_fps: float = DEFAULT_VIDEO_FPS, video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in self.SUPPORTED_MODEL_TYPES:
            raise TypeError(f"Qwen2VLAdapter does not support model_type {model_type!r}")
        self.model = model
        self.processor = processor
        self.language_model = model.language_model
        self.vision_cache = vision_cache
        self.vision_encoder: Callable[[mx.array, mx.array], mx.array] = self._encode_vision
        config = model.config
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.media_token_ids = frozenset({self.image_token_id, self.video_token_id})
        self.image_token = getattr(processor, "image_token", "<|image_pad|>")
        self.video_token = getattr(processor, "video_token", "<|video_pad|>")
        self.video_fps, self.video_max_frames = validate_video_sampling(video_fps, video_max_frames)
        self._fingerprint: str | None = None
        self._video_fingerprint: str | None = None

    # ---- identity ---------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Model + processor identity that goes into every media key (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = _model_fingerprint(self.model, self.processor)
        return self._fingerprint

    def media_key(self, pixel_values: mx.array, image_grid_thw: mx.array) -> str:
        """Content key of an ordered image list: the preprocessed pixels (the exact encoder input), the grid
        and the model/processor fingerprint. Independent of file names and of the prompt text."""
        return content_key(["qwen2_vl-vision", self.fingerprint, image_grid_thw.astype(mx.int64), pixel_values])

    def video_media_key(self, pixel_values_videos: mx.array, video_grid_thw: mx.array) -> str:
        """Content key of an ordered video list: the preprocessed pixels of the *selected* frames (so the same
        video sampled the same way hits, and another fps / cap that selects other frames does not), the grids,
        the model fingerprint and the video processor's settings. Independent of file names and prompt text."""
        if self._video_fingerprint is None:
            video_processor = getattr(self.processor, "video_processor", None)
            extra = _processor_settings(video_processor) if video_processor is not None else []
            self._video_fingerprint = content_key([self.fingerprint, *extra])
        return content_key(["qwen2_vl-video", self._video_fingerprint, video_grid_thw.astype(mx.int64),
                            pixel_values_videos])

    # ---- CPU side -----------------------------------------------------------------------------------
    def prepare(self, prompt: str | list[dict], images: Sequence[ImageInput] | None = (),
                videos: Sequence[VideoInput] | None = (), fps: float | None = None,
                max_frames: int | None = None) -> PreparedRequest:
        """CPU-side preprocessing of one request.

        ``prompt``: templated text, or chat messages (images: mlx-vlm's template, as ``mlx_vlm.generate`` does;
        videos: the model's own template, one ``{"type": "video"}`` part per video). ``videos``: file paths, raw
        bytes or frame lists; frames are selected at ``fps`` capped at ``max_frames`` (default: the adapter's
        ``video_fps`` / ``video_max_frames``; see ``scheduler/models/media.py``). An unusable image / video raises
        ``MediaError`` naming it; a bad prompt or mismatched placeholders raise ``ValueError``.
        """
        images = list(images) if images is not None else []
        videos = list(videos) if videos is not None else []
        fps, max_frames = validate_video_sampling(self.video_fps if fps is None else fps,
                                                  self.video_max_frames if max_frames is None else max_frames)
        if images and videos:
            raise ValueError("a request with both images and videos is not supported: mlx-vlm's Qwen2-VL merges "
                             "one kind of media per request")
        pil = [load_image(src, i) for i, src in enumerate(images)]
        clips: list[VideoFrames] = [load_video(src, i, fps, max_frames) for i, src in enumerate(videos)]
        if isinstance(prompt, str):
            text = prompt  # already templated
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
            if not prompt:
                raise ValueError("no messages")
            if clips:
                text = _vlm_video_chat_template(self.processor, list(prompt))
            else:
                text = _vlm_chat_template(self.processor, self.model.config, list(prompt), num_images=len(pil))
        else:
            raise TypeError(f"prompt must be a templated str or a list of chat messages, got {type(prompt).__name__}")
        if not text:
            raise ValueError("empty prompt")
        placeholders = text.count(self.image_token)
        if placeholders != len(pil):
            raise ValueError(f"prompt has {placeholders} image placeholder(s) ({self.image_token}) "
                             f"for {len(pil)} image(s)")
        video_placeholders = text.count(self.video_token)
        if video_placeholders != len(clips):
            raise ValueError(f"prompt has {video_placeholders} video placeholder(s) ({self.video_token}) "
                             f"for {len(clips)} video(s)")
        frame_lists = [clip.frames for clip in clips]
        try:
            inputs = _vlm_prepare_inputs(self.model, self.processor, text, pil, frame_lists or None)
        except Exception as exc:
            self._blame_image(pil, exc)
            self._blame_video(frame_lists, exc)
            raise
        ids = self._prompt_ids(inputs, "an image/video")
        pixel_values = inputs.get("pixel_values") if pil else None
        grid = inputs.get("image_grid_thw") if pil else None
        video_pixels = inputs.get("pixel_values_videos") if clips else None
        video_grid = inputs.get("video_grid_thw") if clips else None
        num_media = sum(1 for t in ids if t in self.media_token_ids)
        merge = int(getattr(self.model.config.vision_config, "spatial_merge_size", 2))
        for kind, grids, present in (("image", grid, pil), ("video", video_grid, clips)):
            if not present:
                continue
            if grids is None or grids.shape[0] != len(present):
                raise ValueError(f"processor returned no {kind} grid for {len(present)} {kind}(s)")
            expected = int(mx.sum(mx.prod(grids, axis=-1)).item()) // (merge * merge)
            if expected != num_media:
                raise ValueError(f"prompt holds {num_media} {kind} tokens but the {kind}s need {expected}")
        if pil:
            media_key = self.media_key(pixel_values, grid)
        elif clips:
            media_key = self.video_media_key(video_pixels, video_grid)
        else:
            media_key = None
        extras = {k: v for k, v in inputs.items()
                  if k not in ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
        return PreparedRequest(
            input_ids=ids,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            extras=extras,
            media_key=media_key,
            num_media_tokens=num_media,
            prompt=text,
            num_images=len(pil),
            pixel_values_videos=video_pixels,
            video_grid_thw=video_grid,
            num_videos=len(clips),
            video_frame_indices=tuple(clip.indices for clip in clips),
        )

    def _blame_image(self, pil: list[Image.Image], exc: Exception) -> None:
        """The processor failed on the whole list: find the first image it refuses alone and name it."""
        image_processor = getattr(self.processor, "image_processor", None)
        if image_processor is None:
            return
        for i, image in enumerate(pil):
            try:
                image_processor(images=[image])
            except Exception as one:
                raise MediaError(i, f"rejected by the image processor ({image.width}x{image.height}): "
                                    f"{type(one).__name__}: {one}") from exc

    def _blame_video(self, frame_lists: list[list], exc: Exception) -> None:
        """The same for videos: the first video the video processor refuses alone."""
        video_processor = getattr(self.processor, "video_processor", None) or getattr(
            self.processor, "image_processor", None)
        if video_processor is None:
            return
        for i, frames in enumerate(frame_lists):
            try:
                video_processor(videos=[frames])
            except Exception as one:
                h, w = frames[0].shape[:2]
                raise MediaError(i, f"rejected by the video processor ({len(frames)} frames of {w}x{h}): "
                                    f"{type(one).__name__}: {one}", "video") from exc

    # ---- device side ----------------------------------------------------------------------------------
    def _encode_vision(self, pixel_values: mx.array, image_grid_thw: mx.array) -> mx.array:
        return _vlm_vision_features(self.model, pixel_values, image_grid_thw)

    def encode(self, prepared: PreparedRequest) -> EncodedRequest:
        """Vision tower (unless the vision cache has these images / videos) + embedding merge + prompt positions.
        Everything returned is evaluated."""
        ids = mx.array(prepared.input_ids, dtype=mx.int32)[None]
        mask = prepared.extras.get("attention_mask")
        if mask is None:
            mask = mx.ones(ids.shape, dtype=mx.int32)
        hit: bool | None = None
        vision_time = 0.0
        features = None
        videos = bool(getattr(prepared, "num_videos", 0))
        if videos:
            pixels, grid, kind = prepared.pixel_values_videos, prepared.video_grid_thw, "video"
        else:
            pixels, grid, kind = prepared.pixel_values, prepared.image_grid_thw, "image"
        has_media = bool(prepared.num_images) or videos
        if has_media:
            if pixels is None:
                raise ValueError("pixel values were released before encode")
            key = prepared.media_key
            if self.vision_cache is not None and key is not None:
                features = self.vision_cache.get(key)
            hit = features is not None
            if features is None:
                t0 = time.perf_counter()
                features = self.vision_encoder(pixels, grid)
                mx.eval(features)
                vision_time = time.perf_counter() - t0
                if self.vision_cache is not None and key is not None:
                    self.vision_cache.put(key, features, vision_time)
            if features.shape[0] != prepared.num_media_tokens:
                raise ValueError(f"vision features have {features.shape[0]} rows for "
                                 f"{prepared.num_media_tokens} {kind} tokens")
        embeds, positions, deltas = _vlm_input_embeddings(
            self.model, ids, pixels if has_media else None, grid, mask, features, videos=videos)
        positions = _as_mrope_positions(positions, ids.shape[1])
        rope_delta = int(mx.array(deltas).reshape(-1)[0].item()) if deltas is not None else 0
        mx.eval(embeds, positions)
        return EncodedRequest(embeddings=embeds, position_ids=positions, rope_delta=rope_delta, input_ids=ids,
                              vision_cache_hit=hit, vision_time_s=vision_time)

    def make_cache(self) -> list:
        return _vlm_make_cache(self.language_model)

    def prefill(self, cache: list, encoded: EncodedRequest, start: int, end: int) -> None:
        """Run the language model on prompt positions [start, end) into ``cache`` (which must hold exactly
        ``start`` tokens). Logits are not computed (only the cache is evaluated)."""
        if not self._prefill_range_ok(cache, encoded, start, end):
            return
        ids = encoded.input_ids
        inputs = ids[:, start:end] if ids is not None else mx.zeros((1, end - start), mx.int32)
        _vlm_lm_forward(self.language_model, inputs, cache, encoded.position_ids[:, :, start:end],
                        inputs_embeds=encoded.embeddings[:, start:end])
        mx.eval([c.state for c in cache])

    def decode_positions(self, cache: list, rope_deltas: mx.array) -> mx.array:
        """(3, B, 1) positions of the next token of every row: tokens already in that row's cache + its delta."""
        offsets = _cache_row_offsets(cache)
        deltas = mx.array(rope_deltas).reshape(-1).astype(mx.int32)
        if deltas.shape[0] != offsets.shape[0]:
            raise ValueError(f"{deltas.shape[0]} rope deltas for a batch of {offsets.shape[0]} rows")
        positions = (offsets + deltas)[:, None]
        return mx.broadcast_to(positions[None], (3, positions.shape[0], 1))

    def decode(self, batch_cache: list, tokens: mx.array, rope_deltas: mx.array) -> mx.array:
        """One batched step: ``tokens`` (B,) are each row's input, ``rope_deltas`` (B,) each row's delta.
        Returns logits (B, V). Uses no per-instance state of the model."""
        tokens = mx.array(tokens).reshape(-1, 1)
        positions = self.decode_positions(batch_cache, rope_deltas)  # before the forward moves the offsets
        logits = _vlm_lm_forward(self.language_model, tokens, batch_cache, positions)
        return logits[:, -1, :]


# ================================================================================================
# Gemma 4 (text + audio)
# ================================================================================================


def _g4_text_embeddings(model: Any, input_ids: mx.array) -> tuple[mx.array, mx.array | None]:
    """``Model.get_input_embeddings`` with no media: the scaled token embeddings and the per-layer inputs (with
    media token ids zeroed, as mlx-vlm computes them whatever the media)."""
    out = model.get_input_embeddings(input_ids)
    return out.inputs_embeds, getattr(out, "per_layer_inputs", None)


def _g4_audio_features(model: Any, input_features: mx.array, input_features_mask: mx.array) -> mx.array:
    """The audio tower + projection alone, exactly as ``get_input_embeddings``' ``_encode_audio`` runs it
    (mask inverted: the extractor marks real frames True, the tower wants padding True)."""
    audio_mask = ~input_features_mask.astype(mx.bool_)
    encoded, _ = model.audio_tower(input_features, audio_mask)
    return model.embed_audio(encoded)


def _g4_merge_audio(model: Any, input_ids: mx.array, embeds: mx.array, features: mx.array) -> mx.array:
    """Audio features into the audio-token positions with mlx-vlm's own ``masked_scatter`` (the same call,
    so the merged embeddings are those of a solo run)."""
    from mlx_vlm.models.gemma4.gemma4 import masked_scatter

    mask = mx.broadcast_to(mx.expand_dims(input_ids == model.config.audio_token_id, -1), embeds.shape)
    return masked_scatter(embeds, mask, features.astype(embeds.dtype))


def _g4_lm_forward(language_model: Any, inputs: mx.array | None, cache: list,
                   inputs_embeds: mx.array | None = None, per_layer_inputs: mx.array | None = None) -> mx.array:
    """One Gemma 4 language-model call. With ``inputs_embeds`` (prefill) the per-layer inputs of those positions
    are given explicitly; with token ids (decode) the model derives both from the ids, as in a solo decode step.
    Positions come from each cache row's offset (plain RoPE: no per-request position state)."""
    out = language_model(inputs, inputs_embeds=inputs_embeds, cache=cache, per_layer_inputs=per_layer_inputs)
    return getattr(out, "logits", out)


class Gemma4AudioAdapter(_FamilyAdapter):
    """Gemma 4 adapter for text + audio requests (``model_type`` ``gemma4`` with an audio tower).

    The same seam as ``Qwen2VLAdapter``: ``prepare`` (audio -> waveforms at the extractor's rate, mlx-vlm's chat
    template, the processor's expanded ``<|audio|>`` tokens and log-mel ``input_features``, the content key),
    ``encode`` (the audio tower, skipped on a cache hit, merged with mlx-vlm's ``masked_scatter``; per-layer
    inputs), ``prefill`` (embeddings + per-layer inputs of a range into the request's own cache: one
    ``RotatingKVCache`` per sliding layer, one ``KVCache`` per full layer, as ``mlx_vlm.generate`` builds them) and
    ``decode`` (one batched step from token ids over mlx-vlm's ``BatchRotatingKVCache`` / ``BatchKVCache``).
    Gemma 4 uses plain RoPE from each row's cache offset, so every rope delta is 0. Images and videos are not
    handled by this adapter yet (refused).

    ``audio_encoder``: the callable ``(input_features, input_features_mask) -> features``; replace it on the
    instance to instrument it. The ``VisionCache`` holds audio features too (keys are namespaced).
    """

    SUPPORTED_MODEL_TYPES = frozenset({"gemma4"})

    def __init__(self, model: Any, processor: Any, vision_cache: VisionCache | None = None,
                 video_fps: float = DEFAULT_VIDEO_FPS, video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in self.SUPPORTED_MODEL_TYPES:
            raise TypeError(f"Gemma4AudioAdapter does not support model_type {model_type!r}")
        if getattr(model, "audio_tower", None) is None:
            raise TypeError("this gemma4 checkpoint has no audio tower (audio_config is missing)")
        extractor = getattr(processor, "feature_extractor", None)
        if extractor is None:
            raise TypeError("the gemma4 processor has no audio feature extractor")
        validate_video_sampling(video_fps, video_max_frames)  # accepted for a uniform constructor; unused here
        self.model = model
        self.processor = processor
        self.language_model = model.language_model
        self.vision_cache = vision_cache
        self.audio_encoder: Callable[[mx.array, mx.array], mx.array] = self._encode_audio
        config = model.config
        self.audio_token_id = int(config.audio_token_id)
        placeholders = (config.audio_token_id, config.image_token_id, getattr(config, "video_token_id", None))
        self.media_token_ids = frozenset(int(t) for t in placeholders if t is not None)
        self.audio_token = getattr(processor, "audio_token", "") or "<|audio|>"
        self.image_token = getattr(processor, "image_token", "") or "<|image|>"
        self.sample_rate = int(getattr(extractor, "sampling_rate", 16000))
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _modules_fingerprint(self.model, ("audio_tower", "embed_audio"),
                                                     (getattr(self.processor, "feature_extractor", None),))
        return self._fingerprint

    def media_key(self, input_features: mx.array, input_features_mask: mx.array) -> str:
        """Content key of an ordered audio list: the extractor's log-mel features (the exact encoder input) and
        their mask, and the model / extractor fingerprint. Independent of file names and prompt text."""
        return content_key(["gemma4-audio", self.fingerprint, input_features_mask.astype(mx.uint8), input_features])

    # ---- CPU side -------------------------------------------------------------------------------
    def prepare(self, prompt: str | list[dict], images: Sequence[ImageInput] | None = (),
                videos: Sequence[VideoInput] | None = (), audio: Sequence[AudioInput] | None = (),
                fps: float | None = None, max_frames: int | None = None) -> PreparedRequest:
        """CPU-side preprocessing. ``audio``: WAV (or other audio) paths, their bytes, or
        ``(samples, sample_rate)``; see ``scheduler/models/media.py``. Chat messages are rendered with mlx-vlm's
        template (``num_audios``), as ``mlx_vlm.generate`` does."""
        if images or videos:
            raise ValueError("the gemma4 adapter takes text and audio; images and videos are not supported yet")
        clips = list(audio) if audio is not None else []
        waves = [load_audio(src, i, self.sample_rate) for i, src in enumerate(clips)]
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
            if not prompt:
                raise ValueError("no messages")
            from mlx_vlm.prompt_utils import apply_chat_template

            text = apply_chat_template(self.processor, self.model.config, list(prompt), num_audios=len(waves))
        else:
            raise TypeError(f"prompt must be a templated str or a list of chat messages, got {type(prompt).__name__}")
        if not text:
            raise ValueError("empty prompt")
        if self.image_token in text:
            raise ValueError(f"the prompt holds an image placeholder ({self.image_token}); images are not supported")
        placeholders = text.count(self.audio_token)
        if placeholders != len(waves):
            raise ValueError(f"prompt has {placeholders} audio placeholder(s) ({self.audio_token}) "
                             f"for {len(waves)} audio clip(s)")
        try:
            inputs = _vlm_prepare_inputs(self.model, self.processor, text, None, audio=waves or None)
        except Exception as exc:
            self._blame_audio(waves, exc)
            raise
        ids = self._prompt_ids(inputs, "an audio")
        num_media = sum(1 for t in ids if t == self.audio_token_id)
        features = inputs.get("input_features") if waves else None
        mask = inputs.get("input_features_mask") if waves else None
        if waves and (features is None or mask is None):
            raise ValueError("the processor returned no audio features")
        extras = {k: v for k, v in inputs.items() if k == "attention_mask"}
        return PreparedRequest(
            input_ids=ids, pixel_values=None, image_grid_thw=None, extras=extras,
            media_key=self.media_key(features, mask) if waves else None,
            num_media_tokens=num_media, prompt=text, num_images=0,
            audio_features=features, audio_features_mask=mask, num_audio=len(waves),
        )

    def _blame_audio(self, waves: list, exc: Exception) -> None:
        extractor = getattr(self.processor, "feature_extractor", None)
        if extractor is None:
            return
        for i, wave in enumerate(waves):
            try:
                extractor([wave], sampling_rate=self.sample_rate, return_attention_mask=True)
            except Exception as one:
                raise MediaError(i, f"rejected by the audio feature extractor ({wave.shape[0]} samples): "
                                    f"{type(one).__name__}: {one}", "audio") from exc

    # ---- device side ----------------------------------------------------------------------------
    def _encode_audio(self, input_features: mx.array, input_features_mask: mx.array) -> mx.array:
        return _g4_audio_features(self.model, input_features, input_features_mask)

    def encode(self, prepared: PreparedRequest) -> EncodedRequest:
        """Audio tower (unless the cache has these clips) + merge + per-layer inputs; all evaluated."""
        ids = mx.array(prepared.input_ids, dtype=mx.int32)[None]
        embeds, per_layer = _g4_text_embeddings(self.model, ids)
        hit: bool | None = None
        audio_time = 0.0
        if getattr(prepared, "num_audio", 0):
            if prepared.audio_features is None:
                raise ValueError("audio features were released before encode")
            key = prepared.media_key
            features = self.vision_cache.get(key) if self.vision_cache is not None and key is not None else None
            hit = features is not None
            if features is None:
                t0 = time.perf_counter()
                features = self.audio_encoder(prepared.audio_features, prepared.audio_features_mask)
                mx.eval(features)
                audio_time = time.perf_counter() - t0
                if self.vision_cache is not None and key is not None:
                    self.vision_cache.put(key, features, audio_time)
            rows = int(features.size // features.shape[-1])
            if rows < prepared.num_media_tokens:
                raise ValueError(f"audio features have {rows} rows for {prepared.num_media_tokens} audio tokens")
            embeds = _g4_merge_audio(self.model, ids, embeds, features)
        length = ids.shape[1]
        positions = mx.broadcast_to(mx.arange(length, dtype=mx.int32)[None, None], (3, 1, length))
        mx.eval([a for a in (embeds, per_layer) if a is not None])
        return EncodedRequest(embeddings=embeds, position_ids=positions, rope_delta=0, input_ids=ids,
                              vision_cache_hit=hit, vision_time_s=audio_time, per_layer_inputs=per_layer)

    def make_cache(self) -> list:
        return self.language_model.make_cache()

    def prefill(self, cache: list, encoded: EncodedRequest, start: int, end: int) -> None:
        if not self._prefill_range_ok(cache, encoded, start, end):
            return
        per_layer = encoded.per_layer_inputs[:, start:end] if encoded.per_layer_inputs is not None else None
        _g4_lm_forward(self.language_model, None, cache, inputs_embeds=encoded.embeddings[:, start:end],
                       per_layer_inputs=per_layer)
        mx.eval([c.state for c in cache])

    def decode(self, batch_cache: list, tokens: mx.array, rope_deltas: mx.array | None = None) -> mx.array:
        """One batched step from each row's input token; ``rope_deltas`` are ignored (all 0 for Gemma 4)."""
        tokens = mx.array(tokens).reshape(-1, 1)
        return _g4_lm_forward(self.language_model, tokens, batch_cache)[:, -1, :]


def _as_mrope_positions(positions: mx.array, length: int) -> mx.array:
    """(3, 1, L) int32. Text-only prompts come back from ``get_rope_index`` as (1, L): the same position on
    every axis, which (3, 1, L) states explicitly (the rotary embedding gives the same angles either way)."""
    if positions.ndim == 2:
        positions = mx.broadcast_to(positions[None], (3, *positions.shape))
    if positions.shape != (3, 1, length):
        raise ValueError(f"unexpected prompt position shape {tuple(positions.shape)}")
    return positions.astype(mx.int32)


ADAPTERS: dict[str, type] = {"qwen2_vl": Qwen2VLAdapter, "gemma4": Gemma4AudioAdapter}


def adapter_for(model: Any, processor: Any, vision_cache: VisionCache | None = None,
                **options: Any) -> Qwen2VLAdapter | Gemma4AudioAdapter:
    """The adapter for ``model``'s family; TypeError for an unsupported one. ``options`` (e.g. ``video_fps``,
    ``video_max_frames``) go to the adapter's constructor."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = ADAPTERS.get(model_type)
    if cls is None:
        raise TypeError(f"no VLM adapter for model_type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}")
    return cls(model, processor, vision_cache=vision_cache, **options)


__all__ = ["ADAPTERS", "DEFAULT_VIDEO_FPS", "DEFAULT_VIDEO_MAX_FRAMES", "EncodedRequest", "Gemma4AudioAdapter",
           "MediaError", "PreparedRequest", "Qwen2VLAdapter", "adapter_for", "load_audio", "load_image", "load_video"]

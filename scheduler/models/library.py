"""The library seam of the model layer: the one place it reaches into mlx-vlm (its mlx-lm counterpart is
``scheduler/execution/library.py``). Each function wraps one internal; tests pin each one
(tests/models/test_vlm_adapter.py, tests/models/test_vlm_families.py).

``prepare_inputs``        the processor call ``mlx_vlm.stream_generate`` makes (same arguments, so the expanded ids
                          and pixel values equal a solo run's), without the feature extractor's per-clip warning
                          that no sample rate was passed.
``chat_template``         mlx-vlm's ``apply_chat_template`` (the family's placeholders + generation prompt), with
                          the template called without kwargs it does not read (no per-request warning);
                          ``own_chat_template``: the model's own template (messages with videos).
``processor_markups``     mlx-lm's tool-parser inference (``_infer_tool_parser``) on a processor's chat template,
                          and its reasoning markers (``_infer_thinking``) in the vocabulary.
``input_embeddings``      ``Model.get_input_embeddings``: the encoder(s) and the merge, as ``mlx_vlm.generate``
                          calls it; also with no media (the text path).
``mrope_tokens``          what the M-RoPE families' ``get_rope_index`` reads from the config (media token ids, patch
                          merge), for our own ``positions.mrope_index``; ``canvas_rope``: MiniCPM-V 4.7's own
                          ``CanvasRoPE``, for ``positions.canvas_index``.
``lm_forward``            one language-model call with ``inputs_embeds`` or token ids and explicit kwargs.
``prefills_in_one_forward`` mlx-vlm's chunked-prefill policy (``generate.common._chunked_prefill_enabled``) for a
                          prompt: whether ``mlx_vlm.generate`` prefills it in one forward, no draft model.
``make_cache``            the cache ``mlx_vlm.stream_generate`` builds (``make_prompt_cache``), or rotating caches
                          of ``max_kv_size`` tokens.
``row_offsets``           tokens each row of a single or batch cache holds.
``splice_marker``         the id a spliced family's merge puts an image's rows at (its config's, or its module's);
                          ``tower_rows_per_view``: a LLaVA-NeXT-style tower's rows a view (a class row or not).
``quantized_kv_schedule`` where ``mlx_vlm.generate_step`` checks ``quantized_kv_start`` during a prompt (its
                          default ``prefill_step_size``), for the engine's ``kv_bits`` on these models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from caches.layers import QuantizationRefused
from caches.vision import content_key


def prepare_inputs(model: Any, processor: Any, prompt: str, images: list | None, videos: list | None = None,
                   audio: list | None = None, video_sources: list | None = None, video_rates: list | None = None,
                   channels_first: bool = False) -> dict:
    """``videos``: frame lists (already sampled), each passed on as one ``(frames, H, W, 3)`` array, as mlx-vlm's
    ``load_video`` hands the processor a decoded file (Nemotron's processor takes a video only so: a list of
    frames raised "Cannot handle this data type" in it), or ``(frames, 3, H, W)`` with ``channels_first``
    (``FamilySpec.video_channels_first``: Gemma 4's). ``video_sources``: per video, ``(total_frames,
    source_fps, frame_indices)`` of a decoded file, or None for a frame list. ``video_rates``: per video, the
    rate a file's frames were sampled at, or None for a frame list, for a processor that stamps frame j at j /
    ``fps`` (``FamilySpec.video_rate``); given, it goes as mlx-vlm's ``fps`` instead of ``video_metadata``.
    ``audio``: float32 mono waveforms at the feature extractor's rate (passed on as is)."""
    from mlx_vlm.utils import prepare_inputs as vlm_prepare_inputs, should_add_special_tokens

    extra = {}
    if videos and video_rates is not None:
        rates = stamp_rates(processor, video_rates)
        if rates is not None:
            extra["fps"] = rates
    elif videos:
        metadata = video_metadata(processor, videos, video_sources)
        if metadata is not None:
            extra["video_metadata"] = metadata
    with _no_missing_rate_warning(processor) if audio else contextlib.nullcontext():
        return vlm_prepare_inputs(
            processor,
            images=images or None,
            videos=[video_array(frames, channels_first) for frames in videos] if videos else None,
            audio=audio or None,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
            **extra,
        )


def video_array(frames: list, channels_first: bool = False) -> np.ndarray:
    """One video's frames as the processor takes them: ``(frames, H, W, 3)``, or ``(frames, 3, H, W)`` (mlx-vlm's
    ``load_video`` layout) with ``channels_first``."""
    video = np.stack([np.asarray(frame) for frame in frames])
    return np.ascontiguousarray(video.transpose(0, 3, 1, 2)) if channels_first else video


def processor_frame_cap(processor: Any) -> int | None:
    """The most frames a video keeps in this processor, as mlx-vlm's ``processor_video_sampling`` reads it (Gemma
    4's ``video_sampling_defaults``: its ``num_frames``), or None when it declares none."""
    from mlx_vlm.utils import processor_video_sampling

    cap = processor_video_sampling(processor).max_frames
    return int(cap) if cap is not None else None


def stamp_rates(processor: Any, rates: list) -> list[float] | None:
    """The ``fps`` per video to give mlx-vlm for a processor that stamps frame j at ``j / fps`` (Gemma 4's
    ``mm:ss``, seconds truncated): each file's sampling rate, so frame j is stamped with the time it is on screen
    (``media.sampling_rate``); a frame list (None) gets the rate mlx-vlm gives one (its resolved sampling fps).
    None when every video is a frame list, so such a request calls mlx-vlm exactly as before. Each rate is lowered
    by a relative 1e-12 (as ``media`` keeps exact ratios exact with 1e-9): the processor's float ``j / fps`` falls
    one ulp short of a whole second about once in a thousand frames (frame 16 of 32 of a 246 s clip at 1 fps:
    122.99999999999999, stamped 02:02 for 02:03); the nudge moves a time by under 1e-8 s for a 3-hour clip, and a
    time that is not a whole second (k / fps, or k x total / (cap x source fps)) lies far further from the next."""
    if all(rate is None for rate in rates):
        return None
    from mlx_vlm.utils import resolve_video_sampling

    default = resolve_video_sampling(processor, {}).fps
    return [default if rate is None else float(rate) * (1 - 1e-12) for rate in rates]


def video_metadata(processor: Any, videos: list, sources: list | None) -> list | None:
    """The ``VideoMetadata`` mlx-vlm's ``prepare_inputs`` gives the processor for each video, with a decoded
    file's own: its frame rate and the source frames we selected, as mlx-vlm's ``load_video`` reports a file it
    samples itself. Without it, ``prepare_inputs`` takes any frames as sampled from frame 0 at the processor's
    own ``fps``, and the processors that write each frame group's time into the prompt (Qwen3-VL's ``<t
    seconds>``, Qwen3.5's, GLM-5-Next's, Mage-VL's, Nemotron Omni's) stamp it wrong whenever our selection is
    not that: a 40 s clip capped at 32 frames was told it ended at 15.2 s, a clip sampled at ``video_fps=1`` ran
    at twice its speed. A frame list (no source) keeps mlx-vlm's own metadata (the processor's rate, positions
    0..n-1); None when no video has a source, so such a request calls mlx-vlm exactly as before."""
    if not sources or all(source is None for source in sources):
        return None
    from mlx_vlm.utils import VideoMetadata, resolve_video_sampling

    rate = resolve_video_sampling(processor, {}).fps
    out = []
    for frames, source in zip(videos, sources):
        if source is None:
            out.append(VideoMetadata(total_num_frames=len(frames), fps=rate, frames_indices=list(range(len(frames)))))
            continue
        total, fps, indices = source
        out.append(VideoMetadata(total_num_frames=int(total), fps=float(fps), frames_indices=[int(i) for i in indices],
                                 duration=total / fps))
    return out


class _MissingRateWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pass the `sampling_rate` argument" not in record.getMessage()


@contextlib.contextmanager
def _no_missing_rate_warning(processor: Any):
    """transformers' audio feature extractors (Whisper's, which Qwen3-Omni's processor uses) log a warning for
    every clip called without ``sampling_rate``, and mlx-vlm forwards only the keywords a processor's signature
    names, so a processor that routes the rate through ``**kwargs`` can never get it (mlx-vlm's generate logs it
    too). The clips are at the extractor's own rate (``scheduler.models.media`` resamples them), so the warning
    is only noise: filtered on the extractor module's logger for the call."""
    extractor = getattr(processor, "feature_extractor", None)
    if extractor is None:
        yield
        return
    logger, quiet = logging.getLogger(type(extractor).__module__), _MissingRateWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def chat_template(processor: Any, config: Any, messages: list[dict], num_images: int = 0,
                  num_audios: int = 0, template_kwargs: dict[str, Any] | None = None) -> str:
    """Chat messages -> prompt text exactly as mlx-vlm's ``apply_chat_template`` renders them (its per-family
    messages with placeholders, then the chat template with the generation prompt unless ``template_kwargs`` end
    it otherwise), but calling the template the way transformers wants: mlx-vlm passes ``enable_thinking=False``
    to every template, and a processor
    whose template does not use it prints a "processor_kwargs" warning per request; we pass it only to a
    template that reads it (what it renders is the same either way). ``template_kwargs`` (``tools``, a
    request's ``chat_template_kwargs``) go to the template after that default, so they can turn thinking on;
    a model without a chat template cannot take them (ValueError)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    rendered = apply_chat_template(processor, config, messages, return_messages=True, num_images=num_images,
                                   num_audios=num_audios)
    template_processor = _template_holder(processor)
    if template_processor is None:  # no template: mlx-vlm's own rendering
        if template_kwargs:
            raise ValueError(f"this model has no chat template to pass {sorted(template_kwargs)} to")
        return apply_chat_template(processor, config, messages, num_images=num_images, num_audios=num_audios)
    kwargs = {"enable_thinking": False} if _template_mentions(template_processor, "enable_thinking") else {}
    return template_processor.apply_chat_template(rendered, tokenize=False, **{
        "add_generation_prompt": True, **kwargs, **_as_mlx_vlm_passes(template_kwargs)})


def _template_holder(processor: Any) -> Any:
    """What renders the chat template, as mlx-vlm's ``get_chat_template`` picks it: the processor where it has a
    template and can apply it, else its tokenizer where that has one (Phi-4-reasoning-vision's processor keeps the
    template but has no ``apply_chat_template``), else None."""
    for holder in (processor, getattr(processor, "tokenizer", None)):
        if hasattr(holder, "apply_chat_template") and getattr(holder, "chat_template", None) is not None:
            return holder
    return None


def own_chat_template(processor: Any, messages: list[dict], template_kwargs: dict[str, Any] | None = None,
                      on_tokenizer: bool = False) -> str:
    """The model's own chat template on messages holding media parts (each placeholder where its part is): the
    processor's, else its tokenizer's (as mlx-vlm's ``get_chat_template`` picks; Nemotron's processor keeps none);
    the tokenizer's first with ``on_tokenizer`` (Gemma 4: mlx-vlm's ``Gemma4Processor.apply_chat_template`` renders
    a video part only with its source, and drops the engine's source-less parts)."""
    if (on_tokenizer or getattr(processor, "chat_template", None) is None) and getattr(
            getattr(processor, "tokenizer", None), "chat_template", None) is not None:
        processor = processor.tokenizer
    return processor.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True,
                                                                      **_as_mlx_vlm_passes(template_kwargs)})


def _as_mlx_vlm_passes(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Template arguments as mlx-vlm's ``get_chat_template`` passes them: each tool schema with its keys sorted
    (so that equal schemas render equal prompts)."""
    kwargs = dict(template_kwargs or {})
    if "tools" in kwargs:
        from mlx_vlm.prompt_utils import _sort_tool_schema_keys

        kwargs["tools"] = _sort_tool_schema_keys(kwargs["tools"])
    return kwargs


@dataclass(frozen=True)
class ToolCallMarkup:
    """How a model writes tool calls, as mlx-lm's tokenizer loader infers it from the chat template: the
    attributes mlx-lm's ``TokenizerWrapper`` carries (``has_tool_calling``, ``tool_call_start``,
    ``tool_call_end``, ``tool_parser``), for a vision-language model's processor, which mlx-lm never wraps."""

    tool_call_start: str
    tool_call_end: str
    tool_parser: Callable[..., Any]
    has_tool_calling: bool = True


@dataclass(frozen=True)
class ThinkingMarkup:
    """The reasoning markers mlx-lm's ``TokenizerWrapper`` declares (``has_thinking``, ``think_start``,
    ``think_end``), for a vision-language model's processor."""

    think_start: str
    think_end: str
    has_thinking: bool = True


def processor_markups(processor: Any) -> tuple[ToolCallMarkup | None, ThinkingMarkup | None]:
    """(tool-call markup, reasoning markers) of this processor, each None where it declares none, by mlx-lm's own
    rules: ``_infer_tool_parser`` (the function its ``load`` calls) on the chat template and vocabulary, and
    ``_infer_thinking`` on the vocabulary. Both are private, so tests/models/test_vlm_tools.py fails loudly if
    they move. The vocabulary is read once for both (a tokenizer builds it anew on each ``get_vocab``: a few ms
    an engine, paid by every engine built on the processor)."""
    import importlib
    from types import SimpleNamespace

    from mlx_lm.tokenizer_utils import _infer_thinking, _infer_tool_parser

    tokenizer = getattr(processor, "tokenizer", processor)
    vocab = tokenizer.get_vocab()
    # what they read of a tokenizer: the template (a VLM's may be the processor's alone), the vocabulary, and
    # (the reasoning markers made of several tokens) the encoding
    template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    view = SimpleNamespace(chat_template=template, get_vocab=lambda: vocab, encode=tokenizer.encode)
    name = _infer_tool_parser(view)
    tool_calling = None
    if name is not None:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        tool_calling = ToolCallMarkup(module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    start, end, *_ = _infer_thinking(view)
    return tool_calling, (None if start is None else ThinkingMarkup(start, end))


def _template_mentions(template_processor: Any, name: str) -> bool:
    templates = [getattr(template_processor, "chat_template", None),
                 getattr(getattr(template_processor, "tokenizer", None), "chat_template", None)]
    for template in templates:
        values = template.values() if isinstance(template, dict) else [template]
        if any(isinstance(v, str) and name in v for v in values):
            return True
    return False


def input_embeddings(model: Any, input_ids: mx.array, media_inputs: dict[str, Any], mask: mx.array | None) -> Any:
    """``InputEmbeddingsFeatures`` of the prompt. ``media_inputs`` are the processor's media outputs (pixel
    values, grids, audio features, ...), given by name; ``pixel_values`` goes positionally as mlx-vlm does."""
    kwargs = dict(media_inputs)
    pixel_values = kwargs.pop("pixel_values", None)
    # GLM-4V's get_input_embeddings stores the prompt's M-RoPE positions on its language model (one prompt per
    # model instance): put back what was there, so no call of the engine's leaves per-prompt state on the model
    # (every forward passes its rows' positions)
    language_model = getattr(model, "language_model", None)
    kept = {name: getattr(language_model, name) for name in _INSTANCE_POSITION_STATE
            if hasattr(language_model, name)}
    try:
        return model.get_input_embeddings(input_ids, pixel_values, mask=mask, **kwargs)
    finally:
        for name, value in kept.items():
            setattr(language_model, name, value)


_INSTANCE_POSITION_STATE = ("_position_ids", "_rope_deltas")


def canvas_rope(config: Any) -> Any:
    """mlx-vlm's ``CanvasRoPE`` of MiniCPM-V 4.7 (numpy already): its ``get_rope_index`` lays each image's thumbnail
    and slices on one 2-D canvas."""
    from mlx_vlm.models.minicpmv4_7.rope import CanvasRoPE

    return CanvasRoPE(config)


def mrope_tokens(model: Any) -> tuple[int, int, int, int]:
    """(image token, video token, vision-start token, spatial merge size), read where the M-RoPE language
    models' ``get_rope_index`` reads them (``language_model.config``). GLM-OCR's config names its start token
    ``image_start_token_id`` (its ``get_rope_index`` blocks each run of image tokens instead: the same positions
    for its prompts, where every image follows that token; tests/models/test_positions.py)."""
    config = model.language_model.config
    start = getattr(config, "vision_start_token_id", None)
    if start is None:
        start = config.image_start_token_id
    return (int(config.image_token_id), int(config.video_token_id), int(start),
            int(config.vision_config.spatial_merge_size))


def spatial_merge(model: Any) -> int:
    """The patch merge of a tower fed Qwen2-VL-style flattened patches with a ``*_grid_thw`` row per item: an
    item of grid (t, h, w) fills t * h * w / merge**2 prompt positions. Read from the model's vision config, so
    it also serves the families whose language model keeps no media config (dots.ocr's plain-RoPE Qwen2). Muse
    Glimmer's vision config names it ``merge_size``."""
    config = _vision_config(model)
    merge = getattr(config, "spatial_merge_size", None)
    return int(config.merge_size if merge is None else merge)


def _vision_config(model: Any) -> Any:
    """The model's vision config: the top-level config's, or (Qwen3-Omni, whose config nests the thinker's
    vision, audio and text configs under ``thinker_config``) the language model's config's."""
    vision = getattr(model.config, "vision_config", None)
    return vision if vision is not None else model.language_model.config.vision_config


def lm_forward(language_model: Any, inputs: mx.array, cache: list, inputs_embeds: mx.array | None = None,
               **kwargs: Any) -> mx.array:
    """Logits of one language-model call. Given explicit ``position_ids`` (M-RoPE) and no ``pixel_values`` /
    ``rope_deltas``, the Qwen-VL language models neither read nor write their per-instance rope state."""
    out = language_model(inputs, inputs_embeds=inputs_embeds, cache=cache, **kwargs)
    return getattr(out, "logits", out)


def prefills_in_one_forward(model: Any, input_ids: mx.array, prefill_kwargs: dict[str, Any]) -> bool:
    """Whether ``mlx_vlm.generate`` prefills this prompt in one forward rather than in chunks: the model's own
    ``chunked_prefill_policy`` (or ``no_chunked_prefill``) asked as ``generate_step`` asks it, with no draft
    model. Gemma 4 says so for a prompt with images and no audio when its checkpoint sets
    ``use_bidirectional_attention: "vision"``: that forward lets each image's tokens attend to each other both
    ways. ``prefill_kwargs``: the prompt's inputs the policy reads (Gemma 4: ``mm_token_type_ids``)."""
    from mlx_vlm.generate.common import _chunked_prefill_enabled

    return not _chunked_prefill_enabled(model, input_ids=input_ids, prefill_kwargs=prefill_kwargs)


def make_cache(language_model: Any, max_kv_size: int | None = None) -> list:
    """The cache ``mlx_vlm.stream_generate`` builds for one request. With ``max_kv_size`` every layer is a
    ``RotatingKVCache(max_kv_size, keep=0)``: mlx-vlm's own single path keeps 4 sink tokens, but its batch cache
    has none, so batching with sinks would change results (the same rule as the text engine)."""
    from mlx_vlm.models import cache as vlm_cache

    if max_kv_size is None:
        return vlm_cache.make_prompt_cache(language_model)
    if hasattr(language_model, "make_cache"):
        raise ValueError("max_kv_size: this model builds its own caches (e.g. sliding windows); mlx-vlm ignores "
                         "max_kv_size for it and so would the results")
    return [vlm_cache.RotatingKVCache(max_size=max_kv_size, keep=0) for _ in language_model.layers]


def quantized_kv_schedule(model: Any) -> int:
    """The prefill step after which ``mlx_vlm.generate_step`` runs its quantized-KV check during a prompt.

    With integer ``kv_bits`` and its default ``kv_quant_scheme`` ("uniform"), mlx-vlm 0.7 converts exactly as
    mlx-lm does: after each prefill step of ``prefill_step_size`` tokens (all but the prompt's last token), after
    the last token and after every decode step, every layer with ``to_quantized`` whose offset has reached
    ``quantized_kv_start``. A model whose chunked-prefill policy turns chunking off (mlx-vlm's
    ``_chunked_prefill_enabled``, asked as ``generate_step`` asks it without a drafter) prefills in one piece and
    checks elsewhere, so it is refused (``QuantizationRefused``), as is a default scheme other than the uniform
    one (turboquant or mixed key/value bits keep other layers and schedules). The policies mlx-vlm 0.7 ships read
    the config and the drafter, not the prompt, except Gemma 4's (token types), whose sliding windows the cache
    check refuses first."""
    import inspect

    from mlx_vlm.generate import generate_step
    from mlx_vlm.generate.common import _chunked_prefill_enabled

    parameters = inspect.signature(generate_step).parameters
    scheme = parameters["kv_quant_scheme"].default
    if scheme != "uniform":
        raise QuantizationRefused("QuantizedKVCache", f"mlx-vlm's default kv_quant_scheme is {scheme!r}, not the "
                                  "uniform one the engine's conversion follows")
    if not _chunked_prefill_enabled(model):
        raise QuantizationRefused(type(model).__name__, "mlx-vlm prefills it in one piece (its chunked-prefill "
                                  "policy), so it checks quantized_kv_start at other points than the engine")
    return int(parameters["prefill_step_size"].default)


def row_offsets(cache: list) -> mx.array:
    """(B,) tokens each row's cache holds. Single-request caches have an int ``offset``; mlx-vlm's
    ``BatchKVCache.offset`` is an array of real (non-padding) tokens per row. A layer that is a ``CacheList``
    (Inkling's: KV and short-convolution states) counts by its first cache that has an offset."""
    parts = (part for c in cache for part in getattr(c, "caches", (c,)))  # a CacheList's caches, in order
    layer = next(c for c in parts if hasattr(c, "offset"))  # hybrids: the first attention layer (recurrent
    offset = layer.offset                                   # state has no length)
    if isinstance(offset, mx.array):  # (a batch's is (B,) int32 already: no op then, as a decode tick adds each)
        return offset if offset.ndim == 1 and offset.dtype == mx.int32 else offset.reshape(-1).astype(mx.int32)
    return mx.array([int(offset)], dtype=mx.int32)


def patch_grid(model: Any) -> tuple[int, int]:
    """(patch size, spatial merge size) of the Pixtral-style towers (mistral3, pixtral): an image of h x w pixels
    fills (h / patch / merge) x (w / patch / merge) prompt positions (pixtral has no patch merger: merge 1)."""
    return (int(model.config.vision_config.patch_size), int(getattr(model.config, "spatial_merge_size", None) or 1))


def splice_marker(model: Any) -> int:
    """The id a spliced family's input preparation writes for an image (``scheduler.models.splice``): the config's
    ``image_token_index`` (-200 for Bunny, a vocabulary id for Janus), else the constant its model module merges at
    (phi4-siglip's ``IMAGE_TOKEN_INDEX``, which its config does not name)."""
    value = getattr(model.config, "image_token_index", None)
    if value is None:
        value = getattr(sys.modules[type(model).__module__], "IMAGE_TOKEN_INDEX", None)
    if not isinstance(value, int):
        raise ValueError(f"{model.config.model_type} names no image id for its merge to splice at")
    return value


def tower_rows_per_view(model: Any) -> int:
    """The rows a LLaVA-NeXT-style tower gives a view, as the merge takes them: its patch grid, plus the class row
    where the tower has one (CLIP's ``class_embedding``; SigLIP has none), less the first row under the "default"
    feature strategy (which drops it, the class row for CLIP)."""
    vision = model.config.vision_config
    embeddings = getattr(getattr(model.vision_tower, "vision_model", None), "embeddings", None)
    rows = (vision.image_size // vision.patch_size) ** 2 + (getattr(embeddings, "class_embedding", None) is not None)
    return rows - (getattr(model.config, "vision_feature_select_strategy", "default") == "default")


def global_image_token_id(processor: Any) -> int | None:
    """The id of the tag before each image's last (global) view in an Idefics3 / SmolVLM prompt, or None."""
    value = getattr(processor, "global_image_token_id", None)
    if isinstance(value, int):
        return value
    tag = getattr(processor, "global_image_tag", None) or getattr(processor, "global_image_token", None)
    tokenizer = getattr(processor, "tokenizer", None)
    if not isinstance(tag, str) or tokenizer is None:
        return None
    value = tokenizer.convert_tokens_to_ids(tag)
    return value if isinstance(value, int) and value != getattr(tokenizer, "unk_token_id", None) else None


def text_embedding_module(language_model: Any) -> Any:
    inner = getattr(language_model, "model", None)
    return getattr(inner, "embed_tokens", None) or language_model.embed_tokens


def encoder_modules(model: Any) -> list[str]:
    """Names of the submodules that turn media into features (towers and projectors): what, besides the
    pixels, decides a vision-cache entry."""
    return sorted(name for name, _ in model.children().items() if name != "language_model")


def model_fingerprint(model: Any, processor: Any) -> str:
    """Model class and config, the encoder modules' weights (names, shapes and dtypes of all, a strided sample
    of each: any other checkpoint differs in it, at a cost of milliseconds) and the processor components'
    settings."""
    from mlx.utils import tree_flatten

    def as_dict(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return dataclasses.asdict(obj)
        return getattr(obj, "__dict__", repr(obj))

    parts: list[Any] = [f"{type(model).__module__}.{type(model).__name__}",
                        json.dumps(as_dict(model.config), sort_keys=True, default=str)]
    for name in encoder_modules(model):
        module = getattr(model, name)
        if not hasattr(module, "parameters"):
            continue
        params = tree_flatten(module.parameters())
        parts.append(name)
        parts.append(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in params]))
        samples = [p.reshape(-1)[:: max(1, p.size // 1024)] for _, p in params]
        mx.eval(samples)
        parts += samples
    for component in ("image_processor", "video_processor", "feature_extractor"):
        value = getattr(processor, component, None)
        if value is not None:
            parts += processor_settings(value)
    return content_key(parts)


def processor_settings(component: Any) -> list:
    settings = {k: v for k, v in vars(component).items()
                if isinstance(v, (int, float, str, bool, list, tuple, dict, type(None)))}
    return [type(component).__name__, json.dumps(settings, sort_keys=True, default=str)]


def media_token_ids(model: Any, processor: Any, media_token: str | None = None) -> frozenset[int]:
    """Every placeholder id the family's config names (image, video, audio tokens), and the token that
    ``media_token`` (``FamilySpec.media_token``) names: a config attribute holding its id, or a processor attribute
    (a dotted path into its parts) holding its id or its text."""
    ids: set[int] = set()
    # the language model's config too: Qwen3-Omni's top-level config nests the media token ids in its thinker's
    # config, the one its language model (and its get_rope_index) reads
    for holder in (model.config, getattr(model.config, "text_config", None),
                   getattr(getattr(model, "language_model", None), "config", None)):
        for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                     "audio_token_id", "audio_token_index"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    # the processor's own ids too: Nemotron Omni's config names its tokens img_context_token_id /
    # sound_context_token_id, MiniCPM-V's processor names its video pad there only (its config names none)
    for name in ("image_token_id", "video_token_id", "audio_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int) and value >= 0:
            ids.add(value)
    if media_token:
        held = processor
        for name in media_token.split("."):  # a dotted path reaches a processor's part (image_processor.unk)
            held = getattr(held, name, None)
        token = next((v for v in (getattr(model.config, media_token, None), held) if isinstance(v, (int, str))), None)
        if isinstance(token, str):
            tokenizer = getattr(processor, "tokenizer", processor)
            value = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(value, int) or value == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"the processor's {media_token} ({token!r}) is not a token of its tokenizer")
            token = value
        if not isinstance(token, int):
            raise ValueError(f"neither the config nor the processor names a media token {media_token!r}")
        ids.add(token)
    return frozenset(ids)


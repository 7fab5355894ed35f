"""The vision-language families we batch, as data: one ``FamilySpec`` per mlx-vlm ``model_type``.

Every family runs through the one generic adapter (``scheduler/models/adapter.py``) over mlx-vlm's common
model interface (``Model.get_input_embeddings`` and the language model's ``inputs_embeds`` path). What differs
between families is declared here, and nothing else:

``positions``      how the language model places tokens: ``ROPE`` (plain 1-D RoPE from each cache row's offset:
                   most families) or ``MROPE`` (Qwen2/2.5/3-VL and their MoE variants, Qwen3.5 and IndicOCR's OCR
                   stage, Qwen3-Omni, the GLM-4V family, ERNIE 4.5 VL: 3-D positions from the image / video grids,
                   a per-request rope delta; see ``positions.py``; MiniCPM-V 4.6 and MiniCPM-o: M-RoPE with no grids,
                   every axis counting tokens; MiniCPM-V 4.7: canvas positions, ``canvas_positions``).
``positions_last`` M-RoPE: the language model takes its ``position_ids`` as (B, L, 3), the axes last (ERNIE 4.5
                   VL), where the Qwen families take (3, B, L); the adapter keeps (3, B, L) and transposes at the call.
``canvas_positions`` M-RoPE: the prompt's positions are MiniCPM-V 4.7's canvas layout (mlx-vlm's ``CanvasRoPE``,
                   ``positions.canvas_index``): each image's thumbnail and slices laid on one 2-D canvas from the
                   crop grids (the processor's ``tgt_sizes``), not Qwen2-VL's grid blocks; decode as any M-RoPE row.
``media_free_text_path`` the text path (a request whose media rows come from the vision cache or from another
                   request of the tick) embeds the prompt with its media tokens replaced by a non-media token, the
                   rows overwriting those positions after: MiniCPM-V 4.7's get_input_embeddings raises on runs of
                   image tokens without their crop grids.
``video_block_per_frame``  M-RoPE: a video's frame groups are each their own vision block, temporal position 0
                   (Qwen3-VL, Qwen3.5), where Qwen2/2.5-VL give a video one block along the temporal axis.
``media``          the media kinds the family's processor and embedding merge take.
``placeholder``    the processor attribute naming the text a prompt holds once per image (``image_token`` for
                   most; gemma3's prompt holds its ``boi_token``, which the processor expands; MiniCPM-V 4.6's
                   holds ``<image>./</image>``, whose ``<image>`` its tokenizer's ``im_start`` names; Molmo 2's
                   ``<|image|>``, its processor's ``image_placeholder_token``).
``placeholder_text`` that text itself, for a family whose processor names it in no attribute (Kimi K3: mlx-vlm's
                   chat renderer writes ``<|kimi_image_placeholder|>`` per image, a constant of its processor
                   module, which the processor replaces with the image's ``<|media_pad|>`` run; LocateAnything:
                   ``<image-``, the start of the ``<image-N>`` its template writes per image); it overrides
                   ``placeholder``.
``media_token``    the config or processor attribute naming the token whose positions take the media rows (its id,
                   or its text), for a family whose usual config fields name none of them (Molmo's processor's
                   ``image_patch_token``, Molmo 2's config ``image_patch_id``, Jina VLM's config
                   ``image_patch_token_id``: their features are added at the patch tokens the processor writes, not
                   at the prompt's placeholder; Moondream 3's config ``bos_token_id``: its processor writes an
                   image's placeholders as BOS ids; GOT-OCR 2.0's config ``im_patch_token``, its ``<imgpad>``).
``media_mask_input`` / ``media_row_inputs``  extra language-model inputs that ``get_input_embeddings`` returns
                   and the language model reads per prefill chunk: a (1, L) mask of the media positions
                   (Qwen3-VL's ``visual_pos_masks``) and per-media-token rows (its ``deepstack_visual_embeds``).
``media_rows_whole_prompt``  the language model takes the media mask and rows over the whole prompt (the rows as
                   (layers, L, H), zeros off the media positions) and slices both at its cache's offset, one
                   sequence for every row of a batch (Granite 4 Vision's deepstack features): the adapter keeps
                   the rows per media token (vision cache, recompute) and spreads them back over the positions up
                   to each chunk's end; a chunk holding media positions is prefilled in a forward of its own.
``media_rows_dense`` the language model takes each media row input dense over the forward's positions, (B, L,
                   layers, H) with zeros off the media positions, one sequence per batch row (Qwen3-Omni's
                   ``deepstack_visual_embeds``, which its ``get_input_embeddings`` returns so over the whole prompt),
                   where Qwen3-VL's takes the media positions' rows alone: the adapter keeps the rows per media token
                   as for those (vision cache, items, recompute) and spreads each chunk's rows over its positions.
``sequence_inputs`` extra (1, L, ...) inputs sliced with the chunk (Gemma 4's ``per_layer_inputs``).
``token_types_input`` the processor output giving each prompt position's kind (Gemma 4's ``mm_token_type_ids``),
                   which ``mlx_vlm.generate`` hands its chunked-prefill policy and the prefill forward. Where the
                   policy prefills a prompt in one forward (``library.prefills_in_one_forward``: a Gemma 4 checkpoint
                   with ``use_bidirectional_attention: "vision"`` and a prompt with images or videos and no audio,
                   whose image and frame tokens then attend to each other both ways), the engine prefills it from 0
                   through its last media token in one forward of its own with that input (the request's
                   ``first_chunk_reach``); the text after it is causal and chunks as any other.
``dropped_inputs`` processor outputs that are neither media tensors nor read by the family's encoders or language
                   model, dropped after the processor call (dots.ocr: transformers' Qwen2.5-VL processor returns
                   ``mm_token_type_ids``, (1, L) like the prompt: kept as a media tensor it cannot be split per
                   image nor concatenated across requests of other lengths; GLM-5-Next's processor too).
``mixed_image_video`` whether one request may carry both images and videos (mlx-vlm's Qwen2/2.5-VL merge one kind).
``video_channels_first`` the processor takes a video as one (frames, 3, H, W) array, the layout mlx-vlm's
                   ``load_video`` returns (Gemma 4's ``Gemma4VideoProcessor``, which reads the engine's usual
                   (frames, H, W, 3) as frames of H channels and a list of frames not at all); the others take
                   (frames, H, W, 3).
``video_rate``     the processor times a video's frames from one rate per video, frame j at j / ``fps`` (Gemma 4
                   writes each frame's ``mm:ss`` so; it reads no ``video_metadata``), and thins a video of more
                   frames than its own cap itself, restamping the kept ones at that rate: the engine caps each video
                   at the processor's frames (mlx-vlm's ``processor_video_sampling``, as mlx-vlm caps a file it
                   decodes for it) and passes a file's ``fps`` as the rate its frames were sampled at
                   (``media.sampling_rate``), so each frame is stamped with the time it is on screen (a frame list,
                   which carries no times, keeps mlx-vlm's default rate).
``video_chat_on_tokenizer`` chat messages with videos render with the tokenizer's chat template (the model's own:
                   Gemma 4's renders a video part as ``<|video|>``), not the processor's ``apply_chat_template``
                   (mlx-vlm's Gemma 4 override renders a video part only with a source, which the engine's parts,
                   placeholders for the request's videos, do not carry: it dropped them). mlx-vlm's generate renders
                   the same prompt for a video (``prompt_utils.apply_chat_template`` with ``video=``).
``images_per_request`` the most images mlx-vlm's processor and merge take in one prompt (None: any); more are
                   refused at ``add_request`` for that request alone, before the processor runs (Step 3.7, Molmo,
                   PaddleOCR-VL, Moondream 3, GOT-OCR 2.0: 1).
``audio_encoder``  the model attribute (a dotted path) that turns audio features into embeddings (a checkpoint
                   without it takes no audio: refused at load where the family takes audio only, else audio requests
                   alone, as Gemma 4 26B-A4B / 31B with ``audio_config`` null): Gemma 4's Conformer ``audio_tower``;
                   Gemma 4 unified has no encoder, its ``embed_audio`` projects raw 40 ms frames; Qwen3-Omni's
                   thinker holds its Whisper-style ``thinker.audio_tower``, MiniCPM-o its Whisper ``audio_tower``;
                   MiMo-V2.6's ``audio_encoder`` embeds the codes its processor's MiMo audio tokenizer gives; Nemotron
                   Omni's Parakeet ``sound_encoder`` takes the waveforms (its processor's ``sound_clips``) and
                   computes their mel features itself.
``kv_bits_refused`` why ``EngineConfig.kv_bits`` cannot batch this family exactly: refused at configuration with
                   this reason (Qwen3.5's language model: see ``QWEN3_5_QUANTIZED_PADS``).
``honors_lengths`` whether the language model keeps right pads out of its sliding windows and recurrent state when
                   its batch cache is prepared with each row's length (mlx-lm's padded-batch contract; as
                   ``scheduler.families.Family.honors_lengths``): then its windows and recurrent layers share
                   prefill forwards of chunks of any lengths. gemma3, qwen3_5, minicpmv4_6, minicpmv4_7, step3p7,
                   plamo2vl, inkling, indic_ocr, kimi_k3, muse_glimmer and mimo_v2 (shown by
                   tests/models/test_vlm_families.py), gemma4 and gemma4_unified (tests/models/test_audio.py);
                   plain-KV families do not need it.
``item_split``     how the media tensors split into items, each keyed and encoded on its own (``ItemSplit``,
                   ``media_items.py``): a chat turn that adds an image then restores the turns before it from the prefix
                   cache, images included, and encodes only the new image. ``GRID`` for the towers fed flattened patches
                   with a ``*_grid_thw`` row per item (the Qwen and GLM families, mage_vl, dots_ocr, muse_glimmer,
                   mimo_v2, glm5_next), ``STACK`` for llava, ``SIZED_STACK`` for mistral3 and pixtral, ``TILES`` for
                   idefics3 and smolvlm; ``WHOLE`` (keyed and encoded as one unit) where no split is exact or
                   possible: gemma3 (see its note: an image's rows depend, by a few 1e-7 under OpenBLAS, on the images
                   stacked with it, and the tiny gemma3's greedy tokens follow them), media inputs holding Python
                   values or absolute prompt positions (kimi_vl, kimi_k25, kimi_k3, molmo, minicpmv4_6, minicpmv4_7,
                   minicpmo, moondream3, nemotron_h_nano_omni) or pooling indices into all of a request's crops
                   (molmo2), a tower that does not keep a call's images apart (ernie4_5_moe_vl), patches of all of a
                   request's images concatenated with no count per image (inkling), views padded to the most of any
                   image of the request (llava_onevision), an image's tiles counted against the tokens of the prompt's
                   other images (plamo2vl), the audio families (and a Qwen3-Omni request with audio). Each row's
                   comment says why.
``vision_batch`` / ``media_axis``  how the media of several requests go through the encoders in one call
                   (``VisionBatch``) and the axis of the media tensors that counts images (their other axes
                   must agree to be concatenated; ``*_grid_thw`` always count on axis 0). ``ONE``: every request
                   of the tick in one call (towers that take flattened patches of any number of images with their
                   ``grid_thw`` and attend within each image: the Qwen towers (Qwen3-Omni's too), GLM-4.5V's,
                   GLM-OCR's, PaddleOCR-VL's, dots.ocr's, Mage-VL's, Muse Glimmer's, MiMo-V2.6's, GLM-5-Next's);
                   ``EQUAL_SHAPE``: one call per group of requests whose pixel tensors agree on every other axis
                   (stacked along ``media_axis``);
                   ``PER_REQUEST``: one call per request (a tower whose images of one call do not stay apart, media
                   that cannot be concatenated, inputs holding absolute prompt positions; each row's comment says
                   which).

A family absent from this table is refused at load with ``UnsupportedFamily`` (a ``TypeError``) naming the
supported ones (and, for the types in ``LEFT_OUT``, why they have no row): mlx-vlm may load it, but nothing here has
shown that it batches exactly. ``ALIASES`` are the other names mlx-vlm loads a row's model under. A family declared with
``refused`` is one mlx-vlm runs that cannot batch through this interface; it is refused at load with the reason.
``refused_options`` refuses only the checkpoints of a family that set a config option the scheduler cannot batch
(Inkling's ``text_config.log_scaling_n_floor``: see its row); ``refused_media_options`` refuses only one kind of
media on such a checkpoint (Nemotron Omni's ``video_pruning_rate``: videos are refused per request, its images, audio
and text still batch).
Every family here without ``refused`` is exact in tests/models/test_vlm_families.py (gemma4 and gemma4_unified:
tests/models/test_audio.py; the audio requests of qwen3_omni_moe, inkling, minicpmo, mimo_v2 and
nemotron_h_nano_omni there too).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Positions(enum.Enum):
    ROPE = "rope"  # 1-D positions = tokens already in the row's cache
    MROPE = "mrope"  # (3, B, L) positions; decode position = tokens in the row's cache + the request's delta


class ItemSplit(enum.Enum):
    """How a request's media tensors split into items (``media_items.py``)."""

    WHOLE = "whole"  # not split: the request's media are one unit
    GRID = "grid"  # flattened patch rows with a ``*_grid_thw`` row per item (the Qwen processors)
    STACK = "stack"  # ``pixel_values`` axis 0, one equal-size image per index
    SIZED_STACK = "sized_stack"  # ``pixel_values`` padded to the largest image, with its ``image_sizes`` row
    TILES = "tiles"  # ``pixel_values`` (1, views, ...): each image's tile views, then its global view
    PACKED = "packed"  # packed patches (images, patches, ...) with each image's ``pixel_attention_mask`` row


class SpliceRows(enum.Enum):
    """How many embedding rows each image of a spliced prompt becomes, known before the tower runs (``splice.py``):
    the families whose merge puts an image's rows in place of its ids, not one row per id."""

    TOWER_GRID = "tower_grid"  # one id; (vision_config.image_size / patch_size)^2 rows (Bunny's SigLIP: 729)
    VALID_PATCHES = "valid_patches"  # one id; its set entries of pixel_attention_mask (phi4-siglip's packed patches)
    # llava_next: the processor's expanded ids; a block of the tower's rows per view, then as many newline blocks,
    # cut to as many blocks as ids (mlx-vlm's merge)
    VIEW_BLOCKS = "view_blocks"


class VisionBatch(enum.Enum):
    ONE = "one"  # all the tick's media in one encoder call
    EQUAL_SHAPE = "equal_shape"  # one call per group of equal-shape media tensors
    PER_REQUEST = "per_request"  # one call per request


class UnsupportedFamily(TypeError):
    """This mlx-vlm ``model_type`` is not one the generic adapter batches (see ``FAMILIES``)."""


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    positions: Positions = Positions.ROPE
    media: frozenset[str] = frozenset({"image"})
    placeholder: str = "image_token"
    placeholder_text: str | None = None
    media_token: str | None = None
    media_mask_input: str | None = None
    media_row_inputs: tuple[str, ...] = ()
    media_rows_whole_prompt: bool = False
    media_rows_dense: bool = False
    sequence_inputs: tuple[str, ...] = ()
    token_types_input: str | None = None
    dropped_inputs: tuple[str, ...] = ()
    mixed_image_video: bool = False
    video_channels_first: bool = False  # videos as (frames, 3, H, W), as mlx-vlm's load_video returns them
    video_rate: bool = False  # the processor stamps frame j at j / fps: pass the sampling rate, cap frames
    video_chat_on_tokenizer: bool = False  # video messages render with the tokenizer's chat template
    images_per_request: int | None = None
    video_block_per_frame: bool = False
    positions_last: bool = False  # M-RoPE positions given to the language model as (B, L, 3)
    canvas_positions: bool = False  # M-RoPE positions laid on MiniCPM-V 4.7's canvas (positions.canvas_index)
    media_free_text_path: bool = False  # the text path embeds the prompt with its media tokens replaced
    # the merge replaces an image's ids by the image's rows, another count (``splice.py``): the ids are written once
    # per row before the scheduler sees the prompt, and the encoders get them back as the processor wrote them
    splice: SpliceRows | None = None
    vision_batch: VisionBatch = VisionBatch.EQUAL_SHAPE
    media_axis: int = 0
    item_split: ItemSplit = ItemSplit.WHOLE
    audio_encoder: str = "audio_tower"
    honors_lengths: bool = False  # as `scheduler.families.Family.honors_lengths`, for the language model
    kv_bits_refused: str | None = None  # why quantized KV cannot batch exactly (refused at configuration)
    refused: str | None = None  # why mlx-vlm's model cannot be batched here (refused at load)
    # (dotted attribute path under the model's config, reason): a checkpoint of the family that sets this option (not
    # None) is refused at load with the reason, one the family's other checkpoints batch exactly without
    refused_options: tuple[tuple[str, str], ...] = ()
    # (media kind, dotted attribute path under the model's config, reason): a checkpoint of the family that sets
    # this option to a true value (not None, 0 or False) takes no media of that kind; its other media, and its text,
    # batch as the family's other checkpoints do. A request with that kind of media is refused with the reason
    refused_media_options: tuple[tuple[str, str, str], ...] = ()
    notes: str = field(default="", compare=False)


_QWEN_MEDIA = frozenset({"image", "video"})
_ONE = VisionBatch.ONE
_GRID = ItemSplit.GRID

# Why gemma3 encodes per request (measured; ARCHITECTURE.md, "Vision batching"): under OpenBLAS its SigLIP patch
# conv on 4 stacked images rounds an image's patch embeddings 5-6e-7 away from the same conv on that image alone
# (0 with the wheel's BLAS), and the tiny seeded gemma3 is sensitive enough that, with its tower batched, 4 of
# the 9 requests of tests/models/test_vlm_families.py's workload (6 of 9 in `python -m bench.vision_batch
# --gemma3`) gave other greedy tokens than solo mlx_vlm. The other families' towers also round a few 1e-7
# differently in a batch under OpenBLAS, and their greedy tokens stay equal (tests/models/test_vision_batch.py).
#
# For the same reason its media are keyed and encoded whole (ItemSplit.WHOLE): keyed per image (STACK), a chat turn
# adding an image restored the turn before from the prefix cache and encoded the new image alone, while solo
# mlx_vlm stacks both images; under OpenBLAS the second turn's greedy tokens then differed from solo mlx_vlm
# (tests/models/test_vlm_families.py, the chat-turn test, tried 2026-12-05).
GEMMA3_PER_REQUEST = ("vision tower per request, media keyed whole: its patch conv rounds differently on stacked "
                      "images under OpenBLAS (5-6e-7), which flipped greedy tokens of the tiny gemma3")

# Why a Nemotron Omni checkpoint with a video pruning rate takes no video here. Efficient Video Sampling (mlx-vlm's
# compute_retention_mask) drops the video rows least changed from the frame before after the tower has run, so the
# embedded prompt comes out shorter than its token ids (0.5 on the tiny build: 149 rows for 165 ids): a request's
# length would depend on its encoder's output, where the planner, the KV budget, the prefix cache and replay all plan
# with the ids. NVIDIA's released config sets 0.7; with it at 0 in config.json mlx-vlm keeps every row, and videos
# batch exactly (tests/models/test_vlm_families.py).
NEMOTRON_VIDEO_PRUNING = ("Efficient Video Sampling drops video rows after the vision tower, so the prompt's length "
                          "would depend on the encoder's output; set video_pruning_rate to 0 in config.json to keep "
                          "every row (its images, audio and text batch as they are)")

# Why FastVLM (llava_qwen2) is refused though its merge is a splice as Bunny's (splice.py would expand its images'
# ids to the tower's (image_size / 64)^2 rows): no batching here is claimed without a test against solo mlx-vlm, and
# no tiny FastVLM can be built to test it. FastViTHD's stage layout (layers, embed_dims, mlp_ratios, ...) is class
# attributes of mlx-vlm's VisionConfig, not fields config.json sets: every build has the full 125M-parameter tower,
# which encodes a 128-pixel image in 2.6 s on this CPU (tests/models/test_refused_vlm_families.py builds it small by
# setting them on one instance, which a checkpoint cannot)
FASTVLM_UNTESTED = ("not tested against mlx_vlm here: its FastViTHD tower's stage layout is fixed in mlx-vlm's "
                    "VisionConfig class (config.json cannot shrink it), so no tiny build can be made; its merge is a "
                    "splice as Bunny's, which the engine batches")

# Why a DeepSeek-VL checkpoint with the SAM + SigLIP hybrid tower (deepseek-vl-7b: vision_config.params names a
# high_res_cfg) is refused while the SigLIP-only ones (deepseek-vl-1.3b, Janus, Janus-Pro) batch: mlx-vlm builds the
# hybrid's SAM part at full size whatever the config says (SAMEncoder() takes none), so no tiny build tests it, and
# the splice's row count (the tower's grid) would read the high-resolution image size its config sets
JANUS_HYBRID_TOWER = ("its SAM + SigLIP hybrid vision tower is not tested here: mlx-vlm builds the SAM part at full "
                      "size whatever config.json says, so no tiny build can be made, and its rows an image are not "
                      "the grid of the image size its config names (the SigLIP-only checkpoints batch)")

# Why kv_bits is refused for the families on mlx-vlm's Qwen3.5 language model (qwen3_5, qwen3_5_moe, minicpmv4_6;
# tests/models/test_vlm_families.py, test_qwen3_5_attends_the_pads_of_a_quantized_batch_decode): in a one-token
# decode of a left-padded batch its attention returns the mask "left_padded_decode", drops it (mask None) and hands
# the pads to its ragged path, which skips a cache with `bits`; the fallback then attends every position, pads
# included. A batched row shorter than the longest got logits 1e-2 away from the row alone on the tiny builds, and
# one of MiniCPM-V 4.6's greedy outputs differed from solo mlx-vlm under kv_bits=8 (the qwen3_5_moe seed note in
# that test file too).
QWEN3_5_QUANTIZED_PADS = ("mlx-vlm's Qwen3.5 attention takes no mask in a one-token decode of a left-padded batch "
                          "whose cache is quantized, so a row shorter than the longest attends the left pads")

# Why an Inkling checkpoint with log_scaling_n_floor set is refused (tests/models/test_refused_vlm_families.py,
# test_inkling_log_scaling_reads_padded_positions: the tiny build with a floor of 8 gave 3 of the 9 requests other
# greedy tokens than solo mlx-vlm in the staggered schedule). Unset (the tests' build), tau is 1 everywhere.
INKLING_LOG_SCALING = ("mlx-vlm's Inkling attention scales the global layers' queries and position bias by a "
                       "function of each query's absolute position, which it takes from the cache's key count "
                       "(S - L), left padding included, for every row of a batch: in a left-padded batch a shorter "
                       "row gets the scaling of positions it is not at")

FAMILIES: dict[str, FamilySpec] = {spec.model_type: spec for spec in (
    FamilySpec("qwen2_vl", Positions.MROPE, _QWEN_MEDIA, vision_batch=_ONE, item_split=_GRID),
    FamilySpec("qwen2_5_vl", Positions.MROPE, _QWEN_MEDIA, vision_batch=_ONE, item_split=_GRID),
    FamilySpec("qwen3_vl", Positions.MROPE, _QWEN_MEDIA, video_block_per_frame=True,
               media_mask_input="visual_pos_masks",
               media_row_inputs=("deepstack_visual_embeds",), vision_batch=_ONE, item_split=_GRID),
    FamilySpec("qwen3_5", Positions.MROPE, _QWEN_MEDIA, video_block_per_frame=True, vision_batch=_ONE,
               item_split=_GRID, honors_lengths=True, kv_bits_refused=QWEN3_5_QUANTIZED_PADS,
               notes="hybrid: gated-delta (recurrent) layers next to full attention"),
    FamilySpec("gemma3", placeholder="boi_token", vision_batch=VisionBatch.PER_REQUEST, honors_lengths=True,
               notes=GEMMA3_PER_REQUEST),
    FamilySpec("idefics3", media_axis=1, item_split=ItemSplit.TILES),  # pixel_values (1, views, C, H, W)
    FamilySpec("smolvlm", media_axis=1, item_split=ItemSplit.TILES,
               notes="idefics3's model with SmolVLMProcessor (video frames become images there)"),
    # a checkpoint with Llama-4 attention scaling (Ministral 3's and Devstral Small 2's text config, model_type
    # "ministral3") batches exactly only below original_max_position_embeddings, where the engine caps its context
    # (VLMAdapter.position_limit)
    FamilySpec("mistral3", item_split=ItemSplit.SIZED_STACK),
    FamilySpec("pixtral", item_split=ItemSplit.SIZED_STACK,
               notes="mistral3's tower and language model without its patch merger"),
    FamilySpec("llava", item_split=ItemSplit.STACK, notes="CLIP tower, every image resized and cropped to one size"),
    FamilySpec("qwen3_vl_moe", Positions.MROPE, _QWEN_MEDIA, video_block_per_frame=True,
               media_mask_input="visual_pos_masks", media_row_inputs=("deepstack_visual_embeds",),
               vision_batch=_ONE, item_split=_GRID, notes="qwen3_vl with mixture-of-experts layers"),
    FamilySpec("qwen3_5_moe", Positions.MROPE, _QWEN_MEDIA, video_block_per_frame=True, vision_batch=_ONE,
               item_split=_GRID, honors_lengths=True, kv_bits_refused=QWEN3_5_QUANTIZED_PADS,
               notes="hybrid: gated-delta (recurrent) layers next to full attention, mixture-of-experts layers"),
    # its rope index is Qwen2-VL's (a block per image after its begin-of-image token). Its tower does not keep the
    # images of one call apart as the Qwen towers do: its attention cuts a call at the first two of its cu_seqlens
    # only (`mx.split(t, [l0, l0 + l1])`), so the third and later images attend to each other; a request's features
    # from a call with other requests' images differed from its own call by 0.017, so one call per request
    FamilySpec("glm4v", Positions.MROPE, vision_batch=VisionBatch.PER_REQUEST, item_split=_GRID,
               notes="GLM-4.1V: partial-rotary M-RoPE; vision tower per request"),
    # pixel_values (1, tiles, C, H, W), and the processor returns the image token id (an int) with the tensors:
    # one encoder call per request, keyed whole
    FamilySpec("internvl_chat", media_axis=1, vision_batch=VisionBatch.PER_REQUEST,
               notes="InternViT tiles (dynamic tiling and a thumbnail), pixel shuffle"),
    # views padded to one patch count (pixel_attention_mask, spatial_shapes): tensors agree but for axis 0
    FamilySpec("lfm2_vl", honors_lengths=True,
               notes="hybrid: short-conv (recurrent) layers next to full attention; packed patches"),
    # pixel_values (1, views, C, H, W), the crops and the whole image, with no tag that would split it by image
    FamilySpec("idefics2", media_axis=1, notes="perceiver resampler, image splitting"),
    # every image's tiles flat along axis 0 (a tile count per image): keyed whole
    FamilySpec("aya_vision", notes="Cohere2 language model: sliding-window layers; tiles and a global view"),
    # its processor's mm_token_type_ids is read by the chunked-prefill policy and the prefill forward only (not by
    # get_input_embeddings): kept out of the media tensors (and so out of the media keys, which it would tie to the
    # prompt's text) as the prompt's token types
    FamilySpec("gemma4", media=frozenset({"image", "video", "audio"}), sequence_inputs=("per_layer_inputs",),
               token_types_input="mm_token_type_ids", vision_batch=VisionBatch.PER_REQUEST, honors_lengths=True,
               video_channels_first=True, video_rate=True, video_chat_on_tokenizer=True, mixed_image_video=True,
               notes="images, videos and audio; with use_bidirectional_attention 'vision' (real checkpoints) a "
               "prompt's tokens through its last image or video frame (no audio) are prefilled in one forward of "
               "their own, each image's (frame's) tokens attending to each other both ways, as mlx_vlm.generate "
               "prefills it; each frame's mm:ss is the time it is on screen"),
    FamilySpec("gemma4_unified", media=frozenset({"audio"}), sequence_inputs=("per_layer_inputs",),
               audio_encoder="embed_audio", vision_batch=VisionBatch.PER_REQUEST, honors_lengths=True,
               notes="audio only: Gemma 4's language model with an encoder-free audio path (each 40 ms of samples "
               "projected into the embedding space); images not attempted (the tiny build has no vision embedder "
               "to test them with)"),
    # pixel_values (patches, 3, 14, 14) with image_grid_hws rows, and the processor returns `_grid_shapes` (a list of
    # tuples) and `image_token_id` among the media: one encoder call per request, keyed whole
    FamilySpec("kimi_vl", vision_batch=VisionBatch.PER_REQUEST,
               notes="DeepSeek-V3 text (multi-head latent attention, mixture of experts); MoonViT tower"),
    # 3-D RoPE with Qwen2-VL's rope index keyed on <|IMAGE_START|>, its language model taking the positions as
    # (B, L, 3); videos share the image placeholder token. mlx-vlm's generate passes no token_type_ids, so image
    # tokens go through the text experts, in the engine as alone. Its tower's attention splits a call's patches at
    # the first two images' ends only (mlx-vlm's VisionAttention): every image after the second attends to the
    # later ones (tests/models/test_vision_batch.py), so a request's images are encoded as mlx-vlm encodes them,
    # all of them in one call of their own
    FamilySpec("ernie4_5_moe_vl", Positions.MROPE, positions_last=True, vision_batch=VisionBatch.PER_REQUEST,
               notes="ERNIE 4.5 mixture-of-experts text (text and multimodal expert groups); DFNRope tower and "
               "resampler; vision tower per request, media keyed whole"),
    # a stock Qwen3 decoder (1-D RoPE) under a tower that attends within each image (block-diagonal mask)
    FamilySpec("mage_vl", media=_QWEN_MEDIA, vision_batch=_ONE, item_split=_GRID,
               notes="Qwen3 text; Mage-ViT tower (3-D vision RoPE, block-diagonal mask per image)"),
    FamilySpec("hunyuan_vl", refused="its language model takes no per-row positions: XD-RoPE positions are used "
               "only on a forward whose cache is at offset 0, and every later forward (prefill chunks, decode steps) "
               "rotates all rows by the batch cache's one shared offset, so a row whose length differs from the "
               "batch's gets other positions than alone; and the prefill positions come from state on the model "
               "instance (`_position_ids`) that its own forward writes and the next request's prefill reads"),
    # its processor writes each image's tokens (<im_start>, <im_patch>, <im_col>, <im_end>) before the whole text and
    # takes one image a prompt (with two it returns input_ids of shape (2, L)); the features are added at the
    # <im_patch> positions that image_input_idx holds (absolute prompt positions): one encoder call per request,
    # keyed whole
    FamilySpec("molmo", media_token="image_patch_token", images_per_request=1, vision_batch=VisionBatch.PER_REQUEST,
               notes="OLMo decoder; CLIP ViT on overlapping crops and a global view, features added to the patch "
               "tokens"),
    # Qwen3.5's language model, whose M-RoPE positions are plain counting here (all axes equal, delta 0): MROPE
    # passes them explicitly (with none it reads the instance's _rope_deltas). pixel_values is a per-prompt list of
    # slices of differing sizes and image_bound holds absolute prompt positions: one encoder call per request,
    # keyed whole. The prompt holds <image>./</image> per image (tokenizer.im_start names its <image>). A video's
    # frames are <image> blocks of <|video_pad|> (the processor's video_token_id) after the images' slices
    FamilySpec("minicpmv4_6", Positions.MROPE, frozenset({"image", "video"}), placeholder="im_start",
               vision_batch=VisionBatch.PER_REQUEST,
               honors_lengths=True, kv_bits_refused=QWEN3_5_QUANTIZED_PADS,
               notes="hybrid: gated-delta (recurrent) layers next to full attention; SigLIP slices merged inside "
               "the tower"),
    # its tower attends within each image of a call (cu_seqlens), unlike glm4v's: one call for the tick's images
    FamilySpec("glm4v_moe", Positions.MROPE, vision_batch=_ONE, item_split=_GRID,
               notes="GLM-4.5V / 4.6V: glm4v with mixture-of-experts layers (grouped routing, a shared expert)"),
    # its rope index (GLM-4.6V's: each run of image tokens one block, text after it advancing by max(h, w) / merge)
    # gives the Qwen2-VL layout's positions on image prompts; its config names image_start_token_id
    FamilySpec("glm_ocr", Positions.MROPE, vision_batch=_ONE, item_split=_GRID,
               notes="GLM-OCR: GLM text with M-RoPE, GlmOcr tower"),
    # mlx-vlm's image processor stacks a prompt's images with np.array: images of other sizes raise, images of one
    # size would be read as frames of one image. So one image a prompt, keyed whole (an item is the request's
    # image). pixel_values (1, patches, C, 14, 14): patches on axis 1
    FamilySpec("paddleocr_vl", Positions.MROPE, images_per_request=1, vision_batch=_ONE, media_axis=1,
               notes="PaddleOCR-VL: ERNIE-4.5 text with M-RoPE, NaViT tower; one image a prompt"),
    # transformers' Qwen2.5-VL processor (under mlx-vlm's DotsVLProcessor) returns mm_token_type_ids, which
    # nothing reads
    FamilySpec("dots_ocr", dropped_inputs=("mm_token_type_ids",), vision_batch=_ONE, item_split=_GRID,
               notes="dots.ocr: Qwen2 text (1-D RoPE), dots ViT on Qwen2-VL-style flattened patches"),
    # get_input_embeddings encodes pixel_values[0] only (one prompt's views), so one encoder call per request and
    # the media keyed whole; the image enters only as deepstack features added at chosen layers, over the whole
    # prompt, sliced by the language model at its cache's offset (media_rows_whole_prompt). A prompt's second
    # image takes the first image's features (mlx-vlm clamps the feature index to their last row): reproduced
    FamilySpec("granite4_vision", media_mask_input="visual_pos_masks", media_row_inputs=("deepstack_visual_embeds",),
               media_rows_whole_prompt=True, vision_batch=VisionBatch.PER_REQUEST,
               notes="Granite 4 Vision: LLaVA-NeXT anyres views through windowed-QFormer projectors, features only "
               "as deepstack additions"),
    # the processor takes exactly one <im_patch> a prompt (more raise ValueError)
    FamilySpec("step3p7", images_per_request=1, vision_batch=VisionBatch.PER_REQUEST, honors_lengths=True,
               notes="Step 3.7 VL: a sliding-window layer next to full attention, mixture-of-experts layers"),
    # pixel_values (images, views, C, H, W), each image's views padded to the request's most, with image_sizes
    # (images, 2) and batch_num_images: the tower takes each image's own views, so requests whose tensors agree but
    # for axis 0 stack (videos: pixel_values_videos (videos, frames, C, H, W)). How many padded views an image
    # carries depends on the other images of its request: keyed whole
    FamilySpec("llava_onevision", media=frozenset({"image", "video"}),
               notes="LLaVA-OneVision: SigLIP AnyRes tiles and a base view (a large grid's features downsampled), "
               "video frames pooled 2x2; Qwen2 text"),
    # pixel_values (1, tiles, C, H, W), of which get_input_embeddings encodes pixel_values[0] (one prompt's tiles),
    # and the processor returns the image token id (an int) among the media tensors: one encoder call per request,
    # keyed whole
    FamilySpec("internvl", media_axis=1, vision_batch=VisionBatch.PER_REQUEST,
               notes="InternVL in transformers' layout: InternVL vision tower (layer scale, q/k norms) on dynamic "
               "tiles and a thumbnail, pixel shuffle; Qwen3 text"),
    # the processor writes BOS and 729 placeholder ids of the BOS id (0) before the text, and the merge writes the
    # image's rows at positions 1..729 whatever the ids there: the media positions are the prompt's BOS-id ones
    # (the BOS itself among them, its row its own embedding). One image a prompt (two give features of shape
    # (2, 729, H), which do not concatenate with the BOS row); num_crops / crop_layouts are Python lists: one
    # encoder call per request, keyed whole. get_input_embeddings also returns a 4-D mask that attends
    # bidirectionally over BOS and the image rows, which mlx-vlm's generate drops (its prefill is causal, as the
    # engine's: tests/models/test_vlm_families.py, test_moondream3_prefill_is_causal_as_mlx_vlms_generate)
    FamilySpec("moondream3", media_token="bos_token_id", images_per_request=1, vision_batch=VisionBatch.PER_REQUEST,
               notes="Moondream 3: mixture-of-experts text with learned query / value scaling (tau); a global crop "
               "and overlapping local crops pooled to 729 rows after BOS"),
    # Qwen3-Omni's thinker (the talker, which speaks, is not built): Qwen3-VL-MoE's text, M-RoPE with Qwen2-VL's rope
    # index (a video one block along the temporal axis), and its tower, which attends within each image of a call
    # (cu_seqlens): one call for the tick's images. Its get_input_embeddings returns the deepstack rows dense over the
    # whole prompt, (1, L, layers, H) with zeros off the media, and the language model adds them per forward
    # position (media_rows_dense). A request with audio is keyed and encoded whole (input_features are not a grid
    # layout's tensors)
    FamilySpec("qwen3_omni_moe", Positions.MROPE, frozenset({"image", "video", "audio"}),
               media_mask_input="visual_pos_masks", media_row_inputs=("deepstack_visual_embeds",),
               media_rows_dense=True, vision_batch=_ONE, item_split=_GRID, audio_encoder="thinker.audio_tower",
               notes="Qwen3-Omni thinker: Qwen3-VL-MoE text (mixture of experts, deepstack) with a Whisper-style "
               "audio tower"),
    # pixel_values (patches, 3, 14, 14) with image_grid_hws rows, and the processor returns image_token_id (an int)
    # among the media: one encoder call per request, keyed whole, as kimi_vl
    FamilySpec("kimi_k25", vision_batch=VisionBatch.PER_REQUEST,
               notes="Kimi K2.5: DeepSeek-V3 text (multi-head latent attention, mixture of experts); MoonViT tower "
               "and a LayerNorm + MLP projector"),
    # the prompt holds <|image|> (processor.image_placeholder_token), which the processor replaces with a low-res
    # view's and overlapping crops' tokens; the features are added at the <im_patch> ones (config image_patch_id).
    # image_token_pooling indexes the request's crops, and the merge groups a prompt's images by counting its
    # <im_end> tokens: one encoder call per request, keyed whole
    FamilySpec("molmo2", placeholder="image_placeholder_token", media_token="image_patch_id",
               vision_batch=VisionBatch.PER_REQUEST,
               notes="Molmo 2: Qwen3-style decoder; ViT on a low-res view and overlapping crops, pooled 2x2 by "
               "attention, features added to the patch tokens"),
    # mlx-vlm's processor writes the ja01 instruction template and each image's placeholders (one per tile token,
    # between <siglip2:img> tags) around the prompt's text itself: the prompt holds no placeholder. pixel_values
    # (tiles, C, H, W), all tiles of one size: requests' tiles stack on axis 0, each tile encoded on its own. How
    # many tiles an image gets depends on the prompt's other images (their tokens share tile_context_length):
    # keyed whole
    FamilySpec("plamo2vl", honors_lengths=True,
               notes="PLaMo 2 VL: hybrid PLaMo 2 text (Mamba layers next to attention), SigLIP tower on Eagle2-style "
               "dynamic tiles and a thumbnail"),
    # each layer's cache is a CacheList of a KVCache and an ArraysCache of short-convolution states, which take the
    # batch cache's lengths and left padding (mlx-lm's padded-batch contract); no rotary: a learned relative-position
    # bias in the mask, from each key's distance. pixel_values (patches, 2, 40, 40, 3), every image's 40 px patches
    # concatenated with no per-image count (the processor drops num_patches): keyed whole, and the patchifier (no
    # attention) takes any requests' patches stacked in one call. Audio: audio_input_ids (clips, frames, 80 mel bins
    # quantized) with their frame mask, through the dMel front end (audio_tower), keyed whole with the request
    FamilySpec("inkling", media=frozenset({"image", "audio"}), honors_lengths=True,
               refused_options=(("text_config.log_scaling_n_floor", INKLING_LOG_SCALING),),
               notes="Inkling: short convolutions on keys, values and residual branches; sliding-window and global "
               "attention with a relative-position bias; mixture of experts; an HMLP patchifier, a dMel audio "
               "front end"),
    # mlx-vlm's indic_ocr Model is Qwen3.5's with its config's model_type set to qwen3_5: a loaded checkpoint is
    # batched by qwen3_5's row (this one, its copy, names the type for the table)
    FamilySpec("indic_ocr", Positions.MROPE, _QWEN_MEDIA, video_block_per_frame=True, vision_batch=_ONE,
               item_split=_GRID, honors_lengths=True, kv_bits_refused=QWEN3_5_QUANTIZED_PADS,
               notes="IndicOCR's OCR stage: Qwen3.5 (gated-delta layers next to full attention)"),
    # the prompt holds <image> per image (tokenizer.im_start names it), which the processor expands to <image>, a run
    # of the literal <unk> text (image_processor.unk: the rows' positions) and </image>; mlx-vlm's Qwen3-VL language
    # model with M-RoPE positions that count tokens (get_input_embeddings stores arange positions on the instance:
    # MROPE passes them explicitly, delta 0). pixel_values is a per-prompt list of images of differing sizes and
    # image_bound holds absolute prompt positions; audio: Whisper features of the request's clips, whose rows go at
    # <unk> runs too (between <|audio_start|> / <|audio_end|>), by the absolute audio_bounds: one encoder call per
    # request, keyed whole. mlx-vlm's chat formatting writes a clip as <|audio_N|> text, which the processor does not
    # match: it puts the clips after the last user tag and leaves that text (the engine renders as mlx-vlm does)
    FamilySpec("minicpmo", Positions.MROPE, media=frozenset({"image", "audio"}), placeholder="im_start",
               media_token="image_processor.unk", audio_encoder="audio_tower",
               vision_batch=VisionBatch.PER_REQUEST,
               notes="MiniCPM-o: Qwen3-VL text (M-RoPE counting tokens); SigLIP tower and a learned-query resampler, "
               "a Whisper audio tower (its speech decoder not built)"),
    # MiniCPM-V 4.6's tower, processor and prompt (as minicpmv4_6's row), on the Qwen3.5 language models (dense or
    # mixture of experts), with canvas M-RoPE: mlx-vlm's CanvasRoPE over the crop grids (tgt_sizes) lays each
    # image's thumbnail and slices on one 2-D canvas. The processor also returns downsample_mode (a string; the
    # config's value, which get_input_embeddings reads when it is absent) and mm_token_type_ids (recomputed from
    # the ids there): dropped. Its get_input_embeddings raises on runs of image tokens without their crop grids,
    # so the text path embeds the prompt without them (media_free_text_path)
    FamilySpec("minicpmv4_7", Positions.MROPE, frozenset({"image", "video"}), placeholder="im_start",
               canvas_positions=True,
               media_free_text_path=True, dropped_inputs=("downsample_mode", "mm_token_type_ids"),
               vision_batch=VisionBatch.PER_REQUEST, honors_lengths=True, kv_bits_refused=QWEN3_5_QUANTIZED_PADS,
               notes="MiniCPM-V 4.7: hybrid Qwen3.5 text (gated-delta and full attention, optionally mixture of "
               "experts); SigLIP slices merged inside the tower; canvas M-RoPE"),
    # the prompt holds <|kimi_image_placeholder|> per image (mlx-vlm's Python renderer writes it; no processor
    # attribute names it), which the processor replaces with the image's <|media_pad|> run. pixel_values (patches,
    # 3, 14, 14) with grid_thws rows, and the processor returns image_token_id (an int) among the media: one encoder
    # call per request, keyed whole, as kimi_k25. Its delta-attention layer's short conv and state skip right pads
    # (the lengths of a prepared batch cache); its latent attention takes no positions (NoPE)
    FamilySpec("kimi_k3", placeholder_text="<|kimi_image_placeholder|>", vision_batch=VisionBatch.PER_REQUEST,
               honors_lengths=True,
               notes="Kimi K3: hybrid, Kimi Delta Attention (delta-rule linear attention) next to NoPE latent "
               "attention, block attention residuals, latent mixture of experts; MoonViT3d tower"),
    # Qwen-style flattened patches with an image_grid_thw row per image (its vision config names the merge
    # merge_size); its tower attends within windows of each image and within each image (split at cu_seqlens): one
    # call for the tick's images. Sliding-window RoPE layers next to NoPE full attention, the windows skipping right
    # pads
    FamilySpec("muse_glimmer", vision_batch=_ONE, item_split=_GRID, honors_lengths=True,
               notes="Muse Glimmer: sliding-window RoPE layers next to NoPE full attention, gated attention, "
               "soft-capped logits; ViT with window and full attention"),
    # MiMo-V2.6: MiMo-V2-Flash's text with plain 1-D RoPE, whose sliding-window layers take their masks from the
    # batch cache (right pads kept out), under a tower that attends within each image of a call (cu_seqlens spans,
    # windows inside each): one call for the tick's images, keyed per image (Qwen2.5-VL's processor: image_grid_thw
    # rows). Audio: the processor turns each clip into codes with mlx-audio's MiMo audio tokenizer (audio_codes,
    # (frames, 20), and audio_code_lengths, one per clip), which the audio encoder embeds clip by clip: a request
    # with audio is keyed whole, and the tick's clips go through one call
    FamilySpec("mimo_v2", media=frozenset({"image", "video", "audio"}), audio_encoder="audio_encoder",
               vision_batch=_ONE, item_split=_GRID, honors_lengths=True,
               notes="MiMo-V2.6: MiMo-V2-Flash text (sliding-window layers with attention sinks, mixture of experts); "
               "windowed ViT with sinks on flattened patches; audio as MiMo audio-tokenizer codes"),
    # Nemotron-3 Nano Omni: pixel_values is a Python list where a request's images differ in size, and the processor
    # returns num_patches / num_tokens / imgs_sizes (lists) with it; audio is sound_clips, the request's waveforms (a
    # list), which get_input_embeddings turns into mel features and pads to the request's longest clip: one encoder
    # call per request, keyed whole. The sound rows go at <so_embedding>, which the processor's audio_token_id names
    # (the config's sound_context_token_id). Videos: one a request (its processor refuses more), never with images;
    # frame pairs as tubelets in image-token blocks. Its Mamba-2 mixer gives ssm_update the padding mask but not the
    # lengths (as mlx-lm's nemotron_h): no honors_lengths, so only aligned chunks share a forward
    FamilySpec("nemotron_h_nano_omni", media=frozenset({"image", "video", "audio"}), audio_encoder="sound_encoder",
               vision_batch=VisionBatch.PER_REQUEST,
               refused_media_options=(("video", "video_pruning_rate", NEMOTRON_VIDEO_PRUNING),),
               notes="Nemotron-3 Nano Omni: hybrid Nemotron-H text (Mamba-2, attention and mixture-of-experts "
               "blocks); RADIO ViT on one dynamic-resolution view, pixel shuffle; Parakeet sound encoder"),
    # GLM-5-Next: no rotary anywhere (NoPE latent attention; the linear-attention layers carry order), so ROPE's
    # plain counting. Its sparse-attention layers keep mlx-vlm's CacheList with a PoolingCache (caches/layers.py:
    # the Pooling kind). The tower attends within each image of a call (cu_seqlens splits): one call for the tick's
    # images, keyed per image. Its processor returns mm_token_type_ids, which nothing reads. A video's frame pairs
    # are image-token blocks between its video markers, one GRID item a video (adapter._item_unit keeps the markers)
    FamilySpec("glm5_next", media=_QWEN_MEDIA, dropped_inputs=("mm_token_type_ids",), vision_batch=_ONE,
               item_split=_GRID,
               notes="GLM-5-Next: hyper-connections, gated-delta linear attention next to NoPE DeepSeek sparse "
               "attention with a pooled top-k indexer, mixture of experts"),
    # GOT-OCR 2.0: a Qwen2 decoder (plain RoPE, KV), one image a prompt (the processor writes one <img> block of 256
    # <imgpad> whatever the image count, and the merge fills it from the first image only). Its merge takes batch
    # row b's rows from image b of the call, so images of several requests cannot go through one
    # get_input_embeddings call under one prompt row: one call per request. The config names the rows' token
    # im_patch_token
    FamilySpec("got", media_token="im_patch_token", images_per_request=1, vision_batch=VisionBatch.PER_REQUEST,
               notes="GOT-OCR 2.0: Qwen2 text; SAM-style windowed ViT at 1024 px, a convolutional neck down to 256 "
               "rows"),
    # LocateAnything: a Qwen2 decoder (plain RoPE, KV) under Kimi-VL's MoonViT. Its chat template writes an image as
    # `<image-N>`, N counting the chat's images, which the processor expands (no fixed placeholder string: the
    # prompt's image count is that of `<image-`). pixel_values (patches, 3, 14, 14) with image_grid_hws rows, and the
    # processor returns `_grid_shapes` (a list of tuples) and `image_token_id` among the media, as Kimi-VL's: one
    # encoder call per request, keyed whole
    FamilySpec("locateanything", placeholder_text="<image-", vision_batch=VisionBatch.PER_REQUEST,
               notes="LocateAnything: Qwen2 text (its parallel box decoding, pbd_generate, is not mlx_vlm.generate's "
               "path); MoonViT tower, 2x2 patch merge"),
    FamilySpec("gemma3n", media=frozenset({"audio"}), refused="mlx-vlm's get_input_embeddings embeds a prompt's text "
               "tokens without the sqrt(hidden_size) scale its language model applies to the token ids it is fed, so "
               "a token the scheduler feeds as an id (the last prompt token as the first decode input, a preempted "
               "request's recomputed outputs) is not embedded as mlx_vlm.generate embeds it, and the outputs differ"),
    # LLaVA-NeXT: its processor expands an image's <image> to the HF feature count, and mlx-vlm's merge puts a block of
    # the tower's rows per view (pixel_values[0]: the first image's) and as many image_newline blocks in place of
    # those ids, cut to as many blocks as ids (splice.py). One image a prompt (mlx-vlm's single-image list), one
    # request an encoder call (its merge reads the call's first image only)
    FamilySpec("llava_next", splice=SpliceRows.VIEW_BLOCKS, images_per_request=1,
               vision_batch=VisionBatch.PER_REQUEST,
               notes="LLaVA-NeXT: CLIP tower on anyres views (a base view and a crop per grid cell)"),
    FamilySpec("mllama", refused="its language model cross-attends to each request's vision states (cross-"
               "attention layers fed `cross_attention_states`), which neither the inputs_embeds path nor a batch "
               "cache carries per row"),
    # Phi-4-reasoning-vision: its processor writes one id (-200, its model module's IMAGE_TOKEN_INDEX) an image, and
    # the merge puts the image's valid packed SigLIP2 patches there (as many as its pixel_attention_mask sets;
    # splice.py). Several images a prompt, each keyed and encoded alone (a one-id prompt gets an image's rows
    # bitwise as in a whole prompt, under both BLAS libraries)
    FamilySpec("phi4-siglip", placeholder_text="<image>", splice=SpliceRows.VALID_PATCHES,
               item_split=ItemSplit.PACKED,
               notes="Phi-4-reasoning-vision: SigLIP2 NaFlex tower on packed patches + Phi-3-style text"),
    FamilySpec("llava_qwen2", refused=FASTVLM_UNTESTED),
    # Bunny (one model class, two model types): its input preparation cuts the prompt at the text "<image>" and
    # writes one id (-200) between the pieces, which the merge replaces by the SigLIP tower's 729 rows (splice.py).
    # One image a prompt; one image an encoder call: its merge puts batch row b's image at that row's first id (a
    # call of several units in one sequence would lose all but the first), and stacked, its patch conv rounds an
    # image 1e-7 away from the image alone under OpenBLAS
    FamilySpec("llava-qwen2", placeholder_text="<image>", splice=SpliceRows.TOWER_GRID, images_per_request=1,
               item_split=ItemSplit.STACK, vision_batch=VisionBatch.PER_REQUEST,
               notes="Bunny: SigLIP at 384 px (729 rows an image) + Qwen2 text"),
    FamilySpec("bunny-llama", placeholder_text="<image>", splice=SpliceRows.TOWER_GRID, images_per_request=1,
               item_split=ItemSplit.STACK, vision_batch=VisionBatch.PER_REQUEST,
               notes="Bunny: SigLIP at 384 px (729 rows an image) + Llama-3 text"),
    FamilySpec("deepseek_vl_v2", refused="mlx-vlm's get_input_embeddings reads images_spatial_crop (one row per "
               "image) for as many rows as pixel_values has tiles (a global view and the local tiles of every "
               "image), past its end: the tile count it sums from that memory varies from one process to the next, "
               "so an image's tiles are kept or dropped at random and solo mlx_vlm itself is not deterministic"),
    FamilySpec("jvlm", refused="its language model's RoPE turns a batch cache's per-row offsets into one position "
               "(offset.max()) and takes no position ids, so in a batch every row shorter than the longest is rotated "
               "at the longest row's positions"),
    # IBM Granite Vision: LLaVA-NeXT's processor and mlx-vlm's LLaVA-NeXT merge (a block per view of the first
    # image, as many newline blocks, cut to as many blocks as the image's ids) on a SigLIP tower (no class row) with
    # several feature layers and Granite text (splice.py, VIEW_BLOCKS). One image a prompt (mlx-vlm's merge encodes
    # pixel_values[0] only), one request an encoder call
    FamilySpec("granite_vision", splice=SpliceRows.VIEW_BLOCKS, images_per_request=1,
               vision_batch=VisionBatch.PER_REQUEST,
               notes="Granite Vision: SigLIP tower on anyres views, several feature layers, Granite text"),
    # tests/models/test_refused_vlm_families.py builds it small and pins the fact
    FamilySpec("llama4", refused="its chunked-attention layers keep a ChunkedKVCache (make_cache), which has no batch "
               "form, and its language model builds their chunk mask from one offset (the batch cache's largest) "
               "with no padding mask, so in a left-padded batch a row shorter than the longest attends its pads and "
               "other chunk boundaries than alone"),
    # Janus / DeepSeek-VL (tests/models/test_refused_vlm_families.py pins its merge, and phi4mm's refusal):
    # mlx_vlm.load gives its processor mlx-vlm's own ImageProcessor (384 px), for which the input preparation writes
    # one image_token_index id per image; get_input_embeddings splices the tower's rows in there
    # (its num_image_tokens ids in between are dropped again by the merge: the row count is the tower's grid). One
    # image a prompt, and one an encoder call: mlx-vlm's merge drops the text between two images
    FamilySpec("multi_modality", placeholder_text="<image>", splice=SpliceRows.TOWER_GRID, images_per_request=1,
               item_split=ItemSplit.STACK, vision_batch=VisionBatch.PER_REQUEST,
               refused_options=(("vision_config.params.high_res_cfg", JANUS_HYBRID_TOWER),),
               notes="Janus / DeepSeek-VL: SigLIP tower at 384 px + LLaMA text"),
    # tests/models/test_refused_vlm_families.py builds it small and pins the fact
    FamilySpec("molmo_point", refused="mlx-vlm's MolmoPoint keeps the last embedded prompt's image state on the model "
               "instance (_image_cache, _token_bounds, the ids generated since), and its decode forward (its "
               "language_model is the model itself) scores point tokens, ids past the vocabulary (one per pooled "
               "patch of that image, then subpatches and locations), against that state: the logits' width and point "
               "scores belong to whichever prompt was embedded last, so a batch's rows cannot each decode against "
               "their own image"),
    FamilySpec("phi4mm", refused="its get_input_embeddings merges the vision or "
               "the speech LoRA into the language model's weights on the model instance (set_modality) for the media "
               "of the prompt it embeds (a text prompt keeps whichever the last one left), so requests of other "
               "modalities cannot share a forward"),
    # tests/models/test_refused_vlm_families.py builds each from mlx-vlm's config classes and measures the fact. The
    # engine's cache check would refuse minimax_m3_vl at load anyway (MiniMaxM3KVCache: no batch form), and
    # qwen4_exp's QSAKVCache too (a KVCache subclass, refused since the check matches classes exactly); the rows say
    # why they could not batch exactly even with a batch form. deepseek_v4's caches batch (PoolingCache: the Pooling
    # kind); what its pooled keys hold depends on where forwards split (scheduler/fixtures/VLM_FAMILIES.md)
    FamilySpec("deepseek_v4", refused="its compressed attention pools keys in windows of 4 that overlap the window "
               "before (ratio-4 layers and their indexer), and a forward pools its first new window with zeros in "
               "place of that earlier window (mlx-vlm's PoolingCache keeps none of it), so a prompt's keys depend on "
               "where its prefill is split: mlx_vlm.generate prefills an image prompt whole, last token included, and "
               "a text prompt in chunks of 2048, where the engine splits by its budgets, holds the last prompt token "
               "for the first decode step (a different window when the prompt length is a multiple of 4) and "
               "recomputes a preempted request's outputs in one forward that solo decoding pooled one window at a "
               "time. Its image sentinel ids (past the vocabulary, attending both ways inside an image, refused past "
               "cache offset 0) would be handled as Gemma 4's images are"),
    FamilySpec("minimax_m3_vl", refused="mlx-vlm's sparse attention cuts key blocks over cache slots, which a row's "
               "left padding shifts off its positions, and in a batch of rows of other lengths (mlx-vlm's own "
               "MiniMaxM3BatchKVCache, left-padded) a row's logits differ from the row alone"),
    FamilySpec("qwen4_exp", refused="mlx-vlm's Qwen sparse attention (QSA) picks key blocks for each query, and in "
               "a batch whose rows differ in length (mlx-vlm's own BatchQSAKVCache, left-padded) a row's logits "
               "differ from the row alone, the unpadded row's too; they agree when the block budget covers every "
               "block or the rows are of one length"),
    # tests/models/test_refused_vlm_families.py builds it small from mlx-vlm's config class and pins both facts
    FamilySpec("falcon_ocr", refused="mlx-vlm's get_input_embeddings returns a prefill mask (attention_mask_4d) under "
               "which each image's tokens attend to each other both ways, and mlx_vlm.generate prefills the prompt "
               "with it in one forward (no_chunked_prefill); the scheduler's prefill is causal and chunked. Its "
               "positions also put every token of an image block at one position, with 2-D patch positions (pos_hw), "
               "which its language model reads only from that call's outputs and state kept on the model instance"),
)}


# Other names mlx-vlm loads a row's model under (its MODEL_REMAPPING; the loaded config keeps the name it was
# given): each resolves to that row, tested under the alias in tests/models/test_vlm_aliases.py, which also lists
# the aliases of rows that do not resolve, with why
ALIASES: dict[str, str] = {
    "lfm2-vl": "lfm2_vl",
    "inkling_mm_model": "inkling",
}

# mlx-vlm vision-language model types with no row, with why (the README's list of families "not in the table" says
# more): refused at load like any type without a row, naming the reason
LEFT_OUT: dict[str, str] = {
    "paligemma": "its checkpoints attend bidirectionally over the whole prompt, which mlx-vlm prefills in one pass; "
                 "a chunked, batched prefill would differ",
    "phi3_v": "mlx-vlm's LongRoPE picks its rotary factors per forward from the largest position in it, so a batch "
              "row or a prefill chunk past original_max_position_embeddings changes the others' frequencies; and its "
              "hard-coded CLIP tower cannot be built small to test",
    "moondream2": "mlx-vlm's processor loads its tokenizer from the Hugging Face hub whatever the checkpoint holds, "
                  "so it cannot be built or tested offline",
    "zaya1_vl": "mlx-vlm 0.7.10 cannot generate with it (its prefill calls language_model(inputs=...), which "
                "ZAYA1-VL's LanguageModel names input_ids)",
    "deepseekocr": "mlx-vlm builds its SAM encoder from defaults whatever config.json says, so it cannot be built "
                   "small to test",
    "deepseekocr_2": "mlx-vlm builds its SAM encoder and its decoder-as-encoder from defaults whatever config.json "
                     "says, so it cannot be built small to test",
    "unlimited_ocr": "mlx-vlm builds its SAM encoder from defaults whatever config.json says (as deepseekocr), and "
                     "its RingSlidingKVCache has no batch form",
    "youtu_vl": "mlx-vlm 0.7.10 has no processor for it (the checkpoints' own is remote code)",
    "llmjpvl": "mlx-vlm 0.7.10 has no processor for it (the checkpoints' own is remote code)",
    "muse_spark": "its language model in mlx-vlm runs Metal kernels only",
    "cohere_compass": "its language model keeps only the last position's logits when the cache has left padding and "
                      "no mask is passed, its deepstack rows come in an object of their own, and its M-RoPE tokens "
                      "sit on the top-level config (a tiny build showed all three)",
    "florence2": "an encoder-decoder: its decoder cross-attends to each request's encoder states (a second cache "
                 "per layer), which the decoder-only batching has no place for",
    "nemotron_parse": "an encoder-decoder: its mBART-style decoder cross-attends to the vision encoder's states",
    "deepseek_v41": "it keeps one cache object for all its layers (DeepseekV41Cache), a kind the cache-layer "
                    "protocol does not know (mlx-vlm's BatchDeepseekV41Cache is not adopted; mlx-lm's text model of "
                    "the family is refused for its layer cache too)",
}


def family_for(model_type: str | None) -> FamilySpec:
    """The row of a loaded model's ``model_type`` (or of the row it is an alias of); UnsupportedFamily otherwise,
    naming why where the type is known to be left out."""
    name = model_type or ""
    spec = FAMILIES.get(name) or FAMILIES.get(ALIASES.get(name, ""))
    if spec is None:
        why = f"it is not batched here: {LEFT_OUT[name]}" if name in LEFT_OUT else "no VLM family spec for it"
        raise UnsupportedFamily(f"model_type {model_type!r}: {why}; supported: "
                                f"{', '.join(sorted(k for k, v in FAMILIES.items() if not v.refused))}")
    return spec

"""The library seam of the execution layer: the one place that reaches into mlx-lm internals (its mlx-vlm
counterpart is `scheduler/models/library.py`).

mlx-lm's batch-cache classes and model attributes move between minor releases (a refactor of the batch
classes broke wrappers before). Everything version-sensitive is here and in the cache-layer protocol
(`caches/layers.py`, which this module imports and which imports nothing from `scheduler`), and
tests/execution/test_library_seam.py pins the exact behaviour we rely on so an upgrade fails loudly in one spot.
"""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from caches import layers
from caches.kv import KVLayout, QuantizeRule

# The cache-layer protocol is `caches.layers`; these names are its operations, for the modules that drive
# model caches through this seam.
from caches.layers import (  # noqa: F401  (re-exported)
    Cache,
    cache_arrays,
    cache_nbytes,
    extend_batch,
    filter_batch,
    finalize_padded,
    join_rows,
    merge_caches,
    prepare_padded,
    restore_cache,
    snapshot_cache,
    split_batch,
)

from scheduler.families import Family, UnsupportedModel, family_of, model_type_of


def make_request_cache(model: Any, max_kv_size: int | None = None) -> Cache:
    """A fresh single-request cache: what `mlx_lm.generate` builds for a prompt.

    With `max_kv_size`, every layer is a `RotatingKVCache(max_kv_size, keep=0)`. mlx-lm's own single path
    keeps 4 attention-sink tokens (`keep=4`), but its batch cache has no `keep`, so batching with sinks
    would silently change results; we use no sinks on every path. Models that build their own caches
    (sliding-window models) ignore max_kv_size in mlx-lm; here that is an error, not a silent no-op.
    """
    if max_kv_size is None:
        return mlx_cache.make_prompt_cache(model)
    if supports_max_kv_size(model) is False:
        raise ValueError(f"max_kv_size: {type(model).__module__} builds its own caches; bound it with its "
                         "own sliding-window configuration instead")
    return [mlx_cache.RotatingKVCache(max_size=max_kv_size, keep=0) for _ in model.layers]


def supports_max_kv_size(model: Any) -> bool:
    return not hasattr(model, "make_cache")


def model_family(model: Any) -> Family:
    """The family facts of a text model, after checking that its caches can be batched at all: a family
    mlx-lm cannot batch raises UnsupportedModel (model type and reason) here, at load."""
    model_type = model_type_of(model)
    family = family_of(model_type)
    if family.refused:
        raise UnsupportedModel(model_type, family.refused)
    try:
        layers.check_batchable(make_request_cache(model))
    except layers.UnsupportedCache as exc:
        raise UnsupportedModel(model_type, str(exc)) from exc
    return family


def materialize(*models: Any) -> int:
    """Evaluate, on this thread, every array the models hold: their parameters, and the arrays that are not
    parameters (underscore attributes, and attributes of plain objects a module keeps, e.g. mlx-vlm Pixtral's
    rotary table, `PixtralRotaryEmbedding.inv_freq`, computed lazily at construction). MLX evaluates a lazy
    array on the stream it was built on, and streams are per thread: such an array, first needed by a forward
    on another thread (an AsyncEngine's loop, a server), raises "There is no Stream(cpu, 0) in current thread".
    A text model's probe forwards happen to evaluate what its text path needs; a vision tower is not probed.
    Returns how many arrays were evaluated (tests/execution/test_library_seam.py)."""
    arrays: list[mx.array] = []
    seen: set[int] = set()
    pending: list[Any] = [m for m in models if m is not None]
    while pending:
        obj = pending.pop()
        if isinstance(obj, _NOT_STATE) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            arrays.append(obj)
            continue
        if isinstance(obj, dict):  # an nn.Module is a dict of its arrays, submodules and lists
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
        pending.extend(getattr(obj, "__dict__", {}).values())  # other attributes; a plain object's fields
    mx.eval(arrays)
    return len(arrays)


# values that hold no model state: scalars, and code (classes, modules, functions, bound methods)
_NOT_STATE = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType,
              types.MethodType, types.BuiltinFunctionType)


def kv_layout(model: Any, max_kv_size: int | None = None) -> KVLayout:
    """Bytes of each layer (per token, sliding windows, fixed recurrent state), measured on a one-token probe
    of the model's own cache."""
    cache = make_request_cache(model, max_kv_size)
    model(mx.array([[0]]), cache=cache)
    mx.eval(cache_arrays(cache))
    layout = layers.probe_layout(cache)
    stores = [layer.bytes_per_token > 0 or layer.fixed_bytes > 0 for layer in layout.layers]
    if stores and not stores[0] and any(stores):
        # mlx-lm's models build a batch's attention mask from their first cache (nemotron-nas: the first
        # attention layer's, which a linear replacement of attention never writes): its rows' padding would not
        # be masked, and batched output would differ from each request's alone
        raise UnsupportedModel(model_type_of(model), "this checkpoint's first cache layer stores nothing (attention "
                               "replaced by a linear map), and the batch's attention mask is built from it")
    return layout


def check_rows_at_different_positions(model: Any, max_kv_size: int | None = None) -> None:
    """Raise UnsupportedModel unless the model's own code runs a decode step over a batch of rows at different
    positions (a one-token and a two-token prompt's caches, merged as the engine merges them): what every batched
    tick rests on, proved at load. Some checkpoints' options select code that takes one position for the whole
    batch: mlx-lm's `DynamicNTKScalingRoPE` (`rope_scaling` type "dynamic", InternLM 2.5's and 3's configs) derives
    its base with Python's `max` over the cache's offset, which a batch holds per row, and without this probe every
    batched decode of such a checkpoint failed, request by request."""
    caches = [make_request_cache(model, max_kv_size) for _ in range(2)]
    for cache, prompt in zip(caches, ([[1]], [[1, 2]])):
        model(mx.array(prompt), cache=cache)
    try:
        batch = layers.merge_caches(caches, family_of(model_type_of(model)).mask)
        mx.eval(model(mx.array([[3], [3]]), cache=batch))
    except Exception as exc:
        scaling = getattr(model_args(model), "rope_scaling", None)
        raise UnsupportedModel(model_type_of(model), "this checkpoint's model code fails on a batch of rows at "
                               f"different positions ({type(exc).__name__}: {exc})"
                               + (f"; its rope_scaling is {scaling}" if scaling else "")) from None


def mlx_lm_prefill_step() -> int:
    """mlx-lm generate_step's default `prefill_step_size`: where its quantized-KV check runs during a prompt."""
    import inspect

    from mlx_lm.generate import generate_step

    return int(inspect.signature(generate_step).parameters["prefill_step_size"].default)


def quantize_rule(bits: int, group_size: int, start: int) -> QuantizeRule:
    return QuantizeRule(bits, group_size, start, mlx_lm_prefill_step())


def quantized_kv_layout(model: Any, layout: KVLayout, rule: QuantizeRule) -> KVLayout:
    """`layout` with the bytes per token of each layer once quantized, measured on a one-token probe that is
    converted the way mlx-lm converts (`layers.probe_quantized_layout`: a family whose attention cannot read a
    quantized cache fails there, at configuration, as QuantizationRefused)."""
    def step(cache: Cache) -> mx.array:  # a one-token forward
        return model(mx.array([[0]]), cache=cache)

    quantized = layers.probe_quantized_layout(make_request_cache(model), step, rule.group_size, rule.bits)
    return layout.quantized(rule, quantized)


class HiddenStateSeamError(ValueError):
    """The model's logits are not `logits_from_hidden(model)(model.model(x))`: a hidden-state drafter (MTP)
    cannot run on it exactly, so it is refused at configuration."""


# Families whose `__call__` transforms the output head's logits after `output_head(model.model(x))`: the same
# transform, as data. `check_hidden_seam` proves on a probe that the result is the model's own call; a family
# that is neither here nor plain fails that probe and is refused.
_LOGIT_TRANSFORMS = {
    "granite": lambda model, logits: logits / model.logits_scaling,  # mlx_lm.models.granite
    "cohere": lambda model, logits: logits * model.model.args.logit_scale,  # mlx_lm.models.cohere
}


def logits_from_hidden(model: Any):
    """hidden -> logits exactly as the model's own `__call__` computes them from `model.model`'s output."""
    head = output_head(model)
    transform = _LOGIT_TRANSFORMS.get(getattr(model_args(model), "model_type", None))
    if transform is None:
        return head
    return lambda hidden: transform(model, head(hidden))


def check_hidden_seam(model: Any) -> None:
    """Raise HiddenStateSeamError unless `forward_with_hidden` gives the logits of the model's own `__call__`
    (compared on a probe with fresh caches): what the hidden-state path rests on, proved, not assumed."""
    probe = mx.array([[1, 2, 3, 4]])
    own = model(probe, cache=make_request_cache(model))
    try:
        seam, _ = forward_with_hidden(model, probe, make_request_cache(model))
        same = seam.shape == own.shape and bool(mx.allclose(seam, own, rtol=1e-4, atol=1e-5))
    except Exception as exc:  # no `model.model`, another signature: not the seam either
        raise HiddenStateSeamError(f"{type(model).__module__}: no hidden-state seam ({type(exc).__name__}: "
                                   f"{exc})") from None
    if not same:
        raise HiddenStateSeamError(
            f"{type(model).__module__}: its logits are not output_head(model.model(x)) (a logit scale, soft cap "
            "or other transform this seam does not know), so a hidden-state drafter would sample from the "
            "wrong distribution; use drafter='prompt-lookup' or 'draft-model'")


def forward_with_hidden(model: Any, inputs: mx.array, cache: Cache) -> tuple[mx.array, mx.array]:
    """(logits, final hidden states) of an mlx-lm model whose `model.model` returns the normed hidden states
    and whose output head is `lm_head` or the tied embedding, followed by the family's logit transform if it
    has one (`_LOGIT_TRANSFORMS`). Only for models `check_hidden_seam` accepts."""
    hidden = model.model(inputs, cache)
    return logits_from_hidden(model)(hidden), hidden


def has_native_mtp(model: Any) -> bool:
    """A model carrying its own multi-token-prediction module the way vllm-mlx's MTP models do: `.mtp` (not
    None), `.mtp_forward(hidden, next_tokens, mtp_cache=None) -> logits`, and `return_hidden=True` on its call."""
    return getattr(model, "mtp", None) is not None and callable(getattr(model, "mtp_forward", None))


def forward_with_native_hidden(model: Any, inputs: mx.array, cache: Cache) -> tuple[mx.array, mx.array]:
    """(logits, hidden states) from the model's own `return_hidden=True` call: the hidden states its own
    `mtp_forward` expects (whatever norm they are taken at), with the logits of its own call."""
    out = model(inputs, cache=cache, return_hidden=True)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise HiddenStateSeamError(f"{type(model).__module__}: return_hidden=True did not give (logits, hidden)")
    return out


def native_mtp_logits(model: Any, hidden: mx.array, tokens: mx.array) -> mx.array:
    """(n, H) hidden states and (n,) tokens they produced -> (n, V) logits of the token after, from the model's
    native MTP module (no MTP cache: each draft attends to itself only, as vllm-mlx calls it)."""
    return model.mtp_forward(hidden[:, None, :], tokens[:, None], mtp_cache=None)[:, -1, :]


def token_embedding(model: Any):
    return model.model.embed_tokens


def output_head(model: Any):
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear
    return model.lm_head


def model_args(model: Any) -> Any:
    return getattr(model, "args", None)


# Where mlx-lm's model args name the vocabulary: most families' `vocab_size`, phixtral's `num_vocab`; a wrapper
# around a text model (mistral3) keeps it in its `text_config`.
_VOCAB_FIELDS = ("vocab_size", "num_vocab")


def vocab_size(model: Any) -> int:
    args = model_args(model)
    text_config = getattr(args, "text_config", None)
    for source in (args, text_config):
        for name in _VOCAB_FIELDS:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if value:
                return int(value)
    return int(model.model.embed_tokens.weight.shape[0])


def max_positions(model: Any) -> int | None:
    args = model_args(model)
    value = getattr(args, "max_position_embeddings", None) if args is not None else None
    return int(value) if value else None


def is_vision_language_model(model: Any) -> bool:
    """mlx-vlm models: a language model next to their encoders (named per family: vision_tower, vision_model,
    audio_tower), built by mlx-vlm's model modules."""
    return hasattr(model, "language_model") and (
        type(model).__module__.startswith("mlx_vlm.") or hasattr(model, "vision_tower"))


def is_vision_language_dir(model_dir: Any) -> bool:
    import json
    from pathlib import Path

    config = Path(model_dir) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text(encoding="utf-8"))


def model_identity(model: Any) -> dict[str, Any]:
    """What identifies the model in a trace: its type and architecture numbers (not its weights)."""
    args = model_args(model)
    fields = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "num_key_value_heads", "sliding_window")
    identity = {f: getattr(args, f) for f in fields if args is not None and getattr(args, f, None) is not None}
    identity["class"] = f"{type(model).__module__}.{type(model).__name__}"
    return identity


def eos_token_ids(tokenizer: Any) -> frozenset[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eos is None else [eos]
    return frozenset(int(i) for i in ids)

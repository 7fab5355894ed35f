"""Reading a LoRA adapter directory, in either layout users bring: mlx-lm's (what `mlx_lm.lora` and mlx-vlm's
trainer write) or Hugging Face PEFT's (what vLLM's `--lora-modules` serves). Either way the result is mlx-lm's
layout: per adapted layer `lora_a` (in, r) and `lora_b` (r, out), with one scale, so the layers that serve
adapters (`scheduler/models/lora.py`) know one formula.

* **mlx-lm**: `adapter_config.json` (`fine_tune_type`, `lora_parameters.rank` / `.scale`) and
  `adapters.safetensors` with `<module path>.lora_a` / `.lora_b`.
* **PEFT**: `adapter_config.json` (`peft_type` "LORA", `r`, `lora_alpha`, `use_rslora`) and
  `adapter_model.safetensors` with `base_model.model.<module path>.lora_A.weight` (r, in) and `.lora_B.weight`
  (out, r). PEFT computes `scaling * B(A(x))` with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with
  rsLoRA), which is mlx-lm's `scale * (x @ A.T) @ B.T`. Module paths are the Hugging Face model's, which
  mlx-lm's text models keep, and which a vision-language model's language model gets under mlx-vlm's names
  (`in_language_model`); a path the model does not have is refused when the adapter is checked against it.
  What is not a plain LoRA of linear layers is refused naming the field: DoRA, `modules_to_save`, trained biases,
  `fan_in_fan_out` (GPT-2's Conv1D), per-module `rank_pattern` / `alpha_pattern`, embedding adapters,
  `adapter_model.bin` (pickled weights are not loaded: convert them to safetensors).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"  # mlx-lm's
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PICKLED_WEIGHTS = "adapter_model.bin"
_PEFT_PREFIX = "base_model.model."
# (a state dict taken from a live PeftModel names its adapter, "default"; saved files do not)
_PEFT_KEY = re.compile(r"(?P<target>.+)\.lora_(?P<half>[AB])(?:\.default)?\.weight")


class LoRAError(ValueError):
    """An adapter that cannot be served per request (unreadable, another kind of fine-tune, shapes that do not
    fit the model); names the adapter."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter as read from its directory."""

    name: str
    path: str
    scale: float
    rank: int
    targets: tuple[str, ...]  # the model's layers it adapts, by module path
    layout: str = "mlx-lm"  # or "peft": the layout it was read from


def read_adapter(name: str, path: Path) -> tuple[LoRAAdapter, dict[str, mx.array]]:
    """An adapter directory, in mlx-lm's or PEFT's layout -> the adapter and its weights in mlx-lm's layout
    (`<target>.lora_a` / `.lora_b`). Raises LoRAError naming what is wrong."""
    if not name:
        raise LoRAError("an adapter needs a non-empty name")
    config_file = path / ADAPTER_CONFIG
    if config_file.is_file() and (path / ADAPTER_WEIGHTS).is_file():
        config, weights = _load(name, config_file, path / ADAPTER_WEIGHTS)
        return _from_mlx(name, path, config, weights)
    if config_file.is_file() and (path / PEFT_WEIGHTS).is_file():
        config, weights = _load(name, config_file, path / PEFT_WEIGHTS)
        return _from_peft(name, path, config, weights)
    if config_file.is_file() and (path / PEFT_PICKLED_WEIGHTS).is_file():
        raise LoRAError(f"adapter {name!r}: {path} holds {PEFT_PICKLED_WEIGHTS}, pickled weights, which are not "
                        f"loaded; save them as {PEFT_WEIGHTS} (PEFT's save_pretrained does by default)")
    raise LoRAError(f"adapter {name!r}: {path} has no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (the layout "
                    f"mlx_lm.lora writes) or {PEFT_WEIGHTS} (PEFT's)")


# Hugging Face's module paths of a vision-language model's language model (transformers 5's, then 4's) -> mlx-vlm's,
# under its `language_model` module: what a PEFT adapter trained with transformers names
_HF_LANGUAGE_MODEL = (("model.language_model.", "model."), ("model.layers.", "model.layers."), ("lm_head", "lm_head"))


def in_language_model(adapter: LoRAAdapter, weights: dict[str, mx.array],
                      within: str) -> tuple[LoRAAdapter, dict[str, mx.array]]:
    """A PEFT adapter of a vision-language model with its module paths as mlx-vlm names them: Hugging Face's
    `model.language_model.<x>` (transformers 5) or `model.layers.<x>` (4) is mlx-vlm's `<within>.model.<x>`, and
    `lm_head` its `<within>.lm_head`. Other paths stay (the vision tower's are then refused as outside `within`);
    an mlx-vlm adapter's are mlx-vlm's already."""
    if adapter.layout != "peft":
        return adapter, weights

    def ours(target: str) -> str:
        if target.startswith(within + "."):
            return target
        for hf, mlx_vlm in _HF_LANGUAGE_MODEL:
            if target == hf or target.startswith(hf):
                return f"{within}.{mlx_vlm}{target[len(hf):]}"
        return target

    renamed = {f"{ours(key.rsplit('.', 1)[0])}.{key.rsplit('.', 1)[1]}": value for key, value in weights.items()}
    return replace(adapter, targets=tuple(sorted(ours(t) for t in adapter.targets))), renamed


def _load(name: str, config_file: Path, weights_file: Path) -> tuple[dict, dict[str, mx.array]]:
    try:
        config = json.loads(config_file.read_text())
        weights = mx.load(str(weights_file))
    except (OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"adapter {name!r}: cannot read {config_file.parent}: {e}") from e
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {ADAPTER_CONFIG} is not a JSON object")
    return config, weights


def _from_mlx(name: str, path: Path, config: dict,
              weights: dict[str, mx.array]) -> tuple[LoRAAdapter, dict[str, mx.array]]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise LoRAError(f"adapter {name!r}: fine_tune_type {kind!r}; only LoRA adapters are served per request "
                        "(fuse it into the model with mlx_lm.fuse instead)")
    parameters = config.get("lora_parameters") or {}
    if "rank" not in parameters or "scale" not in parameters:
        raise LoRAError(f"adapter {name!r}: {ADAPTER_CONFIG} has no lora_parameters rank and scale")
    targets = sorted({key.rsplit(".", 1)[0] for key in weights})
    for target in targets:
        if set(k for k in weights if k.rsplit(".", 1)[0] == target) != {f"{target}.lora_a", f"{target}.lora_b"}:
            raise LoRAError(f"adapter {name!r}: {target} does not hold exactly lora_a and lora_b (DoRA and "
                            "adapters of other layer kinds are not served per request)")
    if not targets:
        raise LoRAError(f"adapter {name!r}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return LoRAAdapter(name, str(path), float(parameters["scale"]), int(parameters["rank"]), tuple(targets)), weights


def _from_peft(name: str, path: Path, config: dict,
               weights: dict[str, mx.array]) -> tuple[LoRAAdapter, dict[str, mx.array]]:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {kind!r}; only LoRA adapters are served per request")
    refused = {
        "use_dora": "DoRA adapters are not served per request",
        "modules_to_save": "it replaces whole modules, which per-request adapters do not",
        "fan_in_fan_out": "its weights are laid out for GPT-2's Conv1D",
        "rank_pattern": "per-module ranks are not read",
        "alpha_pattern": "per-module alphas are not read",
        "layer_replication": "it replicates layers",
    }
    for field, why in refused.items():
        if config.get(field):
            raise LoRAError(f"adapter {name!r}: {ADAPTER_CONFIG} sets {field}: {why}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r}: {ADAPTER_CONFIG} has bias {config['bias']!r}: trained biases are not "
                        "served per request")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"adapter {name!r}: {ADAPTER_CONFIG} needs r (an integer >= 1) and lora_alpha")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        match = _PEFT_KEY.fullmatch(key.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise LoRAError(f"adapter {name!r}: {PEFT_WEIGHTS} holds {key}, not a LoRA weight of a linear layer "
                            "(lora_A / lora_B; embedding adapters, magnitudes and biases are not served)")
        halves.setdefault(match["target"], {})[match["half"]] = value
    converted: dict[str, mx.array] = {}
    for target, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"} or pair["A"].ndim != 2 or pair["B"].ndim != 2:
            raise LoRAError(f"adapter {name!r}: {target} does not hold one 2-D lora_A and lora_B")
        # PEFT's A is (r, in) and B (out, r): mlx-lm's lora_a (in, r) and lora_b (r, out) are their transposes
        converted[f"{target}.lora_a"] = pair["A"].T
        converted[f"{target}.lora_b"] = pair["B"].T
    if not converted:
        raise LoRAError(f"adapter {name!r}: {PEFT_WEIGHTS} holds no LoRA weights")
    return LoRAAdapter(name, str(path), float(scale), rank, tuple(sorted(halves)), "peft"), converted


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_WEIGHTS", "LoRAAdapter", "LoRAError", "in_language_model",
           "read_adapter"]

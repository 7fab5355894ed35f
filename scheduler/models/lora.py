"""LoRA adapters chosen per request: several adapters over one base model, rows of one batch on different ones.

`LoRASet.install(model, {name: directory})` reads each adapter (the layout `mlx_lm.lora` writes, or Hugging Face
PEFT's, turned into mlx-lm's by `scheduler/models/lora_formats.py`: per adapted layer `lora_a` / `lora_b` and a
scale) and puts an adapted layer in place of every layer some adapter adapts: a `MultiLoRALinear` for a linear
layer, a `MultiLoRASwitchLinear` for an expert projection of a mixture-of-experts block. Before a forward the
executor says which adapter each row uses (`LoRASet.rows`); outside that the layers compute the base model.
Adapters also come and go while an engine runs: `prepare` reads and checks one on any thread, `commit` installs
it and `remove` uninstalls it on the engine's, between forwards (`Engine.load_lora` / `unload_lora`).

What a row computes is what `mlx_lm.load(model, adapter_path=...)` (or mlx-vlm's, whose adapters have the same
layout and formula) would for that request alone. A forward whose rows are all on one adapter adds mlx-lm's
update exactly (`LoRALinear`'s `(scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)`, `LoRASwitchLinear`'s the
same through each token's experts' pairs); one with no row on an adapter runs the base layers alone. A mixed
forward runs one gathered matmul pair per layer (`mx.gather_mm`), each row through its own adapter's matrices
stacked with zeros for the base model (so a base row gets `y + 0`, its base output exactly, and an adapter row
the same products within rounding), so its cost does not grow with the number of adapters in the batch.

Expert projections need one more thing in a mixed forward: mlx-lm's `SwitchGLU` / `SwitchMLP` regroup a
forward's tokens by expert before their projections (once a forward routes 64 tokens or more), so a projection
alone cannot tell which row a token came from. The block becomes a `RoutedExperts`, which hands its projections
the block's expert indices, from which they rebuild that regrouping's order (`_Routing`); a change in how mlx-lm
regroups fails the mixed-adapter tests loudly rather than mixing rows.

Only mlx-lm's LoRA (`fine_tune_type` "lora") on `nn.Linear` / `nn.QuantizedLinear` layers and on the expert
projections (`SwitchLinear` / `QuantizedSwitchLinear`) of `SwitchGLU` / `SwitchMLP` blocks is read: DoRA, full
fine-tunes and adapters of embeddings raise `LoRAError`, as does an adapter whose shapes do not fit the model or,
on a vision-language model, that adapts a layer outside its language model (`within`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from .lora_formats import ADAPTER_CONFIG, LoRAAdapter, LoRAError, in_language_model, read_adapter


class UnknownLoRA(LookupError):
    """No adapter of that name is loaded."""


class LoRAInUse(ValueError):
    """An adapter live requests run on cannot be unloaded."""


class _Selection:
    """Which adapter each row of the running forward uses, as every adapted layer of a model reads it. Empty
    outside `LoRASet.rows`: the layers then compute the base model."""

    def __init__(self) -> None:
        self.owner: LoRASet | None = None  # the set installed with it (another engine on the model reuses it)
        self.single: int | None = None  # every row on this one adapter's slot
        # a mixed forward: each row's slot + 1 (0: the base model), the slots present, the rows, the slots there are
        self.row_slots: mx.array | None = None
        self.present: frozenset[int] = frozenset()
        self.batch = 0
        self.slots = 0
        # within a mixed forward's call of a mixture-of-experts block (`RoutedExperts`): its tokens' experts
        self.routing: _Routing | None = None


class _Routing:
    """The expert indices one call of a mixture-of-experts block got, `(rows, ..., k)` laid out by batch row, and
    from them which row each of its expert projections' gathered tokens belongs to."""

    def __init__(self, indices: mx.array):
        self.indices = indices
        self._rows: dict[bool, mx.array] = {}

    def rows_of(self, indices: mx.array, sorted_indices: bool, batch: int) -> mx.array:
        """The batch row of each entry of `indices` (a projection's; same shape): laid out as the block's own
        indices, or, when `sorted_indices`, flattened and sorted by expert as mlx-lm's `SwitchGLU` / `SwitchMLP`
        sort them (`switch_layers._gather_sort`: `argsort` of the flattened indices)."""
        n = self.indices.size
        laid_out = indices.shape == (n,) if sorted_indices else indices.shape == self.indices.shape
        if not laid_out or n % batch:
            raise LoRAError(f"an expert projection got indices of shape {tuple(indices.shape)} in a forward of "
                            f"{batch} rows on different adapters, its block {tuple(self.indices.shape)}: this "
                            "model does not keep its batch rows apart")
        if sorted_indices not in self._rows:
            position = mx.argsort(self.indices.flatten()) if sorted_indices else mx.arange(n).reshape(indices.shape)
            self._rows[sorted_indices] = position // (n // batch)
        return self._rows[sorted_indices]


class RoutedExperts(nn.Module):
    """A mixture-of-experts block whose expert projections some adapter adapts (mlx-lm's `SwitchGLU` or
    `SwitchMLP`, called as `(x, indices)`), unchanged but for one thing: in a forward of rows on different adapters,
    its projections learn which row each token they are given belongs to, which the block's regrouping of tokens
    by expert otherwise hides."""

    def __init__(self, base: nn.Module, selection: _Selection):
        super().__init__()
        self.base = base
        self._selection = selection

    def __call__(self, x: mx.array, indices: mx.array, *args, **kwargs) -> mx.array:
        selection = self._selection
        if selection.row_slots is None:
            return self.base(x, indices, *args, **kwargs)
        selection.routing = _Routing(indices)
        try:
            return self.base(x, indices, *args, **kwargs)
        finally:
            selection.routing = None


@dataclass
class _Stacks:
    """A layer's adapters stacked for a mixed forward: entry 0 is zeros (the base model, and adapters that do not
    adapt the layer), ranks zero-padded to the largest; `index` maps a row's slot + 1 to its entry. An expert
    layer's are stacked by entry then expert: entry e's expert j is matrix `e * experts + j`."""

    lora_a: mx.array  # (entries * experts, in, r)
    lora_b: mx.array  # (entries * experts, r, out)
    scales: mx.array  # (entries,)
    index: mx.array  # (slots + 1,) uint32


class _AdaptedLayer(nn.Module):
    """A layer and the adapters that adapt it, by slot: each row of a forward gets its own adapter's update
    (`LoRASet.rows`), or none. Subclasses say how an update is computed, alone and stacked."""

    def __init__(self, base: nn.Module, selection: _Selection):
        super().__init__()
        self.base = base
        self.adapters: dict[str, dict[str, mx.array]] = {}  # slot (as a string: a parameter tree key) -> a, b
        self._scales: dict[int, float] = {}
        self._selection = selection
        self._stacks: _Stacks | None = None  # built at the first mixed forward after a change

    def add(self, slot: int, lora_a: mx.array, lora_b: mx.array, scale: float) -> None:
        self.adapters[str(slot)] = {"lora_a": lora_a, "lora_b": lora_b}
        self._scales[slot] = scale
        self._stacks = None

    def drop(self, slot: int) -> None:
        del self.adapters[str(slot)]
        del self._scales[slot]
        self._stacks = None

    # how mlx-lm stores the pair: as `x @ a @ b` takes it (LoRALinear), or transposed (LoRASwitchLinear's per expert)
    _stored_transposed = False

    def _oriented(self, slot: int) -> tuple[mx.array, mx.array]:
        """A slot's (lora_a, lora_b) as `x @ a @ b` takes them: `(..., in, r)` and `(..., r, out)`."""
        weights = self.adapters[str(slot)]
        if self._stored_transposed:
            return weights["lora_a"].swapaxes(-1, -2), weights["lora_b"].swapaxes(-1, -2)
        return weights["lora_a"], weights["lora_b"]

    def _stacked(self, slots: int) -> _Stacks:
        if self._stacks is None or self._stacks.index.size < slots + 1:
            mine = sorted(self._scales)
            pairs = [self._oriented(s) for s in mine]
            rank = max(a.shape[-1] for a, _ in pairs)
            a0, b0 = pairs[0]
            index = [0] * (slots + 1)
            for entry, slot in enumerate(mine, 1):
                index[slot + 1] = entry
            pad_a = [(0, 0)] * (a0.ndim - 1)
            pad_b = [(0, 0)] * (b0.ndim - 2)
            lora_a = mx.stack([mx.zeros((*a0.shape[:-1], rank), a0.dtype)]
                              + [mx.pad(a, pad_a + [(0, rank - a.shape[-1])]) for a, _ in pairs])
            lora_b = mx.stack([mx.zeros((*b0.shape[:-2], rank, b0.shape[-1]), b0.dtype)]
                              + [mx.pad(b, pad_b + [(0, rank - b.shape[-2]), (0, 0)]) for _, b in pairs])
            self._stacks = _Stacks(lora_a.reshape(-1, *lora_a.shape[-2:]), lora_b.reshape(-1, *lora_b.shape[-2:]),
                                   mx.array([0.0] + [self._scales[s] for s in mine]),
                                   mx.array(index, dtype=mx.uint32))
        return self._stacks

    @staticmethod
    def _mixed(x: mx.array, y: mx.array, stacks: _Stacks, entries: mx.array, matrices: mx.array) -> mx.array:
        """`y` plus each token's own adapter update: `entries` its adapter's stack entry, `matrices` (the same
        shape) the stacked matrices it goes through."""
        z = mx.gather_mm(mx.gather_mm(x, stacks.lora_a, rhs_indices=matrices), stacks.lora_b, rhs_indices=matrices)
        scale = stacks.scales[entries].astype(z.dtype)
        scale = scale.reshape(*scale.shape, *([1] * (z.ndim - scale.ndim)))
        return y + (scale * z).astype(x.dtype)


class MultiLoRALinear(_AdaptedLayer):
    """A linear layer (`nn.Linear` / `nn.QuantizedLinear`) and its adapters (mlx-lm's `LoRALinear`)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        selection = self._selection
        if selection.single is not None:  # every row on one adapter: mlx-lm's LoRALinear, exactly
            if selection.single not in self._scales:
                return y
            lora_a, lora_b = self._oriented(selection.single)
            z = (x @ lora_a) @ lora_b
            return y + (self._scales[selection.single] * z).astype(x.dtype)
        if selection.row_slots is None or not selection.present & self._scales.keys():
            return y  # no row on an adapter of this layer
        # a mixed forward: one gathered matmul pair, each row through its own adapter's (zeros for the others)
        if x.shape[0] != selection.batch:  # a layer fed tokens not laid out by row: the rows cannot be told apart
            raise LoRAError(f"a linear layer got inputs of shape {tuple(x.shape)} in a forward of {selection.batch} "
                            "rows on different adapters: this model does not keep its batch rows apart")
        stacks = self._stacked(selection.slots)
        entries = stacks.index[selection.row_slots]
        return self._mixed(x, y, stacks, entries, entries)


class MultiLoRASwitchLinear(_AdaptedLayer):
    """An expert projection of a mixture-of-experts block (`SwitchLinear` / `QuantizedSwitchLinear`, called with
    each token's experts) and its adapters (mlx-lm's `LoRASwitchLinear`: one low-rank pair per expert). Its block
    is a `RoutedExperts`, which tells it, in a mixed forward, which row each token it is given comes from."""

    _stored_transposed = True  # mlx-lm's (experts, r, in) and (experts, out, r)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base(x, indices, sorted_indices=sorted_indices)
        selection = self._selection
        if selection.single is not None:  # every row on one adapter: mlx-lm's LoRASwitchLinear, exactly
            if selection.single not in self._scales:
                return y
            lora_a, lora_b = self._oriented(selection.single)
            z = mx.gather_mm(x, lora_a, rhs_indices=indices, sorted_indices=sorted_indices)
            z = mx.gather_mm(z, lora_b, rhs_indices=indices, sorted_indices=sorted_indices)
            return y + (self._scales[selection.single] * z).astype(x.dtype)
        if selection.row_slots is None or not selection.present & self._scales.keys():
            return y
        if selection.routing is None:
            raise LoRAError("an expert projection was called outside its block's routing in a forward of rows on "
                            "different adapters: this model's experts are not called as block(x, indices)")
        rows = selection.routing.rows_of(indices, sorted_indices, selection.batch)
        stacks = self._stacked(selection.slots)
        entries = stacks.index[selection.row_slots][rows]
        # entry e's expert j is stacked matrix e * experts + j (not sorted by expert any more: sorted_indices off)
        return self._mixed(x, y, stacks, entries, entries * self.base.num_experts + indices)


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read and checked against the model, not installed yet (`LoRASet.prepare`, `commit`)."""

    adapter: LoRAAdapter
    weights: dict[str, mx.array]


class LoRASet:
    """The adapters installed on one model, by name; `rows(names)` selects them per row around a forward.
    Adapters are added (`prepare` then `commit`) and removed (`remove`) between forwards."""

    def __init__(self, model: nn.Module, within: str | None = None):
        self._model = model
        # the module whose linear layers adapters may adapt (a vision-language model's `language_model`: its
        # vision tower's features are shared by requests on any adapter, in the vision cache); None: any
        self.within = within
        self.adapters: dict[str, LoRAAdapter] = {}
        self._slots: dict[str, int] = {}
        self._next_slot = 0  # a removed adapter's slot is not reused: nothing can still select it
        self._layers: dict[str, MultiLoRALinear] = {}  # module path -> the layer installed there
        self._selection = _Selection()
        self._selection.owner = self

    @classmethod
    def install(cls, model: nn.Module, adapters: Mapping[str, str | Path], within: str | None = None) -> "LoRASet":
        """Read each adapter and install it on `model` (in place: its adapted linear layers become
        `MultiLoRALinear`s, which compute the base model whenever no row selects an adapter). A model that
        carries the same adapters already (another engine's on it) gets the set it carries; one that carries
        others raises ValueError (load the model again). Raises LoRAError for an adapter that cannot be read or
        does not fit, and then changes nothing. `within`: the module path adapters must stay inside."""
        installed = next((m for _, m in model.named_modules() if isinstance(m, _AdaptedLayer)), None)
        if installed is not None:
            owner = installed._selection.owner
            if {n: a.path for n, a in owner.adapters.items()} != {str(n): str(p) for n, p in adapters.items()}:
                raise ValueError(f"this model carries other per-request adapters already ({', '.join(owner.names)}"
                                 "): load it again")
            return owner
        loras = cls(model, within)
        prepared = [loras.prepare(str(name), path) for name, path in adapters.items()]  # all checked first
        for one in prepared:
            loras.commit(one)
        return loras

    def prepare(self, name: str, path: str | Path) -> PreparedAdapter:
        """Read adapter `name` from `path` and check it against the model's layers; the model is not
        touched. Raises LoRAError (unreadable, another kind of fine-tune, a layer or shape that does not fit)."""
        adapter, weights = read_adapter(name, Path(path))
        if self.within is not None:
            adapter, weights = in_language_model(adapter, weights, self.within)
        for target in adapter.targets:
            if self.within is not None and not target.startswith(self.within + "."):
                raise LoRAError(f"adapter {name!r}: {target} is outside {self.within}; per-request adapters adapt "
                                f"{self.within} only (the vision tower's features are shared by every request)")
            layer = _module_at(self._model, target)
            base = layer.base if isinstance(layer, _AdaptedLayer) else layer
            lora_a, lora_b = weights[f"{target}.lora_a"], weights[f"{target}.lora_b"]
            if isinstance(base, (nn.Linear, nn.QuantizedLinear)):
                out_dims, in_dims = _linear_dims(base)
                want_a, want_b = (in_dims, adapter.rank), (adapter.rank, out_dims)
            elif isinstance(base, (SwitchLinear, QuantizedSwitchLinear)):
                block = _module_at(self._model, target.rsplit(".", 1)[0])
                if not isinstance(block, (SwitchGLU, SwitchMLP)):
                    # the block must be one whose regrouping of tokens by expert `RoutedExperts` knows
                    raise LoRAError(f"adapter {name!r}: {target} is an expert projection outside mlx-lm's SwitchGLU "
                                    f"and SwitchMLP blocks (in a {type(block).__name__}); rows on different "
                                    "adapters could not be told apart in it")
                experts, in_dims, out_dims = base.num_experts, base.input_dims, base.output_dims
                want_a, want_b = (experts, adapter.rank, in_dims), (experts, out_dims, adapter.rank)
            else:
                raise LoRAError(f"adapter {name!r}: {target} is "
                                f"{'not in the model' if base is None else type(base).__name__}, not a linear layer "
                                "or an expert projection (only LoRA on those is served per request)")
            if lora_a.shape != want_a or lora_b.shape != want_b:
                raise LoRAError(f"adapter {name!r}: {target} has lora_a {tuple(lora_a.shape)} and "
                                f"lora_b {tuple(lora_b.shape)}; the layer takes {want_a} and {want_b} for the "
                                f"rank {adapter.rank} its {ADAPTER_CONFIG} names")
        # evaluated here, on the caller's thread: an MLX array is computed on a stream of the thread that made it,
        # and the engine's thread, which installs it, has none of another thread's
        mx.eval(weights)
        return PreparedAdapter(adapter, weights)

    def commit(self, prepared: PreparedAdapter) -> None:
        """Install a prepared adapter under its name (between forwards): the layers it adapts become
        `MultiLoRALinear`s where they are not yet, and it takes a slot of its own."""
        adapter = prepared.adapter
        if adapter.name in self.adapters:
            raise ValueError(f"an adapter named {adapter.name!r} is installed already")
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        for target in adapter.targets:
            if target not in self._layers:
                self._layers[target] = self._adapt(target)
            self._layers[target].add(slot, prepared.weights[f"{target}.lora_a"], prepared.weights[f"{target}.lora_b"],
                                     adapter.scale)
        mx.eval([self._layers[target].adapters for target in adapter.targets])
        self.adapters[adapter.name] = adapter
        self._slots[adapter.name] = slot

    def _adapt(self, target: str) -> _AdaptedLayer:
        """Put an adapted layer in place of the model's layer at `target` (an expert projection's block becomes a
        `RoutedExperts` too, once); returns it."""
        base = _module_at(self._model, target)
        if isinstance(base, (SwitchLinear, QuantizedSwitchLinear)):
            block_path = target.rsplit(".", 1)[0]
            if not isinstance(_module_at(self._model, block_path, transparent=False), RoutedExperts):
                _replace(self._model, block_path, RoutedExperts(_module_at(self._model, block_path), self._selection))
            layer: _AdaptedLayer = MultiLoRASwitchLinear(base, self._selection)
        else:
            layer = MultiLoRALinear(base, self._selection)
        _replace(self._model, target, layer)
        return layer

    def remove(self, name: str) -> None:
        """Uninstall adapter `name` (between forwards, with no row on it): its weights leave every layer (a layer
        left with none computes its base, as before)."""
        slot = self._slots.pop(name)
        for target in self.adapters.pop(name).targets:
            self._layers[target].drop(slot)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Within: row i of each forward uses adapter `names[i]` (None: the base model). Names not installed
        raise KeyError."""
        slots = [None if name is None else self._slots[name] for name in names]
        selection = self._selection
        present = frozenset(s for s in slots if s is not None)
        if not present:
            yield
            return
        if len(present) == 1 and None not in slots:
            selection.single = slots[0]
        else:
            selection.row_slots = mx.array([0 if s is None else s + 1 for s in slots], dtype=mx.uint32)
            selection.present, selection.batch, selection.slots = present, len(slots), self._next_slot
        try:
            yield
        finally:
            selection.single, selection.row_slots, selection.present, selection.batch = None, None, frozenset(), 0


def _module_at(model: nn.Module, path: str, transparent: bool = True) -> nn.Module | None:
    """The module at `path` as the model was loaded (`named_modules()`' names), looking through the
    `RoutedExperts` put around expert blocks (`transparent`: also at the end); None where there is none."""
    found = _walk(model, path)
    while transparent and isinstance(found, RoutedExperts):
        found = found.base
    return found if isinstance(found, nn.Module) else None


def _walk(model: nn.Module, path: str) -> nn.Module | list | None:
    found: object = model
    for part in path.split(".") if path else ():
        while isinstance(found, RoutedExperts):
            found = found.base
        if isinstance(found, list) and part.isdigit() and int(part) < len(found):
            found = found[int(part)]
        elif isinstance(found, nn.Module) and isinstance(found.get(part), (nn.Module, list)):
            found = found[part]
        else:
            return None
    return found


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put `new` at `path` (named as `_module_at` names it)."""
    parent_path, _, key = path.rpartition(".")
    parent = _walk(model, parent_path)
    while isinstance(parent, RoutedExperts):
        parent = parent.base
    if isinstance(parent, list):
        parent[int(key)] = new
    else:
        setattr(parent, key, new)


def _linear_dims(layer: nn.Module) -> tuple[int, int]:
    out_dims, in_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
    return out_dims, in_dims


__all__ = ["ADAPTER_CONFIG", "LoRAAdapter", "LoRAError", "LoRAInUse", "LoRASet", "MultiLoRALinear",
           "MultiLoRASwitchLinear", "RoutedExperts", "UnknownLoRA"]

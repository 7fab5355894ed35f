"""Pins the mlx-lm (and MLX) behaviour scheduler/execution/library.py relies on. If an upgrade moves any of it,
these fail here, loudly, instead of as wrong tokens somewhere else."""

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from scheduler.execution import library


def _filled(model, tokens):
    cache = library.make_request_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval(library.cache_arrays(cache))
    return cache


def test_request_caches_are_what_mlx_lm_generate_builds(text_model, sliding_model):
    text = library.make_request_cache(text_model[0])
    assert all(type(c) is KVCache for c in text)
    sliding = library.make_request_cache(sliding_model[0])
    assert [type(c) for c in sliding].count(RotatingKVCache) == 3
    assert [type(c) for c in sliding].count(KVCache) == 1


def test_merge_extend_filter_round_trip_keeps_each_rows_keys(text_model):
    model = text_model[0]
    a, b, c = _filled(model, [7, 8, 9]), _filled(model, [10] * 5), _filled(model, [11, 12])
    batch = library.merge_caches([a, b])
    # mlx-lm's BatchKVCache, subclassed only for its mask (rolled-back drafts as masked holes: caches/layers.py)
    assert all(isinstance(layer, BatchKVCache) for layer in batch)
    batch = library.extend_batch(batch, library.merge_caches([c]))
    assert batch[0].left_padding.tolist() == [2, 0, 3]
    assert batch[0].offset.tolist() == [3, 5, 2]
    # row 2 (c) keeps its own keys right-aligned after extend
    k = batch[0].keys[2, :, batch[0].left_padding[2].item(): batch[0]._idx]
    assert mx.array_equal(k, c[0].keys[0, :, :2])
    batch = library.filter_batch(batch, [0, 2])
    assert batch[0].offset.tolist() == [3, 2]
    assert library.filter_batch(batch, []) == []


def test_rotating_caches_merge_into_batch_rotating(sliding_model):
    model = sliding_model[0]
    batch = library.merge_caches([_filled(model, [7] * 20), _filled(model, [8] * 3)])
    kinds = [type(layer) for layer in batch]
    assert kinds.count(BatchRotatingKVCache) == 3 and sum(issubclass(k, BatchKVCache) for k in kinds) == 1


def test_nbytes_counts_the_real_arrays(text_model):
    cache = _filled(text_model[0], [7, 8, 9])
    assert library.cache_nbytes(cache) == sum(c.keys.nbytes + c.values.nbytes for c in cache) > 0


def test_model_facts(text_model):
    model, tokenizer = text_model
    assert library.vocab_size(model) == 512
    assert library.max_positions(model) is not None
    eos = library.eos_token_ids(tokenizer)
    assert eos and all(isinstance(i, int) for i in eos)


_MATERIALIZE_SCRIPT = """
import os, threading
import mlx.core as mx, mlx.nn as nn
from scheduler.execution import library

class Table:  # a plain object a module keeps, as mlx-vlm's PixtralRotaryEmbedding is
    def __init__(self):
        self.freqs = mx.arange(8).astype(mx.float32) * 2

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.table = Table()
        self._hidden = mx.ones((3,)) + 1  # underscore: not a parameter

def on_another_thread(model):
    out = []
    def run():
        try:
            mx.eval(model.table.freqs, model._hidden)
            out.append("ok")
        except RuntimeError as exc:
            out.append(str(exc))
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]

lazy, ready = Model(), Model()
count = library.materialize(ready)
print(on_another_thread(lazy), "|", on_another_thread(ready), "|", count, flush=True)
os._exit(0)  # not the interpreter's exit: a thread that ran MLX work can make that abort (MLX's thread-locals)
"""


def test_materialize_evaluates_what_the_parameters_leave_out():
    """Pins the MLX behaviour `library.materialize` exists for (a lazy array built on one thread cannot be
    evaluated on another), and that it reaches arrays outside `parameters()`: an underscore attribute and a plain
    object's field. In a child process, which leaves with os._exit."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _MATERIALIZE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lazy, ready, count = (part.strip() for part in run.stdout.strip().split("|"))
    assert "There is no Stream" in lazy, lazy
    assert ready == "ok"
    assert count == "4"  # linear.weight, linear.bias, table.freqs, _hidden


def test_a_recurrent_row_split_from_a_batch_does_not_keep_the_batch_alive():
    """mlx-lm's `ArraysCache.extract` slices the batch's state, and a slice keeps the whole buffer alive; the
    split (`split_batch`, after a shared prefill forward) copies the row, so a request holds its own state's
    bytes only, which is what the KV budget counts."""
    import gc

    from mlx_lm.models.cache import ArraysCache

    from caches import layers

    rows, shape = 8, (1, 256, 1024)  # 1 MiB of float32 state per row
    batch = ArraysCache(2)
    batch.cache = [mx.random.normal((rows, *shape[1:])), mx.random.normal((rows, *shape[1:]))]
    mx.eval(batch.cache)
    gc.collect()
    before = mx.get_active_memory()
    row = layers.split_batch([batch], rows)[0]
    mx.eval(layers.cache_arrays(row))
    del batch
    gc.collect()
    held = mx.get_active_memory() - before + 2 * rows * (1 << 20)  # the batch's 16 MiB are gone
    assert layers.cache_nbytes(row) == 2 * (1 << 20)
    assert held <= 2 * layers.cache_nbytes(row), held



def test_a_library_subclass_of_a_cache_kind_is_refused_not_taken_for_its_base():
    """The cache-layer protocol matches a layer's class exactly: a subclass keeps behaviour of its own that the
    base kind's merge, snapshot and rollback would drop (mlx-vlm 0.7.10 has four: qwen4_exp's QSAKVCache and
    QSAQuantizedKVCache, Unlimited-OCR's RingSlidingKVCache, HY-V4's HyV4KVCache), so it is refused naming both
    classes, where an isinstance match had taken QSAKVCache for a plain KVCache. The protocol's own batch forms
    (caches/layers.py's subclasses of BatchKVCache, which a merge builds) are still that kind."""
    import pytest
    from mlx_vlm.models.qwen4_exp.language import QSAKVCache
    from mlx_vlm.models.unlimited_ocr.language import RingSlidingKVCache

    from caches import layers

    class WindowedKV(KVCache):
        pass

    for layer, base in ((WindowedKV(), "mlx_lm.models.cache.KVCache"), (QSAKVCache(), "mlx_vlm.models.cache.KVCache"),
                        (RingSlidingKVCache(8), "mlx_vlm.models.cache.KVCache")):
        with pytest.raises(layers.UnsupportedCache, match=f"^{type(layer).__name__}: a subclass of {base} "):
            layers.capabilities([KVCache(), layer])
    rows = []
    for n in (3, 5):
        row = KVCache()
        row.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
        rows.append([row])
    batch = layers.merge_caches(rows)
    assert type(batch[0]) is not BatchKVCache and isinstance(batch[0], BatchKVCache)  # the protocol's own form
    assert layers.capabilities(batch).layers[0] == layers.capabilities(rows[0]).layers[0]

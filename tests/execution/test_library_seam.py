"""Pins the mlx-lm behaviour scheduler/execution/library.py relies on. If an mlx-lm upgrade moves any of it, these
fail here, loudly, instead of as wrong tokens somewhere else."""

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

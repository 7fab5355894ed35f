"""Soak: many short requests through the engine with caches on; nothing grows past warm-up (internal maps,
the state machine's model list, open files, MLX memory). CI runs 1,500 requests; set MLXSCHED_SOAK=10000
for the full-size run."""

import gc
import os

import mlx.core as mx
import pytest

from scheduler import Engine, EngineConfig, SamplingParams

N = int(os.environ.get("MLXSCHED_SOAK", "1500"))


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


@pytest.mark.slow
def test_soak_nothing_grows(text_model, tmp_path):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_seqs=32, max_batched_tokens=512, prefill_chunk=64,
                                                   prefix_cache_bytes=4 << 20, kv_memory_bytes=64 << 20,
                                                   trace_path=str(tmp_path / "soak.jsonl")))
    shared = list(range(100, 140))

    def wave(start, count):
        for i in range(start, start + count):
            prompt = (shared if i % 3 == 0 else []) + [7 + (i * 7919 + k) % 500 for k in range(4 + i % 13)]
            engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=1 + i % 3, temperature=0.0 if i % 2 else 0.7, seed=i))
            if i % 4 == 0:
                engine.step()
        while engine.has_pending():
            engine.step()

    warm = N // 10
    wave(0, warm)
    gc.collect()
    mx.clear_cache()
    # MLX memory net of the prefix cache, which legitimately fills up to its own budget
    baseline = {
        "active_memory": mx.get_active_memory() - engine.scheduler.prefix_cache.bytes,
        "files": _open_files(),
        "ended_ids": len(engine._ended),
    }
    wave(warm, N - warm)
    gc.collect()
    mx.clear_cache()
    sched = engine.scheduler
    assert not sched.requests and not sched.waiting and not sched.prefilling and not sched.decoding
    assert not sched._prefix_memo
    assert not sched.lifecycle._machine.models, "requests are never registered on the shared machine"
    assert set(sched.time_in_state) <= {"queued", "chunk_prefilling", "decoding"}
    assert not engine._known_live and not engine._inbox and not engine._abort_inbox
    assert not engine.executor.live_request_ids() and engine.executor.cache_bytes() == 0
    assert sched.prefix_cache.bytes <= sched.prefix_cache.max_bytes
    assert _open_files() == baseline["files"]
    # memory after N requests is within 5% (or 1 MiB) of memory after the warm-up
    grown = mx.get_active_memory() - sched.prefix_cache.bytes - baseline["active_memory"]
    assert grown <= max(0.05 * baseline["active_memory"], 1 << 20), (grown, baseline)
    stats = engine.stats()
    assert stats.requests_finished == N
    engine.close()

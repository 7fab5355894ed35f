"""pytest-benchmark benchmarks. Not part of the test suite (`pytest` collects `tests/` only); run with

    python -m pytest bench/ --benchmark-only
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m pytest bench/ --benchmark-only

* group "decode-b8-text": 32 decode steps at batch 8 on the tiny text model, our Engine vs mlx-lm's
  BatchGenerator (prefill happens in the untimed setup of each round, so only steady-state decode is timed).
* group "planner-N": `plan_tick` on N = 16 / 256 / 1024 live fake requests (no model), per policy.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("pytest_benchmark")

from bench.compare import _NoEosTokenizer, default_engine_config  # noqa: E402
from bench.workloads import uniform  # noqa: E402

BATCH = 8
PROMPT_LEN = 128
DECODE_STEPS = 32
ROUNDS = 5


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from mlx_lm import load

    from scheduler.fixtures.tiny_models import build_model

    return load(str(build_model("text", tmp_path_factory.mktemp("bench-text"))))


def _prompts() -> list[list[int]]:
    return uniform(BATCH, PROMPT_LEN, DECODE_STEPS).prompt_lists


# ---------------------------------------------------------------------------------------- decode, batch 8
@pytest.mark.benchmark(group="decode-b8-text")
def test_decode_engine(benchmark, text_model):
    from scheduler import Engine, SamplingParams

    model, tokenizer = text_model
    produced: list[int] = []

    def setup():
        engine = Engine(model, _NoEosTokenizer(tokenizer), default_engine_config())
        ids = {engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=DECODE_STEPS + 8))
               for p in _prompts()}
        started: set[str] = set()
        while started != ids:  # every request prefilled and holding its first token
            started.update(o.request_id for o in engine.step() if o.token_ids)
        return (engine,), {}

    def decode(engine):
        n = 0
        for _ in range(DECODE_STEPS):
            n += sum(len(o.token_ids) for o in engine.step())
        produced.append(n)

    benchmark.pedantic(decode, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(batch=BATCH, steps=DECODE_STEPS, tokens_per_round=BATCH * DECODE_STEPS)
    assert set(produced) == {BATCH * DECODE_STEPS}


@pytest.mark.benchmark(group="decode-b8-text")
def test_decode_batchgenerator(benchmark, text_model):
    from mlx_lm.generate import BatchGenerator

    model, _ = text_model
    produced: list[int] = []

    def setup():
        gen = BatchGenerator(model, max_tokens=DECODE_STEPS + 8, completion_batch_size=32)
        uids = set(gen.insert(_prompts()))
        started: set[int] = set()
        while started != uids:
            started.update(r.uid for r in gen.next()[1])
        return (gen,), {}

    def decode(gen):
        n = 0
        for _ in range(DECODE_STEPS):
            n += len(gen.next()[1])
        produced.append(n)
        gen.close()

    benchmark.pedantic(decode, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(batch=BATCH, steps=DECODE_STEPS, tokens_per_round=BATCH * DECODE_STEPS)
    assert set(produced) == {BATCH * DECODE_STEPS}


# ---------------------------------------------------------------------------------------- planner, no model
def _view(n: int, tick: int = 1000):
    """n live fake requests: 70% decoding, 10% part-prefilled, 20% waiting; varied prompt lengths."""
    from scheduler import Request, RequestState, SamplingParams
    from scheduler.planner import SchedulerView

    sampling = SamplingParams(max_tokens=256)
    waiting, prefilling, decoding = [], [], []
    for i in range(n):
        prompt_len = 32 + (i * 37) % 700
        r = Request(request_id=f"req-{i}", prompt_tokens=[7 + (i + k) % 500 for k in range(prompt_len)],
                    sampling=sampling, priority=i % 3, arrival_tick=i // 4)
        kind = i % 10
        if kind < 7:
            r.num_computed_tokens = prompt_len
            r.output_tokens = [9] * (1 + i % 50)
            r.state = RequestState.DECODING
            decoding.append(r)
        elif kind == 7:
            r.num_computed_tokens = prompt_len // 2
            r.state = RequestState.CHUNK_PREFILLING
            prefilling.append(r)
        else:
            waiting.append(r)
    return SchedulerView(tick=tick, waiting=tuple(waiting), prefilling=tuple(prefilling),
                         decoding=tuple(decoding))


def _policy_names() -> list[str]:
    from scheduler.policy import POLICIES

    return sorted(POLICIES)


@pytest.mark.parametrize("policy_name", _policy_names())
@pytest.mark.parametrize("n", [16, 256, 1024])
def test_plan_tick(benchmark, n, policy_name):
    from scheduler import EngineConfig
    from scheduler.planner import plan_tick
    from scheduler.policy import make_policy

    benchmark.group = f"planner-{n}"
    view = _view(n)
    config = EngineConfig(max_batched_tokens=8192, max_seqs=max(n, 16), prefill_chunk=512)
    policy = make_policy(policy_name)
    plan = benchmark.pedantic(plan_tick, args=(view, config, policy), rounds=20, iterations=10, warmup_rounds=2)
    assert len(plan.decode) == len(view.decoding)
    assert plan.num_batched_tokens <= config.max_batched_tokens


# --------------------------------------------------------------------------- policies on the same arrivals

@pytest.fixture(scope="module")
def arrivals():
    """One synthetic arrival stream (Poisson, mixed lengths, shared prefixes) re-run under every policy."""
    from scheduler.tools.workload import synthetic_workload

    return synthetic_workload(400, rate_per_s=40.0, prompt_len=(16, 400), output_len=(8, 96),
                              shared_prefix_share=0.3, shared_prefix_len=64, seed=3,
                              priorities=(0, 0, 1, 2))


@pytest.mark.benchmark(group="policies-same-arrivals")
@pytest.mark.parametrize("policy_name", _policy_names())
def test_policy_on_recorded_arrivals(benchmark, arrivals, policy_name):
    """Model-free: the same arrivals under each policy with the fitted-style cost model; the benchmark times
    the simulation and `extra_info` keeps the latency figures each policy achieves."""
    from scheduler.config import EngineConfig
    from scheduler.tools.simulate import CostModel, simulate

    config = EngineConfig(max_seqs=32, max_batched_tokens=1024, prefill_chunk=256, prefix_cache_bytes=64 << 20)
    cost = CostModel(base=0.004, per_prefill_token=2e-5, per_decode_row=3e-4, per_prefill_chunk=5e-4,
                     per_decode_forward=0.0, per_prefill_done=0.0)
    result = benchmark.pedantic(simulate, args=(arrivals, config, cost, policy_name), rounds=3, iterations=1)
    summary = result.summary()
    assert summary["finished"] == len(arrivals)
    benchmark.extra_info.update({k: summary[k] for k in ("ttft_p50_s", "ttft_p95_s", "throughput_tok_s",
                                                        "queue_mean_s", "cache_hit_rate")})

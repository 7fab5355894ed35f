"""A model sharded across two local processes (MLX's ring backend over loopback), by tensor or by pipeline:
rank 0 plans, both ranks execute, and the outputs are mlx-lm's own sharded generation of each request alone,
token for token.

Each test launches the ranks itself, with a timeout, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from scheduler import SamplingParams
from scheduler.execution.distributed import (MessageKind, RequestData, ShardDivergence, TickMessage, decode_plan,
                                             encode_plan)
from scheduler.execution.stall_watchdog import SHARD_LOST_EXIT_CODE
from scheduler.plan import PrefillChunk, TickPlan
from scheduler.tools.replay import load_trace, replay

from ..helpers import free_ports

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [str(Path(sys.executable).with_name("mlx.launch"))]  # installed next to the interpreter by the mlx wheel


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def equality_run(request, text_model_dir, tmp_path_factory):
    """Every schedule on two ranks, sharded two ways: `tensor` (the tiny qwen3: each matmul split across the
    ranks) and `pipeline` (a tiny qwen2, one of mlx-lm's families with `pipeline`: each rank runs one of its
    two layers and passes the hidden states on)."""
    if request.param == "tensor":
        model_dir, scenario = text_model_dir, "equality"
    else:
        from scheduler.fixtures.families import build_family_model

        model_dir = build_family_model("qwen2", tmp_path_factory.mktemp("pp-qwen2"))
        scenario = "pipeline-equality"
    out = tmp_path_factory.mktemp(f"{request.param}-equality")
    proc = subprocess.run([*LAUNCH, "-n", "2", "--backend", "ring", sys.executable, str(WORKER), str(model_dir),
                           str(out), scenario], capture_output=True, text=True, timeout=420, env=_env(), cwd=ROOT)
    assert proc.returncode == 0 and (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "result.json").read_text())


SCHEDULES = ["all-at-once", "staggered-small-budget", "kv-budget-preempts", "prefix-cache", "prompt-lookup-drafting"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sharded_engine_equals_mlx_lm_sharded_generation_of_each_request_alone(equality_run, schedule):
    _, result = equality_run
    run = result["configs"][schedule]
    reference = result["sharded_solo"][schedule]
    assert run["tokens"], "requests ran"
    for rid, tokens in run["tokens"].items():
        assert tokens == reference[rid], rid
    assert run["kv_bytes_left"] == 0  # every request's cache was freed on rank 0 (and the run ended cleanly)


@pytest.mark.slow
def test_each_schedule_exercised_what_it_names(equality_run):
    _, result = equality_run
    configs = result["configs"]
    assert configs["kv-budget-preempts"]["preemptions"] >= 1
    assert configs["prefix-cache"]["prefix_hits"] >= 2
    assert configs["prompt-lookup-drafting"]["draft_accepted"] >= 1
    assert "r0" not in configs["all-at-once"]["tokens"]  # aborted at tick 3
    for run in configs.values():  # one message per executed tick
        assert run["channel"]["messages"] > 0 and run["channel"]["bytes"] > 0


@pytest.mark.slow
def test_async_engine_runs_over_a_sharded_engine_and_processors_are_refused(equality_run):
    _, result = equality_run
    reference = result["sharded_solo"]["staggered-small-budget"]  # the same prompts and max_tokens
    assert result["async"] == {rid: reference[rid] for rid in result["async"]} and len(result["async"]) == 9
    assert result["refused_field"] == "logits_processors"


@pytest.mark.slow
def test_prompt_logprobs_on_a_sharded_engine_equal_the_unsharded_forward(equality_run):
    """Rank 0 reads each prefill chunk's logits, and the followers run the same reads (their collectives line
    up): the values are the unsharded model's own forward of each prompt, to the tolerance of a sharded sum."""
    _, results = equality_run
    for (values, top, tokens), want, name in zip(results["prompt_logprobs"], results["unsharded_prompt_logprobs"],
                                                  ["r0", "r1", "r2"]):
        assert values[0] is None and values[1:] == pytest.approx(want, abs=1e-4)
        assert [len(t) for t in top[1:]] == [2] * len(want)
        assert tokens == results["sharded_solo"]["all-at-once"][name][:4]  # mlx-lm's own sharded generation


@pytest.mark.slow
def test_structured_outputs_on_a_sharded_engine_equal_the_unsharded_model_alone(equality_run):
    """The constraint travels in the request's sampling record: each rank builds the same matcher and masks the
    same tokens, and the outputs are mlx-lm's alone with the same GrammarProcessor (on this model, where sharded
    and unsharded agree: the test below). Likewise allowed ids and bad words."""
    _, results = equality_run
    assert results["structured"] == results["unsharded_structured"] and len(results["structured"]) == 3
    # allowed ids, bad words and min_tokens travel in the record too, and every rank masks alike
    assert results["masked"] == results["unsharded_masked"] and all(
        set(out) <= set(range(40, 140)) - {60} for out in results["masked"])


def test_sharded_output_equals_the_unsharded_model_on_this_model(equality_run):
    """Tensor sharding splits each matmul's sum across ranks, so float rounding differs from the unsharded model
    and a near-tie could flip a greedy choice; on these tiny float32 models none does (under both BLAS
    libraries), so equality is asserted here. A flip on another model would be rounding, not a scheduling
    error. (Pipeline sharding computes each layer whole, on one rank.)"""
    _, result = equality_run
    for schedule, run in result["configs"].items():
        for rid, tokens in run["tokens"].items():
            assert tokens == result["unsharded_solo"][schedule][rid], (schedule, rid)


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["all-at-once", "staggered", "kv-budget", "prefix", "drafting"])
def test_the_rank0_trace_replays_identically_with_no_model(equality_run, trace):
    out, _ = equality_run
    report = replay(load_trace(out / f"{trace}.jsonl"))
    assert report.identical, report.format()


def _stderr(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"rank{rank}.stderr").read_text(errors="replace")[-8000:]


@contextlib.contextmanager
def _ranks_by_hand(model_dir: Path, tmp_path: Path, scenario: str) -> Iterator[list[subprocess.Popen]]:
    """Both ranks of a worker scenario, started by hand (what mlx.launch does for the ring backend) so that one
    can die without the launcher killing the other; whatever is still running at the end is killed. stderr
    goes to files (`_stderr`): a pipe nobody drains can fill and block a rank."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(model_dir), str(tmp_path), scenario],
                              env={**_env(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / f"rank{rank}.stderr").open("wb"))
             for rank in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.exclusive  # times how long the survivor takes to notice
@pytest.mark.parametrize("scenario", ["a-rank-dies", "a-rank-dies-mid-forward"], ids=["short-ticks", "mid-forward"])
@pytest.mark.parametrize("victim", [1, 0], ids=["follower-killed", "rank0-killed"])
def test_a_killed_rank_fails_the_other_with_a_clear_error_quickly(text_model_dir, tmp_path, victim, scenario):
    """The survivor reports ShardLost within seconds, wherever in its tick the peer died: raised by its engine
    when MLX fails the collective (it then exits 0), or from its stall watchdog when MLX's ring backend left the
    forward blocked (it then exits with SHARD_LOST_EXIT_CODE). `mid-forward` makes the second case common."""
    with _ranks_by_hand(text_model_dir, tmp_path, scenario) as procs:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.pid").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks did not start"
            assert all(p.poll() is None for p in procs), [_stderr(tmp_path, r) for r in range(2)]
            time.sleep(0.1)
        time.sleep(1.0)  # a few ticks run
        survivor = 1 - victim
        killed_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        done = tmp_path / f"rank{survivor}.json"
        while not done.exists():
            if time.monotonic() - killed_at > 30:
                procs[survivor].send_signal(signal.SIGUSR1)  # the worker dumps every thread's stack to stderr
                time.sleep(2.0)
                procs[survivor].kill()
                pytest.fail("the surviving rank hung after its peer died; its stacks:\n"
                            + _stderr(tmp_path, survivor))
            time.sleep(0.05)
        elapsed = time.monotonic() - killed_at
        code = procs[survivor].wait(timeout=30)  # it reported and exited on its own
        result = json.loads(done.read_text())
        assert result["error_type"] == "ShardLost", result
        assert "peer rank is gone" in result["error"]
        assert elapsed < 15
        assert code == {"raise": 0, "watchdog": SHARD_LOST_EXIT_CODE}[result["by"]], (code, result)


@pytest.mark.slow
@pytest.mark.exclusive  # a 2 s watchdog
def test_a_rank_stalled_at_construction_is_ended_by_the_watchdog(text_model_dir, tmp_path):
    """The engine's construction runs probe forwards (its KV layout), collectives like any tick's: with its peer
    not joining them, rank 0 is ended by its stall watchdog (exit SHARD_LOST_EXIT_CODE, a ShardLost naming the
    probe) instead of blocking for ever."""
    with _ranks_by_hand(text_model_dir, tmp_path, "a-rank-stalls-at-construction") as procs:
        try:
            code = procs[0].wait(timeout=90)
        except subprocess.TimeoutExpired:
            procs[0].send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            pytest.fail("rank 0 blocked in its construction; its stacks:\n" + _stderr(tmp_path, 0))
        result = json.loads((tmp_path / "rank0.json").read_text())
        assert result["by"] == "watchdog" and result["error_type"] == "ShardLost", result
        assert "the KV-layout probe forward has been blocked for 2 s" in result["error"]
        assert code == SHARD_LOST_EXIT_CODE, _stderr(tmp_path, 0)


@pytest.mark.slow
def test_followers_keep_every_checkpoint_a_request_stores_in_one_tick(tmp_path):
    """gpt_oss (sliding-window layers: its caches cannot be trimmed) with the prefix cache: the prefill stores
    exact checkpoints, one request stores a checkpoint and its prefill end in the same tick, and the followers
    restore each from its own entry (a follower that kept one payload per request would restore the wrong
    state, or fail the restore)."""
    from scheduler.fixtures.families import build_family_model

    model_dir = build_family_model("gpt_oss", tmp_path / "gpt_oss")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([*LAUNCH, "-n", "2", "--backend", "ring", sys.executable, str(WORKER), str(model_dir),
                           str(out), "checkpoints"], capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0 and (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["tokens"] == result["sharded_solo"] == result["unsharded_solo"]
    assert result["kv_bytes_left"] == 0
    per_tick = [(tick, rid) for tick, rid, _ in result["stores"]]
    assert any(per_tick.count(key) == 2 for key in per_tick), "a request stored two entries in one tick"
    assert [48, 52] == [n for _, rid, n in result["stores"] if rid == "r0" and per_tick.count((_, rid)) == 2]
    assert sorted(result["hits"]) == [["r1", 48, "checkpoint"], ["r2", 32, "checkpoint"]]


@pytest.mark.slow
def test_the_command_line_demo_runs_sharded_with_its_ranks_pinned(text_model_dir):
    """README's `mlx.launch -n 2 --backend ring -- mlxsched demo --tensor-parallel`: both ranks run, rank 0
    prints, and the ranks (on loopback) are each pinned to their own share of the CPUs
    (`scheduler/execution/rank_pinning.py`)."""
    proc = subprocess.run([*LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "scheduler.cli",
                           "demo", "--tensor-parallel", "--model", str(text_model_dir), "--requests", "3",
                           "--max-tokens", "4"], capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^rank 0 of 2 pinned to CPUs? \S+", proc.stdout, re.M), proc.stdout[-3000:]
    assert '"requests_finished": 3' in proc.stdout


def test_the_plan_crosses_the_wire_unchanged():
    plan = TickPlan(tick=7, admitted=("a",), prefill=(PrefillChunk("a", 0, 16, False), PrefillChunk("b", 16, 20, True)),
                    decode=("c", "d"), draft=(("c", 2),), prefix_hits=(("a", 3, 16),), preempted=("e",),
                    failed=(("f", "too big"),), kv_bytes_bound=1234, num_batched_tokens=24, num_seqs=4)
    message = TickMessage(MessageKind.TICK, plan=encode_plan(plan),
                          requests={"a": RequestData([1, 2], SamplingParams(max_tokens=3).to_record(), 9, 0, [])},
                          appended={"c": [5, 6]}, released=["z"], prefix_added=[(3, "y", 16)], prefix_evicted=[1])
    back = TickMessage.from_bytes(message.to_bytes())
    assert decode_plan(back.plan) == plan
    assert back == message


@pytest.mark.parametrize("received", [
    np.arange(40, dtype=np.float32).tobytes(),  # another collective's floats: not UTF-8
    b"[1, 2, 3]",  # JSON, but not a message
    b'{"kind": "tick"}',  # a message's start, its fields missing
    b'{"kind": "resize", "plan": null}',  # no such kind
], ids=["floats", "json-list", "fields-missing", "unknown-kind"])
def test_a_broadcast_that_is_not_a_tick_message_says_the_ranks_are_out_of_step(received):
    """What a follower receives when its collectives and rank 0's no longer line up is refused as such (the
    follower ends with that error), not as a decoding error from deep inside JSON."""
    with pytest.raises(ShardDivergence, match="is not a tick message .* the ranks' collectives are out of step"):
        TickMessage.from_bytes(received)


def test_follow_is_only_for_the_other_ranks_of_a_sharded_engine(text_model):
    from scheduler import Engine

    engine = Engine(*text_model)
    with pytest.raises(RuntimeError, match="follow"):
        engine.follow()

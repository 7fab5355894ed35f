"""Ranks of one machine on CPUs of their own (`scheduler/execution/rank_pinning.py`): which launches count as
one machine, each rank's share, and a real pin of every thread (in a child process: pinning is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scheduler.execution.rank_pinning import RankPinning, cpus_of_rank, local_ranks, pin_local_rank

ROOT = Path(__file__).resolve().parents[2]


def _hostfile(tmp_path: Path, hosts: list[list[str]]) -> str:
    path = tmp_path / f"hosts{len(list(tmp_path.glob('hosts*.json')))}.json"  # each call a file of its own
    path.write_text(json.dumps(hosts))
    return str(path)


def test_a_launch_on_loopback_is_local_and_any_other_address_is_not(tmp_path):
    loopback = _hostfile(tmp_path, [["127.0.0.1:5000"], ["127.0.0.1:5001"]])  # what `mlx.launch -n 2` writes
    assert local_ranks({"MLX_RANK": "1", "MLX_HOSTFILE": loopback}) == (1, 2)
    ipv6 = _hostfile(tmp_path, [["[::1]:5000"], ["localhost:5001"], ["127.0.0.2:5002"]])
    assert local_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": ipv6}) == (0, 3)
    # two Macs over Thunderbolt: one address each; a rank with an address elsewhere makes the launch not local
    remote = _hostfile(tmp_path, [["127.0.0.1:5000"], ["10.0.0.2:5000", "127.0.0.1:5001"]])
    assert local_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": remote}) == "the ranks are on other machines"
    assert "no MLX_RANK" in local_ranks({"MLX_HOSTFILE": loopback})
    assert "no MLX_RANK" in local_ranks({"MLX_RANK": "0"})
    assert "not a rank" in local_ranks({"MLX_RANK": "first", "MLX_HOSTFILE": loopback})
    assert "not one of the hostfile's 2 ranks" in local_ranks({"MLX_RANK": "2", "MLX_HOSTFILE": loopback})
    (tmp_path / "bad.json").write_text("{not json")
    assert "is not a ring hostfile" in local_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": str(tmp_path / "bad.json")})
    assert "is not a ring hostfile" in local_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": str(tmp_path / "missing")})


@pytest.mark.parametrize("usable, ranks, shares", [
    ([0, 1], 2, [(0,), (1,)]),
    ([3, 1, 0, 2], 2, [(0, 1), (2, 3)]),
    ([0, 1, 2, 3, 4], 2, [(0, 1), (2, 3)]),  # equal shares: the remainder is nobody's
    ([0, 1], 3, [(0,), (1,), (0,)]),  # more ranks than CPUs: one each, round the CPUs
    ([5], 1, [(5,)]),
])
def test_each_rank_gets_an_equal_contiguous_share(usable, ranks, shares):
    assert [cpus_of_rank(r, ranks, usable) for r in range(ranks)] == shares
    if len(usable) >= ranks:  # no CPU is shared by two ranks
        every = [c for r in range(ranks) for c in cpus_of_rank(r, ranks, usable)]
        assert len(every) == len(set(every))


def test_nothing_is_pinned_outside_a_local_launch_or_when_opted_out(tmp_path):
    before = os.sched_getaffinity(0)
    got = pin_local_rank({})
    assert got == RankPinning(None, skipped=got.skipped) and "no MLX_RANK" in got.skipped
    assert got.describe().startswith("ranks not pinned: ")
    assert os.sched_getaffinity(0) == before
    local = _hostfile(tmp_path, [["127.0.0.1:5000"], ["127.0.0.1:5001"]])
    off = pin_local_rank({"MLX_RANK": "0", "MLX_HOSTFILE": local}, enabled=False)  # `--no-pin-ranks`
    assert off.describe() == "ranks not pinned: --no-pin-ranks"
    assert os.sched_getaffinity(0) == before


def test_every_thread_of_the_rank_is_pinned_and_later_threads_inherit_it(tmp_path):
    """In a child with a thread already running (as a preloaded BLAS's are): after `pin_local_rank`, that thread,
    the main one and a thread started later all run on the rank's share; `unpin` gives each its CPUs back."""
    usable = sorted(os.sched_getaffinity(0))
    hostfile = _hostfile(tmp_path, [["127.0.0.1:5000"], ["127.0.0.1:5001"]])
    code = textwrap.dedent("""
        import ctypes, json, os, sys, threading
        from scheduler.execution.rank_pinning import pin_local_rank, unpin

        def affinity_of_a_thread():
            seen, go = {}, threading.Event()
            def run():
                seen["before"] = sorted(os.sched_getaffinity(0))
                go.wait()
                seen["after"] = sorted(os.sched_getaffinity(0))
            t = threading.Thread(target=run)
            t.start()
            return seen, go, t

        blas = getattr(ctypes.CDLL(None), "openblas_get_num_threads", None)  # (OpenBLAS preloaded: CI's 2nd run)
        blas_before = blas() if blas is not None else None
        early, go, thread = affinity_of_a_thread()
        pinning = pin_local_rank()
        go.set(); thread.join()
        late, go2, thread2 = affinity_of_a_thread()
        go2.set(); thread2.join()
        main = sorted(os.sched_getaffinity(0))
        blas_pinned = blas() if blas is not None else None
        unpin(pinning)
        print(json.dumps({"cpus": list(pinning.cpus), "early": early["after"], "late": late["before"],
                          "main": main, "restored": sorted(os.sched_getaffinity(0)),
                          "describe": pinning.describe(), "blas_set": pinning.blas_threads,
                          "blas_pinned": blas_pinned, "blas_before": blas_before,
                          "blas_restored": blas() if blas is not None else None}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MLX_RANK": "1", "MLX_HOSTFILE": hostfile})
    got = json.loads(out.stdout)
    share = list(cpus_of_rank(1, 2, usable))
    assert got["cpus"] == got["early"] == got["late"] == got["main"] == share
    assert got["restored"] == usable
    # a preloaded OpenBLAS runs as many threads as the share has CPUs, and as many as before once unpinned
    assert got["blas_set"] == got["blas_pinned"] == (len(share) if got["blas_pinned"] is not None else None)
    assert got["blas_restored"] == got["blas_before"]
    assert got["describe"].startswith("rank 1 of 2 pinned to CPU")

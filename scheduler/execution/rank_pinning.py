"""Ranks of one machine on CPUs of their own.

`mlx.launch -n N --backend ring` starts N ranks on this machine, connected over loopback. Left to the kernel's
scheduler, their threads share every core, and each collective waits far longer than the bytes it moves: on a
2-core VM, an `all_sum` of 64 floats took 1.6-7.4 ms with the ranks unpinned and 0.18-0.31 ms with each rank on
a core of its own, and `mlxsched demo --tensor-parallel --kind text` ran at 270 end-to-end tokens/s against 768
(OpenBLAS preloaded; README, "One model across processes"). So the command line pins each local rank to its
share of the CPUs this process may use. Ranks on other machines (a hostfile with other addresses than loopback)
are left alone: their cores are their own.

Linux only (`os.sched_setaffinity`); elsewhere nothing is pinned. Every thread the process has is pinned (a
preloaded BLAS and MLX start theirs before this runs); threads started later inherit it. A preloaded OpenBLAS
started a thread per core, which would now take turns on the rank's share, each waiting for the others: its
public `openblas_set_num_threads` gets the share's size (text-medium sharded over 2 ranks on 2 cores: a decode
tick of 245 ms with OpenBLAS's 2 threads on the rank's one CPU, 88-97 ms with one; `bench.tensor_parallel`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class RankPinning:
    """What `pin_local_rank` did: this rank's CPUs, or why it pinned nothing."""

    rank: int | None
    ranks: int = 0  # how many ranks share this machine
    cpus: tuple[int, ...] = ()
    skipped: str | None = None  # why nothing was pinned (None: pinned to `cpus`)
    before: tuple[int, ...] = ()  # the CPUs the process could use before (`unpin` restores them)
    blas_threads: int | None = None  # what OpenBLAS's thread count was set to (None: no OpenBLAS here)
    blas_threads_before: int | None = None

    def describe(self) -> str:
        if self.skipped is not None:
            return f"ranks not pinned: {self.skipped}"
        blas = f", OpenBLAS threads {self.blas_threads}" if self.blas_threads is not None else ""
        return (f"rank {self.rank} of {self.ranks} pinned to CPU{'s' if len(self.cpus) > 1 else ''} "
                f"{_ranges(self.cpus)}{blas} (each rank on this machine on its own share)")


def local_ranks(environ: Mapping[str, str]) -> tuple[int, int] | str:
    """(rank, number of ranks) where `mlx.launch`'s ring environment puts every rank on this machine (every
    address in MLX_HOSTFILE on loopback), else why not."""
    rank, hostfile = environ.get("MLX_RANK"), environ.get("MLX_HOSTFILE")
    if rank is None or hostfile is None:
        return "not started by mlx.launch's ring backend (no MLX_RANK / MLX_HOSTFILE)"
    if not rank.isdigit():
        return f"MLX_RANK is {rank!r}, not a rank"
    try:
        hosts = json.loads(Path(hostfile).read_text())
        addresses = [address.rsplit(":", 1)[0].strip("[]") for entry in hosts for address in entry]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return f"MLX_HOSTFILE {hostfile} is not a ring hostfile ({exc})"
    if not addresses or not all(_is_loopback(a) for a in addresses):
        return "the ranks are on other machines"
    if int(rank) >= len(hosts):
        return f"MLX_RANK {rank} is not one of the hostfile's {len(hosts)} ranks"
    return int(rank), len(hosts)


def cpus_of_rank(rank: int, ranks: int, usable: list[int]) -> tuple[int, ...]:
    """A rank's share of `usable`: contiguous, equal shares (the remainder left out); with more ranks than
    CPUs, one CPU each, round the CPUs."""
    usable = sorted(usable)
    share = len(usable) // ranks
    if share == 0:
        return (usable[rank % len(usable)],)
    return tuple(usable[rank * share:(rank + 1) * share])


def pin_local_rank(environ: Mapping[str, str] | None = None, enabled: bool = True) -> RankPinning:
    """Pin this process, every thread of it, to its rank's share of the CPUs, where every rank runs on this
    machine (`local_ranks`) and `enabled` (False: the command line's `--no-pin-ranks`). Returns what was done."""
    if not enabled:
        return RankPinning(None, skipped="--no-pin-ranks")
    found = local_ranks(os.environ if environ is None else environ)
    if isinstance(found, str):
        return RankPinning(None, skipped=found)
    rank, ranks = found
    if not hasattr(os, "sched_setaffinity"):
        return RankPinning(rank, ranks, skipped="this OS cannot pin threads")
    before = tuple(sorted(os.sched_getaffinity(0)))
    cpus = cpus_of_rank(rank, ranks, list(before))
    _set_every_thread(cpus)
    blas_before = _set_openblas_threads(len(cpus))
    return RankPinning(rank, ranks, cpus, before=before, blas_threads=None if blas_before is None else len(cpus),
                       blas_threads_before=blas_before)


def unpin(pinning: RankPinning) -> None:
    """Give every thread back the CPUs it had before `pin_local_rank` (a rank that goes on alone after its peers
    are done: `bench.tensor_parallel`'s one-process run)."""
    if pinning.skipped is None and pinning.before:
        _set_every_thread(pinning.before)
        if pinning.blas_threads_before is not None:
            _set_openblas_threads(pinning.blas_threads_before)


def _set_every_thread(cpus: tuple[int, ...]) -> None:
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _set_openblas_threads(n: int) -> int | None:
    """Set a loaded OpenBLAS's thread count to `n` (its public API); returns the count it had, or None where this
    process has no OpenBLAS (the mlx wheel's own BLAS has no threads to set)."""
    process = ctypes.CDLL(None)
    setter = getattr(process, "openblas_set_num_threads", None)
    getter = getattr(process, "openblas_get_num_threads", None)
    if setter is None or getter is None:
        return None
    before = int(getter())
    setter.argtypes = [ctypes.c_int]
    setter(n)
    return before


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ranges(cpus: tuple[int, ...]) -> str:
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))

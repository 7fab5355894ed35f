"""Run the same workload through our Engine and mlx-lm's BatchGenerator on the same loaded model.

Both sides are timed from the outside with the same clock and the same definitions:

* wall_s: from submitting the first request (`add_request` / `insert`) until the last token is back.
* e2e tok/s: generated tokens / wall_s.
* t_all_first_s: when the *last* request received its first token (every prompt is prefilled from then on).
* decode tok/s (steady state): tokens generated *after* t_all_first / (wall_s - t_all_first). No prefill work
  happens in that window on either side (both have every request in the decode batch), so it measures the
  per-step cost of batched decoding plus each loop's per-step Python overhead.
* ms/step: decode-phase time / number of decode steps (engine ticks / `next()` calls) in that window.

Warm-up: each side runs the workload once (with a few new tokens) before anything is timed. Then repeats
alternate the order (ours, peer / peer, ours / ...) so neither side always runs on a warmer process. Figures
are summarised over repeats as best-of-N (default: highest throughput, lowest time, each figure on its own)
or as the median (`stat="median"`); `Comparison.to_dict()` carries both and every run.

Equal work: BatchGenerator gets no stop tokens; our engine gets the tokenizer through a proxy that declares
no eos ids (`ignore_eos=True`, the default), so both produce exactly `new_tokens` tokens per request. With
`ignore_eos=False` the engine stops on `<|im_end|>` and the run reports how many requests stopped early.
Greedy outputs are compared token by token per request (they should be identical). A workload with sampled
requests (`Workload.with_sampling`) gives each side its own sampler for them (ours: seeded `SamplingParams`;
mlx-lm: `make_sampler` per request; the reference: its per-request temperature and top-p); their outputs differ by
random stream, so only the greedy requests are compared.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from .workloads import Workload


# ---------------------------------------------------------------------------------------------- results
@dataclass
class RunStats:
    """One timed run of one side."""

    side: str  # "ours" | "peer"
    wall_s: float
    tokens: int  # generated tokens, all requests
    t_all_first_s: float  # last request's first token, from the start
    decode_tokens: int  # tokens generated after t_all_first
    decode_s: float
    decode_steps: int
    steps: int  # engine ticks / BatchGenerator.next() calls in total
    short_requests: int  # requests that produced fewer than new_tokens tokens (eos stop)
    cpu_s: float = 0.0  # CPU time of this process (all threads) during the run
    load1: float = 0.0  # 1-minute load average at the end of the run (other processes on the machine)
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # per request, workload order

    @property
    def e2e_tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def ms_per_decode_step(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("outputs")
        d.update(e2e_tps=self.e2e_tps, decode_tps=self.decode_tps, ms_per_decode_step=self.ms_per_decode_step)
        return d


@dataclass
class Mismatch:
    index: int  # request index in the workload
    position: int  # first differing output position (or the shorter length)
    ours: list[int]
    peer: list[int]


@dataclass
class Comparison:
    model: str
    workload: str
    n: int
    prompt_tokens: int
    new_tokens: int
    ours: list[RunStats]  # one per repeat
    peer: list[RunStats]
    mismatches: list[Mismatch]
    blas: str = ""
    stat: str = "best"  # how repeats are summarised: "best" (best of N per figure) or "median"
    peer_name: str = "mlx-lm"  # which peer: "mlx-lm" (BatchGenerator) or "vllm-mlx" (MLLMBatchGenerator)
    compared: int = -1  # requests whose outputs were compared (the greedy ones); -1: all n

    def __post_init__(self) -> None:
        if self.compared < 0:
            self.compared = self.n

    def figure(self, side: str, attr: str, stat: str | None = None) -> float:
        """A figure of one side over its repeats.

        stat "median": the median. stat "best": best of N for that figure (the highest throughput, the
        lowest time; for load1 the highest, i.e. the worst contention seen). On a shared machine interference
        only ever slows a run down, so best-of-N is the least disturbed measurement.
        """
        values = [getattr(r, attr) for r in (self.ours if side == "ours" else self.peer)]
        if (stat or self.stat) == "median":
            return statistics.median(values)
        return max(values) if attr in _HIGHER_IS_BETTER or attr == "load1" else min(values)

    def median(self, side: str, attr: str) -> float:
        return self.figure(side, attr, "median")

    def ratio(self, attr: str, stat: str | None = None) -> float:
        """ours / peer for a throughput attribute (> 1: ours faster); for times < 1 means ours faster."""
        peer = self.figure("peer", attr, stat)
        return self.figure("ours", attr, stat) / peer if peer else float("nan")

    @property
    def identical(self) -> bool:
        return not self.mismatches

    def row(self, stat: str | None = None) -> dict[str, Any]:
        f = lambda side, attr: self.figure(side, attr, stat)  # noqa: E731
        return {
            "model": self.model,
            "peer": self.peer_name,
            "workload": self.workload,
            "n": self.n,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "stat": stat or self.stat,
            "repeats": len(self.ours),
            "ours_wall_s": f("ours", "wall_s"),
            "peer_wall_s": f("peer", "wall_s"),
            "ours_cpu_s": f("ours", "cpu_s"),
            "peer_cpu_s": f("peer", "cpu_s"),
            "ours_e2e_tps": f("ours", "e2e_tps"),
            "peer_e2e_tps": f("peer", "e2e_tps"),
            "e2e_ratio": self.ratio("e2e_tps", stat),
            "ours_decode_tps": f("ours", "decode_tps"),
            "peer_decode_tps": f("peer", "decode_tps"),
            "decode_ratio": self.ratio("decode_tps", stat),
            "ours_ms_step": f("ours", "ms_per_decode_step"),
            "peer_ms_step": f("peer", "ms_per_decode_step"),
            "ours_ttaf_s": f("ours", "t_all_first_s"),
            "peer_ttaf_s": f("peer", "t_all_first_s"),
            "ours_short": max(r.short_requests for r in self.ours),
            "peer_short": max(r.short_requests for r in self.peer),
            "max_load1": max(r.load1 for r in self.ours + self.peer),
            "mismatches": len(self.mismatches),
            "compared": self.compared,
            "blas": self.blas,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.row(),
            "median": self.row("median"),
            "ours_runs": [r.summary() for r in self.ours],
            "peer_runs": [r.summary() for r in self.peer],
            "mismatch_detail": [asdict(m) for m in self.mismatches],
            "ours_outputs": self.ours[0].outputs if self.ours else [],
        }


_HIGHER_IS_BETTER = frozenset({"e2e_tps", "decode_tps"})


# ---------------------------------------------------------------------------------------------- timing
class _Clock:
    """Shared bookkeeping of both loops: per-request tokens, first-token times, decode window."""

    def __init__(self, n: int, new_tokens: int):
        self.n = n
        self.new_tokens = new_tokens
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()
        self.n_started = 0
        self.t_all_first: float | None = None
        self.tokens_at_all_first = 0
        self.steps_at_all_first = 0
        self.tokens = 0
        self.steps = 0

    def record(self, index: int, token_ids: Sequence[int]) -> None:
        if token_ids:
            if not self.outputs[index]:
                self.n_started += 1
            self.outputs[index].extend(token_ids)
            self.tokens += len(token_ids)

    def end_step(self) -> None:
        self.steps += 1
        if self.t_all_first is None and self.n_started == self.n:
            self.t_all_first = time.perf_counter()
            self.tokens_at_all_first = self.tokens
            self.steps_at_all_first = self.steps

    def stats(self, side: str) -> RunStats:
        t_end = time.perf_counter()
        cpu = time.process_time() - self.cpu0
        t_af = self.t_all_first if self.t_all_first is not None else t_end
        return RunStats(
            side=side,
            wall_s=t_end - self.t0,
            tokens=self.tokens,
            t_all_first_s=t_af - self.t0,
            decode_tokens=self.tokens - self.tokens_at_all_first,
            decode_s=t_end - t_af,
            decode_steps=self.steps - self.steps_at_all_first,
            steps=self.steps,
            short_requests=sum(len(o) < self.new_tokens for o in self.outputs),
            cpu_s=cpu,
            load1=_load1(),
            outputs=self.outputs,
        )


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


class _NoEosTokenizer:
    """A tokenizer proxy that declares no eos ids, so the engine stops on max_tokens only."""

    eos_token_ids: tuple[int, ...] = ()
    eos_token_id = None

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def default_engine_config() -> Any:
    from scheduler import EngineConfig

    return EngineConfig(max_batched_tokens=4096, max_seqs=64, prefill_chunk=512)


def run_ours(model: Any, tokenizer: Any, workload: Workload, config: Any = None,
             ignore_eos: bool = True) -> RunStats:
    """One timed run of the workload through a fresh Engine (fresh caches) on `model`."""
    from scheduler import Engine, SamplingParams

    engine = Engine(model, _NoEosTokenizer(tokenizer) if ignore_eos else tokenizer,
                    config or default_engine_config())
    greedy = SamplingParams(max_tokens=workload.new_tokens)
    prompts = workload.prompt_lists
    gc.collect()
    clock = _Clock(len(prompts), workload.new_tokens)
    index = {engine.add_request(prompt_tokens=p, sampling=SamplingParams(
        max_tokens=workload.new_tokens, temperature=workload.temperature, top_p=workload.top_p, seed=i)
        if workload.sampled(i) else greedy): i for i, p in enumerate(prompts)}
    while engine.has_pending():
        for out in engine.step():
            clock.record(index[out.request_id], out.token_ids)
        clock.end_step()
    stats = clock.stats("ours")
    engine.close()
    return stats


def run_peer(model: Any, workload: Workload, completion_batch_size: int | None = None,
             prefill_batch_size: int = 8, prefill_step_size: int = 2048, stop_tokens: Sequence[int] = (),
             logits_processors: Callable[[], list] | None = None) -> RunStats:
    """One timed run of the workload through a fresh mlx-lm BatchGenerator (greedy; no stop tokens unless given).

    completion_batch_size defaults to max(32, n) so every request decodes in one batch like ours;
    prefill_batch_size / prefill_step_size default to mlx-lm's own defaults (8, 2048). `logits_processors`: makes
    one request's processors (called per request: processors may keep state).
    """
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    prompts = workload.prompt_lists
    gen = BatchGenerator(
        model, max_tokens=workload.new_tokens, stop_tokens=[[t] for t in stop_tokens] or None,
        completion_batch_size=completion_batch_size or max(32, len(prompts)),
        prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size,
    )
    gc.collect()
    try:
        clock = _Clock(len(prompts), workload.new_tokens)
        processors = {"logits_processors": [logits_processors() for _ in prompts]} if logits_processors else {}
        if workload.sampled_every:  # greedy requests take the generator's own (argmax) sampler
            processors["samplers"] = [make_sampler(temp=workload.temperature, top_p=workload.top_p)
                                      if workload.sampled(i) else None for i in range(len(prompts))]
        uids = gen.insert(prompts, max_tokens=[workload.new_tokens] * len(prompts), **processors)
        index = {u: i for i, u in enumerate(uids)}
        remaining = len(prompts)
        while remaining:
            _, responses = gen.next()
            for r in responses:
                clock.record(index[r.uid], (r.token,))
                if r.finish_reason is not None:
                    remaining -= 1
            clock.end_step()
        return clock.stats("peer")
    finally:
        gen.close()


def compare_outputs(ours: list[list[int]], peer: list[list[int]], only: Sequence[int] | None = None
                    ) -> list[Mismatch]:
    """Requests whose outputs differ (among `only`, the greedy ones of a workload with sampled requests)."""
    out = []
    for i, (a, b) in enumerate(zip(ours, peer)):
        if only is not None and i not in only:
            continue
        if a != b:
            pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(Mismatch(i, pos, a, b))
    return out


PEERS = ("mlx-lm", "vllm-mlx")


def compare(model: Any, tokenizer: Any, workload: Workload, **kwargs: Any) -> Comparison:
    """Ours vs mlx-lm's BatchGenerator (see `compare_peers`)."""
    return compare_peers(model, tokenizer, workload, peers=("mlx-lm",), **kwargs)[0]


def compare_peers(
    model: Any,
    tokenizer: Any,
    workload: Workload,
    *,
    peers: Sequence[str] = ("mlx-lm",),
    model_name: str = "",
    repeats: int = 2,
    warmup_tokens: int = 4,
    config: Any = None,
    ignore_eos: bool = True,
    peer_prefill_batch: int = 8,
    peer_completion_batch: int | None = None,
    blas: str = "",
    stat: str = "best",
    log: Callable[[str], None] | None = None,
) -> list[Comparison]:
    """Warm every side up once, then `repeats` timed runs of each side, the order rotating per repeat
    (ours, A, B / A, B, ours / B, ours, A / ...); one Comparison per peer, all sharing our runs, outputs checked
    for equality against ours.

    peers: "mlx-lm" (mlx-lm's BatchGenerator) and / or "vllm-mlx" (the reference's MLLMBatchGenerator).
    """
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise ValueError(f"peers must be a non-empty subset of {PEERS}, got {list(peers)}")

    def ours(wl: Workload) -> RunStats:
        return run_ours(model, tokenizer, wl, config, ignore_eos)

    def mlx_lm(wl: Workload) -> RunStats:
        return run_peer(model, wl, peer_completion_batch, peer_prefill_batch)

    def vllm_mlx(wl: Workload) -> RunStats:
        from .reference import run_reference

        return run_reference(model, tokenizer, wl, peer_completion_batch)

    sides = [("ours", ours)] + [(p, mlx_lm if p == "mlx-lm" else vllm_mlx) for p in peers]
    if warmup_tokens:
        warm = workload.with_new_tokens(warmup_tokens)
        for _, fn in sides:
            fn(warm)
    runs: dict[str, list[RunStats]] = {name: [] for name, _ in sides}
    for rep in range(repeats):
        shift = rep % len(sides)
        for name, fn in sides[shift:] + sides[:shift]:
            r = fn(workload)
            runs[name].append(r)
            if log:
                log(f"  rep {rep} {name}: wall {r.wall_s:.3f}s e2e {r.e2e_tps:.1f} tok/s "
                    f"decode {r.decode_tps:.1f} tok/s ({r.ms_per_decode_step:.2f} ms/step) "
                    f"all-first {r.t_all_first_s:.3f}s cpu {r.cpu_s:.2f}s load1 {r.load1:.2f}")
    return [
        Comparison(
            model=model_name, workload=workload.name, n=len(workload), prompt_tokens=workload.prompt_tokens,
            new_tokens=workload.new_tokens, ours=runs["ours"], peer=runs[p],
            mismatches=compare_outputs(runs["ours"][0].outputs, runs[p][0].outputs,
                                       workload.greedy_indices if workload.sampled_every else None),
            blas=blas, stat=stat, peer_name=p, compared=len(workload.greedy_indices),
        )
        for p in peers
    ]


# ---------------------------------------------------------------------------------------------- tables
def markdown_table(comparisons: Sequence[Comparison], stat: str | None = None) -> str:
    """One row per comparison; "a / b" cells are ours / peer; ratios are ours / peer (> 1: ours faster)."""
    head = ("| model | peer | workload | n | new tok | wall s | e2e tok/s | e2e ratio | decode tok/s | decode ratio "
            "| ms/step | all-first s | identical | load1 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in comparisons:
        r = c.row(stat)
        ident = "yes" if c.identical else f"NO ({r['mismatches']}/{c.compared})"
        if c.compared != c.n:
            ident += f" ({c.compared} greedy of {c.n})"
        if r["ours_short"] or r["peer_short"]:
            ident += f"; short: ours {r['ours_short']} peer {r['peer_short']}"
        lines.append(
            f"| {c.model} | {c.peer_name} | {c.workload} | {c.n} | {c.new_tokens} "
            f"| {r['ours_wall_s']:.3f} / {r['peer_wall_s']:.3f} "
            f"| {r['ours_e2e_tps']:.0f} / {r['peer_e2e_tps']:.0f} | **{r['e2e_ratio']:.2f}** "
            f"| {r['ours_decode_tps']:.0f} / {r['peer_decode_tps']:.0f} | **{r['decode_ratio']:.2f}** "
            f"| {r['ours_ms_step']:.2f} / {r['peer_ms_step']:.2f} "
            f"| {r['ours_ttaf_s']:.3f} / {r['peer_ttaf_s']:.3f} | {ident} | {r['max_load1']:.1f} |"
        )
    return "\n".join(lines)

"""Shared test helpers: reference outputs from mlx-lm run alone, and an engine driver that checks the
per-request output contract (one stream, ends exactly once) on every tick."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.events import EventLog, MemorySink
from scheduler.fixtures.executors import FixedTokenExecutor
from scheduler.loop import TickLoop
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler

if TYPE_CHECKING:  # the core's names only at import: tests/core imports this module where MLX is not importable
    from scheduler import Engine


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now (bound at once, then released: what a child process then listens on)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def mixed_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """n token-id prompts whose lengths cover lo..hi (both ends included); ids avoid the specials (0..6)."""
    rng = random.Random(seed)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)]
    return [[rng.randrange(7, vocab) for _ in range(length)] for length in lengths]


def solo_tokens(model, tokenizer, prompt: list[int], max_tokens: int, **kwargs) -> list[int]:
    """What mlx-lm produces for this request alone (greedy unless a sampler is given)."""
    from mlx_lm import stream_generate  # here, not at the top: the core tests import this module without MLX

    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)]


def min_tokens_mask(prompt_len: int, min_tokens: int, ids, vocab: int):
    """An mlx-lm logits processor for what `SamplingParams.min_tokens` promises: `ids` cannot be sampled until the
    output has `min_tokens` tokens (mlx-lm's processors see prompt + output)."""
    import mlx.core as mx  # here, not at the top: the core tests import this module without MLX
    import numpy as np

    held = np.zeros(vocab, dtype=bool)
    held[list(ids)] = True
    held = mx.array(held)

    def mask(tokens, logits):
        return mx.where(held, -mx.inf, logits) if tokens.size - prompt_len < min_tokens else logits
    return mask


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, object] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    ticks: int = 0


def prefill_many_against_alone(adapter, rows, follow: int = 0, atol: float = 1e-4
                               ) -> list[tuple[list, list]]:
    """A VLM adapter's shared prefill forward (`prefill_many(rows)`) against each row's chunks fed alone: every
    row's logits within `atol` (the matrices have other shapes, so rounding differs), and with `follow`, its cache
    continued by the next `follow` positions on both sides, within `atol` too (the state check: a wrong window
    or recurrent state shows there). Returns (shared cache, alone cache) per row."""
    import mlx.core as mx  # here, not at the top: the core tests import this module without MLX

    got, logits = adapter.prefill_many(rows)
    pairs = []
    for i, ((_, encoded, start, n), shared) in enumerate(zip(rows, got)):
        alone = adapter.make_cache()
        if start:
            adapter.prefill(alone, encoded, 0, start)
        want = adapter.prefill(alone, encoded, start, start + n)
        assert mx.allclose(logits[i, :n], want[0], atol=atol).item(), f"row {i}: logits"
        if follow:
            after = adapter.prefill(shared, encoded, start + n, start + n + follow)
            alone_after = adapter.prefill(alone, encoded, start + n, start + n + follow)
            assert mx.allclose(after, alone_after, atol=atol).item(), f"row {i}: the next {follow} positions"
        pairs.append((shared, alone))
    return pairs


def drive(engine: "Engine", arrivals: list[tuple[int, dict]], max_ticks: int = 100_000) -> Run:
    """Step `engine`, adding each `(tick, add_request kwargs)` at its tick; check the output contract."""
    run = Run()
    pending = sorted(arrivals, key=lambda a: a[0])
    ids: list[str] = []
    while pending or engine.has_pending():
        while pending and pending[0][0] <= engine.tick:
            ids.append(engine.add_request(**pending.pop(0)[1]))
            run.tokens[ids[-1]] = []
        for out in engine.step():
            assert out.request_id not in run.finish, f"{out.request_id} produced output after it ended"
            run.tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                run.finish[out.request_id] = out.finish_reason
                if out.error:
                    run.errors[out.request_id] = out.error
        run.ticks += 1
        assert run.ticks < max_ticks, "engine did not drain"
    assert set(run.finish) == set(ids), "every request ends exactly once"
    return run


def interleave(engine, rng, events: int, add, add_below: float, abort_below: float, burst: int) -> list[str]:
    """`events` random calls into the engine, each drawn as r = rng.random(): r < add_below adds a request
    (`add()` returns its id, or None when the engine refused it), r < abort_below aborts one added (if any),
    otherwise 1..`burst` ticks. Returns the ids added."""
    ids: list[str] = []
    for _ in range(events):
        r = rng.random()
        if r < add_below:
            rid = add()
            if rid is not None:
                ids.append(rid)
        elif r < abort_below and ids:
            engine.abort(rng.choice(ids))
        else:
            for _ in range(rng.randint(1, burst)):
                engine.step()
    return ids


def drain(engine, max_ticks: int = 3000) -> int:
    """Step the engine until nothing is pending; a run that does not drain within `max_ticks` is a livelock.
    Returns the ticks it took."""
    ticks = 0
    while engine.has_pending():
        engine.step()
        ticks += 1
        assert ticks < max_ticks, "requests pending but nothing progresses"
    return ticks


def engine_with_log(model, tokenizer, config) -> tuple["Engine", MemorySink]:
    from scheduler import Engine

    sink = MemorySink()
    return Engine(model, tokenizer, config, event_sinks=[sink]), sink


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def simulate_planning(config, requests, policy=None, max_ticks=10_000, kv_layout=None):
    """Model-free run of the real Scheduler. requests: (arrival_tick, prompt_len, max_tokens[, priority[,
    num_images]]); `kv_layout`: the per-token KV cost that `config.kv_memory_bytes` is planned against.

    Returns (scheduler, plans, {request_id: (finish tick, reason)}); checks invariants every tick."""
    sched = Scheduler(config, EventLog(), policy=policy, kv_layout=kv_layout)
    loop = TickLoop(sched, FixedTokenExecutor())
    plans, finished_at, tick = [], {}, 0
    pending = sorted(enumerate(requests), key=lambda x: x[1][0])
    while pending or sched.has_live():
        while pending and pending[0][1][0] <= tick:
            i, spec = pending.pop(0)
            priority = spec[3] if len(spec) > 3 else 0
            images = spec[4] if len(spec) > 4 else 0
            sched.add(Request(f"r{i}", [5] * spec[1], SamplingParams(max_tokens=spec[2]), priority=priority,
                              arrival_tick=tick, num_images=images, media_key=f"media-{i}" if images else None),
                      tick)
        decoding_before = set(sched.decoding)
        plan = loop.plan(tick)
        running = decoding_before - set(plan.preempted) - {rid for rid, _ in plan.failed}
        if config.mix == "decode-first":
            assert set(plan.decode) == running, "every decoding request decodes every tick"
        else:
            assert set(plan.decode) in (running, set()), "prefill-first pauses all rows or none"
        applied = loop.carry_out(plan).applied
        sched.check_invariants(plan)
        plans.append(plan)
        for out in applied.outputs:
            if out.finished:
                finished_at[out.request_id] = (tick, out.finish_reason)
        tick += 1
        assert tick < max_ticks, "did not drain"
    return sched, plans, finished_at


class OracleDrafter:
    """A drafter for tests (the `Drafter` protocol): proposes each row's true continuation, `references[rid]`
    (its solo output), from the row's output count (`DraftRequest.step`), with position `call % (k + 1)` of
    each proposal spoiled, `call` counting proposals (ticks): the rows of one tick are spoiled at the same
    place, so across ticks drafts are kept whole, in part and not at all."""

    def __init__(self, references: dict[str, list[int]], vocab_size: int):
        self.references, self.vocab_size = references, vocab_size
        self.calls = 0

    def propose(self, rows, k):
        from scheduler.execution.drafters import Draft  # here: the core tests import this module without MLX

        self.calls += 1
        drafts = []
        for row in rows:
            n = min(k, row.max_tokens or k)
            tokens = list(self.references[row.request_id][row.step: row.step + n])
            spoil = self.calls % (n + 1)
            if spoil < len(tokens):
                tokens[spoil] = (tokens[spoil] + 1) % self.vocab_size
            drafts.append(Draft(row.request_id, tokens))
        return drafts

    def accept(self, request_id, num_accepted, emitted=()):
        pass

    def release(self, request_ids):
        pass

    def stats(self):
        return {}


def peft_copy(src, dst, rslora=False, path=lambda target: target, **config):
    """The mlx-lm adapter at `src` rewritten in Hugging Face PEFT's layout (its documented checkpoint format):
    `adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight`
    (out, r), and an `adapter_config.json` whose `lora_alpha / r` (`/ sqrt(r)` with rsLoRA) is the scale. `path`: each
    module's path as the Hugging Face model names it (mlx-lm's text models keep those; mlx-vlm's differ)."""
    import json

    import mlx.core as mx

    cfg = json.loads((src / "adapter_config.json").read_text())["lora_parameters"]
    rank, scale = cfg["rank"], cfg["scale"]
    weights = {}
    for key, value in mx.load(str(src / "adapters.safetensors")).items():
        target, half = key.rsplit(".", 1)
        weights[f"base_model.model.{path(target)}.lora_{half[-1].upper()}.weight"] = value.T
    dst.mkdir()
    mx.save_safetensors(str(dst / "adapter_model.safetensors"), weights)
    (dst / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "use_rslora": rslora,
        "lora_alpha": scale * (rank ** 0.5 if rslora else rank), "lora_dropout": 0.05, "bias": "none",
        "target_modules": sorted({k.split(".")[-3] for k in weights}), "modules_to_save": None,
        "fan_in_fan_out": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, **config}))
    return dst

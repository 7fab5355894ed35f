"""One rank of a sharded-engine test (started by tests/execution/test_tensor_parallel.py, never collected by pytest).

    mlx.launch -n 2 --backend ring python tests/execution/distributed_worker.py MODEL_DIR OUT_DIR SCENARIO

Every rank loads the model sharded and builds the engine; rank 0 drives it and writes `OUT_DIR/result.json`.
Scenarios:
- `equality`: several engine configurations (all at once; staggered with small budgets and chunks; a KV budget
  that preempts; the prefix cache with shared prefixes; prompt-lookup drafting; an abort), each compared with
  mlx-lm's own sharded generation of every request alone under the same launch (all ranks generate together),
  then, after the followers are released, with the unsharded model on rank 0 alone.
- `pipeline-equality`: the same, with the model loaded by pipeline (`pipeline_group`: each rank runs some of
  the layers) instead of by tensor.
- `checkpoints`: a model whose caches cannot be trimmed (a tiny gpt_oss: sliding-window layers) with the prefix
  cache: its prefill stores exact checkpoints, so one request can store two entries in one tick (a checkpoint
  and its prefill end); the followers must keep each under its own entry id. Compared with mlx-lm alone.
- `a-rank-dies`: both ranks write their pids and run short requests; the test kills one and times how long the
  survivor takes to record the error its engine raised, or its stall watchdog reported before exiting.
- `a-rank-dies-mid-forward`: the same with 3000-token prompts, so most of a tick is its forward and the kill
  mostly lands inside one (where MLX's ring backend can block for good, and the watchdog ends the rank).
- `a-rank-stalls-at-construction`: both ranks load the model sharded, then rank 1 sleeps instead of building its
  engine; rank 0's construction blocks in its KV-layout probe forward (a collective rank 1 never joins) and
  its watchdog must end it (OUT/rank0.json, `"by": "watchdog"`).
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scheduler import (AsyncEngine, Engine, EngineConfig, InvalidRequest, SamplingParams,  # noqa: E402
                       StructuredOutput)
from scheduler.events import read_jsonl  # noqa: E402
from scheduler.execution.rank_pinning import pin_local_rank  # noqa: E402
from tests.helpers import mixed_prompts, solo_tokens  # noqa: E402

MAX_TOKENS = 12
CONSTRAINT = StructuredOutput.regex("[0-9]{2}-(yes|no|later)")  # (the structured-output run below)
# (the masks run below: allowed ids, bad words and min_tokens cross the wire in the sampling record)
MASKED = SamplingParams(max_tokens=8, min_tokens=8, allowed_token_ids=tuple(range(40, 140)),
                        bad_words_ids=((60,), (41, 42)))


def _prompts() -> list[list[int]]:
    prompts = mixed_prompts(6, 3, 70, seed=5)
    shared = prompts[1][:40]
    prompts += [shared + [11, 12, 13], shared + [21, 22]]  # prefix-cache hits on the first stored prompt
    prompts.append([9, 10, 11, 12] * 6)  # repetitive: prompt lookup finds drafts
    return prompts


@dataclass
class Schedule:
    config: EngineConfig
    prompts: list[list[int]]
    max_tokens: int = MAX_TOKENS
    per_tick: int = 1  # arrivals per tick (0: all at once)
    abort: str | None = None  # a request aborted at tick 3


KV_BUDGET_TOKENS = 1170  # the KV budget of `kv-budget-preempts`, in tokens of a rank's own layers


def _schedules(trace_dir: Path, kv_bytes_per_token: int) -> dict[str, Schedule]:
    """`kv_bytes_per_token`: what a token's KV costs on rank 0 (its shard of the layers or heads)."""
    def trace(name: str) -> str:
        return str(trace_dir / f"{name}.jsonl")

    prompts = _prompts()
    return {
        "all-at-once": Schedule(EngineConfig(trace_path=trace("all-at-once")), prompts, per_tick=0, abort="r0"),
        "staggered-small-budget": Schedule(EngineConfig(max_batched_tokens=48, prefill_chunk=16, max_seqs=3,
                                                        trace_path=trace("staggered")), prompts),
        # about three of these rows fit per rank: decoding rows outgrow the budget and are preempted
        "kv-budget-preempts": Schedule(EngineConfig(max_batched_tokens=128, prefill_chunk=32,
                                                    kv_memory_bytes=KV_BUDGET_TOKENS * kv_bytes_per_token,
                                                    kv_headroom_tokens=8, trace_path=trace("kv-budget")),
                                       mixed_prompts(10, 8, 120, seed=21), max_tokens=32, per_tick=4),
        "prefix-cache": Schedule(EngineConfig(prefix_cache_bytes=4 << 20, prefix_block_size=16,
                                              trace_path=trace("prefix")), prompts),
        # draft_gate=False: one repetitive row among nine, whose drafts the gate would (rightly) decline; the
        # schedule is here to verify drafts on every rank
        "prompt-lookup-drafting": Schedule(EngineConfig(draft_tokens=2, draft_gate=False, trace_path=trace("drafting")),
                                           prompts),
    }


def _run(engine: Engine, schedule: Schedule) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(schedule.prompts))
    while pending or engine.has_pending():
        while pending and (schedule.per_tick == 0 or pending[0][0] // schedule.per_tick <= engine.tick):
            i, p = pending.pop(0)
            rid = engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=schedule.max_tokens),
                                     request_id=f"r{i}")
            tokens[rid] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        if schedule.abort is not None and engine.tick == 3:
            engine.abort(schedule.abort)
    if schedule.abort is not None:
        tokens.pop(schedule.abort)
    return tokens


async def _async_run(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    aengine = AsyncEngine(engine)
    try:
        outs = await asyncio.gather(*(aengine.generate(prompt_tokens=p, sampling=SamplingParams(max_tokens=MAX_TOKENS))
                                      for p in prompts))
    finally:
        aengine.close()
    return {f"r{i}": out.token_ids for i, out in enumerate(outs)}


def equality(model_dir: str, out: Path, group, sharding: str = "tensor_group") -> None:
    results: dict = {"configs": {}}
    probe = Engine.from_pretrained(model_dir, EngineConfig(), **{sharding: group})
    schedules = _schedules(out, probe.kv_layout.bytes_per_token)
    if group.rank() == 0:
        probe.close()
    else:
        probe.follow()
    engine = None
    for name, schedule in schedules.items():
        engine = Engine.from_pretrained(model_dir, schedule.config, **{sharding: group})
        if group.rank() != 0:
            engine.follow()
            continue
        t0 = time.perf_counter()
        got = _run(engine, schedule)
        channel = engine.executor.channel
        results["configs"][name] = {
            "tokens": got, "seconds": time.perf_counter() - t0,
            "channel": {"messages": channel.messages, "bytes": channel.bytes_sent, "seconds": channel.seconds},
            "draft_accepted": engine.draft_stats()["accepted"],
            "prefix_hits": engine.scheduler.prefix_cache.stats()["hits"] if engine.scheduler.prefix_cache else 0,
            "kv_bytes_left": engine.executor.cache_bytes(),
        }
        engine.close()
        results["configs"][name]["preemptions"] = sum(
            e["event"] == "transition" and e["trigger"] == "preempt" for e in read_jsonl(schedule.config.trace_path))
    # the asyncio front over a sharded engine, and what a sharded engine refuses
    engine = Engine.from_pretrained(model_dir, EngineConfig(), **{sharding: group})
    if group.rank() == 0:
        results["async"] = asyncio.run(_async_run(engine, _prompts()))
        try:
            engine.add_request(prompt_tokens=[7, 8], sampling=SamplingParams(logits_processors=[lambda t, x: x]))
            results["refused_field"] = None
        except InvalidRequest as exc:
            results["refused_field"] = exc.field
        engine.close()
    else:
        engine.follow()
    # prompt logprobs: the logits of prefill chunks are read on every rank, in the same order (with a pipeline
    # their vocabulary projection follows a collective, which every rank must run)
    engine = Engine.from_pretrained(model_dir, EngineConfig(prefill_chunk=16), **{sharding: group})
    if group.rank() == 0:
        outs = engine.generate(_prompts()[:3], SamplingParams(max_tokens=4, prompt_logprobs=2))
        results["prompt_logprobs"] = [[o.prompt_logprobs, o.prompt_top_logprobs, o.token_ids] for o in outs]
        engine.close()
    else:
        engine.follow()
    # structured outputs: the constraint crosses the wire as a value, and every rank masks its logits alike (a
    # follower that did not would sample other tokens, which the ranks' check of each tick reports)
    engine = Engine.from_pretrained(model_dir, EngineConfig(prefill_chunk=16), **{sharding: group})
    grammars = engine.grammars
    if group.rank() == 0:
        outs = engine.generate(_prompts()[:3], SamplingParams(max_tokens=10, structured_output=CONSTRAINT))
        results["structured"] = [o.token_ids for o in outs]
        results["masked"] = [o.token_ids for o in engine.generate(_prompts()[:3], MASKED)]
        engine.close()
    else:
        engine.follow()
    # mlx-lm's own sharded generation, each request alone: every rank runs it (its collectives line up)
    solo = _solo_per_schedule(schedules, engine.model, engine.tokenizer)
    if group.rank() != 0:
        return
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_dir)  # unsharded, on rank 0 alone (no collectives)
    results["sharded_solo"] = solo
    results["unsharded_prompt_logprobs"] = [_forward_logprobs(model, p) for p in _prompts()[:3]]
    results["unsharded_structured"] = [solo_tokens(model, tokenizer, p, 10,
                                                   logits_processors=[grammars.processor(CONSTRAINT)])
                                       for p in _prompts()[:3]]
    results["unsharded_masked"] = [solo_tokens(model, tokenizer, p, 8, logits_processors=[_masks(len(p))])
                                   for p in _prompts()[:3]]
    results["unsharded_solo"] = _solo_per_schedule(schedules, model, tokenizer)
    (out / "result.json").write_text(json.dumps(results))


def _masks(prompt_len: int):
    """An mlx-lm processor for MASKED: only its allowed ids, and its bad words' last tokens masked where the output
    so far leads into them (its min_tokens masks eos, which these models never rank first)."""
    import numpy as np

    def processor(tokens, logits):
        allowed = np.zeros(logits.shape[-1], dtype=bool)
        allowed[list(MASKED.allowed_token_ids)] = True
        out = tokens.tolist()[prompt_len:]
        ends = [w[-1] for w in MASKED.bad_words_ids if len(w) == 1 or out[-(len(w) - 1):] == list(w[:-1])]
        logits = mx.where(mx.array(allowed), logits, -mx.inf)
        return logits.at[:, mx.array(ends)].add(-mx.inf) if ends else logits
    return processor


def _solo_per_schedule(schedules: dict[str, Schedule], model, tokenizer) -> dict[str, dict[str, list[int]]]:
    """mlx-lm's generation of each schedule's requests alone, by request id; a request several schedules share
    (the same prompt and max_tokens) is generated once: a sharded token costs a collective round trip."""
    generated: dict[tuple[tuple[int, ...], int], list[int]] = {}
    solo: dict[str, dict[str, list[int]]] = {}
    for name, s in schedules.items():
        solo[name] = {}
        for i, p in enumerate(s.prompts):
            key = (tuple(p), s.max_tokens)
            if key not in generated:
                generated[key] = solo_tokens(model, tokenizer, p, s.max_tokens)
            solo[name][f"r{i}"] = generated[key]
    return solo


def _forward_logprobs(model, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob (after the first) from one unsharded forward of the prompt alone."""
    import mlx.core as mx

    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]


def checkpoints(model_dir: str, out: Path, group) -> None:
    shared = mixed_prompts(1, 40, 40, seed=5)[0]
    # chunks of 9: r0's completing chunk [45, 53) passes block boundary 48 (a checkpoint) and ends at 52 (its
    # prefill end), in one tick; r1 shares 50 tokens with it (the checkpoint at 48 is what it can reuse), r2 35
    # (the checkpoint at 32). Each arrives after the previous one finished.
    first = shared + list(range(9, 22))
    prompts = [first, first[:50] + [7, 7], shared[:35] + [12, 13]]
    trace = out / "checkpoints.jsonl"
    config = EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=9, prefix_cache_bytes=4 << 20,
                          prefix_block_size=16, trace_path=str(trace))
    engine = Engine.from_pretrained(model_dir, config, tensor_group=group)
    if group.rank() == 0:
        tokens: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            tokens[engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=6), request_id=f"r{i}")] = []
            while engine.has_pending():
                for o in engine.step():
                    tokens[o.request_id].extend(o.token_ids)
        results = {"tokens": tokens, "kv_bytes_left": engine.executor.cache_bytes()}
        engine.close()
    else:
        engine.follow()
    solo = {f"r{i}": solo_tokens(engine.model, engine.tokenizer, p, 6) for i, p in enumerate(prompts)}
    if group.rank() != 0:
        return
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_dir)
    events = read_jsonl(trace)
    results.update(sharded_solo=solo,
                   unsharded_solo={f"r{i}": solo_tokens(model, tokenizer, p, 6) for i, p in enumerate(prompts)},
                   stores=[[e["tick"], e["request_id"], e["tokens"]] for e in events if e["event"] == "prefix_store"],
                   hits=[[e["request_id"], e["length"], e["reuse"]] for e in events if e["event"] == "prefix_hit"])
    (out / "result.json").write_text(json.dumps(results))


def _keep_busy(engine: Engine) -> None:
    if not engine.has_pending():
        engine.add_request(prompt_tokens=[7, 8, 9], sampling=SamplingParams(max_tokens=50))
    engine.step()


STALL_TIMEOUT_S = 4.0  # a tick's forward here takes milliseconds; the test allows 15 s from the kill


def a_rank_dies(model_dir: str, out: Path, group, prompt_len: int = 3, max_tokens: int = 50) -> None:
    """Both ranks write their pid (OUT/rank{N}.pid) and run until their engine raises (or its watchdog ends
    the process); the test kills one and times how long the survivor takes to write what it raised
    (OUT/rank{N}.json, with `"by": "raise"` or `"watchdog"`)."""
    rank = group.rank()

    def record(exc: BaseException, by: str) -> None:
        (out / f"rank{rank}.json").write_text(json.dumps({"error_type": type(exc).__name__, "error": str(exc),
                                                          "by": by}))

    engine = Engine.from_pretrained(model_dir, EngineConfig(shard_stall_timeout_s=STALL_TIMEOUT_S),
                                    tensor_group=group, on_shard_lost=[lambda exc: record(exc, "watchdog")])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    prompt = [(7 + 13 * j) % 400 + 5 for j in range(prompt_len)]
    try:
        if rank != 0:
            engine.follow()
        while rank == 0:
            if not engine.has_pending():
                engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=max_tokens))
            engine.step()
        (out / f"rank{rank}.json").write_text(json.dumps({"error_type": None}))
    except Exception as exc:  # what the engine raised is the result
        record(exc, "raise")


def a_rank_stalls_at_construction(model_dir: str, out: Path, group) -> None:
    rank = group.rank()
    if rank != 0:
        from mlx_lm.utils import sharded_load

        sharded_load(model_dir, tensor_group=group)  # (ends with a barrier rank 0's load joins)
        time.sleep(120)  # the test kills this rank once rank 0 has exited
        return

    def record(exc: BaseException, by: str) -> None:
        (out / "rank0.json").write_text(json.dumps({"error_type": type(exc).__name__, "error": str(exc), "by": by}))

    Engine.from_pretrained(model_dir, EngineConfig(shard_stall_timeout_s=2.0), tensor_group=group,
                           on_shard_lost=[lambda exc: record(exc, "watchdog")])
    (out / "rank0.json").write_text(json.dumps({"error_type": None, "by": "constructed"}))


def main() -> None:
    model_dir, out, scenario = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that sees a hang asks for the stacks
    pin_local_rank()  # as the command line does (unpinned, the equality scenario took 2x as long on 2 cores)
    group = mx.distributed.init()
    scenarios = {"equality": equality, "checkpoints": checkpoints, "a-rank-dies": a_rank_dies,
                 "pipeline-equality": lambda *args: equality(*args, sharding="pipeline_group"),
                 "a-rank-dies-mid-forward": lambda *args: a_rank_dies(*args, prompt_len=3000, max_tokens=2),
                 "a-rank-stalls-at-construction": a_rank_stalls_at_construction}
    scenarios[scenario](model_dir, out, group)


if __name__ == "__main__":
    main()

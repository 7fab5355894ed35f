"""Feature figures, each measured side by side in one process on the same model:

* prefix cache: time to first token of a request whose 1,000-token prefix is cached vs the same request cold;
* drafting: tokens per target forward and wall-clock speed-up vs plain decoding, per drafter;
* vision: tok/s of a 16-request mixed image/text workload on the tiny VLM, with the vision cache cold and warm;
* trace size: bytes of event log per generated token.

    python -m bench.features [--model text-medium] [--only prefix drafting vision trace interleave]
                             [--prefix-len 1000] [--long-prompt 2000] [--streams 32] [--new-tokens 64]
                             [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def _engine(model, tokenizer, **config):
    from scheduler import Engine, EngineConfig

    draft_model = config.pop("draft_model", None)
    mtp_head = config.pop("mtp_head", None)
    return Engine(model, tokenizer, EngineConfig(**config), draft_model=draft_model, mtp_head=mtp_head)


def _ttft(engine, prompt, max_tokens=1):
    from scheduler import SamplingParams

    t0 = time.perf_counter()
    rid = engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=max_tokens))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.token_ids:
                ttft = time.perf_counter() - t0
                while engine.has_pending():
                    engine.step()
                return ttft


def prefix_figure(model, tokenizer, repeats=3, prefix_len=1000):
    rng = random.Random(0)
    shared = [rng.randrange(7, 512) for _ in range(prefix_len)]
    cold, warm = [], []
    for r in range(repeats):
        engine = _engine(model, tokenizer, prefix_cache_bytes=1 << 30, prefill_chunk=512, max_batched_tokens=2048)
        _ttft(engine, shared + [7 + r])  # fills the cache (and warms up kernels)
        cold_engine = _engine(model, tokenizer, prefill_chunk=512, max_batched_tokens=2048)
        _ttft(cold_engine, [8] * 16)  # warm-up
        cold.append(_ttft(cold_engine, shared + [100 + r, 101, 102]))
        warm.append(_ttft(engine, shared + [100 + r, 101, 102]))
        assert engine.prefix_cache_stats()["hits"] >= 1
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix_len": prefix_len, "cold_ttft_s": c, "cached_ttft_s": w, "ratio": w / c}


def drafting_figure(model, tokenizer, draft_model=None, mtp_head=None, n=4, new_tokens=64):
    from scheduler import SamplingParams

    phrase = list(range(101, 121))
    prompts = [phrase * 5 + [7 + i] for i in range(n)]  # a repetitive workload
    results, outputs = {}, {}
    configs = {"plain": dict(), "prompt-lookup k=4": dict(draft_tokens=4),
               "draft-model (self) k=4": dict(draft_tokens=4, drafter="draft-model", draft_model=model)}
    if draft_model is not None:
        configs["draft-model (small) k=4"] = dict(draft_tokens=4, drafter="draft-model", draft_model=draft_model)
    if mtp_head is not None:
        for k in (1, 4):
            configs[f"mtp head k={k}"] = dict(draft_tokens=k, drafter="mtp", mtp_head=mtp_head)
    for name, extra in configs.items():
        best = None
        for _ in range(2):
            engine = _engine(model, tokenizer, max_batched_tokens=512, **dict(extra))
            t0 = time.perf_counter()
            outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
            wall = time.perf_counter() - t0
            best = wall if best is None else min(best, wall)
        stats = engine.draft_stats()
        outputs[name] = [o.token_ids for o in outs]
        results[name] = {"wall_s": best, "tokens": sum(len(o.token_ids) for o in outs),
                         "acceptance_rate": stats["acceptance_rate"],
                         "tokens_per_row_forward": stats["tokens_per_row_forward"] or 1.0}
    for name, r in results.items():
        r["speedup"] = results["plain"]["wall_s"] / r["wall_s"]
        r["same_tokens_as_plain"] = outputs[name] == outputs["plain"]
    return results


def vision_figure(tmp: Path, new_tokens=32):
    import numpy as np
    from PIL import Image

    from scheduler import Engine, EngineConfig
    from scheduler.fixtures.tiny_models import build_model

    engine = Engine.from_pretrained(build_model("vlm", tmp / "vlm"), EngineConfig())
    sizes = [(112, 140), (56, 56), (84, 112), (140, 84)]
    prompts, images = [], []
    for i in range(16):
        if i % 2 == 0:
            w, h = sizes[(i // 2) % 4]
            img = Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
            prompts.append([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"picture {i}"}]}])
            images.append([img])
        else:
            prompts.append([{"role": "user", "content": "tell me something " * (1 + i)}])
            images.append(None)
    from scheduler import SamplingParams

    out = {}
    for label in ("vision cache cold", "vision cache warm"):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens), images=images)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        out[label] = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}
    out["vision_cache"] = engine.vision_cache_stats()
    return out


def interleave_figure(model, tokenizer, streams=32, long_prompt=2000, chunk=256) -> dict:
    """A long prompt arrives while `streams` requests decode: its time to first token, and the decode streams'
    time per tick before it arrived vs while it was being prefilled (decode-first interleaving)."""
    from scheduler import SamplingParams

    engine = _engine(model, tokenizer, max_seqs=streams + 1, max_batched_tokens=streams + chunk,
                     prefill_chunk=chunk)
    rng = random.Random(2)
    for _ in range(streams):
        engine.add_request(prompt_tokens=[rng.randrange(7, 512) for _ in range(32)],
                           sampling=SamplingParams(max_tokens=10_000))
    while len(engine.scheduler.decoding) < streams:  # until every stream is decoding
        engine.step()
    before = []
    for _ in range(8):
        t0 = time.perf_counter()
        engine.step()
        before.append(time.perf_counter() - t0)
    rid = engine.add_request(prompt_tokens=[rng.randrange(7, 512) for _ in range(long_prompt)],
                             sampling=SamplingParams(max_tokens=1))
    during, t_arrival, streams_fed = [], time.perf_counter(), True
    while True:
        t0 = time.perf_counter()
        outs = engine.step()
        during.append(time.perf_counter() - t0)
        streams_fed &= sum(1 for o in outs if o.request_id != rid and o.token_ids) == streams
        if any(o.request_id == rid and o.token_ids for o in outs):
            ttft = time.perf_counter() - t_arrival
            break
    return {"streams": streams, "long_prompt": long_prompt, "prefill_chunk": chunk, "ttft_s": ttft,
            "ticks_to_first_token": len(during), "stream_tick_before_ms": 1e3 * statistics.median(before),
            "stream_tick_during_ms": 1e3 * statistics.median(during), "streams_decoded_every_tick": streams_fed}


def trace_figure(model, tokenizer, tmp: Path, new_tokens=64):
    from scheduler import SamplingParams

    path = tmp / "trace.jsonl"
    engine = _engine(model, tokenizer, trace_path=str(path), prefix_cache_bytes=64 << 20)
    rng = random.Random(1)
    prompts = [[rng.randrange(7, 512) for _ in range(rng.randint(16, 300))] for _ in range(32)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
    engine.close()
    tokens = sum(len(o.token_ids) for o in outs)
    size = os.path.getsize(path)
    return {"trace_bytes": size, "generated_tokens": tokens, "bytes_per_token": size / tokens}


def main(argv=None) -> int:
    from mlx_lm import load

    from bench.blas import describe, detect_blas
    from scheduler.fixtures.tiny_models import build_model

    ap = argparse.ArgumentParser(prog="python -m bench.features", description=__doc__)
    ap.add_argument("--model", default="text-medium", choices=["text", "text-medium"])
    ap.add_argument("--only", nargs="+", default=["prefix", "drafting", "vision", "trace", "interleave"])
    ap.add_argument("--prefix-len", type=int, default=1000, help="the cached prefix of the prefix figure")
    ap.add_argument("--long-prompt", type=int, default=2000, help="the prompt that arrives among decode streams")
    ap.add_argument("--streams", type=int, default=32, help="decode streams of the interleave figure")
    ap.add_argument("--new-tokens", type=int, default=64, help="per request (the vision figure: half of it)")
    ap.add_argument("--repeats", type=int, default=3, help="of the prefix figure (median)")
    args = ap.parse_args(argv)
    print(describe(detect_blas()))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model, tokenizer = load(str(build_model(args.model, tmp / args.model)))
        mx.eval(model.parameters())
        if "prefix" in args.only:
            print("prefix cache:", prefix_figure(model, tokenizer, args.repeats, args.prefix_len))
        if "drafting" in args.only:
            small, _ = load(str(build_model("text", tmp / "small", seed=1))) if args.model != "text" else (None, None)
            head = None
            if args.model == "text":  # the tiny text model has a fitted MTP head (make-model text-mtp)
                from scheduler.execution.mtp import load_mtp_head

                head = load_mtp_head(build_model("text-mtp", tmp / "text-mtp"))
            for name, r in drafting_figure(model, tokenizer, small, head, new_tokens=args.new_tokens).items():
                print(f"drafting {name}: {r}")
        if "vision" in args.only:
            print("vision:", vision_figure(tmp, max(1, args.new_tokens // 2)))
        if "trace" in args.only:
            print("trace:", trace_figure(model, tokenizer, tmp, args.new_tokens))
        if "interleave" in args.only:
            for chunk in (256, 32):
                print("interleave:", interleave_figure(model, tokenizer, args.streams, args.long_prompt, chunk))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Quantized KV cache (EngineConfig.kv_bits): bytes per token, requests admitted under one KV budget, and
decode throughput at batch 32, at 16 (unquantized), 8 and 4 bits, in one process on one model.

    python -m bench.quantized_kv [--batch 32] [--prompt-len 128] [--new-tokens 48] [--json PATH]
    python -m bench.quantized_kv --vlm     # the tiny Qwen2-VL with image requests: bytes and admission

The model is a seeded llama built here (hidden 256, 4 layers, head_dim 64, float16, so "16 bits" is the
unquantized cache). Figures:

* bytes/token: the KV layout the engine measures on a one-token probe (all layers, keys + values).
* admitted: the most requests holding a slot at once when `--admit-requests` prompts of `--admit-len` tokens
  arrive together under one `kv_memory_bytes` (the budget of `--admit-base` unquantized requests); max_seqs is
  not the limit (it is set above the number of requests).
* decode tok/s: tokens generated after every row of the batch has its first token, over that window (no
  prefill in it), one run after a warm-up; the ratio is to the unquantized run of the same process.
* bare forward tok/s: the same batch decoded by forward + argmax on a merged batch cache, no engine: what the
  attention kernels cost (mlx-lm reads a quantized cache with two `quantized_matmul`s and a softmax instead
  of the fused float attention).
Greedy outputs of the quantized runs are checked against mlx-lm alone with the same kv_bits for two prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import mlx.core as mx
from mlx_lm import load, stream_generate

from caches import layers
from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.execution.library import make_request_cache as layers_make
from scheduler.events import MemorySink
from scheduler.fixtures.families import build_family_model

from .workloads import uniform

BENCH_MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64}
BITS = (None, 8, 4)


def _label(bits: int | None) -> str:
    return "16 (off)" if bits is None else str(bits)


def _quantized(bits: int | None) -> dict:
    return {} if bits is None else {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}


def admitted(model, tokenizer, bits, budget: int, n: int, prompt_len: int) -> int:
    sink = MemorySink()
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=8192, max_seqs=n + 1, prefill_chunk=prompt_len,
                                                   kv_memory_bytes=budget, kv_headroom_tokens=16, **_quantized(bits)),
                    event_sinks=[sink])
    for prompt in uniform(n, prompt_len, 2, seed=3).prompts:
        engine.add_request(prompt_tokens=list(prompt), sampling=SamplingParams(max_tokens=2))
    while engine.has_pending():
        engine.step()
    return max(p["num_seqs"] for p in sink.events if p["event"] == "plan")


def decode_tps(model, tokenizer, bits, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, list, list]:
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=8192, max_seqs=batch, prefill_chunk=512,
                                                   **_quantized(bits)))
    prompts = [list(p) for p in uniform(batch, prompt_len, new_tokens, seed=5).prompts]
    ids = [engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=new_tokens)) for p in prompts]
    got = {rid: [] for rid in ids}
    t_first = None
    after = 0
    while engine.has_pending():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if t_first is not None:
                after += len(out.token_ids)
            got[out.request_id] += out.token_ids
        if t_first is None and all(got[rid] for rid in ids):
            t_first = now
    return after / (time.perf_counter() - t_first), prompts, [got[rid] for rid in ids]


def bare_decode_tps(model, bits, prompts: list[list[int]], new_tokens: int) -> float:
    """The same batch decoded without the engine: each prompt prefilled into its own mlx-lm cache (converted
    as mlx-lm converts it), merged into one batch cache, then forward + argmax per step. What the attention
    kernels cost, apart from the engine's per-tick work."""
    caches = []
    for prompt in prompts:
        cache = layers_make(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        if bits is not None:
            layers.quantize_layers(cache, 64, bits)
        mx.eval(layers.cache_arrays(cache))
        caches.append(cache)
    batch = layers.merge_caches(caches)
    tokens = mx.array([p[-1] for p in prompts])
    mx.eval(model(tokens[:, None], cache=batch))  # the first step (not timed)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        tokens = mx.argmax(model(tokens[:, None], cache=batch)[:, -1, :], axis=-1)
        mx.eval(tokens)
    return len(prompts) * (new_tokens - 1) / (time.perf_counter() - t0)


def vlm_rows(requests: int, base_rows: int, base_len: int) -> tuple[int, list[dict]]:
    """The tiny Qwen2-VL (head_dim 32, float32, groups of 32): bytes per token, and how many image requests one
    budget (`base_rows` float rows of `base_len` tokens) holds at once, at float / 8 / 4 bits; outputs checked
    against mlx_vlm.stream_generate alone with the same settings for the first two."""
    import mlx_vlm
    import numpy as np
    from PIL import Image

    from scheduler.fixtures.tiny_models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model, processor = mlx_vlm.load(str(build_model("vlm", tmp)))
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (112, 112, 3), dtype=np.uint8))
              for i in range(requests)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                  "text": "Describe the picture in detail. " * 6}]}]
    prompt = mlx_vlm.prompt_utils.apply_chat_template(processor, model.config, messages, num_images=1)
    budget = Engine(model, processor).kv_layout.batch_bytes([base_len] * base_rows)
    rows = []
    for bits in BITS:
        settings = {} if bits is None else {"kv_bits": bits, "kv_group_size": 32, "quantized_kv_start": 0}
        layout = Engine(model, processor, EngineConfig(**settings)).kv_layout
        sink = MemorySink()
        engine = Engine(model, processor, EngineConfig(kv_memory_bytes=budget, max_seqs=requests + 1,
                                                       kv_headroom_tokens=16, **settings), event_sinks=[sink])
        ids = [engine.add_request(prompt=messages, images=[image], sampling=SamplingParams(max_tokens=8))
               for image in images]
        got = {rid: [] for rid in ids}
        while engine.has_pending():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        solo = [list(r.token_ids) for r in (
            list(mlx_vlm.stream_generate(model, processor, prompt, image=[image], max_tokens=8, temperature=0.0,
                                         **settings))[-1] for image in images[:2])]
        rows.append({"bits": "32 (off)" if bits is None else str(bits),
                     "bytes_per_token": sum(x.quantized_bytes_per_token or x.bytes_per_token for x in layout.layers),
                     "admitted": max(p["num_seqs"] for p in sink.events if p["event"] == "plan"),
                     "prompt_tokens": next(len(e["prompt_tokens"]) for e in sink.events if e["event"] == "arrival"),
                     "equals_mlx_vlm_alone": [got[rid] for rid in ids[:2]] == solo})
    return budget, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--admit-requests", type=int, default=16)
    ap.add_argument("--admit-len", type=int, default=512)
    ap.add_argument("--admit-base", type=int, default=4, help="the budget holds this many unquantized requests")
    ap.add_argument("--json", default=None)
    ap.add_argument("--vlm", action="store_true", help="the tiny Qwen2-VL with image requests: bytes per token and "
                    "requests admitted (24 image requests, a budget of 4 float rows of 400 tokens)")
    args = ap.parse_args(argv)
    if args.vlm:
        budget, rows = vlm_rows(24, 4, 400)
        print(f"model: tiny Qwen2-VL (float32, head_dim 32), kv_group_size 32; budget {budget} bytes (4 float rows "
              f"of 400 tokens); 24 image requests of {rows[0]['prompt_tokens']} prompt tokens, 8 new tokens")
        print("| kv bits | bytes/token | admitted at once | first two = mlx_vlm alone |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['bits']} | {r['bytes_per_token']} | {r['admitted']} | {r['equals_mlx_vlm_alone']} |")
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load(str(build_family_model("llama", tmp, seed=0, overrides=BENCH_MODEL)))
    model.set_dtype(mx.float16)
    rows = []
    plain_layout = None
    for bits in BITS:
        engine = Engine(model, tokenizer, EngineConfig(**_quantized(bits)))
        layout = engine.kv_layout
        plain_layout = plain_layout or layout
        per_token = sum(layer.quantized_bytes_per_token or layer.bytes_per_token for layer in layout.layers)
        rows.append({"bits": _label(bits), "bytes_per_token": per_token})
    # one budget for every run: room for admit_base unquantized requests of admit_len tokens
    budget = plain_layout.batch_bytes([args.admit_len + 16] * args.admit_base)
    for row, bits in zip(rows, BITS):
        print(f"admission at {_label(bits)} bits ...", file=sys.stderr)
        row["admitted"] = admitted(model, tokenizer, bits, budget, args.admit_requests, args.admit_len)
    decode_tps(model, tokenizer, None, 4, 16, 4)  # warm-up
    for row, bits in zip(rows, BITS):
        print(f"decode at batch {args.batch}, {_label(bits)} bits ...", file=sys.stderr)
        row["decode_tps"], prompts, outputs = decode_tps(model, tokenizer, bits, args.batch, args.prompt_len,
                                                         args.new_tokens)
        solo = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=args.new_tokens, **_quantized(bits))]
                for p in prompts[:2]]
        row["equals_mlx_lm_alone"] = outputs[:2] == solo
        row["bare_decode_tps"] = bare_decode_tps(model, bits, prompts, args.new_tokens)
    base = rows[0]
    for row in rows:
        row["bytes_ratio"] = row["bytes_per_token"] / base["bytes_per_token"]
        row["admitted_ratio"] = row["admitted"] / base["admitted"]
        row["decode_ratio"] = row["decode_tps"] / base["decode_tps"]
        row["bare_ratio"] = row["bare_decode_tps"] / base["bare_decode_tps"]
    print(f"model: llama {BENCH_MODEL}, float16; budget {budget} bytes "
          f"({args.admit_base} unquantized requests of {args.admit_len} tokens); decode: batch {args.batch}, "
          f"prompts of {args.prompt_len}, {args.new_tokens} new tokens")
    print("| kv bits | bytes/token | ratio | admitted | ratio | decode tok/s | ratio | bare forward tok/s | ratio "
          "| = mlx-lm alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bits']} | {r['bytes_per_token']} | {r['bytes_ratio']:.3f} | {r['admitted']} | "
              f"{r['admitted_ratio']:.2f} | {r['decode_tps']:.1f} | {r['decode_ratio']:.2f} | "
              f"{r['bare_decode_tps']:.1f} | {r['bare_ratio']:.2f} | {r['equals_mlx_lm_alone']} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"budget": budget, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a forward's time goes on the CPU: the ops every engine on this model runs, timed alone.

Both peers and our engine call the same mlx-lm model, so a decode step or a prefill forward costs the same on
every side; what differs is only how many forwards run and how wide they are. This probe says what that shared
floor is made of on the machine it runs on, at the shapes of a workload: a whole bare forward (the model over a
left-padded batch cache, as the engines build it), then its parts timed alone at the same shapes, each summed
over the model's layers:

* ``attention``: `mx.fast.scaled_dot_product_attention` as the model calls it (MLX's CPU backend runs its
  fallback: scale, a batched matmul per row and head, the mask, a softmax, a second matmul);
* ``softmax``: the softmax inside it, alone at the scores' shape, and ``exp of the scores``: `mx.exp` alone on
  as many elements;
* ``linear projections``: the layers' q, k, v, o, gate, up and down matmuls and the output head;
* ``SwiGLU``: the MLP's activation as mlx-lm computes it (``silu(gate) * up``), and ``exp of the gate``:
  `mx.exp` alone on the gate (SiLU is ``x * sigmoid(x)``, one exp per element).

The parts overlap (the softmax is inside the attention, each exp inside its op) and leave out the norms, RoPE,
the cache writes and the graph building, so they do not add up to the forward; each is its own share of it.
On x86 the exps are the surprise: MLX's CPU `exp` is a polynomial run one float at a time there
(mlx/backend/cpu/simd/math.h; its only vector path is for ARM Macs), about 10-15 ns an element, so the
activations cost about what the matmuls do. ``ns per exp`` gives the figure.

    python -m bench.op_floor [--model text-medium] [--batch 32] [--lo 16] [--hi 300] [--new-tokens 64]
        [--prefill-len 300] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .verify_tick import _low_ms  # the 10th percentile of timed calls, in ms


@dataclass(frozen=True)
class Shapes:
    """The model's dimensions that the parts are timed at."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model_dir: Path) -> "Shapes":
        """From the model directory's config.json (the Hugging Face fields the model was built from)."""
        config = json.loads((model_dir / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"])


def _parts(shapes: Shapes, rows: int, queries: int, keys: int, mask, iters: int) -> dict[str, float]:
    """The parts of one forward of ``rows`` x ``queries`` positions attending to ``keys`` positions, summed
    over the layers (ms)."""
    import mlx.core as mx
    import mlx.nn as nn

    s = shapes
    q = mx.random.normal((rows, s.heads, queries, s.head_dim))
    k = mx.random.normal((rows, s.kv_heads, keys, s.head_dim))
    v = mx.random.normal((rows, s.kv_heads, keys, s.head_dim))
    scores = mx.random.normal((rows, s.heads, queries, keys))
    tokens = rows * queries
    x = mx.random.normal((tokens, s.hidden))
    h = mx.random.normal((tokens, s.intermediate))
    weights = {name: mx.random.normal(shape) * 0.02 for name, shape in {
        "q": (s.heads * s.head_dim, s.hidden), "k": (s.kv_heads * s.head_dim, s.hidden),
        "v": (s.kv_heads * s.head_dim, s.hidden), "o": (s.hidden, s.heads * s.head_dim),
        "gate": (s.intermediate, s.hidden), "up": (s.intermediate, s.hidden), "down": (s.hidden, s.intermediate),
        "head": (s.vocab, s.hidden)}.items()}
    mx.eval(q, k, v, scores, x, h, *weights.values())
    scale = s.head_dim ** -0.5

    def attention():
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))

    def linears():
        outs = [x @ weights[n].T for n in ("q", "k", "v", "gate", "up")]
        outs.append(mx.random.normal((tokens, s.heads * s.head_dim)) @ weights["o"].T)
        outs.append(h @ weights["down"].T)
        mx.eval(outs)

    head_ms = _low_ms(lambda: mx.eval(x @ weights["head"].T), iters)
    exp_scores = _low_ms(lambda: mx.eval(mx.exp(scores)), iters)
    return {
        "attention": s.layers * _low_ms(attention, iters),
        "softmax": s.layers * _low_ms(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)), iters),
        "exp of the scores": s.layers * exp_scores,
        "linear projections": s.layers * _low_ms(linears, iters) + head_ms,
        "SwiGLU": s.layers * _low_ms(lambda: mx.eval(nn.silu(h) * h), iters),
        "exp of the gate": s.layers * _low_ms(lambda: mx.eval(mx.exp(h)), iters),
        "ns per exp": 1e6 * exp_scores / scores.size,
    }


def decode_floor(model, shapes: Shapes, prompts: list[list[int]], new_tokens: int, iters: int,
                 width: int = 1) -> dict[str, float]:
    """A decode step of ``width`` positions per row (more than one: a verify forward of width - 1 drafts) over
    the prompts' merged batch cache, halfway through ``new_tokens``, and its parts."""
    import mlx.core as mx

    from scheduler.execution import library

    caches = []
    for p in prompts:
        cache = library.make_request_cache(model)
        model(mx.array(p + [7] * (new_tokens // 2))[None], cache=cache)
        mx.eval(library.cache_arrays(cache))
        caches.append(cache)
    batch, _ = library.join_rows([], caches)
    y = mx.array([[7] * width] * len(prompts))
    keys = max(len(p) for p in prompts) + new_tokens // 2 + width

    def step():
        mx.eval(model(y, cache=batch))
        for layer in batch:  # back to where it was: every repetition sees the same cache
            layer.trim(width)

    out = {"forward": _low_ms(step, iters)}
    mask = mx.ones((len(prompts), 1, width, keys), dtype=mx.bool_)  # the batch cache's padding mask
    out.update(_parts(shapes, len(prompts), width, keys, mask, iters))
    return out


def prefill_floor(model, shapes: Shapes, length: int, iters: int) -> dict[str, float]:
    """One request's prefill forward of ``length`` tokens (the causal mask) and its parts."""
    import mlx.core as mx

    from scheduler.execution import library

    tokens = mx.array([[(7 + 31 * i) % 500 + 7 for i in range(length)]])

    def forward():
        cache = library.make_request_cache(model)
        mx.eval(model(tokens, cache=cache))

    out = {"forward": _low_ms(forward, iters)}
    out.update(_parts(shapes, 1, length, length, "causal", iters))
    return out


def _table(title: str, figures: dict[str, float]) -> str:
    forward = figures["forward"]
    lines = [f"{title}", "| part | ms | share of the forward |", "|---|---|---|"]
    for name, ms in figures.items():
        if name != "ns per exp":
            lines.append(f"| {name} | {ms:.2f} | {100 * ms / forward:.0f}% |")
    lines.append(f"\n{figures['ns per exp']:.1f} ns per exp")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.op_floor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="text-medium", choices=["text", "text-medium"])
    ap.add_argument("--model-dir", type=Path, help="a local mlx-lm model directory instead of --model "
                                                   "(e.g. `mlxsched make-model trained DIR`)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lo", type=int, default=16)
    ap.add_argument("--hi", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--widths", type=int, nargs="+", default=[1],
                    help="positions per row in the decode step (k + 1 for a verify forward of k drafts)")
    ap.add_argument("--prefill-len", type=int, default=300)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)

    import mlx_lm

    from scheduler.fixtures.tiny_models import build_model

    from .blas import describe, detect_blas
    from .workloads import mixed

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_model(args.model, Path(tmp) / args.model)
        model, _ = mlx_lm.load(str(model_dir))
        shapes = Shapes.of(model_dir)
    prompts = mixed(args.batch, args.lo, args.hi, args.new_tokens).prompt_lists
    print(f"# {args.model_dir or args.model}, {describe(detect_blas())}")
    for width in args.widths:
        print(_table(f"\ndecode step of width {width}, batch {args.batch}, prompts {args.lo}..{args.hi}, "
                     f"{args.new_tokens // 2} tokens in",
                     decode_floor(model, shapes, prompts, args.new_tokens, args.iters, width)))
    print(_table(f"\nprefill forward, one request of {args.prefill_len} tokens",
                 prefill_floor(model, shapes, args.prefill_len, args.iters)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

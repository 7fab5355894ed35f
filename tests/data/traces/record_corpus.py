"""Records the committed replay corpus (tests/data/traces/*.jsonl.gz) with tiny models built from the fixtures.

Run once, with the code whose decisions the corpus pins: `python tests/data/traces/record_corpus.py` (from the
repository root, with it on PYTHONPATH). The traces
are then replayed by tests/core/test_replay_corpus_committed.py, so a refactor that changes a decision (or stops
reading an old trace) fails there. Re-record only on a deliberate change of decisions or of the trace schema.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
KV_BUDGET = int(os.environ.get("KV_BUDGET", 1_100_000))  # tight enough for the 8 requests to force preemption


def _prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [lo, hi] + [int(rng.integers(lo, hi + 1)) for _ in range(n - 2)]
    return [[int(t) for t in rng.integers(7, vocab, size=length)] for length in lengths]


def _run(engine, arrivals) -> None:
    """Step the engine, adding each (tick, add_request kwargs) at its tick, until it drains."""
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_pending():
        while pending and pending[0][0] <= engine.tick:
            engine.add_request(**pending.pop(0)[1])
        engine.step()
    engine.close()


def _gzip(src: Path, name: str) -> None:
    """Compress the trace into the corpus; the header's trace_path (a temporary directory) is written as the
    bare file name, so no machine's path lands in the repository."""
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    header = json.loads(lines[0])
    header["config"]["trace_path"] = src.name
    lines[0] = json.dumps(header) + "\n"
    with gzip.GzipFile(HERE / f"{name}.jsonl.gz", "wb", mtime=0) as out:
        out.write("".join(lines).encode("utf-8"))


def record(work: Path) -> None:
    import mlx_lm
    import mlx_vlm
    from PIL import Image

    from scheduler import Engine, EngineConfig, SamplingParams
    from scheduler.fixtures.tiny_models import build_model

    text_dir = build_model("text", work / "text")
    model, tokenizer = mlx_lm.load(str(text_dir))

    def greedy(n):
        return SamplingParams(max_tokens=n)

    # text: staggered arrivals, chunked prefill, mixed sampling, an abort
    path = work / "text.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=32, max_seqs=4, prefill_chunk=8,
                                                   trace_path=str(path)))
    for i, p in enumerate(_prompts(8, 1, 60, seed=1)):
        engine.add_request(prompt_tokens=p, request_id=f"t{i}",
                           sampling=SamplingParams(max_tokens=5 + i % 3, temperature=0.0 if i % 2 else 0.8, seed=i))
        engine.step()
        if i == 5:
            engine.abort("t2")
    while engine.has_pending():
        engine.step()
    engine.close()
    _gzip(path, "text")

    # drafting with prompt lookup on a repetitive workload
    path = work / "drafting.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=16,
                                                   draft_tokens=3, drafter="prompt-lookup", trace_path=str(path)))
    # a prompt followed by its own greedy continuation, then the prompt again: the continuation repeats
    # what the history holds, so lookup drafts get accepted
    seeds = _prompts(3, 8, 14, seed=2)
    solos = [[r.token for r in mlx_lm.stream_generate(model, tokenizer, p, max_tokens=16)] for p in seeds]
    _run(engine, [(i, {"prompt_tokens": p + s + p, "sampling": greedy(16), "request_id": f"d{i}"})
                  for i, (p, s) in enumerate(zip(seeds, solos))])
    _gzip(path, "drafting")

    # drafting with the target as its own draft model: every draft is accepted (several tokens per row per tick,
    # a stop inside the accepted run)
    path = work / "drafting_self.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=16,
                                                   draft_tokens=3, drafter="draft-model", trace_path=str(path)),
                    draft_model=model)
    _run(engine, [(i, {"prompt_tokens": p, "sampling": greedy(10 + i), "request_id": f"s{i}"})
                  for i, p in enumerate(_prompts(3, 5, 30, seed=6))])
    _gzip(path, "drafting_self")

    # preemption under a KV budget
    path = work / "preemption.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=8, prefill_chunk=16,
                                                   kv_memory_bytes=KV_BUDGET, kv_headroom_tokens=4,
                                                   trace_path=str(path)))
    _run(engine, [(i // 3, {"prompt_tokens": p, "sampling": greedy(40), "request_id": f"k{i}"})
                  for i, p in enumerate(_prompts(8, 8, 100, seed=3))])
    _gzip(path, "preemption")

    # prefix hits: a shared prefix, second wave after the first stored it
    path = work / "prefix.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=48, max_seqs=4, prefill_chunk=16,
                                                   prefix_cache_bytes=8 << 20, prefix_block_size=8,
                                                   trace_path=str(path)))
    shared = _prompts(1, 40, 40, seed=4)[0]
    tails = _prompts(6, 2, 12, seed=5)
    _run(engine, [((0 if i < 2 else 12 + i), {"prompt_tokens": shared + t, "sampling": greedy(4),
                                              "request_id": f"p{i}"}) for i, t in enumerate(tails)])
    _gzip(path, "prefix")

    # VLM: requests with images (two sizes, one repeated for a vision-cache hit) and text-only ones
    vlm_dir = build_model("vlm", work / "vlm")
    vmodel, processor = mlx_vlm.load(str(vlm_dir))
    from mlx_vlm.prompt_utils import apply_chat_template

    def templated(text, n_images):
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}] if n_images else text
        return apply_chat_template(processor, vmodel.config, [{"role": "user", "content": content}],
                                   num_images=n_images)

    def image(w, h, seed):
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    path = work / "vlm.jsonl"
    engine = Engine(vmodel, processor, EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=32,
                                                    trace_path=str(path)))
    arrivals = [
        (0, {"prompt": templated("What does the cat see?", 1), "images": [image(56, 56, 1)], "request_id": "v0"}),
        (0, {"prompt": templated("Hi.", 0), "request_id": "v1"}),
        (1, {"prompt": templated("Look.", 1), "images": [image(84, 56, 2)], "request_id": "v2"}),
        (2, {"prompt": templated("Again?", 1), "images": [image(56, 56, 1)], "request_id": "v3"}),
        (3, {"prompt": templated("The old man reads many books.", 0), "request_id": "v4"}),
    ]
    _run(engine, [(t, {**kw, "sampling": greedy(6)}) for t, kw in arrivals])
    _gzip(path, "vlm")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["MLXSCHED_CHECK_INVARIANTS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        record(Path(tmp))
    for p in sorted(HERE.glob("*.jsonl.gz")):
        print(p.name, p.stat().st_size)

"""The reference as a peer: vllm-mlx's `MLLMBatchGenerator` (PyPI `vllm-mlx==0.4.1`) on the same workloads.

vllm-mlx is a bench-only dependency, installed without its own dependency tree so that it runs on *our* mlx,
mlx-lm and mlx-vlm versions:

    pip install --no-deps vllm-mlx==0.4.1

Text workloads are token ids, so each request gets its `input_ids` set before `insert`: the generator's
`_preprocess_request` returns early for a text-only request that already has ids (its documented fast path for
pre-tokenized requests), and `is_text_only=True` sends it down its chunked text prefill rather than the VLM
forward. Sampling is greedy (`temperature=0`: `make_sampler` returns argmax) and `stop_tokens` is empty, so it
produces exactly `new_tokens` tokens per request like the other two sides.

Image requests go through the generator's own path: a prompt string (our chat template applied), each image
file as a `data:image/png;base64,...` URI (it accepts only URLs and data URIs), `mlx_vlm.utils.prepare_inputs`
with the processor, then one VLM forward per request.
"""

from __future__ import annotations

import gc
from typing import Any, Sequence

from .compare import RunStats, _Clock
from .workloads import Workload

PEER_NAME = "vllm-mlx MLLMBatchGenerator"


def available() -> str | None:
    """None when the reference can be imported, else why not (the exact install line)."""
    try:
        import vllm_mlx.mllm_batch_generator  # noqa: F401
    except Exception as e:  # any import failure: missing package or an incompatible dependency
        return (f"vllm-mlx is not importable ({type(e).__name__}: {e}); "
                "install it with `pip install --no-deps vllm-mlx==0.4.1`")
    return None


def quiet_reference_logs() -> None:
    """It logs every request's sampling settings at INFO; keep that out of the timed loop's stderr."""
    import logging

    logging.getLogger("vllm_mlx").setLevel(logging.WARNING)


def _generator(model: Any, processor: Any, n: int, completion_batch_size: int | None,
               prefill_step_size: int) -> Any:
    from vllm_mlx.mllm_batch_generator import MLLMBatchGenerator

    quiet_reference_logs()
    return MLLMBatchGenerator(
        model, processor, stop_tokens=set(),
        completion_batch_size=completion_batch_size or max(32, n),
        prefill_step_size=prefill_step_size,
    )


def _drive(gen: Any, requests: list, n: int, new_tokens: int) -> RunStats:
    gc.collect()
    clock = _Clock(n, new_tokens)
    uids = gen.insert(requests)
    index = {u: i for i, u in enumerate(uids)}
    remaining = n
    while remaining:
        responses = gen.next()
        for r in responses:
            if r.finish_reason == "error":
                remaining -= 1  # counted as short in the stats
                continue
            clock.record(index[r.uid], (r.token,))
            if r.finish_reason is not None:
                remaining -= 1
        clock.end_step()
    return clock.stats("vllm-mlx")


def run_reference(model: Any, tokenizer: Any, workload: Workload, completion_batch_size: int | None = None,
                  prefill_step_size: int = 1024) -> RunStats:
    """One timed run of a token-id workload through a fresh `MLLMBatchGenerator` (greedy, no stop tokens).

    completion_batch_size defaults to max(32, n) as for BatchGenerator, so all requests are admitted in the
    first step; prefill_step_size is the generator's own default (1024).
    """
    import mlx.core as mx
    from vllm_mlx.mllm_batch_generator import MLLMBatchRequest

    prompts = workload.prompt_lists
    gen = _generator(model, tokenizer, len(prompts), completion_batch_size, prefill_step_size)
    try:
        requests = []
        for i, p in enumerate(prompts):
            sampled = workload.sampled(i)
            req = MLLMBatchRequest(uid=0, request_id=f"r{i}", prompt="", max_tokens=workload.new_tokens,
                                   temperature=workload.temperature if sampled else 0.0,
                                   top_p=workload.top_p if sampled else 1.0)
            req.input_ids = mx.array(p)[None, :]
            req.is_text_only = True
            requests.append(req)
        return _drive(gen, requests, len(prompts), workload.new_tokens)
    finally:
        gen.close()


def _data_uri(path: str) -> str:
    import base64

    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode("ascii")


def run_reference_media(model: Any, processor: Any, prompts: Sequence[str], image_paths: Sequence[list[str] | None],
                        new_tokens: int) -> RunStats:
    """One timed run of string prompts (chat template applied), some with image files, through the reference."""
    from vllm_mlx.mllm_batch_generator import MLLMBatchRequest

    gen = _generator(model, processor, len(prompts), None, 1024)
    try:
        # vllm-mlx takes only http(s) URLs and data: URIs (a local path is dropped with a warning)
        requests = [MLLMBatchRequest(uid=0, request_id=f"r{i}", prompt=p,
                                     images=[_data_uri(path) for path in imgs] if imgs else None,
                                     max_tokens=new_tokens, temperature=0.0, top_p=1.0)
                    for i, (p, imgs) in enumerate(zip(prompts, image_paths))]
        return _drive(gen, requests, len(prompts), new_tokens)
    finally:
        gen.close()

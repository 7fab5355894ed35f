"""The reference's own consumers on our generator: vllm-mlx 0.4.1's `MLLMScheduler` (sync `step()` loop and its
async streaming loop) and its `BatchedEngine`, with only the module `vllm_mlx.mllm_batch_generator` replaced by
`scheduler.compat.generator`, the way a vllm-mlx user switches.

The substitution: vllm-mlx's scheduler does `from .mllm_batch_generator import MLLMBatchGenerator, ...` at import
(and `install_chunked_prefill_mllm` / `install_mtp_mllm` the same way inside `_ensure_batch_generator`), so putting
our module in `sys.modules["vllm_mlx.mllm_batch_generator"]` before a fresh import of `vllm_mlx.mllm_scheduler`
makes the unchanged reference code build and drive our generator; `BatchedEngine` imports the scheduler module
lazily and so gets the same one. The fixture restores sys.modules afterwards. Nothing in the library is patched.
The reference package is a test dependency (installed with --no-deps, .ci/install-reference), so these tests run
in CI rather than skip.

Every output is compared with mlx-lm / mlx-vlm run on the request alone (greedy), and for the VLM with our Engine.
"""

import asyncio
import importlib
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors
from PIL import Image

import scheduler.compat.generator as compat_generator
from scheduler.compat import MLLMBatchGenerator

from ..helpers import solo_tokens

REFERENCE_MODULES = ("vllm_mlx.mllm_batch_generator", "vllm_mlx.mllm_scheduler")


@pytest.fixture
def reference():
    """vllm-mlx's `mllm_scheduler` module, freshly imported over our generator module."""
    import vllm_mlx

    saved = {name: sys.modules.get(name) for name in REFERENCE_MODULES}
    saved_attrs = {name: getattr(vllm_mlx, name.rsplit(".", 1)[1], None) for name in REFERENCE_MODULES}
    sys.modules["vllm_mlx.mllm_batch_generator"] = compat_generator
    sys.modules.pop("vllm_mlx.mllm_scheduler", None)
    try:
        module = importlib.import_module("vllm_mlx.mllm_scheduler")
        assert module.MLLMBatchGenerator is MLLMBatchGenerator
        yield module
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
            attr = name.rsplit(".", 1)[1]  # the import also bound the package attribute: put it back
            if saved_attrs[name] is None:
                vars(vllm_mlx).pop(attr, None)
            else:
                setattr(vllm_mlx, attr, saved_attrs[name])


def _run_sync(sched, max_steps=2000):
    """Drive the reference scheduler's own step() loop; finished RequestOutputs and every output, by id."""
    finished, seen = {}, {}
    steps = 0
    while sched.has_requests():
        for out in sched.step().outputs:
            assert out.request_id not in finished, "an output after the final one"
            seen.setdefault(out.request_id, []).append(out)
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < max_steps
    return finished, seen


def _assert_no_leak(sched):
    engine = sched.batch_generator.engine
    assert not engine.has_pending()
    assert not engine.executor.live_request_ids()


def _solo_text(model, tokenizer, prompt: str, n: int) -> list[int]:
    return solo_tokens(model, tokenizer, tokenizer.encode(prompt), n)


TEXT_PROMPTS = ["hello there friend", "what is this thing that walks", "the cat sat on a mat and looked around",
                "why", "tell me how the river runs to the sea in the morning"]


def test_reference_scheduler_text_single_concurrent_abort(reference, text_model):
    model, tokenizer = text_model
    cfg = reference.MLLMSchedulerConfig(max_num_seqs=8, prefill_step_size=16)
    sched = reference.MLLMScheduler(model, tokenizer, cfg)
    # single request first
    rid = sched.add_request(TEXT_PROMPTS[0], max_tokens=8, temperature=0.0)
    finished, _ = _run_sync(sched)
    assert finished[rid].output_token_ids == _solo_text(model, tokenizer, TEXT_PROMPTS[0], 8)
    assert finished[rid].finish_reason == "length"
    # concurrent requests, one aborted mid-decode through the reference's abort_request
    ids = [sched.add_request(p, max_tokens=10, temperature=0.0) for p in TEXT_PROMPTS]
    doomed = ids[2]
    finished, seen = {}, {}
    steps = 0
    while sched.has_requests():
        for out in sched.step().outputs:
            seen.setdefault(out.request_id, []).append(out)
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 3:
            assert sched.abort_request(doomed)
        assert steps < 500
    assert doomed not in finished and 0 < len(seen[doomed]) < 10
    for rid, prompt in zip(ids, TEXT_PROMPTS):
        if rid != doomed:
            assert finished[rid].output_token_ids == _solo_text(model, tokenizer, prompt, 10)
            assert finished[rid].output_text == tokenizer.decode(finished[rid].output_token_ids)
    stats = sched.get_stats()
    assert stats["batch_generator"]["generation_tokens"] >= 8 + 4 * 10
    assert stats["mtp"]["enabled"] is False  # get_stats() keeps its mtp section (hasattr get_mtp_stats)
    _assert_no_leak(sched)


def test_reference_async_streaming_and_disconnect_abort(reference, text_model):
    model, tokenizer = text_model

    async def main():
        sched = reference.MLLMScheduler(model, tokenizer, reference.MLLMSchedulerConfig(prefill_step_size=16))
        await sched.start()
        try:
            async def stream(prompt, n, stop_after=None):
                rid = await sched.add_request_async(prompt, max_tokens=n, temperature=0.0)
                tokens, text = [], ""
                async for out in sched.stream_outputs(rid):
                    tokens += out.new_token_ids
                    text += out.new_text
                    if stop_after is not None and len(tokens) >= stop_after:
                        break  # a client disconnect: stream_outputs' finally aborts the request
                return rid, tokens, text

            results = await asyncio.gather(stream(TEXT_PROMPTS[1], 12), stream(TEXT_PROMPTS[3], 12),
                                           stream(TEXT_PROMPTS[4], 40, stop_after=3))
            for _ in range(200):  # the loop drains the deferred removal at its next step
                if not sched.batch_generator.engine.has_pending():
                    break
                await asyncio.sleep(0.01)
            _assert_no_leak(sched)  # the disconnected request was aborted and its caches freed
            return results, sched
        finally:
            await sched.stop()

    results, sched = asyncio.run(main())
    (_, t1, text1), (_, t2, _), (_, t3, _) = results
    assert t1 == _solo_text(model, tokenizer, TEXT_PROMPTS[1], 12)
    assert text1 == tokenizer.decode(t1)
    assert t2 == _solo_text(model, tokenizer, TEXT_PROMPTS[3], 12)
    assert t3 == _solo_text(model, tokenizer, TEXT_PROMPTS[4], 3)[: len(t3)] and len(t3) == 3
    assert sched.batch_generator is None  # stop() closed our generator


def test_reference_scheduler_images_and_text_mixed(reference, vlm_model_dir, tmp_path):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.request import SamplingParams

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    rng = np.random.default_rng(3)
    paths = []
    for i, shape in enumerate([(140, 112, 3), (112, 112, 3)]):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)
        paths.append(str(path))
    templated = apply_chat_template(processor, model.config, "Describe it.", num_images=1)
    text_only = apply_chat_template(processor, model.config, "Tell me a story.", num_images=0)
    # (prompt as the client sends it, images, the prompt mlx-vlm is run with alone)
    specs = [
        ("What's in this image?", [paths[0]], apply_chat_template(processor, model.config, "What's in this image?",
                                                                   num_images=1)),  # no placeholder: inserted
        (templated, [paths[1]], templated),
        (text_only, None, text_only),
        (templated, [paths[0]], templated),  # same image again: a vision-cache hit
    ]
    sched = reference.MLLMScheduler(model, processor, reference.MLLMSchedulerConfig(prefill_step_size=64))
    ids = [sched.add_request(p, images=imgs, max_tokens=8, temperature=0.0) for p, imgs, _ in specs]
    finished, _ = _run_sync(sched)
    engine = Engine(model, processor, EngineConfig())
    ours = engine.generate([solo for _, _, solo in specs], SamplingParams(max_tokens=8),
                           images=[imgs for _, imgs, _ in specs])
    for rid, (_, imgs, solo_prompt), mine in zip(ids, specs, ours):
        last = None
        for last in mlx_vlm.stream_generate(model, processor, solo_prompt, image=imgs, max_tokens=8, temperature=0.0):
            pass
        assert finished[rid].output_token_ids == list(last.token_ids) == mine.token_ids
    stats = sched.get_stats()
    assert stats["vision_embedding_cache"]["hits"] >= 1
    assert stats["batch_generator"]["num_images_processed"] == 3
    _assert_no_leak(sched)


def test_reference_scheduler_prefix_cache_clear(reference, text_model):
    model, tokenizer = text_model
    prompt = " ".join(TEXT_PROMPTS)  # long enough for several prefix blocks
    sched = reference.MLLMScheduler(model, tokenizer, reference.MLLMSchedulerConfig())
    expected = _solo_text(model, tokenizer, prompt, 6)
    outputs = []
    for _ in range(2):
        rid = sched.add_request(prompt, max_tokens=6, temperature=0.0)
        outputs.append(_run_sync(sched)[0][rid].output_token_ids)
    cache_stats = sched.get_stats()["memory_aware_cache"]
    assert cache_stats["hits"] == 1 and cache_stats["entry_count"] >= 1
    # what BatchedEngine.clear_prefix_cache() calls (MLLMScheduler.clear_runtime_caches reads a `vision_cache`
    # attribute it never sets in 0.4.1, so it raises on the reference's own generator too)
    sched.batch_generator.prefix_cache.clear()
    rid = sched.add_request(prompt, max_tokens=6, temperature=0.0)
    outputs.append(_run_sync(sched)[0][rid].output_token_ids)
    cache_stats = sched.get_stats()["memory_aware_cache"]
    assert cache_stats["hits"] == 1 and cache_stats["misses"] == 2  # the third lookup missed: the cache was empty
    assert outputs == [expected] * 3
    with pytest.raises(NotImplementedError, match="SSD"):
        sched.batch_generator.prefix_cache.set_ssd_tier(object())


def test_reference_scheduler_installs_native_mtp_and_reports_stats(reference, native_mtp_model):
    model, tokenizer = native_mtp_model
    cfg = reference.MLLMSchedulerConfig(enable_mtp=True, mtp_num_draft_tokens=2, prefill_step_size=32)
    sched = reference.MLLMScheduler(model, tokenizer, cfg)
    ids = [sched.add_request(p, max_tokens=16, temperature=0.0) for p in TEXT_PROMPTS[:3]]
    finished, _ = _run_sync(sched)
    assert sched.batch_generator._mtp_requested == 2  # the reference's scheduler installed MTP on our generator
    for rid, prompt in zip(ids, TEXT_PROMPTS):
        # greedy output unchanged by drafting (mlx-lm on the same weights, its plain call)
        assert finished[rid].output_token_ids == _solo_text(model, tokenizer, prompt, 16)
    mtp = sched.get_stats()["mtp"]
    assert set(mtp) == {"enabled", "requested_draft_tokens", "effective_draft_tokens", "mode", "attempted",
                        "accepted", "rejected", "errors", "acceptance_rate", "bypass_counts",
                        "bypass_counts_semantics"}
    assert set(mtp["bypass_counts"]) == {"prefill", "no_active_batch", "concurrent_batch", "logits_processors"}
    assert mtp["enabled"] and mtp["requested_draft_tokens"] == 2 and mtp["effective_draft_tokens"] == 1
    assert mtp["attempted"] > 0 and mtp["accepted"] > 0 and mtp["errors"] == 0
    assert mtp["accepted"] + mtp["rejected"] == mtp["attempted"]
    # the scheduler's own per-request counters (from MLLMBatchResponse.from_draft / mtp_attempted_count)
    assert sum(o.mtp_accepted for o in finished.values()) == mtp["accepted"]
    assert sum(o.mtp_drafts for o in finished.values()) == mtp["attempted"]
    assert mtp["bypass_counts"]["prefill"] >= 1


def test_reference_processor_history_and_penalties_see_generated_tokens_only(reference, text_model):
    model, tokenizer = text_model
    prompt = TEXT_PROMPTS[2]
    pen_prompt = TEXT_PROMPTS[1]  # its prompt tokens recur in mlx-lm's window: the two semantics differ on it
    pen_ids = tokenizer.encode(pen_prompt)
    seen = []

    def recorder(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    sched = reference.MLLMScheduler(model, tokenizer, reference.MLLMSchedulerConfig())
    rec = sched.add_request(prompt, max_tokens=6, temperature=0.0, logits_processors=[recorder])
    pen = sched.add_request(pen_prompt, max_tokens=12, temperature=0.0, repetition_penalty=1.8)
    finished, _ = _run_sync(sched)
    out = finished[rec].output_token_ids
    assert out == _solo_text(model, tokenizer, prompt, 6)  # an identity processor changes nothing
    assert seen == [out[:i] for i in range(6)]  # generated tokens only; the first call gets an empty array

    # the reference's penalty: mlx-lm's processor (context 20) over the generated tokens only
    (penalty,) = make_logits_processors(repetition_penalty=1.8)
    generated_only = [lambda tokens, logits: penalty(tokens[len(pen_ids):], logits)]
    expected = [r.token for r in stream_generate(model, tokenizer, pen_ids, max_tokens=12,
                                                 logits_processors=generated_only)]
    assert finished[pen].output_token_ids == expected
    assert expected != [r.token for r in stream_generate(model, tokenizer, pen_ids, max_tokens=12,
                                                         logits_processors=[penalty])]  # the two semantics differ


def test_reference_batched_engine_generate_stream_and_cache_calls(reference, vlm_model_dir, tmp_path):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template
    from vllm_mlx.engine.batched import BatchedEngine

    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (140, 112, 3), dtype=np.uint8)).save(image)

    async def main():
        engine = BatchedEngine(str(vlm_model_dir))
        assert engine.is_mllm
        await engine.start()
        try:
            out = await engine.generate("What's in this image?", max_tokens=6, temperature=0.0, images=[str(image)])
            streamed = [o async for o in engine.stream_generate("What's in this image?", max_tokens=6,
                                                                temperature=0.0, images=[str(image)])]
            engine.clear_prefix_cache()
            stats = engine.get_stats()
            cache_stats = engine.get_cache_stats()
            with pytest.raises(NotImplementedError, match="persisting"):
                engine.save_cache_to_disk(str(tmp_path / "cache"))
            return out, streamed, stats, cache_stats, engine._mllm_scheduler.batch_generator
        finally:
            await engine.stop()

    out, streamed, stats, cache_stats, generator = asyncio.run(main())
    assert isinstance(generator, MLLMBatchGenerator)
    model, processor = mlx_vlm.load(str(vlm_model_dir))
    prompt = apply_chat_template(processor, model.config, "What's in this image?", num_images=1)
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=[str(image)], max_tokens=6, temperature=0.0):
        pass
    assert out.tokens == list(last.token_ids) and out.finish_reason == "length"
    assert streamed[-1].text == out.text  # both cleaned by the reference (clean_output_text)
    assert "".join(o.new_text for o in streamed).strip() == out.text.strip()
    assert streamed[-1].finished and streamed[-1].completion_tokens == 6
    assert stats["mtp"]["enabled"] is False and "batch_generator" in stats
    assert cache_stats["vision_embedding_cache"]["hits"] >= 1  # the second request reused the image's features


def test_default_sampler_picks_tokens_of_requests_without_their_own_sampling(text_model):
    from scheduler.compat import MLLMBatchRequest

    model, tokenizer = text_model
    calls = []

    def argmax_sampler(logprobs):
        calls.append(logprobs.shape)
        return mx.argmax(logprobs, axis=-1)

    gen = MLLMBatchGenerator(model, tokenizer, sampler=argmax_sampler)
    prompt = tokenizer.encode(TEXT_PROMPTS[0])
    gen.insert([MLLMBatchRequest(uid=-1, request_id="default", prompt="", input_ids=prompt, max_tokens=5,
                                 temperature=None),
                MLLMBatchRequest(uid=-1, request_id="own", prompt="", input_ids=prompt, max_tokens=5,
                                 temperature=0.0)])
    tokens = {}
    while gen.has_pending():
        for r in gen.next():
            tokens.setdefault(r.request_id, []).append(r.token)
    expected = solo_tokens(model, tokenizer, prompt, 5)
    assert tokens == {"default": expected, "own": expected}
    assert calls == [(1, 512)] * 5  # once per token of the request without its own sampling, never for "own"
    with pytest.raises(TypeError, match="sampler"):
        MLLMBatchGenerator(model, tokenizer, sampler="argmax")

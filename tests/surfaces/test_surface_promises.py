"""Promises of the public surfaces (issue 24 items 11-13): `generate()` text leaves out the eos marker as
mlx-lm's does; `prefill_progress()` never passes 100% after a preemption; a compat configuration the engine
refuses raises at the call instead of being turned into request errors and raised later by `next()`."""

import mlx_lm
import pytest

from scheduler import Engine, EngineConfig, FinishReason, SamplingParams
from scheduler.compat import MLLMBatchGenerator, MLLMBatchRequest, install_mtp_mllm
from scheduler.families import UnsupportedFeature

from ..helpers import mixed_prompts

MAX_TOKENS = 20


def test_generate_text_leaves_out_the_eos_marker_like_mlx_lm(text_eos_model):
    model, tokenizer = text_eos_model
    prompts = mixed_prompts(16, 1, 300, seed=1)
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=512, max_seqs=16, prefill_chunk=128))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    stopped = [o for o in outputs if o.finish_reason is FinishReason.STOP]
    assert stopped and len(stopped) < len(outputs)  # both endings are compared
    for prompt, out in zip(prompts, outputs):
        assert out.text == mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    eos = set(tokenizer.eos_token_ids)
    for out in stopped:  # the token is still in token_ids; only the text leaves it out
        assert out.token_ids[-1] in eos and tokenizer.decode([out.token_ids[-1]]) not in out.text


def test_prefill_progress_stays_within_the_prompt_after_a_preemption(text_model):
    """Three 40-token prompts join at once (their rows and, while merging, their own caches: 2 x 3 x (40 + 256)
    tokens' worth); decoding, the rows outgrow the budget, the newest is preempted while decoding and later
    recomputes its prompt and its outputs so far (num_computed_tokens then counts past the prompt)."""
    from caches.kv import STEP

    model, tokenizer = text_model
    per_token = 2 * 512  # the tiny text model: 2 layers x 512 bytes
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=256, max_seqs=4, prefill_chunk=64,
                                                   kv_memory_bytes=2 * 3 * (40 + STEP) * per_token + 4096,
                                                   kv_headroom_tokens=0))
    ids = [engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=300))
           for p in mixed_prompts(3, 40, 40, seed=8)]
    preempted_decoding, past_prompt = set(), 0
    while engine.has_pending():
        before = {rid: engine.state_of(rid).value for rid in ids}
        engine.step()
        for rid in ids:
            request = engine.scheduler.requests.get(rid)
            if request is None:
                continue
            if request.state.value == "queued" and before[rid] == "decoding":  # preempted while decoding
                preempted_decoding.add(rid)
            computed, total = engine.prefill_progress(rid)
            assert 0 <= computed <= total == request.prompt_len
            past_prompt += request.num_computed_tokens > request.prompt_len  # once this read over 100%
    assert preempted_decoding and past_prompt


def test_a_compat_configuration_the_engine_refuses_raises_at_install(sliding_model, tmp_path):
    from scheduler.execution.mtp import load_mtp_head
    from scheduler.fixtures.tiny_models import build_model

    model, tokenizer = sliding_model  # its sliding-window caches cannot be rolled back in place: no MTP drafting
    gen = MLLMBatchGenerator(model, tokenizer)
    with pytest.raises(UnsupportedFeature, match="MTP drafting"):
        install_mtp_mllm(gen, load_mtp_head(build_model("text-mtp", tmp_path)), num_draft_tokens=2)
    # the generator is as it was: requests run, without drafting
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id="a", prompt="", input_ids=[9, 10, 11], max_tokens=4,
                                        temperature=0.0)])
    finished = {}
    while gen.has_pending():
        for r in gen.next():
            if r.finish_reason is not None:
                finished[r.uid] = r.finish_reason
    assert finished == {uids[0]: "length"}


def test_a_configuration_error_raises_from_insert_and_next_not_as_request_errors(sliding_model):
    model, tokenizer = sliding_model
    gen = MLLMBatchGenerator(model, tokenizer, max_kv_size=64)  # refused by this model (its own cache layout)
    request = MLLMBatchRequest(uid=-1, request_id="a", prompt="", input_ids=[9, 10, 11], max_tokens=4)
    with pytest.raises(ValueError, match="max_kv_size"):
        gen.insert([request])
    assert not gen.has_pending()  # nothing was queued as an "error" response for the caller's mistake
    with pytest.raises(ValueError, match="max_kv_size"):
        gen.next()

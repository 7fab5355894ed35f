"""The vllm-mlx MLLMBatchGenerator surface, driven the way its users drive it, on the tiny real models."""

import threading

import numpy as np
import pytest
from PIL import Image

from scheduler.compat import (
    MLLMBatchGenerator,
    MLLMBatchRequest,
    MLLMBatchStats,
    install_chunked_prefill_mllm,
)
from scheduler.events import MemorySink

from ..helpers import mixed_prompts, solo_tokens

PROMPTS = mixed_prompts(6, 5, 150, seed=12)


def _collect(responses, tokens, finish):
    for r in responses:
        assert r.uid not in finish, "a response after the final one"
        if r.finish_reason in (None, "stop", "length"):
            tokens.setdefault(r.uid, []).append(r.token)
        if r.finish_reason is not None:
            finish[r.uid] = r.finish_reason


def _run(gen, tokens=None, finish=None, max_ticks=10_000):
    """Loop next() until has_pending() is false; tokens and finish reasons per uid."""
    tokens, finish = ({} if tokens is None else tokens), ({} if finish is None else finish)
    ticks = 0
    while gen.has_pending():
        _collect(gen.next(), tokens, finish)
        ticks += 1
        assert ticks < max_ticks
    return tokens, finish


def test_text_model_requests_match_solo_and_remove_abort_work(text_model):
    model, tokenizer = text_model
    sink = MemorySink()
    gen = MLLMBatchGenerator(model, tokenizer, prefill_step_size=32, completion_batch_size=8, event_sinks=[sink])
    reqs = [MLLMBatchRequest(uid=-1, request_id=f"r{i}", prompt="", input_ids=p, max_tokens=10, temperature=0.0)
            for i, p in enumerate(PROMPTS)]
    reqs.append(MLLMBatchRequest(uid=-1, request_id="text", prompt=tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, tokenize=False),
        max_tokens=10, temperature=0.0))
    reqs.append(MLLMBatchRequest(uid=-1, request_id="long", prompt="", input_ids=[9] * 400, max_tokens=10,
                                 temperature=0.0))
    uids = gen.insert(reqs)
    assert uids == list(range(len(reqs)))
    tokens, finish = {}, {}
    _collect(gen.next(), tokens, finish)
    gen.abort_prefill("long")  # still prefilling: 400 tokens at 32 per chunk
    removed = uids[2]
    first = gen.next()
    _collect(first, tokens, finish)
    gen.remove([removed])
    tokens, finish = _run(gen, tokens, finish)
    assert finish[uids[-1]] == "abort"
    assert removed not in finish  # removed: no response at all after remove()
    for i, uid in enumerate(uids[:6]):
        if uid == removed:
            assert len(tokens.get(uid, [])) <= 2  # what it produced before remove(), nothing after
            continue
        assert tokens[uid] == solo_tokens(model, tokenizer, PROMPTS[i], 10)
        assert finish[uid] == "length"
    text_ids = tokenizer.encode(reqs[6].prompt)
    assert tokens[uids[6]] == solo_tokens(model, tokenizer, text_ids, 10)
    assert first  # responses carry full log-softmax vectors
    assert all(r.logprobs.shape == (512,) for r in first if r.finish_reason is None)

    # stats: each token once, each second once, checked against the event log
    stats = gen.stats()
    d = stats.to_dict()
    assert set(d) == {"prompt_tokens", "prompt_time", "prompt_tps", "generation_tokens", "generation_time",
                      "generation_tps", "vision_encoding_time", "num_images_processed", "peak_memory"}
    outcomes = sink.of_kind("outcome")
    assert d["generation_tokens"] == sum(len(o["sampled"]) for o in outcomes)
    assert d["prompt_tokens"] == sum(end - start for p in sink.of_kind("plan") for _, start, end, _ in p["prefill"])
    assert d["generation_time"] == pytest.approx(sum(o["measure"]["decode_s"] for o in outcomes))
    assert d["prompt_time"] == pytest.approx(sum(o["measure"]["prefill_s"] for o in outcomes))
    assert d["prompt_tps"] == pytest.approx(d["prompt_tokens"] / d["prompt_time"])
    assert isinstance(stats, MLLMBatchStats) and d["peak_memory"] > 0
    gen.close()


def test_prefix_cache_stats_have_the_reference_keys_and_true_values(text_model):
    model, tokenizer = text_model
    sink = MemorySink()
    gen = MLLMBatchGenerator(model, tokenizer, prefix_cache_config={"max_memory_mb": 32}, event_sinks=[sink])
    assert gen.get_prefix_cache_stats()["hits"] == 0
    long_prompts = [p for p in PROMPTS if len(p) > 20][:3]
    for wave in range(2):
        gen.insert([MLLMBatchRequest(uid=-1, request_id=f"w{wave}-{i}", prompt="", input_ids=p,
                                     max_tokens=4, temperature=0.0) for i, p in enumerate(long_prompts)])
        _run(gen)
    stats = gen.get_prefix_cache_stats()
    assert set(stats) == {"hits", "misses", "hit_rate", "evictions", "tokens_saved", "current_memory_mb",
                          "max_memory_mb", "memory_utilization", "entry_count"}
    hits = sink.of_kind("prefix_hit")
    assert stats["hits"] == len(hits) == 3 and stats["misses"] == len(sink.of_kind("prefix_miss")) == 3
    assert stats["tokens_saved"] == sum(h["length"] for h in hits)
    assert stats["max_memory_mb"] == 32


def test_schedule_removal_from_another_thread_loses_nothing(text_model):
    model, tokenizer = text_model
    gen = MLLMBatchGenerator(model, tokenizer, completion_batch_size=8)
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id=f"t{i}", prompt="", input_ids=PROMPTS[i % 6],
                                        max_tokens=200, temperature=0.0) for i in range(12)])
    doomed = uids[::2]
    started = threading.Event()

    def remover():
        started.wait()
        for uid in doomed:
            gen.schedule_removal([uid])

    thread = threading.Thread(target=remover)
    thread.start()
    seen_after = {}
    ticks = 0
    while gen.has_pending():
        for r in gen.next():
            seen_after.setdefault(r.uid, []).append(r.finish_reason)
        ticks += 1
        if ticks == 2:
            started.set()
        if ticks == 40:
            thread.join()
    # every scheduled removal took effect: those requests never reached a final response
    for uid in doomed:
        assert None in seen_after.get(uid, [None]) and not any(seen_after.get(uid, [])[1:][-1:]) or \
            all(f is None for f in seen_after.get(uid, []))
    for uid in uids[1::2]:
        assert seen_after[uid][-1] == "length"
    assert not gen.engine.executor.live_request_ids()


def test_install_chunked_prefill_is_configuration(text_model):
    model, tokenizer = text_model
    sink = MemorySink()
    gen = MLLMBatchGenerator(model, tokenizer, completion_batch_size=4, event_sinks=[sink])
    install_chunked_prefill_mllm(gen, budget=16)
    gen.insert([MLLMBatchRequest(uid=-1, request_id="a", prompt="", input_ids=PROMPTS[1], max_tokens=4, temperature=0.0),
                MLLMBatchRequest(uid=-1, request_id="b", prompt="", input_ids=[7] * 90, max_tokens=4, temperature=0.0)])
    tokens, _ = _run(gen)
    plans = sink.of_kind("plan")
    assert all(sum(end - start for _, start, end, _ in p["prefill"]) <= 16 for p in plans)
    assert any(p["prefill"] and p["decode"] for p in plans)
    with pytest.raises(RuntimeError, match="before the first insert"):
        install_chunked_prefill_mllm(gen, budget=32)
    assert tokens[0] == solo_tokens(model, tokenizer, PROMPTS[1], 4)


def test_bad_requests_get_error_responses(text_model):
    model, tokenizer = text_model
    gen = MLLMBatchGenerator(model, tokenizer)
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id="ok", prompt="", input_ids=PROMPTS[0], max_tokens=3, temperature=0.0),
                       MLLMBatchRequest(uid=-1, request_id="empty", prompt=""),
                       MLLMBatchRequest(uid=-1, request_id="img", prompt="hi", images=["x.png"])])
    tokens, finish = _run(gen)
    assert finish == {uids[0]: "length", uids[1]: "error", uids[2]: "error"}


def test_vlm_requests_with_and_without_images_match_solo(vlm_model_dir):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    sink = MemorySink()
    gen = MLLMBatchGenerator(model, processor, event_sinks=[sink])
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (140, 112, 3), dtype=np.uint8))
    with_image = apply_chat_template(processor, model.config, "What is this?", num_images=1)
    text_only = apply_chat_template(processor, model.config, "Tell me a story.", num_images=0)
    specs = [(with_image, [image]), (text_only, None), (with_image, [image])]
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id=f"v{i}", prompt=p, images=imgs, max_tokens=8, temperature=0.0)
                       for i, (p, imgs) in enumerate(specs)])
    # an image that does not decode: refused by the engine (UnreadableMedia), an "error" response here
    bad, = gen.insert([MLLMBatchRequest(uid=-1, request_id="bad", prompt=with_image, images=[b"\x89PNG not really"],
                                        max_tokens=8, temperature=0.0)])
    tokens, finish = _run(gen)
    assert finish[bad] == "error" and not tokens.get(bad)
    for uid, (prompt, imgs) in zip(uids, specs):
        last = None
        for last in mlx_vlm.stream_generate(model, processor, prompt, image=imgs, max_tokens=8, temperature=0.0):
            pass
        assert tokens[uid] == list(last.token_ids)
    vstats = gen.get_vision_cache_stats()
    assert vstats["hits"] == len([e for e in sink.events if e["event"] == "vision_hit"]) == 1
    assert vstats["misses"] == 1
    assert gen.stats().num_images_processed == 2


def test_image_prompt_without_placeholders_gets_them_and_says_so(vlm_model_dir):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    gen = MLLMBatchGenerator(model, processor)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (112, 140, 3), dtype=np.uint8))
    text_only = apply_chat_template(processor, model.config, "What's in this image?", num_images=0)
    uids = gen.insert([
        MLLMBatchRequest(uid=-1, request_id="raw", prompt="What's in this image?", images=[image], max_tokens=5,
                         temperature=0.0),
        # templated, but with no placeholder: where the image goes cannot be known, so it is refused alone
        MLLMBatchRequest(uid=-1, request_id="templated", prompt=text_only, images=[image], max_tokens=5,
                         temperature=0.0),
    ])
    first, tokens, finish = {}, {}, {}
    while gen.has_pending():
        for r in gen.next():
            first.setdefault(r.uid, r)
            _collect([r], tokens, finish)
    assert finish == {uids[0]: "length", uids[1]: "error"}
    assert first[uids[0]].placeholders_inserted == 1
    last = None
    prompt = apply_chat_template(processor, model.config, "What's in this image?", num_images=1)
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=[image], max_tokens=5, temperature=0.0):
        pass
    assert tokens[uids[0]] == list(last.token_ids)


def test_video_requests_pass_through_to_the_engine(vlm_model_dir):
    import mlx_vlm

    from scheduler import Engine, EngineConfig, SamplingParams

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    frames = [np.random.default_rng(i).integers(0, 256, (56, 56, 3), dtype=np.uint8) for i in range(4)]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what now?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    gen = MLLMBatchGenerator(model, processor)
    (uid,) = gen.insert([MLLMBatchRequest(uid=-1, request_id="v", prompt=prompt, videos=[frames], max_tokens=6,
                                          temperature=0.0)])
    tokens, finish = _run(gen)
    (mine,) = Engine(model, processor, EngineConfig()).generate([prompt], SamplingParams(max_tokens=6),
                                                                 videos=[[frames]])
    assert finish[uid] == "length" and tokens[uid] == mine.token_ids


def test_install_mtp_with_a_draft_model_and_a_native_module(text_model, native_mtp_model):
    from scheduler.compat import MLLMBatch, PrefillAbortedError, install_mtp_mllm

    model, tokenizer = text_model
    prompts = [p for p in PROMPTS if len(p) > 20][:3]
    expected = [solo_tokens(model, tokenizer, p, 12) for p in prompts]

    # an external draft model (newer reference releases): the target itself here, so every draft is accepted
    gen = MLLMBatchGenerator(model, tokenizer)
    assert gen.prefix_cache is None and gen.language_model is model and not gen.is_vlm
    install_mtp_mllm(gen, None, num_draft_tokens=1, draft_model=model, draft_block_size=4)
    # with a draft model, only requests that ask for it draft (mllm_draft, default False as in the reference)
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id=f"d{i}", prompt="", input_ids=p, max_tokens=12,
                                        temperature=0.0, mllm_draft=True) for i, p in enumerate(prompts)]
                      + [MLLMBatchRequest(uid=-1, request_id="optout", prompt="", input_ids=prompts[0],
                                          max_tokens=12, temperature=0.0)])
    tokens, seen_batch = {}, None
    while gen.has_pending():
        for r in gen.next():
            tokens.setdefault(r.uid, []).append(r.token)
            if r.request_id == "optout":
                assert not r.from_draft and not r.mtp_attempted  # did not ask: never drafted
        seen_batch = seen_batch or gen.active_batch
    assert [tokens[u] for u in uids] == expected + [expected[0]]
    stats = gen.get_mtp_stats()
    assert stats["effective_draft_tokens"] == 3 and stats["attempted"] > 0  # a block of 4: 3 drafts + its own
    assert stats["bypass_counts"]["logits_processors"] > 0  # steps where the request without mllm_draft decoded
    assert stats["accepted"] == stats["attempted"]  # drafting with the target itself: all accepted
    assert isinstance(seen_batch, MLLMBatch) and len(seen_batch) >= 1
    assert PrefillAbortedError("x").request_id == "x"

    # a native MTP module, installed directly; a request with a logits processor decodes without drafting
    native, tok = native_mtp_model
    gen = MLLMBatchGenerator(native, tok)
    install_mtp_mllm(gen, gen.language_model, num_draft_tokens=4)
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id="n", prompt="", input_ids=prompts[1], max_tokens=12,
                                        temperature=0.0),
                       MLLMBatchRequest(uid=-1, request_id="p", prompt="", input_ids=prompts[2], max_tokens=12,
                                        temperature=0.0, logits_processors=[lambda t, x: x])])
    tokens, _ = _run(gen)
    assert [tokens[u] for u in uids] == [solo_tokens(native, tok, p, 12) for p in prompts[1:]]
    stats = gen.get_mtp_stats()
    assert stats["effective_draft_tokens"] == 1 and stats["requested_draft_tokens"] == 4
    assert stats["accepted"] > 0 and stats["bypass_counts"]["logits_processors"] > 0
    class AssistantDrafter:  # the shape of an mlx-vlm MTP assistant drafter (newer reference releases)
        def reset(self, model):
            pass

        def set_shared_kv(self, *args, **kwargs):
            pass

    with pytest.raises(TypeError, match="assistant drafter"):
        install_mtp_mllm(MLLMBatchGenerator(model, tokenizer), model, draft_model=AssistantDrafter())
    with pytest.raises(TypeError, match="needs a drafter"):
        install_mtp_mllm(MLLMBatchGenerator(model, tokenizer), model)  # a plain model has no MTP module

"""The context limit (vLLM's rule): prompt + outputs never exceed `max_model_len`. Generation is capped there
and ends with LENGTH; `add_request` refuses only a prompt that leaves no room for one output token; drafts are
planned inside the limit; `max_kv_size` bounds what is attended, not how long a request runs; replay applies
the same rule from the recorded limit."""

import pytest
from mlx_lm.models.cache import RotatingKVCache

from scheduler import Engine, EngineConfig, FinishReason, SamplingParams
from scheduler.events import MemorySink
from scheduler.planner import SchedulerView, plan_tick
from scheduler.policy import make_policy
from scheduler.tools.replay import load_trace, replay
from scheduler.request import InvalidRequest, Request

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

LIMIT = 64
PROMPTS = mixed_prompts(5, 20, 62, seed=41)  # 20..62 tokens: each leaves a different room under LIMIT


def test_the_issue_case_stops_at_max_model_len(text_model):
    """55-token prompt, max_tokens=100, max_model_len=64: 9 tokens (55 + 9 = 64), LENGTH, and they are
    mlx-lm's first 9 tokens for that prompt alone."""
    model, tokenizer = text_model
    prompt = mixed_prompts(2, 55, 55, seed=3)[0]
    engine = Engine(model, tokenizer, EngineConfig(max_model_len=LIMIT, check_invariants=True))
    out = engine.generate([prompt], SamplingParams(max_tokens=100))[0]
    assert out.finish_reason is FinishReason.LENGTH
    assert len(prompt) + len(out.token_ids) == LIMIT
    assert out.token_ids == solo_tokens(model, tokenizer, prompt, LIMIT - len(prompt))


def test_every_row_of_a_batch_is_capped_at_its_own_room(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_model_len=LIMIT, max_batched_tokens=48, prefill_chunk=16,
                                                   max_seqs=4, check_invariants=True))
    # staggered arrivals, chunked prefill, fewer slots than requests; one request whose max_tokens is tighter
    max_tokens = [100, 100, 5, 100, 100]
    run = drive(engine, [(i * 2, {"prompt_tokens": p, "sampling": greedy(m)})
                         for i, (p, m) in enumerate(zip(PROMPTS, max_tokens))])
    outputs = list(run.tokens.values())
    want_lengths = [min(m, LIMIT - len(p)) for p, m in zip(PROMPTS, max_tokens)]
    assert [len(o) for o in outputs] == want_lengths
    assert set(run.finish.values()) == {FinishReason.LENGTH}
    assert outputs == [solo_tokens(model, tokenizer, p, n) for p, n in zip(PROMPTS, want_lengths)]


def test_a_prompt_is_refused_only_when_no_output_token_fits(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(max_model_len=LIMIT))
    for n in (LIMIT, LIMIT + 1):
        with pytest.raises(InvalidRequest, match="max_model_len is 64") as err:
            engine.add_request(prompt_tokens=[9] * n)
        assert err.value.field == "prompt"
    assert not engine.has_pending()
    out = engine.generate([[9] * (LIMIT - 1)], SamplingParams(max_tokens=50))[0]
    assert len(out.token_ids) == 1 and out.finish_reason is FinishReason.LENGTH


def test_the_default_limit_is_the_models_max_position_embeddings(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig())
    assert engine.max_model_len == model.args.max_position_embeddings
    assert engine.scheduler.max_model_len == engine.max_model_len


def test_output_limit_is_max_tokens_capped_by_the_context():
    r = Request("r", [5] * 10, SamplingParams(max_tokens=8))
    assert r.output_limit == 8  # no limit known: max_tokens alone
    r.max_model_len = 15
    assert r.output_limit == 5
    r.max_model_len = 100
    assert r.output_limit == 8


def test_the_planner_never_drafts_past_the_context_limit():
    """A decoding row with 3 outputs of room left drafts at most 2 (the verify forward emits k + 1)."""
    config = EngineConfig(draft_tokens=8, max_batched_tokens=64, max_seqs=4)
    rows = []
    for room in (1, 2, 3, 9, 20):
        r = Request(f"room{room}", [5] * 10, SamplingParams(max_tokens=100), max_model_len=10 + 2 + room)
        r.num_computed_tokens = r.prefill_len
        r.output_tokens = [7, 7]  # 2 outputs so far: room tokens may still come
        rows.append(r)
    plan = plan_tick(SchedulerView(tick=0, waiting=(), prefilling=(), decoding=tuple(rows)), config,
                     make_policy("fcfs"))
    assert dict(plan.draft) == {"room2": 1, "room3": 2, "room9": 8, "room20": 8}


def test_drafting_stops_exactly_at_the_limit(text_model):
    """The target drafting for itself accepts every draft: without the cap, a tick would emit k + 1 tokens
    across the limit. Every planned draft fits, and the output is plain greedy decoding's."""
    model, tokenizer = text_model
    log = MemorySink()
    room = [7, 3, 12]
    prompts = mixed_prompts(3, 60, 60, seed=8)
    limit = 60
    prompts = [p[: limit - n] for p, n in zip(prompts, room)]
    engine = Engine(model, tokenizer, EngineConfig(max_model_len=limit, draft_tokens=4, drafter="draft-model",
                                                   check_invariants=True), draft_model=model, event_sinks=[log])
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(100)}) for p in prompts])
    outputs = list(run.tokens.values())
    assert [len(o) for o in outputs] == room
    assert set(run.finish.values()) == {FinishReason.LENGTH}
    assert outputs == [solo_tokens(model, tokenizer, p, n) for p, n in zip(prompts, room)]
    assert engine.draft_stats()["drafted"] > 0
    produced = dict.fromkeys(run.tokens, 0)
    prompt_len = {rid: len(p) for rid, p in zip(run.tokens, prompts)}
    outcomes = {e["tick"]: e for e in log.of_kind("outcome")}
    for plan in log.of_kind("plan"):
        for rid, k in plan["draft"]:
            # the verify forward covers positions up to prompt + produced + k - 1: inside the limit
            assert prompt_len[rid] + produced[rid] + k + 1 <= limit, (plan["tick"], rid, k)
        outcome = outcomes.get(plan["tick"], {})
        for rid in outcome.get("sampled", {}):
            produced[rid] += 1 + len(outcome.get("accepted_drafts", {}).get(rid, []))


def test_max_kv_size_bounds_attention_not_length(text_model):
    """With rotating caches the model attends to the last max_kv_size tokens, but positions still count
    from the start: the request still ends at max_model_len, like mlx-lm alone with the same caches."""
    model, tokenizer = text_model
    prompt = mixed_prompts(2, 30, 30, seed=5)[0]
    engine = Engine(model, tokenizer, EngineConfig(max_kv_size=16, max_model_len=40, check_invariants=True))
    out = engine.generate([prompt], SamplingParams(max_tokens=100))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 10
    assert out.token_ids == solo_tokens(model, tokenizer, prompt, 10,
                                        prompt_cache=[RotatingKVCache(max_size=16, keep=0) for _ in model.layers])


def test_a_capped_run_replays_with_the_recorded_limit(text_model):
    """Replay takes the limit from engine_start (the resolved one: config or model), so it ends requests at
    the same ticks."""
    model, tokenizer = text_model
    log = MemorySink()
    engine = Engine(model, tokenizer, EngineConfig(max_model_len=LIMIT, max_batched_tokens=48, prefill_chunk=16),
                    event_sinks=[log])
    drive(engine, [(i, {"prompt_tokens": p, "sampling": greedy(100)}) for i, p in enumerate(PROMPTS)])
    events = list(log.events)
    assert events[0]["event"] == "engine_start" and events[0]["max_model_len"] == LIMIT
    report = replay(load_trace(events))
    assert report.identical, report.format()
    # and the limit matters to replay: without it the replayed plans keep decoding past the recorded end
    header = dict(events[0], max_model_len=None, config=dict(events[0]["config"], max_model_len=None))
    assert not replay(load_trace([header] + events[1:])).identical


def test_a_vision_language_request_is_capped_too(vlm_model_dir):
    """The image's placeholder tokens are part of the prompt: prompt + outputs still fit max_model_len, and
    the tokens are mlx-vlm's own for that request alone."""
    import mlx_vlm
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor = mlx_vlm.load(str(vlm_model_dir))
    image = Image.fromarray(np.random.default_rng(6).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    prompt = apply_chat_template(processor, model.config, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], num_images=1)
    probe = Engine(model, processor, EngineConfig())
    prompt_len = len(probe.vlm.prepare(prompt, [image]).input_ids)
    engine = Engine(model, processor, EngineConfig(max_model_len=prompt_len + 3, check_invariants=True))
    out = engine.generate([prompt], SamplingParams(max_tokens=50), images=[[image]])[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 3
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, image=[image], max_tokens=3, temperature=0.0):
        pass
    assert out.token_ids == list(last.token_ids)

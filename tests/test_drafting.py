"""Speculative decoding in the engine: drafting as a declared state, exact greedy output with every drafter
and draft length, reproducible seeded sampling, aborts in the drafting state, replayable traces."""

import pytest

from scheduler import Engine, EngineConfig, FinishReason, RequestState, SamplingParams
from scheduler.tools.replay import load_trace, replay

from scheduler.events import MemorySink

from .helpers import drive, greedy, mixed_prompts, solo_tokens

PROMPTS = mixed_prompts(16, 1, 200, seed=31)
PHRASE = [101, 57, 302, 44, 250, 17, 99, 480, 33, 71]
REPETITIVE = [PHRASE * 6 + PHRASE[:3], (PHRASE[::-1] * 5)[:45]]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(text_model):
    model, tokenizer = text_model
    return [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS + REPETITIVE]


@pytest.fixture(scope="module")
def mtp_head(tmp_path_factory):
    """The tiny text model's own MTP head (text-mtp builds the same model weights as text, plus the head)."""
    from scheduler.execution.mtp import load_mtp_head
    from scheduler.fixtures.tiny_models import build_model

    return load_mtp_head(build_model("text-mtp", tmp_path_factory.mktemp("mtp")))


@pytest.fixture(scope="module")
def other_draft_model(tmp_path_factory):
    from mlx_lm import load

    from scheduler.fixtures.tiny_models import build_model

    model, _ = load(str(build_model("text", tmp_path_factory.mktemp("draft"), seed=1)))
    return model


def _run(model, tokenizer, config, draft_model=None, prompts=None, mtp_head=None):
    log = MemorySink()
    engine = Engine(model, tokenizer, config, draft_model=draft_model, mtp_head=mtp_head, event_sinks=[log])
    prompts = PROMPTS + REPETITIVE if prompts is None else prompts
    run = drive(engine, [(i // 3, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS)}) for i, p in enumerate(prompts)])
    return engine, log, list(run.tokens.values())


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model-self", "draft-model-other", "mtp"])
def test_greedy_output_is_unchanged_by_drafting(text_model, other_draft_model, mtp_head, reference, drafter, k):
    model, tokenizer = text_model
    kind = {"prompt-lookup": "prompt-lookup", "mtp": "mtp"}.get(drafter, "draft-model")
    draft_model = {"draft-model-self": model, "draft-model-other": other_draft_model}.get(drafter)
    config = EngineConfig(max_batched_tokens=160, max_seqs=16, prefill_chunk=32, draft_tokens=k, drafter=kind,
                          check_invariants=True)
    engine, log, outputs = _run(model, tokenizer, config, draft_model, mtp_head=mtp_head if kind == "mtp" else None)
    mismatches = [i for i, (got, want) in enumerate(zip(outputs, reference)) if got != want]
    assert not mismatches
    stats = engine.draft_stats()
    assert stats["verify_forwards"] > 0 and stats["drafted"] > 0
    if drafter == "draft-model-self":  # the target drafting for itself: everything is accepted
        assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_row_forward"] > 1.0
    moves = [(e["from"], e["to"]) for e in log.of_kind("transition")]
    assert ("decoding", "drafting") in moves
    assert all(sum(k for _, k in p["draft"]) + len(p["decode"]) + sum(e - s for _, s, e, _ in p["prefill"])
               <= config.max_batched_tokens for p in log.of_kind("plan"))


def test_prompt_lookup_accepts_on_a_repetitive_workload(text_model):
    model, tokenizer = text_model
    config = EngineConfig(draft_tokens=4, max_batched_tokens=128, check_invariants=True)
    engine = Engine(model, tokenizer, config)
    # a prompt whose continuation the tiny model itself keeps repeating: lookup has something to find
    outs = engine.generate([PHRASE * 6], greedy(64))
    stats = engine.draft_stats()
    assert outs[0].token_ids == solo_tokens(model, tokenizer, PHRASE * 6, 64)
    assert stats["drafted"] > 0 and stats["accepted"] >= 0


def test_seeded_sampling_with_drafting_is_reproducible_alone_and_in_a_batch(text_model):
    model, tokenizer = text_model
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    config = EngineConfig(draft_tokens=3, max_batched_tokens=128)

    def run(with_crowd):
        engine = Engine(model, tokenizer, config)
        arrivals = [(0, {"prompt_tokens": REPETITIVE[0], "sampling": sampled, "request_id": "x"})]
        if with_crowd:
            arrivals += [(0, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=10, temperature=1.0, seed=i)})
                         for i, p in enumerate(PROMPTS[:5])]
        return drive(engine, arrivals).tokens["x"]

    alone = run(False)
    assert alone == run(False) == run(True)
    assert len(alone) == 24


def test_abort_in_the_drafting_state_frees_everything(text_model):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=2, drafter="draft-model", check_invariants=True),
                    draft_model=model)
    drafter = engine.executor.drafter
    victim = engine.add_request(prompt_tokens=REPETITIVE[0], sampling=greedy(200))
    other = engine.add_request(prompt_tokens=PROMPTS[3], sampling=greedy(MAX_TOKENS))
    while engine.state_of(victim) is not RequestState.DRAFTING:
        engine.step()
    assert drafter.cached_tokens(victim)  # the draft model holds KV for it
    engine.abort(victim)
    tokens = []
    while engine.has_pending():
        for out in engine.step():
            if out.request_id == other:
                tokens.extend(out.token_ids)
            elif out.request_id == victim:
                assert out.finish_reason is FinishReason.ABORT
    assert engine.state_of(victim) is RequestState.ABORTED
    assert engine.executor.cache_bytes() == 0 and not engine.executor.live_request_ids()
    with pytest.raises(KeyError):
        drafter.cached_tokens(victim)
    assert drafter.cache_bytes() == 0 and drafter.stats()["live_requests"] == 0


def test_a_drafting_trace_replays(text_model, tmp_path):
    model, tokenizer = text_model
    path = tmp_path / "draft.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=3, max_batched_tokens=64, prefill_chunk=16,
                                                   drafter="draft-model", trace_path=str(path)), draft_model=model)
    drive(engine, [(i, {"prompt_tokens": p, "sampling": greedy(12)}) for i, p in enumerate(PROMPTS[:6] + REPETITIVE)])
    engine.close()
    assert replay(load_trace(path)).identical


def test_drafting_is_refused_where_it_cannot_be_exact(sliding_model, text_model):
    model, tokenizer = sliding_model
    with pytest.raises(ValueError, match="draft_tokens"):
        Engine(model, tokenizer, EngineConfig(draft_tokens=2))
    model, tokenizer = text_model
    with pytest.raises(ValueError, match="draft_model"):
        Engine(model, tokenizer, EngineConfig(draft_tokens=2, drafter="draft-model"))


def test_mtp_head_round_trips_and_compat_install(text_model, mtp_head, tmp_path):
    import mlx.core as mx

    from scheduler.compat import MLLMBatchGenerator, MLLMBatchRequest, install_mtp_mllm
    from scheduler.execution.mtp import load_mtp_head, save_mtp_head

    save_mtp_head(mtp_head, tmp_path)
    again = load_mtp_head(tmp_path)
    h, e = mx.ones((2, 128)), mx.ones((2, 128)) * 0.5
    assert mx.array_equal(again(h, e), mtp_head(h, e))
    assert load_mtp_head(tmp_path / "nothing-here") is None

    model, tokenizer = text_model
    gen = MLLMBatchGenerator(model, tokenizer)
    install_mtp_mllm(gen, mtp_head, num_draft_tokens=2)
    uids = gen.insert([MLLMBatchRequest(uid=-1, request_id=f"m{i}", prompt="", input_ids=p, max_tokens=12,
                                        temperature=0.0) for i, p in enumerate(PROMPTS[:4])])
    tokens, attempted = {u: [] for u in uids}, 0
    while gen.has_pending():
        for r in gen.next():
            tokens[r.uid].append(r.token)
            attempted += r.mtp_attempted
    assert [tokens[u] for u in uids] == [solo_tokens(model, tokenizer, p, 12) for p in PROMPTS[:4]]
    assert attempted > 0
    with pytest.raises(TypeError, match="MTP head"):
        install_mtp_mllm(MLLMBatchGenerator(model, tokenizer), model, 1)

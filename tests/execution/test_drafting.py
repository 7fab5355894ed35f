"""Speculative decoding in the engine: drafting as a declared state, exact greedy output with every drafter
and draft length, reproducible seeded sampling, aborts in the drafting state, replayable traces."""

import dataclasses

import pytest
from mlx_lm import stream_generate

from scheduler import Engine, EngineConfig, FinishReason, RequestState, SamplingParams
from scheduler.tools.replay import load_trace, replay

from scheduler.execution.drafters import DraftModelDrafter
from scheduler.events import MemorySink

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

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
    # draft_gate=False: this checks the verify path itself, so every draft is verified; on this untrained model
    # the gate would (rightly) decline most of them (tests/execution/test_draft_gate.py checks it gated)
    config = EngineConfig(max_batched_tokens=160, max_seqs=16, prefill_chunk=32, draft_tokens=k, drafter=kind,
                          check_invariants=True, draft_gate=False)
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


def _lookup_hits(prompt: list[int], output: list[int]) -> int:
    """Output positions whose next token a 1..3-gram lookup of the history so far predicts (an oracle computed
    from mlx-lm's own output, independent of the engine)."""
    from scheduler.execution.drafters import NgramIndex

    hits = 0
    for i in range(len(output) - 1):
        proposal, _ = NgramIndex(1, 3, prompt + output[: i + 1]).lookup(1)
        hits += proposal[:1] == [output[i + 1]]
    return hits


def test_prompt_lookup_accepts_on_a_repetitive_workload(text_model):
    model, tokenizer = text_model
    # a prompt whose continuation repeats what came before (by the oracle): lookup has something to find
    solos = {i: solo_tokens(model, tokenizer, p, 48) for i, p in enumerate(PROMPTS + REPETITIVE)}
    i = max(solos, key=lambda i: _lookup_hits((PROMPTS + REPETITIVE)[i], solos[i]))
    prompt = (PROMPTS + REPETITIVE)[i]
    assert _lookup_hits(prompt, solos[i]) >= 3
    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=4, max_batched_tokens=128))
    outs = engine.generate([prompt], greedy(48))
    stats = engine.draft_stats()
    assert outs[0].token_ids == solos[i]
    assert stats["drafted"] > 0 and stats["accepted"] > 0  # the oracle's hits are drafts the target accepts


def test_seeded_sampling_with_drafting_is_reproducible_alone_and_in_a_batch(text_model):
    """A seeded sampled row draws the same tokens with drafting as without (`kernels.speculative.sampled_accept`),
    alone or next to other requests whose histories its lookup reads."""
    model, tokenizer = text_model
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    config = EngineConfig(draft_tokens=3, max_batched_tokens=128)

    def run(with_crowd, draft_tokens=3):
        engine = Engine(model, tokenizer, dataclasses.replace(config, draft_tokens=draft_tokens))
        arrivals = [(0, {"prompt_tokens": REPETITIVE[0], "sampling": sampled, "request_id": "x"})]
        if with_crowd:
            arrivals += [(0, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=10, temperature=1.0, seed=i)})
                         for i, p in enumerate(PROMPTS[:5])]
        return drive(engine, arrivals).tokens["x"]

    alone = run(False)
    assert alone == run(False) == run(True) == run(False, draft_tokens=0)
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
    model, tokenizer = sliding_model  # sliding windows: re-fed drafting needs k >= 2, and no MTP head
    with pytest.raises(ValueError, match="draft_tokens >= 2"):
        Engine(model, tokenizer, EngineConfig(draft_tokens=1))
    with pytest.raises(ValueError, match="MTP drafting"):
        Engine(model, tokenizer, EngineConfig(draft_tokens=2, drafter="mtp"), mtp_head=object())
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


class _PositionCountingRunner:
    """A TextRunner that counts the token positions every forward it runs really computes (batch x length)."""

    def __new__(cls, model):
        from scheduler.execution.runners import TextRunner

        class Counting(TextRunner):
            positions = 0

            def prefill(self, cache, request, encoded, start, end):
                Counting.positions += end - start
                super().prefill(cache, request, encoded, start, end)

            def prefill_many(self, chunks):
                Counting.positions += len(chunks) * max(n for *_, n in chunks)  # right pads are computed too
                return super().prefill_many(chunks)

            def decode(self, batch_cache, inputs, rope_deltas):
                Counting.positions += inputs.shape[0]
                return super().decode(batch_cache, inputs, rope_deltas)

            def verify(self, batch_cache, inputs, rope_deltas=None):
                Counting.positions += inputs.shape[0] * inputs.shape[1]
                return super().verify(batch_cache, inputs, rope_deltas)

        return Counting(model)


@pytest.mark.parametrize("budget", [40, 200])
def test_the_verify_forward_is_planned_as_computed(text_model, budget):
    """32 rows, one of which may draft k=4: the verify forward runs all 32 rows at width 5 (160 positions), so a
    plan may only grant that width when max_batched_tokens pays for it; no tick computes more than planned."""
    from scheduler.execution.executor import MLXExecutor

    model, tokenizer = text_model
    runner = _PositionCountingRunner(model)
    config = EngineConfig(max_batched_tokens=budget, max_seqs=32, prefill_chunk=32, draft_tokens=4)
    log = MemorySink()
    # the target drafting for itself: every row that may draft has a full-length draft every tick
    engine = Engine(model, tokenizer, config, executor=MLXExecutor(runner, drafter=DraftModelDrafter(model)),
                    event_sinks=[log])
    prompts = [p[:8] for p in mixed_prompts(31, 8, 12, seed=40)] + [REPETITIVE[0]]
    ids = [engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=MAX_TOKENS, logprobs=True))
           for p in prompts[:-1]] + [engine.add_request(prompt_tokens=prompts[-1], sampling=greedy(MAX_TOKENS))]
    tokens = {rid: [] for rid in ids}
    per_tick = []
    while engine.has_pending():
        before = type(runner).positions
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        per_tick.append(type(runner).positions - before)
    # a batched prefill's right pads are computed on top of the plan, reported per tick and bounded
    pads = {o["tick"]: o.get("padded_tokens", 0) for o in log.of_kind("outcome")}
    assert all(n <= budget + pads.get(tick, 0) for tick, n in enumerate(per_tick)), f"a tick computed {per_tick}"
    plans = log.of_kind("plan")
    planned = {p["tick"]: p["num_batched_tokens"] for p in plans}
    assert all(n <= planned.get(tick, 0) + pads.get(tick, 0) for tick, n in enumerate(per_tick)), \
        "a tick computed more than planned"
    drafted = [p for p in plans if p["draft"]]
    assert drafted and engine.draft_stats()["accepted"] > 0
    if budget == 40:  # 32 rows x (1 + 1) > 40: no width fits until rows have finished
        assert all(len(p["decode"]) * 2 <= 40 for p in drafted)
        assert any(len(p["decode"]) > 20 for p in plans)
    else:  # 32 rows x (1 + 4) <= 200: the drafting row gets k = 4 while all 32 run
        assert any(len(p["decode"]) == 32 and p["draft"] == [[ids[-1], 4]] for p in plans)
    assert tokens[ids[-1]] == solo_tokens(model, tokenizer, prompts[-1], MAX_TOKENS)


@pytest.fixture(scope="module")
def granite_model(tmp_path_factory):
    from mlx_lm import load

    from scheduler.fixtures.tiny_models import build_model

    return load(str(build_model("granite", tmp_path_factory.mktemp("granite"))))


def test_mtp_on_a_logit_scaling_model_keeps_its_logits(granite_model):
    """granite divides its head's logits by logits_scaling in its own __call__: with the MTP drafter every
    target forward goes through the hidden-state path, which must give the same logits (tokens and logprobs
    equal mlx-lm's, drafting or not)."""
    import mlx.core as mx

    from scheduler.execution.mtp import MTPHead

    model, tokenizer = granite_model
    mx.random.seed(0)
    head = MTPHead(model.args.hidden_size)  # untrained: what it drafts is verified, what matters is the target
    mx.eval(head.parameters())
    engine = Engine(model, tokenizer, EngineConfig(draft_tokens=2, drafter="mtp", max_batched_tokens=128),
                    mtp_head=head)
    prompts = PROMPTS[:4]
    with_logprobs = SamplingParams(max_tokens=MAX_TOKENS, logprobs=True)
    outs = engine.generate(prompts, [with_logprobs, with_logprobs, greedy(MAX_TOKENS), greedy(MAX_TOKENS)])
    for out, prompt in zip(outs, prompts):
        solo = list(stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS))
        assert out.token_ids == [r.token for r in solo]
        if out.logprobs:
            want = [r.logprobs[r.token].item() for r in solo]
            assert out.logprobs == pytest.approx(want, abs=1e-4)
    assert engine.draft_stats()["drafted"] > 0


def test_mtp_is_refused_for_a_model_whose_logits_are_not_the_hidden_state_seam(text_model, mtp_head):
    import mlx.core as mx

    from scheduler.execution.library import HiddenStateSeamError

    model, tokenizer = text_model

    class SoftCapped(type(model)):  # a family whose __call__ caps the logits in a way the library seam does not know
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return 2.0 * mx.tanh(super().__call__(inputs, cache, input_embeddings) / 2.0)

    capped = SoftCapped(model.args)
    capped.update(model.parameters())
    with pytest.raises(HiddenStateSeamError, match="output_head"):
        Engine(capped, tokenizer, EngineConfig(draft_tokens=2, drafter="mtp"), mtp_head=mtp_head)
    Engine(capped, tokenizer, EngineConfig(draft_tokens=2))  # other drafters go through the model's own call


@pytest.mark.parametrize("drafter", ["draft-model-self", "prompt-lookup"])
def test_eos_inside_accepted_drafts_stops_like_mlx_lm(text_eos_model, drafter):
    """On a model that emits eos: drafting output equals mlx-lm's, and when eos is one of a row's accepted
    drafts (the target drafting for itself accepts everything), the request stops there and nothing after it
    is emitted."""
    model, tokenizer = text_eos_model
    eos = set(tokenizer.eos_token_ids)
    config = EngineConfig(max_batched_tokens=160, max_seqs=16, prefill_chunk=32, draft_tokens=4,
                          drafter="draft-model" if drafter == "draft-model-self" else drafter)
    engine, log, outputs = _run(model, tokenizer, config, model if drafter == "draft-model-self" else None)
    reference = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS + REPETITIVE]
    assert outputs == reference
    stopped = [o for o in outputs if o[-1] in eos]
    assert stopped and all(not set(o[:-1]) & eos for o in outputs)
    if drafter == "draft-model-self":
        in_drafts = [rid for e in log.of_kind("outcome") for rid, toks in e["accepted_drafts"].items()
                     if set(toks) & eos]
        assert in_drafts, "no eos was an accepted draft"
        ends = {e["request_id"]: e["reason"] for e in log.of_kind("transition") if e["to"] == "finished"}
        assert all(ends[rid] == "stop" for rid in in_drafts)

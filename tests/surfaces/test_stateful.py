"""Stateful property test on the real tiny model (and on a hybrid one): random interleavings of add (varied
lengths, shared prefixes, greedy and seeded sampling, logits processors: one that changes nothing and one that
raises after a few tokens, prompt logprobs), abort in any state, and ticks, under KV-budget pressure, with the prefix cache (a
large budget, or one of about two entries so entries are evicted every few ticks), speculative decoding (prompt
lookup) and either tick mix. Invariants are checked every tick (EngineConfig.check_invariants: the plan's
budgets, and real KV bytes <= the plan's bound <= kv_memory_bytes at the tick's peak and after it); at the end
every request ended exactly once, a request fails only if its own processor raised, every unaborted greedy
request equals its solo mlx-lm output, every cache byte held for requests is returned, and the run's event
log replays decision for decision (tools/replay.py)."""

import json
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from caches import layers
from scheduler import Engine, EngineConfig, FinishReason, RequestState, SamplingParams
from scheduler.events import MemorySink, _jsonable
from scheduler.execution import library
from scheduler.tools.replay import load_trace, replay

from ..helpers import min_tokens_mask, solo_tokens

SHARED = [random.Random(1).randrange(7, 512) for _ in range(40)]
# references by (model, ...): the text and hybrid machines draw the same prompts, and their models differ
_SOLO: dict[tuple, list] = {}
SMALL_PREFIX_BUDGET = 150_000  # about two stored prompts of the tiny model: every few stores evict
# over all examples: the mix was exercised
SEEN = {"prefix_evictions": 0, "processor_failures": 0, "scored": 0, "min_tokens": 0}


def _keep(tokens, logits):
    return logits


def _raise_after(prompt_len: int, n: int):
    def processor(tokens, logits):
        if len(tokens) >= prompt_len + n:
            raise RuntimeError("processor failed on purpose")
        return logits

    return processor


def _scored(model, prompt):
    """Each prompt token's logprob (after the first) from one forward of the prompt alone."""
    import mlx.core as mx

    key = (id(model), "scored", tuple(prompt))
    if key not in _SOLO:
        logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        _SOLO[key] = [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    return _SOLO[key]


def _solo(model, tokenizer, prompt, n, min_tokens=0):
    """mlx-lm alone; with min_tokens, eos masked out of the first min_tokens tokens by a processor."""
    key = (id(model), tuple(prompt), n, min_tokens)
    if key not in _SOLO:
        vocab = model.args.vocab_size
        held = [min_tokens_mask(len(prompt), min_tokens, tokenizer.eos_token_ids, vocab)] if min_tokens else None
        _SOLO[key] = solo_tokens(model, tokenizer, prompt, n, logits_processors=held)
    return _SOLO[key]


def _assert_replays(log: MemorySink) -> None:
    """The run's event log, as its trace file would hold it, replays decision for decision."""
    report = replay(load_trace([json.loads(json.dumps(e, default=_jsonable)) for e in log.events]))
    assert report.identical, report.format()


def _engine_machine(model, tokenizer, kv_budgets, drafts):
    """The machine for one model: `kv_budgets` and `drafts` are what its caches allow (a hybrid cannot draft)."""
    checkpoints_only = not layers.capabilities(library.make_request_cache(model)).trimmable

    class EngineMachine(RuleBasedStateMachine):
        @initialize(kv_budget=st.sampled_from(kv_budgets),
                    prefix=st.sampled_from([0, SMALL_PREFIX_BUDGET, 8 << 20]),
                    chunk=st.sampled_from([5, 16, 64]), draft=st.sampled_from(drafts),
                    mix=st.sampled_from(["decode-first", "prefill-first"]))
        def start(self, kv_budget, prefix, chunk, draft, mix):
            self.log = MemorySink()
            self.engine = Engine(model, tokenizer, EngineConfig(
                max_batched_tokens=chunk + 8 + 6 * draft, max_seqs=6, prefill_chunk=chunk, kv_memory_bytes=kv_budget,
                kv_headroom_tokens=4, prefix_cache_bytes=prefix, draft_tokens=draft, mix=mix,
                check_invariants=True), event_sinks=[self.log])
            self.specs, self.tokens, self.ended, self.aborted = {}, {}, {}, set()
            self.raising, self.errors = {}, {}
            self.scored, self.prompt_logprobs = {}, {}  # prompt_logprobs asked; every output that carried them

        @rule(length=st.integers(1, 90), shared=st.booleans(), n=st.integers(1, 12),
              sampled=st.booleans(), seed=st.integers(0, 100),
              processor=st.sampled_from([None, None, "keep", "raise"]), scored=st.sampled_from([None, None, 0, 2]),
              held=st.sampled_from([0, 0, 3]))
        def add(self, length, shared, n, sampled, seed, processor, scored, held):
            rng = random.Random(seed)
            body = [rng.randrange(7, 512) for _ in range(length)]
            prompt = (SHARED + body) if shared else body
            processors = {None: (), "keep": (_keep,), "raise": (_raise_after(len(prompt), 2),)}[processor]
            sampling = SamplingParams(max_tokens=n, temperature=0.8 if sampled else 0.0, seed=seed,
                                      logits_processors=processors, prompt_logprobs=scored, min_tokens=min(held, n))
            rid = self.engine.add_request(prompt_tokens=prompt, sampling=sampling)
            self.scored[rid], self.prompt_logprobs[rid] = scored, []
            self.specs[rid] = (prompt, n, sampled, sampling.min_tokens)
            self.raising[rid] = processor == "raise" and n > 2  # it reaches its third token: the raise
            self.tokens[rid] = []

        @precondition(lambda self: bool(self.specs))
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(sorted(self.specs)))
            live = self.engine.abort(rid)
            if live:
                self.aborted.add(rid)
            else:
                assert rid in self.ended

        @rule(ticks=st.integers(1, 4))
        def tick(self, ticks):
            for _ in range(ticks):
                self._step()

        def _step(self):
            for out in self.engine.step():
                assert out.request_id not in self.ended, "output after the end"
                self.tokens[out.request_id].extend(out.token_ids)
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[out.request_id].append(out.prompt_logprobs)
                if out.finished:
                    self.ended[out.request_id] = out.finish_reason
                    self.errors[out.request_id] = out.error

        @invariant()
        def states_are_consistent(self):
            if not hasattr(self, "engine"):
                return
            for rid in self.ended:
                assert self.engine.state_of(rid) in (RequestState.FINISHED, RequestState.ABORTED)

        @invariant()
        def untrimmable_state_is_stored_as_exact_checkpoints(self):
            cache = getattr(self, "engine", None) and self.engine.scheduler.prefix_cache
            if cache and checkpoints_only:
                assert all(entry.whole_only for entry in cache._entries.values())

        def teardown(self):
            if not hasattr(self, "engine"):
                return
            while self.engine.has_pending():
                self._step()
            assert set(self.ended) == set(self.specs), "every request ended exactly once"
            for rid, (prompt, n, sampled, min_tokens) in self.specs.items():
                # prompt logprobs: once, with the first token (preempted and recomputed or not), the prompt's own
                delivered = self.prompt_logprobs[rid]
                if self.scored[rid] is None or not self.tokens[rid]:
                    assert delivered == [], rid
                else:
                    (values,) = delivered
                    assert values[0] is None and values[1:] == pytest.approx(_scored(model, prompt), abs=1e-4), rid
                    SEEN["scored"] += 1
                reason = self.ended[rid]
                if reason is FinishReason.ABORT:
                    assert rid in self.aborted
                    continue
                # a row that sampled a stop token within its first two tokens ended before its processor's raise
                stopped_first = reason is FinishReason.STOP and len(self.tokens[rid]) <= 2
                if self.raising[rid] and not stopped_first:  # its processor raised: it failed, alone, with that error
                    assert reason is FinishReason.ERROR and "processor failed on purpose" in self.errors[rid]
                    assert len(self.tokens[rid]) == 2
                    SEEN["processor_failures"] += 1
                    continue
                assert reason in (FinishReason.STOP, FinishReason.LENGTH), (rid, reason, self.errors[rid])
                if not sampled:
                    assert self.tokens[rid] == _solo(model, tokenizer, prompt, n, min_tokens), rid
                if reason is FinishReason.STOP:
                    assert len(self.tokens[rid]) > min_tokens, rid
                SEEN["min_tokens"] += bool(min_tokens)
            assert self.engine.executor.cache_bytes() == 0
            assert not self.engine.executor.live_request_ids()
            cache = self.engine.scheduler.prefix_cache
            if cache is not None:
                assert cache.bytes == sum(e.nbytes for e in cache._entries.values()) <= cache.max_bytes
                SEEN["prefix_evictions"] += cache.stats()["evictions"]
            _assert_replays(self.log)

    return EngineMachine


@pytest.fixture(scope="module")
def machine_class(text_model):
    return _engine_machine(*text_model, kv_budgets=[None, 1_500_000], drafts=[0, 0, 2])


@pytest.fixture(scope="module")
def hybrid_machine_class(tmp_path_factory):
    """qwen3_next: gated delta-net linear-attention state next to attention KV (and mixture-of-experts MLPs).
    The budget holds two rows of 80 tokens (the longest request fits alone), so the KV-budget examples
    preempt; derandomized, so the same examples (with preemptions and checkpoint hits) run every time."""
    from mlx_lm import load

    from scheduler.fixtures.families import build_family_model

    model, tokenizer = load(str(build_family_model("qwen3_next", tmp_path_factory.mktemp("qwen3_next"))))
    budget = library.kv_layout(model).batch_bytes([len(SHARED) + 40] * 2)
    return _engine_machine(model, tokenizer, kv_budgets=[None, budget], drafts=[0])


def test_random_interleavings_on_a_hybrid_model(hybrid_machine_class):
    hybrid_machine_class.TestCase.settings = settings(
        max_examples=6, stateful_step_count=25, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    hybrid_machine_class.TestCase().runTest()


@pytest.mark.slow
def test_random_interleavings_keep_every_guarantee(machine_class):
    settings_ = settings(max_examples=40, stateful_step_count=40, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    machine_class.TestCase.settings = settings_
    machine_class.TestCase().runTest()
    assert all(SEEN.values()), SEEN


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "gemma4"])
def vlm_machine_class(request, vlm_model_dir, tmp_path_factory):
    """The VLM machine on a generic-adapter family: Qwen2-VL (tiny_models), Qwen3-VL (deepstack inputs per
    prefill chunk; scheduler/fixtures/vlm_families.py) or Gemma 4 (an image prompt's first chunk in one forward
    through its image: `Request.first_chunk_reach`; tiny_models' `audio` build), under a KV budget that preempts
    image requests or none, with prompt-lookup drafting or not."""
    import mlx_vlm
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    from scheduler.fixtures.tiny_models import build_model
    from scheduler.fixtures.vlm_families import build_tiny_vlm
    from scheduler.models.prompt import MediaInputs

    if request.param == "qwen2_vl":
        model_dir = vlm_model_dir
    elif request.param == "gemma4":
        model_dir = build_model("audio", tmp_path_factory.mktemp("stateful-gemma4"))
    else:
        model_dir = build_tiny_vlm(request.param, tmp_path_factory.mktemp(f"stateful-{request.param}"))
    model, processor = mlx_vlm.load(str(model_dir))
    probe = Engine(model, processor)
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
              for i, (w, h) in enumerate([(56, 56), (84, 112), (112, 140)])]
    texts = ["Look.", "What is this thing here?", "Describe it in many words, please, carefully."]
    # the tight budget holds two rows of the longest prompt `add` can make: admitted rows always fit, and the
    # longest one outgrows it as soon as it decodes next to another row
    resolved = [probe.prompts.resolve(apply_chat_template(processor, model.config, text, num_images=len(imgs)),
                                      None, MediaInputs.of(imgs or None), None)
                for text in texts for imgs in ([], *([image] for image in images))]
    longest = max(len(r.token_ids) for r in resolved)
    tight_budget = probe.kv_layout.batch_bytes([longest] * 2)
    reach = max(r.first_chunk_reach for r in resolved)  # a tick must hold an image prompt's first chunk

    def solo(prompt, imgs, n):
        key = (request.param, prompt, tuple(id(i) for i in imgs), n)
        if key not in _SOLO:
            last = None
            for last in mlx_vlm.stream_generate(model, processor, prompt, image=list(imgs) or None,
                                                max_tokens=n, temperature=0.0):
                pass
            _SOLO[key] = list(last.token_ids)
        return _SOLO[key]

    class VLMMachine(RuleBasedStateMachine):
        preemptions = 0  # over all examples: the budget really preempted

        @initialize(chunk=st.sampled_from([7, 32]), vision_budget=st.sampled_from([1, 4]), prefix=st.booleans(),
                    tight=st.booleans(), draft=st.sampled_from([0, 2]))
        def start(self, chunk, vision_budget, prefix, tight, draft):
            # tight: room for two rows of the longest prompt, no admission headroom
            self.log = MemorySink()
            self.engine = Engine(model, processor, event_sinks=[self.log], config=EngineConfig(
                max_batched_tokens=max(chunk + 6 + 5 * draft, reach), max_seqs=5, prefill_chunk=chunk,
                vision_budget=vision_budget, prefix_cache_bytes=(8 << 20) if prefix else 0,
                kv_memory_bytes=tight_budget if tight else None, kv_headroom_tokens=0,
                draft_tokens=draft, check_invariants=True))
            self.specs, self.tokens, self.ended, self.aborted = {}, {}, {}, set()

        @rule(text=st.sampled_from(range(3)), image=st.sampled_from([None, 0, 1, 2]), n=st.integers(1, 24))
        def add(self, text, image, n):
            imgs = [] if image is None else [images[image]]
            prompt = apply_chat_template(processor, model.config, texts[text], num_images=len(imgs))
            rid = self.engine.add_request(prompt=prompt, images=imgs or None, sampling=SamplingParams(max_tokens=n))
            self.specs[rid] = (prompt, imgs, n)
            self.tokens[rid] = []

        @precondition(lambda self: bool(self.specs))
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(sorted(self.specs)))
            if self.engine.abort(rid):
                self.aborted.add(rid)

        @rule(ticks=st.integers(1, 3))
        def tick(self, ticks):
            for _ in range(ticks):
                for out in self.engine.step():
                    assert out.request_id not in self.ended
                    self.tokens[out.request_id].extend(out.token_ids)
                    if out.finished:
                        self.ended[out.request_id] = out.finish_reason

        def teardown(self):
            if not hasattr(self, "engine"):
                return
            while self.engine.has_pending():
                self.tick(1)
            assert set(self.ended) == set(self.specs)
            for rid, (prompt, imgs, n) in self.specs.items():
                if self.ended[rid] is FinishReason.ABORT:
                    assert rid in self.aborted
                else:
                    assert self.tokens[rid] == solo(prompt, imgs, n), rid
            assert self.engine.executor.cache_bytes() == 0 and not self.engine.executor.live_request_ids()
            _assert_replays(self.log)
            VLMMachine.preemptions += sum(1 for e in self.log.of_kind("transition")
                                          if e["to"] == "queued" and e["from"] != "queued" and self.specs[
                                              e["request_id"]][1])  # image requests preempted

    return VLMMachine


@pytest.mark.slow
def test_random_interleavings_with_images(vlm_machine_class):
    # the same examples every run (derandomized: which ones follows the machine's source; 20, as the first 12 of
    # the machine with Gemma 4's budget preempted nothing on any family)
    vlm_machine_class.TestCase.settings = settings(
        max_examples=20, stateful_step_count=20, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    vlm_machine_class.TestCase().runTest()
    assert vlm_machine_class.preemptions > 0, "no example preempted an image request"

"""Replay is faithful on ordinary traces (issue 24 items 3-7), each a regression test that failed before:

3. per-token logprobs are in the outcome, so a trace with `logprobs=True` replays (replay raised KeyError);
4. an arrival failed at inbox time (unreadable media, by engines before UnreadableMedia refused it) carries its
   error, so replay fails it the same way (an unedited trace was "DIVERGED at tick 0");
5. whether a row may draft is recorded per arrival, so rows with logits processors do not draft in replay
   either (replay diverged at the first decode tick with drafting on);
6. the policy is recorded with its parameters (Priority(aging_ticks=5) replayed with the default aging), and a
   policy replay cannot rebuild is exit 2 with a message (a traceback before);
7. KV merges, filters and draft rollbacks are events, compared tick by tick (they were not in the trace).
"""

import io
import json

import pytest

from scheduler import Engine, EngineConfig, SamplingParams, UnreadableMedia
from scheduler.cli import main
from scheduler.events import SCHEMA_VERSION, read_jsonl
from scheduler.policy import FCFS, Priority, PolicyUnavailable
from scheduler.tools.replay import TraceError, load_trace, replay

from ..helpers import drive, mixed_prompts

PHRASE = [101, 57, 302, 44, 250, 17, 99, 480, 33, 71]


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _keep(tokens, logits):  # a logits processor that changes nothing: its row must still not draft
    return logits


# ---- 3: logprobs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def logprob_run(text_model, tmp_path_factory):
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("lp") / "logprobs.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=48, max_seqs=3, prefill_chunk=16,
                                                   trace_path=str(path)))
    arrivals = [(i // 2, {"prompt_tokens": p, "request_id": f"r{i}",
                          "sampling": SamplingParams(max_tokens=5 + i, logprobs=i != 2, top_logprobs=3 if i == 1 else 0,
                                                     temperature=0.0 if i % 2 else 0.9, seed=i)})
                for i, p in enumerate(mixed_prompts(5, 3, 40, seed=7))]
    streamed: dict[str, list[float]] = {}
    streamed_top: dict[str, list] = {}
    pending = list(arrivals)
    while pending or engine.has_pending():
        while pending and pending[0][0] <= engine.tick:
            engine.add_request(**pending.pop(0)[1])
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.logprobs)
            streamed_top.setdefault(out.request_id, []).extend(out.top_logprobs)
    engine.close()
    assert len(streamed_top["r1"]) == len(streamed["r1"]) and not streamed_top["r0"]
    return path, streamed, streamed_top


def test_the_outcome_carries_each_sampled_tokens_logprob(logprob_run):
    path, streamed, _ = logprob_run
    recorded: dict[str, list[float]] = {}
    for e in read_jsonl(path):
        if e["event"] == "outcome":
            assert set(e["logprobs"]) <= set(e["sampled"])
            for rid, lp in e["logprobs"].items():
                recorded.setdefault(rid, []).append(lp)
    assert "r2" not in recorded  # it asked for none
    assert recorded == {rid: lps for rid, lps in streamed.items() if lps}
    assert all(len(recorded[f"r{i}"]) == 5 + i for i in (0, 1, 3, 4))


def test_the_outcome_carries_top_logprobs_for_the_requests_that_asked(logprob_run):
    path, _, streamed_top = logprob_run
    recorded: dict[str, list] = {}
    for e in read_jsonl(path):
        if e["event"] == "outcome":
            for rid, pairs in e.get("top_logprobs", {}).items():
                recorded.setdefault(rid, []).append([tuple(pair) for pair in pairs])
    assert recorded == {"r1": streamed_top["r1"]}


def test_a_trace_with_logprobs_replays_and_the_command_says_identical(logprob_run, capsys):
    """Logprobs and top_logprobs (r1) included: replay feeds the recorded outcomes back."""
    path, _, _ = logprob_run
    report = replay(load_trace(path))
    assert report.identical, report.format()
    assert main(["replay", str(path)]) == 0
    assert "identical" in capsys.readouterr().out


# ---- 4: unreadable media ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


def _image_prompt(vlm, text):
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    return apply_chat_template(processor, model.config,
                               [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                               num_images=1)


def _noise_image(seed, size=(56, 56)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _trace_with_an_arrival_failed_at_once(vlm, tmp_path):
    """A trace as engines before UnreadableMedia wrote it: the unreadable request was accepted, its arrival
    carried the error and it was failed in its arrival tick. Today's engine refuses that request, so the trace
    is the one it writes for the readable request, with what the older engine wrote for the other put back: its
    arrival (with the error) and fail transition at tick 1, and its id in that tick's plan's `step.finished`."""
    model, processor = vlm
    path = tmp_path / "media.jsonl"
    engine = Engine(model, processor, EngineConfig(trace_path=str(path)))
    drive(engine, [(0, {"prompt": _image_prompt(vlm, "What is this?"), "images": [_noise_image(2)],
                        "request_id": "good", "sampling": SamplingParams(max_tokens=4)})])
    engine.close()
    events = read_jsonl(path)
    good = next(e for e in events if e["event"] == "arrival")
    bad = {**good, "tick": 1, "request_id": "bad", "prompt_tokens": [0], "num_images": 0, "media_key": None,
           "error": "unreadable image: image 0: truncated"}
    fail = {"schema": good["schema"], "seq": 0, "tick": 1, "event": "transition", "request_id": "bad",
            "from": "queued", "to": "aborted", "trigger": "fail", "reason": bad["error"]}
    at = next(i for i, e in enumerate(events) if e["tick"] == 1)
    events[at:at] = [bad, fail]
    plan = next(e for e in events if e["event"] == "plan" and e["tick"] == 1)
    plan["step"]["finished"] = ["bad", *plan["step"]["finished"]]  # ended before the plan, as at any arrival
    for seq, e in enumerate(events):
        e["seq"] = seq
    return events


def test_unreadable_media_is_refused_and_nothing_is_recorded(vlm, tmp_path):
    model, processor = vlm
    path = tmp_path / "media.jsonl"
    buf = io.BytesIO()
    _noise_image(1).save(buf, format="PNG")
    engine = Engine(model, processor, EngineConfig(trace_path=str(path)))
    with pytest.raises(UnreadableMedia):
        engine.add_request(prompt=_image_prompt(vlm, "And this?"), images=[buf.getvalue()[:40]], request_id="bad")
    run = drive(engine, [(0, {"prompt": _image_prompt(vlm, "What is this?"), "images": [_noise_image(2)],
                              "request_id": "good", "sampling": SamplingParams(max_tokens=4)})])
    engine.close()
    assert len(run.tokens["good"]) == 4
    events = read_jsonl(path)
    assert [e["request_id"] for e in events if e["event"] == "arrival"] == ["good"]
    assert all("error" not in e for e in events if e["event"] == "arrival")
    assert replay(load_trace(path)).identical


def test_an_older_trace_with_an_arrival_failed_at_once_replays_that_failure(vlm, tmp_path):
    events = _trace_with_an_arrival_failed_at_once(vlm, tmp_path)
    report = replay(load_trace(_write(tmp_path / "older.jsonl", events)))
    assert report.identical, report.format()
    # and replay does read the error: without it, the request is admitted where it was failed
    next(e for e in events if e.get("request_id") == "bad" and e["event"] == "arrival")["error"] = None
    edited = replay(load_trace(_write(tmp_path / "no-error.jsonl", events)))
    assert not edited.identical and edited.divergence.tick == 1


# ---- 5: draft eligibility -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafting_trace(text_model, tmp_path_factory):
    """Drafting on (prompt lookup); r1 and r3 have logits processors, r5 asks for logprobs: they never draft. r6
    drafts once it has its min_tokens."""
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("draft") / "drafting.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=16,
                                                   draft_tokens=3, trace_path=str(path)))
    for i in range(7):
        sampling = SamplingParams(max_tokens=10, logits_processors=(_keep,) if i in (1, 3) else (),
                                  logprobs=i == 5, min_tokens=6 if i == 6 else 0)
        engine.add_request(prompt_tokens=PHRASE[i:] * 4 + PHRASE[:i], sampling=sampling, request_id=f"r{i}")
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def test_draft_eligibility_is_recorded_per_arrival(drafting_trace):
    events = read_jsonl(drafting_trace)
    eligible = {e["request_id"]: e["draft_eligible"] for e in events if e["event"] == "arrival"}
    assert eligible == {"r0": True, "r1": False, "r2": True, "r3": False, "r4": True, "r5": False, "r6": True}
    granted = {rid for e in events if e["event"] == "plan" for rid, _ in e["draft"]}
    assert granted == {"r0", "r2", "r4", "r6"}


def test_rows_with_processors_do_not_draft_in_replay_either(drafting_trace, tmp_path):
    report = replay(load_trace(drafting_trace))
    assert report.identical, report.format()
    # replay reads the recorded fact (processors are code, the trace cannot rebuild them): flip it for r1 and
    # the first tick r1 decodes next to drafting rows grants it drafts too
    events = read_jsonl(drafting_trace)
    next(e for e in events if e["event"] == "arrival" and e["request_id"] == "r1")["draft_eligible"] = True
    first = min(e["tick"] for e in events if e["event"] == "plan" and "r1" in e["decode"] and e["draft"])
    edited = replay(load_trace(_write(tmp_path / "r1-drafts.jsonl", events)))
    assert not edited.identical and edited.divergence.tick == first
    assert "draft" in edited.divergence.differing_fields
    assert any(rid == "r1" for rid, _ in edited.divergence.replayed["draft"])


def test_min_tokens_holds_drafts_back_in_replay_too(drafting_trace, tmp_path):
    """r6 (min_tokens 6) is held back from drafting (reason draft_min_tokens) until its sixth token, then drafts.
    The bound is a recorded sampling field: with it edited away, replay grants r6 drafts at the first tick it
    was held back."""
    events = read_jsonl(drafting_trace)
    plans = [e for e in events if e["event"] == "plan"]
    held = [p["tick"] for p in plans for rid, reason, _ in p.get("reasons", ())
            if (rid, reason) == ("r6", "draft_min_tokens")]
    drafted = [p["tick"] for p in plans for rid, _ in p["draft"] if rid == "r6"]
    assert held and drafted and max(held) < min(drafted)
    sampled = sum(1 for e in events if e["event"] == "outcome" and e["tick"] < min(drafted)
                  for rid in e.get("sampled", {}) if rid == "r6")
    assert sampled >= 6  # (a draft-free row gets one token a tick)
    next(e for e in events if e["event"] == "arrival" and e["request_id"] == "r6")["sampling"]["min_tokens"] = 0
    edited = replay(load_trace(_write(tmp_path / "r6-unbound.jsonl", events)))
    assert not edited.identical and edited.divergence.tick == min(held)
    assert any(rid == "r6" for rid, _ in edited.divergence.replayed["draft"])


# ---- 6: policy and its parameters ---------------------------------------------------------------------------


def _priority_run(model, tokenizer, path, policy):
    """One slot; a low-priority request waits while higher-priority ones keep arriving: when it gets the slot
    depends on the aging."""
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=32, max_seqs=1, prefill_chunk=32,
                                                   trace_path=str(path)), policy=policy)
    arrivals = [(0, {"prompt_tokens": [20, 21, 22], "priority": 0, "request_id": "low",
                     "sampling": SamplingParams(max_tokens=3)})]
    arrivals += [(t, {"prompt_tokens": [30 + t, 31, 32], "priority": 1, "request_id": f"high{t}",
                      "sampling": SamplingParams(max_tokens=3)}) for t in range(0, 40, 2)]
    drive(engine, arrivals)
    engine.close()
    return path


class NewestFirst(FCFS):
    """A custom policy (not in the registry): replay needs the object."""

    name = "newest-first"

    def order_waiting(self, waiting, tick, cached_prefix=None):
        return list(reversed(waiting))


def test_policy_parameters_are_recorded_and_replayed(text_model, tmp_path, capsys):
    model, tokenizer = text_model
    path = _priority_run(model, tokenizer, tmp_path / "priority.jsonl", Priority(aging_ticks=5))
    header = read_jsonl(path)[0]
    assert header["policy"] == {"name": "priority", "aging_ticks": 5}
    report = replay(load_trace(path))
    assert report.identical, report.format()
    assert main(["replay", str(path)]) == 0
    # the parameter matters in this trace: with the default aging the low-priority request waits longer
    other = replay(load_trace(path), policy=Priority())
    assert not other.identical
    capsys.readouterr()
    assert main(["replay", str(path), "--policy", "priority"]) == 1
    assert "DIVERGED" in capsys.readouterr().out


def test_a_policy_replay_cannot_rebuild_is_exit_2_with_a_message(text_model, tmp_path, capsys):
    model, tokenizer = text_model
    path = _priority_run(model, tokenizer, tmp_path / "custom.jsonl", NewestFirst())
    header = read_jsonl(path)[0]
    assert header["policy"]["name"] == "newest-first" and header["policy"]["custom"].endswith("NewestFirst")
    with pytest.raises(PolicyUnavailable, match="custom policy 'newest-first'"):
        replay(load_trace(path))
    assert replay(load_trace(path), policy=NewestFirst()).identical
    capsys.readouterr()
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot replay" in err and "custom policy 'newest-first'" in err and "Traceback" not in err
    assert main(["replay", str(path), "--policy", "bogus"]) == 2
    assert "unknown policy 'bogus'" in capsys.readouterr().err


# ---- 7: KV decisions are events -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_run(text_model, tmp_path_factory):
    """Draft-model drafting (the target drafts for itself: every tick verifies, so every tick rolls back),
    staggered arrivals and an abort: merges, filters and rollbacks all happen."""
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("kv") / "kv.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=3, prefill_chunk=16,
                                                   draft_tokens=2, drafter="draft-model", trace_path=str(path)),
                    draft_model=model)
    prompts = mixed_prompts(6, 4, 30, seed=11)
    for i, p in enumerate(prompts):
        engine.add_request(prompt_tokens=p, request_id=f"r{i}", sampling=SamplingParams(max_tokens=4 + 2 * i))
        engine.step()
        if i == 3:
            engine.abort("r2")
    while engine.has_pending():
        engine.step()
    engine.close()
    return path, engine.kv_cache_stats()


def test_kv_merges_filters_and_rollbacks_are_in_the_trace(kv_run):
    path, kv_stats = kv_run
    events = read_jsonl(path)
    assert all(e["schema"] == SCHEMA_VERSION == 2 for e in events)
    merges = [e for e in events if e["event"] == "kv_merge"]
    filters = [e for e in events if e["event"] == "kv_filter"]
    rollbacks = [e for e in events if e["event"] == "kv_rollback"]
    assert len(merges) == kv_stats["merges"] and len(filters) == kv_stats["filters"] and rollbacks
    # a merge at a tick is exactly the prefills that completed in it, in plan order
    plans = {e["tick"]: e for e in events if e["event"] == "plan"}
    for e in merges:
        assert e["request_ids"] == [c[0] for c in plans[e["tick"]]["prefill"] if c[3]]
    # every request that joined the batch leaves it exactly once
    assert sorted(r for e in merges for r in e["request_ids"]) == sorted(r for e in filters for r in e["request_ids"])
    # a rollback names every row of the tick's verify forward: the decoding rows and those that joined
    for e in rollbacks:
        plan = plans[e["tick"]]
        assert [rid for rid, _ in e["rows"]] == plan["decode"] + [c[0] for c in plan["prefill"] if c[3]]
        assert all(0 <= n <= 2 for _, n in e["rows"])


@pytest.mark.parametrize("kind", ["kv_merge", "kv_filter", "kv_rollback"])
def test_an_edited_kv_event_diverges_at_its_tick(kv_run, tmp_path, kind):
    path, _ = kv_run
    assert replay(load_trace(path)).identical
    events = read_jsonl(path)
    victims = [i for i, e in enumerate(events) if e["event"] == kind]
    target = victims[len(victims) // 2]
    tick = events[target]["tick"]
    del events[target]
    report = replay(load_trace(_write(tmp_path / f"no-{kind}.jsonl", events)))
    assert not report.identical and report.divergence.tick == tick
    assert report.divergence.differing_fields == [kind]


def test_a_schema_1_trace_is_refused(kv_run, tmp_path):
    path, _ = kv_run
    events = read_jsonl(path)
    for e in events:
        e["schema"] = 1
    with pytest.raises(TraceError, match="schema 1"):
        load_trace(_write(tmp_path / "v1.jsonl", events))

"""A replay corpus: traces recorded on the tiny models from every feature replay identically (the library call
and `mlxsched replay`, exit 0), and an edited one diverges at exactly the tick the edit changes (exit 1).

One recording per feature, shared by the module's tests (a module-scoped parametrised fixture). Each trace
first shows it really exercises its feature (a corpus entry that never hits the prefix cache proves nothing).
"""

import dataclasses
import json

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.cli import main
from scheduler.events import read_jsonl
from scheduler.policy import Priority
from scheduler.tools.replay import load_trace, replay

from ..helpers import drive, mixed_prompts, solo_tokens

def _keep(tokens, logits):
    return logits


def _boom(tokens, logits):
    raise RuntimeError("processor failed on purpose")


def _kinds(events, kind, **match):
    return [e for e in events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


# ---- recordings: (engine kwargs, arrivals) per feature, and what the trace must show ----------------------


def _logprobs(text, vlm):
    arrivals = [(i // 2, {"prompt_tokens": p, "sampling": SamplingParams(
        max_tokens=6, logprobs=True, temperature=0.0 if i % 2 else 0.7, seed=i)})
        for i, p in enumerate(mixed_prompts(6, 2, 50, seed=41))]
    return text, EngineConfig(max_batched_tokens=40, max_seqs=4, prefill_chunk=12), {}, arrivals


def _check_logprobs(events):
    assert sum(len(e["logprobs"]) for e in _kinds(events, "outcome")) == 36


def _drafting_with_processors(text, vlm):
    """Prompt lookup; rows with a processor (one that raises), logprobs or penalties never draft. Each prompt
    ends with the model's own greedy continuation of its start, so lookups find something to propose."""
    starts = mixed_prompts(6, 8, 20, seed=5)
    prompts = [p + solo_tokens(*text, p, 24) for p in starts]
    samplings = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, logits_processors=(_keep,)),
                 SamplingParams(max_tokens=12, temperature=0.8, seed=3),
                 SamplingParams(max_tokens=12, logits_processors=(_boom,)),
                 SamplingParams(max_tokens=12, repetition_penalty=1.2), SamplingParams(max_tokens=12, logprobs=True)]
    arrivals = [(i // 3, {"prompt_tokens": prompts[i], "sampling": s, "request_id": f"d{i}"})
                for i, s in enumerate(samplings)]
    # draft_gate=False: every proposal is verified, so the trace holds verifications of rows beside ineligible
    # ones (on this untrained model the gate would decline most of them; "draft-gate" records it on)
    return text, EngineConfig(max_batched_tokens=64, max_seqs=6, prefill_chunk=32, draft_tokens=3,
                              draft_gate=False), {}, arrivals


def _check_drafting_with_processors(events):
    granted = {rid for e in _kinds(events, "plan") for rid, _ in e["draft"]}
    assert granted == {"d0", "d2"}
    assert _kinds(events, "transition", request_id="d3", trigger="fail")
    assert _kinds(events, "transition", trigger="start_draft")
    assert sum(d[0] for e in _kinds(events, "outcome") for d in e["drafts"].values()) > 0  # lookups proposed
    assert _kinds(events, "kv_rollback")


def _draft_gate(text, vlm):
    """The tick-level draft gate on: two rows whose prompts end with the start of the model's own greedy
    continuation (lookups are accepted) and two of random ids, k=4. What the gate let through is in each
    outcome's `drafts`, which replay reads; its decisions are not replayed (they are the executor's)."""
    starts = mixed_prompts(4, 8, 20, seed=11)
    prompts = [p + solo_tokens(*text, p, 24) if i < 2 else p for i, p in enumerate(starts)]
    arrivals = [(0, {"prompt_tokens": prompts[i], "sampling": SamplingParams(max_tokens=16), "request_id": f"g{i}"})
                for i in range(4)]
    return text, EngineConfig(max_batched_tokens=128, max_seqs=4, prefill_chunk=64, draft_tokens=4), {}, arrivals


def _check_draft_gate(events):
    grants = {e["tick"] for e in _kinds(events, "plan") if e["draft"]}
    verified = {e["tick"] for e in _kinds(events, "outcome") if any(d[0] for d in e["drafts"].values())}
    assert verified and verified < grants  # some granted ticks verified drafts, some were decoded plainly
    assert _kinds(events, "kv_rollback")


def _draft_model(text, vlm):
    arrivals = [(i, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=8 + i)})
                for i, p in enumerate(mixed_prompts(5, 3, 40, seed=43))]
    config = EngineConfig(max_batched_tokens=64, max_seqs=3, prefill_chunk=16, draft_tokens=2, drafter="draft-model")
    return text, config, {"draft_model": text[0]}, arrivals


def _check_draft_model(events):
    drafts = [d for e in _kinds(events, "outcome") for d in e["drafts"].values()]
    assert drafts and sum(accepted for _, accepted in drafts) > 0


def _preemption(text, vlm):
    arrivals = [(i // 3, {"prompt_tokens": p, "sampling": SamplingParams(max_tokens=24)})
                for i, p in enumerate(mixed_prompts(10, 8, 120, seed=21))]
    config = EngineConfig(max_batched_tokens=96, max_seqs=8, prefill_chunk=32, kv_memory_bytes=1_100_000,
                          kv_headroom_tokens=0)
    return text, config, {}, arrivals


def _check_preemption(events):
    preempted = _kinds(events, "transition", trigger="preempt")
    assert preempted
    for e in preempted:  # readmitted later and recomputed to the end
        assert [t for t in _kinds(events, "transition", request_id=e["request_id"], trigger="start_prefill")
                if t["tick"] > e["tick"]]
        assert _kinds(events, "transition", request_id=e["request_id"], trigger="finish")
    assert all(p["kv_bytes_bound"] <= 1_700_000 for p in _kinds(events, "plan"))


def _prefix(text, vlm):
    """Three 32-token system prompts, a budget of about two entries: hits, then evictions."""
    systems = mixed_prompts(3, 32, 32, seed=47)
    arrivals = []
    for i, s in enumerate([0, 0, 1, 1, 2, 0, 2, 1, 0]):
        arrivals.append((2 * i, {"prompt_tokens": systems[s] + [200 + i, 201 + i, 9], "request_id": f"p{i}",
                                 "sampling": SamplingParams(max_tokens=4)}))
    config = EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=64, prefix_cache_bytes=80_000)
    return text, config, {}, arrivals


def _check_prefix(events):
    assert len(_kinds(events, "prefix_hit")) >= 2 and _kinds(events, "prefix_evict")
    assert _kinds(events, "prefix_miss")


def _vlm_media(text, vlm):
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm

    def prompt(body, images):
        content = [{"type": "image"}] * images + [{"type": "text", "text": body}] if images else body
        return apply_chat_template(processor, model.config, [{"role": "user", "content": content}],
                                   num_images=images)

    arrivals = [
        (0, {"prompt": prompt("What is this?", 1), "images": [_noise(2)], "request_id": "image",
             "sampling": SamplingParams(max_tokens=6)}),
        (0, {"prompt": prompt("Hello there.", 0), "request_id": "text", "sampling": SamplingParams(max_tokens=6)}),
        (2, {"prompt": prompt("Again?", 1), "images": [_noise(2)], "request_id": "image-again",
             "sampling": SamplingParams(max_tokens=6)}),
    ]
    return vlm, EngineConfig(max_batched_tokens=40, max_seqs=4, prefill_chunk=16), {}, arrivals


def _noise(seed):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def _check_vlm_media(events):
    assert len(_kinds(events, "transition", trigger="start_vision")) == 2
    assert _kinds(events, "transition", request_id="image", trigger="finish")


def _priority(text, vlm):
    arrivals = [(0, {"prompt_tokens": [20, 21, 22], "priority": 0, "request_id": "low",
                     "sampling": SamplingParams(max_tokens=3)})]
    arrivals += [(t, {"prompt_tokens": [30 + t, 31, 32], "priority": 1, "request_id": f"high{t}",
                      "sampling": SamplingParams(max_tokens=3)}) for t in range(0, 30, 2)]
    return text, EngineConfig(max_batched_tokens=32, max_seqs=1), {"policy": Priority(aging_ticks=5)}, arrivals


def _check_priority(events):
    assert events[0]["policy"] == {"name": "priority", "aging_ticks": 5}
    admitted = [rid for e in _kinds(events, "plan") for rid in e["admitted"]]
    assert 0 < admitted.index("low") < len(admitted) - 1  # aging let it in while urgent ones still waited


FEATURES = {
    "logprobs": (_logprobs, _check_logprobs),
    "drafting-with-processors": (_drafting_with_processors, _check_drafting_with_processors),
    "draft-gate": (_draft_gate, _check_draft_gate),
    "draft-model": (_draft_model, _check_draft_model),
    "preemption": (_preemption, _check_preemption),
    "prefix-hits-and-evictions": (_prefix, _check_prefix),
    "vlm-media": (_vlm_media, _check_vlm_media),
    "priority-aging-5": (_priority, _check_priority),
}


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


@pytest.fixture(scope="module", params=list(FEATURES))
def recorded(request, text_model, tmp_path_factory):
    """(feature, trace path) recorded once per feature for the module."""
    feature = request.param
    setup, _ = FEATURES[feature]
    vlm = request.getfixturevalue("vlm") if feature.startswith("vlm") else None
    (model, tokenizer), config, kwargs, arrivals = setup(text_model, vlm)
    path = tmp_path_factory.mktemp(feature) / "trace.jsonl"
    engine = Engine(model, tokenizer, dataclasses.replace(config, trace_path=str(path)), **kwargs)
    drive(engine, arrivals)
    engine.close()
    return feature, path


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_the_trace_exercises_its_feature(recorded):
    feature, path = recorded
    FEATURES[feature][1](read_jsonl(path))


def test_the_trace_replays_identically(recorded, capsys):
    feature, path = recorded
    events = read_jsonl(path)
    report = replay(load_trace(path))  # the recorded policy, with its recorded parameters
    assert report.identical, report.format()
    assert report.ticks_compared == max(e["tick"] for e in _kinds(events, "plan")) + 1
    assert report.requests == len(_kinds(events, "arrival"))
    assert main(["replay", str(path)]) == 0
    assert "identical" in capsys.readouterr().out


def _editable_tick(events):
    """A tick in the middle of the run with a decoding row that does not end in it: (tick, row)."""
    ended = {(e["tick"], e["request_id"]) for e in _kinds(events, "transition") if e["to"] in ("finished", "aborted")}
    candidates = [(e["tick"], rid) for e in _kinds(events, "plan") for rid in e["decode"]
                  if (e["tick"], rid) not in ended]
    return candidates[len(candidates) // 2]


def test_a_stop_token_edited_in_at_tick_k_diverges_at_k(recorded, tmp_path, capsys):
    feature, path = recorded
    events = read_jsonl(path)
    tick, rid = _editable_tick(events)
    outcome = _kinds(events, "outcome", tick=tick)[0]
    outcome["sampled"][rid] = events[0]["stop_token_ids"][0]
    outcome["accepted_drafts"].pop(rid, None)
    if rid in outcome["drafts"]:
        outcome["drafts"][rid][1] = 0
    edited = _write(tmp_path / "stop.jsonl", events)
    report = replay(load_trace(edited))
    assert not report.identical and report.divergence.tick == tick, report.format()
    assert any(e["request_id"] == rid and e["trigger"] == "finish" for e in report.divergence.replayed["transition"])
    assert main(["replay", str(edited)]) == 1
    assert f"first divergence at tick {tick}" in capsys.readouterr().out


def test_a_plan_decision_edited_at_tick_k_diverges_at_k(recorded, tmp_path):
    feature, path = recorded
    events = read_jsonl(path)
    tick, rid = _editable_tick(events)
    plan = _kinds(events, "plan", tick=tick)[0]
    plan["decode"] = [r for r in plan["decode"] if r != rid]
    report = replay(load_trace(_write(tmp_path / "plan.jsonl", events)))
    assert not report.identical and report.divergence.tick == tick
    assert "decode" in report.divergence.differing_fields

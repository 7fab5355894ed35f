"""Structured outputs (`SamplingParams.structured_output`) on the tiny real text model: constrained rows batched
with unconstrained ones, under chunked prefill, drafting, the prefix cache and preemption, each equal to mlx-lm
alone given the same `GrammarProcessor`; the outputs keep to their constraints; bad specs are refused on arrival
and a row whose tokens break its constraint fails alone."""

import json
import re

import jsonschema
import mlx.core as mx
import pytest

from scheduler import (
    Engine,
    EngineConfig,
    FinishReason,
    InvalidRequest,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
)
from scheduler.tools.replay import load_trace, replay

from ..execution.family_conformance import preempting_config
from ..helpers import drive, engine_with_log, mixed_prompts, solo_tokens

PROMPTS = mixed_prompts(7, 4, 90, seed=21)
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["ok", "color", "count", "tags"], "additionalProperties": False}
REGEX = r"[0-9]{2}-(yes|no|later)"
CHOICES = ["alpha", "beta gamma", 'delta "quoted"']
CONSTRAINTS = [StructuredOutput.json(SCHEMA), StructuredOutput.regex(REGEX), StructuredOutput.choice(CHOICES),
               StructuredOutput.grammar('start: "(" item ("," item)* ")"\nitem: "x" | "y" | "zz"'),
               StructuredOutput.json_object(), None, StructuredOutput.json(SCHEMA)]
MAX_TOKENS = 96


def _text(tokenizer, tokens: list[int]) -> str:
    """The output's text without its end-of-sequence token."""
    eos = set(tokenizer.eos_token_ids)
    return tokenizer.decode([t for t in tokens if t not in eos])


def _solo(engine, model, tokenizer, prompt, constraint, max_tokens=MAX_TOKENS):
    processors = [engine.grammars.processor(constraint)] if constraint is not None else None
    return solo_tokens(model, tokenizer, prompt, max_tokens, logits_processors=processors)


@pytest.mark.parametrize("config", [
    dict(max_batched_tokens=40, prefill_chunk=9, max_seqs=8),
    dict(max_batched_tokens=256, max_seqs=3, prefill_chunk=64, draft_tokens=3, prefix_cache_bytes=1 << 24,
         prefix_block_size=8),
], ids=["chunked", "drafting+prefix"])
def test_constrained_rows_batch_exactly_like_mlx_lm_alone(text_model, config):
    model, tokenizer = text_model
    engine, sink = engine_with_log(model, tokenizer, EngineConfig(check_invariants=True, **config))
    want = [_solo(engine, model, tokenizer, p, c) for p, c in zip(PROMPTS, CONSTRAINTS)]
    plain = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]
    run = drive(engine, [(i % 3, {"prompt_tokens": p, "request_id": f"r{i}",
                                  "sampling": SamplingParams(max_tokens=MAX_TOKENS, structured_output=c)})
                         for i, (p, c) in enumerate(zip(PROMPTS, CONSTRAINTS))])
    assert not run.errors, run.errors
    got = [run.tokens[f"r{i}"] for i in range(len(PROMPTS))]
    assert got == want
    for i, c in enumerate(CONSTRAINTS):  # the constraint is what changed them (the random model writes no JSON)
        assert (got[i] != plain[i]) == (c is not None), i
    texts = [_text(tokenizer, t) for t in got]
    finished = [run.finish[f"r{i}"] for i in range(len(PROMPTS))]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert finished[0] is FinishReason.STOP and finished[6] is FinishReason.STOP
    jsonschema.validate(json.loads(texts[6]), SCHEMA)
    assert re.fullmatch(REGEX, texts[1]) and finished[1] is FinishReason.STOP
    assert texts[2] in CHOICES and finished[2] is FinishReason.STOP
    assert re.fullmatch(r"\((x|y|zz)(,(x|y|zz))*\)?", texts[3])  # the random model may run out of tokens
    assert texts[4].startswith("{")
    eligible = {e["request_id"]: e["draft_eligible"] for e in sink.of_kind("arrival")}
    assert eligible == {f"r{i}": c is None for i, c in enumerate(CONSTRAINTS)}  # constrained rows never draft


def test_a_preempted_constrained_row_resumes_its_constraint(text_model):
    """Under a KV budget the newest row is preempted and recomputed: its matcher is rebuilt from the outputs so
    far, and the row still equals mlx-lm alone."""
    model, tokenizer = text_model
    prompts = mixed_prompts(3, 24, 24, seed=9)
    engine, sink = engine_with_log(model, tokenizer, preempting_config(model, prompts))
    constraint = StructuredOutput.json(SCHEMA)
    run = drive(engine, [(0, {"prompt_tokens": p, "request_id": f"r{i}",
                              "sampling": SamplingParams(max_tokens=12, structured_output=constraint)})
                         for i, p in enumerate(prompts)])
    assert not run.errors
    assert any(e["trigger"] == "preempt" for e in sink.of_kind("transition")), "the budget preempted a row"
    for i, p in enumerate(prompts):
        assert run.tokens[f"r{i}"] == _solo(engine, model, tokenizer, p, constraint, 12)


@pytest.mark.parametrize("make", [
    lambda: StructuredOutput.regex("([a-z"),
    lambda: StructuredOutput.grammar("start: missing_rule"),
    lambda: StructuredOutput.json({"type": "objekt"}),
    lambda: StructuredOutput.json("{not json"),
    lambda: StructuredOutput.choice([]),
    lambda: StructuredOutput(StructuredKind.REGEX, ""),
], ids=["regex", "grammar", "schema", "schema-text", "choice", "empty"])
def test_a_bad_constraint_is_refused_on_arrival(text_model, make):
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig())
    with pytest.raises(InvalidRequest) as info:
        engine.add_request(prompt_tokens=PROMPTS[0], sampling=SamplingParams(structured_output=make()))
    assert info.value.field == "structured_output"
    assert not engine.has_pending()


def test_a_row_that_breaks_its_constraint_fails_alone(text_model):
    """A custom sampler may pick a token the mask ruled out: the next step's matcher refuses it, that request
    fails with the reason, and the others finish as alone."""
    model, tokenizer = text_model
    digit = tokenizer.encode("7")[0]
    engine = Engine(model, tokenizer, EngineConfig(check_invariants=True))
    run = drive(engine, [
        (0, {"prompt_tokens": PROMPTS[0], "request_id": "bad", "sampling": SamplingParams(
            max_tokens=8, structured_output=StructuredOutput.choice(CHOICES),
            sampler=lambda logprobs: mx.array([digit]))}),
        (0, {"prompt_tokens": PROMPTS[1], "request_id": "good",
             "sampling": SamplingParams(max_tokens=MAX_TOKENS, structured_output=StructuredOutput.regex(REGEX))}),
    ])
    assert run.finish["bad"] is FinishReason.ERROR and "breaks the constraint" in run.errors["bad"]
    assert run.tokens["good"] == _solo(engine, model, tokenizer, PROMPTS[1], StructuredOutput.regex(REGEX))
    assert engine.executor.live_request_ids() == set()


def test_the_constraint_is_recorded_and_replays(text_model, tmp_path):
    model, tokenizer = text_model
    trace = tmp_path / "trace.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(trace_path=str(trace), max_batched_tokens=32, max_seqs=4,
                                                   prefill_chunk=8))
    sampling = SamplingParams(max_tokens=10, structured_output=StructuredOutput.json(SCHEMA))
    drive(engine, [(0, {"prompt_tokens": p, "sampling": sampling}) for p in PROMPTS[:3]])
    engine.close()
    assert SamplingParams.from_record(sampling.to_record()) == sampling
    arrivals = [e for e in map(json.loads, trace.read_text().splitlines()) if e.get("event") == "arrival"]
    assert all(StructuredOutput.from_record(a["sampling"]["structured_output"]) == sampling.structured_output
               for a in arrivals) and len(arrivals) == 3
    assert replay(load_trace(trace)).identical


def test_schema_key_order_is_the_outputs():
    """A schema's properties come out in the order given (not sorted), as OpenAI's structured outputs do."""
    a = StructuredOutput.json({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}})
    assert a.spec.index('"b"') < a.spec.index('"a"')
    assert StructuredOutput.json(a.spec) == a


def test_after_leaves_the_text_up_to_the_marker_free(text_model):
    """`after`: logits pass unchanged until the output contains the marker, however its text is split into
    tokens, and the grammar applies from the next token on; tokens of the prompt never start it."""
    model, tokenizer = text_model
    engine = Engine(model, tokenizer, EngineConfig())
    marker = "ENDS"
    prompt = tokenizer.encode("the prompt says ENDS already", add_special_tokens=False)
    before = [tokenizer.encode(piece, add_special_tokens=False) for piece in ("so E", "N", "D", "S")]
    processor = engine.grammars.processor(StructuredOutput.choice(["yes", "no"], after=marker), len(prompt))
    logits = mx.random.normal((1, engine.vocab_size))
    history = list(prompt)
    assert mx.array_equal(processor(mx.array(history), logits), logits)  # the prompt's marker does not count
    for piece in before[:-1]:
        history += piece
        assert mx.array_equal(processor(mx.array(history), logits), logits), piece
    history += before[-1]
    masked = processor(mx.array(history), logits)
    allowed = [t for t in range(engine.vocab_size) if masked[0, t].item() != float("-inf")]
    assert allowed and set(allowed) <= {t for word in ("yes", "no") for t in range(engine.vocab_size)
                                        if word.startswith(tokenizer.decode([t])) and tokenizer.decode([t])}

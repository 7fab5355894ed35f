"""SamplingParams and prompt validation: each invalid value is refused with a message naming the field."""

import math

import pytest

from scheduler.request import InvalidRequest, SamplingParams, validate_prompt_tokens

INVALID = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -1), ("top_p", math.nan),
    ("top_k", -1), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.0), ("min_p", math.nan),
    ("presence_penalty", math.inf), ("presence_penalty", None),
    ("frequency_penalty", math.nan), ("frequency_penalty", "often"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)), ("stop_token_ids", 5),
    ("seed", -1), ("seed", 2**32), ("seed", 1.5),
    ("logprobs", "yes"),
    ("logits_processors", (1,)),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(field)
    assert isinstance(info.value, ValueError)


def test_valid_sampling_values_are_kept():
    p = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=-0.5,
                       repetition_penalty=1.2, stop_token_ids=[3, 4], seed=7, logprobs=True,
                       logits_processors=[lambda t, l: l])
    assert p.stop_token_ids == (3, 4) and isinstance(p.logits_processors, tuple)
    assert not p.is_greedy and SamplingParams().is_greedy


@pytest.mark.parametrize(
    "tokens,field",
    [([], "prompt"), ([1, 512], "prompt_tokens"), ([-1], "prompt_tokens"), ([1.0], "prompt_tokens"),
     (list(range(11)), "prompt")],
)
def test_prompt_validation(tokens, field):
    with pytest.raises(InvalidRequest) as info:
        validate_prompt_tokens(tokens, vocab_size=512, max_len=10)
    assert info.value.field == field


def test_valid_prompt_is_copied():
    src = [1, 2, 3]
    out = validate_prompt_tokens(src, vocab_size=512, max_len=10)
    assert out == src and out is not src


def test_custom_sampler_opt_out_processor_history_and_lookup_scope_are_validated():
    from scheduler.config import EngineConfig
    from scheduler.request import InvalidRequest, Request, SamplingParams

    with pytest.raises(InvalidRequest, match="sampler"):
        SamplingParams(sampler="argmax")
    with pytest.raises(InvalidRequest, match="allow_drafts"):
        SamplingParams(allow_drafts=1)
    with pytest.raises(ValueError, match="processor_history"):
        EngineConfig(processor_history="all")
    with pytest.raises(ValueError, match="prompt_lookup_scope"):
        EngineConfig(prompt_lookup_scope="everyone")
    # a custom sampler or an opt-out keeps the request out of drafting; the trace records that it had a sampler
    assert not Request("a", [1], SamplingParams(sampler=lambda lp: lp)).draft_eligible
    assert not Request("b", [1], SamplingParams(allow_drafts=False)).draft_eligible
    assert Request("c", [1], SamplingParams()).draft_eligible
    assert SamplingParams(sampler=lambda lp: lp).to_record()["custom_sampler"] is True

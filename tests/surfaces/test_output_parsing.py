"""scheduler/server/tool_calls.py and reasoning.py: a chat choice's text split into content and tool calls (with
mlx-lm's own JSON tool parser, what its tokenizer wrapper infers for `<tool_call>` templates), and into reasoning
and content, the same way however it arrives in pieces. Text processing only; what a real model writes is in
tests/surfaces/test_serve_tools.py."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st
from mlx_lm.tool_parsers import json_tools, mistral

from scheduler.server.reasoning import ReasoningFormat, ReasoningSplitter
from scheduler.server.tool_calls import ToolCallFormat, ToolCallSplitter

FORMAT = ToolCallFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "Plain text, no call at all.  \n",
    CALL,
    "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n",
    "Look: <tool_call>not json</tool_call> and <tool but no call",
    "Before " + CALL + " after.",
    'Cut short <tool_call>\n{"name": "get_weather", "argu',
    "<tool_call>\n" + json.dumps([{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]) + "\n</tool_call>",
    "ends with a partial marker <tool_ca",
]


# mlx-lm's `mistral` parser: a start marker and no end marker (Mistral's templates); a call runs to the next one
MISTRAL = ToolCallFormat(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call)
MISTRAL_TEXTS = [
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    "No call here, only [TOOL_CALL",
    'Cut [TOOL_CALLS]get_weather[ARGS]{"ci',
]


def _run(text: str, cuts: list[int], first_call_only: bool = False, fmt: ToolCallFormat = FORMAT):
    splitter = ToolCallSplitter(fmt, None, first_call_only)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, calls = "", []
    for a, b in zip(bounds, bounds[1:]):
        piece = splitter.feed(text[a:b])
        content += piece.content
        calls += piece.calls
    tail = splitter.finish()
    return content + tail.content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                    for c in calls + tail.calls]


def test_what_each_text_splits_into():
    paris, rome = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
    assert [_run(t, []) for t in TEXTS] == [
        ("Plain text, no call at all.  \n", []),  # no call: the text as it is, whitespace included
        ("", [paris]),
        ("Checking.", [paris, rome]),  # whitespace next to calls is not content
        ("Look: <tool_call>not json</tool_call> and <tool but no call", []),  # unreadable: kept as written
        ("Before after.", [paris]),
        ('Cut short <tool_call>\n{"name": "get_weather", "argu', []),  # an unfinished call stays text
        ("", [("a", {}), ("b", {"x": 1})]),  # a parser may return several calls from one block
        ("ends with a partial marker <tool_ca", []),
    ]
    assert _run(TEXTS[2], [], first_call_only=True) == ("Checking.", [paris])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_the_split_does_not_depend_on_how_the_text_arrives(text, cuts):
    assert _run(text, cuts) == _run(text, [])


def test_a_format_without_an_end_marker_runs_each_call_to_the_next_or_to_the_end():
    """Mistral's calls (`[TOOL_CALLS]name[ARGS]{...}`, or a JSON list after the marker) are calls, not content,
    however the text arrives; an unfinished one stays text."""
    paris, rome = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
    want = [("Sure.", [paris]), ("", [paris, ("get_time", {})]), ("", [rome]),
            ("No call here, only [TOOL_CALL", []), ('Cut [TOOL_CALLS]get_weather[ARGS]{"ci', [])]
    assert [_run(t, [], fmt=MISTRAL) for t in MISTRAL_TEXTS] == want
    assert _run(MISTRAL_TEXTS[1], [], first_call_only=True, fmt=MISTRAL) == ("", [paris])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(MISTRAL_TEXTS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_an_end_less_split_does_not_depend_on_how_the_text_arrives(text, cuts):
    assert _run(text, cuts, fmt=MISTRAL) == _run(text, [], fmt=MISTRAL)


def test_calls_get_openai_ids_and_json_string_arguments():
    splitter = ToolCallSplitter(FORMAT, None)
    piece = splitter.feed(CALL + CALL)
    assert [c["type"] for c in piece.calls] == ["function", "function"]
    assert all(c["id"].startswith("call_") for c in piece.calls) and piece.calls[0]["id"] != piece.calls[1]["id"]
    assert piece.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert splitter.calls_made == 2


def test_a_model_without_a_tool_call_format_has_none():
    class NoTools:
        has_tool_calling = False

    assert ToolCallFormat.of(NoTools()) is None


THINK = ReasoningFormat("<think>", "</think>")
REASONING_TEXTS = [  # (text, whether the prompt left the reasoning open)
    ("Weighing it.\n</think>\n\nThe answer.", True),
    ("<think>\nThe model opens it itself.\n</think>\nThe answer.", False),
    ("Cut short while still thinking <", True),
    ("No reasoning at all, and a partial </thi", False),
    ("first</think>between<think>second</think>  end", True),
]


def _think(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, opened)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:]):
        piece = splitter.feed(text[a:b])
        reasoning, content = reasoning + piece.reasoning, content + piece.content
    tail = splitter.finish()
    return reasoning + tail.reasoning, content + tail.content


def test_what_each_reasoning_text_splits_into():
    assert [_think(t, opened, []) for t, opened in REASONING_TEXTS] == [
        ("Weighing it.\n", "The answer."),  # whitespace right after the end marker is not content
        ("\nThe model opens it itself.\n", "The answer."),
        ("Cut short while still thinking <", ""),  # a reasoning cut short stays reasoning
        ("", "No reasoning at all, and a partial </thi"),
        ("firstsecond", "betweenend"),  # (the blank after each end marker is dropped)
    ]
    assert THINK.opens_in("<|im_start|>assistant\n<think>\n")
    assert not THINK.opens_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.opens_in("no markers at all")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(REASONING_TEXTS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_the_reasoning_split_does_not_depend_on_how_the_text_arrives(case, cuts):
    text, opened = case
    assert _think(text, opened, cuts) == _think(text, opened, [])

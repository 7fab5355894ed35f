"""The server's text pieces on their own: stop strings held back and never retracted, the incremental
detokenizer against whole-sequence decoding on the tiny models' real tokenizer."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.fixtures.tiny_models import build_tokenizer
from scheduler.server.detokenize import IncrementalDetokenizer
from scheduler.server.stops import StopMatcher, StopResult


def _feed(matcher: StopMatcher, text: str, cuts: list[int], unchecked: int = 0) -> tuple[str, bool]:
    """(output, stopped) of `text` fed in pieces cut at `cuts` (and at `unchecked`: what comes before it is fed
    unchecked), then flushed."""
    bounds = sorted({0, unchecked, len(text), *(c for c in cuts if c <= len(text))})
    out = []
    for a, b in zip(bounds, bounds[1:]):
        result = matcher.feed(text[a:b], checked=a >= unchecked)
        out.append(result.text)
        if result.stopped:
            return "".join(out), True
    tail = matcher.flush()
    return "".join(out) + tail.text, tail.stopped


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_strings_cut_at_the_earliest_match_whatever_the_pieces(text, stops, cuts):
    got, stopped = _feed(StopMatcher(stops), text, cuts)
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        assert stopped and got == text[: min(hits)]
    else:
        assert not stopped and got == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8), unchecked=st.integers(0, 40))
def test_unchecked_text_holds_no_stop_string_and_one_ending_after_it_counts(text, stops, cuts, unchecked):
    """`min_tokens`' text comes unchecked: the output ends before the earliest stop string that ends past it
    (vLLM's rule), however both parts are split into pieces."""
    unchecked = min(unchecked, len(text))
    hits = [i for i in (text.find(s, max(0, unchecked - len(s) + 1)) for s in stops) if i >= 0]
    assert _feed(StopMatcher(stops), text, cuts, unchecked) == ((text[: min(hits)], True) if hits else (text, False))


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_a_kept_stop_string_ends_the_output_after_it_whatever_the_pieces(text, stops, cuts):
    """vLLM's include_stop_str_in_output: the output runs through the earliest stop string (the longest of those
    beginning there), however the text is split."""
    hits = [(text.find(s), -len(s)) for s in stops if s in text]
    start, minus_len = min(hits) if hits else (len(text), 0)
    assert _feed(StopMatcher(stops, include=True), text, cuts) == (text[: start - minus_len], bool(hits))


def test_a_stop_string_begun_in_unchecked_text_cuts_where_it_begins():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a STOP b ST", checked=False).text == "a STOP b "  # the first is within min_tokens
    assert matcher.feed("OP c") == StopResult("", True)  # this one ends after: it counts from where it began
    with pytest.raises(ValueError, match="unchecked text after checked text"):
        matcher.feed("x", checked=False)


def test_a_partial_stop_string_is_held_back_then_released():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ST").text == "hello "  # "ST" could begin STOP
    assert matcher.feed("ONE").text == "STONE"  # it did not
    assert matcher.feed("xx S").text == "xx "
    result = matcher.feed("TOP and more")
    assert result.stopped and result.text == ""
    assert matcher.flush().text == ""


def test_a_later_stop_string_that_starts_earlier_wins():
    matcher = StopMatcher(["a", "baa"])
    assert matcher.feed("ba").text == ""  # "a" matched, but "baa" may be beginning at 0
    assert matcher.feed("a!") == StopResult("", True)  # it was "baa"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_incremental_detokenization_equals_decoding_the_whole_sequence(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    texts = ["plain words and the river", "caf\u00e9 \u00fcber na\u00efve \u2014 \u20ac5 \U0001f600 done"]
    sequences = [tokenizer.encode(t) for t in texts]
    sequences += [[rng.randrange(7, vocab) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    for ids in sequences:
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add([t]) for t in ids]
        streamed = "".join(pieces) + detok.flush()
        assert streamed == tokenizer.decode(ids), ids
        if "\ufffd" not in tokenizer.decode(ids):  # valid UTF-8: a split character is held, never sent broken
            assert not any("\ufffd" in p for p in pieces)
    assert len(sequences[1]) > len(texts[1].split())  # the accented text really is split into byte tokens


def test_bad_words_become_token_sequences_by_vllms_rule(tokenizer):
    """vLLM's `bad_words`: each word as the tokenizer encodes it (leading spaces stripped, no special tokens), and
    its encoding after a space where that is another sequence of as many tokens (so the word is kept out in the
    middle of the text too); a spaced encoding of another length is left out, as vLLM leaves it."""
    from scheduler.server.generation import bad_words_ids

    def enc(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    for word in ("river", " garden", "the scheduler", "caf\u00e9"):
        bare, spaced = enc(word.lstrip()), enc(" " + word.lstrip())
        want = (bare, spaced) if len(spaced) == len(bare) and spaced[0] != bare[0] else (bare,)
        assert bad_words_ids(tokenizer, [word]) == want, word
    assert len(bad_words_ids(tokenizer, ["caf\u00e9"])) == 2 and len(bad_words_ids(tokenizer, ["river"])) == 1


def test_an_engine_refusal_names_the_request_field_it_came_from():
    """The engine's InvalidRequest fields, as the client sent them: an adapter the engine no longer has (unloaded
    between the server's model check and the submission) is the `model` field; bad words are `bad_words`; a chat's
    prompt is its `messages`."""
    from scheduler import InvalidRequest
    from scheduler.server.generation import refusal
    from scheduler.server.protocol import ChatCompletionRequest, CompletionRequest

    completion = CompletionRequest(prompt="hi", bad_words=["x"])
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert refusal(completion, InvalidRequest("lora", "no adapter 'three'")).param == "model"
    assert refusal(completion, InvalidRequest("bad_words_ids", "ids outside")).param == "bad_words"
    assert refusal(chat, InvalidRequest("prompt", "empty prompt")).param == "messages"
    assert refusal(chat, InvalidRequest("lora", "no adapter 'three'")).message == "model: no adapter 'three'"


def test_a_responses_request_runs_as_the_chat_completion_of_the_same_conversation():
    """`to_chat`: instructions are the first system message, a developer message a system one, an assistant
    message and the calls after it one assistant turn (text and tool_calls), each call's output a tool message
    answering its call id, reasoning sent back dropped, image parts image_url parts; tools, tool_choice,
    text.format and max_output_tokens become the chat's fields."""
    from scheduler.server.responses import ResponsesRequest, to_chat

    body = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "id": "msg_1", "status": "completed", "phase": None, "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                  {"type": "function", "name": "get_time", "description": "Time."}],
        "tool_choice": {"type": "function", "name": "get_time"}})
    chat = to_chat(body)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "noon", "tool_call_id": "c2"}]
    assert chat.token_limit() == (7, "max_completion_tokens") and chat.temperature == 0
    assert [t.function.name for t in chat.tools] == ["get_weather", "get_time"]
    assert chat.tool_choice.function.name == "get_time"
    # settings a client leaves unset (null, false, an object of nulls) ask for nothing
    unset = to_chat(ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": None, "summary": None},
                                                     "background": False, "previous_response_id": None}))
    assert [m.content for m in unset.messages] == ["hi"]
    # reasoning effort reaches the chat template (effort "none" as enable_thinking false too); the request's own
    # chat_template_kwargs take precedence
    effort = to_chat(ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"}}))
    assert effort.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    both = to_chat(ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"},
                                                    "chat_template_kwargs": {"enable_thinking": True}}))
    assert both.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": True}
    formatted = to_chat(ResponsesRequest.model_validate({"input": "hi", "text": {
        "format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}, "verbosity": None}}))
    assert formatted.response_format.json_schema.name == "w" and formatted.messages[0].content == "hi"

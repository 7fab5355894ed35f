"""Tool calling and reasoning through `mlxsched serve`, end to end: the `text-tools` tiny model
(scheduler/fixtures/tool_calling.py, trained to answer a few chats word for word; a thinking model, whose
template opens the reasoning in the prompt) behind the real server in a subprocess, driven with the official
`openai` client. Calls and reasoning are parsed out of what the model really generated (each answer is first
checked against `mlx_lm.generate` alone on the same rendered prompt), streamed and not: reasoning then a call,
text before two calls, a chat sent back with the calls and the tool's result, thinking turned off
(`enable_thinking` / `chat_template_kwargs`), calls forced by tool_choice "required" or a named function, output
formats (`response_format`, `structured_outputs`) after the reasoning, and the refusals (an unknown named
function, a forced call with an output format, a model without a tool-call format, tool messages without an id,
template arguments the engine sets itself). Then forced calls in each call markup of mlx-lm's tool parsers: end to
end on the tiny text model with a template of that markup, sampled under each markup's grammar with every
parameter type, and at the grammar itself (the markup as the model's template renders it is allowed, string values
end and are never a "null" the parser would read as None, no JSON value holds one of the markup's markers). And
/tokenize renders each chat as its completion does. The same chats through OpenAI's Responses API
(`/v1/responses`): reasoning, message and function_call items, streamed and not, sent back as items or continued by
previous_response_id from the server's response store, and what it cannot honour refused by name.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.fixtures.tool_calling import CHATS, TOOLS, template_messages

from scheduler.server.tool_calls import CallShape, ToolCallFormat, ToolCallSplitter

from .test_serve import _http, _start, _stop, _wait_healthy

CHAT = {chat.name: chat for chat in CHATS}
STORED = 3  # the tools server keeps the last 3 Responses API responses


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    from scheduler.fixtures.tiny_models import build_model

    return build_model("text-tools", tmp_path_factory.mktemp("tiny-text-tools"))


@pytest.fixture(scope="module")
def server(tool_model_dir, text_model_dir, tmp_path_factory):
    import time

    tmp = tmp_path_factory.mktemp("serve-tools")
    tools = _start(tool_model_dir, tmp, "tools", "--responses-store", str(STORED))
    plain = _start(text_model_dir, tmp, "plain")  # the `text` kind: its template has no tool-call format
    try:
        for one in (tools, plain):
            _wait_healthy(one, time.monotonic() + 120)
        yield tools, plain
    finally:
        _stop(tools)
        _stop(plain)


def test_the_model_answers_each_chat_alone_as_trained(tool_model_dir):
    """The ground truth of the tests below is what the model generates, not the fixture's text: mlx-lm alone on
    each chat's rendered prompt gives exactly its completion (and its tokenizer declares the JSON tool format)."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(tool_model_dir))
    assert tokenizer.has_tool_calling and (tokenizer.tool_call_start, tokenizer.tool_call_end) == (
        "<tool_call>", "</tool_call>")
    assert tokenizer.has_thinking and (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    for chat in CHATS:
        prompt = tokenizer.apply_chat_template(template_messages(chat.messages), add_generation_prompt=True,
                                               **chat.template_args())
        assert generate(model, tokenizer, prompt, max_tokens=256) == chat.completion, chat.name


async def _chat(client, chat, **kwargs):
    return await client.chat.completions.create(model="tiny-vlm", messages=list(chat.messages),
                                                tools=list(chat.tools) or openai.NOT_GIVEN, max_tokens=256,
                                                temperature=0, **kwargs)


async def _stream(client, chat, **kwargs):
    """(reasoning, content, tool calls assembled from their deltas by index, finish reason) of a streamed chat."""
    stream = await _chat(client, chat, stream=True, **kwargs)
    reasoning, content, calls, finish = "", "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                assert call.index not in calls, "each call arrives whole, in one delta"
                calls[call.index] = call
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def _named(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def _reasoning(message) -> str | None:
    return getattr(message, "reasoning_content", None)


def test_reasoning_then_a_call_streamed_or_not(server):
    """The prompt opens the reasoning, so the answer starts in it: the text up to `</think>` is
    reasoning_content, the call after it tool_calls, with no content."""
    tools, _ = server

    async def run():
        client = tools.client()
        whole = await _chat(client, CHAT["one-call"])
        streamed = await _stream(client, CHAT["one-call"])
        return whole, streamed

    whole, (reasoning, content, calls, finish) = asyncio.run(run())
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls"
    assert (_reasoning(choice.message), choice.message.content) == ("The user asks for the weather.\n", None)
    assert _named(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert choice.message.tool_calls[0].type == "function" and choice.message.tool_calls[0].id.startswith("call_")
    assert (reasoning, content, _named(calls), finish) == (
        "The user asks for the weather.\n", "", [("get_weather", {"city": "Paris"})], "tool_calls")


def test_text_before_two_calls_is_the_content(server):
    tools, _ = server

    async def run():
        client = tools.client()
        return await _chat(client, CHAT["text-and-two-calls"]), await _stream(client, CHAT["text-and-two-calls"])

    whole, (reasoning, content, calls, finish) = asyncio.run(run())
    want = [("get_weather", {"city": "Rome"}), ("get_time", {"city": "Rome"})]
    (choice,) = whole.choices
    assert (_reasoning(choice.message), choice.message.content, _named(choice.message.tool_calls),
            choice.finish_reason) == ("Two tools.\n", "Checking both.", want, "tool_calls")
    assert (reasoning, content, _named(calls), finish) == ("Two tools.\n", "Checking both.", want, "tool_calls")
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_parallel_tool_calls_false_returns_the_first_call_only(server):
    tools, _ = server
    whole = asyncio.run(_chat(tools.client(), CHAT["text-and-two-calls"], parallel_tool_calls=False))
    assert _named(whole.choices[0].message.tool_calls) == [("get_weather", {"city": "Rome"})]


def test_a_chat_sent_back_with_the_calls_and_the_result_is_answered_in_text(server):
    """The client sends the assistant's tool_calls (arguments as a JSON string) and the tool's result: the
    server renders them through the chat template (the prompt the model was trained on) and the answer is
    plain content."""
    tools, _ = server
    whole = asyncio.run(_chat(tools.client(), CHAT["after-the-result"]))
    (choice,) = whole.choices
    assert (_reasoning(choice.message), choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "The tool answered.\n", "It is sunny in Paris, 21 C.", None, "stop")


def test_tool_choice_none_offers_no_tools(server):
    """tool_choice "none": the template gets no tools (the `no-tools` chat's prompt), so the answer is text."""
    tools, _ = server
    whole = asyncio.run(_chat(tools.client(), CHAT["one-call"], tool_choice="none"))
    (choice,) = whole.choices
    assert (_reasoning(choice.message), choice.message.content, choice.finish_reason) == (
        "No tool to use.\n", "I cannot look that up.", "stop")


def test_thinking_turned_off_answers_without_reasoning(server):
    """enable_thinking false (vllm-mlx's field, or vLLM's chat_template_kwargs) reaches the template, which closes
    an empty reasoning in the prompt: the answer is content only, streamed or not."""
    tools, _ = server
    chat = CHAT["no-thinking"]

    async def run():
        client = tools.client()
        return (await _chat(client, chat, extra_body={"enable_thinking": False}),
                await _chat(client, chat, extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
                await _stream(client, chat, extra_body={"enable_thinking": False}))

    first, second, streamed = asyncio.run(run())
    for whole in (first, second):
        (choice,) = whole.choices
        assert (_reasoning(choice.message), choice.message.content, choice.finish_reason) == (
            None, "Paris is in France.", "stop")
    assert streamed == ("", "Paris is in France.", [], "stop")


def test_ignore_eos_runs_a_choice_past_the_models_end_to_max_tokens(server):
    """vLLM's `ignore_eos`: the chat the model ends early (finish "stop") runs on to max_tokens (finish "length"),
    its text beginning with the answer it ended before."""
    tools, _ = server
    chat = CHAT["no-thinking"]

    async def run(**extra):
        return await tools.client().chat.completions.create(
            model="tiny-vlm", messages=list(chat.messages), max_tokens=40, temperature=0,
            extra_body={"chat_template_kwargs": dict(chat.template_kwargs), **extra})

    ended, ran_on = asyncio.run(run()), asyncio.run(run(ignore_eos=True))
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 40
    assert ran_on.choices[0].finish_reason == "length" and ran_on.usage.completion_tokens == 40
    assert ran_on.choices[0].message.content.startswith(ended.choices[0].message.content)


def test_tokenize_renders_tools_and_template_arguments_as_a_chat_completion_does(server, tool_model_dir):
    """/tokenize of each chat (tools, a sent-back call and its result, enable_thinking) gives the ids mlx-lm's own
    rendering gives, which is the prompt the chat completion ran on (its usage counts them)."""
    from mlx_lm import load

    tools, _ = server
    _, tokenizer = load(str(tool_model_dir))
    for chat in CHATS:
        want = tokenizer.apply_chat_template(template_messages(chat.messages), add_generation_prompt=True,
                                             **chat.template_args())
        kwargs = {"chat_template_kwargs": dict(chat.template_kwargs)} if chat.template_kwargs else {}
        body = {"messages": list(chat.messages), **({"tools": list(chat.tools)} if chat.tools else {}), **kwargs}
        status, got = tools.post("/tokenize", body)
        assert status == 200, (chat.name, got)
        assert got["tokens"] == list(want), chat.name
        whole = asyncio.run(_chat(tools.client(), chat, extra_body=kwargs or None))
        assert whole.usage.prompt_tokens == got["count"], chat.name


def _status(exc: pytest.ExceptionInfo) -> tuple[int, str | None]:
    return exc.value.status_code, exc.value.body.get("param") if isinstance(exc.value.body, dict) else None


def test_what_cannot_be_honoured_is_refused_naming_the_field(server):
    tools, plain = server

    async def refused(srv, chat, **kwargs):
        with pytest.raises(openai.BadRequestError) as exc:
            await _chat(srv.client(), chat, **kwargs)
        return _status(exc)

    async def run():
        out = [await refused(tools, CHAT["one-call"], tool_choice={"type": "function", "function": {"name": "nope"}}),
               await refused(tools, CHAT["one-call"], tool_choice="required",
                             response_format={"type": "json_object"}),
               await refused(plain, CHAT["one-call"])]
        bad_history = [*CHAT["after-the-result"].messages[:2], {"role": "tool", "content": "sunny"}]
        with pytest.raises(openai.BadRequestError) as exc:
            await tools.client().chat.completions.create(model="tiny-vlm", messages=bad_history, max_tokens=4)
        out.append(_status(exc))
        return out

    assert asyncio.run(run()) == [(400, "tool_choice"), (400, "tool_choice"), (400, "tools"), (400, "messages.2")]
    status, body = tools.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"})
    assert (status, body["error"]["param"]) == (400, "tool_choice")  # tool_choice without tools
    for extra, param in (({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         ({"enable_thinking": "yes"}, "enable_thinking")):
        status, body = tools.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
        assert (status, body["error"]["param"]) == (400, param)
    bad_arguments = [CHAT["after-the-result"].messages[0],
                     {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "get_weather", "arguments": "{"}}]}]
    status, body = tools.post("/v1/chat/completions", {"messages": bad_arguments})
    assert (status, body["error"]["param"]) == (400, "messages.1.tool_calls.0.function.arguments")
    assert tools.get("/health")[0] == 200


def test_the_engine_renders_tools_into_the_chat_template_and_refuses_them_elsewhere(tool_model_dir):
    """`Engine.add_request(tools=..., chat_template_kwargs=...)`: the prompt is the tokenizer's own rendering with
    them (the trace records it), and each request's greedy output is its trained completion; tools or template
    arguments without chat messages, of the wrong type or setting what the engine sets are refused naming the
    argument; a template that fails on the messages is refused naming `prompt`. (A vision-language model's:
    tests/models/test_vlm_tools.py.)"""
    from mlx_lm import load

    from scheduler import Engine, EngineConfig, InvalidRequest, SamplingParams

    from ..helpers import drive, engine_with_log

    model, tokenizer = load(str(tool_model_dir))
    chat = CHAT["text-and-two-calls"]
    engine, log = engine_with_log(model, tokenizer, EngineConfig())
    off = CHAT["no-thinking"]
    run = drive(engine, [(0, {"prompt": template_messages(chat.messages), "tools": list(chat.tools),
                              "sampling": SamplingParams(max_tokens=256), "request_id": "r"}),
                         (0, {"prompt": list(off.messages), "chat_template_kwargs": dict(off.template_kwargs),
                              "sampling": SamplingParams(max_tokens=256), "request_id": "off"})])
    arrivals = {e["request_id"]: e["prompt_tokens"] for e in log.of_kind("arrival")}
    assert arrivals["r"] == tokenizer.apply_chat_template(template_messages(chat.messages), tools=list(chat.tools),
                                                          add_generation_prompt=True)
    assert arrivals["off"] == tokenizer.apply_chat_template(list(off.messages), add_generation_prompt=True,
                                                            enable_thinking=False) != tokenizer.apply_chat_template(
        list(off.messages), add_generation_prompt=True)
    for rid, want in (("r", chat.completion), ("off", off.completion)):
        assert tokenizer.decode(run.tokens[rid][:-1]) == want and run.tokens[rid][-1] in tokenizer.eos_token_ids
    for bad, name in ((dict(prompt="a string", tools=TOOLS), "tools"),
                      (dict(prompt=[{"role": "user", "content": "hi"}], tools="x"), "tools"),
                      (dict(prompt_tokens=[1, 2, 3], tools=TOOLS), "tools"),
                      (dict(prompt="a string", chat_template_kwargs={"enable_thinking": False}), "chat_template_kwargs"),
                      (dict(prompt=[{"role": "user", "content": "hi"}], chat_template_kwargs={"tokenize": False}),
                       "chat_template_kwargs"),
                      (dict(prompt=[{"role": "user", "content": "hi"}], chat_template_kwargs=["x"]),
                       "chat_template_kwargs")):
        with pytest.raises(InvalidRequest) as info:
            engine.add_request(**bad)
        assert info.value.field == name
    with pytest.raises(InvalidRequest) as info:
        engine.add_request(prompt=[{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
                           tools=TOOLS)  # a call without a name: the template fails on it
    assert info.value.field == "prompt" and "chat template" in str(info.value)
    assert not engine.has_pending()
    engine.close()


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_tool_choice_required_forces_calls_after_free_reasoning(server):
    """tool_choice "required": the answer is calls, each to an offered tool with arguments its schema accepts.
    The reasoning stays free (the constraint starts after `</think>`), so it is the model's own, and where the
    model calls anyway the forced answer is the one it gives unforced. Streamed equals not streamed."""
    tools, _ = server

    async def run():
        client = tools.client()
        natural = await _chat(client, CHAT["one-call"], tool_choice="required")
        forced = await _chat(client, CHAT["after-the-result"], tool_choice="required")
        streamed = await _stream(client, CHAT["after-the-result"], tool_choice="required")
        return natural, forced, streamed

    natural, forced, (reasoning, content, calls, finish) = asyncio.run(run())
    (choice,) = natural.choices
    assert (_reasoning(choice.message), _named(choice.message.tool_calls), choice.finish_reason) == (
        "The user asks for the weather.\n", [("get_weather", {"city": "Paris"})], "tool_calls")
    (choice,) = forced.choices  # unforced, this chat is answered in text ("It is sunny in Paris, 21 C.")
    assert _reasoning(choice.message) == "The tool answered.\n" and not choice.message.content
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for name, arguments in _named(choice.message.tool_calls):
        jsonschema.validate(arguments, _schema_of(name))
    assert (reasoning, content, _named(calls), finish) == (
        "The tool answered.\n", "", _named(choice.message.tool_calls), "tool_calls")


def test_a_named_tool_choice_makes_one_call_of_that_tool(server):
    tools, _ = server
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = asyncio.run(_chat(tools.client(), CHAT["text-and-two-calls"], tool_choice=named))
    (choice,) = whole.choices
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), _schema_of("get_time"))
    assert _reasoning(choice.message) == "Two tools.\n" and not choice.message.content


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


def test_output_formats_hold_for_chat_and_completions(server):
    """response_format (json_schema, json_object) and vLLM's structured_outputs (choice, regex) on the plain
    model, for chat and completions, streamed and not; on the thinking model after its free reasoning."""
    tools, plain = server
    schema_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    async def run():
        client, out = plain.client(), {}
        out["schema"] = await client.chat.completions.create(model="tiny-vlm", messages=ask, max_tokens=64,
                                                             temperature=0, response_format=schema_format)
        stream = await client.chat.completions.create(model="tiny-vlm", messages=ask, max_tokens=64, temperature=0,
                                                      response_format=schema_format, stream=True)
        out["schema-streamed"] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        out["object"] = await client.chat.completions.create(model="tiny-vlm", messages=ask, max_tokens=8,
                                                             temperature=0, response_format={"type": "json_object"})
        out["choice"] = await client.completions.create(model="tiny-vlm", prompt="The city is", max_tokens=8,
                                                        temperature=0, extra_body={"structured_outputs": {
                                                            "choice": ["Paris", "Rome", "New York"]}})
        out["regex"] = await client.completions.create(model="tiny-vlm", prompt="Code:", max_tokens=12, temperature=0.8,
                                                       seed=3, n=2, extra_body={"structured_outputs": {
                                                           "regex": "[A-Z]{2}-[0-9]{3}"}})
        out["thinking"] = await _chat(tools.client(), CHAT["no-tools"], response_format=schema_format)
        return out

    out = asyncio.run(run())
    text = out["schema"].choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out["schema"].choices[0].finish_reason == "stop" and out["schema-streamed"] == text
    assert out["object"].choices[0].message.content.startswith("{")
    assert out["choice"].choices[0].text in ("Paris", "Rome", "New York")
    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.text) for c in out["regex"].choices)
    (choice,) = out["thinking"].choices
    assert _reasoning(choice.message) == "No tool to use.\n"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_output_formats_the_server_cannot_honour_are_refused_naming_the_field(server):
    tools, plain = server
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, param in (
            ({"response_format": {"type": "json_schema"}}, "response_format"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
             "response_format"),
            ({"structured_outputs": {"regex": "([", "choice": ["a"]}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
            ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
            ({"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
             "structured_outputs"),
            ({"tools": TOOLS, "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs")):
        status, body = tools.post("/v1/chat/completions", {**ask, **extra})
        assert (status, body["error"]["param"]) == (400, param), (extra, body)
    status, body = plain.post("/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                                  "response_format": {"type": "json_object", "x": 1}})
    assert (status, body["error"]["param"]) == (400, "response_format.x")
    assert tools.get("/health")[0] == 200 and plain.get("/health")[0] == 200


# ---- the Responses API (`POST /v1/responses`): the same chats, as a Responses client sends and reads them ------


def _responses_input(messages) -> list[dict]:
    """A chat's messages as Responses API input items: a sent-back call is a `function_call` item, the tool's
    answer a `function_call_output`."""
    items = []
    for message in messages:
        if message.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
        elif message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})
        else:
            items.append({"role": message["role"], "content": message["content"]})
    return items


def _responses_kwargs(chat, **extra) -> dict:
    kwargs = {"model": "tiny-vlm", "input": _responses_input(chat.messages), "max_output_tokens": 256,
              "temperature": 0, **extra}
    if chat.tools:
        kwargs["tools"] = [{"type": "function", **tool["function"]} for tool in chat.tools]
    if chat.template_kwargs:
        kwargs["extra_body"] = {"chat_template_kwargs": dict(chat.template_kwargs)}
    return kwargs


def _items(response) -> list[tuple]:
    """A response's output as (kind, its text or (name, arguments))."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", (item.name, json.loads(item.arguments))))
    return out


def test_the_responses_api_answers_each_chat_as_its_chat_completion(server):
    """Each chat through /v1/responses, whole and streamed (the SDK's own stream accumulator): the reasoning is a
    reasoning item, the content a message, each call a function_call item, in the order the model wrote them,
    and the same as the chat completion of the same chat (checked against mlx-lm alone in the tests above);
    a call and its result sent back as items are answered as the chat sent back with them. The stream's deltas
    add up to the final items, its sequence numbers count from 0, and the usage is the chat completion's."""
    tools, _ = server

    async def run():
        client, out = tools.client(), {}
        for chat in CHATS:
            chat_args = {"chat_template_kwargs": dict(chat.template_kwargs)} if chat.template_kwargs else {}
            completion = await _chat(client, chat, extra_body=chat_args or None)
            whole = await client.responses.create(**_responses_kwargs(chat))
            events = []
            async with client.responses.stream(**_responses_kwargs(chat)) as stream:
                async for event in stream:
                    events.append(event)
                streamed = await stream.get_final_response()
            out[chat.name] = completion, whole, streamed, events
        return out

    for name, (completion, whole, streamed, events) in asyncio.run(run()).items():
        message = completion.choices[0].message
        want = ([("reasoning", _reasoning(message))] if _reasoning(message) else []) + (
            [("message", message.content)] if message.content is not None or not message.tool_calls else []) + [
            ("function_call", call) for call in _named(message.tool_calls or [])]
        assert _items(whole) == _items(streamed) == want, name
        assert whole.status == streamed.status == "completed"
        assert whole.output_text == (message.content or "")
        calls = [item.call_id for item in whole.output if item.type == "function_call"]
        assert len(set(calls)) == len(calls) and all(calls)
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
            completion.usage.prompt_tokens, completion.usage.completion_tokens), name
        assert (whole.usage.output_tokens_details.reasoning_tokens > 0) == bool(_reasoning(message))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == (
            _reasoning(message) or "")


def test_a_responses_output_sent_back_with_the_tools_answer_is_answered_in_text(server):
    """The Responses client's loop: the first answer's output items (reasoning, the call) sent back as they came
    (`model_dump`), with a `function_call_output` answering the call, get the answer the chat sent back with the
    call and the result gets ("after-the-result")."""
    tools, _ = server
    chat = CHAT["one-call"]

    async def run():
        client = tools.client()
        first = await client.responses.create(**_responses_kwargs(chat))
        (call,) = [item for item in first.output if item.type == "function_call"]
        kwargs = _responses_kwargs(chat)
        kwargs["input"] += [item.model_dump(exclude_none=True) for item in first.output] + [
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
        return await client.responses.create(**kwargs)

    second = asyncio.run(run())
    answer = CHAT["after-the-result"].completion.split("</think>\n\n")[1]
    assert _items(second) == [("reasoning", "The tool answered.\n"), ("message", answer)]


def test_reasoning_effort_none_turns_a_thinking_models_reasoning_off(server):
    """`reasoning: {"effort": "none"}` reaches the chat template as enable_thinking false: the chat is answered as
    with thinking turned off ("no-thinking"), with no reasoning item; another effort leaves the reasoning on."""
    tools, _ = server
    chat = CHAT["no-thinking"]
    kwargs = {**_responses_kwargs(chat)}
    kwargs.pop("extra_body")

    async def run():
        client = tools.client()
        return (await client.responses.create(**kwargs, reasoning={"effort": "none"}),
                await client.responses.create(**kwargs, reasoning={"effort": "high"}))

    off, on = asyncio.run(run())
    assert _items(off) == [("message", chat.completion)] and off.reasoning.effort == "none"
    assert [kind for kind, _ in _items(on)][0] == "reasoning"


def test_a_stored_response_is_continued_by_previous_response_id_read_back_and_deleted(server):
    """With --responses-store N: a response is kept (its input and output) unless `store: false`; the next turn
    sends only the tool's output with `previous_response_id` and is answered as the whole chat sent back
    ("after-the-result"), and a third turn continues that chain; GET /v1/responses/{id} reads a kept response back,
    DELETE forgets it. The store keeps the last N: an evicted or deleted response, or one whose chain lost a
    response, cannot be continued (a 400 naming previous_response_id), and a server without a store refuses the
    field."""
    tools, plain = server
    chat = CHAT["one-call"]
    answer = CHAT["after-the-result"].completion.split("</think>\n\n")[1]

    async def run():
        client, out = tools.client(), {}
        out["first"] = first = await client.responses.create(**_responses_kwargs(chat))
        (call,) = [item for item in first.output if item.type == "function_call"]
        out["second"] = second = await client.responses.create(
            model="tiny-vlm", previous_response_id=first.id, max_output_tokens=256, temperature=0,
            tools=_responses_kwargs(chat)["tools"],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        out["read"] = await client.responses.retrieve(first.id)
        out["unstored"] = await client.responses.create(**_responses_kwargs(chat), store=False)
        return out

    out = asyncio.run(run())
    first, second = out["first"], out["second"]
    assert first.store and second.store and not out["unstored"].store
    assert second.previous_response_id == first.id
    assert _items(second) == [("reasoning", "The tool answered.\n"), ("message", answer)]
    assert out["read"].id == first.id and _items(out["read"]) == _items(first)
    status, _ = tools.get(f"/v1/responses/{out['unstored'].id}")
    assert status == 404
    # a third turn continues the chain (first, second): its prompt is the whole conversation so far
    status, third = tools.post("/v1/responses", {"model": "tiny-vlm", "previous_response_id": second.id,
                                                 "input": "Thanks.", "max_output_tokens": 4, "temperature": 0})
    assert status == 200 and third["usage"]["input_tokens"] > second.usage.input_tokens
    status, deleted = _http("DELETE", f"{tools.base_url}/v1/responses/{first.id}")
    assert (status, json.loads(deleted)) == (200, {"id": first.id, "object": "response", "deleted": True})
    assert tools.get(f"/v1/responses/{first.id}")[0] == 404
    assert _http("DELETE", f"{tools.base_url}/v1/responses/{first.id}")[0] == 404
    status, error = tools.post("/v1/responses", {"previous_response_id": second.id, "input": "again"})
    assert (status, error["error"]["param"]) == (400, "previous_response_id")
    assert f"continues {first.id!r}" in error["error"]["message"]
    # eviction: STORED more responses push `second` out
    for _ in range(STORED):
        status, _ = tools.post("/v1/responses", {"input": "hi", "max_output_tokens": 2})
        assert status == 200
    assert tools.get(f"/v1/responses/{second.id}")[0] == 404
    status, error = plain.post("/v1/responses", {"previous_response_id": second.id, "input": "again"})
    assert (status, error["error"]["param"]) == (400, "previous_response_id")
    assert "keeps no responses" in error["error"]["message"]


def test_the_responses_api_takes_output_formats_and_ends_incomplete_at_max_output_tokens(server):
    """text.format json_schema constrains the answer as the chat's response_format does (after the free
    reasoning); max_output_tokens cuts it: status "incomplete", reason "max_output_tokens", the text the chat
    completion cut at the same max_tokens shows."""
    tools, _ = server
    chat = CHAT["no-tools"]
    schema = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}}

    async def run():
        client = tools.client()
        formatted = await client.responses.create(**_responses_kwargs(chat, text=schema))
        chat_formatted = await _chat(client, chat, response_format={"type": "json_schema", "json_schema": {
            "name": "weather", "schema": SCHEMA}})
        cut = await client.responses.create(**_responses_kwargs(chat, max_output_tokens=20))
        chat_cut = await client.chat.completions.create(model="tiny-vlm", messages=list(chat.messages),
                                                        max_tokens=20, temperature=0)
        return formatted, chat_formatted, cut, chat_cut

    formatted, chat_formatted, cut, chat_cut = asyncio.run(run())
    jsonschema.validate(json.loads(formatted.output_text), SCHEMA)
    assert formatted.output_text == chat_formatted.choices[0].message.content
    assert chat_cut.choices[0].finish_reason == "length"
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert _items(cut)[0] == ("reasoning", _reasoning(chat_cut.choices[0].message))
    assert cut.usage.output_tokens == 20


def test_what_the_responses_api_cannot_honour_here_is_refused_naming_the_field(server):
    tools, _ = server
    ask = {"model": "tiny-vlm", "input": "hi", "max_output_tokens": 4}
    for extra, param in (
            ({"previous_response_id": "resp_1"}, "previous_response_id"),
            ({"background": True}, "background"),
            ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
            ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
            ({"truncation": "auto"}, "truncation"),
            ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "input.0.content.0"),
            ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input.0.type"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input.0.output"),
            ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
            ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
            ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
             "tool_choice"),
            ({"text": {"format": {"type": "xml"}}}, "text.format"),
            ({"include": ["file_search_call.results"]}, "include"),
            ({"max_output_tokens": 0}, "max_output_tokens"),
            ({"input": ""}, "input"),
            ({"model": "other"}, "model")):
        status, body = tools.post("/v1/responses", {**ask, **extra})
        assert (status, body["error"]["param"]) == (404 if param == "model" else 400, param), (extra, body)
    assert tools.get("/health")[0] == 200


# Call markups other than JSON between markers, each a minimal template of its shape on the tiny text model's
# weights, from which mlx-lm infers its parser: Mistral's `[TOOL_CALLS]name[ARGS]{...}` (no end marker; `mistral`),
# the pythonic `<|tool_call_start|>[name(x=...)]<|tool_call_end|>` (`pythonic`: LFM2, Llama), Qwen3-Coder's
# `<tool_call>` / `<function=name>` / `<parameter=x>` lines (`qwen3_coder`), FunctionGemma's and Gemma 4's
# `call:name{key:value}` (`function_gemma`, `gemma4`)
_TURNS = ("{%- for message in messages -%}"
          "{%- if message['role'] == 'user' -%}[INST]{{- message['content'] -}}[/INST]"
          "{%- elif message['role'] == 'assistant' -%}{{- message['content'] or '' -}}CALLS<|im_end|>"
          "{%- elif message['role'] == 'tool' -%}[TOOL_RESULTS]{{- message['content'] -}}[/TOOL_RESULTS]"
          "{%- endif -%}"
          "{%- endfor -%}")


def _template(tools_open: str, tools_close: str, calls: str) -> str:
    """A template that lists the tools' names between the two markers and writes an assistant's calls so."""
    listed = "{{- tools | map(attribute='function.name') | join(',') -}}"
    return "{%- if tools -%}" + tools_open + listed + tools_close + "{%- endif -%}" + _TURNS.replace("CALLS", calls)


MARKUPS = {  # name -> (template, (start marker, end marker, shape) mlx-lm's parser for it declares)
    "mistral": (_template("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "{%- for call in message['tool_calls'] or [] -%}[TOOL_CALLS]{{- call.function.name -}}"
                          "[ARGS]{{- call.function.arguments | tojson -}}{%- endfor -%}"),
                ("[TOOL_CALLS]", "", CallShape.NAME_ARGS)),
    "pythonic": (_template("<|tool_list_start|>", "<|tool_list_end|>",
                           "{%- if message['tool_calls'] -%}<|tool_call_start|>[{%- for call in message['tool_calls']"
                           " -%}{{- call.function.name -}}(){%- endfor -%}]<|tool_call_end|>{%- endif -%}"),
                 ("<|tool_call_start|>", "<|tool_call_end|>", CallShape.PYTHONIC)),
    "qwen3_coder": (_template("<tools>", "</tools>",
                              "{%- for call in message['tool_calls'] or [] -%}<tool_call>\n<function="
                              "{{- call.function.name -}}>\n</function>\n</tool_call>{%- endfor -%}"),
                    ("<tool_call>", "</tool_call>", CallShape.XML_PARAMETERS)),
    "function_gemma": (_template("<start_function_declaration>", "<end_function_declaration>",
                                 "{%- for call in message['tool_calls'] or [] -%}<start_function_call>call:"
                                 "{{- call.function.name -}}{}<end_function_call>{%- endfor -%}"),
                       ("<start_function_call>", "<end_function_call>", CallShape.FUNCTION_GEMMA)),
    "gemma4": (_template("<|tool>", "<tool|>", "{%- for call in message['tool_calls'] or [] -%}<|tool_call>call:"
                                               "{{- call.function.name -}}{}<tool_call|>{%- endfor -%}"),
               ("<|tool_call>", "<tool_call|>", CallShape.GEMMA4)),
    "glm47": (_template("<tools>", "</tools>", "{%- for call in message['tool_calls'] or [] -%}<tool_call>"
                                               "{{- call.function.name -}}{%- for k, v in call.function.arguments"
                                               ".items() -%}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>"
                                               "{%- endfor -%}</tool_call>{%- endfor -%}"),
              ("<tool_call>", "</tool_call>", CallShape.ARG_KEY)),
    "minimax_m2": (_template("<tools>", "</tools>", "{%- if message['tool_calls'] -%}<minimax:tool_call>\n"
                                                    "{%- for call in message['tool_calls'] -%}<invoke name=\""
                                                    "{{- call.function.name -}}\">\n</invoke>\n{%- endfor -%}"
                                                    "</minimax:tool_call>{%- endif -%}"),
                   ("<minimax:tool_call>", "</minimax:tool_call>", CallShape.INVOKE)),
    "kimi_k2": (_template("<tools>", "</tools>", "{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>"
                                                 "{%- for call in message['tool_calls'] -%}<|tool_call_begin|>"
                                                 "functions.{{- call.function.name -}}:{{ loop.index0 }}"
                                                 "<|tool_call_argument_begin|>{}<|tool_call_end|>{%- endfor -%}"
                                                 "<|tool_calls_section_end|>{%- endif -%}"),
                ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", CallShape.KIMI)),
    "minicpm5": (_template("<tools>", "</tools>", "{%- for call in message['tool_calls'] or [] -%}<function name=\""
                                                  "{{- call.function.name -}}\"><param name=\"x\">1</param>"
                                                  "</function>{%- endfor -%}"),
                 ("<function name=", "</function>", CallShape.PARAM_TAGS)),
    "longcat": (_template("<tools>", "</tools>", "{%- for call in message['tool_calls'] or [] -%}<longcat_tool_call>"
                                                 "{{- call.function.name -}}<longcat_arg_key>x</longcat_arg_key>"
                                                 "<longcat_arg_value>1</longcat_arg_value></longcat_tool_call>"
                                                 "{%- endfor -%}"),
                ("<longcat_tool_call>", "</longcat_tool_call>", CallShape.LONGCAT)),
    "muse_spark": (_template("<tools>", "</tools>", "{%- if message['tool_calls'] -%}<atem:function_calls>"
                                                    "{%- for call in message['tool_calls'] -%}<atem:invoke name=\""
                                                    "{{- call.function.name -}}\"></atem:invoke>{%- endfor -%}"
                                                    "</atem:function_calls>{%- endif -%}"),
                   ("<atem:function_calls>", "</atem:function_calls>", CallShape.ATEM)),
}


@pytest.fixture(scope="module")
def markup_model_dirs(text_model_dir, tmp_path_factory):
    """The tiny text model's weights with each markup's template."""
    import shutil

    from scheduler.fixtures.tiny_models import build_tokenizer

    dirs = {}
    for name, (template, _) in MARKUPS.items():
        out = dirs[name] = tmp_path_factory.mktemp(f"{name}-tools")
        for file in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            if (text_model_dir / file).exists():
                shutil.copy(text_model_dir / file, out / file)
        tokenizer = build_tokenizer()
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(out))
    return dirs


MARKUP_TOOLS = [{"type": "function", "function": {"name": name, "description": "a lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city"], "additionalProperties": False}}} for name in ("get_weather", "get_time")]


@pytest.mark.parametrize("markup", sorted(MARKUPS))
def test_forced_calls_in_each_markup_are_written_and_parsed(markup, markup_model_dirs, tmp_path):
    """tool_choice "required" (one call) and a named function on a model whose calls are written in another
    markup than JSON between markers: the grammar writes that markup with the offered tool's arguments (an enum
    and an optional bounded integer), the server parses the calls out with mlx-lm's parser for it, the
    arguments hold to the tool's schema, streamed equal to not streamed."""
    import time

    from mlx_lm import load

    model_dir = markup_model_dirs[markup]
    _, tokenizer = load(str(model_dir))
    fmt = ToolCallFormat.of(tokenizer)
    assert (fmt.start, fmt.end, fmt.shape) == MARKUPS[markup][1]
    server = _start(model_dir, tmp_path, markup)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    try:
        _wait_healthy(server, time.monotonic() + 120)

        async def run():
            client = server.client()
            args = dict(model="tiny-vlm", messages=messages, tools=MARKUP_TOOLS, max_tokens=200, temperature=0)
            forced = await client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **args)
            named = await client.chat.completions.create(
                tool_choice={"type": "function", "function": {"name": "get_time"}}, **args)
            calls, finish = {}, None
            async for chunk in await client.chat.completions.create(tool_choice="required", stream=True,
                                                                    parallel_tool_calls=False, **args):
                finish = chunk.choices[0].finish_reason or finish
                for delta in chunk.choices[0].delta.tool_calls or []:
                    calls[delta.index] = (delta.function.name, json.loads(delta.function.arguments))
            await client.close()
            return forced, named, (list(calls.values()), finish)

        forced, named, streamed = asyncio.run(run())
    finally:
        _stop(server)
    schema = MARKUP_TOOLS[0]["function"]["parameters"]
    (choice,) = forced.choices
    assert choice.message.tool_calls, choice.message.content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert choice.finish_reason == "tool_calls" and len(got) == 1 and got[0][0] in ("get_weather", "get_time")
    jsonschema.validate(got[0][1], schema)
    assert choice.message.content is None
    assert streamed == (got, "tool_calls")
    (named_choice,) = named.choices
    assert [c.function.name for c in named_choice.message.tool_calls] == ["get_time"]
    assert named_choice.finish_reason == "tool_calls"
    for call in named_choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_tool_the_markup_cannot_write_is_refused_by_name():
    """A forced call whose tool the model's markup cannot write back (a parameter name that is not a Python
    identifier in `[name(x=...)]`; a parameter whose type is a list of types in `<parameter=x>` lines and
    `<parameter name="x">` lines, or `anyOf` in `<param name="x">`, whose parsers merge the types; an enum of
    mixed types; a name with whitespace in `<arg_key>` or a string enum value that GLM's parser would strip; an
    object in FunctionGemma's `call:name{...}`; a tool name that is not a Python name in `[name(...)]`) is
    refused with a 400 naming the parameter and the tool, before anything runs."""
    from mlx_lm.tool_parsers import function_gemma, pythonic, qwen3_coder

    from scheduler.server.constraints import output_constraint
    from scheduler.server.protocol import APIError, ChatCompletionRequest

    def tool(name, schema):
        return [{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {name: schema}}}}]

    cases = [(pythonic, tool("user-id", {"type": "string"}), "not an ASCII Python identifier"),
             (qwen3_coder, tool("when", {"type": ["string", "null"]}), "cannot write back exactly"),
             (function_gemma, tool("where", {"type": "object"}), "cannot write back")]
    renamed = [{"type": "function", "function": {**tool("x", {})[0]["function"], "name": "look-up"}}]
    cases.append((pythonic, renamed, "a name that [name(x=...)] cannot write"))
    from mlx_lm.tool_parsers import glm47, minicpm5, minimax_m2

    cases += [(minimax_m2, tool("when", {"type": ["string", "null"]}), "cannot write back exactly"),
              (minicpm5, tool("when", {"anyOf": [{"type": "string"}, {"type": "integer"}]}), "cannot write back"),
              (minimax_m2, tool("mode", {"enum": ["a", 1]}), "cannot write back exactly"),
              (glm47, tool("in city", {"type": "string"}), "which <arg_key>x</arg_key> cannot write"),
              (glm47, tool("mode", {"type": "string", "enum": [" padded"]}), "cannot write back exactly")]
    for module, tools, why in cases:
        fmt = ToolCallFormat(module.tool_call_start, module.tool_call_end, module.parse_tool_call)
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "look it up"}], tools=tools,
                                     tool_choice="required")
        with pytest.raises(APIError) as info:
            output_constraint(body, fmt, tools, None)
        assert info.value.status == 400 and info.value.param == "tool_choice"
        assert why in str(info.value) and tools[0]["function"]["name"] in str(info.value)


def _markup(name: str) -> ToolCallFormat:
    import importlib

    parser = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolCallFormat(parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call)


def _forced(fmt: ToolCallFormat, tools: list[dict]):
    from scheduler.server.constraints import output_constraint
    from scheduler.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "call"}], tools=tools,
                                 tool_choice="required")
    return output_constraint(body, fmt, tools, None)


def _accepts(tokenizer, constraint, text: str) -> bool:
    """Whether the grammar of ``constraint`` allows ``text`` as the whole output."""
    from llguidance import LLMatcher

    from scheduler.execution.structured import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer.get_vocab()), [tokenizer.eos_token_id])
    matcher = LLMatcher(compiler.ll_tokenizer, compiler.compile(constraint), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


# A call as each markup's model writes it (its template's rendering, GLM 4.7's and 4.5's: without and with
# newlines between the parts), which the forced-call grammar must allow: a forced call is the model's own markup
RENDERED = {
    "glm47": ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
              "<arg_value>3</arg_value></tool_call>",
              "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
              "\n<arg_value>3</arg_value>\n</tool_call>"],
    "minimax_m2": ['<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'],
    "kimi_k2": ['<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'],
    "minicpm5": ['<function name="get_weather"><param name="city">Paris</param><param name="days">3</param>'
                 '</function>'],
    "longcat": ["<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris"
                "</longcat_arg_value><longcat_arg_key>days</longcat_arg_key><longcat_arg_value>3</longcat_arg_value>"
                "</longcat_tool_call>",
                "<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n<longcat_arg_value>Paris"
                "</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n<longcat_arg_value>3"
                "</longcat_arg_value>\n</longcat_tool_call>"],
    # (values JSON: Muse Spark's parser reads JSON first, so a string written raw could come back a number)
    "muse_spark": ['<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter name="city">"Paris"'
                   '</atem:parameter>\n<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>\n'
                   '</atem:function_calls>'],
    # (its parser's own example, indented, and the same without whitespace)
    "kimi_k3": ['<|open|>tools<|sep|>\n  <|open|>call tool="get_weather" index="1"<|sep|>\n    <|open|>argument '
                'key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>\n    <|open|>argument key="days" '
                'type="integer"<|sep|>3<|close|>argument<|sep|>\n  <|close|>call<|sep|>\n<|close|>tools<|sep|>',
                '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
                'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" type="integer"<|sep|>3'
                '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'],
}


@pytest.mark.parametrize("markup", sorted(RENDERED))
def test_a_forced_call_may_be_written_as_the_model_writes_it(markup):
    """The grammar of a forced call allows the call as the model's own template renders it, and mlx-lm's parser
    reads that back to the call; the same call as JSON between the markers (which GLM's and LongCat's parsers
    also read, and which the grammar wrote for GLM before) is not allowed."""
    from scheduler.fixtures.tiny_models import build_tokenizer
    from scheduler.server.tool_calls import ToolCallSplitter

    tokenizer = build_tokenizer()
    fmt = _markup(markup)
    constraint = _forced(fmt, MARKUP_TOOLS)
    for text in RENDERED[markup]:
        assert _accepts(tokenizer, constraint, text), text
        splitter = ToolCallSplitter(fmt, MARKUP_TOOLS)
        first, last = splitter.feed(text), splitter.finish()
        assert not (first.content + last.content).strip()
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first.calls + last.calls] \
            == [("get_weather", {"city": "Paris", "days": 3})]
    as_json = fmt.start + "\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) + "\n" + fmt.end
    assert not _accepts(tokenizer, constraint, as_json)


STRING_NULL_MARKUPS = {"glm47", "longcat"}  # markups whose parsers keep a string parameter's "null" a string


@pytest.mark.parametrize("markup", ["qwen3_coder", "minimax_m2", "minicpm5", "glm47", "longcat"])
def test_a_free_string_value_ends_and_is_null_only_where_the_parser_reads_it_as_a_string(markup):
    """A free string parameter's value, empty, of several words or lines, is allowed and closes (`qwen3_coder`'s
    could not: its text and the closing line were separate terminals, and llguidance's lexer does not step back
    out of a text at the newline that begins the closing). The tag markups whose parsers read a value "null" (any
    case) as None for any parameter (`qwen3_coder`, `minimax_m2`, `minicpm5`) never write it for a string
    parameter, whose schema a None would break; `glm47` and `longcat` keep a string parameter's value as written,
    so "null" is a string there."""
    from scheduler.fixtures.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    fmt = _markup(markup)
    tools = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    constraint = _forced(fmt, tools)
    null_is_text = markup in STRING_NULL_MARKUPS
    for value, allowed in (("null", null_is_text), ("NULL", null_is_text), ("nullable", True), ("", True),
                           ("two words\nand a line", True)):
        text = fmt.start + fmt.shape.example({"name": "note", "arguments": {"text": value}}) + fmt.end
        assert _accepts(tokenizer, constraint, text) == allowed, text
        if allowed:
            assert _markup(markup).parse(text[len(fmt.start): len(text) - len(fmt.end)], tools)["arguments"] \
                == {"text": value}


JSON_VALUE_MARKUPS = ["glm47", "json_tools", "kimi_k2", "kimi_k3", "laguna", "longcat", "minicpm5", "minimax_m2",
                      "mistral", "muse_spark", "pythonic", "qwen3_coder"]  # (gemma's write objects in their own syntax)


@pytest.mark.parametrize("markup", JSON_VALUE_MARKUPS)
def test_a_json_value_never_holds_a_marker_that_would_cut_the_call(markup):
    """A JSON value inside a call (an object parameter here) may hold `<`, tags and brackets, but no string or key
    of it may hold one of the markup's markers (`ToolCallFormat.markers`: the start and end markers, the closing
    tags): the parser would end the value there, or the splitter the call. Before, the grammar allowed them."""
    from scheduler.fixtures.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    fmt = _markup(markup)
    tools = [{"type": "function", "function": {"name": "store", "parameters": {
        "type": "object", "properties": {"doc": {"type": "object"}}, "required": ["doc"]}}}]
    constraint = _forced(fmt, tools)

    def text(doc: dict) -> str:
        return fmt.start + fmt.shape.example({"name": "store", "arguments": {"doc": doc}}) + fmt.end

    fine = {"html": "a < b, <b>bold</b> [x] </", "list": ["<", "</x>", {"k": "v"}], "n": 1}
    assert _accepts(tokenizer, constraint, text(fine))
    splitter = ToolCallSplitter(fmt, tools)
    first, last = splitter.feed(text(fine)), splitter.finish()
    assert [json.loads(c["function"]["arguments"]) for c in first.calls + last.calls] == [{"doc": fine}]
    assert all(any(m in marker_text for m in fmt.markers) for marker_text in (fmt.start, fmt.end) if marker_text)
    for marker in fmt.markers:
        for doc in ({"s": f"a{marker}b"}, {"list": [f"{marker}"]}, {f"k{marker}": 1}, {"deep": {"s": marker}}):
            assert not _accepts(tokenizer, constraint, text(doc)), (marker, doc)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<>/|[]ab_xT", max_size=24), st.sampled_from(sorted({m for name in JSON_VALUE_MARKUPS
                                                                            for m in _markup(name).markers})))
def test_the_exclusion_regex_matches_exactly_the_strings_without_a_marker(text, extra):
    """`_without` against a direct check, on strings near the markers (random, with markers and their prefixes
    spliced in)."""
    from scheduler.server.constraints import _without

    markers = ("</parameter>", "<|tool_call_end|>", "[TOOL_CALLS]", extra)
    pieces = [text[: len(text) // 2], extra[: len(text) % (len(extra) + 1)], text[len(text) // 2:]]
    for candidate in (text, "".join(pieces), text + extra, extra[:-1]):
        want = not any(m in candidate for m in markers)
        assert (re.fullmatch(_without(markers), candidate) is not None) == want, (candidate, markers)


def test_every_tool_call_format_mlx_lm_infers_has_a_grammar():
    """Each of mlx-lm's tool parsers reads one of the shapes a forced call's grammar writes, the model's own markup
    before JSON (GLM's and LongCat's parsers read JSON too). Fails when an mlx-lm release adds a parser, or changes
    one so that its markup no longer reads back: the shape table in scheduler/server/tool_calls.py is then due."""
    import pkgutil

    import mlx_lm.tool_parsers

    shapes = {module.name: _markup(module.name).shape for module in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert shapes == {
        "json_tools": CallShape.JSON_OBJECT, "mistral": CallShape.NAME_ARGS, "pythonic": CallShape.PYTHONIC,
        "qwen3_coder": CallShape.XML_PARAMETERS, "function_gemma": CallShape.FUNCTION_GEMMA,
        "gemma4": CallShape.GEMMA4, "glm47": CallShape.ARG_KEY, "laguna": CallShape.ARG_KEY,
        "longcat": CallShape.LONGCAT, "minimax_m2": CallShape.INVOKE, "kimi_k2": CallShape.KIMI,
        "minicpm5": CallShape.PARAM_TAGS, "muse_spark": CallShape.ATEM, "kimi_k3": CallShape.XTML}


def test_a_call_the_parser_fails_on_with_any_error_stays_content():
    """mlx-lm's `longcat` parser raises AttributeError on a call without arguments (its name regex does not match):
    the splitter keeps that text as content, as for any call its parser cannot read, instead of failing the
    choice."""
    from scheduler.server.tool_calls import ToolCallSplitter

    fmt = _markup("longcat")
    text = "<longcat_tool_call>get_time</longcat_tool_call>"
    with pytest.raises(AttributeError):
        fmt.parse("get_time", None)
    splitter = ToolCallSplitter(fmt, None)
    first, last = splitter.feed(text), splitter.finish()
    assert (first.content + last.content, first.calls + last.calls) == (text, [])


TYPED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"}, "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "opts": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["a"], "additionalProperties": False},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "days", "metric", "ratio", "opts"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "set_level", "parameters": {"type": "object", "properties": {
        "level": {"type": "integer", "enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "minItems": 1, "maxItems": 2}},
        "required": ["level", "tags"], "additionalProperties": False}}},
]


MAX_TOKENS = 1000  # per sampled forced call (the tag markups take many tokens of the tiny BPE)

#: the markups that write objects and arrays (FunctionGemma's parser cuts the arguments at commas: scalars only)
NESTED_MARKUPS = {"pythonic", "qwen3_coder", "gemma4", "glm47", "minimax_m2", "kimi_k2", "minicpm5", "longcat",
                  "muse_spark", "kimi_k3"}


@pytest.mark.parametrize("markup", ["pythonic", "qwen3_coder", "function_gemma", "gemma4", "glm47", "minimax_m2",
                                    "kimi_k2", "minicpm5", "longcat", "muse_spark", "kimi_k3"])
def test_forced_calls_hold_to_every_parameter_type(markup, text_model_dir):
    """Sampled at temperature 1 under the forced-call grammar of each markup, every output parses back (mlx-lm's
    own parser) into calls of the offered tools whose arguments hold to their schemas: enums of strings and
    integers, bounded integers and numbers, booleans, nested objects and arrays (where the markup writes them),
    an optional parameter after the required ones, a tool with no parameters; each tool named and any."""
    import importlib

    from mlx_lm import load

    from scheduler import Engine, EngineConfig, SamplingParams
    from scheduler.server.constraints import output_constraint
    from scheduler.server.protocol import ChatCompletionRequest
    from scheduler.server.tool_calls import ToolCallSplitter

    parser = importlib.import_module(f"mlx_lm.tool_parsers.{markup}")
    fmt = ToolCallFormat(parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call)
    tools = TYPED_TOOLS if markup in NESTED_MARKUPS else _scalars_only(TYPED_TOOLS)
    model, tokenizer = load(str(text_model_dir))
    engine = Engine(model, tokenizer, EngineConfig())
    outputs = {}
    for choice in ["required", *({"type": "function", "function": {"name": t["function"]["name"]}} for t in tools)]:
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "call"}], tools=tools,
                                     tool_choice=choice)
        constraint = output_constraint(body, fmt, tools, None)
        for seed in range(6):
            outputs[engine.add_request(prompt="call", sampling=SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured_output=constraint))] = []
    while engine.has_pending():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    engine.close()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    given = set()
    for tokens in outputs.values():
        text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])  # the stop token
        splitter = ToolCallSplitter(fmt, tools)
        first, last = splitter.feed(text), splitter.finish()
        # "required" allows several calls, and a sampled row may write calls until max_tokens cuts the last one:
        # then the calls closed before it are the output's (none where one pair of markers holds them all)
        cut = len(tokens) == MAX_TOKENS and not text.rstrip().endswith(fmt.end or "\0")
        assert not first.content.strip() and (cut or not last.content.strip()), text
        calls = first.calls + ([] if cut else last.calls)
        assert calls or cut, text
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, schemas[call["function"]["name"]])
            given |= {(call["function"]["name"], name) for name in arguments}
    assert {name for name, _ in given} == {"get_weather", "set_level"}, given  # (ping takes no arguments)


def _scalars_only(tools: list[dict]) -> list[dict]:
    """The tools without their object and array parameters."""
    out = []
    for tool in tools:
        params = tool["function"]["parameters"]
        kept = {k: v for k, v in params.get("properties", {}).items() if v.get("type") not in ("object", "array")}
        out.append({"type": "function", "function": {"name": tool["function"]["name"], "parameters": {
            **params, "properties": kept, "required": [r for r in params.get("required", []) if r in kept]}}})
    return out

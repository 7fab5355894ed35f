"""Tool calling on a vision-language model: tools and template arguments reach the model's chat template as
mlx-vlm renders them, the output is `mlx_vlm.stream_generate`'s on that prompt, and the server returns calls
parsed by the markup mlx-lm infers from the template (the tiny Qwen2-VL with a tool-calling template, the
`vlm-tools` kind; its weights are random, so its calls are forced with tool_choice)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import jsonschema
import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, InvalidRequest, SamplingParams

from ..helpers import drive, engine_with_log


def _tool(name: str, parameter: str, values: list[str]) -> dict:
    """A tool whose one argument is one of `values`: a random model's forced call then always ends (a free
    string could run on to max_tokens)."""
    return {"type": "function", "function": {"name": name, "description": f"{name} of a place.", "parameters": {
        "type": "object", "properties": {parameter: {"type": "string", "enum": values}}, "required": [parameter],
        "additionalProperties": False}}}


WEATHER_TOOL = _tool("get_weather", "city", ["Paris", "Rome", "Oslo"])
TIME_TOOL = _tool("get_time", "zone", ["UTC", "CET"])
TOOLS = [WEATHER_TOOL, TIME_TOOL]
IMAGE = Image.fromarray(np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8))
ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the weather there?"}]}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def vlm_tools_dir(tmp_path_factory):
    from scheduler.fixtures.tiny_models import build_model

    return build_model("vlm-tools", tmp_path_factory.mktemp("tiny-vlm-tools"))


@pytest.fixture(scope="module")
def loaded(vlm_tools_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_tools_dir))


def _solo(model, processor, messages, images, **template_kwargs) -> list[int]:
    """mlx-vlm alone: its own rendering of the messages (with the template arguments), then greedy generation."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    text = apply_chat_template(processor, model.config, messages, num_images=len(images), **template_kwargs)
    last = None
    for last in mlx_vlm.stream_generate(model, processor, text, image=images or None, max_tokens=MAX_TOKENS,
                                        temperature=0.0):
        pass
    return list(last.token_ids)  # (its last result carries every token; the results before it, one each)


def test_the_tool_markup_is_mlx_lms_rule_on_the_vlm_chat_template(loaded, vlm_model_dir):
    import mlx_vlm

    from scheduler.server.tool_calls import CallShape, ToolCallFormat

    engine = Engine(*loaded)
    markup = engine.vlm.tool_calling
    assert (markup.tool_call_start, markup.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert ToolCallFormat.of(markup).shape is CallShape.JSON_OBJECT  # its parser reads what a grammar writes
    plain = Engine(*mlx_vlm.load(str(vlm_model_dir)))  # ChatML without tools: no call markup
    assert plain.vlm.tool_calling is None and ToolCallFormat.of(plain.vlm.tool_calling) is None
    engine.close()
    plain.close()


def test_tools_reach_the_vlm_chat_template_and_the_output_is_mlx_vlms(loaded):
    """Three requests batched under chunked prefill: an image question with tools, the same without, and a text
    chat with one tool. Each prompt is mlx-vlm's own rendering (tools included: the template lists them) and each
    output is mlx-vlm's alone on it; the tools change the prompt."""
    model, processor = loaded
    text_chat = [{"role": "user", "content": "Just tell me the time."}]
    cases = [("tools", ASK, [IMAGE], {"tools": TOOLS}), ("plain", ASK, [IMAGE], {}),
             ("text", text_chat, [], {"tools": [TIME_TOOL]})]
    engine, log = engine_with_log(model, processor, EngineConfig(max_batched_tokens=48, prefill_chunk=16))
    run = drive(engine, [(0, dict(prompt=messages, images=images or None, sampling=SamplingParams(max_tokens=MAX_TOKENS),
                                  request_id=rid, **kwargs)) for rid, messages, images, kwargs in cases])
    prompts = {e["request_id"]: e["prompt_tokens"] for e in log.of_kind("arrival")}
    assert len(prompts["tools"]) > len(prompts["plain"])  # the tools block is in the prompt
    from mlx_vlm.prompt_utils import apply_chat_template

    rendered = apply_chat_template(processor, model.config, ASK, num_images=1, tools=TOOLS)
    assert "Tools: get_weather(city) get_time(zone)" in rendered and rendered.count("<|image_pad|>") == 1
    for rid, messages, images, kwargs in cases:
        assert run.tokens[rid] == _solo(model, processor, messages, images, **kwargs), rid
    engine.close()


def test_a_continued_assistant_message_is_rendered_and_continued_as_mlx_vlm_does(loaded):
    """chat_template_kwargs {"continue_final_message": true} (transformers' argument, vLLM's field): the image
    chat's last message, an assistant's beginning, is left open in the prompt (no end of turn, no generation
    prompt), as mlx-vlm renders it with that argument, and the output continues it as mlx-vlm's generation on
    that prompt does; batched with the same chat asked plainly, whose prompt differs."""
    model, processor = loaded
    begun = ASK + [{"role": "assistant", "content": "The weather there is"}]
    cases = [("continued", begun, {"chat_template_kwargs": {"continue_final_message": True}}),
             ("plain", ASK, {})]
    engine, log = engine_with_log(model, processor, EngineConfig(max_batched_tokens=48, prefill_chunk=16))
    run = drive(engine, [(0, dict(prompt=messages, images=[IMAGE], sampling=SamplingParams(max_tokens=MAX_TOKENS),
                                  request_id=rid, **kwargs)) for rid, messages, kwargs in cases])
    prompts = {e["request_id"]: e["prompt_tokens"] for e in log.of_kind("arrival")}
    text = processor.tokenizer.decode(prompts["continued"])
    assert text.endswith("<|im_start|>assistant\nThe weather there is")
    assert run.tokens["continued"] == _solo(model, processor, begun, [IMAGE], add_generation_prompt=False,
                                            continue_final_message=True)
    assert run.tokens["plain"] == _solo(model, processor, ASK, [IMAGE])
    engine.close()


def test_tools_and_template_arguments_on_a_vlm_are_checked_like_a_text_models(loaded, vlm_model_dir):
    """Without chat messages, of the wrong type, or setting what the engine sets: refused naming the argument;
    a model with no chat template at all cannot take them; nothing is queued."""
    engine = Engine(*loaded)
    for bad, name in ((dict(prompt="<|im_start|>user\nhi<|im_end|>\n", tools=TOOLS), "tools"),
                      (dict(prompt_tokens=[5, 6, 7], tools=TOOLS), "tools"),
                      (dict(prompt=ASK, images=[IMAGE], tools="get_weather"), "tools"),
                      (dict(prompt=ASK, images=[IMAGE], chat_template_kwargs={"tools": TOOLS}),
                       "chat_template_kwargs"),
                      (dict(prompt=ASK, images=[IMAGE], chat_template_kwargs={"continue_final_message": True}),
                       "chat_template_kwargs"),  # the last message is the user's
                      (dict(prompt=ASK + [{"role": "assistant", "content": "It"}], images=[IMAGE],
                            chat_template_kwargs={"continue_final_message": True, "add_generation_prompt": True}),
                       "chat_template_kwargs"),
                      (dict(prompt=ASK, images=[IMAGE], chat_template_kwargs={"add_generation_prompt": "no"}),
                       "chat_template_kwargs")):
        with pytest.raises(InvalidRequest) as info:
            engine.add_request(**bad)
        assert info.value.field == name, bad
    assert not engine.has_pending()
    engine.close()


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# the image question as a client sends it
SERVED_ASK = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(IMAGE)}},
                                           {"type": "text", "text": "What is the weather there?"}]}]


@pytest.fixture(scope="module")
def server(vlm_tools_dir, tmp_path_factory):
    """The vlm-tools model behind the real server (a subprocess), driven with the official `openai` client."""
    import time

    from ..surfaces.test_serve import _start, _stop, _wait_healthy

    started = _start(vlm_tools_dir, tmp_path_factory.mktemp("serve-vlm-tools"), "vlm-tools")
    try:
        _wait_healthy(started, time.monotonic() + 120)
        yield started
    finally:
        _stop(started)


def test_the_server_returns_forced_calls_of_a_vlm_streamed_or_not(server):
    """An image chat with tools and tool_choice "required" (one call: parallel_tool_calls false) on the VLM
    server: the answer is a call of an offered tool, its arguments valid against the tool's schema, finish
    reason `tool_calls`; streamed equals not streamed; a named tool_choice calls that tool."""

    async def run():
        client = server.client()
        args = dict(model="tiny-vlm", messages=SERVED_ASK, tools=TOOLS, max_tokens=96, temperature=0,
                    parallel_tool_calls=False)
        forced = await client.chat.completions.create(tool_choice="required", **args)
        calls, finish = {}, None
        async for chunk in await client.chat.completions.create(tool_choice="required", stream=True, **args):
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        named = await client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "get_time"}}, **args)
        await client.close()
        return forced, (calls, finish), named

    forced, (streamed, streamed_finish), named = asyncio.run(run())
    (choice,) = forced.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert streamed_finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    (named_choice,) = named.choices
    assert [c.function.name for c in named_choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(named_choice.message.tool_calls[0].function.arguments), schemas["get_time"])


def test_a_thinking_vlms_reasoning_is_split_out_when_its_template_opens_it(loaded, server):
    """The vlm-tools tokenizer has `<think>` / `</think>` (mlx-lm's rule finds them); its template opens the
    reasoning only with `enable_thinking` (mlx-vlm renders with it off). Served: with `chat_template_kwargs`
    turning it on, the answer (cut by max_tokens inside the reasoning: the random model never closes it) is all
    `reasoning_content`; without, all `content`; each the engine's own text for that request."""
    from scheduler.models.library import ThinkingMarkup

    model, processor = loaded
    engine = Engine(model, processor)
    assert engine.vlm.thinking == ThinkingMarkup("<think>", "</think>")
    run = drive(engine, [(0, dict(prompt=ASK, images=[IMAGE], sampling=SamplingParams(max_tokens=MAX_TOKENS),
                                  request_id=name, **kwargs))
                         for name, kwargs in (("thinking", {"chat_template_kwargs": {"enable_thinking": True}}),
                                              ("plain", {}))])
    wanted = {name: engine.tokenizer.decode(tokens) for name, tokens in run.tokens.items()}
    engine.close()
    assert "</think>" not in wanted["thinking"] and wanted["thinking"] != wanted["plain"]

    async def run():
        client = server.client()
        args = dict(model="tiny-vlm", messages=SERVED_ASK, max_tokens=MAX_TOKENS, temperature=0)
        thinking = await client.chat.completions.create(extra_body={"chat_template_kwargs": {
            "enable_thinking": True}}, **args)
        plain = await client.chat.completions.create(**args)
        await client.close()
        return thinking, plain

    thinking, plain = asyncio.run(run())
    message = thinking.choices[0].message
    assert (message.reasoning_content, message.content) == (wanted["thinking"], None)
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.choices[0].message.content == wanted["plain"]

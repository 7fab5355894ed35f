"""LoRA adapters through `mlxsched serve --lora-modules NAME=DIR ...` (vLLM's flag), end to end with the official
`openai` client: a request chooses an adapter by sending its name as the model, requests on the base model and on
each adapter run concurrently in one engine, and each answer is the text of mlx-lm's greedy output for that prompt
alone on `mlx_lm.load(model, adapter_path=<its adapter>)`. `/v1/models` lists each adapter as a model whose parent
is the served one; an answer names the model it was asked for; another name is a 404 naming what is served. With
`--allow-runtime-lora`, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters while it
runs."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from scheduler.fixtures.lora import write_lora_adapter

from ..helpers import mixed_prompts, peft_copy, solo_tokens
from .test_serve import MODEL_NAME, _start, _stop, _wait_healthy

ADAPTERS = ("one", "two")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(text_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-loras")
    return {name: write_lora_adapter(text_model_dir, root / name, seed=seed) for seed, name in enumerate(ADAPTERS, 1)}


@pytest.fixture(scope="module")
def server(text_model_dir, adapters, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-lora")
    server = _start(text_model_dir, tmp, "lora", "--max-seqs", "16", "--max-batched-tokens", "64",
                    "--prefix-cache-mb", "8", "--allow-runtime-lora",
                    "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))
    try:
        _wait_healthy(server, time.monotonic() + 120)
        yield server
    finally:
        _stop(server)


def test_adapters_are_models_whose_parent_is_the_served_one(server):
    status, raw = server.get("/v1/models")
    assert status == 200
    listed = json.loads(raw)
    assert [(card["id"], card.get("parent")) for card in listed["data"]] == [
        (MODEL_NAME, None), ("one", MODEL_NAME), ("two", MODEL_NAME)]
    status, raw = server.get("/v1/models/two")
    assert status == 200 and json.loads(raw)["parent"] == MODEL_NAME
    status, error = server.post("/v1/completions", {"model": "three", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert all(repr(name) in error["error"]["message"] for name in (MODEL_NAME, *ADAPTERS))
    status, tokens = server.post("/tokenize", {"model": "one", "prompt": "hello"})
    assert status == 200 and tokens["count"] > 0


def test_concurrent_requests_on_each_adapter_answer_as_mlx_lm_with_that_adapter_alone(
        server, text_model_dir, adapters):
    import mlx_lm

    references = {MODEL_NAME: mlx_lm.load(str(text_model_dir))}
    references.update({n: mlx_lm.load(str(text_model_dir), adapter_path=str(p)) for n, p in adapters.items()})
    prompts = mixed_prompts(9, 4, 60, seed=21)
    models = [(MODEL_NAME, *ADAPTERS)[i % 3] for i in range(len(prompts))]
    tokenizer = references[MODEL_NAME][1]
    want = [tokenizer.decode(solo_tokens(*references[m], p, MAX_TOKENS)) for p, m in zip(prompts, models)]
    assert len(set(want)) == len(want)

    async def one(client, prompt, model, stream):
        if not stream:
            out = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return out.model, out.choices[0].text
        text, named = "", set()
        async for chunk in await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                           temperature=0, stream=True):
            named.add(chunk.model)
            text += "".join(c.text for c in chunk.choices)
        (name,) = named
        return name, text

    async def run():
        client = server.client()
        return await asyncio.gather(*(one(client, p, m, i % 2 == 1)
                                      for i, (p, m) in enumerate(zip(prompts, models))))

    before = server.metrics()
    answers = asyncio.run(run())
    assert [name for name, _ in answers] == models  # each answer names the model it was asked for
    assert [text for _, text in answers] == want
    after = server.metrics()
    for name in ADAPTERS:  # the metrics count each adapter's requests, none live once answered
        arrived = after[("mlxsched_lora_requests_total", (("adapter", name),))] - before.get(
            ("mlxsched_lora_requests_total", (("adapter", name),)), 0)
        assert arrived == models.count(name)
        assert after[("mlxsched_lora_live_requests", (("adapter", name),))] == 0


def test_chat_completions_and_responses_run_on_the_adapter_they_name(server, text_model_dir, adapters):
    """A chat on an adapter, as a chat completion and through the Responses API (model = the adapter's name),
    answers as mlx-lm's chat with that adapter alone, and the answer names the adapter."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(text_model_dir), adapter_path=str(adapters["two"]))
    messages = [{"role": "user", "content": "Name a river."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = tokenizer.decode(solo_tokens(model, tokenizer, prompt, MAX_TOKENS))

    async def run():
        client = server.client()
        chat = await client.chat.completions.create(model="two", messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0)
        response = await client.responses.create(model="two", input=messages, max_output_tokens=MAX_TOKENS,
                                                 temperature=0)
        return chat, response

    chat, response = asyncio.run(run())
    assert chat.choices[0].message.content == response.output_text == want
    assert chat.model == response.model == "two"


def test_adapters_load_and_unload_while_the_server_runs(server, text_model_dir, adapters, tmp_path):
    """vLLM's runtime LoRA routes: an adapter loaded under a new name (in PEFT's layout, as vLLM's are) is listed
    and answers as mlx-lm with the same matrices alone; a name already served, the served model's name and a
    directory without an adapter are 400s naming the field; once unloaded the name is a 404 again, and unloading it
    twice is a 404."""
    import mlx_lm

    # (in Hugging Face PEFT's layout: the same matrices as adapter "two")
    peft = peft_copy(adapters["two"], tmp_path / "peft")
    status, text = server.post_raw("/v1/load_lora_adapter", {"lora_name": "three", "lora_path": str(peft)})
    assert status == 200 and b"three" in text
    status, raw = server.get("/v1/models")
    assert [card["id"] for card in json.loads(raw)["data"]] == [MODEL_NAME, "one", "three", "two"]
    model, tokenizer = mlx_lm.load(str(text_model_dir), adapter_path=str(adapters["two"]))
    prompt = mixed_prompts(1, 12, 12, seed=30)[0]
    status, answer = server.post("/v1/completions", {"model": "three", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0})
    assert status == 200 and answer["model"] == "three"
    assert answer["choices"][0]["text"] == tokenizer.decode(solo_tokens(model, tokenizer, prompt, MAX_TOKENS))
    for body, param in (({"lora_name": "three", "lora_path": str(adapters["one"])}, "lora_name"),
                        ({"lora_name": MODEL_NAME, "lora_path": str(adapters["one"])}, "lora_name"),
                        ({"lora_name": "four", "lora_path": str(tmp_path)}, "lora_path")):
        status, error = server.post("/v1/load_lora_adapter", body)
        assert status == 400 and error["error"]["param"] == param, error
    status, text = server.post_raw("/v1/unload_lora_adapter", {"lora_name": "three"})
    assert status == 200
    status, error = server.post("/v1/completions", {"model": "three", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, error = server.post("/v1/unload_lora_adapter", {"lora_name": "three"})
    assert status == 404

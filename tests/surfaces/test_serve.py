"""`mlxsched serve` end to end: the real server in a subprocess on a loopback port, driven with the official
`openai` client (and raw HTTP where a client cannot send the bad input), outputs compared with the engine's own
greedy output in this process, metrics parsed with prometheus-client's parser.

One main server for the module (tiny Qwen2-VL), and a small one (one slot, `--max-queue 1`, a trace file that
may not grow past a size limit, media URLs from localhost only) for backpressure, a failed engine loop and the
media domains. Image URLs are served on loopback (tests/media_http.py). Both start at once; the tests
run in file order and the last one stops the main server with SIGINT.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

import scheduler
from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.events import MemorySink, read_jsonl
from scheduler.request import FinishReason
from scheduler.server.generation import bad_words_ids

from ..media_http import MediaServer

MAX_MODEL_LEN = 512
MODEL_NAME = "tiny-vlm"
SMALL_TRACE_LIMIT = 160 << 10  # bytes the small server's trace may reach before writes fail (EFBIG)
REPO_ROOT = Path(scheduler.__file__).resolve().parent.parent


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    trace: Path
    log: Path

    def get(self, path: str) -> tuple[int, bytes]:
        return _http("GET", self.base_url + path)

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, raw = _http("POST", self.base_url + path, data)
        return status, json.loads(raw)

    def post_raw(self, path: str, body: dict) -> tuple[int, bytes]:
        return _http("POST", self.base_url + path, json.dumps(body).encode())

    def metrics(self) -> dict[tuple[str, tuple], float]:
        status, raw = self.get("/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(raw.decode()):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _http(method: str, url: str, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit_file_size() -> None:  # runs in the child: its trace cannot grow past the limit (Python ignores SIGXFSZ)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SMALL_TRACE_LIMIT, SMALL_TRACE_LIMIT))


def _start(model_dir: Path, tmp: Path, name: str, *flags: str, preexec=None) -> Server:
    port, trace, log = _free_port(), tmp / f"{name}.jsonl", tmp / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "scheduler.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--trace", str(trace), "--max-model-len", str(MAX_MODEL_LEN),
           "--graceful-shutdown-s", "1", *flags]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, preexec_fn=preexec)
    return Server(process, f"http://127.0.0.1:{port}", trace, log)


def _wait_healthy(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n{server.log.read_text()[-3000:]}")
        try:
            if server.get("/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the server did not come up:\n{server.log.read_text()[-3000:]}")


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="module")
def servers(vlm_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    main = _start(vlm_model_dir, tmp, "main", "--max-seqs", "32", "--max-batched-tokens", "2048",
                  "--prefix-cache-mb", "16")
    small = _start(vlm_model_dir, tmp, "small", "--max-seqs", "1", "--max-batched-tokens", "256", "--max-queue", "1",
                   "--max-request-mb", "1", "--allowed-media-domains", "localhost", preexec=_limit_file_size)
    try:
        deadline = time.monotonic() + 120
        _wait_healthy(main, deadline)
        _wait_healthy(small, deadline)
        yield main, small
    finally:
        _stop(main)
        _stop(small)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def reference(vlm_model_dir):
    """The engine in this process, on the same model: what the server must answer for each request."""
    sink = MemorySink()
    engine = Engine.from_pretrained(vlm_model_dir, EngineConfig(max_model_len=MAX_MODEL_LEN), event_sinks=[sink])
    return engine, sink


def _greedy_reference(reference, prompts: list, images: list, max_tokens: list[int]):
    """(text as the server shows it, completion tokens, finish reason, prompt tokens) per request."""
    engine, sink = reference
    first = len(sink.events)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens], images=images)
    arrivals = {e["request_id"]: len(e["prompt_tokens"]) for e in sink.events[first:] if e["event"] == "arrival"}
    results = []
    for out in outs:
        shown = out.token_ids[:-1] if out.finish_reason is FinishReason.STOP else out.token_ids  # eos not shown
        results.append((engine.tokenizer.decode(shown), len(out.token_ids), out.finish_reason.value,
                        arrivals[out.request_id]))
    return results


def _picture(seed: int, size: tuple[int, int]) -> tuple[Image.Image, str]:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), \
        "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat_workload(n: int, seed: int):
    """n chat requests, every other one with a picture: (openai messages, engine messages, images, max_tokens)."""
    rng = random.Random(seed)
    words = ["the scheduler", "a cache", "the river", "an old clock", "the market", "a quiet street", "a garden"]
    sizes = [(56, 56), (84, 112), (112, 84)]
    work = []
    for i in range(n):
        text = "Tell me about " + " and ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        max_tokens = rng.randint(8, 24)
        if i % 2 == 0:
            picture, url = _picture(seed * 1000 + i, sizes[i // 2 % len(sizes)])
            api = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": text}]}]
            eng = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            work.append((api, eng, [picture], max_tokens))
        else:
            work.append(([{"role": "user", "content": text}], [{"role": "user", "content": text}], None, max_tokens))
    return work


async def _stream_chat(client: openai.AsyncOpenAI, messages: list, **kwargs):
    """(text, finish reason, usage, chunk id) of one streaming chat request."""
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **kwargs)
    text, finish, usage, cid = [], None, None, None
    async for chunk in stream:
        cid = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    return "".join(text), finish, usage, cid


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---- tests (file order matters: the last one shuts the main server down) ------------------------------


def test_models_and_health(server):
    """/v1/models lists the served model; OpenAI's retrieve gets its card (404 naming `model` for another), and
    /version the installed distribution's version."""
    import importlib.metadata

    status, raw = server.get("/v1/models")
    assert status == 200
    (card,) = json.loads(raw)["data"]
    assert card["id"] == MODEL_NAME
    assert server.get("/health")[0] == 200

    async def retrieve():
        async with server.client() as client:
            found = await client.models.retrieve(MODEL_NAME)
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("gpt-4")
            return found, missing.value

    found, missing = asyncio.run(retrieve())
    assert found.model_dump(exclude_none=True) == card
    assert missing.body["param"] == "model" and missing.body["code"] == "model_not_found"
    status, raw = server.get("/version")
    assert status == 200 and json.loads(raw) == {"version": importlib.metadata.version("mlxsched")}


def test_32_concurrent_streaming_chats_equal_the_engine_greedy_output(server, reference):
    work = _chat_workload(32, seed=1)
    expected = _greedy_reference(reference, [w[1] for w in work], [w[2] for w in work], [w[3] for w in work])

    async def run():
        async with server.client() as client:
            return await asyncio.gather(*[_stream_chat(client, api, max_tokens=m, temperature=0)
                                          for api, _, _, m in work])

    got = asyncio.run(run())
    for i, ((text, finish, usage, _), (ref_text, ref_tokens, ref_finish, ref_prompt)) in enumerate(zip(got, expected)):
        assert text == ref_text, f"request {i} ({'image' if i % 2 == 0 else 'text'})"
        assert finish == ref_finish
        assert (usage.completion_tokens, usage.prompt_tokens) == (ref_tokens, ref_prompt)
        assert usage.total_tokens == ref_tokens + ref_prompt


def test_the_responses_api_answers_image_and_text_chats_as_the_engine(server, reference):
    """`POST /v1/responses` (OpenAI's Responses API, through the official client): image and text chats as input
    items (`input_image` with a data URI, `input_text`), concurrent, whole and streamed, with `instructions`
    sent as a system message: each output_text is the engine's greedy text for the same chat alone, a choice cut
    at max_output_tokens is "incomplete", and the usage counts the engine's tokens."""
    work = _chat_workload(8, seed=4)
    system = {"role": "system", "content": "Answer briefly."}
    expected = _greedy_reference(reference, [[system, *w[1]] for w in work], [w[2] for w in work],
                                 [w[3] for w in work])

    def as_input(messages):
        return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
            {"type": "input_image", "image_url": part["image_url"]["url"]} if part["type"] == "image_url"
            else {"type": "input_text", "text": part["text"]} for part in m["content"]]} for m in messages]

    async def one(client, api, max_tokens, stream):
        kwargs = dict(model=MODEL_NAME, input=as_input(api), instructions="Answer briefly.",
                      max_output_tokens=max_tokens, temperature=0)
        if not stream:
            return await client.responses.create(**kwargs)
        async with client.responses.stream(**kwargs) as events:
            # the last event carries the response: "response.completed", or "response.incomplete" for one cut at
            # max_output_tokens (as OpenAI's; the SDK's get_final_response waits for the first only)
            return [event async for event in events][-1].response

    async def run():
        async with server.client() as client:
            return await asyncio.gather(*[one(client, api, m, i % 3 == 0) for i, (api, _, _, m) in enumerate(work)])

    answers = asyncio.run(run())
    assert any(a.status == "incomplete" for a in answers[::3])  # a streamed one ended with response.incomplete
    # logprobs (include "message.output_text.logprobs", top_logprobs) are the chat completion's, token for token
    ask = {"model": MODEL_NAME, "max_output_tokens": 10, "temperature": 0, "top_logprobs": 2}
    status, answer = server.post("/v1/responses", {**ask, "input": "Tell me about a garden",
                                                   "include": ["message.output_text.logprobs"]})
    status_chat, chat = server.post("/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about a garden"}], "max_tokens": 10,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert status == status_chat == 200
    (part,) = answer["output"][0]["content"]
    assert part["text"] == chat["choices"][0]["message"]["content"]
    assert part["logprobs"] == chat["choices"][0]["logprobs"]["content"] and len(part["logprobs"]) == 10
    for i, (got, (text, tokens, finish, prompt)) in enumerate(zip(answers, expected)):
        assert got.output_text == text, f"request {i}"
        assert got.status == ("incomplete" if finish == "length" else "completed")
        assert (got.usage.input_tokens, got.usage.output_tokens) == (prompt, tokens)


def test_stop_strings_stop_ids_n_seed_and_logprobs(server, reference):
    text = "Tell me about the river and a garden"
    messages = [{"role": "user", "content": text}]
    (ref_text, ref_tokens, ref_finish, ref_prompt), = _greedy_reference(reference, [messages], [None], [24])
    engine = reference[0]
    ref_ids = engine.generate([messages], [SamplingParams(max_tokens=24)])[0].token_ids
    stop = ref_text[len(ref_text) // 2: len(ref_text) // 2 + 3]
    assert stop and stop in ref_text

    async def run():
        async with server.client() as client:
            chat = client.chat.completions
            plain = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0, n=2,
                                      logprobs=True)
            stopped = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0, stop=[stop])
            streamed_stop = await _stream_chat(client, messages, max_tokens=24, temperature=0, stop=stop)
            by_id = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                      extra_body={"stop": [ref_ids[3]]})
            seeded = [await chat.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0.9,
                                        seed=7, n=n, extra_body={"top_k": 50, "min_p": 0.01}) for n in (1, 2)]
            completion = await client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=10, temperature=0)
            biased = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                       logit_bias={str(t): -100 for t in ref_ids[:3]} | {str(ref_ids[5]): 5})
            penalised = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                          frequency_penalty=1.5, presence_penalty=0.25)
            return plain, stopped, streamed_stop, by_id, seeded, completion, biased, penalised

    plain, stopped, streamed_stop, by_id, seeded, completion, biased, penalised = asyncio.run(run())
    assert [c.message.content for c in plain.choices] == [ref_text, ref_text]
    assert plain.usage.completion_tokens == 2 * ref_tokens and plain.usage.prompt_tokens == ref_prompt
    logprobs = plain.choices[0].logprobs.content
    shown_ids = ref_ids[:-1] if ref_finish == "stop" else ref_ids  # logprobs of the shown tokens
    assert [entry.token for entry in logprobs] == [engine.tokenizer.decode([t]) for t in shown_ids]
    assert all(entry.logprob <= 0 for entry in logprobs) and len(set(e.logprob for e in logprobs)) > 1

    cut = ref_text[: ref_text.index(stop)]
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (cut, "stop")
    assert streamed_stop[:2] == (cut, "stop")
    # a stop token id ends generation on it: counted, not shown
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == ref_ids.index(ref_ids[3]) + 1
    assert by_id.choices[0].message.content == engine.tokenizer.decode(ref_ids[: ref_ids.index(ref_ids[3])])
    # seeded sampling: choice i samples with seed + i, so choice 0 of n=2 is the n=1 answer
    assert seeded[1].choices[0].message.content == seeded[0].choices[0].message.content
    assert completion.choices[0].text == engine.tokenizer.decode(
        engine.generate([text], [SamplingParams(max_tokens=10)])[0].token_ids)
    # logit_bias: the engine's SamplingParams.logit_bias (mlx-lm's processor), and it changes the answer
    bias = {t: -100.0 for t in ref_ids[:3]} | {ref_ids[5]: 5.0}
    want = engine.generate([messages], [SamplingParams(max_tokens=24, logit_bias=bias)])[0]
    want_ids = want.token_ids[:-1] if want.finish_reason is FinishReason.STOP else want.token_ids
    assert biased.choices[0].message.content == engine.tokenizer.decode(want_ids) != ref_text
    # frequency_penalty and presence_penalty: the engine's (mlx-lm's processors), and they change the answer
    want = engine.generate([messages], [SamplingParams(max_tokens=24, frequency_penalty=1.5,
                                                       presence_penalty=0.25)])[0]
    want_ids = want.token_ids[:-1] if want.finish_reason is FinishReason.STOP else want.token_ids
    assert penalised.choices[0].message.content == engine.tokenizer.decode(want_ids) != ref_text


def _cut_after(full: str, unchecked: int, stop: str) -> int | None:
    """Where the output ends for a stop string that counts only where it ends past `full[:unchecked]`."""
    i = full.find(stop, max(0, unchecked - len(stop) + 1))
    return None if i < 0 else i


def test_min_tokens_holds_stop_strings_and_stop_tokens_back_until_then(server, reference):
    """vLLM's `min_tokens` through the server: a stop string within the text of the first min_tokens tokens is
    not matched, one that begins there and ends after it is (the text is cut where it begins), streamed or not;
    a stop token id among those tokens is masked, so the choice runs on as the engine's own min_tokens run does.
    min_tokens above max_tokens, or with an output format, is refused by field (`_bad_inputs`). vLLM's
    `allowed_token_ids` and `bad_words` restrict a choice as the engine's own run with them; with
    `include_stop_str_in_output` the text runs through the stop string."""
    messages = [{"role": "user", "content": "Tell me about the river and a garden"}]
    engine, m = reference[0], 8
    out = engine.generate([messages], [SamplingParams(max_tokens=24, min_tokens=m)])[0]
    shown = out.token_ids[:-1] if out.finish_reason is FinishReason.STOP else out.token_ids
    full, unchecked = engine.tokenizer.decode(shown), len(engine.tokenizer.decode(out.token_ids[:m]))
    assert full.startswith(engine.tokenizer.decode(out.token_ids[:m])) and 5 <= unchecked < len(full) - 2
    early, straddling = full[2:5], full[unchecked - 2: unchecked + 2]
    stop_id = out.token_ids[3]
    by_id = engine.generate([messages], [SamplingParams(max_tokens=24, min_tokens=m, stop_token_ids=(stop_id,))])[0]
    # vLLM's bad_words: the text of the plain answer's second token, as the server encodes it
    bad = [engine.tokenizer.decode([out.token_ids[1]])]
    bad_ids = bad_words_ids(engine.tokenizer, bad)
    without = engine.generate([messages], [SamplingParams(max_tokens=12, bad_words_ids=bad_ids)])[0]
    # vLLM's allowed_token_ids too: the tokens the plain answer did not use, so the answer changes
    only = sorted(set(range(40, 140)) - set(out.token_ids))
    restricted = engine.generate([messages], [SamplingParams(max_tokens=12, allowed_token_ids=only)])[0]

    async def run():
        async with server.client() as client:
            chat = client.chat.completions
            held = {"extra_body": {"min_tokens": m}}
            answers = [await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                         stop=[stop], **held) for stop in (early, straddling)]
            streamed = await _stream_chat(client, messages, max_tokens=24, temperature=0, stop=straddling, **held)
            ids = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                    extra_body={"stop": [stop_id], "min_tokens": m})
            allowed = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                        extra_body={"allowed_token_ids": only})
            banned = await chat.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"bad_words": bad})
            kept = {"extra_body": {"min_tokens": m, "include_stop_str_in_output": True}}
            kept = [await chat.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                      stop=[straddling], **kept),
                    await _stream_chat(client, messages, max_tokens=24, temperature=0, stop=straddling, **kept)]
            return answers, streamed, ids, allowed, kept, banned

    answers, streamed, ids, allowed, kept, banned = asyncio.run(run())
    for stop, answer in zip((early, straddling), answers):
        cut = _cut_after(full, unchecked, stop)
        assert cut != full.find(stop) or stop == straddling  # the early one would have cut without min_tokens
        want = (full, out.finish_reason.value) if cut is None else (full[:cut], "stop")
        assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == want, stop
    assert _cut_after(full, unchecked, straddling) <= unchecked - 2  # it began within the unchecked text
    assert streamed[:2] == (answers[1].choices[0].message.content, "stop")
    # vLLM's include_stop_str_in_output: the text runs through the stop string
    through = full[: _cut_after(full, unchecked, straddling) + len(straddling)]
    assert (kept[0].choices[0].message.content, kept[0].choices[0].finish_reason) == (through, "stop")
    assert kept[1][:2] == (through, "stop")
    # the stop id was masked among the first m tokens, so the choice is the engine's masked run
    by_id_shown = by_id.token_ids[:-1] if by_id.finish_reason is FinishReason.STOP else by_id.token_ids
    assert ids.choices[0].message.content == engine.tokenizer.decode(by_id_shown)
    assert ids.usage.completion_tokens == len(by_id.token_ids) > m and stop_id not in by_id.token_ids[:m]
    shown = without.token_ids[:-1] if without.finish_reason is FinishReason.STOP else without.token_ids
    assert banned.choices[0].message.content == engine.tokenizer.decode(shown)
    assert out.token_ids[1] not in without.token_ids and without.token_ids != out.token_ids[:len(without.token_ids)]
    assert allowed.choices[0].message.content == engine.tokenizer.decode(restricted.token_ids)
    assert set(restricted.token_ids) <= set(only) and allowed.usage.completion_tokens == 12


def test_logprobs_of_masked_tokens_read_as_vllms_floor(server):
    """Regression (found by a fuzz of the server): with a mask (allowed_token_ids here; a structured output's
    grammar, min_tokens) the alternatives it rules out have logprob -inf, which JSON cannot carry: the answer was a
    500. They read as -9999.0, vLLM's floor, streamed or not; the allowed tokens keep their real logprobs."""
    messages = [{"role": "user", "content": "Tell me about the river"}]
    allowed = [41, 42]

    async def run():
        async with server.client() as client:
            kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                          top_logprobs=5, extra_body={"allowed_token_ids": allowed})
            whole = await client.chat.completions.create(**kwargs)
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
            return whole, chunks

    whole, chunks = asyncio.run(run())
    streamed = [e for c in chunks for choice in c.choices if choice.logprobs for e in choice.logprobs.content]
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 4 and [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    for entry in entries:
        values = sorted((top.logprob for top in entry.top_logprobs), reverse=True)
        assert len(values) == 5 and values[2:] == [-9999.0] * 3 and all(-9999.0 < v <= 0 for v in values[:2])
        assert entry.logprob in values[:2]


def test_truncate_prompt_tokens_keeps_the_last_prompt_tokens(server, reference):
    """vLLM's `truncate_prompt_tokens` on /v1/completions: the choice is the engine's output on the prompt's last k
    tokens, usage counts k; -1 keeps as many as the context leaves room for one output token, so a prompt longer
    than max_model_len is answered. With echo (which shows the prompt as sent) or below 1 it is refused."""
    engine, _ = reference
    prompt = [7 + (i * 37) % 400 for i in range(600)]  # longer than the context (512)
    (want,) = engine.generate([prompt[-40:]], [SamplingParams(max_tokens=6)])
    status, got = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                  "truncate_prompt_tokens": 40})
    assert status == 200, got
    assert got["choices"][0]["text"] == engine.tokenizer.decode(want.token_ids)
    assert got["usage"]["prompt_tokens"] == 40
    status, got = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                  "truncate_prompt_tokens": -1})
    assert status == 200 and got["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1, got
    assert got["usage"]["completion_tokens"] == 1 and got["choices"][0]["finish_reason"] == "length"
    for body in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": 40, "echo": True}):
        status, got = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, **body})
        assert (status, got["error"]["param"]) == (400, "truncate_prompt_tokens"), got


def test_a_list_of_prompts_gets_n_choices_each_in_openais_order(server, reference):
    """/v1/completions with several prompts (token-id lists, and texts): choice p * n + j is prompt p's j-th, each
    equal to the engine's output for that prompt alone, streamed or not; usage counts each prompt once. A bad
    prompt of the list is named by its index."""
    prompts = [[7, 8, 9, 10], [30, 31], [5] * 12]
    refs = _greedy_reference(reference, prompts, [None] * 3, [6] * 3)

    async def run():
        async with server.client() as client:
            whole = await client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0,
                                                    n=2)
            texts = await client.completions.create(model=MODEL_NAME, prompt=["the river", "a garden"],
                                                    max_tokens=3, temperature=0)
            pieces: dict[int, str] = {}
            async for chunk in await client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6,
                                                               temperature=0, n=2, stream=True):
                for choice in chunk.choices:
                    pieces[choice.index] = pieces.get(choice.index, "") + choice.text
            return whole, texts, pieces

    whole, texts, pieces = asyncio.run(run())
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [ref[0] for ref in refs for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(ref[3] for ref in refs)
    assert whole.usage.completion_tokens == 2 * sum(ref[1] for ref in refs)
    assert [pieces[i] for i in range(6)] == [c.text for c in whole.choices]
    assert len(texts.choices) == 2
    status, got = server.post("/v1/completions", {"prompt": [[7, 8], [7, 99999]], "max_tokens": 2})
    assert status == 400 and got["error"]["param"] == "prompt.1", got


def test_top_logprobs_list_the_engines_most_likely_tokens(server, reference):
    """Chat `top_logprobs` and the legacy completions `logprobs: N` list, for each shown token, the most likely
    tokens the engine reports (SamplingParams.top_logprobs, checked against mlx-lm in test_engine_behaviour),
    most likely first; greedy, so the first is the chosen token."""
    engine = reference[0]
    messages = [{"role": "user", "content": "Tell me about the river and a garden"}]
    (want,) = engine.generate([messages], [SamplingParams(max_tokens=12, logprobs=True, top_logprobs=4)])
    prompt_ids = [7, 8, 9, 10, 11]
    (want_text,) = engine.generate([prompt_ids], [SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)])

    def decoded(pairs):
        return [(engine.tokenizer.decode([t]), lp) for t, lp in pairs]

    async def run():
        async with server.client() as client:
            chat = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                                        temperature=0, logprobs=True, top_logprobs=4)
            text = await client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=6, temperature=0,
                                                   logprobs=2)
            return chat, text

    chat, text = asyncio.run(run())
    entries = chat.choices[0].logprobs.content
    shown = len(want.token_ids) - (want.finish_reason is FinishReason.STOP)
    assert len(entries) == shown
    for entry, top in zip(entries, want.top_logprobs):
        got = [(alt.token, alt.logprob) for alt in entry.top_logprobs]
        assert [t for t, _ in got] == [t for t, _ in decoded(top)]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in top], abs=1e-5)
        assert (got[0][0], got[0][1]) == (entry.token, pytest.approx(entry.logprob, abs=1e-6))
        # raw token bytes (test_token_bytes.py): what decodes alone decodes the same as the token's text
        assert all(bytes(alt.bytes).decode("utf-8", "replace") == alt.token for alt in entry.top_logprobs)
    # ...and a client joins the chosen tokens' bytes back into the text
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == chat.choices[0].message.content
    legacy = text.choices[0].logprobs
    assert len(legacy.top_logprobs) == len(legacy.tokens) > 0
    for alternatives, top in zip(legacy.top_logprobs, want_text.top_logprobs):
        listed: dict[str, float] = {}
        for token_text, lp in decoded(top):  # tokens that decode alike (partial UTF-8) share a key
            listed.setdefault(token_text, lp)
        assert list(alternatives) == list(listed)
        assert list(alternatives.values()) == pytest.approx(list(listed.values()), abs=1e-5)


def test_echo_with_logprobs_answers_lm_evals_loglikelihood_request(server, reference):
    """lm-eval's `local-completions` loglikelihood request (token-id prompts, `max_tokens: 1`, `logprobs: 1`,
    `echo: true`) gets each prompt token's logprob (the first null) and the generated token's, as the engine
    computes them; `max_tokens: 0` scores the prompt alone (`SamplingParams.prompt_logprobs`, checked against a forward of the prompt in
    test_prompt_logprobs.py); lm-eval's own parsing (`token_logprobs[ctxlen:-1]`, greedy when each equals its
    alternatives' best) reads them. Echo without logprobs prepends the prompt's text, streamed or not. An echoing
    choice ended by a stop token still lists that token's logprob (its text is left out)."""
    engine = reference[0]
    contexts = [[7, 8, 9, 10, 11, 12], [21, 22, 23]]
    continuations = [[13, 14, 15], [24, 25]]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    want = engine.generate(prompts, SamplingParams(max_tokens=1, logprobs=True, top_logprobs=1, prompt_logprobs=1))
    status, body = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompts, "temperature": 0,
                                                   "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200, body
    for choice, prompt, context, out in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts, contexts,
                                            want):
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(out.prompt_logprobs[1:] + out.logprobs, abs=1e-5)
        assert logprobs["tokens"] == [engine.tokenizer.decode([t]) for t in prompt + out.token_ids]
        assert choice["text"].startswith(engine.tokenizer.decode(prompt))
        # lm-eval's parse_logprobs
        ctxlen = len(context)
        assert sum(logprobs["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(out.prompt_logprobs[ctxlen:]),
                                                                           abs=1e-4)
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs["token_logprobs"][ctxlen:-1],
                                                                logprobs["top_logprobs"][ctxlen:-1]))
        assert greedy == all(lp == top[0][1] for lp, top in zip(out.prompt_logprobs[ctxlen:],
                                                                out.prompt_top_logprobs[ctxlen:]))

    # max_tokens 0 (the legacy API's scoring call, older lm-eval's): the prompt alone, no completion
    status, scored = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompts[0], "max_tokens": 0,
                                                     "logprobs": 2, "echo": True, "temperature": 0})
    assert status == 200, scored
    (choice,) = scored["choices"]
    assert choice["text"] == engine.tokenizer.decode(prompts[0]) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(want[0].prompt_logprobs[1:], abs=1e-5)
    assert len(choice["logprobs"]["tokens"]) == len(prompts[0]) == len(choice["logprobs"]["top_logprobs"])
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(prompts[0])
    status, silent = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompts[1], "max_tokens": 0})
    assert status == 200 and silent["choices"][0]["text"] == "" and silent["choices"][0]["logprobs"] is None

    text = "Tell me about the river"
    (completion,) = engine.generate([text], SamplingParams(max_tokens=4))
    stop_id = completion.token_ids[0]

    async def run():
        async with server.client() as client:
            plain = await client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0,
                                                    echo=True)
            stream = await client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0,
                                                     echo=True, stream=True)
            chunks = [c async for c in stream]
            stopped = await client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0,
                                                      echo=True, logprobs=0, extra_body={"stop_token_ids": [stop_id]})
            prompt_only = await client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=0, echo=True,
                                                          stream=True)
            return plain, chunks, stopped, [c async for c in prompt_only]

    plain, chunks, stopped, prompt_only = asyncio.run(run())
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in prompt_only] == [(text, None), ("", "length")]
    assert plain.choices[0].text == text + completion.text and plain.choices[0].logprobs is None
    assert chunks[0].choices[0].text == text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text + completion.text
    entries = stopped.choices[0].logprobs
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text
    assert len(entries.token_logprobs) == stopped.usage.prompt_tokens + 1 and entries.top_logprobs is None
    assert entries.token_logprobs[-1] is not None and entries.tokens[-1] == engine.tokenizer.decode([stop_id])


def _expected_prompt_logprobs(engine, out, k: int) -> list:
    """What vLLM's `prompt_logprobs` field holds for the engine's output `out` (the server renders the same
    numbers): per prompt token after the first, its own entry (logprob, rank) then its position's k most likely
    (ranks 1..k), one entry per token id."""
    field = [None]
    for token, lp, rank, top in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:],
                                    out.prompt_top_logprobs[1:]):
        entries = {str(token): (lp, rank)}
        for place, (t, value) in enumerate(top[:k], 1):
            entries[str(t)] = (value, place)
        field.append(entries)
    return field


def _assert_prompt_logprobs_field(engine, got: list, want: list) -> None:
    """The server's field against the in-process engine's. Their forwards may batch differently (under OpenBLAS
    the values then differ in the last bits): a rank is exact where the values are, else within one (a
    vocabulary entry that close to the token's value can land on either side of it)."""
    assert len(got) == len(want) and got[0] is None
    for entries, wanted in zip(got[1:], want[1:]):
        assert list(entries) == list(wanted)  # the prompt token first, then the most likely in order
        for token, (value, rank) in wanted.items():
            assert entries[token]["logprob"] == pytest.approx(value, abs=1e-5)
            assert abs(entries[token]["rank"] - rank) <= (entries[token]["logprob"] != value)
            assert entries[token]["decoded_token"] == engine.tokenizer.decode([int(token)])


def test_prompt_logprobs_are_vllms_field(server, reference):
    """vLLM's `prompt_logprobs` request field and answer: on /v1/completions each choice carries its own prompt's
    (computed once per prompt, shared by its n choices), on chat the request carries its rendered prompt's; each
    prompt token's logprob, its rank among the whole vocabulary and its position's k most likely tokens are the
    engine's own (`SamplingParams.prompt_logprobs`, tested against a forward of the prompt alone in
    test_prompt_logprobs.py). `max_tokens: 0` scores the prompt alone; beside `echo` + `logprobs: 1` the echo still
    lists one alternative a token. Streaming and out-of-range values are refused in
    test_every_bad_input_is_refused_naming_the_field_and_nothing_is_queued."""
    engine = reference[0]
    prompts = [[7, 8, 9, 10, 11, 12], [21, 22, 23]]
    want = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=3))
    status, body = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 1,
                                                   "temperature": 0, "prompt_logprobs": 3, "n": 2})
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 4 and all(c["logprobs"] is None for c in choices)
    for choice in choices:
        out = want[choice["index"] // 2]
        assert out.prompt_token_ids == prompts[choice["index"] // 2]
        _assert_prompt_logprobs_field(engine, choice["prompt_logprobs"], _expected_prompt_logprobs(engine, out, 3))
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert "prompt_logprobs" not in body  # completions: per choice

    status, scored = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompts[0], "max_tokens": 0,
                                                     "prompt_logprobs": 0, "echo": True, "logprobs": 1})
    assert status == 200, scored
    (choice,) = scored["choices"]
    assert choice["text"] == engine.tokenizer.decode(prompts[0]) and scored["usage"]["completion_tokens"] == 0
    _assert_prompt_logprobs_field(engine, choice["prompt_logprobs"], _expected_prompt_logprobs(engine, want[0], 0))
    assert all(top is None or len(top) == 1 for top in choice["logprobs"]["top_logprobs"])

    messages = [{"role": "user", "content": "Tell me about the river and a garden"}]
    (chat_want,) = engine.generate([messages], SamplingParams(max_tokens=4, prompt_logprobs=2))
    status, chat = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 4,
                                                        "temperature": 0, "prompt_logprobs": 2})
    assert status == 200, chat
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] == len(chat_want.prompt_token_ids)
    _assert_prompt_logprobs_field(engine, chat["prompt_logprobs"], _expected_prompt_logprobs(engine, chat_want, 2))
    assert "prompt_logprobs" not in chat["choices"][0]
    status, plain = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 4})
    assert status == 200 and "prompt_logprobs" not in plain


def _png_file(tmp_path: Path) -> Path:
    path = tmp_path / "real.png"
    _picture(5, (56, 56))[0].save(path)
    return path


def _bad_inputs(tmp_path: Path, media_server: MediaServer) -> list[tuple[str, bytes | dict, int, str]]:
    """(endpoint, body, status, the field the error must name)."""
    ok = [{"role": "user", "content": "hi"}]
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    garbage = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
    long_text = " ".join(["the scheduler and the river"] * 200)  # far more than 512 tokens
    return [
        (chat, b'{"messages": [', 400, "body"),
        (chat, b"[1, 2]", 400, "body"),
        (chat, {"messages": ok, "max_token": 5}, 400, "max_token"),  # unknown field
        (chat, {"messages": ok, "temperature": "hot"}, 400, "temperature"),
        (chat, {"messages": ok, "max_tokens": 1.5}, 400, "max_tokens"),
        (chat, {"messages": "hi"}, 400, "messages"),
        (chat, {"messages": ok, "priority": "high"}, 400, "priority"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": []}]}, 400, "messages.0.content"),
        (chat, {"messages": [{"role": "user", "content": long_text}]}, 400, "messages"),
        (cmpl, {"prompt": [7] * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
        (cmpl, {"prompt": ""}, 400, "prompt"),
        (chat, {"messages": ok, "temperature": -1}, 400, "temperature"),
        (chat, {"messages": ok, "top_p": 0}, 400, "top_p"),
        (chat, {"messages": ok, "top_k": -2}, 400, "top_k"),
        (chat, {"messages": ok, "min_p": 1}, 400, "min_p"),
        (chat, {"messages": ok, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (chat, b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": NaN}', 400, "presence_penalty"),
        (chat, {"messages": ok, "max_tokens": 0}, 400, "max_tokens"),
        (chat, {"messages": ok, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (chat, {"messages": ok, "n": 0}, 400, "n"),
        (chat, {"messages": ok, "seed": -1}, 400, "seed"),
        (chat, {"messages": ok, "stop": [99999]}, 400, "stop"),
        (chat, {"messages": ok, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        (chat, {"messages": ok, "min_tokens": -1}, 400, "min_tokens"),
        (chat, {"messages": ok, "allowed_token_ids": []}, 400, "allowed_token_ids"),
        (chat, {"messages": ok, "bad_words": [" "]}, 400, "bad_words"),
        (cmpl, {"prompt": "hi", "allowed_token_ids": [5, 999999]}, 400, "allowed_token_ids"),
        (cmpl, {"prompt": "hi", "max_tokens": 0, "min_tokens": 1}, 400, "min_tokens"),
        (chat, {"messages": ok, "min_tokens": 1, "response_format": {"type": "json_object"}}, 400, "min_tokens"),
        (chat, {"messages": ok, "top_logprobs": 2}, 400, "top_logprobs"),  # needs logprobs: true
        (chat, {"messages": ok, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
        (chat, b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": Infinity}', 400,
         "frequency_penalty"),
        (chat, {"messages": ok, "logit_bias": {"the": 1}}, 400, "logit_bias"),
        (chat, {"messages": ok, "logit_bias": {"5": 101}}, 400, "logit_bias"),
        (cmpl, {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),  # outside the vocabulary
        # the VLM's tokenizer declares no tool-call format; and a tool message needs the call's id
        (chat, {"messages": ok, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        (chat, {"messages": ok + [{"role": "tool", "content": "sunny"}]}, 400, "messages.1"),
        (chat, {"messages": ok, "tool_choice": "required"}, 400, "tool_choice"),
        (cmpl, {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
        (cmpl, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        (cmpl, {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),  # vLLM's whole vocabulary: not here
        (chat, {"messages": ok, "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": garbage}},
                                                           {"type": "text", "text": "hi"}]}]}, 400,
         "messages.0.content.0"),
        (chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(tmp_path / "missing.png")}}]}]}, 400, "messages.0.content.0"),
        # a file that exists, but this server allows no media directory: it reads no file a client names
        (chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"file://{_png_file(tmp_path)}"}}]}]}, 400,
         "messages.0.content.0"),
        (chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": media_server.url("/missing")}}]}]}, 400,
         "messages.0.content.0"),  # fetched: HTTP 404
        (chat, {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, 400,
         "messages.0.content.0"),  # this model takes no audio
        # decodes, but the model's processor refuses it (Qwen2-VL: aspect ratio at most 200): the engine's
        # UnreadableMedia names image 1, which the server maps back to its part
        (chat, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                             {"role": "user", "content": [
                                 {"type": "image_url", "image_url": {"url": _picture(3, (56, 56))[1]}},
                                 {"type": "text", "text": "and these?"},
                                 {"type": "image_url", "image_url": {"url": _picture(4, (2000, 8))[1]}}]}]},
         400, "messages.2.content.2"),
        (chat, {"messages": ok, "model": "gpt-4"}, 404, "model"),
    ]


def test_every_bad_input_is_refused_naming_the_field_and_nothing_is_queued(server, reference, tmp_path, media_server):
    cases = _bad_inputs(tmp_path, media_server)
    before = server.metrics()
    messages = [{"role": "user", "content": "Tell me about a quiet street"}]
    (ref_text, _, _, ref_prompt), = _greedy_reference(reference, [messages], [None], [20])

    async def run():
        async with server.client() as client:  # a good request runs while the bad ones are refused
            good = asyncio.create_task(_stream_chat(client, messages, max_tokens=20, temperature=0))
            answers = await asyncio.gather(*[asyncio.to_thread(server.post, path, body) for path, body, _, _ in cases])
            return answers, await good

    answers, (text, _, usage, _) = asyncio.run(run())
    for (path, body, status, param), (got_status, got) in zip(cases, answers):
        where = f"{path} {body if isinstance(body, bytes) else json.dumps(body)[:120]}"
        assert got_status == status, where
        assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, where
        assert got["error"]["param"] == param, f"{where}: {got['error']}"
        assert got["error"]["message"], where
    assert text == ref_text and usage.prompt_tokens == ref_prompt

    after = server.metrics()
    # only the good request reached the engine
    assert _value(after, "mlxsched_prompt_tokens_total") - _value(before, "mlxsched_prompt_tokens_total") == ref_prompt
    ended = "mlxsched_requests_ended_total"
    assert _value(after, ended, finish_reason="length") - _value(before, ended, finish_reason="length") == 1
    assert _value(after, "mlxsched_queue_length") == 0
    # the openai client sees the same refusals as typed errors
    async def typed():
        async with server.client() as client:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=-1)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="gpt-4", messages=messages)
            return bad.value

    assert typed_error_param(asyncio.run(typed())) == "temperature"


def test_image_urls_are_fetched_from_the_allowed_media_domains(servers, reference, media_server):
    """The main server fetches from any host, the small one (`--allowed-media-domains localhost`) only from
    localhost: an image by http URL answers what the same image as a data: URL does."""
    main, small = servers
    picture, data_url = _picture(21, (84, 112))
    url = media_server.serve("/serve.png", base64.b64decode(data_url.split(",", 1)[1]), "image/png")
    text = "Tell me about a garden"
    engine_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    (ref_text, ref_tokens, _, ref_prompt), = _greedy_reference(reference, [engine_messages], [[picture]], [12])

    def chat(server: Server, image_url: str, max_tokens: int = 12) -> tuple[int, dict]:
        return server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0})

    status, got = chat(main, url)
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == ref_text
    assert (got["usage"]["completion_tokens"], got["usage"]["prompt_tokens"]) == (ref_tokens, ref_prompt)
    status, got = chat(small, url, 1)
    assert status == 400 and got["error"]["param"] == "messages.0.content.0"
    assert "host '127.0.0.1' is not among the allowed media domains" in got["error"]["message"]
    fetched = media_server.requests["/serve.png"]
    assert chat(small, media_server.url("/serve.png", host="localhost"), 1)[0] == 200
    assert media_server.requests["/serve.png"] == fetched + 1


def test_requests_stalled_on_a_media_host_hold_no_other_request(server, reference, media_server):
    """Eight chats whose image host answers nothing (more than asyncio's default pool has threads on a small
    machine) wait on the server's media-fetch pool; a text chat sent after them is answered meanwhile. Then the
    host answers with bytes that are no image: each of the eight is a 400 naming its part."""
    messages = [{"role": "user", "content": "Tell me about the market"}]
    (ref_text, _, _, _), = _greedy_reference(reference, [messages], [None], [6])
    stalled = [f"/stall/serve{i}" for i in range(8)]

    async def run():
        async with server.client() as client:
            waiting = [asyncio.create_task(client.chat.completions.create(
                model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": media_server.url(path)}},
                    {"type": "text", "text": "hi"}]}])) for path in stalled]
            deadline = time.monotonic() + 30
            while not all(media_server.requests[p] for p in stalled) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert all(media_server.requests[p] for p in stalled)  # every one is fetching
            try:
                answer = await asyncio.wait_for(client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0), 8)
                assert not any(task.done() for task in waiting)
            finally:
                for path in stalled:
                    media_server.release(path.removeprefix("/stall/"))
            refused = await asyncio.gather(*waiting, return_exceptions=True)
            return answer, refused

    answer, refused = asyncio.run(run())
    assert answer.choices[0].message.content == ref_text
    for exc in refused:
        assert isinstance(exc, openai.BadRequestError), exc
        assert typed_error_param(exc) == "messages.0.content.0"
        assert "not a readable image" in str(exc)


def test_tokenize_gives_the_prompt_tokens_the_engine_runs_and_detokenize_reverses_them(server, reference,
                                                                                       media_server):
    """vLLM's /tokenize and /detokenize: a chat with an image (as a data: URL and as an http URL) tokenizes to the
    ids the engine queued for the same chat completion; a text prompt to the tokenizer's encoding."""
    engine, sink = reference
    picture, data_url = _picture(31, (84, 56))
    http_url = media_server.serve("/tokenize.png", base64.b64decode(data_url.split(",", 1)[1]), "image/png")
    text = "Tell me about an old clock"

    def api(url: str) -> list:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": text}]}]

    status, chat = server.post("/v1/chat/completions", {"messages": api(data_url), "max_tokens": 2, "temperature": 0})
    assert status == 200, chat
    first = len(sink.events)
    engine.generate([[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]],
                    [SamplingParams(max_tokens=1)], images=[[picture]])
    queued, = [e["prompt_tokens"] for e in sink.events[first:] if e["event"] == "arrival"]
    for url in (data_url, http_url):
        status, got = server.post("/tokenize", {"model": MODEL_NAME, "messages": api(url), "return_token_strs": True})
        assert status == 200, got
        assert got["tokens"] == queued and got["count"] == len(queued) == chat["usage"]["prompt_tokens"]
        assert got["max_model_len"] == MAX_MODEL_LEN
        assert got["token_strs"] == engine.tokenizer.convert_ids_to_tokens(queued)
    status, got = server.post("/tokenize", {"prompt": text})
    assert status == 200 and got["tokens"] == engine.tokenizer.encode(text) and got["token_strs"] is None
    status, got = server.post("/detokenize", {"model": MODEL_NAME, "tokens": queued})
    assert status == 200 and got == {"prompt": engine.tokenizer.decode(queued)}
    assert server.post("/detokenize", {"tokens": []}) == (200, {"prompt": ""})

    too_long = " ".join(["the scheduler and the river"] * 200)
    refused = [
        ("/tokenize", {"prompt": text, "messages": [{"role": "user", "content": text}]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": text, "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": text}], "continue_final_message": True}, 400,
         "continue_final_message"),
        ("/tokenize", {"prompt": text, "add_special_tokens": False}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": text, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("/tokenize", {"messages": api(media_server.url("/missing"))}, 400, "messages.0.content.0"),
        ("/tokenize", {"messages": [{"role": "user", "content": too_long}]}, 400, "messages"),
        ("/tokenize", {"prompt": text, "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [1, engine.vocab_size]}, 400, "tokens"),
        ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ]
    for path, body, status, param in refused:
        got_status, got = server.post(path, body)
        assert (got_status, got["error"]["param"]) == (status, param), (path, body, got)
    assert "max_model_len is 512" in server.post("/tokenize", {"prompt": too_long})[1]["error"]["message"]


def test_an_assistant_message_is_continued_and_a_chat_can_end_without_the_generation_prompt(server, reference):
    """vLLM's `continue_final_message` (an assistant prefill) and `add_generation_prompt`: /tokenize gives the
    engine's rendering with them (chat_template_kwargs of the same names), and the chat completion answers with
    what the engine generates after that prompt, streamed or not: the continuation, not the prefill. Refused by
    field: a continued message that is not the assistant's, both true, a field given twice."""
    engine, _ = reference
    ask = [{"role": "user", "content": "Tell me about the river and a garden"}]
    begun = ask + [{"role": "assistant", "content": "The garden"}]
    cases = [(begun, {"continue_final_message": True}), (ask, {"add_generation_prompt": False})]
    for messages, fields in cases:
        want_ids = engine.tokenize(messages, chat_template_kwargs=fields)
        assert want_ids != engine.tokenize(messages[:1])
        status, got = server.post("/tokenize", {"messages": messages, **fields})
        assert status == 200 and got["tokens"] == want_ids, got
        (out,) = engine.generate([want_ids], [SamplingParams(max_tokens=10)])
        shown = out.token_ids[:-1] if out.finish_reason is FinishReason.STOP else out.token_ids

        async def run():
            async with server.client() as client:
                whole = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                                             temperature=0, extra_body=fields)
                return whole, await _stream_chat(client, messages, max_tokens=10, temperature=0, extra_body=fields)

        whole, streamed = asyncio.run(run())
        assert whole.choices[0].message.content == streamed[0] == engine.tokenizer.decode(shown), fields
        assert whole.usage.prompt_tokens == len(want_ids)
    chat = "/v1/chat/completions"
    for body, param in (({"messages": ask, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": begun, "continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message"),
                        ({"messages": begun, "continue_final_message": True,
                          "chat_template_kwargs": {"continue_final_message": True}}, "continue_final_message")):
        status, got = server.post(chat, {"max_tokens": 2, **body})
        assert (status, got["error"]["param"]) == (400, param), (body, got)


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(server):
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI's field): none for a prompt the server has not seen,
    then what the prefix cache served, as its hit-token counter moves, streamed (include_usage) or not."""
    words = random.Random(46).choices(["river", "clock", "market", "garden", "street", "cache", "lamp"], k=80)
    messages = [{"role": "system", "content": " ".join(words)}, {"role": "user", "content": "and then?"}]
    hit_tokens = "mlxsched_prefix_cache_hit_tokens_total"

    async def chat(stream: bool):
        async with server.client() as client:
            if not stream:
                return (await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3,
                                                             temperature=0)).usage
            chunks = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
            return [chunk.usage async for chunk in chunks if chunk.usage is not None][-1]

    first = asyncio.run(chat(False))
    assert first.prompt_tokens_details.cached_tokens == 0
    for stream in (False, True):
        before = _value(server.metrics(), hit_tokens)
        again = asyncio.run(chat(stream))
        served = _value(server.metrics(), hit_tokens) - before
        assert again.prompt_tokens == first.prompt_tokens
        assert 0 < again.prompt_tokens_details.cached_tokens == served < again.prompt_tokens


def typed_error_param(exc: openai.APIStatusError) -> str:
    return exc.body["param"] if isinstance(exc.body, dict) and "param" in exc.body else exc.body["error"]["param"]


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    picture, url = _picture(99, (84, 84))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Tell me a long story"}]}]
    before = server.metrics()

    async def run():
        async with server.client() as client:
            stream = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=400,
                                                          temperature=0, stream=True)
            received, cid = 0, None
            async for chunk in stream:
                cid = chunk.id
                received += sum(1 for c in chunk.choices if c.delta.content)
                if received >= 3:
                    break
            await stream.close()  # drops the connection mid-stream
            return cid

    cid = asyncio.run(run())
    ended = "mlxsched_requests_ended_total"
    _wait_for(lambda: _value(server.metrics(), ended, finish_reason="abort")
              == _value(before, ended, finish_reason="abort") + 1)
    after = server.metrics()
    # its KV rows, per-request caches and encoded image are freed; nothing is live
    assert _value(after, "mlxsched_executor_requests") == 0
    assert _value(after, "mlxsched_kv_cache_bytes") == 0
    assert _value(after, "mlxsched_kv_request_caches") == 0
    assert all(_value(after, "mlxsched_requests", state=s) == 0 for s in
               ("queued", "vision_encoding", "chunk_prefilling", "decoding", "drafting"))
    assert _value(after, "mlxsched_generation_tokens_total") - _value(before, "mlxsched_generation_tokens_total") < 400
    server.aborted_request = f"{cid}-0"  # the trace is checked after shutdown (it is flushed on close)


def test_a_client_that_gives_up_on_a_non_streaming_request_aborts_it(server):
    before = server.metrics()
    limit = MAX_MODEL_LEN - 40

    async def run():
        async with server.client() as client:
            with pytest.raises(openai.APITimeoutError):  # the client closes its connection after 0.3 s
                await client.with_options(timeout=0.3).chat.completions.create(
                    model=MODEL_NAME, max_tokens=limit, temperature=0,
                    messages=[{"role": "user", "content": "Tell me everything"}])

    asyncio.run(run())
    ended = "mlxsched_requests_ended_total"
    _wait_for(lambda: _value(server.metrics(), ended, finish_reason="abort")
              == _value(before, ended, finish_reason="abort") + 1)
    after = server.metrics()
    assert _value(after, "mlxsched_executor_requests") == 0 and _value(after, "mlxsched_kv_cache_bytes") == 0
    assert _value(after, "mlxsched_generation_tokens_total") - _value(before, "mlxsched_generation_tokens_total") < limit


def test_metrics_match_the_counts(server):
    before = server.metrics()
    picture, url = _picture(5, (56, 84))
    image_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is this?"}]}]
    text_messages = [{"role": "user", "content": "Where is the market?"}]

    async def run():
        async with server.client() as client:
            answers = []
            # the same image twice: a vision-cache hit (and a prefix-cache hit: same prompt, same image)
            for messages in (image_messages, image_messages, text_messages):
                answers.append(await client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                                    max_tokens=9, temperature=0))
            return answers

    answers = asyncio.run(run())
    after = server.metrics()

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("mlxsched_generation_tokens_total") == sum(a.usage.completion_tokens for a in answers) == 27
    assert delta("mlxsched_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert delta("mlxsched_requests_ended_total", finish_reason="length") == 3
    assert delta("mlxsched_choices_total", finish_reason="length") == 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
                      "queue_time_seconds"):
        assert delta(f"mlxsched_{histogram}_count") == 3, histogram
    assert delta("mlxsched_tick_duration_seconds_count") >= 27  # one token per request per tick at most
    assert delta("mlxsched_http_requests_total", endpoint="/v1/chat/completions", status="200") == 3
    assert (delta("mlxsched_vision_cache_misses_total"), delta("mlxsched_vision_cache_hits_total")) == (1, 1)
    hits, misses = _value(after, "mlxsched_vision_cache_hits_total"), _value(after, "mlxsched_vision_cache_misses_total")
    assert _value(after, "mlxsched_vision_cache_hit_rate") == pytest.approx(hits / (hits + misses))
    assert _value(after, "mlxsched_vision_cache_entries") >= 1 and _value(after, "mlxsched_vision_cache_bytes") > 0
    assert delta("mlxsched_prefix_cache_hits_total") >= 1 and delta("mlxsched_prefix_cache_hit_tokens_total") >= 16
    hits, misses = _value(after, "mlxsched_prefix_cache_hits_total"), _value(after, "mlxsched_prefix_cache_misses_total")
    assert _value(after, "mlxsched_prefix_cache_hit_rate") == pytest.approx(hits / (hits + misses))
    assert _value(after, "mlxsched_prefix_cache_entries") >= 1 and _value(after, "mlxsched_prefix_cache_bytes") > 0
    # a hit skips computing: prefill tokens computed are the prompt tokens less the reused ones
    assert delta("mlxsched_prefill_tokens_total") == (delta("mlxsched_prompt_tokens_total")
                                                      - delta("mlxsched_prefix_cache_hit_tokens_total"))
    for gauge in ("mlxsched_queue_length", "mlxsched_running_rows", "mlxsched_kv_cache_bytes"):
        assert _value(after, gauge) == 0, gauge
    assert _value(after, "mlxsched_kv_cache_budget_bytes") == 0  # no --kv-memory-mb


def test_an_oversized_body_is_a_413_whether_or_not_it_declares_its_length(servers):
    """`--max-request-mb 1`: a body over it is refused by its Content-Length before it is read, and a chunked
    one (no length) once 1 MB of it has arrived; the server answers the next request as usual."""
    import http.client

    small = servers[1]
    host, port = small.base_url.removeprefix("http://").split(":")
    image = "data:image/png;base64," + "A" * (1200 << 10)  # a little over the limit: what is left unread is small
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]})

    def post(chunked: bool) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            if chunked:
                pieces = (body[i: i + 65536].encode() for i in range(0, len(body), 65536))
                conn.request("POST", "/v1/chat/completions", body=pieces, encode_chunked=True,
                             headers={"Content-Type": "application/json"})
            else:
                conn.request("POST", "/v1/chat/completions", body=body.encode(),
                             headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    for chunked in (False, True):
        status, got = post(chunked)
        assert status == 413 and got["error"]["param"] == "body", (chunked, got)
    status, got = small.post("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2, "temperature": 0})
    assert status == 200, got


def test_max_queue_answers_429_and_a_failed_engine_loop_answers_503(servers):
    small = servers[1]

    async def run():
        async with small.client() as client:
            # the one slot: a long stream (it decodes until the trace can no longer be written)
            runner = await client.chat.completions.create(model=MODEL_NAME, max_tokens=MAX_MODEL_LEN, temperature=0,
                                                          messages=[{"role": "user", "content": "go on"}], stream=True)
            chunks = runner.__aiter__()
            while not (await chunks.__anext__()).choices[0].delta.content:
                pass
            waiting = asyncio.create_task(client.chat.completions.create(
                model=MODEL_NAME, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "wait"}]))
            await asyncio.to_thread(_wait_for, lambda: _value(small.metrics(), "mlxsched_queue_length") == 1)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0,
                                                     messages=[{"role": "user", "content": "one too many"}])
            assert refused.value.status_code == 429
            # the loop dies when the trace write fails: the stream ends with an error event, the waiting
            # request with a 503
            with pytest.raises(openai.APIError) as failed:
                async for _ in chunks:
                    pass
            with pytest.raises(openai.InternalServerError) as unavailable:
                await waiting
            return failed.value, unavailable.value

    # more choices than --max-queue 1 could ever hold: a 400 naming n, not a 429 to retry for ever
    status, body = small.post("/v1/completions", {"prompt": [7, 8], "n": 2, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "n", body
    failed, unavailable = asyncio.run(run())
    assert "engine" in str(failed)
    assert unavailable.status_code == 503
    status, raw = small.get("/health")
    assert status == 503 and json.loads(raw)["error"]["type"] == "server_error"
    status, body = small.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and body["error"]["message"]
    assert small.get("/metrics")[0] == 200  # the event-fed metrics still answer


def test_cache_salt_and_request_id_as_vllm_takes_them(server):
    """vLLM's `cache_salt`: the same prompt under salt "s1", "s2", then "s1" again (one after another) hits the
    prefix cache only the third time, and answers the same text each time. vLLM's `request_id` (and the
    X-Request-Id header, which takes its place): the answer's id is "<kind>-<id>"; an id whose request is still
    known to the engine is refused, and a malformed one is a 400 naming the field."""
    prompt = "tell me a long story about the sea and the ships that sail on it " * 2
    texts = []
    for salt in ("s1", "s2", "s1"):
        before = server.metrics()
        status, answer = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                         "cache_salt": salt})
        assert status == 200, answer
        texts.append(answer["choices"][0]["text"])
        hits = _value(server.metrics(), "mlxsched_prefix_cache_hits_total") - _value(
            before, "mlxsched_prefix_cache_hits_total")
        assert hits == (1 if len(texts) == 3 else 0), (salt, len(texts))
    assert len(set(texts)) == 1
    status, error = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "cache_salt": ""})
    assert status == 400 and error["error"]["param"] == "cache_salt"

    status, answer = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2, "request_id": "my-id.1"})
    assert status == 200 and answer["id"] == "chatcmpl-my-id.1"
    status, error = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "request_id": "my-id.1"})
    assert status == 400 and "duplicate request id" in error["error"]["message"]
    request = urllib.request.Request(server.base_url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "hi", "max_tokens": 2, "request_id": "x"}).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": "from-header"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["id"] == "cmpl-from-header"
    status, error = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "has space"})
    assert status == 400 and error["error"]["param"] == "request_id"
    # (no --allow-runtime-lora here: the runtime LoRA routes are off)
    status, error = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"})
    assert status == 404 and "--allow-runtime-lora" in error["error"]["message"]


def _sse_chunks(server: Server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer, in order ([DONE] left out)."""
    status, raw = server.post_raw(path, {**body, "stream": True})
    assert status == 200, raw
    lines = [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_return_token_ids_answers_the_prompt_and_each_choices_tokens(server, reference):
    """vLLM's `return_token_ids`: a chat answer's `prompt_token_ids` are the prompt as the engine renders it
    (`Engine.tokenize`, which `RequestOutput.prompt_token_ids` equals too) and each choice's `token_ids` what the
    engine produced for it (its stop token included); streamed, each choice's first chunk carries the prompt and
    its chunks' `token_ids` join to the same tokens. On /v1/completions each choice carries its prompt's ids and
    its own. Without the field the answer has neither."""
    engine, _ = reference
    messages = [{"role": "user", "content": "count the ships in the harbour"}]
    prompt_ids = engine.tokenize(messages)
    (want,) = engine.generate([messages], [SamplingParams(max_tokens=7)])
    assert want.prompt_token_ids == prompt_ids
    ask = {"messages": messages, "max_tokens": 7, "temperature": 0, "return_token_ids": True}
    status, chat = server.post("/v1/chat/completions", ask)
    assert status == 200, chat
    assert chat["prompt_token_ids"] == prompt_ids and chat["choices"][0]["token_ids"] == want.token_ids
    chunks = _sse_chunks(server, "/v1/chat/completions", ask)
    assert chunks[0]["prompt_token_ids"] == prompt_ids and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == want.token_ids
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == chat["choices"][0]["message"][
        "content"]

    prompts = [[5, 9, 200, 31, 7, 64], [11, 12, 13, 14]]
    wants = engine.generate(prompts, [SamplingParams(max_tokens=5)] * 2)
    ask = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    status, answer = server.post("/v1/completions", ask)
    assert status == 200, answer
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in answer["choices"]] == [
        (w.prompt_token_ids, w.token_ids) for w in wants]
    assert wants[0].prompt_token_ids == prompts[0]
    chunks = _sse_chunks(server, "/v1/completions", ask)
    for i, w in enumerate(wants):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == w.prompt_token_ids
        assert [t for c in mine for t in c["token_ids"]] == w.token_ids
    status, plain = server.post("/v1/completions", {"prompt": prompts[1], "max_tokens": 2})
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_skip_special_tokens_leaves_them_out_of_the_text(server, reference):
    """vLLM's `skip_special_tokens`: a choice pushed to a special token (`<|vision_start|>`, not a stop token)
    shows it in its text by default, as mlx-lm's server does, and leaves it out with the field true; the token ids
    and the rest of the text are the same either way, streamed and not."""
    engine, _ = reference
    special = engine.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    ask = {"prompt": "the ships", "max_tokens": 6, "temperature": 0, "logit_bias": {str(special): 8},
           "return_token_ids": True}
    answers = {}
    for skip in (False, True):
        status, answer = server.post("/v1/completions", {**ask, "skip_special_tokens": skip})
        assert status == 200, answer
        streamed = _sse_chunks(server, "/v1/completions", {**ask, "skip_special_tokens": skip})
        assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == answer["choices"][0]["text"]
        answers[skip] = answer["choices"][0]
    tokens = answers[False]["token_ids"]
    assert answers[True]["token_ids"] == tokens and tokens.count(special) >= 1
    assert answers[False]["text"] == engine.tokenizer.decode(tokens)
    assert answers[True]["text"] == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "<|vision_start|>" in answers[False]["text"] and "<|vision_start|>" not in answers[True]["text"]


def test_sigint_shuts_down_cleanly(server):
    async def open_stream():
        client = server.client()
        stream = await client.chat.completions.create(model=MODEL_NAME, max_tokens=400, temperature=0, stream=True,
                                                      messages=[{"role": "user", "content": "a long answer"}])
        await stream.__aiter__().__anext__()
        return client, stream

    async def run():
        client, stream = await open_stream()  # a stream still open when the signal arrives
        server.process.send_signal(signal.SIGINT)
        started = time.monotonic()
        rc = await asyncio.to_thread(server.process.wait, 20)
        try:  # it finished within the grace period, or the server cut it: either way it is over
            async for _ in stream:
                pass
        except (openai.APIError, OSError):
            pass
        await client.close()
        return rc, time.monotonic() - started

    rc, took = asyncio.run(run())
    assert rc == 0, server.log.read_text()[-3000:]
    assert took < 15
    with pytest.raises(OSError):  # nothing listens any more
        server.get("/health")
    events = read_jsonl(server.trace)  # complete JSON lines: the trace was flushed and closed
    aborted = [e for e in events if e["event"] == "transition" and e["to"] == "aborted"]
    assert any(e["request_id"] == server.aborted_request for e in aborted)


def test_sigterm_shuts_down_cleanly_too(vlm_model_dir, tmp_path):
    """SIGTERM (what process managers send) as SIGINT: uvicorn shuts down, then raises the signal again with the
    handler from before it ran; the default one ended the process there (exit -15), so the engine loop was never
    stopped and the trace never flushed (it was empty)."""
    server = _start(vlm_model_dir, tmp_path, "term")
    try:
        _wait_healthy(server, time.monotonic() + 120)
        status, body = server.post("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 3, "temperature": 0})
        assert status == 200, body
        server.process.send_signal(signal.SIGTERM)
        rc = server.process.wait(30)
    finally:
        _stop(server)
    assert rc == 0, server.log.read_text()[-3000:]
    events = read_jsonl(server.trace)
    finished = [e for e in events if e["event"] == "transition" and e["to"] == "finished"]
    assert len(finished) == 1


def test_priority_orders_waiting_requests_under_the_priority_policy(vlm_model_dir, tmp_path):
    """`priority` (ours) reaches the engine: with one slot, `--policy priority` admits a later, more urgent request
    before an earlier, less urgent one that waits with it (the trace's admission order)."""
    # one slot, held by a long prompt prefilled a token per tick until both others wait: then its client goes
    # away (the stream is closed, which aborts it), however fast or slow the machine is. The urgent request is
    # 1000 levels above: the policy's aging (a level per 32 ticks waited) cannot let the early one overtake it
    # within the holder's 508 ticks, which 5 levels (160 ticks) did on a fast machine
    server = _start(vlm_model_dir, tmp_path, "priority", "--policy", "priority", "--max-seqs", "1",
                    "--prefill-chunk", "1", "--max-batched-tokens", "2")
    try:
        _wait_healthy(server, time.monotonic() + 120)

        def waiting(n):
            return lambda: _value(server.metrics(), "mlxsched_queue_length") == n

        async def run():
            async with server.client() as client:
                def ask(prompt, priority):
                    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0,
                                                     extra_body={"priority": priority})
                holder = await client.completions.create(model=MODEL_NAME, prompt=[7, 8, 9] * 140, max_tokens=88,
                                                         temperature=0, stream=True)
                await asyncio.to_thread(_wait_for, lambda: _value(server.metrics(), "mlxsched_requests",
                                                                  state="chunk_prefilling") == 1)
                low = asyncio.create_task(ask("an early request that can wait", 0))
                await asyncio.to_thread(_wait_for, waiting(1))
                high = asyncio.create_task(ask("a later urgent request", 1000))
                await asyncio.to_thread(_wait_for, waiting(2))
                await holder.close()
                await asyncio.gather(low, high)
        asyncio.run(run())
    finally:
        _stop(server)
    events = read_jsonl(server.trace)
    arrivals = [e for e in events if e["event"] == "arrival"]  # in arrival order
    assert [e["priority"] for e in arrivals] == [0, 0, 1000]
    _, low, high = (e["request_id"] for e in arrivals)
    admitted = [rid for e in events if e["event"] == "plan" for rid in e["admitted"]]
    assert admitted.index(high) < admitted.index(low)


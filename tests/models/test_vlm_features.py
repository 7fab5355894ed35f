"""Engine features on vision-language requests (the generic adapter), each against mlx-vlm run alone:
per-token logprobs, bounded context (max_kv_size: rotating caches), drafting with a draft model on image rows,
and seeded sampling that does not depend on what else is in the batch. The KV budget with preemption, prompt
lookup drafting and the media-keyed prefix cache are in tests/models/test_vlm_families.py."""

import json
import re

import numpy as np
import pytest
from PIL import Image

from scheduler import Engine, EngineConfig, SamplingParams

from ..helpers import drive

MAX_TOKENS = 12


def noise_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def user(text, n):
    content = [{"type": "image"}] * n + [{"type": "text", "text": text}] if n else text
    return [{"role": "user", "content": content}]


REQUESTS = [
    (user("What is in the picture? Tell me all about it, please.", 1), [noise_image(112, 140, seed=1)]),
    (user("Hi. The cat sat on the mat.", 0), []),
    (user("Describe both.", 2), [noise_image(56, 56, seed=2), noise_image(84, 112, seed=3)]),
    (user("The old man reads many books in the morning, and the teacher brings a warm coat.", 0), []),
]


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


def solo(vlm, messages, images, **kwargs):
    """(token ids, per-token logprob of the chosen token) of mlx_vlm.stream_generate alone."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = vlm
    prompt = apply_chat_template(processor, model.config, messages, num_images=len(images))
    results = list(mlx_vlm.stream_generate(model, processor, prompt, image=images or None, max_tokens=MAX_TOKENS,
                                           temperature=0.0, **kwargs))
    tokens = list(results[-1].token_ids)  # the last result sums the run up (its token repeats the one before)
    logprobs = [float(np.array(r.logprobs).reshape(-1)[r.token]) for r in results[: len(tokens)]]
    assert [r.token for r in results[: len(tokens)]] == tokens
    return tokens, logprobs


def run(engine, sampling, stagger=1):
    out = drive(engine, [(i * stagger, {"prompt": m, "images": im, "sampling": sampling})
                         for i, (m, im) in enumerate(REQUESTS)])
    assert not out.errors, out.errors
    return out


def test_logprobs_of_image_and_text_rows_equal_solo(vlm):
    model, processor = vlm
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=48, prefill_chunk=11, check_invariants=True))
    ids = []
    for i, (m, im) in enumerate(REQUESTS):
        ids.append(engine.add_request(prompt=m, images=im, sampling=SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    logprobs=True)))
    logprobs = {rid: [] for rid in ids}
    tokens = {rid: [] for rid in ids}
    while engine.has_pending():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            logprobs[out.request_id] += out.logprobs
    for rid, (m, im) in zip(ids, REQUESTS):
        want_tokens, want_lp = solo(vlm, m, im)
        assert tokens[rid] == want_tokens
        np.testing.assert_allclose(logprobs[rid], want_lp, rtol=1e-4, atol=1e-4)


def test_max_kv_size_matches_solo_rotating_generation(vlm):
    """Rotating caches of 40 tokens (no sinks, as the text engine): the image prompts are longer than the
    window, so the window wraps during prefill and decode; the reference is mlx_vlm alone with the same
    caches."""
    from mlx_vlm.models.cache import RotatingKVCache

    model, processor = vlm
    window = 40
    engine = Engine(model, processor, EngineConfig(max_kv_size=window, max_batched_tokens=48, prefill_chunk=13,
                                                   check_invariants=True))
    got = list(run(engine, SamplingParams(max_tokens=MAX_TOKENS)).tokens.values())
    layers = model.language_model.layers
    want = [solo(vlm, m, im, prompt_cache=[RotatingKVCache(max_size=window, keep=0) for _ in layers])[0]
            for m, im in REQUESTS]
    assert got == want
    assert got != [solo(vlm, m, im)[0] for m, im in REQUESTS]  # the window really changed the output


def test_draft_model_drafting_on_image_rows_is_exact(vlm, text_model):
    """The tiny text model shares the VLM's tokenizer: it drafts for image rows too (it reads the image pads
    as plain tokens; verification by the VLM keeps the output exact)."""
    model, processor = vlm
    draft, _ = text_model
    engine = Engine(model, processor, EngineConfig(draft_tokens=3, drafter="draft-model", check_invariants=True),
                    draft_model=draft)
    got = list(run(engine, SamplingParams(max_tokens=MAX_TOKENS)).tokens.values())
    assert got == [solo(vlm, m, im)[0] for m, im in REQUESTS]
    stats = engine.draft_stats()
    assert stats["drafted"] > 0 and stats["verify_forwards"] > 0


def test_seeded_sampling_does_not_depend_on_the_batch(vlm):
    model, processor = vlm
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=11)
    alone = []
    for m, im in REQUESTS:
        engine = Engine(model, processor, EngineConfig(check_invariants=True))
        alone += list(drive(engine, [(0, {"prompt": m, "images": im, "sampling": sampling})]).tokens.values())
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=40, prefill_chunk=9, check_invariants=True))
    together = list(run(engine, sampling).tokens.values())
    assert together == alone
    greedy = [solo(vlm, m, im)[0] for m, im in REQUESTS]
    assert together != greedy  # it really sampled


def test_mtp_drafting_is_refused_for_vlms(vlm):
    from scheduler.families import UnsupportedFeature

    model, processor = vlm
    with pytest.raises(UnsupportedFeature, match="MTP head"):
        Engine(model, processor, EngineConfig(draft_tokens=2, drafter="mtp"))


def test_an_image_prompt_past_mlx_vlms_first_prefill_step_converts_inside_its_prefill(vlm, tmp_path):
    """kv_bits: mlx-vlm alone converts a 2100-token image prompt after its first 2048-token prefill step; the
    engine's 300-token chunks straddle that point, so the chunk is split there (a `kv_quantize` event at 2048
    tokens), batched with a short image request; both equal mlx_vlm.stream_generate with the same settings, and
    the trace replays."""
    from scheduler.tools.replay import load_trace, replay

    from ..helpers import engine_with_log

    settings = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    words = "The old man reads many books in the morning, and the teacher brings a warm coat. "
    requests = [(user(words * 120, 1), [noise_image(112, 140, seed=1)]), REQUESTS[0]]
    want = [solo(vlm, m, im, **settings)[0] for m, im in requests]
    trace = tmp_path / "q.jsonl"
    engine, log = engine_with_log(*vlm, EngineConfig(max_batched_tokens=700, prefill_chunk=300,
                                                     trace_path=str(trace), **settings))
    out = drive(engine, [(0, {"prompt": m, "images": im, "sampling": SamplingParams(max_tokens=MAX_TOKENS),
                              "request_id": f"r{i}"}) for i, (m, im) in enumerate(requests)])
    engine.close()
    assert not out.errors, out.errors
    assert [out.tokens["r0"], out.tokens["r1"]] == want
    prompt_len = next(len(e["prompt_tokens"]) for e in log.of_kind("arrival") if e["request_id"] == "r0")
    assert prompt_len > 2048 + 300
    assert [e["request_ids"] for e in log.of_kind("kv_quantize") if e.get("tokens") == 2048] == [["r0"]]
    assert replay(load_trace(trace)).identical


def test_logit_bias_on_image_and_text_rows_equals_mlx_vlm_alone(vlm):
    """SamplingParams.logit_bias on vision-language rows is mlx-vlm's own `logit_bias` (its generate_step builds
    mlx-lm's processor from it): each biased row, batched with the others, equals mlx_vlm.stream_generate alone
    with the same bias, which changes its output."""
    plain = [solo(vlm, m, im)[0] for m, im in REQUESTS]
    biases = [{plain[0][0]: -100.0, plain[0][3]: 8.0}, {}, {plain[2][1]: -100.0}, {plain[3][2]: 6.0, 11: 2.5}]
    want = [solo(vlm, m, im, logit_bias=b or None)[0] for (m, im), b in zip(REQUESTS, biases)]
    assert all(w != p for w, p, b in zip(want, plain, biases) if b)
    engine = Engine(*vlm, EngineConfig(max_batched_tokens=40, prefill_chunk=9, check_invariants=True))
    out = drive(engine, [(i, {"prompt": m, "images": im, "request_id": f"r{i}",
                              "sampling": SamplingParams(max_tokens=MAX_TOKENS, logit_bias=b)})
                         for i, ((m, im), b) in enumerate(zip(REQUESTS, biases))])
    assert not out.errors, out.errors
    assert [out.tokens[f"r{i}"] for i in range(len(REQUESTS))] == want


def test_structured_outputs_on_image_and_text_rows_equal_mlx_vlm_alone(vlm):
    """SamplingParams.structured_output on vision-language rows: each constrained row, batched with an
    unconstrained one, equals mlx_vlm.stream_generate alone given the same `GrammarProcessor`, which changes its
    output, and keeps to its constraint (a choice and a regex short enough to finish within the tokens)."""
    from scheduler import StructuredOutput

    engine = Engine(*vlm, EngineConfig(max_batched_tokens=40, prefill_chunk=9, check_invariants=True))
    choices = ["cat", "two dogs", "none"]
    constraints = [StructuredOutput.choice(choices), None, StructuredOutput.regex(r"[0-9]-(yes|no)"),
                   StructuredOutput.json({"type": "object", "required": ["n"], "additionalProperties": False,
                                          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}})]
    want = [solo(vlm, m, im, logits_processors=[engine.grammars.processor(c)] if c else None)[0]
            for (m, im), c in zip(REQUESTS, constraints)]
    assert [w != solo(vlm, m, im)[0] for w, (m, im) in zip(want, REQUESTS)] == [c is not None for c in constraints]
    out = drive(engine, [(i, {"prompt": m, "images": im, "request_id": f"r{i}",
                              "sampling": SamplingParams(max_tokens=MAX_TOKENS, structured_output=c)})
                         for i, ((m, im), c) in enumerate(zip(REQUESTS, constraints))])
    assert not out.errors, out.errors
    assert [out.tokens[f"r{i}"] for i in range(len(REQUESTS))] == want
    eos, tokenizer = engine.scheduler.model_stop_ids, vlm[1].tokenizer
    text = [tokenizer.decode([t for t in out.tokens[f"r{i}"] if t not in eos]) for i in range(len(REQUESTS))]
    assert text[0] in choices and re.fullmatch(r"[0-9]-(yes|no)", text[2]) and 0 <= json.loads(text[3])["n"] <= 99


# Ministral 3's and Devstral Small 2's text config (mlx-vlm's mistral3 with text model_type "ministral3"): yarn
# rope_parameters with Llama-4 attention scaling, llama_4_scaling_beta 0.1 past original_max_position_embeddings
# (16384 in Ministral 3's, 8192 in Devstral Small 2's); here past 64, so that tiny prompts cross it
MINISTRAL3_ROPE = {"rope_type": "yarn", "type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


def test_llama_4_attention_scaling_caps_the_context_where_it_batches_exactly(tmp_path):
    """mlx-vlm's Ministral 3 language model scales the queries by 1 + beta * log(1 + floor(position /
    original_max_position_embeddings)), with the positions of every row of a batch taken from the first row's
    cache offset. Past that position a batched row got another row's scale: with the limit at 16 and the context
    uncapped, 3 of 7 requests of a mixed image / text workload (all at once) gave other greedy tokens than solo
    mlx-vlm, 4 of 7 staggered in chunks of 8. Below it the scale is exactly 1 for every row, so the engine caps its
    context there (a larger max_model_len is refused, naming why), and image and text rows batch exactly inside it."""
    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    path = build_tiny_vlm("mistral3", tmp_path / "ministral3", seed=5)
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(model_type="ministral3", rope_parameters=MINISTRAL3_ROPE,
                                 max_position_embeddings=262144)
    (path / "config.json").write_text(json.dumps(config))
    model, processor = mlx_vlm.load(str(path))
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=24, prefill_chunk=8, max_seqs=6))
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="batches exactly only up to 64 positions .*llama_4_scaling_beta"):
        Engine(model, processor, EngineConfig(max_model_len=128))
    requests = [(user("Hi.", 1), [noise_image(56, 56, seed=2)]), (user("The cat sat on the mat.", 0), []),
                (user("Describe it.", 1), [noise_image(42, 28, seed=3)]), (user("Why?", 0), [])]
    # each inside the limit (one past it would be refused: an error below)
    want = [solo((model, processor), messages, images)[0] for messages, images in requests]
    run = drive(engine, [(2 * i, {"prompt": messages, "images": images,
                                  "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for i, (messages, images) in enumerate(requests)])
    assert not run.errors and list(run.tokens.values()) == want


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "qwen3_5", "idefics3"])
def test_weight_quantized_checkpoints_batch_exactly(family, tmp_path):
    """Checkpoints as mlx-community publishes them: quantized to 4 bits by mlx_vlm.convert (its language model's
    linear and embedding layers; the vision tower kept as it is). Image (one, two) and text requests, staggered in
    chunks of 8, each give mlx_vlm.stream_generate's tokens alone: on M-RoPE over a grid of patches (qwen2_5_vl),
    sliding windows with a tower per request (gemma3), recurrent state next to attention (qwen3_5), tiles of views
    (idefics3). (All 44 families whose tiny build mlx_vlm.convert quantizes and solo mlx-vlm then runs were exact in
    a survey; kimi_k3's quantized build fails in solo mlx-vlm, muse_glimmer's in mlx_vlm.convert.)"""
    import contextlib
    import io

    import mlx.nn as nn
    import mlx_vlm
    from mlx_vlm.convert import convert

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    source = build_tiny_vlm(family, tmp_path / "source", seed=1)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        convert(str(source), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=32)
    model, processor = mlx_vlm.load(str(tmp_path / "q4"))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.language_model.named_modules())
    want = [solo((model, processor), messages, images)[0] for messages, images in REQUESTS]
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=24, max_seqs=8, prefill_chunk=8,
                                                   check_invariants=True))
    out = drive(engine, [(2 * i, {"prompt": m, "images": im, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for i, (m, im) in enumerate(REQUESTS)])
    assert not out.errors, out.errors
    assert list(out.tokens.values()) == want


@pytest.mark.parametrize("family, image_dtype", [("kimi_vl", "float32"), ("locateanything", "float32"),
                                                 ("qwen2_5_vl", "bfloat16")])
def test_which_families_embed_an_image_prompt_in_float32_on_a_bfloat16_checkpoint(family, image_dtype, tmp_path):
    """The fact behind README's bfloat16 note: on a checkpoint cast to bfloat16 by mlx_vlm.convert, mlx-vlm's
    MoonViT merge (Kimi-VL, LocateAnything) gives an image prompt float32 embeddings (the float32 pixel values
    promote its tower's output), so solo mlx-vlm runs that request in float32 and a text request in bfloat16, where
    a batched forward of both runs one dtype; the other families keep an image prompt in bfloat16 (a survey of every
    family's bfloat16 build: only these two)."""
    import contextlib
    import io

    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.convert import convert

    from scheduler.fixtures.vlm_families import build_tiny_vlm
    from scheduler.models.adapter import VLMAdapter

    source = build_tiny_vlm(family, tmp_path / "source", seed=1)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        convert(str(source), str(tmp_path / "bf16"), dtype="bfloat16")
    adapter = VLMAdapter(*mlx_vlm.load(str(tmp_path / "bf16")))
    image, text = (adapter.encode(adapter.prepare(messages, images=images)) for messages, images in REQUESTS[:2])
    assert (image.embeddings.dtype, text.embeddings.dtype) == (getattr(mx, image_dtype), mx.bfloat16)

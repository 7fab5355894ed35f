"""The tiny offline models load through mlx-lm / mlx-vlm and generate sensibly."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from scheduler.fixtures.tiny_models import MODEL_KINDS, SPECIAL_TOKENS, build_model

N_TOKENS = 16
VOCAB = 512


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def chat_prompt(tokenizer, text="Why does the cat see the moon?"):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def greedy_tokens(model, tokenizer, prompt, n=N_TOKENS, **kwargs):
    from mlx_lm import stream_generate

    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=n, **kwargs)]


def assert_not_collapsed(tokens):
    # Greedy decoding on random weights must not be one repeated token; a
    # collapsed model hides bugs (every request would "agree" with every other).
    assert len(tokens) == N_TOKENS  # special tokens (eos) are never generated
    assert len(set(tokens)) > N_TOKENS // 2, tokens
    assert all(len(SPECIAL_TOKENS) <= t < VOCAB for t in tokens), tokens


LONG_TEXT = "The farmer, in the morning, counts three apples; then the city sees it again."


def assert_context_sensitive(model, tokenizer):
    """Changing only the first word of a long prompt changes the continuation."""
    a = greedy_tokens(model, tokenizer, chat_prompt(tokenizer, LONG_TEXT))
    b = greedy_tokens(model, tokenizer, chat_prompt(tokenizer, "A" + LONG_TEXT[3:]))
    assert a != b


# ---------------------------------------------------------------------- build


def test_kinds():
    assert MODEL_KINDS == ("text", "sliding", "text-medium", "vlm")


def test_unknown_kind_raises(tmp_path):
    with pytest.raises(ValueError, match="text.*sliding.*text-medium.*vlm"):
        build_model("gpt-5", tmp_path / "nope")
    assert not (tmp_path / "nope").exists()


def test_build_is_deterministic(tmp_path, text_model_dir):
    again = build_model("text", tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (text_model_dir / name).read_bytes(), name

    other_seed = build_model("text", tmp_path / "seed1", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (
        text_model_dir / "model.safetensors"
    ).read_bytes()
    # The tokenizer does not depend on the weight seed.
    assert (other_seed / "tokenizer.json").read_bytes() == (
        text_model_dir / "tokenizer.json"
    ).read_bytes()


def test_build_is_deterministic_across_processes(tmp_path, text_model_dir):
    # Rust hash maps in `tokenizers` are seeded per process; the BPE training must
    # not depend on their iteration order.
    code = "import sys; from scheduler.fixtures.tiny_models import build_model; build_model('text', sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], check=True)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "other" / name).read_bytes() == (text_model_dir / name).read_bytes()


def test_vlm_build_is_deterministic(tmp_path, vlm_model_dir):
    again = build_model("vlm", tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json",
                 "preprocessor_config.json", "video_preprocessor_config.json"):
        assert (again / name).read_bytes() == (vlm_model_dir / name).read_bytes(), name


@pytest.mark.parametrize("fixture", ["text_model_dir", "sliding_model_dir", "vlm_model_dir"])
def test_hf_layout_float32_untied(request, fixture):
    path = request.getfixturevalue(fixture)
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == VOCAB
    weights = mx.load(str(path / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.float32}
    assert any(k.endswith("lm_head.weight") for k in weights)
    # transformers validates config keys strictly (e.g. vision mlp_ratio must be an int).
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).model_type == config["model_type"]


# ------------------------------------------------------------------ tokenizer


def test_tokenizer(text_model):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    _, tok = text_model
    assert isinstance(tok, TokenizerWrapper)
    assert isinstance(tok._detokenizer, BPEStreamingDetokenizer)
    assert len(tok) == VOCAB
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"
    assert im_end in tok.eos_token_ids
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|image_pad|>",
                    "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"):
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]

    text = "The old man reads 42 books, slowly. Héllo wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned

    detok = tok.detokenizer
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == text

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------ text kinds


def test_text_model(text_model):
    from mlx_lm import generate

    model, tok = text_model
    assert 400_000 < n_params(model) < 460_000
    assert type(model).__module__ == "mlx_lm.models.qwen3"
    prompt = chat_prompt(tok)
    tokens = greedy_tokens(model, tok, prompt)
    assert_not_collapsed(tokens)
    # generate() is the same greedy decode, detokenized. (mlx-lm's BPE streaming
    # detokenizer drops one leading space of the whole output.)
    text = generate(model, tok, prompt, max_tokens=N_TOKENS)
    assert text == tok.decode(tokens).removeprefix(" ")
    assert greedy_tokens(model, tok, chat_prompt(tok, "A dog opens the door.")) != tokens
    assert_context_sensitive(model, tok)


def test_sliding_model(sliding_model):
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    model, tok = sliding_model
    assert type(model).__module__ == "mlx_lm.models.gemma3_text"
    assert 650_000 < n_params(model) < 800_000
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [RotatingKVCache] * 3 + [KVCache]
    assert all(c.max_size == 16 for c in cache[:3])

    # Prompt + generation run well past the 16-token window.
    prompt = chat_prompt(tok, LONG_TEXT)
    assert len(prompt) > 2 * 16
    tokens = greedy_tokens(model, tok, prompt, prompt_cache=cache)
    assert_not_collapsed(tokens)
    offsets = {c.offset for c in cache}
    assert len(offsets) == 1 and offsets.pop() >= len(prompt) + N_TOKENS - 1
    # The first word is outside every sliding window; only the global layer sees it.
    assert_context_sensitive(model, tok)


def test_medium_model(medium_model_dir):
    import mlx_lm

    model, tok = mlx_lm.load(str(medium_model_dir))
    assert 24_000_000 < n_params(model) < 27_000_000
    assert len(model.layers) == 8
    assert_not_collapsed(greedy_tokens(model, tok, chat_prompt(tok)))


# ------------------------------------------------------------------------ vlm


@pytest.fixture(scope="module")
def vlm(vlm_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(vlm_model_dir))


def make_image(seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(112, 140, 3), dtype=np.uint8))


def vlm_prompt(processor):
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What does the cat see?"}
    ]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_vlm_processor(vlm):
    model, processor = vlm
    prompt = vlm_prompt(processor)
    assert prompt == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "What does the cat see?<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = processor(images=[make_image()], text=[prompt])
    ids = np.array(inputs["input_ids"])
    tok = processor.tokenizer
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert int((ids == model.config.image_token_id).sum()) == 20
    assert np.array(inputs["image_grid_thw"]).tolist() == [[1, 8, 10]]  # 112/14 x 140/14
    assert np.array(inputs["pixel_values"]).shape == (80, 3 * 2 * 14 * 14)


def test_vlm_generate(vlm):
    import mlx_vlm

    model, processor = vlm
    assert type(model).__module__ == "mlx_vlm.models.qwen2_vl.qwen2_vl"
    assert 600_000 < n_params(model) < 800_000
    prompt = vlm_prompt(processor)

    results = list(mlx_vlm.stream_generate(model, processor, prompt, image=[make_image()],
                                           max_tokens=N_TOKENS))
    # mlx-vlm yields one result per token, then a final summary that repeats the
    # last token and carries finish_reason / token_ids.
    final = results[-1]
    assert final.finish_reason == "length"
    tokens = final.token_ids
    assert [r.token for r in results[:-1]] == tokens
    assert final.prompt_tokens == len(processor.tokenizer.encode(prompt)) - 1 + 20
    assert_not_collapsed(tokens)

    result = mlx_vlm.generate(model, processor, prompt, image=[make_image()],
                              max_tokens=N_TOKENS, verbose=False)
    assert result.token_ids == tokens
    # The image reaches the language model: another image, another continuation.
    other = mlx_vlm.generate(model, processor, prompt, image=[make_image(seed=1)],
                             max_tokens=N_TOKENS, verbose=False)
    assert other.token_ids != tokens


@pytest.mark.parametrize("kind,base", [("text-eos", "text"), ("vlm-eos", "vlm")])
def test_eos_kinds_are_deterministic_and_differ_from_their_base_only_in_the_eos_row(tmp_path, kind, base):
    """The -eos kinds rebuild byte-identically, and their weights are the base kind's except <|im_end|>'s
    lm_head row (scaled, not zeroed): so they are the same model, able to stop."""
    import mlx.core as mx

    from scheduler.fixtures.tiny_models import EOS_GAIN

    first, again = build_model(kind, tmp_path / "a"), build_model(kind, tmp_path / "b")
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    ours = mx.load(str(first / "model.safetensors"))
    theirs = mx.load(str(build_model(base, tmp_path / "base") / "model.safetensors"))
    head = next(name for name in ours if name.endswith("lm_head.weight"))
    assert all(mx.array_equal(ours[name], theirs[name]) for name in ours if name != head)
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    others = [i for i in range(ours[head].shape[0]) if i != eos]
    assert mx.array_equal(ours[head][mx.array(others)], theirs[head][mx.array(others)])
    assert not mx.any(theirs[head][eos]).item() and mx.all(ours[head][eos] != 0).item()
    assert EOS_GAIN > 1

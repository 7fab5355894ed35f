"""The `bytes` of a chat logprobs entry are the token's raw bytes (scheduler/server/token_bytes.py): a token
that carries part of a character decodes alone to U+FFFD, but its bytes are its own, so the bytes of a text's
tokens join back into the text's UTF-8, for both ways tokenizers split characters into bytes."""

import pytest

from scheduler.server.token_bytes import DecoderScheme, TokenBytes

TEXT = "naïve café ☃ snow — 東京"


def test_byte_level_bpe_tokens_join_back_into_the_text(text_model):
    _, tokenizer = text_model  # the tiny models' byte-level BPE, through mlx-lm's TokenizerWrapper
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.scheme is DecoderScheme.BYTE_LEVEL
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids), "some token carries part of a character"
    assert b"".join(token_bytes(t) for t in ids) == TEXT.encode("utf-8")
    split = next(t for t in ids if tokenizer.decode([t]) == "\ufffd")
    assert len(token_bytes(split)) == 1 and token_bytes(split)[0] >= 0x80


def test_special_tokens_are_their_text(text_model):
    _, tokenizer = text_model
    token_bytes = TokenBytes(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(im_end) == b"<|im_end|>"


def _sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer: BPE over a few pieces with the word marker, every other byte through
    `<0xNN>` fallback entries, and SentencePiece's decoder (Replace, ByteFallback, Fuse, Strip)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["\u2581", "s", "n", "o", "w", "a", "i", "v", "e", "c", "f", "\u2581s", "\u2581sn", "\u2581snow"]
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces)})
    merges = [("\u2581", "s"), ("\u2581s", "n"), ("\u2581sn", "ow")]
    vocab["ow"] = len(vocab)
    merges.insert(0, ("o", "w"))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                   fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_byte_fallback_tokens_join_back_into_the_text():
    tokenizer = _sentencepiece_style_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.scheme is DecoderScheme.BYTE_FALLBACK
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    entries = tokenizer.convert_ids_to_tokens(ids)
    assert "\u2581snow" in entries and "<0xE2>" in entries  # merged pieces and byte fallback both occur
    # the word marker is a space, the first token's too (decoded text strips that one)
    assert b"".join(token_bytes(t) for t in ids) == (" " + TEXT).encode("utf-8")
    assert tokenizer.decode(ids) == TEXT
    assert token_bytes(tokenizer.convert_tokens_to_ids("<0xE2>")) == b"\xe2"


@pytest.mark.parametrize("entry", ["<0x00>", "<0xFF>"])
def test_byte_fallback_entries_at_the_ends_of_the_byte_range(entry):
    tokenizer = _sentencepiece_style_tokenizer()
    assert TokenBytes(tokenizer)(tokenizer.convert_tokens_to_ids(entry)) == bytes([int(entry[3:5], 16)])

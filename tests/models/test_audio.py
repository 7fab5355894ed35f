"""Audio inputs on the tiny audio families built offline, each test once per family: Gemma 4
(`build_model("audio")`, a Conformer audio tower) and Gemma 4 unified (`build_model("audio-unified")`, the same
language model with an encoder-free audio path). Each loads and generates through mlx_vlm with an audio clip;
the VLMAdapter, solo and batched with text requests (sliding-window caches wrapping), gives exactly the
tokens of mlx_vlm.stream_generate run alone; a repeated clip hits the encoder cache; bad audio fails with
MediaError naming the clip. Gemma 3n is refused at load (the test after Gemma's says why). Last, Qwen3-Omni's
thinker (`qwen3_omni_moe`, a Whisper-style audio tower beside its vision tower), Inkling (a dMel audio front end
beside its patchifier), Nemotron-3 Nano Omni (`nemotron_h_nano_omni`, a Parakeet sound encoder beside its RADIO
tower), MiMo-V2.6 (`mimo_v2`, codes of a tiny mlx-audio MiMo audio tokenizer beside its ViT) and MiniCPM-o
(`minicpmo`, a Whisper tower beside its SigLIP tower and resampler): audio, image and text requests batched in four
schedules equal mlx_vlm alone (their image and video requests: tests/models/test_vlm_families.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402
import wave  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from caches.layers import PrefillSharing  # noqa: E402
from caches.vision import VisionCache  # noqa: E402
from scheduler.execution import library  # noqa: E402
from scheduler.models.media import load_audio  # noqa: E402
from scheduler.fixtures.tiny_models import ALL_KINDS, MODEL_KINDS, build_model  # noqa: E402
from scheduler.models.adapter import MediaError, VLMAdapter, adapter_for  # noqa: E402
from scheduler.models.families import UnsupportedFamily  # noqa: E402

MAX_TOKENS = 12
CHUNK = 7
RATE = 16000


# build kind -> mlx-vlm model_type
AUDIO_KINDS = {"audio": "gemma4", "audio-unified": "gemma4_unified"}


@pytest.fixture(scope="module", params=list(AUDIO_KINDS))
def audio_kind(request):
    return request.param


@pytest.fixture(scope="module")
def audio_model_dir(audio_kind, tmp_path_factory):
    return build_model(audio_kind, tmp_path_factory.mktemp(f"tiny-{audio_kind}"))


@pytest.fixture(scope="module")
def gemma(audio_model_dir):
    import mlx_vlm

    return mlx_vlm.load(str(audio_model_dir))


@pytest.fixture(scope="module")
def adapter(gemma):
    return VLMAdapter(*gemma)


def tone(seconds, seed, rate=RATE):
    """A deterministic clip: a seeded chord plus a little noise, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    freqs = rng.uniform(150, 3000, size=3)
    clip = sum(np.sin(2 * np.pi * f * t) for f in freqs) / 4 + 0.05 * rng.standard_normal(t.shape)
    return clip.astype(np.float32)


def write_wav(path, samples, rate=RATE, channels=1):
    pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    if channels == 2:
        pcm = np.stack([pcm, pcm], axis=1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def audio_messages(text, n=1):
    return [{"role": "user", "content": [{"type": "audio"}] * n + [{"type": "text", "text": text}]}]


def text_messages(text):
    return [{"role": "user", "content": text}]


def solo(gemma, prompt, audio=()):
    """Ground truth: mlx_vlm.stream_generate alone (audio as it takes it: file paths, or arrays at 16 kHz)."""
    import mlx_vlm

    model, processor = gemma
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, audio=list(audio) or None,
                                        max_tokens=MAX_TOKENS, temperature=0.0):
        pass
    return list(last.token_ids)


def prefill(adapter, prepared, chunk=CHUNK):
    encoded = adapter.encode(prepared)
    cache = adapter.make_cache()
    last = len(prepared.input_ids) - 1
    for start in range(0, last, chunk):
        adapter.prefill(cache, encoded, start, min(start + chunk, last))
    return encoded, cache


def run_batch(adapter, prepared_list, join_at=None):
    n = len(prepared_list)
    join_at = join_at or [0] * n
    eos = adapter.eos_token_ids
    staged = [(p, *prefill(adapter, p)) for p in prepared_list]
    outputs = [[] for _ in range(n)]
    batch, rows, inputs, step = [], [], None, 0
    while step <= max(join_at) or rows:
        joining = [i for i in range(n) if join_at[i] == step]
        if joining:
            batch = library.extend_batch(batch, library.merge_caches([staged[i][2] for i in joining]))
            new = mx.array([staged[i][0].input_ids[-1] for i in joining], dtype=mx.uint32)
            inputs = new if inputs is None else mx.concatenate([inputs, new])
            rows += joining
        if rows:
            deltas = mx.zeros((len(rows),), dtype=mx.int32)
            inputs = mx.argmax(adapter.decode(batch, inputs, deltas), axis=-1).astype(mx.uint32)
            keep = []
            for row, (i, token) in enumerate(zip(rows, inputs.tolist())):
                outputs[i].append(token)
                if token not in eos and len(outputs[i]) < MAX_TOKENS:
                    keep.append(row)
            if len(keep) < len(rows):
                batch = library.filter_batch(batch, keep)
                rows = [rows[r] for r in keep]
                inputs = inputs[mx.array(keep)] if keep else None
        step += 1
    return outputs


# ----------------------------------------------------------------------------------------- the tiny model


def test_audio_kinds_are_built_but_not_in_the_pinned_kinds():
    for kind in AUDIO_KINDS:
        assert kind in ALL_KINDS and kind not in MODEL_KINDS


def test_audio_build_is_deterministic(tmp_path, audio_kind, audio_model_dir):
    again = build_model(audio_kind, tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (again / name).read_bytes() == (audio_model_dir / name).read_bytes(), name


def test_mlx_vlm_generate_with_audio(gemma, audio_kind, tmp_path):
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    from scheduler.models.families import family_for

    model, processor = gemma
    family = AUDIO_KINDS[audio_kind]
    assert type(model).__module__.endswith(f"{family}.{family}") and model.config.model_type == family
    assert getattr(model, family_for(family).audio_encoder) is not None
    assert processor.feature_extractor.sampling_rate == RATE
    prompt = apply_chat_template(processor, model.config, "What is in this clip?", num_audios=1)
    outs = []
    for seed in (0, 1):
        path = write_wav(tmp_path / f"clip{seed}.wav", tone(1.0, seed))
        result = mlx_vlm.generate(model, processor, prompt, audio=[str(path)], max_tokens=MAX_TOKENS,
                                  temperature=0.0)
        assert result.prompt_tokens == len(processor.tokenizer(prompt)["input_ids"]) - 1 + 2 + 25  # 1 s = 25 tokens
        assert result.generation_tokens == MAX_TOKENS
        outs.append(result.text)
    assert outs[0] != outs[1]  # the audio changes the answer


# --------------------------------------------------------------------------------------------- adapter


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("wav")
    return {
        "a": write_wav(root / "a.wav", tone(1.0, 0)),
        "b": write_wav(root / "b.wav", tone(1.5, 1)),
        "b8k": write_wav(root / "b8k.wav", tone(1.5, 1, rate=8000), rate=8000),
        "stereo": write_wav(root / "st.wav", tone(0.6, 2), channels=2),
    }


@pytest.fixture(scope="module")
def mixed(gemma, adapter, clips):
    """Audio requests (a file, a 1.5 s file whose prompt + output wraps the 64-token sliding window, an 8 kHz
    file resampled, (array, rate), a stereo file, two clips in one request) and two text requests."""
    long_text = "Listen to this and tell me what the old man reads in the morning before lunch, slowly."
    specs = [
        (audio_messages("What is in this clip?"), [clips["a"]], [str(clips["a"])]),
        (audio_messages(long_text), [clips["b"]], [str(clips["b"])]),
        (audio_messages("Describe it"), [clips["b8k"]], [str(clips["b8k"])]),
        (audio_messages("And this one?"), [(tone(0.8, 3), RATE)], [tone(0.8, 3)]),
        (audio_messages("Stereo?"), [clips["stereo"]], [str(clips["stereo"])]),
        (audio_messages("Compare them", n=2), [clips["a"], (tone(0.5, 4), RATE)], [str(clips["a"]), tone(0.5, 4)]),
        (text_messages("What does the cat see today?"), [], []),
        (text_messages(long_text + " " + long_text), [], []),
    ]
    prepared = [adapter.prepare(messages, audio=ours) for messages, ours, _ in specs]
    references = [solo(gemma, p.prompt, theirs) for p, (_, _, theirs) in zip(prepared, specs)]
    return prepared, references


def test_prepare_shapes(adapter, mixed):
    prepared, _ = mixed
    first = prepared[0]
    assert first.num_audio == 1 and first.num_media_tokens == 25 == first.input_ids.count(adapter.model.config.audio_token_id)
    assert first.num_media_items == 1 and first.media_key is not None
    assert prepared[1].num_media_tokens == 38  # ceil(1500 ms / 40 ms)
    assert len(prepared[1].input_ids) + MAX_TOKENS > 64  # the sliding layer's window wraps
    assert prepared[5].num_audio == 2 and prepared[5].num_media_items == 2
    assert prepared[6].num_audio == 0 and prepared[6].media_key is None and prepared[6].num_media_items == 0
    assert {adapter.encode(p).rope_delta for p in prepared} == {0}


def test_solo_equals_mlx_vlm(adapter, mixed):
    prepared, references = mixed
    for i, (p, want) in enumerate(zip(prepared, references)):
        assert run_batch(adapter, [p])[0] == want, f"request {i}"


def test_batched_equals_each_alone(adapter, mixed):
    prepared, references = mixed
    assert len({tuple(r) for r in references}) == len(references)
    for join_at in ([0] * len(prepared), [0, 3, 1, 0, 5, 2, 0, 4]):
        outputs = run_batch(adapter, prepared, join_at=join_at)
        for i, (got, want) in enumerate(zip(outputs, references)):
            assert got == want, f"request {i} (joins at {join_at[i]}): batched {got} != solo {want}"


def test_prefill_many_with_per_layer_inputs_equals_each_alone(adapter, mixed):
    """Gemma 4 feeds per-layer inputs with each chunk (``per_layer_inputs``, a (1, L, ...) sequence input): a
    shared forward gets each row's slice, right-padded. Chunks of different lengths (two fresh ones, one with
    its audio, and a later one on a cache of 30 tokens that passes the 64-token sliding window) give each
    request its own forward's logits, and caches that continue as its own do (the next 3 positions fed alone
    on each), to float rounding."""
    from ..helpers import prefill_many_against_alone

    prepared, _ = mixed
    assert adapter.prefill_sharing is PrefillSharing.ANY
    encoded = [adapter.encode(prepared[i]) for i in (0, 1, 7)]
    assert all("per_layer_inputs" in e.sequence_inputs for e in encoded)
    later = adapter.make_cache()
    adapter.prefill(later, encoded[1], 0, 30)
    rows = [(None, encoded[0], 0, 20), (later, encoded[1], 30, encoded[1].num_tokens - 34),
            (None, encoded[2], 0, 26)]
    assert rows[1][2] + rows[1][3] > 64  # past the window
    prefill_many_against_alone(adapter, rows, follow=3)


def test_merge_equals_mlx_vlm_get_input_embeddings(gemma, adapter, mixed):
    """Pinned: our split (tower alone, then masked_scatter) gives mlx-vlm's own merged embeddings."""
    model, _ = gemma
    for p in (mixed[0][0], mixed[0][5]):
        ours = adapter.encode(p)
        theirs = model.get_input_embeddings(ours.input_ids, input_features=p.media_inputs["input_features"],
                                            input_features_mask=p.media_inputs["input_features_mask"])
        assert mx.array_equal(ours.embeddings, theirs.inputs_embeds)
        assert mx.array_equal(ours.sequence_inputs["per_layer_inputs"], theirs.per_layer_inputs)


def test_audio_inputs_as_path_bytes_and_array_agree(adapter, clips):
    path = clips["a"]
    samples = load_audio(path, 0, RATE)
    keys = {adapter.prepare(audio_messages("x"), audio=[src]).media_key
            for src in (path, str(path), path.read_bytes(), (samples, RATE))}
    assert len(keys) == 1
    # 8 kHz: the file (resampled by mlx-vlm's loader) and the array (resampled by the same function) agree
    b8k = clips["b8k"]
    with wave.open(str(b8k)) as w:
        raw = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    assert np.array_equal(load_audio((raw, 8000), 0, RATE), load_audio(b8k, 0, RATE))


def test_repeated_clip_hits_the_cache(gemma, clips, mixed):
    _, references = mixed
    cache = VisionCache(16 << 20)
    adapter = VLMAdapter(*gemma, vision_cache=cache)
    calls = []
    inner = adapter.media_encoder
    adapter.media_encoder = lambda ids, media, mask: calls.append(1) or inner(ids, media, mask)
    messages = audio_messages("What is in this clip?")
    first = adapter.prepare(messages, audio=[clips["a"]])
    again = adapter.prepare(messages, audio=[clips["a"].read_bytes()])
    assert first.media_key == again.media_key
    assert run_batch(adapter, [first])[0] == references[0] and len(calls) == 1
    encoded = adapter.encode(again)
    assert encoded.vision_cache_hit is True and encoded.vision_time_s == 0.0
    assert run_batch(adapter, [again])[0] == references[0] and len(calls) == 1
    other = adapter.prepare(messages, audio=[clips["b"]])
    assert other.media_key != first.media_key and adapter.encode(other).vision_cache_hit is False


def test_adapter_for_picks_the_audio_family(gemma):
    assert isinstance(adapter_for(*gemma), VLMAdapter)
    assert adapter_for(*gemma).eos_token_ids == frozenset({1, 4})


# -------------------------------------------------------------------------------------------- bad audio


def _file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return path


BAD = {
    "missing-file": lambda tp: tp / "nope.wav",
    "directory": lambda tp: tp,
    "empty-file": lambda tp: _file(tp, "empty.wav", b""),
    "junk-file": lambda tp: _file(tp, "junk.wav", b"not audio " * 50),
    "junk-bytes": lambda tp: b"\x00\x01junk" * 50,
    "empty-bytes": lambda tp: b"",
    "bare-array": lambda tp: tone(0.5, 0),
    "int-samples": lambda tp: ((tone(0.5, 0) * 32767).astype(np.int16), RATE),
    "nan-samples": lambda tp: (np.full(8000, np.nan, np.float32), RATE),
    "no-samples": lambda tp: (np.zeros(0, np.float32), RATE),
    "bad-rate": lambda tp: (tone(0.5, 0), 0),
    "three-tuple": lambda tp: (tone(0.5, 0), RATE, 1),
    "url": lambda tp: "https://example.com/a.wav",
    "none": lambda tp: None,
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_audio_raises_media_error_naming_it(adapter, clips, tmp_path, kind):
    with pytest.raises(MediaError) as info:
        adapter.prepare(audio_messages("hm", n=2), audio=[clips["a"], BAD[kind](tmp_path)])
    assert info.value.index == 1 and info.value.kind == "audio"
    assert str(info.value).startswith("audio 1:")


def test_mismatches_are_value_errors(adapter, clips):
    with pytest.raises(ValueError, match="audio placeholder"):
        adapter.prepare("<start_of_turn>user\nno audio<end_of_turn>\n<start_of_turn>model\n", audio=[clips["a"]])
    with pytest.raises(ValueError, match="video placeholder|videos are not supported"):  # gemma4 | unified
        adapter.prepare("<start_of_turn>user\nno video <|audio|><end_of_turn>\n<start_of_turn>model\n",
                        audio=[clips["a"]], videos=[[np.zeros((16, 16, 3), np.uint8)]])


def test_prompt_may_end_with_the_audio(gemma, adapter, clips):
    """The processor wraps the audio tokens in <boa> ... <eoa>: the last prompt token is <eoa>, a text token,
    so feeding it as the first decode input is exact."""
    prompt = "<bos><start_of_turn>user\nlisten <|audio|>"
    prepared = adapter.prepare(prompt, audio=[clips["a"]])
    assert prepared.input_ids[-1] == gemma[0].config.eoa_token_id
    assert run_batch(adapter, [prepared])[0] == solo(gemma, prompt, [str(clips["a"])])


# ------------------------------------------------------------------------------------ through the engine


from scheduler import Engine, EngineConfig, InvalidRequest, SamplingParams, UnreadableMedia  # noqa: E402


@pytest.mark.parametrize("budgets", [dict(), dict(max_batched_tokens=24, prefill_chunk=7, max_seqs=4, vision_budget=1)],
                         ids=["default", "small-budgets"])
def test_engine_audio_and_text_match_solo(gemma, mixed, clips, budgets):
    from ..helpers import drive

    model, processor = gemma
    prepared, references = mixed
    audio = [[clips["a"]], [clips["b"]], [clips["b8k"]], [(tone(0.8, 3), RATE)], [clips["stereo"]],
             [clips["a"], (tone(0.5, 4), RATE)], None, None]
    engine = Engine(model, processor, EngineConfig(**budgets, check_invariants=True))
    run = drive(engine, [(t, {"prompt": p.prompt, "audio": a, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for t, (p, a) in enumerate(zip(prepared, audio))])
    assert list(run.tokens.values()) == references
    if budgets:  # chunks of 7 from several requests at once: they share forwards (per-layer inputs included)
        assert engine.prefill_stats()["batched_groups"] > 0 and engine.prefill_stats()["fallbacks"] == 0
    assert engine.stats().num_images_processed == 7  # media items: one per clip
    assert engine.executor.cache_bytes() == 0 and not engine.executor.live_request_ids()



def test_engine_audio_requests_are_quiet(gemma, mixed, clips, capfd, caplog, recwarn):
    """Audio requests (a file, an 8 kHz file resampled, two clips in one) print, log and warn nothing."""
    from ..helpers import drive

    model, processor = gemma
    prepared, references = mixed
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    audio = {0: [clips["a"]], 2: [clips["b8k"]], 5: [clips["a"], (tone(0.5, 4), RATE)]}
    runs = []
    assert_quiet(capfd, caplog, recwarn, lambda: runs.append(drive(engine, [
        (0, {"prompt": prepared[i].prompt, "audio": a, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
        for i, a in audio.items()])))
    assert list(runs[0].tokens.values()) == [references[i] for i in audio]


def test_engine_repeated_clip_hits_the_cache_and_bad_audio_is_refused_alone(gemma, mixed, clips, tmp_path):
    from ..helpers import drive

    model, processor = gemma
    prepared, references = mixed
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    prompt = prepared[0].prompt
    first = drive(engine, [(0, {"prompt": prompt, "audio": [clips["a"]], "sampling": sampling})])
    with pytest.raises(UnreadableMedia, match="^audio: unreadable audio 0: ") as info:
        engine.add_request(prompt=prompt, audio=[tmp_path / "nope.wav"], sampling=sampling, request_id="missing")
    assert (info.value.kind, info.value.index) == ("audio", 0) and not engine.has_pending()
    second = drive(engine, [(0, {"prompt": prompt, "audio": [clips["a"].read_bytes()], "sampling": sampling,
                                 "request_id": "again"})])
    assert list(first.tokens.values()) == [references[0]] and second.tokens["again"] == references[0]
    stats = engine.vision_cache_stats()
    assert (stats["hits"], stats["misses"]) == (1, 1)


def test_engine_drafting_on_audio_rows_matches_solo(gemma, mixed, clips):
    """Gemma 4's sliding-window caches cannot drop positions in place: a verify is undone by a re-feed
    (README, "Drafting where caches cannot roll back"). The drafts come from an oracle that knows the solo
    outputs and spoils some (prompt lookup on a random tiny model rarely has a draft for every row at once)."""
    from ..helpers import OracleDrafter, drive

    model, processor = gemma
    prepared, references = mixed
    audio = [[clips["a"]], [clips["b"]], [clips["b8k"]], [(tone(0.8, 3), RATE)], [clips["stereo"]],
             [clips["a"], (tone(0.5, 4), RATE)], None, None]
    engine = Engine(model, processor, EngineConfig(draft_tokens=3, max_batched_tokens=96, check_invariants=True))
    engine.executor.drafter = OracleDrafter({f"a{i}": ref for i, ref in enumerate(references)}, engine.vocab_size)
    run = drive(engine, [(t, {"prompt": p.prompt, "audio": a, "sampling": SamplingParams(max_tokens=MAX_TOKENS),
                              "request_id": f"a{t}"}) for t, (p, a) in enumerate(zip(prepared, audio))])
    assert [run.tokens[f"a{i}"] for i in range(len(references))] == references
    stats = engine.draft_stats()
    assert stats["verify_forwards"] > 0 and stats["accepted"] > 0


def test_max_kv_size_is_refused(gemma):
    """Gemma 4 (and Gemma 4 unified, its language model) builds its own sliding-window caches, which would
    ignore max_kv_size: refused at construction with the reason."""
    model, processor = gemma
    with pytest.raises(ValueError, match="max_kv_size"):
        Engine(model, processor, EngineConfig(max_kv_size=64))


def test_engine_kv_budget_preempts_audio_requests_and_stays_exact(gemma, mixed, clips):
    """A KV budget of three rows (sliding-window layers counted at their window): audio requests are
    preempted and recomputed (their clips re-encoded or taken from the cache), and every output equals solo."""
    from scheduler.events import MemorySink

    from ..helpers import drive

    model, processor = gemma
    prepared, references = mixed
    audio = [[clips["a"]], [clips["b"]], [clips["b8k"]], [(tone(0.8, 3), RATE)], [clips["stereo"]],
             [clips["a"], (tone(0.5, 4), RATE)], None, None]
    # the first three requests' rows (at the longest of their prompts) with two tokens to spare, no admission
    # headroom: admitted together, they outgrow it a few decode steps later and the newest is preempted
    longest = max(len(p.input_ids) for p in prepared[:3]) + 2
    budget = Engine(model, processor).kv_layout.batch_bytes([longest] * 3)
    log = MemorySink()
    engine = Engine(model, processor, EngineConfig(kv_memory_bytes=budget, kv_headroom_tokens=0,
                                                   check_invariants=True), event_sinks=[log])
    run = drive(engine, [(0, {"prompt": p.prompt, "audio": a, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                         for p, a in zip(prepared, audio)])
    assert list(run.tokens.values()) == references
    audio_ids = {rid for rid, a in zip(run.tokens, audio) if a}
    preempted = {e["request_id"] for e in log.of_kind("transition") if e["to"] == "queued" and e["from"] != "queued"}
    assert preempted & audio_ids, f"no audio request was preempted ({sorted(preempted)})"


# Gemma 4 E2B's released text options (its config.json's text_config: 35 layers, four sliding layers to a full one,
# the last 20 reusing earlier layers' KV with double-wide MLPs, full layers with a 512 global head dim rotated on a
# quarter of it, proportional), which the tiny builds leave off, on ten tiny layers: four of them KV-shared.
E2B_TEXT_OPTIONS = {
    "num_hidden_layers": 10, "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
    "sliding_window_pattern": 5, "num_kv_shared_layers": 4, "use_double_wide_mlp": True, "global_head_dim": 64,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
}


@pytest.mark.parametrize("kind", list(AUDIO_KINDS))
def test_real_checkpoint_text_options_batch_audio_exactly(kind, tmp_path, monkeypatch):
    """With E2B's text options (KV-shared layers read the caches of earlier ones, double-wide MLPs, proportional
    partial rotary on the full layers): a 40 s clip (cut to 30 s, 750 tokens, by the processor's audio_seq_length),
    clips at 16 and 44.1 kHz and a text request, and on Gemma 4 two image requests (each prefilled through its
    image in one forward: tests/models/test_gemma4_images.py), staggered in chunks of 7 and drafting, equal mlx_vlm
    alone."""
    import mlx_vlm

    from scheduler.fixtures import tiny_models

    from ..helpers import drive

    plain = tiny_models.audio_config

    def e2b(tokenizer):
        config = plain(tokenizer)
        config["text_config"].update(E2B_TEXT_OPTIONS)
        return config

    monkeypatch.setattr(tiny_models, "audio_config", e2b)
    gemma = mlx_vlm.load(str(build_model(kind, tmp_path / "model")))
    assert gemma[0].language_model.model.first_kv_shared_layer_idx == 6
    long, short = write_wav(tmp_path / "long.wav", tone(40.0, 5)), write_wav(tmp_path / "short.wav", tone(2.5, 6))
    cd = write_wav(tmp_path / "cd.wav", tone(3.0, 7, rate=44100), rate=44100)
    requests = [(audio_messages("Transcribe this."), [long]), (text_messages("The old man and the sea, slowly."), []),
                (audio_messages("What do you hear?"), [short]), (audio_messages("And this one?"), [cd])]
    adapter = VLMAdapter(*gemma)
    prompts = [adapter.prepare(messages, audio=clips).prompt for messages, clips in requests]
    references = [solo(gemma, prompt, [str(c) for c in clips]) for prompt, (_, clips) in zip(prompts, requests)]
    images = {}  # request index -> its image
    if kind == "audio":
        rng = np.random.default_rng(8)
        for text, (h, w) in (("What is in the picture?", (64, 80)), ("Describe it.", (96, 48))):
            image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            images[len(prompts)] = image
            prompts.append(adapter.prepare(messages, images=[image]).prompt)
            requests.append((messages, []))
            references.append(list(_last(mlx_vlm.stream_generate(*gemma, prompts[-1], image=[image],
                                                                 max_tokens=MAX_TOKENS, temperature=0.0)).token_ids))
    for config in (dict(max_batched_tokens=24, prefill_chunk=7, max_seqs=4), dict(draft_tokens=2)):
        engine = Engine(*gemma, EngineConfig(**config, check_invariants=True))
        run = drive(engine, [(2 * t, {"prompt": prompt, "audio": clips or None, "images": [images[t]] if t in images
                                      else None, "sampling": SamplingParams(max_tokens=MAX_TOKENS)})
                             for t, (prompt, (_, clips)) in enumerate(zip(prompts, requests))])
        assert not run.errors, run.errors
        assert list(run.tokens.values()) == references, config


def _last(stream):
    last = None
    for last in stream:
        pass
    return last


# ------------------------------------------------------------------------------ gemma3n: refused at load


def _tiny_gemma3n():
    """A tiny Gemma 3n (text and audio tower tiny; mlx-vlm's MobileNetV5 vision tower has a fixed 294M-parameter
    shape and stays lazy: nothing here evaluates it). Token ids: 0..511 text, 512..519 vision, 520..527 audio."""
    from mlx_vlm.models import gemma3n

    text = gemma3n.TextConfig(model_type="gemma3n_text", hidden_size=64, num_hidden_layers=2,
                              intermediate_size=[128, 128], num_attention_heads=2, head_dim=32, num_key_value_heads=1,
                              vocab_size=528, vocab_size_per_layer_input=512, laurel_rank=8,
                              hidden_size_per_layer_input=16, sliding_window=16, altup_num_inputs=2,
                              layer_types=["sliding_attention", "full_attention"],
                              activation_sparsity_pattern=[0.0, 0.0])
    audio = gemma3n.AudioConfig(input_feat_size=128, hidden_size=32, conf_num_attention_heads=2,
                                conf_num_hidden_layers=1, sscp_conv_channel_size=(8, 4), vocab_size=8, vocab_offset=520)
    vision = gemma3n.VisionConfig(vocab_size=8, vocab_offset=512)
    mx.random.seed(0)
    return gemma3n.Model(gemma3n.ModelConfig(text_config=text, vision_config=vision, audio_config=audio,
                                             model_type="gemma3n", hidden_size=64, vocab_size=528,
                                             audio_token_id=521, image_token_id=513, audio_soft_tokens_per_image=16))


def test_gemma3n_is_refused_at_load_with_the_reason():
    """mlx-vlm 0.7.10's Gemma 3n embeds prompt text through get_input_embeddings without the sqrt(hidden) scale its
    language model applies to token ids (gemma3n.py:122 vs language.py:479). mlx_vlm.generate feeds the last prompt
    token as that embedding; the scheduler feeds it as an id (the first decode step), so the next-token logits
    differ: refused at load. If mlx-vlm makes the two agree, the second half fails and the refusal can go."""
    from scheduler import Engine

    model = _tiny_gemma3n()
    with pytest.raises(UnsupportedFamily, match="'gemma3n' cannot be batched: .* sqrt\\(hidden_size\\) scale"):
        Engine(model, None)
    ids = mx.array([[2, 40, 41, 42, 43]])
    prompt = model.get_input_embeddings(ids)
    lm = model.language_model
    assert mx.array_equal(prompt.inputs_embeds, lm.model.embed_tokens(ids))  # unscaled
    by_embedding, by_id = model.make_cache(), model.make_cache()
    for cache in (by_embedding, by_id):
        lm(ids[:, :-1], inputs_embeds=prompt.inputs_embeds[:, :-1], cache=cache,
           per_layer_inputs=prompt.per_layer_inputs[:, :-1])
    as_generate = lm(ids[:, -1:], inputs_embeds=prompt.inputs_embeds[:, -1:], cache=by_embedding,
                     per_layer_inputs=prompt.per_layer_inputs[:, -1:]).logits
    as_decode = lm(ids[:, -1:], cache=by_id).logits
    assert not mx.allclose(as_generate, as_decode, atol=1e-3)


def test_served_audio_chat_equals_the_engine_and_media_it_does_not_take_are_refused_by_part(
        gemma, audio_kind, audio_model_dir, tmp_path):
    """`mlxsched serve` on an audio family: an `input_audio` part (base64 WAV) gives what the engine gives for
    the same messages and clip (greedy); a video part is refused naming that part (Gemma 4 unified takes none,
    Gemma 4 reads no local file), and so is an image part on Gemma 4 unified, which takes audio only (it was
    refused naming `messages`, by the engine, after the server had decoded it), while Gemma 4 takes it."""
    import base64
    import io

    from ..surfaces.test_serve import _start, _stop, _wait_healthy

    clip = write_wav(tmp_path / "clip.wav", tone(0.6, seed=3))
    model, processor = gemma
    want = Engine(model, processor, EngineConfig()).generate(
        [audio_messages("What do you hear?")], SamplingParams(max_tokens=MAX_TOKENS), audio=[[str(clip)]])[0]
    audio_part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip.read_bytes()).decode(),
                                                         "format": "wav"}}
    png = io.BytesIO()
    Image.new("RGB", (28, 28)).save(png, format="PNG")
    image_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                            + base64.b64encode(png.getvalue()).decode()}}
    server = _start(audio_model_dir, tmp_path, "audio")
    try:
        _wait_healthy(server, time.monotonic() + 120)
        status, got = server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": [audio_part, {"type": "text", "text": "What do you hear?"}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0})
        image_status, image_reply = server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "and this?"}, image_part]}],
            "max_tokens": 2})
        no_video = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "clip.mp4"}}]}], "max_tokens": 2})
    finally:
        _stop(server)
    assert status == 200, got
    assert got["usage"]["completion_tokens"] == len(want.token_ids)
    assert got["choices"][0]["message"]["content"] == want.text
    if audio_kind == "audio":
        assert image_status == 200 and image_reply["usage"]["completion_tokens"] == 2, image_reply
    else:
        assert image_status == 400 and image_reply["error"]["param"] == "messages.0.content.1", image_reply
        assert "takes no images" in image_reply["error"]["message"]
    assert no_video[0] == 400 and no_video[1]["error"]["param"] == "messages.0.content.0", no_video
    # Gemma 4 takes videos (tests/models/test_gemma4_video.py): this one, a local file, is not read
    assert ("unreadable video" if audio_kind == "audio" else "takes no video") in no_video[1]["error"]["message"]


def test_max_audio_per_request(gemma, clips):
    model, processor = gemma
    engine = Engine(model, processor, EngineConfig(max_audio_per_request=1, check_invariants=True))
    with pytest.raises(InvalidRequest, match=r"2 audio clips in one request; at most 1 \(max_audio_per_request\)") as info:
        engine.add_request(prompt=audio_messages("two", 2), audio=[clips["a"], clips["a"]])
    assert info.value.field == "audio" and not engine.has_pending()


def test_prompt_logprobs_equal_mlx_vlms_own_prefill(gemma, adapter, mixed, clips):
    """Prompt logprobs through the engine (an audio request and a text one whose prompt wraps the 64-token
    sliding window, chunks of 7) equal what mlx-vlm's own generate path computes for each prompt alone:
    `get_input_embeddings`, then the language model with mlx-vlm's prompt cache and the embedding step's extra
    inputs (Gemma 4's per-layer inputs). To 1e-3: the sliding layers' chunked attention reorders sums more than a
    plain cache does (up to 7e-05 measured on OpenBLAS); a wrong position is off by far more."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import prepare_inputs

    from scheduler import Engine, EngineConfig, SamplingParams

    model, processor = gemma
    prepared, references = mixed
    chosen = [0, 7]  # an audio clip; the long text
    engine = Engine(model, processor, EngineConfig(prefill_chunk=CHUNK, max_batched_tokens=30, max_seqs=4))
    outs = engine.generate([prepared[i].prompt for i in chosen],
                           SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=1),
                           audio=[[str(clips["a"])], None])
    for i, out in zip(chosen, outs):
        inputs = prepare_inputs(processor, audio=[str(clips["a"])] if i == 0 else None, prompts=prepared[i].prompt)
        ids = inputs["input_ids"]
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        embedded = model.get_input_embeddings(ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"),
                                              **extra)
        extra.update({k: v for k, v in embedded.to_dict().items() if k != "inputs_embeds" and v is not None})
        logits = model.language_model(ids, inputs_embeds=embedded.inputs_embeds,
                                      cache=make_prompt_cache(model.language_model), **extra).logits[0]
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        tokens = ids[0].tolist()
        assert tokens == prepared[i].input_ids
        want = [logprobs[j, tokens[j + 1]].item() for j in range(len(tokens) - 1)]
        assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-3), i
        assert out.token_ids == references[i], i


# --------------------------------------------------------- qwen3_omni_moe: audio beside images and text


OMNI_SCHEDULES = {
    # one tick apart, small token / chunk / vision budgets, prefix and vision caches on
    "staggered": (1, dict(max_batched_tokens=40, prefill_chunk=9, max_seqs=6, vision_budget=2)),
    # all at once in chunks of 9: prefills of several requests share forwards
    "together": (0, dict(max_batched_tokens=200, prefill_chunk=9)),
    # prompt-lookup drafting on every row, audio rows included
    "drafting": (1, dict(draft_tokens=3, max_batched_tokens=96)),
    # a KV budget of the first three rows: admitted together, they outgrow it and the newest is preempted
    "kv-budget": (0, dict(max_seqs=8, kv_headroom_tokens=0)),
}


def _mixed_requests(model, processor, root):
    """Requests (audio clips, an image, both in one request, two clips in one, text only, the first request again)
    as chat messages with their media, and each one's greedy tokens from mlx_vlm.stream_generate alone."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    a, b = write_wav(root / "a.wav", tone(1.0, 0)), write_wav(root / "b.wav", tone(2.3, 1))
    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (84, 56, 3), dtype=np.uint8))
    specs = [([a], [], "What do you hear?"), ([b], [], "Describe the sound, please."), ([a, b], [], "Compare them."),
             ([], [image], "Describe it."), ([b], [image], "The sound and the picture?"),
             ([], [], "Hi. The cat sat on the mat. The cat sat on the mat."), ([a], [], "What do you hear?")]
    requests, references = [], []
    for clips_in, images, text in specs:
        content = [{"type": "image"}] * len(images) + [{"type": "audio"}] * len(clips_in)
        messages = [{"role": "user", "content": content + [{"type": "text", "text": text}]}]
        prompt = apply_chat_template(processor, model.config, messages, num_images=len(images),
                                     num_audios=len(clips_in))
        last = None
        for last in mlx_vlm.stream_generate(model, processor, prompt, image=images or None,
                                            audio=[str(c) for c in clips_in] or None, max_tokens=MAX_TOKENS,
                                            temperature=0.0):
            pass
        requests.append({"prompt": messages, "images": images or None, "audio": clips_in or None})
        references.append(list(last.token_ids))
    return requests, references


def _tiny_mixed(family, tmp_path_factory, seed=0):
    """The tiny `family` build (scheduler/fixtures/vlm_families.py), its requests and their references."""
    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    root = tmp_path_factory.mktemp(f"tiny-{family}")
    model, processor = mlx_vlm.load(str(build_tiny_vlm(family, root / "model", seed=seed)))
    return (model, processor, *_mixed_requests(model, processor, root))


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """The tiny Qwen3-Omni thinker (scheduler/fixtures/vlm_builds_successors.py), its requests (audio clips, an
    image, both in one request, two clips in one, text only, the first request again) as chat messages with their
    media, and each one's greedy tokens from mlx_vlm.stream_generate alone."""
    return _tiny_mixed("qwen3_omni_moe", tmp_path_factory)


def test_omni_audio_reaches_the_language_model(omni):
    """The requests' answers differ (their clips or their text do), some stop on eos, and a clip's tokens are what
    the processor expands its one placeholder into: 13 for each whole second (100 mel frames through three stride-2
    convs), the rest's frames (30 of 2.3 s) likewise (4)."""
    model, processor, requests, references = omni
    assert len({tuple(r) for r in references[:6]}) == 6 and references[6] == references[0]
    assert any(len(r) < MAX_TOKENS for r in references) and not all(len(r) < MAX_TOKENS for r in references)
    adapter = VLMAdapter(model, processor)
    assert adapter.sample_rate == RATE and adapter.spec.audio_encoder == "thinker.audio_tower"
    one, two = (adapter.prepare(requests[i]["prompt"], audio=requests[i]["audio"]) for i in (0, 2))
    audio_id = model.config.thinker_config.audio_token_id
    assert one.num_audio == 1 and one.input_ids.count(audio_id) == one.num_media_tokens == 13
    assert two.num_audio == 2 and two.num_media_tokens == 13 + 30  # 1 s and 2.3 s


@pytest.mark.parametrize("schedule", list(OMNI_SCHEDULES))
def test_omni_engine_audio_images_and_text_match_solo(omni, schedule):
    """Qwen3-Omni's thinker batched: audio requests (one clip, two, a clip beside an image), an image request and a
    text request, in each schedule, give each request the tokens of mlx_vlm.stream_generate alone; the repeated
    clip is a vision-cache hit, a KV budget preempts an audio request, and drafts are verified on audio rows."""
    _mixed_schedule_matches_solo(*omni, schedule)


def _mixed_schedule_matches_solo(model, processor, requests, references, schedule, budget_chunk=None):
    """``budget_chunk``: the kv-budget schedule's prefill chunk, for a family whose sliding-window layers hold a
    whole chunk before they cut back to their window: with one chunk a prompt, its prefill peak keeps the first
    three requests from being admitted together (as tests/models/test_vlm_families.py's ``budget_chunk``)."""
    from scheduler.events import MemorySink

    from ..helpers import OracleDrafter, drive

    stagger, config = OMNI_SCHEDULES[schedule]
    config = dict(config, prefix_cache_bytes=8 << 20, prefix_block_size=8, check_invariants=True)
    if schedule == "kv-budget" and budget_chunk is not None:
        config["prefill_chunk"] = budget_chunk
    if schedule == "kv-budget":
        lengths = [len(VLMAdapter(model, processor).prepare(r["prompt"], audio=r["audio"], images=r["images"])
                       .input_ids) for r in requests[:3]]
        config["kv_memory_bytes"] = Engine(model, processor).kv_layout.batch_bytes([max(lengths) + 2] * 3)
    log = MemorySink()
    engine = Engine(model, processor, EngineConfig(**config), event_sinks=[log])
    if schedule == "drafting" and not engine._runner.capabilities.rollback:
        engine.executor.drafter = OracleDrafter({f"o{i}": ref for i, ref in enumerate(references)}, engine.vocab_size)
    run = drive(engine, [(i * stagger, dict(r, sampling=SamplingParams(max_tokens=MAX_TOKENS), request_id=f"o{i}"))
                         for i, r in enumerate(requests)])
    assert not run.errors, run.errors
    assert [run.tokens[f"o{i}"] for i in range(len(requests))] == references
    assert engine.executor.cache_bytes() == 0 and not engine.executor.live_request_ids()
    assert engine.vision_cache_stats()["hits"] >= 1  # the first clip, again
    if schedule == "together":
        assert engine.prefill_stats()["batched_groups"] > 0 and engine.prefill_stats()["fallbacks"] == 0
    if schedule == "kv-budget":
        preempted = {e["request_id"] for e in log.of_kind("transition")
                     if e["to"] == "queued" and e["from"] != "queued"}
        assert preempted & {f"o{i}" for i, r in enumerate(requests) if r["audio"]}, preempted
    if schedule == "drafting":
        drafted = {e["request_id"] for e in log.of_kind("transition") if e["to"] == "drafting"}
        assert engine.draft_stats()["verify_forwards"] > 0 and drafted & {"o0", "o1", "o2", "o4"}, drafted



def assert_quiet(capfd, caplog, recwarn, work):
    """`work()` prints, logs (WARNING and above) and warns nothing (a library's DeprecationWarning aside)."""
    import logging

    capfd.readouterr()
    caplog.clear()
    recwarn.clear()
    with caplog.at_level(logging.WARNING):
        work()
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out + err)[:300]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert not [str(w.message) for w in recwarn if not issubclass(w.category, DeprecationWarning)]


def test_omni_audio_requests_are_quiet(omni, capfd, caplog, recwarn):
    """An audio request prints, logs and warns nothing: Qwen3-Omni's Whisper feature extractor logs "It is strongly
    recommended to pass the `sampling_rate` argument" for every clip, which mlx-vlm cannot pass to its processor
    (mlx_vlm.stream_generate logs it); the engine filters that message for its processor call (the clips are
    resampled to the extractor's rate), and the tokens are mlx-vlm's."""
    _mixed_audio_requests_are_quiet(*omni, capfd, caplog, recwarn)


def _mixed_audio_requests_are_quiet(model, processor, requests, references, capfd, caplog, recwarn):
    """A clip, two clips, a clip beside an image: quiet, and mlx-vlm's tokens."""
    from ..helpers import drive

    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    runs = []
    assert_quiet(capfd, caplog, recwarn, lambda: runs.append(drive(engine, [(0, dict(requests[i], sampling=sampling))
                                                                            for i in (0, 2, 4)])))
    assert list(runs[0].tokens.values()) == [references[i] for i in (0, 2, 4)]


# ------------------------------------------------------------------ inkling: dMel audio beside images and text


@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    """The tiny Inkling (scheduler/fixtures/vlm_builds_hybrid_caches.py: short-convolution states next to KV, a dMel
    audio front end), the requests above and their references."""
    return _tiny_mixed("inkling", tmp_path_factory)


def test_inkling_audio_reaches_the_language_model(inkling):
    """The requests' answers differ, and a clip's tokens are what the processor expands its one placeholder into:
    one per 50 ms frame (the feature extractor's hop), 20 for 1 s and 46 for 2.3 s."""
    model, processor, requests, references = inkling
    assert len({tuple(r) for r in references[:6]}) == 6 and references[6] == references[0]
    adapter = VLMAdapter(model, processor)
    assert adapter.sample_rate == RATE and adapter.spec.audio_encoder == "audio_tower"
    one, two = (adapter.prepare(requests[i]["prompt"], audio=requests[i]["audio"]) for i in (0, 2))
    assert one.num_audio == 1 and one.input_ids.count(model.config.audio_token_id) == one.num_media_tokens == 20
    assert two.num_audio == 2 and two.num_media_tokens == 20 + 46


@pytest.mark.parametrize("schedule", list(OMNI_SCHEDULES))
def test_inkling_engine_audio_images_and_text_match_solo(inkling, schedule):
    """Inkling batched as Qwen3-Omni above: each request's tokens are mlx_vlm.stream_generate's alone, in each
    schedule (the clips' dMel ids and frame masks through the audio front end, the convolution states honoring
    the batch's pads)."""
    _mixed_schedule_matches_solo(*inkling, schedule)


def test_inkling_audio_requests_are_quiet(inkling, capfd, caplog, recwarn):
    """Inkling's audio requests print, log and warn nothing either."""
    _mixed_audio_requests_are_quiet(*inkling, capfd, caplog, recwarn)


# ----------------------------------------------- nemotron_h_nano_omni: Parakeet sound beside images and text


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """The tiny Nemotron-3 Nano Omni (scheduler/fixtures/vlm_builds_hybrids.py: Mamba-2, attention and
    mixture-of-experts blocks, a RADIO tower, a one-block Parakeet sound encoder), the requests above and their
    references. Seed 3, as its image tests (tests/models/test_vlm_families.py): seed 0 ends the first request on eos
    after one token, so the KV budget preempts no audio request."""
    return _tiny_mixed("nemotron_h_nano_omni", tmp_path_factory, seed=3)


def test_nemotron_audio_reaches_the_language_model(nemotron):
    """The requests' answers differ, and a clip's tokens are what the processor expands its one `<so_embedding>` into
    (between <so_start> and <so_end>): one per 80 ms, 1 + samples // 160 mel frames through three stride-2
    convolutions, 13 for 1 s and 29 for 2.3 s. The processor hands the model the waveforms (`sound_clips`); the
    model computes their features in get_input_embeddings."""
    model, processor, requests, references = nemotron
    assert len({tuple(r) for r in references[:6]}) == 6 and references[6] == references[0]
    adapter = VLMAdapter(model, processor)
    assert adapter.sample_rate == RATE and adapter.spec.audio_encoder == "sound_encoder"
    one, two = (adapter.prepare(requests[i]["prompt"], audio=requests[i]["audio"]) for i in (0, 2))
    sound = model.config.sound_context_token_id
    assert one.num_audio == 1 and one.input_ids.count(sound) == one.num_media_tokens == 13
    assert two.num_audio == 2 and two.num_media_tokens == 13 + 29 and list(two.media_inputs) == ["sound_clips"]


@pytest.mark.parametrize("schedule", list(OMNI_SCHEDULES))
def test_nemotron_engine_audio_images_and_text_match_solo(nemotron, schedule):
    """Nemotron Omni batched as Qwen3-Omni above: each request's tokens are mlx_vlm.stream_generate's alone, in each
    schedule (a request's clips, and its images, through one get_input_embeddings call of its own, keyed whole; the
    Mamba-2 state of rows whose chunks differ prefilled apart)."""
    _mixed_schedule_matches_solo(*nemotron, schedule)


def test_nemotron_audio_requests_are_quiet(nemotron, capfd, caplog, recwarn):
    """Nemotron Omni's audio requests print, log and warn nothing either."""
    _mixed_audio_requests_are_quiet(*nemotron, capfd, caplog, recwarn)


def test_nemotron_with_video_pruning_refuses_videos_alone(nemotron, tmp_path):
    """A Nemotron Omni checkpoint whose config sets `video_pruning_rate` (NVIDIA's sets 0.7) drops video rows after
    its tower, so its prompts would come out shorter than their ids: its video requests are refused with a typed
    error naming the option, the server's media kinds leave video out, and its audio, image and text requests (the
    same seeded weights as the `nemotron` fixture's build) still give their solo mlx-vlm tokens beside the refusal."""
    import json

    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    from ..helpers import drive

    _, _, requests, references = nemotron
    path = build_tiny_vlm("nemotron_h_nano_omni", tmp_path / "model", seed=3)
    config = json.loads((path / "config.json").read_text())
    assert config.get("video_pruning_rate", 0) == 0  # the fixtures' build keeps every row
    (path / "config.json").write_text(json.dumps(dict(config, video_pruning_rate=0.5)))
    model, processor = mlx_vlm.load(str(path))
    adapter = VLMAdapter(model, processor)
    assert adapter.media_kinds == {"image", "audio"} and "video_pruning_rate is 0.5" in adapter.refused_media["video"]
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=40, prefill_chunk=9, check_invariants=True))
    frames = [Image.fromarray(np.full((56, 56, 3), 9 * i, dtype=np.uint8)) for i in range(4)]
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(InvalidRequest, match="video_pruning_rate is 0.5 in this checkpoint's config"):
        engine.add_request(prompt=video, videos=[frames], request_id="v")
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    run = drive(engine, [(0, dict(requests[i], sampling=sampling, request_id=str(i))) for i in (0, 3, 4, 5)])
    assert not run.errors, run.errors
    assert run.tokens == {str(i): references[i] for i in (0, 3, 4, 5)}


# ------------------------------------------------------ mimo_v2: MiMo audio-tokenizer codes beside images and text


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """The tiny MiMo-V2.6 (scheduler/fixtures/vlm_builds_hybrids.py: sliding-window layers with attention sinks, a
    windowed ViT, an audio encoder on speech codes) with its tiny mlx-audio MiMo audio tokenizer under
    audio_tokenizer/, the requests above and their references (seed 3, as its image tests)."""
    return _tiny_mixed("mimo_v2", tmp_path_factory, seed=3)


def test_mimo_audio_reaches_the_language_model(mimo):
    """The requests' answers differ, and a clip's tokens are what the processor expands its one <|audio_pad|> into:
    one per 4 frames of the codes its audio tokenizer gives (20 codebooks of 40 ms frames: 26 frames, 7 tokens, for
    1 s; 58 frames, 15 tokens, for 2.3 s). The codes (frames, 20) and each clip's frame count are the media inputs."""
    model, processor, requests, references = mimo
    assert len({tuple(r) for r in references[:6]}) == 6 and references[6] == references[0]
    adapter = VLMAdapter(model, processor)
    assert adapter.sample_rate == RATE and adapter.spec.audio_encoder == "audio_encoder"
    one, two = (adapter.prepare(requests[i]["prompt"], audio=requests[i]["audio"]) for i in (0, 2))
    assert one.num_audio == 1 and one.input_ids.count(model.config.audio_token_id) == one.num_media_tokens == 7
    assert two.num_audio == 2 and two.num_media_tokens == 7 + 15
    assert two.media_inputs["audio_codes"].shape[1] == 20 and list(two.media_inputs["audio_code_lengths"]) == [26, 58]


@pytest.mark.parametrize("schedule", list(OMNI_SCHEDULES))
def test_mimo_engine_audio_images_and_text_match_solo(mimo, schedule):
    """MiMo-V2.6 batched as Qwen3-Omni above: each request's tokens are mlx_vlm.stream_generate's alone, in each
    schedule (the tick's clips, and images, through one encoder call, each clip's codes encoded on their own). The
    kv-budget schedule prefills in chunks of 8, its sliding window: whole prompts as one chunk peak above their rows
    and keep the first three requests from being admitted together."""
    _mixed_schedule_matches_solo(*mimo, schedule, budget_chunk=8)


def test_mimo_audio_requests_are_quiet(mimo, capfd, caplog, recwarn):
    """MiMo-V2.6's audio requests print, log and warn nothing either."""
    _mixed_audio_requests_are_quiet(*mimo, capfd, caplog, recwarn)


# ------------------------------------------------------------ minicpmo: Whisper audio beside images and text


@pytest.fixture(scope="module")
def minicpmo(tmp_path_factory):
    """The tiny MiniCPM-o (scheduler/fixtures/vlm_builds_minicpm.py: Qwen3-VL text, a SigLIP tower and resampler, a
    one-layer Whisper audio tower), the requests above and their references (seed 2, as its image tests)."""
    return _tiny_mixed("minicpmo", tmp_path_factory, seed=2)


def test_minicpmo_audio_reaches_the_language_model(minicpmo):
    """The requests' answers differ, and a clip is `<|audio_start|>`, a `<unk>` per 5 of its Whisper encoder's
    frames, `<|audio_end|>` (10 for 1 s, 23 for 2.3 s): the rows go at those `<unk>` positions, the images' media
    token too, by the absolute `audio_bounds` the processor computes. mlx-vlm's chat formatting writes a clip as
    `<|audio_N|>` text, which the processor's marker pattern does not match: it puts the clips after the last
    user tag and leaves the `<|audio_N|>` text in the prompt, and the engine gives what mlx-vlm gives."""
    model, processor, requests, references = minicpmo
    assert len({tuple(r) for r in references[:6]}) == 6 and references[6] == references[0]
    adapter = VLMAdapter(model, processor)
    assert adapter.sample_rate == RATE and adapter.spec.audio_encoder == "audio_tower"
    one, two = (adapter.prepare(requests[i]["prompt"], audio=requests[i]["audio"]) for i in (0, 2))
    assert one.prompt.startswith("<|im_start|>user\n<|audio_1|>What do you hear?")
    unk = processor.tokenizer.convert_tokens_to_ids("<unk>")
    assert one.num_audio == 1 and one.input_ids.count(unk) == one.num_media_tokens == 10
    assert two.num_audio == 2 and two.num_media_tokens == 10 + 23


def test_minicpmo_audio_markers_in_a_templated_prompt_match_solo(minicpmo):
    """A templated prompt that writes its clips as the processor's own `<audio>./</audio>` markers has them
    expanded in place (no `<|audio_N|>` text), and the engine gives mlx_vlm.stream_generate's tokens for it."""
    import mlx_vlm

    from ..helpers import drive

    model, processor, requests, _ = minicpmo
    clips = requests[2]["audio"]
    prompt = ("<|im_start|>user\n<audio>./</audio> then <audio>./</audio> Compare them.<|im_end|>\n"
              "<|im_start|>assistant\n")
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, audio=[str(c) for c in clips],
                                        max_tokens=MAX_TOKENS, temperature=0.0):
        pass
    prepared = VLMAdapter(model, processor).prepare(prompt, audio=clips)
    assert "<|audio_" not in prepared.prompt and prepared.num_media_tokens == 10 + 23
    engine = Engine(model, processor, EngineConfig(check_invariants=True))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    run = drive(engine, [(0, {"prompt": prompt, "audio": clips, "sampling": sampling, "request_id": "m"}),
                         (0, dict(requests[5], sampling=sampling))])
    assert run.tokens["m"] == list(last.token_ids)


@pytest.mark.parametrize("schedule", list(OMNI_SCHEDULES))
def test_minicpmo_engine_audio_images_and_text_match_solo(minicpmo, schedule):
    """MiniCPM-o batched as Qwen3-Omni above: each request's tokens are mlx_vlm.stream_generate's alone, in each
    schedule (a request's clips and images through one get_input_embeddings call of its own, keyed whole: their
    bounds are absolute prompt positions)."""
    _mixed_schedule_matches_solo(*minicpmo, schedule)


def test_minicpmo_audio_requests_are_quiet(minicpmo, capfd, caplog, recwarn):
    """MiniCPM-o's audio requests print, log and warn nothing either."""
    _mixed_audio_requests_are_quiet(*minicpmo, capfd, caplog, recwarn)


# ------------------------------------------------- a video and an audio clip in one request (the omni families)


@pytest.mark.parametrize("family_fixture", ["omni", "mimo", "nemotron"])
def test_video_and_audio_in_one_request_match_solo(family_fixture, request, tmp_path):
    """A request with a video and an audio clip (Qwen3-Omni, MiMo-V2.6 and Nemotron Omni take both) gives
    mlx_vlm.stream_generate's tokens alone, batched with an audio request and an image+audio request of the
    fixture's, staggered in chunks of 9 so that its prefill shares forwards with theirs."""
    import mlx_vlm

    from ..helpers import drive

    model, processor, requests, references = request.getfixturevalue(family_fixture)
    clip = write_wav(tmp_path / "c.wav", tone(1.4, 5))
    rng = np.random.default_rng(7)
    frames = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(4)]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "audio"},
                                             {"type": "text", "text": "What happens, and what do you hear?"}]}]
    # the processor's template, else its tokenizer's (Nemotron's processor keeps none of its own)
    templater = processor if getattr(processor, "chat_template", None) is not None else processor.tokenizer
    prompt = templater.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    last = None
    for last in mlx_vlm.stream_generate(model, processor, prompt, video=[np.stack([np.asarray(f) for f in frames])],
                                        audio=[str(clip)], max_tokens=MAX_TOKENS, temperature=0.0):
        pass
    engine = Engine(model, processor, EngineConfig(max_batched_tokens=40, prefill_chunk=9, check_invariants=True))
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    run = drive(engine, [(0, dict(requests[0], sampling=sampling, request_id="a")),
                         (1, {"prompt": messages, "videos": [frames], "audio": [clip], "sampling": sampling,
                              "request_id": "av"}),
                         (2, dict(requests[4], sampling=sampling, request_id="ia"))])
    assert not run.errors, run.errors
    assert run.tokens == {"a": references[0], "av": list(last.token_ids), "ia": references[4]}

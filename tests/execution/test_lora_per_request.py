"""LoRA adapters chosen per request (`Engine(loras={name: dir})`, `add_request(lora=name)`): requests on the base
model and on different adapters share batches (prefill groups, decode and verify forwards), and each request's
greedy output equals mlx-lm's for it alone on `mlx_lm.load(model, adapter_path=<its adapter>)`, token for token.
The prefix cache shares a prefix only between requests on the same adapter; traces record each request's adapter
and replay decision by decision. The adapters are seeded, not trained (`scheduler.fixtures.lora`), so that each
one's effect shows."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import mlx.core as mx
import pytest

from scheduler import AsyncEngine, Engine, EngineConfig, InvalidRequest, SamplingParams
from scheduler.fixtures.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_lora_adapter
from scheduler.models.lora import LoRAError, LoRASet

from ..helpers import drive, greedy, mixed_prompts, peft_copy, solo_tokens

CONFIG = EngineConfig(max_batched_tokens=48, max_seqs=8, prefill_chunk=16, check_invariants=True)
MAX_TOKENS = 12
# each request's adapter, in arrival order: runs of one adapter, the base model between, every pair adjacent
CHOICE = [None, "one", "two", "one", None, "two", "two", "one", None, "one"]
SCHEDULES = {
    "chunked": {},
    # every drafting row verifies k tokens a tick (no gate, no adaptive stop), so verify forwards mix adapters
    "drafting": {"draft_tokens": 3, "adaptive_drafting": False, "draft_gate": False},
    # rows before their conversion point decode in a float batch of their own: decode forwards per storage group
    "kv-bits": {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 24},
    "prefix-cache": {"prefix_cache_bytes": 8 << 20, "prefix_block_size": 8},
}


@pytest.fixture(scope="module")
def adapters(text_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {name: write_lora_adapter(text_model_dir, root / name, seed=seed) for seed, name in ((1, "one"), (2, "two"))}


@pytest.fixture(scope="module")
def references(text_model_dir, adapters):
    """adapter name (None: the base model) -> mlx-lm's (model, tokenizer) with that adapter loaded alone."""
    import mlx_lm

    out = {None: mlx_lm.load(str(text_model_dir))}
    out.update({name: mlx_lm.load(str(text_model_dir), adapter_path=str(path)) for name, path in adapters.items()})
    return out


def _alone(references, prompt, lora, **kwargs):
    model, tokenizer = references[lora]
    return solo_tokens(model, tokenizer, prompt, MAX_TOKENS, **kwargs)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_requests_on_different_adapters_share_batches_and_each_equals_its_adapter_alone(
        text_model_dir, adapters, references, schedule, tmp_path):
    from scheduler.tools.explain import explain, format_story
    from scheduler.tools.replay import load_trace, replay

    settings = SCHEDULES[schedule]
    prompts = mixed_prompts(len(CHOICE), 3, 70, seed=5)
    if schedule == "prefix-cache":  # later requests repeat earlier prompts, on the same and on other adapters
        prompts = prompts[:4] + [prompts[i % 4] + prompts[4 + i][:5] for i in range(len(CHOICE) - 4)]
    mlx_kwargs = {k: settings[k] for k in ("kv_bits", "kv_group_size", "quantized_kv_start") if k in settings}
    want = [_alone(references, p, lora, **mlx_kwargs) for p, lora in zip(prompts, CHOICE)]
    # each adapter changes the output of every prompt here
    assert all(w != _alone(references, p, None, **mlx_kwargs) for w, p, lora in zip(want, prompts, CHOICE) if lora)
    trace = tmp_path / "t.jsonl"
    config = dataclasses.replace(CONFIG, trace_path=str(trace), **settings)
    engine = Engine.from_pretrained(text_model_dir, config, loras=adapters)
    run = drive(engine, [(i // 3, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "lora": lora})
                         for i, (p, lora) in enumerate(zip(prompts, CHOICE))])
    assert list(run.tokens.values()) == want
    engine.close()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    lora_of = {e["request_id"]: e.get("lora") for e in events if e["event"] == "arrival"}
    assert list(lora_of.values()) == CHOICE
    assert events[0]["event"] == "engine_start" and events[0]["loras"] == ["one", "two"]
    # forwards did mix adapters: some prefill forward, and some decode tick, ran rows on different ones
    assert any(len({lora_of[r] for r in e["request_ids"]}) > 1 for e in events if e["event"] == "prefill_forward")
    assert any(len({lora_of[r] for r in e["decode"]}) > 1 for e in events if e["event"] == "plan")
    stories = explain(trace)  # `mlxsched explain` names each request's adapter
    assert [("on LoRA adapter 'one'" in format_story(story)) for story in stories] == [c == "one" for c in CHOICE]
    if schedule == "prefix-cache":
        hits = [e for e in events if e["event"] == "prefix_hit"]
        assert hits  # requests on one adapter share their prefixes ...
        entry_lora = {e["entry_id"]: lora_of[e["request_id"]] for e in events if e["event"] == "prefix_store"}
        assert all(entry_lora[e["entry_id"]] == lora_of[e["request_id"]] for e in hits)  # ... and only those
        assert any(lora_of[e["request_id"]] is not None for e in hits)
    if schedule == "drafting":  # verify forwards ran rows on different adapters too
        assert engine.draft_stats()["verify_forwards"] > 0
        assert any(len({lora_of[rid] for rid, _ in e["draft"]}) > 1 for e in events if e["event"] == "plan")
    assert replay(load_trace(trace)).identical


def _each_row_its_own(model, loras, x, base, one, two) -> None:
    """A batch of 4 rows all on adapter "one" computes mlx-lm's model with it exactly; rows on "two", the base
    model, "one", "two" each compute their own (the base row exactly, the others within rounding, each adapter
    changing its row's output)."""
    with loras.rows(["one"] * 4):
        assert mx.array_equal(model(x), one(x))
    with loras.rows(["two", None, "one", "two"]):
        mixed = model(x)
    assert mx.array_equal(mixed[1], base(x)[1])
    for i, ref in ((0, two), (2, one), (3, two)):
        alone = ref(x[i:i + 1])[0]
        assert not mx.allclose(alone, base(x[i:i + 1])[0], atol=1e-2).item()  # the adapter shows
        assert mx.allclose(mixed[i], alone, atol=1e-4).item()


def test_a_batch_on_no_adapter_computes_the_base_model_and_one_on_a_single_adapter_computes_it(
        text_model_dir, adapters, references):
    """The layer-level promise: rows on no adapter get the base layers' output unchanged (exactly), a batch all on
    one adapter gets exactly mlx-lm's LoRALinear, and a mixed batch each row's own within rounding; a mixed forward
    whose layer cannot tell its rows apart is refused."""
    import mlx_lm

    model, _ = mlx_lm.load(str(text_model_dir))
    loras = LoRASet.install(model, adapters)
    assert loras.names == ("one", "two")
    x = mx.array(mixed_prompts(4, 9, 9, seed=3))
    base, one, two = (references[k][0] for k in (None, "one", "two"))
    assert mx.array_equal(model(x), base(x))  # outside `rows`: the base model
    with loras.rows([None] * 4):
        assert mx.array_equal(model(x), base(x))
    _each_row_its_own(model, loras, x, base, one, two)
    assert mx.array_equal(model(x), base(x))  # the selection ends with the block
    # a layer fed tokens not laid out by row (batch and positions flattened) in a mixed forward cannot tell the rows
    # apart: it refuses rather than add one row's update to another's tokens
    q_proj = model.model.layers[0].self_attn.q_proj
    with loras.rows(["two", None, "one", "two"]), pytest.raises(LoRAError, match="does not keep its batch rows"):
        q_proj(mx.zeros((4 * 9, q_proj.base.weight.shape[1])))


def test_expert_projections_tell_rows_apart_whether_or_not_their_block_regroups_tokens(tmp_path):
    """The layer-level promise on a mixture-of-experts model (qwen3_moe, every expert projection adapted): mlx-lm's
    SwitchGLU regroups a forward's tokens by expert once it routes 64 or more (here 4 rows x 9 tokens x 2
    experts), and not below (4 rows x 1 token: a decode step); either way a mixed batch's rows each equal their
    own adapter alone, a base row the base model exactly, and a batch on one adapter mlx-lm's LoRASwitchLinear
    exactly."""
    import mlx_lm

    from scheduler.fixtures.families import build_family_model

    model_dir = build_family_model("qwen3_moe", tmp_path / "model")
    adapters = {name: write_lora_adapter(model_dir, tmp_path / name, seed=seed) for seed, name in ((1, "one"),
                                                                                                    (2, "two"))}
    model, _ = mlx_lm.load(str(model_dir))
    loras = LoRASet.install(model, adapters)
    base, one, two = (mlx_lm.load(str(model_dir), **({"adapter_path": str(adapters[k])} if k else {}))[0]
                      for k in (None, "one", "two"))
    assert model.args.num_experts_per_tok * 4 * 9 >= 64 > model.args.num_experts_per_tok * 4
    for length in (9, 1):
        _each_row_its_own(model, loras, mx.array(mixed_prompts(4, length, length, seed=3)), base, one, two)
    # a projection called on its own, not by its block, in a mixed forward cannot place its tokens: it refuses
    gate_proj = model.model.layers[0].mlp.switch_mlp.base.gate_proj
    with loras.rows(["two", None, "one", "two"]), pytest.raises(LoRAError, match="outside its block's routing"):
        gate_proj(mx.zeros((4, 1, 1, 1, model.args.hidden_size)), mx.zeros((4, 1, 2), dtype=mx.uint32))


def test_an_unknown_adapter_is_refused_for_that_request_only(text_model_dir, adapters, references):
    engine = Engine.from_pretrained(text_model_dir, CONFIG, loras=adapters)
    prompt = mixed_prompts(1, 20, 20, seed=9)[0]
    with pytest.raises(InvalidRequest, match="no adapter 'three'") as info:
        engine.add_request(prompt_tokens=prompt, sampling=greedy(MAX_TOKENS), lora="three")
    assert info.value.field == "lora"
    run = drive(engine, [(0, {"prompt_tokens": prompt, "sampling": greedy(MAX_TOKENS), "lora": "two"})])
    assert list(run.tokens.values()) == [_alone(references, prompt, "two")]
    # generate(loras=...) and AsyncEngine's lora= choose the same way
    prompts = mixed_prompts(3, 5, 30, seed=4)
    choice = ["two", None, "one"]
    outs = engine.generate(prompts, greedy(MAX_TOKENS), loras=choice)
    assert [o.token_ids for o in outs] == [_alone(references, p, lora) for p, lora in zip(prompts, choice)]
    with pytest.raises(InvalidRequest, match="^loras: one entry per prompt"):
        engine.generate(prompts, greedy(MAX_TOKENS), loras=["one"])

    async def on_adapter():
        async with AsyncEngine(engine) as aengine:
            return await aengine.generate(prompt_tokens=prompts[0], sampling=greedy(MAX_TOKENS), lora="one")

    assert asyncio.run(on_adapter()).token_ids == _alone(references, prompts[0], "one")
    plain = Engine.from_pretrained(text_model_dir, CONFIG)
    with pytest.raises(InvalidRequest, match="this engine has none"):
        plain.add_request(prompt_tokens=prompt, lora="one")


def _edit_adapter(src, dst, config=None, weights=None):
    dst.mkdir()
    cfg = json.loads((src / ADAPTER_CONFIG).read_text())
    (dst / ADAPTER_CONFIG).write_text(json.dumps(config(cfg) if config else cfg))
    w = mx.load(str(src / ADAPTER_WEIGHTS))
    mx.save_safetensors(str(dst / ADAPTER_WEIGHTS), weights(w) if weights else w)
    return dst


def test_adapters_that_cannot_be_served_per_request_are_refused_naming_why(text_model_dir, adapters, tmp_path):
    import mlx_lm

    one = adapters["one"]
    q_proj = "model.layers.0.self_attn.q_proj"
    cases = {
        "no adapter_config.json and adapters.safetensors": tmp_path / "empty",
        "fine_tune_type 'dora'": _edit_adapter(
            one, tmp_path / "dora", config=lambda c: {**c, "fine_tune_type": "dora"}),
        "does not hold exactly lora_a and lora_b": _edit_adapter(
            one, tmp_path / "m", weights=lambda w: {**w, f"{q_proj}.m": mx.zeros((4,))}),
        "has lora_a": _edit_adapter(  # another rank than the config's
            one, tmp_path / "shape",
            weights=lambda w: {**w, f"{q_proj}.lora_a": mx.zeros((w[f"{q_proj}.lora_a"].shape[0], 2))}),
        "not in the model": _edit_adapter(
            one, tmp_path / "where", weights=lambda w: {k.replace("layers.0.", "layers.99."): v for k, v in w.items()}),
        "no lora_parameters rank and scale": _edit_adapter(
            one, tmp_path / "cfg", config=lambda c: {**c, "lora_parameters": {}}),
    }
    (tmp_path / "empty").mkdir()
    for why, path in cases.items():
        model, _ = mlx_lm.load(str(text_model_dir))
        with pytest.raises(LoRAError, match=why):
            LoRASet.install(model, {"bad": path})
    # an expert projection outside mlx-lm's SwitchGLU / SwitchMLP: how its block regroups tokens is unknown
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    grouped = nn.Module()
    grouped.attn = nn.Module()
    grouped.attn.o_proj = SwitchLinear(8, 8, 2, bias=False)
    (tmp_path / "grouped").mkdir()
    (tmp_path / "grouped" / ADAPTER_CONFIG).write_text(json.dumps({"lora_parameters": {"rank": 4, "scale": 1.0}}))
    mx.save_safetensors(str(tmp_path / "grouped" / ADAPTER_WEIGHTS), {"attn.o_proj.lora_a": mx.zeros((2, 4, 8)),
                                                                      "attn.o_proj.lora_b": mx.zeros((2, 8, 4))})
    with pytest.raises(LoRAError, match=r"attn\.o_proj is an expert projection outside mlx-lm's SwitchGLU"):
        LoRASet.install(grouped, {"bad": tmp_path / "grouped"})
    model, tokenizer = mlx_lm.load(str(text_model_dir))
    first = Engine(model, tokenizer, CONFIG, loras=adapters)
    assert Engine(model, tokenizer, CONFIG, loras=adapters).loras is first.loras  # the same adapters: shared
    with pytest.raises(ValueError, match="carries other per-request adapters already"):
        Engine(model, tokenizer, CONFIG, loras={"one": adapters["one"]})
    with pytest.raises(ValueError, match="^adapter_path and loras"):
        Engine.from_pretrained(text_model_dir, CONFIG, adapter_path=one, loras=adapters)
    with pytest.raises(ValueError, match="^loras: a sharded model takes no adapters"):
        Engine(*mlx_lm.load(str(text_model_dir)), CONFIG, loras=adapters, shard_group=object())


def test_a_what_if_simulation_of_the_trace_shares_prefixes_only_on_one_adapter(text_model_dir, adapters, tmp_path):
    """The same prompt on the base model, then twice on one adapter, one after another: the third hits the second's
    entry and the second misses the first's. The trace's arrivals carry each adapter, so the simulation of the
    recorded config finds the recorded hit rate; the same arrivals with the adapters dropped would find 2/3."""
    from scheduler.tools.simulate import arrivals_from_trace, fit_cost_model, load_recorded, recorded_metrics, simulate

    prompt = mixed_prompts(1, 60, 60, seed=9)[0]
    path = tmp_path / "t.jsonl"
    engine = Engine.from_pretrained(text_model_dir, EngineConfig(prefix_cache_bytes=1 << 22, trace_path=str(path)),
                                    loras=adapters)
    for lora in (None, "one", "one"):
        engine.add_request(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=5), lora=lora)
        while engine.has_pending():
            engine.step()
    engine.close()
    rec = load_recorded(path)
    assert (rec.prefix_hits, rec.prefix_misses) == (1, 2)
    config = dataclasses.replace(rec.trace.config, trace_path=None, check_invariants=True)
    settings, cost = rec.simulation_settings(), fit_cost_model(rec)
    arrivals = arrivals_from_trace(rec)
    assert [a.lora for a in arrivals] == [None, "one", "one"]
    simulated = simulate(arrivals, config, cost, policy=config.policy, **settings).summary()
    assert simulated["cache_hit_rate"] == pytest.approx(1 / 3) == recorded_metrics(rec)["cache_hit_rate"]
    blind = [dataclasses.replace(a, lora=None) for a in arrivals]
    assert simulate(blind, config, cost, policy=config.policy, **settings).summary()["cache_hit_rate"] == (
        pytest.approx(2 / 3))


@pytest.mark.parametrize("family, bits", [("qwen3", 4), ("lfm2", None), ("qwen3_moe", None), ("mixtral", 4),
                                          ("gpt_oss", None)])
def test_adapters_over_a_quantized_base_a_recurrent_family_and_experts(family, bits, tmp_path):
    """mlx-lm's LoRA over 4-bit QuantizedLinear layers, over a family with recurrent state (lfm2's convolutions
    batch with their own padding rules), and over mixture-of-experts models (mlx-lm's LoRASwitchLinear on every
    expert projection, float and 4-bit, and gpt-oss's biased experts), batched and mixed, equals each adapter
    alone."""
    import mlx_lm

    from scheduler.fixtures.families import build_family_model

    model_dir = build_family_model(family, tmp_path / "model", bits=bits)
    loras = {name: write_lora_adapter(model_dir, tmp_path / name, seed=seed, rank=4)
             for seed, name in ((1, "one"), (2, "two"))}
    if family in ("qwen3_moe", "mixtral", "gpt_oss"):  # the adapters do adapt the experts (3-D lora_a)
        assert any(value.ndim == 3 for value in mx.load(str(loras["one"] / ADAPTER_WEIGHTS)).values())
    references = {None: mlx_lm.load(str(model_dir)),
                  **{name: mlx_lm.load(str(model_dir), adapter_path=str(path)) for name, path in loras.items()}}
    prompts = mixed_prompts(6, 3, 50, seed=1)
    choice = [None, "one", "two", "two", "one", None]
    want = [_alone(references, p, lora) for p, lora in zip(prompts, choice)]
    assert all(w != _alone(references, p, None) for w, p, lora in zip(want, prompts, choice) if lora)
    engine = Engine.from_pretrained(model_dir, CONFIG, loras=loras)
    run = drive(engine, [(i // 2, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "lora": lora})
                         for i, (p, lora) in enumerate(zip(prompts, choice))])
    assert list(run.tokens.values()) == want


def test_peft_adapters_serve_as_the_same_matrices_in_mlx_lm_layout(text_model_dir, adapters, references, tmp_path):
    """Adapters in Hugging Face PEFT's layout (what vLLM's --lora-modules serves), plain and rsLoRA, next to one in
    mlx-lm's, mixed in batches: each request equals mlx-lm alone with the same matrices in its own layout. What
    PEFT can hold that is not a plain LoRA of linear layers is refused naming it."""
    peft = peft_copy(adapters["one"], tmp_path / "peft")
    rslora = peft_copy(adapters["two"], tmp_path / "rslora", rslora=True)
    loras = {"peft": peft, "rslora": rslora, "one": adapters["one"]}
    reference_of = {None: None, "peft": "one", "rslora": "two", "one": "one"}
    prompts = mixed_prompts(8, 3, 50, seed=12)
    choice = ["peft", None, "rslora", "one", "rslora", "peft", None, "one"]
    want = [_alone(references, p, reference_of[lora]) for p, lora in zip(prompts, choice)]
    engine = Engine.from_pretrained(text_model_dir, CONFIG, loras=loras)
    run = drive(engine, [(i // 3, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "lora": lora})
                         for i, (p, lora) in enumerate(zip(prompts, choice))])
    assert list(run.tokens.values()) == want
    import mlx_lm

    refused = {
        "sets use_dora": {"use_dora": True},
        "sets modules_to_save": {"modules_to_save": ["lm_head"]},
        "sets fan_in_fan_out": {"fan_in_fan_out": True},
        "sets rank_pattern": {"rank_pattern": {"q_proj": 8}},
        "has bias 'all'": {"bias": "all"},
        "peft_type 'IA3'": {"peft_type": "IA3"},
        "needs r": {"r": None},
    }
    for i, (why, config) in enumerate(refused.items()):
        with pytest.raises(LoRAError, match=why):
            LoRASet.install(mlx_lm.load(str(text_model_dir))[0], {"bad": peft_copy(adapters["one"], tmp_path / f"r{i}",
                                                                                  **config)})
    embedding = peft_copy(adapters["one"], tmp_path / "embedding")
    weights = mx.load(str(embedding / "adapter_model.safetensors"))
    weights["base_model.model.model.embed_tokens.lora_embedding_A"] = mx.zeros((4, 8))
    mx.save_safetensors(str(embedding / "adapter_model.safetensors"), weights)
    pickled = peft_copy(adapters["one"], tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    for why, path in (("embed_tokens.lora_embedding_A, not a LoRA weight of a linear layer", embedding),
                      ("adapter_model.bin, pickled weights, which are not loaded", pickled)):
        with pytest.raises(LoRAError, match=why):
            LoRASet.install(mlx_lm.load(str(text_model_dir))[0], {"bad": path})


def test_adapters_load_and_unload_while_the_engine_runs(text_model_dir, adapters, references, tmp_path):
    """`load_lora` / `unload_lora` between steps, with requests running: a loaded adapter is installed at the next
    tick and serves exactly as mlx-lm with it alone, next to a base request that started before it; an adapter a
    live request runs on is not unloaded (LoRAInUse); an unloaded name is refused to new requests and can be
    loaded again with another adapter; a bad adapter changes nothing. The trace records the loads and replays."""
    from scheduler import LoRAError, LoRAInUse, UnknownLoRA
    from scheduler.tools.replay import load_trace, replay

    trace = tmp_path / "t.jsonl"
    engine = Engine.from_pretrained(text_model_dir, dataclasses.replace(CONFIG, trace_path=str(trace)))
    assert engine.lora_names == ()
    prompts = mixed_prompts(3, 20, 40, seed=8)
    tokens: dict[str, list[int]] = {}

    def step(n=1):
        for _ in range(n):
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)

    base = engine.add_request(prompt_tokens=prompts[0], sampling=greedy(MAX_TOKENS))
    step(2)
    engine.load_lora("one", adapters["one"])
    assert engine.lora_names == ("one",)
    on_one = engine.add_request(prompt_tokens=prompts[1], sampling=greedy(MAX_TOKENS), lora="one")
    step(2)
    with pytest.raises(LoRAInUse, match="in use by 1 live request"):
        engine.unload_lora("one")
    with pytest.raises(ValueError, match="loaded already"):
        engine.load_lora("one", adapters["two"])
    with pytest.raises(LoRAError):
        engine.load_lora("broken", tmp_path)
    assert engine.lora_names == ("one",)
    while engine.has_pending():
        step()
    assert tokens[base] == _alone(references, prompts[0], None)
    assert tokens[on_one] == _alone(references, prompts[1], "one")
    engine.unload_lora("one")
    with pytest.raises(InvalidRequest, match="no adapter 'one'"):
        engine.add_request(prompt_tokens=prompts[2], lora="one")
    with pytest.raises(UnknownLoRA):
        engine.unload_lora("one")
    engine.load_lora("one", adapters["two"])  # the name again, another adapter
    again = engine.add_request(prompt_tokens=prompts[2], sampling=greedy(MAX_TOKENS), lora="one")
    while engine.has_pending():
        step()
    assert tokens[again] == _alone(references, prompts[2], "two")
    engine.close()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(e["event"], e["name"]) for e in events if e["event"].startswith("lora_")] == [
        ("lora_load", "one"), ("lora_unload", "one"), ("lora_load", "one")]
    assert replay(load_trace(trace)).identical


def test_an_adapter_loaded_from_another_thread_serves_on_the_engine_loop(text_model_dir, adapters, references):
    """The server loads adapters on a worker thread while AsyncEngine's loop thread steps the engine: the adapter's
    arrays are computed on the loading thread (an MLX array made on one thread cannot be computed on another's
    stream: the loop died with "There is no Stream(cpu, 2) in current thread" before), and it serves exactly."""
    prompt = mixed_prompts(1, 15, 15, seed=2)[0]
    engine = Engine.from_pretrained(text_model_dir, CONFIG)

    async def run():
        async with AsyncEngine(engine) as aengine:
            await asyncio.to_thread(engine.load_lora, "two", adapters["two"])
            return await aengine.generate(prompt_tokens=prompt, sampling=greedy(MAX_TOKENS), lora="two")

    assert asyncio.run(run()).token_ids == _alone(references, prompt, "two")


def test_requests_on_a_vision_language_model_choose_adapters_of_its_language_model(vlm_model_dir, tmp_path):
    """mlx-vlm adapters (its trainer's layout: the language model's linear layers) chosen per request on the tiny
    Qwen2-VL: image and text requests on the base model and on two adapters share batches, and each equals
    `mlx_vlm.stream_generate` alone on `mlx_vlm.load(model, adapter_path=<its adapter>)`, with the prefix and vision
    caches on (an image's features are shared by requests on any adapter: the vision tower is not adapted), and
    one in PEFT's layout with the Hugging Face model's module paths serves as its mlx-vlm original. An adapter of a
    layer outside the language model (the vision tower) is refused naming it."""
    import mlx_vlm
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    loras = {name: write_lora_adapter(vlm_model_dir, tmp_path / name, seed=seed)
             for seed, name in ((1, "one"), (2, "two"))}
    references = {None: mlx_vlm.load(str(vlm_model_dir)),
                  **{name: mlx_vlm.load(str(vlm_model_dir), adapter_path=str(path)) for name, path in loras.items()}}
    model, processor = references[None]
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    def case(i):
        if i % 2 == 0:
            return apply_chat_template(processor, model.config, f"What is this? {i}", num_images=1), [image]
        return apply_chat_template(processor, model.config, "Tell me a story " * i, num_images=0), None

    cases = [case(i) for i in range(6)]
    choice = [None, "one", "one", "two", "two", None]

    def alone(lora, prompt, images):
        last = None
        for last in mlx_vlm.stream_generate(references[lora][0], processor, prompt, image=images,
                                            max_tokens=MAX_TOKENS, temperature=0.0):
            pass
        return list(last.token_ids)

    want = [alone(lora, p, imgs) for (p, imgs), lora in zip(cases, choice)]
    assert all(w != alone(None, p, imgs) for w, (p, imgs), lora in zip(want, cases, choice) if lora)
    config = dataclasses.replace(CONFIG, prefix_cache_bytes=8 << 20, prefix_block_size=8)
    engine = Engine.from_pretrained(vlm_model_dir, config, loras=loras)
    outs = engine.generate([p for p, _ in cases], greedy(MAX_TOKENS), images=[imgs for _, imgs in cases],
                           loras=choice)
    assert [out.token_ids for out in outs] == want
    assert engine.vision_cache.stats()["hits"] > 0  # the image's features served requests on other adapters
    # adapter "two" in PEFT's layout with transformers 5's module paths (`model.language_model.layers...`, what a
    # PEFT adapter of the Hugging Face model names), served under mlx-vlm's (`language_model.model.layers...`)
    hf = peft_copy(loras["two"], tmp_path / "hf", path=lambda t: t.replace("language_model.model.",
                                                                           "model.language_model.", 1))
    assert all(k.startswith("base_model.model.model.language_model.layers.")
               for k in mx.load(str(hf / "adapter_model.safetensors")))
    outs = Engine.from_pretrained(vlm_model_dir, config, loras={"one": loras["one"], "two": hf}).generate(
        [p for p, _ in cases], greedy(MAX_TOKENS), images=[imgs for _, imgs in cases], loras=choice)
    assert [out.token_ids for out in outs] == want
    # transformers 4's paths (`model.layers...`, `lm_head`) too; the vision tower's stay its own, and are refused
    from scheduler.models.lora_formats import LoRAAdapter, in_language_model

    old = LoRAAdapter("x", "p", 1.0, 4, ("lm_head", "model.layers.0.mlp.up_proj", "model.visual.blocks.0.qkv"), "peft")
    renamed, weights = in_language_model(old, {"model.layers.0.mlp.up_proj.lora_a": mx.zeros(1)}, "language_model")
    assert renamed.targets == ("language_model.lm_head", "language_model.model.layers.0.mlp.up_proj",
                               "model.visual.blocks.0.qkv")
    assert list(weights) == ["language_model.model.layers.0.mlp.up_proj.lora_a"]

    qkv = "vision_tower.blocks.0.attn.qkv"
    extra = {f"{qkv}.lora_a": mx.zeros((32, 4)), f"{qkv}.lora_b": mx.zeros((4, 96))}
    tower = _edit_adapter(loras["one"], tmp_path / "tower", weights=lambda w: {**w, **extra})
    with pytest.raises(LoRAError, match=r"vision_tower\.blocks\.0\.attn\.qkv is outside language_model"):
        Engine.from_pretrained(vlm_model_dir, config, loras={"tower": tower})

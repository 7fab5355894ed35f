"""The mlxsched command: every listed verb works."""

import json

import pytest

from scheduler.cli import build_parser, main
from scheduler.lifecycle import mermaid


def test_only_working_verbs_are_listed():
    verbs = set(build_parser()._subparsers._group_actions[0].choices)
    assert verbs == {"make-model", "make-lora", "demo", "lifecycle", "replay", "simulate", "explain", "sweep",
                     "timeline", "bench", "doctor", "serve"}


def test_bench_passes_every_argument_on_as_given(capsys):
    """`mlxsched bench ARGS` is `python -m bench.run ARGS` (and `--tensor-parallel` bench.tensor_parallel's), with
    or without a `--` first: arguments that look like options are not refused by mlxsched's own parser."""
    for argv in (["bench", "--help"], ["bench", "--", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        assert "--peer" in capsys.readouterr().out  # bench.run's own help
    # one process has no peers to shard over: the sharding bench says so (the flags after it are its own)
    assert main(["bench", "--tensor-parallel", "--model", "text", "--no-pin-ranks"]) == 2
    assert "mlx.launch -n 2" in capsys.readouterr().out


def test_make_model_builds_a_loadable_model(tmp_path, capsys):
    from mlx_lm import load

    assert main(["make-model", "text", str(tmp_path / "m")]) == 0
    model, tokenizer = load(str(tmp_path / "m"))
    assert tokenizer.encode("hello world")


def test_lifecycle_prints_the_generated_diagram(capsys):
    assert main(["lifecycle"]) == 0
    assert mermaid() in capsys.readouterr().out


def test_demo_runs_and_writes_a_trace(text_model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    assert main(["demo", "--model", str(text_model_dir), "--requests", "6", "--max-tokens", "5",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert '"generation_tokens"' in out
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(e["event"] == "arrival" for e in events) == 6
    ends = [e for e in events if e["event"] == "transition" and e["to"] in ("finished", "aborted")]
    assert len(ends) == 6


def test_unknown_kind_is_refused():
    with pytest.raises(SystemExit):
        main(["make-model", "huge", "x"])


def test_demo_default_is_a_mixed_image_and_text_workload_on_the_tiny_vlm(capsys):
    assert main(["demo", "--requests", "4", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "image+text" in out and '"num_images_processed": 2' in out


def test_simulate_and_timeline_commands(text_model_dir, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["demo", "--model", str(text_model_dir), "--requests", "8", "--max-tokens", "6",
                 "--trace", str(trace)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(trace), "--policy", "shortest-prompt-first", "--set", "max_seqs=2"]) == 0
    table = capsys.readouterr().out
    assert "ttft" in table.lower() and "throughput" in table.lower()
    assert main(["timeline", str(trace), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["timeline", str(trace), "-o", str(tmp_path / "t.json")]) == 0
    assert main(["simulate", str(tmp_path / "missing.jsonl")]) == 2


def test_doctor_reports_the_blas(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out and "BLAS" in out.upper()


def test_serve_refuses_a_bad_engine_config_before_loading(capsys):
    # serving itself is tests/surfaces/test_serve.py (a real server in a subprocess)
    assert main(["serve", "--model", "no-such-dir", "--max-seqs", "64", "--max-batched-tokens", "32"]) == 2
    assert "max_batched_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", "no-such-dir", "--max-queue", "0"])


def test_serve_says_in_one_line_what_it_cannot_serve(tmp_path, text_model_dir, capsys):
    """A path that is not a model directory (mlx-lm took it for a Hugging Face repo id and raised from the hub
    client), an adapter directory that is not there, and a family the engine refuses (gpt_bigcode), end with exit
    2 and one line, before anything listens."""
    from scheduler.fixtures.families import build_family_model

    assert main(["serve", "--model", str(tmp_path / "no-such-dir")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such model directory" in err and "no-such-dir" in err
    assert main(["serve", "--model", str(text_model_dir), "--adapter-path", str(tmp_path / "no-adapter")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such adapter directory" in err and "no-adapter" in err
    refused = build_family_model("gpt_bigcode", tmp_path / "gpt_bigcode")
    assert main(["serve", "--model", str(refused)]) == 2
    err = capsys.readouterr().err  # (transformers may warn first, loading the tokenizer)
    assert err.splitlines()[-1].startswith("mlxsched serve: cannot serve") and "gpt_bigcode" in err


def test_serve_refuses_lora_modules_it_cannot_serve_in_one_line(tmp_path, text_model_dir, capsys):
    """--lora-modules NAME=DIR: a name given twice or naming the served model, and a directory without an adapter
    end with exit 2 and one line, before anything listens; a malformed NAME=DIR is argparse's usage error."""
    from scheduler.fixtures.lora import write_lora_adapter

    good = write_lora_adapter(text_model_dir, tmp_path / "good")
    serve = ["serve", "--model", str(text_model_dir), "--served-model-name", "base", "--lora-modules"]
    for modules, why in (([f"a={good}", f"a={good}"], "'a' names two adapters"),
                         ([f"base={good}"], "'base' names the served model"),
                         ([f"a={good}", f"b={tmp_path}"], "adapter 'b'")):
        assert main(serve + modules) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, err
    with pytest.raises(SystemExit):
        main(serve + [str(good)])
    assert "NAME=DIR" in capsys.readouterr().err


def test_every_engine_config_field_is_a_serve_flag_or_says_why_not():
    """README: "Every EngineConfig budget is a flag". Each field is set by a serve flag (given in MB where the
    field is in bytes), or is listed with the reason it has none; a flag left out keeps EngineConfig's default."""
    import dataclasses

    from scheduler.cli import ENGINE_FIELDS_WITHOUT_FLAGS, _engine_config, build_parser
    from scheduler.config import EngineConfig

    parser = build_parser()
    assert _engine_config(parser.parse_args(["serve", "--model", "m"])) == EngineConfig()
    changed = {"max_batched_tokens": ("--max-batched-tokens", "64", 64), "max_seqs": ("--max-seqs", "3", 3),
               "prefill_chunk": ("--prefill-chunk", "16", 16), "max_prefill_tokens": ("--max-prefill-tokens", "40", 40),
               "max_model_len": ("--max-model-len", "300", 300), "penalty_context": ("--penalty-context", "5", 5),
               "processor_history": ("--processor-history", "output", "output"), "seed": ("--seed", "7", 7),
               "policy": ("--policy", "priority", "priority"), "mix": ("--mix", "prefill-first", "prefill-first"),
               "draft_tokens": ("--draft-tokens", "2", 2), "drafter": ("--drafter", "mtp", "mtp"),
               "prompt_lookup_scope": ("--prompt-lookup-scope", "request", "request"),
               "prompt_lookup_pool_tokens": ("--prompt-lookup-pool-tokens", "100", 100),
               "adaptive_drafting": ("--no-adaptive-drafting", None, False),
               "draft_gate": ("--no-draft-gate", None, False), "vision_budget": ("--vision-budget", "2", 2),
               "draft_cost": ("--draft-cost", "0.1,0.05,0,0.02", (0.1, 0.05, 0.0, 0.02)),
               "vision_token_budget": ("--vision-token-budget", "300", 300),
               "video_fps": ("--video-fps", "1.5", 1.5), "video_max_frames": ("--video-max-frames", "8", 8),
               "vision_cache_bytes": ("--vision-cache-mb", "3", 3 << 20),
               "max_images_per_request": ("--max-images-per-request", "4", 4),
               "max_videos_per_request": ("--max-videos-per-request", "2", 2),
               "max_audio_per_request": ("--max-audio-per-request", "3", 3),
               "remote_media": ("--no-remote-media", None, False),
               "media_fetch_timeout_s": ("--media-fetch-timeout-s", "2.5", 2.5),
               "media_fetch_max_bytes": ("--media-fetch-max-mb", "3", 3 << 20),
               "allowed_media_domains": ("--allowed-media-domains", "a.example", ("a.example",)),
               "max_kv_size": ("--max-kv-size", "128", 128), "kv_memory_bytes": ("--kv-memory-mb", "5", 5 << 20),
               "kv_headroom_tokens": ("--kv-headroom-tokens", "4", 4), "kv_bits": ("--kv-bits", "8", 8),
               "kv_group_size": ("--kv-group-size", "32", 32), "quantized_kv_start": ("--quantized-kv-start", "9", 9),
               "prefix_cache_bytes": ("--prefix-cache-mb", "2", 2 << 20),
               "prefix_block_size": ("--prefix-block-size", "8", 8), "trace_path": ("--trace", "t.jsonl", "t.jsonl")}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(changed) | set(ENGINE_FIELDS_WITHOUT_FLAGS) == fields
    assert not set(changed) & set(ENGINE_FIELDS_WITHOUT_FLAGS)
    for name, (flag, value, want) in changed.items():
        argv = ["serve", "--model", "m", flag] + ([value] if value is not None else [])
        config = _engine_config(parser.parse_args(argv))
        assert getattr(config, name) == want, name
        assert dataclasses.replace(config, **{name: getattr(EngineConfig(), name)}) == EngineConfig(), name


def test_make_lora_writes_an_adapter_the_engine_serves_per_request(tmp_path, text_model_dir, capsys):
    """`mlxsched make-lora MODEL DIR`: a seeded adapter in mlx_lm.lora's layout, which `Engine(loras=...)` serves and
    which changes the model's output exactly as mlx-lm loading it does; a model directory that is not there ends
    with exit 2 and one line."""
    import mlx_lm

    from scheduler import Engine, SamplingParams

    assert main(["make-lora", str(text_model_dir), str(tmp_path / "a"), "--seed", "3", "--rank", "2"]) == 0
    assert "rank-2" in capsys.readouterr().out
    prompt = [11, 12, 13, 14, 15, 16]
    adapted, tokenizer = mlx_lm.load(str(text_model_dir), adapter_path=str(tmp_path / "a"))
    want = [r.token for r in mlx_lm.stream_generate(adapted, tokenizer, prompt, max_tokens=6)]
    engine = Engine.from_pretrained(text_model_dir, loras={"a": tmp_path / "a"})
    (out, base) = engine.generate([prompt, prompt], SamplingParams(max_tokens=6), loras=["a", None])
    assert out.token_ids == want != base.token_ids
    assert main(["make-lora", str(tmp_path / "none"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such model directory" in err

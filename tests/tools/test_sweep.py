"""`mlxsched sweep`: the simulator over a grid in worker processes; the same results whatever the number of
workers; a table and a PNG of the trade-off."""

import pytest

from scheduler import Engine, EngineConfig, SamplingParams
from scheduler.cli import main
from scheduler.tools.sweep import parse_grid, sweep

from ..helpers import mixed_prompts


@pytest.fixture(scope="module")
def trace_path(text_model, tmp_path_factory):
    model, tokenizer = text_model
    path = tmp_path_factory.mktemp("sweep") / "run.jsonl"
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=64, max_seqs=4, prefill_chunk=32,
                                                   trace_path=str(path)))
    for i, p in enumerate(mixed_prompts(16, 4, 80, seed=9)):
        engine.add_request(prompt_tokens=p, sampling=SamplingParams(max_tokens=6 + i % 5), priority=i % 3)
    while engine.has_pending():
        engine.step()
    engine.close()
    return path


def test_the_grid_is_the_cross_product_and_workers_do_not_change_results(trace_path):
    grid = parse_grid(["max_seqs=2,4,8", "policy=fcfs,priority"])
    one = sweep(trace_path, grid, workers=1)
    two = sweep(trace_path, grid, workers=2)
    assert [p.settings for p in one.points] == [(("max_seqs", m), ("policy", pol))
                                                 for m in ("2", "4", "8") for pol in ("fcfs", "priority")]
    assert [p.metrics for p in one.points] == [p.metrics for p in two.points]
    by = {p.label: p.metrics for p in one.points}
    # more slots, less queueing: the 8-slot TTFT is below the 2-slot one
    assert by["max_seqs=8, policy=fcfs"]["ttft_p95_s"] < by["max_seqs=2, policy=fcfs"]["ttft_p95_s"]
    assert one.recorded_settings == {"max_seqs": 4, "policy": "fcfs"}


def test_sweep_cli_prints_the_table_and_writes_the_png(trace_path, tmp_path, capsys):
    out = tmp_path / "sweep.png"
    assert main(["sweep", str(trace_path), "--grid", "max_seqs=2,4", "policy=fcfs,priority", "--workers", "2",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recorded (max_seqs=4, policy=fcfs)" in text and "max_seqs=2, policy=priority" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["sweep", str(trace_path), "--grid", "max_seqs"]) == 2

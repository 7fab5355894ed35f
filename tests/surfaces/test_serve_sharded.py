"""`mlxsched serve --tensor-parallel`: a model sharded over two local ranks (MLX's ring backend over loopback)
behind the OpenAI-compatible server. Rank 0 serves and plans, the other rank follows its ticks; clients see one
server. Outputs are mlx-lm's for each request alone, an interrupt (a terminal's Ctrl-C reaches every rank) stops
both ranks cleanly, and a rank lost under the server ends it with SHARD_LOST_EXIT_CODE instead of a server that
answers 503 for ever.

The ranks are started by hand, as `mlx.launch -n 2 --backend ring` starts them (its environment: `MLX_RANK`,
`MLX_HOSTFILE`), so each rank's exit code and stderr are the test's to read, and one rank can die without a
launcher ending the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from scheduler.execution.stall_watchdog import SHARD_LOST_EXIT_CODE
from scheduler.tools.replay import load_trace, replay

from ..helpers import free_ports, solo_tokens

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 200, 31, 7, 64], [11, 12, 13, 14], [300, 17, 2, 90, 91, 92, 93, 94, 95], [42]]
MAX_TOKENS = 8


class ShardedServer:
    def __init__(self, ranks: list[subprocess.Popen], port: int, out: Path):
        self.ranks, self.port, self.out = ranks, port, out

    def log(self, rank: int) -> str:
        return (self.out / f"rank{rank}.log").read_text(errors="replace")[-6000:]

    def post(self, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self.ranks):
                if proc.poll() is not None:
                    pytest.fail(f"rank {rank} exited with {proc.returncode}:\n{self.log(rank)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            time.sleep(0.1)
        pytest.fail(f"the sharded server did not come up:\n{self.log(0)}\n{self.log(1)}")


@contextlib.contextmanager
def _sharded_server(model_dir: Path, out: Path, sharding: str = "--tensor-parallel") -> Iterator[ShardedServer]:
    """Both ranks of `mlxsched serve` sharded (`sharding`: its flag) on loopback; whatever still runs at the end
    is killed."""
    port, *ring = free_ports(3)
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MLX_HOSTFILE": str(hostfile)}
    cmd = [sys.executable, "-m", "scheduler.cli", "serve", sharding, "--model", str(model_dir), "--port", str(port),
           "--trace", str(out / "trace.jsonl"), "--graceful-shutdown-s", "1"]
    ranks = []
    for rank in range(2):
        with (out / f"rank{rank}.log").open("wb") as log:  # (a pipe nobody drains could fill and block a rank)
            ranks.append(subprocess.Popen(cmd, env={**env, "MLX_RANK": str(rank)}, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        yield ShardedServer(ranks, port, out)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _ask(server: ShardedServer, prompt: list[int]) -> tuple[int, dict]:
    return server.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "return_token_ids": True})


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["--tensor-parallel", "--pipeline-parallel"])
def test_a_sharded_server_answers_each_request_as_mlx_lm_alone_and_stops_on_an_interrupt(text_model_dir, tmp_path,
                                                                                          sharding):
    """Requests at once (batched across the shards, one of them streamed and dropped by its client half-way) get
    mlx-lm's greedy tokens for each alone, unsharded; on SIGINT to both ranks, rank 0 lets its clients finish,
    then tells the follower to stop: both exit 0 and rank 0's trace replays decision for decision. By tensor:
    the tiny qwen3, where sharded sums round to the same tokens (tests/execution/test_tensor_parallel.py says
    so of every schedule there); by pipeline: a tiny qwen2 (a family mlx-lm splits by layers), each layer
    computed whole on one rank."""
    from mlx_lm import load

    model_dir = text_model_dir
    if sharding == "--pipeline-parallel":
        from scheduler.fixtures.families import build_family_model

        model_dir = build_family_model("qwen2", tmp_path / "qwen2")
    model, tokenizer = load(str(model_dir))
    wants = [solo_tokens(model, tokenizer, p, MAX_TOKENS) for p in PROMPTS]
    with _sharded_server(model_dir, tmp_path, sharding) as server:
        server.wait_healthy()
        answers: dict[int, tuple[int, dict]] = {}
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _ask(server, PROMPTS[i])))
                   for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        dropped = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"prompt": [7, 8, 9], "max_tokens": 2000,
                                                          "stream": True}).encode())
        with urllib.request.urlopen(dropped, timeout=60) as stream:
            assert stream.readline().startswith(b"data: ")  # its first chunk: it runs, then the client goes
        for t in threads:
            t.join(120)
        for i, want in enumerate(wants):
            status, answer = answers[i]
            assert status == 200, answer
            assert answer["choices"][0]["token_ids"] == want, i
        for proc in server.ranks:  # a terminal's Ctrl-C reaches every rank it started
            proc.send_signal(signal.SIGINT)
        codes = [proc.wait(60) for proc in server.ranks]
    assert codes == [0, 0], (codes, server.log(0), server.log(1))
    assert "Traceback" not in server.log(1), server.log(1)
    report = replay(load_trace(tmp_path / "trace.jsonl"))
    assert report.identical, report.format()
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "transition" and e["to"] == "aborted" for e in events) == 1  # the dropped stream
    assert sum(e["event"] == "transition" and e["to"] == "finished" for e in events) == len(PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["a-request", "sigterm"])
def test_a_sharded_server_whose_follower_dies_stops_with_shard_lost(text_model_dir, tmp_path, then):
    """The follower is killed while the server is idle. `a-request`: the next request fails (503, the engine
    stopped) and rank 0 shuts its server down on its own, rather than answering 503 for ever; `sigterm`: rank 0
    is told to stop (what `mlx.launch` does to the other ranks once one has died) and cannot tell the lost
    follower to stop. Either way rank 0 exits with SHARD_LOST_EXIT_CODE, naming the lost peer, its trace
    flushed."""
    with _sharded_server(text_model_dir, tmp_path) as server:
        server.wait_healthy()
        status, answer = _ask(server, PROMPTS[0])
        assert status == 200, answer
        server.ranks[1].kill()
        server.ranks[1].wait()
        if then == "a-request":
            status, answer = _ask(server, PROMPTS[1])
            assert status == 503, answer
            assert "a peer rank is gone" in answer["error"]["message"]
        else:
            server.ranks[0].send_signal(signal.SIGTERM)
        code = server.ranks[0].wait(60)
    assert code == SHARD_LOST_EXIT_CODE, server.log(0)
    assert "mlxsched serve: rank 0: a peer rank is gone" in server.log(0)
    assert "Traceback" not in server.log(0), server.log(0)
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "transition" and e["to"] == "finished" for e in events) == 1


@pytest.mark.slow
def test_the_follower_of_a_lost_rank0_exits_with_shard_lost(text_model_dir, tmp_path):
    """Rank 0 (the server) is killed while idle: the follower, waiting for its next tick, is told by MLX's ring
    backend that its peer is gone, and exits with SHARD_LOST_EXIT_CODE naming it (not a traceback, not a hang)."""
    with _sharded_server(text_model_dir, tmp_path) as server:
        server.wait_healthy()
        server.ranks[0].kill()
        code = server.ranks[1].wait(60)
    assert code == SHARD_LOST_EXIT_CODE, server.log(1)
    assert "mlxsched serve (rank 1): rank 1: a peer rank is gone" in server.log(1)
    assert "Traceback" not in server.log(1), server.log(1)


def test_a_sharded_server_takes_no_lora_adapters(text_model_dir, capsys):
    """Refused on every rank alike, before any rank waits on another: a sharded model loads without adapters, and
    a runtime-loaded adapter would be on rank 0's shard only."""
    from scheduler.cli import main

    code = main(["serve", "--model", str(text_model_dir), "--tensor-parallel", "--allow-runtime-lora",
                 "--lora-modules", f"mine={text_model_dir}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("mlxsched serve: --tensor-parallel: a sharded model takes no LoRA "
                                               "adapters (--lora-modules, --allow-runtime-lora)")

"""Run the server: feed an Engine's events to the metrics, serve the app with uvicorn.

Shutdown (SIGINT / SIGTERM, handled by uvicorn): new connections stop, open responses get
`graceful_shutdown_s` to finish, then their tasks are cancelled (which aborts their engine requests); after
that the engine loop stops and the trace is flushed and closed, and the process exits with 0.

Rank 0 of a sharded model serves; the other ranks follow its ticks (`Engine.follow`, `mlxsched serve
--tensor-parallel`) and stop when its engine closes. Where a rank is lost, the model cannot answer again: the
server shuts down as above and exits with `SHARD_LOST_EXIT_CODE` (as a rank whose forward stalls does), so the
launcher can start the group anew, rather than answering 503 until someone notices.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from ..async_engine import AsyncEngine
from ..engine import Engine
from ..execution.distributed import ShardLost
from ..execution.stall_watchdog import SHARD_LOST_EXIT_CODE
from .app import DEFAULT_MAX_REQUEST_BYTES, ServerState, create_app
from .metrics import EngineMetrics
from .responses import ResponseStore


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_queue: int | None = None, graceful_shutdown_s: float = 5.0, log_level: str = "info",
          local_media_dir: Path | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          allow_runtime_lora: bool = False, responses_store: int = 0) -> int:
    """Serve `engine` (built on this thread, e.g. `Engine.from_pretrained`) as `model_name` until a signal.
    `local_media_dir`: the directory whose files clients may name as media (None: no file is read);
    `max_request_bytes`: a larger request body is answered 413; `allow_runtime_lora`: clients may load and
    unload LoRA adapters from this machine's directories (vLLM's /v1/load_lora_adapter); `responses_store`: how many
    Responses API responses are kept for previous_response_id (0: none). Returns the process's exit code: 0, or
    `SHARD_LOST_EXIT_CODE` when a sharded model lost a rank."""
    import uvicorn

    metrics = EngineMetrics()
    engine.events.add_sink(metrics)
    aengine = AsyncEngine(engine)
    state = ServerState(aengine, metrics, model_name, max_queue, local_media_dir, max_request_bytes,
                        allow_runtime_lora, ResponseStore(responses_store) if responses_store else None)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=graceful_shutdown_s, lifespan="off"))
    if engine.shard is not None:
        threading.Thread(target=_shut_down_when_a_rank_is_lost, args=(aengine, server), daemon=True,
                         name="mlxsched-shard-watch").start()
    # Once it has shut down, uvicorn raises the signal it handled again, with the handler that was there before
    # it ran: SIGINT's is Python's KeyboardInterrupt, SIGTERM's would end the process before the trace is
    # flushed. So SIGTERM gets a handler that raises too (signals can be handled on the main thread only).
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if on_main_thread else None
    try:
        server.run()
    except (KeyboardInterrupt, _Terminated):  # the re-raised signal: that is the end
        pass
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
        # requests still live (their responses were cancelled after the grace period) are aborted and freed
        # by the loop before it stops: nothing of theirs outlives it
        aengine.close(drain_s=graceful_shutdown_s)
        lost = aengine.error if isinstance(aengine.error, ShardLost) else None
        try:
            engine.close()
        except ShardLost as exc:  # a follower went while the server was idle: it cannot be told to stop
            lost = exc
        import mlx.core as mx

        mx.clear_streams()  # this thread loaded the model: its MLX streams go before the interpreter does
    if lost is not None:
        print(f"mlxsched serve: {lost}", file=sys.stderr)
        return SHARD_LOST_EXIT_CODE
    return 0


def _shut_down_when_a_rank_is_lost(aengine: AsyncEngine, server: object) -> None:
    """Once the engine loop has stopped: if a lost rank stopped it, shut the server down (as a signal would)."""
    aengine.wait_stopped()
    if isinstance(aengine.error, ShardLost):
        server.should_exit = True


class _Terminated(Exception):
    """SIGTERM arrived (raised by `_raise_terminated`, the server's SIGTERM handler)."""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise _Terminated()

"""One model across processes: rank 0 plans, every rank executes the same plan on its shard.

The `TickPlan` is the only contract with an executor and planning is deterministic, so tensor parallelism
needs no cluster layer of its own. Rank 0 owns the scheduler, the public API, the trace and the caches'
bookkeeping. Before each tick's work it broadcasts one `TickMessage` (the plan, plus what the other ranks
cannot know: new requests' data, the tokens rank 0 sampled last tick, released ids, prefix-cache entries added
and evicted) over MLX's own distributed layer; every rank then runs the same forward on its shard, so the
model's collectives line up. Followers hand their executor the plan with its new requests rebuilt from the
message (prompt, sampling, seed, outputs), and check that the tokens they sampled are the tokens rank 0
sampled: a difference is a loud `ShardDivergence`, never a silent wrong answer.

A lost peer makes MLX's ring backend raise within about a second; both sides turn that into `ShardLost`. A
forward that was under way when the peer died can instead block for good inside MLX; a `StallWatchdog`
(scheduler/execution/stall_watchdog.py) bounds every forward and ends such a rank with the same error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from scheduler import plan as plan_module
from scheduler.plan import NewRequest, TickPlan, TickResult
from scheduler.request import SamplingParams


class ShardLost(RuntimeError):
    """A rank went away (crashed, killed, or its link broke): the sharded engine cannot continue."""


class ShardDivergence(RuntimeError):
    """A follower computed different tokens from rank 0's (or received something that is not a tick message:
    the ranks' collectives are out of step): the shards no longer agree."""


# What MLX's backends say when a peer is gone. The executor contains a failing forward to the requests in it
# (TickResult.errors); a lost peer is not such a failure, and after one the backend's next collective can block
# forever, so both ranks check every result for it and stop at once.
_PEER_LOST_MARKERS = ("connection to a peer was lost", "Failing pending tasks")


def raise_if_peer_lost(result: TickResult, rank: int) -> None:
    for rid, error in result.errors.items():
        if any(marker in error for marker in _PEER_LOST_MARKERS):
            raise ShardLost(f"rank {rank}: a peer rank is gone (while computing {rid}: {error})")


def guarded_execute(executor: Any, plan: TickPlan, watchdog: Any, rank: int) -> TickResult:
    """One tick's forward on this rank's shard, under the watchdog when there is one."""
    with watchdog.guard(f"tick {plan.tick}'s forward") if watchdog is not None else contextlib.nullcontext():
        result = executor.execute(plan)
    raise_if_peer_lost(result, rank)
    return result


class MessageKind(str, enum.Enum):
    TICK = "tick"
    SHUTDOWN = "shutdown"


# ---- the wire --------------------------------------------------------------------------------------------
def encode_plan(value: Any) -> Any:
    """A plan (frozen dataclasses of tuples) as JSON-ready data, generic over its fields so a new plan field
    travels without a codec change."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"@": type(value).__name__, **{f.name: encode_plan(getattr(value, f.name))
                                              for f in dataclasses.fields(value)}}
    if isinstance(value, enum.Enum):
        return {"@enum": type(value).__name__, "value": value.value}
    if isinstance(value, (tuple, list)):
        return [encode_plan(v) for v in value]
    if isinstance(value, dict):
        return {k: encode_plan(v) for k, v in value.items()}
    return value


def decode_plan(data: Any) -> Any:
    """Inverse of `encode_plan`: lists become tuples (the plan's fields are tuples), classes come from
    `scheduler.plan`."""
    if isinstance(data, dict):
        if "@enum" in data:
            return getattr(plan_module, data["@enum"])(data["value"])
        if "@" in data:
            cls = getattr(plan_module, data["@"])
            return cls(**{k: decode_plan(v) for k, v in data.items() if k != "@"})
        return {k: decode_plan(v) for k, v in data.items()}
    if isinstance(data, list):
        return tuple(decode_plan(v) for v in data)
    return data


@dataclass
class RequestData:
    """What a follower needs of a request the plan admits (again, after a preemption)."""

    prompt_tokens: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_record()
    seed: int
    recompute_tokens: int
    output_tokens: list[int]


@dataclass
class TickMessage:
    kind: MessageKind
    plan: Any = None  # encode_plan(TickPlan)
    requests: dict[str, RequestData] = field(default_factory=dict)
    appended: dict[str, list[int]] = field(default_factory=dict)  # tokens rank 0 sampled last tick, per request
    released: list[str] = field(default_factory=list)
    # (entry id, request id that stored it, its tokens: a request may store a checkpoint and its prefill end in
    # one tick)
    prefix_added: list[tuple[int, str, int]] = field(default_factory=list)
    prefix_evicted: list[int] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        record = dataclasses.asdict(self)
        record["kind"] = self.kind.value
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TickMessage":
        """The message rank 0 broadcast. Anything else (bytes of another collective, which a follower receives
        when the ranks' collectives are out of step) raises ShardDivergence saying so, not a decoding error."""
        try:
            record = json.loads(data)
            return cls(kind=MessageKind(record["kind"]), plan=record["plan"],
                       requests={rid: RequestData(**r) for rid, r in record["requests"].items()},
                       appended=record["appended"], released=record["released"],
                       prefix_added=[tuple(a) for a in record["prefix_added"]],
                       prefix_evicted=record["prefix_evicted"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise ShardDivergence(f"a {len(data)}-byte broadcast is not a tick message ({type(exc).__name__}: "
                                  f"{exc}; it starts {bytes(data[:16])!r}): the ranks' collectives are out of step"
                                  ) from exc


class PlanChannel:
    """Rank 0 broadcasts bytes to every rank with two `all_sum`s (length, then payload; the other ranks add
    zeros), which every MLX backend provides."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = group.rank()
        self.bytes_sent = 0
        self.messages = 0
        self.seconds = 0.0

    def _all_sum(self, x: mx.array) -> mx.array:
        try:
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:  # the ring backend: "connection to a peer was lost"
            raise ShardLost(f"rank {self.rank}: a peer rank is gone ({exc})") from exc
        return out

    def broadcast(self, payload: bytes | None) -> bytes:
        t0 = time.perf_counter()
        n = len(payload) if self.rank == 0 else 0
        n = int(self._all_sum(mx.array([n], dtype=mx.int32)).item())
        buf = np.frombuffer(payload, dtype=np.uint8) if self.rank == 0 else np.zeros(n, dtype=np.uint8)
        data = bytes(np.array(self._all_sum(mx.array(buf)), copy=False))
        self.seconds += time.perf_counter() - t0
        self.bytes_sent += n
        self.messages += 1
        return data


# ---- rank 0 ------------------------------------------------------------------------------------------------
class PrefixEntryWatch:
    """An event sink on rank 0's log: which prefix entries were stored (by which request) and evicted since the
    last tick, so followers keep the same entries for their own shards."""

    def __init__(self) -> None:
        self.added: list[tuple[int, str, int]] = []
        self.evicted: list[int] = []

    def write(self, event: dict[str, Any]) -> None:
        if event["event"] == "prefix_store":
            self.added.append((event["entry_id"], event["request_id"], event["tokens"]))
        elif event["event"] == "prefix_evict":
            self.evicted.append(event["entry_id"])

    def take(self) -> tuple[list[tuple[int, str]], list[int]]:
        added, evicted, self.added, self.evicted = self.added, self.evicted, [], []
        return added, evicted

    def close(self) -> None:
        pass


class ShardedExecutor:
    """Rank 0's executor: sends each tick's message, then runs its own shard like any executor."""

    def __init__(self, inner: Any, channel: PlanChannel, prefix_watch: PrefixEntryWatch | None = None,
                 watchdog: Any = None):
        self.inner = inner
        self.channel = channel
        self.prefix_watch = prefix_watch
        self.watchdog = watchdog  # a StallWatchdog, or None
        self._produced: dict[str, list[int]] = {}  # tokens rank 0 sampled last tick (accepted drafts first)
        self._released: list[str] = []
        self.closed = False
        self.encode_seconds = 0.0  # building and serialising messages (the broadcast is `channel.seconds`)

    def __getattr__(self, name: str) -> Any:  # stats, cache_bytes, draft_stats, ... are the inner executor's
        return getattr(self.inner, name)

    def message_for(self, plan: TickPlan) -> TickMessage:
        # new requests travel as RequestData (sampling as its record: the wire carries no code)
        message = TickMessage(MessageKind.TICK, plan=encode_plan(dataclasses.replace(plan, new_requests=())),
                              released=self._released, appended=self._produced)
        self._released, self._produced = [], {}
        for new in plan.new_requests:
            message.requests[new.request_id] = RequestData(list(new.prompt_tokens), new.sampling.to_record(),
                                                           new.seed, new.recompute_tokens, list(new.output_tokens))
        if self.prefix_watch is not None:
            message.prefix_added, message.prefix_evicted = self.prefix_watch.take()
        return message

    def execute(self, plan: TickPlan) -> TickResult:
        t0 = time.perf_counter()
        payload = self.message_for(plan).to_bytes()
        self.encode_seconds += time.perf_counter() - t0
        try:
            self.channel.broadcast(payload)
            result = guarded_execute(self.inner, plan, self.watchdog, self.channel.rank)
        except ShardLost:
            # no shutdown message after this: a collective with a lost peer can block for good (see above)
            self.closed = True
            raise
        self._produced = {rid: [*result.accepted_drafts.get(rid, ()), token] for rid, token in result.sampled.items()}
        return result

    def release(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.inner.release(request_ids)
        for rid in request_ids:
            self._produced.pop(rid, None)
        self._released.extend(request_ids)  # the followers release them before the next tick's work

    def shutdown(self) -> None:
        """Tell the followers to stop (their `follow()` returns). Idempotent; nothing once a peer was lost."""
        if not self.closed:
            self.closed = True
            self.channel.broadcast(TickMessage(MessageKind.SHUTDOWN).to_bytes())


# ---- the other ranks ---------------------------------------------------------------------------------------
class MirroredPayloads:
    """A follower's prefix-cache payloads: its own shard's arrays under rank 0's entry ids."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.entries: dict[int, Any] = {}

    def payload(self, entry_id: int) -> Any:
        return self.entries[entry_id]


@dataclass
class FollowerStats:
    ticks: int = 0
    message_bytes: int = 0


class Follower:
    """Runs on every rank but 0: receive a message, mirror, execute, repeat until rank 0 shuts down."""

    def __init__(self, executor: Any, channel: PlanChannel, payloads: MirroredPayloads | None,
                 watchdog: Any = None):
        self.executor = executor
        self.channel = channel
        self.payloads = payloads
        self.watchdog = watchdog  # a StallWatchdog, or None
        self.stats = FollowerStats()
        self._produced: dict[str, list[int]] = {}  # tokens this rank emitted last tick, per request
        self._pending_stores: dict[tuple[str, int], Any] = {}

    def run(self) -> FollowerStats:
        while True:
            data = self.channel.broadcast(None)
            message = TickMessage.from_bytes(data)
            if message.kind is MessageKind.SHUTDOWN:
                return self.stats
            self.stats.ticks += 1
            self.stats.message_bytes += len(data)
            self.handle(message)

    def handle(self, message: TickMessage) -> TickResult:
        if message.released:
            self.executor.release(message.released)
            for rid in message.released:
                self._produced.pop(rid, None)
        if self.payloads is not None:
            for entry_id, rid, tokens in message.prefix_added:
                self.payloads.entries[entry_id] = self._pending_stores[(rid, tokens)]
            for entry_id in message.prefix_evicted:
                self.payloads.entries.pop(entry_id, None)
        self._pending_stores = {}
        for rid, tokens in message.appended.items():
            self._check_agrees(rid, tokens)
        new = tuple(NewRequest(rid, tuple(data.prompt_tokens), SamplingParams.from_record(data.sampling), data.seed,
                               tuple(data.output_tokens), data.recompute_tokens)
                    for rid, data in message.requests.items())
        for rid in message.requests:
            self._produced.pop(rid, None)
        result = guarded_execute(self.executor, dataclasses.replace(decode_plan(message.plan), new_requests=new),
                                 self.watchdog, self.channel.rank)
        self._pending_stores = {(s.request_id, s.num_tokens): s.payload for s in result.prefix_stores}
        self._produced = {rid: result.accepted_drafts.get(rid, []) + [token] for rid, token in result.sampled.items()}
        return result

    def _check_agrees(self, rid: str, appended: list[int]) -> None:
        produced = self._produced.get(rid)
        # rank 0 sends what its shard produced last tick: the same forward on every shard samples the same tokens
        if produced is not None and produced != appended:
            raise ShardDivergence(f"request {rid}: rank {self.channel.rank} sampled {produced}, rank 0 sampled "
                                  f"{appended}: the shards disagree")

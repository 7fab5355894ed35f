"""The request lifecycle, declared once.

`TRANSITIONS` is the single source of truth: the `transitions` state machine is built from it, the tests
enumerate it, and `mermaid()` draws it for ARCHITECTURE.md. Nothing else in the project moves a request's
state: every move goes through `Lifecycle.fire`, which raises `IllegalTransition` for an undeclared move or a
refused guard instead of flipping a flag.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable

from transitions import Machine, MachineError


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    VISION_ENCODING = "vision_encoding"
    CHUNK_PREFILLING = "chunk_prefilling"
    DECODING = "decoding"
    DRAFTING = "drafting"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RequestState.FINISHED, RequestState.ABORTED})
LIVE_STATES = tuple(s for s in RequestState if s not in TERMINAL_STATES)


class Trigger(str, enum.Enum):
    START_VISION = "start_vision"
    START_PREFILL = "start_prefill"
    START_DECODE = "start_decode"
    START_DRAFT = "start_draft"
    END_DRAFT = "end_draft"
    PREEMPT = "preempt"
    FINISH = "finish"
    ABORT = "abort"
    FAIL = "fail"


@dataclass(frozen=True)
class TransitionSpec:
    """One declared move. `guard` names a zero-argument predicate on the request object (or None)."""

    trigger: Trigger
    sources: tuple[RequestState, ...]
    dest: RequestState
    guard: str | None
    meaning: str


_S = RequestState
TRANSITIONS: tuple[TransitionSpec, ...] = (
    TransitionSpec(Trigger.START_VISION, (_S.QUEUED,), _S.VISION_ENCODING, "has_media",
                   "admitted; its media must be encoded before prefill"),
    TransitionSpec(Trigger.START_PREFILL, (_S.QUEUED, _S.VISION_ENCODING), _S.CHUNK_PREFILLING, "media_ready",
                   "admitted (text) or media encoded; prompt tokens are fed in chunks"),
    TransitionSpec(Trigger.START_DECODE, (_S.CHUNK_PREFILLING,), _S.DECODING, "prefill_complete",
                   "every prompt token is in the KV cache and the first token was sampled"),
    TransitionSpec(Trigger.START_DRAFT, (_S.DECODING,), _S.DRAFTING, None,
                   "the policy lets this row propose draft tokens"),
    TransitionSpec(Trigger.END_DRAFT, (_S.DRAFTING,), _S.DECODING, None,
                   "draft verified; back to plain decoding"),
    TransitionSpec(Trigger.PREEMPT, (_S.VISION_ENCODING, _S.CHUNK_PREFILLING, _S.DECODING, _S.DRAFTING),
                   _S.QUEUED, None,
                   "memory pressure: caches dropped, recomputed when readmitted"),
    TransitionSpec(Trigger.FINISH, (_S.DECODING, _S.DRAFTING), _S.FINISHED, "has_finish_reason",
                   "stop token or max_tokens reached"),
    TransitionSpec(Trigger.ABORT, LIVE_STATES, _S.ABORTED, None,
                   "the caller aborted it"),
    TransitionSpec(Trigger.FAIL, LIVE_STATES, _S.ABORTED, "has_error",
                   "its own input or work failed; other requests continue"),
)


class IllegalTransition(RuntimeError):
    """A move the table does not declare, or whose guard refused. Never a silent no-op."""

    def __init__(self, request_id: str, state: RequestState, trigger: Trigger, detail: str):
        self.request_id = request_id
        self.state = state
        self.trigger = trigger
        self.detail = detail
        super().__init__(
            f"request {request_id!r}: cannot {trigger.value} from {state.value} ({detail})"
        )


def allowed_triggers(state: RequestState) -> frozenset[Trigger]:
    return frozenset(t.trigger for t in TRANSITIONS if state in t.sources)


def destination(state: RequestState, trigger: Trigger) -> RequestState | None:
    for t in TRANSITIONS:
        if t.trigger is trigger and state in t.sources:
            return t.dest
    return None


class Lifecycle:
    """One shared `transitions.Machine` driving many request objects.

    A request object needs a `request_id`, a `state` attribute (a `RequestState`, owned by this machine) and
    the guard predicates the table names. `auto_transitions=False` so only declared triggers exist.

    Requests are not registered with the machine (`add_model` binds a method per trigger and per state onto
    every request, ~55 us each, and keeps a list of all of them); `fire` dispatches through the machine's own
    event objects instead, so guards, the declared sources and `MachineError` behave exactly the same at a
    fraction of the cost.
    """

    def __init__(self, table: Iterable[TransitionSpec] = TRANSITIONS):
        self.table = tuple(table)
        self._machine = Machine(
            model=None,
            states=RequestState,
            transitions=[
                {
                    "trigger": t.trigger.value,
                    "source": list(t.sources),
                    "dest": t.dest,
                    **({"conditions": t.guard} if t.guard else {}),
                }
                for t in self.table
            ],
            initial=RequestState.QUEUED,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            model_attribute="state",
        )
        self._events = {trigger: self._machine.events[trigger.value] for trigger in Trigger
                        if trigger.value in self._machine.events}

    def attach(self, request: Any) -> None:
        """A new request starts in the machine's initial state."""
        request.state = RequestState.QUEUED

    def fire(self, request: Any, trigger: Trigger) -> tuple[RequestState, RequestState]:
        """Move `request` by `trigger`; return (source, destination) or raise IllegalTransition."""
        source = request.state
        event = self._events.get(trigger)
        if event is None:
            raise IllegalTransition(request.request_id, source, trigger, "not declared")
        try:
            moved = event.trigger(request)
        except MachineError as exc:
            raise IllegalTransition(request.request_id, source, trigger, "not declared") from exc
        if not moved:
            guard = next(
                (t.guard for t in self.table if t.trigger is trigger and source in t.sources), None
            )
            raise IllegalTransition(request.request_id, source, trigger, f"guard {guard} refused")
        return source, request.state


def mermaid(table: Iterable[TransitionSpec] = TRANSITIONS) -> str:
    """A Mermaid state diagram generated from the table (ARCHITECTURE.md embeds this output)."""
    lines = ["stateDiagram-v2", f"    [*] --> {RequestState.QUEUED.value}"]
    for t in table:
        label = t.trigger.value + (f" [{t.guard}]" if t.guard else "")
        for s in t.sources:
            lines.append(f"    {s.value} --> {t.dest.value}: {label}")
    for s in sorted(TERMINAL_STATES, key=lambda s: s.value):
        lines.append(f"    {s.value} --> [*]")
    return "\n".join(lines)

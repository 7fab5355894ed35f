"""`mlxsched explain`: one request's life from a trace, in plain words and a small table.

Built from the events alone (no model, no MLX): the arrival, every transition (with its wall time), the
binding constraints the planner recorded while the request got less than it could use, waiting to run or
as a running row paused or drafting less (`reasons` /
`reasons_cleared` of each plan event: recorded when they change, so a reason holds from the tick it appears
until it changes, is cleared, or the request ends), prefix-cache hits, vision-cache hits, preemptions, drafts
and how it ended. A tick's time span is its outcome's `tick_start_t`..`t`; a wait's duration runs from the
start of its first tick to the start of the tick after its last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from scheduler.calibration import CALIBRATION_EVENT
from scheduler.plan import Reason
from scheduler.tools.replay import TraceError, parse_events


@dataclass(frozen=True)
class StateSpan:
    state: str
    start_s: float  # seconds after the request's arrival
    seconds: float | None  # None: still in it when the trace ends (or a terminal state)


@dataclass(frozen=True)
class Wait:
    reason: Reason
    others: tuple[str, ...]  # POLICY_ORDER: requests ahead of it; PREEMPTED_BY: the one it made room for
    first_tick: int
    last_tick: int
    seconds: float | None  # None when the ticks are untimed

    @property
    def ticks(self) -> int:
        return self.last_tick - self.first_tick + 1


@dataclass
class RequestStory:
    request_id: str
    arrival_tick: int
    arrival_s: float  # seconds after engine start
    prompt_tokens: int
    num_images: int
    states: list[StateSpan] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    prefix_hits: list[tuple[int, int]] = field(default_factory=list)  # (tick, tokens restored)
    vision_cache_hits: int = 0
    vision_encodes: int = 0
    shared_prefill: list[int] = field(default_factory=list)  # rows of each shared prefill forward it was in
    items_encoded: int | None = None  # media items its encodings put through the encoders (None: not recorded)
    preemptions: list[tuple[int, str | None]] = field(default_factory=list)  # (tick, made room for)
    drafted: int = 0
    draft_accepted: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    end: str | None = None  # trigger that ended it: finish, abort, fail (None: live at the end of the trace)
    end_reason: str | None = None  # stop / length / the error text / ...
    end_s: float | None = None  # seconds after arrival
    prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs (None: not asked)
    lora: str | None = None  # the LoRA adapter it ran on (None: the base model)
    salted: bool = False  # it had a cache salt: its prefix hits were among requests with the same salt

    @property
    def prefix_tokens_saved(self) -> int:
        return sum(n for _, n in self.prefix_hits)


def _events_of(source: "str | os.PathLike | Iterable[dict]") -> list[dict[str, Any]]:
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as f:
                return parse_events(f, os.fspath(source))
        except OSError as exc:
            raise TraceError(f"cannot read trace {os.fspath(source)}: {exc}") from None
    return list(source)


class _StoryBuilder:
    """Reads a trace's events in order into one RequestStory per request: a handler per event kind."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.stories: dict[str, RequestStory] = {}
        self.tick_start: dict[int, float] = {}
        self.tick_end: dict[int, float] = {}
        self.open_waits: dict[str, tuple[Reason, tuple[str, ...], int]] = {}  # id -> (reason, others, first tick)
        self.closed: dict[str, list[tuple[Reason, tuple[str, ...], int, int]]] = {}
        self.entered: dict[str, tuple[str, float]] = {}  # id -> (state, when it was entered)
        self.last_plan_tick = -1
        self.calibration: set[str] = set()  # Engine.calibrate()'s synthetic requests
        self._handlers = {"arrival": self._on_arrival, CALIBRATION_EVENT: self._on_calibration,
                          "plan": self._on_plan, "outcome": self._on_outcome, "prefix_hit": self._on_prefix_hit,
                          "prefill_forward": self._on_prefill_forward,
                          "transition": self._on_transition}

    def read(self, event: dict[str, Any]) -> None:
        handler = self._handlers.get(event["event"])
        if handler is not None:
            handler(event, event["tick"], event.get("measure", {}))

    def _close(self, rid: str, last_tick: int) -> None:
        if rid in self.open_waits:
            reason, others, first = self.open_waits.pop(rid)
            self.closed.setdefault(rid, []).append((reason, others, first, last_tick))

    def _on_arrival(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        rid, t = e["request_id"], float(measure.get("t", self.t0))
        self.stories[rid] = RequestStory(rid, tick, t - self.t0, len(e["prompt_tokens"]), e.get("num_images", 0),
                                         prompt_logprobs=e.get("sampling", {}).get("prompt_logprobs"),
                                         lora=e.get("lora"), salted=e.get("cache_salt") is not None)
        self.entered[rid] = ("queued", t)

    def _on_calibration(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        self.calibration.update(e["request_ids"])

    def _on_plan(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        self.last_plan_tick = tick
        for rid in e.get("reasons_cleared", []):
            self._close(rid, tick - 1)
        for rid, reason, others in e.get("reasons", []):
            self._close(rid, tick - 1)
            self.open_waits[rid] = (Reason(reason), tuple(others), tick)
            if reason == Reason.PREEMPTED_BY.value and rid in self.stories:
                self.stories[rid].preemptions.append((tick, others[0] if others else None))

    def _on_outcome(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        if "tick_start_t" in measure:
            self.tick_start[tick] = float(measure["tick_start_t"])
        if "t" in measure:
            self.tick_end[tick] = float(measure["t"])
        for rid in e.get("sampled", {}):
            story = self.stories.get(rid)
            if story is None or rid in e.get("errors", {}):
                continue
            story.output_tokens += 1 + len(e.get("accepted_drafts", {}).get(rid, []))
            if story.ttft_s is None and "t" in measure:
                story.ttft_s = float(measure["t"]) - self.t0 - story.arrival_s
        for rid, (proposed, accepted) in e.get("drafts", {}).items():
            if rid in self.stories:
                self.stories[rid].drafted += proposed
                self.stories[rid].draft_accepted += accepted
        for rid, info in e.get("encoded", {}).items():
            if rid in self.stories:
                story = self.stories[rid]
                story.vision_encodes += 1
                story.vision_cache_hits += bool(info.get("vision_cache_hit"))
                if "items_encoded" in info:
                    story.items_encoded = (story.items_encoded or 0) + int(info["items_encoded"])

    def _on_prefill_forward(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        rows = e.get("request_ids", [])
        for rid in rows:
            if rid in self.stories:
                self.stories[rid].shared_prefill.append(len(rows))

    def _on_prefix_hit(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        if e.get("request_id") in self.stories:
            self.stories[e["request_id"]].prefix_hits.append((tick, int(e.get("length", 0))))

    def _on_transition(self, e: dict[str, Any], tick: int, measure: dict[str, Any]) -> None:
        t = float(measure.get("t", self.t0))
        for rid in e.get("request_ids") or [e.get("request_id")]:
            story = self.stories.get(rid)
            if story is None:
                continue
            state, since = self.entered[rid]
            arrival = self.t0 + story.arrival_s
            story.states.append(StateSpan(state, since - arrival, t - since))
            self.entered[rid] = (e["to"], t)
            if e.get("trigger") in ("finish", "abort", "fail"):
                story.end, story.end_reason, story.end_s = e["trigger"], e.get("reason"), t - arrival
                # an abort lands before the tick's plan; a finish or failure in its apply
                self._close(rid, tick - 1 if e["trigger"] == "abort" else tick)

    def finish(self) -> dict[str, RequestStory]:
        """Closes what is still open at the end of the trace and times the waits; returns the stories."""
        for rid, (state, since) in self.entered.items():
            story = self.stories[rid]
            if story.end is None:
                story.states.append(StateSpan(state, since - self.t0 - story.arrival_s, None))
        for rid in list(self.open_waits):
            self._close(rid, self.last_plan_tick)
        for rid, waits in self.closed.items():
            if rid in self.stories:
                self.stories[rid].waits = [Wait(r, o, a, b, self._span(a, b)) for r, o, a, b in waits if b >= a]
        return self.stories

    def _span(self, first: int, last: int) -> float | None:
        start, stop = self.tick_start.get(first), self.tick_start.get(last + 1, self.tick_end.get(last))
        return None if start is None or stop is None else stop - start


def explain(source: "str | os.PathLike | Iterable[dict]", request_ids: Sequence[str] | None = None,
            slowest: int | None = None) -> list[RequestStory]:
    """Stories of `request_ids` (default: every request but the synthetic ones of `Engine.calibrate()`), or of
    the `slowest` requests by TTFT (worst first; a request that never got a token counts as slowest)."""
    events = _events_of(source)
    if not events or events[0]["event"] != "engine_start":
        raise TraceError("trace does not start with an engine_start event")
    builder = _StoryBuilder(float(events[0].get("measure", {}).get("t", 0.0)))
    for event in events[1:]:
        builder.read(event)
    stories = builder.finish()
    chosen = [story for rid, story in stories.items() if rid not in builder.calibration]
    if request_ids:
        unknown = [rid for rid in request_ids if rid not in stories]
        if unknown:
            raise KeyError(f"not in the trace: {', '.join(unknown)}")
        chosen = [stories[rid] for rid in request_ids]
    if slowest is not None:
        chosen.sort(key=lambda s: -(s.ttft_s if s.ttft_s is not None else float("inf")))
        chosen = chosen[:slowest]
    return chosen


_PLAIN = {
    Reason.MAX_SEQS: "every slot was taken (max_seqs)",
    Reason.TOKEN_BUDGET: "the tick's token budget was used up (max_batched_tokens)",
    Reason.PREFILL_CHUNK: "its prefill was cut into chunks (prefill_chunk)",
    Reason.PREFILL_TOKEN_CAP: "the prefill share of the tick was used up (max_prefill_tokens)",
    Reason.KV_BUDGET: "its KV memory did not fit (kv_memory_bytes)",
    Reason.VISION_BUDGET: "the tick's media encoding was taken (vision_budget items or vision_token_budget tokens)",
    Reason.POLICY_ORDER: "the policy put a blocked request ahead of it",
    Reason.WAITING_FOR_MEDIA: "its media was being encoded",
    Reason.PREEMPTED_BY: "it was preempted to make room",
    Reason.PREFILL_FIRST: "prefill went first (mix=prefill-first)",
    Reason.DRAFT_BUDGET: "the token budget left paid for fewer draft tokens (draft_tokens)",
    Reason.DRAFT_INELIGIBLE: ("it does not draft (logprobs, logits processors, a logit bias, a structured output, a "
                              "custom sampler, penalties or allow_drafts off)"),
    Reason.DRAFT_MIN_TOKENS: "it does not draft until it has min_tokens tokens",
}
# what a running row's reason held back: its decode, or its drafts (every other reason holds back a wait)
_HELD = {Reason.PREFILL_FIRST: "Paused", Reason.DRAFT_BUDGET: "Drafted less", Reason.DRAFT_INELIGIBLE: "No drafts",
         Reason.DRAFT_MIN_TOKENS: "No drafts"}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def format_story(story: RequestStory) -> str:
    media = f", {story.num_images} media item(s)" if story.num_images else ""
    lora = f", on LoRA adapter {story.lora!r}" if story.lora is not None else ""
    salt = ", with a cache salt" if story.salted else ""
    lines = [f"{story.request_id}: arrived at {story.arrival_s * 1e3:.1f} ms (tick {story.arrival_tick}), "
             f"{story.prompt_tokens} prompt tokens{media}{lora}{salt}."]
    if story.ttft_s is not None:
        lines.append(f"First token after {_ms(story.ttft_s)}; {story.output_tokens} tokens in all.")
    for wait in story.waits:
        who = f" ({', '.join(wait.others)})" if wait.others else ""
        lines.append(f"{_HELD.get(wait.reason, 'Waited')} {_ms(wait.seconds)} over {wait.ticks} tick(s) from tick "
                     f"{wait.first_tick}: "
                     f"{_PLAIN[wait.reason]} [{wait.reason.value}{who}].")
    if story.prefix_hits:
        lines.append(f"Prefix cache: {len(story.prefix_hits)} hit(s), {story.prefix_tokens_saved} prompt tokens "
                     "not recomputed.")
    if story.shared_prefill:
        lines.append(f"Prefill: {len(story.shared_prefill)} chunk(s) fed in forwards shared with other requests "
                     f"(up to {max(story.shared_prefill)} rows).")
    if story.prompt_logprobs is not None:
        lines.append(f"Prompt logprobs asked ({story.prompt_logprobs} alternatives a position): every prompt "
                     "token computed, the prefix cache not looked up.")
    if story.vision_encodes:
        items = ("" if story.items_encoded is None else
                 f"; {story.items_encoded} media item(s) through the encoders, of the {story.num_images} it has")
        lines.append(f"Vision cache: {story.vision_cache_hits} of {story.vision_encodes} encoding(s) hit{items}.")
    for tick, by in story.preemptions:
        lines.append(f"Preempted at tick {tick}" + (f" to make room for {by}." if by else "."))
    if story.drafted:
        lines.append(f"Drafts: {story.draft_accepted} of {story.drafted} accepted.")
    if story.end is None:
        lines.append("Still live when the trace ends.")
    else:
        lines.append(f"Ended by {story.end} ({story.end_reason}) at {_ms(story.end_s)}.")
    lines += ["", "| state | from | for |", "| --- | ---: | ---: |"]
    lines += [f"| {s.state} | {_ms(s.start_s)} | {_ms(s.seconds)} |" for s in story.states]
    if story.waits:
        lines += ["", "| wait reason | ahead / by | first tick | ticks | for |", "| --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {w.reason.value} | {', '.join(w.others) or '-'} | {w.first_tick} | {w.ticks} | {_ms(w.seconds)} |"
                  for w in story.waits]
    return "\n".join(lines)

"""The per-tick cost model: tick features, a non-negative least-squares fit on a recorded trace."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from scheduler.plan import TickPlan
from scheduler.tools.replay import Trace, TraceError
from scheduler.tools.simulation.recorded import load_recorded
from scheduler.tools.workload import samples_tokens


#: Per-tick features (see `tick_features`). The executor feeds a completing chunk's last prompt token in the
#: batched decode forward, so "prefill tokens" excludes it and "decode rows" includes it; a completing chunk
#: also merges that request's cache into the batch cache (`per_prefill_done`).
#: Vision-language work: `per_image_encoded` is each media item encoded this tick that missed the vision
#: cache (its encoder forward), `per_vision_token` each media token of those items (the encoder's cost grows
#: with the image's size: its patches), `per_media_prefill_token` the extra cost of a prefill token of a
#: media request (embedding inputs, M-RoPE positions) over a text one. `per_context_token`: each token of
#: context a decode row attends over (its prompt and the tokens it produced), summed over the rows.
#: `per_sampling_forward`: a decode forward with at least one row that samples (temperature or penalties:
#: the sampler's softmax and draws over the vocabulary, which greedy rows skip); `per_sampling_row` each such row
#: (measured on the tiny text model, 4 rows: greedy 1.55 ms a decode, every row sampling 1.94-2.12 ms, two of
#: four 1.90-1.98 ms).
#: `per_join_padded_token`: a tick whose prefills complete merges their caches into the batch, and the merge
#: copies every row at the longest row's length (the batch is left-padded): its cost grows with rows x the
#: longest context (measured on a 12-slot Poisson recording of the tiny text model: a decode phase with a merge
#: took 3.9 ms at 12 rows against 2.4 ms without, 2.5 against 1.7 ms at 4 rows; fitted without this term, the
#: merges' time went into every decode forward and a 4-slot what-if was predicted 13-15% slow).
FEATURES = ("base", "per_prefill_token", "per_decode_row", "per_prefill_chunk", "per_decode_forward",
            "per_prefill_done", "per_image_encoded", "per_media_prefill_token", "per_vision_token",
            "per_context_token", "per_sampling_forward", "per_sampling_row", "per_join_padded_token")

#: The phases of a tick the engine times (`outcome.measure`), each with the features that cost time in it: a
#: trace that has a phase's time fits those features on it alone (a phase that is rare, such as encoding,
#: is not drowned by the many decode-only ticks); the rest of the tick (`tick_s` less the timed phases:
#: planning, bookkeeping, and any phase the trace does not time) is fitted on `base` and the features of the
#: untimed phases.
PHASES = (("vision_s", ("per_image_encoded", "per_vision_token")),
          ("prefill_s", ("per_prefill_token", "per_prefill_chunk", "per_media_prefill_token")),
          ("decode_s", ("per_decode_row", "per_decode_forward", "per_prefill_done", "per_context_token",
                        "per_sampling_forward", "per_sampling_row", "per_join_padded_token")))

#: The rest of a tick (planning, `apply`, events, prefix-cache bookkeeping) is not one constant: it grows
#: with the rows and chunks the tick schedules (measured on a 12-slot recording: ~0.1 ms for one row, ~0.25
#: ms for 12, ~0.5-0.7 ms with prefill chunks). It is fitted on these features as well as on the features of
#: any phase the trace does not time; a feature fitted in two places gets the sum of both terms (the model
#: is additive: which phase a term was measured in does not matter to a prediction).
REST_FEATURES = ("base", "per_decode_row", "per_prefill_chunk", "per_prefill_done")


@dataclass
class CostModel:
    """Seconds per tick = (base + per_prefill_token * prefill tokens + per_decode_row * decode rows
    + per_prefill_chunk * chunks + per_decode_forward * [any decode row] + per_prefill_done * completed
    prefills + per_image_encoded * images encoded + per_vision_token * their media tokens
    + per_media_prefill_token * prefill tokens of media requests + per_context_token * decode rows' context
    + per_sampling_forward * [any sampling row] + per_sampling_row * sampling rows
    + per_join_padded_token * [a merge] * rows x longest context) * slowdown + overhead (see FEATURES).

    `slowdown` scales the terms so that they also account for the time the fit's outlier ticks took (pauses,
    contention; see `fit_cost_model`). `overhead` is the engine/client time between two busy ticks (outside
    `tick_s`), added to every simulated tick; `per_arrival` (each arrival) + `per_media_arrival` (each of its
    media items) the loop's time to take an arrival in, added when one comes in while requests are served.
    `r2`, `mean_rel_error` (the model as used, slowdown included), `typical_rel_error` (median over ticks of the
    terms alone: how well the shape fits), `n_ticks` and `dropped` describe the fit (None when not fitted).
    """

    base: float = 0.0
    per_prefill_token: float = 0.0
    per_decode_row: float = 0.0
    per_prefill_chunk: float = 0.0
    per_decode_forward: float = 0.0
    per_prefill_done: float = 0.0
    per_image_encoded: float = 0.0
    per_media_prefill_token: float = 0.0
    per_vision_token: float = 0.0
    per_context_token: float = 0.0
    per_sampling_forward: float = 0.0
    per_sampling_row: float = 0.0
    per_join_padded_token: float = 0.0
    slowdown: float = 1.0
    overhead: float = 0.0
    # time the loop spends taking in an arrival between two ticks, which delays the next tick: per arrival
    # (tokenizing) and per media item it carries (the processor's preprocessing and the content keys, which grow
    # with its images: a chat turn that resends three images takes about three times one's), fitted on the gaps
    # before the ticks that drained arrivals. Zero where the arrivals come in on another thread (a server) and
    # the gaps show none.
    per_arrival: float = 0.0
    per_media_arrival: float = 0.0
    r2: float | None = None
    mean_rel_error: float | None = None
    typical_rel_error: float | None = None
    n_ticks: int = 0
    dropped: int = 0  # outlier ticks left out of the final fit (e.g. the first tick's warm-up)
    # decode rows of the fitted ticks that decode (10th..90th percentile, widened to the whole range of the
    # calibration ticks when the trace has them): what the per-row term was fitted over; a recording that
    # decoded at one batch size cannot split a decode forward's cost into per-tick and per-row parts, and a
    # what-if at another batch size then extrapolates an arbitrary split
    decode_rows_seen: tuple[int, int] | None = None
    # the prompt token ids that stand for media (the trace's `engine_start.media_token_ids`): what
    # `per_vision_token` counts in a prompt
    media_token_ids: frozenset[int] = frozenset()
    phases: tuple[str, ...] = ()  # the timed phases the fit used (PHASES' measure keys)

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in FEATURES)

    def tick_seconds(self, prefill_tokens: int, decode_rows: int, num_chunks: int, completed: int = 0,
                     images_encoded: int = 0, media_prefill_tokens: int = 0, vision_tokens: int = 0,
                     context_tokens: int = 0, sampling_forward: float = 0.0, sampling_rows: int = 0,
                     join_padded_tokens: int = 0) -> float:
        """Predicted wall time of one tick (including `overhead`); `sampling_forward`: whether a decode row
        samples (1.0 or 0.0, as the feature), `sampling_rows`: how many; `join_padded_tokens`: what a merge
        copies (`context_features`)."""
        return (self.base + self.per_prefill_token * prefill_tokens + self.per_decode_row * decode_rows
                + self.per_prefill_chunk * num_chunks + (self.per_decode_forward if decode_rows else 0.0)
                + self.per_prefill_done * completed + self.per_image_encoded * images_encoded
                + self.per_media_prefill_token * media_prefill_tokens + self.per_vision_token * vision_tokens
                + self.per_context_token * context_tokens
                + (self.per_sampling_forward if sampling_forward else 0.0) + self.per_sampling_row * sampling_rows
                + self.per_join_padded_token * join_padded_tokens) * self.slowdown + self.overhead

    def arrival_seconds(self, media_items: int) -> float:
        """Loop time taken by one arrival (with `media_items` images, videos, clips) that comes in while requests
        are being served."""
        return self.per_arrival + self.per_media_arrival * media_items

    def plan_seconds(self, plan: TickPlan, images_encoded: int = 0,
                     media: "Callable[[str], bool]" = lambda _rid: False, vision_tokens: int = 0,
                     context_tokens: int = 0, samples: "Callable[[str], bool]" = lambda _rid: False,
                     join_padded_tokens: int = 0) -> float:
        """A plan's predicted time; `images_encoded`: media items it encodes that miss the vision cache,
        `vision_tokens` their media tokens; `media(request_id)`: whether a request carries media (its prefill
        tokens cost the media term too); `context_tokens`, `join_padded_tokens`: its decode rows' context
        (`context_features`); `samples(request_id)`: whether a request samples (`samples_tokens` of its
        sampling)."""
        row = tick_features([[c.request_id, c.start, c.end, c.completes] for c in plan.prefill], plan.decode,
                            plan.num_batched_tokens, images_encoded, media, vision_tokens, context_tokens, samples,
                            join_padded_tokens)
        return self.tick_seconds(*row[1:4], *row[5:])

    def describe(self) -> str:
        parts = [f"{self.base * 1e3:.3g} ms/tick", f"{self.per_prefill_token * 1e6:.3g} us/prefill token",
                 f"{self.per_decode_row * 1e6:.3g} us/decode row", f"{self.per_prefill_chunk * 1e6:.3g} us/chunk",
                 f"{self.per_decode_forward * 1e3:.3g} ms/decode forward",
                 f"{self.per_prefill_done * 1e6:.3g} us/completed prefill",
                 f"{self.per_image_encoded * 1e3:.3g} ms/image encoded",
                 f"{self.per_media_prefill_token * 1e6:.3g} us/media prefill token",
                 f"{self.per_vision_token * 1e6:.3g} us/vision token encoded",
                 f"{self.per_context_token * 1e9:.3g} ns/context token of a decode row",
                 f"{self.per_sampling_forward * 1e3:.3g} ms/decode forward that samples",
                 f"{self.per_sampling_row * 1e6:.3g} us/sampling row",
                 f"{self.per_join_padded_token * 1e9:.3g} ns/padded token merged",
                 f"{self.overhead * 1e6:.3g} us between ticks"]
        text = "cost model: (" + " + ".join(parts[:-1]) + f") x {self.slowdown:.3g} + {parts[-1]}"
        if self.per_arrival or self.per_media_arrival:
            text += (f"; {self.per_arrival * 1e3:.3g} ms per arrival + {self.per_media_arrival * 1e3:.3g} ms per "
                     "media item it carries, between ticks")
        if self.r2 is not None:
            timed = f", phases timed apart: {'/'.join(self.phases)}" if self.phases else ""
            text += (f"; fit over {self.n_ticks} ticks{timed} ({self.dropped} outliers left out of the terms): "
                     f"R^2 = {self.r2:.3f}, mean relative error {self.mean_rel_error:.1%}, "
                     f"typical tick (median, terms alone) {self.typical_rel_error:.1%}")
        if self.decode_rows_seen is not None:
            lo, hi = self.decode_rows_seen
            text += f"; decode rows seen {lo}..{hi} (10th..90th percentile)"
            if hi - lo < 2:
                text += (": too narrow to tell the per-row decode cost from the per-tick cost (a what-if at "
                         "another batch size extrapolates; record with Engine.calibrate() or `mlxsched demo "
                         "--calibrate` to see every batch size)")
        return text


def tick_features(prefill: Sequence[Sequence[Any]], decode: Sequence[str], num_batched_tokens: int,
                  images_encoded: int = 0, media: "Callable[[str], bool]" = lambda _rid: False,
                  vision_tokens: int = 0, context_tokens: int = 0,
                  samples: "Callable[[str], bool]" = lambda _rid: False, join_padded_tokens: int = 0) -> list[float]:
    """Feature row for one recorded plan (`prefill` as `[[id, start, end, completes], ...]`), in FEATURES order.
    `images_encoded`: media items encoded this tick that missed the vision cache, `vision_tokens` their media
    tokens; `media(id)`: whether a request carries media; `context_tokens`, `join_padded_tokens`: its decode
    rows' context (`context_features`); `samples(id)`: whether a request samples."""
    completing = [c[0] for c in prefill if c[3]]
    decode_rows = len(decode) + len(completing)
    media_tokens = sum(c[2] - c[1] - (1 if c[3] else 0) for c in prefill if media(c[0]))
    sampling_rows = sum(1 for rid in [*decode, *completing] if samples(rid))
    return [1.0, float(num_batched_tokens - decode_rows), float(decode_rows), float(len(prefill)),
            1.0 if decode_rows else 0.0, float(len(completing)), float(images_encoded), float(media_tokens),
            float(vision_tokens), float(context_tokens), 1.0 if sampling_rows else 0.0, float(sampling_rows),
            float(join_padded_tokens)]


def context_features(row_contexts: Sequence[int], merges: bool) -> tuple[int, int]:
    """A tick's decode rows (`row_contexts`: each row's prompt and produced tokens) as the two context
    features: the context they attend over (summed), and, on a tick that merges completed prefills into the
    batch (`merges`), the padded tokens the merge copies (rows x the longest context). One reading for the fit
    (from a trace) and the simulator."""
    if not row_contexts:
        return 0, 0
    return sum(row_contexts), len(row_contexts) * max(row_contexts) if merges else 0


def _encoded_misses(outcome: Mapping[str, Any], images: Mapping[str, int],
                    vision_tokens: Mapping[str, int]) -> tuple[int, int]:
    """Media items a recorded tick encoded that missed the vision cache (`outcome.encoded`), and their media
    tokens: as the outcome counts them per request (`items_encoded`, `media_tokens_encoded`: a chat turn whose
    earlier images were in the cache encoded its new one only), or, in traces from before those, all of the
    media of each request that was not a hit."""
    items = tokens = 0
    for rid, info in outcome.get("encoded", {}).items():
        if "items_encoded" in info:
            items, tokens = items + int(info["items_encoded"]), tokens + int(info.get("media_tokens_encoded", 0))
        elif not info.get("vision_cache_hit"):
            items, tokens = items + images.get(rid, 1), tokens + vision_tokens.get(rid, 0)
    return items, tokens


def _fit_phase(x: np.ndarray, y: np.ndarray, outlier_mads: float | None) -> tuple[np.ndarray, np.ndarray]:
    """NNLS of y on x, refitted without the ticks that took much longer than the fit says (more than
    `outlier_mads` median absolute deviations above it: warm-up, GC pauses, another process taking the CPU).
    One-sided, because such noise only ever adds time. Returns the coefficients and the kept ticks."""
    used = np.any(x != 0, axis=0)  # a feature no tick has is fitted on nothing: its term stays 0
    if not used.all():
        coef, keep = _fit_phase(x[:, used], y, outlier_mads)
        full = np.zeros(x.shape[1])
        full[used] = coef
        return full, keep
    coef = nnls(x, y)
    keep = np.ones(len(y), bool)
    if outlier_mads is None or len(y) < 2 * x.shape[1] + 2:  # too few ticks to tell an outlier
        return coef, keep
    for _ in range(5):  # refit without the outliers of the current fit until the kept set settles
        resid = y - x @ coef
        mad = float(np.median(np.abs(resid - np.median(resid))))
        if mad <= 0:
            break
        new_keep = resid - np.median(resid) <= outlier_mads * 1.4826 * mad
        if new_keep.sum() < x.shape[1] + 1 or np.array_equal(new_keep, keep):
            break
        keep = new_keep
        coef = nnls(x[keep], y[keep])
    return coef, keep


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best unconstrained fit over every support.

    The NNLS optimum is the unconstrained least-squares solution on its own support, so trying every subset
    of columns (2**k; k <= 13: a phase fits at most 8, a trace without phase timings all 13) and keeping the
    best one whose coefficients are all >= 0 is exact.
    """
    k = a.shape[1]
    if k > 13:
        raise ValueError("nnls here is exhaustive over supports; use at most 13 columns")
    best, best_err = np.zeros(k), float(np.sum(b * b))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((a[:, cols] @ coef - b) ** 2))
            if err < best_err - 1e-18:
                best = np.zeros(k)
                best[cols] = coef
                best_err = err
    return best


@dataclass
class _RecordedTicks:
    """What the fit reads off a trace: each timed tick's feature row, its time, its measures and whether it
    served the workload (not calibration alone); the requests' media counts and the media token ids."""

    rows: list[list[float]]
    seconds: list[float]
    measures: list[Mapping[str, Any]]
    served: list[bool]
    images: dict[str, int]
    media_token_ids: frozenset[int]


def _recorded_ticks(rec: Any) -> _RecordedTicks:
    arrivals = rec.arrival_events + rec.calibration_events  # calibration ticks are fitted like the others
    images = {e["request_id"]: int(e.get("num_images", 0)) for e in arrivals}
    media_ids = frozenset(int(t) for t in rec.trace.header.get("media_token_ids", ()))
    prompt_len = {e["request_id"]: len(e["prompt_tokens"]) for e in arrivals}
    vision_tokens = {e["request_id"]: sum(1 for t in e["prompt_tokens"] if t in media_ids)
                     for e in arrivals if images.get(e["request_id"])}
    media = lambda rid: images.get(rid, 0) > 0  # noqa: E731
    sampling = {e["request_id"] for e in arrivals if samples_tokens(e.get("sampling", {}))}
    produced: dict[str, int] = {}
    out = _RecordedTicks([], [], [], [], images, media_ids)
    for tick in sorted(rec.trace.outcomes):
        plan = rec.trace.plans.get(tick)
        outcome = rec.trace.outcomes[tick]
        m = outcome.get("measure", {})
        if plan is not None and "tick_s" in m:
            completing = [c[0] for c in plan["prefill"] if c[3]]
            context, merged = context_features([prompt_len.get(rid, 0) + produced.get(rid, 0)
                                                for rid in [*plan["decode"], *completing]], bool(completing))
            encoded, encoded_tokens = _encoded_misses(outcome, images, vision_tokens)
            out.rows.append(tick_features(plan["prefill"], plan["decode"], plan["num_batched_tokens"], encoded,
                                          media, encoded_tokens, context, sampling.__contains__, merged))
            out.seconds.append(float(m["tick_s"]))
            out.measures.append(m)
            out.served.append(not rec.calibration_only(tick))
        for rid in outcome.get("sampled", {}):
            produced[rid] = produced.get(rid, 0) + 1 + len(outcome.get("accepted_drafts", {}).get(rid, ()))
    return out


def fit_cost_model(trace: "Trace | str | os.PathLike | Iterable[dict]",
                   outlier_mads: float | None = 3.0) -> CostModel:
    """Least-squares (non-negative) fit of the per-tick cost over a trace's busy ticks.

    x comes from each tick's `plan` (`tick_features`), y is that tick's `outcome.measure.tick_s`. Where the
    trace times a tick's phases (`PHASES`: vision encoding, prefill, decode), each phase's features are fitted
    on that phase's time over the ticks that do such work, and `base` (with the features of any phase not
    timed) on the rest of the tick: encoding and prefill ticks are few next to decode ticks, and one fit over
    the whole tick would take them for outliers. Each fit is robust: refits leave out ticks that took more
    than `outlier_mads` median absolute deviations longer than the fit says (warm-up, GC pauses, another
    process taking the CPU; None keeps every tick). Each phase's terms are then scaled so that its predicted
    time over the recorded plans matches the recording (over the workload's ticks when the trace has
    calibration ticks: those shape the terms, the workload sets their level), and `slowdown` = recorded busy
    time / predicted busy time applies to all of them (a slowdown from contention is proportional: it carries
    over to a config with more, cheaper ticks better than a constant per tick would). `overhead` is the median gap between one busy
    tick's end and the next busy tick's start. R^2 and the mean relative error are those of the model as used
    over all busy ticks; `typical_rel_error` is the median relative error of the terms before the scaling.
    """
    rec = load_recorded(trace)
    ticks = _recorded_ticks(rec)
    if len(ticks.rows) < 2:
        raise TraceError("fit_cost_model: the trace has fewer than 2 timed ticks (outcome.measure.tick_s)")
    rows, ys, measures, served = ticks.rows, ticks.seconds, ticks.measures, ticks.served
    x, y = np.asarray(rows), np.asarray(ys)
    # Calibration ticks (Engine.calibrate()) show every batch size, so they shape the terms; the level is set
    # by the workload's own ticks, which run with the machine in the state serving leaves it in (measured on
    # the tiny models here: 5-10% slower per tick than the calibration's clean ramps at the same features).
    level = np.asarray(served) if any(served) else np.ones(len(y), bool)
    timed = [(key, [FEATURES.index(f) for f in names]) for key, names in PHASES
             if all(key in m for m in measures)]
    in_phases = {i for _key, cols in timed for i in cols}
    rest_cols = [i for i, name in enumerate(FEATURES) if i not in in_phases or name in REST_FEATURES]
    rest_y = y - sum((np.asarray([float(m[key]) for m in measures]) for key, _ in timed), np.zeros(len(y)))
    coef, scaled = np.zeros(len(FEATURES)), np.zeros(len(FEATURES))
    keep = np.ones(len(y), bool)
    typical_terms = np.zeros(len(y))
    for key, cols in [(None, rest_cols)] + timed:
        phase_y = rest_y if key is None else np.asarray([float(m[key]) for m in measures])
        active = np.ones(len(y), bool) if key is None else np.any(x[:, cols] != 0, axis=1)
        if active.sum() == 0:
            continue
        c, kept = _fit_phase(x[active][:, cols], phase_y[active], outlier_mads)
        coef[cols] += c
        idx = np.flatnonzero(active)
        keep[idx[~kept]] = False
        terms = x[:, cols] @ c
        typical_terms += terms
        # the phase's terms account for all its recorded time (the outliers' too); the time of a phase on a
        # tick that does none of its work (a few microseconds of bookkeeping) is left to the rest
        counted = active & level if (active & level).any() else active
        total, predicted = float(phase_y[counted].sum()), float(terms[counted].sum())
        scaled[cols] += c * (total / predicted if predicted > 0 else 1.0)
    fitted = float((x[level] @ coef).sum())
    slowdown = float(y[level].sum() / fitted) if fitted > 0 else 1.0
    scaled /= slowdown  # the coefficients stay the fitted terms where one phase is timed (tick_s alone)
    pred = (x @ scaled) * slowdown
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    typical = float(np.median(np.abs(typical_terms - y) / np.maximum(y, 1e-12)))
    overhead, per_arrival, per_media_arrival = _fit_gaps(rec, ticks.images, outlier_mads)
    rows_column = x[:, FEATURES.index("per_decode_row")]
    decode_rows = rows_column[keep & (rows_column > 0)]
    seen = (tuple(int(v) for v in np.percentile(decode_rows, [10, 90], method="nearest"))
            if decode_rows.size else None)
    ramps = rows_column[~level & (rows_column > 0)]  # calibration ticks: however few next to the workload's,
    if seen is not None and ramps.size:  # they were run to show every batch size, and they do
        seen = (min(seen[0], int(ramps.min())), max(seen[1], int(ramps.max())))
    return CostModel(*[float(c) for c in scaled], slowdown=slowdown, overhead=overhead, per_arrival=per_arrival,
                     per_media_arrival=per_media_arrival, r2=r2,
                     mean_rel_error=float(rel.mean()), typical_rel_error=typical, n_ticks=len(y),
                     dropped=int((~keep).sum()), decode_rows_seen=seen, media_token_ids=ticks.media_token_ids,
                     phases=tuple(key for key, _ in timed))


def _fit_gaps(rec: Any, images: Mapping[str, int], outlier_mads: float | None) -> tuple[float, float, float]:
    """The time between one busy tick's end and the next one's start: a constant (engine/client time) plus
    what the arrivals drained at the next tick cost the loop to take in (per arrival, per media item they carry);
    robust like the phases, and like them scaled to account for all the recorded gap time, the outliers' too.
    (Unscaled, the terms missed 20-30% of an image chat's gap time, the long gaps of arrivals carrying several
    images, and the simulated clock ran ahead where requests queue, which is where a TTFT is most sensitive to
    it: the recorded config simulated against its own recording gave TTFTs 18-21% short; bench/README.md.)"""
    rows, ys = [], []
    ticks = sorted(rec.trace.outcomes)
    for a, b in zip(ticks, ticks[1:]):
        if b == a + 1:
            ma, mb = rec.trace.outcomes[a]["measure"], rec.trace.outcomes[b]["measure"]
            if "tick_start_t" in mb and "t" in ma:
                arrived = [e["request_id"] for e in rec.trace.arrivals.get(b, ())]
                rows.append([1.0, float(len(arrived)), float(sum(images.get(rid, 0) for rid in arrived))])
                ys.append(max(0.0, mb["tick_start_t"] - ma["t"]))
    if not rows:
        return 0.0, 0.0, 0.0
    x, y = np.asarray(rows), np.asarray(ys)
    cols = [0] + [i for i in (1, 2) if x[:, i].any()]  # a column no gap has would be fitted on nothing
    coef = np.zeros(3)
    coef[cols], _kept = _fit_phase(x[:, cols], y, outlier_mads)
    predicted = float((x @ coef).sum())
    if predicted > 0:
        coef *= float(y.sum()) / predicted
    return float(coef[0]), float(coef[1]), float(coef[2])

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


#: Per-tick features (see `tick_features`). The executor feeds a completing chunk's last prompt token in the
#: batched decode forward, so "prefill tokens" excludes it and "decode rows" includes it; a completing chunk
#: also merges that request's cache into the batch cache (`per_prefill_done`).
#: Vision-language work: `per_image_encoded` is each media item encoded this tick that missed the vision
#: cache (its encoder forward), `per_media_prefill_token` the extra cost of a prefill token of a media
#: request (embedding inputs, M-RoPE positions) over a text one.
FEATURES = ("base", "per_prefill_token", "per_decode_row", "per_prefill_chunk", "per_decode_forward",
            "per_prefill_done", "per_image_encoded", "per_media_prefill_token")


@dataclass
class CostModel:
    """Seconds per tick = (base + per_prefill_token * prefill tokens + per_decode_row * decode rows
    + per_prefill_chunk * chunks + per_decode_forward * [any decode row] + per_prefill_done * completed
    prefills) * slowdown + overhead.

    `slowdown` scales the terms so that they also account for the time the fit's outlier ticks took (pauses,
    contention; see `fit_cost_model`). `overhead` is the engine/client time between two busy ticks (outside
    `tick_s`), added to every simulated tick. `r2`, `mean_rel_error` (the model as used, slowdown included),
    `typical_rel_error` (median over ticks of the terms alone: how well the shape fits), `n_ticks` and
    `dropped` describe the fit (None when not fitted).
    """

    base: float = 0.0
    per_prefill_token: float = 0.0
    per_decode_row: float = 0.0
    per_prefill_chunk: float = 0.0
    per_decode_forward: float = 0.0
    per_prefill_done: float = 0.0
    per_image_encoded: float = 0.0
    per_media_prefill_token: float = 0.0
    slowdown: float = 1.0
    overhead: float = 0.0
    r2: float | None = None
    mean_rel_error: float | None = None
    typical_rel_error: float | None = None
    n_ticks: int = 0
    dropped: int = 0  # outlier ticks left out of the final fit (e.g. the first tick's warm-up)

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in FEATURES)

    def tick_seconds(self, prefill_tokens: int, decode_rows: int, num_chunks: int, completed: int = 0,
                     images_encoded: int = 0, media_prefill_tokens: int = 0) -> float:
        """Predicted wall time of one tick (including `overhead`)."""
        return (self.base + self.per_prefill_token * prefill_tokens + self.per_decode_row * decode_rows
                + self.per_prefill_chunk * num_chunks + (self.per_decode_forward if decode_rows else 0.0)
                + self.per_prefill_done * completed + self.per_image_encoded * images_encoded
                + self.per_media_prefill_token * media_prefill_tokens) * self.slowdown + self.overhead

    def plan_seconds(self, plan: TickPlan, images_encoded: int = 0,
                     media: "Callable[[str], bool]" = lambda _rid: False) -> float:
        """A plan's predicted time; `images_encoded`: media items it encodes that miss the vision cache;
        `media(request_id)`: whether a request carries media (its prefill tokens cost the media term too)."""
        row = tick_features([[c.request_id, c.start, c.end, c.completes] for c in plan.prefill], plan.decode,
                            plan.num_batched_tokens, images_encoded, media)
        return self.tick_seconds(*row[1:4], row[5], row[6], row[7])

    def describe(self) -> str:
        parts = [f"{self.base * 1e3:.3g} ms/tick", f"{self.per_prefill_token * 1e6:.3g} us/prefill token",
                 f"{self.per_decode_row * 1e6:.3g} us/decode row", f"{self.per_prefill_chunk * 1e6:.3g} us/chunk",
                 f"{self.per_decode_forward * 1e3:.3g} ms/decode forward",
                 f"{self.per_prefill_done * 1e6:.3g} us/completed prefill",
                 f"{self.per_image_encoded * 1e3:.3g} ms/image encoded",
                 f"{self.per_media_prefill_token * 1e6:.3g} us/media prefill token",
                 f"{self.overhead * 1e6:.3g} us between ticks"]
        text = "cost model: (" + " + ".join(parts[:-1]) + f") x {self.slowdown:.3g} + {parts[-1]}"
        if self.r2 is not None:
            text += (f"; fit over {self.n_ticks} ticks ({self.dropped} outliers left out of the terms): "
                     f"R^2 = {self.r2:.3f}, mean relative error {self.mean_rel_error:.1%}, "
                     f"typical tick (median, terms alone) {self.typical_rel_error:.1%}")
        return text


def tick_features(prefill: Sequence[Sequence[Any]], decode: Sequence[str], num_batched_tokens: int,
                  images_encoded: int = 0, media: "Callable[[str], bool]" = lambda _rid: False) -> list[float]:
    """Feature row for one recorded plan (`prefill` as `[[id, start, end, completes], ...]`), in FEATURES order.
    `images_encoded`: media items encoded this tick that missed the vision cache; `media(id)`: whether a
    request carries media."""
    completing = sum(1 for c in prefill if c[3])
    decode_rows = len(decode) + completing
    media_tokens = sum(c[2] - c[1] - (1 if c[3] else 0) for c in prefill if media(c[0]))
    return [1.0, float(num_batched_tokens - decode_rows), float(decode_rows), float(len(prefill)),
            1.0 if decode_rows else 0.0, float(completing), float(images_encoded), float(media_tokens)]


def _images_encoded(outcome: Mapping[str, Any], images: Mapping[str, int]) -> int:
    """Media items a recorded tick encoded that missed the vision cache (`outcome.encoded`)."""
    return sum(images.get(rid, 1) for rid, info in outcome.get("encoded", {}).items()
               if not info.get("vision_cache_hit"))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best unconstrained fit over every support.

    The NNLS optimum is the unconstrained least-squares solution on its own support, so trying every subset
    of columns (2**k, k <= ~8) and keeping the best one whose coefficients are all >= 0 is exact.
    """
    k = a.shape[1]
    if k > 10:
        raise ValueError("nnls here is exhaustive over supports; use at most 10 columns")
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


def fit_cost_model(trace: "Trace | str | os.PathLike | Iterable[dict]",
                   outlier_mads: float | None = 3.0) -> CostModel:
    """Least-squares (non-negative) fit of the per-tick cost over a trace's busy ticks.

    x comes from each tick's `plan` (`tick_features`), y is that tick's `outcome.measure.tick_s`. The
    coefficients are fitted robustly: refits leave out ticks whose residual exceeds `outlier_mads` median
    absolute deviations (warm-up, GC pauses, another process taking the CPU; None keeps every tick). The
    terms are then scaled by `slowdown` = recorded busy time / predicted busy time, so the predicted total
    time of the recorded plans matches the recording (a slowdown from contention is proportional: it carries
    over to a config with more, cheaper ticks better than a constant per tick would). `overhead` is the
    median gap between one busy tick's end and the next busy tick's start. R^2 and the mean relative error
    are those of the model as used over all busy ticks; `typical_rel_error` is the median relative error of
    the terms alone.
    """
    rec = load_recorded(trace)
    images = {e["request_id"]: int(e.get("num_images", 0)) for e in rec.arrival_events}
    media = lambda rid: images.get(rid, 0) > 0  # noqa: E731
    rows, ys = [], []
    for tick in sorted(rec.trace.outcomes):
        plan = rec.trace.plans.get(tick)
        outcome = rec.trace.outcomes[tick]
        m = outcome.get("measure", {})
        if plan is None or "tick_s" not in m:
            continue
        rows.append(tick_features(plan["prefill"], plan["decode"], plan["num_batched_tokens"],
                                  _images_encoded(outcome, images), media))
        ys.append(float(m["tick_s"]))
    if len(rows) < 2:
        raise TraceError("fit_cost_model: the trace has fewer than 2 timed ticks (outcome.measure.tick_s)")
    x, y = np.asarray(rows), np.asarray(ys)
    coef = nnls(x, y)
    keep = np.ones(len(y), bool)
    if outlier_mads is not None:
        for _ in range(5):  # refit without the outliers of the current fit until the kept set settles
            resid = y - x @ coef
            mad = float(np.median(np.abs(resid - np.median(resid))))
            if mad <= 0:
                break
            new_keep = np.abs(resid) <= outlier_mads * 1.4826 * mad
            if new_keep.sum() < len(FEATURES) or np.array_equal(new_keep, keep):
                break
            keep = new_keep
            coef = nnls(x[keep], y[keep])
    terms = x @ coef
    slowdown = float(y.sum() / terms.sum()) if terms.sum() > 0 else 1.0
    pred = terms * slowdown
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    typical = float(np.median(np.abs(terms - y) / np.maximum(y, 1e-12)))
    gaps = []
    ticks = sorted(rec.trace.outcomes)
    for a, b in zip(ticks, ticks[1:]):
        if b == a + 1:
            ma, mb = rec.trace.outcomes[a]["measure"], rec.trace.outcomes[b]["measure"]
            if "tick_start_t" in mb and "t" in ma:
                gaps.append(max(0.0, mb["tick_start_t"] - ma["t"]))
    overhead = float(np.median(gaps)) if gaps else 0.0
    return CostModel(*[float(c) for c in coef], slowdown=slowdown, overhead=overhead, r2=r2,
                     mean_rel_error=float(rel.mean()), typical_rel_error=typical, n_ticks=len(y),
                     dropped=int((~keep).sum()))

"""The tick-level draft gate: how wide this tick's verify forward is, given every row's draft.

The batched verify forward runs every row of the batch (drafting or not) at the width of the widest draft,
so drafting is a decision for the tick, not for a row: one hopeful row makes all B rows compute ``w``
positions, pay the acceptance read-back and keep rows of different lengths in the cache. Per-row
pacing (`drafters.AdaptivePace`) cannot see that. The gate can: after the drafter has proposed, it picks the
width ``w`` (1 = a plain one-token step, no drafts) that maximises expected tokens per unit of tick time,

    rate(w) = (B + sum_i E_i(min(d_i, w - 1))) / cost(B, w),    E_i(n) = p_i + p_i^2 + ... + p_i^n,

where ``d_i`` is row i's draft length, ``p_i`` its estimated per-token acceptance (each draft token is
accepted with probability ``p_i`` while every earlier one was: greedy verification keeps the longest matching
prefix) and ``cost`` the tick's time relative to a plain tick of the same batch (:class:`VerifyCost`,
measured by ``bench/verify_tick.py``). Every draft is cut to ``w - 1``. A row with low acceptance adds
little to any width's numerator, so it cannot widen the tick on its own; at the chosen width it still
verifies its (cut) draft: those positions are computed anyway.

``p_i`` is a decayed count of the row's verified draft tokens (:class:`_Acceptance`): each verification of
``n`` tokens with ``a`` accepted observes ``a`` successes and, if ``a < n``, one failure (the tokens after
the first rejection were never tried). An optimistic prior (p = 0.8, the weight of 1.25 observations) lets
a new row draft, and a row whose draft was declined decays towards it, so a row that stopped paying is
retried after a while instead of never again.

Deterministic and replayable: the decision is a function of the drafts, the verified outcomes and the cost
constants fixed at construction, never of a clock read per tick; what it let through is recorded in each
tick's outcome (`TickResult.drafts`: the verified length), which is what replay reads. Pure bookkeeping (no
MLX): tested in tests/execution/test_draft_gate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class VerifyCost:
    """A decode tick's time relative to a plain one-token tick of the same batch, by width ``w`` (>= 2):

        cost(B, w) = 1 + verify + width * (w - 1) * (1 + rows * (B - 1)) + (shift if B > 1)

    * ``verify``: a verify tick's fixed extra (the wider logits and their argmax read back to the host, the
      drafter and the bookkeeping of more tokens);
    * ``width``: each extra position of width, for one row; ``rows``: how much more each further row adds to
      it (a small model's forward is overhead-bound: four rows at width 5 cost far less than four times one);
    * ``shift``: rows that keep different lengths after acceptance (with more than one row, the usual case):
      their dropped positions become masked holes (`caches.layers.rollback_rows`), which cost the mask an op
      and, every HOLE_LIMIT positions, one compaction (a per-row copy of every layer before 2026-12-05: 0.45).

    Defaults: the trained tiny model under OpenBLAS (bench/README.md, "A cheaper verify tick";
    `bench/verify_tick.py`: whole batch-4 ticks at w = 2..5 cost 1.22-1.57x a plain one; "Drafting from the
    batch's histories": the bare forward at w = 5 costs 1.46-1.72x a w = 1 one at batch 4 and 2.5-2.6x at
    batch 16).
    Another model's figures come from running that probe on it."""

    verify: float = 0.10
    width: float = 0.09
    # once the verify tick's fixed costs were cut, its forward is what grows with width, and on this CPU it is
    # compute-bound: each position costs more with more rows. The bare forward at w = 5 is 1.46-1.72x a w = 1
    # one at batch 4 and 2.5-2.6x at batch 16; with the ~0.3 ms of engine work every tick has, whole ticks
    # come to about 1.5-1.6x and 2.1-2.3x, which 0.1 fits (1.62x, 2.05x). It was 0 while fixed costs dominated
    rows: float = 0.1
    shift: float = 0.05

    def __post_init__(self) -> None:
        for name in ("verify", "width", "rows", "shift"):
            if getattr(self, name) < 0:
                raise ValueError(f"VerifyCost.{name} must be >= 0, got {getattr(self, name)}")

    def tick(self, batch: int, width: int) -> float:
        if width <= 1:
            return 1.0
        return (1.0 + self.verify + self.width * (width - 1) * (1.0 + self.rows * (batch - 1))
                + (self.shift if batch > 1 else 0.0))

    @classmethod
    def fit(cls, forward_ms: Mapping[int, Mapping[int, float]], tick_overhead_ms: float = 0.0,
            verify: float = 0.10, shift: float = 0.05) -> "VerifyCost":
        """``width`` and ``rows`` from measured forwards on one machine and model: ``forward_ms[B][w]``, the bare
        batch-B forward at width w (w = 1 and at least one w > 1 per batch size), and ``tick_overhead_ms``, what a
        plain engine tick costs beyond its forward (`bench/verify_tick.py` prints both, and this fit). What a
        position of width adds, relative to a plain tick, is ``(forward(B, w) - forward(B, 1)) / (forward(B, 1) +
        overhead)``; its least-squares slope in ``w - 1`` per batch size is ``width * (1 + rows * (B - 1))``,
        solved from the smallest and the largest batch size (``rows`` 0 with one). ``verify`` and ``shift`` (the
        acceptance read-back, the holes) are kept as given."""
        slopes = {}
        for batch, by_width in sorted(forward_ms.items()):
            base = by_width[1] + tick_overhead_ms
            points = [(w - 1, (ms - by_width[1]) / base) for w, ms in by_width.items() if w > 1]
            if not points or base <= 0:
                raise ValueError(f"batch {batch}: need the w = 1 forward and at least one wider one")
            slopes[batch] = max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))
        b0, b1 = min(slopes), max(slopes)
        rows = 0.0
        if b1 > b0:
            denominator = slopes[b0] * (b1 - 1) - slopes[b1] * (b0 - 1)
            rows = max(0.0, (slopes[b1] - slopes[b0]) / denominator) if denominator > 0 else 0.0
        width = slopes[b0] / (1.0 + rows * (b0 - 1))
        return cls(verify=verify, width=round(width, 4), rows=round(rows, 4), shift=shift)


@dataclass
class _Acceptance:
    """Decayed counts of one row's verified draft tokens (see the module docstring)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def p(self, prior_accepted: float, prior_rejected: float) -> float:
        return (self.accepted + prior_accepted) / (self.accepted + self.rejected + prior_accepted + prior_rejected)


def expected_accepted(p: float, n: int) -> float:
    """E[accepted] of an n-token draft when each token is accepted with probability p while every earlier one
    was: p + p^2 + ... + p^n."""
    total, term = 0.0, 1.0
    for _ in range(n):
        term *= p
        total += term
    return total


@dataclass(frozen=True)
class GateDecision:
    width: int  # the verify forward's width (1: a plain step, every draft declined)
    rate: float  # expected tokens per plain-tick time at that width
    plain_rate: float  # the same for a plain step (B)


@dataclass
class DraftGate:
    """Chooses each tick's verify width (see the module docstring)."""

    cost: VerifyCost = field(default_factory=VerifyCost)
    decay: float = 0.8  # weight of older verifications per newer one (memory of ~1 / (1 - decay) drafts)
    # the prior: p = 0.8 with the weight of 1.25 observations. Optimistic, so a new row's first draft is
    # verified even at k = 1 in a large batch (a row that never verifies never shows its acceptance), and
    # light, so a few rejections outweigh it.
    prior_accepted: float = 1.0
    prior_rejected: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.prior_accepted <= 0 or self.prior_rejected <= 0:
            raise ValueError("the prior counts must be > 0")
        self._rows: dict[str, _Acceptance] = {}
        self.ticks = 0  # ticks that had at least one draft to judge
        self.declined = 0  # of those, ticks decoded plainly
        self.narrowed = 0  # ticks verified at less than the widest draft
        self.tokens_cut = 0  # draft tokens cut off by narrowing or declining

    def acceptance(self, request_id: str) -> float:
        row = self._rows.get(request_id)
        return (row or _Acceptance()).p(self.prior_accepted, self.prior_rejected)

    def decide(self, batch: int, drafts: Mapping[str, int]) -> GateDecision:
        """The width for a tick of ``batch`` rows whose drafts have these lengths (request id -> length)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        widest = max(drafts.values(), default=0)
        plain = float(batch)
        best = GateDecision(1, plain, plain)
        if not widest:
            return best
        ps = {rid: self.acceptance(rid) for rid, n in drafts.items() if n}
        for w in range(2, widest + 2):
            tokens = batch + sum(expected_accepted(p, min(drafts[rid], w - 1)) for rid, p in ps.items())
            rate = tokens / self.cost.tick(batch, w)
            if rate > best.rate * (1 + 1e-9):  # ties (to rounding) keep the narrower width
                best = GateDecision(w, rate, plain)
        return best

    def apply(self, batch: int, drafts: Mapping[str, int]) -> dict[str, int]:
        """Decide, count, and return each row's draft length cut to the chosen width (rows cut to 0 are
        absent); a declined row's estimate decays towards the prior."""
        if not any(drafts.values()):
            return {}
        decision = self.decide(batch, drafts)
        keep = decision.width - 1
        self.ticks += 1
        self.declined += keep == 0
        self.narrowed += 0 < keep < max(drafts.values())
        out = {}
        for rid, n in drafts.items():
            self.tokens_cut += max(0, n - keep)
            if n and keep:
                out[rid] = min(n, keep)
            elif n:
                row = self._rows.get(rid)
                if row is not None:
                    row.accepted *= self.decay
                    row.rejected *= self.decay
        return out

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """A verification of ``verified`` draft tokens of this row, ``accepted`` of them accepted."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"{request_id}: accepted {accepted} of {verified}")
        if not verified:
            return
        row = self._rows.setdefault(request_id, _Acceptance())
        row.accepted = self.decay * row.accepted + accepted
        row.rejected = self.decay * row.rejected + (accepted < verified)

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {"judged_ticks": self.ticks, "declined_ticks": self.declined, "narrowed_ticks": self.narrowed,
                "draft_tokens_cut": self.tokens_cut}

"""Workloads for the model-free simulator: synthetic (seeded, Poisson arrivals) or taken from a recorded trace.

A `SimArrival` is everything the simulator needs to know about one request: when it arrives, its prompt, its
`max_tokens`, and how many tokens it will actually produce before a stop (`output_len`), which a real run only
reveals afterwards. Media are carried as a count and a content key (the cost model prices encoding per media item).

Length specs (`prompt_len`, `output_len` of `synthetic_workload`):
  * an int: that constant;
  * `(lo, hi)` or `Uniform(lo, hi)`: uniform integer in [lo, hi], both ends included;
  * `Lognormal(mean, sigma, lo, hi)` or `{"dist": "lognormal", "mean": m, "sigma": s, "lo": .., "hi": ..}`:
    a rounded lognormal whose (unclipped) mean is `mean`, clipped to [lo, hi];
  * a callable `rng -> int` (`rng` is a `random.Random`).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from scheduler.request import MediaItemRef

if TYPE_CHECKING:  # pragma: no cover
    from scheduler.tools.replay import Trace

FIRST_ORDINARY_ID = 7  # ids 0..6 are special tokens in the tiny models (and a safe convention elsewhere)
VOCAB = 512  # synthetic prompt ids are drawn from [FIRST_ORDINARY_ID, VOCAB)


def media_marks(arrival: Mapping[str, Any]) -> tuple[tuple[int, str], ...]:
    """The arrival's media marks (`Request.media_marks`). Traces from before they were recorded keyed a media
    request's prefix entries by its media as a whole from its first position (no text shared with other
    requests): one mark at 0 with its media key gives those keys. Traces that recorded a `media_offset` (for a
    while, instead of marks) get one mark there."""
    if "media_marks" in arrival:
        return tuple((int(position), str(key)) for position, key in arrival["media_marks"])
    key = arrival.get("media_key")
    return () if key is None else ((int(arrival.get("media_offset", 0)), key),)


def media_items(arrival: Mapping[str, Any]) -> tuple[MediaItemRef, ...]:
    """The arrival's media items (`Request.media_items`): recorded where the model layer keyed its media per
    item; () for a request whose media are one unit, and in traces from before they were recorded."""
    return tuple(MediaItemRef.from_record(item) for item in arrival.get("media_items", ()))


def samples_tokens(sampling: Mapping[str, Any]) -> bool:
    """Whether a request's recorded sampling (`SamplingParams.to_record()`) goes through the sampler rather
    than the greedy argmax: a temperature, or penalties (which rewrite the logits first)."""
    return (float(sampling.get("temperature", 0.0)) > 0.0 or float(sampling.get("presence_penalty", 0.0)) != 0.0
            or float(sampling.get("repetition_penalty", 1.0)) != 1.0
            or float(sampling.get("frequency_penalty", 0.0)) != 0.0)


@dataclass
class SimArrival:
    request_id: str
    arrival_time: float  # seconds, relative to the start of the run
    prompt_tokens: list[int]
    max_tokens: int
    output_len: int  # tokens it produces before it stops (<= max_tokens); == max_tokens: ends by length
    priority: int = 0
    num_images: int = 0
    num_media_tokens: int = 0  # prompt positions its media fill (the vision token budget counts them)
    media_key: str | None = None  # content key of its ordered media (the vision cache's key)
    media_marks: tuple[tuple[int, str], ...] = ()  # Request.media_marks (its prefix keys' media)
    media_items: tuple[MediaItemRef, ...] = ()  # Request.media_items (per item where keyed per item)
    first_chunk_reach: int = 0  # Request.first_chunk_reach (its first chunk is one forward of its own)
    lora: str | None = None  # Request.lora (its prefix keys carry it)
    cache_salt: str | None = None  # Request.cache_salt (so do they)
    abort_time: float | None = None  # the caller aborts it at this time (relative), if still live
    error_after: int | None = None  # it fails (executor error) when sampling token number error_after + 1
    samples: bool = False  # goes through the sampler (a temperature or penalties), not the greedy argmax

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    @property
    def upper(self) -> int | None:
        return self.hi


@dataclass(frozen=True)
class Lognormal:
    """Rounded lognormal with (unclipped) mean `mean` and log-space standard deviation `sigma`."""

    mean: float
    sigma: float = 1.0
    lo: int = 1
    hi: int | None = None

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        value = int(round(rng.lognormvariate(mu, self.sigma)))
        value = max(self.lo, value)
        return value if self.hi is None else min(self.hi, value)

    @property
    def upper(self) -> int | None:
        return self.hi


@dataclass(frozen=True)
class _Constant:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value

    @property
    def upper(self) -> int | None:
        return self.value


@dataclass(frozen=True)
class _Custom:
    fn: Callable[[random.Random], int]

    def sample(self, rng: random.Random) -> int:
        return int(self.fn(rng))

    @property
    def upper(self) -> int | None:
        return None


LengthSpec = Union[int, tuple, Uniform, Lognormal, Mapping[str, Any], Callable[[random.Random], int]]


def length_dist(spec: LengthSpec) -> Uniform | Lognormal | _Constant | _Custom:
    """Normalise a length spec (see the module docstring) into an object with `sample(rng)` and `upper`."""
    if isinstance(spec, (Uniform, Lognormal)):
        dist = spec
    elif isinstance(spec, bool):
        raise ValueError(f"not a length spec: {spec!r}")
    elif isinstance(spec, int):
        dist = _Constant(spec)
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        dist = Uniform(int(spec[0]), int(spec[1]))
    elif isinstance(spec, Mapping):
        kind = spec.get("dist", "uniform")
        rest = {k: v for k, v in spec.items() if k != "dist"}
        if kind == "lognormal":
            dist = Lognormal(**rest)
        elif kind == "uniform":
            dist = Uniform(**rest)
        else:
            raise ValueError(f"unknown length distribution {kind!r} (uniform, lognormal)")
    elif callable(spec):
        return _Custom(spec)
    else:
        raise ValueError(f"not a length spec: {spec!r} (int, (lo, hi), Uniform, Lognormal, dict or callable)")
    if isinstance(dist, Uniform) and not 1 <= dist.lo <= dist.hi:
        raise ValueError(f"uniform lengths need 1 <= lo <= hi, got {dist}")
    if isinstance(dist, Lognormal) and not (dist.mean > 0 and dist.sigma >= 0 and dist.lo >= 1
                                            and (dist.hi is None or dist.hi >= dist.lo)):
        raise ValueError(f"lognormal lengths need mean > 0, sigma >= 0, 1 <= lo <= hi, got {dist}")
    if isinstance(dist, _Constant) and dist.value < 1:
        raise ValueError(f"a constant length must be >= 1, got {dist.value}")
    return dist


def synthetic_workload(
    n: int,
    rate_per_s: float | None,
    prompt_len: LengthSpec = (16, 512),
    output_len: LengthSpec = (16, 256),
    shared_prefix_share: float = 0.0,
    shared_prefix_len: int = 0,
    image_share: float = 0.0,
    seed: int = 0,
    *,
    num_prefixes: int = 4,
    max_tokens: int | None = None,
    priorities: Sequence[int] = (0,),
    images_per_request: int = 1,
) -> list[SimArrival]:
    """`n` requests with Poisson arrivals at `rate_per_s` (None or inf: all at time 0).

    A share `shared_prefix_share` of the prompts starts with one of `num_prefixes` fixed prefixes of
    `shared_prefix_len` tokens (the rest of such a prompt is random, at least one token, so the total is
    max(drawn length, shared_prefix_len + 1)). `max_tokens` defaults to the output spec's upper bound (so
    requests usually stop before it, as real ones do), or to `output_len` when the spec has none.
    A share `image_share` of the requests carries `images_per_request` images (a count only).

    Deterministic per `seed`; arrivals, lengths, tokens and flags use separate random streams, so changing
    one knob (say the prefix share) does not move the arrival times.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if rate_per_s is not None and not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0 (or None for all at once), got {rate_per_s}")
    for name, share in (("shared_prefix_share", shared_prefix_share), ("image_share", image_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {share}")
    if shared_prefix_share > 0 and shared_prefix_len < 1:
        raise ValueError("shared_prefix_share > 0 needs shared_prefix_len >= 1")
    prompt_dist, output_dist = length_dist(prompt_len), length_dist(output_len)
    streams = {name: random.Random(f"mlxsched-workload:{seed}:{name}")
               for name in ("arrivals", "lengths", "tokens", "flags")}
    population = range(FIRST_ORDINARY_ID, VOCAB)
    prefixes = [streams["tokens"].choices(population, k=shared_prefix_len) for _ in range(max(1, num_prefixes))]

    clock = 0.0
    arrivals: list[SimArrival] = []
    for i in range(n):
        if rate_per_s is not None and math.isfinite(rate_per_s):
            clock += streams["arrivals"].expovariate(rate_per_s)
        length = prompt_dist.sample(streams["lengths"])
        out = output_dist.sample(streams["lengths"])
        flags = streams["flags"]
        shared = flags.random() < shared_prefix_share
        prefix_index = flags.randrange(len(prefixes))
        images = images_per_request if flags.random() < image_share else 0
        priority = flags.choice(priorities)
        if shared:
            suffix = streams["tokens"].choices(population, k=max(1, length - shared_prefix_len))
            tokens = prefixes[prefix_index] + suffix
        else:
            tokens = streams["tokens"].choices(population, k=length)
        cap = max_tokens if max_tokens is not None else (output_dist.upper or out)
        arrivals.append(SimArrival(
            request_id=f"sim-{i}", arrival_time=clock, prompt_tokens=tokens, max_tokens=max(cap, 1),
            output_len=min(out, max(cap, 1)), priority=priority, num_images=images,
        ))
    return arrivals


def arrivals_from_trace(trace: "Trace | str | os.PathLike") -> list[SimArrival]:
    """The recorded requests as simulator arrivals.

    arrival_time is the arrival's wall time (`measure.t`) relative to `engine_start`'s; output_len is the
    number of tokens the request got in the run. A request the caller aborted keeps `output_len = max_tokens`
    (its natural length is unknown) and gets `abort_time`, so the simulator aborts it at that time if it is
    still live. A request that failed gets `error_after` = the tokens it had when the executor reported its
    error.
    """
    from scheduler.tools.simulate import load_recorded  # local: simulate imports this module

    rec = load_recorded(trace)
    out: list[SimArrival] = []
    for event in rec.arrival_events:
        rid = event["request_id"]
        sampling = event["sampling"]
        max_tok = int(sampling["max_tokens"])
        produced = rec.tokens.get(rid, 0)
        abort_time = rec.abort_time.get(rid)
        error_after = produced if rid in rec.errored else None
        ended_early = abort_time is not None or error_after is not None  # natural length unknown
        out.append(SimArrival(
            request_id=rid,
            arrival_time=max(0.0, rec.arrival_time[rid] - rec.t0),
            prompt_tokens=list(event["prompt_tokens"]),
            max_tokens=max_tok,
            output_len=max_tok if ended_early else max(1, min(produced, max_tok)),
            priority=event.get("priority", 0),
            num_images=int(event.get("num_images", 0)),
            num_media_tokens=int(event.get("num_media_tokens", 0)),
            media_key=event.get("media_key"),
            media_marks=media_marks(event),
            media_items=media_items(event),
            first_chunk_reach=int(event.get("first_chunk_reach", 0)),
            lora=event.get("lora"),
            cache_salt=event.get("cache_salt"),
            abort_time=None if abort_time is None else max(0.0, abort_time - rec.t0),
            error_after=error_after,
            samples=samples_tokens(sampling),
        ))
    return out

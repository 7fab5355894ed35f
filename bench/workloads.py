"""Deterministic, seeded workloads: token-id prompts for the tiny models (vocab 512).

Prompt ids are drawn from [7, 512): ids 0..6 are the ChatML / vision specials of the tiny tokenizer
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` = eos, ...), so no prompt contains an eos or a media marker.
The same (arguments, seed) always give the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Iterator

TOKEN_LO = 7  # first non-special id of the tiny tokenizer
TOKEN_HI = 512  # vocab size of the tiny models (exclusive)


@dataclass(frozen=True)
class Workload:
    """`n` prompts (lists of token ids), each to be extended by exactly `new_tokens` tokens.

    Behaves like the list of prompts (len, iteration, indexing) so callers that only want the prompts can
    use it directly.
    """

    name: str
    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int
    seed: int
    # sampled requests (`with_sampling`): every `sampled_every`-th request, from the first, is drawn at this
    # temperature and top-p with its index as seed; the rest are greedy. 0: every request greedy
    sampled_every: int = 0
    temperature: float = 1.0
    top_p: float = 1.0

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[list[int]]:
        return (list(p) for p in self.prompts)

    def __getitem__(self, i: int) -> list[int]:
        return list(self.prompts[i])

    @property
    def prompt_lists(self) -> list[list[int]]:
        return [list(p) for p in self.prompts]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_new_tokens(self) -> int:
        return self.new_tokens * len(self.prompts)

    def with_new_tokens(self, new_tokens: int) -> "Workload":
        """Same prompts and sampling, a different generation length (used for warm-up runs)."""
        return replace(self, new_tokens=new_tokens)

    def with_sampling(self, every: int, temperature: float = 1.0, top_p: float = 1.0) -> "Workload":
        """Every `every`-th request (from the first) sampled at `temperature` / `top_p`; 0: all greedy."""
        if every < 0 or (every and not temperature > 0) or not 0 < top_p <= 1:
            raise ValueError(f"need every >= 0, temperature > 0, 0 < top_p <= 1; got {every}, {temperature}, {top_p}")
        return replace(self, sampled_every=every, temperature=temperature, top_p=top_p)

    def sampled(self, i: int) -> bool:
        return bool(self.sampled_every) and i % self.sampled_every == 0

    @property
    def greedy_indices(self) -> list[int]:
        return [i for i in range(len(self.prompts)) if not self.sampled(i)]

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        sampling = (f"; every {self.sampled_every}. request sampled (temperature {self.temperature}, top-p "
                    f"{self.top_p}), {len(self.greedy_indices)} greedy" if self.sampled_every else "")
        return (f"{self.name}: {len(lens)} prompts, {min(lens)}-{max(lens)} tokens "
                f"(total {sum(lens)}), {self.new_tokens} new tokens each{sampling}")


def _check(n: int, new_tokens: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be an integer >= 1, got {new_tokens!r}")


def _prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(length))


def uniform(n: int, prompt_len: int, new_tokens: int, seed: int = 0) -> Workload:
    """`n` prompts of exactly `prompt_len` random ids in [7, 512)."""
    _check(n, new_tokens)
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be an integer >= 1, got {prompt_len!r}")
    rng = random.Random(f"uniform:{seed}:{n}:{prompt_len}")
    return Workload(f"uniform(n={n}, len={prompt_len})", tuple(_prompt(rng, prompt_len) for _ in range(n)),
                    new_tokens, seed)


def mixed(n: int, lo: int, hi: int, new_tokens: int, seed: int = 0) -> Workload:
    """`n` prompts with lengths drawn uniformly from [lo, hi] (inclusive), random ids in [7, 512)."""
    _check(n, new_tokens)
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"need integers 1 <= lo <= hi, got lo={lo!r} hi={hi!r}")
    rng = random.Random(f"mixed:{seed}:{n}:{lo}:{hi}")
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    return Workload(f"mixed(n={n}, len={lo}-{hi})", tuple(_prompt(rng, k) for k in lengths), new_tokens, seed)

"""Multi-token prediction (MTP) heads: the reference's drafter, as one of ours.

An MTP head predicts the token after next from the target's own last hidden state: given the final hidden
state `h_t` of the position that produced token `x_{t+1}` and the embedding of `x_{t+1}`, it returns a hidden
state whose logits (through the *target's* output head) predict `x_{t+2}` (DeepSeek-V3 style, here without an
attention block). Chained, one head drafts k tokens: each step feeds its own output hidden state and the token
it just drafted. The head shares the target's embedding and output head, so a checkpoint adds only a few
weights: `mtp.safetensors` + `mtp_config.json` next to the model's own files.

`MTPDrafter` implements the drafter protocol of scheduler/execution/drafters.py; it needs each row's last hidden state,
which the executor keeps when the drafter asks for it (`needs_hidden`).

`NativeMTPDrafter` drafts with a model's own MTP module instead (vllm-mlx's convention: `.mtp`, `.mtp_forward`,
`return_hidden=True`); that module returns logits only, so it drafts one token per step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn

from scheduler.execution import library
from scheduler.execution.drafters import Draft, DraftRequest

MTP_WEIGHTS = "mtp.safetensors"
MTP_CONFIG = "mtp_config.json"


class MTPHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int | None = None, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.embed_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.up = nn.Linear(hidden_size, self.intermediate_size, bias=False)
        self.down = nn.Linear(self.intermediate_size, hidden_size, bias=False)
        self.out_norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, hidden: mx.array, token_embeddings: mx.array) -> mx.array:
        """(n, H) hidden states and (n, H) embeddings of the tokens they produced -> (n, H) next hidden."""
        x = self.proj(mx.concatenate([self.hidden_norm(hidden), self.embed_norm(token_embeddings)], axis=-1))
        x = x + self.down(nn.silu(self.up(x)))
        return self.out_norm(x)

    def config(self) -> dict[str, int]:
        return {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size}


def has_native_mtp(model: Any) -> bool:
    return library.has_native_mtp(model)


def save_mtp_head(head: MTPHead, model_dir: str | Path) -> None:
    from mlx.utils import tree_flatten

    model_dir = Path(model_dir)
    mx.save_safetensors(str(model_dir / MTP_WEIGHTS), dict(tree_flatten(head.parameters())))
    (model_dir / MTP_CONFIG).write_text(json.dumps(head.config(), indent=2) + "\n", encoding="utf-8")


def load_mtp_head(model_dir: str | Path) -> MTPHead | None:
    """The MTP head stored next to a model, or None if the checkpoint has none."""
    model_dir = Path(model_dir)
    if not (model_dir / MTP_CONFIG).is_file():
        return None
    config = json.loads((model_dir / MTP_CONFIG).read_text(encoding="utf-8"))
    head = MTPHead(config["hidden_size"], config.get("intermediate_size"))
    head.load_weights(str(model_dir / MTP_WEIGHTS))
    mx.eval(head.parameters())
    return head


class _HiddenStateDrafter:
    """What the MTP drafters share: no per-request state (the hidden states live in the executor's rows),
    and counts of drafted and accepted tokens."""

    needs_hidden = True
    kind = ""

    def __init__(self) -> None:
        self.drafted = self.accepted = 0

    def _counted(self, drafts: list[Draft]) -> list[Draft]:
        self.drafted += sum(len(d.tokens) for d in drafts)
        return drafts

    def accept(self, request_id: str, num_accepted: int, emitted: Sequence[int] = ()) -> None:
        self.accepted += num_accepted

    def release(self, request_ids: Iterable[str]) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"kind": self.kind, "drafted": self.drafted, "accepted": self.accepted}


class MTPDrafter(_HiddenStateDrafter):
    """Drafts with an MTP head on the target's hidden states (greedy drafts: q is one-hot, `logprobs=None`)."""

    kind = "mtp"

    def __init__(self, head: MTPHead, target_model: Any):
        super().__init__()
        # every target forward then goes through the hidden-state seam: refuse a model whose own logits differ
        library.check_hidden_seam(target_model)
        self.head = head
        self.embed = library.token_embedding(target_model)
        self.logits = library.logits_from_hidden(target_model)

    def propose(self, rows: Sequence[DraftRequest], k: int) -> list[Draft]:
        ready = [r for r in rows if r.hidden is not None and (r.max_tokens is None or r.max_tokens > 0)]
        drafts = {r.request_id: Draft(r.request_id, []) for r in rows}
        if ready and k > 0:
            steps = max(min(k, r.max_tokens if r.max_tokens is not None else k) for r in ready)
            hidden = mx.stack([r.hidden for r in ready])
            tokens = mx.array([r.tokens[-1] for r in ready], dtype=mx.int32)
            proposed = []
            for _ in range(steps):  # chained: each step feeds the hidden state and token it just produced
                hidden = self.head(hidden, self.embed(tokens))
                tokens = mx.argmax(self.logits(hidden), axis=-1).astype(mx.int32)
                proposed.append(tokens)
            mx.eval(proposed)
            columns = [p.tolist() for p in proposed]
            for j, r in enumerate(ready):
                limit = min(k, r.max_tokens if r.max_tokens is not None else k)
                drafts[r.request_id] = Draft(r.request_id, [col[j] for col in columns[:limit]])
        return self._counted([drafts[r.request_id] for r in rows])


class NativeMTPDrafter(_HiddenStateDrafter):
    """One greedy draft per row from the model's native MTP module, on the hidden states of its own
    `return_hidden=True` call (`native_hidden`: the executor takes them from that call, not the seam)."""

    kind = "native-mtp"
    native_hidden = True

    def __init__(self, target_model: Any):
        super().__init__()
        if not library.has_native_mtp(target_model):
            raise TypeError(f"{type(target_model).__module__}: no native MTP module (.mtp and .mtp_forward)")
        self.model = target_model

    def propose(self, rows: Sequence[DraftRequest], k: int) -> list[Draft]:
        ready = [r for r in rows if r.hidden is not None and (r.max_tokens is None or r.max_tokens > 0)]
        drafts = {r.request_id: Draft(r.request_id, []) for r in rows}
        if ready and k > 0:
            hidden = mx.stack([r.hidden for r in ready])
            tokens = mx.array([r.tokens[-1] for r in ready], dtype=mx.int32)
            proposed = mx.argmax(library.native_mtp_logits(self.model, hidden, tokens), axis=-1)
            for r, token in zip(ready, proposed.tolist()):
                drafts[r.request_id] = Draft(r.request_id, [token])
        return self._counted([drafts[r.request_id] for r in rows])

"""The device side of logprobs (runtime/decoding/logprobs.py): the asking rows' log-softmax of the raw logits
(taken before any logit hook or control changes them), the chosen tokens' log-probabilities and the top k, as
read-back columns (zeros for the rows that did not ask, never read); for prompt logprobs, the same of the
prompt tokens a scoring prefill chunk's logit rows are followed by."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover_export.runtime.decoding.base import DeviceWork


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 bit patterns (read back with the step's int columns; `logprobs.floats` undoes it)."""
    return t.float().contiguous().view(torch.int32)


@dataclass
class Asked:
    """The batch rows that asked, the most alternatives one of them asked for, their log-softmax [n, R, V]."""

    rows: list[int]
    k: int
    lsm: torch.Tensor | None = None
    every: bool = False  # every batch row asked: no gathering of rows, no scattering back

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The asking rows of a [B, ...] tensor."""
        return t if self.every else t.index_select(0, torch.tensor(self.rows, device=t.device))


def asked(step, logits: torch.Tensor, rows: list[int], parameter: str = "logprobs") -> Asked:
    """The rows whose request set `parameter` (the alternatives wanted)."""
    rows = [r for r in rows if getattr(step.plan.requests[r].params, parameter, None) is not None]
    if not rows:
        return Asked(rows, 0)
    k = max(getattr(step.plan.requests[r].params, parameter) for r in rows)
    a = Asked(rows, k, every=len(rows) == logits.shape[0])
    a.lsm = torch.log_softmax(a.take(logits).float(), -1)
    return a


def asked_causal(step) -> Asked:
    """The verifying rows that asked: their logit rows' distributions."""
    return asked(step, step.causal_logits, step.rows(DeviceWork.VERIFY))


def asked_block(step) -> Asked:
    """The filling rows (low_confidence) that asked: their block positions' distributions."""
    return asked(step, step.logits, step.rows(DeviceWork.FILL, with_block=True))


def asked_prompt(step) -> Asked:
    """The rows scoring a prompt chunk (`Rows.scored`, prompt logprobs): their logit rows' distributions."""
    rows = [r for r, row in enumerate(step.plan.rows) if row.scored]
    return asked(step, step.causal_logits, rows, "prompt_logprobs")


def prompt_columns(step, a: Asked) -> dict[str, torch.Tensor]:
    """`prompt_lp` [B, R] the log-probability of the prompt token each scoring logit row is followed by,
    `prompt_top_ids` / `prompt_top_lp` [B, R * k]."""
    if not a.rows:
        return {}
    return columns({"lp": pick(a.lsm, a.take(step.inputs["scored"]))}, a, step.causal_logits.shape[0], "prompt_")


def causal_columns(step, a: Asked, ar_tokens: torch.Tensor, sampled: torch.Tensor) -> dict[str, torch.Tensor]:
    """`lp_ar` [B, R] the AR token's log-probability per logit row, `lp_draft` [B, R - 1] the draft token's,
    `lp_bonus` [B, 1] the sampled bonus's at the row that drew it, `top_ids` / `top_lp` [B, R * k]."""
    if not a.rows:
        return {}
    R, lsm = ar_tokens.shape[1], a.lsm
    cols = {"lp_ar": pick(lsm, a.take(ar_tokens))}
    if R > 1:  # drafts under verification
        cols["lp_draft"] = pick(lsm[:, :R - 1], a.take(step.inputs["drafts"]).clamp_min(0))  # padding -1: unread
    if step.sampling(a.rows):  # a sampled bonus, drawn at row `accepted`
        drawn = a.take(sampled).long()
        at = drawn[:, :1].clamp(0, R - 1)
        cols["lp_bonus"] = lsm.gather(1, at[..., None].expand(-1, 1, lsm.shape[2]))[:, 0].gather(
            1, drawn[:, 1:].clamp_min(0))
    return columns(cols, a, ar_tokens.shape[0], "")


def block_columns(step, a: Asked, block: torch.Tensor) -> dict[str, torch.Tensor]:
    """`blk_lp` [B, N] the log-probability of each block position's token after the step (read for the
    positions the step filled), `blk_top_ids` / `blk_top_lp` [B, N * k]."""
    if not a.rows:
        return {}
    return columns({"lp": pick(a.lsm, a.take(block))}, a, block.shape[0], "blk_")


def pick(lsm: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """lsm [n, R, V] at ids [n, R]."""
    return lsm.gather(2, ids.long()[..., None])[..., 0]


def columns(cols: dict[str, torch.Tensor], a: Asked, B: int, prefix: str) -> dict[str, torch.Tensor]:
    """The asking rows' columns (plus their top k) scattered into [B, width] int32 columns named prefix+name."""
    if a.k:
        top = a.lsm.topk(a.k, -1)
        cols["top_ids"], cols["top_lp"] = top.indices.flatten(1), top.values.flatten(1)
    idx = None if a.every else torch.tensor(a.rows, device=a.lsm.device)
    out = {}
    for name, t in cols.items():
        if idx is not None:
            t = torch.zeros(B, t.shape[1], dtype=t.dtype, device=t.device).index_copy_(0, idx, t)
        out[prefix + name] = t.to(torch.int32) if name == "top_ids" else as_bits(t)
    return out

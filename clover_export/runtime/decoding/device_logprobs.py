"""The device side of logprobs (runtime/decoding/logprobs.py): the asking rows' log-softmax, the chosen
candidates' log-probabilities and the top k, as read-back columns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 bit patterns (read back with the step's int columns; `floats` undoes it)."""
    return t.float().contiguous().view(torch.int32)


@dataclass
class Asked:
    """The batch rows that verify and asked for logprobs, the most alternatives one of them asked for, and
    their logit rows' log-softmax [n, R, V] (taken before any logit hook or control changes the logits)."""

    rows: list[int]
    k: int
    lsm: torch.Tensor | None


def asked(step) -> Asked:
    rows = [r for r, (req, row) in enumerate(zip(step.plan.requests, step.plan.rows))
            if row.logit_rows and getattr(req.params, "logprobs", None) is not None]
    if not rows:
        return Asked(rows, 0, None)
    k = max(step.plan.requests[r].params.logprobs for r in rows)
    idx = torch.tensor(rows, device=step.causal_logits.device)
    return Asked(rows, k, torch.log_softmax(step.causal_logits.index_select(0, idx).float(), -1))


def causal_columns(step, a: Asked, ar_tokens: torch.Tensor, sampled: torch.Tensor) -> dict[str, torch.Tensor]:
    """Read-back columns for the asking rows (zeros elsewhere): `lp_ar` [B, R] the AR token's log-probability
    per logit row, `lp_draft` [B, R - 1] the draft token's, `lp_bonus` [B, 1] the sampled bonus's at the row
    that drew it, `top_ids` / `top_lp` [B, R * k]."""
    if not a.rows:
        return {}
    B, R = ar_tokens.shape
    device, lsm = ar_tokens.device, a.lsm
    idx = torch.tensor(a.rows, device=device)
    drafts = step.inputs["drafts"].long().index_select(0, idx).clamp_min(0)  # padding -1 -> any id, unread
    drawn = sampled.index_select(0, idx).long()
    at = drawn[:, :1].clamp(0, R - 1)
    cols = {"lp_ar": lsm.gather(2, ar_tokens.index_select(0, idx).long()[..., None])[..., 0],
            "lp_draft": lsm[:, :R - 1].gather(2, drafts[..., None])[..., 0],
            "lp_bonus": lsm.gather(1, at[..., None].expand(-1, 1, lsm.shape[2]))[:, 0]
            .gather(1, drawn[:, 1:].clamp_min(0))}
    if a.k:
        top = lsm.topk(a.k, -1)
        cols["top_ids"], cols["top_lp"] = top.indices.flatten(1), top.values.flatten(1)
    out = {}
    for name, t in cols.items():
        full = torch.zeros(B, t.shape[1], dtype=t.dtype, device=device)
        full.index_copy_(0, idx, t)
        out[name] = full.to(torch.int32) if name == "top_ids" else as_bits(full)
    return out

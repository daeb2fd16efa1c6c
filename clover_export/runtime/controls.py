"""Generation controls on block logits, per batch row, in the order of DECODING.md 3.

Everything stays on the logits' device and works in place on the [B, N, V]
logits without a full pass over the vocabulary: the count penalties touch
the seen tokens' columns, the ramps their token columns (end tokens,
`</think>`). Per-row parameters come from the runner's parameter table
(`RowParams`), so rows of one batch may use different values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# columns of the per-slot parameter table (float32 on the device)
COLUMNS = (
    "threshold", "temperature", "top_k", "top_p", "do_sample",
    "repetition_penalty", "frequency_penalty", "presence_penalty",
    "dllm_length_penalty", "dllm_length_penalty_start", "dllm_length_penalty_window",
    "dllm_think_end_bias", "dllm_think_end_start", "dllm_think_end_window", "enable_thinking",
    "min_tokens", "draft_threshold",
)
COL = {name: i for i, name in enumerate(COLUMNS)}


def param_row(settings) -> list[float]:
    """A GenerationSettings as one row of the parameter table."""
    return [float(getattr(settings, name)) for name in COLUMNS]


@dataclass
class RowParams:
    """Per-row parameters gathered for one step: each attribute a [B] float tensor."""

    table: torch.Tensor  # [B, len(COLUMNS)]

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in COL:
            return self.table[:, COL[name]]
        raise AttributeError(name)


def thinking_open(enable_thinking: bool, think_end_id: int | None, seen) -> bool:
    """DECODING.md 3: thinking is open while enable_thinking is on and `</think>` is not counted yet."""
    return bool(enable_thinking) and think_end_id is not None and think_end_id not in seen


def ramp(n: torch.Tensor, start: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """clamp((n - start) / window, 0, 1); n [B, N], start/window [B]."""
    return ((n - start[:, None]) / window[:, None]).clamp(0.0, 1.0)


def count_penalties_(l: torch.Tensor, seen_ids: torch.Tensor, seen_counts: torch.Tensor, p: RowParams) -> None:
    """Repetition, frequency and presence penalties of the seen tokens, on their gathered [B, N, K] columns."""
    B, N = l.shape[:2]
    idx = seen_ids[:, None, :].expand(B, N, -1)
    v = l.gather(2, idx)  # [B, N, K]
    c = seen_counts if seen_counts.dim() == 3 else seen_counts[:, None, :]
    rep = p.repetition_penalty[:, None, None]
    pen = torch.where(v > 0, v / rep, v * rep)
    pen = pen - p.frequency_penalty[:, None, None] * c
    pen = pen - p.presence_penalty[:, None, None]
    l.scatter_(2, idx, torch.where(c > 0, pen, v))


def apply_controls_(
    l: torch.Tensor,  # [B, N, V] fp32, mask token already -inf; modified in place
    seen_ids: torch.Tensor,  # [B, K] int64: tokens with count > 0 in the response so far, padded
    seen_counts: torch.Tensor,  # [B, K] or per position [B, N, K] fp32: their counts (0 = padding; a padding
    #                             id must not be a seen id)
    n: torch.Tensor,  # [B, N] fp32 response index of each position
    p: RowParams,
    end_ids: torch.Tensor,  # [B, E] int64 end-token ids of each row, -1 = padding
    think_end_id: int | None,
    thinking_open: torch.Tensor | None = None,  # [B] or per position [B, N] bool: enable_thinking and no
    #                                             </think> counted yet
) -> torch.Tensor:
    """The five controls of DECODING.md 3, in table order, in place; returns `l`. Then vLLM's
    `min_tokens`: end tokens get -inf at response positions n < min_tokens.

    The count penalties only change seen tokens, so they run on the gathered
    [B, N, K] columns and are scattered back (the host knows the response
    tokens; K is small next to the vocabulary). The ramps touch only their
    columns (end tokens, `</think>`).
    """
    B, N = n.shape
    if seen_ids.shape[1] > 0:
        count_penalties_(l, seen_ids, seen_counts, p)
    length = p.dllm_length_penalty[:, None] * ramp(n, p.dllm_length_penalty_start, p.dllm_length_penalty_window)
    valid = (end_ids >= 0).to(l.dtype)[:, None, :]  # [B, 1, E]
    l.scatter_add_(2, end_ids.clamp(min=0)[:, None, :].expand(B, N, -1), length[:, :, None] * valid)
    if think_end_id is not None and thinking_open is not None:
        bias = p.dllm_think_end_bias[:, None] * ramp(n, p.dllm_think_end_start, p.dllm_think_end_window)
        open_ = thinking_open if thinking_open.dim() == 2 else thinking_open[:, None]
        l[:, :, think_end_id] += bias * open_.to(l.dtype)
    early = (n < p.min_tokens[:, None])[:, :, None] & (end_ids >= 0)[:, None, :]  # [B, N, E]
    blocked = torch.where(early, float("-inf"), 0.0)  # padding adds 0 (to column 0)
    l.scatter_add_(2, end_ids.clamp(min=0)[:, None, :].expand(B, N, -1), blocked)
    return l

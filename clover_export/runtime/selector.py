"""One LowConfidence denoise step on the device, branch-free (DECODING.md 2).

`choose` turns block logits into a token and a confidence per position
(mask token excluded, controls applied, greedy or seeded sampling);
`fill` decides which masked positions take their token this step. Nothing
here reads a tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from clover_export.runtime.controls import RowParams, apply_controls_


def greedy(l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax (first index on ties, as torch.max documents) and its softmax probability
    (the fused softmax kernel is faster on CPU than max/exp/sum passes)."""
    tok = l.max(-1).indices
    return tok, torch.softmax(l, -1).gather(-1, tok[..., None]).squeeze(-1)


def sample(
    l: torch.Tensor,  # [R, N, V] controlled logits of the sampling rows
    temperature: torch.Tensor,  # [R]
    top_k: torch.Tensor,  # [R] (0 = off)
    top_p: torch.Tensor,  # [R]
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, then top-k, then top-p; draw from the renormalised result (DECODING.md 2.4-2.5).

    Sorting is stable (ties: lower id ranks first), so top-k keeps exactly k
    tokens and top-p keeps the shortest prefix reaching `top_p`, never less
    than the first token (a top_p under float32's range arrives as 0). The draw is
    an exponential race (argmax p / E, E ~ Exp(1) from the row's generator),
    which samples p exactly and uses a fixed amount of randomness per step.
    """
    R, N, V = l.shape
    l = l / temperature[:, None, None]
    sorted_l, order = torch.sort(l, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=l.device)
    k = top_k.long()[:, None, None]
    sorted_l = sorted_l.masked_fill((k > 0) & (rank >= k), float("-inf"))
    probs = torch.softmax(sorted_l, dim=-1)
    before = probs.cumsum(-1) - probs
    tp = top_p[:, None, None]
    sorted_l = sorted_l.masked_fill((tp < 1) & (before >= tp) & (rank > 0), float("-inf"))
    probs = torch.softmax(sorted_l, dim=-1)
    noise = torch.stack([torch.empty(N, V, device=l.device).exponential_(generator=g) for g in generators])
    j = (probs / noise).argmax(-1, keepdim=True)
    return order.gather(-1, j).squeeze(-1), probs.gather(-1, j).squeeze(-1)


def sampling_probs(
    l: torch.Tensor,  # [..., V] controlled logits
    temperature: torch.Tensor,  # [...] (the logits' leading dims) or broadcastable
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution `sample` draws from, in vocabulary order: temperature, then top-k, then top-p
    (stable sort: ties rank the lower id first), renormalised (DECODING.md 2.4). The lossless modes need it
    whole: speculative sampling compares two of them (runtime/decoding/speculative.py)."""
    V = l.shape[-1]
    l = l / temperature[..., None]
    sorted_l, order = torch.sort(l, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=l.device)
    k = top_k.long()[..., None]
    sorted_l = sorted_l.masked_fill((k > 0) & (rank >= k), float("-inf"))
    probs = torch.softmax(sorted_l, dim=-1)
    before = probs.cumsum(-1) - probs
    tp = top_p[..., None]
    sorted_l = sorted_l.masked_fill((tp < 1) & (before >= tp) & (rank > 0), float("-inf"))
    return torch.zeros_like(l).scatter_(-1, order, torch.softmax(sorted_l, dim=-1))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per leading position of `probs` [..., V]: the exponential race argmax p / E, E ~ Exp(1)
    from the generator (exact sampling with a fixed amount of randomness)."""
    noise = torch.empty(probs.shape, device=probs.device).exponential_(generator=generator)
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(-1)  # a zero draw must not make 0/0


@dataclass
class Controls:
    """What the generation controls read besides the logits and the parameter rows (DECODING.md 3)."""

    seen_ids: torch.Tensor  # [B, K] tokens counted in the response so far (padding: mask_id)
    seen_counts: torch.Tensor  # [B, K] their counts (padding: 0)
    n: torch.Tensor  # [B, N] response index of each position
    end_ids: torch.Tensor  # [B, E] end-token ids per row, -1 = padding
    think_end_id: int | None = None
    thinking_open: torch.Tensor | None = None  # [B] bool

    @classmethod
    def none(cls, rows: int, positions: int) -> Controls:
        """Nothing counted, no end token: the controls change no logit (tests, evaluation)."""
        empty = torch.zeros(rows, 0)
        return cls(empty.long(), empty, torch.zeros(rows, positions), torch.full((rows, 1), -1))


def choose(
    logits: torch.Tensor,  # [B, N, V] fp32
    c: Controls,
    p: RowParams,
    mask_id: int,
    sampling_rows: Sequence[int] = (),
    generators: Sequence[torch.Generator | None] = (),
    in_place: bool = False,  # True: `logits` may be overwritten (saves a copy)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-5 of DECODING.md 2 for every position: (token [B, N], confidence [B, N])."""
    l = logits if in_place and logits.dtype == torch.float32 else logits.float().clone()
    l[..., mask_id] = float("-inf")
    apply_controls_(l, c.seen_ids, c.seen_counts, c.n, p, c.end_ids, c.think_end_id, c.thinking_open)
    s_tok = None
    if sampling_rows:
        rows = torch.tensor(list(sampling_rows), device=l.device)
        sub = RowParams(p.table.index_select(0, rows))
        s_tok, s_conf = sample(l.index_select(0, rows), sub.temperature, sub.top_k, sub.top_p, generators)
    tok, conf = greedy(l)
    if s_tok is not None:
        tok = tok.index_copy(0, rows, s_tok)
        conf = conf.index_copy(0, rows, s_conf)
    return tok, conf


def fill(
    block: torch.Tensor,  # [B, N] current tokens, mask_id where masked
    tok: torch.Tensor,  # [B, N]
    conf: torch.Tensor,  # [B, N]
    threshold: torch.Tensor,  # [B]
    mask_id: int,
    active: torch.Tensor | None = None,  # [B] bool: rows denoising this step
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 6: fill masked positions with conf > threshold (strict), else the single most confident
    one (lowest index on ties). Returns (new block, newly filled mask)."""
    masked = block == mask_id
    if active is not None:
        masked = masked & active[:, None]
    take = masked & (conf > threshold[:, None])
    none = ~take.any(-1, keepdim=True)
    best = torch.where(masked, conf, torch.full_like(conf, -1.0)).argmax(-1, keepdim=True)
    pos = torch.arange(block.shape[1], device=block.device)
    take = take | (none & masked & (pos == best))
    return torch.where(take, tok.to(block.dtype), block), take

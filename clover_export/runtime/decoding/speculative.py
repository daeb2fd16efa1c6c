"""Speculative sampling, the device side of a sampled draft's verification (DECODING.md 5;
runtime/decoding/device.py runs it for `DeviceWork.VERIFY` rows; greedy rows: `ar.accept_greedy`).

`ar` and `self_spec` rows name the causal rows whose logits they read (`StepPlan.logit_rows`): the row of
the newest token not yet verified by a forward, then one row per draft token. Row i predicts the token at
response index len(response) + i, so its controls count the response plus the draft tokens before it.

- Greedy rows: the AR token of each row (mask token excluded, controls, argmax, lowest id on ties). The
  draft's longest prefix equal to those tokens is accepted, plus the AR token after it (`base.Verdict`).
- Sampling rows: speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Draft token x_i was drawn
  from q_i (the block's distribution at its position, after the same controls and sampling transforms); it
  is kept with probability min(1, p_i(x_i) / q_i(x_i)), p_i the AR distribution; the first rejected position
  draws from normalise(max(0, p_i - q_i)), and after a fully accepted draft the bonus token is drawn from p.
  The output is then distributed exactly as `ar` sampling.
"""

from __future__ import annotations

import torch

from clover_export.runtime.controls import RowParams
from clover_export.runtime.selector import draw, sampling_probs


def accept_sampled(
    p: torch.Tensor,  # [D + 1, V] the AR distribution of each logit row (after controls and sampling transforms)
    q: torch.Tensor,  # [D, V] the distribution each draft token was drawn from
    draft: torch.Tensor,  # [D] int64
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, bonus) as 0-d tensors, by speculative sampling's rule. Uses D uniforms and D + 1 races of
    the generator whatever the outcome, so a seeded request draws the same randomness per step."""
    D = draft.shape[0]
    u = torch.rand(D, device=p.device, generator=generator)
    if D:
        px = p[:D].gather(1, draft[:, None]).squeeze(1)
        qx = q.gather(1, draft[:, None]).squeeze(1)
        keep = u * qx < px  # u < p / q without dividing; q(x) > 0 for a drawn x
        residual = (p[:D] - q).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        # p == q leaves no residual, but then no token is ever rejected: fall back to p to stay finite
        residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p[:D])
        targets = torch.cat([residual, p[D:]], 0)
    else:
        keep = torch.zeros(0, dtype=torch.bool, device=p.device)
        targets = p
    drawn = draw(targets, generator)  # [D + 1]
    rejected = torch.cat([~keep, torch.ones(1, dtype=torch.bool, device=p.device)])
    accepted = rejected.int().argmax()  # the first rejection, or D
    return accepted, drawn[accepted]


def ar_distribution(l: torch.Tensor, params: RowParams) -> torch.Tensor:
    """p for every position of sampling rows: l [B, R, V] controlled logits, params of those B rows."""
    shape = l.shape[:2]
    return sampling_probs(l, params.temperature[:, None].expand(shape), params.top_k[:, None].expand(shape),
                          params.top_p[:, None].expand(shape))

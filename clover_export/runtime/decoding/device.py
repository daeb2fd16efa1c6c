"""The strategies' device work after the forward, batched over the step's rows (DECODING.md 2, 3, 5).

Each row takes part in the `DeviceWork` its strategy declares, in this order:
1. logit hooks: a strategy with `logit_hook` masks its rows' logits in place (`Strategy.mask_logits`);
2. VERIFY: the AR token of every logit row (controls counting the response plus the draft before it,
   argmax), and speculative sampling for sampling rows (runtime/decoding/speculative.py);
3. select: the controls and the LowConfidence choice on every row's block logits (greedy); SELECT rows
   that sample draw from their own generator, so a seeded request gives the same tokens whatever shares
   the step (DECODING.md 4);
4. DRAFT: the block's choice is the next draft; sampling rows draw it from q and keep q for the next VERIFY;
5. FILL: the LowConfidence fill of the block's masked positions.
`run` returns the read-back columns (runtime/step_io.py), or None when no row reads anything back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from clover_export.runtime.controls import RowParams, apply_controls_
from clover_export.runtime.decoding import device_logprobs, speculative
from clover_export.runtime.decoding.base import DeviceWork
from clover_export.runtime.selector import Controls, choose, draw, fill, sampling_probs

if TYPE_CHECKING:
    from clover_export.runtime.scheduler import StepPlan


@dataclass
class DeviceStep:
    """What the device work reads: the plan, the named upload (runtime/step_io.py) and the forward's logits."""

    plan: "StepPlan"
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor  # [B, N, V] block logits (logits_shift applied); controlled in place by `select`
    causal_logits: torch.Tensor  # [B, R, V] the logit rows' next-token logits
    params: RowParams  # the rows' parameter table
    end_ids: torch.Tensor  # [B, E]
    mask_id: int
    think_end_id: int | None
    generators: list  # per slot (the runner's)
    draft_q: dict[int, torch.Tensor] = field(default_factory=dict)  # per slot: q of its draft (DRAFT -> VERIFY)

    def rows(self, work: DeviceWork, with_block: bool = False) -> list[int]:
        """Batch rows whose strategy takes `work` (and that have block rows this step, if asked)."""
        plan = self.plan
        return [r for r, (req, row) in enumerate(zip(plan.requests, plan.rows))
                if req.strategy.takes(work) and (row.block is not None or not with_block)
                and (work is not DeviceWork.VERIFY or row.verified_rows)]

    def sampling(self, rows: list[int]) -> list[int]:
        return [r for r in rows if self.plan.requests[r].params.do_sample]

    def generator(self, r: int):
        return self.generators[self.plan.requests[r].slot]


def run(step: DeviceStep) -> dict[str, torch.Tensor] | None:
    """Every row's device work, in order; the named read-back columns ([B, width] each)."""
    verifying = step.rows(DeviceWork.VERIFY)
    prompt = device_logprobs.prompt_columns(step, device_logprobs.asked_prompt(step))  # raw logits'
    if not any(step.plan.has_block) and not verifying:  # prefill or commit rows only: their scores at most
        return prompt or None
    causal_lp, block_lp = device_logprobs.asked_causal(step), device_logprobs.asked_block(step)  # raw logits'
    apply_logit_hooks(step)
    ar_tokens, sampled = verify(step, verifying)
    tok, conf = select(step)
    draft(step, step.sampling(step.rows(DeviceWork.DRAFT, with_block=True)), tok, conf)
    block = fill_blocks(step, tok, conf)
    # the leading confident block positions after position 0: a drafting row's next draft (DECODING.md 5)
    lead = (conf[:, 1:] > step.params.draft_threshold[:, None]).int().cumprod(1).sum(1, keepdim=True)
    return {"block": block, "tokens": tok, "lead": lead, "ar_tokens": ar_tokens, "sampled": sampled,
            **device_logprobs.causal_columns(step, causal_lp, ar_tokens, sampled),
            **device_logprobs.block_columns(step, block_lp, block), **prompt}


def apply_logit_hooks(step: DeviceStep) -> None:
    """The hook for per-row logit masks (e.g. grammar-constrained decoding): before any control or choice."""
    for r, (req, rows) in enumerate(zip(step.plan.requests, step.plan.rows)):
        if req.strategy.logit_hook and (rows.verified_rows or rows.block is not None):
            req.strategy.mask_logits(req, step.logits[r], step.causal_logits[r])


def causal_controls(step: DeviceStep) -> Controls:
    """Controls of logit row i: counts of the response plus the draft's first i tokens, n = response
    length + i, thinking open until a `</think>` among those draft tokens (DECODING.md 3, 5)."""
    ids, counts = step.inputs["verify_ids"].long(), step.inputs["verify_counts"]
    drafts, state = step.inputs["drafts"].long(), step.inputs["verify_state"]
    B, K = ids.shape
    R = drafts.shape[1] + 1
    hits = (drafts[:, :, None] == ids[:, None, :]).float()  # [B, R - 1, K]
    before = torch.cat([torch.zeros(B, 1, K, device=ids.device), hits.cumsum(1)], 1)  # draft[:i] counts
    n = state[:, :1].float() + torch.arange(R, device=ids.device).float()
    think = state[:, 1:] != 0
    if step.think_end_id is not None:
        ended = (drafts == step.think_end_id).int().cumsum(1) > 0
        think = think & ~torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=ids.device), ended], 1)
    return Controls(ids, counts.float()[:, None, :] + before, n, step.end_ids, step.think_end_id,
                    think.expand(B, R))


def verify(step: DeviceStep, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The AR token of every logit row [B, R] (greedy), and per row (accepted, bonus) drawn by speculative
    sampling for sampling rows, (-1, -1) for the others (their acceptance is `ar.accept_greedy`'s)."""
    B, R = step.causal_logits.shape[:2]
    device = step.causal_logits.device
    sampled = torch.full((B, 2), -1, dtype=torch.int32, device=device)
    if not rows:
        return torch.zeros(B, R, dtype=torch.int32, device=device), sampled
    c = causal_controls(step)
    l = step.causal_logits.float().clone()
    l[..., step.mask_id] = float("-inf")
    apply_controls_(l, c.seen_ids, c.seen_counts, c.n, step.params, c.end_ids, c.think_end_id, c.thinking_open)
    for r in step.sampling(rows):
        sampled[r, 0], sampled[r, 1] = verify_sampled(step, r, l[r:r + 1])
    return l.max(-1).indices, sampled


def verify_sampled(step: DeviceStep, r: int, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of row r's draft against p, its AR distribution (l: its controlled logits [1, R, V])."""
    d = step.plan.rows[r].draft
    p = speculative.ar_distribution(l[:, :len(d) + 1], RowParams(step.params.table[r:r + 1]))[0]
    q = step.draft_q[step.plan.requests[r].slot][:len(d)] if d else p[:0]
    draft_ids = torch.tensor(d, dtype=torch.long, device=p.device)
    return speculative.accept_sampled(p, q, draft_ids, step.generator(r))


def select(step: DeviceStep) -> tuple[torch.Tensor, torch.Tensor]:
    """Controls and choice on every row's block logits (in place: the logits are ours until the next step)."""
    B, N = step.logits.shape[:2]
    n = (step.inputs["response_base"][:, None] + torch.arange(N, device=step.logits.device)).float()
    controls = Controls(step.inputs["seen_ids"].long(), step.inputs["seen_counts"].float(), n, step.end_ids,
                        step.think_end_id, step.inputs["thinking_open"] != 0)
    rows = step.sampling(step.rows(DeviceWork.SELECT, with_block=True))
    gens = [step.generator(r) for r in rows]
    return choose(step.logits, controls, step.params, step.mask_id, rows, gens, in_place=True)


def draft(step: DeviceStep, rows: list[int], tok: torch.Tensor, conf: torch.Tensor) -> None:
    """Sampling DRAFT rows' block choice: drawn from q, the block distribution after the controls and
    sampling transforms; q kept for the next step's verification; max q reported as the confidence (so the
    draft's length does not depend on what was drawn). Greedy rows keep `select`'s tokens."""
    N, p = step.plan.block_size, step.params
    for r in rows:
        q = sampling_probs(step.logits[r], p.temperature[r].expand(N), p.top_k[r].expand(N), p.top_p[r].expand(N))
        tok[r] = draw(q, step.generator(r))
        conf[r] = q.max(-1).values
        step.draft_q[step.plan.requests[r].slot] = q[1:]


def fill_blocks(step: DeviceStep, tok: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """FILL rows' blocks after the LowConfidence fill (DECODING.md 2 step 6); other rows' stay as they were."""
    plan, N = step.plan, step.plan.block_size
    block = step.inputs["input_ids"][:, plan.width - N:]
    active = torch.zeros(plan.batch, dtype=torch.bool)
    active[step.rows(DeviceWork.FILL, with_block=True)] = True
    new_block, _ = fill(block, tok, conf, step.params.threshold, step.mask_id, active.to(block.device))
    return new_block

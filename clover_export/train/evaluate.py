"""A minimal greedy LowConfidence block decoder for scoring a model (DECODING.md 2; issue 5).

Not the runtime: no penalties, no sampling, no streaming. It exists so that
training can score itself before `clover_export.runtime` is available, and as
an independent reference for it. Per batch row: the prompt is folded into the
first denoise step of block 0 (causal rows + block rows in one forward); the
commit of block b is folded into the first denoise step of block b + 1; a
block stops once an end token is filled with every position before it filled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from clover_export.model.model import CloverModel, allocate_pools
from clover_export.train.data import ChatCodec
from clover_export.train.tasks import Example, is_correct


@dataclass
class Decoded:
    token_ids: list[int]  # response, cut after the first end token (kept)
    steps: int  # denoise forwards (the folded prefill / commits included)
    blocks: int
    coreset_sizes: list[float] = field(default_factory=list)  # per step: |kept set| mean over layers

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(self.steps, 1)


def _block_done(block: torch.Tensor, mask_id: int, end_ids: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B] bool: no masks left, or an end token with every position before it filled."""
    filled = block != mask_id
    is_end = torch.isin(block, end_ids) & filled
    prefix_filled = filled.long().cumprod(dim=1).bool()
    return filled.all(dim=1) | (is_end & prefix_filled).any(dim=1)


@torch.no_grad()
def lowconf_step(logits: torch.Tensor, block: torch.Tensor, mask_id: int, threshold: float) -> torch.Tensor:
    """One greedy LowConfidence step on [B, N] blocks (DECODING.md 2; penalties off)."""
    logits = logits.clone()
    logits[..., mask_id] = float("-inf")
    conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)  # first maximum = lowest id on ties
    masked = block == mask_id
    conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
    fill = masked & (conf > threshold)
    best = conf.argmax(dim=1, keepdim=True)  # lowest index on ties
    none = ~fill.any(dim=1, keepdim=True) & masked.any(dim=1, keepdim=True)
    fill = fill | (none & torch.zeros_like(fill).scatter(1, best, True))
    return torch.where(fill, tok, block)


@torch.no_grad()
def generate(model: CloverModel, prompts: list[list[int]], threshold: float, end_ids: list[int],
             max_new_tokens: int = 32) -> list[Decoded]:
    """Greedy block decoding of a batch of prompts, all starting from empty caches."""
    cfg, N = model.cfg, model.block_size
    mask_id = cfg.require_mask_token()
    B = len(prompts)
    blocks_needed = -(-max_new_tokens // N)
    L = max(len(p) for p in prompts) + blocks_needed * N
    pools = list(allocate_pools(cfg, B, L, dtype=model.dtype).values())
    ends = torch.tensor(end_ids)
    C = max(len(p) for p in prompts)
    causal = torch.zeros(B, C, dtype=torch.long)
    for i, p in enumerate(prompts):
        causal[i, :len(p)] = torch.tensor(p)
    n_causal = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    past_len = torch.zeros(B, dtype=torch.int32)
    out = [Decoded([], 0, 0) for _ in prompts]
    active = torch.ones(B, dtype=torch.bool)
    slot_ids, has_block = torch.arange(B, dtype=torch.int32), torch.ones(B, dtype=torch.int32)
    for _ in range(blocks_needed):
        block = torch.full((B, N), mask_id, dtype=torch.long)
        done = ~active
        while not bool(done.all()):
            ids = torch.cat([causal, block], dim=1)
            logits, coreset, *pools = model(ids, n_causal, has_block, slot_ids, past_len, *pools)
            past_len, n_causal, causal = past_len + n_causal, torch.zeros_like(n_causal), causal[:, :0]
            block = torch.where(done.unsqueeze(1), block, lowconf_step(logits, block, mask_id, threshold))
            for i in torch.nonzero(~done).flatten().tolist():
                out[i].steps += 1
                out[i].coreset_sizes.append(coreset[i].float().mean().item())
            done = done | _block_done(block, mask_id, ends)
        for i in torch.nonzero(active).flatten().tolist():
            out[i].blocks += 1
            toks = block[i].tolist()
            hit = [j for j, t in enumerate(toks) if t in end_ids]
            out[i].token_ids += toks[: hit[0] + 1] if hit else toks
            if hit or len(out[i].token_ids) >= max_new_tokens:
                active[i] = False
                out[i].token_ids = out[i].token_ids[:max_new_tokens]
        if not bool(active.any()):
            break
        causal, n_causal = block, active.to(torch.int32) * N  # commit folded into the next block's first step
    return out


@dataclass
class Score:
    accuracy: float  # percent
    tokens_per_forward: float  # total response tokens / total denoise steps
    forwards_per_block: float
    experts_per_block: float  # mean |kept set| over layers and steps
    results: list[tuple[Example, str, bool]]

    def line(self) -> str:
        return (f"acc={self.accuracy:.1f}% tpf={self.tokens_per_forward:.2f} "
                f"fwd/block={self.forwards_per_block:.2f} experts/block={self.experts_per_block:.2f}")


def score(model: CloverModel, codec: ChatCodec, examples: list[Example], threshold: float = 0.95,
          enable_thinking: bool = False, batch_size: int = 64, max_new_tokens: int = 32) -> Score:
    """Decode every example and check its answer (exact match)."""
    end_ids = [codec.im_end, codec.eot]
    results, decoded = [], []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        outs = generate(model, [codec.prompt_ids(ex.prompt, enable_thinking) for ex in chunk], threshold,
                        end_ids, max_new_tokens)
        for ex, d in zip(chunk, outs):
            text = codec.tokenizer.decode([t for t in d.token_ids if t not in end_ids])
            results.append((ex, text, is_correct(ex, text)))
            decoded.append(d)
    tokens = sum(len(d.token_ids) for d in decoded)
    steps = sum(d.steps for d in decoded)
    sizes = [c for d in decoded for c in d.coreset_sizes]
    return Score(
        accuracy=100.0 * sum(r[2] for r in results) / len(results),
        tokens_per_forward=tokens / steps,
        forwards_per_block=steps / sum(d.blocks for d in decoded),
        experts_per_block=sum(sizes) / len(sizes),
        results=results,
    )


def load_for_eval(model_dir: str | Path, top_p: float | None = None, dtype=torch.float32) -> CloverModel:
    """The reference model of a folder, with the coreset top_p overridden when given."""
    from clover_export.checkpoint import load_state_dict
    from clover_export.config import load_config
    from clover_export.models import build_model

    cfg = load_config(model_dir)
    if top_p is not None:
        cfg = cfg.replace(moe_block_coreset_top_p=top_p)
    model = build_model(cfg, dtype, device="meta")
    model.load_state_dict(load_state_dict(Path(model_dir), cfg, dtype=dtype), strict=True, assign=True)
    return model.eval()

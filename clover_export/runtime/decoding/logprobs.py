"""Log-probabilities of the response tokens (docs/serving.md, Logprobs), for the rows that ask (`logprobs` set).

The causal model's distribution: the log-softmax of a logit row's raw logits, before any control or sampling
transform (vLLM's default). `ar` and `self_spec` read it at the causal row that verified or emitted each token,
so it is exact. The device computes it for the asking rows only and reads back per logit row the chosen
candidates' log-probabilities (the AR token's, the draft token's, a sampled bonus's) and the top-k ids and
log-probabilities: a few numbers per row, never a vocabulary-sized copy. Floats travel in the step's one int32
read-back bit for bit (`device_logprobs.as_bits`, `floats` here). This module is the host side (plain
Python); runtime/decoding/device_logprobs.py the device side.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One response token's log-probability and the `top` likeliest (id, log-probability), likeliest first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def floats(bits: list[int]) -> list[float]:
    return list(array("f", array("i", bits).tobytes()))


def verified(out, k: int, accepted: int, bonus: int, draft: list[int], sampled: bool) -> list[TokenLogprob]:
    """Each token a verifying step emitted (draft[:accepted], then bonus): its log-probability at its logit row
    and the row's top k."""
    top = tops(out.top_ids, out.top_lp, k, len(out.lp_ar)) or [[] for _ in out.lp_ar]
    got = [TokenLogprob(t, out.lp_draft[i], top[i]) for i, t in enumerate(draft[:accepted])]
    last = out.lp_bonus[0] if sampled else out.lp_ar[accepted]
    return got + [TokenLogprob(bonus, last, top[accepted])]


def tops(ids: list[int], lps: list[float], k: int, rows: int) -> list[list[tuple[int, float]]]:
    """Flat [rows * width] top columns as per row its first k [(id, log-probability)], likeliest first. The
    width is the most alternatives any request of the step asked for, which may be more than this one's k."""
    width = len(ids) // rows if rows else 0
    return [list(zip(ids[r * width:r * width + k], lps[r * width:r * width + k])) for r in range(rows)] if k else []


def filled(out, k: int, before: list[int], mask_id: int) -> dict[int, TokenLogprob]:
    """low_confidence: the block positions this step filled (masked before, a token after) with their
    token's log-probability in this step's block distribution and its top k."""
    top = tops(out.blk_top_ids, out.blk_top_lp, k, len(out.blk_lp))
    return {i: TokenLogprob(t, out.blk_lp[i], top[i] if k else [])
            for i, (was, t) in enumerate(zip(before, out.block)) if was == mask_id and t != mask_id}


def scored(out, k: int, tokens: list[int]) -> list[TokenLogprob]:
    """Prompt logprobs: each scoring logit row's next prompt token with its log-probability and the row's top k."""
    top = tops(out.prompt_top_ids, out.prompt_top_lp, k, len(out.prompt_lp))
    return [TokenLogprob(t, out.prompt_lp[i], top[i] if k else []) for i, t in enumerate(tokens)]

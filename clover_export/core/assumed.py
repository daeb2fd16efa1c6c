"""Every [assumed] part of Clover in one place (MODEL.md sections 3, 5.1-5.3).

The model card does not publish the exact math of Clover's block mixer, its
expert coreset or its extra tensors. This module is our documented reading of
them; adapting to the official checkpoint is a change to this file alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The math below imports torch where it runs, not here: the config's [assumed] defaults above are read by
# processes that load no model (the server's HTTP side, serve/engine_process.py), which import no torch.

# --- Config fields (MODEL.md 5.1), with their defaults -----------------------
LOGITS_SHIFT_DEFAULT = False  # block position i is predicted by the logits at i
BLOCK_ALIGNMENTS = ("prompt_end", "absolute")
BLOCK_ALIGNMENT_DEFAULT = "prompt_end"

# --- Extra tensors per GDN layer, under `L.linear_attn.` (MODEL.md 3) -------
# name -> shape as a function of (conv_dim C, kernel K, value heads Hv)
CLOVER_GDN_TENSORS = {
    "conv1d_right.weight": lambda C, K, Hv: (C, 1, K),
    "block_softmax_scale": lambda C, K, Hv: (Hv,),
    "block_softmax_gate": lambda C, K, Hv: (Hv,),
}


# --- Block mixer (MODEL.md 5.2) ----------------------------------------------
def anticausal_conv(m: torch.Tensor, w_right: torch.Tensor) -> torch.Tensor:
    """sum_j w_r[c, j] * m[c, t + j], zero beyond the block end.

    m: [B, N, C] pre-conv rows of the block; w_right: [C, K]. Returns [B, N, C].
    """
    import torch.nn.functional as F

    K = w_right.shape[-1]
    padded = F.pad(m.transpose(1, 2), (0, K - 1))  # [B, C, N + K - 1]
    return F.conv1d(padded, w_right.unsqueeze(1), groups=w_right.shape[0]).transpose(1, 2)


def block_conv_taps(w: torch.Tensor, w_right: torch.Tensor) -> torch.Tensor:
    """The block's causal conv (from the prefix state) plus `anticausal_conv`, as one depthwise kernel [C, 2K-1]
    over [state, block rows, K-1 zero rows]: w's first K-1 taps, then w's last plus w_right's first (both
    multiply the row itself), then w_right's others. The eager runtime's form: one conv in place of two and
    a sum, equal up to rounding."""
    import torch

    K = w.shape[-1]
    return torch.cat([w[:, :K - 1], w[:, K - 1:] + w_right[:, :1], w_right[:, 1:]], dim=1)


def block_mixer(
    q: torch.Tensor,  # [B, N, Hv, dk] L2-normalised, NOT yet scaled by dk^-1/2 (fp32)
    k: torch.Tensor,  # [B, N, Hv, dk] L2-normalised (fp32)
    v: torch.Tensor,  # [B, N, Hv, dv] (fp32)
    beta: torch.Tensor,  # [B, N, Hv] (fp32)
    g: torch.Tensor,  # [B, N, Hv] log-decay (fp32)
    s0: torch.Tensor,  # [B, Hv, dk, dv] recurrent state before the block (fp32)
    softmax_scale: torch.Tensor,  # [Hv]
    softmax_gate: torch.Tensor,  # [Hv]
) -> torch.Tensor:
    """Bidirectional read of one block against the prefix state (MODEL.md 5.2 steps 2-6).

    Returns o [B, N, Hv, dv] in fp32, before the gated norm.
    """
    import torch

    dk = q.shape[-1]
    G = torch.cumsum(g, dim=1)  # [B, N, Hv], inclusive
    decay = torch.exp(G).unsqueeze(-1)  # [B, N, Hv, 1]
    q_scaled = q * dk**-0.5
    # step 3: prefix read-out  o_pre_t = exp(G_t) S0^T q_t
    o_pre = decay * torch.einsum("bhkv,bnhk->bnhv", s0, q_scaled)
    # step 4: innovation  v'_s = v_s - exp(G_s) S0^T k_s
    v_innov = v - decay * torch.einsum("bhkv,bnhk->bnhv", s0, k)
    # step 5: softmax over all block positions, scale used as stored
    scores = torch.einsum("bthk,bshk->bhts", q, k) * softmax_scale.float().view(1, -1, 1, 1)
    attn = torch.softmax(scores, dim=-1)  # [B, Hv, N, N]
    o_blk = torch.einsum("bhts,bshv->bthv", attn, beta.unsqueeze(-1) * v_innov)
    # step 6
    return o_pre + torch.sigmoid(softmax_gate.float()).view(1, 1, -1, 1) * o_blk


# --- Block expert coreset (MODEL.md 5.3) --------------------------------------
def coreset_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Kept-expert mask of one block per batch row.

    probs: [B, N, E] router softmax (fp32) of the block positions.
    Returns bool [B, E]: the shortest prefix of experts sorted by aggregated
    top-k probability (ties: lower id first) whose cumulative sum reaches
    top_p of the total; always at least one expert.

    The boundary rule, one for torch, the ONNX body (`onnx_bodies.moe_body`)
    and the Triton kernel (`plugins/triton/moe.py`), so that they keep the same set
    even at exact ties (MODEL.md 5.3 step 3 made precise):
    - A_e: fp32 sum of the positions' top-k probabilities (the order over
      positions is not pinned: where those sums round, implementations may
      differ by an ulp before the rule applies); experts sorted by A_e
      descending, ties to the lower id: a_0 >= a_1 >= ...;
    - c_r = fl32(c_{r-1} + a_r): the fp32 running sum in that order, one
      rounding per addition (no wider accumulator, no tree);
    - target = fl32(fl32(top_p) * c_{E-1}) (the total is that same sum);
    - sorted position r is kept iff r = 0 or c_{r-1} < target;
    - top_p >= 1 also keeps every expert with A_e > 0: fp32 sums absorb tiny
      masses, and with top_p = 1 routing must equal plain top-k.
    """
    import torch

    from clover_export.core.sorting import stable_argsort_desc, stable_topk

    B, N, E = probs.shape
    top_vals, top_idx = stable_topk(probs, top_k)
    agg = torch.zeros(B, E, dtype=torch.float32, device=probs.device)
    agg = agg.scatter_add(1, top_idx.reshape(B, N * top_k), top_vals.reshape(B, N * top_k).float())
    order = stable_argsort_desc(agg)  # [B, E]
    sorted_agg = torch.gather(agg, 1, order)
    cum = fp32_running_sum(sorted_agg)
    target = top_p * cum[:, -1:]
    # keep sorted position r iff the prefix strictly before it is below the target
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    keep_sorted = (before < target) | (torch.arange(E, device=probs.device) == 0)
    if top_p >= 1.0:
        keep_sorted = keep_sorted | (sorted_agg > 0)
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def fp32_running_sum(x: torch.Tensor) -> torch.Tensor:
    """c_r = fl32(c_{r-1} + x_r) along the last dim (fp32 x). torch.cumsum accumulates in double on the CPU
    and by a parallel scan on CUDA; numpy's `add.accumulate` adds one element at a time in the array's dtype."""
    import numpy as np
    import torch

    return torch.from_numpy(np.add.accumulate(x.detach().float().cpu().numpy(), axis=-1)).to(x.device)

"""`attention_core` as two single-kernel steps: the contracts of BlockAttention's split-KV form on TensorRT.

A TensorRT AOT plugin is one kernel launch with no workspace, so the
flash-decoding split of the cached prefix (more programs when batch x heads
alone leave the GPU idle) is two plugins in `model.trt.onnx`, the partials a
graph tensor between them (STEP_GRAPH.md 2, 4):

- `split_core` (BlockAttentionSplit): the step's causal K/V written into the
  pools, and per split s of the visible prefix (the block's own K/V in the
  last split) the unnormalised partials in base 2, as the kernel keeps them,
  query row (b, t, h) of split s at row s * B * T + b * T + t:
  m = max of score * scale * log2(e), l = sum 2^(that - m), acc = sum
  2^(that - m) v. A split that sees nothing has m = -1e30, l = 0, acc = 0.
- `merge_core` (BlockAttentionMerge): o = sum_s 2^(m_s - M) acc_s / sum_s
  2^(m_s - M) l_s with M = max_s m_s, in q's dtype.

How the prefix is cut into splits is the kernel's choice (its tiles; the
count from `launch.attention_splits`); the split step outputs the count S and
the merge reads it. The kernels' partial buffers may hold more rows than
S * B * T (`launch.attention_partial_rows`: a bound TensorRT can size);
these references return exactly S * B * T. Composed they equal
`attention_core` for any cut.
"""

from __future__ import annotations

import torch

from clover_export.model.attention import write_causal_rows

LOG2E = 1.4426950408889634
EMPTY_MAX = -1.0e30  # the running maximum of a split that sees no position (finite: exp2 stays NaN-free)


def split_core(q, k, v, key_pool, value_pool, slot_ids, past_len, n_causal, block_size: int, scale: float,
               splits: int = 2):
    """Returns (acc [S B T, H, hd] fp32, ml [S B T, H, 2] fp32 (m, l), S as int32 [1], key_pool, value_pool) for
    S = `splits`: the prefix [0, L) cut into S equal ranges of positions, the block's own K/V in the last."""
    B, T, H, hd = q.shape
    Tc, N = T - block_size, block_size
    slot_ids = slot_ids.long()
    k_slot = write_causal_rows(key_pool, k[:, :Tc], slot_ids, past_len, n_causal)
    v_slot = write_causal_rows(value_pool, v[:, :Tc], slot_ids, past_len, n_causal)
    L = k_slot.shape[2]
    rep = H // k.shape[2]
    past, nc = past_len.long(), n_causal.long()
    rows = torch.arange(T, device=q.device)
    limit = torch.where((rows < Tc).unsqueeze(0), past.unsqueeze(1) + rows + 1, (past + nc).unsqueeze(1))  # [B, T]
    pos = torch.arange(L, device=q.device)
    keys = k_slot.float().repeat_interleave(rep, dim=1)  # [B, H, L, hd]
    vals = torch.where((pos < (past + nc).view(B, 1, 1)).unsqueeze(-1), v_slot.float(), 0).repeat_interleave(rep, 1)
    qf = q.float().transpose(1, 2)  # [B, H, T, hd]
    scores = (qf @ keys.transpose(-1, -2)) * (scale * LOG2E)  # [B, H, T, L]
    seen = (pos.view(1, 1, 1, L) < limit.view(B, 1, T, 1)).expand(B, H, T, L)
    bk = k[:, Tc:].float().transpose(1, 2).repeat_interleave(rep, dim=1)  # the block's K/V [B, H, N, hd]
    bv = v[:, Tc:].float().transpose(1, 2).repeat_interleave(rep, dim=1)
    b_scores = (qf @ bk.transpose(-1, -2)) * (scale * LOG2E)  # [B, H, T, N]
    b_seen = (rows >= Tc).view(1, 1, T, 1).expand(B, H, T, N)
    per = -(-L // splits)
    accs, mls = [], []
    for s in range(splits):
        cut = (pos >= s * per) & (pos < (s + 1) * per)
        sc, ok, vv = scores, seen & cut.view(1, 1, 1, L), vals
        if s == splits - 1:
            sc, ok, vv = torch.cat([sc, b_scores], -1), torch.cat([ok, b_seen], -1), torch.cat([vals, bv], 2)
        sc = sc.masked_fill(~ok, float("-inf"))
        m = sc.amax(-1).clamp(min=EMPTY_MAX)  # [B, H, T]
        p = torch.exp2(sc - m.unsqueeze(-1))
        accs.append((p @ vv).transpose(1, 2))  # [B, T, H, hd]
        mls.append(torch.stack([m, p.sum(-1)], -1).transpose(1, 2))  # [B, T, H, 2]
    new_k, new_v = key_pool.index_copy(0, slot_ids, k_slot), value_pool.index_copy(0, slot_ids, v_slot)
    count = torch.tensor([splits], dtype=torch.int32, device=q.device)
    return torch.stack(accs).flatten(0, 2), torch.stack(mls).flatten(0, 2), count, new_k, new_v


def merge_core(acc: torch.Tensor, ml: torch.Tensor, splits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """o [B, T, H, hd] in q's dtype from the first splits[0] x B x T rows of `split_core`'s partials (q gives the
    shape and dtype only)."""
    B, T, H, hd = q.shape
    S = int(splits.reshape(-1)[0])
    acc, ml = acc[:S * B * T].reshape(S, B, T, H, hd), ml[:S * B * T].reshape(S, B, T, H, 2)
    m, l = ml[..., 0], ml[..., 1]
    w = torch.exp2(m - m.amax(0, keepdim=True))  # [S, B, T, H]
    den = (w * l).sum(0)
    num = (w.unsqueeze(-1) * acc).sum(0)
    return (num / torch.where(den > 0, den, 1.0).unsqueeze(-1)).to(q.dtype)

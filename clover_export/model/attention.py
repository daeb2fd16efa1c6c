"""The attention core: step rows against the slot's cached K/V (MODEL.md 4, 5.1).

`attention_core` is the contract of the `clover::BlockAttention` op
(STEP_GRAPH.md 2). Causal row j of a batch row sees cached positions
< past_len and the step's causal rows <= j; block rows see every cached
position, the step's valid causal rows and the whole block. Causal rows'
K/V are written into the slot at positions past_len + j.
"""

from __future__ import annotations

import torch


def write_causal_rows(pool: torch.Tensor, new: torch.Tensor, slot_ids, past_len, n_causal) -> torch.Tensor:
    """Slots of `pool` [S, Hkv, L, hd] with `new` [B, Tc, Hkv, hd] written at past_len + j, j < n_causal.

    Returns the batch rows' updated slots [B, Hkv, L, hd].
    """
    slots = pool.index_select(0, slot_ids)
    B, Hkv, L, hd = slots.shape
    Tc = new.shape[1]
    if Tc == 0:
        return slots
    rel = torch.arange(L, device=pool.device).unsqueeze(0) - past_len.long().unsqueeze(1)  # [B, L]
    write = (rel >= 0) & (rel < n_causal.long().unsqueeze(1))
    src = rel.clamp(0, Tc - 1)[:, None, :, None].expand(B, Hkv, L, hd)
    gathered = torch.gather(new.transpose(1, 2).to(pool.dtype), 2, src)
    return torch.where(write[:, None, :, None], gathered, slots)


def attention_core(
    q: torch.Tensor,  # [B, T, H, hd] after q_norm and RoPE
    k: torch.Tensor,  # [B, T, Hkv, hd] after k_norm and RoPE
    v: torch.Tensor,  # [B, T, Hkv, hd]
    key_pool: torch.Tensor,  # [S, Hkv, L, hd]
    value_pool: torch.Tensor,  # [S, Hkv, L, hd]
    slot_ids: torch.Tensor,  # [B]
    past_len: torch.Tensor,  # [B]
    n_causal: torch.Tensor,  # [B]
    block_size: int,
    scale: float,
):
    """Returns (o [B, T, H, hd], new key_pool, new value_pool)."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    Tc, N = T - block_size, block_size
    slot_ids, past_len, n_causal = slot_ids.long(), past_len.long(), n_causal.long()
    k_slot = write_causal_rows(key_pool, k[:, :Tc], slot_ids, past_len, n_causal)
    v_slot = write_causal_rows(value_pool, v[:, :Tc], slot_ids, past_len, n_causal)
    L = k_slot.shape[2]

    keys = torch.cat([k_slot, k[:, Tc:].transpose(1, 2).to(k_slot.dtype)], dim=2)  # [B, Hkv, L+N, hd]
    vals = torch.cat([v_slot, v[:, Tc:].transpose(1, 2).to(v_slot.dtype)], dim=2)
    rows = torch.arange(T, device=q.device)
    causal_row = rows < Tc
    # visible cached positions p < limit: past_len + j + 1 for causal row j, past_len + n_causal for block rows
    limit = torch.where(causal_row.unsqueeze(0), past_len.unsqueeze(1) + rows + 1, (past_len + n_causal).unsqueeze(1))
    see_slot = torch.arange(L, device=q.device).view(1, 1, L) < limit.unsqueeze(-1)  # [B, T, L]
    see_block = (~causal_row).view(1, T, 1).expand(B, T, N)
    allowed = torch.cat([see_slot, see_block], dim=-1).unsqueeze(1)  # [B, 1, T, L+N]

    rep = H // Hkv  # q-head h uses kv-head floor(h * Hkv / H)
    keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    scores = (q.transpose(1, 2) @ keys.transpose(-1, -2).to(q.dtype)) * scale  # [B, H, T, L+N]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = (probs @ vals.to(q.dtype)).transpose(1, 2)  # [B, T, H, hd]
    new_k = key_pool.index_copy(0, slot_ids, k_slot)
    new_v = value_pool.index_copy(0, slot_ids, v_slot)
    return o, new_k, new_v

"""The attention core: step rows against the slot's cached K/V (MODEL.md 4, 5.1).

`attention_core` is the contract of the `clover::BlockAttention` op
(STEP_GRAPH.md 2), functional: it returns new pools. Causal row j of a batch
row sees cached positions < past_len and the step's causal rows <= j; block
rows see every cached position, the step's valid causal rows and the whole
block. Causal rows' K/V are written into the slot at positions past_len + j.

`attention_core_in_place` is the same op as the runtime runs it (STEP_GRAPH.md 1:
pools allocated once, read up to past_len, written in place): it writes the
causal rows' K/V into the pools where they belong and reads only the first
`read_len` positions of the rows' slots, so its cost does not depend on the
pools' capacity L.
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


def write_causal_rows_(pool: torch.Tensor, new: torch.Tensor, slot_ids, past_len, n_causal) -> None:
    """In place: pool[slot_ids[b], :, past_len[b] + j] = new[b, j] for j < n_causal[b] (nothing else is touched)."""
    B, Tc = new.shape[:2]
    if Tc == 0:
        return
    b, j = torch.nonzero(torch.arange(Tc, device=new.device).unsqueeze(0) < n_causal.long().unsqueeze(1), as_tuple=True)
    pool[slot_ids.long()[b], :, past_len.long()[b] + j] = new[b, j].to(pool.dtype)


def read_slots(pool: torch.Tensor, slot_ids: torch.Tensor, read_len: int) -> torch.Tensor:
    """The rows' slots' first `read_len` positions [B, Hkv, read_len, hd]: a view for one row, else a
    gather of exactly those positions (B x Hkv x read_len x hd elements)."""
    head = pool[:, :, :read_len]
    if slot_ids.shape[0] == 1 and not slot_ids.is_cuda:
        s = int(slot_ids[0])
        return head[s:s + 1]
    return head.index_select(0, slot_ids.long())


def attend(q, k, v, k_slot, v_slot, past_len, n_causal, block_size: int, scale: float) -> torch.Tensor:
    """Step rows against the rows' slots k_slot/v_slot [B, Hkv, L', hd] (causal rows already written,
    positions >= past_len + n_causal never read) plus the block's own K/V. Returns o [B, T, H, hd]."""
    B, T, H, hd = q.shape
    Tc, N = T - block_size, block_size
    past_len, n_causal = past_len.long(), n_causal.long()
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
    # positions past a row's valid prefix may hold anything (stale, NaN): zero them so 0 * NaN cannot leak
    pos = torch.arange(L + N, device=q.device).view(1, 1, L + N, 1)
    vals = torch.where((pos < (past_len + n_causal).view(B, 1, 1, 1)) | (pos >= L), vals, 0)

    rep = H // k.shape[2]  # q-head h uses kv-head floor(h * Hkv / H)
    keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    scores = (q.transpose(1, 2) @ keys.transpose(-1, -2).to(q.dtype)) * scale  # [B, H, T, L+N]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ vals.to(q.dtype)).transpose(1, 2)  # [B, T, H, hd]


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
    Tc = q.shape[1] - block_size
    slot_ids = slot_ids.long()
    k_slot = write_causal_rows(key_pool, k[:, :Tc], slot_ids, past_len, n_causal)
    v_slot = write_causal_rows(value_pool, v[:, :Tc], slot_ids, past_len, n_causal)
    o = attend(q, k, v, k_slot, v_slot, past_len, n_causal, block_size, scale)
    return o, key_pool.index_copy(0, slot_ids, k_slot), value_pool.index_copy(0, slot_ids, v_slot)


def attention_core_in_place(q, k, v, key_pool, value_pool, slot_ids, past_len, n_causal, block_size: int,
                            scale: float, read_len: int | None = None):
    """`attention_core` updating key_pool/value_pool in place; returns (o, key_pool, value_pool).

    Writes B x n_causal positions per pool; reads positions < read_len of the rows' slots, where
    read_len >= max(past_len + n_causal) (computed here, one host sync, when not given).
    """
    Tc = q.shape[1] - block_size
    write_causal_rows_(key_pool, k[:, :Tc], slot_ids, past_len, n_causal)
    write_causal_rows_(value_pool, v[:, :Tc], slot_ids, past_len, n_causal)
    if read_len is None:
        read_len = int((past_len.long() + n_causal.long()).max()) if q.shape[0] else 0
    o = attend(q, k, v, read_slots(key_pool, slot_ids, read_len), read_slots(value_pool, slot_ids, read_len),
               past_len, n_causal, block_size, scale)
    return o, key_pool, value_pool

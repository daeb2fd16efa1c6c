"""A torch-backend step costs what its rows compute and read, not the pools' capacity.

The same step at two pool capacities gives bit-identical logits, runs the same
ops on the same shapes (nothing sized by max_context is computed), writes only
the rows' new positions, and never reads past a row's valid prefix: everything
outside it is a NaN sentinel that must neither leak into the logits nor change.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.model.model import allocate_pools

SLOTS = 3


class ShapeLog(TorchDispatchMode):
    """Every non-mutating op of a step with its output shapes (in-place writes return their pool)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.ops.append((str(func), tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
        return out


def step_inputs(cfg, block: int, slot_ids, past_len, n_causal, C: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B = len(slot_ids)
    ids = torch.randint(0, cfg.vocab_size, (B, C + block), generator=gen, dtype=torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return {names.INPUT_IDS: ids, names.N_CAUSAL: i32(n_causal), names.HAS_BLOCK: i32([1] * B),
            names.SLOT_IDS: i32(slot_ids), names.PAST_LEN: i32(past_len),
            names.LOGIT_ROWS: i32([[max(n - 1, 0), 0] for n in n_causal])}  # the last valid causal row, row 0


def sentinel_pools(cfg, capacity: int, slot_ids, past_len, seed: int = 1) -> dict[str, torch.Tensor]:
    """NaN everywhere except the used slots' valid prefixes and states (random, the same at any capacity)."""
    gen = torch.Generator().manual_seed(seed)
    pools = allocate_pools(cfg, SLOTS, capacity)
    for name, pool in pools.items():
        pool.fill_(float("nan"))
        for s, p in zip(slot_ids, past_len):
            if name.endswith((".key", ".value")):
                pool[s, :, :p] = torch.randn(pool[s, :, :p].shape, generator=gen)
            else:
                pool[s] = 0.5 * torch.randn(pool[s].shape, generator=gen)
    return pools


CASES = {  # slot_ids, past_len, n_causal, causal rows C
    "two rows, different lengths": ([2, 0], [5, 9], [3, 1], 3),
    "one row, block only": ([1], [7], [0], 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_step_at_two_capacities(tiny_model, case):
    slot_ids, past_len, n_causal, C = CASES[case]
    backend = TorchBackend(tiny_model)
    cfg, N = backend.cfg, backend.block_size
    inputs = step_inputs(cfg, N, slot_ids, past_len, n_causal, C)
    results = {}
    for capacity in (64, 640):
        before = sentinel_pools(cfg, capacity, slot_ids, past_len)
        pools = {k: v.clone() for k, v in before.items()}
        with ShapeLog() as log:
            res = backend.step(inputs, pools)
        logits, coreset, after = res
        assert all(after[k] is pools[k] for k in pools)  # updated in place
        assert torch.isfinite(logits).all() and torch.isfinite(res.causal_logits).all()
        for name, pool in after.items():
            expect = before[name].clone()
            for b, s in enumerate(slot_ids):
                if name.endswith((".key", ".value")):  # only the new causal positions were written
                    new = pool[s, :, past_len[b]:past_len[b] + n_causal[b]]
                    assert torch.isfinite(new).all()
                    expect[s, :, past_len[b]:past_len[b] + n_causal[b]] = new
                else:
                    assert torch.isfinite(pool[s]).all()
                    expect[s] = pool[s]
            torch.testing.assert_close(pool, expect, rtol=0, atol=0, equal_nan=True)
        results[capacity] = logits.clone(), coreset.clone(), log.ops, res.causal_logits.clone()
    (l1, c1, ops1, r1), (l2, c2, ops2, r2) = results.values()
    assert torch.equal(l1, l2) and torch.equal(c1, c2) and torch.equal(r1, r2)
    assert ops1 == ops2  # the same work, whatever the capacity


def test_in_place_step_equals_the_functional_contract(tiny_model):
    """The backend's in-place cores give the model's functional cores' logits and pools (finite pools)."""
    slot_ids, past_len, n_causal, C = CASES["two rows, different lengths"]
    backend = TorchBackend(tiny_model)
    inputs = step_inputs(backend.cfg, backend.block_size, slot_ids, past_len, n_causal, C, seed=3)
    pools = {k: torch.nan_to_num(v, nan=0.25) for k, v in sentinel_pools(backend.cfg, 32, slot_ids, past_len).items()}
    with torch.inference_mode():
        ref = tiny_model.step(inputs, {k: v.clone() for k, v in pools.items()})
    ref_logits, ref_coreset, ref_pools = ref
    res = backend.step(inputs, pools)
    logits, coreset, new_pools = res
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.causal_logits, ref.causal_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(coreset, ref_coreset)
    for k in ref_pools:  # the gathered MoE sums the experts in another order: fp32 rounding, as the logits
        torch.testing.assert_close(new_pools[k], ref_pools[k], rtol=1e-5, atol=1e-5)

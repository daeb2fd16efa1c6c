"""`causal_logits` (STEP_GRAPH.md 6): the next-token logits of the causal rows a step's `logit_rows` names are
the upstream causal model's, i.e. the lm_head over the hidden state a plain causal forward (`trunk`, no block)
gives that row, whatever the step's block, chunking, batch neighbours or cache."""

from __future__ import annotations

import torch

from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.model.model import allocate_pools


def plain_causal_logits(model, ids: list[int]) -> torch.Tensor:
    """[P, V]: the lm_head over every row of one cache-free causal forward of `ids` (no block)."""
    N, P = model.block_size, len(ids)
    pools = allocate_pools(model.cfg, 1, P)
    one = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    x = torch.tensor([list(ids) + [0] * N], dtype=torch.int32)
    with torch.no_grad():
        h, _, _ = model.trunk(x, one(P), one(0), one(0), one(0), *pools.values())
        return model.logits(h[0, :P])


def test_causal_logits_are_the_plain_causal_forward_at_each_row(model):
    """Two prompts played in two chunks, each folded with a masked block, rows in different phases; the
    causal logits of the rows asked for equal the plain causal forward's at the same positions."""
    N, mask = model.block_size, model.cfg.mask_token_id
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 500, (12,), generator=g).tolist(), torch.randint(6, 500, (5,), generator=g).tolist()]
    want = [plain_causal_logits(model, p) for p in prompts]
    backend = TorchBackend(model, in_place=False)
    pools = backend.allocate_pools(3, 64)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    # (chunks per prompt as (start, length), rows asked per batch row as offsets into the chunk)
    steps = [((0, 7), (0, 5), [[6, 0, 3], [4, 1, 2]]), ((7, 5), (5, 0), [[4, 2, 0], [None] * 3])]
    checked = 0
    for (s0, n0), (s1, n1), rows in steps:
        C = max(n0, n1)
        ids = torch.full((2, C + N), mask, dtype=torch.int32)
        ids[0, :n0] = i32(prompts[0][s0:s0 + n0])
        ids[1, :n1] = i32(prompts[1][s1:s1 + n1])
        asked = [[C if r is None else r for r in row] for row in rows]  # a row without causal rows: a block row
        inputs = {names.INPUT_IDS: ids, names.N_CAUSAL: i32([n0, n1]), names.HAS_BLOCK: i32([1, 1]),
                  names.SLOT_IDS: i32([2, 0]), names.PAST_LEN: i32([s0, s1]), names.LOGIT_ROWS: i32(asked)}
        res = backend.step(inputs, pools)
        pools = res[2]
        assert res.causal_logits.shape == (2, 3, model.cfg.vocab_size) and res.causal_logits.dtype == torch.float32
        for b, (start, row) in enumerate(((s0, rows[0]), (s1, rows[1]))):
            for r, j in enumerate(row):
                if j is None:
                    continue
                torch.testing.assert_close(res.causal_logits[b, r], want[b][start + j], atol=1e-4, rtol=1e-4,
                                           msg=lambda m, b=b, j=j: f"batch row {b}, causal row {start + j}: {m}")
                checked += 1
    assert checked == 9


def test_without_logit_rows_the_step_returns_row_0(model):
    """A step whose inputs lack `logit_rows` returns the logits of causal row 0 (R = 1)."""
    N = model.block_size
    ids = torch.randint(6, 500, (1, 4 + N), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    inputs = {names.INPUT_IDS: ids, names.N_CAUSAL: i32([4]), names.HAS_BLOCK: i32([1]), names.SLOT_IDS: i32([0]),
              names.PAST_LEN: i32([0])}
    backend = TorchBackend(model, in_place=False)
    pools = backend.allocate_pools(1, 16)
    res = backend.step(inputs, pools)
    with_row = backend.step({**inputs, names.LOGIT_ROWS: i32([[0]])}, pools)
    assert res.causal_logits.shape == (1, 1, model.cfg.vocab_size)
    assert torch.equal(res.causal_logits, with_row.causal_logits)
    torch.testing.assert_close(res.causal_logits[0, 0], plain_causal_logits(model, ids[0, :4].tolist())[0],
                               atol=1e-4, rtol=1e-4)

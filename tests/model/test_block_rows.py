"""Block rows of a step against a literal reference (MODEL.md 5.1-5.3).

`reference_literal.py` re-derives one full step formula by formula (per
token, per head, conv taps and the delta rule as explicit loops, the coreset
with Python sorting); here the package's `CloverModel.forward` must agree
with it on block logits, coreset sizes and caches, starting from non-empty
caches. Then the step semantics: block rows never write a cache, a causal +
block step equals a causal step followed by a block-only step, and batch
rows in different phases do not disturb each other.
"""

from __future__ import annotations

import pytest
import torch
from reference_literal import literal_step

from clover_export.model.loading import build_model
from clover_export.model.model import allocate_pools, init_random_
from clover_export.tiny import tiny_config

LIN, FULL = "linear_attention", "full_attention"
N = 8  # block size of the test model
NUM_SLOTS = 4


@pytest.fixture(scope="module")
def model():
    """A small random Clover model whose every tensor matters (dk != dv, GQA 2, Hv/Hk 2, a peaked router)."""
    cfg = tiny_config(
        hidden_size=64, num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        block_size=N, moe_block_coreset_top_p=0.9,
    )
    m = init_random_(build_model(cfg), seed=3, std=0.15).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)  # peaked router: the coreset drops experts
            if name == "lm_head.weight":
                p.mul_(0.5)
    return m


def ints(*v):
    return torch.tensor(v, dtype=torch.int32)


def run(model, ids, n_causal, has_block, slots, past_len, pools):
    with torch.no_grad():
        out = model(ids, n_causal, has_block, slots, past_len, torch.zeros_like(slots)[:, None], *pools)
    return out[0], out[1], list(out[2:-1])


def literal(model, ids, n_causal, has_block, slots, past_len, pools):
    return literal_step(
        model.cfg, model.state_dict(), model.block_size, ids, n_causal, has_block, slots, past_len, pools
    )


def random_ids(gen, B, T, vocab):
    return torch.randint(0, vocab, (B, T), generator=gen, dtype=torch.int64).to(torch.int32)


def assert_pools_close(got, want, tol, what):
    """Max error relative to the pool's scale (at least 1)."""
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())
        assert err <= tol, f"{what}: pool {i} differs by {err} (relative to its scale)"


def assert_pools_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (
            f"{what}: pool {i} not bit-exact (max diff {(a.float() - b.float()).abs().max().item()})"
        )


def filled_pools(model, gen, slots=(2, 0), lengths=(11, 6)):
    """Pools after one prefill-only step (no block) of the given lengths into the given slots."""
    cfg = model.cfg
    pools = list(allocate_pools(cfg, NUM_SLOTS, 64).values())
    C = max(lengths)
    ids = random_ids(gen, len(slots), C + N, cfg.vocab_size)
    zeros = torch.zeros(len(slots), dtype=torch.int32)
    _, _, pools = run(model, ids, ints(*lengths), zeros, ints(*slots), zeros, pools)
    return pools


def test_block_logits_match_literal_from_nonempty_caches(model):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    pools = list(allocate_pools(cfg, NUM_SLOTS, 64).values())
    lit_pools = [p.clone() for p in pools]
    slots = ints(2, 0)
    errs = {}

    # 1. prefill only (has_block = 0): caches of both implementations agree
    ids = random_ids(gen, 2, 11 + N, cfg.vocab_size)
    n_causal, has_block, past = ints(11, 6), ints(0, 0), ints(0, 0)
    logits, sizes, pools = run(model, ids, n_causal, has_block, slots, past, pools)
    _, lit_sizes, lit_pools = literal(model, ids, n_causal, has_block, slots, past, lit_pools)
    assert_pools_close(pools, lit_pools, 5e-5, "prefill caches")
    assert sizes.eq(0).all() and lit_sizes.eq(0).all(), "coreset_size must be 0 for rows without a block"

    # 2. commit folded into a denoise step (row 0) and a plain denoise step (row 1), non-empty caches
    past = past + n_causal
    ids = random_ids(gen, 2, 4 + N, cfg.vocab_size)
    ids[:, 4 + 2:] = cfg.mask_token_id  # a partly masked block
    n_causal, has_block = ints(3, 0), ints(1, 1)
    logits, sizes, pools = run(model, ids, n_causal, has_block, slots, past, pools)
    lit_logits, lit_sizes, lit_pools = literal(model, ids, n_causal, has_block, slots, past, lit_pools)
    errs["mixed step"] = (logits - lit_logits).abs().max().item()
    assert torch.equal(sizes, lit_sizes), f"coreset sizes {sizes.tolist()} != literal {lit_sizes.tolist()}"
    assert_pools_close(pools, lit_pools, 5e-5, "caches after the mixed step")

    # 3. block only, no causal columns at all (C = 0)
    past = past + n_causal
    ids = random_ids(gen, 2, N, cfg.vocab_size)
    logits3, sizes3, _ = run(model, ids, ints(0, 0), has_block, slots, past, pools)
    lit_logits3, lit_sizes3, _ = literal(model, ids, ints(0, 0), has_block, slots, past, lit_pools)
    errs["block-only step"] = (logits3 - lit_logits3).abs().max().item()
    assert torch.equal(sizes3, lit_sizes3)

    print(
        f"max |logits - literal|: {errs}; logits scale {lit_logits.abs().max().item():.2f}; "
        f"coreset sizes {sizes.tolist()}"
    )
    for what, err in errs.items():
        assert err < 1e-4, f"{what}: block logits differ from the literal reference by {err}"
    # the test exercises the coreset: some layer keeps fewer experts than the block's plain top-k union
    assert (sizes < cfg.num_experts).any()


def test_block_rows_leave_caches_bit_exact(model):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    pools = filled_pools(model, gen)
    slots, past = ints(2, 0), ints(11, 6)
    for C in (0, 3):  # no causal columns, or only padding ones (garbage ids)
        ids = random_ids(gen, 2, C + N, cfg.vocab_size)
        _, _, new = run(model, ids, ints(0, 0), ints(1, 1), slots, past, pools)
        assert_pools_equal(new, pools, f"block-only step with C={C}")


def test_causal_plus_block_equals_causal_step_then_block_step(model):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(2)
    pools = filled_pools(model, gen)
    slots, past = ints(2, 0), ints(11, 6)
    causal = random_ids(gen, 2, 5, cfg.vocab_size)
    block = random_ids(gen, 2, N, cfg.vocab_size)
    other_block = random_ids(gen, 2, N, cfg.vocab_size)
    n_causal = ints(5, 2)

    folded_logits, _, folded_pools = run(model, torch.cat([causal, block], 1), n_causal, ints(1, 1), slots, past, pools)
    # the same causal rows with a different block: the block never reaches the caches
    _, _, causal_pools = run(model, torch.cat([causal, other_block], 1), n_causal, ints(1, 1), slots, past, pools)
    assert_pools_equal(causal_pools, folded_pools, "caches after causal rows with different blocks")
    # then the block alone from the caches the causal rows left
    block_logits, _, block_pools = run(model, block, ints(0, 0), ints(1, 1), slots, past + n_causal, causal_pools)
    err = (block_logits - folded_logits).abs().max().item()
    print(f"folded vs separate block step: max |dlogits| = {err:.2e}")
    assert err < 1e-5
    assert_pools_equal(block_pools, causal_pools, "block-only step after the causal step")


def test_rows_in_different_phases_match_alone(model):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(3)
    pools = list(allocate_pools(cfg, NUM_SLOTS, 64).values())
    # rows 1 and 2 already hold a prefix; row 0 starts from an empty slot
    zeros = torch.zeros(2, dtype=torch.int32)
    _, _, pools = run(model, random_ids(gen, 2, 9 + N, cfg.vocab_size), ints(9, 4), zeros, ints(1, 0), zeros, pools)

    # row 0: prefill chunk only; row 1: commit + denoise; row 2: denoise only
    slots, past, n_causal, has_block = ints(3, 1, 0), ints(0, 9, 4), ints(6, 2, 0), ints(0, 1, 1)
    C = 6
    ids = random_ids(gen, 3, C + N, cfg.vocab_size)
    logits, sizes, new = run(model, ids, n_causal, has_block, slots, past, pools)
    for r in range(3):
        nc = int(n_causal[r])
        alone_ids = torch.cat([ids[r:r + 1, :nc], ids[r:r + 1, C:]], 1)  # no padding columns when alone
        a_logits, a_sizes, a_new = run(model, alone_ids, n_causal[r:r + 1], has_block[r:r + 1], slots[r:r + 1],
                                       past[r:r + 1], pools)
        if has_block[r]:
            err = (logits[r] - a_logits[0]).abs().max().item()
            # fp32 noise only: padding changes the matmul shapes, hence the summation order (seen: 1.2e-5)
            assert err < 1e-4 * max(1.0, logits[r].abs().max().item()), (
                f"row {r}: batched vs alone logits differ by {err}"
            )
        assert torch.equal(sizes[r], a_sizes[0]), f"row {r}: coreset sizes {sizes[r].tolist()} vs {a_sizes[0].tolist()}"
        s = int(slots[r])
        assert_pools_close([p[s] for p in new], [p[s] for p in a_new], 1e-6, f"row {r} slot {s}")
    # the slot nobody owns this step is untouched
    assert_pools_equal([p[2] for p in new], [p[2] for p in pools], "unused slot 2")

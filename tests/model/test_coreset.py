"""Block expert coreset and MoE routing within it (MODEL.md 5.3), against `reference_literal`.

Property tests on `assumed.coreset_mask` with random router probabilities
(softmax ones, and quantized ones full of exact ties): enough mass, minimal,
never empty, a prefix of the sorted order with ties to the lower id, equal
to the literal Python implementation. Then `moe_core`: block rows route
only inside the kept set, weights renormalised, the distinct-expert count
matches; with top_p = 1.0 the coreset changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from reference_literal import aggregate, literal_distinct, order_desc, top_k_experts
from reference_literal import coreset as literal_coreset

from clover_export.core.assumed import coreset_mask
from clover_export.model.loading import build_model
from clover_export.model.model import allocate_pools, init_random_
from clover_export.model.moe import moe_core, route
from clover_export.tiny import tiny_config

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def block_probs(draw, max_b=3, max_n=8, max_e=12):
    """(probs [B, N, E] fp32, top_k, top_p): softmax rows, or quantized rows with many exact ties."""
    B, N, E = draw(st.integers(1, max_b)), draw(st.integers(1, max_n)), draw(st.integers(1, max_e))
    k = draw(st.integers(1, min(E, 4)))
    if draw(st.booleans()):
        logits = draw(arrays(np.float32, (B, N, E), elements=st.floats(-6, 6, width=32)))
        probs = torch.softmax(torch.from_numpy(logits), dim=-1)
    else:
        # multiples of 1/64, strictly positive like a softmax: every fp32 sum here is exact
        levels = draw(st.integers(1, 6))
        q = draw(arrays(np.int64, (B, N, E), elements=st.integers(1, levels)))
        probs = torch.from_numpy(q).float() / 64
    top_p = draw(st.one_of(st.sampled_from([0.5, 0.9, 1.0]), st.floats(0.01, 1.0)))
    return probs, k, top_p


def kept_ids(mask_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask_row).flatten().tolist())


@PROPERTY
@given(block_probs())
def test_coreset_mask_properties_and_literal(case):
    probs, k, top_p = case
    mask = coreset_mask(probs, k, top_p)
    assert mask.dtype == torch.bool and mask.shape == (probs.shape[0], probs.shape[2])
    assert torch.equal(mask, coreset_mask(probs.clone(), k, top_p)), "not deterministic"
    for b in range(probs.shape[0]):
        rows = list(probs[b])
        A = [float(a) for a in aggregate(rows, k)]
        order = order_desc(A)  # by mass descending, ties: lower id first
        kept = kept_ids(mask[b])
        m = len(kept)
        assert m >= 1, "the coreset is never empty"
        assert kept == set(order[:m]), f"kept {sorted(kept)} is not a prefix of the sorted order {order}"
        assert kept == set(literal_coreset(rows, k, top_p)), "differs from the literal implementation"
        total = sum(A)
        mass = sum(A[e] for e in kept)
        if top_p >= 1.0:
            assert kept == ({e for e in order if A[e] > 0} or {order[0]})
            continue
        assert mass >= top_p * total * (1 - 1e-6), f"kept mass {mass} < top_p * total = {top_p * total}"
        if m > 1:  # minimal: without the last kept expert the target is missed
            assert mass - A[order[m - 1]] < top_p * total * (1 + 1e-6)


def test_coreset_ties_go_to_the_lower_id():
    E = 8
    flat = torch.full((1, 1, E), 1.0 / E)
    # one position, top-8 of a flat distribution: all masses equal, the lower ids win
    assert kept_ids(coreset_mask(flat, 8, 0.5)[0]) == {0, 1, 2, 3}
    assert literal_coreset(list(flat[0]), 8, 0.5) == [0, 1, 2, 3]
    # top-2 of a flat distribution picks experts 0 and 1; half the mass is expert 0
    assert kept_ids(coreset_mask(flat, 2, 0.5)[0]) == {0}
    # equal masses split over positions: experts 5 and 2 each get 0.5, expert 2 sorts first
    probs = torch.zeros(1, 2, E)
    probs[0, 0, 5] = probs[0, 1, 2] = 0.5
    probs[0, 0, 0] = probs[0, 1, 7] = 0.25
    assert kept_ids(coreset_mask(probs, 1, 0.5)[0]) == {2}


def test_target_exactly_on_a_prefix_sum():
    """A_1 = A_2 + A_0 exactly, so top_p = 0.5 puts the target on the first prefix sum.

    The decision then rests on how the fp32 prefix sums are accumulated. The
    rule (assumed.coreset_mask) is one fp32 rounding per addition, which ONNX's
    CumSum and the Triton kernel can follow: the total comes out one ulp above
    A_0 + A_1 + A_2, the target above the first prefix sum, and {1, 2} is kept.
    torch's CPU cumsum (float64 accumulator, fp32-rounded outputs) would keep {1}.
    """
    probs = torch.tensor([[[0.2771241069, 0.3614379764, 0.3614379764], [1 / 3, 1 / 3, 1 / 3]]])
    assert kept_ids(coreset_mask(probs, 2, 0.5)[0]) == {1, 2}
    assert literal_coreset(list(probs[0]), 2, 0.5) == [1, 2]


def test_running_sum_rounds_once_per_addition():
    """Hand-computed: A = [1, 2^-24, 2^-24, 2^-24]. One fp32 rounding per addition absorbs every 2^-24
    (1 + 2^-24 is a tie, rounded to even 1), so the total is 1 and, at top_p = 1 - 2^-24, the target
    1 - 2^-24 is already reached by expert 0 alone. A wider accumulator would reach 1 + 2^-22, a target
    of 1 + 2^-23, and keep {0, 1, 2}. top_p = 1 keeps every expert with mass (plain top-k)."""
    probs = torch.zeros(1, 4, 4)
    probs[0, 0, 0] = 1.0
    for j in (1, 2, 3):
        probs[0, j, j] = 2.0**-24
    top_p = float(np.float32(1 - 2.0**-24))
    assert kept_ids(coreset_mask(probs, 1, top_p)[0]) == {0}
    assert literal_coreset(list(probs[0]), 1, top_p) == [0]
    assert kept_ids(coreset_mask(probs, 1, 1.0)[0]) == {0, 1, 2, 3}
    assert kept_ids(coreset_mask(probs, 1, 0.5)[0]) == {0}


def test_top_p_one_keeps_experts_with_tiny_mass():
    """fp32 prefix sums absorb masses below an ulp of the total; top_p = 1.0 must still keep them."""
    probs = torch.zeros(1, 2, 4)
    probs[0, 0, :2] = 0.5
    probs[0, 1, 2], probs[0, 1, 3] = 2.0**-26, 2.0**-27
    assert kept_ids(coreset_mask(probs, 2, 1.0)[0]) == {0, 1, 2, 3}
    allowed = coreset_mask(probs, 2, 1.0).unsqueeze(1).expand(-1, 2, -1)
    dense, _ = route(probs, allowed, 2)
    plain, _ = route(probs, torch.ones_like(allowed), 2)
    assert torch.equal(dense, plain)


@PROPERTY
@given(block_probs())
def test_routing_stays_inside_the_kept_set(case):
    probs, k, top_p = case
    B, N, E = probs.shape
    keep = coreset_mask(probs, k, top_p)
    dense, chosen = route(probs, keep.unsqueeze(1).expand(B, N, E), k)
    for b in range(B):
        allowed = kept_ids(keep[b])
        for t in range(N):
            picked = set(torch.nonzero(chosen[b, t]).flatten().tolist())
            assert picked == set(top_k_experts(probs[b, t], k, allowed)), "not the literal top-min(k, |set|)"
            assert len(picked) == min(k, len(allowed))
            assert picked <= allowed
            used = set(torch.nonzero(dense[b, t]).flatten().tolist())
            assert used <= picked, "weight on an expert outside the chosen set"
            assert abs(dense[b, t].sum().item() - 1.0) < 1e-6
            want = probs[b, t, sorted(picked)] / probs[b, t, sorted(picked)].sum()
            torch.testing.assert_close(dense[b, t, sorted(picked)], want, atol=1e-7, rtol=1e-6)


def random_experts(gen, E, D, I):
    return torch.randn(E, 2 * I, D, generator=gen) / D**0.5, torch.randn(E, D, I, generator=gen) / I**0.5


def literal_routed(x, router, gate_up, down, k, top_p, coreset, N):
    """Per-row literal MoE (routed part only): causal rows plain top-k, block rows within the coreset."""
    B, T, D = x.shape
    Tc, I = T - N, down.shape[2]
    out = torch.zeros(B, T, D, dtype=torch.float64)
    distinct = []
    for b in range(B):
        probs = [torch.softmax((router @ x[b, t]).float(), -1) for t in range(T)]
        allowed = set(literal_coreset(probs[Tc:], k, top_p)) if coreset and N else None
        block_experts = set()
        for t in range(T):
            ex = top_k_experts(probs[t], k, allowed if t >= Tc else None)
            if t >= Tc:
                block_experts |= set(ex)
            mass = sum(probs[t][e].double() for e in ex)
            for e in ex:
                g, u = (gate_up[e].double() @ x[b, t].double()).split(I)
                out[b, t] += probs[t][e].double() / mass * (down[e].double() @ (F.silu(g) * u))
        distinct.append(len(block_experts))
        if N:
            assert len(block_experts) == literal_distinct(torch.stack(probs[Tc:]), k, top_p, coreset)
    return out, distinct


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 3), st.integers(0, 4), st.integers(0, 6), st.integers(2, 10), st.integers(1, 3),
    st.sampled_from([0.3, 0.7, 0.9, 1.0]), st.booleans(), st.sampled_from([1.0, 4.0]), st.integers(0, 2**31 - 1),
)
def test_moe_core_matches_literal_routing(B, Tc, N, E, k, top_p, coreset, router_scale, seed):
    assume(Tc + N > 0)
    k = min(k, E)
    D, I = 16, 8
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, Tc + N, D, generator=gen)
    router = router_scale * torch.randn(E, D, generator=gen)
    gate_up, down = random_experts(gen, E, D, I)
    out, distinct = moe_core(x, router, gate_up, down, k, top_p, coreset, N)
    want, want_distinct = literal_routed(x, router, gate_up, down, k, top_p, coreset, N)
    err = (out.double() - want).abs().max().item()
    assert err < 1e-5, f"routed output differs from the literal routing by {err}"
    assert distinct.dtype == torch.int32 and distinct.tolist() == want_distinct


@pytest.mark.parametrize("router_scale", [1.0, 6.0, 40.0])
def test_top_p_one_equals_coreset_disabled(router_scale):
    gen = torch.Generator().manual_seed(int(router_scale))
    B, Tc, N, E, k, D, I = 3, 2, 16, 16, 4, 32, 8
    x = torch.randn(B, Tc + N, D, generator=gen)
    router = router_scale * torch.randn(E, D, generator=gen) / D**0.5  # large scale: tiny top-k masses
    gate_up, down = random_experts(gen, E, D, I)
    on, d_on = moe_core(x, router, gate_up, down, k, 1.0, True, N)
    off, d_off = moe_core(x, router, gate_up, down, k, 1.0, False, N)
    assert (on - off).abs().max().item() <= 1e-6
    assert torch.equal(d_on, d_off)


def test_top_p_one_in_config_equals_coreset_disabled_in_model():
    """Through the whole model: `moe_block_coreset_top_p: 1.0` gives the same block logits as the coreset off."""
    LIN, FULL = "linear_attention", "full_attention"
    base = tiny_config(
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=[LIN, FULL],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        block_size=8,
    )
    ref = init_random_(build_model(base), seed=5, std=0.2)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(5.0)
    state = ref.state_dict()
    results = []
    for cfg in (base.replace(moe_block_coreset_top_p=1.0), base.replace(moe_block_coreset_enabled=False),
                base.replace(moe_block_coreset_top_p=0.5)):
        m = build_model(cfg)
        m.load_state_dict(state)
        pools = allocate_pools(cfg, 2, 32).values()
        ids = torch.randint(0, cfg.vocab_size, (2, 3 + 8), generator=torch.Generator().manual_seed(0)).to(torch.int32)
        one = torch.ones(2, dtype=torch.int32)
        with torch.no_grad():
            logits, sizes, *_ = m(ids, 3 * one, one, torch.tensor([1, 0], dtype=torch.int32), 0 * one, 0 * one[:, None],
                                  *pools)
        results.append((logits, sizes))
    (l1, s1), (l_off, s_off), (l_half, s_half) = results
    assert (l1 - l_off).abs().max().item() <= 1e-6
    assert torch.equal(s1, s_off)
    # and a smaller top_p does change something, so the comparison above is not vacuous
    assert (s_half < s1).any() and (l_half - l_off).abs().max().item() > 1e-4

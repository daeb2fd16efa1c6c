"""Property tests of the LowConfidence selector (DECODING.md 2) on random logits and block states."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clover_export.core.generation import GenerationSettings
from clover_export.runtime.controls import RowParams, param_row
from clover_export.runtime.selector import Controls, choose, fill, sample

MASK = 3
V = 12


def params(threshold: float, **kw) -> RowParams:
    # controls off, so the selector alone is under test
    s = GenerationSettings(threshold=threshold, repetition_penalty=1.0, presence_penalty=0.0,
                           dllm_length_penalty=0.0, dllm_think_end_bias=0.0, **kw)
    return RowParams(torch.tensor([param_row(s)], dtype=torch.float32))


def select(logits, block, threshold, **kw):
    """choose + fill for one row."""
    p = params(threshold, **kw)
    N = block.shape[1]
    tok, conf = choose(logits, Controls.none(1, N), p, MASK)
    new, newly = fill(block, tok, conf, p.threshold, MASK)
    return new, newly, tok, conf


@st.composite
def cases(draw):
    N = draw(st.integers(1, 8))
    vals = st.floats(-4, 4, allow_nan=False, width=32)
    # coarse values make ties likely
    coarse = draw(st.booleans())
    logits = torch.tensor(draw(st.lists(st.lists(st.sampled_from([-1.0, 0.0, 1.0]) if coarse else vals,
                                                 min_size=V, max_size=V), min_size=N, max_size=N)))
    filled = draw(st.lists(st.booleans(), min_size=N, max_size=N))
    if all(filled):
        filled[draw(st.integers(0, N - 1))] = False
    toks = draw(st.lists(st.integers(0, V - 1).filter(lambda t: t != MASK), min_size=N, max_size=N))
    block = torch.tensor([[t if f else MASK for t, f in zip(toks, filled)]])
    threshold = draw(st.sampled_from([1.0, 0.5, 0.2, 0.05]) | st.floats(0.01, 1.0))
    return logits[None], block, threshold


@settings(max_examples=150, deadline=None)
@given(cases())
def test_fills_at_least_one_and_keeps_filled_positions(case):
    logits, block, threshold = case
    new, newly, _, _ = select(logits, block, threshold)
    masked = block == MASK
    assert int(newly.sum()) >= 1
    assert torch.equal(new[~masked], block[~masked])  # filled positions never change
    assert torch.equal(newly, masked & (new != MASK))
    assert not (new[newly] == MASK).any()  # the mask token is never chosen


@settings(max_examples=150, deadline=None)
@given(cases())
def test_threshold_is_strict_and_fallback_takes_lowest_index(case):
    logits, block, threshold = case
    new, newly, tok, conf = select(logits, block, threshold)
    masked = block[0] == MASK
    above = masked & (conf[0] > threshold)
    if above.any():
        assert torch.equal(newly[0], above)  # exactly the positions strictly above
    else:
        best = max(conf[0][masked].tolist())
        first = next(i for i in range(block.shape[1]) if masked[i] and conf[0][i] == best)
        assert newly[0].nonzero().flatten().tolist() == [first]


@settings(max_examples=100, deadline=None)
@given(cases())
def test_greedy_token_is_lowest_argmax_and_confidence_is_its_probability(case):
    logits, block, threshold = case
    _, _, tok, conf = select(logits, block, threshold)
    l = logits[0].clone()
    l[:, MASK] = float("-inf")
    for i in range(l.shape[0]):
        row = l[i].tolist()
        best = max(row)
        assert tok[0, i] == row.index(best)  # first (lowest) id among ties
        assert abs(conf[0, i] - torch.softmax(l[i], 0)[row.index(best)]) < 1e-6


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(0, 2**31), st.sampled_from([1.0, 0.3, 0.01]))
def test_a_block_resolves_within_block_size_steps(N, seed, threshold):
    gen = torch.Generator().manual_seed(seed)
    block = torch.full((1, N), MASK)
    steps = 0
    while (block == MASK).any():
        logits = torch.randn(1, N, V, generator=gen) * 3
        block, newly, _, _ = select(logits, block, threshold)
        steps += 1
        assert steps <= N
    if threshold == 1.0:  # nothing can beat probability 1: one position per step
        assert steps == N


def test_threshold_exactly_equal_is_not_filled():
    # two tokens of equal logit: each has probability 1/2 (mask excluded, the rest far below)
    logits = torch.full((1, 2, V), -1e4)
    logits[0, :, 0] = logits[0, :, 1] = 0.0
    block = torch.full((1, 2), MASK)
    new, newly, tok, conf = select(logits, block, 0.5)
    assert torch.allclose(conf, torch.full((1, 2), 0.5))
    assert newly.tolist() == [[True, False]]  # none strictly above: fallback, lowest index
    assert tok.tolist() == [[0, 0]]  # tie between ids 0 and 1: lowest id
    new, newly, _, _ = select(logits, block, 0.49)
    assert newly.tolist() == [[True, True]]


def test_mask_token_never_chosen_even_when_it_dominates():
    logits = torch.zeros(1, 4, V)
    logits[..., MASK] = 100.0
    new, newly, tok, _ = select(logits, torch.full((1, 4), MASK), 0.01)
    assert (tok != MASK).all() and newly.all()


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    torch.manual_seed(0)
    l = torch.randn(1, 64, V)
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        draws.append(sample(l, torch.tensor([0.7]), torch.tensor([3.0]), torch.tensor([1.0]), [g])[0])
    assert torch.equal(draws[0], draws[1])
    top3 = l.topk(3, -1).indices
    assert (draws[0][..., None] == top3).any(-1).all()  # top-k: only the 3 best ids
    # top-p tiny: only the most likely token survives, and its renormalised probability is 1
    tok, conf = sample(l, torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1e-6]), [torch.Generator()])
    assert torch.equal(tok, l.argmax(-1)) and torch.allclose(conf, torch.ones_like(conf))
    # a top_p too small for float32 (1e-50, valid in (0, 1]) arrives as 0.0: the most likely token still stays
    tok, conf = sample(l, torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1e-50]), [torch.Generator()])
    assert torch.equal(tok, l.argmax(-1)) and torch.allclose(conf, torch.ones_like(conf))


def test_sampling_frequencies_follow_the_distribution():
    l = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None, None].expand(1, 4000, 3).contiguous()
    g = torch.Generator().manual_seed(1)
    tok, conf = sample(l, torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]), [g])
    freq = torch.bincount(tok.flatten(), minlength=3).float() / tok.numel()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    assert torch.allclose(conf, torch.tensor([0.5, 0.3, 0.2])[tok], atol=1e-6)
    # top-p 0.6: keeps {0.5, 0.3} (0.5 alone is short of 0.6), renormalised to 0.625 / 0.375
    tok, conf = sample(l, torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.6]), [g])
    assert set(tok.flatten().tolist()) == {0, 1}
    assert torch.allclose(conf, torch.tensor([0.625, 0.375])[tok], atol=1e-6)

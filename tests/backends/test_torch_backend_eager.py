"""The torch backend's eager computations against float64 references (backends/torch_backend.py):
`moe_core_gathered` (only the selected experts) for the dense `moe_core`, the GDN core's few-row path
(row-by-row delta rule, conv as taps) and chunk fitted to the causal rows, and the causal-only step of a
step without blocks. Each equals the reference within fp32 rounding, also on ill-conditioned inputs."""

from __future__ import annotations

import pytest
import torch
from test_causal_logits import plain_causal_logits
from test_gdn_numerics import float64_delta_rule, trained_like_case

from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.model.gdn import gdn_core_in_place
from clover_export.model.moe import moe_core, moe_core_gathered, routing

E, D, I, TOP_K, TOP_P = 16, 48, 24, 4, 0.7
B, C, N = 3, 5, 8  # batch rows, causal rows, block rows


def moe_case(seed: int, ill: bool) -> tuple:
    """(x, router_w, gate_up, down) fp32. ill: rows of norms 1e-3 .. 1e3, experts scaled 1e-3 .. 1e3, and
    expert pairs that route alike (equal router rows, so both are chosen with equal weights) whose outputs
    nearly cancel (down[2j + 1] = -down[2j] (1 + 1e-3 noise)): a row's sum is far smaller than its terms."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C + N, D, generator=g) + 1.0
    router = 2.0 * torch.randn(E, D, generator=g)  # decisive routing: fp32 and fp64 pick the same experts
    router[E // 2:] -= 1.0  # ... and the last experts lose to the first (x has a positive mean): some unselected
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    down = torch.randn(E, D, I, generator=g) / I**0.5
    if ill:
        x = x * torch.logspace(-3, 3, C + N).view(1, -1, 1)
        router[1::2], gate_up[1::2] = router[0::2], gate_up[0::2]
        down[1::2] = -down[0::2] * (1 + 1e-3 * torch.randn(E // 2, D, I, generator=g))
        scale = torch.logspace(-3, 3, E // 2).repeat_interleave(2)
        gate_up, down = gate_up * scale.view(-1, 1, 1).sqrt(), down * scale.view(-1, 1, 1).sqrt()
    return x, router, gate_up, down


def rounding_scale(x, router, gate_up, down) -> torch.Tensor:
    """[B, T, D] float64: what fp32 rounding of a row's routed sum scales with, from absolute values: per
    chosen expert |w| |down| (|h| + |silu'(g)| |u| |x||W_g| + |silu(g)| |x||W_u|), h = silu(g) u (the
    errors of h, of the down projection and of the sum; not the sum itself, which cancels when ill)."""
    w, _, _ = routing(x, router, TOP_K, TOP_P, True, N)
    xd, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    lin = torch.nn.functional.linear
    for e in range(E):
        wg, wu = gate_up[e].double().chunk(2)
        gate, up = lin(xd, wg), lin(xd, wu)
        sig = torch.sigmoid(gate)
        dsilu = sig * (1 + gate * (1 - sig))
        h_err = (gate * sig * up).abs() + dsilu.abs() * up.abs() * lin(xd.abs(), wg.abs()) \
            + (gate * sig).abs() * lin(xd.abs(), wu.abs())
        out += w[..., e:e + 1].double().abs() * lin(h_err, down[e].double().abs())
    return out


def record_experts_paths(monkeypatch) -> list[str]:
    """The paths moe_core_gathered's calls take ("looped", "batched"), in order."""
    from clover_export.model import moe

    calls = []
    for path in ("looped", "batched"):
        real = getattr(moe, f"experts_{path}")
        monkeypatch.setattr(moe, f"experts_{path}", lambda *a, p=path, f=real: (calls.append(p), f(*a))[1])
    return calls


@pytest.fixture(params=["looped", "batched"])
def experts_path(request, monkeypatch):
    """moe_core_gathered made to run its experts one at a time, or as batched GEMMs: (that path, the paths taken)."""
    from clover_export.model import moe

    batched = request.param == "batched"
    monkeypatch.setattr(moe, "BATCHED_MIN_EXPERTS", 0 if batched else 10**9)
    monkeypatch.setattr(moe, "BATCHED_PADDING", 10**9 if batched else -1)
    monkeypatch.setattr(moe, "BATCHED_COPY_BYTES", 10**12 if batched else -1)
    return request.param, record_experts_paths(monkeypatch)


@pytest.mark.parametrize("ill", [False, True], ids=["random", "ill-conditioned"])
def test_gathered_moe_equals_the_dense_reference(ill, experts_path):
    x, router, gate_up, down = moe_case(3, ill)
    args = (TOP_K, TOP_P, True, N)
    _, chosen32, _ = routing(x, router, *args)
    _, chosen64, _ = routing(x.double(), router.double(), *args)
    assert torch.equal(chosen32, chosen64)  # the same experts: the comparison is of the sums alone
    assert int(chosen32.reshape(-1, E).any(0).sum()) < E  # some expert unselected: the gather skips it
    ref, ref_distinct = moe_core(x.double(), router.double(), gate_up.double(), down.double(), *args)
    dense, _ = moe_core(x, router, gate_up, down, *args)
    gathered, distinct = moe_core_gathered(x, router, gate_up, down, *args)
    assert torch.equal(distinct, ref_distinct)
    size = rounding_scale(x, router, gate_up, down)
    if ill:  # the sums do cancel (rows whose chosen experts all have probability 0 in fp32 sum to exactly 0)
        assert float((ref.abs() / size)[size > 0].median()) < 1e-2
    bound = max(D, I) * torch.finfo(torch.float32).eps * size  # worst-case fp32 dot products of D and I terms
    for name, got in (("dense", dense), ("gathered", gathered)):
        err = (got.double() - ref).abs()
        assert bool((err <= bound).all()), f"{name}: {float((err / bound).max()):.1f}x the fp32 rounding bound"
    assert bool(((gathered.double() - dense.double()).abs() <= bound).all())
    path, taken = experts_path
    assert taken == [path]  # the path asked for ran


def test_gathered_moe_batches_small_steps_and_loops_over_skewed_ones(monkeypatch):
    """The sizes pick the path: a row that uses 4 of 16 experts runs as batched GEMMs; a row that uses 2 (fewer
    than BATCHED_MIN_EXPERTS: the loop's ops are fewer) loops, and so do 40 rows that all take expert 0 and one
    of the others (padding every used expert to 40 rows: over twice the pairs)."""
    calls = record_experts_paths(monkeypatch)
    x, router, gate_up, down = moe_case(4, False)
    moe_core_gathered(x[:1, :1], router, gate_up, down, 4, TOP_P, False, 0)
    moe_core_gathered(x[:1, :1], router, gate_up, down, 2, TOP_P, False, 0)
    g = torch.Generator().manual_seed(5)
    skewed = router.clone()
    skewed[0] = 60.0 / D  # x has a positive mean: expert 0 first (logit ~60, the others' spread ~20) for
    #                       every row, the second one varies
    xs = torch.randn(1, 40, D, generator=g) + 1.0
    _, chosen, _ = routing(xs, skewed, 2, 1.0, False, 0)
    assert bool(chosen[0, :, 0].all()) and int(chosen[0, :, 1:].any(0).sum()) >= 4
    moe_core_gathered(xs, skewed, gate_up, down, 2, 1.0, False, 0)
    assert calls == ["batched", "looped", "looped"]


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 40, 70])
def test_eager_gdn_matches_float64_on_trained_like_keys(rows):
    """gdn_core_in_place (row by row up to FEW_ROWS causal rows, else a chunk of at most the rows) against
    MODEL.md 4 token by token in float64, on keys that agree in direction with slow decay and beta near 1."""
    t, attrs = trained_like_case(seed=1, Tc=rows)
    slot = int(t["slot_ids"][0])
    ref_o, ref_S, _ = float64_delta_rule(t, rows) if rows else (None, t["rec_pool"][slot].double().numpy(), 0)
    ref_S = torch.from_numpy(ref_S).clone()
    o, _, rec = gdn_core_in_place(*t.values(), **attrs)
    err_s = (rec[slot].double() - ref_S).abs().max() / ref_S.abs().max()
    assert float(err_s) < 1e-5, err_s
    if rows:
        ref_o = torch.from_numpy(ref_o)
        err_o = (o[0, :rows].double() - ref_o).abs().max() / ref_o.abs().max()
        assert float(err_o) < 1e-5, err_o
    assert o.shape[1] == rows + attrs["block_size"] and bool(torch.isfinite(o).all())


def causal_step(ids_rows: list[list[int]], past: list[int], slots: list[int], mask: int, block: int) -> dict:
    """A step without blocks: each batch row's causal tokens (left-aligned, padded), `logit_rows` = each
    row's causal rows (the last one repeated as padding)."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    Cs = max(len(r) for r in ids_rows)
    ids = torch.full((len(ids_rows), Cs + block), mask, dtype=torch.int32)
    for b, r in enumerate(ids_rows):
        ids[b, :len(r)] = i32(r)
    rows = [[min(j, len(r) - 1) for j in range(Cs)] for r in ids_rows]
    return {names.INPUT_IDS: ids, names.N_CAUSAL: i32([len(r) for r in ids_rows]),
            names.HAS_BLOCK: i32([0] * len(ids_rows)), names.SLOT_IDS: i32(slots), names.PAST_LEN: i32(past),
            names.LOGIT_ROWS: i32(rows)}


def test_steps_without_blocks_run_the_causal_rows_alone(model, monkeypatch):
    """Two prompts played by causal-only steps of 3, 1 (decode-like), 5 and 2 rows at once, as prefill chunks,
    commits and `ar` steps are: the causal logits equal the plain causal forward's (an independent full
    forward with block rows), the block rows were never computed, coreset sizes are 0, and a step with a
    block after them sees the same caches as the model's functional step would have left."""
    Nb, mask = model.block_size, model.cfg.mask_token_id
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(6, 500, (11,), generator=g).tolist(), torch.randint(6, 500, (9,), generator=g).tolist()]
    want = [plain_causal_logits(model, p) for p in prompts]
    eager, functional = TorchBackend(model), TorchBackend(model, in_place=False)
    pools, ref_pools = eager.allocate_pools(3, 64), functional.allocate_pools(3, 64)
    widths = []
    real_moe = moe_core_gathered
    monkeypatch.setattr("clover_export.backends.torch_backend.moe_core_gathered",
                        lambda x, *a: (widths.append(x.shape[1]), real_moe(x, *a))[1])
    pos = [0, 0]
    for lens in ([3, 1], [1, 5], [5, 2], [2, 1]):
        step = causal_step([p[s:s + n] for p, s, n in zip(prompts, pos, lens)], pos, [2, 0], mask, Nb)
        res = eager.step(step, pools)
        ref_pools = functional.step(step, ref_pools)[2]
        assert set(widths) == {max(lens)}, widths  # C rows a layer, no block rows
        widths.clear()
        assert not res[1].any() and res[0].shape == (2, Nb, model.cfg.vocab_size)
        for b in range(2):
            for j in range(lens[b]):
                torch.testing.assert_close(res.causal_logits[b, j], want[b][pos[b] + j], atol=1e-4, rtol=1e-4)
        pos = [p + n for p, n in zip(pos, lens)]
    for name in pools:
        torch.testing.assert_close(pools[name], ref_pools[name], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("ill", [False, True], ids=["random", "ill-conditioned"])
def test_eager_convs_are_the_reference_convs(ill):
    """The runtime's convs (gdn.depthwise_conv) against the reference convs (conv1d) in float64, within fp32
    rounding of their products: the causal conv from a state, and the block's causal and anticausal convs as
    one kernel (assumed.block_conv_taps). ill: channels scaled 1e-3 .. 1e3, and the two block convs' taps on
    the row itself nearly cancelling."""
    from clover_export.core.assumed import anticausal_conv, block_conv_taps
    from clover_export.model.gdn import causal_conv, causal_conv_taps, depthwise_conv

    g = torch.Generator().manual_seed(11)
    Bc, Nc, Cc, K = 2, 9, 12, 4
    m, state = torch.randn(Bc, Nc, Cc, generator=g), torch.randn(Bc, Cc, K - 1, generator=g)
    w, w_right = torch.randn(Cc, K, generator=g), torch.randn(Cc, K, generator=g)
    if ill:
        m = m * torch.logspace(-3, 3, Cc)
        w_right[:, 0] = -w[:, -1] * (1 + 1e-4 * torch.randn(Cc, generator=g))
    bound = 2 * K * torch.finfo(torch.float32).eps
    md, sd, wd, rd = m.double(), state.double(), w.double(), w_right.double()
    ref, size = causal_conv(md, sd, wd), causal_conv(md.abs(), sd.abs(), wd.abs())
    got = causal_conv_taps(m, state, w)
    assert got.shape == (Bc, Nc, Cc) and bool(((got.double() - ref).abs() <= bound * size).all())
    ref = ref + anticausal_conv(md, rd)
    size = size + anticausal_conv(md.abs(), rd.abs())
    rows = torch.cat([state.transpose(1, 2), m, torch.zeros(Bc, K - 1, Cc)], dim=1)
    got = depthwise_conv(rows, block_conv_taps(w, w_right))
    assert got.shape == (Bc, Nc, Cc) and bool(((got.double() - ref).abs() <= bound * size).all())


def test_a_block_step_in_place_equals_the_functional_step(model):
    """A step of causal rows and a block, as the runtime runs it (in place: one delta-rule chunk of exactly the
    causal rows, the block's convs as one, batched experts) against the model's functional step: block and
    causal logits and every pool within fp32 rounding."""
    Nb, mask = model.block_size, model.cfg.mask_token_id
    g = torch.Generator().manual_seed(9)
    ids = torch.full((2, 12 + Nb), mask, dtype=torch.int32)
    ids[:, :12] = torch.randint(6, 500, (2, 12), generator=g, dtype=torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    step = {names.INPUT_IDS: ids, names.N_CAUSAL: i32([12, 7]), names.HAS_BLOCK: i32([1, 1]),
            names.SLOT_IDS: i32([1, 0]), names.PAST_LEN: i32([0, 0]),
            names.LOGIT_ROWS: i32([list(range(12)), [min(j, 6) for j in range(12)]])}
    eager, functional = TorchBackend(model), TorchBackend(model, in_place=False)
    pools, ref_pools = eager.allocate_pools(2, 64), functional.allocate_pools(2, 64)
    res, ref = eager.step(step, pools), functional.step(step, ref_pools)
    torch.testing.assert_close(res[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res.causal_logits, ref.causal_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(res[1], ref[1])  # the same coreset sizes
    for name in pools:
        torch.testing.assert_close(pools[name], ref[2][name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

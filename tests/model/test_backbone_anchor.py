"""The backbone anchor (MODEL.md 5.1): a plain Qwen3.5-MoE checkpoint in causal mode reproduces transformers.

Tiny random `Qwen3_5MoeForCausalLM`s (every norm weight randomised so that
the 1+w / plain-weight forms matter; several layer patterns, GQA ratios, head
dims, linear-head ratios, rotary fractions, conv kernels) are saved with
`save_pretrained` (per-expert tensors, `qwen3_5_moe_text` config) and loaded
with `load_model(..., allow_qwen=True, block_size=0)`. Causal rows through
`trunk` + `logits` must match transformers' logits in fp32, in one pass and
step by step with caches carried in slot pools; padding rows change nothing;
the multimodal wrapper layout loads and matches too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from clover_export.core.checkpoint import save_checkpoint  # noqa: E402
from clover_export.model.loading import load_model  # noqa: E402
from clover_export.model.model import allocate_pools  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
TOL = 1e-4  # max |logits - transformers| in fp32
VOCAB = 128


@dataclass(frozen=True)
class Case:
    layer_types: tuple[str, ...]
    heads: int  # H
    kv_heads: int  # Hkv
    head_dim: int
    k_heads: int  # Hk
    v_heads: int  # Hv
    dk: int
    dv: int
    rotary: float
    kernel: int = 4


CASES = {
    # 3 GDN + 1 attention like the real model; GQA 2, Hv/Hk 2, dk != dv
    "lin3full": Case((LIN, LIN, LIN, FULL), 4, 2, 16, 2, 4, 16, 8, 0.25),
    # attention first; no GQA (H/Hkv 1), Hv/Hk 1, head dim 32, half rotary
    "full-lin": Case((FULL, LIN), 4, 4, 32, 2, 2, 8, 16, 0.5),
    # alternating; GQA 4, Hv/Hk 2, kernel 3
    "alt": Case((LIN, FULL, LIN, FULL), 4, 1, 32, 1, 2, 16, 16, 0.5, kernel=3),
}


def hf_config(case: Case):
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=len(case.layer_types), layer_types=list(case.layer_types),
        num_attention_heads=case.heads, num_key_value_heads=case.kv_heads, head_dim=case.head_dim,
        linear_num_key_heads=case.k_heads, linear_num_value_heads=case.v_heads,
        linear_key_head_dim=case.dk, linear_value_head_dim=case.dv, linear_conv_kernel_dim=case.kernel,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": case.rotary},
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )


@torch.no_grad()
def randomise_(model, seed: int):
    """Every tensor random and mattering: norms away from their identity, decays spread, router peaked."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            val = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith(("dt_bias", "linear_attn.norm.weight")):  # plain-weight gated norm: around 1
            val = 1.0 + 0.3 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:  # RMSNorms in the (1 + w) form: input/post/final, q_norm, k_norm
            val = 0.3 * torch.randn(p.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            val = torch.randn(p.shape, generator=gen)
        else:
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            if name.endswith("mlp.gate.weight"):
                val *= 2.0
            if name == "lm_head.weight":
                val *= 0.5
        p.copy_(val)


_BUILT: dict[str, tuple] = {}


def build(name: str, tmp_path_factory):
    """(transformers model, folder written by save_pretrained, our model), once per case."""
    if name not in _BUILT:
        torch.manual_seed(0)
        hf = transformers.Qwen3_5MoeForCausalLM(hf_config(CASES[name])).eval()
        randomise_(hf, seed=list(CASES).index(name) + 1)
        folder = tmp_path_factory.mktemp(f"qwen-{name}")
        hf.save_pretrained(folder)
        with pytest.warns(UserWarning, match="zero-filled"):
            ours = load_model(folder, allow_qwen=True, block_size=0)
        _BUILT[name] = (hf, folder, ours)
    return _BUILT[name]


def ints(*v):
    return torch.tensor(v, dtype=torch.int32)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids.long()).logits.float()


def causal_step(model, ids, n_causal, slots, past_len, pools: dict):
    """Causal rows only: (logits of every row [B, C, V], new pools dict)."""
    B = ids.shape[0]
    with torch.no_grad():
        h, _, new = model.trunk(ids, n_causal, torch.zeros(B, dtype=torch.int32), slots, past_len, *pools.values())
        return model.logits(h), dict(zip(pools, new))


def full_pass(model, ids, slots=(0, 1), num_slots=2, max_len=160):
    pools = allocate_pools(model.cfg, num_slots, max_len)
    B, T = ids.shape
    return causal_step(model, ids, ints(*[T] * B), ints(*slots), ints(*[0] * B), pools)


def random_ids(seed: int, B: int, T: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed)).to(torch.int32)


def max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_pools_close(got: dict, want: dict, tol: float, what: str):
    """Max error relative to each pool's scale (at least 1)."""
    for name in want:
        err = max_err(got[name], want[name]) / max(1.0, want[name].float().abs().max().item())
        assert err <= tol, f"{what}: {name} differs by {err}"


@pytest.mark.parametrize("T", [7, 64, pytest.param(130, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CASES))
def test_full_pass_matches_transformers(name, T, tmp_path_factory):
    hf, _, ours = build(name, tmp_path_factory)
    ids = random_ids(T, 2, T)
    got, _ = full_pass(ours, ids)
    want = hf_logits(hf, ids)
    err = max_err(got, want)
    print(f"{name} T={T}: max |logits - transformers| = {err:.2e} (logits up to {want.abs().max().item():.2f})")
    assert err < TOL


def run_schedule(model, ids, chunks_per_row, slots=(2, 0), num_slots=3, max_len=160, seed=0):
    """Causal steps over `ids` [B, T], row r advancing by chunks_per_row[r][s] at step s (0 = idle).

    Each step's C is the largest chunk of the step; shorter rows are padded with garbage ids.
    Returns (logits [B, T, V] of every position, final pools).
    """
    B, T = ids.shape
    gen = torch.Generator().manual_seed(seed)
    pools = allocate_pools(model.cfg, num_slots, max_len)
    out = torch.full((B, T, VOCAB), float("nan"))
    done = [0] * B
    for step in range(max(len(c) for c in chunks_per_row)):
        n = [c[step] if step < len(c) else 0 for c in chunks_per_row]
        C = max(n)
        if C == 0:
            continue
        step_ids = torch.randint(0, VOCAB, (B, C), generator=gen).to(torch.int32)  # padding: garbage
        for r in range(B):
            step_ids[r, :n[r]] = ids[r, done[r]:done[r] + n[r]]
        logits, pools = causal_step(model, step_ids, ints(*n), ints(*slots), ints(*done), pools)
        for r in range(B):
            out[r, done[r]:done[r] + n[r]] = logits[r, :n[r]]
            done[r] += n[r]
    assert done == [T] * B
    return out, pools


def schedules(T: int) -> dict[str, list[list[int]]]:
    """Chunk sizes per row and step (0 = idle that step): token by token (short T), and uneven
    chunks differing per row that cross the 64-row chunk of the delta rule, then single tokens."""
    def split(sizes):
        out, left = [], T
        for s in sizes:
            out.append(min(s, left))
            left -= out[-1]
        return out + ([left] if left else [])

    if T <= 32:
        return {"token-by-token": [[1] * T, [1] * T], "uneven": [split([5, 1, 0, 3, 2, 7]), split([1, 9, 3, 0, 2])]}
    return {
        "uneven": [split([5, 1, 0, 30, 2, 70]), split([1, 17, 3, 0, 63, 1, 9])],
        "prefill-then-tokens": [split([70, 0, 40] + [1] * 12), split([3, 90] + [1] * 20)],
    }


@pytest.mark.parametrize("T", [21, pytest.param(130, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["lin3full", pytest.param("alt", marks=pytest.mark.slow)])
def test_steps_with_carried_pools_equal_one_pass(name, T, tmp_path_factory):
    hf, _, ours = build(name, tmp_path_factory)
    ids = random_ids(1000 + T, 2, T)
    want, want_pools = full_pass(ours, ids, slots=(2, 0), num_slots=3)
    hf_err = max_err(want, hf_logits(hf, ids))
    assert hf_err < TOL
    for kind, chunks in schedules(T).items():
        got, pools = run_schedule(ours, ids, chunks)
        err = max_err(got, want)
        print(f"{name} T={T} {kind}: max |step logits - one pass| = {err:.2e}, one pass vs transformers {hf_err:.2e}")
        assert not got.isnan().any()
        assert err < TOL, f"{kind}: step-by-step logits differ from one pass by {err}"
        assert_pools_close(pools, want_pools, 1e-4, kind)


def test_padded_causal_rows_match_unpadded(tmp_path_factory):
    hf, _, ours = build("lin3full", tmp_path_factory)
    gen = torch.Generator().manual_seed(7)
    # non-empty caches first: prefixes of 9 and 4 tokens in slots 2 and 0
    pools = allocate_pools(ours.cfg, 3, 64)
    prefix = random_ids(8, 2, 9)
    slots = ints(2, 0)
    _, pools = causal_step(ours, prefix, ints(9, 4), slots, ints(0, 0), pools)
    past = ints(9, 4)

    ids = torch.randint(0, VOCAB, (2, 8), generator=gen).to(torch.int32)  # row 0: 5 valid, 3 garbage rows
    padded_logits, padded_pools = causal_step(ours, ids, ints(5, 8), slots, past, pools)
    # unpadded: each row alone with exactly its valid rows
    alone0, pools0 = causal_step(ours, ids[:1, :5], ints(5), slots[:1], past[:1], pools)
    alone1, pools1 = causal_step(ours, ids[1:], ints(8), slots[1:], past[1:], pools)
    err = max(max_err(padded_logits[0, :5], alone0[0]), max_err(padded_logits[1], alone1[0]))
    print(f"padded vs unpadded: max |dlogits| = {err:.2e}")
    assert err < 1e-5
    assert_pools_close({n: p[2] for n, p in padded_pools.items()}, {n: p[2] for n, p in pools0.items()}, 1e-6, "row 0")
    assert_pools_close({n: p[0] for n, p in padded_pools.items()}, {n: p[0] for n, p in pools1.items()}, 1e-6, "row 1")
    for n, p in padded_pools.items():  # nothing written beyond the valid rows
        if n.endswith((".key", ".value")):
            assert p[2, :, 9 + 5:].eq(0).all(), f"{n}: padding rows were written into the cache"
    # and the padded step still matches transformers on the valid rows
    full = torch.cat([prefix[:1], ids[:1, :5]], 1)
    assert max_err(padded_logits[0, :5], hf_logits(hf, full)[0, 9:]) < TOL


@pytest.mark.parametrize("per_expert", [False, True])
def test_wrapper_layout_loads_and_matches(per_expert, tmp_path_factory):
    hf, _, _ = build("alt", tmp_path_factory)
    folder = tmp_path_factory.mktemp("qwen-wrapper") / "model"
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    state["mtp.fc.weight"] = torch.zeros(4, 4)  # ignored: multi-token-prediction head
    wrapper = transformers.Qwen3_5MoeConfig(text_config=hf.config.to_dict())
    save_checkpoint(state, folder, prefix="model.language_model.", per_expert=per_expert,
                    extra_files={"config.json": wrapper.to_json_string()})
    cfg_json = json.loads((folder / "config.json").read_text())
    assert cfg_json["model_type"] == "qwen3_5_moe" and "text_config" in cfg_json
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.embed_tokens.weight" in index
    with pytest.warns(UserWarning, match="zero-filled"):
        ours = load_model(folder, allow_qwen=True, block_size=0)
    assert ours.cfg.model_type == "qwen3_5_moe" and ours.cfg.layer_types == CASES["alt"].layer_types
    ids = random_ids(3, 2, 40)
    err = max_err(full_pass(ours, ids)[0], hf_logits(hf, ids))
    print(f"wrapper layout (per_expert={per_expert}): max |logits - transformers| = {err:.2e}")
    assert err < TOL

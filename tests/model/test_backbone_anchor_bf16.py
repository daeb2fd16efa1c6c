"""The backbone anchor in bf16 (MODEL.md 4 cast points): transformers' Qwen3_5MoeForCausalLM in bf16 against
our reference model in bf16, on the same weights (the fp32 anchor is tests/model/test_backbone_anchor.py).

In bf16 the two differ by rounding-order noise (a bf16 value one ulp apart here
and there, e.g. the GDN core's fp32 result landing either side of a bf16
rounding boundary), so the logits are judged on their mean and max error.
Measured on the "lin3full" case (3 GDN layers first, so every GDN output
feeds the logits without an attention layer's own bf16 noise in front of it),
T = 7 / 33 / 64 / 100, the correct model: mean |dlogits| 0.99-1.11e-3, max
0.8-1.2e-2. Changing one cast point of the gated norm (MODEL.md 4: the
normalised value cast to the input dtype before the weight; silu(z) in fp32)
moves every GDN output by up to an ulp: with the cast dropped, mean 7.2-13.9e-3,
max 0.06-0.65; with silu(z) in bf16, mean 7.3-11.7e-3, max 0.08-0.57.
The limits sit between (mean 3e-3, max 3e-2), and the last test checks that
both changes fail them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_backbone_anchor import build, full_pass, hf_logits, random_ids

transformers = pytest.importorskip("transformers")

MEAN_TOL, MAX_TOL = 3e-3, 3e-2
CASE = "lin3full"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from clover_export.model.loading import load_model

    hf, folder, _ = build(CASE, tmp_path_factory)
    hf16 = transformers.Qwen3_5MoeForCausalLM(hf.config).eval()
    hf16.load_state_dict(hf.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # block-mixer tensors zero-filled (a plain Qwen checkpoint)
        ours16 = load_model(folder, dtype=torch.bfloat16, allow_qwen=True, block_size=0)
    return hf16.to(torch.bfloat16), ours16


def logit_errors(models, T: int) -> tuple[float, float]:
    hf16, ours16 = models
    ids = random_ids(T, 2, T)
    d = (full_pass(ours16, ids)[0].float() - hf_logits(hf16, ids)).abs()
    return d.mean().item(), d.max().item()


@pytest.mark.parametrize("T", [7, 64])
def test_bf16_logits_match_transformers_bf16(models, T):
    mean, mx = logit_errors(models, T)
    print(f"{CASE} T={T} bf16: mean |dlogits| {mean:.2e}, max {mx:.2e}")
    assert mean < MEAN_TOL and mx < MAX_TOL


def gated_norm_without_cast(o, z, weight, eps):
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)  # stays fp32: no cast before the weight
    return ((weight * y) * F.silu(z.float())).to(o.dtype)


def gated_norm_silu_in_model_dtype(o, z, weight, eps):
    of = o.float()
    y = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * y) * F.silu(z)).to(o.dtype)  # silu(z) in bf16


@pytest.mark.parametrize("mutant", [gated_norm_without_cast, gated_norm_silu_in_model_dtype])
def test_bf16_anchor_fails_when_a_gated_norm_cast_point_changes(models, mutant, monkeypatch):
    from clover_export.model import model as M

    monkeypatch.setattr(M, "gated_rms_norm", mutant)
    mean, mx = logit_errors(models, 64)
    assert mean > MEAN_TOL and mx > MAX_TOL, (mean, mx)

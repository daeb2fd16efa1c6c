"""A tiny checkpoint whose GDN layers look trained (STEP_GRAPH.md 2, the note on the chunk inverse).

Trained GDN layers have keys that agree in direction, slow decay and beta
near 1. Made from the embedded tiny by editing weights:
- one hidden dimension gets a constant positive value in every embedding
  row and no layer writes it, so every token's normalised input has a shared
  positive component;
- per GDN layer, the key rows of `in_proj_qkv` read mostly that component
  (nearly rank 1: keys share one direction after conv, SiLU and L2 norm),
  `in_proj_b` reads it with a large weight (beta ~ 0.95+), and `A_log` is
  very negative (decay exp(g) ~ 1 per token).
`gdn_statistics` measures those three properties on a real forward pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

SHARED_DIM = 7  # the hidden dimension carrying the shared component


def make_trained_like(src: Path, out: Path, calibration_ids: list[int], seed: int = 0) -> Path:
    """Copy `src` to `out` with trained-like GDN layers; the weights reading the shared component are
    scaled by its measured size at each layer's input (RMSNorm shrinks it as the residual grows)."""
    from safetensors.torch import load_file, save_file

    from clover_export.model.loading import load_model

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (shard,) = sorted(out.glob("*.safetensors"))
    dtype = getattr(torch, cfg.get("torch_dtype", "bfloat16"))
    w = {k: v.float() for k, v in load_file(shard).items()}
    emb = w["model.embed_tokens.weight"]
    emb[:, SHARED_DIM] = 4.0 * emb.std()  # shared positive component
    gdn_layers = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "linear_attention"]
    for i in range(len(cfg["layer_types"])):
        lp = f"model.layers.{i}."
        for name in ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.shared_expert.down_proj.weight"):
            if lp + name in w:
                w[lp + name][SHARED_DIM] = 0.0  # no layer writes the shared dimension: it stays in the residual
        w[lp + "mlp.experts.down_proj"][:, SHARED_DIM] = 0.0
        w[lp + "input_layernorm.weight"][SHARED_DIM] = 0.0  # (1 + w) = 1
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, shard, metadata={"format": "pt"})
    shared = shared_component(load_model(out), calibration_ids, gdn_layers)

    g = torch.Generator().manual_seed(seed)
    Hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    for i in gdn_layers:
        p, c = f"model.layers.{i}.linear_attn.", shared[i]
        keys = w[p + "in_proj_qkv.weight"][Hk * dk:2 * Hk * dk]  # [Hk dk, D] rows of the keys (a view)
        keys.mul_(0.05)
        keys[:, SHARED_DIM] += 3.0 * (torch.randn(Hk * dk, generator=g).abs() + 0.5) / c  # positive: SiLU keeps it
        w[p + "in_proj_b.weight"].mul_(0.05)
        w[p + "in_proj_b.weight"][:, SHARED_DIM] = 6.0 / c  # beta = sigmoid(>= 6) for 90% of tokens
        w[p + "in_proj_a.weight"].mul_(0.05)
        w[p + "A_log"].fill_(-7.0)  # decay exp(-e^-7 softplus(.)) ~ 0.999 per token
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, shard, metadata={"format": "pt"})
    return out


@torch.no_grad()
def shared_component(model, ids: list[int], layers: list[int]) -> dict[int, float]:
    """Per layer: the 10th percentile over tokens of the shared dimension at the GDN mixer's input."""
    seen = {}
    hooks = [
        model.model.layers[i].linear_attn.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(
                i, torch.quantile(args[0][0, : len(ids), SHARED_DIM].float(), 0.1).item()
            )
        )
        for i in layers
    ]
    try:
        causal_pass(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def causal_pass(model, ids: list[int]):
    from clover_export.model.model import allocate_pools

    P = len(ids)
    i32 = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    x = torch.tensor([list(ids) + [0] * model.block_size], dtype=torch.int32)
    model.step(dict(input_ids=x, n_causal=i32(P), has_block=i32(0), slot_ids=i32(0), past_len=i32(0)),
               allocate_pools(model.cfg, 1, P))


@torch.no_grad()
def gdn_statistics(model, prompt_ids: list[int]) -> list[dict]:
    """Per GDN layer on one causal pass over the prompt: mean pairwise key cosine, min and median beta,
    min exp(g)."""
    import dataclasses

    from clover_export.model.functional import l2_normalize
    from clover_export.model.gdn import causal_conv, split_heads

    cfg, stats = model.cfg, []
    base = model.cores.gdn

    def gdn(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, *rest):
        Tc = mixed_qkv.shape[1] - model.block_size
        m = mixed_qkv[:, :Tc].float()
        x = F.silu(causal_conv(m, torch.zeros(m.shape[0], m.shape[2], conv_w.shape[1] - 1), conv_w.float()))
        _, k, _ = split_heads(x, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        k = l2_normalize(k[0]).transpose(0, 1)  # [Hk, Tc, dk]
        cos = k @ k.transpose(1, 2)
        off = ~torch.eye(Tc, dtype=torch.bool)
        g = -torch.exp(A_log.float()) * F.softplus(a[:, :Tc].float() + dt_bias.float())
        stats.append(dict(key_cosine=float(cos[:, off].mean()), beta_min=float(torch.sigmoid(b[:, :Tc].float()).min()),
                          beta_median=float(torch.sigmoid(b[:, :Tc].float()).median()),
                          decay_min=float(torch.exp(g).min())))
        return base(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, *rest)

    model.cores = dataclasses.replace(model.cores, gdn=gdn)
    try:
        causal_pass(model, prompt_ids)
    finally:
        model.cores = dataclasses.replace(model.cores, gdn=base)
    return stats

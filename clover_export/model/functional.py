"""Small pieces of math shared by the cores (MODEL.md 4), following transformers' dtype rules."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * (1 + w)`, statistics and product in fp32, cast at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: plain weight (not 1 + w); normalised value cast to the input dtype, silu(z) in fp32."""
    dtype = o.dtype
    of = o.float()
    y = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * y) * F.silu(z.float())).to(dtype)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add and the norm after it: (h + r, rms_norm(h + r)); the sum rounds to the model dtype."""
    s = h + r
    return s, rms_norm(s, weight, eps)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """Attention's q/k path: per-head RMSNorm, then the partial RoPE."""
    return apply_partial_rope(rms_norm(x, weight, eps), cos, sin)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention's output gate, o [B, T, H, hd] * sigmoid(gate) (same shape), in the model dtype."""
    return o * torch.sigmoid(gate)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def gated_residual(routed: torch.Tensor, shared_gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The sparse MoE block's output: routed + sigmoid(shared_gate [.., 1]) * shared expert."""
    return routed + torch.sigmoid(shared_gate) * shared


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """NeoX rotate-half RoPE tables for absolute positions [...] -> cos, sin [..., rotary_dim]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd]; cos/sin [B, T, rot]: rotate the first `rot` dims (i pairs with i + rot/2)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def row_mask(n_valid: torch.Tensor, rows: int) -> torch.Tensor:
    """[B] counts -> bool [B, rows], True for the first n_valid rows."""
    return torch.arange(rows, device=n_valid.device).unsqueeze(0) < n_valid.unsqueeze(1)

"""FP8 (e4m3fn) quantization math (STEP_GRAPH.md 4): per-output-channel weight scales, per-tensor activation scales.

Scales follow ONNX QuantizeLinear: q = saturate(round(x / scale)), x' = q * scale,
with float8e4m3fn saturating at +-448. A zero channel gets scale 1 (any scale
represents zeros exactly), so no scale is ever 0 or subnormal.
"""

from __future__ import annotations

import numpy as np
import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
MIN_SCALE = float(np.finfo(np.float32).tiny)


def weight_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales of a weight [..., out, in] -> [..., out] (fp32): amax / 448."""
    amax = w.detach().float().abs().amax(dim=-1)
    return torch.where(amax > 0, (amax / E4M3_MAX).clamp(min=MIN_SCALE), torch.ones_like(amax))


def activation_scale(amax: float) -> float:
    """Per-tensor activation scale from a calibrated absolute maximum."""
    return amax / E4M3_MAX if amax > 0 else 1.0


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3fn (round-to-nearest-even), saturated at +-448; scale broadcasts on the
    last-but-one dim."""
    s = scale.float().unsqueeze(-1) if scale.dim() else scale.float()
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    s = scale.float().unsqueeze(-1) if scale.dim() else scale.float()
    return (q.float() * s).to(dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 per-channel scales) of one [..., out, in] weight."""
    scales = weight_scales(w)
    return quantize(w, scales), scales


def relative_error_bound() -> float:
    """Worst relative rounding error of e4m3 for values in the normal range: 2^-4 (3 mantissa bits)."""
    return 2.0**-4

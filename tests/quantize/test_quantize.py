"""FP8 quantization math against ml_dtypes' float8_e4m3fn casts."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from clover_export.quantize.scales import (
    E4M3_MAX,
    activation_scale,
    dequantize,
    quantize,
    quantize_weight,
    relative_error_bound,
    weight_scales,
)


def reference_quantize(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ONNX QuantizeLinear to float8e4m3fn with saturation, via ml_dtypes."""
    y = np.clip(x.astype(np.float32) / scale[:, None], -448, 448)
    return y.astype(ml_dtypes.float8_e4m3fn)


def test_scales_are_amax_over_448_per_output_channel():
    w = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0], [0.5, 0.25, -0.125]])
    s = weight_scales(w)
    assert s.tolist() == pytest.approx([2.0, 1.0, 0.5 / 448], rel=1e-6)
    q, scales = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn
    # the channel maximum lands exactly on +-448
    assert q.float()[0, 1] == -448 and q.float()[2, 0] == 448


def test_saturation_at_448():
    q = quantize(torch.tensor([1e6, -1e6, 500.0, 449.0]), torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0]


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, (4, 16), elements=st.floats(-1e4, 1e4, width=32)))
def test_matches_ml_dtypes_and_round_trip_bound(w):
    t = torch.from_numpy(w)
    q, scales = quantize_weight(t)
    ref = reference_quantize(w, scales.numpy())
    assert np.array_equal(q.float().numpy(), ref.astype(np.float32))
    back = dequantize(q, scales).numpy()
    # normal range: relative error <= 2^-4; near zero: absolute error <= half the smallest subnormal step
    amax = np.abs(w).max(axis=1, keepdims=True)
    tol = np.maximum(np.abs(w) * relative_error_bound(), scales.numpy()[:, None] * 2.0**-9)
    assert np.all(np.abs(back - w) <= tol + 1e-30)
    assert np.all(np.abs(back) <= amax * (1 + 1e-6) + 1e-30)


def test_per_channel_beats_per_tensor_on_uneven_channels():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=g) * torch.logspace(-4, 1, 8).unsqueeze(1)
    q, s = quantize_weight(w)
    per_channel = (dequantize(q, s) - w).abs().sum(dim=1) / w.abs().sum(dim=1)
    t_scale = w.abs().max() / E4M3_MAX
    per_tensor = (dequantize(quantize(w, t_scale), t_scale) - w).abs().sum(dim=1) / w.abs().sum(dim=1)
    assert per_channel.max() < 0.05
    assert per_tensor[0] > 4 * per_channel.max()  # per tensor, the smallest channel falls into subnormals


@pytest.mark.parametrize("amax, expected", [(448.0, 1.0), (0.0, 1.0), (4.48, 0.01)])
def test_activation_scale(amax, expected):
    assert activation_scale(amax) == pytest.approx(expected)

"""The coreset boundary at fp32 ties (tests/coreset_tie_case.py) in torch's moe_core and the ONNX body.

The Triton kernel plays the same case in tests/plugins/test_kernels_interpret.py
(`moe_tie_*`). All follow assumed.coreset_mask's rule.
"""

from __future__ import annotations

import pytest
import torch
from coreset_tie_case import KEPT, K, N, tie_case
from test_export_ops import one_node_model, ort_outputs

from clover_export.model.moe import moe_core


@pytest.mark.parametrize("top_p", sorted(KEPT))
def test_torch_core_and_onnx_body_keep_the_rule_set(top_p):
    t = tie_case()
    attrs = dict(top_k=K, top_p=top_p, coreset=1, block_size=N)
    _, want = moe_core(t["x"], t["router_w"], t["gate_up"], t["down"], K, top_p, True, N)
    assert want.tolist() == [KEPT[top_p]]
    routed, size = ort_outputs(one_node_model("CoresetMoE", t, attrs), t)
    assert size.tolist() == [KEPT[top_p]]


def test_full_p_routes_like_plain_top_k():
    t = tie_case()
    attrs = dict(top_k=K, top_p=1.0, coreset=1, block_size=N)
    plain = moe_core(t["x"], t["router_w"], t["gate_up"], t["down"], K, 1.0, False, N)
    routed, size = ort_outputs(one_node_model("CoresetMoE", t, attrs), t)
    torch.testing.assert_close(torch.from_numpy(routed), plain[0], atol=1e-6, rtol=1e-5)  # outputs ~1e3
    assert size.tolist() == plain[1].tolist()

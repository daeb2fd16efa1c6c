"""Each custom op's ONNX function body (plugins/onnx_bodies.py) against its plain-torch core.

One node per model, the FunctionProto attached; ONNX Runtime (and onnx.reference
for one case) runs the body. Cases cover C = 0 causal rows, more than one
64-row chunk, padding rows, unordered slots and the coreset switches.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from clover_export.plugins.contracts import CONTRACTS
from clover_export.plugins.onnx_ops import OPSET, function_proto, node_attributes
from clover_export.plugins.torch_ops import reference_core

_DT = {torch.float32: TensorProto.FLOAT, torch.int32: TensorProto.INT32}


def one_node_model(name: str, tensors: dict, attrs: dict, with_function: bool = True) -> onnx.ModelProto:
    c = CONTRACTS[name]
    node = helper.make_node(c.name, [t.name for t in c.inputs], [t.name for t in c.outputs], domain=c.namespace,
                            **node_attributes(c, attrs))
    ins = [helper.make_tensor_value_info(t.name, _DT[tensors[t.name].dtype], [None] * t.rank) for t in c.inputs]
    outs = [helper.make_tensor_value_info(t.name, TensorProto.INT32 if t.dtype == "int32" else TensorProto.FLOAT,
                                          [None] * t.rank) for t in c.outputs]
    return helper.make_model(
        helper.make_graph([node], name, ins, outs), ir_version=9,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(c.namespace, 1)],
        functions=[function_proto(c)] if with_function else [],
    )


def core_outputs(name, tensors, attrs):
    c = CONTRACTS[name]
    return [
        o.numpy()
        for o in reference_core(c)(*[tensors[t.name] for t in c.inputs], *[attrs[a.name] for a in c.attributes])
    ]


def ort_outputs(model, tensors):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {k: v.numpy() for k, v in tensors.items()})


def rn(g, *s):
    return torch.randn(*s, generator=g)


def gdn_case(Tc, n_causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S, Hk, dk, dv, Hv, K, N = 2, 3, 2, 8, 8, 4, 4, 5
    Cc, T = 2 * Hk * dk + Hv * dv, Tc + N
    t = dict(mixed_qkv=rn(g, B, T, Cc), a=rn(g, B, T, Hv), b=rn(g, B, T, Hv), conv_w=rn(g, Cc, K) / 2,
             conv_w_right=rn(g, Cc, K) / 2, A_log=torch.rand(Hv, generator=g) * 2, dt_bias=rn(g, Hv),
             block_scale=torch.rand(Hv, generator=g) * 4, block_gate=rn(g, Hv), conv_pool=rn(g, S, Cc, K - 1),
             rec_pool=rn(g, S, Hv, dk, dv) * 0.1, slot_ids=torch.tensor([2, 0], dtype=torch.int32),
             n_causal=torch.tensor(n_causal, dtype=torch.int32))
    return t, dict(num_k_heads=Hk, head_k_dim=dk, head_v_dim=dv, block_size=N)


def attention_case(Tc, n_causal, past, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S, H, Hkv, hd, L, N = 2, 3, 4, 2, 8, 20, 5
    T = Tc + N
    t = dict(q=rn(g, B, T, H, hd), k=rn(g, B, T, Hkv, hd), v=rn(g, B, T, Hkv, hd), key_pool=rn(g, S, Hkv, L, hd),
             value_pool=rn(g, S, Hkv, L, hd), slot_ids=torch.tensor([1, 2], dtype=torch.int32),
             past_len=torch.tensor(past, dtype=torch.int32), n_causal=torch.tensor(n_causal, dtype=torch.int32))
    return t, dict(block_size=N, scale=hd**-0.5)


def moe_case(Tc, coreset, top_p, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, D, E, I, N = 2, 16, 8, 12, 5
    T = Tc + N
    t = dict(x=rn(g, B, T, D), router_w=rn(g, E, D), gate_up=rn(g, E, 2 * I, D) * 0.3, down=rn(g, E, D, I) * 0.3)
    return t, dict(top_k=2, top_p=top_p, coreset=coreset, block_size=N)


CASES = [
    ("BlockGDN", *gdn_case(7, [7, 3])),
    ("BlockGDN", *gdn_case(0, [0, 0])),  # block-only step: no causal rows
    ("BlockGDN", *gdn_case(70, [70, 65])),  # two 64-row chunks, padding rows
    ("BlockAttention", *attention_case(4, [4, 2], [0, 9])),
    ("BlockAttention", *attention_case(0, [0, 0], [3, 5])),
    ("CoresetMoE", *moe_case(3, True, 0.9)),
    ("CoresetMoE", *moe_case(3, True, 0.5)),
    ("CoresetMoE", *moe_case(3, False, 0.9)),
    ("CoresetMoE", *moe_case(0, True, 1.0)),
]


def valid_rows(name, tensors, attrs, outputs):
    """Padding causal rows (at or past n_causal) are don't-care rows of every op (STEP_GRAPH.md 1): the
    attention core zeroes the values a padding row would read past the valid prefix (so stale or NaN
    cache entries cannot leak), the function body reads them; both are set to 0 here before comparing."""
    if name != "BlockAttention":
        return outputs
    o = np.array(outputs[0])
    Tc = o.shape[1] - attrs["block_size"]
    pad = np.arange(o.shape[1])[None, :] >= tensors["n_causal"].numpy()[:, None]
    pad[:, Tc:] = False
    o[pad] = 0
    return [o, *outputs[1:]]


@pytest.mark.parametrize("name,tensors,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_function_body_reproduces_the_core(name, tensors, attrs):
    model = one_node_model(name, tensors, attrs)
    onnx.checker.check_model(model, full_check=True)
    got = valid_rows(name, tensors, attrs, ort_outputs(model, tensors))
    want = valid_rows(name, tensors, attrs, [np.asarray(x) for x in core_outputs(name, tensors, attrs)])
    for spec, g, r in zip(CONTRACTS[name].outputs, got, want):
        assert g.shape == r.shape, spec.name
        assert g.dtype == r.dtype, spec.name
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=0, err_msg=f"{name}.{spec.name}")


def test_cases_exercise_the_interesting_paths():
    """The cases above would not catch much if pools stayed put or routing never changed."""
    t, a = gdn_case(70, [70, 65])
    o, conv, rec = core_outputs("BlockGDN", t, a)
    assert not np.allclose(rec[[2, 0]], t["rec_pool"].numpy()[[2, 0]]) and np.array_equal(
        rec[1], t["rec_pool"].numpy()[1]
    )
    sizes = {float(p): core_outputs("CoresetMoE", *moe_case(3, True, p))[1].tolist() for p in (0.5, 0.9)}
    plain = core_outputs("CoresetMoE", *moe_case(3, False, 0.9))[1].tolist()
    assert sizes[0.5] != plain and sizes[0.5] != sizes[0.9]


def test_functions_run_in_onnx_reference_too():
    from onnx.reference import ReferenceEvaluator

    for name, tensors, attrs in (CASES[0], CASES[3], CASES[5]):
        model = one_node_model(name, tensors, attrs)
        got = ReferenceEvaluator(model).run(None, {k: v.numpy() for k, v in tensors.items()})
        got = valid_rows(name, tensors, attrs, got)
        for g, r in zip(
            got, valid_rows(name, tensors, attrs, [np.asarray(x) for x in core_outputs(name, tensors, attrs)])
        ):
            np.testing.assert_allclose(g, r, atol=1e-4, rtol=0)


def test_without_the_function_onnxruntime_cannot_run_the_node():
    name, tensors, attrs = CASES[0]
    with pytest.raises(Exception, match="BlockGDN|clover"):
        ort_outputs(one_node_model(name, tensors, attrs, with_function=False), tensors)

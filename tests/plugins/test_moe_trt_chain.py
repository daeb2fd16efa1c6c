"""CoresetMoE as the TensorRT sub-op chain (STEP_GRAPH.md 2, 4): route, align, gate_up, down, combine.

- The torch references of the sub-ops (`model/moe_split.py`), composed as
  `model.trt.onnx` wires them, equal `moe_core` / `moe_core_fp8`.
- Each sub-op's Triton kernel, launched exactly as its TensorRT AOT plan says
  (`plan.aot_plan`: variant constexprs and options, grid, the int32 scalars
  taken from input dims, pointers in contract order), equals its torch
  reference, and the kernel chain equals `moe_core`; under TRITON_INTERPRET=1
  in a child process (the interpreter must be on before triton is imported), fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

ATOL, RTOL = 3e-5, 1e-5


def make_case(B=2, Tc=3, N=5, D=32, E=8, I=16, k=2, seed=0, ties=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = Tc + N
    x = torch.randn(B, T, D, generator=g).to(dtype)
    rw = torch.randn(E, D, generator=g) * 0.5
    if ties:
        rw[1::2] = rw[0::2]
    gu = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    dn = torch.randn(E, D, I, generator=g) / I ** 0.5
    return x, rw.to(dtype), gu.to(dtype), dn.to(dtype)


CASES = {  # name -> (make_case kwargs, routing attrs)
    "coreset": ({}, dict(top_k=2, top_p=0.9, coreset=True)),
    "plain": ({"seed": 1}, dict(top_k=2, top_p=0.9, coreset=False)),
    "small_top_p": ({"E": 16, "k": 3, "seed": 2}, dict(top_k=3, top_p=0.5, coreset=True)),
    "no_block": ({"N": 0, "Tc": 4, "seed": 3}, dict(top_k=2, top_p=0.9, coreset=True)),
    "block_only": ({"Tc": 0, "N": 7, "seed": 4}, dict(top_k=2, top_p=1.0, coreset=True)),
    "ties": ({"ties": True, "seed": 5}, dict(top_k=2, top_p=0.6, coreset=True)),
    "coreset_below_k": ({"E": 16, "k": 3, "seed": 8}, dict(top_k=3, top_p=0.05, coreset=True)),  # unused slots
    "many_pairs": ({"B": 3, "Tc": 30, "N": 8, "E": 5, "seed": 6}, dict(top_k=2, top_p=0.9, coreset=True)),
}


# ----------------------------------------------------------------- torch: the chain is moe_core
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_chain_equals_moe_core(case, dtype):
    from clover_export.model.moe import moe_core
    from clover_export.model.moe_split import moe_chain

    kw, attrs = CASES[case]
    x, rw, gu, dn = make_case(dtype=dtype, **kw)
    N = kw.get("N", 5)
    want = moe_core(x, rw, gu, dn, attrs["top_k"], attrs["top_p"], attrs["coreset"], N)
    got = moe_chain(x, rw, gu, dn, attrs["top_k"], attrs["top_p"], attrs["coreset"], N)
    assert torch.equal(got[1], want[1])
    # bf16: moe_core adds the experts' contributions in bf16 one expert at a time, combine sums in fp32
    tol = dict(atol=ATOL, rtol=RTOL) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)


def test_reference_chain_fp8_equals_moe_core_fp8():
    from clover_export.model.moe import moe_core_fp8
    from clover_export.model.moe_split import moe_chain
    from clover_export.quantize.scales import quantize_weight

    x, rw, gu, dn = make_case(seed=7)
    (gq, gs), (dq, ds) = quantize_weight(gu), quantize_weight(dn)
    want = moe_core_fp8(x, rw, gq, gs, dq, ds, 2, 0.9, True, 5)
    got = moe_chain(x, rw, gq, dq, 2, 0.9, True, 5, gate_up_scale=gs, down_scale=ds)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=RTOL)


def test_align_is_a_stable_sort_with_offsets():
    from clover_export.model.moe_split import align_core

    idx = torch.tensor([[[3, 0], [3, 4], [1, 3]]], dtype=torch.int32)  # E = 4: id 4 is an unused slot
    offsets, order = align_core(idx, 4)
    assert offsets.tolist() == [0, 1, 2, 2, 5]  # hand-computed: one 0, one 1, no 2, three 3s
    assert order.reshape(-1).tolist() == [1, 4, 0, 2, 5, 3]


# ----------------------------------------------------------------- Triton kernels as TensorRT launches them
def launch_as_tensorrt(op: str, inputs: dict, attrs: dict, outputs: dict) -> None:
    """Launch a sub-op's kernel from its AOT plan: pointers of the inputs, the plan's int32 scalars, output pointers."""
    import importlib

    from clover_export.plugins.contracts import MOE_SUBOPS
    from clover_export.plugins.trt import plan

    c = MOE_SUBOPS[op]
    shapes = {n: tuple(t.shape) for n, t in inputs.items()}
    dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in inputs.items()}
    p = plan.aot_plan(op, shapes, attrs, dtypes, 90)
    fn = getattr(importlib.import_module(f"clover_export.plugins.triton.{p.variant.module}"), p.variant.kernel)
    scalars = [int(shapes[src][dim]) for src, dim in p.scalars]
    args = [inputs[t.name] for t in c.inputs] + scalars + [outputs[t.name] for t in c.outputs]
    fn[p.grid](*args, **p.variant.constexprs, **p.variant.options)


def chain_case(name: str, fp8: bool = False):
    from clover_export.model import moe_split as S
    from clover_export.model.moe import moe_core, moe_core_fp8
    from clover_export.quantize.scales import quantize_weight

    kw, attrs = CASES[name]
    N = kw.get("N", 5)
    x, rw, gu, dn = make_case(**kw)
    B, T, D = x.shape
    E, k, I = rw.shape[0], attrs["top_k"], dn.shape[2]
    ra = dict(attrs, block_size=N)
    empty = lambda *s, dt=torch.float32: torch.full(s, -7, dtype=dt)  # noqa: E731  (garbage: every read row must be written)
    logits = torch.nn.functional.linear(x, rw)
    idx, w, cs = empty(B, T, k, dt=torch.int32), empty(B, T, k), empty(B, dt=torch.int32)
    launch_as_tensorrt("MoERoute", {"logits": logits}, ra, {"idx": idx, "w": w, "coreset_size": cs})
    r_idx, r_w, r_cs = S.route_core(logits, k, attrs["top_p"], attrs["coreset"], N)
    assert torch.equal(idx, r_idx) and torch.equal(cs, r_cs), "MoERoute ids / coreset_size"
    torch.testing.assert_close(w, r_w, atol=ATOL, rtol=RTOL)
    offsets, order = empty(E + 1, dt=torch.int32), empty(B, T, k, dt=torch.int32)
    launch_as_tensorrt("MoEAlign", {"idx": idx}, {"num_experts": E}, {"offsets": offsets, "order": order})
    r_off, r_order = S.align_core(idx, E)
    assert torch.equal(offsets, r_off) and torch.equal(order, r_order), "MoEAlign"
    used = (idx < E).unsqueeze(-1)
    h = empty(B, T, k, I)
    if fp8:
        (gq, gs), (dq, ds) = quantize_weight(gu), quantize_weight(dn)
        launch_as_tensorrt("MoEGateUpFP8", {"x": x, "gate_up_fp8": gq, "gate_up_scale": gs, "offsets": offsets,
                                            "order": order}, {}, {"h": h})
        r_h = S.gate_up_fp8_core(x, gq, gs, offsets, order)
    else:
        launch_as_tensorrt("MoEGateUp", {"x": x, "gate_up": gu, "offsets": offsets, "order": order}, {}, {"h": h})
        r_h = S.gate_up_core(x, gu, offsets, order)
    torch.testing.assert_close(torch.where(used, h, 0.0), r_h, atol=ATOL, rtol=RTOL)
    y = empty(B, T, k, D)
    if fp8:
        launch_as_tensorrt("MoEDownFP8", {"h": h, "down_fp8": dq, "down_scale": ds, "w": w, "offsets": offsets,
                                          "order": order}, {}, {"y": y})
        r_y = S.down_fp8_core(h, dq, ds, w, offsets, order)
    else:
        launch_as_tensorrt("MoEDown", {"h": h, "down": dn, "w": w, "offsets": offsets, "order": order}, {}, {"y": y})
        r_y = S.down_core(h, dn, w, offsets, order)
    torch.testing.assert_close(torch.where(used, y, 0.0), r_y, atol=ATOL, rtol=RTOL)
    routed = empty(B, T, D)
    launch_as_tensorrt("MoECombine", {"y": y, "idx": idx}, {"num_experts": E}, {"routed": routed})
    if fp8:
        want = moe_core_fp8(x, rw, gq, gs, dq, ds, k, attrs["top_p"], attrs["coreset"], N)
    else:
        want = moe_core(x, rw, gu, dn, k, attrs["top_p"], attrs["coreset"], N)
    torch.testing.assert_close(routed, want[0], atol=ATOL, rtol=RTOL)
    assert torch.equal(cs, want[1])
    return {"unused_slots": int((idx == E).sum()), "pairs": B * T * k}


CHILD_CASES = {**{n: (lambda n=n: chain_case(n)) for n in CASES}, "fp8": lambda: chain_case("coreset", fp8=True)}


def _child(names):
    out = {}
    for name in names:
        try:
            out[name] = {"ok": True, "info": CHILD_CASES[name]()}
        except Exception:
            out[name] = {"ok": False, "error": traceback.format_exc(limit=6)}
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__, *CHILD_CASES], env=env, capture_output=True, text=True,
                          timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line, f"the interpreter child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULTS "):])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CHILD_CASES))
def test_kernel_chain_equals_moe_core(results, case):
    pytest.importorskip("triton")
    assert results[case]["ok"], results[case].get("error")


@pytest.mark.slow
def test_chain_cases_exercise_unused_slots(results):
    """Some case leaves routing slots unused (coreset smaller than k), so the E sentinel path is tested."""
    assert any(r["info"]["unused_slots"] > 0 for r in results.values() if r["ok"])


if __name__ == "__main__":
    _child(sys.argv[1:])

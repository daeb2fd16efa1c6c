"""GPU check of CoresetMoE as TensorRT runs it: the five AOT sub-op kernels from their PTX.

Each sub-op of `model.trt.onnx` (MoERoute, MoEAlign, MoEGateUp(FP8), MoEDown(FP8), MoECombine) is
compiled to PTX for this GPU (`aot.compile_variant`, hidden parameters stripped) and launched exactly
as TensorRT's AOT plugin launch would: grid, block and shared memory from `plan.aot_plan`, input
pointers, int32 scalars from input dims, output pointers (CuPy RawModule, else libcuda). The router
logits are a plain bf16 matmul, as the graph's MatMul. Checked against `moe_core` (fp32 and bf16
references) and the sub-op torch references; timed side by side with the Triton+torch path
(`ops.coreset_moe`: torch.sort + searchsorted + four Triton launches). No TensorRT needed.

    python gpu_checks/moe_trt_chain_gpu.py          (prints PASS/FAIL and BENCH lines)
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
from pathlib import Path

import torch

from clover_export.testing.cuda import arch, bench_ms
from clover_export.testing.kernel_cases import REAL, rel
from clover_export.testing.ptx_launcher import Launcher


def sub_op_chain(x, rw, gu, dn, gs, ds, attrs, launcher, ptx_dir, cache):
    """The chain of model.trt.onnx on the GPU from AOT PTX; returns every intermediate."""
    from clover_export.plugins.contracts import MOE_SUBOPS
    from clover_export.plugins.triton import aot
    from clover_export.plugins.trt import plan

    B, T, D = x.shape
    E, k, I = rw.shape[0], attrs["top_k"], dn.shape[2]
    fp8 = gs is not None
    t = dict(x=x, logits=torch.nn.functional.linear(x, rw))
    t.update(idx=torch.empty(B, T, k, dtype=torch.int32, device=x.device), w=torch.empty(B, T, k, dtype=x.dtype,
             device=x.device), coreset_size=torch.empty(B, dtype=torch.int32, device=x.device),
             offsets=torch.empty(E + 1, dtype=torch.int32, device=x.device),
             order=torch.empty(B, T, k, dtype=torch.int32, device=x.device),
             h=torch.empty(B, T, k, I, dtype=x.dtype, device=x.device),
             y=torch.empty(B, T, k, D, dtype=x.dtype, device=x.device), routed=torch.empty_like(x))
    if fp8:
        t.update(gate_up_fp8=gu, gate_up_scale=gs, down_fp8=dn, down_scale=ds)
    else:
        t.update(gate_up=gu, down=dn)
    ops = ["MoERoute", "MoEAlign", "MoEGateUpFP8" if fp8 else "MoEGateUp", "MoEDownFP8" if fp8 else "MoEDown",
           "MoECombine"]
    launches = []
    for op in ops:
        c = MOE_SUBOPS[op]
        shapes = {s.name: tuple(t[s.name].shape) for s in c.inputs}
        dtypes = {s.name: str(t[s.name].dtype).removeprefix("torch.") for s in c.inputs}
        a = attrs if op == "MoERoute" else ({"num_experts": E} if op in ("MoEAlign", "MoECombine") else {})
        p = plan.aot_plan(op, shapes, a, dtypes, arch())
        if p.variant.key not in cache:
            comp = aot.compile_variant(p.variant, arch())
            path = ptx_dir / f"{p.variant.key}.ptx"
            path.write_text(comp.ptx)
            cache[p.variant.key] = (launcher.load(path, comp.name), comp)
        fn, comp = cache[p.variant.key]
        args = [("ptr", t[s.name].data_ptr()) for s in c.inputs]
        args += [("i32", int(shapes[src][dim])) for src, dim in p.scalars]
        args += [("ptr", t[s.name].data_ptr()) for s in c.outputs]
        launches.append((fn, p.grid, comp.block, comp.shared, args))

    def run():
        t["logits"].copy_(torch.nn.functional.linear(x, rw))
        for fn, grid, block, shared, args in launches:
            launcher.launch(fn, grid, block, shared, args)

    run()
    torch.cuda.synchronize()
    return t, run


def check_case(name, B, Tc, fp8, launcher, ptx_dir, cache, results):
    from clover_export.model import moe_split as S
    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton.ops import coreset_moe
    from clover_export.quantize.scales import quantize_weight

    D, E, k, I, N = REAL["D"], REAL["E"], REAL["k"], REAL["I"], REAL["N"]
    g = torch.Generator(device="cuda").manual_seed(3)
    T = Tc + N
    x = torch.randn(B, T, D, device="cuda", generator=g).bfloat16()
    rw = (torch.randn(E, D, device="cuda", generator=g) * 0.05).bfloat16()
    gu = (torch.randn(E, 2 * I, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    dn = (torch.randn(E, D, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    attrs = dict(top_k=k, top_p=REAL["top_p"], coreset=1, block_size=N)
    gs = ds = None
    if fp8:
        (gq, gs), (dq, ds) = quantize_weight(gu.float()), quantize_weight(dn.float())
        gu, dn = gq, dq
        gu_ref = (gq.float() * gs[..., None]).bfloat16()
        dn_ref = (dq.float() * ds[..., None]).bfloat16()
    else:
        gu_ref, dn_ref = gu, dn
    t, run = sub_op_chain(x, rw, gu, dn, gs, ds, attrs, launcher, ptx_dir, cache)
    r_idx, r_w, r_cs = S.route_core(t["logits"], k, attrs["top_p"], True, N)
    r_off, r_order = S.align_core(r_idx, E)
    ok_route = torch.equal(t["idx"], r_idx) and torch.equal(t["coreset_size"], r_cs)
    ok_align = torch.equal(t["offsets"], r_off) and torch.equal(t["order"], r_order)
    ref16 = moe_core(x, rw, gu_ref, dn_ref, k, attrs["top_p"], True, N)
    ref32 = moe_core(x.float(), rw.float(), gu_ref.float(), dn_ref.float(), k, attrs["top_p"], True, N)
    e_chain, e_ref16 = rel(t["routed"], ref32[0]), rel(ref16[0], ref32[0])
    ok = ok_route and ok_align and e_chain <= max(2 * e_ref16, 1e-2) and torch.equal(t["coreset_size"], ref16[1])
    line = (f"{'PASS' if ok else 'FAIL'} moe-trt-chain {name}: route ids {'==' if ok_route else '!='} reference, "
            f"align {'==' if ok_align else '!='} stable sort, rel err vs fp32 moe_core {e_chain:.2e} "
            f"(bf16 moe_core itself {e_ref16:.2e})")
    print(line, flush=True)
    results.append(line)
    chain_ms = bench_ms(run)
    kw = dict(gate_up_scale=gs, down_scale=ds) if fp8 else {}
    triton_ms = bench_ms(lambda: coreset_moe(x, rw, gu, dn, k, attrs["top_p"], True, N, **kw))
    line = (f"BENCH moe-trt-chain {name}: AOT sub-op chain {chain_ms * 1e3:.1f} us, Triton+torch.sort path "
            f"{triton_ms * 1e3:.1f} us, ratio {chain_ms / triton_ms:.2f}")
    print(line, flush=True)
    results.append(line)
    return ok


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    launcher = Launcher()
    print(f"GPU {torch.cuda.get_device_name()} sm_{arch()}, launcher {launcher.kind}", flush=True)
    ptx_dir = Path(tempfile.mkdtemp(prefix="moe_ptx_"))
    cache, results, fails = {}, [], 0
    for name, B, Tc, fp8 in (("decode B8 bf16", 8, 32, False), ("prefill B1 C256 bf16", 1, 256, False),
                             ("decode B8 fp8", 8, 32, True)):
        try:
            fails += not check_case(name, B, Tc, fp8, launcher, ptx_dir, cache, results)
        except Exception:  # report every case
            fails += 1
            print(f"FAIL moe-trt-chain {name}:\n{traceback.format_exc(limit=5)}", flush=True)
    print(f"SUMMARY {fails} failure(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())

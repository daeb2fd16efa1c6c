#!/usr/bin/env python3
"""GPU check of the plugin kernels on one CUDA GPU without TensorRT (STEP_GRAPH.md 5).

Run through `gpu_checks/gpu_check.sh` (it sets up the environment and a hard
timeout). Each step prints one `PASS name ...`, `FAIL name ...` or
`SKIP name ...` line and never stops the run; results accumulate in
`$OUT/gpu_check_results.json` (rewritten after every step) and the AOT PTX
under `$OUT/ptx/`.

1. Correctness on CUDA against the plain-torch cores (same inputs, same
   dtype; fp32 and bf16; FP8 expert weights against the dequantized
   reference): BlockGDN, BlockAttention (one pass and split), CoresetMoE.
2. The AOT PTX of BlockGDN and BlockAttention launched exactly as TensorRT
   launches an AOT plugin (hidden Triton params stripped; pointers of the
   inputs, int32 scalars, pointers of the outputs; grid, block, dynamic
   shared memory), through CuPy `RawModule` (or libcuda via ctypes when CuPy
   is missing): PTX compiled here by this machine's Triton, and the PTX
   carried from the project machine (gpu_checks/ptx, if present).
3. A tiny model step with the kernels as its cores, eager and CUDA-graph replay.
4. Benchmarks at Clover-35B-A3B layer sizes: CoresetMoE bandwidth over the
   selected experts' bytes and FP8/BF16 speedup; BlockGDN and BlockAttention
   against the eager torch cores; small tile sweeps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # before triton is imported

import torch  # noqa: E402

from clover_export.testing.cuda import arch, bench_ms, graph_ms  # noqa: E402
from clover_export.testing.kernel_cases import (  # noqa: E402
    DEV,
    REAL,
    attention_inputs,
    check_attention,
    check_gdn,
    check_moe,
    gdn_inputs,
    moe_inputs,
    rel,
    valid_rows,
)
from clover_export.testing.ptx_launcher import Launcher  # noqa: E402

PEAK_BW = 4.8e12  # H200 HBM3e, vendor figure
MOE_BW_TARGET, FP8_TARGET, CORE_SPEEDUP_TARGET = 0.60, 1.6, 10.0
CARRIED_PTX = Path(__file__).resolve().parent / "ptx"  # optional: PTX built on another machine, launched too


# ------------------------------------------------------------------ bookkeeping
class Run:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget, self.t0, self.results = out, budget_s, time.time(), []
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def step(self, name: str, fn, min_left: float = 0.0, bench: bool = False):
        if self.left() < min_left:
            print(f"SKIP {name} (time budget: {self.left():.0f}s left, wants {min_left:.0f}s)", flush=True)
            self.results.append({"name": name, "status": "SKIP"})
            return None
        t = time.time()
        try:
            info = fn() or {}
            ok = bool(info.pop("_ok", True))
            torch.cuda.synchronize()  # a kernel fault surfaces here, inside the step that caused it
        except Exception as e:  # every check reports and the run goes on
            ok, info = False, {"error": f"{type(e).__name__}: {e}"[:800], "trace": traceback.format_exc(limit=8)}
        status = ("BENCH" if ok else "FAIL") if bench else ("PASS" if ok else "FAIL")
        brief = {k: v for k, v in info.items() if k != "trace"}
        print(f"{status} {name} ({time.time() - t:.1f}s) {json.dumps(brief, default=str)[:1500]}", flush=True)
        if not ok and "trace" in info:
            print(info["trace"], flush=True)
        self.results.append({"name": name, "status": status, "seconds": round(time.time() - t, 2), **info})
        self.save()
        return info

    def save(self):
        tmp = self.out / "gpu_check_results.json.tmp"
        tmp.write_text(json.dumps({"elapsed_s": round(time.time() - self.t0, 1), "results": self.results},
                                  indent=1, default=str))
        tmp.replace(self.out / "gpu_check_results.json")


def _abi_args(abi, tensors: dict, shapes: dict):
    """TensorRT's order: input pointers, int32 scalars (from input dims), output pointers."""
    args = [("ptr", tensors[n].data_ptr()) for n in abi.inputs]
    args += [("i32", int(shapes[src][dim])) for _, src, dim in abi.scalars]
    args += [("ptr", tensors[n].data_ptr()) for n in abi.outputs]
    return args


def aot_cases(dtype=torch.bfloat16):
    """(op, variant key, build) for the real-size TensorRT AOT kernels; build() -> (tensors, shapes, check, grid)."""
    from clover_export.model.attention import attention_core
    from clover_export.model.gdn import gdn_core
    from clover_export.plugins.triton import launch

    def gdn():
        c = dict(B=2, Hk=REAL["Hk"], Hv=REAL["Hv"], dk=REAL["dk"], dv=REAL["dv"], K=REAL["K"], N=REAL["N"], Tc=32, S=3)
        args, (cp, rp), slots, nc = gdn_inputs(**c, dtype=dtype, pdtype=dtype, seed=4, nc=[32, 9], slots=[2, 0])
        want = gdn_core(*args, cp, rp, slots, nc, c["Hk"], c["dk"], c["dv"], c["N"])
        names = ["mixed_qkv", "a", "b", "conv_w", "conv_w_right", "A_log", "dt_bias", "block_scale", "block_gate"]
        t = dict(zip(names, args), conv_pool=cp.clone(), rec_pool=rp.clone(), slot_ids=slots, n_causal=nc)
        t["o"] = torch.full((2, 32 + c["N"], REAL["Hv"], REAL["dv"]), float("nan"), dtype=dtype, device=DEV)
        t["conv_pool_out"], t["rec_pool_out"] = t["conv_pool"], t["rec_pool"]  # aliased, as TensorRT binds them
        shapes = {n: tuple(x.shape) for n, x in t.items()}

        def check():
            return {"o_rel": rel(t["o"], want[0]), "rec_rel": rel(t["rec_pool"], want[2]),
                    "conv_exact": bool(torch.equal(t["conv_pool"], want[1]))}
        return t, shapes, check, lambda consts: launch.gdn_grid(shapes["mixed_qkv"][0], consts["HK"])

    def attention():
        c = dict(B=2, H=REAL["H"], Hkv=REAL["Hkv"], hd=REAL["hd"], N=REAL["N"], Tc=32, S=3, L=4160)
        (q, k, v), (kp, vp), ids = attention_inputs(**c, past=[4000, 5], nc=[32, 3], dtype=dtype, seed=5)
        want = attention_core(q, k, v, kp, vp, *ids, c["N"], c["hd"] ** -0.5)
        t = dict(q=q, k=k, v=v, key_pool=kp.clone(), value_pool=vp.clone(), slot_ids=ids[0], past_len=ids[1],
                 n_causal=ids[2])
        t["o"] = torch.full_like(q, float("nan"))
        t["key_pool_out"], t["value_pool_out"] = t["key_pool"], t["value_pool"]
        shapes = {n: tuple(x.shape) for n, x in t.items()}

        def check():
            rows = valid_rows(ids[2], c["Tc"], c["N"])  # padding causal rows are unspecified
            return {"o_rel": rel(t["o"][rows], want[0][rows]), "k_exact": bool(torch.equal(t["key_pool"], want[1])),
                    "v_exact": bool(torch.equal(t["value_pool"], want[2]))}
        return t, shapes, check, lambda consts: launch.attention_grid(shapes["q"][0], shapes["q"][1], consts)

    tt = launch.TRITON_TYPES[str(dtype).removeprefix("torch.")]
    return [("BlockGDN", f"BlockGDN.{tt}.p{tt}", gdn), ("BlockAttention", f"BlockAttention.{tt}", attention)]


def check_aot(run: Run, launcher: Launcher, carried: Path | None):
    from clover_export.core.config import CloverConfig
    from clover_export.plugins.triton import aot, launch

    cfg = CloverConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4)
    a = arch()
    variants = {v.key: v for v in aot.trt_variants(cfg, a)}
    abis = {"BlockGDN": launch.GDN_ABI, "BlockAttention": launch.ATTENTION_ABI}
    manifest = {}
    if carried and (carried / "manifest.json").exists():
        manifest = {(m["key"], m["arch"]): m for m in json.loads((carried / "manifest.json").read_text())}
    (run.out / "ptx").mkdir(exist_ok=True)
    for op, key, build in aot_cases():
        def local(op=op, key=key, build=build):
            c = aot.compile_variant(variants[key], a)
            path = run.out / "ptx" / f"{key}.sm{a}.ptx"
            path.write_text(c.ptx)
            return _launch_and_check(launcher, path, c.name, c.block, c.shared, variants[key].constexprs, abis[op],
                                     build, dict(params=len(c.params), stripped=[p for _, p in c.hidden]))
        run.step(f"aot_ptx_local.{key} [{launcher.kind}]", local, min_left=60)
        m = manifest.get((key, a))
        if m:
            def carried_fn(m=m, op=op, build=build):
                return _launch_and_check(launcher, carried / m["file"], m["name"], m["num_warps"] * 32, m["shared"],
                                         m["constexprs"], abis[op], build, {"from": str(carried / m["file"])})
            run.step(f"aot_ptx_carried.{key} [{launcher.kind}]", carried_fn, min_left=40)
        elif carried:
            print(f"SKIP aot_ptx_carried.{key} (no sm_{a} entry in {carried}/manifest.json)", flush=True)


def _launch_and_check(launcher, path, name, block, shared, consts, abi, build, extra):
    from clover_export.plugins.triton.aot import entry_params

    _, params = entry_params(path.read_text())
    t, shapes, check, grid_fn = build()
    args = _abi_args(abi, t, shapes)
    if len(params) != len(args):
        return {"_ok": False, "error": f"PTX entry has {len(params)} params, the TensorRT launch passes {len(args)}"}
    fn = launcher.load(path, name)
    grid = grid_fn(consts)
    launcher.launch(fn, grid, block, shared, args)
    torch.cuda.synchronize()
    info = dict(check(), grid=list(grid), block=block, shared=shared, **extra)
    info["_ok"] = info["o_rel"] < 3e-2 and info.get("rec_rel", 0) < 3e-2 and all(
        v for k, v in info.items() if k.endswith("_exact"))
    if shared > 48 * 1024:  # does a launch without raising the dynamic shared memory limit work? (TensorRT question)
        try:
            fn2 = launcher.load(path, name)
            t2, shapes2, _, _ = build()
            launcher.launch(fn2, grid, block, shared, _abi_args(abi, t2, shapes2), opt_in=False)
            torch.cuda.synchronize()
            info["launch_without_smem_opt_in"] = "worked"
        except Exception as e:  # noqa: BLE001
            info["launch_without_smem_opt_in"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
    return info


# ------------------------------------------------------------------ 3. model step, CUDA graph
def check_model_step(dtype):
    from clover_export.model.model import CloverModel, allocate_pools, init_random_
    from clover_export.plugins import cuda_ops
    from clover_export.tiny import tiny_config

    cfg = tiny_config()
    model = init_random_(CloverModel(cfg), seed=3).to(device=DEV, dtype=dtype).eval()
    g = torch.Generator(device=DEV).manual_seed(6)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    B, C, N = 3, 32, cfg.block_size
    inputs = dict(input_ids=torch.randint(0, cfg.vocab_size, (B, C + N), generator=g, device=DEV, dtype=torch.int32),
                  n_causal=i32(32, 4, 0), has_block=i32(1, 1, 1), slot_ids=i32(2, 0, 3), past_len=i32(0, 100, 37),
                  logit_rows=i32([31, 0, 7], [3, 1, 0], [C, C + 5, C + N + 9]))  # causal rows; block rows, clamped
    pools = allocate_pools(cfg, 4, 256, dtype=dtype, device=DEV)
    for p in pools.values():
        p.copy_(torch.randn(p.shape, generator=g, device=DEV) * 0.5)
    with torch.no_grad():
        want = model.step(inputs, {n: p.clone() for n, p in pools.items()})
        model.cores = cuda_ops.cuda_cores()
        mine = {n: p.clone() for n, p in pools.items()}
        got = model.step(inputs, mine)
        # CUDA graph: the same step captured and replayed on fresh copies of the pools
        static = {n: p.clone() for n, p in pools.items()}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model.step(inputs, {n: p.clone() for n, p in pools.items()})  # warm-up (compiles) off the graph
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = model.step(inputs, static)
        for n, p in static.items():
            p.copy_(pools[n])
        graph.replay()
        torch.cuda.synchronize()
    info = {"logits_rel": rel(got[0], want[0]), "coreset_equal": bool(torch.equal(got[1], want[1])),
            "causal_logits_rel": rel(got.causal_logits, want.causal_logits),
            "graph_causal_logits_equal_eager": bool(torch.equal(g_out.causal_logits, got.causal_logits)),
            "pools_rel_max": max(rel(mine[n], want[2][n]) for n in pools),
            "graph_logits_equal_eager": bool(torch.equal(g_out[0], got[0])),
            "graph_pools_equal_eager": all(torch.equal(static[n], mine[n]) for n in pools)}
    graph_ok = (info["graph_logits_equal_eager"] and info["graph_pools_equal_eager"]
                and info["graph_causal_logits_equal_eager"])
    if dtype == torch.float32:
        info["_ok"] = (graph_ok and info["logits_rel"] < 2e-3 and info["causal_logits_rel"] < 2e-3
                       and info["pools_rel_max"] < 2e-3 and info["coreset_equal"])
    else:  # bf16 rounding upstream of the router may flip near-tied experts: report, do not require equality
        info["_ok"] = graph_ok and info["logits_rel"] < 1e-1 and info["causal_logits_rel"] < 1e-1
    return info


# ------------------------------------------------------------------ 4. benchmarks
def bench_moe(B: int, sweep: bool):
    from clover_export.plugins.triton import ops
    from clover_export.quantize.scales import quantize_weight

    T, N = 2 * REAL["N"], REAL["N"]
    D, E, I, k = REAL["D"], REAL["E"], REAL["I"], REAL["k"]
    x, rw, gu, dn = moe_inputs(B, T, D, E, I, torch.bfloat16, seed=7)
    (gq, gs), (dq, ds) = quantize_weight(gu), quantize_weight(dn)
    idx, w, distinct = ops.moe_route(x, rw, k, REAL["top_p"], True, N)
    used = int(torch.unique(idx[idx < E]).numel())
    bytes_bf16 = used * (2 * I * D + D * I) * 2
    bytes_fp8 = used * (2 * I * D + D * I) + used * (2 * I + D) * 4
    info = {"B": B, "T": T, "selected_experts": used, "coreset_size": distinct.tolist(),
            "MB_selected_bf16": round(bytes_bf16 / 1e6, 1)}
    full = lambda **kw: ops.coreset_moe(x, rw, gu, dn, k, REAL["top_p"], True, N, **kw)  # noqa: E731
    full8 = lambda **kw: ops.coreset_moe(x, rw, gq, dq, k, REAL["top_p"], True, N, gate_up_scale=gs,  # noqa: E731
                                         down_scale=ds, **kw)
    experts = lambda: ops.moe_experts(x, idx, w, gu, dn)  # noqa: E731
    experts8 = lambda: ops.moe_experts(x, idx, w, gq, dq, gate_up_scale=gs, down_scale=ds)  # noqa: E731
    t_bf16, t_fp8 = bench_ms(full), bench_ms(full8)
    info.update(op_ms_bf16=round(t_bf16, 4), op_ms_fp8=round(t_fp8, 4),
                experts_ms_bf16=round(bench_ms(experts), 4), experts_ms_fp8=round(bench_ms(experts8), 4))
    try:
        info["graph_op_ms_bf16"] = round(graph_ms(full), 4)
        info["graph_op_ms_fp8"] = round(graph_ms(full8), 4)
    except Exception as e:  # noqa: BLE001
        info["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    best_bf16 = min(t_bf16, info.get("graph_op_ms_bf16", math.inf))
    best_fp8 = min(t_fp8, info.get("graph_op_ms_fp8", math.inf))
    info["bw_TBps_bf16"] = round(bytes_bf16 / (best_bf16 * 1e-3) / 1e12, 3)
    info["bw_TBps_fp8"] = round(bytes_fp8 / (best_fp8 * 1e-3) / 1e12, 3)
    info["bw_frac_of_4.8TBps_bf16"] = round(bytes_bf16 / (best_bf16 * 1e-3) / PEAK_BW, 3)
    info["bw_frac_experts_only_bf16"] = round(bytes_bf16 / (info["experts_ms_bf16"] * 1e-3) / PEAK_BW, 3)
    info["fp8_speedup"] = round(best_bf16 / best_fp8, 3)
    info["target_bw>=60%"] = "MET" if info["bw_frac_of_4.8TBps_bf16"] >= MOE_BW_TARGET else "MISSED"
    info["target_fp8>=1.6x"] = "MET" if info["fp8_speedup"] >= FP8_TARGET else "MISSED"
    if sweep:  # which tiles stream the weights best (for launch.MOE_TILES)
        res = {}
        for tiles in (
            {"BLOCK_N1": 64, "BLOCK_K1": 128, "BLOCK_N2": 64, "BLOCK_K2": 128, "num_stages": 4},
            {"BLOCK_N1": 128, "BLOCK_K1": 64, "BLOCK_N2": 128, "BLOCK_K2": 64, "num_stages": 4},
            {"BLOCK_N1": 64, "BLOCK_K1": 64, "BLOCK_N2": 128, "BLOCK_K2": 128, "num_stages": 3},
            {"BLOCK_N1": 32, "BLOCK_K1": 256, "BLOCK_N2": 64, "BLOCK_K2": 256, "num_stages": 3, "num_warps": 4},
        ):
            tag = ",".join(f"{a}={b}" for a, b in tiles.items())
            try:
                res[tag] = (round(bench_ms(lambda: ops.moe_experts(x, idx, w, gu, dn, tiles=tiles)), 4),
                            round(bench_ms(lambda: ops.moe_experts(x, idx, w, gq, dq, gate_up_scale=gs, down_scale=ds,
                                                                   tiles=tiles)), 4))
            except Exception as e:  # noqa: BLE001
                res[tag] = f"{type(e).__name__}: {str(e)[:120]}"
        info["sweep_experts_ms_(bf16,fp8)"] = res
    return info


def bench_moe_eager_reference():
    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton import ops

    x, rw, gu, dn = moe_inputs(1, 64, REAL["D"], REAL["E"], REAL["I"], torch.bfloat16, seed=8)
    t_ref = bench_ms(lambda: moe_core(x, rw, gu, dn, REAL["k"], REAL["top_p"], True, REAL["N"]), rep_ms=300)
    t = bench_ms(lambda: ops.coreset_moe(x, rw, gu, dn, REAL["k"], REAL["top_p"], True, REAL["N"]))
    return {"B": 1, "eager_core_ms": round(t_ref, 3), "kernels_ms": round(t, 4), "speedup": round(t_ref / t, 1)}


def bench_gdn(B: int, sweep: bool):
    from clover_export.model.gdn import gdn_core
    from clover_export.plugins.triton.ops import block_gdn

    c = dict(B=B, Hk=REAL["Hk"], Hv=REAL["Hv"], dk=REAL["dk"], dv=REAL["dv"], K=REAL["K"], N=REAL["N"], Tc=32, S=B)
    args, (cp, rp), slots, nc = gdn_inputs(**c, dtype=torch.bfloat16, pdtype=torch.bfloat16, seed=9)
    tail = (slots, nc, c["Hk"], c["dk"], c["dv"], c["N"])
    t_ref = bench_ms(lambda: gdn_core(*args, cp, rp, *tail), rep_ms=200)
    t = bench_ms(lambda: block_gdn(*args, cp, rp, *tail))
    state_bytes = 2 * B * c["Hv"] * c["dk"] * c["dv"] * 4 + args[0].numel() * 2
    info = {"B": B, "T": 64, "eager_core_ms": round(t_ref, 4), "kernel_ms": round(t, 4), "speedup": round(t_ref / t, 1),
            "kernel_GBps_state+inputs": round(state_bytes / (t * 1e-3) / 1e9, 1)}
    info["target>=10x"] = "MET" if info["speedup"] >= CORE_SPEEDUP_TARGET else "MISSED"
    if sweep:
        res = {}
        for kw in (dict(bv=64, dot_precision="tf32x3"), dict(bv=32), dict(chunk=16)):
            tag = ",".join(f"{a}={b}" for a, b in kw.items())
            try:
                res[tag] = round(bench_ms(lambda: block_gdn(*args, cp, rp, *tail, **kw)), 4)
            except Exception as e:  # noqa: BLE001
                res[tag] = f"{type(e).__name__}: {str(e)[:120]}"
        info["sweep_ms"] = res
    return info


def bench_attention(B: int, prefix: int, sweep: bool):
    from clover_export.model.attention import attention_core
    from clover_export.plugins.triton.ops import block_attention

    c = dict(B=B, H=REAL["H"], Hkv=REAL["Hkv"], hd=REAL["hd"], N=REAL["N"], Tc=32, S=B, L=prefix + 64)
    (q, k, v), (kp, vp), ids = attention_inputs(**c, past=[prefix] * B, nc=[32] * B, dtype=torch.bfloat16, seed=10)
    scale = c["hd"] ** -0.5
    t_ref = bench_ms(lambda: attention_core(q, k, v, kp, vp, *ids, c["N"], scale), rep_ms=300)
    t = bench_ms(lambda: block_attention(q, k, v, kp, vp, *ids, c["N"], scale))
    t1 = bench_ms(lambda: block_attention(q, k, v, kp, vp, *ids, c["N"], scale, splits=1))
    kv_bytes = 2 * B * c["Hkv"] * prefix * c["hd"] * 2
    info = {"B": B, "prefix": prefix, "eager_core_ms": round(t_ref, 3), "kernel_ms": round(t, 4),
            "kernel_ms_one_pass(TensorRT AOT)": round(t1, 4), "speedup": round(t_ref / t, 1),
            "kv_read_TBps": round(kv_bytes / (t * 1e-3) / 1e12, 3)}
    info["target>=10x"] = "MET" if info["speedup"] >= CORE_SPEEDUP_TARGET else "MISSED"
    if sweep:
        res = {}
        for tiles in ((64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 3)):
            try:
                res[str(tiles)] = round(bench_ms(lambda: block_attention(q, k, v, kp, vp, *ids, c["N"], scale,
                                                                         tiles=tiles)), 4)
            except Exception as e:  # noqa: BLE001
                res[str(tiles)] = f"{type(e).__name__}: {str(e)[:120]}"
        info["sweep_ms_(BM,BN,warps,stages)"] = res
    return info


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/clover_gpu_check")))
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later steps are skipped past it")
    ap.add_argument("--carried", type=Path, default=CARRIED_PTX, help="PTX + manifest.json built elsewhere")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweeps")
    args = ap.parse_args()
    run = Run(args.out, args.budget)
    if not torch.cuda.is_available():
        print("FAIL cuda (torch sees no GPU)")
        return 1
    import triton

    p = torch.cuda.get_device_properties(0)
    env = {"gpu": p.name, "sm": arch(), "sms": p.multi_processor_count, "mem_GB": round(p.total_memory / 1e9, 1),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    print("ENV " + json.dumps(env), flush=True)
    run.results.append({"name": "env", "status": "INFO", **env})
    torch.backends.cuda.matmul.allow_tf32 = False  # full-fp32 references (matmuls and cuDNN convs)
    torch.backends.cudnn.allow_tf32 = False
    from clover_export.plugins.triton import launch

    run.results.append({"name": "configs", "status": "INFO", "moe_tiles": launch.MOE_TILES.get(arch()),
                        "attention_tiles": launch.ATTENTION_TILES.get(arch()),
                        "gdn": launch.gdn_constexprs(16, 32, 128, 128, 4, 32)})

    f32, bf16 = torch.float32, torch.bfloat16
    for dt, pdt in ((f32, f32), (bf16, bf16)):
        run.step(f"gdn.{str(dt)[6:]}.params_{str(pdt)[6:]}", lambda dt=dt, pdt=pdt: check_gdn(dt, pdt), min_left=60)
    for dt in (f32, bf16):
        for splits in (1, 4, None):
            run.step(
                f"attention.{str(dt)[6:]}.splits_{splits or 'auto'}",
                lambda dt=dt, s=splits: check_attention(dt, s),
                min_left=60,
            )
    run.step("moe.float32", lambda: check_moe(f32), min_left=60)
    run.step("moe.bfloat16", lambda: check_moe(bf16), min_left=60)
    run.step("moe.bfloat16.fp8_weights", lambda: check_moe(bf16, fp8=True), min_left=60)
    try:
        launcher = Launcher()
    except Exception as e:  # noqa: BLE001
        print(f"FAIL launcher ({type(e).__name__}: {e})", flush=True)
        launcher = None
    if launcher is not None:
        check_aot(run, launcher, args.carried if args.carried.exists() else None)
        if launcher.kind == "cupy":  # the ctypes path as well: it is what a C++ host (TensorRT) does
            try:
                check_aot(run, Launcher(force_ctypes=True), None)
            except OSError as e:
                print(f"SKIP aot ctypes path ({e})", flush=True)
    run.step("model_step.float32 (cuda_cores vs reference, CUDA graph)", lambda: check_model_step(f32), min_left=50)

    sweep = not args.no_sweep
    run.step("bench.moe.B1", lambda: bench_moe(1, sweep), min_left=60, bench=True)
    run.step("bench.moe.B8", lambda: bench_moe(8, False), min_left=40, bench=True)
    run.step("bench.gdn.B1", lambda: bench_gdn(1, sweep), min_left=50, bench=True)
    run.step("bench.gdn.B8", lambda: bench_gdn(8, False), min_left=30, bench=True)
    for prefix in (4096, 65536):
        for B in (1, 8):
            run.step(f"bench.attention.B{B}.prefix{prefix}",
                     lambda B=B, pf=prefix: bench_attention(B, pf, sweep and B == 1 and pf == 65536),
                     min_left=30, bench=True)
    run.step("bench.moe.eager_reference.B1", bench_moe_eager_reference, min_left=25, bench=True)

    fails = [r["name"] for r in run.results if r.get("status") == "FAIL"]
    print("\nSUMMARY " + ("all checks passed" if not fails else f"{len(fails)} FAIL: {', '.join(fails)}"), flush=True)
    for r in run.results:
        if r.get("status") == "BENCH":
            keys = [k for k in r if k.startswith(("speedup", "bw_frac", "fp8_speedup", "target", "kernel_ms", "op_ms",
                                                  "graph_op", "eager"))]
            print(f"  {r['name']}: " + ", ".join(f"{k}={r[k]}" for k in keys), flush=True)
    print(f"results: {run.out / 'gpu_check_results.json'}  elapsed {time.time() - run.t0:.0f}s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())

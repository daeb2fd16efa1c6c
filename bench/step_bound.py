"""Whole steps against their memory bound (PERF.md 1-3): one prepared run, random and Zipf-skewed routers.

For the PERF.md 1 scenarios (B=1 denoise, B=1 AR decode, B=8 commit+denoise, the
last also with FP8 experts) on a full-size random-weight model on the GPU:
median CUDA-graph replay time of the whole step (Triton kernels, in-place
pools, logits of the rows that need them), the bytes the step must read by
PERF.md 1's rule (dense weights, the union over all rows of the experts
selected per layer, the step's embedding rows only, K/V prefix read + the
step's K/V written, GDN state read + written), the copy bandwidth measured in
the same run, the compute bound at the measured bf16 matmul rate, and
`ms / bound_ms`. Also the MoE op alone (fraction of copy bandwidth, FP8 over
BF16 at the same selection, FP8 widened and w8a8), a per-kernel profile of the
replayed B=8 step, and the kernel changes side by side (`VARIANTS`: each
alone on the 2026-11-30 kernels, then together) on three of the steps.

The steps run the triton backend's kernels (`variant_cores(product_flags())`).

    bash bench/step_bound.sh                    # the GPU run (<= 8 min on an H200)
    python bench/step_bound.py --dry-run        # CPU, tiny config (B <= 2), TRITON_INTERPRET=1 (CI runs it)

Writes $OUT/step_bound_<gpu>.json (rewritten after every scenario: one failure
keeps the others) and $OUT/step_bound_<gpu>_profile.txt; a GPU run from the
repository also copies both to bench/results/. The bytes follow PERF.md 1
through `clover_export.model.perf_bound` (reported as dense incl. lm_head, embedding
rows, experts, K/V, GDN state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
if "--dry-run" in sys.argv:  # the interpreter must be on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from clover_export.core import names  # noqa: E402
from clover_export.model import perf_bound  # noqa: E402
from clover_export.model.model import CloverModel, allocate_pools  # noqa: E402
from clover_export.model.moe import moe_core  # noqa: E402
from clover_export.quantize.scales import dequantize, quantize_weight  # noqa: E402
from clover_export.testing.cuda import copy_bandwidth, graph_ms  # noqa: E402
from clover_export.testing.fullsize import full_size_config  # noqa: E402

PEAK_BW = 4.8e12  # H200 HBM3e, vendor figure (PERF.md 1)
ZIPF_S = 1.1  # skew of the planted router (PERF.md 2)


# ------------------------------------------------------------------ setup
def dry_config():
    from clover_export.tiny import tiny_config

    return tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], hidden_size=64,
                       num_experts=16, num_experts_per_tok=4, block_size=4,
                       shared_expert_intermediate_size=32)  # the real model's equal widths: the shared fusion runs


def init_weights_(model: CloverModel, seed: int, device) -> None:
    """Random weights with a spread like `testing.cuda.init_random_on_device_` (norms and GDN parameters in their
    ranges; norm weights around 1; the routers are set apart by `set_router_`)."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("block_softmax_scale"):
                p.fill_(4.0)
            elif p.dim() == 1 or name.endswith("block_softmax_gate"):
                p.normal_(0, 0.1, generator=g).add_(1.0 if name.endswith("norm.weight") else 0.0)
            elif name.endswith(("conv1d.weight", "conv1d_right.weight")):
                p.normal_(0, 0.5, generator=g)
            else:
                p.normal_(0, 0.02, generator=g)


def set_router_(model: CloverModel, kind: str, seed: int = 7, std: float = 0.5) -> None:
    """'random': i.i.d. rows (near-uniform routing). 'zipf': expert e's row scaled by (rank_e + 1)^-s / rank
    permuted per layer (seeded): a large-norm row wins top-k far more often, so selection is Zipf-skewed."""
    for li, layer in enumerate(model.model.layers):
        w = layer.mlp.gate.weight
        g = torch.Generator(device=w.device).manual_seed(seed + li)
        with torch.no_grad():
            w.normal_(0, std, generator=g)
            if kind == "zipf":
                E = w.shape[0]
                perm = torch.randperm(E, generator=g, device=w.device)
                scale = (torch.arange(E, device=w.device, dtype=torch.float32) + 1) ** -ZIPF_S
                w.mul_((4.0 * scale / scale[0])[perm].to(w.dtype)[:, None])


# ------------------------------------------------------------------ timing
class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def step_ms(self, fn, n: int = 3, reps: int = 5) -> float:
        """Median ms per call: CUDA-graph replay of n calls on the GPU (host excluded), eager on the CPU."""
        if not self.cuda:  # the dry run: one eager call (the interpreter is slow)
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)
        return graph_ms(fn, n=n, reps=reps)

    def copy_bw(self, dev) -> float:
        """Bytes/s of a large device-to-device copy (read + write)."""
        if self.cuda:
            return copy_bandwidth()
        n = 2**24
        x = torch.empty(n, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        ms = self.step_ms(lambda: y.copy_(x), n=5)
        return 2 * n / (ms / 1e3)

    def matmul_rate(self, dev, dtype) -> float:
        n = 8192 if self.cuda else 256
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        ms = self.step_ms(lambda: a @ b, n=5)
        return 2 * n**3 / (ms / 1e3)


# ------------------------------------------------------------------ bytes (PERF.md 1)
def step_bytes(cfg, sc: dict, union: list[int], fp8: bool, dtype_bytes: int) -> dict:
    """The step's bytes by PERF.md 1 (`perf_bound.step_bytes`), in the parts this script reports."""
    by = perf_bound.step_bytes(cfg, rows=sc["B"] * (sc["C"] + sc["N"]), past_len=[sc["past"]] * sc["B"],
                               experts_per_layer=union, fp8=fp8, dtype_bytes=dtype_bytes)
    return dict(dense=by.dense + by.head, embedding_rows=by.embedding, experts=by.experts, kv=by.kv,
                gdn_state=by.state, total=by.total)


def active_params(model, cfg) -> int:
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and "embed_tokens" not in n)
    return dense + cfg.num_hidden_layers * cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * cfg.hidden_size


# ------------------------------------------------------------------ the step
SCENARIOS = [  # PERF.md 1; C causal rows, N block rows per batch row
    dict(name="b1_denoise", B=1, C=0, N=None, fp8=False),
    dict(name="b1_ar_decode", B=1, C=1, N=0, fp8=False),
    dict(name="b8_commit_denoise", B=8, C=None, N=None, fp8=False),
    dict(name="b8_commit_denoise_fp8", B=8, C=None, N=None, fp8=True),
]


# The kernel changes, each alone on the 2026-11-30 baseline and all together, timed side by side
# (same model, same step inputs, one run). Flags: gdn_split (conv kernel + delta rule on a (row, v-head,
# dv tile) grid, else the one-launch kernel), glue (norms.py fused RMSNorm/residual, q/k-norm + RoPE, gated
# norm, else torch), align (count + place kernels, else torch.sort + searchsorted), kv_first (the step's K/V
# written before the attention launch), a8 (FP8 experts w8a8), moe_tiles / attn_tiles (tile overrides),
# attn_split_rule (launch.attention_splits_waves: FlashAttention's split count).
# the triton backend (FP8_W8A8 aside); shared_moe (the shared expert as expert E of the grouped GEMMs, BF16 steps
# only) groups the pairs with the align kernels whatever `align` says
PRODUCT = dict(gdn_split=True, glue=True, align=True, kv_first=True, shared_moe=True)
VARIANTS = {
    "baseline": {},
    **{flag: {flag: True} for flag in PRODUCT},  # each change alone
    "product": PRODUCT,
    # candidates on top of the product (the down projection's earlier tile, attention BLOCK_M 128, FA's splits)
    "product_down_n64": dict(PRODUCT, moe_tiles={"BLOCK_N2": 64}),
    "product_attn_m128": dict(PRODUCT, attn_tiles=(128, 64, 8, 2)),
    "product_attn_waves": dict(PRODUCT, attn_split_rule="waves"),
    "product_no_shared_moe": dict(PRODUCT, shared_moe=False),  # the shared expert as its own GEMMs again
}
FP8_VARIANTS = {"product": PRODUCT, "product_w8a8": dict(PRODUCT, a8=True),
                # the down projection's earlier tile (BLOCK_N2 64) on the FP8 experts, weight-only and w8a8
                "product_down_n64": VARIANTS["product_down_n64"],
                "product_w8a8_down_n64": dict(VARIANTS["product_down_n64"], a8=True)}
DRY_VARIANTS = ("baseline", "product", "product_w8a8")  # the interpreter is slow: the dry run plays the ends (CI)
VARIANT_SCENARIOS = ("b1_denoise", "b8_commit_denoise", "b8_commit_denoise_fp8")
DRY_VARIANT_SCENARIOS = ("b1_denoise", "b8_commit_denoise_fp8")  # the interpreter is slow: DRY_VARIANTS of each


def product_flags() -> dict:
    from clover_export.plugins.triton import launch

    return dict(PRODUCT, a8=launch.FP8_W8A8)


def variant_cores(flags: dict, fp8_experts: dict | None, cfg):
    """`Cores` of the triton backend's kernels with each kernel change on or off (`VARIANTS` flags); the shared
    expert joins the grouped GEMMs only where launch.moe_shared_fusable allows, as in the backend."""
    from functools import partial

    from clover_export.model.model import Cores
    from clover_export.plugins.triton import launch, ops

    align = "kernels" if flags.get("align") else "sort"

    def moe(x, router_w, gate_up, down, k, p, coreset, n):
        tiles, scales = dict(flags.get("moe_tiles") or {}), {}
        if fp8_experts is not None:
            gate_up, gs, down, ds = fp8_experts[gate_up.data_ptr()]
            scales, tiles["A8"] = dict(gate_up_scale=gs, down_scale=ds), bool(flags.get("a8"))
        return ops.coreset_moe(x, router_w, gate_up, down, k, p, coreset, n, align=align, tiles=tiles or None,
                               **scales)

    attention = partial(ops.block_attention, kv_first=bool(flags.get("kv_first")), tiles=flags.get("attn_tiles"),
                        split_rule=flags.get("attn_split_rule", "two_waves"))
    block = None
    if flags.get("shared_moe") and launch.moe_shared_fusable(cfg.moe_intermediate_size,
                                                              cfg.shared_expert_intermediate_size,
                                                              fp8_experts is not None):
        block = partial(ops.moe_block, tiles=flags.get("moe_tiles"))
    return Cores(gdn=partial(ops.block_gdn, split=bool(flags.get("gdn_split"))), attention=attention,
                 moe=moe, moe_block=block, **(ops.GLUE if flags.get("glue") else {}))


class Step:
    """One scenario's step: the trunk on the kernels, then the logits of the rows that need them."""

    def __init__(self, model, cfg, sc, dev, dtype, fp8_experts, seed=1, flags: dict | None = None):
        self.model, self.sc = model, sc
        B, C, N, past = sc["B"], sc["C"], sc["N"], sc["past"]
        T = C + N
        g = torch.Generator(device=dev).manual_seed(seed)
        i32 = dict(dtype=torch.int32, device=dev)
        self.args = (torch.randint(0, cfg.vocab_size, (B, T), generator=g, **i32), torch.full((B,), C, **i32),
                     torch.full((B,), int(N > 0), **i32), torch.arange(B, **i32), torch.full((B,), past, **i32))
        self.pools = allocate_pools(cfg, B, past + T, dtype=dtype, device=dev)
        for k, v in self.pools.items():  # a filled prefix
            v.normal_(0, 0.5 if k.endswith(("key", "value")) else 0.05, generator=g)
        self.order = [self.pools[n] for n in names.pool_names(cfg)]
        self.cores = variant_cores(product_flags() if flags is None else flags, fp8_experts if sc["fp8"] else None,
                                   cfg)
        self.rows = N if N > 0 else C  # rows whose logits the step needs

    def __call__(self):
        m = self.model
        m.cores, m.block_size = self.cores, self.sc["N"]
        h, _, _ = m.trunk(*self.args, *self.order)
        return m.logits(h[:, h.shape[1] - self.rows:])

    def union_per_layer(self) -> list[int]:
        """Distinct experts selected per layer by all rows of the step (one untimed eager pass)."""
        from clover_export.plugins.triton.ops import moe_route

        union, inner = [], self.cores.moe

        def recording(x, router_w, gate_up, down, k, p, coreset, n):
            idx, _, _ = moe_route(x, router_w, k, p, coreset, n)
            union.append(int(torch.unique(idx[idx < router_w.shape[0]]).numel()))
            return inner(x, router_w, gate_up, down, k, p, coreset, n)

        # moe_block off: the recording wraps the routed-experts core (same routing)
        cores, self.cores = self.cores, dataclasses.replace(self.cores, moe=recording, moe_block=None)
        saved = {k: v.clone() for k, v in self.pools.items()}
        try:
            with torch.no_grad():
                self()
        finally:
            self.cores = cores
            for k, v in saved.items():
                self.pools[k].copy_(v)
        return union


def quantize_experts(model) -> dict:
    """FP8 twins of every layer's experts, keyed by the bf16 gate_up tensor's address (the op looks them up)."""
    out = {}
    for layer in model.model.layers:
        ex = layer.mlp.experts
        (gq, gs), (dq, ds) = quantize_weight(ex.gate_up_proj), quantize_weight(ex.down_proj)
        out[ex.gate_up_proj.data_ptr()] = (gq, gs, dq, ds)
    return out


def moe_only(model, cfg, timer, dev, dtype, fp8_experts, B: int, rows: int, N: int) -> dict:
    """Layer 0's routed experts alone at the B=8 commit+denoise shape: bytes / time vs copy bandwidth
    (FP8: widened to bf16 in registers, and w8a8)."""
    from clover_export.plugins.triton import ops
    from clover_export.plugins.triton.ops import moe_route

    mlp = model.model.layers[0].mlp
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(B, rows, cfg.hidden_size, generator=g, device=dev).to(dtype)
    a = (x, mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj, cfg.num_experts_per_tok,
         cfg.moe_block_coreset_top_p, cfg.moe_block_coreset_enabled, N)
    idx = moe_route(*a[:2], *a[4:])[0]
    union = int(torch.unique(idx[idx < cfg.num_experts]).numel())
    io = mlp.gate.weight.numel() * mlp.gate.weight.element_size() + 2 * x.numel() * x.element_size()
    res = {"experts_selected": union}
    with torch.no_grad():
        # correctness first (the kernels at this routing: M-block grid, FP8 on fp16 dots) vs the torch core
        want = moe_core(*a)[0]
        res["bf16_rel_err_vs_core"] = _rel(ops.coreset_moe(*a)[0], want)
        ms = timer.step_ms(lambda: ops.coreset_moe(*a), n=10)
        res.update(bf16_ms=ms, bf16_bytes=union * perf_bound.expert_bytes(cfg, False) + io)
        if fp8_experts is not None:
            gq, gs, dq, ds = fp8_experts[mlp.experts.gate_up_proj.data_ptr()]
            want8 = moe_core(x, a[1], dequantize(gq, gs, dtype), dequantize(dq, ds, dtype), *a[4:])[0]
            res["fp8_bytes"] = union * perf_bound.expert_bytes(cfg, True) + io
            for tag, a8 in (("", False), ("_w8a8", True)):
                fp8 = lambda a8=a8: ops.coreset_moe(x, a[1], gq, dq, *a[4:], gate_up_scale=gs, down_scale=ds,  # noqa: E731
                                                    tiles={"A8": a8})
                res[f"fp8{tag}_rel_err_vs_dequantized_core"] = _rel(fp8()[0], want8)
                ms8 = timer.step_ms(fp8, n=10)
                res.update({f"fp8{tag}_ms": ms8, f"fp8{tag}_over_bf16": ms / ms8})
    return res


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def profile_step(step: Step, timer: Timer, path: Path) -> None:
    """Per-kernel table of the replayed step (torch.profiler; eager on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timer.cuda else [])
    fn = step
    if timer.cuda:
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph), torch.no_grad():
            step()
        fn = graph.replay
    with torch.no_grad():
        if timer.cuda:
            fn()
        with profile(activities=acts) as prof:
            for _ in range(3 if timer.cuda else 1):
                fn()
            if timer.cuda:
                torch.cuda.synchronize()
    avg = prof.key_averages()
    sort = "cpu_time_total"
    if timer.cuda:
        sort = "device_time_total" if hasattr(avg[0], "device_time_total") else "cuda_time_total"
    path.write_text(f"# {step.sc['name']} router={step.sc['router']}: 3 replays, sorted by {sort}\n"
                    + avg.table(sort_by=sort, row_limit=40, max_name_column_width=90))


# ------------------------------------------------------------------ main
def environment(cuda: bool) -> dict:
    import triton

    env = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    else:
        env.update(gpu="cpu-dry-run")
    return env


def tag_of(gpu: str) -> str:
    m = re.search(r"(H200|H100|B200|A100|L40S|GH200)", gpu)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", gpu.lower())).lower()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny config, fp32, TRITON_INTERPRET=1")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/clover_step_bound"))
    ap.add_argument("--past", type=int, default=None, help="cached prefix per row (default 4096; dry run 8)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds; later scenarios are skipped past it (default 330; dry run: none)")
    ap.add_argument("--routers", default="random,zipf")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (same pattern), for a quick look")
    args = ap.parse_args(argv)
    t0 = time.time()
    cuda = not args.dry_run
    budget = args.budget if args.budget is not None else (330.0 if cuda else float("inf"))
    if cuda and not torch.cuda.is_available():
        print("step_bound: no CUDA GPU (use --dry-run for the CPU check)", file=sys.stderr)
        return 1
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = full_size_config() if cuda else dry_config()
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers, layer_types=cfg.layer_types[:args.layers])
    past = args.past if args.past is not None else (4096 if cuda else 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(cuda)
    tag = "dryrun" if not cuda else tag_of(env["gpu"])
    json_path, prof_path = out / f"step_bound_{tag}.json", out / f"step_bound_{tag}_profile.txt"
    timer = Timer(cuda)
    res = dict(env, past=past, layers=cfg.num_hidden_layers, config=cfg.to_dict(), steps=[], moe={}, errors=[])

    def save():
        res["elapsed_s"] = round(time.time() - t0, 1)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        tmp.replace(json_path)

    def attempt(what, fn):
        try:
            return fn()
        except Exception as e:  # one failure must not lose the other scenarios
            res["errors"].append({"what": what, "error": f"{type(e).__name__}: {e}"[:600],
                                  "trace": traceback.format_exc(limit=6)})
            print(f"FAIL {what}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            return None
        finally:
            save()

    res["copy_tb_s"] = timer.copy_bw(dev) / 1e12
    res["peak_tb_s"] = PEAK_BW / 1e12
    res["matmul_tflops"] = timer.matmul_rate(dev, dtype) / 1e12
    print(f"{env}\ncopy {res['copy_tb_s']:.3f} TB/s, dense matmul {res['matmul_tflops']:.0f} TFLOP/s", flush=True)
    torch.set_default_dtype(dtype)  # allocate directly in the model dtype (fp32 would not fit at full size)
    with dev:
        model = CloverModel(cfg).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    init_weights_(model, 0, dev)
    block = cfg.block_size
    fp8_experts = attempt("quantize experts", lambda: quantize_experts(model))
    print(f"model ready ({time.time() - t0:.0f} s)", flush=True)
    copy_bw = res["copy_tb_s"] * 1e12
    compute = active_params(model, cfg)
    routers = args.routers.split(",")
    res["variants"] = []
    for name in VARIANT_SCENARIOS if cuda else DRY_VARIANT_SCENARIOS:  # first router: side by side, same step
        base = next(b for b in SCENARIOS if b["name"] == name)
        if base["fp8"] and fp8_experts is None:
            continue
        sc = dict(base, router=routers[0], past=past, N=block if base["N"] is None else base["N"],
                  C=block if base["C"] is None else base["C"], B=base["B"] if cuda else min(base["B"], 2))
        if time.time() - t0 > budget:
            res["variants"].append(dict(name=name, skipped="time budget"))
            continue
        set_router_(model, routers[0])

        def run_variants(sc=sc):
            row = dict(name=sc["name"], router=sc["router"], ms={}, speedup={})
            res["variants"].append(row)
            for vname, flags in (FP8_VARIANTS if sc["fp8"] else VARIANTS).items():
                if not cuda and vname not in DRY_VARIANTS:
                    continue
                step = Step(model, cfg, sc, dev, dtype, fp8_experts, flags=flags)
                with torch.no_grad():
                    row["ms"][vname] = timer.step_ms(step)
                ref = row["ms"].get("baseline", row["ms"].get("product"))
                row["speedup"][vname] = ref / row["ms"][vname]
                print(f"VARIANT {sc['name']:24s} {vname:14s} {row['ms'][vname]:8.3f} ms "
                      f"({row['speedup'][vname]:.2f}x {'baseline' if 'baseline' in row['ms'] else 'product'})",
                      flush=True)

        attempt(f"variants {name}", run_variants)
    for router in routers:
        set_router_(model, router)
        for base in SCENARIOS:
            sc = dict(base, router=router, past=past, N=block if base["N"] is None else base["N"],
                      C=block if base["C"] is None else base["C"], B=base["B"] if cuda else min(base["B"], 2))
            if sc["fp8"] and fp8_experts is None:
                continue
            if time.time() - t0 > budget:
                res["steps"].append(dict(name=sc["name"], router=router, skipped="time budget"))
                continue

            def run(sc=sc):
                step = Step(model, cfg, sc, dev, dtype, fp8_experts)
                union = step.union_per_layer()
                with torch.no_grad():
                    ms = timer.step_ms(step)
                by = step_bytes(cfg, sc, union, sc["fp8"], torch.finfo(dtype).bits // 8)
                mem_ms = 1e3 * by["total"] / copy_bw
                comp_ms = 1e3 * 2 * compute * sc["B"] * (sc["C"] + sc["N"]) / (res["matmul_tflops"] * 1e12)
                bound = max(mem_ms, comp_ms)
                row = dict(
                    name=sc["name"],
                    router=router,
                    B=sc["B"],
                    causal_rows=sc["C"],
                    block_rows=sc["N"],
                    past=past,
                    fp8_experts=sc["fp8"],
                    ms=ms,
                    bound_ms=bound,
                    memory_bound_ms=mem_ms,
                    compute_bound_ms=comp_ms,
                    over_bound=ms / bound,
                    peak_bound_ms=1e3 * by["total"] / PEAK_BW,
                    over_peak_bound=ms * PEAK_BW / (1e3 * by["total"]),
                    bytes_gb={k: v / 1e9 for k, v in by.items()},
                    experts_per_layer=dict(mean=sum(union) / len(union), min=min(union), max=max(union)),
                )
                res["steps"].append(row)
                print(f"STEP {sc['name']:24s} router={router:6s} {ms:8.3f} ms, bound {bound:7.3f} ms "
                      f"({ms / bound:.2f}x), {by['total'] / 1e9:.2f} GB, experts/layer "
                      f"{row['experts_per_layer']['mean']:.1f} [{min(union)}-{max(union)}]", flush=True)
                if sc["name"] == "b8_commit_denoise" and router == routers[0]:
                    attempt("profile", lambda: profile_step(step, timer, prof_path))

            sc["router"] = router
            attempt(f"{sc['name']} router={router}", run)
        if time.time() - t0 <= budget:
            def moe(router=router):
                r = moe_only(model, cfg, timer, dev, dtype, fp8_experts, 8 if cuda else 2, 2 * block, block)
                r["bf16_copy_fraction"] = r["bf16_bytes"] / (r["bf16_ms"] / 1e3) / copy_bw
                if "fp8_ms" in r:
                    r["fp8_copy_fraction"] = r["fp8_bytes"] / (r["fp8_ms"] / 1e3) / copy_bw
                    r["fp8_w8a8_copy_fraction"] = r["fp8_bytes"] / (r["fp8_w8a8_ms"] / 1e3) / copy_bw
                res["moe"][router] = r
                print(f"MOE router={router}: {json.dumps(r)}", flush=True)

            attempt(f"moe router={router}", moe)
    res["moe_copy_fraction"] = {r: v.get("bf16_copy_fraction") for r, v in res["moe"].items()}
    res["fp8_over_bf16"] = {r: max(v.get("fp8_over_bf16") or 0, v.get("fp8_w8a8_over_bf16") or 0) or None
                            for r, v in res["moe"].items()}
    save()
    if cuda:  # keep the figures with the repository
        dest = RESULTS
        for p in (json_path, prof_path):
            if p.exists() and dest.is_dir() and out.resolve() != dest.resolve():
                shutil.copy(p, dest / p.name)
    print(f"SUMMARY copy {res['copy_tb_s']:.2f} TB/s; " + "; ".join(
        f"{s['name']}/{s['router']} {s['ms']:.2f} ms = {s['over_bound']:.2f}x bound" for s in res["steps"] if "ms" in s)
        + f"; moe copy fraction {res['moe_copy_fraction']}; fp8/bf16 {res['fp8_over_bf16']}; "
        f"errors {len(res['errors'])}; {json_path}", flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

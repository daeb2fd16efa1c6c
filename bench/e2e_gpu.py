"""End to end on one GPU: the `triton` backend (kernels + CUDA graphs) on a full-size random-weight model.

For B = 1, 8, 64 rows (4k cached prefix each), with a random router and a
planted-skew (Zipf) router, bf16 experts then FP8 experts (quantized at
load): step time of a denoise step (32 block rows), a commit + denoise step
(32 causal + 32 block rows) and an AR step (one row, plain top-8: the same
weights as a block-size-1 engine) and a self_spec step of draft length k = 4
and 10 (docs/decoding.md: 1 + k causal rows, the newest token and the draft,
then 32 block rows; `logit_rows` = 0..k, so 1 + k rows of `causal_logits`;
it replays in the C = 32 graph bucket, as the runtime runs it), each beside
its bound by PERF.md 1 (`clover_export.model.perf_bound`; experts = the union
selected by any row, as counted in an uncaptured run of the same step). Then
tokens/s: block diffusion at tokens-per-forward 1, 2.55, 3.19 (one step of
every block carries the folded commit) beside AR; self_spec at the embedded
default's measured 5.46 tokens per forward (SELF_SPEC_TPF) and at k + 1 (every
draft token accepted), every forward costing the step of draft length k,
beside AR of the same B; and compiled vs eager: the eager reference model
(plain-torch cores, the torch backend) and the kernels launched without graphs.
The dry run's block is 8 rows, so its self_spec drafts are k = 4 and 7.

    python bench/e2e_gpu.py [--out DIR] [--budget-s 400]     # on the GPU (bash bench/e2e_gpu.sh)
    TRITON_INTERPRET=1 python bench/e2e_gpu.py --dry-run       # tiny config on the CPU (the test runs this)

Every section is in try/except (FAIL and go on); sections past the time
budget print SKIP; `e2e_gpu.json` is rewritten after each measurement.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from clover_export.backends.torch_backend import in_place_cores  # noqa: E402
from clover_export.core import names  # noqa: E402
from clover_export.core.config import config_from_dict  # noqa: E402
from clover_export.model import perf_bound
from clover_export.model.model import CloverModel, Cores, init_random_  # noqa: E402
from clover_export.testing.cuda import copy_bandwidth, init_random_on_device_  # noqa: E402
from clover_export.testing.fullsize import full_size_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TPF = (1.0, 2.55, 3.19)  # tokens per forward: one per step, and the anchor's range (PERF.md 4)
SELF_SPEC_K = (4, 10)  # draft lengths of the self_spec steps timed (at most block_size - 1)
# self_spec tokens per forward of the embedded default (bench/decoding.py's runtime self_spec row, bench/README.md:
# 10.02 draft tokens accepted per verifying forward); used with the draft lengths k whose ceiling k + 1 holds it
SELF_SPEC_TPF = (5.46,)


class Bench:
    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res: dict = {"rows": [], "eager": [], "tokens_per_s": [], "self_spec_tokens_per_s": [], "sections": {}}

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        (self.out / "e2e_gpu.json").write_text(json.dumps(self.res, indent=1))

    def section(self, name: str, fn, need_s: float = 0.0) -> None:
        if self.left() < need_s:
            print(f"SKIP {name}: {self.left():.0f} s left of the budget", flush=True)
            self.res["sections"][name] = "skip"
            self.save()
            return
        t = time.perf_counter()
        try:
            fn()
            self.res["sections"][name] = "ok"
            print(f"DONE {name} in {time.perf_counter() - t:.1f} s", flush=True)
        except Exception:
            self.res["sections"][name] = "fail: " + traceback.format_exc(limit=3)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        self.save()


# ----------------------------------------------------------------- model and inputs
def config(args):
    if args.dry_run:  # 2 layers (GDN + attention), small dims: seconds per step under the interpreter
        from clover_export.tiny import tiny_config_dict

        d = tiny_config_dict(num_hidden_layers=2, hidden_size=64, vocab_size=128, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=32, block_size=8,
                             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        d["layer_types"] = ["linear_attention", "full_attention"]
        return config_from_dict(d)
    return full_size_config()


def build_model(cfg, args, device) -> CloverModel:
    if args.dry_run:
        return init_random_(CloverModel(cfg), seed=0).eval().requires_grad_(False)
    torch.set_default_dtype(torch.bfloat16)  # allocate the weights directly in bf16
    try:
        with torch.device(device):
            model = CloverModel(cfg).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(torch.float32)
    init_random_on_device_(model, router_std=args.router_std)
    return model


def zipf_bias(cfg, model, args, device) -> dict[int, torch.Tensor]:
    """Planted skew: per layer a seeded random ranking of the experts and a logit bias -s ln(rank) (Zipf)."""
    g = torch.Generator().manual_seed(7)
    E, out = cfg.num_experts, {}
    for layer in model.model.layers:
        rank = torch.randperm(E, generator=g).float() + 1
        out[id(layer.mlp.gate.weight)] = (-args.zipf * rank.log()).to(device, model.dtype)
    return out


def step_inputs(cfg, B, C, N, past, device, seed=1, logit_rows: list[int] | None = None):
    """A step of B rows x C causal + N block rows over `past` cached positions; `logit_rows` (the same causal
    row indices for every row) adds the [B, R] `logit_rows` input, else the step leaves it out (row 0)."""
    g = torch.Generator().manual_seed(seed)
    i32 = dict(dtype=torch.int32)
    out = {names.INPUT_IDS: torch.randint(0, cfg.vocab_size, (B, C + N), generator=g, **i32).to(device),
           names.N_CAUSAL: torch.full((B,), C, **i32).to(device), names.HAS_BLOCK: torch.ones(B, **i32).to(device),
           names.SLOT_IDS: torch.arange(B, **i32).to(device), names.PAST_LEN: torch.full((B,), past, **i32).to(device)}
    if logit_rows is not None:
        out[names.LOGIT_ROWS] = torch.tensor(logit_rows, **i32).repeat(B, 1).to(device)
    return out


def fill_prefix_(pools, seed=2):
    g = torch.Generator(device=next(iter(pools.values())).device).manual_seed(seed)
    for k, v in pools.items():
        v.normal_(0, 0.5 if k.endswith((".key", ".value")) else 0.05, generator=g)


@contextmanager
def plain_topk(model):
    """AR decoding routes plain top-k (no block coreset) while the AR engine runs or is captured."""
    saved = [(m, m.cfg) for m in (layer.mlp for layer in model.model.layers)]
    for m, cfg in saved:
        m.cfg = cfg.replace(moe_block_coreset_enabled=False)
    try:
        yield
    finally:
        for m, cfg in saved:
            m.cfg = cfg


# ----------------------------------------------------------------- timing
def measure_bw(device, dry) -> tuple[float, float]:
    """(copy bytes/s of a large device-to-device copy, dense matmul flop/s) measured here."""
    if dry:
        n = 1 << 22
        x = torch.empty(n, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        bw = 2 * n / timed(lambda: y.copy_(x), device, 3)
    else:
        bw = copy_bandwidth()
    m = 256 if dry else 8192
    a = torch.randn(m, m, device=device, dtype=torch.float32 if dry else torch.bfloat16)
    tm = timed(lambda: a @ a, device, 2 if dry else 10)
    return bw, 2 * m**3 / tm


def timed(fn, device, reps: int) -> float:
    """Median seconds per call (CUDA events on the GPU: device time, host gaps between launches included;
    on the CPU dry run wall time, no warm-up)."""
    if device.type != "cuda":
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    fn()
    torch.cuda.synchronize(device)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def union_per_layer(backend, inputs, pools) -> list[int]:
    """Experts selected by any row of the step, per layer (one uncaptured step)."""
    backend.moe.selected = []
    try:
        backend._run(inputs, pools)
        return backend.moe.selected
    finally:
        backend.moe.selected = None


# ----------------------------------------------------------------- the run
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny config on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--out", default=os.environ.get("OUT", str(RESULTS)))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="sections needing more than the budget left are skipped (default 400 s; dry run: none)")
    ap.add_argument("--past", type=int, default=None, help="cached prefix per row (default 4096; dry run 16)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,64; dry run 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per measurement (default 20; dry run 1)")
    ap.add_argument("--zipf", type=float, default=1.0, help="planted skew: per-layer logit bias -s ln(rank of expert)")
    ap.add_argument("--router-std", type=float, default=0.5,
                    help="random router init std (full size; 0.5: router logits of std ~2 per token, so the "
                         "Zipf bias tilts routing without fixing it)")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--no-eager", action="store_true")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if args.budget_s is None:
        args.budget_s = math.inf if dry else 400.0
    if not dry and not torch.cuda.is_available():
        sys.exit("e2e_gpu: no CUDA GPU here; run with --dry-run (TRITON_INTERPRET=1) on the CPU")
    device = torch.device("cpu" if dry else "cuda")
    batches = [int(b) for b in (args.batches or ("2" if dry else "1,8,64")).split(",")]
    past = args.past if args.past is not None else (16 if dry else 4096)
    reps = args.reps or (1 if dry else 20)
    bench = Bench(args)
    cfg = config(args)
    N = cfg.block_size
    import triton

    bench.res["env"] = {"device": torch.cuda.get_device_name() if not dry else "cpu (TRITON_INTERPRET=1, dry run)",
                        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                        "layers": cfg.num_hidden_layers, "past": past, "batches": batches, "reps": reps,
                        "zipf": args.zipf, "dtype": "fp32" if dry else "bf16"}
    bench.res["config"] = cfg.to_dict()
    if not dry:
        bench.res["env"]["driver"] = (
            os.popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader").read().strip()
        )
    bw, flops = measure_bw(device, dry)
    bench.res["env"].update(copy_TBps=bw / 1e12, matmul_TFLOPs=flops / 1e12)
    print(f"ENV {json.dumps(bench.res['env'])}", flush=True)

    t = time.perf_counter()
    model = build_model(cfg, args, device)
    print(f"model ready in {time.perf_counter() - t:.1f} s", flush=True)
    bias = zipf_bias(cfg, model, args, device)
    state: dict = {}
    max_b = max(batches)
    L = past + 2 * N + 8
    spec_k = sorted({min(k, N - 1) for k in SELF_SPEC_K})  # causal rows 1 + k <= block_size (docs/decoding.md)

    def engines(fp8: bool):
        """The block engine (buckets: batches x C in {0, N}; self_spec's C = 1 + k replays in C = N, as in the
        runtime) and the AR engine (block 1, C = 0), same weights."""
        from clover_export.backends.fp8_experts import quantize_at_load
        from clover_export.backends.triton_backend import TritonBackend

        state.clear()
        gc.collect()  # the old graphs (a backend <-> graphs cycle) and their memory pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
        table = quantize_at_load(model) if fp8 else None
        zeros = {k: torch.zeros_like(v) for k, v in bias.items()}  # the router bias buffers the graphs read
        state["bias"] = zeros
        opts = dict(fp8=table, graph_batch_sizes=tuple(batches), progress=True)
        blk = TritonBackend(model, None, graph_causal_rows=(0, N), **opts)
        blk.moe.router_bias = zeros
        state["blk"], state["blk_pools"] = blk, blk.allocate_pools(max_b, L)
        ar_model = copy.copy(model)  # shares the modules; only block_size (and cores) differ
        ar_model.block_size = 1
        with plain_topk(model):
            ar = TritonBackend(ar_model, None, graph_causal_rows=(0,), **opts)
            ar.moe.router_bias = zeros
            state["ar"], state["ar_pools"] = ar, ar.allocate_pools(max_b, L)
        for p in (state["blk_pools"], state["ar_pools"]):
            fill_prefix_(p)

    def set_router(kind: str):
        for k, v in state["bias"].items():
            v.copy_(bias[k] if kind == "zipf" else torch.zeros_like(v))

    def scenario_rows(experts: str):
        for router in ("random", "zipf"):
            set_router(router)
            for B in batches:
                steps = [("denoise", 0, N, "blk", None), ("commit+denoise", N, N, "blk", None),
                         ("ar", 0, 1, "ar", None)]
                # self_spec: the newest token + a draft of k (causal), the block after it; logits of causal rows 0..k
                steps += [(f"self_spec k={k}", 1 + k, N, "blk", list(range(k + 1))) for k in spec_k]
                for kind, C, n, eng, logit_rows in steps:
                    be, pools = state[eng], state[f"{eng}_pools"]
                    inputs = step_inputs(cfg, B, C, n, past, device, logit_rows=logit_rows)
                    R = 1 if logit_rows is None else len(logit_rows)
                    ctx = plain_topk(model) if eng == "ar" else _null()
                    with ctx:
                        sel = union_per_layer(be, inputs, pools)
                        step_s = timed(lambda: be.step(inputs, pools), device, reps)
                    rows = B * (C + n)
                    # The lm_head runs over n + R rows of each batch row: step_bytes reads its weights once
                    # (logits=True) whatever the rows, bound_seconds's compute counts every active parameter,
                    # lm_head included, for all C + n rows, i.e. exactly the logit rows when R = C (self_spec),
                    # R - C rows short otherwise (1 a batch row; the logits written are in no step's bytes).
                    nbytes = perf_bound.step_bytes(cfg, rows=rows, past_len=[past] * B, experts_per_layer=sel,
                                                   fp8=experts == "fp8", dtype_bytes=4 if dry else 2)
                    bound = perf_bound.bound_seconds(cfg, nbytes.total, rows, bw, flops)
                    row = dict(experts=experts, router=router, B=B, step=kind, causal=C, block=n, logit_rows=R,
                               graph=be.graphs is not None and be.graphs.bucket_for(B, C, R) is not None,
                               experts_per_layer=sum(sel) / len(sel), step_ms=1e3 * step_s,
                               bytes_GB=nbytes.total / 1e9, bound_ms=1e3 * bound["bound_s"],
                               compute_bound_ms=1e3 * bound["compute_s"],
                               time_over_bound=step_s / bound["bound_s"],
                               time_over_vendor_bound=step_s / (nbytes.total / 4.8e12))
                    bench.res["rows"].append(row)
                    print("ROW " + json.dumps(row), flush=True)
                    bench.save()

    def eager_rows():
        """Compiled vs eager at the denoise step, random router: reference model and kernels without graphs."""
        set_router("random")
        blk, pools = state["blk"], state["blk_pools"]
        for B in batches:
            inputs = step_inputs(cfg, B, 0, N, past, device)
            kern = timed(lambda: blk._run(inputs, pools), device, max(1, reps // 4))
            saved = model.cores
            model.cores = in_place_cores(Cores(), past + N, device)  # the torch backend's cores, pools by slot
            try:
                with torch.inference_mode():
                    ref = timed(lambda: model.step(inputs, pools), device, 1 if B >= 64 or dry else 2)
            finally:
                model.cores = saved
            comp = next(r["step_ms"] for r in bench.res["rows"] if r["B"] == B and r["step"] == "denoise"
                        and r["router"] == "random" and r["experts"] == "bf16")
            row = dict(B=B, eager_reference_ms=1e3 * ref, kernels_no_graph_ms=1e3 * kern, compiled_ms=comp,
                       compiled_vs_eager=1e3 * ref / comp, compiled_vs_kernels_no_graph=1e3 * kern / comp)
            bench.res["eager"].append(row)
            print("EAGER " + json.dumps(row), flush=True)
            bench.save()

    def tokens_per_s():
        """Block diffusion: B x tpf / mean step, one step in 32/tpf carrying the commit; AR: B / AR step;
        self_spec: B x tpf / the step of draft length k, tpf the measured SELF_SPEC_TPF (where <= k + 1) and k + 1."""
        for experts in ("bf16", "fp8"):
            for router in ("random", "zipf"):
                got = {(r["B"], r["step"]): r for r in bench.res["rows"]
                       if r["experts"] == experts and r["router"] == router}
                for B in batches:
                    if any((B, k) not in got for k in ("denoise", "commit+denoise", "ar")):
                        continue
                    d, c, a = (got[(B, k)]["step_ms"] for k in ("denoise", "commit+denoise", "ar"))
                    bd, bc, ba = (got[(B, k)]["bound_ms"] for k in ("denoise", "commit+denoise", "ar"))
                    ar_tps, ar_bound_tps = 1e3 * B / a, 1e3 * B / ba
                    for tpf in TPF:
                        fwd = N / tpf  # forwards per block
                        mean = ((fwd - 1) * d + c) / fwd
                        mean_bound = ((fwd - 1) * bd + bc) / fwd
                        row = dict(experts=experts, router=router, B=B, tokens_per_forward=tpf,
                                   block_tokens_per_s=1e3 * B * tpf / mean, ar_tokens_per_s=ar_tps,
                                   block_over_ar=(B * tpf / mean) / (B / a),
                                   block_bound_tokens_per_s=1e3 * B * tpf / mean_bound,
                                   ar_bound_tokens_per_s=ar_bound_tps,
                                   block_share_of_bound=mean_bound / mean, ar_share_of_bound=ba / a)
                        bench.res["tokens_per_s"].append(row)
                        print("TPS " + json.dumps(row), flush=True)
                    for k in spec_k:
                        s = got.get((B, f"self_spec k={k}"))
                        if s is None:
                            continue
                        for tpf in sorted({t for t in SELF_SPEC_TPF if t <= k + 1} | {float(k + 1)}):
                            row = dict(experts=experts, router=router, B=B, draft=k, tokens_per_forward=tpf,
                                       step_ms=s["step_ms"], self_spec_tokens_per_s=1e3 * B * tpf / s["step_ms"],
                                       ar_tokens_per_s=ar_tps, self_spec_over_ar=tpf * a / s["step_ms"],
                                       self_spec_bound_tokens_per_s=1e3 * B * tpf / s["bound_ms"],
                                       ar_bound_tokens_per_s=ar_bound_tps,
                                       self_spec_over_ar_at_bound=tpf * ba / s["bound_ms"],
                                       self_spec_share_of_bound=s["bound_ms"] / s["step_ms"])
                            bench.res["self_spec_tokens_per_s"].append(row)
                            print("SPEC " + json.dumps(row), flush=True)
        bench.save()

    est = 30 if dry else 120  # rough seconds a section needs (compiles and captures dominate)
    bench.section("bf16 engines (compile + capture)", lambda: engines(False), need_s=0)
    bench.section("bf16 step times", lambda: scenario_rows("bf16"), need_s=est / 2)
    if not args.no_eager:
        bench.section("eager vs compiled", eager_rows, need_s=est / 2)
    if not args.no_fp8:
        bench.section("fp8 engines (quantize + capture)", lambda: engines(True), need_s=est)
        bench.section("fp8 step times", lambda: scenario_rows("fp8"), need_s=est / 4)
    bench.section("tokens/s", tokens_per_s)
    summary(bench)


@contextmanager
def _null():
    yield


def summary(bench: Bench) -> None:
    env = bench.res["env"]
    lines = [f"e2e_gpu on {env['device']} (torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}); "
             f"copy {env['copy_TBps']:.2f} TB/s, matmul {env['matmul_TFLOPs']:.0f} TFLOP/s; prefix {env['past']}",
             "| experts | router | B | step | experts/layer | step ms | bound ms | time/bound | time/vendor bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in bench.res["rows"]:
        lines.append(f"| {r['experts']} | {r['router']} | {r['B']} | {r['step']} | {r['experts_per_layer']:.1f} | "
                     f"{r['step_ms']:.2f} | {r['bound_ms']:.2f} | {r['time_over_bound']:.2f} | "
                     f"{r['time_over_vendor_bound']:.2f} |")
    if bench.res["eager"]:
        lines += [
            "",
            "| B | eager reference ms | kernels, no graph ms | compiled ms | compiled vs eager | vs no graph |",
            "|---|---|---|---|---|---|",
        ]
        for r in bench.res["eager"]:
            lines.append(
                f"| {r['B']} | {r['eager_reference_ms']:.1f} | {r['kernels_no_graph_ms']:.2f} | "
                f"{r['compiled_ms']:.2f} | {r['compiled_vs_eager']:.1f}x | {r['compiled_vs_kernels_no_graph']:.1f}x |"
            )
    if bench.res["tokens_per_s"]:
        lines += [
            "",
            "| experts | router | B | tok/fwd | block tok/s | AR tok/s | block/AR | block tok/s at bound "
            "| AR at bound | block share of bound | AR share of bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bench.res["tokens_per_s"]:
            lines.append(f"| {r['experts']} | {r['router']} | {r['B']} | {r['tokens_per_forward']} | "
                         f"{r['block_tokens_per_s']:.4g} | {r['ar_tokens_per_s']:.4g} | {r['block_over_ar']:.2f} | "
                         f"{r['block_bound_tokens_per_s']:.4g} | {r['ar_bound_tokens_per_s']:.4g} | "
                         f"{r['block_share_of_bound']:.2f} | {r['ar_share_of_bound']:.2f} |")
    if bench.res["self_spec_tokens_per_s"]:
        lines += [
            "",
            "| experts | router | B | draft k | tok/fwd | step ms | self_spec tok/s | AR tok/s | self_spec/AR "
            "| self_spec tok/s at bound | AR at bound | self_spec/AR at bound | self_spec share of bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bench.res["self_spec_tokens_per_s"]:
            lines.append(f"| {r['experts']} | {r['router']} | {r['B']} | {r['draft']} | {r['tokens_per_forward']} | "
                         f"{r['step_ms']:.2f} | {r['self_spec_tokens_per_s']:.4g} | {r['ar_tokens_per_s']:.4g} | "
                         f"{r['self_spec_over_ar']:.2f} | {r['self_spec_bound_tokens_per_s']:.4g} | "
                         f"{r['ar_bound_tokens_per_s']:.4g} | {r['self_spec_over_ar_at_bound']:.2f} | "
                         f"{r['self_spec_share_of_bound']:.2f} |")
    text = "\n".join(lines)
    (bench.out / "e2e_gpu.md").write_text(text + "\n")
    print(text, flush=True)
    print(f"SUMMARY sections {json.dumps(bench.res['sections'])}", flush=True)


if __name__ == "__main__":
    main()

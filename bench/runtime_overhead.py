"""Runtime loop overhead: per step, the engine call vs everything else (target: < 10 % of the step).

    python bench/runtime_overhead.py                  # ORT backend (torch if the exporter is missing)
    python bench/runtime_overhead.py --backend torch --batch 1 --steps 60

A mid-size random model (8 layers, hidden 512, 32k vocabulary, 16 experts)
is generated once into the cache folder and exported (fp32) for ONNX
Runtime. Requests run greedy, one token per step (threshold 1.0) so every
step is a denoise step. Per step the wall time is split into:
  engine    the backend's step call (device synchronised),
  select    the rest of the runner: input upload, controls + LowConfidence
            selection on the logits, the one device-to-host read,
  host      the scheduler, request bookkeeping, detokenising and streaming.
The last line prints overhead = (select + host) / step.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

MID = dict(vocab_size=32768, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
           head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
           linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
           shared_expert_intermediate_size=256, max_context=4096)


def prepare(root: Path, backend: str) -> tuple[Path, str, str]:
    """(path to load, backend, note): the model folder, exported when the ORT backend is asked for."""
    import torch

    from clover_export.tiny import generate_random_tiny

    model_dir = root / "mid-model"
    if not (model_dir / "config.json").exists():
        generate_random_tiny(model_dir, seed=0, dtype=torch.float32, **MID)
    if backend != "ort":
        return model_dir, backend, ""
    try:
        from clover_export.exporter import load_artifact  # noqa: F401
        from clover_export.exporter.export import export
        from clover_export.exporter.session import ort_session  # noqa: F401
    except ImportError as e:
        return model_dir, "torch", f"exporter not ready ({e}); measured the torch backend instead"
    art = root / "mid-ort-fp32"
    if not (art / "manifest.json").exists():
        export(model_dir, art, dtype="fp32", weights="link", max_batch=8, slots=8, max_len=MID["max_context"])
    return art, "ort", ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["ort", "torch"], default="ort")
    ap.add_argument("--batch", type=int, default=4, help="requests stepping together")
    ap.add_argument("--steps", type=int, default=64, help="timed steps (after warm-up)")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 with ort, where torch only runs the selection and ONNX Runtime "
                         "owns the cores; all cores with torch)")
    ap.add_argument("--device", default=None, help="torch backend device (default: cuda if available, else cpu)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="torch backend dtype")
    ap.add_argument("--cache", type=Path, default=None, help="where the model and export live (default: cache folder)")
    args = ap.parse_args()

    import torch

    from clover_export.runtime import Generator
    from clover_export.tiny import cache_root

    root = args.cache or cache_root() / "bench"
    path, backend, note = prepare(root, args.backend)
    threads = args.threads or (1 if backend == "ort" else None)
    if threads:
        torch.set_num_threads(threads)
    opts = {"dtype": args.dtype, "device": args.device, "threads": threads} if backend == "torch" else {}
    gen = Generator.load(path, backend=backend, max_slots=args.batch, max_context=1024, **opts)
    cuda = gen.runner.device.type == "cuda"

    timers = {"engine": 0.0, "runner": 0.0}
    engine_step, runner_run = gen.backend.step, gen.runner.run

    def timed_engine(*a):
        t = time.perf_counter()
        out = engine_step(*a)
        if cuda:
            torch.cuda.synchronize()
        timers["engine"] += time.perf_counter() - t
        return out

    def timed_runner(*a):
        t = time.perf_counter()
        out = runner_run(*a)
        timers["runner"] += time.perf_counter() - t
        return out

    gen.backend.step, gen.runner.run = timed_engine, timed_runner
    rng = random.Random(0)
    vocab = min(gen.cfg.vocab_size, 500)  # ids the tokenizer can decode
    prompts = [[rng.randrange(6, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = dict(threshold=1.0, max_new_tokens=4096 // 8, eos_token_id=[])
    handles = [gen.submit(prompt_ids=p, **params) for p in prompts]
    for _ in range(8):  # warm-up, prefill included
        gen.step()
    for k in timers:
        timers[k] = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        gen.step()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    for h in handles:
        h.cancel()

    n = args.steps
    engine, select = timers["engine"] / n, (timers["runner"] - timers["engine"]) / n
    host = wall / n - timers["runner"] / n
    step = wall / n
    dtype = args.dtype if backend == "torch" else gen.backend.art.dtype
    print(
        f"backend {backend} ({dtype}) on {gen.runner.device} "
        f"({os.cpu_count()} cores, {torch.get_num_threads()} torch threads); "
        f"model {gen.cfg.num_hidden_layers} layers, hidden {gen.cfg.hidden_size}, vocab {gen.cfg.vocab_size}; "
        f"batch {args.batch} x {gen.block_size} block rows (+{gen.block_size} causal rows at commits)"
    )
    if note:
        print(f"note: {note}")
    print(f"per step: {step * 1e3:.2f} ms = engine {engine * 1e3:.2f} ms + select {select * 1e3:.2f} ms "
          f"+ host {host * 1e3:.2f} ms over {n} steps")
    print(f"overhead (select + host) / step = {(select + host) / step:.1%}  (target < 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

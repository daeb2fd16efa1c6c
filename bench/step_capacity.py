"""Per-step time against the pools' capacity: the same greedy request at several max_context.

    python bench/step_capacity.py                        # torch backend, embedded default, 1 thread
    python bench/step_capacity.py --contexts 1024 131072 --steps 32

The embedded default's folder is copied (weights linked) with its config's
max_context raised to the largest capacity asked for; each capacity then gets
a Generator with that `max_context` (pools allocated once, one slot) and runs
the same request greedily, one position per denoise step (threshold 1.0).
Printed per capacity: median backend step time and its ratio to the smallest
capacity's (goal: all within 1.2x). Requests at the different capacities
are interleaved, so the load of a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def model_folder(root: Path, max_context: int) -> Path:
    """The embedded default with config max_context = `max_context` (other files linked)."""
    from clover_export.model.loading import resolve_model_dir

    src = resolve_model_dir("tiny")
    out = root / f"tiny-ctx{max_context}"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_context"] = max_context
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    tmp.replace(out / "config.json")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768, 131072])
    ap.add_argument("--steps", type=int, default=24, help="denoise steps timed per capacity (new tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="requests per capacity, interleaved")
    ap.add_argument("--prompt", default="Sort: 3 1 2 9 4")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()

    import torch

    from clover_export.runtime import Generator
    from clover_export.tiny import cache_root

    torch.set_num_threads(args.threads)
    folder = model_folder(cache_root() / "bench", max(args.contexts))
    params = dict(threshold=1.0, max_new_tokens=args.steps, eos_token_id=[], stop=[])
    gens, times = {}, {}
    for ctx in args.contexts:  # all pools allocated up front, once
        gen = gens[ctx] = Generator.load(folder, backend="torch", device=args.device, dtype=args.dtype,
                                         max_slots=1, max_context=ctx, threads=args.threads)
        times[ctx] = []

        def timed(*a, _step=gen.backend.step, _log=times[ctx]):
            t = time.perf_counter()
            out = _step(*a)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            _log.append(time.perf_counter() - t)
            return out

        gen.backend.step = timed
        gen.generate(args.prompt, **params)  # warm-up
        times[ctx].clear()
    steps = {}
    for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits every capacity alike
        for ctx, gen in gens.items():
            steps[ctx] = gen.generate(args.prompt, **params).denoise_steps
    rows = [(ctx, statistics.median(times[ctx]), steps[ctx]) for ctx in args.contexts]
    base = rows[0][1]
    print(
        f"torch backend, {args.device} {args.dtype}, {args.threads} thread(s), {os.cpu_count()} cores; "
        "embedded default; "
        f"prompt {args.prompt!r}, {args.steps} greedy steps"
    )
    for ctx, med, n in rows:
        print(f"max_context {ctx:>7}: median step {med * 1e3:8.2f} ms  ({med / base:5.2f}x)  "
              f"over {args.rounds} x {n} denoise steps")
    worst = max(r[1] for r in rows) / min(r[1] for r in rows)
    print(f"largest / smallest median step = {worst:.2f}x  (goal <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

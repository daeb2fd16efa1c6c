"""The CPU path on a busy machine: step time with 0, 2, 4 busy processes beside it.

    python bench/cpu_contention.py                       # torch and ort, before/after, 0 2 4 busy
    python bench/cpu_contention.py --backends torch --busy 0 2 --seconds 10

The same greedy requests on the embedded default, each configuration in a
fresh child process (so torch starts with its own default thread count):
  before  threads = every usable core (what torch's and ONNX Runtime's
          defaults gave before the thread policy; no OMP_NUM_THREADS);
  after   the thread policy (backends/threads.py; no OMP_NUM_THREADS, no --threads).
Busy processes are pure-Python spin loops, started for a load level and
stopped after it (each also stops itself after --busy-limit seconds).
Printed: median step time per configuration and the slowdown against the
same configuration with 0 busy processes (goal: <= 3x at 2 busy on 2 cores).
The ort backend runs the cached fp32 export of the embedded default (made on
first use). On a machine that other work already loads, the 0-busy baseline
is contended too: say so with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = ["Sort: 3 1 2 9 4", "Reverse: robot", "Sort: 8 5 7 1"]
SPIN = "import time, sys\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


def child(backend: str, policy: str, seconds: float) -> None:
    """One configuration: prints one JSON line {steps, step_s[]}."""
    from clover_export.backends.threads import usable_cores
    from clover_export.runtime import Generator

    threads = usable_cores() if policy == "before" else None
    gen = Generator.load("tiny", backend=backend, max_slots=1, threads=threads,
                         **({"device": "cpu", "dtype": "fp32"} if backend == "torch" else {}))
    times: list[float] = []
    run = gen.runner.run

    def timed(plan):
        t = time.perf_counter()
        out = run(plan)
        times.append(time.perf_counter() - t)
        return out

    gen.generate(PROMPTS[0], max_new_tokens=32)  # warm-up
    gen.runner.run = timed
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(times) < 3:
        gen.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=32, threshold=0.95)
        i += 1
    import torch

    print(json.dumps({"step_s": times, "requests": i, "torch_threads": torch.get_num_threads()}))


def measure(backend: str, policy: str, seconds: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, __file__, "--child", backend, policy, str(seconds)], env=env,
                         capture_output=True, text=True, timeout=seconds * 20 + 300)
    if out.returncode != 0:
        raise SystemExit(f"{backend}/{policy} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["torch", "ort"], choices=["torch", "ort"])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2, 4], help="busy processes per load level")
    ap.add_argument("--seconds", type=float, default=12.0, help="timed requests per configuration (at least 3 steps)")
    ap.add_argument("--busy-limit", type=float, default=900.0, help="each busy process stops itself after this")
    args = ap.parse_args()

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{os.cpu_count()} cores, load average before the run {' '.join(load)} (other work on this machine counts)")
    results: dict[tuple, float] = {}
    for busy in args.busy:
        procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(args.busy_limit)]) for _ in range(busy)]
        try:
            time.sleep(1.0 if busy else 0.0)
            for backend in args.backends:
                for policy in ("before", "after"):
                    r = measure(backend, policy, args.seconds)
                    med = statistics.median(r["step_s"])
                    results[(backend, policy, busy)] = med
                    base = results.get((backend, policy, args.busy[0]), med)
                    print(f"busy {busy}  {backend:5s} {policy:6s}: median step {med * 1e3:9.2f} ms over "
                          f"{len(r['step_s'])} steps ({r['requests']} requests)  slowdown {med / base:7.2f}x",
                          flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model's steps beside Python work on another thread of the same process (the GIL).

    python bench/gil_contention.py                                  # 300 us every 5 ms, and 50 us every 1 ms
    python bench/gil_contention.py --bursts 1000:20 --rounds 8
    python bench/gil_contention.py --bursts 50:1 --where thread process

What `clover-export serve` asks of its batch-loop thread: the event loop and the tokenizing workers run
Python in the same process. Here the same greedy requests (serve_load.py's prompts, 40 tokens, 8 in
flight, the embedded default on the torch backend, 1 thread) run alone and beside a thread that spends
BURST microseconds in Python (JSON encoding, as a streamed chunk is) every PERIOD milliseconds,
alternated for --rounds. Printed per setting: the median wall time of each side, their ratio, and the
side thread's busy share. A ratio well above 1 + the busy share is time the model's thread loses waiting
to take the GIL back: torch releases it around every op and takes it again after. `--where process` runs
the same bursts in another process instead (no GIL shared, the same CPU work beside the model): the
control, and what `clover-export serve --engine process` does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
from types import SimpleNamespace

from serve_load import PROMPTS  # bench/, this script's folder, is first on the path

CHUNK = {"id": "cmpl-0", "object": "text_completion", "model": "tiny",
         "choices": [{"index": 0, "text": "abc def", "logprobs": None, "finish_reason": None}]}


def bursts(burst: float, period: float, stop, busy) -> None:
    """`burst` seconds of Python every `period` seconds until `stop` is set; busy seconds added to busy.value."""
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < burst:
            json.dumps(CHUNK)
        busy.value += time.perf_counter() - t
        time.sleep(period)


class Side:
    """Bursts of Python on a thread of this process, or in another process (`where`); its busy seconds."""

    def __init__(self, burst_us: float, period_ms: float, where: str = "thread"):
        ctx = multiprocessing.get_context("spawn")
        if where == "process":
            self.stop, self._busy = ctx.Event(), ctx.Value("d", 0.0)
            self.worker = ctx.Process(target=bursts, args=(burst_us * 1e-6, period_ms * 1e-3, self.stop, self._busy),
                                      daemon=True)
        else:
            self.stop, self._busy = threading.Event(), SimpleNamespace(value=0.0)
            self.worker = threading.Thread(target=bursts, args=(burst_us * 1e-6, period_ms * 1e-3, self.stop,
                                                                self._busy), daemon=True)

    @property
    def busy(self) -> float:
        return self._busy.value

    def __enter__(self) -> "Side":
        self.worker.start()
        time.sleep(0.2)  # a process's interpreter starts before the timed requests
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.worker.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--bursts", nargs="+", default=["300:5", "50:1"], help="BURST_US:PERIOD_MS settings")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--where", nargs="+", default=["thread"], choices=["thread", "process"],
                    help="where the bursts run: a thread of this process, another process, or both")
    args = ap.parse_args(argv)

    import torch

    from clover_export.runtime import Generator

    torch.set_num_threads(1)
    gen = Generator.load("tiny", "torch", max_slots=8, threads=1)

    def requests() -> float:
        t0 = time.perf_counter()
        gen.wait([gen.submit(prompt=p, raw=True, max_new_tokens=args.max_tokens) for p in PROMPTS * 2])
        return time.perf_counter() - t0

    requests()  # warm-up
    print("| side: burst every period | where | alone s (median) | beside s (median) | beside / alone | side busy |")
    print("|---|---|---|---|---|---|")
    for spec in args.bursts:
        burst_us, period_ms = (float(x) for x in spec.split(":"))
        sides = ["alone", *args.where]
        times, busy = {side: [] for side in sides}, dict.fromkeys(args.where, 0.0)
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                if side == "alone":
                    times[side].append(requests())
                    continue
                with Side(burst_us, period_ms, side) as s:
                    times[side].append(requests())
                busy[side] += s.busy
        a = statistics.median(times["alone"])
        for where in args.where:
            b = statistics.median(times[where])
            print(f"| {burst_us:g} us every {period_ms:g} ms | {where} | {a:.2f} | {b:.2f} | {b / a:.2f} | "
                  f"{busy[where] / sum(times[where]):.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

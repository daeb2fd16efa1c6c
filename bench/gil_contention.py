"""The model's steps beside Python work on another thread of the same process (the GIL).

    python bench/gil_contention.py                                  # 300 us every 5 ms, and 50 us every 1 ms
    python bench/gil_contention.py --bursts 1000:20 --rounds 8

What `clover-export serve` asks of its batch-loop thread: the event loop and the tokenizing workers run
Python in the same process. Here the same greedy requests (serve_load.py's prompts, 40 tokens, 8 in
flight, the embedded default on the torch backend, 1 thread) run alone and beside a thread that spends
BURST microseconds in Python (JSON encoding, as a streamed chunk is) every PERIOD milliseconds,
alternated for --rounds. Printed per setting: the median wall time of each side, their ratio, and the
side thread's busy share. A ratio well above 1 + the busy share is time the model's thread loses waiting
to take the GIL back: torch releases it around every op and takes it again after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from serve_load import PROMPTS  # bench/, this script's folder, is first on the path

CHUNK = {"id": "cmpl-0", "object": "text_completion", "model": "tiny",
         "choices": [{"index": 0, "text": "abc def", "logprobs": None, "finish_reason": None}]}


class Side:
    """A thread spending `burst_us` in Python every `period_ms`, until stopped; its busy seconds."""

    def __init__(self, burst_us: float, period_ms: float):
        self.burst, self.period = burst_us * 1e-6, period_ms * 1e-3
        self.stop, self.busy = threading.Event(), 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < self.burst:
                json.dumps(CHUNK)
            self.busy += time.perf_counter() - t
            time.sleep(self.period)

    def __enter__(self) -> "Side":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--bursts", nargs="+", default=["300:5", "50:1"], help="BURST_US:PERIOD_MS settings")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
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
    print("| side thread: burst every period | alone s (median) | beside s (median) | beside / alone | side busy |")
    print("|---|---|---|---|---|")
    for spec in args.bursts:
        burst_us, period_ms = (float(x) for x in spec.split(":"))
        alone, beside, busy = [], [], 0.0
        for r in range(args.rounds):
            for side in ((False, True) if r % 2 == 0 else (True, False)):
                if side:
                    with Side(burst_us, period_ms) as s:
                        beside.append(requests())
                    busy += s.busy
                else:
                    alone.append(requests())
        a, b = statistics.median(alone), statistics.median(beside)
        print(f"| {burst_us:g} us every {period_ms:g} ms | {a:.2f} | {b:.2f} | {b / a:.2f} | "
              f"{busy / sum(beside):.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

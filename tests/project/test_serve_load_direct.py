"""bench/serve_load.py's in-process baselines on a hand-timed fake engine: `direct` submits a client's next
request for the very next step, `direct+1` for the step after (an arrival during a running step), except
when nothing else runs. The clock counts steps, so every latency is known by hand."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from types import SimpleNamespace

from clover_export.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"a": 2, "b": 4}  # steps each prompt takes


class FakeGen:
    """Each request finishes after STEPS[prompt] steps; `now` counts the steps run."""

    def __init__(self):
        self.now, self.live = 0, []

    def submit(self, prompt, raw, max_new_tokens):
        h = SimpleNamespace(chunks=deque(), done=False, left=STEPS[prompt],
                            result=SimpleNamespace(text=prompt, response_tokens=1))
        self.live.append(h)
        return h

    def step(self):
        self.now += 1
        for h in self.live:
            h.left -= 1
            h.chunks.append("x")
            h.done = h.left == 0
        self.live = [h for h in self.live if not h.done]


def latencies(lag: bool, jobs, concurrency: int) -> list[float]:
    gen = FakeGen()
    serve_load = load_script(ROOT / "bench" / "serve_load.py")
    outs, _ = serve_load.run_direct(gen, jobs, concurrency, 8, lag=lag, clock=lambda: gen.now)
    return [o.latency for o in outs]


def test_direct_submits_for_the_next_step():
    assert latencies(False, ["a", "b", "a", "b"], 2) == [2, 4, 2, 4]


def test_direct_plus_one_waits_a_step_while_others_run():
    # a0 ends at step 2 while b1 runs: a2 (clock from 2) enters after step 3, ends at 5; b1 ends at 4 while a2
    # runs: b3 (clock from 4) enters after step 5, ends at 9
    assert latencies(True, ["a", "b", "a", "b"], 2) == [2, 4, 3, 5]


def test_direct_plus_one_takes_an_arrival_at_once_when_nothing_runs():
    assert latencies(True, ["a", "a", "b"], 1) == [2, 2, 4]

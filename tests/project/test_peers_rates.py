"""bench/peers.py's tokens per second, on engines timed by a hand-run clock: a rate is one round's tokens over
one round's seconds, whatever the number of rounds, for our engines (`Bench.measure`) and for the peers run
in a subprocess (`timed_batches`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from clover_export.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2], [3, 4], [5, 6], [7, 8]]
SECONDS_PER_PROMPT = {"transformers": 1.0, "ar (torch)": 0.5}  # each prompt's answer: 3 tokens


@pytest.fixture(scope="module")
def peers():
    return load_script(ROOT / "bench" / "peers.py")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def engine(self, name: str):
        def run(prompts):
            self.now += SECONDS_PER_PROMPT[name] * len(prompts)
            return [[9, 9, 9] for _ in prompts], len(prompts)
        return run


@pytest.mark.parametrize("rounds", [1, 3])
def test_our_rates_are_per_round(peers, rounds):
    clock = Clock()
    bench = peers.Bench.__new__(peers.Bench)
    bench.name, bench.prompts, bench.clock = "fake", PROMPTS, clock
    bench.args = SimpleNamespace(rounds=rounds, small_gap=0.5)
    bench.engines = lambda: {n: clock.engine(n) for n in SECONDS_PER_PROMPT}
    runs = {2: bench.measure(2)}
    rows = {r["engine"]: r for r in peers.report_rows(bench, runs, [])}
    assert rows["transformers"]["tokens_per_s"] == pytest.approx(3.0)  # 3 tokens a prompt, 1 s a prompt
    assert rows["ar (torch)"]["tokens_per_s"] == pytest.approx(6.0)
    assert rows["ar (torch)"]["ratio"] == pytest.approx(2.0)
    assert rows["ar (torch)"]["tokens_per_forward"] == pytest.approx(3.0)


@pytest.mark.parametrize("rounds", [1, 3])
def test_peer_rates_are_per_round(peers, monkeypatch, rounds):
    clock = Clock()
    monkeypatch.setattr(peers.time, "perf_counter", clock)
    run = clock.engine("transformers")
    out = peers.timed_batches(lambda ps: run(ps)[0], dict(prompts=PROMPTS, batches=[1, 4], rounds=rounds))
    for batch in ("1", "4"):
        assert out[batch]["seconds"] == pytest.approx(len(PROMPTS) * 1.0)
        assert sum(map(len, out[batch]["tokens"])) == 3 * len(PROMPTS)

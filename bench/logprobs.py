"""Per-step cost of logprobs (docs/serving.md, Logprobs): the same batch of requests with and without
`logprobs`, side by side in one run, per decoding mode; then the device work alone at a Qwen-sized vocabulary.

    python bench/logprobs.py [--batch 4] [--tokens 48] [--repeats 5] [--top 5] [--json FILE]

1. End to end on the embedded default (torch, fp32, CPU): B prompts, greedy, `ignore_eos`, `max_tokens`
   tokens each; seconds per engine step (wall time over the steps the batch took), without logprobs and with
   `logprobs=top`, alternating the two (A B A B ...) and taking medians so drift in the machine's load hits
   both; the ratio is the cost.
2. The device work alone (runtime/decoding/device_logprobs.py): log-softmax of the asking rows' raw logits,
   the chosen tokens' gathers and the top k, on random logits [B, R, V] with V = 151,936 (Clover-35B-A3B's
   lm_head), against the lm_head matmul that produced those logits (hidden 2048) on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from clover_export.runtime import Generator
from clover_export.tiny import TRAINED_DIR

PROMPTS = ["sort: 5 3 9 1 7 2", "reverse: a b c d e f g", "sort: 9 8 7 1 1 4 4 2", "reverse: q w e r t y",
           "sort: 4 2 8 6", "reverse: z x c v", "sort: 1 9 2 8 3 7", "reverse: m n b v"]
MODES = ("ar", "self_spec", "low_confidence")


def per_step(gen: Generator, prompts: list[str], mode: str, tokens: int, top: int | None) -> float:
    """Seconds per engine step for the batch (all requests submitted together, stepped to the end)."""
    handles = [gen.submit(p, decoding=mode, max_new_tokens=tokens, ignore_eos=True, enable_thinking=False,
                          logprobs=top) for p in prompts]
    steps, t = 0, time.perf_counter()
    while not all(h.done for h in handles):
        gen.step()
        steps += 1
    return (time.perf_counter() - t) / steps


def end_to_end(args) -> dict[str, dict[str, float]]:
    gen = Generator.load(TRAINED_DIR, "torch", dtype="fp32", max_slots=args.batch, prefix_cache=False)
    prompts = (PROMPTS * 2)[:args.batch]
    out = {}
    for mode in MODES:
        per_step(gen, prompts, mode, 8, args.top)  # warm-up
        runs = {"off": [], "on": []}
        for _ in range(args.repeats):
            runs["off"].append(per_step(gen, prompts, mode, args.tokens, None))
            runs["on"].append(per_step(gen, prompts, mode, args.tokens, args.top))
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        out[mode] = {"off_ms": off * 1e3, "on_ms": on * 1e3, "ratio": on / off}
    return out


def timed(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_work(args, vocab: int = 151936, hidden: int = 2048) -> dict[str, dict[str, float]]:
    """The logprob work on [B, R, V] logits vs the lm_head matmul [B * R, hidden] x [hidden, V]."""
    out = {}
    head = torch.randn(vocab, hidden) / hidden ** 0.5
    for R in (1, 8):
        h = torch.randn(args.batch * R, hidden)
        logits = (h @ head.T).view(args.batch, R, vocab)
        ids = logits.argmax(-1)

        def logprob_work():
            lsm = torch.log_softmax(logits.float(), -1)
            lsm.gather(2, ids[..., None])
            lsm.topk(args.top, -1)

        lm = timed(lambda: h @ head.T)
        work = timed(logprob_work)
        out[f"R={R}"] = {"lm_head_ms": lm * 1e3, "logprobs_ms": work * 1e3, "ratio": work / lm}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    e2e = end_to_end(args)
    print(f"end to end, embedded default, B={args.batch}, {args.tokens} tokens, top {args.top} "
          f"(median of {args.repeats}, ms per step)")
    print(f"{'mode':<16}{'without':>10}{'with':>10}{'ratio':>8}")
    for mode, r in e2e.items():
        print(f"{mode:<16}{r['off_ms']:>10.2f}{r['on_ms']:>10.2f}{r['ratio']:>8.3f}")
    dev = device_work(args)
    print(f"device work alone, V=151936, B={args.batch}, top {args.top} (ms)")
    print(f"{'rows':<8}{'lm_head':>10}{'logprobs':>10}{'ratio':>8}")
    for rows, r in dev.items():
        print(f"{rows:<8}{r['lm_head_ms']:>10.2f}{r['logprobs_ms']:>10.2f}{r['ratio']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "end_to_end": e2e, "device_work": dev}, f, indent=1)


if __name__ == "__main__":
    main()

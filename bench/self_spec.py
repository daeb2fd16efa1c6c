"""The decoding modes side by side on the embedded default (DECODING.md 2, 5).

    python bench/self_spec.py                    # 64 held-out prompts, batch 1 and 8, torch on the CPU
    python bench/self_spec.py --count 200 --draft-thresholds 0.1 0.3 0.5 0.7 0.9

On the held-out task prompts (clover_export.train.tasks, never trained on), greedy, for each mode:
accuracy (exact answer), tokens per forward (response tokens / forwards the request took part in after its
prompt), draft length and acceptance length (draft tokens proposed / accepted per verifying forward, the
mean over every verification), the share of responses identical
to `ar`'s token for token, and wall tokens/s on this machine, at batch 1 (one request at a time) and batch
8 (eight stepping together). `low_confidence` runs at threshold 0.95; `self_spec` at each draft threshold
given. All rows of one run share the process and the backend, so the ratios are side by side.
"""

from __future__ import annotations

import argparse
import time

import torch

from clover_export.model.loading import resolve_model_dir
from clover_export.runtime import Generator
from clover_export.train import tasks


def run(gen: Generator, prompts: list[str], batch: int, thinking: bool, **params) -> tuple[list, float]:
    """Results of every prompt, `batch` requests stepping together; and the wall seconds. Each result
    carries its request's draft totals (`drafted`, `verifications`)."""
    start, results = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        handles = [gen.submit(p, enable_thinking=thinking, max_new_tokens=48, **params)
                   for p in prompts[i:i + batch]]
        results += gen.wait(handles)
        for h in handles:
            h.result.drafted, h.result.verifications = h.request.drafted_tokens, h.request.verifications
    return results, time.perf_counter() - start


def row(name: str, batch: int, examples, results, seconds: float, ar_ids) -> str:
    ok = sum(tasks.is_correct(ex, r.text) for ex, r in zip(examples, results))
    tokens = sum(len(r.token_ids) for r in results)
    forwards = sum(r.forwards for r in results)
    verifications = sum(r.verifications for r in results)
    accept = sum(r.accepted_per_forward * r.verifications for r in results) / verifications if verifications else 0.0
    drafted = sum(r.drafted for r in results) / verifications if verifications else 0.0
    same = sum(r.token_ids == a for r, a in zip(results, ar_ids)) if ar_ids else len(results)
    return (f"{name:<24} {batch:>5} {100.0 * ok / len(results):>6.1f} {tokens / forwards:>6.2f} {drafted:>6.2f} "
            f"{accept:>7.2f} {100.0 * same / len(results):>7.1f} {tokens / seconds:>8.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="tiny", help="model folder (default: the embedded default)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--count", type=int, default=64, help="held-out prompts")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--draft-thresholds", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--thinking", action="store_true", help="render prompts with enable_thinking")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    examples = tasks.heldout_examples(args.count)
    prompts = [ex.prompt for ex in examples]
    gen = Generator.load(resolve_model_dir(args.model), args.backend, max_slots=max(args.batches),
                         prefix_cache=False)
    print(f"{args.count} held-out prompts, {args.backend}, thinking={args.thinking}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'mode':<24} {'batch':>5} {'acc%':>6} {'tok/fw':>6} {'draft':>6} {'accept':>7} {'=ar %':>7} {'tok/s':>8}")
    summary = {}
    for batch in args.batches:
        ar, seconds = run(gen, prompts, batch, args.thinking, decoding="ar")
        ar_ids = [r.token_ids for r in ar]
        print(row("ar", batch, examples, ar, seconds, ar_ids), flush=True)
        base = len(ar_ids) and sum(len(i) for i in ar_ids) / seconds
        lc, seconds = run(gen, prompts, batch, args.thinking, decoding="low_confidence", threshold=0.95)
        print(row("low_confidence@0.95", batch, examples, lc, seconds, ar_ids), flush=True)
        for thr in args.draft_thresholds:
            res, seconds = run(gen, prompts, batch, args.thinking, decoding="self_spec", draft_threshold=thr)
            print(row(f"self_spec@{thr}", batch, examples, res, seconds, ar_ids), flush=True)
            tps = sum(len(r.token_ids) for r in res) / seconds
            summary[(batch, thr)] = (sum(len(r.token_ids) for r in res) / sum(r.forwards for r in res), tps / base)
    for (batch, thr), (tpf, speed) in sorted(summary.items()):
        print(f"batch={batch} self_spec@{thr}: tokens_per_forward={tpf:.2f} speedup_vs_ar={speed:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

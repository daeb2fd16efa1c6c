"""Structured output end to end on the embedded default (torch, CPU): what a grammar costs per decoding step,
and what it does to self_spec's tokens per forward (docs/structured_output.md, bench/README.md).

    python bench/structured_cost.py [--batch 8] [--tokens 48] [--repeats 3] [--json out.json]

1. Per-step cost: the same batch of requests with and without a grammar, every row running to `--tokens`
   (the grammar: an object holding an array of at least 60 digits, which cannot close before then; without:
   `ignore_eos`), so both runs step the same number of full batches. The ratio is CPU ms per step with /
   without (process CPU time: on a shared machine wall time measures the neighbours), medians over
   `--repeats` alternating runs, for `ar` and `self_spec`; the CPU ms of the grammar's logit hooks alone; and
   the ratio per generated token (self_spec: the grammar changes the drafts, so the steps and their rows differ).
2. self_spec tokens per forward on the same prompts, greedy: free text, and under a nested JSON schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from clover_export.constraints import compile as compile_grammar
from clover_export.runtime import Generator
from clover_export.runtime.decoding import device

PROMPTS = ["sort: 5 3 9 1 7 2", "reverse: 1 2 3 4 5", "sort: 9 8 7 1 1 4 4 2", "reverse: 7 7 1 0 3",
           "sort: 4 2 6", "reverse: 9 0 1 2", "sort: 8 1 5 5 3 2 7", "reverse: 6 5 4"]
LONG = {"type": "json_schema", "json_schema": {"name": "digits", "schema": {
    "type": "object", "properties": {"digits": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "minItems": 60}},
    "required": ["digits"], "additionalProperties": False}}}
NESTED = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"task": {"enum": ["sort", "reverse"]},
                                     "digits": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}, "maxItems": 10},
                                     "note": {"type": "string", "maxLength": 24}},
    "required": ["task", "digits", "note"], "additionalProperties": False}}}


HOOK_CPU = [0.0]  # CPU seconds inside the strategies' logit hooks (the grammar's masks)


def timed_hooks() -> None:
    """Count the CPU time of `device.apply_logit_hooks` (where the grammar's work on a step is)."""
    inner = device.apply_logit_hooks

    def hooks(step):
        start = time.process_time()
        inner(step)
        HOOK_CPU[0] += time.process_time() - start

    device.apply_logit_hooks = hooks


def ms_per_step(gen: Generator, prompts: list[str], grammar, **params) -> tuple[float, int, float]:
    """CPU ms per `gen.step()` while every request of the batch runs (CPU time: the machine is shared, so wall
    time measures the neighbours), the step count and the hooks' CPU ms per step."""
    handles = [gen.submit(p, grammar=grammar, **params) if grammar is not None else
               gen.submit(p, ignore_eos=True, **params) for p in prompts]
    steps, start, HOOK_CPU[0] = 0, time.process_time(), 0.0
    while not all(h.done for h in handles):
        gen.step()
        steps += 1
    elapsed = time.process_time() - start
    assert all(len(h.wait().token_ids) == params["max_new_tokens"] for h in handles), "a row ended early"
    return 1000 * elapsed / steps, steps, 1000 * HOOK_CPU[0] / steps


def step_cost(gen: Generator, args, mode: str) -> dict:
    grammar = compile_grammar(LONG, gen.grammar_vocab())
    prompts = (PROMPTS * 4)[:args.batch]
    params = dict(decoding=mode, max_new_tokens=args.tokens, enable_thinking=False)
    ms_per_step(gen, prompts, grammar, **params)  # warm-up
    with_g, without = [], []
    for _ in range(args.repeats):
        without.append(ms_per_step(gen, prompts, None, **params))
        with_g.append(ms_per_step(gen, prompts, grammar, **params))
    a, b = statistics.median(m[0] for m in with_g), statistics.median(m[0] for m in without)
    hook = statistics.median(m[2] for m in with_g)
    return {"mode": mode, "batch": args.batch, "cpu_ms_per_step_grammar": round(a, 3),
            "cpu_ms_per_step_free": round(b, 3), "ratio": round(a / b, 3),
            "grammar_hook_cpu_ms_per_step": round(hook, 3),
            "hook_share": round(hook / a, 3), "steps_grammar": with_g[0][1], "steps_free": without[0][1],
            "cpu_ms_per_token_ratio": round(a * with_g[0][1] / (b * without[0][1]), 3)}


def tokens_per_forward(gen: Generator, args) -> dict:
    grammar = compile_grammar(NESTED, gen.grammar_vocab())
    out = {}
    for label, g in (("free", None), ("json_schema", grammar)):
        results = [gen.generate(p, decoding="self_spec", grammar=g, max_new_tokens=args.tokens * 2,
                                enable_thinking=False) for p in PROMPTS]
        tokens, forwards = sum(len(r.token_ids) for r in results), sum(r.forwards for r in results)
        out[label] = {"tokens": tokens, "forwards": forwards, "tokens_per_forward": round(tokens / forwards, 3)}
    out["ratio"] = round(out["json_schema"]["tokens_per_forward"] / out["free"]["tokens_per_forward"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    gen = Generator.load(None, "torch", dtype="fp32", max_slots=args.batch, prefix_cache=False)
    timed_hooks()
    report = {"steps": [step_cost(gen, args, m) for m in ("ar", "self_spec")],
              "self_spec": tokens_per_forward(gen, args)}
    print(f"{'mode':10} {'batch':>5} {'CPU ms/step free':>17} {'with grammar':>13} {'ratio':>6} "
          f"{'of it, masks':>13} {'share':>6} {'per token':>9}")
    for s in report["steps"]:
        print(f"{s['mode']:10} {s['batch']:>5} {s['cpu_ms_per_step_free']:>17.2f} "
              f"{s['cpu_ms_per_step_grammar']:>13.2f} "
              f"{s['ratio']:>6.3f} {s['grammar_hook_cpu_ms_per_step']:>13.2f} {s['hook_share']:>6.3f} "
              f"{s['cpu_ms_per_token_ratio']:>9.3f}")
    t = report["self_spec"]
    print(f"self_spec tokens/forward: free {t['free']['tokens_per_forward']:.3f}, json_schema "
          f"{t['json_schema']['tokens_per_forward']:.3f} (ratio {t['ratio']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

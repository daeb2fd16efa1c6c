"""Prefix reuse across requests (docs/prefix_cache.md): prompt rows computed and time to first block, cache on vs off.

    python bench/prefix_cache.py                       # the embedded default `tiny`, torch on the CPU
    python bench/prefix_cache.py --backend ort --json out.json
    python bench/prefix_cache.py --arithmetic-only     # the full-size fork vs prefill table alone

Two workloads, each run with the cache off and on by the same backend in one
run, at the embedded default's largest context (2,048 positions):
- a 6-turn chat: each turn re-sends the conversation (system prompt, earlier
  turns with their answers through the chat template, a new user message),
  growing to close to the context;
- 16 requests sharing a long system prompt, submitted together.
For each: prompt rows computed (causal rows of prefill steps, seen through the
runner's observer), prompt tokens resumed from the cache, time to first
block (submit to first committed block, per request: median and max) and
wall time; and whether every response is token for token the same.

Then the full-size arithmetic (Clover-35B-A3B's config): bytes a fork copies
(K/V rows of the shared prefix + one GDN state snapshot) against the FLOPs of
prefilling that prefix, at 4K / 32K / 128K tokens, with times at an H200's
measured copy bandwidth and bf16 matmul rate (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from clover_export.runtime.request import Phase

CONTEXT_FILL = 0.9  # the conversation grows to about this share of the context
TURNS = 6
SHARERS = 16
H200_COPY_BPS = 4.12e12  # measured, bench/README.md e2e_gpu (2026-11-30)
H200_MATMUL_FLOPS = 775e12  # measured dense bf16, same run


def numbers_text(n_words: int, seed: int) -> str:
    """Filler text of about n_words short words (deterministic)."""
    import random

    rng = random.Random(seed)
    return " ".join(str(rng.randrange(100)) for _ in range(n_words))


class Rows:
    """Prompt rows each request computed: causal rows of its prefill steps."""

    def __init__(self, gen):
        self.by_id: dict[int, int] = {}
        gen.runner.observer = self

    def __call__(self, plan, logits):
        for r, req in enumerate(plan.requests):
            if req.phase is Phase.PREFILL:
                self.by_id[req.request_id] = self.by_id.get(req.request_id, 0) + plan.n_causal[r]


def run_together(gen, prompts: list[list[int]], **kw) -> tuple[list, list[float]]:
    """Submit all, step until done; (results, seconds from submit to each one's first committed block)."""
    t0 = time.perf_counter()
    handles = [gen.submit(prompt_ids=p, **kw) for p in prompts]
    first = [None] * len(handles)
    while not all(h.done for h in handles):
        gen.step()
        now = time.perf_counter()
        for i, h in enumerate(handles):
            if first[i] is None and (h.chunks or h.done):
                first[i] = now - t0
    return [h.result for h in handles], first


def chat_turns(gen, max_new: int) -> tuple[list, list[float], list[list[int]]]:
    """The 6-turn conversation: each turn's prompt is the whole chat so far through the template."""
    system = "You are a careful assistant. " + numbers_text(40, 0)
    room = int(gen.max_context * CONTEXT_FILL) - max_new * TURNS
    per_turn = max(8, room // TURNS)  # prompt tokens each turn adds, about
    messages = [{"role": "system", "content": system}]
    results, ttfb, prompts = [], [], []
    for turn in range(TURNS):
        words = per_turn * 2 // 3
        while True:  # size the user message to its token budget
            msg = f"Sort these numbers: {numbers_text(words, turn + 1)}"
            ids = gen.prompt_ids(messages=messages + [{"role": "user", "content": msg}], enable_thinking=False)
            if len(ids) <= (turn + 1) * (per_turn + max_new) or words < 4:
                break
            words = words * 3 // 4
        messages.append({"role": "user", "content": msg})
        (res,), (t,) = run_together(gen, [ids], max_new_tokens=max_new)
        results.append(res)
        ttfb.append(t)
        prompts.append(ids)
        messages.append({"role": "assistant", "content": res.content})
    return results, ttfb, prompts


def shared_system(gen, max_new: int) -> tuple[list, list[float], list[list[int]]]:
    """16 requests with one long system prompt and different short questions, submitted together."""
    system = "Follow these rules. " + numbers_text(600, 7)
    prompts = []
    for i in range(SHARERS):
        ids = gen.prompt_ids(messages=[{"role": "system", "content": system},
                                       {"role": "user", "content": f"add {i} and {i + 5}"}], enable_thinking=False)
        prompts.append(ids)
    cut = gen.max_context - gen.block_size * -(-max_new // gen.block_size)
    if max(map(len, prompts)) > cut:
        raise SystemExit(f"system prompt too long for the context ({max(map(len, prompts))} > {cut})")
    results, ttfb = run_together(gen, prompts, max_new_tokens=max_new)
    return results, ttfb, prompts


def measure(args, backend, on: bool, workload) -> dict:
    from clover_export.runtime import Generator

    gen = Generator(backend, backend.source_dir, max_slots=args.slots, prefill_chunk=args.chunk, prefix_cache=on)
    rows = Rows(gen)
    t0 = time.perf_counter()
    results, ttfb, prompts = workload(gen, args.max_new)
    wall = time.perf_counter() - t0
    return {"prompt_tokens": sum(map(len, prompts)),
            "prompt_rows": sum(rows.by_id.get(r.request_id, 0) for r in results),
            "cached_tokens": sum(r.cached_tokens for r in results),
            "ttfb_median_s": statistics.median(ttfb), "ttfb_max_s": max(ttfb), "ttfb_s": ttfb, "wall_s": wall,
            "tokens": [r.token_ids for r in results], "longest_prompt": max(map(len, prompts)),
            "per_request": [{"prompt": len(p), "cached": r.cached_tokens, "rows": rows.by_id.get(r.request_id, 0),
                             "new": new} for p, r, new in zip(prompts, results, new_tokens(prompts, results))]}


def new_tokens(prompts: list[list[int]], results: list) -> list[int]:
    """Per request, prompt tokens past its common prefix with the previous request's prompt + answer (the
    "new tokens" of a conversation's turn; the whole prompt for the first)."""
    from clover_export.runtime.prefix_cache import TokenRun

    out, before = [], None
    for p, r in zip(prompts, results):
        out.append(len(p) - (TokenRun(p).common_prefix(TokenRun(before)) if before is not None else 0))
        before = p + r.token_ids
    return out


def fork_vs_prefill(tokens: int) -> dict:
    """Full size: what a fork copies for a `tokens`-long shared prefix, and the FLOPs of prefilling it."""
    from clover_export.backends.threads import flops_per_row
    from clover_export.model.model import cache_bytes_per_token_and_fixed
    from clover_export.testing.fullsize import full_size_config

    cfg = full_size_config()
    per_token, snapshot = cache_bytes_per_token_and_fixed(cfg, dtype_bytes=2)  # bf16 K/V and conv, fp32 recurrent
    copied = tokens * per_token + snapshot
    weights = flops_per_row(cfg) * tokens  # every projection and the top-k experts, per row
    # causal QK and PV
    attention = 2 * cfg.num_attention_heads * cfg.head_dim * tokens * tokens * len(cfg.attention_layers)
    recurrence = 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * tokens \
        * len(cfg.gdn_layers)
    flops = weights + attention + recurrence
    copy_s, prefill_s = copied / H200_COPY_BPS, flops / H200_MATMUL_FLOPS
    return {"tokens": tokens, "copied_bytes": copied, "kv_bytes": tokens * per_token, "snapshot_bytes": snapshot,
            "prefill_flops": flops, "attention_flops": attention, "copy_ms": copy_s * 1e3,
            "prefill_ms": prefill_s * 1e3, "ratio": prefill_s / copy_s}


def print_workload(name: str, off: dict, on: dict) -> None:
    same = off["tokens"] == on["tokens"]
    print(f"\n{name}: {len(on['tokens'])} requests, {on['prompt_tokens']} prompt tokens, longest prompt "
          f"{on['longest_prompt']}; responses identical with the cache: {same}")
    print(f"{'':>10} {'prompt rows':>12} {'cached':>8} {'ttfb median':>12} {'ttfb max':>10} {'wall':>8}")
    for label, r in (("cache off", off), ("cache on", on)):
        print(f"{label:>10} {r['prompt_rows']:>12} {r['cached_tokens']:>8} {r['ttfb_median_s'] * 1e3:>10.1f}ms "
              f"{r['ttfb_max_s'] * 1e3:>8.1f}ms {r['wall_s']:>7.2f}s")
    print(f"{'on / off':>10} {on['prompt_rows'] / off['prompt_rows']:>12.3f} {'':>8} "
          f"{on['ttfb_median_s'] / off['ttfb_median_s']:>12.3f} {on['ttfb_max_s'] / off['ttfb_max_s']:>10.3f} "
          f"{on['wall_s'] / off['wall_s']:>8.3f}")


def print_turns(off: dict, on: dict, block: int) -> None:
    print(f"per turn (cache on): prompt, new tokens (past the previous prompt + answer), cached, rows computed "
          f"(bound: new + one block of {block})")
    for i, t in enumerate(on["per_request"]):
        print(f"  turn {i + 1}: prompt {t['prompt']:>5}  new {t['new']:>5}  cached {t['cached']:>5}  "
              f"rows {t['rows']:>5}  (off: {off['per_request'][i]['rows']})")


def print_arithmetic(table: list[dict]) -> None:
    print(f"\nfull size (Clover-35B-A3B, bf16 K/V): a fork copies vs prefilling the prefix; H200 at "
          f"{H200_COPY_BPS / 1e12:.2f} TB/s copy, {H200_MATMUL_FLOPS / 1e12:.0f} TFLOP/s bf16")
    print(f"{'tokens':>8} {'copied':>10} {'copy':>9} {'prefill':>12} {'prefill':>10} {'ratio':>8}")
    for r in table:
        print(f"{r['tokens']:>8} {r['copied_bytes'] / 2**30:>8.2f}GiB {r['copy_ms']:>7.2f}ms "
              f"{r['prefill_flops'] / 1e15:>9.2f}PF {r['prefill_ms']:>8.0f}ms {r['ratio']:>8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="torch", choices=["torch", "ort", "triton"])
    ap.add_argument("--device", default=None, help="torch/triton: device (default: cuda if available, else cpu)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (the Generator's default)")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--arithmetic-only", action="store_true")
    args = ap.parse_args()
    out = {"arithmetic": [fork_vs_prefill(t) for t in (4096, 32768, 131072)]}
    if not args.arithmetic_only:
        from clover_export.backends import open_backend

        opts = {"device": args.device} if args.device and args.backend != "ort" else {}
        backend = open_backend(args.backend, None, **opts)
        print(f"backend {args.backend} on {backend.device}, embedded default (max context {backend.max_context}), "
              f"{args.slots} slots, prefill chunk {args.chunk}, max_new_tokens {args.max_new}")
        for name, workload in (("6-turn chat", chat_turns), ("16 requests sharing a system prompt", shared_system)):
            off = measure(args, backend, False, workload)  # one generator at a time: ort's pool sets are per generator
            on = measure(args, backend, True, workload)
            print_workload(name, off, on)
            if workload is chat_turns:
                print_turns(off, on, backend.block_size)
            out[name] = {"off": off, "on": on, "identical": off["tokens"] == on["tokens"]}
    print_arithmetic(out["arithmetic"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

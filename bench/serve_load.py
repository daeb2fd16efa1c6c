"""Load on `clover-export serve`: N concurrent streaming clients vs the Generator called directly (SERVING.md).

    python bench/serve_load.py [MODEL] [--requests 24] [--concurrency 1,8,32] [--max-tokens 64] [--rounds 2]
        [--warmup 2] [--engines process,thread]

For each concurrency c, the same fixed list of greedy requests runs both
ways, alternating A B B A (--rounds) so that load drift cancels: (1) over HTTP against a `clover-export serve`
subprocess, c streaming clients (closed loop: a client sends its next
request when the previous one ends); (2) in this process with the Python
API, c requests in flight. Printed: requests/s, time to first block p50/p99,
tokens/s, mean latency of both, and the server overhead per request
(mean latency difference, and its share of the latency). Every streamed
answer is checked against the direct one: 0 lost or duplicated tokens
means equal text and equal completion_tokens for every request.

The direct side runs twice, and the overhead is printed against both:
- `direct`: a client's next request enters the very next step after its previous one finished (the
  Python API's best case: it submits between steps);
- `direct+1`: it enters one step later, unless the batch is empty, which is when a request sent over any
  network reaches a continuous-batching engine: it arrives while the next step runs and joins the one after
  (what every served request pays, whatever the server; bench/README.md, serve_load.py). The overhead
  against `direct+1` is the server's own cost: HTTP, checks, tokenizing, streaming, its threads.

`--engines process,thread` runs one server per `clover-export serve --engine` (the engine in its own process,
the default; or on a thread of the server's process), each one more side of the same alternation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

PROMPTS = ["The answer is", "What is 2 + 3?", "12*12=", "What is 7 + 8?", "Hi", "Tell me a story"]


@dataclass
class Outcome:
    text: str
    tokens: int
    ttfb: float  # seconds to the first block
    latency: float


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# --- over HTTP ----------------------------------------------------------------------------------
async def one_http(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> Outcome:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, tokens = None, [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if first is None and c["finish_reason"] is None:
                    first = time.perf_counter()
                text.append(c["text"])
    end = time.perf_counter()
    return Outcome("".join(text), tokens, (first or end) - t0, end - t0)


async def run_http(url: str, jobs: list[str], concurrency: int, max_tokens: int):
    queue = list(enumerate(jobs))
    out: dict[int, Outcome] = {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while queue:
                i, prompt = queue.pop(0)
                out[i] = await one_http(client, url, prompt, max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [out[i] for i in range(len(jobs))], wall


# --- the Python API directly ----------------------------------------------------------------------
def run_direct(gen, jobs: list[str], concurrency: int, max_tokens: int, lag: bool = False, clock=time.perf_counter):
    """c closed-loop clients on the Python API. lag: a client's next request (its clock started when the
    previous one finished) enters after one more step, as a request arriving during that step would,
    unless nothing else is running (an idle engine takes an arrival at once)."""
    pending = list(enumerate(jobs))
    live, out, held = {}, {}, []

    def submit(i, prompt, start):
        live[i] = (gen.submit(prompt, raw=True, max_new_tokens=max_tokens), start, [None])

    t0 = clock()
    while pending and len(live) < concurrency:
        submit(*pending.pop(0), t0)
    while live or held:
        if not live:  # an idle engine admits the arrivals at once
            for args in held:
                submit(*args)
            held = []
        gen.step()
        now = clock()
        for args in held:  # arrived while that step ran: in for the next one
            submit(*args)
        held = []
        for i, (h, start, first) in list(live.items()):
            if h.chunks and first[0] is None:
                first[0] = now
            h.chunks.clear()
            if h.done:
                res = h.result
                out[i] = Outcome(res.text, res.response_tokens, (first[0] or now) - start, now - start)
                del live[i]
                if pending:
                    args = (*pending.pop(0), now)
                    if lag:
                        held.append(args)
                    else:
                        submit(*args)
    return [out[i] for i in range(len(jobs))], clock() - t0


def start_server(model, backend, max_batch, max_queue, engine="process"):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "clover_export.cli", "serve", *([model] if model else []), "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--log-level", "warning",
           "--engine", engine, *(["--backend", backend] if backend else [])]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited")
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not come up")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="model folder / artifact; default: the embedded tiny model")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--requests", type=int, default=24, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="direct/server alternations (A B B A ...) per level")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds of both sides first, per level")
    ap.add_argument("--engines", default="process",
                    help="the servers' --engine, comma-separated: process, thread, or both side by side")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    max_batch = max(levels)

    # the direct side runs as the server does (start_server passes OMP_NUM_THREADS=1): without it this process's
    # OpenMP pool is sized for every core and the direct baseline ran ~2x slower beside busy processes
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from clover_export.runtime import Generator

    torch.set_num_threads(1)
    backend = args.backend or "torch"
    gen = Generator.load(args.model, backend=backend, max_slots=max_batch)
    servers = {}
    rows = []
    try:
        for engine in engines:
            servers[engine] = start_server(args.model, args.backend, max_batch, max(64, args.requests), engine)
        for c in levels:
            jobs = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
            direct, lagged, d_wall = [], [], 0.0
            served = {e: [] for e in engines}
            s_wall = dict.fromkeys(engines, 0.0)
            sides = ("direct", "direct+1", *engines)
            for _ in range(args.warmup):  # untimed: both processes' first passes (allocations, caches) run slow
                run_direct(gen, jobs, c, args.max_tokens)
                for _proc, url in servers.values():
                    asyncio.run(run_http(url, jobs, c, args.max_tokens))
            for r in range(args.rounds):  # A B C C B A ...: a load drift on the shared machine cancels out
                for side in sides if r % 2 == 0 else sides[::-1]:
                    if side in servers:
                        outs, wall = asyncio.run(run_http(servers[side][1], jobs, c, args.max_tokens))
                        served[side] += outs
                        s_wall[side] += wall
                    elif side == "direct":
                        outs, wall = run_direct(gen, jobs, c, args.max_tokens)
                        direct, d_wall = direct + outs, d_wall + wall
                    else:
                        lagged += run_direct(gen, jobs, c, args.max_tokens, lag=True)[0]
            n = len(jobs) * args.rounds
            lat_d = statistics.mean(o.latency for o in direct)
            lat_l = statistics.mean(o.latency for o in lagged)
            for engine in engines:
                outs = served[engine]
                bad = sum(a.text != b.text or a.tokens != b.tokens for a, b in zip(direct, outs))
                bad += sum(a.text != b.text or a.tokens != b.tokens for a, b in zip(direct, lagged))
                lat_s = statistics.mean(o.latency for o in outs)
                rows.append(
                    dict(
                        concurrency=c,
                        engine=engine,
                        requests=n,
                        req_per_s=n / s_wall[engine],
                        direct_req_per_s=n / d_wall,
                        ttfb_p50_ms=1e3 * pct([o.ttfb for o in outs], 50),
                        ttfb_p99_ms=1e3 * pct([o.ttfb for o in outs], 99),
                        tokens_per_s=sum(o.tokens for o in outs) / s_wall[engine],
                        direct_tokens_per_s=sum(o.tokens for o in direct) / d_wall,
                        latency_ms=1e3 * lat_s,
                        direct_latency_ms=1e3 * lat_d,
                        overhead_ms=1e3 * (lat_s - lat_d),
                        overhead_pct=100 * (lat_s - lat_d) / lat_s,
                        lagged_latency_ms=1e3 * lat_l,
                        server_cost_ms=1e3 * (lat_s - lat_l),
                        server_cost_pct=100 * (lat_s - lat_l) / lat_s,
                        mismatched=bad,
                    )
                )
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
    finally:
        for proc, _url in servers.values():
            proc.terminate()
            proc.wait(60)
    print("\n| concurrency | engine | req/s (direct) | TTFB p50 / p99 ms | tokens/s (direct) "
          "| latency ms (direct; direct+1) | overhead ms (%) | server's own cost: vs direct+1, ms (%) | lost/dup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['engine']} | {r['req_per_s']:.2f} ({r['direct_req_per_s']:.2f}) | "
            f"{r['ttfb_p50_ms']:.0f} / {r['ttfb_p99_ms']:.0f} | "
            f"{r['tokens_per_s']:.1f} ({r['direct_tokens_per_s']:.1f}) "
            f"| {r['latency_ms']:.0f} ({r['direct_latency_ms']:.0f}; {r['lagged_latency_ms']:.0f}) | "
            f"{r['overhead_ms']:+.0f} ({r['overhead_pct']:+.1f} %) "
            f"| {r['server_cost_ms']:+.0f} ({r['server_cost_pct']:+.1f} %) "
            f"| {r['mismatched']} |"
        )
    if any(r["mismatched"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

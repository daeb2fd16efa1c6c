"""A real `clover-export serve` process under mixed traffic for a set time, sampled, judged (SERVING.md 1-5).

    python bench/soak.py                          # 60 minutes, a sample every 30 s
    python bench/soak.py --minutes 10 --sample-s 15
    python bench/soak.py --minutes 1 --sample-s 3 --clients 3      # test-sized (tests/project/test_soak.py)
    python bench/soak.py --minutes 10 --engine thread              # the engine on a thread of the server

The server listens on 127.0.0.1 only and every request goes there; the request loops stop at the
deadline or after `--max-requests`, whichever comes first; a request still running `--grace-s` after the
deadline is cancelled and counted as an error. `--clients` closed-loop clients (each sends
its next request when the previous one ends) draw from a fixed-seed mix:
- completions and chat completions, streamed and not, in every decoding mode (`decoding`:
  low_confidence, ar, self_spec, as the extra body field);
- chats that share one of a few system prompts, and multi-turn chats that resend the conversation so far
  (the prefix cache resumes them);
- streams the client cancels after the first chunk (closing the connection);
- hostile bodies: malformed JSON (400), an oversize body (413), a bad field (400). Their statuses are the
  deliberate errors; any other non-200 status, or a transport error, is an error;
- the API agents send: `response_format` json_schema (the answer must parse and validate unless cut by
  `max_tokens`), tools with a forced or automatic `tool_choice` (a forced call must come back as a call
  whose arguments validate), `logprobs` with `n` 2 (one logprob per token of each choice), and the
  Anthropic Messages and OpenAI Responses doors. An answer that breaks its promise is an error
  (`invalid: why`).

Every `--sample-s` seconds: the server's RSS (/proc/PID/status VmRSS, summed over the server process and its
children: the engine runs in a process of its own); from /metrics (parsed with
prometheus_client's text parser) the rows holding a slot, the requests waiting, the prefix cache's
snapshot and parked bytes and its budget, the requests answered by status; from the clients, the
latency p50/p99 of the generation requests that ended since the last sample, and the errors.

Pass criteria (exit status 1 when one fails), windows scaled to the run (W = a sixth of it, 10 minutes
of 60, but at least MIN_WINDOW_S where the run after its warm-up has room for two: a p99 needs a few hundred
requests to stand for the tail rather than for the two slowest requests; warm-up = `--warmup-frac` of it):
- RSS: the mean of the last W's samples within 5 % of the mean of the first W after the warm-up;
- slots in use and waiting requests back to 0 once the traffic stops;
- prefix-cache snapshot bytes within the budget at every sample;
- no error except the deliberate ones (client side; and no 5xx on the server's own counter);
- p99 latency of the generation requests of the last W within 1.5x of the first W after the warm-up.
Results: bench/results/soak_<date>_<minutes>min.{md,json,png} (the plot needs matplotlib; without it
the run says so and writes the numbers only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from clover_export.serve.engine import ENGINES
from clover_export.testing import server

MODES = ("low_confidence", "ar", "self_spec")
SYSTEMS = ("You are a careful assistant. Answer with the result only.",
           "You sort and reverse lists of digits. Keep answers short.",
           "Reply in one line.")
QUESTIONS = ("Sort: 5 3 7", "Reverse: 2 8 2 7 9", "Sort: 0 9 1 7 5 4", "What is 2 + 3?", "Reverse: 1 2 3",
             "Sort: 6 8 9 1", "Hi", "Tell me a story")
# scenario -> weight; each is one client-side coroutine below
MIX = {"completion": 3, "completion_stream": 3, "chat": 3, "chat_stream": 3, "multi_turn": 2, "cancel_stream": 1,
       "json_schema": 1, "tool_call": 1, "logprobs_n": 1, "messages_door": 0.5, "responses_door": 0.5,
       "malformed_json": 0.3, "oversize": 0.3, "bad_field": 0.4}
DELIBERATE = {"malformed_json": 400, "oversize": 413, "bad_field": 400}
# bounded, so that a weak model's answer ends well inside STRUCTURED_MAX_TOKENS
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "sorted": {"type": "boolean"}}, "required": ["answer", "sorted"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "sort_digits", "parameters": {
    "type": "object", "properties": {"digits": {"type": "string", "maxLength": 12}}, "required": ["digits"]}}}]
STRUCTURED_MAX_TOKENS = 120


@dataclass
class Options:
    minutes: float = 60.0
    sample_s: float = 30.0
    clients: int = 4
    model: str | None = None
    backend: str | None = None
    engine: str = "process"  # the server's --engine
    max_batch: int = 8
    max_tokens: int = 48
    max_body_bytes: int = 64 << 10
    warmup_frac: float = 0.1
    max_requests: int = 1_000_000
    grace_s: float = 60.0  # after the deadline, for the requests in flight to end
    rss_growth: float = 0.05
    p99_ratio: float = 1.5
    seed: int = 0
    out: str | None = None  # results stem; None: bench/results/soak_<date>_<minutes>min
    plot: bool = True


@dataclass
class Outcome:
    scenario: str
    start: float
    end: float
    status: int | str  # HTTP status, or the transport error's type name
    ok: bool  # the status this scenario expects

    @property
    def generation(self) -> bool:
        return self.scenario not in DELIBERATE and self.scenario != "cancel_stream"


@dataclass
class Sample:
    t: float  # seconds since the traffic started
    rss_mb: float
    heap_in_use_mb: float  # the server's C heap (clover_heap_bytes; 0 without glibc): held by live allocations
    heap_free_mb: float  # ... and kept free by the allocator (fragmentation when it grows with RSS)
    running: float
    waiting: float
    snapshot_bytes: float
    parked_bytes: float
    budget_bytes: float
    server_5xx: float
    requests: int  # client-side, ended since the start
    errors: int  # client-side unexpected outcomes since the start
    p50_ms: float | None
    p99_ms: float | None


@dataclass
class Report:
    options: dict
    samples: list[Sample] = field(default_factory=list)
    drained: Sample | None = None
    counts: dict = field(default_factory=dict)
    criteria: dict = field(default_factory=dict)  # name -> (passed, detail)

    @property
    def passed(self) -> bool:
        return all(ok for ok, _ in self.criteria.values())


# --- the server -------------------------------------------------------------------------------------------
def start_server(o: Options, log_path: Path) -> tuple[subprocess.Popen, str]:
    args = [*([o.model] if o.model else []), "--host", "127.0.0.1", "--max-batch", str(o.max_batch),
            "--max-body-bytes", str(o.max_body_bytes), "--log-level", "warning", "--engine", o.engine,
            *(["--backend", o.backend] if o.backend else [])]
    return server.start_server(*args, timeout=300, log=log_path,
                               env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def rss_mb(pid: int) -> float:
    """The resident memory of process `pid` and its descendants (the server and its engine process)."""
    total = 0.0
    for p in [pid, *server.descendants(pid)]:
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:  # ended meanwhile
            continue
        total += next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), 0.0)
    return total or float("nan")


def server_figures(url: str) -> dict[str, float]:
    """The server's own gauges and counters from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {"server_5xx": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "clover_running_rows":
                out["running"] = s.value
            elif s.name == "clover_queue_depth":
                out["waiting"] = s.value
            elif s.name == "clover_prefix_cache_bytes":
                out[f"{s.labels['kind']}_bytes"] = s.value
            elif s.name == "clover_prefix_cache_budget_bytes":
                out["budget_bytes"] = s.value
            elif s.name == "clover_heap_bytes":
                out[f"heap_{s.labels['state']}_mb"] = s.value / 2**20
            elif s.name == "clover_requests_total" and s.labels.get("status", "").startswith("5"):
                out["server_5xx"] += s.value
    return out


# --- the traffic ------------------------------------------------------------------------------------------
class Traffic:
    """Closed-loop clients drawing scenarios from MIX until `stop_at` or `max_requests` outcomes."""

    def __init__(self, url: str, o: Options):
        self.url, self.o = url, o
        self.outcomes: list[Outcome] = []
        self.started = 0
        self.model_name: str | None = None

    def body(self, rng: random.Random, chat: bool, stream: bool, messages=None) -> dict:
        common = {"max_tokens": rng.choice([8, 16, self.o.max_tokens]), "temperature": 0, "stream": stream,
                  "decoding": rng.choice(MODES)}
        if not chat:
            return {"prompt": rng.choice(QUESTIONS), **common}
        messages = messages or [{"role": "system", "content": rng.choice(SYSTEMS)},
                                {"role": "user", "content": rng.choice(QUESTIONS)}]
        return {"messages": messages, **common}

    async def post(self, client, chat: bool, body) -> tuple[int, dict | None]:
        """A non-streamed request: (status, its JSON or None)."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
            {"json": body}
        r = await client.post(self.url + path, **kw)
        return r.status_code, (r.json() if r.status_code == 200 else None)

    async def stream(self, client, chat: bool, body: dict, cancel: bool) -> int:
        """A streamed request read to `[DONE]` (an error chunk fails it), or closed after the first chunk."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with client.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                return r.status_code
            async for line in r.aiter_lines():
                if cancel and line.startswith("data: "):
                    return 200  # leaving the block closes the connection: the server cancels the row
                if line.startswith("data: ") and '"error"' in line:
                    return 500
                if line == "data: [DONE]":
                    return 200
        return 599  # the stream ended without [DONE]

    async def scenario(self, client, rng: random.Random, name: str) -> int:
        if name in ("completion", "chat"):
            return (await self.post(client, name == "chat", self.body(rng, name == "chat", False)))[0]
        if name in ("completion_stream", "chat_stream", "cancel_stream"):
            chat = name != "completion_stream"
            return await self.stream(client, chat, self.body(rng, chat, True), cancel=name == "cancel_stream")
        if name == "multi_turn":
            body = self.body(rng, True, False)
            for _ in range(rng.randint(2, 3)):
                status, answer = await self.post(client, True, body)
                if status != 200:
                    return status
                body["messages"] += [answer["choices"][0]["message"] | {"role": "assistant"},
                                     {"role": "user", "content": rng.choice(QUESTIONS)}]
                body["messages"][-2].pop("reasoning_content", None)
            return 200
        if name in AGENT_SCENARIOS:
            return await AGENT_SCENARIOS[name](self, client, rng)
        if name == "malformed_json":
            return (await self.post(client, True, b'{"messages": [{"role": "user", "content": "hi"}'))[0]
        if name == "oversize":
            return (await self.post(client, False, {"prompt": "x" * (self.o.max_body_bytes + 1)}))[0]
        body = self.body(rng, False, False) | rng.choice([{"temperature": "hot"}, {"max_tokens": -3},
                                                          {"decoding": "fastest"}, {"top_p": 7}])
        return (await self.post(client, False, body))[0]

    async def json_schema(self, client, rng: random.Random) -> int | str:
        body = self.body(rng, True, False) | {"max_tokens": STRUCTURED_MAX_TOKENS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}
        status, done = await self.post(client, True, body)
        if status != 200 or done["choices"][0]["finish_reason"] == "length":
            return status
        try:
            answer = json.loads(done["choices"][0]["message"]["content"])
        except json.JSONDecodeError:
            return "invalid: not JSON"
        ok = (isinstance(answer, dict) and set(answer) == {"answer", "sorted"} and type(answer["answer"]) is int
              and 0 <= answer["answer"] <= 999 and isinstance(answer["sorted"], bool))
        return 200 if ok else "invalid: against the schema"

    async def tool_call(self, client, rng: random.Random) -> int | str:
        choice = rng.choice(["required", {"type": "function", "function": {"name": "sort_digits"}}, "auto"])
        body = self.body(rng, True, False) | {"max_tokens": STRUCTURED_MAX_TOKENS, "tools": TOOLS,
                                               "tool_choice": choice, "parallel_tool_calls": False}
        status, done = await self.post(client, True, body)
        if status != 200 or choice == "auto" or done["choices"][0]["finish_reason"] == "length":
            return status
        calls = done["choices"][0]["message"].get("tool_calls") or []
        if done["choices"][0]["finish_reason"] != "tool_calls" or len(calls) != 1:
            return "invalid: a forced call did not come back as one call"
        try:
            args = json.loads(calls[0]["function"]["arguments"])
        except json.JSONDecodeError:
            return "invalid: arguments not JSON"
        ok = calls[0]["function"]["name"] == "sort_digits" and isinstance(args.get("digits"), str)
        return 200 if ok else "invalid: arguments against the schema"

    async def logprobs_n(self, client, rng: random.Random) -> int | str:
        body = self.body(rng, True, False) | {"logprobs": True, "top_logprobs": 2, "n": 2}
        status, done = await self.post(client, True, body)
        if status != 200:
            return status
        if len(done["choices"]) != 2:
            return "invalid: n choices"
        contents = [(c.get("logprobs") or {}).get("content") for c in done["choices"]]
        if any(not content or any(len(t["top_logprobs"]) != 2 or t["logprob"] > 0 for t in content)
               for content in contents):
            return "invalid: logprobs"
        if sum(map(len, contents)) != done["usage"]["completion_tokens"]:  # one per token of each choice
            return "invalid: logprobs not one per token"
        return 200

    async def model(self, client) -> str:
        """The served model's name (the doors require it): /v1/models, asked once."""
        if self.model_name is None:
            self.model_name = (await client.get(self.url + "/v1/models")).json()["data"][0]["id"]
        return self.model_name

    async def messages_door(self, client, rng: random.Random) -> int | str:
        body = {"model": await self.model(client), "max_tokens": rng.choice([8, 16]), "messages": [
            {"role": "user", "content": rng.choice(QUESTIONS)}], "system": rng.choice(SYSTEMS)}
        r = await client.post(self.url + "/v1/messages", json=body)
        if r.status_code == 200 and r.json().get("type") != "message":
            return "invalid: not a message"
        return r.status_code

    async def responses_door(self, client, rng: random.Random) -> int | str:
        body = {"model": await self.model(client), "max_output_tokens": rng.choice([8, 16]),
                "input": rng.choice(QUESTIONS), "instructions": rng.choice(SYSTEMS)}
        r = await client.post(self.url + "/v1/responses", json=body)
        if r.status_code == 200 and r.json().get("object") != "response":
            return "invalid: not a response"
        return r.status_code

    async def client(self, i: int, stop_at: float) -> None:
        rng = random.Random(self.o.seed * 1000 + i)
        names, weights = list(MIX), list(MIX.values())
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < stop_at and self.started < self.o.max_requests:
                self.started += 1
                name = rng.choices(names, weights)[0]
                t0 = time.monotonic()
                try:
                    status = await self.scenario(client, rng, name)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                except asyncio.CancelledError:  # still running `grace_s` after the deadline
                    self.outcomes.append(Outcome(name, t0, time.monotonic(), "unfinished", False))
                    raise
                expected = DELIBERATE.get(name, 200)
                self.outcomes.append(Outcome(name, t0, time.monotonic(), status, status == expected))

    async def run(self, stop_at: float) -> None:
        """Until `stop_at`; requests still running `grace_s` later are cancelled (each an error)."""
        clients = asyncio.gather(*(self.client(i, stop_at) for i in range(self.o.clients)))
        try:
            await asyncio.wait_for(clients, stop_at + self.o.grace_s - time.monotonic())
        except asyncio.TimeoutError:
            pass


AGENT_SCENARIOS = {"json_schema": Traffic.json_schema, "tool_call": Traffic.tool_call, "logprobs_n": Traffic.logprobs_n,
                   "messages_door": Traffic.messages_door, "responses_door": Traffic.responses_door}


# --- sampling and judging ----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def latencies(outcomes: list[Outcome], t0: float, t1: float) -> list[float]:
    """Seconds of the generation requests that ended successfully in [t0, t1)."""
    return [o.end - o.start for o in outcomes if o.generation and o.ok and t0 <= o.end < t1]


def sample(proc, url: str, traffic: Traffic, t0: float, since: float) -> Sample:
    now = time.monotonic()
    f = server_figures(url)
    lat = latencies(traffic.outcomes, since, now)
    return Sample(t=now - t0, rss_mb=rss_mb(proc.pid), heap_in_use_mb=f.get("heap_in_use_mb", 0.0),
                  heap_free_mb=f.get("heap_free_mb", 0.0), running=f.get("running", 0), waiting=f.get("waiting", 0),
                  snapshot_bytes=f.get("snapshots_bytes", 0), parked_bytes=f.get("parked_bytes", 0),
                  budget_bytes=f.get("budget_bytes", 0), server_5xx=f["server_5xx"],
                  requests=len(traffic.outcomes), errors=sum(not o.ok for o in traffic.outcomes),
                  p50_ms=1e3 * pct(lat, 50) if lat else None, p99_ms=1e3 * pct(lat, 99) if lat else None)


async def sampler(proc, url, traffic: Traffic, o: Options, t0: float, stop_at: float, out: list[Sample]) -> None:
    since = t0
    while time.monotonic() < stop_at:
        await asyncio.sleep(min(o.sample_s, max(0.0, stop_at - time.monotonic())))
        out.append(await asyncio.to_thread(sample, proc, url, traffic, t0, since))
        since = time.monotonic()
        s = out[-1]
        print(f"t={s.t:7.1f}s rss={s.rss_mb:7.1f}MB heap={s.heap_in_use_mb:.1f}+{s.heap_free_mb:.1f}free "
              f"running={s.running:.0f} waiting={s.waiting:.0f} "
              f"cache={s.snapshot_bytes / 2**20:.1f}+{s.parked_bytes / 2**20:.1f}MiB requests={s.requests} "
              f"errors={s.errors} p50/p99={s.p50_ms or 0:.0f}/{s.p99_ms or 0:.0f}ms", flush=True)


def drained(proc, url: str, traffic: Traffic, t0: float, timeout: float = 60) -> Sample:
    """After the traffic stops: the first sample with no row running and none waiting (or the last one)."""
    end = time.monotonic() + timeout
    while True:
        s = sample(proc, url, traffic, t0, time.monotonic())
        if (s.running == 0 and s.waiting == 0) or time.monotonic() > end:
            return s
        time.sleep(0.5)


MIN_WINDOW_S = 20.0  # a test-sized run's windows: 10 s of 3 clients held ~150 requests, its p99 the 2nd slowest


def judge(rep: Report, traffic: Traffic, o: Options, duration: float) -> dict:
    warm = duration * o.warmup_frac
    window = max(duration / 6, min(MIN_WINDOW_S, (duration - warm) / 2))
    after = [s for s in rep.samples if s.t > warm]
    first = [s for s in after if s.t <= warm + window] or after[:1]
    last = [s for s in after if s.t > duration - window] or after[-1:]
    c = {}
    if first and last:
        base, end = statistics.mean(s.rss_mb for s in first), statistics.mean(s.rss_mb for s in last)
        heap = {k: (statistics.mean(getattr(s, k) for s in first), statistics.mean(getattr(s, k) for s in last))
                for k in ("heap_in_use_mb", "heap_free_mb")}
        c["rss"] = (end <= base * (1 + o.rss_growth), f"{base:.1f} MB after warm-up -> {end:.1f} MB in the last "
                    f"window ({100 * (end / base - 1):+.1f} %, limit {100 * o.rss_growth:.0f} %); C heap in use "
                    f"{heap['heap_in_use_mb'][0]:.1f} -> {heap['heap_in_use_mb'][1]:.1f} MB, kept free "
                    f"{heap['heap_free_mb'][0]:.1f} -> {heap['heap_free_mb'][1]:.1f} MB")
    else:
        c["rss"] = (False, "too few samples")
    d = rep.drained
    c["drained"] = (d.running == 0 and d.waiting == 0, f"{d.running:.0f} rows running, {d.waiting:.0f} waiting "
                    "after the traffic stopped")
    over = [s for s in rep.samples + [d] if s.snapshot_bytes > s.budget_bytes]
    peak = max(s.snapshot_bytes for s in rep.samples + [d])
    c["cache_budget"] = (not over, f"snapshots peak {peak / 2**20:.1f} MiB, budget {d.budget_bytes / 2**20:.1f} MiB, "
                         f"{len(over)} sample(s) over")
    unexpected = [o_ for o_ in traffic.outcomes if not o_.ok]
    kinds = sorted({f"{o_.scenario}:{o_.status}" for o_ in unexpected})
    c["errors"] = (not unexpected and d.server_5xx == 0, f"{len(unexpected)} unexpected outcome(s) {kinds[:6]}, "
                   f"{d.server_5xx:.0f} server 5xx")
    t0 = min((x.start for x in traffic.outcomes), default=0.0)
    p_first = pct(latencies(traffic.outcomes, t0 + warm, t0 + warm + window), 99)
    p_last = pct(latencies(traffic.outcomes, t0 + duration - window, t0 + duration + 3600), 99)
    if p_first and p_last:
        c["p99"] = (p_last <= o.p99_ratio * p_first, f"first window {1e3 * p_first:.0f} ms, last window "
                    f"{1e3 * p_last:.0f} ms ({p_last / p_first:.2f}x, limit {o.p99_ratio}x)")
    else:
        c["p99"] = (False, "no finished generation request in a window")
    return c


def counts(traffic: Traffic) -> dict:
    out: dict[str, dict] = {}
    for o_ in traffic.outcomes:
        row = out.setdefault(o_.scenario, {"n": 0, "unexpected": 0})
        row["n"] += 1
        row["unexpected"] += not o_.ok
    return out


def run(o: Options) -> Report:
    """Start the server, drive it for `o.minutes`, judge; the server is stopped (SIGTERM) whatever happens."""
    stem = results_stem(o)
    stem.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(o, stem.with_suffix(".server.log"))
    rep = Report(options=asdict(o))
    try:
        traffic = Traffic(url, o)
        duration = 60 * o.minutes
        t0 = time.monotonic()

        async def both():
            await asyncio.gather(traffic.run(t0 + duration), sampler(proc, url, traffic, o, t0, t0 + duration,
                                                                       rep.samples))

        asyncio.run(both())
        rep.drained = drained(proc, url, traffic, t0)
        rep.counts = counts(traffic)
        rep.criteria = judge(rep, traffic, o, duration)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = stem.with_suffix(".server.log")
    if log.exists() and not log.stat().st_size:
        log.unlink()  # a quiet server (warnings and worse only)
    write(rep, stem, o)
    return rep


# --- results ----------------------------------------------------------------------------------------------
def results_stem(o: Options) -> Path:
    if o.out:
        return Path(o.out)
    return Path(__file__).parent / "results" / f"soak_{time.strftime('%Y-%m-%d')}_{o.minutes:g}min"


def summary(rep: Report) -> str:
    lines = [f"soak: {rep.options['minutes']:g} min, {rep.options['clients']} clients, sample every "
             f"{rep.options['sample_s']:g} s; requests by scenario (unexpected): " +
             ", ".join(f"{k} {v['n']} ({v['unexpected']})" for k, v in sorted(rep.counts.items())), ""]
    for name, (ok, detail) in rep.criteria.items():
        lines.append(f"- {'PASS' if ok else 'FAIL'} {name}: {detail}")
    lines += ["", "| t s | RSS MB | heap in use MB | heap free MB | running | waiting | snapshots MiB | parked MiB "
              "| requests | errors | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rep.samples + ([rep.drained] if rep.drained else []):
        lines.append(f"| {s.t:.0f} | {s.rss_mb:.1f} | {s.heap_in_use_mb:.1f} | {s.heap_free_mb:.1f} | "
                     f"{s.running:.0f} | {s.waiting:.0f} | "
                     f"{s.snapshot_bytes / 2**20:.2f} | {s.parked_bytes / 2**20:.2f} | {s.requests} | {s.errors} | "
                     f"{s.p50_ms or 0:.0f} | {s.p99_ms or 0:.0f} |")
    return "\n".join(lines)


def plot(rep: Report, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib; the bench's only, not a dependency)"
    ss = rep.samples
    t = [s.t / 60 for s in ss]
    fig, ax = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    ax[0].plot(t, [s.rss_mb for s in ss], label="RSS")
    ax[0].plot(t, [s.heap_in_use_mb for s in ss], label="C heap in use")
    ax[0].plot(t, [s.heap_free_mb for s in ss], label="C heap kept free")
    ax[0].set_ylabel("MB")
    ax[0].legend()
    ax[1].plot(t, [s.running for s in ss], label="rows running")
    ax[1].plot(t, [s.waiting for s in ss], label="waiting")
    ax[1].legend()
    ax[2].plot(t, [s.snapshot_bytes / 2**20 for s in ss], label="snapshots")
    ax[2].plot(t, [s.parked_bytes / 2**20 for s in ss], label="parked")
    ax[2].set_ylabel("prefix cache MiB")
    ax[2].legend()
    ax[3].plot(t, [s.p50_ms or float("nan") for s in ss], label="p50")
    ax[3].plot(t, [s.p99_ms or float("nan") for s in ss], label="p99")
    ax[3].set_ylabel("latency ms")
    ax[3].set_xlabel("minutes")
    ax[3].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot: {path.name}"


def write(rep: Report, stem: Path, o: Options) -> None:
    if rep.drained is None:
        return
    text = summary(rep)
    note = plot(rep, stem.with_suffix(".png")) if o.plot else "no plot (--no-plot)"
    stem.with_suffix(".md").write_text(f"{time.strftime('%Y-%m-%d %H:%M')}, load average "
                                       f"{os.getloadavg()[0]:.1f}; {note}\n\n{text}\n")
    stem.with_suffix(".json").write_text(json.dumps(asdict(rep), indent=1))
    print(f"\n{text}\n\n{note}\nwritten: {stem}.md, {stem}.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    d = Options()
    ap.add_argument("--minutes", type=float, default=d.minutes)
    ap.add_argument("--sample-s", type=float, default=d.sample_s)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--engine", default=d.engine, choices=ENGINES,
                    help="the server's --engine: the engine in its own process, or on a thread of the server's")
    ap.add_argument("--max-batch", type=int, default=d.max_batch)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--max-requests", type=int, default=d.max_requests)
    ap.add_argument("--grace-s", type=float, default=d.grace_s)
    ap.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=None, help="results file stem")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    a = ap.parse_args(argv)
    rep = run(Options(**vars(a)))
    return 0 if rep.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

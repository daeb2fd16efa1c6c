"""GPU check of `clover-export serve --backend triton` through the official `openai` client.

A real server process on the embedded default (Triton kernels with CUDA graphs), then, greedy:
- chat in each decoding mode; `ar` and `self_spec` answers equal (both give the causal model's greedy tokens);
- a streamed chat whose text equals the same request unstreamed;
- `logprobs` with `top_logprobs` 3 in `ar` and `self_spec`: one entry per token, each the top-1 (greedy), and
  the two modes' values within 1e-3;
- `n` 2; a `json_schema` answer that parses and holds its required key; `tool_choice` "required": a call
  whose arguments parse;
- 8 concurrent requests per mode: tokens/s through the server.
Prints PASS/FAIL and BENCH lines; exit 1 on any FAIL.

    python gpu_checks/serve_triton_gpu.py [--device cuda] [--dtype fp32|bf16]
    TRITON_INTERPRET=1 python gpu_checks/serve_triton_gpu.py --device cpu --no-load   # CPU rehearsal (slow)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from clover_export.testing.server import start_server, stop_server

MODES = ("low_confidence", "ar", "self_spec")
QUESTION = [{"role": "user", "content": "Sort: 3 1 2 9 4"}]
PROMPTS = ["Sort: 3 1 2 9 4", "Reverse: 5 6 7 1 2 8 9", "Sort: 9 8 7 6 5 4 3 2 1 0 5 5", "Reverse: 1 2",
           "Sort: 4 4 1", "Reverse: 9 0 9 1", "What is 2 + 3?", "Sort: 7 2"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "sort_digits", "description": "Sort digits ascending.",
        "parameters": {"type": "object", "properties": {"digits": {"type": "string"}}, "required": ["digits"]}}}


class Checks:
    def __init__(self) -> None:
        self.fails = 0

    def check(self, ok: bool, what: str) -> None:
        self.fails += not ok
        print(f"{'PASS' if ok else 'FAIL'} serve triton: {what}", flush=True)

    def run(self, label: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (every check runs; one failure is one FAIL line)
            self.check(False, f"{label}: {type(e).__name__}: {e}")


def chat(client: openai.OpenAI, model: str, mode: str, **kw):
    return client.chat.completions.create(model=model, messages=kw.pop("messages", QUESTION),
                                          max_tokens=kw.pop("max_tokens", 48), temperature=0,
                                          extra_body={"decoding": mode}, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--log", type=Path, default=Path("/tmp/serve_triton_gpu.log"))
    ap.add_argument("--no-load", action="store_true", help="skip the timed concurrent requests (CPU rehearsal)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    proc, url = start_server("--backend", "triton", "--device", args.device, "--dtype", args.dtype,
                             "--max-batch", "8", "--log-level", "warning", timeout=400, log=args.log)
    print(f"BENCH serve triton: up in {time.perf_counter() - t0:.1f} s", flush=True)
    c = Checks()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id
        texts = {}

        def modes():
            for mode in MODES:
                out = chat(client, model, mode)
                texts[mode] = out.choices[0].message.content
                c.check(bool(texts[mode]) and out.usage.completion_tokens > 0,
                        f"{mode}: {out.usage.completion_tokens} tokens, {texts[mode]!r}")
            c.check(texts["ar"] == texts["self_spec"], "ar and self_spec answers equal")

        def stream():
            chunks = chat(client, model, "self_spec", stream=True)
            parts = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
            c.check("".join(parts) == texts.get("self_spec"), f"streamed self_spec text equals unstreamed "
                    f"({len(parts)} chunks)")

        def logprobs():
            got = {}
            for mode in ("ar", "self_spec"):
                out = chat(client, model, mode, logprobs=True, top_logprobs=3)
                entries = out.choices[0].logprobs.content
                top1 = all(e.top_logprobs and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 for e in entries)
                c.check(len(entries) == out.usage.completion_tokens and top1,
                        f"{mode} logprobs: {len(entries)} entries, each the top-1")
                got[mode] = [e.logprob for e in entries]
            diff = max((abs(a - b) for a, b in zip(got["ar"], got["self_spec"])), default=0.0)
            c.check(len(got["ar"]) == len(got["self_spec"]) and diff < 1e-3,
                    f"ar and self_spec logprobs within 1e-3 (max diff {diff:.2e})")

        def n2():
            out = chat(client, model, "ar", n=2, max_tokens=16)
            c.check(len(out.choices) == 2 and all(ch.message.content for ch in out.choices), "n 2: two choices")

        def schema():
            out = chat(client, model, "self_spec", max_tokens=64, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
            ch = out.choices[0]
            ok = ch.finish_reason == "length" or isinstance(json.loads(ch.message.content).get("answer"), str)
            c.check(ok, f"json_schema answer {ch.message.content!r} ({ch.finish_reason})")

        def tools():
            out = chat(client, model, "ar", max_tokens=64, tools=[TOOL], tool_choice="required")
            calls = out.choices[0].message.tool_calls or []
            ok = bool(calls) and all(isinstance(json.loads(t.function.arguments), dict) for t in calls)
            c.check(ok, f"tool_choice required: {[(t.function.name, t.function.arguments) for t in calls]}")

        def load():
            for mode in MODES:
                def one(p, mode=mode):
                    out = client.completions.create(model=model, prompt=p, max_tokens=64, temperature=0,
                                                    extra_body={"decoding": mode, "ignore_eos": True})
                    return out.usage.completion_tokens
                t = time.perf_counter()
                with ThreadPoolExecutor(8) as pool:
                    tokens = sum(pool.map(one, PROMPTS))
                dt = time.perf_counter() - t
                print(f"BENCH serve triton {mode}: 8 concurrent, {tokens} tokens in {dt:.2f} s = "
                      f"{tokens / dt:.0f} tokens/s", flush=True)

        for label, fn in (("modes", modes), ("stream", stream), ("logprobs", logprobs), ("n", n2),
                          ("json_schema", schema), ("tools", tools), ("load", load)):
            if not (label == "load" and args.no_load):
                c.run(label, fn)
    finally:
        out = stop_server(proc, args.log)
    c.check(proc.returncode == 0, f"server exited {proc.returncode} on SIGTERM")
    if c.fails:
        print(out[-3000:], flush=True)
    return 1 if c.fails else 0


if __name__ == "__main__":
    sys.exit(main())

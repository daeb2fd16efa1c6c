"""Decoding benchmark of the embedded default: accuracy vs parallelism (DECODING.md 2, MODEL.md 5.3).

    python bench/decoding.py                      # torch + ort, 200 held-out prompts
    python bench/decoding.py --backends torch --count 64

For LowConfidence thresholds 0.5 / 0.7 / 0.9 / 0.95 / 1.0 (1.0 = the
one-token-per-step baseline) and expert-coreset top_p 0.9 / 1.0, on the
held-out task prompts (clover_export.train.tasks, never trained on), prints
accuracy (exact answer), tokens per forward (response tokens incl. the end
token / denoise forwards), forwards per block and distinct experts per block
(mean |kept set| over layers and steps), for each backend. Decoding is greedy
with the shipped generation_config (penalties neutral). Then the
autoregressive mode: greedy next-token decoding from the last causal row,
one token per forward, by the plain loop of `clover_export.train.evaluate`
(`score_ar`: the fp32 reference model, no runtime, no generation controls),
and, when the runtime is installed, its decoding="ar" and "self_spec" modes
(torch backend: accuracy, tokens per forward, draft tokens accepted per
verifying forward).
The last line reads `tpf@0.95=X acc@0.95=Y acc@1.0=Z acc_ar=W` for the first
backend at the model's own coreset top_p.

Backends run through `clover_export.runtime.Generator` when the runtime is
installed; `--evaluator` (or a runtime without the backend) uses the training
evaluator `clover_export.train.evaluate` instead (torch only), and says so.
The ort backend needs an exported artifact; it is exported once per top_p
into a temporary folder, or skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from clover_export.model.loading import resolve_model_dir
from clover_export.train import tasks
from clover_export.train.data import ChatCodec

THRESHOLDS = (0.5, 0.7, 0.9, 0.95, 1.0)
TOP_PS = (0.9, 1.0)


def with_top_p(model_dir: Path, top_p: float, work: Path) -> Path:
    """A copy of the model folder whose config sets moe_block_coreset_top_p (weights hard-linked when possible)."""
    out = work / f"model-top_p{top_p}"
    if out.exists():
        return out
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            try:
                (out / f.name).hardlink_to(f)
            except OSError:
                shutil.copyfile(f, out / f.name)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["moe_block_coreset_top_p"] = top_p
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def runtime_available(backend: str) -> str | None:
    """None when the runtime can drive `backend`, else the reason it cannot."""
    try:
        from clover_export.runtime.generator import Generator  # noqa: F401
    except ImportError as e:
        return f"clover_export.runtime not available ({e})"
    try:
        __import__(f"clover_export.backends.{backend}_backend")
    except ImportError as e:
        return f"runtime backend {backend!r} not available ({e})"
    return None


def export_for_ort(model_dir: Path, out: Path, slots: int) -> Path:
    """Export an fp32 step graph (ONNX Runtime on CPU) with the project's exporter."""
    from clover_export.exporter.export import export

    return export(model_dir, out, dtype="fp32", weights="copy", max_batch=slots).dir


class RuntimeRunner:
    label = "runtime"

    def __init__(self, backend: str, source: Path, slots: int):
        from clover_export.runtime.generator import Generator

        self.gen = Generator.load(source, backend=backend, max_slots=slots)

    def run(self, examples, threshold, thinking):
        res = self.gen.generate_batch([ex.prompt for ex in examples], threshold=threshold,
                                      enable_thinking=thinking, max_new_tokens=32)
        return [(r.text, len(r.token_ids), r.denoise_steps, r.blocks, r.distinct_experts_per_block) for r in res]


class EvaluatorRunner:
    label = "train.evaluate"

    def __init__(self, source: Path, slots: int):
        from clover_export.train.evaluate import load_for_eval

        self.model, self.codec, self.slots = load_for_eval(source), ChatCodec(source), slots

    def run(self, examples, threshold, thinking):
        from clover_export.train.evaluate import generate

        end_ids = [self.codec.im_end, self.codec.eot]
        rows = []
        for s in range(0, len(examples), self.slots):
            chunk = examples[s:s + self.slots]
            outs = generate(self.model, [self.codec.prompt_ids(ex.prompt, thinking) for ex in chunk],
                            threshold, end_ids, max_new_tokens=32)
            for d in outs:
                text = self.codec.tokenizer.decode([t for t in d.token_ids if t not in end_ids])
                rows.append((text, len(d.token_ids), d.steps, d.blocks, d.experts_per_block))
        return rows


def measure(runner, examples, threshold, thinking) -> dict:
    start = time.perf_counter()
    rows = runner.run(examples, threshold, thinking)
    ok = [tasks.is_correct(ex, text) for ex, (text, *_rest) in zip(examples, rows)]
    tokens, steps, blocks = (sum(r[i] for r in rows) for i in (1, 2, 3))
    return {"acc": 100.0 * sum(ok) / len(ok), "tpf": tokens / steps, "fpb": steps / blocks,
            "experts": sum(r[4] for r in rows) / len(rows), "seconds": time.perf_counter() - start}


def measure_ar(model_dir: Path, examples, thinking: bool, slots: int) -> float:
    """Accuracy of greedy next-token decoding (train.evaluate.score_ar, the plain loop); prints its row."""
    from clover_export.train.evaluate import load_for_eval, score_ar

    start = time.perf_counter()
    sc = score_ar(load_for_eval(model_dir), ChatCodec(model_dir), examples, enable_thinking=thinking,
                  batch_size=slots)
    print(f"{'ar (plain loop)':<22} {'-':>5} {'-':>5} {sc.accuracy:>6.1f} {1.0:>8.2f} {'-':>9} {'-':>13} "
          f"{time.perf_counter() - start:>6.1f}", flush=True)
    return sc.accuracy


def measure_lossless(model_dir: Path, examples, thinking: bool, slots: int) -> None:
    """The runtime's lossless modes (torch backend, fp32): decoding="ar" and "self_spec"; prints their rows."""
    from clover_export.runtime.generator import Generator

    gen = Generator.load(model_dir, "torch", dtype="fp32", max_slots=slots)
    for mode in ("ar", "self_spec"):
        start = time.perf_counter()
        res = gen.wait([gen.submit(ex.prompt, decoding=mode, enable_thinking=thinking, max_new_tokens=32)
                        for ex in examples])
        acc = 100.0 * sum(tasks.is_correct(ex, r.text) for ex, r in zip(examples, res)) / len(res)
        tpf = sum(len(r.token_ids) for r in res) / sum(r.forwards for r in res)
        accepted = sum(r.accepted_per_forward for r in res) / len(res)
        print(f"{'runtime ' + mode:<22} {'-':>5} {'-':>5} {acc:>6.1f} {tpf:>8.2f} {'-':>9} {'-':>13} "
              f"{time.perf_counter() - start:>6.1f}  accepted/verifying forward {accepted:.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="tiny", help="model folder (default: the embedded default)")
    ap.add_argument("--backends", default="torch,ort", help="comma-separated: torch, ort")
    ap.add_argument("--count", type=int, default=200, help="held-out prompts (default 200)")
    ap.add_argument("--thinking", action="store_true", help="render prompts with enable_thinking=True")
    ap.add_argument("--slots", type=int, default=50, help="requests stepping together")
    ap.add_argument("--evaluator", action="store_true", help="use clover_export.train.evaluate, not the runtime")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--no-ar", action="store_true", help="skip the autoregressive (next-token) modes")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model)
    own_top_p = json.loads((model_dir / "config.json").read_text()).get("moe_block_coreset_top_p", 0.9)
    examples = tasks.heldout_examples(args.count)
    print(f"model {model_dir} | {len(examples)} held-out prompts ({', '.join(tasks.TASKS)}) | "
          f"enable_thinking={args.thinking} | greedy, penalties from generation_config | {args.threads} thread(s)")
    header = (f"{'backend':<22} {'top_p':>5} {'thr':>5} {'acc%':>6} {'tok/fwd':>8} {'fwd/block':>9} "
              f"{'experts/block':>13} {'s':>6}")
    results: dict[tuple[str, float, float], dict] = {}
    with tempfile.TemporaryDirectory(prefix="clover-bench-") as tmp:
        work = Path(tmp)
        for backend in args.backends.split(","):
            printed_header = False
            for top_p in TOP_PS:
                source = with_top_p(model_dir, top_p, work)
                why = None if not args.evaluator else "--evaluator"
                why = why or runtime_available(backend)
                try:
                    if why is None:
                        if backend == "ort":
                            source = export_for_ort(source, work / f"ort-top_p{top_p}", args.slots)
                        runner = RuntimeRunner(backend, source, args.slots)
                    elif backend == "torch":
                        runner = EvaluatorRunner(source, args.slots)
                    else:
                        print(f"{backend}: skipped: {why}")
                        break
                except Exception as e:  # noqa: BLE001 - a missing piece of another part is reported, not fatal
                    print(f"{backend}: skipped: {type(e).__name__}: {e}")
                    break
                if not printed_header:
                    print(header)
                    printed_header = True
                name = f"{backend} ({runner.label})"
                for thr in THRESHOLDS:
                    m = measure(runner, examples, thr, args.thinking)
                    print(f"{name:<22} {top_p:>5} {thr:>5} {m['acc']:>6.1f} {m['tpf']:>8.2f} {m['fpb']:>9.2f} "
                          f"{m['experts']:>13.2f} {m['seconds']:>6.1f}", flush=True)
                    results[(backend, top_p, thr)] = m
    ar = "" if args.no_ar else f" acc_ar={measure_ar(model_dir, examples, args.thinking, args.slots):.1f}"
    if not args.no_ar and runtime_available("torch") is None:
        measure_lossless(model_dir, examples, args.thinking, args.slots)
    ran = [b for b in args.backends.split(",") if (b, own_top_p, 0.95) in results]
    if not ran:
        print(f"no backend ran at the model's coreset top_p {own_top_p}", file=sys.stderr)
        return 1
    at95, at100 = results[(ran[0], own_top_p, 0.95)], results[(ran[0], own_top_p, 1.0)]
    print(f"tpf@0.95={at95['tpf']:.2f} acc@0.95={at95['acc']:.1f} acc@1.0={at100['acc']:.1f}{ar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

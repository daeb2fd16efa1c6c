"""`clover-export generate` and `clover-export compare` (DECODING.md; golden files in golden.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from clover_export.cli.options import BACKEND_CHOICES, request_options, runtime_options
from clover_export.core.errors import CloverError
from clover_export.runtime.config import RuntimeConfig


def _load(model, runtime: RuntimeConfig):
    from clover_export.runtime import Generator

    return Generator.load(model, config=runtime)


@click.command()
@click.argument("model", required=False)
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Prompt text (chat template applied unless --raw). Repeat for a batch.")
@request_options
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--raw", is_flag=True, help="Tokenise the prompt as is, without the chat template.")
@runtime_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per request instead of streaming text.")
def generate(model, prompts, params, stop, raw, runtime, as_json):
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
    and tokens_per_forward count the kept ids only. The generation options
    are the request parameters of docs/runtime.md (Request parameters).
    """
    if stop:
        params["stop"] = list(stop)
    if any(k in params for k in ("temperature", "top_k", "top_p")):
        params.setdefault("do_sample", True)
    gen = _load(model, dataclasses.replace(runtime, max_slots=max(1, min(len(prompts), 16))))
    if runtime.block_size is not None:
        params["block_size"] = runtime.block_size
    handles = [gen.submit(p, raw=raw, **params) for p in prompts]  # all checked before any compute
    if as_json:
        for res in gen.wait(handles):
            click.echo(json.dumps(_report(res, params.get("decoding") or gen.defaults.decoding)))
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
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
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
    runtime = RuntimeConfig(backend=backend, device=device, dtype="fp32", allow_qwen=allow_qwen, max_slots=1,
                            block_size=g.params.get("block_size"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plain Qwen folder warns about zero-filled Clover tensors
        if g.expected_logits is not None:
            ref = TorchBackend.load(_reference_dir(model), dtype="fp32", device=device, allow_qwen=allow_qwen,
                                    block_size=g.params.get("block_size"))
            compare_logits(g, ref.prompt_logits(g.prompt_ids), report)
        if g.expected_token_ids is not None:
            gen = _load(model, runtime)
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

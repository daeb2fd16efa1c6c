"""Foundation commands: `info` and `forward`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from clover_export.core.atomic import atomic_write
from clover_export.core.errors import CloverError
from clover_export.core.step_shape import PREFILL_CHUNK

MODEL_ARG = click.argument("model", required=False, default=None)


def human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.2f} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1024
    return f"{n} {unit}"


@click.command()
@MODEL_ARG
@click.option(
    "--context", type=int, default=None, help="Context length for the cache figure (default: the model's max_context)."
)
@click.option("--max-batch", type=int, default=1, show_default=True, help="Cache slots for the engine memory plan.")
@click.option(
    "--gpu-memory",
    type=float,
    default=None,
    help="GPU memory in GiB to judge the plan against (default: this GPU's, if any).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def info(model, context, max_batch, gpu_memory, as_json):
    """Print MODEL's normalised config, parameter counts, weight and cache memory.

    Works on a config-only folder (full-size config.json without weights): nothing is loaded.
    """
    from clover_export.core.config import load_config
    from clover_export.model.loading import has_weights, resolve_model_dir
    from clover_export.model.sizing import cache_bytes, param_counts, weight_bytes

    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    ctx = cfg.max_context if context is None else context
    if ctx < 1:
        raise CloverError("info", f"--context must be >= 1, got {ctx}")
    counts = param_counts(cfg)
    caches = cache_bytes(cfg, ctx)
    report = {
        "model_dir": str(model_dir),
        "has_weights": has_weights(model_dir),
        "config": cfg.to_dict(),
        "config_fingerprint": cfg.fingerprint(),
        "parameters": {"total": counts.total, "active_per_token": counts.active_per_token,
                       "routed_experts": counts.routed_experts},
        "weights_bytes": {"bf16": weight_bytes(cfg, "bf16"), "fp8": weight_bytes(cfg, "fp8")},
        "cache_bytes_per_sequence": {"context": ctx, **caches},
    }
    from clover_export.engines.memory_plan import plan_memory
    from clover_export.pipeline.checks import gpu_memory_bytes
    from clover_export.pipeline.context import BuildOptions

    gpu = gpu_memory_bytes(BuildOptions(gpu_memory_gib=gpu_memory))
    plans = [plan_memory(cfg, p, max_batch, ctx, PREFILL_CHUNK, gpu) for p in ("bf16", "fp8")]
    report["memory_plans"] = [p.to_dict() for p in plans]
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"model: {model_dir}{'' if report['has_weights'] else '  (config only, no weights)'}")
    click.echo(f"type: {cfg.model_type}  fingerprint: {report['config_fingerprint']}")
    for k, v in cfg.to_dict().items():
        if k != "layer_types":
            click.echo(f"  {k}: {v}")
    kinds = "".join("G" if t == "linear_attention" else "A" for t in cfg.layer_types)
    click.echo(f"  layer_types: {kinds}  (G = Gated DeltaNet, A = full attention)")
    click.echo(f"parameters: total {counts.total / 1e9:.3f}B, active per token {counts.active_per_token / 1e9:.3f}B")
    click.echo(f"weights: BF16 {human(report['weights_bytes']['bf16'])}, FP8 {human(report['weights_bytes']['fp8'])}")
    click.echo(f"cache per sequence at {ctx} tokens: {human(caches['total'])} "
               f"(attention K/V {human(caches['attention_kv'])}, GDN states {human(caches['gdn_states'])})")
    for p in plans:  # the same arithmetic `build` refuses a plan with
        click.echo("\n".join(p.lines()))


@click.command()
@MODEL_ARG
@click.option("--input-ids", required=True, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("--mode", type=click.Choice(["causal", "denoise"]), default="causal", show_default=True,
              help="causal: all ids are causal rows; denoise: the ids are one block (T = block_size).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--save", type=click.Path(dir_okay=False), default=None, help="Save the logits [T, V] as float32 .npy.")
@click.option("--allow-qwen", is_flag=True, help="Allow a plain Qwen3.5-MoE checkpoint (Clover tensors zero-filled).")
def forward(model, input_ids, mode, dtype, save, allow_qwen):
    """Run one step of the reference model on empty caches and print the top tokens.

    For checking against other implementations: the saved array is the logits
    [T, V] as float32 for every input position.
    """
    import numpy as np
    import torch

    from clover_export.model.loading import load_model, parse_dtype, resolve_model_dir
    from clover_export.model.model import allocate_pools

    try:
        ids = [int(x) for x in input_ids.replace(" ", "").split(",") if x]
    except ValueError:
        raise CloverError("forward", f"--input-ids must be comma-separated integers, got {input_ids!r}") from None
    if not ids:
        raise CloverError("forward", "--input-ids is empty")
    model_dir = resolve_model_dir(model)
    from clover_export.core.config import load_config

    cfg = load_config(model_dir)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise CloverError("forward", f"token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})")
    if mode == "denoise" and len(ids) != cfg.block_size:
        raise CloverError("forward", f"--mode denoise needs exactly block_size={cfg.block_size} ids, got {len(ids)}")
    save_path = Path(save) if save else None
    if save_path is not None and not save_path.absolute().parent.is_dir():
        raise CloverError("forward", f"--save {save}: folder {save_path.absolute().parent} does not exist")
    block = cfg.block_size if mode == "denoise" else 0
    ref = load_model(model_dir, parse_dtype(dtype), allow_qwen=allow_qwen, block_size=block)
    pools = allocate_pools(cfg, 1, max(len(ids), 1), dtype=ref.dtype)
    T = len(ids)
    inputs = [torch.tensor([ids]), torch.tensor([T - block]), torch.tensor([1 if block else 0]),
              torch.tensor([0]), torch.tensor([0])]
    with torch.no_grad():
        h, _, _ = ref.trunk(*inputs, *pools.values())
        logits = ref.logits(h)[0]
    top = logits.argmax(-1).tolist()
    click.echo(f"logits [{T}, {cfg.vocab_size}] ({mode}, {dtype}); argmax per position: {top}")
    if save_path is not None:
        path = (
            save_path if save_path.suffix == ".npy" else save_path.with_name(save_path.name + ".npy")
        )  # np.save's rule
        try:
            atomic_write(path, lambda f: np.save(f, logits.numpy().astype(np.float32)))
        except OSError as e:
            raise CloverError("forward", f"--save {path}: cannot write ({e.strerror or e})") from None
        click.echo(f"saved {path}")


COMMANDS = [info, forward]

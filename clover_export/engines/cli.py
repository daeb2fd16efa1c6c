"""Engine commands: `doctor` (and `build`, below)."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def doctor(as_json):
    """Say what this machine has (torch/CUDA/GPU, ONNX Runtime, TensorRT, Triton) and what will work."""
    from dataclasses import asdict

    from clover_export.engines.doctor import capabilities, collect, report

    facts = collect()
    if as_json:
        rows = [{"what": w, "works": ok, "why": why} for w, ok, why in capabilities(facts)]
        click.echo(json.dumps({"facts": asdict(facts), "capabilities": rows}, indent=2))
    else:
        click.echo("\n".join(report(facts)))


COMMANDS = [doctor]

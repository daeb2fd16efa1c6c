"""`clover-export`: one click group; each part of the design adds its own commands.

Every user-facing failure is a CloverError, printed as one message without a
traceback (exit 1). Heavy imports happen inside the commands.
"""

from __future__ import annotations

import importlib
import sys

import click

from clover_export.core.errors import CloverError

# modules that define click commands, added to the group when they import
COMMAND_MODULES = [
    "clover_export.cli.model",
    "clover_export.cli.export",
    "clover_export.cli.generate",
    "clover_export.cli.build",
    "clover_export.cli.serve",
]


class OneLineErrors:
    """Mixin for click commands: a CloverError or a usage error is one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CloverError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except click.UsageError as e:  # a bad option value (a file where a folder goes, ...): one line too
            where = f"{e.ctx.command_path} --help" if e.ctx is not None else f"{ctx.command_path} --help"
            click.echo(f"error: [cli] {e.format_message()} (see `{where}`)", err=True)
            sys.exit(1)


class Group(OneLineErrors, click.Group):
    pass


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="clover-export")
def main():
    """Compile Clover-35B-A3B (block-diffusion MoE) into ONNX graphs and TensorRT engines, and run it.

    MODEL is a Hugging Face model folder (config.json + safetensors) or `tiny`,
    the embedded default; leaving MODEL out means `tiny`.
    """


for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(_name)
    except ModuleNotFoundError as _e:
        if _e.name != _name:  # a real missing dependency inside the module
            raise
        continue
    for _cmd in getattr(_mod, "COMMANDS", []):
        main.add_command(_cmd)


"""`clover-export`: one click group; each part of the design adds its own commands.

Every user-facing failure is a CloverError, printed as one message without a
traceback (exit 1). Heavy imports happen inside the commands.

Progress lines: the library reports through `logging` (each module's
`logging.getLogger(__name__)`, INFO for progress) and prints nothing itself;
while a command runs, `printed_logs` prints the `clover_export` loggers' INFO
records on stdout as plain lines and warnings on stderr, as the commands have
always printed them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
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


class EchoHandler(logging.Handler):
    """A record as one plain line: INFO on stdout, warnings and errors on stderr. `click.echo` looks the
    stream up at each record, so a stream swapped after the handler was added (CliRunner, pytest's capture)
    gets the line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(self.format(record), err=record.levelno >= logging.WARNING)
        except Exception:  # a closed stream: logging's own report, not a failed command
            self.handleError(record)


@contextlib.contextmanager
def printed_logs(name: str = "clover_export"):
    """Print the `name` logger tree's INFO records and above while the block runs (`EchoHandler`); the
    logger's level and handlers are restored afterwards (a library caller configures its own)."""
    logger = logging.getLogger(name)
    handler, level = EchoHandler(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def quiet(*names: str):
    """Hold the named loggers to warnings while the block runs: a command that prints one line per stage
    leaves out the progress lines of the library functions its stages call."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class Group(OneLineErrors, click.Group):
    def invoke(self, ctx):
        with printed_logs():
            return super().invoke(ctx)


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


"""Options of the commands that run the model (`generate`, `serve`): the runtime's and the request parameters'.

`runtime_options` adds --backend, --block-size, --dtype, --device, --threads
and hands the command one `runtime` (a RuntimeConfig, runtime/config.py);
`request_options` adds one option per entry of the request parameter table
(`generation.PARAMETERS`, docs/runtime.md) with that entry's help, default
and accepted values, and hands the command one `params` dict (the options
given). A value outside the table's range is a usage error naming the option
and saying what the runtime accepts, before any model loads.
"""

from __future__ import annotations

import functools
from typing import Any

import click

from clover_export.core import generation
from clover_export.core.errors import CloverError
from clover_export.core.generation import Parameter
from clover_export.runtime import decoding  # noqa: F401  (fills the table's decoding modes)
from clover_export.runtime.config import RuntimeConfig

BACKEND_CHOICES = ("torch", "ort", "trt", "triton")  # backends.BACKENDS, without importing torch
BACKEND_HELP = ("Engine to run: torch (reference model), ort (exported artifact; a model folder is exported "
                "into the cache on first use), trt (TensorRT engine), triton (model folder on the Triton "
                "kernels with CUDA graphs; CPU only under TRITON_INTERPRET=1). "
                "Default: ort for an artifact folder (it has manifest.json), triton on a CUDA GPU without "
                "TensorRT, torch otherwise.")
RUNTIME_OPTIONS = (
    click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None, help=BACKEND_HELP),
    click.option("--block-size", type=int, default=None,
                 help="Block size: torch/triton build the model with it; the other backends run the engine's "
                      "(generate: a different one is an error)."),
    click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto",
                 help="torch/triton backend dtype."),
    click.option("--device", default=None, help="torch/triton backend device (default: cuda if available, else cpu)."),
    click.option("--threads", type=click.IntRange(min=1), default=None,
                 help="CPU threads (torch intra-op, or ONNX Runtime intra-op). Default: OMP_NUM_THREADS if set, "
                      "else sized from the work (the embedded default runs on one)."),
)
RUNTIME_NAMES = ("backend", "block_size", "dtype", "device", "threads")


def runtime_options(command):
    """RUNTIME_OPTIONS on `command`, which receives them as one `runtime` RuntimeConfig."""
    @functools.wraps(command)
    def gathered(*args, **kwargs):
        runtime = RuntimeConfig(**{name: kwargs.pop(name) for name in RUNTIME_NAMES})
        return command(*args, runtime=runtime, **kwargs)
    return _with(gathered, RUNTIME_OPTIONS)


class TableValue(click.ParamType):
    """A number of the parameter table: click's INT or FLOAT, then the entry's own check (the runtime's message)."""

    def __init__(self, parameter: Parameter):
        self.parameter = parameter
        self.base = click.INT if parameter.accepts.kind == "int" else click.FLOAT
        self.name = self.base.name

    def convert(self, value, param, ctx):
        number = self.base.convert(value, param, ctx)
        try:
            self.parameter.check(number)
        except CloverError as e:
            self.fail(e.message, param, ctx)
        return number


def parameter_option(p: Parameter):
    """The option of table entry `p`: a flag for a boolean (`--no-...` sets False), the choices of a string, a
    checked number otherwise; its help says the accepted values and the default."""
    fallback = "" if p.default is None else f", else {_shown(p.default)}"
    default = f"default: the model's generation_config.json{fallback}"
    if p.accepts.kind == "bool":
        value = not p.cli.startswith("--no-")
        return click.option(p.cli, p.name, is_flag=True, flag_value=value, default=None,
                            help=f"{p.help}; this flag turns it {_shown(value)} ({default}).")
    kind = click.Choice(p.accepts.values) if p.accepts.kind == "str" else TableValue(p)
    accepted = "" if p.accepts.kind == "str" else f"; {p.accepts.describe()}"
    return click.option(p.cli, p.name, type=kind, default=None, help=f"{p.help}{accepted} ({default}).")


CLI_PARAMETERS = tuple(p for p in generation.PARAMETERS if p.cli)


def request_options(command):
    """One option per CLI_PARAMETERS entry on `command`, which receives the ones given as one `params` dict."""
    @functools.wraps(command)
    def gathered(*args, **kwargs):
        given = {p.name: kwargs.pop(p.name) for p in CLI_PARAMETERS}
        return command(*args, params={k: v for k, v in given.items() if v is not None}, **kwargs)
    return _with(gathered, [parameter_option(p) for p in CLI_PARAMETERS])


def _with(command, options):
    for option in reversed(options):  # the first option on top of --help
        command = option(command)
    return command


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)

"""The shape of the code: no function takes more than MAX_PARAMETERS parameters (read from the source's syntax
tree, nested functions and lambdas included), outside the op cores and kernels and the click commands."""

from __future__ import annotations

import ast
from pathlib import Path

import clover_export

ROOT = Path(clover_export.__file__).parent
MAX_PARAMETERS = 8

# Modules whose signatures mirror an op contract (plugins/contracts.py): the reference cores of the model, the
# Triton kernels with their launch sizes and op entry points, the CUDA ops, the Triton backend's op hooks, and
# the kernel inputs the tests and benchmarks draw at the ops' sizes. A tensor or size of the op is a parameter.
OP_MODULES = {
    "model/attention.py",
    "model/attention_split.py",
    "model/gdn.py",
    "model/moe.py",
    "model/moe_split.py",
    "plugins/cuda_ops.py",
    "plugins/triton/attention.py",
    "plugins/triton/gdn.py",
    "plugins/triton/launch.py",
    "plugins/triton/moe.py",
    "plugins/triton/norms.py",
    "plugins/triton/ops.py",
    "backends/triton_backend.py",
    "testing/kernel_cases.py",
}


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, in_class: bool) -> int:
    """Named parameters a caller can pass: positional and keyword ones (not *args / **kwargs); a method's
    self or cls is not one."""
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    decorators = [ast.unparse(d) for d in getattr(fn, "decorator_list", [])]
    return n - 1 if in_class and n and "staticmethod" not in decorators else n


def is_click_command(fn) -> bool:
    """Decorated with click (a command, or an option / argument of one): its parameters are the command line's."""
    for d in getattr(fn, "decorator_list", []):
        target = ast.unparse(d.func if isinstance(d, ast.Call) else d)
        if target.startswith("click."):
            return True
    return False


def long_signatures(source: str, where: str) -> list[str]:
    """'where:line name (n parameters)' for every function in `source` over MAX_PARAMETERS."""
    tree = ast.parse(source)
    in_class = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or is_click_command(node):
            continue
        n = parameter_count(node, id(node) in in_class)
        if n > MAX_PARAMETERS:
            found.append(f"{where}:{node.lineno} {getattr(node, 'name', 'lambda')} ({n} parameters)")
    return found


def test_no_function_takes_more_than_eight_parameters():
    """Group what belongs together (an options dataclass, a context object) instead of passing it one by one."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in OP_MODULES:
            found += long_signatures(path.read_text(), rel)
    assert not found, "functions over MAX_PARAMETERS parameters:\n  " + "\n  ".join(found)


def test_the_op_modules_exist():
    """An exemption for a module that moved or went away would exempt nothing, silently."""
    assert not [m for m in sorted(OP_MODULES) if not (ROOT / m).exists()]


def test_the_count_and_its_exemptions():
    src = '''
import click

def nine(a, b, c, d, e, f, g, h, i): ...
def eight(a, b, c, d, e, f, g, h, *args, **kwargs): ...
def keywords(a, b, c, d, e, f, g, *, h, i): ...
class C:
    def method(self, a, b, c, d, e, f, g, h): ...
    @staticmethod
    def static(a, b, c, d, e, f, g, h, i): ...
def outer():
    return lambda a, b, c, d, e, f, g, h, i: a
@click.command()
@click.option("--a")
def command(a, b, c, d, e, f, g, h, i): ...
'''
    found = sorted(s.split(" (")[0] for s in long_signatures(src, "m"))
    assert found == ["m:10 static", "m:12 lambda", "m:4 nine", "m:6 keywords"], found


MAX_RUNTIME_LINES = 40  # the runtime reads as small steps (docs/runtime.md): a longer function is two


def long_functions(source: str, where: str, limit: int) -> list[str]:
    """'where:line name (n lines)' for every function in `source` over `limit` lines (def line to last line)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found.append(f"{where}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_runtime_function_is_over_forty_lines():
    found = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        found += long_functions(path.read_text(), path.relative_to(ROOT).as_posix(), MAX_RUNTIME_LINES)
    assert not found, "runtime functions over MAX_RUNTIME_LINES lines:\n  " + "\n  ".join(found)


def test_the_line_rule_counts_a_function_from_its_def_to_its_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(40))
    assert long_functions(f"def f():\n{body}\n", "m.py", MAX_RUNTIME_LINES) == ["m.py:1 f (41 lines)"]
    assert long_functions(f"def f():\n{body[:-len('    x39 = 39') - 1]}\n", "m.py", MAX_RUNTIME_LINES) == []


MODE_NAMES = {"low_confidence", "ar", "self_spec"}  # the decoding modes, written out (not read from the registry)


def mode_branches(source: str, where: str) -> list[str]:
    """'where:line' of every comparison with a mode's name (==, !=, in, not in) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            values = [e.value for s in sides for e in ([s] + list(getattr(s, "elts", [])))
                      if isinstance(e, ast.Constant)]
            if MODE_NAMES & {v for v in values if isinstance(v, str)}:
                found.append(f"{where}:{node.lineno}")
    return found


def test_only_the_decoding_strategies_branch_on_a_mode():
    """A mode's behaviour lives in its strategy (runtime/decoding/); elsewhere the code asks the strategy.
    (train/ names its two losses "block" and "ar": not a decoding mode.)"""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(("runtime/decoding/", "train/")):
            found += mode_branches(path.read_text(), rel)
    assert not found, "comparisons with a decoding mode's name outside runtime/decoding/:\n  " + "\n  ".join(found)


def test_the_mode_check_sees_a_branch():
    assert mode_branches('if req.decoding == "self_spec":\n    pass\n', "m.py") == ["m.py:1"]
    assert mode_branches('x = d in ("ar", "self_spec")\n', "m.py") == ["m.py:1"]
    assert mode_branches('x = d == "block"\n', "m.py") == []

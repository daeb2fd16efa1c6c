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

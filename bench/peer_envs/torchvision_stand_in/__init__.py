"""A stand-in `torchvision` for an environment that runs text models only (bench/peer_envs.sh puts it in
vLLM's): every `torchvision.*` module imports, and anything taken from one raises when used.

Why: vLLM's Qwen3.5 module imports Qwen3-VL's, which imports transformers' Qwen2-VL image processor, which
imports `torchvision.transforms.v2` unconditionally; the package index's torchvision for torch 2.13 is a
CUDA build that does not load against the CPU torch (`operator torchvision::nms does not exist`), and no
CPU build is reachable. A text model never calls it, so the measured path is vLLM's own."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Unusable:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"torchvision stand-in: {self._name} used (this environment runs text models only)")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(f"{module_name}.{name}")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _module_getattr(spec.name)
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr("torchvision")

"""AOT PTX launched the way TensorRT launches an AOT plugin (STEP_GRAPH.md 5), without TensorRT.

Arguments in TensorRT's order (input pointers, int32 scalars, output pointers), grid, block and dynamic
shared memory as given; on torch's current stream. CuPy `RawModule` when CuPy is there, else libcuda
through ctypes (what a C++ host such as TensorRT does).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch


class Launcher:
    """CuPy RawModule; libcuda through ctypes when CuPy is missing or refuses."""

    def __init__(self, force_ctypes: bool = False):
        self.cp = None
        if not force_ctypes:
            try:
                import cupy
                self.cp = cupy
            except Exception as e:  # noqa: BLE001
                print(f"NOTE cupy unavailable ({type(e).__name__}: {e}); using libcuda via ctypes", flush=True)
        self.kind = "cupy" if self.cp is not None else "ctypes-libcuda"
        if self.cp is None:
            lib = ctypes.CDLL("libcuda.so.1")
            vp, u = ctypes.c_void_p, ctypes.c_uint
            lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
            lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
            lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
            lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
            self.lib = lib

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def load(self, ptx_path: Path, name: str):
        if self.cp is not None:
            return self.cp.RawModule(path=str(ptx_path)).get_function(name)
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(mod), ptx_path.read_bytes() + b"\0"), "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        return fn

    def launch(self, fn, grid, block: int, shared: int, args, opt_in: bool = True):
        """args: [("ptr", int) | ("i32", int)] in kernel order; on torch's current stream."""
        stream = torch.cuda.current_stream().cuda_stream
        if self.cp is not None:
            if opt_in and shared > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = shared
            vals = tuple(np.uint64(v) if kind == "ptr" else np.int32(v) for kind, v in args)
            with self.cp.cuda.ExternalStream(stream):
                fn(tuple(int(g) for g in grid), (block, 1, 1), vals, shared_mem=shared)
            return
        if opt_in and shared > 48 * 1024:
            max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._check(self.lib.cuFuncSetAttribute(fn, max_dynamic_shared, shared), "cuFuncSetAttribute")
        store = [ctypes.c_uint64(v) if kind == "ptr" else ctypes.c_int32(v) for kind, v in args]
        params = (ctypes.c_void_p * len(store))(*[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in store])
        gx, gy, gz = (int(g) for g in grid)
        self._check(self.lib.cuLaunchKernel(fn, gx, gy, gz, block, 1, 1, shared, ctypes.c_void_p(stream), params, None),
                    "cuLaunchKernel")

"""Fixtures shared by the benchmarks (`bench/`), the GPU checks (`gpu_checks/`) and the tests.

- `fullsize`: the Clover-35B-A3B config, its layer sizes, and a full-size
  checkpoint of sparse files (real headers, zero data, ~0 bytes on disk);
- `cuda`: timing on one CUDA GPU (copy bandwidth, CUDA-graph replay,
  `do_bench`) and random full-size weights initialised on the device;
- `ptx_launcher`: AOT PTX launched the way TensorRT launches an AOT plugin
  (CuPy, or libcuda through ctypes);
- `kernel_cases`: kernel inputs at real layer sizes and the checks of the
  Triton kernels against the plain-torch cores.
- `logs`: the progress lines the toolchain logs, collected for a test.

The toolchain itself never imports this package.
"""

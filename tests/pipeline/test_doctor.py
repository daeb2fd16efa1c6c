"""`doctor`: the capability rules, and its output on this machine."""

import subprocess
import sys

from clover_export.pipeline.doctor import Facts, capabilities, collect


def rows(f):
    return {what: ok for what, ok, _ in capabilities(f)}


def test_rules_for_known_machines():
    h200 = Facts(torch="2.13", tensorrt="11.0", triton="3.9", onnxruntime="1.32",
                 gpus=[{"name": "H200", "sm": (9, 0), "memory": 141 * 1024**3}])
    a100 = Facts(torch="2.13", tensorrt="10.9", gpus=[{"name": "A100", "sm": (8, 0), "memory": 80 * 1024**3}])
    r = rows(h200)
    assert r["build engines / generate --backend trt"] and r["fp8 engine on H200"] and r["bf16 engine on H200"]
    r = rows(a100)
    assert r["bf16 engine on A100"] and not r["fp8 engine on A100"]
    r = rows(Facts(torch="2.13", triton="3.9"))
    assert not r["build engines / generate --backend trt"] and r["plugin PTX (AOT, no GPU needed)"]
    assert not r["validate / generate --backend ort"]
    # TensorRT without a GPU is not enough
    assert not rows(Facts(torch="2.13", tensorrt="10.9"))["build engines / generate --backend trt"]
    # below the floor (10.9: aot_impl) even with a GPU
    assert not rows(Facts(torch="2.13", tensorrt="10.8", gpus=a100.gpus))["build engines / generate --backend trt"]


def test_doctor_on_this_machine_reports_what_it_finds():
    facts = collect()
    out = subprocess.run(
        [sys.executable, "-m", "clover_export.cli", "doctor"], capture_output=True, text=True, check=True
    ).stdout
    assert f"torch {facts.torch}" in out
    if facts.tensorrt is None:
        assert "tensorrt: not installed" in out and "[no ] build engines" in out
    if not facts.gpus:
        assert "GPU: none" in out

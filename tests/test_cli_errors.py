"""CLI user errors: exit status 1, one `error: [component] ...` message on stderr, no traceback, nothing written.

Each case runs `python -m clover_export.cli ...` in a subprocess (the real entry point, with the
CloverError handler of cli.py). The cases run concurrently once per module; each test checks one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

# name -> (argv after `clover-export`, substrings the stderr must hold); {tiny}, {tmp} are filled in
CASES = {
    "model_missing": (["info", "{tmp}/nope"], ["[model]", "nope", "no such model folder"]),
    "model_no_config": (["info", "{tmp}/noconf"], ["[model]", "no config.json"]),
    "config_bad_field": (["info", "{tmp}/badconf"], ["[config]", "config.json", "'hidden_size'"]),
    "info_context_0": (["info", "{tiny}", "--context", "0"], ["[info]", "--context", "got 0"]),
    "info_gpu_memory_negative": (["info", "{tiny}", "--gpu-memory", "-1"], ["--gpu-memory"]),
    "forward_denoise_wrong_count": (["forward", "{tiny}", "--input-ids", "1,2", "--mode", "denoise"],
                                    ["[forward]", "block_size=32", "got 2"]),
    "forward_save_missing_folder": (["forward", "{tiny}", "--input-ids", "1", "--save", "{tmp}/nodir/x.npy"],
                                    ["[forward]", "--save", "nodir"]),
    "export_out_inside_model": (["export", "{tiny}", "--out", "{tiny}/sub"], ["[export]", "inside the model folder"]),
    "build_out_is_model": (["build", "{tiny}", "--out", "{tiny}"], ["[build]", "model folder"]),
    "build_max_context_0": (["build", "{tiny}", "--out", "{tmp}/b0", "--max-context", "0"],
                            ["[build]", "--max-context", "got 0"]),
    "check_not_export": (["check", "{tmp}/noconf"], ["[check]", "manifest.json"]),
    "check_corrupt_manifest": (["check", "{tmp}/badart"], ["[check]", "manifest.json", "not valid JSON"]),
    "validate_not_export": (["validate", "{tmp}/noconf"], ["[artifact]", "manifest.json"]),
    "generate_ort_not_export": (["generate", "{tmp}/noconf", "--backend", "ort", "--prompt", "hi"],
                                ["[artifact]", "manifest.json"]),
    "generate_threshold_0": (["generate", "{tiny}", "--prompt", "hi", "--threshold", "0"], ["'threshold'", "(0, 1]"]),
    "generate_threshold_2": (["generate", "{tiny}", "--prompt", "hi", "--threshold", "2"], ["'threshold'", "(0, 1]"]),
    "generate_max_new_tokens_0": (["generate", "{tiny}", "--prompt", "hi", "--max-new-tokens", "0"],
                                  ["'max_new_tokens'"]),
    "generate_over_context": (["generate", "{tiny}", "--prompt", "hi", "--max-new-tokens", "100000"],
                              ["[generate]", "context limit"]),
    "generate_block_size_0": (["generate", "{tiny}", "--prompt", "hi", "--block-size", "0"], ["block_size", "got 0"]),
    "generate_bad_device": (["generate", "{tiny}", "--prompt", "hi", "--device", "foo"], ["[runtime]", "'foo'"]),
    "compare_corrupt_golden": (["compare", "{tmp}/bad.json", "{tiny}"], ["[golden]", "bad.json", "not valid JSON"]),
}
# these two only mean something where CUDA / TensorRT are missing (skipped elsewhere)
CASES["generate_cuda_missing"] = (["generate", "{tiny}", "--prompt", "hi", "--device", "cuda"],
                                  ["[runtime]", "--device cuda"])
CASES["generate_trt_missing"] = (["generate", "{tiny}", "--prompt", "hi", "--backend", "trt"], ["[runtime]", "TensorRT"])


@pytest.fixture(scope="module")
def results(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "noconf").mkdir()
    (tmp / "badconf").mkdir()
    (tmp / "badconf" / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "hidden_size": "abc"}))
    (tmp / "badart").mkdir()
    (tmp / "badart" / "manifest.json").write_text("{bad")
    (tmp / "bad.json").write_text("{not json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(argv):
        argv = [a.format(tiny=tiny_dir, tmp=tmp) for a in argv]
        return subprocess.run([sys.executable, "-m", "clover_export.cli", *argv], capture_output=True, text=True,
                              env=env, timeout=120)

    before = sorted(p.name for p in tiny_dir.iterdir())
    with ThreadPoolExecutor(max_workers=4) as pool:
        out = dict(zip(CASES, pool.map(run, [argv for argv, _ in CASES.values()])))
    out["_tiny_unchanged"] = sorted(p.name for p in tiny_dir.iterdir()) == before
    out["_tmp"] = tmp
    return out


def _skip_if_present(name):
    if name == "generate_trt_missing" and importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    if name == "generate_cuda_missing":
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")


@pytest.mark.parametrize("name", list(CASES))
def test_user_error_is_one_clean_message(results, name):
    _skip_if_present(name)
    r = results[name]
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ["), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].strip().startswith("Note:")), r.stderr
    for s in CASES[name][1]:
        assert s in r.stderr, (s, r.stderr)


def test_nothing_written(results):
    """Refused commands leave no output behind (and never touch the model folder)."""
    tmp = results["_tmp"]
    assert results["_tiny_unchanged"]
    assert not (tmp / "b0").exists()
    assert not (tmp / "nodir").exists()
    assert not any(p.name.startswith(".") for p in tmp.iterdir())

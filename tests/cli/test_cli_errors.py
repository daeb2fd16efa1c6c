"""CLI user errors: exit status 1, one `error: [component] ...` message on stderr, no traceback, nothing written.

Each case runs `python -m clover_export.cli ...` in a subprocess (the real entry point, with the
CloverError handler of cli.py). The cases run concurrently once per module; each test checks one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
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
    "generate_decoding_bogus": (["generate", "{tiny}", "--prompt", "hi", "--decoding", "bogus"],
                                ["[cli]", "--decoding", "'bogus' is not one of", "'self_spec'"]),
    "generate_draft_threshold_2": (["generate", "{tiny}", "--prompt", "hi", "--decoding", "self_spec",
                                    "--draft-threshold", "2"], ["'draft_threshold'", "[0, 1]"]),
    "compare_corrupt_golden": (["compare", "{tmp}/bad.json", "{tiny}"], ["[golden]", "bad.json", "not valid JSON"]),
}
# OUT policy (clover_export/artifact/outdir.py): a user's folder or file is never replaced, --force or not
# (the policy's other cases are in test_outdir.py, without a subprocess each).
# The commands run in {tmp}/work, a folder of the user's: `--out .` must not touch it.
CASES.update(
    {
        "export_out_user_folder": (
            ["export", "{tiny}", "--out", "{tmp}/mine"],
            ["[export]", "is not empty", "notes.txt", "results/"],
        ),
        "export_out_dot": (["export", "{tiny}", "--out", ".", "--force"], ["[export]", "is the working directory"]),
        "export_out_earlier_export": (
            ["export", "{tiny}", "--out", "{tmp}/earlier"],
            ["[export]", "earlier output", "--force"],
        ),
        "export_out_is_a_file": (["export", "{tiny}", "--out", "{tmp}/afile"], ["[cli]", "--out", "is a file"]),
        "export_out_unwritable": (
            ["export", "{tiny}", "--out", "/sys/clover-export-test"],
            ["[export]", "cannot create"],
        ),
        "build_out_user_folder": (["build", "{tiny}", "--out", "{tmp}/mine", "--force"], ["[build]", "is not empty"]),
        "train_out_user_folder": (
            ["@train", "--out", "{tmp}/mine", "--steps", "1", "--force"],
            ["[train]", "is not empty"],
        ),
        "validate_save_io_user_file": (
            ["validate", "{tmp}/earlier", "--save-io", "{tmp}/mine/notes.txt", "--force"],
            ["[validate]", "--save-io", "exists and is not"],
        ),
        "forward_save_is_a_folder": (
            ["forward", "{tiny}", "--input-ids", "1", "--save", "{tmp}/mine"],
            ["[cli]", "--save"],
        ),
        # broken checkpoints
        "export_corrupt_safetensors": (
            ["export", "{tmp}/corrupt", "--out", "{tmp}/e1"],
            ["[checkpoint]", "safetensors header is not valid JSON"],
        ),
        "export_missing_shard": (["export", "{tmp}/noshard", "--out", "{tmp}/e2"], ["[checkpoint]", "does not exist"]),
        "unknown_option": (["export", "--bogus"], ["[cli]", "--bogus"]),
    }
)
# these two only mean something where CUDA / TensorRT are missing (skipped elsewhere)
CASES["generate_cuda_missing"] = (["generate", "{tiny}", "--prompt", "hi", "--device", "cuda"],
                                  ["[runtime]", "--device cuda"])
CASES["generate_trt_missing"] = (
    ["generate", "{tiny}", "--prompt", "hi", "--backend", "trt"],
    ["[runtime]", "TensorRT"],
)


USER_FILES = {"work/draft.txt": "my draft", "mine/notes.txt": "my notes", "mine/results/run1.csv": "1,2",
              "home/.bashrc": "export X=1", "afile": "not a folder"}


@pytest.fixture(scope="module")
def results(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "noconf").mkdir()
    (tmp / "badconf").mkdir()
    (tmp / "badconf" / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "hidden_size": "abc"}))
    (tmp / "badart").mkdir()
    (tmp / "badart" / "manifest.json").write_text("{bad")
    (tmp / "bad.json").write_text("{not json")
    for name, text in USER_FILES.items():  # the user's files: no refused command may touch them
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    (tmp / "earlier").mkdir()
    (tmp / "earlier" / "manifest.json").write_text(json.dumps({"format": "clover-export/step-graph"}))
    for name, damage in (("corrupt", "header"), ("noshard", "shard")):
        shutil.copytree(tiny_dir, tmp / name)
        shard = next((tmp / name).glob("*.safetensors"))
        if damage == "shard":
            shard.unlink()
        else:
            data = bytearray(shard.read_bytes())
            data[8:40] = b"x" * 32  # the JSON header after its 8-byte length
            shard.write_bytes(bytes(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp / "home")}

    def run(argv):
        argv = [a.format(tiny=tiny_dir, tmp=tmp) for a in argv]
        entry = ["clover_export.train", *argv[1:]] if argv[0] == "@train" else ["clover_export.cli", *argv]
        return subprocess.run([sys.executable, "-m", *entry], capture_output=True, text=True, env=env, timeout=180,
                              cwd=tmp / "work")

    before = sorted(p.name for p in tiny_dir.iterdir())
    def timed(argv):
        t = time.perf_counter()
        r = run(argv)
        r.seconds = time.perf_counter() - t
        return r

    with ThreadPoolExecutor(max_workers=4) as pool:
        out = dict(zip(CASES, pool.map(timed, [argv for argv, _ in CASES.values()])))
    print("slowest cases:", sorted(((round(r.seconds), k) for k, r in out.items()), reverse=True)[:8])
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
    """Refused commands leave no output behind (and never touch the model folder or the user's files)."""
    tmp = results["_tmp"]
    assert results["_tiny_unchanged"]
    for name in ("b0", "nodir", "e1", "e2"):
        assert not (tmp / name).exists(), name
    assert not any(p.name.startswith(".") for p in tmp.iterdir())
    for name, text in USER_FILES.items():
        assert (tmp / name).read_text() == text, name
    assert {p.name for p in (tmp / "home").iterdir()} <= {".bashrc", ".cache"}  # ONNX Runtime caches a device id
    for folder in ("work", "mine"):
        assert sorted(p.relative_to(tmp).as_posix() for p in (tmp / folder).rglob("*") if p.is_file()) == \
            sorted(n for n in USER_FILES if n.startswith(folder + "/")), folder
    assert sorted(p.name for p in (tmp / "earlier").iterdir()) == ["manifest.json"]

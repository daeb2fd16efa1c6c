"""The CPU thread policy, and the ort backend straight from a model folder (cached export, its key)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from clover_export.backends import ort_cache, threads
from clover_export.backends.threads import ENV
from clover_export.backends.torch_backend import TorchBackend
from clover_export.core.errors import CloverError
from clover_export.runtime.generator import Generator


def threads_seen_in_steps(backend, tiny_dir, caller_threads: int) -> set[int]:
    """torch's thread count inside every backend step of one request; the caller's is set before."""
    seen: set[int] = set()
    step = backend.step

    def spy(*a):
        seen.add(torch.get_num_threads())
        return step(*a)

    backend.step = spy
    gen = Generator(backend, tiny_dir, max_slots=1)
    before = torch.get_num_threads()
    torch.set_num_threads(caller_threads)
    try:
        gen.generate("Sort: 3 1 2", max_new_tokens=8)
        assert torch.get_num_threads() == caller_threads  # library use: the caller's setting is left alone
    finally:
        torch.set_num_threads(before)
    return seen


def test_explicit_threads_win_over_the_environment(model, tiny_dir, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert threads_seen_in_steps(TorchBackend(model, tiny_dir, threads=2), tiny_dir, caller_threads=3) == {2}


def test_small_model_runs_single_threaded_without_a_setting(model, tiny_dir, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert threads_seen_in_steps(TorchBackend(model, tiny_dir), tiny_dir, caller_threads=2) == {1}


def test_omp_num_threads_leaves_torch_as_the_caller_set_it(model, tiny_dir, monkeypatch):
    monkeypatch.setenv(ENV, "2")
    assert threads_seen_in_steps(TorchBackend(model, tiny_dir), tiny_dir, caller_threads=2) == {2}


def test_bad_thread_counts_are_refused(model, tiny_dir):
    with pytest.raises(CloverError, match="threads must be a positive integer"):
        TorchBackend(model, tiny_dir, threads=0)
    from clover_export.cli import main

    r = CliRunner().invoke(main, ["generate", "--prompt", "Hi", "--threads", "0"])
    assert r.exit_code == 1 and "--threads" in r.output  # usage errors: one line, exit 1 (cli.py)


@pytest.mark.slow
def test_generate_tiny_with_ort_exports_once_then_reuses(tmp_path, monkeypatch):
    """From a clean cache: the first run exports into it (one line says so), the second reuses the entry."""
    pytest.importorskip("onnxruntime")
    from clover_export.backends import ort_cache
    from clover_export.cli import main

    monkeypatch.setenv("CLOVER_EXPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV, raising=False)
    args = ["generate", "tiny", "--backend", "ort", "--prompt", "Sort: 3 1 2 9 4", "--max-new-tokens", "8", "--json"]
    runs = [CliRunner().invoke(main, args) for _ in range(2)]
    for r in runs:
        assert r.exit_code == 0, r.output
    first, second = runs
    listed = sorted((tmp_path / "cache" / ort_cache.CACHE_SUBDIR).iterdir())  # the entry and its hidden lock file
    entries = [e for e in listed if not e.name.startswith(".")]
    assert len(entries) == 1 and [e.name for e in listed] == [f".{entries[0].name}.lock", entries[0].name]
    assert "ort: exporting" in first.stderr and str(entries[0]) in first.stderr
    assert "ort: using the cached fp32 export" in second.stderr and "exporting" not in second.stderr
    a, b = (json.loads(r.stdout) for r in runs)
    assert a["token_ids"] == b["token_ids"] and 0 < a["response_tokens"] <= 8

    from clover_export.backends.ort_backend import OrtBackend

    backend = OrtBackend.load("tiny", threads=1)  # library use reaches the same entry
    assert backend.art.dir == entries[0]
    assert backend.session.get_session_options().intra_op_num_threads == 1


# --- ONNX Runtime threads: OMP_NUM_THREADS is respected (threads.py policy 2) --------------------------------
BIG_STEP = 1e12  # flops: sized from the work, as many threads as there are cores
SMALL_STEP = 1.0  # one thread


def test_ort_threads_follow_omp_num_threads(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.delenv(ENV, raising=False)
    assert (threads.ort_threads(None, BIG_STEP), threads.ort_threads(None, SMALL_STEP)) == (8, 1)
    monkeypatch.setenv(ENV, "3")
    assert (threads.ort_threads(None, BIG_STEP), threads.ort_threads(None, SMALL_STEP)) == (3, 3)
    assert threads.ort_threads(2, BIG_STEP) == 2  # an explicit count still wins
    monkeypatch.setenv(ENV, "zero")  # not a positive integer: as if unset
    assert threads.ort_threads(None, SMALL_STEP) == 1


def test_ort_session_gets_omp_num_threads(tiny_fp32_export, monkeypatch):
    pytest.importorskip("onnxruntime")
    from clover_export.backends.ort_backend import OrtBackend

    monkeypatch.setenv(ENV, "3")  # the embedded default's steps are small: sized from the work it would be 1
    backend = OrtBackend.load(tiny_fp32_export)
    assert backend.session.get_session_options().intra_op_num_threads == 3


# --- the ONNX Runtime cache key: a changed exporter or checkpoint makes a fresh export ------------------------
def fake_model(folder: Path) -> Path:
    """A model folder as the cache key sees it (config, generation config, weight files): no real weights,
    since the export below is recorded, not run."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "clover"}))
    (folder / "generation_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


@pytest.fixture
def recorded_exports(tmp_path, monkeypatch):
    """Exports that `ort_cache.exported_artifact` asks for, recorded (each writes a manifest, so it is
    reused after)."""
    from clover_export.exporter import export as export_module

    monkeypatch.setenv("CLOVER_EXPORT_CACHE", str(tmp_path / "cache"))
    made: list[Path] = []

    def export(model_dir, out, **kw):
        made.append(Path(out))
        Path(out).mkdir(parents=True)
        (Path(out) / "manifest.json").write_text("{}")

    monkeypatch.setattr(export_module, "export", export)
    return made


def edited_source(monkeypatch, relative: str, extra: bytes = b"\n# edited\n") -> None:
    """The package source `relative` (e.g. "exporter/export.py") reads as if edited: bytes appended."""
    target = (Path(ort_cache.__file__).resolve().parents[1] / relative).resolve()
    assert target.is_file(), target
    read = Path.read_bytes

    def read_bytes(self):
        data = read(self)
        return data + extra if self.resolve() == target else data

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize("source", ["exporter/export.py", "model/moe.py", "plugins/triton/launch.py", "core/names.py"])
def test_an_exporter_source_change_forces_a_fresh_export(tmp_path, recorded_exports, monkeypatch, source):
    model = fake_model(tmp_path / "m")
    first = ort_cache.exported_artifact(model, log=lambda s: None)
    assert ort_cache.exported_artifact(model, log=lambda s: None) == first and recorded_exports == [first]
    edited_source(monkeypatch, source)
    again = ort_cache.exported_artifact(model, log=lambda s: None)
    assert again != first and recorded_exports == [first, again]


def test_a_checkpoint_change_forces_a_fresh_export(tmp_path, recorded_exports):
    model = fake_model(tmp_path / "m")
    first = ort_cache.exported_artifact(model, log=lambda s: None)
    key = ort_cache.exporter_fingerprint()
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # re-saved, same size
    second = ort_cache.exported_artifact(model, log=lambda s: None)
    (model / "config.json").write_text(json.dumps({"model_type": "clover", "block_size": 16}))  # edited config
    third = ort_cache.exported_artifact(model, log=lambda s: None)
    assert len({first, second, third}) == 3 and recorded_exports == [first, second, third]
    assert ort_cache.exporter_fingerprint() == key  # the exporter is the same
    (model / "notes.txt").write_text("a file the export does not read")
    assert ort_cache.exported_artifact(model, log=lambda s: None) == third and len(recorded_exports) == 3


# --- the test session's own temporary folders ---------------------------------------------------------------
def test_a_test_run_leaves_no_temporary_folder(tmp_path):
    """conftest.py makes the session's cache folder in the temp dir and removes it when the session ends; the
    folder of a session that was killed goes with the next session, a running session's stays."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp / f"clover-test-cache-{int(dead.stdout)}-abc123"  # its process has exited
    live = tmp / f"clover-test-cache-{os.getpid()}-def456"  # this process
    for d in (stale, live):
        (d / "tiny-v2").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "CLOVER_EXPORT_CACHE"}
    env["TMPDIR"] = str(tmp)
    run = tmp_path / "run"  # a test of its own beside a copy of this suite's conftest.py
    run.mkdir()
    shutil.copy(Path(__file__).parents[1] / "conftest.py", run / "conftest.py")
    (run / "test_probe.py").write_text(
        "import os, pathlib, tempfile\n"
        "def test_the_cache_is_a_temp_folder_and_written():\n"
        "    cache = pathlib.Path(os.environ['CLOVER_EXPORT_CACHE'])\n"
        "    assert cache.parent == pathlib.Path(tempfile.gettempdir())\n"
        "    (cache / 'entry').write_text('x')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(run)],
                       capture_output=True, text=True, env=env, cwd=run, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith("pytest-of-")) == [live.name]


def test_processes_starting_together_export_once_and_all_use_it(tmp_path, tiny_dir):
    """Servers or test workers started together on an empty cache: one exports, the others wait for it and use
    that export (without the lock the later ones failed at the end: the cache entry 'exists from an earlier run')."""
    env = {**os.environ, "CLOVER_EXPORT_CACHE": str(tmp_path / "cache")}
    code = ("from clover_export.backends.ort_cache import exported_artifact\n"
            f"print(exported_artifact({str(tiny_dir)!r}))")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert [rc for *_, rc in results] == [0, 0, 0], [err for _, err, rc in results if rc]
    assert len({out for out, _, _ in results}) == 1
    exporting = [err for _, err, _ in results if "ort: exporting" in err]
    assert len(exporting) == 1, [err for _, err, _ in results]

"""Issue 16: the CPU thread policy, and the ort backend straight from a model folder (cached export)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from clover_export.errors import CloverError
from clover_export.runtime.backends.torch_backend import TorchBackend
from clover_export.runtime.generator import Generator
from clover_export.runtime.threads import ENV


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
    from clover_export.cli import main
    from clover_export.runtime import ort_cache

    monkeypatch.setenv("CLOVER_EXPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV, raising=False)
    args = ["generate", "tiny", "--backend", "ort", "--prompt", "Sort: 3 1 2 9 4", "--max-new-tokens", "8", "--json"]
    runs = [CliRunner().invoke(main, args) for _ in range(2)]
    for r in runs:
        assert r.exit_code == 0, r.output
    first, second = runs
    entries = list((tmp_path / "cache" / ort_cache.CACHE_SUBDIR).iterdir())
    assert [e.name for e in entries if not e.name.startswith(".")] == [entries[0].name]  # one entry, no leftovers
    assert "ort: exporting" in first.stderr and str(entries[0]) in first.stderr
    assert "ort: using the cached fp32 export" in second.stderr and "exporting" not in second.stderr
    a, b = (json.loads(r.stdout) for r in runs)
    assert a["token_ids"] == b["token_ids"] and 0 < a["response_tokens"] <= 8

    from clover_export.runtime.backends.ort_backend import OrtBackend

    backend = OrtBackend.load("tiny", threads=1)  # library use reaches the same entry
    assert backend.art.dir == entries[0]
    assert backend.session.get_session_options().intra_op_num_threads == 1

"""One runtime configuration for every door (`RuntimeConfig`, docs/runtime.md: Runtime configuration) and one rule
for the backend left out (`backends.default_backend`): the Python API, `clover-export generate`, `clover-export
serve`'s options and Ray Serve's arguments build the same configuration and open the same backend, with the
same options, for the same model on the same machine. The backend's load is replaced by a recorder that stops
there: what is checked is what each door asks for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from click.testing import CliRunner

from clover_export.cli import main
from clover_export.core.errors import CloverError
from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.app import ServeOptions


class Opened(Exception):
    """The recorder's stop: the backend was chosen and would be opened now."""


@pytest.fixture
def opened(monkeypatch):
    """[(backend, model, load options)] of every backend a door opens."""
    calls = []

    def record(name, model, **options):
        calls.append((name, model, options))
        raise Opened(name)

    monkeypatch.setattr("clover_export.runtime.generator.open_backend", record)
    return calls


@pytest.fixture
def cuda_without_tensorrt(monkeypatch):
    """A machine whose device is CUDA, with Triton and without TensorRT: where the server's own rule (torch
    unless an artifact) and `default_backend` (triton) used to disagree."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorrt" else real(n, *a))


TORCH_DEFAULTS = {"dtype": "auto", "device": None, "block_size": None, "allow_qwen": False, "threads": None}


def serve_options(monkeypatch, *args) -> ServeOptions:
    """The ServeOptions `clover-export serve *args` runs with (its uvicorn start replaced)."""
    seen = []
    monkeypatch.setattr("clover_export.cli.serve._run_uvicorn", lambda opts, *rest: seen.append(opts))
    r = CliRunner().invoke(main, ["serve", "--port", "0", *args])
    assert r.exit_code == 0, r.output
    return seen[0]


def test_every_door_leaves_the_backend_to_default_backend(opened, cuda_without_tensorrt, monkeypatch, tmp_path):
    from clover_export.runtime import Generator

    with pytest.raises(Opened):
        Generator.load(None, device="cuda")
    r = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--device", "cuda"])
    assert isinstance(r.exception, Opened), r.output
    opts = serve_options(monkeypatch, "--device", "cuda")
    with pytest.raises(Opened):
        opts.load_generator()
    assert [name for name, _, _ in opened] == ["triton"] * 3
    assert opts.runtime.backend_for(None) == "triton"  # what Ray Serve's replica check asks
    (tmp_path / "manifest.json").write_text("{}")  # an artifact: ort at every door
    assert RuntimeConfig(device="cuda").backend_for(tmp_path) == "ort"
    assert RuntimeConfig(device="cpu").backend_for(None) == "torch"


def test_generate_and_serve_build_the_configuration_the_python_api_takes(opened, monkeypatch):
    from clover_export.runtime import Generator

    flags = ["--backend", "torch", "--dtype", "fp32", "--device", "cpu", "--block-size", "16", "--threads", "2"]
    r = CliRunner().invoke(main, ["generate", "--prompt", "a", "--prompt", "b", *flags])
    assert isinstance(r.exception, Opened), r.output
    opts = serve_options(monkeypatch, *flags, "--max-batch", "3", "--prefix-cache-gb", "1.5")
    want = RuntimeConfig(backend="torch", max_slots=3, prefix_cache=1.5, dtype="fp32", device="cpu", block_size=16,
                         threads=2)
    assert opts.runtime == want and opts.max_batch == 3
    with pytest.raises(Opened):
        opts.load_generator()
    with pytest.raises(Opened):
        Generator.load(None, "torch", dtype="fp32", device="cpu", block_size=16, threads=2, max_slots=3)
    options = dict(dtype="fp32", device="cpu", block_size=16, allow_qwen=False, threads=2)
    assert opened == [("torch", None, options)] * 3
    assert serve_options(monkeypatch, "--no-prefix-cache", "--prefix-cache-gb", "1.5").runtime.prefix_cache is False
    assert serve_options(monkeypatch).runtime == RuntimeConfig(max_slots=8)  # --max-batch's default


def test_each_backend_gets_its_own_options_and_the_rest_as_given(opened):
    from clover_export.runtime import Generator

    full = RuntimeConfig(dtype="bf16", device="cuda:1", block_size=8, allow_qwen=True, threads=3)
    for backend, want in (("ort", {"threads": 3}), ("trt", {}),
                          ("triton", {"dtype": "bf16", "device": "cuda:1", "block_size": 8, "allow_qwen": True})):
        with pytest.raises(Opened):
            Generator.load("m", backend, config=full)
        assert opened.pop() == (backend, "m", want)
    with pytest.raises(Opened):  # a backend's own option (not a field) goes to its load as given
        Generator.load(None, "triton", cuda_graphs=False, graph_batch_sizes=(1, 2))
    triton_defaults = {k: v for k, v in TORCH_DEFAULTS.items() if k != "threads"}
    assert opened.pop() == ("triton", None, {**triton_defaults, "cuda_graphs": False, "graph_batch_sizes": (1, 2)})
    config = RuntimeConfig.of(max_slots=2, cuda_graphs=False)
    assert (config.max_slots, config.backend_options) == (2, {"cuda_graphs": False})


@pytest.mark.parametrize("bad, message", [(dict(max_slots=0), "max_slots must be >= 1, got 0"),
                                          (dict(prefix_cache=-1), "prefix_cache must be True, False or a budget"),
                                          (dict(prefix_cache="4"), "prefix_cache must be True, False or a budget")])
def test_a_bad_setting_is_refused_when_the_configuration_is_made(bad, message):
    with pytest.raises(CloverError, match=message):
        RuntimeConfig(**bad)


def test_ray_serve_arguments_fill_the_same_configuration():
    pytest.importorskip("ray.serve")
    from clover_export.serve import ray_app

    seen = []
    real = ray_app.deployment
    try:
        ray_app.deployment = lambda opts, *rest: seen.append(opts)
        ray_app.app_builder({"model": "/m", "backend": "trt", "max_batch": "16", "max_queue": "64", "threads": "2",
                             "served_model_name": "clover"})
    finally:
        ray_app.deployment = real
    opts = seen[0]
    assert (opts.model, opts.max_queue, opts.served_model_name) == ("/m", 64, "clover")
    assert opts.runtime == RuntimeConfig(backend="trt", max_slots=16, threads=2)


def test_the_shipped_ray_serve_config_is_accepted_and_runs_each_engine_in_its_own_process(monkeypatch):
    pytest.importorskip("ray.serve")
    import yaml

    from clover_export.serve import ray_app

    seen = []
    monkeypatch.setattr(ray_app, "deployment", lambda opts, *rest: seen.append((opts, rest)))
    config = yaml.safe_load((Path(ray_app.__file__).parent / "ray_serve.yaml").read_text())
    (application,) = config["applications"]
    ray_app.app_builder(application["args"])
    (opts, (replicas, gpus)), = seen
    assert (opts.model, opts.engine, opts.runtime.backend, opts.runtime.max_slots) == ("/models/clover", "process",
                                                                                       "trt", 16)
    assert gpus == application["deployments"][0]["ray_actor_options"]["num_gpus"]


def test_the_docs_list_every_field_and_each_backends_own():
    import dataclasses
    from pathlib import Path

    from clover_export.runtime.config import BACKEND_FIELDS

    doc = (Path(__file__).parents[2] / "docs" / "runtime.md").read_text()
    section = doc.split("## Runtime configuration")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = [name.strip().strip("`") for cell in rows for name in cell.split(",")]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(RuntimeConfig))
    assert BACKEND_FIELDS == {"torch": ("dtype", "device", "block_size", "allow_qwen", "threads"),
                              "triton": ("dtype", "device", "block_size", "allow_qwen"), "ort": ("threads",),
                              "trt": ()}  # as the section says

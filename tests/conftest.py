"""Shared fixtures: generated model folders are made once per test session, in a temporary cache folder
that goes with the session."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

CACHE_ENV = "CLOVER_EXPORT_CACHE"
CACHE_PREFIX = "clover-test-cache-"
_session_cache: str | None = None  # the cache folder this process made (None: the caller's, or a parent's)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def sweep_stale_caches(tmp: Path) -> None:
    """Cache folders of earlier sessions that were killed (no pytest_unconfigure ran): their process is gone."""
    for d in tmp.glob(f"{CACHE_PREFIX}*"):
        m = re.fullmatch(re.escape(CACHE_PREFIX) + r"(\d+)-\w+", d.name)
        if m and d.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)


def pytest_configure(config):
    """Generated fixtures (the embedded default too) go to a per-session cache folder, never ~/.cache; made
    here, before collection, so every import and subprocess sees it, and named after this process, so that a
    later session removes it if this one is killed. Under xdist the controller makes it and the workers
    inherit it. Tiny models on 2 shared cores: torch's intra-op threads spin and make small ops many times
    slower, so torch runs one."""
    global _session_cache
    if CACHE_ENV not in os.environ:
        sweep_stale_caches(Path(tempfile.gettempdir()))
        _session_cache = tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-")
        os.environ[CACHE_ENV] = _session_cache
    import torch

    torch.set_num_threads(1)


def pytest_unconfigure(config):
    """The session's cache folder goes with the session (a CLOVER_EXPORT_CACHE set by the caller stays)."""
    global _session_cache
    if _session_cache is not None:
        shutil.rmtree(_session_cache, ignore_errors=True)
        if os.environ.get(CACHE_ENV) == _session_cache:
            del os.environ[CACHE_ENV]
        _session_cache = None


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The embedded default model folder."""
    from clover_export.model.loading import resolve_model_dir

    return resolve_model_dir("tiny")


@pytest.fixture(scope="session")
def tiny_fp32_dir(tmp_path_factory) -> Path:
    """A random tiny Clover folder stored in F32 (for tight fp32 comparisons)."""
    import torch

    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(tmp_path_factory.mktemp("tiny32") / "model", seed=1, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model(tiny_fp32_dir):
    from clover_export.model.loading import load_model

    return load_model(tiny_fp32_dir)


@pytest.fixture(scope="session")
def random_tiny_dir(tmp_path_factory) -> Path:
    """A random-weight tiny Clover folder (BF16, the pre-training sizes): unconfident on purpose,
    for tests of the loop's mechanics (several positions per step only at low thresholds, ties)."""
    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(tmp_path_factory.mktemp("random-tiny") / "model", seed=0, moe_intermediate_size=64)


@pytest.fixture(scope="session")
def model(tiny_dir):
    """The embedded (trained) default as an fp32 reference model."""
    import torch

    from clover_export.model.loading import load_model

    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tok(tiny_dir):
    """The embedded default's tokenizer and chat template."""
    from clover_export.model.tokenizer import ChatTokenizer

    return ChatTokenizer(tiny_dir)


@pytest.fixture(scope="session")
def tiny_fp32_export(tiny_dir, tmp_path_factory) -> Path:
    """An fp32 export of the embedded default (batch 1), for tests that need any real export folder."""
    from clover_export.exporter.export import export

    out = tmp_path_factory.mktemp("tiny-export") / "onnx-fp32"
    export(tiny_dir, out, dtype="fp32", max_batch=1)
    return out


@pytest.fixture(scope="session")
def reference(tiny_dir):
    """(transformers' Qwen3_5MoeForCausalLM on the embedded default's weights (its Clover block tensors left
    out), its tokenizer, the mask token id): the independent reference for the causal model's logprobs."""
    transformers = pytest.importorskip("transformers")
    import glob
    import json

    from safetensors.torch import load_file

    cfg = json.loads((tiny_dir / "config.json").read_text())
    clover_only = ("architectures", "model_type", "block_size", "mask_token_id", "max_context", "torch_dtype",
                   "moe_block_coreset_enabled", "moe_block_coreset_top_p")
    hf = transformers.Qwen3_5MoeForCausalLM(
        transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k not in clover_only})).eval()
    weights = {}
    for f in glob.glob(str(tiny_dir / "*.safetensors")):
        weights.update({k: v.float() for k, v in load_file(f).items()})
    loaded = hf.load_state_dict(weights, strict=False)
    assert not loaded.missing_keys  # every upstream tensor is the checkpoint's
    return hf, transformers.AutoTokenizer.from_pretrained(str(tiny_dir)), cfg["mask_token_id"]

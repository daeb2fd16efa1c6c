"""Shared fixtures: generated model folders are made once per test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# generated fixtures (the embedded default too) go to a per-session cache, never ~/.cache
os.environ.setdefault("CLOVER_EXPORT_CACHE", tempfile.mkdtemp(prefix="clover-test-cache-"))


def pytest_configure(config):
    """Tiny models on 2 shared cores: torch's intra-op threads spin and make small ops many times slower."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The embedded default model folder."""
    from clover_export.models import resolve_model_dir

    return resolve_model_dir("tiny")


@pytest.fixture(scope="session")
def tiny_fp32_dir(tmp_path_factory) -> Path:
    """A random tiny Clover folder stored in F32 (for tight fp32 comparisons)."""
    import torch

    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(tmp_path_factory.mktemp("tiny32") / "model", seed=1, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model(tiny_fp32_dir):
    from clover_export.models import load_model

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

    from clover_export.models import load_model

    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tok(tiny_dir):
    """The embedded default's tokenizer and chat template."""
    from clover_export.runtime.tokenizer import ChatTokenizer

    return ChatTokenizer(tiny_dir)

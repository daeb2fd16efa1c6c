"""Backend parity: the ort backend (exported step graph through ONNX Runtime) gives the torch backend's
greedy tokens (margin rule of test_loop.py) and block logits within tolerance."""

from __future__ import annotations

import pytest
from test_loop import LONG, PROMPTS, check_same, run_both  # the literal DECODING.md reference, margin rule


def exporter_api():
    try:
        from clover_export.exporter import load_artifact  # noqa: F401
        from clover_export.exporter.session import ort_session  # noqa: F401
    except ImportError:
        return None
    from clover_export.exporter.export import export

    return export


@pytest.fixture(scope="module")
def artifact(tiny_dir, tmp_path_factory):
    export = exporter_api()
    if export is None:
        pytest.skip("the exporter does not provide clover_export.exporter.load_artifact / ort_session yet")
    pytest.importorskip("onnxruntime")
    out = tmp_path_factory.mktemp("art") / "tiny-fp32"
    export(tiny_dir, out, dtype="fp32", weights="copy", slots=3, max_batch=3, max_len=1024)
    return out


@pytest.mark.parametrize("threshold", [1.0, 0.9])
def test_ort_matches_the_literal_reference_and_torch(artifact, model, tiny_dir, tok, threshold):
    from clover_export.backends.ort_backend import OrtBackend

    backend = OrtBackend.load(artifact, providers=["CPUExecutionProvider"])
    # the export carries the tokenizer files, so the artifact alone is enough (the model folder may move)
    assert backend.max_context == 1024 and backend.source_dir == artifact
    assert (artifact / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    prompt = PROMPTS["short"]
    res, ref, seen = run_both(model, tiny_dir, tok, prompt, backend=backend, threshold=threshold, **LONG)
    assert check_same(res, ref, seen) >= min(len(ref.response), 32)  # ort vs the reference on the torch model
    torch_res, _, _ = run_both(model, tiny_dir, tok, prompt, threshold=threshold, **LONG)
    if ref.first_unclear_block is None:
        assert res.token_ids == torch_res.token_ids


def test_generator_loads_an_artifact_by_its_manifest(artifact):
    import json

    from click.testing import CliRunner

    from clover_export.cli import main

    r = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", "Hi", "--max-new-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)
    assert 0 < row["response_tokens"] == len(row["token_ids"]) <= 8 and row["denoise_steps"] > 0

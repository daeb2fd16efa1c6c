"""The output policy (clover_export/artifact/outdir.py): a user's folder is never replaced.

The policy is tested on its own (fast: folders of a few files), then through `export()`, whose
refusal comes before any work. The CLI cases (exit 1, one line, files untouched) are in
test_cli_errors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_export.artifact.manifest import FORMAT
from clover_export.artifact.outdir import claim_dir, claim_file, commit_dir
from clover_export.core.errors import CloverError


def user_folder(path: Path, n: int = 6) -> dict[str, str]:
    path.mkdir(parents=True)
    files = {f"notes-{i}.txt": f"precious {i}" for i in range(n)}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def untouched(path: Path, files: dict[str, str]) -> bool:
    return {p.name: p.read_text() for p in path.iterdir()} == files


def earlier_export(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": FORMAT}))
    (path / "model.onnx").write_bytes(b"x")
    return path


def test_new_or_empty_folder_is_written(tmp_path):
    assert claim_dir(tmp_path / "new", "export", command="export") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert claim_dir(tmp_path / "empty", "export", command="export") == tmp_path / "empty"


@pytest.mark.parametrize("kind", ["export", "fp8", "build", "train"])
@pytest.mark.parametrize("force", [False, True])
def test_a_user_folder_is_refused_even_with_force(tmp_path, kind, force):
    files = user_folder(tmp_path / "mine")
    with pytest.raises(CloverError) as e:
        claim_dir(tmp_path / "mine", kind, command=kind, force=force)
    msg = str(e.value)
    assert "is not empty" in msg and "notes-0.txt" in msg and "(6 entries)" in msg, msg
    assert "notes-5.txt" not in msg  # a few entries, not the whole listing
    assert untouched(tmp_path / "mine", files)


def test_an_earlier_export_is_replaced_only_with_force(tmp_path):
    out = earlier_export(tmp_path / "out")
    with pytest.raises(CloverError, match="earlier output.*export") as e:
        claim_dir(out, "export", command="export")
    assert "--force" in str(e.value)
    assert claim_dir(out, "export", command="export", force=True) == out


def test_another_kind_of_artifact_is_not_ours_to_replace(tmp_path):
    out = earlier_export(tmp_path / "out")
    for kind in ("build", "fp8", "train"):
        with pytest.raises(CloverError, match="is not empty"):
            claim_dir(out, kind, command=kind, force=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "build.json").write_text(json.dumps({"stages": {}}))
    assert claim_dir(tmp_path / "b", "build", command="build") == tmp_path / "b"  # builds are incremental
    with pytest.raises(CloverError, match="is not empty"):
        claim_dir(tmp_path / "b", "export", command="export", force=True)


def test_a_corrupt_marker_is_not_an_artifact(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text("{not json")
    with pytest.raises(CloverError, match="is not empty"):
        claim_dir(tmp_path / "out", "export", command="export", force=True)


def test_working_directory_home_and_model_folder_are_never_out(tmp_path, monkeypatch):
    work, home, model = tmp_path / "work" / "here", tmp_path / "home", tmp_path / "models" / "m"
    for p in (work, home, model):
        p.mkdir(parents=True)
        (p / "manifest.json").write_text(json.dumps({"format": FORMAT}))  # even looking like an export
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    cases = {".": "is the working directory", "..": "contains the working directory",
             str(home): "is the home folder", str(model): "is the model folder",
             str(model / "sub"): "lies inside the model folder", str(tmp_path / "models"): "contains the model folder",
             "/": "contains the working directory"}
    for out, why in cases.items():
        with pytest.raises(CloverError, match=why):
            claim_dir(out, "export", command="export", force=True, model_dirs=[model])
    link = tmp_path / "link"
    link.symlink_to(earlier_export(tmp_path / "elsewhere"))  # replacing it would delete what it points at
    with pytest.raises(CloverError, match="is a link"):
        claim_dir(link, "export", command="export", force=True)


def test_a_file_where_a_folder_goes(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(CloverError, match="is a file, not a folder"):
        claim_dir(tmp_path / "f", "export", command="export", force=True)
    assert (tmp_path / "f").read_text() == "mine"


def test_files_follow_the_same_rule(tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text('{"mine": 1}')
    with pytest.raises(CloverError, match="exists and is not"):
        claim_file(mine, "validate-io", command="validate", option="--save-io", force=True)
    ours = tmp_path / "io.json"
    ours.write_text(json.dumps({"lst": [], "polygraphy_class": "RunResults"}))
    with pytest.raises(CloverError, match="--force"):
        claim_file(ours, "validate-io", command="validate", option="--save-io")
    assert claim_file(ours, "validate-io", command="validate", option="--save-io", force=True) == ours
    with pytest.raises(CloverError, match="does not exist"):
        claim_file(tmp_path / "nodir" / "x.json", "validate-io", command="validate", option="--save-io")
    with pytest.raises(CloverError, match="is a folder"):
        claim_file(tmp_path, "validate-io", command="validate", option="--save-io")
    assert mine.read_text() == '{"mine": 1}'


def test_commit_rechecks_out(tmp_path):
    """A folder that appeared at OUT during the work is not swept away by the final rename."""
    tmp = tmp_path / ".out.tmp"
    tmp.mkdir()
    (tmp / "manifest.json").write_text(json.dumps({"format": FORMAT}))
    files = user_folder(tmp_path / "out")
    with pytest.raises(CloverError, match="is not empty"):
        commit_dir(tmp, tmp_path / "out", "export", command="export", force=True)
    assert untouched(tmp_path / "out", files)
    commit_dir(tmp, tmp_path / "new", "export", command="export")
    assert (tmp_path / "new" / "manifest.json").exists() and not tmp.exists()


def test_export_refuses_a_user_folder_and_deletes_nothing(tiny_dir, tmp_path):
    """export never replaces a user's folder wholesale: the user's files stay."""
    from clover_export.exporter.export import export

    files = user_folder(tmp_path / "mine")
    with pytest.raises(CloverError, match="is not empty"):
        export(tiny_dir, tmp_path / "mine", dtype="bf16", force=True)
    assert untouched(tmp_path / "mine", files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp folder left beside it


def test_quantize_refuses_a_user_folder(tiny_fp32_export, tmp_path, monkeypatch):
    """The FP8 rewrite follows the same rule, before any work (the build passes force=True for its own
    folders): a real export as the source, so the refusal can only be the output policy's."""
    from clover_export.quantize import weights as fp8_weights
    from clover_export.quantize.graph import quantize_graph

    def no_work(*a, **k):
        raise AssertionError("the FP8 weights were quantized before OUT was checked")

    monkeypatch.setattr(fp8_weights, "quantize_weights", no_work)
    files = user_folder(tmp_path / "mine")
    with pytest.raises(CloverError) as e:
        quantize_graph(tiny_fp32_export, tmp_path / "mine", {}, force=True)
    assert str(e.value).startswith(f"[quantize] --out {tmp_path / 'mine'} is not empty and is not an FP8 graph")
    assert "notes-0.txt" in str(e.value)
    assert untouched(tmp_path / "mine", files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary folder beside it

"""`clover-export export / check / validate` on tiny models (STEP_GRAPH.md 1-3, 5).

The graph is traced once per dtype (trace_step caches within the process);
every export here reuses it, so the file stays well under a few minutes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from test_export_loaders import no_reflinks

from clover_export.artifact import manifest as A
from clover_export.core import names
from clover_export.core.checkpoint import locate_tensors
from clover_export.core.errors import CloverError
from clover_export.exporter import load_artifact
from clover_export.exporter import weights as W
from clover_export.exporter.check import check_folder
from clover_export.exporter.export import export
from clover_export.exporter.session import ort_session
from clover_export.verify import validate as V
from clover_export.verify.runners import OrtRunner
from clover_export.verify.scenario import NUM_SLOTS, initial_pools, make_feeds, play, pool_len, scenario


def as_large_checkpoint_without_reflinks(m: pytest.MonkeyPatch) -> None:
    """`--weights link` as it treats a full-size checkpoint on ext4: hard links, not a small model's copy."""
    no_reflinks(m)
    m.setattr(A, "COPY_BELOW", 0)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    """A random tiny Clover folder stored in BF16 (the real checkpoint's dtype)."""
    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(tmp_path_factory.mktemp("tiny16") / "model", seed=2, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_export(tiny_fp32_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "fp32"
    return out, export(tiny_fp32_dir, out, dtype="fp32", weights="link", chunk=16, max_batch=2, slots=3)


@pytest.fixture(scope="module")
def bf16_export(bf16_dir, tmp_path_factory):
    """Hard-linked, as a full-size checkpoint is where no reflink can be made (zero copy is asserted)."""
    out = tmp_path_factory.mktemp("exports") / "bf16"
    with pytest.MonkeyPatch.context() as m:
        as_large_checkpoint_without_reflinks(m)
        return out, export(bf16_dir, out, dtype="bf16", weights="link")


def leftovers(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# --- the graph against the reference model --------------------------------------------
def test_onnxruntime_matches_the_reference_over_steps_of_every_kind(fp32_export, tiny_model):
    out, _ = fp32_export
    art = load_artifact(out)
    plans = scenario(art.block_size, art.chunk)
    feeds = make_feeds(plans, art.config, art.block_size)
    pools = initial_pools(art, NUM_SLOTS, pool_len(plans, art.block_size))
    sess = ort_session(art, providers=["CPUExecutionProvider"])
    ort_pools, ref_pools = dict(pools), {k: torch.from_numpy(v.copy()) for k, v in pools.items()}
    kinds = {(p.causal_rows == 0, tuple(r for r in p.rows)) for p in plans}
    assert len(kinds) == len(plans)  # every step is a different kind
    for step, (plan, f) in enumerate(zip(plans, feeds)):
        got = dict(zip(art.output_names, sess.run(art.output_names, {**f, **ort_pools})))
        with torch.no_grad():
            ref = tiny_model(*(torch.from_numpy(f[n]) for n in names.STEP_INPUTS), *ref_pools.values())
        ref = dict(zip(art.output_names, (t.numpy() for t in ref)))
        for name in art.output_names:
            np.testing.assert_allclose(got[name], ref[name], atol=1e-4, rtol=0, err_msg=f"step {step} {name}")
        assert np.array_equal(got[names.CORESET_SIZE], ref[names.CORESET_SIZE])
        # runtime-style: each side carries its own pools; rows really wrote their slots
        written = [n for n in ort_pools if not np.array_equal(got[names.present_name(n)], ort_pools[n])]
        assert bool(written) == any(r[0] > 0 for r in plan.rows), step
        ort_pools = {n: got[names.present_name(n)] for n in ort_pools}
        ref_pools = {n: torch.from_numpy(ref[names.present_name(n)]) for n in ref_pools}
    assert got[names.LOGITS].shape == (2, art.block_size, art.config.vocab_size)
    assert got[names.CAUSAL_LOGITS].shape == (2, f[names.LOGIT_ROWS].shape[1], art.config.vocab_size)


def test_ort_backend_returns_the_reference_causal_logits(fp32_export, tiny_model):
    """The ort backend on the exported fp32 graph: causal_logits [B, R, V] of the rows `logit_rows` names (last
    valid causal rows, earlier ones, block rows, indices past the step's rows and below 0, clamped) equal the
    reference model's; a step without `logit_rows` gets row 0's."""
    from clover_export.backends.ort_backend import OrtBackend

    out, _ = fp32_export
    be = OrtBackend.load(out, providers=["CPUExecutionProvider"])
    N, B, C, V = be.block_size, 2, 6, be.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    i32 = dict(dtype=torch.int32)
    inputs = {names.INPUT_IDS: torch.randint(6, 500, (B, C + N), generator=g, **i32),
              names.N_CAUSAL: torch.tensor([6, 3], **i32), names.HAS_BLOCK: torch.tensor([1, 1], **i32),
              names.SLOT_IDS: torch.tensor([2, 0], **i32), names.PAST_LEN: torch.tensor([5, 0], **i32),
              names.LOGIT_ROWS: torch.tensor([[5, 0, 3, C + N + 7, C, C + N - 1], [2, 1, -4, 0, C + N - 1, 999]],
                                             **i32)}
    pools = be.allocate_pools(3, 64)
    for p in pools.values():
        p.normal_(0, 0.3, generator=g)
    start = {k: v.clone() for k, v in pools.items()}
    with torch.no_grad():
        want = tiny_model.step(inputs, {k: v.clone() for k, v in start.items()})
        want_row0 = tiny_model.step({k: v for k, v in inputs.items() if k != names.LOGIT_ROWS},
                                    {k: v.clone() for k, v in start.items()})
    got = be.step(inputs, pools)
    assert got.causal_logits.shape == (B, 6, V) and got.causal_logits.dtype == torch.float32
    np.testing.assert_allclose(got.causal_logits.numpy(), want.causal_logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), atol=1e-4, rtol=0)
    # clamped: past the rows is the last (block) row, below 0 is row 0
    for b, (r, same) in enumerate([(3, 5), (5, 4)]):
        np.testing.assert_array_equal(got.causal_logits[b, r].numpy(), got.causal_logits[b, same].numpy())
    np.testing.assert_array_equal(got.causal_logits[1, 2].numpy(), got.causal_logits[1, 3].numpy())
    got = be.step({k: v for k, v in inputs.items() if k != names.LOGIT_ROWS}, {k: v.clone() for k, v in start.items()})
    assert got.causal_logits.shape == (B, 1, V)
    np.testing.assert_allclose(got.causal_logits.numpy(), want_row0.causal_logits.numpy(), atol=1e-4, rtol=0)


def test_validate_command_reports_every_output(fp32_export, tmp_path):
    out, _ = fp32_export
    rep = V.validate(out, save_io=tmp_path / "io.json", reference_evaluator=False)
    assert rep.passed and rep.runners == ["onnxruntime-cpu"]
    assert {e.output for e in rep.errors} == set(load_artifact(out).output_names)
    assert {e.step for e in rep.errors} == set(range(len(scenario(32, 16))))
    from polygraphy.json import load_json

    results, inputs = load_json(str(tmp_path / "io.json")), load_json(str(tmp_path / "io.inputs.json"))
    assert [r for r, _ in results] == ["reference-torch", "onnxruntime-cpu"]
    assert len(inputs) == len(results[0][1]) and names.INPUT_IDS in inputs[0]
    from clover_export.artifact.outdir import claim_file

    for f in ("io.json", "io.inputs.json"):  # recognised as validate's own files: replaced with --force only
        with pytest.raises(CloverError, match="--force"):
            claim_file(tmp_path / f, "validate-io", command="validate", option="--save-io")
        claim_file(tmp_path / f, "validate-io", command="validate", option="--save-io", force=True)


def test_bf16_graph_runs_in_onnx_reference(bf16_export):
    out, _ = bf16_export
    rep = V.validate(out)
    assert rep.runners == ["onnx-reference"] or "onnxruntime-cuda" in rep.runners
    assert rep.passed, rep.format()


def test_bf16_validation_catches_a_norm_computed_in_bf16(bf16_dir, tmp_path, monkeypatch):
    """The bf16 judgement is loose enough for bf16 noise but not for a real bug: a graph whose
    RMSNorm statistics run in bf16 (the `.float()` dropped) must fail."""
    from clover_export.exporter import trace
    from clover_export.model import model as M

    def rms_norm_in_bf16(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)

    out = tmp_path / "bad"
    with monkeypatch.context() as m:
        m.setattr(M, "rms_norm", rms_norm_in_bf16)
        m.setattr(trace, "_CACHE", {})
        m.setattr(trace, "_TRACES", {})
        export(bf16_dir, out, dtype="bf16", weights="copy")  # copy: the shard's link count is asserted elsewhere
    rep = V.validate(out)
    assert not rep.passed, rep.format()


def test_layer_replication_equals_tracing_every_layer(fp32_export, tiny_fp32_dir, tmp_path, monkeypatch):
    import clover_export.exporter.export as E
    from clover_export.exporter import trace

    monkeypatch.setattr(E, "trace_step", lambda cfg, dt, bs: trace.trace_step(cfg, dt, bs, replicate=False))
    out, _ = fp32_export
    export(tiny_fp32_dir, tmp_path / "full", dtype="fp32", weights="link", chunk=16, max_batch=2, slots=3)
    art, full = load_artifact(out), load_artifact(tmp_path / "full")
    ops = [
        [n.op_type for n in onnx.load(str(a.graph_path), load_external_data=False).graph.node if n.domain == "clover"]
        for a in (art, full)
    ]
    assert ops[0] == ops[1]  # same custom ops in the same order
    plans = scenario(art.block_size, art.chunk)
    feeds = make_feeds(plans, art.config, art.block_size)
    pools = initial_pools(art, NUM_SLOTS, pool_len(plans, art.block_size))
    a = play(OrtRunner.load(art, "CPUExecutionProvider"), feeds, pools)
    b = play(OrtRunner.load(full, "CPUExecutionProvider"), feeds, pools)
    for step_a, step_b in zip(a, b):
        for name in art.output_names:
            np.testing.assert_allclose(step_a[name], step_b[name], atol=1e-6, rtol=0, err_msg=name)


# --- the attached functions ------------------------------------------------------------
def test_functions_are_what_onnxruntime_runs(fp32_export, tmp_path):
    out, _ = fp32_export
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {(f.domain, f.name) for f in proto.functions} == {("clover", "BlockGDN"), ("clover", "BlockAttention"),
                                                             ("clover", "CoresetMoE")}
    custom = [n for n in proto.graph.node if n.domain == "clover"]
    cfg = load_artifact(out).config
    assert len(custom) == 2 * cfg.num_hidden_layers  # a mixer and an MoE per layer
    for n in custom:
        attrs = {a.name: a for a in n.attribute}
        assert attrs["plugin_namespace"].s == b"clover" and attrs["plugin_version"].s == b"1"
    # full check, external data included: a small checkpoint is reflinked or copied, never hard-linked
    assert json.loads((out / "manifest.json").read_text())["weights"]["placement"] in ("reflink", "copy")
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    # without the functions ONNX Runtime has no implementation for the clover nodes
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    del proto.functions[:]
    onnx.save_model(proto, str(copy / "nofunc.onnx"))
    import onnxruntime as ort

    with pytest.raises(Exception, match="clover|BlockGDN|BlockAttention|CoresetMoE"):
        ort.InferenceSession(str(copy / "nofunc.onnx"), providers=["CPUExecutionProvider"])


def test_manifest_records_what_the_runtime_needs(fp32_export):
    out, res = fp32_export
    art = load_artifact(out)
    m = json.loads((out / "manifest.json").read_text())  # the file as written
    assert (art.block_size, art.chunk, art.dtype, art.weights_mode) == (32, 16, "fp32", "link")
    assert art.input_names == list(names.STEP_INPUTS) + names.pool_names(art.config)
    assert art.output_names[:2] == [names.LOGITS, names.CORESET_SIZE] and art.output_names[-1] == names.CAUSAL_LOGITS
    assert art.output_names[2:-1] == [names.present_name(p) for p in names.pool_names(art.config)]
    rows, causal = art.inputs[len(names.STEP_SCALARS)], art.outputs[-1]
    assert (rows.shape, rows.dtype) == (("batch", "logit_rows"), "int32")
    assert (causal.shape, causal.dtype) == (("batch", "logit_rows", art.config.vocab_size), "float32")
    assert m["opset"] == 20 and m["ir_version"] == 9 and m["config_fingerprint"] == art.config.fingerprint()
    assert set(m["ops"]) == {"clover::BlockGDN", "clover::BlockAttention", "clover::CoresetMoE"}
    decode, prefill = m["profiles"]
    assert decode["dims"]["step_len"] == [32, 64, 64] and prefill["dims"]["step_len"] == [32, 48, 48]
    assert decode["dims"]["logit_rows"] == prefill["dims"]["logit_rows"] == [1, 1, 32]
    assert decode["shapes"][names.LOGIT_ROWS] == {"min": [1, 1], "opt": [2, 1], "max": [2, 32]}
    assert prefill["shapes"][names.INPUT_IDS] == {"min": [1, 32], "opt": [1, 48], "max": [2, 48]}
    proto = onnx.load(str(art.graph_path), load_external_data=False)
    assert proto.ir_version == 9 and {o.domain: o.version for o in proto.opset_import} == {"": 20, "clover": 1}
    dims = {d.dim_param for vi in proto.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
    assert dims == {"batch", "step_len", "slots", "pool_len", "logit_rows"}
    assert "torch" in m["tools"] and m["weights"]["mode"] == "link"


# --- zero copy -------------------------------------------------------------------------
def _initializer_bytes(folder: Path, t: onnx.TensorProto) -> bytes:
    info = {e.key: e.value for e in t.external_data}
    with open(folder / info["location"], "rb") as f:
        f.seek(int(info["offset"]))
        return f.read(int(info["length"]))


def _checkpoint_bytes(model_dir: Path, name: str) -> bytes:
    from safetensors import safe_open

    loc = locate_tensors(model_dir)[name]
    with safe_open(str(loc.file), framework="pt") as f:
        return f.get_tensor(loc.stored_name).contiguous().view(torch.uint8).numpy().tobytes()


def test_bf16_link_export_references_the_checkpoint_bytes(bf16_export, bf16_dir):
    out, res = bf16_export
    assert res.weights.mode == "link" and res.weights.weight_bytes_written == 0
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight", "lm_head.weight",
                 "model.layers.0.mlp.experts.gate_up_proj"):
        assert inits[name].data_type == onnx.TensorProto.BFLOAT16
        assert _initializer_bytes(out, inits[name]) == _checkpoint_bytes(bf16_dir, name)
    # the shard in the export is the checkpoint's file (same inode), not a copy
    shard = next((bf16_dir).glob("*.safetensors"))
    linked = out / "weights" / shard.name
    assert os.path.samefile(shard, linked) and shard.stat().st_nlink == 2
    own = sum(p.stat().st_blocks * 512 for p in out.rglob("*") if p.is_file() and not os.path.samefile(p, shard))
    assert own < shard.stat().st_size / 2  # graph + json only; the weights are not on disk twice


def test_map_mode_feeds_the_mapped_bytes(tiny_fp32_dir, bf16_dir, tmp_path):
    res = export(bf16_dir, tmp_path / "map16", dtype="bf16", weights="map")
    assert res.weights.mode == "map" and res.weights.weight_bytes_written == 0
    assert not (tmp_path / "map16" / "weights").exists()
    from clover_export.exporter.session import _mapped_initializers

    art = load_artifact(tmp_path / "map16")
    names_, values, arrays = _mapped_initializers(art)
    name = "model.layers.1.linear_attn.in_proj_qkv.weight"
    i = names_.index(name)
    assert values[i].data_type() == "tensor(bfloat16)" and values[i].shape() == list(arrays[i].shape)
    assert values[i].data_ptr() == arrays[i].ctypes.data  # ONNX Runtime reads the mapped pages themselves
    assert isinstance(arrays[i], np.memmap) and arrays[i].tobytes() == _checkpoint_bytes(bf16_dir, name)
    # and an fp32 map export runs in ONNX Runtime through ort_session
    export(tiny_fp32_dir, tmp_path / "map32", dtype="fp32", weights="map")
    rep = V.validate(tmp_path / "map32", steps=2, reference_evaluator=False)
    assert rep.passed, rep.format()


def test_per_expert_checkpoint_fuses_experts_with_concat(tiny_fp32_dir, tmp_path):
    from clover_export.core.checkpoint import load_state_dict, save_checkpoint
    from clover_export.core.config import load_config

    cfg = load_config(tiny_fp32_dir)
    src = tmp_path / "per_expert"
    save_checkpoint(load_state_dict(tiny_fp32_dir, cfg), src, per_expert=True, prefix="model.language_model.",
                    extra_files={"config.json": (tiny_fp32_dir / "config.json").read_text()})
    export(src, tmp_path / "out", dtype="fp32", weights="copy")
    proto = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False)
    fuse = [n for n in proto.graph.node if n.op_type == "Concat" and n.name.endswith("fuse_experts")]
    assert len(fuse) == 2 * cfg.num_hidden_layers and len(fuse[0].input) in (cfg.num_experts, 2 * cfg.num_experts)
    rep = V.validate(tmp_path / "out", steps=2, reference_evaluator=False)
    assert rep.passed, rep.format()


# --- bad input --------------------------------------------------------------------------
def test_unknown_model_folder(tmp_path):
    with pytest.raises(CloverError, match="no such model folder"):
        export(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoint_missing_a_tensor(tiny_fp32_dir, tmp_path):
    from clover_export.core.checkpoint import load_state_dict, save_checkpoint
    from clover_export.core.config import load_config

    state = load_state_dict(tiny_fp32_dir, load_config(tiny_fp32_dir))
    del state["model.layers.2.linear_attn.dt_bias"]
    src = save_checkpoint(
        state, tmp_path / "broken", extra_files={"config.json": (tiny_fp32_dir / "config.json").read_text()}
    )
    with pytest.raises(CloverError, match=r"missing: model\.layers\.2\.linear_attn\.dt_bias"):
        export(src, tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, "out")


def hf_cache_layout(src: Path, root: Path) -> Path:
    """snapshots/<rev>/ holding symlinks into blobs/, as the Hugging Face cache does."""
    blobs, snap = root / "blobs", root / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    return snap


def test_symlinked_shards_are_resolved_and_linked(bf16_dir, tmp_path, monkeypatch):
    as_large_checkpoint_without_reflinks(monkeypatch)
    snap = hf_cache_layout(bf16_dir, tmp_path / "hub")
    res = export(snap, tmp_path / "out", dtype="bf16", weights="link")
    assert any("symlink" in m and "Hugging Face" in m for m in res.weights.messages)
    shard = next(p for p in (tmp_path / "out" / "weights").iterdir())
    assert not shard.is_symlink() and os.path.samefile(shard, next(snap.glob("*.safetensors")).resolve())
    assert not check_folder(tmp_path / "out").failures


def test_other_filesystem_falls_back_to_map(tiny_fp32_dir, tmp_path, monkeypatch):
    def exdev(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(W, "reflink", exdev)
    monkeypatch.setattr(W, "hardlink", exdev)
    monkeypatch.setattr(A, "COPY_BELOW", 0)  # a large checkpoint: a small one is copied instead
    res = export(tiny_fp32_dir, tmp_path / "out", dtype="fp32", weights="link")
    assert res.weights.requested == "link" and res.weights.mode == "map"
    assert any("another filesystem" in m and "--weights copy" in m for m in res.weights.warnings)
    art = load_artifact(tmp_path / "out")
    assert art.weights_mode == "map" and art.manifest.weights.messages == res.weights.messages
    assert V.validate(tmp_path / "out", steps=1, reference_evaluator=False).passed


def test_failing_write_leaves_nothing_half_written(tiny_fp32_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export(tiny_fp32_dir, out, dtype="fp32", weights="copy")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    manifest = (out / "manifest.json").read_text()

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "weights/model-00001-of-00001.safetensors")

    monkeypatch.setattr(W, "copy_file", disk_full)
    with pytest.raises(CloverError, match="No space left on device") as e:
        export(tiny_fp32_dir, out, dtype="fp32", weights="copy", force=True)
    assert "nothing was written" in str(e.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # the earlier export is intact
    assert (out / "manifest.json").read_text() == manifest
    assert not leftovers(tmp_path, "out")
    monkeypatch.undo()
    export(tiny_fp32_dir, out, dtype="fp32", weights="copy", force=True)  # --force replaces an earlier export
    assert json.loads((out / "manifest.json").read_text())["weights"]["mode"] == "copy"


def test_output_may_not_replace_the_model_folder(tiny_fp32_dir):
    with pytest.raises(CloverError, match="would replace the model folder"):
        export(tiny_fp32_dir, tiny_fp32_dir.parent, dtype="fp32")


# --- the readiness check ------------------------------------------------------------------
def test_check_passes_and_catches_what_tensorrt_would_reject(fp32_export, tmp_path):
    out, _ = fp32_export
    rep = check_folder(out)
    assert not rep.failures and rep.nodes_checked > 500
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    proto = onnx.load(str(bad / "model.onnx"), load_external_data=False)
    gdn = next(n for n in proto.graph.node if n.op_type == "BlockGDN")
    next(a for a in gdn.attribute if a.name == "block_size").i = 2**40
    proto.graph.node.append(onnx.helper.make_node("NonMaxSuppression", ["n_causal"], ["nms"]))
    proto.graph.node.append(onnx.helper.make_node("Unique", ["n_causal"], ["uniq"]))
    t = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in t.external_data if e.key == "location").value = "../elsewhere.bin"
    onnx.save_model(proto, str(bad / "model.onnx"))
    m = json.loads((bad / "manifest.json").read_text())
    del m["profiles"][1]["dims"]["pool_len"]
    (bad / "manifest.json").write_text(json.dumps(m))
    text = check_folder(bad).format(only_failures=True)
    assert "block_size: 1099511627776 outside the int32 range" in text
    assert "Unique" in text and "not supported by TensorRT" in text
    assert "input type INT32 not among TensorRT's FLOAT, FLOAT16" in text  # NonMaxSuppression's listed types
    assert "'../elsewhere.bin' must be relative, without '..'" in text
    assert "'pool_len' has no valid min/opt/max in profile 'prefill'" in text


def test_cli_commands(fp32_export, tmp_path):
    from clover_export.cli import main

    out, _ = fp32_export
    r = CliRunner().invoke(main, ["check", str(out)])
    assert r.exit_code == 0 and "0 failure(s)" in r.output
    r = CliRunner().invoke(main, ["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no such model folder" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["validate", str(out), "--steps", "1"])
    assert r.exit_code == 0 and "PASSED" in r.output

"""`build` at the real model's size, on small models: no fp32 weight copy, FP8 weights written
once and shared, full-width slice validation, layer-streamed calibration, the disk plan, resume after Ctrl-C.

One fp8 build of a random 4-layer tiny (bf16 checkpoint, slice validation) is interrupted inside the FP8
weight stage and then rerun; the finished folder serves the other tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from clover_export.core.errors import CloverError
from clover_export.pipeline import build as B
from clover_export.pipeline.checks import validation_mode
from clover_export.pipeline.context import Stages
from clover_export.quantize import weights as fp8_weights
from clover_export.testing.logs import log_lines

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
OPTS = dict(precision="fp8", max_batch=2, max_context=64, chunk=16, validation="slice")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(tmp_path_factory.mktemp("ckpt") / "model", seed=11, dtype=torch.bfloat16,
                                num_hidden_layers=4, layer_types=LAYERS)


@pytest.fixture(scope="module")
def resumed(model, tmp_path_factory):
    """(out, first log, second log): the first build is interrupted after 3 FP8 tensors, the second finishes."""
    out = tmp_path_factory.mktemp("build") / "out"
    logs: list[list[str]] = [[], []]
    real, calls = fp8_weights.quantize_weight, []

    def interrupting(w):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(w)

    from clover_export.core.names import EMBED, LM_HEAD
    from clover_export.quantize import stream_calib

    streamed, handed = stream_calib.streamed_model, [[], []]  # per build: what each streamed model was handed

    def recording(run):
        def streamed_model(*a, preloaded=None, **k):
            handed_now = dict(preloaded or {})
            m = streamed(*a, preloaded=preloaded, **k)
            params = {EMBED: m.model.embed_tokens.weight, LM_HEAD: m.lm_head.weight}
            # taken: the model's own parameter is the tensor handed (on a GPU it is copied there)
            handed[run].append({n: params[n].device.type != "cpu" or params[n].data_ptr() == t.data_ptr()
                                for n, t in handed_now.items()})
            return m
        return streamed_model

    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_weights, "quantize_weight", interrupting)
    mp.setattr(stream_calib, "streamed_model", recording(0))
    try:
        with pytest.raises(KeyboardInterrupt), log_lines() as logs[0]:
            B.build(model, out, B.BuildOptions(**OPTS))
    finally:
        mp.undo()
    state = {"stages": json.loads((out / "build.json").read_text())["stages"],
             "entries": sorted(p.name for p in out.iterdir()), "handed": handed}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream_calib, "streamed_model", recording(1))
        with log_lines() as logs[1]:
            B.build(model, out, B.BuildOptions(**OPTS))
    return out, logs, state


# --- resume ---------------------------------------------------------------------------------
def test_interrupted_stage_leaves_nothing_half_written(resumed):
    _, _, state = resumed
    assert {"export-fp32", "validate-slices", "export-bf16", "calibrate"} <= set(state["stages"])
    assert "fp8-weights" not in state["stages"]
    assert "fp8-weights" not in state["entries"]
    assert not [e for e in state["entries"] if e.startswith(".")], state["entries"]  # no temp folder left


def test_rerun_continues_from_the_finished_stages(resumed):
    out, logs, _ = resumed
    text = "\n".join(logs[1])
    for line in ("[export fp32] reused", "[validate slices] reused", "[export bf16] reused", "[calibrate] reused"):
        assert line in text, text
    assert "[quantize] fp8-weights:" in text and "[quantize] onnx-fp8-bf16:" in text
    assert (out / "onnx-fp8-bf16" / "manifest.json").exists()


def test_background_fp8_weights_stop_with_the_build_and_keep_what_finished(model, resumed, tmp_path, monkeypatch):
    """The FP8 weight file is written in a thread beside the CPU-bound stages (pipeline/background.py).
    Interrupted mid-way by the build's own thread: nothing of it is left and the thread has stopped.
    Finished when a later stage fails: it is recorded, and the next run reuses it."""
    import threading
    import time

    from clover_export.quantize import calibration

    out, logs = tmp_path / "out", [[], []]
    real_q = fp8_weights.quantize_weight

    calibrating = threading.Event()

    def slow(w):  # still writing when calibration starts
        calibrating.wait(120)
        time.sleep(0.2)
        return real_q(w)

    def interrupted(*a, **k):
        calibrating.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(fp8_weights, "quantize_weight", slow)
    monkeypatch.setattr(calibration, "calibrate", interrupted)
    with pytest.raises(KeyboardInterrupt), log_lines() as logs[0]:
        B.build(model, out, B.BuildOptions(**OPTS))
    assert any("writing in the background" in line for line in logs[0])
    assert not [t for t in threading.enumerate() if t.name == "fp8-weights"]
    entries = sorted(p.name for p in out.iterdir())
    assert "fp8-weights" not in entries and not [e for e in entries if e.startswith(".")], entries
    assert "fp8-weights" not in json.loads((out / "build.json").read_text())["stages"]

    def fails_after_the_writer(*a, **k):
        for t in threading.enumerate():
            if t.name == "fp8-weights":
                t.join()
        raise RuntimeError("calibration failed")

    monkeypatch.setattr(fp8_weights, "quantize_weight", real_q)
    monkeypatch.setattr(calibration, "calibrate", fails_after_the_writer)
    (out / ".fp8-weights.killed").mkdir()  # as a writer killed outright (SIGKILL) leaves its temp folder
    (out / ".fp8-weights.killed" / fp8_weights.FP8_BIN).write_bytes(b"partial")
    with pytest.raises(RuntimeError, match="calibration failed"), log_lines() as logs[1]:
        B.build(model, out, B.BuildOptions(**OPTS))
    assert "fp8-weights" in json.loads((out / "build.json").read_text())["stages"]
    assert (out / "fp8-weights" / fp8_weights.FP8_BIN).exists()
    assert not (out / ".fp8-weights.killed").exists()
    # recorded under the key a finished build of the same model and options records (so the next run reuses it)
    finished = json.loads((resumed[0] / "build.json").read_text())["stages"]["fp8-weights"]["key"]
    assert Stages(out).done("fp8-weights", finished, out / "fp8-weights")


# --- no fp32 weight copy, FP8 weights once ------------------------------------------------
def _files(folder: Path):
    return [p for p in folder.rglob("*") if p.is_file()]


def test_no_fp32_weight_file_at_any_stage(resumed, model):
    """The only weight files besides the FP8 file are the checkpoint's own bf16 shards: linked, or where the
    filesystem has no reflinks and the checkpoint is small, copied (exporter/weights.py)."""
    import filecmp

    out, _, _ = resumed
    shards = {p.name: p for p in model.glob("*.safetensors")}
    for p in _files(out):
        assert p.name != "converted.bin", p
        if p.name in shards and filecmp.cmp(p, shards[p.name], shallow=False):
            continue
        assert p.suffix in (".onnx", ".json", ".bin", ".jinja", ".txt", ".model") or p.name.startswith("tokenizer"), p
    proto = onnx.load(str(out / "onnx-fp32" / "model.onnx"), load_external_data=False)
    ext = [t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert ext and all(t.data_type == TensorProto.BFLOAT16 for t in ext)  # the shards' bf16, cast in the graph
    checkpoint = sum(p.stat().st_size for p in shards.values())
    for g in ("onnx-fp32", "onnx-bf16"):
        w = json.loads((out / g / "manifest.json").read_text())["weights"]
        assert w["bytes_converted"] == 0 and w["weight_bytes_written"] in (0, checkpoint), w  # linked, or copied


def test_fp8_weights_written_once_and_shared(resumed):
    out, _, _ = resumed
    bins = [p for p in _files(out) if p.suffix == ".bin"]
    assert sorted(p.relative_to(out).as_posix() for p in bins) == [
        "fp8-weights/fp8.bin", "onnx-fp8-bf16/weights/fp8.bin", "onnx-fp8/weights/fp8.bin"]
    # written once; a file above COPY_BELOW is reflinked or hard-linked into both graphs, a small one (this
    # model's) copied, so that plain onnx.load reads the folders (docs/exports.md)
    from clover_export.artifact.manifest import COPY_BELOW

    assert bins[0].stat().st_size <= COPY_BELOW
    assert len({p.stat().st_ino for p in bins}) == 3 and len({p.read_bytes() for p in bins}) == 1, bins
    index = json.loads((out / "fp8-weights" / fp8_weights.FP8_INDEX).read_text())
    assert bins[0].stat().st_size == index["bytes_written"]


def test_fp8_graph_from_shared_weights_matches_the_per_graph_quantization(resumed, tmp_path):
    """The fp32-activation FP8 graph built from the shared file computes what a stand-alone rewrite computes."""
    from clover_export.artifact.manifest import load_artifact
    from clover_export.exporter.session import ort_session
    from clover_export.quantize.graph import quantize_graph
    from clover_export.verify.scenario import NUM_SLOTS, initial_pools, make_feeds, pool_len, scenario

    out, _, _ = resumed
    amax = json.loads((out / "build.json").read_text())["stages"]["calibrate"]["result"]["amax"]
    quantize_graph(out / "onnx-fp32", tmp_path / "alone", amax)
    outs = []
    for folder in (out / "onnx-fp8", tmp_path / "alone"):
        art = load_artifact(folder)
        plans = scenario(art.block_size, art.chunk)[:1]
        feeds = {**make_feeds(plans, art.config, art.block_size)[0],
                 **initial_pools(art, NUM_SLOTS, pool_len(plans, art.block_size))}
        outs.append(ort_session(art, ["CPUExecutionProvider"]).run(None, feeds)[0])
    np.testing.assert_array_equal(outs[0], outs[1])


# --- slice validation ---------------------------------------------------------------------
def test_slice_validation_ran_and_passed(resumed):
    out, logs, _ = resumed
    rec = json.loads((out / "build.json").read_text())["stages"]["validate-slices"]["result"]
    assert (
        rec["passed"]
        and len(rec["lines"]) == 1
        and "layers 0 (linear_attention), 1 (full_attention)" in rec["lines"][0]
    )
    assert any("[validate] a slice at full width" in line for line in logs[0])


def test_slice_hands_its_embedding_and_lm_head_to_the_streamed_calibration(model, resumed, tmp_path):
    """The slice's reference reads the embedding (as stored) and the fp32 lm_head; the streamed calibration
    after it takes those tensors (not read, cast and paged in again: 3 GiB at full size) and calibrates
    exactly as when it reads them itself; a tensor not as the model keeps it is read instead."""
    from clover_export.core.checkpoint import load_state_dict
    from clover_export.core.config import load_config
    from clover_export.core.names import EMBED, LM_HEAD
    from clover_export.quantize.calibration import BUILTIN_PROMPTS, calibrate, prompt_batch
    from clover_export.quantize.stream_calib import streamed_model
    from clover_export.verify import slice as S

    keep: dict = {}
    assert S.validate_slices(model, tmp_path / "w", 8, 16, 2, keep=keep).passed
    stored = load_state_dict(model, load_config(model))
    assert set(keep) == {EMBED, LM_HEAD}
    assert keep[EMBED].dtype == torch.bfloat16 and torch.equal(keep[EMBED], stored[EMBED])
    assert keep[LM_HEAD].dtype == torch.float32 and torch.equal(keep[LM_HEAD], stored[LM_HEAD].float())
    took = streamed_model(model, 8, device="cpu", preloaded=keep)
    assert took.model.embed_tokens.weight.data_ptr() == keep[EMBED].data_ptr()
    assert took.lm_head.weight.data_ptr() == keep[LM_HEAD].data_ptr()
    batch = prompt_batch(model, BUILTIN_PROMPTS[:2], 8)
    assert calibrate(model, batch, 8, model=took) == calibrate(model, batch, 8,
                                                             model=streamed_model(model, 8, device="cpu"))
    wrong = streamed_model(model, 8, device="cpu", preloaded={LM_HEAD: stored[LM_HEAD]})  # bf16: not as kept
    assert wrong.lm_head.weight.dtype == torch.float32 and wrong.lm_head.weight.data_ptr() != stored[LM_HEAD].data_ptr()
    # and the build wires them through: the run that validated the slice handed both to its calibration
    out, logs, state = resumed
    ran = [i for i in (0, 1) if any("[calibrate] " in s and " prompts," in s for s in logs[i])]
    assert ran and all(any("[validate slices] slice of" in s for s in logs[i]) for i in ran)
    assert all(state["handed"][i][0] == {EMBED: True, LM_HEAD: True} for i in ran), state["handed"]


def test_slice_validation_catches_a_wrong_layer(model, tmp_path, monkeypatch):
    """The slice holds the first GDN (0) and attention (1) layers; the graph gets layer 3's attention weights
    in place of layer 1's: the GDN state still matches, the attention layer's K/V and the logits do not."""
    from clover_export.verify import slice as S

    good = S.validate_slices(model, tmp_path / "w", 8, 16, 2)
    assert (good.layers, good.passed) == ([0, 1], True), good.report
    monkeypatch.setattr(S, "graph_plans", lambda plans, layers: S.slice_plans(plans, [0, 3]))
    bad = S.validate_slices(model, tmp_path / "w", 8, 16, 2)
    assert bad.passed is False and "FAIL" in bad.report
    failing = {line.split()[1] for line in bad.report.splitlines() if line.startswith("  FAIL ")}
    assert "logits" in failing and "present.1.key" in failing and not any(".0." in n for n in failing), failing
    assert "slice layer -> model layer: 0 -> 0 (linear_attention), 1 -> 1 (full_attention)" in bad.report
    assert not (tmp_path / "w").exists()  # the slice graphs are transient


def test_auto_validation_picks_slices_when_the_whole_graph_does_not_fit(model, monkeypatch):
    from clover_export.core.config import load_config
    from clover_export.verify import slice as S

    cfg = load_config(model)
    monkeypatch.setattr(S, "available_memory", lambda: 10 * S.whole_validation_bytes(cfg))
    assert validation_mode(cfg, B.BuildOptions())[0] is True
    monkeypatch.setattr(S, "available_memory", lambda: S.whole_validation_bytes(cfg))
    whole, why = validation_mode(cfg, B.BuildOptions())
    assert whole is False and "GiB" in why


# --- calibration ----------------------------------------------------------------------------
def test_layer_streamed_calibration_equals_whole_model_calibration(model):
    from clover_export.quantize.calibration import BUILTIN_PROMPTS, calibrate, calibration_steps, prompt_batch
    from clover_export.quantize.stream_calib import resident_layers, streamed_model

    whole_steps = calibration_steps(model, BUILTIN_PROMPTS[:4], 8)
    whole = calibrate(model, whole_steps, 8)
    # the prompt batch played directly (prefill once, its own fill for the denoise step) is the same calibration
    assert calibrate(model, prompt_batch(model, BUILTIN_PROMPTS[:4], 8), 8) == whole
    streamed = streamed_model(model, 8, device="cpu")
    seen, loads = [], []
    for layer in streamed.model.layers:
        layer.register_forward_hook(lambda m, a, o: seen.append(resident_layers(streamed)))
        layer.register_forward_pre_hook(lambda m, a: loads.append(1))
    steps = calibration_steps(model, BUILTIN_PROMPTS[:4], 8, model=streamed)
    for a, b in zip(whole_steps, steps):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    loads.clear()
    heads = []
    streamed.lm_head.register_forward_hook(lambda m, a, o: heads.append(1))
    got = calibrate(model, prompt_batch(model, BUILTIN_PROMPTS[:4], 8), 8, model=streamed)
    assert len(loads) == 2 * len(streamed.model.layers)  # two passes over the weights: prefill, denoise
    assert len(heads) == 1 and "logits" not in vars(streamed)  # the denoise step's logits are not computed
    # ... unless the lm_head is quantized too: then both steps' inputs to it count
    from clover_export.model.loading import load_model

    whole_model, seen_head = load_model(model, torch.float32, block_size=8), []
    whole_model.lm_head.register_forward_pre_hook(lambda m, a: seen_head.append(float(a[0].abs().max())))
    with_head = calibrate(model, prompt_batch(model, BUILTIN_PROMPTS[:4], 8), 8, include_lm_head=True,
                          model=whole_model)
    assert len(seen_head) == 2 and with_head["lm_head.weight"] == max(seen_head)
    assert got.keys() == whole.keys() and len(got) > 0
    for k in whole:  # routed experts on row subsets: fp32 GEMM rounding of other shapes only
        assert got[k] == pytest.approx(whole[k], rel=1e-5, abs=0), k
    # our forward hook runs after the streaming hook: at most the layer itself was resident, nothing after
    assert seen and all(r == [] for r in seen)
    assert resident_layers(streamed) == []


def test_streamed_layers_read_ahead_into_reused_buffers(model, tmp_path):
    """Per-expert checkpoint: layer i + 1 is read in a thread while layer i runs, into one of two arenas that
    every layer reuses (experts, and the other weights cast in two more), its experts used from there (views,
    no copy); the read-ahead gives the same
    calibration as reading each layer on entry, and both the same as the whole model."""
    from clover_export.core.checkpoint import load_state_dict
    from clover_export.core.config import load_config
    from clover_export.quantize.calibration import BUILTIN_PROMPTS, calibrate, prompt_batch
    from clover_export.quantize.stream_calib import streamed_model
    from clover_export.tiny import write_model_folder

    ckpt = write_model_folder(tmp_path / "per-expert", load_state_dict(model, load_config(model)),
                              json.loads((model / "config.json").read_text()), per_expert=True)
    assert any(
        ".experts.0." in n for n in json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    )
    batch = prompt_batch(ckpt, BUILTIN_PROMPTS[:2], 8)
    plain = calibrate(ckpt, batch, 8, model=streamed_model(ckpt, 8, device="cpu", read_ahead=False))
    streamed = streamed_model(ckpt, 8, device="cpu")
    loader, storages, dense = streamed.stream_loader, set(), set()

    def arenas(m, a):
        gate_up, down = loader.experts
        assert len(gate_up) == len(down) == m.mlp.cfg.num_experts and len(gate_up[0]) == 2  # gate, up: as read
        assert all(p.device.type == "meta" for n, p in m.named_parameters() if ".experts." in n)
        storages.update(t.untyped_storage().data_ptr() for blocks in (gate_up, down) for grp in blocks for t in grp)
        dense.update(p.untyped_storage().data_ptr() for n, p in m.named_parameters() if ".experts." not in n)

    for layer in streamed.model.layers:
        layer.register_forward_pre_hook(arenas)
    assert calibrate(ckpt, batch, 8, model=streamed) == plain
    assert len(storages) == 2  # two alternating arenas for 4 layers x 2 steps
    assert len(dense) == 2  # the other weights too: the same pages every time (fresh ones cost ~1 s a GiB)
    whole = calibrate(ckpt, batch, 8)
    assert plain.keys() == whole.keys()
    for k in whole:
        assert plain[k] == pytest.approx(whole[k], rel=1e-5, abs=0), k


def test_routed_moe_core_equals_the_dense_core():
    from clover_export.model.moe import moe_core
    from clover_export.quantize.stream_calib import routed_moe_core

    g = torch.Generator().manual_seed(0)
    B, T, D, E, I, N = 3, 12, 16, 10, 8, 4
    args = (
        torch.randn(B, T, D, generator=g, dtype=torch.float64),
        torch.randn(E, D, generator=g, dtype=torch.float64),
        torch.randn(E, 2 * I, D, generator=g, dtype=torch.float64),
        torch.randn(E, D, I, generator=g, dtype=torch.float64),
    )
    for coreset in (True, False):
        want, wd = moe_core(*args, 3, 0.9, coreset, N)
        got, gd = routed_moe_core(*args, 3, 0.9, coreset, N)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(gd, wd)


@pytest.mark.parametrize("blocks", [False, True])
def test_routed_moe_core_casts_stored_experts_exactly(blocks):
    """bf16 experts (fused, or per expert as row blocks, as a per-expert checkpoint is read) under an fp32
    model: each expert cast into reused buffers gives the dense core on the fp32 casts, every expert routed."""
    from clover_export.model.moe import moe_core
    from clover_export.quantize.stream_calib import routed_moe_core

    g = torch.Generator().manual_seed(1)
    B, T, D, E, I, N = 2, 40, 16, 6, 8, 4
    x, router = torch.randn(B, T, D, generator=g), torch.randn(E, D, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g).bfloat16()
    down = torch.randn(E, D, I, generator=g).bfloat16()
    want, wd = moe_core(x, router, gate_up.float(), down.float(), 2, 1.0, False, N)
    args = ([(w[:I], w[I:]) for w in gate_up], [(w,) for w in down]) if blocks else (gate_up, down)
    got, gd = routed_moe_core(x, router, *args, 2, 1.0, False, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 GEMMs on row subsets: rounding only
    assert torch.equal(gd, wd)


def test_streamed_layers_hold_one_layer_at_a_time(model):
    from clover_export.quantize.calibration import BUILTIN_PROMPTS, calibration_steps
    from clover_export.quantize.stream_calib import resident_layers, streamed_model

    streamed = streamed_model(model, 8, device="cpu")
    during = []
    for layer in streamed.model.layers:
        layer.register_forward_pre_hook(lambda m, a: during.append(resident_layers(streamed)))
    calibration_steps(model, BUILTIN_PROMPTS[:2], 8, model=streamed)
    assert during and all(len(r) <= 1 for r in during)
    # pre-hooks run in registration order: ours (added last) sees the layer loaded by the streaming hook
    assert all(len(r) == 1 for r in during)


# --- quantization ---------------------------------------------------------------------------
def test_zero_and_constant_tensors_get_finite_scales(tmp_path):
    from safetensors.torch import save_file

    from clover_export.core.checkpoint import TensorPlan, read_header

    tensors = {
        "zero": torch.zeros(3, 4, 8, dtype=torch.bfloat16),
        "const": torch.full((5, 8), -2.5, dtype=torch.bfloat16),
        "mixed": torch.cat([torch.zeros(2, 8), torch.randn(2, 8)]).to(torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    locs = read_header(tmp_path / "w.safetensors")
    plans = {n: TensorPlan(n, tuple(t.shape), ((locs[n],),), True) for n, t in tensors.items()}
    w = fp8_weights.quantize_weights(plans, list(plans), tmp_path / "fp8")
    raw = (tmp_path / "fp8" / fp8_weights.FP8_BIN).read_bytes()
    for n, t in tensors.items():
        e = w.index[n]
        off, length, shape = e["scale"]
        s = np.frombuffer(raw[off:off + length], np.float32).reshape(shape)
        q = torch.frombuffer(bytearray(raw[e["fp8"][0]:e["fp8"][0] + e["fp8"][1]]), dtype=torch.uint8)
        q = q.view(torch.float8_e4m3fn).float().reshape(t.shape)
        assert np.isfinite(s).all() and (s > 0).all(), n
        back = q * torch.from_numpy(s.copy()).unsqueeze(-1)
        torch.testing.assert_close(back, t.float(), rtol=2**-4, atol=0)
    planned = fp8_weights.fp8_bytes({n: tuple(t.shape) for n, t in tensors.items()})  # the disk plan's figure
    assert 0 <= planned - w.bytes_written < fp8_weights.ALIGN  # the file ends without the last page's padding


# --- disk plan ------------------------------------------------------------------------------
def test_disk_plan_refuses_up_front_with_the_figures(model, tmp_path, monkeypatch):
    from clover_export.pipeline import disk_plan

    monkeypatch.setattr(disk_plan, "free_bytes", lambda path: 100 * 2**20)
    out = tmp_path / "out"
    with pytest.raises(CloverError) as e, log_lines() as logged:
        B.build(model, out, B.BuildOptions(**OPTS))
    msg = str(e.value)
    assert msg.startswith("[build] not enough free disk space") and "fp8-weights" in msg and "0.10 GiB free" in msg
    assert msg.count("\n") == 1 and msg.endswith("Note: nothing was written")  # one line (and the note)
    assert any("DOES NOT FIT" in line for line in logged)  # the plan's figures, logged
    assert not out.exists()  # nothing written


def test_disk_plan_counts_fp8_weights_once_and_reused_stages_as_zero(model, tmp_path):
    from clover_export.core.config import load_config
    from clover_export.engines.builder import tensorrt_version
    from clover_export.pipeline.checks import check_inputs
    from clover_export.pipeline.disk_plan import GRAPH_BYTES, fp8_weight_file_bytes, plan_disk
    from clover_export.pipeline.stages import FP8_WEIGHTS

    cfg = load_config(model)
    ctx = check_inputs(model, tmp_path / "out", B.BuildOptions(**OPTS))  # the plan the build would log
    plan = ctx.disk
    assert plan.stages["fp8-weights"] == fp8_weight_file_bytes(cfg) > 0
    assert plan.stages["quantize-onnx-fp8"] == plan.stages["quantize-onnx-fp8-bf16"] == GRAPH_BYTES  # links fp8.bin
    if tensorrt_version() is None:
        assert "engine" not in plan.stages
    ctx.stages.record(FP8_WEIGHTS.name, ctx.key(FP8_WEIGHTS), {})  # done by an earlier run, its folder there
    (tmp_path / "out" / FP8_WEIGHTS.folder).mkdir()
    reused = plan_disk(ctx, ctx.plan)
    assert reused.stages["fp8-weights"] == 0 and reused.total == plan.total - plan.stages["fp8-weights"]
    big = check_inputs(model, tmp_path / "big", B.BuildOptions(**{**OPTS, "precision": "bf16", "weights": "copy"}))
    shards = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    stages = big.disk.stages
    assert stages["export-fp32"] >= shards and math.isclose(stages["export-bf16"], stages["export-fp32"])
    assert "fp8-weights" not in stages


def test_bf16_export_runs_in_a_background_process(resumed):
    """At full size (slice validation) the bf16 export runs in a child process beside the build's own stages
    and is collected after calibrating (pipeline/background.py); its graph is the one the FP8 stages use."""
    out, logs, _ = resumed
    assert "[export bf16] in a background process beside the stages below" in logs[0]
    text = "\n".join(logs[0])
    line = next(line for line in logs[0] if line.startswith("[export bf16] onnx-bf16 in "))
    assert "in a background process (waited" in line
    assert text.index("[calibrate] ") < text.index(line)
    fp32 = next(line for line in logs[0] if line.startswith("[export fp32] onnx-fp32 in "))
    assert "background" not in fp32 and text.index(fp32) < text.index("[validate slices] slice of layers")
    assert (out / "onnx-bf16" / "manifest.json").exists()


# --- everything checked before the first stage, at full size -------------------------------------------------
@pytest.fixture(scope="module")
def fullsize_without_tokenizer(tmp_path_factory) -> Path:
    """The Clover-35B-A3B checkpoint as sparse files (real headers, zero data, ~69 GB apparent, a few MB on disk),
    its tokenizer removed."""
    from clover_export.testing.fullsize import write_sparse_checkpoint

    ckpt = tmp_path_factory.mktemp("fullsize") / "checkpoint"
    write_sparse_checkpoint(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (ckpt / name).unlink()
    return ckpt


def test_fullsize_fp8_build_without_a_tokenizer_fails_in_seconds_writing_nothing(fullsize_without_tokenizer, tmp_path):
    """The fp8 calibration needs the tokenizer: missing, the build fails before its first stage (it used to
    write the FP8 weights and export for minutes first), within 10 s, the real CLI in a process of its own."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    ckpt, out = fullsize_without_tokenizer, tmp_path / "out"
    before = sorted(p.name for p in ckpt.iterdir())
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "clover_export.cli", "build", str(ckpt), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:  # a stage started after all (it writes ~0.5 GB/s): stop it and its children
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - t
    written = sorted(p.name for p in tmp_path.iterdir())
    for p in tmp_path.iterdir():  # what a regression wrote goes now, not with pytest's old temp folders
        shutil.rmtree(p, ignore_errors=True)
    assert proc.returncode == 1 and "Traceback" not in stderr, (proc.returncode, stdout[-2000:], stderr[-2000:])
    assert f"[tokenizer] {ckpt / 'tokenizer.json'}: file not found" in stderr, stderr
    assert "[export" not in stdout and "[quantize]" not in stdout, stdout
    assert seconds < 10, f"{seconds:.1f} s"
    assert written == [] and sorted(p.name for p in ckpt.iterdir()) == before


def test_background_export_hands_back_errors_and_stops_cleanly(model, tmp_path):
    import time

    from clover_export.pipeline.background import BackgroundExport

    job = BackgroundExport(model=tmp_path / "missing", out=tmp_path / "a", dtype="bf16")
    with pytest.raises(CloverError) as e:  # crossed the process boundary with its parts
        job.result()
    assert str(tmp_path / "missing") in str(e.value) and e.value.component and e.value.message
    job.stop()
    out = tmp_path / "b"
    job = BackgroundExport(model=model, out=out, dtype="bf16", max_batch=2, max_len=64, chunk=16)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".b.*")) and time.monotonic() < deadline:  # the export is under way
        time.sleep(0.05)
    assert list(tmp_path.glob(".b.*")), "the background export never started writing"
    job.stop()  # SIGINT: the child removes its temporary folder and exits
    assert not job._proc.is_alive() and not out.exists() and not list(tmp_path.glob(".b.*"))


def test_ctrl_c_in_the_cli_says_how_to_continue(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from clover_export.cli import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "build", interrupted)
    r = CliRunner().invoke(main, ["build", "tiny", "--out", str(tmp_path / "b"), "--validation", "slice"])
    assert r.exit_code == 130
    assert "interrupted" in r.output and "run the same command again" in r.output and "Traceback" not in r.output


def test_sparse_holes_quantize_to_zeros_without_reading(tmp_path, monkeypatch):
    """A sparse shard (header, then a hole): SEEK_DATA says hole, nothing is read, q = 0 and scales 1."""
    import struct

    from clover_export.core.checkpoint import TensorPlan, read_header

    shape, n = (4, 1024, 1024), 4 * 1024 * 1024 * 2
    header = json.dumps({"w": {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, n]}}).encode()
    header += b" " * ((-len(header)) % 8)
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + n)
    loc = read_header(path)["w"]
    per_expert = n // shape[0]
    if not fp8_weights._is_hole(path, loc.offset + per_expert, per_expert):
        pytest.skip("this filesystem reports no holes (SEEK_DATA)")
    assert not fp8_weights._is_hole(path, 0, 16)  # the header is data
    reads, real = [], fp8_weights.np.memmap
    monkeypatch.setattr(fp8_weights.np, "memmap", lambda *a, **k: reads.append(k["offset"]) or real(*a, **k))
    w = fp8_weights.quantize_weights({"w": TensorPlan("w", shape, ((loc,),), True)}, ["w"], tmp_path / "fp8")
    raw = (tmp_path / "fp8" / fp8_weights.FP8_BIN).read_bytes()
    e = w.index["w"]
    assert raw[e["fp8"][0]:e["fp8"][0] + e["fp8"][1]] == bytes(math.prod(shape))
    off, length, s_shape = e["scale"]
    assert s_shape == [4, 1024] and (np.frombuffer(raw[off:off + length], np.float32) == 1.0).all()
    assert reads == [loc.offset]  # only expert 0, which shares its first page with the header, was read

"""The `triton` runtime backend: kernels under TRITON_INTERPRET=1 against the torch backend, bad input.

The interpreter must be on before triton is imported, so the kernel checks
run in a child process (this file as a script); each test reads its case's
result. The references are independent of the kernels: the torch backend
(plain-torch cores) and the reference MoE on dequantized weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

from clover_export.core.errors import CloverError


# ----------------------------------------------------------------- the checks (run in the child)
class EagerGraph:
    """A stand-in for a captured CUDA graph on the CPU: replay = the step on the static buffers, results into
    the static outputs."""

    def __init__(self, fn, static, out):
        self.fn, self.static, self.out = fn, static, out

    def replay(self):
        for dst, src in zip(self.out, self.fn(self.static)):
            dst.copy_(src)


def install_eager_graph(graphs, bucket, fn) -> None:
    """Put an EagerGraph where StepGraphs keeps the bucket's (graph, static inputs, static outputs)."""
    static = graphs._static_inputs(bucket)
    out = tuple(t.clone() for t in fn(static))
    graphs.graphs[bucket] = (EagerGraph(fn, static, out), static, out)


def tokens_case():
    """Greedy tokens of a batch whose requests are in different phases: torch == triton (embedded default)."""
    from clover_export.runtime import Generator

    prompts = [("sort 3 1 2", 40), ("reverse 7 4", 8)]
    out, phases = {}, []
    for be in ("torch", "triton"):
        gen = Generator.load(None, backend=be, device="cpu", dtype="fp32", max_slots=2, prefill_chunk=64)
        if be == "triton":
            gen.runner.observer = lambda plan, _: phases.append((list(plan.n_causal), list(plan.has_block)))
        first = gen.submit(prompts[0][0], max_new_tokens=prompts[0][1], enable_thinking=False,
                           ignore_eos=True)  # past its short answer: two blocks, still decoding as the second joins
        gen.step()  # the second request joins while the first one decodes
        second = gen.submit(prompts[1][0], max_new_tokens=prompts[1][1], enable_thinking=False)
        out[be] = [r.token_ids for r in gen.wait([first, second])]
    return {"torch": out["torch"], "triton": out["triton"], "phases": phases}


def fp8_case():
    """One step with experts quantized at load (CoresetMoEFP8 kernels) vs the torch backend on the dequantized
    experts."""
    import torch

    from clover_export.backends.fp8_experts import expert_names
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.backends.triton_backend import TritonBackend
    from clover_export.core import names
    from clover_export.quantize.scales import dequantize

    fp8 = TritonBackend.load(None, device="cpu", fp8_experts=True)
    ref = TorchBackend.load(None, device="cpu", dtype="fp32")
    with torch.no_grad():
        for name in expert_names(ref.model):
            w8 = fp8.model.get_parameter(name)
            gu = fp8.moe.fp8.scales(w8, w8)[0]
            ref.model.get_parameter(name).copy_(dequantize(w8, gu))
    B, C, N = 2, 3, fp8.block_size
    g = torch.Generator().manual_seed(0)
    inputs = {
        names.INPUT_IDS: torch.randint(6, 500, (B, C + N), generator=g, dtype=torch.int32),
        names.N_CAUSAL: torch.tensor([3, 1], dtype=torch.int32),
        names.HAS_BLOCK: torch.ones(B, dtype=torch.int32),
        names.SLOT_IDS: torch.tensor([1, 0], dtype=torch.int32),
        names.PAST_LEN: torch.zeros(B, dtype=torch.int32),
    }
    got, cs, _ = fp8.step(inputs, fp8.allocate_pools(2, 64))
    want, cs_ref, _ = ref.step(inputs, ref.allocate_pools(2, 64))
    dtypes = sorted({str(fp8.model.get_parameter(n).dtype) for n in expert_names(fp8.model)})
    return {"max_abs": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "coreset_equal": bool(torch.equal(cs, cs_ref)), "expert_dtypes": dtypes}


def padding_case():
    """CoresetMoE with n_causal: padding causal rows select no expert; every valid row's output is unchanged."""
    import torch

    from clover_export.plugins.triton.ops import coreset_moe, moe_route

    g = torch.Generator().manual_seed(0)
    B, Tc, N, D, E, I, k = 2, 4, 3, 32, 8, 16, 2
    x = torch.randn(B, Tc + N, D, generator=g)
    rw, gu, dn = (
        torch.randn(E, D, generator=g),
        torch.randn(E, 2 * I, D, generator=g) * 0.1,
        torch.randn(E, D, I, generator=g) * 0.1,
    )
    nc = torch.tensor([1, 4], dtype=torch.int32)
    full, d_full = coreset_moe(x, rw, gu, dn, k, 0.9, True, N)
    masked, d_masked = coreset_moe(x, rw, gu, dn, k, 0.9, True, N, n_causal=nc)
    idx, w, _ = moe_route(x, rw, k, 0.9, True, N, n_causal=nc)
    valid = torch.ones(B, Tc + N, dtype=torch.bool)
    valid[0, 1:Tc] = False
    return {"valid_equal": bool(torch.equal(masked[valid], full[valid])),
            "padding_zero": bool(torch.equal(masked[~valid], torch.zeros_like(masked[~valid]))),
            "padding_idx_none": bool((idx[~valid] == E).all()), "padding_w_zero": bool((w[~valid] == 0).all()),
            "valid_idx_some": bool((idx[valid] < E).all()), "distinct_equal": bool(torch.equal(d_full, d_masked))}


def causal_logits_case():
    """One step's causal_logits (valid causal rows, block rows, an index past the step's rows): the triton
    backend eager and through a CUDA-graph bucket (a stand-in graph replaying `_run` on the bucket's static
    buffers: no CUDA here) against the torch backend."""
    import torch

    from clover_export.backends.cuda_graphs import Bucket, StepGraphs
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.backends.triton_backend import TritonBackend
    from clover_export.core import names

    tri = TritonBackend.load(None, device="cpu")
    ref = TorchBackend.load(None, device="cpu", dtype="fp32")
    N, slots = tri.block_size, 3
    B, C = 2, 3
    g = torch.Generator().manual_seed(0)
    i32 = dict(dtype=torch.int32)
    inputs = {names.INPUT_IDS: torch.randint(6, 500, (B, C + N), generator=g, **i32),
              names.N_CAUSAL: torch.tensor([3, 2], **i32), names.HAS_BLOCK: torch.tensor([1, 0], **i32),
              names.SLOT_IDS: torch.tensor([2, 0], **i32), names.PAST_LEN: torch.tensor([4, 0], **i32),
              names.LOGIT_ROWS: torch.tensor([[2, 0, C + 5, 500], [1, 0, C, C + N - 1]], **i32)}
    pools = tri.allocate_pools(slots, 64)  # + the scratch slot (no graphs on the CPU)
    for p in pools.values():
        p.normal_(0, 0.3, generator=g)
    start = {k: v.clone() for k, v in pools.items()}
    want = ref.step(inputs, {k: v.clone() for k, v in start.items()})
    eager = tri.step(inputs, pools)

    graph_pools = {k: v.clone() for k, v in start.items()}
    fn = lambda inp: tri._run(inp, graph_pools)  # noqa: E731

    b = Bucket(4, N + 1)
    graphs = StepGraphs(fn, [b], N, slots, torch.device("cpu"))
    install_eager_graph(graphs, b, fn)
    bucket = graphs.replay(b, inputs)
    err = lambda a, w: float((a - w).abs().max())  # noqa: E731
    return {"shape": list(eager.causal_logits.shape), "bucket_shape": list(bucket[2].shape),
            "eager": err(eager.causal_logits, want.causal_logits), "bucket": err(bucket[2], want.causal_logits),
            "bucket_logits": err(bucket[0], want[0]), "scale": float(want.causal_logits.abs().max()),
            "V": ref.cfg.vocab_size}


CASES = {"tokens": tokens_case, "fp8": fp8_case, "padding": padding_case, "causal_logits": causal_logits_case}


def _child(names: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            results[name] = {"ok": True, "info": CASES[name]()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc(limit=6)}
    print("RESULTS " + json.dumps(results))


def run_child(*names: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, *names], env=env, capture_output=True, text=True, timeout=1200)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line, f"the interpreter child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(line[len("RESULTS "):])
    for name in names:
        assert res[name]["ok"], res[name]["error"]
    return {n: res[n]["info"] for n in names}


# ----------------------------------------------------------------- pytest side
def test_padding_causal_rows_select_no_expert():
    r = run_child("padding")["padding"]
    assert r == {k: True for k in r}, r


@pytest.mark.slow
def test_causal_logits_equal_the_torch_backend_eager_and_in_a_bucket():
    """The triton backend's causal_logits [B, R, V] are the torch backend's, eager and through a CUDA-graph
    bucket (logit_rows padded to block_size columns, block-row indices moved with the bucket's block)."""
    r = run_child("causal_logits")["causal_logits"]
    assert r["shape"] == r["bucket_shape"] == [2, 4, r["V"]]
    tol = 1e-4 * max(1.0, r["scale"])
    assert r["eager"] <= tol and r["bucket"] <= tol and r["bucket_logits"] <= tol, r


@pytest.mark.slow
def test_greedy_tokens_equal_the_torch_backend_with_requests_in_different_phases():
    r = run_child("tokens")["tokens"]
    assert r["triton"] == r["torch"]
    assert all(len(t) > 0 for t in r["torch"])
    # at least one step held a request decoding a block beside one in another phase (different causal rows)
    assert any(len(set(nc)) > 1 and len(hb) == 2 for nc, hb in r["phases"]), r["phases"]


@pytest.mark.slow
def test_fp8_experts_quantized_at_load_match_the_reference_on_dequantized_weights():
    r = run_child("fp8")["fp8"]
    assert r["expert_dtypes"] == ["torch.float8_e4m3fn"]
    assert r["coreset_equal"]
    assert r["max_abs"] <= 1e-4 * max(1.0, r["scale"]), r


def test_cpu_needs_the_interpreter(monkeypatch):
    from clover_export.backends.triton_backend import check_target

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(CloverError, match="TRITON_INTERPRET=1"):
        check_target("cpu", "auto")


def test_bf16_on_the_cpu_and_unknown_dtypes_are_refused(monkeypatch):
    from clover_export.backends.triton_backend import check_target

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(CloverError, match="bf16 on cpu"):
        check_target("cpu", "bf16")
    with pytest.raises(CloverError, match="fp16"):
        check_target("cpu", "fp16")
    assert check_target("cpu", "auto")[1] is __import__("torch").float32


def test_cuda_without_a_gpu_and_other_devices_are_refused(monkeypatch):
    import torch

    from clover_export.backends.triton_backend import check_target

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(CloverError, match="no CUDA device"):
        check_target("cuda", "auto")
    with pytest.raises(CloverError, match="not meta"):
        check_target("meta", "auto")


def test_cli_reports_one_line_for_the_cpu_without_the_interpreter(monkeypatch):
    from click.testing import CliRunner

    from clover_export.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = CliRunner().invoke(main, ["generate", "--backend", "triton", "--device", "cpu", "--prompt", "hi"])
    assert res.exit_code == 1
    assert "TRITON_INTERPRET=1" in res.output and "Traceback" not in res.output


def test_default_backend_is_triton_on_cuda_without_tensorrt(monkeypatch, tmp_path):
    import importlib.util

    from clover_export import backends

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorrt" else real(n, *a))
    assert backends.default_backend(None, "cuda") == "triton"
    assert backends.default_backend(None, "cpu") == "torch"
    (tmp_path / "manifest.json").write_text("{}")
    assert backends.default_backend(tmp_path, "cuda") == "ort"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())  # TensorRT installed
    assert backends.default_backend(None, "cuda") == "torch"


def test_graphs_only_needs_cuda(monkeypatch):
    from clover_export.backends.triton_backend import TritonBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(CloverError, match="eager_fallback=False needs CUDA graphs"):
        TritonBackend.load(None, device="cpu", eager_fallback=False)


def test_a_step_past_the_buckets_is_refused_when_graphs_only(monkeypatch):
    """Graphs only: a step no captured bucket holds raises one CloverError naming the shape (no replay)."""
    import torch

    from clover_export.backends.cuda_graphs import Bucket, StepGraphs
    from clover_export.backends.triton_backend import TritonBackend
    from clover_export.core import names

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be = TritonBackend.load(None, device="cpu")
    pools = be.allocate_pools(4, 64)
    be.graphs = StepGraphs(None, [], be.block_size, 4, be.device)
    be.graphs.graphs = {Bucket(2, 0): None, Bucket(2, 32): None}  # as if captured
    be.eager_fallback = False
    B, C = 3, 0
    i32 = dict(dtype=torch.int32)
    inputs = {names.INPUT_IDS: torch.zeros(B, C + be.block_size, **i32), names.N_CAUSAL: torch.zeros(B, **i32),
              names.HAS_BLOCK: torch.ones(B, **i32), names.SLOT_IDS: torch.arange(B, **i32),
              names.PAST_LEN: torch.zeros(B, **i32)}
    with pytest.raises(CloverError, match=r"3 rows x 0 causal rows is past the CUDA-graph buckets"):
        be.step(inputs, pools)


def test_bucket_choice_and_bad_buckets():
    from clover_export.backends.cuda_graphs import Bucket, default_buckets, pick

    bs = default_buckets(6, 32)  # causal rows: denoise steps; commit + denoise and self_spec steps (<= 32 rows)
    assert sorted({b.batch for b in bs}) == [1, 2, 4, 6] and sorted({b.causal for b in bs}) == [0, 32]
    assert pick(bs, 3, 0, 32) == Bucket(4, 0)
    assert pick(bs, 3, 5, 32) == Bucket(4, 32) and pick(bs, 1, 32, 32) == Bucket(1, 32)
    assert pick(bs, 1, 33, 32) is None and pick(bs, 7, 0, 32) is None
    assert sorted({b.batch for b in default_buckets(64, 32, batch_sizes=(1, 8, 64, 128))}) == [1, 8, 64]
    with pytest.raises(CloverError, match="batch sizes >= 1"):
        default_buckets(8, 32, batch_sizes=(0, 4))
    with pytest.raises(CloverError, match="causal rows >= 0"):
        default_buckets(8, 32, causal_rows=(-1,))
    with pytest.raises(CloverError, match="fits the 4 slots"):
        default_buckets(4, 32, batch_sizes=(8, 16))


def test_fp8_weights_without_scales_are_refused():
    import torch

    from clover_export.backends.triton_backend import KernelMoE

    w = torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(CloverError, match="FP8 expert weights without scales"):
        KernelMoE(None)(torch.zeros(1, 2, 4), torch.zeros(2, 4), w, w, 1, 0.9, True, 1)


def test_fp8_artifact_without_scales_is_refused(tmp_path, monkeypatch):
    """An FP8 artifact whose graph lacks an expert scale: one CloverError naming the tensor."""
    from clover_export.backends import fp8_experts
    from clover_export.backends.triton_backend import TritonBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be = TritonBackend.load(None, device="cpu")
    name = fp8_experts.expert_names(be.model)[0]

    class Manifest:
        quantization = object()

    class Art:
        dir, manifest, graph_path = tmp_path, Manifest, tmp_path / "model.onnx"

    import onnx
    from onnx import helper

    onnx.save(helper.make_model(helper.make_graph([], "g", [], [])), str(Art.graph_path))
    monkeypatch.setattr("clover_export.artifact.manifest.load_artifact", lambda d: Art)
    monkeypatch.setattr("clover_export.artifact.manifest.read_weight_map",
                        lambda a: {f"{name}.fp8": {"dtype": "F8_E4M3", "file": "x.bin", "offset": 0, "shape": [1]}})
    with pytest.raises(CloverError, match=f"FP8 scales {name}.scale missing"):
        fp8_experts.from_artifact(be.model, tmp_path)
    Manifest.quantization = None
    with pytest.raises(CloverError, match="not an FP8 artifact"):
        fp8_experts.from_artifact(be.model, tmp_path)


def test_a_step_padded_into_a_bucket_gives_the_unpadded_step(tiny_dir):
    """The bucket padding of `StepGraphs.replay` (extra batch rows on the scratch slot, extra causal rows
    past n_causal, logit_rows padded to block_size columns) leaves the valid rows' logits, causal logits,
    coreset sizes and pools as the unpadded step computes them. A stand-in graph replays the step eagerly on
    the static buffers (no CUDA here); the step is the torch backend's (plain-torch cores), so this checks the
    padding, not the kernels."""
    import torch

    from clover_export.backends.cuda_graphs import Bucket, StepGraphs
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.core import names

    be = TorchBackend.load(tiny_dir, device="cpu", dtype="fp32")
    N, slots = be.block_size, 5
    pools = be.allocate_pools(slots + 1, 96)  # + the scratch slot
    g = torch.Generator().manual_seed(0)
    for p in pools.values():
        p.normal_(0, 0.3, generator=g)
    ref_pools = {k: v.clone() for k, v in pools.items()}
    def fn(inp):
        res = be.step(inp, pools)
        return res[0], res[1], res.causal_logits

    b = Bucket(4, N)
    graphs = StepGraphs(fn, [b], N, slots, torch.device("cpu"))
    install_eager_graph(graphs, b, fn)
    for k, v in pools.items():  # the capture-time warm-up ran on the scratch slot only
        assert torch.equal(v[:slots], ref_pools[k][:slots]), k

    B, C = 3, 5
    i32 = dict(dtype=torch.int32)
    inputs = {names.INPUT_IDS: torch.randint(6, 500, (B, C + N), generator=g, **i32),
              names.N_CAUSAL: torch.tensor([5, 0, 2], **i32), names.HAS_BLOCK: torch.tensor([1, 1, 0], **i32),
              names.SLOT_IDS: torch.tensor([3, 0, 4], **i32), names.PAST_LEN: torch.tensor([10, 40, 0], **i32),
              # causal rows, block rows (moved with the bucket's block), one past the rows (clamped)
              names.LOGIT_ROWS: torch.tensor([[4, 0, C + 1], [C, C + N - 1, 99], [1, C + 2, C]], **i32)}
    assert graphs.bucket_for(B, C, 3) == b and graphs.bucket_for(B, C, N + 1) is None
    logits, coreset, causal = graphs.replay(b, inputs)
    want = be.step(inputs, ref_pools)
    want_logits, want_coreset, _ = want
    assert logits.shape == want_logits.shape and coreset.shape == want_coreset.shape
    assert causal.shape == want.causal_logits.shape == (B, 3, be.cfg.vocab_size)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(causal, want.causal_logits, atol=2e-5, rtol=1e-5)
    assert torch.equal(coreset, want_coreset)
    for k in pools:
        torch.testing.assert_close(pools[k][:slots], ref_pools[k][:slots], atol=2e-5, rtol=1e-5, msg=k)


@pytest.mark.slow
def test_fp8_experts_read_from_an_fp8_artifact_are_its_e4m3_bytes_and_scales(tmp_path, monkeypatch):
    """An artifact written by the FP8 rewrite (quantize/graph.py): the backend's experts are its e4m3 tensors,
    equal to quantize_weight of the source weights, with its scales."""
    import torch

    from clover_export.backends.fp8_experts import expert_names
    from clover_export.backends.triton_backend import TritonBackend
    from clover_export.model.loading import load_model
    from clover_export.quantize.scales import quantize_weight
    from clover_export.tiny import generate_random_tiny
    from tests.quantize.test_fp8_graph import build_fp8

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model_dir = generate_random_tiny(tmp_path / "model", seed=7, dtype=torch.float32, num_hidden_layers=2,
                                     layer_types=["linear_attention", "full_attention"])
    _, fp8_dir, _ = build_fp8(model_dir, tmp_path)
    be = TritonBackend.load(model_dir, device="cpu", fp8_experts=fp8_dir)
    src = load_model(model_dir)
    for name in expert_names(be.model):
        w8 = be.model.get_parameter(name)
        want8, want_scale = quantize_weight(src.get_parameter(name))
        assert w8.dtype == torch.float8_e4m3fn
        assert torch.equal(w8.view(torch.uint8), want8.view(torch.uint8)), name
        assert torch.equal(be.moe.fp8.scales(w8, w8)[0], want_scale), name


if __name__ == "__main__":
    _child(sys.argv[1:])

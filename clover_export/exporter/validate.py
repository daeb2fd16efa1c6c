"""`clover-export validate`: the exported graph against the reference model (STEP_GRAPH.md 1, 3).

Running and judging are separate (Polygraphy's habit): every runner
(reference model, ONNX Runtime CPU / CUDA EP, `onnx.reference` for one small
bf16 step) plays the same scenario with its own cache pools carried from
step to step, as a runtime would; then each output of each step is compared
with the reference model's.

Scenario (2 batch rows in slots 2 and 0 of a 3-slot pool): a prefill chunk
(one row folds its last chunk with a block), a prefill chunk + block next
to a block-only row, commits folded with the next block, a step with no
causal rows at all (T = block_size), and rows in different phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from clover_export import names
from clover_export.errors import CloverError
from clover_export.exporter.artifact import Artifact, load_artifact, ort_session

FP32_TOLERANCE = 1e-4  # max abs error of fp32 graphs (STEP_GRAPH.md: the function bodies reproduce the cores within 1e-4)
BF16_FLOOR = 1e-2
SLOTS = (2, 0)  # slot of each batch row
NUM_SLOTS = 3


@dataclass
class StepPlan:
    name: str
    causal_rows: int  # C of this step
    rows: list[tuple[int, int]]  # per batch row: (n_causal, has_block)


def scenario(block_size: int, chunk: int) -> list[StepPlan]:
    N = block_size
    c = min(chunk, 12)
    return [
        StepPlan("prefill chunk; row 1 folds its last chunk with a block", c, [(c, 0), (c - 5, 1)]),
        StepPlan("prefill + block | block only", N, [(N - 3, 1), (0, 1)]),
        StepPlan("commit folded with the next block (both rows)", N, [(N, 1), (N, 1)]),
        StepPlan("block only, no causal rows (T = block_size)", 0, [(0, 1), (0, 1)]),
        StepPlan("block only | commit + block", N, [(0, 1), (N, 1)]),
    ]


def make_feeds(plans: list[StepPlan], cfg, block_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Step inputs (int32) for the plans; past_len follows each row's committed rows."""
    rng = np.random.default_rng(seed)
    past = [0] * len(plans[0].rows)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else 0
    feeds = []
    for p in plans:
        B = len(p.rows)
        ids = rng.integers(0, cfg.vocab_size, size=(B, p.causal_rows + block_size), dtype=np.int64)
        ids[:, p.causal_rows:][rng.random((B, block_size)) < 0.5] = mask  # partly masked blocks
        feeds.append({
            names.INPUT_IDS: ids.astype(np.int32),
            names.N_CAUSAL: np.array([r[0] for r in p.rows], np.int32),
            names.HAS_BLOCK: np.array([r[1] for r in p.rows], np.int32),
            names.SLOT_IDS: np.array(SLOTS[:B], np.int32),
            names.PAST_LEN: np.array(past, np.int32),
        })
        past = [a + r[0] for a, r in zip(past, p.rows)]
    return feeds


def pool_len(plans: list[StepPlan], block_size: int) -> int:
    return sum(p.causal_rows for p in plans) + block_size


# --- runners: feeds (scalars) + their own pools in, outputs by name out -------------------
class TorchRunner:
    name = "reference-torch"

    def __init__(self, art: Artifact, dtype: torch.dtype):
        from clover_export.models import load_model

        model_dir = Path(art.manifest["model_dir"])
        if not model_dir.exists():
            raise CloverError("validate", f"{model_dir}: the model folder the graph was exported from is gone",
                              "validate needs the reference model; export again from an existing folder")
        self.model = load_model(model_dir, dtype=dtype, block_size=art.block_size, allow_qwen=True)
        self.outputs = art.output_names

    @torch.no_grad()
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [_to_torch(feeds[n]) for n in list(names.STEP_SCALARS) + names.pool_names(self.model.cfg)]
        return {n: _to_numpy(t) for n, t in zip(self.outputs, self.model(*args))}


class OrtRunner:
    def __init__(self, art: Artifact, provider: str):
        self.name = f"onnxruntime-{provider.replace('ExecutionProvider', '').lower()}"
        self.session = ort_session(art, providers=[provider])
        self.outputs = art.output_names

    def run(self, feeds):
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))


class ReferenceEvaluatorRunner:
    name = "onnx-reference"

    def __init__(self, art: Artifact):
        import onnx
        from onnx.reference import ReferenceEvaluator

        proto = onnx.load(str(art.graph_path), load_external_data=False)
        _load_weights(proto, art)
        self.evaluator = ReferenceEvaluator(proto)
        self.outputs = art.output_names

    def run(self, feeds):
        return dict(zip(self.outputs, self.evaluator.run(self.outputs, feeds)))


def _load_weights(proto, art: Artifact) -> None:
    """Fill the proto's external initializers from the weight map (any mode), for onnx.reference."""
    from onnx import numpy_helper

    from clover_export.exporter.artifact import read_weight_map
    from clover_export.exporter.weights import storage_dtype

    wmap = read_weight_map(art)
    for i, t in enumerate(proto.graph.initializer):
        if t.data_location != t.EXTERNAL:
            continue
        e = wmap[t.name]
        path = Path(e["file"]) if Path(e["file"]).is_absolute() else art.dir / e["file"]
        raw = np.fromfile(path, dtype=storage_dtype(e["dtype"]), count=int(np.prod(e["shape"])), offset=e["offset"])
        if e["dtype"] == "BF16":
            import ml_dtypes

            raw = raw.view(ml_dtypes.bfloat16)
        proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(raw.reshape(e["shape"]), t.name))


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def initial_pools(art: Artifact, num_slots: int, length: int, seed: int = 1) -> dict[str, np.ndarray]:
    """Pools as a runtime would hand them over: allocated once; filled with noise, so a graph that reads
    beyond past_len or writes outside its rows shows up."""
    from clover_export.model.model import pool_dtype, pool_shape

    rng = np.random.default_rng(seed)
    dtype = torch.bfloat16 if art.dtype == "bf16" else torch.float32
    out = {}
    for name in names.pool_names(art.config):
        t = torch.from_numpy(rng.standard_normal(pool_shape(art.config, name, num_slots, length), np.float32) * 0.5)
        out[name] = _to_numpy(t.to(pool_dtype(name, dtype)))
    return out


def play(runner, feeds: list[dict], pools: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """All steps with the runner's own pools carried from step to step; returns each step's outputs."""
    pools = dict(pools)
    results = []
    for f in feeds:
        out = runner.run({**f, **pools})
        pools = {p: out[names.present_name(p)] for p in pools}
        results.append(out)
    return results


# --- judging ------------------------------------------------------------------------
@dataclass
class OutputError:
    runner: str
    step: int
    output: str
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.tolerance


@dataclass
class ValidationReport:
    errors: list[OutputError] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    runners: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.errors) and all(e.passed for e in self.errors)

    def worst(self, runner: str, output_prefix: str = "") -> OutputError:
        return max((e for e in self.errors if e.runner == runner and e.output.startswith(output_prefix)),
                   key=lambda e: e.max_abs / e.tolerance)

    def format(self) -> str:
        lines = [f"steps: " + "; ".join(f"{i}: {s}" for i, s in enumerate(self.steps))]
        for r in self.runners:
            errs = [e for e in self.errors if e.runner == r]
            by_out: dict[str, OutputError] = {}
            for e in errs:  # worst step per output
                if e.output not in by_out or e.max_abs / e.tolerance > by_out[e.output].max_abs / by_out[e.output].tolerance:
                    by_out[e.output] = e
            bad = [e for e in by_out.values() if not e.passed]
            n_steps = len({e.step for e in errs})
            lines.append(f"{r} vs reference: {len(by_out)} outputs x {n_steps} step(s), "
                         f"{'PASS' if not bad else f'FAIL ({len(bad)} outputs)'}")
            for e in sorted(by_out.values(), key=lambda e: (e.passed, e.output)):
                lines.append(f"  {'ok  ' if e.passed else 'FAIL'} {e.output:42s} max abs {e.max_abs:.3g} "
                             f"(rel {e.max_rel:.3g}, tol {e.tolerance:.3g}, worst at step {e.step})")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def compare(runner: str, results: list[dict], reference: list[dict], tolerance) -> list[OutputError]:
    """Max abs / relative error of every output of every step; tolerance(step, name, reference array)."""
    out = []
    for step, (got, ref) in enumerate(zip(results, reference)):
        for name, r in ref.items():
            g, r = got[name].astype(np.float64), r.astype(np.float64)
            tol = tolerance(step, name, r)
            if g.shape != r.shape:
                out.append(OutputError(runner, step, name, float("inf"), float("inf"), tol))
                continue
            scale = float(np.abs(r).max()) if r.size else 0.0
            err = float(np.abs(g - r).max()) if r.size else 0.0
            out.append(OutputError(runner, step, name, err, err / max(scale, 1e-30), tol))
    return out


def fp32_tolerance(step, name, ref) -> float:
    """1e-4, relative to the output's scale once that exceeds 1 (trained logits reach tens: fp32
    rounding of a different summation order alone is ~1e-5 of the scale)."""
    return FP32_TOLERANCE * max(1.0, float(np.abs(ref).max()) if ref.size else 0.0)


def bf16_tolerance(ref16: list[dict], ref32: list[dict]):
    """bf16 graphs are judged against bf16 rounding itself: an output may differ from the fp32 reference
    model by twice what the bf16 reference model differs from it on the same inputs (at least 1% of the
    output's scale). The graph's plugin bodies compute in fp32, so it is often closer than the bf16 model."""

    def tol(step, name, ref):
        noise = float(np.abs(ref16[step][name].astype(np.float64) - ref32[step][name].astype(np.float64)).max())
        return max(2 * noise, BF16_FLOOR * max(1.0, float(np.abs(ref).max()) if ref.size else 0.0))

    return tol


def validate(folder: str | Path, steps: int | None = None, save_io: str | Path | None = None, cuda: bool = True,
             reference_evaluator: bool | None = None, log: Callable[[str], None] = lambda s: None) -> ValidationReport:
    """Play the scenario on every runner and compare with the reference model (see the module docstring)."""
    import onnxruntime as ort

    art = load_artifact(folder)
    bf16 = art.dtype == "bf16"
    plans = scenario(art.block_size, art.chunk)[:steps]
    if not plans:
        raise CloverError("validate", "--steps must be at least 1")
    rep = ValidationReport(steps=[p.name for p in plans])
    ref = TorchRunner(art, torch.bfloat16 if bf16 else torch.float32)
    ref32 = TorchRunner(art, torch.float32) if bf16 else None
    if bf16:
        rep.notes.append("bf16 graphs are compared with the fp32 reference model; tolerance per output and step: "
                         "2 x |bf16 reference - fp32 reference| on the same inputs, at least 1% of the output's scale")

    def judge(runner, feeds, pools):
        t = time.perf_counter()
        got = play(runner, feeds, pools)
        log(f"{runner.name}: {len(feeds)} step(s) in {time.perf_counter() - t:.1f} s")
        expected = play(ref, feeds, pools)
        tol = fp32_tolerance
        if bf16:  # judged against the fp32 truth, allowed twice the bf16 reference model's own error
            truth = play(ref32, feeds, _upcast(pools))
            tol, expected = bf16_tolerance(expected, truth), truth
        rep.runners.append(runner.name)
        rep.errors.extend(compare(runner.name, got, expected, tol))
        return got, expected

    providers = [] if bf16 else ["CPUExecutionProvider"]
    if cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.append("CUDAExecutionProvider")
    elif bf16:
        rep.notes.append("ONNX Runtime's CPU EP has no bf16 MatMul: without the CUDA EP the bf16 graph runs in "
                         "onnx.reference only")
    feeds = make_feeds(plans, art.config, art.block_size)
    pools = initial_pools(art, NUM_SLOTS, pool_len(plans, art.block_size))
    results = {}
    for p in providers:
        runner = OrtRunner(art, p)
        results[runner.name], results[ref.name] = judge(runner, feeds, pools)
    if reference_evaluator if reference_evaluator is not None else bf16:
        judge(ReferenceEvaluatorRunner(art), *small_step(art))
        rep.notes.append("onnx-reference ran one small step (1 row, 3 causal rows + a block, 2 slots)")
    if not rep.runners:
        raise CloverError("validate", f"no runner can execute this {art.dtype} graph here",
                          "export with --dtype fp32 for ONNX Runtime on CPU, or pass --reference-evaluator")
    if save_io:
        if ref.name not in results:
            results[ref.name] = play(ref, feeds, pools)
        save_polygraphy(Path(save_io), feeds, pools, results)
        rep.notes.append(f"inputs and outputs saved in Polygraphy's JSON format: {save_io} "
                         f"and {_inputs_path(Path(save_io))}")
    return rep


def _upcast(pools: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in pools.items()}


def small_step(art: Artifact):
    plans = [StepPlan("small", 3, [(3, 1)])]
    feeds = make_feeds(plans, art.config, art.block_size, seed=5)
    feeds[0][names.SLOT_IDS] = np.array([1], np.int32)
    return feeds, initial_pools(art, 2, 3 + art.block_size, seed=6)


def _inputs_path(path: Path) -> Path:
    return path.with_name(path.stem + ".inputs.json")


def save_polygraphy(path: Path, feeds, pools, results: dict[str, list[dict]]) -> None:
    """RunResults (one IterationResult per step and runner) and the input data list (the feeds each step
    got, with the reference model's pools carried in), in Polygraphy's JSON format."""
    from polygraphy.comparator import IterationResult, RunResults
    from polygraphy.json import save_json

    ref = results["reference-torch"]
    inputs, carried = [], dict(pools)
    for f, out in zip(feeds, ref):
        inputs.append({**f, **carried})
        carried = {p: out[names.present_name(p)] for p in carried}
    rr = RunResults()
    for runner, res in sorted(results.items(), key=lambda kv: kv[0] != "reference-torch"):
        rr.append((runner, [IterationResult(outputs=o, runner_name=runner) for o in res]))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_json(rr, str(path), description="clover-export validate outputs")
    save_json(inputs, str(_inputs_path(path)), description="clover-export validate inputs")

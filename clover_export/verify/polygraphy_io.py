"""`validate --save-io`: the inputs and every runner's outputs in Polygraphy's JSON format, so
`polygraphy run --load-inputs / --load-outputs` can replay and compare them."""

from __future__ import annotations

from pathlib import Path

from clover_export.core import names
from clover_export.core.atomic import atomic_write
from clover_export.verify.runners import REFERENCE


def inputs_path(path: Path) -> Path:
    """Where the input data list goes, beside the results file: `io.json` -> `io.inputs.json`."""
    return path.with_name(path.stem + ".inputs.json")


def save_polygraphy(path: Path, feeds, pools, results: dict[str, list[dict]]) -> None:
    """RunResults (one IterationResult per step and runner, the reference first) and the input data list
    (the feeds each step got, with the reference model's pools carried in), each written whole or not at all."""
    from polygraphy.comparator import IterationResult, RunResults
    from polygraphy.json import to_json

    inputs, carried = [], dict(pools)
    for f, out in zip(feeds, results[REFERENCE]):
        inputs.append({**f, **carried})
        carried = {p: out[names.present_name(p)] for p in carried}
    rr = RunResults()
    for runner, res in sorted(results.items(), key=lambda kv: kv[0] != REFERENCE):
        rr.append((runner, [IterationResult(outputs=o, runner_name=runner) for o in res]))
    path.parent.mkdir(parents=True, exist_ok=True)
    for obj, dest in ((inputs, inputs_path(path)), (rr, path)):
        atomic_write(dest, lambda f, obj=obj: f.write(to_json(obj).encode()))

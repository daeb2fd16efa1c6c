"""Validation's runners are the runtime's backends behind numpy edges (clover_export/verify/runners.py).

What the adapters must add, each checked against an independent reference: every step's outputs kept
whole while later steps run (the ort backend reuses its logits buffer and alternates two pool sets), and
the reference model run functionally (the torch backend updates pools in place for the runtime).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clover_export.artifact.manifest import load_artifact
from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.exporter.session import ort_session
from clover_export.model.loading import load_model
from clover_export.verify.runners import OrtRunner, TorchRunner
from clover_export.verify.scenario import initial_pools, make_feeds, play, pool_len, profile_batch, scenario


@pytest.fixture(scope="module")
def steps(tiny_fp32_export):
    """(artifact, the first three scenario steps' feeds, initial pools)."""
    art = load_artifact(tiny_fp32_export)
    batch = profile_batch(art)
    plans = scenario(art.block_size, art.chunk, batch)[:3]
    pools = initial_pools(art, batch + 1, pool_len(plans, art.block_size))
    return art, make_feeds(plans, art.config, art.block_size), pools


def test_ort_runner_keeps_every_step_as_session_run_returns_it(steps):
    """Against plain `InferenceSession.run` (no IO binding): the same outputs, step for step, after all
    steps ran (an adapter handing out the backend's reused buffers shows the last step everywhere)."""
    art, feeds, pools = steps
    got = play(OrtRunner.load(art, "CPUExecutionProvider"), feeds, pools)
    sess, carried = ort_session(art, ["CPUExecutionProvider"]), dict(pools)
    for step, f in enumerate(feeds):
        want = dict(zip(art.output_names, sess.run(art.output_names, {**f, **carried})))
        carried = {p: want[names.present_name(p)] for p in carried}
        assert list(got[step]) == art.output_names
        for name in art.output_names:
            np.testing.assert_array_equal(got[step][name], want[name], err_msg=f"step {step} {name}")


def test_torch_runner_is_the_functional_model_and_leaves_pools_alone(steps):
    """Against the model's own forward: the same outputs; the pools handed in are not written."""
    art, feeds, pools = steps
    runner = TorchRunner.load(art, torch.float32)
    before = {k: v.copy() for k, v in pools.items()}
    got = play(runner, feeds[:1], pools)[0]
    for k in pools:
        np.testing.assert_array_equal(pools[k], before[k], err_msg=f"{k} was written")
    model = load_model(art.model_dir, dtype=torch.float32, block_size=art.block_size)
    with torch.no_grad():
        out = model(*(torch.from_numpy(feeds[0][n]) for n in names.STEP_INPUTS),
                    *(torch.from_numpy(before[p].copy()) for p in names.pool_names(art.config)))
    for name, t in zip(art.output_names, out):
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)


def test_torch_runner_refuses_the_in_place_backend(steps):
    art, _, _ = steps
    with pytest.raises(ValueError, match="in_place=False"):
        TorchRunner(TorchBackend(load_model(art.model_dir)), art.output_names)

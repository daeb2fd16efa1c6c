"""Checkpoint reading and writing (MODEL.md 3): round trips and every loader error."""

import json
import shutil
import struct
import subprocess
import sys
import warnings

import pytest
import torch

from clover_export.core import names
from clover_export.core.checkpoint import INDEX_FILE, load_state_dict
from clover_export.core.config import load_config
from clover_export.core.errors import CloverError
from clover_export.model.loading import build_model, load_model
from clover_export.model.model import init_random_
from clover_export.tiny import tiny_config, tiny_config_dict, write_model_folder

SMALL = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
             num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
             layer_types=["linear_attention"] * 3 + ["full_attention"])


@pytest.fixture(scope="module")
def small_state():
    model = init_random_(build_model(tiny_config(**SMALL)), seed=3)
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def write(tmp_path, state, name="m", config=None, **kw):
    return write_model_folder(tmp_path / name, state, config or tiny_config_dict(**SMALL), **kw)


def test_round_trip_fused_per_expert_wrapper_and_shards(tmp_path, small_state):
    cfg_dir = write(tmp_path, small_state)
    cfg = load_config(cfg_dir)
    base = load_state_dict(cfg_dir, cfg)
    assert set(base) == set(small_state)
    for k in small_state:
        assert torch.equal(base[k], small_state[k]), k
    per = write(tmp_path, small_state, "per", per_expert=True, max_shard_bytes=20_000)
    index = json.loads((per / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert any(".experts.0.gate_proj.weight" in n for n in index["weight_map"])
    wrap = write(tmp_path, small_state, "wrap", prefix="model.language_model.")
    for d in (per, wrap):
        other = load_state_dict(d, cfg)
        for k in small_state:
            assert torch.equal(other[k], small_state[k]), (d.name, k)


def test_ignored_tensors_and_f32_small_tensors(tmp_path, small_state):
    state = dict(small_state)
    state["mtp.fc.weight"] = torch.zeros(2, 2)
    state["model.visual.patch.weight"] = torch.zeros(2)
    state["model.layers.0.linear_attn.A_log"] = small_state["model.layers.0.linear_attn.A_log"].float()
    d = write(tmp_path, state)
    got = load_state_dict(d, load_config(d), dtype=torch.float32)
    assert "mtp.fc.weight" not in got
    assert torch.equal(got["model.layers.0.linear_attn.A_log"], state["model.layers.0.linear_attn.A_log"])


def test_plain_qwen_needs_opt_in_and_zero_fills(tmp_path, small_state):
    state = {k: v for k, v in small_state.items() if k not in names.clover_tensor_names(tiny_config(**SMALL))}
    cfg = dict(tiny_config_dict(**SMALL), model_type="qwen3_5_moe_text")
    d = write(tmp_path, state, config=cfg)
    with pytest.raises(CloverError, match="allow-qwen"):
        load_model(d)
    with pytest.warns(UserWarning, match="meaningless"):
        model = load_model(d, allow_qwen=True)
    assert float(model.model.layers[0].linear_attn.block_softmax_gate.abs().sum()) == 0.0


def errors_of(d):
    with pytest.raises(CloverError) as e:
        load_state_dict(d, load_config(d))
    return str(e.value)


def test_missing_unexpected_and_misshaped_are_reported_together(tmp_path, small_state):
    state = dict(small_state)
    del state["model.layers.1.linear_attn.dt_bias"]
    state["model.layers.0.mlp.gate.weight"] = torch.zeros(5, 32, dtype=torch.bfloat16)
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    state["model.norm.weight"] = torch.zeros(32, dtype=torch.int32)
    msg = errors_of(write(tmp_path, state))
    assert "4 problem(s)" in msg
    assert "missing: model.layers.1.linear_attn.dt_bias" in msg
    assert "wrong shape: model.layers.0.mlp.gate.weight: [5, 32], expected [4, 32]" in msg
    assert "unexpected: model.layers.0.extra.weight" in msg
    assert "wrong dtype: model.norm.weight: I32" in msg


def test_corrupt_header_truncated_shard_and_bad_index(tmp_path, small_state):
    d = write(tmp_path, small_state, max_shard_bytes=50_000)
    shards = sorted(d.glob("*.safetensors"))
    # corrupt header: valid length, garbage JSON
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    raw = bytearray((bad / shards[0].name).read_bytes())
    raw[8:20] = b"#" * 12
    (bad / shards[0].name).write_bytes(bytes(raw))
    assert "not valid JSON" in errors_of(bad) and shards[0].name in errors_of(bad)
    # absurd header length
    raw[:8] = struct.pack("<Q", 10**12)
    (bad / shards[0].name).write_bytes(bytes(raw))
    assert "header length" in errors_of(bad)
    # truncated shard
    trunc = tmp_path / "trunc"
    shutil.copytree(d, trunc)
    data = (trunc / shards[-1].name).read_bytes()
    (trunc / shards[-1].name).write_bytes(data[: len(data) - 100])
    assert "truncated" in errors_of(trunc)
    # index naming a missing file, and a path outside the folder
    for fname, expect in (
        ("model-99999-of-99999.safetensors", "does not exist"),
        ("../elsewhere.safetensors", "outside"),
    ):
        idx = tmp_path / f"idx-{expect[:4]}"
        shutil.copytree(d, idx)
        index = json.loads((idx / INDEX_FILE).read_text())
        index["weight_map"]["model.norm.weight"] = fname
        (idx / INDEX_FILE).write_text(json.dumps(index))
        assert expect in errors_of(idx)


def test_symlinked_shards_load(tmp_path, small_state):
    d = write(tmp_path, small_state)
    blobs = tmp_path / "blobs"
    snap = tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    for f in d.iterdir():
        shutil.move(str(f), blobs / f.name)
        (snap / f.name).symlink_to(blobs / f.name)
    got = load_state_dict(snap, load_config(snap))
    assert torch.equal(got["lm_head.weight"], small_state["lm_head.weight"])


def test_writer_is_atomic(tmp_path, small_state, monkeypatch):
    import safetensors.torch as st

    d = write(tmp_path, small_state)
    before = sorted(p.name for p in d.iterdir())

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", boom)
    with pytest.raises(OSError):
        write(tmp_path, small_state)
    assert sorted(p.name for p in d.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_cli_errors_are_one_line_without_traceback(tmp_path, small_state):
    d = write(tmp_path, {k: v for k, v in small_state.items() if k != "lm_head.weight"})
    for args in (["forward", str(d), "--input-ids", "1,2"], ["info", str(tmp_path / "nope")],
                 ["forward", "--input-ids", "1,x"]):
        r = subprocess.run([sys.executable, "-m", "clover_export.cli", *args], capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.startswith("error: ["), r.stderr


def test_cli_forward_saves_logits_that_match_the_model(tmp_path, small_state):
    import numpy as np

    d = write(tmp_path, small_state)
    out = tmp_path / "logits.npy"
    ids = [3, 9, 27, 81, 243]
    r = subprocess.run([sys.executable, "-m", "clover_export.cli", "forward", str(d), "--input-ids",
                        ",".join(map(str, ids)), "--save", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    saved = np.load(out)
    assert saved.shape == (5, 512) and saved.dtype == np.float32
    with warnings.catch_warnings():
        model = load_model(d, block_size=0)
    from clover_export.model.model import allocate_pools

    pools = allocate_pools(model.cfg, 1, 8)
    h, _, _ = model.trunk(torch.tensor([ids]), torch.tensor([5]), torch.tensor([0]), torch.tensor([0]),
                          torch.tensor([0]), *pools.values())
    assert np.allclose(model.logits(h)[0].detach().numpy(), saved, atol=1e-5)

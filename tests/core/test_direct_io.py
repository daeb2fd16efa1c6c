"""Reads past the page cache (`direct_io`): the same tensors as safetensors' own reader, in runs and pieces."""

from __future__ import annotations

import math
import os

import pytest
import torch

from clover_export.core import direct_io
from clover_export.core.checkpoint import TensorReader, locate_tensors, plan_tensors, save_checkpoint
from clover_export.core.direct_io import DirectReader, DirectWriter
from clover_export.core.errors import CloverError


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shards of tensors of odd sizes and mixed dtypes (offsets not 4 KiB aligned)."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i:02d}": torch.randn(n, generator=g).to(dt)
             for i, (n, dt) in enumerate([(7, torch.float32), (3000, torch.bfloat16), (1, torch.float16),
                                          (70_000, torch.bfloat16), (5, torch.float32), (123_457, torch.bfloat16),
                                          (2049, torch.float32), (9, torch.bfloat16)])}
    folder = save_checkpoint(state, tmp_path_factory.mktemp("direct") / "ckpt", max_shard_bytes=300_000)
    return state, locate_tensors_raw(folder)


def locate_tensors_raw(folder):
    from clover_export.core.checkpoint import read_header, shard_files

    return {n: loc for f in shard_files(folder) for n, loc in read_header(f).items()}


def collect(reader: DirectReader, locs) -> dict[str, torch.Tensor]:
    out = {}
    for loc, first, piece in reader.read(locs):
        t = out.setdefault(loc.stored_name, torch.full((math.prod(loc.shape),), float("nan"), dtype=piece.dtype))
        t[first:first + piece.numel()] = piece  # copied now: the piece is a view into the staging buffer
    return {loc.stored_name: out[loc.stored_name].reshape(loc.shape) for loc in locs}


def fused_and_per_expert(tmp_path, seed: int):
    """(config, folder, folder): a random 2-layer tiny (GDN, attention) with fused experts, and the same
    weights saved with one tensor per expert."""
    import json

    from clover_export.core.checkpoint import load_state_dict
    from clover_export.core.config import load_config
    from clover_export.tiny import generate_random_tiny, write_model_folder

    fused = generate_random_tiny(tmp_path / "fused", seed=seed, num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"])
    cfg = load_config(fused)
    per = write_model_folder(tmp_path / "per", load_state_dict(fused, cfg),
                             json.loads((fused / "config.json").read_text()), per_expert=True)
    return cfg, fused, per


def o_direct_works(path) -> bool:
    """Probe: an aligned O_DIRECT read of the file's first block."""
    import mmap

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    try:
        return os.preadv(fd, [mmap.mmap(-1, direct_io.BLOCK)], 0) > 0
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("run_bytes", [direct_io.RUN_BYTES, 4096, 1000])
def test_same_tensors_as_safetensors(shards, direct, run_bytes, monkeypatch):
    """Every tensor, bit for bit, whether runs hold many tensors or a tensor comes in many pieces."""
    monkeypatch.setattr(direct_io, "RUN_BYTES", run_bytes)
    monkeypatch.setattr(direct_io, "MAX_GAP", 0 if run_bytes < 4096 else direct_io.MAX_GAP)
    state, locs = shards
    assert len({loc.file for loc in locs.values()}) == 2
    assert any(loc.offset % direct_io.BLOCK for loc in locs.values())
    reader = DirectReader(direct=direct)
    got = collect(reader, list(locs.values()))
    assert got.keys() == state.keys()
    for name, want in state.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    if not direct:
        assert reader.used_direct == {False}
    else:  # O_DIRECT where the file system has it, the page cache otherwise
        assert reader.used_direct == {o_direct_works(next(iter(locs.values())).file)}
    assert reader._buf is None or len(reader._buf) <= max(run_bytes, 4096) + 3 * direct_io.BLOCK


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("max_gap", [direct_io.MAX_GAP, 0])
def test_views_into_an_arena_are_the_same_tensors(shards, direct, max_gap, monkeypatch):
    """read_views: every tensor bit for bit as a view into the arena (one window per file, or one per tensor),
    no staging buffer; the arena is reused while it is large enough."""
    monkeypatch.setattr(direct_io, "MAX_GAP", max_gap)
    state, locs = shards
    reader, arena = DirectReader(direct=direct), direct_io.Arena()
    got = reader.read_views(list(locs.values()), arena)
    assert reader._buf is None
    for loc in locs.values():
        t, want = got[loc], state[loc.stored_name]
        assert t.dtype == want.dtype and torch.equal(t, want), loc.stored_name
        assert t.untyped_storage().data_ptr() == arena.bytes.untyped_storage().data_ptr()  # a view, not a copy
    mm = arena.mm
    some = [loc for loc in locs.values() if loc.length < 100_000]
    again = reader.read_views(some, arena)
    assert arena.mm is mm and all(torch.equal(again[loc], state[loc.stored_name]) for loc in some)
    assert reader.used_direct == ({o_direct_works(some[0].file)} if direct else {False})


def test_runs_cut_large_tensors_into_pieces(shards, monkeypatch):
    monkeypatch.setattr(direct_io, "RUN_BYTES", 4096)
    _, locs = shards
    big = max(locs.values(), key=lambda l: l.length)
    runs = direct_io._runs(sorted((l for l in locs.values() if l.file == big.file), key=lambda l: l.offset))
    pieces = [r[0] for r in runs if r[0][0] == big]
    assert len(pieces) == -(-big.length // 4096) and all(n <= 4096 for _, _, n in pieces)
    assert [f for _, f, _ in pieces] == list(range(0, big.length, 4096))


def test_truncated_shard_names_the_file(shards, tmp_path):
    _, locs = shards
    loc = max(locs.values(), key=lambda l: l.offset + l.length)
    cut = tmp_path / loc.file.name
    cut.write_bytes(loc.file.read_bytes()[:loc.offset + loc.length // 2])
    from dataclasses import replace

    with pytest.raises(CloverError, match=str(cut)):
        list(DirectReader().read([replace(loc, file=cut)]))


def test_streamed_reads_equal_memory_mapped_reads(tmp_path):
    """A per-expert checkpoint: the streamed model's layer state equals TensorReader's (safetensors) tensors."""
    from clover_export.quantize.stream_calib import EXPERTS, expert_weight, streamed_model

    cfg, fused, per = fused_and_per_expert(tmp_path, seed=3)
    for folder in (fused, per):
        plans = plan_tensors(cfg, locate_tensors(folder))
        model = streamed_model(folder, 8, device="cpu")
        loader = model.stream_loader
        reader = TensorReader()
        for i, layer in enumerate(model.model.layers):
            got = loader.state(f"model.layers.{i}.", layer)
            experts = dict(zip(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), got.pop(EXPERTS)))
            for name, t in got.items():
                want = reader.read(plans[f"model.layers.{i}.{name}"])
                if name in experts:  # the module's parameter stays meta; the loader holds the weights, as stored
                    assert t.device.type == "meta" and t.shape == want.shape
                    assert all(torch.equal(expert_weight(w, want.dtype), want[e]) for e, w in enumerate(experts[name]))
                else:
                    assert torch.equal(t, want.to(t.dtype)), (folder.name, name)
            assert set(experts) <= set(got)
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # kept as stored, cast on lookup
        ids = torch.tensor([[1, 2, 3]])
        table = reader.read(plans["model.embed_tokens.weight"])
        assert torch.equal(model.model.embed_tokens(ids), table[ids].float())


@pytest.mark.parametrize("populate_bytes", [0, direct_io.POPULATE_BYTES])
def test_read_plan_equals_tensor_reader(tmp_path, populate_bytes, monkeypatch):
    """`read_plan`: every canonical tensor of a fused and of a per-expert checkpoint (experts stacked from
    their parts) equals TensorReader's, as stored and cast; with POPULATE_BYTES 0 every tensor is made by
    `empty`'s pre-mapped path (where the platform has MAP_POPULATE: Linux), and none of them shares memory
    with another; an empty tensor takes no mapping."""
    monkeypatch.setattr(direct_io, "POPULATE_BYTES", populate_bytes)
    cfg, fused, per = fused_and_per_expert(tmp_path, seed=4)
    for folder in (fused, per):
        plans, reader, direct = plan_tensors(cfg, locate_tensors(folder)), TensorReader(), DirectReader()
        assert any(not p.fused for p in plans.values()) == (folder == per)
        got = {n: direct_io.read_plan(direct, p) for n, p in plans.items()}
        for name, plan in plans.items():
            want = reader.read(plan)
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), (folder.name, name)
            assert torch.equal(direct_io.read_plan(direct, plan, torch.float32), want.float())
        ptrs = [t.data_ptr() for t in got.values() if t.numel()]
        assert len(set(ptrs)) == len(ptrs)
    assert direct_io.empty((0, 5), torch.bfloat16).shape == (0, 5)
    t = direct_io.empty((3, 5), torch.float32)
    t.fill_(2.0)
    assert t.shape == (3, 5) and t.is_contiguous() and float(t.sum()) == 30.0


@pytest.mark.parametrize("direct", [True, False])
def test_writer_writes_exactly_the_bytes_appended(tmp_path, direct, monkeypatch):
    """Pieces of odd sizes, zero runs, pieces larger than a chunk: the file is their concatenation, to the byte."""
    monkeypatch.setattr(DirectWriter, "CHUNK", 3 * direct_io.BLOCK)
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy() if kind == "data" else n
             for kind, n in [("data", 5), ("zeros", 4091), ("data", 3 * 4096 + 7), ("zeros", 9000), ("data", 1),
                             ("data", 20_000), ("zeros", 3)]]
    path = tmp_path / "out.bin"
    w = DirectWriter(path, direct=direct)
    want = bytearray()
    for p in parts:
        assert w.tell() == len(want)
        if isinstance(p, int):
            w.zeros(p)
            want += bytes(p)
        else:
            w.write(p)
            want += p.tobytes()
    assert w.close() == len(want)
    assert path.read_bytes() == bytes(want)
    assert w.direct == (direct and o_direct_works(path))
    w.abort()  # after close: nothing


def test_write_failure_surfaces_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk mid-file: the error names the file and says why, and quantize_weights leaves no temp folder."""
    import errno

    from clover_export.core.checkpoint import TensorPlan
    from clover_export.quantize import weights as fp8_weights

    state = {"w": torch.randn(64, 32).to(torch.bfloat16)}
    folder = save_checkpoint(state, tmp_path / "ckpt")
    loc = locate_tensors_raw(folder)["w"]
    plans = {"w": TensorPlan("w", (64, 32), ((loc,),), fused=True)}

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(direct_io.os, "write", full)
    with pytest.raises(CloverError, match="No space left on device") as err:
        fp8_weights.quantize_weights(plans, ["w"], tmp_path / "out" / "fp8-weights")
    assert "fp8.bin" in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []  # no temp folder, no half-written file


def test_zero_length_tensor(tmp_path):
    state = {"a": torch.ones(3, dtype=torch.bfloat16), "empty": torch.ones(0, dtype=torch.float32),
             "b": torch.full((5,), 2.0)}
    locs = locate_tensors_raw(save_checkpoint(state, tmp_path / "ckpt"))
    got = collect(DirectReader(), list(locs.values()))
    assert all(torch.equal(got[n], t) for n, t in state.items())

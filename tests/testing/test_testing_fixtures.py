"""`clover_export.testing`'s CPU-side fixtures: the full-size config, its layer sizes, the sparse checkpoint."""

from __future__ import annotations

from clover_export.core.checkpoint import locate_tensors, plan_tensors
from clover_export.core.config import CloverConfig, config_from_dict, load_config
from clover_export.testing.fullsize import full_size_config, layer_sizes, write_sparse_checkpoint


def test_full_size_config_is_model_md_defaults():
    """MODEL.md 2: `CloverConfig()` defaults, a GDN-GDN-GDN-attention pattern, a mask token."""
    d = {k: v for k, v in CloverConfig().to_dict().items() if k != "layer_types"}
    d.update(full_attention_interval=4, mask_token_id=248077)
    assert full_size_config() == config_from_dict(d)


def test_layer_sizes_of_clover_35b_a3b():
    assert layer_sizes() == dict(D=2048, E=256, k=8, I=512, Hk=16, Hv=32, dk=128, dv=128, K=4, H=16, Hkv=2, hd=256,
                                 N=32, top_p=0.9)


def test_sparse_checkpoint_is_a_full_size_checkpoint_on_almost_no_disk(tmp_path):
    apparent, allocated = write_sparse_checkpoint(tmp_path / "ckpt")
    assert apparent > 69e9 and allocated < 50e6  # 69.3 GB of bf16 weights, headers only on disk
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 13
    cfg = load_config(tmp_path / "ckpt")
    assert cfg == full_size_config()
    plans = plan_tensors(cfg, locate_tensors(tmp_path / "ckpt"))  # raises on a missing or misshapen tensor
    experts = [n for n in plans if n.endswith(".experts.gate_up_proj")]
    assert len(experts) == cfg.num_hidden_layers
    locs = locate_tensors(tmp_path / "ckpt")
    assert not any(n.endswith(".experts.gate_up_proj") for n in locs)  # stored per expert: the exporter fuses them

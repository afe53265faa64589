"""Kimi K2's dist_muon planned as Muon under the layer-wise optimizer, and the fields Gemma 4 and Kimi recipes set
classified or named (memory/from_config.optimizer_name, memory/coverage.py). Pure functions: no Bridge build."""

from types import SimpleNamespace as NS

import pytest

from mbmem_overlays.memory import coverage
from mbmem_overlays.memory.from_config import optimizer_name


def test_dist_muon_is_muon_under_the_layer_wise_optimizer():
    assert optimizer_name(NS(optimizer="dist_muon", use_layer_wise_distributed_optimizer=False)) == ("muon", True)
    assert optimizer_name(NS(optimizer="muon", use_layer_wise_distributed_optimizer=False)) == ("muon", False)
    assert optimizer_name(NS(optimizer="adam", use_layer_wise_distributed_optimizer=False)) == ("adam", False)


def _named(cfg):
    return {path for path, _, _ in coverage.unmodelled_fields(cfg)}


def test_dist_muon_is_not_named_but_other_optimizers_are():
    assert "optimizer.optimizer" not in _named(NS(optimizer=NS(optimizer="dist_muon"), model=NS()))
    assert "optimizer.optimizer" in _named(NS(optimizer=NS(optimizer="soap"), model=NS()))
    assert "optimizer.optimizer" in _named(NS(optimizer=NS(optimizer="dist_soap"), model=NS()))


@pytest.mark.parametrize("field", [
    "model.beta_fast", "model.full_attention_rope_base", "model.full_attention_rope_partial_factor",
    "model.global_kv_channels", "model.num_global_query_groups", "model.num_kv_shared_layers",
    "model.per_layer_embed_dim", "model.per_layer_embed_vocab_size", "model.scale_embeddings_by_hidden_size",
    "model.sliding_window_rope_base", "model.hf_model_path", "model.ignore_index",
    "model.media_placeholder_token_id", "model.trust_remote_code"])
def test_census_fields_are_classified(field):
    known = coverage.MODEL_READS | {u.path for u in coverage.NOT_MODELLED} | set(coverage.FIELD_CLASSES)
    assert field in known


def _gemma4_dense(**kw):
    model = dict(per_layer_embed_dim=256, per_layer_embed_vocab_size=262144, global_kv_channels=512,
                 kv_channels=256, num_global_query_groups=None, num_query_groups=2, num_kv_shared_layers=18)
    model.update(kw)
    return NS(model=NS(**model), optimizer=NS(optimizer="adam"))


def test_gemma4_dense_architecture_is_named_with_its_direction():
    gaps = {g.name: g for g in coverage.gaps(coverage.not_modelled(_gemma4_dense()))}
    assert gaps["model.per_layer_embed_dim"].moves == coverage.UP   # tables, gradients, state: only more memory
    assert {"model.global_kv_channels", "model.num_kv_shared_layers"} <= set(gaps)


def test_gemma4_dense_parts_absent_are_not_named():
    named = _named(_gemma4_dense(per_layer_embed_dim=0, global_kv_channels=256, num_kv_shared_layers=0))
    assert not named & {"model.per_layer_embed_dim", "model.global_kv_channels", "model.num_kv_shared_layers"}
    # other query groups alone make the full-attention layers differ
    assert "model.global_kv_channels" in _named(_gemma4_dense(global_kv_channels=256, num_global_query_groups=4))

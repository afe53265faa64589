"""The hybrid (Mamba) terms of the memory plan, each pinned to the formula its megatron-core / mamba_ssm code gives:
what a Mamba mixer keeps for backward, its parameters, its default head count, the hybrid pattern (blocks, MTP
depth, pipe segments), and what a multi-token-prediction depth keeps until the main loss's backward. Pure, except
the last test, which plans a Megatron-LM hybrid command line."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.activations import mamba_activation_terms
from mbmem_overlays.memory.from_config import hybrid_pattern, mamba_heads
from mbmem_overlays.memory.stage_activations import loss_kept_bytes, mtp_layer_activation

# A small hybrid shape: 16 heads of 64 (d_inner 1024), 8 groups of state 128, hidden 512.
MAMBA = P.Shape(layers=2, hidden=512, ffn=2048, heads=8, groups=8, head_dim=64, vocab=1024, gated=False,
                layer_kinds=("mamba", "attn"), mamba_heads=16, mamba_head_dim=64, mamba_groups=8, mamba_state=128)


def test_mamba_heads_default_to_twice_the_hidden_size_over_the_head_dim():
    # MambaMixer: d_inner = expand (2) x d_model, nheads = d_inner // headdim unless mamba_num_heads is set
    assert mamba_heads(SimpleNamespace(mamba_num_heads=None, mamba_head_dim=64, hidden_size=1024)) == 32
    assert mamba_heads(SimpleNamespace(mamba_num_heads=64, mamba_head_dim=64, hidden_size=2688)) == 64
    assert mamba_heads(SimpleNamespace(mamba_num_heads=None, mamba_head_dim=0, hidden_size=1024)) == 0


@pytest.mark.parametrize("tp, cp, bc_groups", [
    (1, 1, 8),    # all 8 groups of B and C
    (2, 1, 4),    # TP splits groups
    (2, 4, 4),    # CP = local groups: each CP rank gets whole groups, per local token the same width
    (2, 8, 8),    # CP > local groups: B and C are repeated (group_repeat_count), wider per local token
])
def test_a_mamba_mixer_keeps_the_kernel_input_scan_output_norm_input_and_out_proj_input(tp, cp, bc_groups):
    lay = P.Layout(world=tp * cp, tp=tp, cp=cp, seq=1024, mbs=1)
    terms = mamba_activation_terms(MAMBA, lay, P.Settings(), ln_out=2, gemm_in=2, keeps_input=lambda t: True)
    inner = 16 * 64 / tp
    assert terms["mamba_layernorm_output"] == 2 * 512                      # in_proj's fused norm output
    # the contiguous copy of z, x, B, C, dt the fused conv1d + scan kernel saves
    assert terms["mamba_in_proj_output"] == 2 * (2 * inner + 2 * bc_groups * 128 + 16 / tp)
    assert terms["mamba_scan_output"] == 2 * inner                          # out_x, before the z gate
    assert terms["mamba_norm_input"] == 2 * inner + 4 * 8 / tp              # the group RMSNorm's input, fp32 rstd
    assert terms["mamba_out_proj_input"] == 2 * inner
    # a whole Mamba layer adds its norm input (the residual stream)
    layer = P.layer_activation_terms(MAMBA, lay, P.Settings(), "mamba")
    assert layer == {"mamba_layernorm_input": 2 * 512, **terms}


def test_a_mamba_mixer_under_fp8_keeps_out_proj_input_quantized():
    lay = P.Layout(world=1, seq=1024)
    terms = P.layer_activation_terms(MAMBA, lay, P.Settings(fp8=True), "mamba")
    assert terms["mamba_out_proj_input"] == 1 * 1024
    assert terms["mamba_layernorm_output"] == 1 * 512
    assert terms["mamba_norm_input"] == 2 * 1024 + 4 * 8                   # the norm itself runs in bf16


def test_mamba_parameters_are_in_proj_conv_with_bias_head_vectors_norm_and_out_proj():
    inner, bc = 1024, 2 * 8 * 128
    in_proj = 512 * (2 * inner + bc + 16)
    conv = (inner + bc) * 4 + (inner + bc)        # depthwise weight (d_conv 4) and bias over x, B, C
    heads = 3 * 16                                # dt_bias, A_log, D
    assert P._mamba_params(MAMBA) == in_proj + conv + heads + inner + inner * 512
    dense, expert = P._block_params(MAMBA, P.Layout(world=2, tp=2), "mamba")
    assert (dense, expert) == (P._mamba_params(MAMBA) / 2 + 512, 0.0)   # + the layer's own norm weight


def test_a_hybrid_pattern_gives_blocks_the_mtp_depth_and_pipe_segments():
    kinds, mtp, segments = hybrid_pattern("M-M*|E-M/*E/*E")
    assert kinds == ("mamba", "mlp", "mamba", "attn", "moe", "mlp", "mamba")
    assert mtp == ("attn", "moe")
    assert segments == (4, 3)
    # Bridge's provider keeps the MTP pattern apart until it finalizes
    assert hybrid_pattern("MM*", "*-") == (("mamba", "mamba", "attn"), ("attn", "mlp"), (3,))
    assert hybrid_pattern("MM*") == (("mamba", "mamba", "attn"), (), (3,))


def test_pipe_segments_place_the_layers_of_each_chunk():
    kinds, _, segments = hybrid_pattern("MM*-|M*|-MM|*")
    shape = replace(MAMBA, layers=len(kinds), layer_kinds=kinds)
    lay = P.Layout(world=2, pp=2, vpp=2, chunk_layers=segments)   # chunk c on rank c % pp
    assert P.rank_chunks(shape, lay, 0) == (("mamba", "mamba", "attn", "mlp"), ("mlp", "mamba", "mamba"))
    assert P.rank_chunks(shape, lay, 1) == (("mamba", "attn"), ("attn",))


def test_a_repeated_mtp_layer_is_built_once_and_run_at_every_depth():
    lay = P.Layout(world=1, seq=1024)
    base = replace(MAMBA, mtp_blocks=("attn", "mamba"))
    one, two = replace(base, mtp_layers=1), replace(base, mtp_layers=2)
    shared = replace(two, mtp_shared=True)
    d0, _, _ = P.stage_params(base, lay, first=True, last=True)
    d1, _, _ = P.stage_params(one, lay, first=True, last=True)
    d2, _, _ = P.stage_params(two, lay, first=True, last=True)
    ds, _, _ = P.stage_params(shared, lay, first=True, last=True)
    mtp_layer = (P._attention_params(base) + 512) + (P._mamba_params(base) + 512) + 3 * 512 + 2 * 512 * 512
    assert d1 - d0 == mtp_layer
    assert d2 - d0 == 2 * mtp_layer
    assert ds - d0 == mtp_layer
    # its activations are both blocks', at every depth
    st = P.Settings()
    assert mtp_layer_activation(base, lay, st) == 6 * 2 * 512 * 1024 + P.layer_activation(base, lay, st, "attn") \
        + P.layer_activation(base, lay, st, "mamba")
    assert P.stage_activations(shared, lay, st, 0).steady == P.stage_activations(two, lay, st, 0).steady


@pytest.mark.parametrize("impl, kept", [("unfused", 4), ("native", 4), ("te", 2)])
def test_an_mtp_depth_keeps_only_what_its_loss_saves(impl, kept):
    """Each depth's loss ran in the forward; until the main loss's backward (the loss's peak) it holds its saved
    softmax (fp32) or, with TE's kernel, the bf16 logits holding the gradient, not a second loss peak."""
    lay = P.Layout(world=1, seq=1024, mbs=2)
    st = P.Settings(cross_entropy_impl=impl, logits_bytes={"unfused": 6, "native": 10, "te": 2}[impl])
    assert loss_kept_bytes(st) == kept
    base = replace(MAMBA, mtp_blocks=("attn",))
    a0 = P.stage_activations(base, lay, st, 0).steady
    a2 = P.stage_activations(replace(base, mtp_layers=2), lay, st, 0).steady
    tokens = 1024 * 2
    assert a2 - a0 == 2 * (mtp_layer_activation(base, lay, st) + kept * 1024 * tokens)


@pytest.mark.bridge
def test_a_megatron_lm_hybrid_job_is_planned_from_its_pattern(bridge):
    pytest.importorskip("mbmem_overlays.bridge.megatron_args", reason="needs the Megatron-LM arguments input")
    from mbmem_overlays.bridge.megatron_args import load_job
    argv = ["--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512",
            "--max-position-embeddings", "512", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "10", "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--bf16",
            "--position-embedding-type", "none",
            "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
            "--hybrid-layer-pattern", "M-M*|M-M-M/*-/*-", "--pipeline-model-parallel-size", "2",
            "--mtp-num-layers", "2", "--mtp-use-repeated-layer"]
    shape, lay, _ = P.from_config(load_job(argv, world_size=2, script="pretrain_hybrid.py").config, 2)
    assert shape.mamba_heads == 2 * 256 // 64          # --mamba-num-heads unset
    assert shape.mtp_blocks == ("attn", "mlp") and shape.mtp_shared and shape.mtp_layers == 2
    assert lay.chunk_layers == (4, 5)                  # the pipe, not an even split
    assert P.rank_layers(shape, lay, 0) == {"mamba": 2, "mlp": 1, "attn": 1}
    assert P.rank_layers(shape, lay, 1) == {"mamba": 3, "mlp": 2}


def test_the_non_fused_mixer_is_named_and_g_d_plus_layers_are_not():
    from mbmem_overlays.memory.coverage import not_modelled
    # G, D and + are blocks of the plan (memory/variants.py, tests/test_plan_variants.py)
    model = SimpleNamespace(hybrid_layer_pattern="MG*-+/D", use_mamba_mem_eff_path=False)
    named = not_modelled(SimpleNamespace(model=model))
    assert [n.split("=")[0] for n in named] == ["model.use_mamba_mem_eff_path"]
    assert not not_modelled(SimpleNamespace(model=SimpleNamespace(hybrid_layer_pattern="M*-E/*E",
                                                                  use_mamba_mem_eff_path=True)))

"""The features Bridge 0.6.2's recipes use that bench/recipe_census.py still found not modelled, each term pinned to
the code it comes from: TE's operation fuser on the experts and megatron-core's paged stash, the stage outputs kept
with deallocate_pipeline_outputs off, context-parallel attention other than the p2p ring, Gemma 2's softcapped
attention and logits, the non-fused softmax's dtype and an unscattered embedding output. Pure functions on small
shapes first, then the shipped recipes that use them (one module-scoped build each)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.activations import attention_scores_bytes, local_expert_params, quantized_bytes
from mbmem_overlays.memory.pipeline import rank_alive
from mbmem_overlays.memory.stage_activations import (cp_allgather_working, kept_stage_outputs, logit_softcap_bytes,
                                                     paged_stash_working)

# an MoE stack: 4 attention + MoE layers, 64 experts of which 8 per token, SwiGLU experts
MOE = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=2, head_dim=128, vocab=2048, gated=True,
              experts=64, moe_ffn=512, topk=8, moe_layers=4, layer_kinds=("attn+moe",) * 4)
LAY = P.Layout(world=8, ep=8, seq=4096, mbs=1, gbs=8)
DENSE = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=2, head_dim=128, vocab=2048)
ROUTED = MOE.topk          # tokens each token sends to the experts (TP 1, balanced)


# ----------------------------------------------------------------------------- the cited code is there
def _site_packages() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


# (file under site-packages, 1-based line, text on that line): what the terms' docstrings cite (TE's are at tag
# v2.17.1, not installed here; their behaviour is pinned by the formulas below)
CITED = [
    ("megatron/core/transformer/moe/experts.py", 286, "if self.config.use_transformer_engine_op_fuser:"),
    ("megatron/core/transformer/moe/experts.py", 398,
     'if use_glu_fusion and int(os.environ.get("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "0")) <= 0:'),
    ("megatron/core/transformer/moe/experts.py", 484,
     'activation_recompute_in_mlp = bool(getattr(self, "activation_recompute", False))'),
    ("megatron/core/transformer/moe/experts.py", 654, "if self.config.moe_paged_stash:"),
    ("megatron/core/transformer/moe/experts.py", 661, "int(max_num_tokens // cap_factor)"),
    ("megatron/core/transformer/moe/paged_stash.py", 66, "self.cuda_buffer = torch.empty("),
    ("megatron/core/transformer/moe/paged_stash.py", 509, "paged_tensor._original_tensor = None"),
    ("megatron/core/transformer/moe/paged_stash.py", 526, "paged_tensor._tensor = torch.empty("),
    ("megatron/core/transformer/moe/paged_stash.py", 570, "max_tokens_dict = self.max_avg_tokens_across_vp_stages"),
    ("megatron/core/transformer/moe/paged_stash.py", 603,
     "num_tokens = int(max_tokens_dict[dtype, hidden_size] * cuda_scale)"),
    ("megatron/core/transformer/moe/paged_stash.py", 688, "or not hasattr(tensor, 'grouped_tensor_scale_inv')"),
    ("megatron/core/pipeline_parallel/schedules.py", 178, "if (out is None) or (not deallocate_pipeline_outputs):"),
    ("megatron/core/pipeline_parallel/schedules.py", 196,
     "out.data = torch.empty((1,), device=out.device, dtype=out.dtype)"),
    ("megatron/core/pipeline_parallel/schedules.py", 1633,
     "deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)"),
    ("megatron/core/fusions/fused_softmax.py", 313, "if self.input_in_float16 and self.softmax_in_fp32:"),
    ("megatron/core/fusions/fused_softmax.py", 340, "probs = probs.bfloat16()"),
    ("megatron/core/transformer/transformer_config.py", 1466, "self.attention_softmax_in_fp32 = True"),
    ("megatron/core/transformer/moe/moe_utils.py", 836, "# - Logits are converted to fp32 for score functions."),
    ("megatron/core/transformer/moe/moe_utils.py", 162, "logsum = torch.logsumexp(logits, dim=-1)"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 1808,
     '"DSAttention context parallelism currently supports cp_comm_type=allgather only."'),
    ("megatron/core/models/common/embeddings/language_model_embedding.py", 140,
     "if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:"),
    ("megatron/core/tensor_parallel/mappings.py", 79,
     "output = input_[dim_offset : dim_offset + local_dim_size].contiguous()"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 242,
     "matmul_result = logit_softcapping(matmul_result, self.config.attn_logit_softcapping)"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 381,
     "fused_eligible = attention_mask is None and dropout_p == 0.0"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 392, "out = _flex_attn_func("),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 401,
     "return out.permute(2, 0, 1, 3).contiguous().view(sq, b, np_heads * hn)"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 414,
     "output = logit_softcapping(output, self.config.final_logit_softcapping)"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 423, "return scale * torch.tanh(logits / scale)"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 447, "core_attention=Gemma2FlexDotProductAttention,"),
    ("megatron/bridge/models/gemma/gemma2_provider.py", 522,
     "extend_instance(model.output_layer, Gemma2OutputLayer)"),
    ("megatron/bridge/models/gemma/modeling_gemma4.py", 1490,
     "output = _logit_softcapping(output, self.config.final_logit_softcapping)"),
    ("megatron/bridge/training/gpt_step.py", 123,
     'uses_custom_attention_mask = not getattr(dataset_cfg, "skip_getting_attention_mask_from_dataset", True)'),
    ("megatron/bridge/models/gpt_provider.py", 55,
     'kwargs = {"use_te_op_fuser": config.use_transformer_engine_op_fuser}'),
]


@pytest.mark.parametrize("path, line, text", CITED)
def test_the_cited_lines_say_what_the_terms_read(path, line, text):
    assert text in (_site_packages() / path).read_text().splitlines()[line - 1]


# ----------------------------------------------------------------------------- TE's operation fuser on the experts
def _moe_terms(st: P.Settings, s: P.Shape = MOE, lay: P.Layout = LAY) -> dict[str, float]:
    return P.layer_activation_terms(s, lay, st, "attn+moe")


def test_the_fusers_basic_ops_keep_the_gemm_inputs_and_the_activations_input_only():
    # an unfused GLU of the modules keeps silu(a), b + offset and the probability-weighted input beside them
    module = P.Settings(swiglu_fused=False, moe_probs_mul=True)
    ops = replace(module, moe_op_fuser="ops")
    m, o = _moe_terms(module), _moe_terms(ops)
    assert {"moe_silu_output", "moe_glu_linear_input", "moe_probs_mul_input"} <= set(m)
    assert not {"moe_silu_output", "moe_glu_linear_input", "moe_probs_mul_input"} & set(o)
    # bf16: FC1's input, the scaled activation's input (FC1's output), FC2's input, as the modules
    d = P.BF16
    assert o["moe_permuted_input"] == m["moe_permuted_input"] == ROUTED * d * MOE.hidden
    assert o["moe_fc1_output"] == m["moe_fc1_output"] == ROUTED * d * 2 * MOE.moe_ffn
    assert o["moe_act_output"] == m["moe_act_output"] == ROUTED * d * MOE.moe_ffn
    assert "moe_op_weight_copies" not in o          # bf16 weights: the parameters themselves


def test_the_fusers_ops_quantize_bf16_weights_every_forward_and_keep_columnwise_inputs():
    st = P.Settings(fp8=True, moe_op_fuser="ops", moe_op_quant="tensorwise", fp8_weight_copy_bytes=2 * P.FP8)
    terms = _moe_terms(st)
    # FP8 GEMM inputs in their columnwise layout only (one byte, a per-tensor scale)
    assert terms["moe_permuted_input"] == ROUTED * 1 * MOE.hidden
    assert terms["moe_act_output"] == ROUTED * 1 * MOE.moe_ffn
    assert terms["moe_fc1_output"] == ROUTED * P.BF16 * 2 * MOE.moe_ffn
    # the local experts' weights, quantized per forward, columnwise copies saved per layer-microbatch
    local = MOE.experts // LAY.ep * 3 * MOE.moe_ffn * MOE.hidden
    assert local_expert_params(MOE, LAY) == local
    tokens = LAY.seq * LAY.mbs
    assert terms["moe_op_weight_copies"] * tokens == pytest.approx(local * 1)
    mx = _moe_terms(replace(st, moe_op_quant="mxfp8"))
    assert mx["moe_op_weight_copies"] * tokens == pytest.approx(local * (1 + 1 / 32))
    assert mx["moe_permuted_input"] == pytest.approx(ROUTED * (1 + 1 / 32) * MOE.hidden)
    # FP8 primary weights are the quantized tensors the ops use: no copy
    assert "moe_op_weight_copies" not in _moe_terms(replace(st, param_bytes=P.FP8))
    # and no cache across microbatches either: the experts' persistent FP8 copy is not kept (weights.model_state)
    p_ops = P.model_state(MOE, LAY, st, True, True)[0]
    p_mod = P.model_state(MOE, LAY, replace(st, moe_op_fuser=""), True, True)[0]
    expert = P._block_params(MOE, LAY, "moe")[1]
    assert p_mod - p_ops == pytest.approx(2 * P.FP8 * expert * MOE.layers)
    # the MoE checkpoint keeps none of them
    moe = P._selected_terms(MOE, LAY, replace(st, recompute="selective", modules=("moe",)), "attn+moe")
    assert "moe_op_weight_copies" not in moe and "moe_permuted_input" not in moe


def test_the_fused_grouped_mlp_keeps_mxfp8_columnwise_inputs_and_both_layouts_of_bf16_weights():
    st = P.Settings(fp8=True, moe_op_fuser="fused", moe_op_quant="mxfp8")
    terms = _moe_terms(st)
    q = quantized_bytes("mxfp8")
    assert q == 1 + 1 / 32 and quantized_bytes("blockwise") == 1 + 4 / 128 and quantized_bytes("delayed") == 1
    assert terms["moe_permuted_input"] == pytest.approx(ROUTED * q * MOE.hidden)
    assert terms["moe_fc1_output"] == ROUTED * P.BF16 * 2 * MOE.moe_ffn        # the kernel's bf16 c_tensor
    assert terms["moe_act_output"] == pytest.approx(ROUTED * q * MOE.moe_ffn)
    tokens = LAY.seq * LAY.mbs
    assert terms["moe_op_weight_copies"] * tokens == pytest.approx(2 * q * local_expert_params(MOE, LAY))
    # an FP8 job's bf16 layer runs outside fp8_autocast: TE fuses nothing there, the ops keep bf16 tensors
    bf16 = P.layer_activation_terms(MOE, LAY, st, "attn+moe" + P.BF16_LAYER)
    assert bf16["moe_permuted_input"] == ROUTED * P.BF16 * MOE.hidden and "moe_op_weight_copies" not in bf16


def test_moe_act_recompute_under_the_fuser_follows_the_fused_kernel():
    act = dict(recompute="selective", modules=("moe_act",))
    # the modules: the activation checkpoint drops FC2's input
    assert "moe_act_output" not in P._selected_terms(MOE, LAY, P.Settings(**act), "attn+moe")
    # the fused GLU kernel ignores activation_recompute_in_mlp: FC2's input stays
    glu = P.Settings(fp8=True, moe_op_fuser="fused", moe_op_quant="mxfp8", **act)
    assert "moe_act_output" in P._selected_terms(MOE, LAY, glu, "attn+moe")
    # the fused squared ReLU recomputes it from dsrelu
    srelu = replace(MOE, gated=False)
    st = replace(glu, moe_op_srelu=True)
    terms = P._selected_terms(srelu, LAY, st, "attn+moe")
    assert "moe_act_output" not in terms and terms["moe_fc1_output"] == ROUTED * P.BF16 * MOE.moe_ffn


def test_from_config_picks_the_fusers_path_and_names_what_megatron_core_refuses():
    from mbmem_overlays.memory.from_config import fused_grouped_mlp_eligible, moe_op_fuser, op_fuser_unsupported
    from mbmem_overlays.memory.coverage import op_fuser_blind
    import torch.nn.functional as F
    m = NS(use_transformer_engine_op_fuser=True, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=False,
           gated_linear_unit=True, activation_func=F.silu, moe_apply_probs_on_input=False,
           fine_grained_activation_offloading=False, offload_modules=[], moe_mlp_glu_interleave_size=32,
           hidden_size=1024, moe_latent_size=None, moe_ffn_hidden_size=512, transformer_impl="transformer_engine")
    assert op_fuser_unsupported(m, 1, 1) == ""
    assert "NVTE_CUTEDSL_FUSED_GROUPED_MLP" in op_fuser_unsupported(m, 1, 0)      # a GLU needs the flag
    assert "expert tensor parallelism 2" in op_fuser_unsupported(m, 2, 1)
    assert fused_grouped_mlp_eligible(m, "mxfp8", 1) and not fused_grouped_mlp_eligible(m, "tensorwise", 1)
    assert not fused_grouped_mlp_eligible(replace_ns(m, moe_mlp_glu_interleave_size=None), "mxfp8", 1)
    assert not fused_grouped_mlp_eligible(replace_ns(m, moe_ffn_hidden_size=520), "mxfp8", 1)
    assert moe_op_fuser(m, MOE, LAY, "mxfp8", 10, 1) == "fused"
    assert moe_op_fuser(m, MOE, LAY, "mxfp8", 9, 1) == "ops"          # TE fuses on compute capability 10 only
    assert moe_op_fuser(m, MOE, LAY, "mxfp8", 10, 0) == ""             # refused: no job to plan
    assert moe_op_fuser(m, DENSE, LAY, "mxfp8", 10, 1) == ""
    # named where the plan has no job: refused, moe_act with only the basic ops, or a dense MLP as TE fused ops
    # the config as Bridge's setup runs it (bridge/as_run.py): the preset's fp8 and fp8_recipe are on the model
    cfg = lambda **kw: NS(model=replace_ns(m, **{"num_moe_experts": 64, "expert_tensor_parallel_size": 1,  # noqa: E731
                                                 "tensor_model_parallel_size": 1, "recompute_granularity": None,
                                                 "recompute_modules": None, "fp8": "hybrid", "fp8_recipe": "mxfp8",
                                                 **kw}),
                          mixed_precision=None, env_vars={
                              "NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"})
    assert not op_fuser_blind(cfg())
    assert op_fuser_blind(cfg(expert_tensor_parallel_size=2))
    moe_act = cfg(recompute_granularity="selective", recompute_modules=["moe_act"])
    assert not op_fuser_blind(moe_act)
    assert op_fuser_blind(NS(model=replace_ns(moe_act.model, fp8_recipe="tensorwise"), mixed_precision=None,
                             env_vars=moe_act.env_vars))
    assert op_fuser_blind(NS(model=replace_ns(cfg().model, num_moe_experts=None)))


def replace_ns(ns: NS, **kw) -> NS:
    return NS(**{**vars(ns), **kw})


# ----------------------------------------------------------------------------- the paged stash
STASH = P.Settings(fp8=True, moe_op_fuser="fused", moe_op_quant="mxfp8", paged_stash_cuda=1.2, paged_stash_cpu=1.0,
                   moe_load=1.5, moe_rank_capacity=1.5, param_bytes=P.FP8)


def test_the_paged_stash_takes_the_fused_mlps_marked_tensors_out_of_the_saved_ones():
    with_stash = _moe_terms(STASH)
    without = _moe_terms(replace(STASH, paged_stash_cuda=0.0))
    for name in ("moe_permuted_input", "moe_fc1_output", "moe_act_output"):
        assert name in without and name not in with_stash
    # the basic ops mark nothing (TE's mark_grouped_tensor runs in the fused grouped MLP only): no stash
    ops = replace(STASH, moe_op_fuser="ops")
    assert _moe_terms(ops) == _moe_terms(replace(ops, paged_stash_cuda=0.0))
    assert P.paged_stash_buffer(MOE, LAY, ops, 0) == 0.0
    assert paged_stash_working(MOE, LAY, ops, 0) == 0.0


def test_the_paged_stash_buffer_is_its_factor_times_the_peak_of_balanced_in_flight_layers():
    from mbmem_overlays.memory.activations import paged_stash_layer_bytes
    per_layer = sum(_moe_terms(replace(STASH, paged_stash_cuda=0.0, moe_load=1.0))[n]
                    for n in ("moe_permuted_input", "moe_fc1_output", "moe_act_output")) * LAY.seq * LAY.mbs
    assert paged_stash_layer_bytes(MOE, LAY, STASH, "attn+moe", 1.0) == pytest.approx(per_layer)
    # PP 1: one microbatch of all 4 MoE layers in flight; the capture counts the expected (balanced) tokens
    assert P.paged_stash_buffer(MOE, LAY, STASH, 0) == pytest.approx(1.2 * 4 * per_layer)
    assert P.paged_stash_host_buffer(MOE, LAY, STASH, 0) == pytest.approx(1.0 * 4 * per_layer)
    # a negative factor sizes on the actual tokens, the same at balanced routing
    assert P.paged_stash_buffer(MOE, LAY, replace(STASH, paged_stash_cuda=-1.2), 0) == pytest.approx(
        1.2 * 4 * per_layer)
    # PP 2, 8 microbatches: rank 0 holds 2 layers of 2 microbatches in flight, rank 1 one
    pp = replace(LAY, pp=2, world=16, gbs=64)
    one = paged_stash_layer_bytes(MOE, pp, STASH, "attn+moe", 1.0)
    assert P.paged_stash_buffer(MOE, pp, STASH, 0) == pytest.approx(1.2 * 2 * 2 * one)
    assert P.paged_stash_buffer(MOE, pp, STASH, 1) == pytest.approx(1.2 * 2 * 1 * one)
    # the backward reloads a layer and prefetches the next at their padded (budget) shape
    assert paged_stash_working(MOE, LAY, STASH, 0) == pytest.approx(2 * 1.5 * per_layer)
    # the buffer is in every phase, the optimizer step included; the reload only in the steady state
    phases = P.phase_breakdowns(MOE, LAY, STASH, 0)
    assert dict(phases["optimizer step"].detail)["MoE paged stash GPU buffer (the experts' saved tensors)"] == \
        pytest.approx(1.2 * 4 * per_layer)
    assert "MoE paged stash: two layers' reloaded expert tensors" in dict(phases["steady 1F1B"].detail)
    # with the MoE checkpoint the forward saves nothing: one layer's recompute at a time
    moe = replace(STASH, recompute="selective", modules=("moe",))
    assert P.paged_stash_buffer(MOE, LAY, moe, 0) == pytest.approx(1.2 * per_layer)


# ----------------------------------------------------------------------------- deallocate_pipeline_outputs
def test_kept_stage_outputs_add_one_hidden_state_per_in_flight_microbatch_but_the_loss_chunks():
    lay = P.Layout(world=4, pp=4, seq=2048, mbs=1, gbs=16)
    st = P.Settings(keep_stage_outputs=True)
    hidden = P.BF16 * DENSE.hidden * lay.seq * lay.mbs
    for rank in range(4):
        kept = P.stage_activations(DENSE, lay, st, rank).steady - P.stage_activations(DENSE, lay, P.Settings(),
                                                                                        rank).steady
        alive = min(lay.pp - rank, lay.microbatches)       # 1F1B: pp - rank microbatches in flight
        assert kept == pytest.approx(0 if rank == 3 else alive * hidden), rank
    # interleaved: every chunk but the last rank's last one sends its output
    assert kept_stage_outputs(DENSE, replace(lay, vpp=2), st, 3, 2) == (1, 0)
    assert kept_stage_outputs(DENSE, replace(lay, vpp=2), st, 0, 2) == (1, 1)
    assert kept_stage_outputs(DENSE, replace(lay, pp=1), st, 0, 1) == (0,)


# ----------------------------------------------------------------------------- context-parallel attention
def test_a2a_context_parallelism_keeps_the_kernels_output_apart():
    cp = replace(LAY, cp=2)
    p2p, a2a = (P.layer_activation_terms(DENSE, cp, P.Settings(cp_comm=c), "attn+mlp") for c in ("p2p", "a2a"))
    out = P.BF16 * DENSE.heads * DENSE.head_dim
    assert set(a2a) - set(p2p) == {"attention_kernel_output"} and a2a["attention_kernel_output"] == out
    assert P.layer_activation_terms(DENSE, cp, P.Settings(cp_comm="a2a+p2p"), "attn+mlp") == a2a
    assert P.layer_activation_terms(DENSE, cp, P.Settings(cp_comm="allgather"), "attn+mlp") == p2p
    # core_attn recompute drops the kernel's copy; FP8 already kept it apart (linear_proj keeps a quantized one)
    core = replace(P.Settings(cp_comm="a2a"), recompute="selective", modules=("core_attn",))
    assert "attention_kernel_output" not in P._selected_terms(DENSE, cp, core, "attn+mlp")
    fp8 = [P.layer_activation_terms(DENSE, cp, P.Settings(fp8=True, cp_comm=c), "attn+mlp") for c in ("p2p", "a2a")]
    assert fp8[0] == fp8[1]


def test_allgather_context_parallelism_holds_one_layers_gathered_kv_and_their_gradients():
    lay = P.Layout(world=4, tp=2, cp=2, seq=8192, mbs=1, gbs=4)
    st = P.Settings(cp_comm="allgather")
    kv = DENSE.groups * DENSE.head_dim                 # K and V widths
    full = P.BF16 * lay.seq * lay.mbs / lay.tp          # over the whole sequence
    assert cp_allgather_working(DENSE, lay, st) == pytest.approx(full * (2 * (kv + kv) + kv))
    assert cp_allgather_working(DENSE, lay, P.Settings()) == 0.0
    assert cp_allgather_working(DENSE, replace(lay, cp=1), st) == 0.0
    base = P.stage_activations(DENSE, lay, P.Settings(), 0).steady
    # the last (and only) stage: the transient never coexists with the loss's logits, the larger of the two counts
    with_ag = P.stage_activations(DENSE, lay, st, 0)
    assert with_ag.steady >= base and "context-parallel all-gather" in " ".join(n for n, _ in with_ag.detail)
    from mbmem_overlays.memory.from_config import cp_comm_type
    assert cp_comm_type(NS(cp_comm_type=["a2a", "a2a"])) == "a2a" and cp_comm_type(NS(cp_comm_type=None)) == "p2p"
    from mbmem_overlays.memory.coverage import not_modelled
    mixed = NS(model=NS(cp_comm_type=["a2a", "p2p"], context_parallel_size=2))
    assert [n for n in not_modelled(mixed) if n.startswith("model.cp_comm_type")]
    assert not [n for n in not_modelled(NS(model=NS(cp_comm_type="a2a", context_parallel_size=2)))
                if n.startswith("model.cp_comm_type")]


# ----------------------------------------------------------------------------- Gemma 2 and the softmax's dtype
def test_gemma2_attention_flex_keeps_its_output_apart_and_the_fallback_its_softcap():
    lay = P.Layout(world=1, seq=4096, mbs=1, gbs=1)
    base = P.layer_activation_terms(DENSE, lay, P.Settings(), "attn+mlp")
    flex = P.layer_activation_terms(DENSE, lay, P.Settings(attn_softcap="flex"), "attn+mlp")
    assert set(flex) - set(base) == {"attention_kernel_output"}
    assert flex["attention_softmax_stats"] == base["attention_softmax_stats"]      # FlexAttention's logsumexp
    unfused = P.Settings(attn_softcap="unfused", attention_scores="torch_softmax", softmax_fp32=False)
    terms = P.layer_activation_terms(DENSE, lay, unfused, "attn+mlp")
    scores = DENSE.heads * lay.seq                        # per token: heads x keys
    assert terms["attention_softcap"] == P.BF16 * scores     # tanh keeps its output
    assert terms["attention_scores"] == P.BF16 * scores      # torch's softmax in bf16 without softmax_in_fp32
    core = replace(unfused, recompute="selective", modules=("core_attn",))
    assert not {"attention_softcap", "attention_scores"} & set(P._selected_terms(DENSE, lay, core, "attn+mlp"))


def test_softmax_in_fp32_upcasts_torchs_softmax_only():
    lay = P.Layout(world=1, seq=4096)
    fp32 = P.Settings(attention_scores="torch_softmax")
    assert attention_scores_bytes(fp32, lay) == P.FP32 + P.BF16      # fp32 softmax and its cast back
    assert attention_scores_bytes(replace(fp32, softmax_fp32=False), lay) == P.BF16
    fused = P.Settings(attention_scores="fused_softmax", softmax_fp32=False)
    assert attention_scores_bytes(fused, lay) == P.BF16


def test_softcapped_logits_keep_one_more_logits_sized_tensor_per_loss_microbatch():
    lay = P.Layout(world=2, pp=2, seq=2048, mbs=1, gbs=8)
    st = P.Settings(logit_softcap=True)
    tanh = P.BF16 * DENSE.vocab * lay.seq
    assert logit_softcap_bytes(DENSE, lay, st) == tanh and logit_softcap_bytes(DENSE, lay, P.Settings()) == 0
    last = P.stage_activations(DENSE, lay, st, 1).steady - P.stage_activations(DENSE, lay, P.Settings(), 1).steady
    assert last == pytest.approx(tanh)
    assert P.stage_activations(DENSE, lay, st, 0).steady == P.stage_activations(DENSE, lay, P.Settings(), 0).steady


def test_an_unscattered_embedding_output_is_whole_on_every_tensor_parallel_rank():
    lay = P.Layout(world=4, tp=4, sp=True, pp=1, seq=2048, mbs=1, gbs=1)
    shard = P.BF16 * DENSE.hidden * lay.seq / lay.tp
    diff = P.stage_activations(DENSE, lay, P.Settings(embedding_whole=True), 0).steady - P.stage_activations(
        DENSE, lay, P.Settings(), 0).steady
    assert diff == pytest.approx((lay.tp - 1) * shard)


# ----------------------------------------------------------------------------- shipped recipes
@pytest.fixture(scope="module")
def gemma2(bridge):
    cfg = bridge.build_recipe("gemma2_2b_pretrain_2gpu_h100_bf16_config")
    return cfg, P.from_config(cfg, 2)


@pytest.mark.bridge
def test_gemma2_is_planned_on_flexattention_with_the_materialized_scores_as_its_range(gemma2):
    from mbmem_overlays.memory.coverage import not_modelled
    from mbmem_overlays.memory.ranges import uncertainty
    cfg, (shape, lay, st) = gemma2
    assert st.attn_softcap == "flex" and st.logit_softcap and cfg.model.final_logit_softcapping == 30.0
    assert st.attn_softcap_scores in ("fused_softmax", "torch_softmax")
    assert not [n for n in not_modelled(cfg) if "softcapping" in n]
    b = P.estimate(shape, lay, st)
    ranges = [r for r in uncertainty(shape, lay, st, b) if r.component == "activations (Gemma 2's core attention)"]
    assert len(ranges) == 1 and ranges[0].high > ranges[0].low == b.footprint
    assert ranges[0].assumption == P.ATTENTION_KERNEL
    # a dataset that passes the attention mask takes the materialized path
    from mbmem_overlays.memory.from_config import gemma2_attention
    masked = NS(model=cfg.model, dataset=NS(skip_getting_attention_mask_from_dataset=False))
    assert gemma2_attention(masked) == "unfused"


@pytest.mark.bridge
def test_a2a_and_kept_outputs_on_shipped_recipes(bridge):
    from mbmem_overlays.memory.coverage import not_modelled
    qwen = bridge.build_recipe("qwen3_8b_sft_8gpu_h100_bf16_32k_config")
    shape, lay, st = P.from_config(qwen, 8)
    assert lay.cp > 1 and st.cp_comm == "a2a" == qwen.model.cp_comm_type
    assert "attention_kernel_output" in P.layer_activation_terms(shape, lay, st, "attn+mlp")
    assert not [n for n in not_modelled(qwen) if "cp_comm_type" in n]
    moon = bridge.build_recipe("moonlight_16b_sft_8gpu_h100_bf16_config")
    shape, lay, st = P.from_config(moon, 8)
    assert moon.model.deallocate_pipeline_outputs is False and lay.pp > 1 and st.keep_stage_outputs
    kept = dict(P.stage_activations(shape, lay, st, 0).detail)["stage outputs kept after the send "
                                                               "(deallocate_pipeline_outputs off)"]
    tokens = lay.seq * lay.mbs / lay.cp / (lay.tp if lay.sp else 1)
    assert kept == pytest.approx(st.dtype_bytes * shape.hidden * tokens * rank_alive(lay, 0)[0][0])
    assert not [n for n in not_modelled(moon) if "deallocate" in n]


@pytest.mark.bridge
def test_qwen3_moe_on_gb200_runs_the_fused_grouped_mlp_with_the_paged_stash(bridge):
    from mbmem_overlays.memory.coverage import not_modelled
    cfg = bridge.build_recipe("megatron.bridge.perf_recipes.qwen.gb200.qwen3_moe."
                              "qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config")
    shape, lay, st = P.from_config(cfg, 8, arch=10)
    assert (st.moe_op_fuser, st.moe_op_quant, st.paged_stash_cuda) == ("fused", "mxfp8", 1.2)
    assert st.moe_load == pytest.approx(1.5)          # HybridEP's rank budget
    b = P.estimate(shape, lay, st)
    stash = dict(b.detail)["MoE paged stash GPU buffer (the experts' saved tensors)"]
    assert stash == pytest.approx(P.paged_stash_buffer(shape, lay, st, b.rank)) and stash > 0
    # on a GPU TE does not fuse on, the basic ops run and the stash holds nothing
    h100 = P.from_config(cfg, 8, arch=9)[2]
    assert h100.moe_op_fuser == "ops" and P.paged_stash_buffer(shape, lay, h100, 0) == 0.0
    assert not [n for n in not_modelled(cfg) if "op_fuser" in n or "paged_stash" in n]

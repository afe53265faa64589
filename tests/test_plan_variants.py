"""The attention-variant terms of the memory plan (memory/variants.py), each pinned to the megatron-core 0.19.2 /
fla-core 0.4.2 code it comes from: the gated delta net's and DSA's layer patterns (checked against megatron-core's
own functions), parameters and saved tensors, what selective recompute drops, the attention output gate, the
hybrid symbols G, D and +, and what coverage.py names. The last tests build Bridge's shipped Qwen3-Next and GLM-5.2
recipes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory import variants as V
from mbmem_overlays.memory.activations import _selected_terms
from mbmem_overlays.memory.inputs import _tokens
from mbmem_overlays.memory.pipeline import HYBRID_SYMBOLS
from mbmem_overlays.memory.coverage import FIELD_CLASSES, not_modelled
from mbmem_overlays.memory.from_config import attention_blocks, hybrid_pattern, share_dsa_topk

# a small Qwen3-Next-like GDN shape: 4 key heads, 8 value heads of 64, hidden 512
GDN = P.Shape(layers=4, hidden=512, ffn=1024, heads=8, groups=2, head_dim=64, vocab=1024,
              layer_kinds=("gdn+mlp", "gdn+mlp", "gdn+mlp", "attn+mlp"),
              gdn_key_heads=4, gdn_value_heads=8, gdn_key_dim=64, gdn_value_dim=64, gdn_conv=4)
# a small GLM-5-like DSA shape: 8 heads, MLA latents (FlashMLA's 512-wide latent value), q and kv norms
# (qk_layernorm in a GPT model), an indexer of 4 heads of 32, top-k 256
DSA = P.Shape(layers=2, hidden=512, ffn=1024, heads=8, groups=8, head_dim=64, vocab=1024, mla=True,
              qk_head_dim=48, qk_pos_dim=16, v_head_dim=32, kv_lora_rank=512, q_lora_rank=96, qk_norm=True,
              layer_kinds=("dsa+mlp", "dsa_shared+mlp"), dsa_heads=4, dsa_head_dim=32, dsa_topk=256,
              dsa_qkv_norms=True)
ALL = lambda target: True  # noqa: E731


def _site_packages() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- which layers are which
@pytest.mark.parametrize("freq", [4, 2, 1, [1, 0, 1, 1, 0, 0, 1, 1]])
def test_linear_attention_pattern_is_megatron_cores(freq):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    config = SimpleNamespace(linear_attention_freq=freq, num_layers=8, experimental_attention_variant="gated_delta_net")
    assert V.linear_attention_pattern(freq, 8) == tuple(bool(x) for x in get_linear_attention_pattern(config))


def test_dsa_topk_sharing_is_megatron_cores():
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer
    for freq in (1, 2, 3, 4):
        for offset in (0, 1, 2, 5):
            assert [V.dsa_reuses_topk(n, offset, freq) for n in range(1, 20)] == \
                [freq > 1 and is_dsa_skip_topk_layer(n, offset, freq) for n in range(1, 20)]


def test_gpt_layers_take_the_variant_block_megatron_core_builds():
    m = SimpleNamespace(experimental_attention_variant="gated_delta_net", linear_attention_freq=4)
    assert attention_blocks(m, 8) == ("gdn", "gdn", "gdn", "attn") * 2
    assert attention_blocks(SimpleNamespace(experimental_attention_variant="dsa"), 3) == ("dsa",) * 3
    # a variant 0.19.2 does not build is planned as softmax attention (and named by coverage)
    assert attention_blocks(SimpleNamespace(experimental_attention_variant="dsv4_hybrid"), 2) == ("attn", "attn")
    shared = share_dsa_topk(("dsa+mlp",) * 5, SimpleNamespace(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=0))
    assert shared == ("dsa+mlp", "dsa_shared+mlp", "dsa+mlp", "dsa_shared+mlp", "dsa+mlp")


def test_hybrid_symbols_g_d_and_plus_are_blocks():
    kinds, mtp, _ = hybrid_pattern("MG*D+-E/G-")
    assert kinds == ("mamba", "gdn", "attn", "dsa", "mla", "mlp", "moe")
    assert mtp == ("gdn", "mlp")
    # the symbols are megatron-core's (models/hybrid/hybrid_layer_allocation.py Symbols)
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
    assert set(HYBRID_SYMBOLS) == Symbols.VALID_LAYERS


# ----------------------------------------------------------------------------- the gated delta net
def test_gdn_parameters_are_in_proj_conv_gates_norm_and_out_proj():
    h, qk, v, hv = 512, 4 * 64, 8 * 64, 8
    in_proj = h * (2 * qk + 2 * v + 2 * hv)        # q, k, v, z, beta, alpha
    conv = (2 * qk + v) * 4                         # depthwise over q, k, v; no bias
    expected = h + in_proj + conv + 2 * hv + 64 + v * h   # fused input norm, dt_bias + A_log, out_norm, out_proj
    assert V.block_params(GDN, P.Layout(world=1), "gdn") == expected
    assert P._block_params(GDN, P.Layout(world=1), "gdn") == (expected, 0.0)
    # TP splits everything but the norms (out_norm is over one head)
    tp2 = V.block_params(GDN, P.Layout(world=2, tp=2), "gdn")
    assert tp2 == h + in_proj / 2 + conv / 2 + hv + 64 + v * h / 2


@pytest.mark.parametrize("tp", [1, 2])
def test_a_gdn_layer_keeps_the_projection_the_kernel_inputs_and_the_gated_norm(tp):
    lay = P.Layout(world=tp, tp=tp, seq=1024)
    terms = V.gdn_activation_terms(GDN, lay, P.Settings(), ln_out=2, gemm_in=2, keeps_input=ALL)
    hk, hv = 4 / tp, 8 / tp
    qk, v = hk * 64, hv * 64
    assert terms["gdn_in_proj_output"] == 2 * (2 * qk + 2 * v + 2 * hv)    # the conv's saved view keeps it whole
    assert terms["gdn_qk_l2norm"] == 2 * 2 * qk + 4 * 2 * hk              # l2norm's output and rstd
    assert terms["gdn_kernel_qkv"] == 2 * (2 * hv * 64 + v)               # q, k repeated to the value heads, v
    assert terms["gdn_kernel_gates"] == 4 * hv + 2 * hv + 2 * hv * 64 + 2 * hv   # g (fp32), beta, A, alpha
    assert terms["gdn_core_attn_output"] == terms["gdn_gate"] == terms["gdn_norm_output"] == 2 * v
    assert terms["gdn_norm_stats"] == 4 * hv
    assert terms["gdn_out_proj_input"] == 2 * v
    layer = P.layer_activation_terms(GDN, lay, P.Settings(), "gdn+mlp")
    assert {k: layer[k] for k in terms} == terms and layer["gdn_layernorm_input"] == 2 * 512


def test_gdn_norm_out_recompute_drops_the_norm_and_out_projs_bf16_input():
    lay = P.Layout(world=1, seq=1024)
    eager = P.layer_activation(GDN, lay, P.Settings(), "gdn")
    st = P.Settings(recompute="selective", modules=("gdn_norm_out",))
    v, hv = 8 * 64, 8
    assert eager - P.layer_activation(GDN, lay, st, "gdn") == (4 * hv + 2 * v + 2 * v) * 1024
    # under FP8 out_proj keeps its quantized copy, which the checkpoint does not free
    fp8 = P.Settings(fp8=True, recompute="selective", modules=("gdn_norm_out",))
    assert "gdn_out_proj_input_fp8" in _selected_terms(GDN, lay, fp8, "gdn")
    # core_attn is softmax attention's label: a GDN layer keeps everything
    core = P.Settings(recompute="selective", modules=("core_attn",))
    assert P.layer_activation(GDN, lay, core, "gdn") == eager


# ----------------------------------------------------------------------------- DeepSeek sparse attention
@pytest.mark.parametrize("arch", [9, 10])
def test_flash_mla_head_padding_is_megatron_cores(arch, monkeypatch):
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels as k
    monkeypatch.setattr(k, "_current_sm", lambda: (arch, 0))
    for heads in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256):
        assert V.dsa_padded_heads(heads, arch) == (k._flash_mla_head_padding(heads) or heads)


def test_dsa_parameters_are_mla_plus_an_indexer_on_computing_layers():
    lay = P.Layout(world=1)
    mla = P._attention_params(DSA) + 512 + 96 + 512      # + the input norm and the q / kv norms
    indexer = 96 * 4 * 32 + 512 * 32 + 2 * 32 + 512 * 4  # wq_b (from q_lora), wk, k_norm (LayerNorm), weights_proj
    assert V.block_params(DSA, lay, "dsa") == mla + indexer
    assert V.block_params(DSA, lay, "dsa_shared") == mla
    # the indexer is duplicated on every TP rank
    tp2 = P.Layout(world=2, tp=2, sp=True)
    assert V.block_params(DSA, tp2, "dsa") - V.block_params(DSA, tp2, "dsa_shared") == indexer


def test_dsa_cudnn_layer_keeps_query_key_topk_latent_output_and_the_indexer_grads():
    lay = P.Layout(world=1, seq=1024)
    st = P.Settings(dsa_backend="cudnn", dsa_loss=True)
    terms = V.dsa_activation_terms(DSA, lay, st, ln_out=2, computes_topk=True)
    latent = 512 + 16
    assert terms["dsa_query"] == 2 * 8 * latent and terms["dsa_key"] == 2 * latent
    assert terms["dsa_q_up_output"] == 2 * 8 * (48 + 16)        # kept by the absorbing einsum
    assert terms["dsa_topk_indices"] == 4 * 256                  # int32 global indices
    assert terms["dsa_latent_output"] == 2 * 64 * 512            # FlashMLA pads 8 heads to 64 on Hopper
    assert terms["dsa_softmax_stats"] == 4 * 64
    assert terms["dsa_up_v_weight"] == 2 * 8 * 32 * 512 / 1024   # one weight-sized copy per layer-microbatch
    assert "dsa_loss_topk_indices" not in terms                  # the joint kernel's precomputed gradients
    assert terms["dsa_indexer"] == 2 * 32 + 8 + 2 * 4 * 32 + 4 * 32 + 2 * 4
    assert terms["attention_output"] == 2 * 8 * 32
    assert "dsa_scores" not in terms
    # a layer reusing the top-k has no indexer; without the loss the indexer keeps nothing
    shared = V.dsa_activation_terms(DSA, lay, st, ln_out=2, computes_topk=False)
    assert "dsa_indexer" not in shared and shared["dsa_topk_indices"] == terms["dsa_topk_indices"]
    assert "dsa_indexer" not in V.dsa_activation_terms(DSA, lay, replace(st, dsa_loss=False), 2, True)
    # 192 heads: a multiple of 64 on Hopper; FlashMLA declines it on Blackwell, where the unfused path runs
    assert V.dsa_activation_terms(replace(DSA, heads=192), lay, st, 2, True)["dsa_latent_output"] == 2 * 192 * 512
    assert "dsa_scores" in V.dsa_activation_terms(replace(DSA, heads=192), lay, replace(st, gpu_arch=10), 2, True)


def test_dsa_unfused_path_materializes_the_scores_over_every_key():
    lay = P.Layout(world=1, seq=1024)
    terms = V.dsa_activation_terms(DSA, lay, P.Settings(dsa_backend="none", dsa_loss=True), 2, True)
    assert terms["dsa_scores"] == 13 * 8 * 1024                  # 3 bool masks, 2 fp32, 1 bf16 per score
    assert terms["dsa_fp32_query_key"] == 4 * 8 * 528 + 4 * 528
    assert terms["dsa_topk_indices"] == 8 * 256                  # the reference loss saves int64 indices
    # the unfused attention backend turns the fused kernels off (dsa_kernels.py use_fused_dsa_kernels)
    from mbmem_overlays.memory.from_config import dsa_backend
    assert dsa_backend(SimpleNamespace(attention_backend="unfused", dsa_kernel_backend="cudnn")) == "none"
    assert dsa_backend(SimpleNamespace(attention_backend="auto", dsa_kernel_backend="cudnn")) == "cudnn"


def test_dsa_recompute_labels_drop_what_their_checkpoints_free():
    lay = P.Layout(world=1, seq=1024)
    st = P.Settings(dsa_backend="cudnn", dsa_loss=True)
    eager = _selected_terms(DSA, lay, st, "dsa")
    core = _selected_terms(DSA, lay, replace(st, recompute="selective", modules=("core_attn",)), "dsa")
    assert set(eager) - set(core) == {"dsa_topk_indices", "dsa_latent_output", "dsa_softmax_stats",
                                      "dsa_up_v_weight", "dsa_indexer"}
    up = _selected_terms(DSA, lay, replace(st, recompute="selective", modules=("mla_up_proj",)), "dsa")
    assert set(eager) - set(up) == {"dsa_q_up_output", "dsa_query", "dsa_key"}
    assert up["dsa_up_proj_checkpoint_inputs"] == 2 * 512 + 2 * (512 + 16)


# ----------------------------------------------------------------------------- which DSA path runs
@pytest.mark.parametrize("arch", [8, 9, 10])
def test_the_fused_dsa_path_runs_where_flash_mla_takes_the_layout(arch, monkeypatch):
    """dsa_fused follows megatron-core's own checks: FlashMLA's 512-wide latent value and its head padding (none
    before SM90); every cuDNN hook declines the rest, and the unfused path runs (its scores over every key)."""
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels as k
    monkeypatch.setattr(k, "_current_sm", lambda: (arch, 0))
    st = P.Settings(dsa_backend="cudnn", gpu_arch=arch)
    for rank, pos in ((512, 64), (512, 16), (128, 64), (256, 512)):
        for heads in (4, 8, 48, 64, 128, 192):
            s = replace(DSA, kv_lora_rank=rank, qk_pos_dim=pos, heads=heads)
            expected = (k._supports_flash_mla_value_layout(rank + pos, rank)
                        and k._flash_mla_head_padding(heads) is not None)
            assert V.dsa_fused(s, P.Layout(world=1), st) == expected, (rank, pos, heads)
            terms = V.dsa_activation_terms(s, P.Layout(world=1, seq=1024), st, 2, True)
            assert ("dsa_scores" in terms) == (not expected)
    assert not V.dsa_fused(DSA, P.Layout(world=1), P.Settings(dsa_backend="none", gpu_arch=arch))


def _joint_kernel_runs(monkeypatch, cp: int, loss: float, sparse: bool, packed: bool) -> bool:
    """Whether megatron-core's run_fused_dsa_attention takes the joint kernel (FusedIndexerSparseAttnFunc) for the
    mask DSAttention builds (dsa_masking.build_dsattention_forward_mask), on CPU tensors: the kernel is replaced by
    a sentinel, what it declines returns None before any CUDA call."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels as k, dsa_masking

    class Joint(Exception):
        pass

    def joint(*args, **kwargs):
        raise Joint

    monkeypatch.setattr(k, "fused_indexer_sparse_attn", joint)
    sq, heads = 8, 4
    skv = sq * cp
    params = None
    if packed:
        cu = torch.tensor([0, skv // 2, skv], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=skv,
                                 max_seqlen_kv=skv)
    _, bounds, plain = dsa_masking.build_dsattention_forward_mask(
        sq=sq, skv=skv, b=1, device=torch.device("cpu"), cp_size=cp, cp_rank=0, cp_comm_type="allgather",
        cp_group=None, attn_mask_type=AttnMaskType.causal, attention_mask=None, position_ids=None,
        packed_seq_params=params)
    starts, ends, positions = bounds
    try:
        out = k.run_fused_dsa_attention(
            config=SimpleNamespace(kv_lora_rank=512), query=torch.zeros(sq, 1, heads, 576),
            key=torch.zeros(skv, 1, 1, 576), value=None, up_v_weight=torch.zeros(heads, 32, 512),
            q_indexer=torch.zeros(sq, 1, 2, 32), k_indexer=torch.zeros(skv, 1, 32), indexer_weights=torch.zeros(sq, 1, 2),
            indexer_topk=4, softmax_scale=1.0, loss_coeff=loss, sparse_loss=sparse, calculate_per_token_loss=False,
            absorbed_mla=True, cp_size=cp, attn_mask_type=AttnMaskType.causal, packed_seq_params=params,
            varlen_starts=starts, varlen_ends=ends, key_positions=positions, query_valid_rows=None,
            varlen_is_plain_causal=plain, use_relu=True,
            # dsa.py DSAttention.forward :1927-1934
            use_local_indexer_varlen=packed and cp > 1 and positions is None)
    except Joint:
        return True
    assert out is None
    return False


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_the_reference_indexer_loss_runs_where_the_joint_kernel_declines(cp, packed, monkeypatch):
    """With context parallelism (or packed sequences) the joint kernel declines only the dense indexer loss, and the
    split path keeps the fused sparse attention with the reference loss (int64 top-k, bf16 indexer q, weights, k);
    the sparse loss and no loss take the joint kernel; index sharing never tries it."""
    lay = P.Layout(world=cp, cp=cp, seq=1024)
    for loss in (0.0, 0.1):
        for sparse in (False, True):
            st = P.Settings(dsa_backend="cudnn", dsa_loss=loss > 0, dsa_sparse_loss=sparse, packed_sequences=packed)
            joint = _joint_kernel_runs(monkeypatch, cp, loss, sparse, packed)
            assert V.dsa_reference_loss(DSA, lay, st) == (loss > 0 and not joint), (loss, sparse)
            terms = V.dsa_activation_terms(DSA, lay, st, 2, True)
            assert "dsa_scores" not in terms                          # the sparse attention stays fused
            if loss > 0 and not joint:
                assert terms["dsa_loss_topk_indices"] == 8 * 256
                assert terms["dsa_indexer"] == 2 * 32 + 8 + 2 * 4 * 32 + 2 * 4 + 2 * 32 * cp
            else:
                assert "dsa_loss_topk_indices" not in terms
    # index sharing: the split path, the sparse loss kept fused, the dense one on the reference path
    shared = replace(DSA, dsa_topk_freq=2)
    assert V.dsa_reference_loss(shared, P.Layout(world=1), P.Settings(dsa_backend="cudnn", dsa_loss=True))
    assert not V.dsa_reference_loss(shared, P.Layout(world=1), P.Settings(dsa_backend="cudnn", dsa_loss=True,
                                                                           dsa_sparse_loss=True))


@pytest.mark.bridge
def test_packed_sequences_are_bridges_packed_batches(bridge):
    from megatron.bridge.training.gpt_step import _uses_packed_sequence_metadata

    from mbmem_overlays.memory.from_config import packed_sequences
    for dataset in (None, SimpleNamespace(), SimpleNamespace(enable_in_batch_packing=True),
                    SimpleNamespace(enable_offline_packing=True, offline_packing_specs=None),
                    SimpleNamespace(enable_offline_packing=True,
                                    offline_packing_specs=SimpleNamespace(packed_sequence_size=-1)),
                    SimpleNamespace(enable_offline_packing=True,
                                    offline_packing_specs=SimpleNamespace(packed_sequence_size=4096))):
        cfg = SimpleNamespace(dataset=dataset)
        assert packed_sequences(cfg) == bool(_uses_packed_sequence_metadata(cfg)), dataset


# ----------------------------------------------------------------------------- a hybrid stack's D
def test_a_hybrid_d_layer_has_no_q_or_kv_norm():
    """hybrid_layer_specs.py builds the D layer's q and kv norms as IdentityOp: no weights, no saved inputs, and
    without SP the up-projection checkpoint's kv_compressed is a view of kv_down's output."""
    hybrid = replace(DSA, mla=False, layer_kinds=("dsa", "moe"), dsa_qkv_norms=False)
    lay = P.Layout(world=1, seq=1024)
    assert V.block_params(DSA, lay, "dsa") - V.block_params(hybrid, lay, "dsa") == 96 + 512
    st = P.Settings(dsa_backend="cudnn")
    gpt, d = (V.dsa_activation_terms(x, lay, st, 2, True) for x in (DSA, hybrid))
    assert set(gpt) - set(d) == {"dsa_q_norm_input", "dsa_kv_norm_input"}
    up = P.Settings(recompute="selective", modules=("mla_up_proj",))
    assert _selected_terms(hybrid, lay, up, "dsa")["dsa_up_proj_checkpoint_inputs"] == 2 * (512 + 16)
    sp = P.Layout(world=2, tp=2, sp=True, seq=1024)
    assert (_selected_terms(hybrid, sp, up, "dsa")["dsa_up_proj_checkpoint_inputs"]
            == _selected_terms(DSA, sp, up, "dsa")["dsa_up_proj_checkpoint_inputs"])


DSA_ARGS = ["--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512", "--max-position-embeddings",
            "512", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "10", "--vocab-size", "1024",
            "--tokenizer-type", "NullTokenizer", "--bf16", "--position-embedding-type", "none",
            "--multi-latent-attention", "--kv-lora-rank", "512", "--q-lora-rank", "64", "--qk-head-dim", "32",
            "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm",
            "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "2", "--dsa-indexer-head-dim", "32",
            "--dsa-indexer-topk", "64"]


@pytest.mark.bridge
def test_a_megatron_lm_dsa_job_has_q_and_kv_norms_in_a_gpt_model_only(bridge):
    """--qk-layernorm builds DSA's q and kv norms in a GPT model; the hybrid stack's D builds IdentityOp whatever it
    says."""
    pytest.importorskip("mbmem_overlays.bridge.megatron_args", reason="needs the Megatron-LM arguments input")
    from mbmem_overlays.bridge.megatron_args import load_job
    hybrid = load_job(DSA_ARGS + ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
                                  "--hybrid-layer-pattern", "D-D-"], world_size=1, script="pretrain_hybrid.py")
    gpt = load_job(DSA_ARGS + ["--num-layers", "2"], world_size=1, script="pretrain_gpt.py")
    (h, _, _), (g, _, _) = P.from_config(hybrid.config, 1), P.from_config(gpt.config, 1)
    assert P.layer_kinds(h) == ("dsa", "mlp", "dsa", "mlp") and P.layer_kinds(g) == ("dsa+mlp", "dsa+mlp")
    assert g.dsa_qkv_norms and not h.dsa_qkv_norms


# ----------------------------------------------------------------------------- fine-grained offloading
def _offload(*modules: str, **settings) -> P.Settings:
    from mbmem_overlays.memory.levers import FineGrainedOffload
    return P.Settings(fine_grained_offload=FineGrainedOffload(modules, min_elements=0), **settings)


ATTENTION_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")


def test_offload_contexts_are_entered_by_softmax_attention_and_mla_only():
    """The qkv_linear / core_attn / attn_proj contexts are in Attention.forward and MultiLatentAttention.forward;
    GatedDeltaNet, absorbed MLA and DSAttention enter none."""
    import inspect

    from megatron.core.ssm.gated_delta_net import common, gdn
    from megatron.core.transformer import attention, multi_latent_attention
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla, dsa
    for forward in (attention.Attention.forward, multi_latent_attention.MultiLatentAttention.forward):
        source = inspect.getsource(forward)
        assert all(f'"{m}")' in source or f'"{m}"' in source for m in ("qkv_linear", "attn_proj"))
    for module in (gdn, common, absorbed_mla, dsa):
        assert "off_interface" not in inspect.getsource(module) and "offload" not in inspect.getsource(module)


def test_offloading_a_gated_delta_net_layer_moves_only_its_moe_part():
    s = replace(GDN, experts=4, moe_ffn=256, topk=2, moe_layers=4,
                layer_kinds=("gdn+moe", "gdn+moe", "gdn+moe", "attn+moe"))
    lay = P.Layout(world=1, seq=1024)
    from mbmem_overlays.memory.levers import layer_offload, no_saving_reason, unhooked_layers_text
    st = _offload(*ATTENTION_MODULES, "mlp_norm", "expert_fc1")
    moved = layer_offload(s, lay, st, "gdn+moe").gpu
    assert moved and set(moved) <= {"moe_layernorm_input", "moe_permuted_input"}
    assert "attention_qkv" in layer_offload(s, lay, st, "attn+moe").gpu       # the softmax layer's are taken
    text = unhooked_layers_text(s, st)
    assert text.startswith("qkv_linear, core_attn, attn_proj: the 3 gated delta net layers of 4 keep")
    attention_only = _offload("qkv_linear", "core_attn", "attn_proj")
    assert not layer_offload(s, lay, attention_only, "gdn+moe").host
    gdn_only = replace(s, layer_kinds=("gdn+moe",) * 4)
    assert "gated delta nets or DSA" in no_saving_reason("fine_grained_offload", gdn_only, lay, attention_only)


@pytest.mark.parametrize("kind, norm_input", [("dsa+mlp", "dsa_layernorm_input"),
                                              ("dsa_shared+mlp", "dsa_shared_layernorm_input"),
                                              ("dsa", "dsa_layernorm_input"), ("mla", "mla_layernorm_input")])
def test_offloading_a_dsa_or_hybrid_mla_layer_takes_its_separate_norms_input(kind, norm_input):
    """DSA's input norm is a module of its own (GPT and hybrid specs), and so is a hybrid "+" layer's: attn_norm
    moves the layer input it saves. DSA's projections, kernel and linear_proj keep theirs (absorbed MLA enters no
    offload context); a hybrid "+" is MultiLatentAttention, whose contexts take its q, k, v."""
    from mbmem_overlays.memory.levers import layer_offload
    lay = P.Layout(world=1, seq=1024)
    one = layer_offload(DSA, lay, _offload(*ATTENTION_MODULES, dsa_backend="cudnn"), kind)
    terms = P.layer_activation_terms(DSA, lay, P.Settings(dsa_backend="cudnn"), kind)
    assert one.gpu[norm_input] == terms[norm_input] == 2 * 512
    if kind.startswith("dsa"):
        assert set(one.gpu) == {norm_input}
    else:
        assert {"attention_qkv", "attention_layernorm_output"} <= set(one.gpu)
    graphed = _offload(*ATTENTION_MODULES, dsa_backend="cudnn", graph_scopes=("attn",))
    graphed = replace(graphed, fine_grained_offload=replace(graphed.fine_grained_offload, graph_modules=("attn",)))
    assert norm_input not in layer_offload(DSA, lay, graphed, kind).gpu


# ----------------------------------------------------------------------------- softmax attention's output gate
def test_the_output_gate_widens_qkv_and_keeps_the_gate_and_the_kernel_output():
    s = P.Shape(layers=1, hidden=512, ffn=1024, heads=8, groups=2, head_dim=64, vocab=1024)
    gated = replace(s, attn_gate=True)
    assert P._attention_params(gated) - P._attention_params(s) == 512 * 8 * 64
    lay = P.Layout(world=1, seq=1024)
    plain = P.layer_activation_terms(s, lay, P.Settings(), "attn")
    terms = P.layer_activation_terms(gated, lay, P.Settings(), "attn")
    assert set(terms) - set(plain) == {"attention_gate", "attention_gate_input"}
    assert terms["attention_gate"] == terms["attention_gate_input"] == terms["attention_output"] == 2 * 8 * 64
    # core_attn recompute cannot drop the kernel output the gate's product holds
    core = P.Settings(recompute="selective", modules=("core_attn",))
    assert "attention_gate_input" in _selected_terms(gated, lay, core, "attn")


# ----------------------------------------------------------------------------- the shared expert's gate (Qwen3-Next)
def test_the_shared_expert_gate_adds_its_weight_and_keeps_the_shared_output_and_the_gate():
    """moe_shared_expert_gate: a (1, hidden) weight whole on every TP rank; output * sigmoid(x @ w) keeps the shared
    expert's output and the gate per token (sequence-local under SP); the shared-experts checkpoint drops both."""
    from mbmem_overlays.memory.optimizers import block_tensors
    s = P.Shape(layers=1, hidden=512, ffn=1024, heads=8, groups=8, head_dim=64, vocab=1024, experts=4, moe_ffn=256,
                topk=2, shared_ffn=256, moe_layers=1, layer_kinds=("attn+moe",))
    gated = replace(s, shared_gate=True)
    for lay in (P.Layout(world=1), P.Layout(world=2, tp=2, sp=True)):
        assert P._block_params(gated, lay, "moe")[0] - P._block_params(s, lay, "moe")[0] == 512
        assert len(block_tensors(gated, lay, "moe")[0]) == len(block_tensors(s, lay, "moe")[0]) + 1
        plain = P.layer_activation_terms(s, replace(lay, seq=1024), P.Settings(), "attn+moe")
        terms = P.layer_activation_terms(gated, replace(lay, seq=1024), P.Settings(), "attn+moe")
        assert set(terms) - set(plain) == {"shared_expert_gate"}
        assert terms["shared_expert_gate"] == 2 * (512 + 1) / lay.tp
    lay = P.Layout(world=1, seq=1024)
    for label in ("shared_experts", "moe"):
        st = P.Settings(recompute="selective", modules=(label,))
        assert "shared_expert_gate" not in _selected_terms(gated, lay, st, "attn+moe")


# ----------------------------------------------------------------------------- the cited code is there
CITED = [
    ("megatron/core/models/gpt/experimental_attention_variant_module_specs.py", 411,
     "0 if ((i + 1) % config.linear_attention_freq == 0) else 1"),
    ("megatron/core/models/gpt/experimental_attention_variant_module_specs.py", 146, "raise ValueError("),
    ("megatron/core/ssm/gated_delta_net/common.py", 265, '"gdn_norm_out" in self.config.recompute_modules'),
    ("megatron/core/ssm/gated_delta_net/common.py", 421, "key = key.repeat_interleave(repeat_factor, dim=2)"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 944,
     "ctx.save_for_backward(q, weights, k, query, key, topk_indices)"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 1665,
     "up_v_weight = up_v_weight.to(device=query.device, dtype=query.dtype).contiguous()"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 1979,
     "with torch.enable_grad() if use_indexer_loss else torch.no_grad():"),
    ("megatron/core/transformer/experimental_attention_variant/dsa_cudnn_kernels.py", 2547,
     "ctx.save_for_backward(q_flat, kv_flat, attn_sink, global_idxs, out_flat, lse)"),
    ("megatron/core/transformer/experimental_attention_variant/absorbed_mla.py", 565,
     'q_absorbed = torch.einsum("...nd,ndk->...nk", q_no_pe, k_up_weight)'),
    ("megatron/core/transformer/experimental_attention_variant/dsa_kernels.py", 97,
     'return _get_dsa_kernel_backend(config) != "none"'),
    ("megatron/core/transformer/experimental_attention_variant/dsa_masking.py", 365,
     "masked_logits = logits.masked_fill(~valid_mask, torch.finfo(logits.dtype).min)"),
    ("megatron/core/transformer/attention.py", 1680,
     "self.linear_qkv_out_dim += self.config.kv_channels * self.config.num_attention_heads"),
    ("megatron/core/transformer/attention.py", 1628, "x = x * torch.sigmoid(gate.float())"),
    ("megatron/core/transformer/multi_latent_attention.py", 324, '"cache_mla_latents conflicts with training."'),
    ("megatron/core/transformer/transformer_config.py", 1778,
     "invalid_modules = set(self.recompute_modules) - allowed_modules"),
    # which DSA path runs
    ("megatron/core/transformer/experimental_attention_variant/dsa_cudnn_kernels.py", 138,
     "_FLASH_MLA_REQUIRED_VALUE_DIM = 512"),
    ("megatron/core/transformer/experimental_attention_variant/dsa_cudnn_kernels.py", 244,
     "if loss_coeff > 0 and not sparse_loss:"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 2037,
     "if use_fused_kernels and not self.index_share:"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 2124,
     "if sparse_indexer_loss and fused_bounds is not None:"),
    ("megatron/core/transformer/experimental_attention_variant/dsa.py", 2156,
     "topk_indices, indexer_loss = compute_indexer_loss_with_reference_path()"),
    # the q / kv norms: the GPT spec's follow qk_layernorm, the hybrid D's are IdentityOp
    ("megatron/core/models/gpt/experimental_attention_variant_module_specs.py", 110,
     "backend.layer_norm(rms_norm=rms_norm, for_qk=True) if config.qk_layernorm else IdentityOp"),
    ("megatron/core/models/hybrid/hybrid_layer_specs.py", 165, "q_layernorm=IdentityOp,"),
    ("megatron/core/models/hybrid/hybrid_layer_specs.py", 166, "kv_layernorm=IdentityOp,"),
    # the offload hooks: a separate input norm only, which the gated delta net's spec fuses and DSA's keeps
    ("megatron/core/transformer/transformer_layer.py", 1442,
     'self.offload_attn_norm = "attn_norm" in self.config.offload_modules and not isinstance('),
    ("megatron/core/models/gpt/experimental_attention_variant_module_specs.py", 76,
     'metainfo={"fuse_input_layernorm": True},'),
    ("megatron/core/models/gpt/experimental_attention_variant_module_specs.py", 127,
     'metainfo={"fuse_input_layernorm": False},'),
    ("megatron/core/models/hybrid/hybrid_layer_specs.py", 140, "input_layernorm=TENorm,"),
    # the shared expert's gate
    ("megatron/core/transformer/moe/shared_experts.py", 134,
     "self.gate_weight = torch.nn.Parameter(torch.empty((1, self.config.hidden_size)))"),
    ("megatron/core/transformer/moe/shared_experts.py", 201, "output = output * gate_score"),
]


@pytest.mark.parametrize("path, line, text", CITED)
def test_the_cited_lines_say_what_the_terms_read(path, line, text):
    assert text in (_site_packages() / path).read_text().splitlines()[line - 1]


# ----------------------------------------------------------------------------- what coverage names
def test_coverage_names_what_megatron_core_0_19_2_cannot_run_and_not_what_is_modelled():
    named = lambda **model: [n.split("=")[0] for n in not_modelled(SimpleNamespace(model=SimpleNamespace(**model)))]  # noqa: E731
    assert named(experimental_attention_variant="gated_delta_net") == []
    assert named(experimental_attention_variant="dsa", dsa_kernel_backend="cudnn") == []
    assert named(experimental_attention_variant="dsv4_hybrid") == ["model.experimental_attention_variant"]
    assert named(enable_hyper_connections=True, use_fused_mhc=False) == ["model.enable_hyper_connections"]
    assert named(recompute_granularity="selective", recompute_modules=["moe_act", "mhc"]) == \
        ["model.recompute_modules"]
    assert named(recompute_granularity="selective", recompute_modules=["moe_act"]) == []
    assert named(experimental_attention_variant="dsa", dsa_kernel_backend="tilelang") == ["model.dsa_kernel_backend"]
    # DSA with CP under a fused backend is modelled (variants.dsa_reference_loss)
    assert named(experimental_attention_variant="dsa", dsa_kernel_backend="cudnn", context_parallel_size=2) == []
    assert named(context_parallel_size=2) == []
    assert named(experimental_attention_variant="gated_delta_net", deterministic_mode=True) == \
        ["model.deterministic_mode"]
    assert named(deterministic_mode=True) == []
    assert named(is_hybrid_model=True, hybrid_layer_pattern="MG*D+-E") == []


def test_memory_neutral_fields_are_megatron_core_config_fields():
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import MLATransformerConfig
    names = {f.name for f in fields(MLATransformerConfig)}
    for path in ("model.window_size", "model.window_attn_skip_freq", "model.softmax_type", "model.cache_mla_latents",
                 "model.layernorm_zero_centered_gamma", "model.dsa_indexer_rotate_activation"):
        assert FIELD_CLASSES[path].kind == "neutral" and path.split(".", 1)[1] in names, path
    # the mHC fields DeepSeek-V4's recipes set are not fields of the installed core
    assert not {"enable_hyper_connections", "use_fused_mhc", "num_residual_streams"} & names


# ----------------------------------------------------------------------------- Bridge's shipped recipes
# The recipes need the models' config.json offline. Until the census ships the checkpoints' own, the test writes
# transformers 5.12's config-class defaults for the model types (not claimed to be the checkpoints' numbers) into
# a directory given by MBMEM_HF_CONFIGS: what is tested is that the recipe's provider is read as megatron-core
# builds it, whatever its numbers.
def _default_config(model_type: str, architecture: str, **extra) -> str:
    from transformers import AutoConfig
    d = AutoConfig.for_model(model_type).to_dict()
    d.update(architectures=[architecture], **extra)
    return json.dumps(d, default=str)


@pytest.fixture(scope="module")
def variant_recipes(bridge, tmp_path_factory):
    import os

    from mbmem_overlays.bridge import hf_offline
    root = tmp_path_factory.mktemp("hf_configs")
    for hub, text in [("Qwen/Qwen3-Next-80B-A3B-Instruct", _default_config("qwen3_next", "Qwen3NextForCausalLM")),
                      ("zai-org/GLM-5.2", _default_config("glm_moe_dsa", "GlmMoeDsaForCausalLM",
                                                          indexer_rope_interleave=False))]:
        (root / hub.replace("/", "--", 1)).mkdir()
        (root / hub.replace("/", "--", 1) / "config.json").write_text(text)
    # the GLM-5.2 recipes pin a revision (recipes/glm/h100/glm5.py _GLM52_MODEL_REVISION)
    (root / "pinned_revisions.json").write_text(json.dumps({"zai-org--GLM-5.2":
                                                            "4d67f66cc64d3219133b767c253b2ad1425c6c88"}))
    before = os.environ.get(hf_offline.USER_DIRS_ENV)
    os.environ[hf_offline.USER_DIRS_ENV] = str(root)
    try:
        hf_offline.activate()
        built = {name: bridge.build_recipe(name) for name in ("qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config",
                                                              "glm52_pretrain_416gpu_h100_bf16_config")}
    finally:
        if before is None:
            os.environ.pop(hf_offline.USER_DIRS_ENV, None)
        else:
            os.environ[hf_offline.USER_DIRS_ENV] = before
        hf_offline.activate()
    return built


@pytest.mark.bridge
def test_qwen3_next_recipe_is_planned_with_gated_delta_net_layers(variant_recipes):
    cfg = variant_recipes["qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config"]
    m = cfg.model
    shape, lay, st = P.from_config(cfg, 32)
    freq = m.linear_attention_freq
    assert P.layer_kinds(shape) == tuple(f"{'gdn' if la else 'attn'}+moe"
                                         for la in V.linear_attention_pattern(freq, m.num_layers))
    assert (shape.gdn_key_heads, shape.gdn_value_heads, shape.gdn_key_dim, shape.gdn_value_dim) == \
        (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim)
    assert shape.attn_gate and m.attention_output_gate
    assert shape.shared_gate == bool(m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size)
    assert not [n for n in not_modelled(cfg) if "attention_variant" in n]
    # a GDN layer's parameters and activations are its block's, not softmax attention's
    gdn_layer = P.layer_activation(shape, lay, st, "gdn+moe")
    terms = V.gdn_activation_terms(shape, lay, st, st.dtype_bytes, st.dtype_bytes, ALL)
    assert gdn_layer - P.layer_activation(shape, lay, st, "moe") == pytest.approx(
        (sum(terms.values()) + st.dtype_bytes * shape.hidden) * _tokens(lay))
    assert P._block_params(shape, lay, "gdn")[0] == V.block_params(shape, lay, "gdn")


@pytest.mark.bridge
def test_glm5_recipe_is_planned_with_dsa_layers_and_the_cudnn_kernels(variant_recipes):
    cfg = variant_recipes["glm52_pretrain_416gpu_h100_bf16_config"]
    m = cfg.model
    shape, lay, st = P.from_config(cfg, 416)
    assert {k.split("+")[0] for k in P.layer_kinds(shape)} == {"dsa"}
    assert (shape.dsa_heads, shape.dsa_head_dim, shape.dsa_topk) == \
        (m.dsa_indexer_n_heads, m.dsa_indexer_head_dim, m.dsa_indexer_topk)
    assert st.dsa_backend == "cudnn" and st.dsa_loss            # the recipe's backend, the bridge's loss coeff
    assert st.dsa_sparse_loss == m.dsa_indexer_use_sparse_loss and shape.dsa_qkv_norms == bool(m.qk_layernorm)
    assert not [n for n in not_modelled(cfg) if "attention_variant" in n]
    # full recompute: the working layer is a DSA layer's, with its indexer
    indexer = sum(n for n, _ in V.dsa_indexer_tensors(shape))
    assert P._block_params(shape, lay, "dsa")[0] - P._block_params(shape, lay, "dsa_shared")[0] == indexer
    assert st.recompute == "full" and P.estimate(shape, lay, st).total > 0

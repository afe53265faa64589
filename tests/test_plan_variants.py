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
from mbmem_overlays.memory.coverage import MEMORY_NEUTRAL, not_modelled
from mbmem_overlays.memory.from_config import attention_blocks, hybrid_pattern, share_dsa_topk

# a small Qwen3-Next-like GDN shape: 4 key heads, 8 value heads of 64, hidden 512
GDN = P.Shape(layers=4, hidden=512, ffn=1024, heads=8, groups=2, head_dim=64, vocab=1024,
              layer_kinds=("gdn+mlp", "gdn+mlp", "gdn+mlp", "attn+mlp"),
              gdn_key_heads=4, gdn_value_heads=8, gdn_key_dim=64, gdn_value_dim=64, gdn_conv=4)
# a small GLM-5-like DSA shape: 8 heads, MLA latents, an indexer of 4 heads of 32, top-k 256
DSA = P.Shape(layers=2, hidden=512, ffn=1024, heads=8, groups=8, head_dim=64, vocab=1024, mla=True,
              qk_head_dim=48, qk_pos_dim=16, v_head_dim=32, kv_lora_rank=128, q_lora_rank=96, qk_norm=True,
              layer_kinds=("dsa+mlp", "dsa_shared+mlp"), dsa_heads=4, dsa_head_dim=32, dsa_topk=256)
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
    mla = P._attention_params(DSA) + 512 + 96 + 128      # + the input norm and the q / kv norms
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
    latent = 128 + 16
    assert terms["dsa_query"] == 2 * 8 * latent and terms["dsa_key"] == 2 * latent
    assert terms["dsa_q_up_output"] == 2 * 8 * (48 + 16)        # kept by the absorbing einsum
    assert terms["dsa_topk_indices"] == 4 * 256                  # int32 global indices
    assert terms["dsa_latent_output"] == 2 * 64 * 128            # FlashMLA pads 8 heads to 64 on Hopper
    assert terms["dsa_softmax_stats"] == 4 * 64
    assert terms["dsa_up_v_weight"] == 2 * 8 * 32 * 128 / 1024   # one weight-sized copy per layer-microbatch
    assert terms["dsa_indexer"] == 2 * 32 + 8 + 2 * 4 * 32 + 4 * 32 + 2 * 4
    assert terms["attention_output"] == 2 * 8 * 32
    assert "dsa_scores" not in terms
    # a layer reusing the top-k has no indexer; without the loss the indexer keeps nothing
    shared = V.dsa_activation_terms(DSA, lay, st, ln_out=2, computes_topk=False)
    assert "dsa_indexer" not in shared and shared["dsa_topk_indices"] == terms["dsa_topk_indices"]
    assert "dsa_indexer" not in V.dsa_activation_terms(DSA, lay, replace(st, dsa_loss=False), 2, True)
    # 192 heads: a multiple of 64 on Hopper, padded to 256 nowhere (FlashMLA declines it on Blackwell)
    assert V.dsa_activation_terms(replace(DSA, heads=192), lay, st, 2, True)["dsa_latent_output"] == 2 * 192 * 128


def test_dsa_unfused_path_materializes_the_scores_over_every_key():
    lay = P.Layout(world=1, seq=1024)
    terms = V.dsa_activation_terms(DSA, lay, P.Settings(dsa_backend="none", dsa_loss=True), 2, True)
    assert terms["dsa_scores"] == 13 * 8 * 1024                  # 3 bool masks, 2 fp32, 1 bf16 per score
    assert terms["dsa_fp32_query_key"] == 4 * 8 * 144 + 4 * 144
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
    assert up["dsa_up_proj_checkpoint_inputs"] == 2 * 128 + 2 * (128 + 16)


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
    assert named(experimental_attention_variant="dsa", dsa_kernel_backend="cudnn", context_parallel_size=2) == \
        ["model.context_parallel_size"]
    assert named(context_parallel_size=2) == []
    assert named(experimental_attention_variant="gated_delta_net", deterministic_mode=True) == \
        ["model.deterministic_mode"]
    assert named(deterministic_mode=True) == []
    assert named(is_hybrid_model=True, hybrid_layer_pattern="MG*D+-E") == []


def test_memory_neutral_fields_are_megatron_core_config_fields():
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import MLATransformerConfig
    names = {f.name for f in fields(MLATransformerConfig)}
    for entry in MEMORY_NEUTRAL:
        assert entry.path.startswith("model.") and entry.path.split(".", 1)[1] in names, entry.path
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
    assert not [n for n in not_modelled(cfg) if "attention_variant" in n]
    # full recompute: the working layer is a DSA layer's, with its indexer
    indexer = sum(n for n, _ in V.dsa_indexer_tensors(shape))
    assert P._block_params(shape, lay, "dsa")[0] - P._block_params(shape, lay, "dsa_shared")[0] == indexer
    assert st.recompute == "full" and P.estimate(shape, lay, st).total > 0

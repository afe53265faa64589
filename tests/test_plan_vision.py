"""Vision-language models in the memory plan (memory/vision.py, issue 38): the vision encoders Bridge 0.6.2's VL
recipes build (Qwen3-VL / Qwen3.5-VL's megatron-core ViT, Qwen2.5-VL's and Gemma 3's SigLIP Hugging Face towers)
and the freeze_* flags. Each formula is pinned to the code: parameter counts against the transformers modules
built on CPU (the same architecture Bridge maps weight for weight), saved tensors against autograd's own
saved-tensor hooks on a CPU forward, the cited lines of the installed sources; then shipped recipes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory import vision as V
from mbmem_overlays.memory.activations import layer_activation_terms
from mbmem_overlays.memory.buffers import optimizer_step_buffers
from mbmem_overlays.memory.coverage import not_modelled
from mbmem_overlays.memory.stage_activations import loss_chunk_inputs
from mbmem_overlays.memory.weights import model_state

HF_CONFIGS = Path(__file__).resolve().parents[1] / "src" / "mbmem_overlays" / "bridge" / "hf_configs"


def _site_packages() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


# (file under site-packages, 1-based line, text on that line): what the terms' docstrings cite
CITED = [
    # frozen parameters: no main-grad buffer, no optimizer state; a frozen megatron-core Linear saves only its weight
    ("megatron/core/distributed/distributed_data_parallel.py", 115, "if not param.requires_grad:"),
    ("megatron/core/optimizer/__init__.py", 330, "if not param.requires_grad:"),
    ("megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py", 2012,
     "only_create_grad_buffer_and_main_weight_buffer_for_param_requires_grad: bool = True"),
    ("megatron/core/tensor_parallel/layers.py", 1096, "return linear_with_frozen_weight(input, weight"),
    ("megatron/core/tensor_parallel/layers.py", 417, "ctx.save_for_backward(weight)"),
    # the VL model's freeze and where its encoder is built; Float16Module casts it with the language model
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py", 302, "if self.pre_process and self.add_encoder:"),
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py", 485,
     "modules.append(self.vision_model.decoder.deepstack_merger_list)"),
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py", 490, "param.requires_grad = False"),
    ("megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py", 107,
     "self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)"),
    ("megatron/bridge/models/gemma_vl/modeling_gemma3_vl.py", 98, "_raw_vision = AutoModel.from_config(_vc)"),
    ("megatron/bridge/models/gemma_vl/modeling_gemma3_vl.py", 312, "self.avg_pool = nn.AvgPool2d("),
    ("megatron/bridge/models/model_provider.py", 691, "if (model_config.fp16 or model_config.bf16) and"),
    ("megatron/core/transformer/module.py", 464, "self.add_module('module', module.bfloat16())"),
    # the vision config: recompute copied, no SP, fp32 rotary, unfused GELU
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/transformer_config.py", 78,
     "config.recompute_granularity = megatron_config.recompute_granularity"),
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/transformer_config.py", 95,
     "config.apply_rotary_pos_emb_in_fp32 = True"),
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/transformer_config.py", 118,
     "config.bias_activation_fusion = False"),
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/transformer_config.py", 124, "config.sequence_parallel = False"),
    # the unfused rotation and its tables
    ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/rope.py", 486, "t = t.float()"),
    ("megatron/core/models/common/embeddings/rope_utils.py", 133, "cos_ = (torch.cos(freqs) * mscale).to(t.dtype)"),
    ("megatron/core/models/common/embeddings/rope_utils.py", 136,
     "t = (t * cos_) + (_rotate_half(t, rotary_interleaved) * sin_)"),
    ("megatron/bridge/models/gpt_provider.py", 230, "self.apply_rope_fusion = False"),
    ("megatron/bridge/utils/fusions.py", 85, 'if position_embedding_type != "rope":'),
    # PEFT: everything frozen, adapters where a module's own name is a target
    ("megatron/bridge/peft/base.py", 176, "def freeze_model(self, model: ModelType, training: bool = True) -> None:"),
    ("megatron/bridge/peft/module_matcher.py", 144, "if name == pattern or wildcard_match(pattern, full_name):"),
    # the datasets' images
    ("megatron/bridge/data/builders/mock_vlm_sft.py", 50, "image_size: tuple[int, int] = (256, 256)"),
    ("megatron/bridge/data/sources/hf_adapters.py", 160, "def _cord_v2_adapter("),
    ("megatron/bridge/training/config.py", 1483, "In-batch packing concatenates multiple sequences within a microbatch"),
]


@pytest.mark.parametrize("path, line, text", CITED)
def test_the_cited_lines_say_what_the_terms_read(path, line, text):
    assert text in (_site_packages() / path).read_text().splitlines()[line - 1]


# ----------------------------------------------------------------------------- parameters against the modules
def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _qwen3_config(**kw):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    base = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=80, patch_size=4,
                spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1])
    return Qwen3VLVisionConfig(**{**base, **kw})


def _qwen3_tower(vc, **kw) -> V.VisionTower:
    patch = vc.patch_size
    return V.VisionTower(V.QWEN3_VL, vc.depth, vc.hidden_size, vc.intermediate_size, vc.num_heads,
                         vc.in_channels * vc.temporal_patch_size * patch * patch, vc.out_hidden_size,
                         vc.spatial_merge_size ** 2, pos_rows=vc.num_position_embeddings,
                         deepstack_layers=tuple(vc.deepstack_visual_indexes), **kw)


def test_qwen3_vl_parameters_are_the_vision_model_bridge_maps_weight_for_weight():
    """transformers' Qwen3VLVisionModel is the architecture Bridge's Qwen3VLVisionModel converts to and from one
    tensor each (its patch embedding, pos_embed, blocks, merger and deepstack mergers): at TP 1 the counts agree."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    vc = _qwen3_config()
    hf = Qwen3VLVisionModel._from_config(vc)
    v = _qwen3_tower(vc)
    assert V.encoder_params(v, 1) + V.projector_params(v, 1) == _count(hf)
    proj = _count(hf.merger) + _count(hf.deepstack_merger_list)
    assert V.projector_params(v, 1) == proj


def test_qwen3_vl_shards_exactly_its_te_linear_layers_over_tp():
    """TP shards linear_qkv (column: weight and bias), linear_proj (row: weight), linear_fc1 (column) and
    linear_fc2 (row) of every block and merger; the norms, the row layers' biases, the conv and pos_embed stay whole."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    vc = _qwen3_config()
    hf = Qwen3VLVisionModel._from_config(vc)
    sharded = sum(p.numel() for n, p in hf.named_parameters()
                  if n.endswith(("qkv.weight", "qkv.bias", "attn.proj.weight", "linear_fc1.weight", "linear_fc1.bias",
                                 "linear_fc2.weight")))
    v = _qwen3_tower(vc)
    whole = lambda t: V.encoder_params(v, t) + V.projector_params(v, t)  # noqa: E731
    assert whole(1) - whole(2) == pytest.approx(sharded / 2)
    assert whole(1) - whole(4) == pytest.approx(3 * sharded / 4)


def test_qwen3_vl_shipped_vision_configs_count_as_their_models():
    """The shipped config.json of Qwen3-VL 8B and Qwen3.5 27B (no deepstack): their vision model built on the meta
    device has the parameters the formula gives."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    for name in ("Qwen--Qwen3-VL-8B-Instruct", "Qwen--Qwen3.5-27B"):
        raw = json.loads((HF_CONFIGS / name / "config.json").read_text())["vision_config"]
        vc = Qwen3VLVisionConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        with torch.device("meta"):
            hf = Qwen3VLVisionModel._from_config(vc)
        v = _qwen3_tower(vc)
        assert V.encoder_params(v, 1) + V.projector_params(v, 1) == _count(hf), name


def _qwen25_config():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    cfg = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=80,
                                 patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                                 fullatt_block_indexes=[1], in_channels=3)
    cfg._attn_implementation = "sdpa"
    return cfg


def _qwen25_tower(**kw) -> V.VisionTower:
    return V.VisionTower(V.QWEN25_VL, 2, 64, 96, 4, 3 * 2 * 4 * 4, 80, 4, **kw)


def test_qwen25_vl_parameters_are_the_transformers_tower_whole_on_every_tp_rank():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(_qwen25_config())
    v = _qwen25_tower()
    assert V.encoder_params(v, 1) + V.projector_params(v, 1) == _count(hf)
    assert V.projector_params(v, 1) == _count(hf.merger)
    assert V.encoder_params(v, 8) == V.encoder_params(v, 1) and V.projector_params(v, 8) == V.projector_params(v, 1)


def _siglip_tower(**kw) -> V.VisionTower:
    return V.VisionTower(V.SIGLIP, 2, 64, 96, 4, 3 * 4 * 4, 80, 4, pos_rows=64, tokens_per_image=16, **kw)


def _siglip_model():
    from transformers.models.siglip.configuration_siglip import SiglipVisionConfig
    from transformers.models.siglip.modeling_siglip import SiglipVisionModel
    cfg = SiglipVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             image_size=32, patch_size=4, vision_use_head=False, num_channels=3)
    cfg._attn_implementation = "sdpa"
    raw = SiglipVisionModel(cfg)
    return getattr(raw, "vision_model", raw)   # as Bridge unwraps it (modeling_gemma3_vl.py:99)


def test_siglip_parameters_are_the_tower_and_gemma3s_projector():
    """SigLIP's tower (post_layernorm, no head) whole on every TP rank; Gemma 3's projector: the soft-embedding
    RMSNorm (hidden) and proj (hidden x text hidden over TP, no bias: modeling_gemma3_vl.py:314-325)."""
    v = _siglip_tower()
    assert V.encoder_params(v, 1) == _count(_siglip_model())
    assert V.projector_params(v, 1) == 64 + 64 * 80 and V.projector_params(v, 4) == 64 + 64 * 80 / 4


# ----------------------------------------------------------------------------- saved tensors against autograd
def _saved_bytes(module, run, stat_bytes: int = 0) -> tuple[int, list]:
    """Bytes of the distinct storages autograd saves in ``run()`` besides ``module``'s parameters and buffers.
    ``stat_bytes``: count a norm's per-token statistics (last dim 1) at that width (CUDA's layer_norm keeps them in
    fp32; the CPU kernel in the input's dtype)."""
    keep = {p.data_ptr() for p in module.parameters()} | {b.data_ptr() for b in module.buffers()}
    seen: dict[int, tuple] = {}

    def pack(t):
        if t.data_ptr() not in keep:
            st = t.untyped_storage()
            nbytes = st.nbytes()
            if stat_bytes and t.dim() >= 2 and t.shape[-1] == 1 and t.dtype == torch.bfloat16:
                nbytes = nbytes // t.element_size() * stat_bytes
            seen[st.data_ptr()] = (nbytes, tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(x[0] for x in seen.values()), list(seen.values())


def test_qwen25_vl_tower_saves_what_the_terms_count():
    """The whole transformers tower in bf16 (as Float16Module makes it) on 64 patches: every tensor autograd saves,
    the patch embedding's input, both blocks (a window and a full attention), their fp32 rotary tables, the window
    indices and the merger, is what vision.terms counts, byte for byte."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(_qwen25_config()).to(torch.bfloat16)
    pixels, grid = torch.randn(64, 96), torch.tensor([[1, 8, 8]])
    saved, _ = _saved_bytes(hf, lambda: hf(pixels, grid_thw=grid))
    v = _qwen25_tower(image_tokens=16)
    assert sum(V.terms(v, P.Layout(world=1), P.Settings()).values()) == saved


def test_qwen25_vl_frozen_encoder_keeps_only_the_merger():
    """freeze_vision_model (patch_embed and blocks frozen, the merger training): the blocks record nothing, the
    merger keeps its norm's normalized tensor and output, the GELU's input and the second Linear's input."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(_qwen25_config()).to(torch.bfloat16)
    for module in (hf.patch_embed, hf.blocks):
        for p in module.parameters():
            p.requires_grad = False
    pixels, grid = torch.randn(64, 96), torch.tensor([[1, 8, 8]])
    saved, _ = _saved_bytes(hf, lambda: hf(pixels, grid_thw=grid))
    v = _qwen25_tower(image_tokens=16, encoder_trains=False)
    # the merger's output is reordered by an int64 index (16 merged tokens) whatever trains
    assert sum(V.terms(v, P.Layout(world=1), P.Settings()).values()) + 16 * 8 == saved


def test_siglip_tower_saves_what_the_terms_count():
    """SigLIP's encoder layers, patch embedding and post_layernorm on two 32 x 32 images (64 patches each), with
    the norms' statistics at CUDA's fp32."""
    hf = _siglip_model().to(torch.bfloat16)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    saved, _ = _saved_bytes(hf, lambda: hf(pixels), stat_bytes=4)
    v = _siglip_tower(image_tokens=32)
    st, lay = P.Settings(), P.Layout(world=1)
    terms = V.terms(v, lay, st)
    post = V._projector_terms(v, lay, st)["vision_post_layernorm"] * v.patches
    assert terms["vision_encoder_layers"] + terms["vision_patch_embed_input"] + post == saved


def test_qwen3_vl_fp32_rotation_saves_a_cos_and_a_sin_table_per_tensor():
    """megatron-core's unfused rotation as Qwen3VLSelfAttention runs it for the vision model (q cast to fp32 first,
    rope.py:484-489): the products save the fp32 cos_ and sin_, nothing of q; q and k each: four per layer."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    patches, heads, dim = 32, 4, 16
    q = torch.randn(patches, 1, heads, dim, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.randn(patches, 1, 1, dim)
    saved, tensors = _saved_bytes(torch.nn.Module(), lambda: _apply_rotary_pos_emb_bshd(q.float(), freqs))
    assert saved == 2 * 4 * dim * patches and all(t[2] == torch.float32 for t in tensors)
    v = _qwen3_tower(_qwen3_config(), image_tokens=patches / 4)
    assert V._qwen3_layer_terms(v, P.Layout(world=1), P.Settings())["vision_rope_tables"] == 2 * saved / patches


# ----------------------------------------------------------------------------- frozen parts
LM = P.Shape(layers=4, hidden=512, ffn=1024, heads=8, groups=2, head_dim=64, vocab=4096)
LAY = P.Layout(world=8, tp=2, sp=True, seq=2048, mbs=2, gbs=16)
DIST = P.Settings(dist_optimizer=True)


def test_a_frozen_language_model_keeps_no_gemm_input_and_every_other_tensor():
    """freeze_language_model: what a frozen-base LoRA layer keeps with no adapter (TE keeps a GEMM input only for
    a weight gradient), the norms' inputs, q/k/v, statistics and activation inputs unchanged."""
    trained = layer_activation_terms(LM, LAY, DIST)
    frozen = layer_activation_terms(LM, LAY, replace(DIST, frozen_lm=True))
    no_adapter = layer_activation_terms(LM, LAY, replace(DIST, lora_rank=16, lora_targets=()))
    no_adapter.pop("lora_intermediates")
    assert frozen == no_adapter
    assert set(trained) - set(frozen) == {"attention_layernorm_output", "attention_output", "mlp_layernorm_output",
                                          "mlp_act_output"}
    assert {k: v for k, v in trained.items() if k in frozen} == {k: v for k, v in frozen.items() if k in trained}
    # the attention kernel's own output stays: linear_proj no longer holds it
    assert frozen["attention_kernel_output"] == trained["attention_output"]


def test_a_frozen_output_layer_keeps_only_the_final_norms_input():
    st = P.Settings()
    assert loss_chunk_inputs(LM, LAY, replace(st, frozen_lm=True)) * 2 == loss_chunk_inputs(LM, LAY, st)


def test_a_frozen_language_model_has_no_gradients_or_optimizer_state_only_the_vision_side_does():
    v = _qwen3_tower(_qwen3_config(), image_tokens=64, encoder_trains=False)
    s = replace(LM, vision=v)
    st = replace(DIST, frozen_lm=True)
    params, grads, opt = model_state(s, LAY, st, first=True, last=False, rank=0)
    proj = V.projector_params(v, LAY.tp)
    shards = LAY.dp * LAY.cp
    assert grads == pytest.approx(proj * st.grad_bytes)
    assert opt == pytest.approx(proj / shards * P.optimizer_gpu_bytes(st))
    p_lm, _, _ = model_state(LM, LAY, st, first=True, last=False, rank=0)
    assert params == pytest.approx(p_lm + (V.encoder_params(v, LAY.tp) + proj) * st.dtype_bytes)
    # with two stages the last holds no vision part: nothing trains there
    pp2 = replace(LAY, pp=2)
    assert model_state(s, pp2, st, first=False, last=True, rank=1)[1:] == (0.0, 0.0)
    assert model_state(s, pp2, st, first=True, last=False, rank=0)[1] == pytest.approx(proj * st.grad_bytes)
    # bf16 gradients: the step upcasts only the projector's shard
    bf16 = replace(st, grad_bytes=P.BF16)
    assert optimizer_step_buffers(s, LAY, bf16, True, False, 0) == pytest.approx(P.FP32 * proj / shards)


def test_a_frozen_encoder_keeps_nothing_but_the_trainable_projector_keeps_its_inputs():
    lay = P.Layout(world=2, tp=2, seq=4096, mbs=1, gbs=8)
    st, vc = P.Settings(), _qwen3_config(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                         deepstack_visual_indexes=[8, 16, 24])
    frozen = V.terms(_qwen3_tower(vc, image_tokens=1000, encoder_trains=False), lay, st)
    assert set(frozen) == {"vision_projector"}
    # four mergers (the main one and three deepstack): each the norm's and fc1's inputs whole, GELU's and fc2's / TP
    h, D = 1152, 2
    assert frozen["vision_projector"] == pytest.approx(4 * (2 * D * h + 2 * D * h / 2) * 4000)
    trained = V.terms(_qwen3_tower(vc, image_tokens=1000), lay, st)
    assert set(trained) == {"vision_encoder_layers", "vision_patch_embed_input", "vision_projector"}
    # the deepstack mergers' norms read a layer output the next layer keeps already
    assert trained["vision_projector"] == pytest.approx(frozen["vision_projector"] - 3 * D * h * 4000)
    nothing = V.terms(_qwen3_tower(vc, image_tokens=1000, encoder_trains=False, projector_trains=False), lay, st)
    assert nothing == {}


def test_qwen3_vl_layers_are_a_te_layer_without_sequence_parallelism_plus_the_rotary_tables():
    vc = _qwen3_config(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)
    v = _qwen3_tower(vc, image_tokens=256)
    lay = P.Layout(world=4, tp=4, sp=True, cp=2, seq=4096, mbs=2)
    layer = V._qwen3_layer_terms(v, lay, P.Settings(fp8=True, hidden_dropout=True))
    h, f, t, D = 1152, 4304, 4, 2
    assert layer == pytest.approx({
        "attn_layernorm_input": D * h, "attention_layernorm_output": D * h, "attention_qkv": D * 3 * h / t,
        "attention_softmax_stats": 4 * 16 / t, "attention_output": D * h / t, "mlp_layernorm_input": D * h,
        "mlp_layernorm_output": D * h, "mlp_fc1_output": D * f / t, "mlp_act_output": D * f / t,
        "vision_rope_tables": 4 * 4 * 72})
    # selective recompute drops the core attention's (the vision config's default recompute modules)
    sel = V._qwen3_layer_terms(v, lay, P.Settings(recompute="selective", modules=("mlp",)))
    assert "attention_softmax_stats" not in sel and "mlp_fc1_output" in sel


# ----------------------------------------------------------------------------- images per microbatch
def _cfg(dataset, mbs=2, seq=4096, model=None):
    return SimpleNamespace(model=model or SimpleNamespace(seq_length=seq), train=SimpleNamespace(micro_batch_size=mbs),
                           dataset=dataset)


def test_image_tokens_from_a_mock_dataset_or_the_sequence_bound():
    MockVLMSFTDatasetConfig = type("MockVLMSFTDatasetConfig", (), {})
    mock = MockVLMSFTDatasetConfig()
    mock.num_images, mock.image_size = 2, (300, 200)
    planned, low, high, how = V.image_tokens(_cfg(mock), V.QWEN3_VL, 16, 2, 0)
    # 300 x 200 rounds to 288 x 192 on the 32-pixel grid: 9 x 6 merged tokens per image
    assert (planned, low, high) == (2 * 2 * 54, 2 * 2 * 54, 8192) and "mock" in how
    assert V.image_tokens(_cfg(mock), V.SIGLIP, 14, 1, 256)[:3] == (1024, 1024, 1024)
    other = type("EnergonDatasetConfig", (), {})()
    assert V.image_tokens(_cfg(other), V.QWEN3_VL, 16, 2, 0)[:3] == (8192, 0.0, 8192)


def test_image_tokens_of_a_one_image_hf_dataset():
    DirectHFSFTDatasetConfig = type("DirectHFSFTDatasetConfig", (), {})
    ds = DirectHFSFTDatasetConfig()
    ds.source, ds.enable_in_batch_packing = SimpleNamespace(dataset_name="cord_v2", schema_adapter=None), True
    assert V.image_tokens(_cfg(ds), V.SIGLIP, 14, 1, 256)[:3] == (512, 512, 512)
    assert V.image_tokens(_cfg(ds), V.QWEN3_VL, 16, 2, 0)[:3] == (8192, 0.0, 8192)
    ds.source = SimpleNamespace(dataset_name="raven", schema_adapter=None)     # several images per sample
    assert V.image_tokens(_cfg(ds), V.SIGLIP, 14, 1, 256)[:3] == (8192, 0.0, 8192)


def test_a_vision_config_the_plan_does_not_model_is_still_named():
    Glm4vVisionConfig = type("Glm4vVisionConfig", (), {})
    GLM45VModelProvider = type("GLM45VModelProvider", (), {})
    m = GLM45VModelProvider()
    m.vision_config = Glm4vVisionConfig()
    named = not_modelled(SimpleNamespace(model=m))
    assert len(named) == 1 and named[0].startswith("model.vision_config=")
    assert V.family_of(m) is None


# ----------------------------------------------------------------------------- shipped recipes


@pytest.fixture(scope="module")
def qwen3_vl_mock(bridge):
    """Qwen3-VL 8B pretraining on the mock dataset: the language model and the ViT frozen, the mergers training."""
    cfg = bridge.build_recipe("qwen3_vl_8b_pretrain_4gpu_h100_bf16_mock_config")
    return cfg, P.from_config(cfg, 4)


@pytest.mark.bridge
def test_the_shipped_qwen3_vl_recipe_is_planned_with_its_vision_side(qwen3_vl_mock):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    cfg, (s, lay, st) = qwen3_vl_mock
    v = s.vision
    assert st.frozen_lm and not v.encoder_trains and v.projector_trains and not v.lora
    # one 256 x 256 mock image per sample: 8 x 8 merged tokens, micro batch 2
    assert (v.image_tokens, v.image_tokens_high, v.patches) == (128, 2 * 4096, 512)
    with torch.device("meta"):
        hf = Qwen3VLVisionModel._from_config(cfg.model.vision_config)
    assert V.encoder_params(v, 1) + V.projector_params(v, 1) == _count(hf)
    b = P.stage_breakdowns(s, lay, st)[0]
    # only the mergers train: their fp32 gradients on TP 4, DP 1
    assert b.gradients == pytest.approx(V.projector_params(v, lay.tp) * P.FP32)
    assert s.rope_tables_bytes == P.BF16 and "attention_rope_tables" in layer_activation_terms(s, lay, st)
    assert not [n for n in not_modelled(cfg) if n.startswith(("model.vision_config", "model.freeze"))]


@pytest.mark.bridge
def test_the_shipped_gemma3_sft_recipe_plans_one_cord_image_per_sample(bridge):
    cfg = bridge.build_recipe("gemma3_vl_4b_sft_1gpu_h100_bf16_config")
    s, lay, st = P.from_config(cfg, 1)
    v = s.vision
    assert v.family == V.SIGLIP and v.encoder_trains and v.projector_trains and not st.frozen_lm
    assert (v.image_tokens, v.patches_per_token, v.patches) == (256 * lay.mbs, 16, 4096 * lay.mbs)
    detail = dict(P.stage_breakdowns(s, lay, st)[0].detail)
    assert detail["vision encoder and projector (first stage)"] == pytest.approx(V.activations(s, lay, st))

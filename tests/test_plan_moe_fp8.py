"""Issue 38's architectures, each term pinned to the code it comes from: latent MoE (moe_latent_size), the flex
MoE dispatcher (DeepEP and HybridEP: what the dispatch keeps, what each layer's manager holds, the buffers outside
torch's allocator), and an FP8 job's first/last layers kept in bf16 (first_last_layers_bf16). Pure functions on
small shapes first, then the shipped recipes that use them (built offline, one module-scoped build each)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.ranges import uncertainty

pytestmark = pytest.mark.bridge

# An MoE layer stack: 4 attention + MoE layers, 64 experts of which 8 per token, squared-ReLU experts (not gated)
MOE = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=2, head_dim=128, vocab=2048, gated=False,
              experts=64, moe_ffn=512, topk=8, shared_ffn=1024, moe_layers=4,
              layer_kinds=("attn+moe",) * 4)
LATENT = replace(MOE, moe_latent=256)
LAY = P.Layout(world=16, tp=2, ep=8, etp=1, sp=True, seq=4096, mbs=1, gbs=16)


# ----------------------------------------------------------------------------- the cited code is there
def _site_packages() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


# (file under site-packages, 1-based line, text on that line): what each term's docstring cites
CITED = [
    # latent MoE: the two duplicated TELinear projections around the dispatch, experts in the latent width
    ("megatron/core/transformer/moe/moe_layer.py", 273, "self.fc1_latent_proj = linear_cls("),
    ("megatron/core/transformer/moe/moe_layer.py", 276, 'parallel_mode="duplicated",'),
    ("megatron/core/transformer/moe/moe_layer.py", 288, 'parallel_mode="duplicated",'),
    ("megatron/core/transformer/moe/moe_layer.py", 483, "hidden_states, _ = self.fc1_latent_proj(hidden_states)"),
    ("megatron/core/transformer/moe/moe_layer.py", 585, "output, _ = self.fc2_latent_proj(output)"),
    ("megatron/core/transformer/moe/experts.py", 218,
     "self.input_size if self.config.moe_latent_size is None else self.config.moe_latent_size,"),
    ("megatron/core/transformer/mlp.py", 220, "use_latent_size = (self.config.moe_latent_size is not None) and is_expert"),
    # first/last layers in bf16: the per-layer FP8 context, at build and in the forward
    ("megatron/core/fp8_utils.py", 686,
     "if layer_no >= 0 and config.first_last_layers_bf16 and (is_first_layer or is_last_layer):"),
    ("megatron/core/fp8_utils.py", 792, "if not need_fp8_context or is_first_last_bf16_layer(config, layer_no):"),
    ("megatron/core/transformer/transformer_block.py", 343, "layer_config, global_layer_number - 1, is_init=True"),
    ("megatron/core/transformer/transformer_block.py", 652, "self.config, layer.layer_number - 1"),
    ("megatron/core/models/hybrid/hybrid_block.py", 128,
     "quant_init_context = get_fp8_context(self.config, i + pp_layer_offset, is_init=True)"),
    ("megatron/core/models/hybrid/hybrid_block.py", 365, "self.config, layer.layer_number - 1"),
    ("megatron/bridge/training/mixed_precision.py", 127,
     "model_config = update_config_with_precision_overrides(self, model_config)"),
    # the flex dispatcher: handles saved for the backward, each layer's manager's routing tensors
    ("megatron/core/transformer/moe/fused_a2a.py", 134, "ctx.handle = handle"),
    ("megatron/core/transformer/moe/fused_a2a.py", 436, "ctx.handle = handle"),
    ("megatron/core/transformer/moe/token_dispatcher.py", 1088, "self.token_probs = probs"),
    ("megatron/core/transformer/moe/token_dispatcher.py", 1102, "self.num_permuted_tokens = budget"),
    ("megatron/core/transformer/moe/token_dispatcher.py", 1291,
     "self.token_probs, self.token_indices = torch.topk(probs, self.router_topk, dim=-1)"),
    ("megatron/core/transformer/moe/token_dispatcher.py", 1355, "multihot_probs[row_indices, valid_indices] = probs[mask]"),
    ("megatron/core/transformer/moe/token_dispatcher.py", 1522, "self.hidden_dim = config.moe_latent_size or config.hidden_size"),
    ("megatron/core/transformer/transformer_config.py", 1609, 'if self.moe_flex_dispatcher_backend == "ncclep":'),
]


@pytest.mark.parametrize("path, line, text", CITED)
def test_the_cited_lines_say_what_the_terms_read(path, line, text):
    assert text in (_site_packages() / path).read_text().splitlines()[line - 1]


# ----------------------------------------------------------------------------- latent MoE
def test_latent_moe_weights_are_duplicated_projections_and_latent_width_experts():
    dense, expert = P._block_params(LATENT, LAY, "moe")
    plain_dense, plain_expert = P._block_params(MOE, LAY, "moe")
    h, k = MOE.hidden, LATENT.moe_latent
    # fc1_latent_proj (h -> k) and fc2_latent_proj (k -> h), whole on every TP rank ("duplicated")
    assert dense - plain_dense == 2 * h * k
    assert P.latent_projection_params(replace(LATENT, linear_bias=True)) == 2 * h * k + k + h
    # the experts' FC1 reads and FC2 writes the latent width: the expert parameters shrink by k / h
    assert expert == MOE.experts * 2 * k * MOE.moe_ffn / (LAY.ep * LAY.etp)
    assert expert / plain_expert == pytest.approx(k / h)
    # gradients and optimizer follow: the projections are dense (DP-sharded), the experts expert-DP-sharded
    st = P.Settings(dist_optimizer=True, grad_bytes=P.BF16)
    p0, g0, o0 = P.model_state(MOE, LAY, st, True, True)
    p1, g1, o1 = P.model_state(LATENT, LAY, st, True, True)
    layers = MOE.layers
    assert p1 - p0 == pytest.approx(P.BF16 * layers * (2 * h * k + expert - plain_expert))
    assert g1 - g0 == pytest.approx(P.BF16 * layers * (2 * h * k + expert - plain_expert))
    dense_shards, expert_shards = P.optimizer_shards(LAY, st)
    assert o1 - o0 == pytest.approx(12 * layers * (2 * h * k / dense_shards + (expert - plain_expert) / expert_shards))


def test_latent_moe_muon_tensors_add_up_to_its_parameters():
    from mbmem_overlays.memory.optimizers import stage_tensors
    lay = P.Layout(world=8, ep=8, seq=128, mbs=1, gbs=8)
    dense, expert = stage_tensors(LATENT, lay, 0)
    layer, embed, experts = P.stage_params(LATENT, lay, True, True, 0)
    assert sum(n for n, _ in expert) == experts
    # the tensors count the attention's and norms' parameters the way the per-block sums do, plus the final norm
    assert sum(n for n, _ in dense) == pytest.approx(layer + embed + LATENT.hidden)


def test_latent_moe_dispatches_and_keeps_latent_width_tokens():
    st = P.Settings()
    plain = P.layer_activation_terms(MOE, LAY, st, "attn+moe")
    latent = P.layer_activation_terms(LATENT, LAY, st, "attn+moe")
    h, k, d = MOE.hidden, LATENT.moe_latent, P.BF16
    routed = MOE.topk / LAY.tp
    for name in ("moe_permuted_input", "moe_unpermute_input"):       # the routed tokens are latent-width
        assert latent[name] == plain[name] * k / h
    assert latent["moe_permuted_input"] == routed * LAY.etp * d * k
    # fc2_latent_proj keeps its input, the combined latent tokens (sequence-local); fc1_latent_proj's input is the
    # norm output the router keeps (no new tensor in bf16)
    assert latent["moe_latent_fc2_input"] == d * k / LAY.tp
    assert "moe_latent_fc1_input_fp8" not in latent and "moe_latent_fc2_input" not in plain
    # the router and the shared expert still work on the hidden states
    assert latent["moe_router"] == plain["moe_router"] and latent["shared_expert"] == plain["shared_expert"]
    # FP8: each projection keeps its quantized input
    fp8 = P.layer_activation_terms(LATENT, LAY, replace(st, fp8=True), "attn+moe")
    assert fp8["moe_latent_fc1_input_fp8"] == P.FP8 * h / LAY.tp and fp8["moe_latent_fc2_input"] == P.FP8 * k / LAY.tp
    # the MoE checkpoint covers the projections (they run inside custom_forward); moe_act does not
    moe = P._selected_terms(LATENT, LAY, replace(st, recompute="selective", modules=("moe",)), "attn+moe")
    assert not {"moe_latent_fc2_input", "moe_permuted_input"} & set(moe)
    act = P._selected_terms(LATENT, LAY, replace(st, recompute="selective", modules=("moe_act",)), "attn+moe")
    assert "moe_latent_fc2_input" in act


# ----------------------------------------------------------------------------- first/last layers in bf16
def test_first_last_bf16_marks_the_global_first_and_last_layers():
    s = replace(MOE, layers=8, layer_kinds=("attn+moe",) * 8, bf16_layers=(1, 2))
    kinds = P.layer_kinds(s)
    assert [P.runs_bf16(k) for k in kinds] == [True] + [False] * 5 + [True, True]
    assert all(P.blocks_of(k) == ("attn", "moe") for k in kinds)
    lay = replace(LAY, pp=4)
    assert sum(n for k, n in P.rank_layers(s, lay, 0).items() if P.runs_bf16(k)) == 1
    assert sum(n for k, n in P.rank_layers(s, lay, 1).items() if P.runs_bf16(k)) == 0
    assert sum(n for k, n in P.rank_layers(s, lay, 3).items() if P.runs_bf16(k)) == 2


def test_first_last_bf16_layers_keep_bf16_weights_and_activations():
    s = replace(MOE, layers=8, layer_kinds=("attn+moe",) * 8, bf16_layers=(1, 1))
    flat = replace(s, bf16_layers=(0, 0))
    lay = replace(LAY, pp=2)
    # FP8 primary weights (fp8_param_gather): 1 byte + Hopper's transposed copy per FP8 layer weight
    st = P.Settings(fp8=True, param_bytes=P.FP8, fp8_weight_copy_bytes=P.FP8, fp8_cast_copy_bytes=P.BF16,
                    dist_optimizer=True, grad_bytes=P.BF16)
    layer = P._block_params(s, lay, "attn")[0] + P._block_params(s, lay, "moe")[0]
    layer_expert = P._block_params(s, lay, "moe")[1]
    p, g, o = P.model_state(s, lay, st, True, False, 0)
    p0, g0, o0 = P.model_state(flat, lay, st, True, False, 0)
    # the first layer's weights are bf16 params (2 bytes) instead of 1 + 1: no change per element at FP8 params
    assert p == pytest.approx(p0) and g == g0 and o == o0
    # bf16 params with FP8 compute cache an FP8 copy in both layouts (2 bytes) of an FP8 layer's weight only
    cached = replace(st, param_bytes=P.BF16, fp8_weight_copy_bytes=2 * P.FP8, fp8_cast_copy_bytes=0)
    pc, _, _ = P.model_state(s, lay, cached, True, False, 0)
    pc0, _, _ = P.model_state(flat, lay, cached, True, False, 0)
    assert pc0 - pc == pytest.approx(2 * P.FP8 * (layer + layer_expert))
    # the step casts only quantized weights' masters (fp8_master_cast_copies): not the bf16 layer's
    dense_shards, expert_shards = P.optimizer_shards(lay, st)
    cast = P.fp8_master_cast_copies(s, lay, st, True, False, 0)
    cast0 = P.fp8_master_cast_copies(flat, lay, st, True, False, 0)
    assert cast0 - cast == pytest.approx(P.BF16 * (layer / dense_shards + layer_expert / expert_shards))
    # activations: the bf16 layer keeps bf16 GEMM inputs and no quantized copies, as a bf16 job's layer
    bf16_layer = P.layer_activation_terms(s, lay, st, "attn+moe" + P.BF16_LAYER)
    assert bf16_layer == P.layer_activation_terms(s, lay, replace(st, fp8=False), "attn+moe")
    assert bf16_layer != P.layer_activation_terms(s, lay, st, "attn+moe")
    a, a0 = P.stage_activations(s, lay, st, 0), P.stage_activations(flat, lay, st, 0)
    assert a.steady > a0.steady
    # without FP8 the span is (0, 0) and nothing is marked (from_config.bf16_layer_span)
    from types import SimpleNamespace as NS
    on = NS(first_last_layers_bf16=True, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=3)
    assert P.bf16_layer_span(on, fp8=False) == (0, 0)
    assert P.bf16_layer_span(on, fp8=True) == (2, 3)
    assert P.bf16_layer_span(NS(first_last_layers_bf16=False), fp8=True) == (0, 0)
    # a preset's own fields reach the model through Bridge's setup (bridge/as_run.py, tests/test_plan_as_run.py)


# ----------------------------------------------------------------------------- the flex dispatcher
def _flex(backend: str, **kw) -> P.Settings:
    return P.Settings(moe_dispatcher="flex", flex_backend=backend, **kw)


def test_deepep_keeps_its_handle_and_topk_indices():
    local = LAY.tp                         # sequence-local under SP
    group = LAY.etp * LAY.ep               # 8: intranode
    terms = P.dispatcher_terms(MOE, LAY, _flex("deepep"))
    received = min(MOE.topk, LAY.ep) * LAY.etp / local
    pairs = MOE.topk * LAY.etp / local
    # is_token_in_rank [N, R] bool + send_head [N, R] int32; recv_src_idx int32 per received token; torch.topk's
    # int64 indices; _indices_to_multihot's two int64 index vectors per received (token, expert) pair
    assert terms == {"moe_dispatch_handle": (5 * group + 8 * MOE.topk) / local + 4 * received + 16 * pairs}
    internode = P.dispatcher_terms(MOE, replace(LAY, ep=16, world=32), _flex("deepep"))
    per_local = 16 + 4 * 2 + 8 * MOE.topk
    assert internode["moe_dispatch_handle"] == pytest.approx(per_local / local + 40 * min(8, 16) / local + 16 * pairs)
    assert P.dispatcher_terms(MOE, LAY, P.Settings()) == {}           # alltoall: no handle
    # the MoE checkpoint drops it; each layer's manager still holds its top-k values and indices
    moe = replace(_flex("deepep"), recompute="selective", modules=("moe",))
    assert "moe_dispatch_handle" not in P._selected_terms(MOE, LAY, moe, "attn+moe")
    tokens = LAY.seq * LAY.mbs / LAY.tp
    assert P.flex_dispatcher_state(MOE, LAY, moe, 0) == MOE.layers * tokens * 12 * MOE.topk * LAY.etp


def test_hybridep_keeps_its_dense_routing_handle_and_expanded_routing_per_layer():
    st = _flex("hybridep")
    group, local_experts = LAY.etp * LAY.ep, MOE.experts // LAY.ep
    terms = P.dispatcher_terms(MOE, LAY, st)
    # sparse_to_dense_map [N, R] int32, local_expert_routing_map [N x R, L] bool, dense_to_expert_map [N x R, L]
    # int32, rdma_to_attn_map / attn_to_rdma_map: one NVLink domain of 8
    assert terms["moe_dispatch_handle"] == (4 * group + 5 * group * local_experts + 1) / LAY.tp
    tokens = LAY.seq * LAY.mbs / LAY.tp
    # the expanded routing map (bool) and probabilities (fp32) over expert TP x experts, one set per MoE layer
    assert P.flex_dispatcher_state(MOE, LAY, st, 0) == MOE.layers * tokens * 5 * MOE.experts * LAY.etp
    phases = P.phase_breakdowns(MOE, LAY, st, 0)
    base = P.phase_breakdowns(MOE, LAY, P.Settings(), 0)
    held = P.flex_dispatcher_state(MOE, LAY, st, 0)
    for phase in ("steady 1F1B", "optimizer step"):
        assert phases[phase].other - base[phase].other == pytest.approx(held)
    # MTP's MoE layer has its own dispatcher (one for every depth with a repeated MTP layer)
    mtp = replace(MOE, mtp_layers=2, mtp_blocks=("attn", "moe"), mtp_shared=True)
    assert P.flex_dispatcher_state(mtp, LAY, st, 0) == (MOE.layers + 1) * tokens * 5 * MOE.experts * LAY.etp


def test_hybridep_rank_budget_sizes_the_routed_tokens():
    st = _flex("hybridep", moe_rank_capacity=1.5, moe_load=1.5)
    terms = P.layer_activation_terms(MOE, LAY, st, "attn+moe")
    assert terms["moe_permuted_input"] == 1.5 * P.layer_activation_terms(MOE, LAY, _flex("hybridep"),
                                                                          "attn+moe")["moe_permuted_input"]
    from mbmem_overlays.memory.ranges import moe_worst_load
    assert moe_worst_load(MOE, LAY, st) == 1.5      # tokens beyond the budget are dropped: no imbalance range


def test_deepep_buffers_outside_torch_follow_its_config_hints():
    st = _flex("deepep", flex_num_sms=24)
    hidden_bytes = 2 * MOE.hidden
    # group 8 (NVLink only): dispatch and combine configs both receive 256-token chunks; 12 channels x 8 peers
    per_token = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl = 12 * 8 * (2 * 1 + 3) * 4 + 12 * 8 * 256 * per_token
    assert P.flex_outside_torch_bytes(MOE, LAY, st) == math.ceil(nvl / 128) * 128 + 32 * 2**20
    # the latent width is what is dispatched
    assert P.flex_outside_torch_bytes(LATENT, LAY, st) < P.flex_outside_torch_bytes(MOE, LAY, st)
    # across nodes the RDMA buffer joins (group 16: dispatch RDMA chunks 20 / 128 -> 140, combine 12 / 128 -> 132)
    lay16 = replace(LAY, ep=16, world=32)
    channels, rdma_peers = 12, 2
    rdma = max(channels * rdma_peers * 18 * 2 * 4 + channels * rdma_peers * recv * (per_token + 16) * 2
               for recv in (140, 132))
    nvl16 = max(12 * 8 * (2 * 2 + 3) * 4 + 12 * 8 * recv * per_token for recv in (288, 288))
    assert P.flex_outside_torch_bytes(MOE, lay16, st) == (math.ceil(nvl16 / 128) * 128 + math.ceil(rdma / 128) * 128
                                                          + 32 * 2**20)
    assert P.flex_outside_torch_bytes(MOE, replace(LAY, ep=12, world=24), st) is None   # no DeepEP config for 12
    assert P.flex_outside_torch_bytes(MOE, LAY, P.Settings()) == 0


def test_hybridep_buffers_outside_torch_hold_every_token_of_the_group():
    st = _flex("hybridep", flex_nvl_ranks=8)
    tokens, group, local_experts = LAY.seq * LAY.mbs // LAY.tp, LAY.etp * LAY.ep, MOE.experts // LAY.ep
    width = MOE.hidden
    nvl = tokens * group * (2 * width + 4 * local_experts * 8 + 4 * (width // 128))
    assert P.flex_outside_torch_bytes(MOE, LAY, st) == nvl
    # two NVLink domains of 8: the RDMA buffers join
    lay16 = replace(LAY, ep=16, world=32)
    local16 = MOE.experts // 16
    nvl16 = tokens * 16 * (2 * width + 4 * local16 * 8 + 4 * (width // 128))
    probs = 4 * local16 * 8
    rdma = tokens * (2 * width + probs * 2 + 4 * 8) + tokens * (2 * width + probs + 4 * 8) + 2 * tokens * (
        2 * width + probs)
    assert P.flex_outside_torch_bytes(MOE, lay16, st) == nvl16 + rdma


def test_flex_buffers_outside_torch_are_a_range_of_the_fit():
    st = _flex("hybridep")
    outside = P.flex_outside_torch_bytes(MOE, LAY, st)
    (r,) = [r for r in uncertainty(MOE, LAY, st) if r.assumption == P.OUTSIDE_TORCH]
    mid = P.estimate(MOE, LAY, st).footprint
    assert (r.low, r.high) == (mid, mid + outside) and r.assumption in P.ASSUMPTIONS
    verdict, _ = P.fit_verdict(True, (r,), mid + outside / 2)
    assert verdict.startswith("fits unless HybridEP's buffers outside torch's allocator count")
    assert not [r for r in uncertainty(MOE, LAY, P.Settings()) if r.assumption == P.OUTSIDE_TORCH]


def test_only_ncclep_of_the_flex_dispatcher_is_named_as_not_modelled():
    from types import SimpleNamespace as NS

    from mbmem_overlays.memory.coverage import not_modelled
    for backend in ("deepep", "hybridep"):
        cfg = NS(model=NS(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend, moe_latent_size=1024,
                          first_last_layers_bf16=True), ddp=None)
        assert not_modelled(cfg) == ()
    cfg = NS(model=NS(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep"), ddp=None)
    (named,) = not_modelled(cfg)
    assert named.startswith("model.moe_flex_dispatcher_backend=ncclep: ")


# ----------------------------------------------------------------------------- shipped recipes
# Nemotron 3 Super's architecture numbers, for building its recipes offline here: Megatron-LM's public functional
# test tests/functional_tests/test_cases/nemotron/nemotron3_super_release_gb200/model_config.yaml (commit d98e8a64:
# 88 layers, hidden 4096, its hybrid pattern, 512 experts top-22, moe ffn 2688, latent 1024, shared 5376, 32 heads
# with 2 query groups of 128, 128 Mamba heads, two MTP depths of "*E") with megatron-core's Mamba defaults (head
# dim 64, state 128, 8 groups) and the 131072-token vocabulary of the Nemotron 3 family; the rest is Nano's
# shipped config.json (bridge/hf_configs).
SUPER_ID = "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
SUPER = {"num_hidden_layers": 88, "hidden_size": 4096, "hybrid_override_pattern": SUPER_PATTERN,
         "n_routed_experts": 512, "num_experts_per_tok": 22, "moe_intermediate_size": 2688, "intermediate_size": 2688,
         "moe_latent_size": 1024, "moe_shared_expert_intermediate_size": 5376, "num_attention_heads": 32,
         "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64,
         "ssm_state_size": 128, "n_groups": 8, "vocab_size": 131072, "num_nextn_predict_layers": 1,
         "mtp_hybrid_override_pattern": "*E", "moe_shared_expert_overlap": False}


@pytest.fixture(scope="module")
def super_recipe(bridge, tmp_path_factory):
    """Nemotron 3 Super's 64-H100 pretraining recipe (the public nemotron_3_super_pretrain_config): latent MoE,
    the HybridEP flex dispatcher, MTP; built with the config.json of Bridge's fixtures when one is shipped, else
    with the numbers above in a user directory (MBMEM_HF_CONFIGS, bridge/hf_offline.py)."""
    import os
    hf = bridge.hf_offline
    shipped = hf.FIXTURE_DIR / SUPER_ID / "config.json"
    saved = os.environ.get(hf.USER_DIRS_ENV)
    if not shipped.is_file():
        base = json.loads((hf.FIXTURE_DIR / "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16" / "config.json").read_text())
        root = tmp_path_factory.mktemp("hf")
        (root / SUPER_ID).mkdir()
        (root / SUPER_ID / "config.json").write_text(json.dumps({**base, **SUPER}))
        os.environ[hf.USER_DIRS_ENV] = os.pathsep.join(p for p in (str(root), saved) if p)
        hf.activate()
    try:
        yield bridge.build_recipe("nemotron_3_super_pretrain_config")
    finally:
        if saved is None:
            os.environ.pop(hf.USER_DIRS_ENV, None)
        else:
            os.environ[hf.USER_DIRS_ENV] = saved
        hf.activate()


def test_nemotron_3_super_is_planned_as_latent_moe_with_hybridep(super_recipe):
    cfg = super_recipe
    shape, lay, st = P.from_config(cfg, 64)
    assert shape.moe_latent == cfg.model.moe_latent_size == 1024 and shape.hidden == 4096
    assert (st.moe_dispatcher, st.flex_backend, st.flex_nvl_ranks) == ("flex", "hybridep", 8)   # cfg.env_vars
    assert shape.bf16_layers == (0, 0)       # a BF16 job: first_last_layers_bf16 changes nothing
    # the capacity factor pads every expert's input (moe_pad_expert_input_to_capacity): the load is 1.1
    assert st.moe_load == pytest.approx(1.1)
    # parameters: the latent projections (2 x 4096 x 1024, duplicated) and latent-width experts per MoE layer
    dense, expert = P._block_params(shape, lay, "moe")
    assert expert == 512 * 2 * 1024 * 2688 / (lay.ep * lay.etp)
    assert dense == 4096 * 512 + 2 * 4096 * 5376 + 2 * 4096 * 1024 + 4096
    before = replace(shape, moe_latent=0)
    assert P.estimate(shape, lay, st).parameters < P.estimate(before, lay, st).parameters
    # what HybridEP allocates outside torch is a range of the fit, sized for 32 x 4096 latent tokens per GPU
    outside = P.flex_outside_torch_bytes(shape, lay, st)
    assert outside == 4096 * 32 * (2 * 1024 + 4 * 16 * 8 + 4 * 8) + (
        4096 * (2 * 1024 + 4 * 16 * 8 * 4 + 4 * 8) + 4096 * 3 * (2 * 1024 + 4 * 16 * 8 + 4 * 8)
        + 2 * 4096 * 3 * (2 * 1024 + 4 * 16 * 8))
    from mbmem_overlays.memory.coverage import not_modelled
    assert not [n for n in not_modelled(cfg) if "latent" in n or "dispatcher" in n or "first_last" in n]


@pytest.fixture(scope="module")
def llama_fp8cs(bridge):
    """Llama3-8B's 2-H100 FP8 current-scaling recipe: its bf16_with_fp8_current_scaling_mixed preset keeps the
    first and the last layer in bf16, with FP8 primary weights."""
    cfg = bridge.build_recipe("llama3_8b_pretrain_2gpu_h100_fp8cs_config")
    return cfg, P.from_config(cfg, 2)


def test_an_fp8_recipe_keeps_its_first_and_last_layer_in_bf16(llama_fp8cs):
    cfg, (shape, lay, st) = llama_fp8cs
    assert st.fp8 and st.param_bytes == P.FP8 and shape.bf16_layers == (1, 1)
    kinds = P.layer_kinds(shape)
    assert P.runs_bf16(kinds[0]) and P.runs_bf16(kinds[-1]) and not any(map(P.runs_bf16, kinds[1:-1]))
    flat = replace(shape, bf16_layers=(0, 0))
    # activations: two layers keep bf16 GEMM inputs instead of FP8 ones (PP 1: one microbatch in flight)
    bf16, fp8 = (P.layer_activation(shape, lay, st, k) for k in ("attn+mlp" + P.BF16_LAYER, "attn+mlp"))
    assert bf16 > fp8
    assert P.stage_activations(shape, lay, st, 0).steady - P.stage_activations(flat, lay, st, 0).steady == \
        pytest.approx(2 * (bf16 - fp8))
    # the step quantizes only FP8 weights: the two bf16 layers' masters are not cast
    layer = sum(P._block_params(shape, lay, b)[0] for b in ("attn", "mlp"))
    dense_shards, _ = P.optimizer_shards(lay, st)
    assert P.fp8_master_cast_copies(flat, lay, st, True, True, 0) - P.fp8_master_cast_copies(
        shape, lay, st, True, True, 0) == pytest.approx(P.BF16 * 2 * layer / dense_shards)
    from mbmem_overlays.memory.coverage import not_modelled
    assert not [n for n in not_modelled(cfg) if "first_last" in n]


def test_a_bf16_recipe_with_first_last_layers_bf16_set_changes_nothing(bridge):
    # Bridge's Nemotron-H bridge sets first_last_layers_bf16 on every Nemotron-H model (nemotron_h_bridge.py), the
    # Nano recipe trains in bf16 (bf16_mixed): nothing is marked and nothing is named
    cfg = bridge.build_recipe("nemotron_3_nano_pretrain_config")
    assert cfg.model.first_last_layers_bf16
    shape, lay, st = P.from_config(cfg, 8)
    assert not st.fp8 and shape.bf16_layers == (0, 0) and not any(map(P.runs_bf16, P.layer_kinds(shape)))
    from mbmem_overlays.memory.coverage import not_modelled
    assert not [n for n in not_modelled(cfg) if "first_last" in n]

"""The cost model (memory/cost/): each term pinned to the count its code gives, worked out by hand on small shapes,
and the rankings of the ladder, --search and the doctor by its price. Pure: no Bridge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbmem_overlays.doctor import command as DC
from mbmem_overlays.doctor.plan import _rank
from mbmem_overlays.memory import cost as K
from mbmem_overlays.memory.activations import layer_activation
from mbmem_overlays.memory.cost import step as S
from mbmem_overlays.memory.cost import work as W
from mbmem_overlays.memory.cost.inputs import CostInputs, dp_overlaps, p2p_overlap, tp_overlap
from mbmem_overlays.memory.inputs import Layout, Settings, Shape
from mbmem_overlays.memory.levers import FineGrainedOffload, layer_offload

H, F, NH, D, SEQ = 1024, 4096, 16, 64, 2048
DENSE = Shape(layers=8, hidden=H, ffn=F, heads=NH, groups=NH, head_dim=D, vocab=32000, gated=False)
ONE = Layout(world=1, seq=SEQ, mbs=1, gbs=4)
BF16 = Settings()
TOKENS = SEQ


def lw(shape=DENSE, lay=ONE, st=BF16, kind="attn+mlp", **kw):
    return W.layer_work(shape, lay, st, kind, "alltoall", **kw)


# ----------------------------------------------------------------------------- FLOPs, by hand
def test_mlp_recompute_replays_the_dense_mlp_forward():
    """selective `mlp` (transformer_layer.py:882-900): FC1 and FC2 forward, 2 x tokens x weight elements each, and
    the norm and activation bytes; nothing else."""
    w = lw(st=replace(BF16, recompute="selective", modules=("mlp",)))
    assert w.r16 == pytest.approx(TOKENS * (2 * H * F + 2 * F * H))
    assert w.r8 == 0
    assert w.rm == pytest.approx(TOKENS * (2 * H * 2 + 2 * F * 2))   # norm read+write h, activation read+write ffn
    assert w.r_tp == 0   # TP 1: no collective to replay


def test_core_attn_recompute_is_the_causal_attention_kernel_forward():
    """A fused kernel computes QK^T and PV over the unmasked half: 2 x heads x (dq + dv) x s/2 per token; a non-fused
    attention scores all s keys (dot_product_attention.py) and replays its softmax bytes too."""
    w = lw(st=replace(BF16, recompute="selective", modules=("core_attn",)))
    assert w.r16 == pytest.approx(TOKENS * 2 * NH * 2 * D * SEQ * 0.5)
    unfused = lw(st=replace(BF16, recompute="selective", modules=("core_attn",), attention_scores="torch_softmax"))
    assert unfused.r16 == pytest.approx(2 * w.r16)
    assert unfused.rm == pytest.approx(TOKENS * 2 * NH * SEQ * 2)


def test_step_flops_backward_is_twice_the_gemms_and_2_5x_flash_attention():
    w = lw()
    gemm = 2 * H * (NH + 2 * NH) * D + 2 * NH * D * H + 2 * H * F + 2 * F * H
    attn = 2 * NH * 2 * D * SEQ * 0.5
    assert w.f16 == pytest.approx(TOKENS * (gemm + attn))
    assert w.b16 == pytest.approx(TOKENS * (2 * gemm + 2.5 * attn))
    # LoRA's frozen base: no weight gradient (data gradient only), the adapters train (2x)
    frozen = lw(st=replace(BF16, lora_rank=8, lora_targets=("linear_fc1",)))
    adapter = 2 * 8 * (H + F)
    assert frozen.b16 == pytest.approx(TOKENS * (gemm + 2.5 * attn + 2 * adapter))


def test_fp8_gemms_go_to_the_fp8_rate_and_attention_stays_bf16():
    w = lw(st=replace(BF16, fp8=True))
    assert w.f8 == pytest.approx(TOKENS * (2 * H * 3 * NH * D + 2 * NH * D * H + 4 * H * F))
    assert w.f16 == pytest.approx(TOKENS * 2 * NH * 2 * D * SEQ * 0.5)


def test_moe_recompute_labels_replay_their_regions():
    moe = Shape(layers=4, hidden=H, ffn=F, heads=NH, groups=NH, head_dim=D, vocab=32000, gated=True, experts=8,
                moe_ffn=512, topk=2, shared_ffn=1024, moe_layers=4)
    act = lw(moe, kind="attn+moe", st=replace(BF16, recompute="selective", modules=("moe_act",)))
    assert act.r16 == 0 and act.rm == pytest.approx(TOKENS * 2 * 3 * 512 * 2)   # topk x (read 2f, write f)
    whole = lw(moe, kind="attn+moe", st=replace(BF16, recompute="selective", modules=("moe",)))
    experts = 2 * (2 * H * 2 * 512 + 2 * 512 * H)
    shared = 2 * H * 2 * 1024 + 2 * 1024 * H
    assert whole.r16 == pytest.approx(TOKENS * (2 * H * 8 + experts + shared))
    shared_only = lw(moe, kind="attn+moe", st=replace(BF16, recompute="selective", modules=("shared_experts",)))
    assert shared_only.r16 == pytest.approx(TOKENS * shared)
    # `mlp` is a no-op on MoE layers (transformer_layer.py:514-516)
    assert lw(moe, kind="attn+moe", st=replace(BF16, recompute="selective", modules=("mlp",))).r16 == 0


def test_mla_up_proj_replays_the_up_projections():
    mla = Shape(layers=2, hidden=H, ffn=F, heads=NH, groups=NH, head_dim=D, vocab=32000, mla=True, qk_head_dim=64,
                qk_pos_dim=32, v_head_dim=64, kv_lora_rank=256, q_lora_rank=0)
    w = lw(mla, st=replace(BF16, recompute="selective", modules=("mla_up_proj",)))
    q_proj = 2 * H * NH * 96       # no q LoRA rank: linear_q_proj is inside the checkpoint (:846-860)
    kv_up = 2 * 256 * NH * 128
    assert w.r16 == pytest.approx(TOKENS * (q_proj + kv_up))


def test_full_recompute_replays_every_layer_uniform_and_the_first_n_of_each_chunk_block():
    lay = replace(ONE, world=2, pp=2, vpp=2, gbs=8)   # 8 layers: 4 chunks of 2
    base = K.demand(DENSE, lay, BF16, CostInputs())
    uni = K.demand(DENSE, lay, replace(BF16, recompute="full", recompute_method="uniform"), CostInputs())
    block = K.demand(DENSE, lay, replace(BF16, recompute="full", recompute_method="block", recompute_layers=1),
                     CostInputs())
    one = W.layer_work(DENSE, lay, BF16, "attn+mlp")
    fwd = one.f8 + one.f16
    assert base.ranks[0].recompute == 0
    assert uni.ranks[0].recompute == pytest.approx(4 * fwd)     # the rank's 4 layers
    assert block.ranks[0].recompute == pytest.approx(2 * fwd)   # the first layer of each of its 2 chunks


# ----------------------------------------------------------------------------- bytes per link
def test_tensor_parallel_bytes_under_sequence_parallelism():
    """Per block: forward all-gather + reduce-scatter; backward reduce-scatter, all-gather of the row-parallel
    output's gradient and the input re-gathered for the weight gradient; ring (tp - 1) / tp of the gathered size."""
    lay = replace(ONE, world=4, tp=4, sp=True)
    w = lw(lay=lay)
    ring = 3 / 4
    assert w.tp_f == pytest.approx(TOKENS * 2 * (2 * H * 2 * ring))   # attention and MLP blocks
    assert w.tp_b == pytest.approx(TOKENS * 2 * (3 * H * 2 * ring))
    # without SP one all-reduce each way per block (twice a ring's bytes): the row-parallel output's in forward
    # (mappings.py _ReduceFromModelParallelRegion), the column-parallel input gradient's in backward
    # (_CopyToModelParallelRegion)
    no_sp = lw(lay=replace(lay, sp=False))
    assert no_sp.tp_f == pytest.approx(TOKENS * 2 * (2 * H * 2 * ring))
    assert no_sp.tp_b == pytest.approx(TOKENS * 2 * (2 * H * 2 * ring))


def test_lora_regather_adds_three_collectives_per_regathered_target():
    lay = replace(ONE, world=2, tp=2, sp=True)
    st = replace(BF16, lora_rank=16, lora_targets=("linear_qkv", "linear_fc1"))
    assert lw(lay=lay, st=st).regather == 0
    on = lw(lay=lay, st=replace(st, lora_regather=("linear_qkv", "linear_fc1")))
    assert on.regather == pytest.approx(TOKENS * 2 * 3 * H * 2 * 0.5)


def test_layer_and_fine_grained_offload_move_what_the_memory_model_offloads():
    off = lw(offloaded=True)
    assert off.d2h == off.h2d == pytest.approx(layer_activation(DENSE, ONE, BF16, "attn+mlp"))
    st = replace(BF16, fine_grained_offload=FineGrainedOffload(("core_attn", "attn_proj"), fraction=0.5,
                                                                min_elements=0))
    fine = lw(st=st)
    host = sum(layer_offload(DENSE, ONE, st, "attn+mlp").host.values()) * TOKENS * 0.5
    assert host > 0 and fine.d2h == pytest.approx(host)


def test_data_parallel_and_fsdp_bytes():
    lay = replace(ONE, world=4, gbs=8)     # DP 4, 2 microbatches
    dist = K.demand(DENSE, lay, replace(BF16, dist_optimizer=True), CostInputs()).ranks[0]
    params = dist.opt_params * 4            # the distributed optimizer shards them over DP 4
    assert dist.dp_grad == pytest.approx(params * 4 * 0.75)    # fp32 gradients reduce-scattered once a step
    assert dist.dp_param == pytest.approx(params * 2 * 0.75)   # bf16 parameters all-gathered once
    plain = K.demand(DENSE, lay, BF16, CostInputs()).ranks[0]
    assert plain.dp_grad == pytest.approx(2 * dist.dp_grad) and plain.dp_param == 0   # an all-reduce
    fsdp = K.demand(DENSE, lay, replace(BF16, dist_optimizer=True, fsdp="optim_grads_params"), CostInputs()).ranks[0]
    # every microbatch: gradients reduce-scattered, weights all-gathered for forward and for backward
    assert fsdp.fsdp == pytest.approx(params * 4 * 0.75 + 2 * params * 2 * 0.75)
    assert fsdp.dp_grad == fsdp.dp_param == 0


def test_bubble_fraction_is_megatron_cores_interleaved_schedule():
    lay = replace(ONE, world=4, pp=4, vpp=2, gbs=8)
    d = K.demand(DENSE, lay, BF16, CostInputs())
    assert d.microbatches == 8 and d.bubble == pytest.approx(3 / (2 * 8))
    assert K.demand(DENSE, replace(lay, vpp=1), BF16, CostInputs()).bubble == pytest.approx(3 / 8)
    assert K.demand(DENSE, ONE, BF16, CostInputs()).bubble == 0


def test_optimizer_offload_adds_the_host_copies_and_the_cpu_adam():
    st = replace(BF16, dist_optimizer=True, optimizer_offload=0.5)
    job = (DENSE, ONE, st, CostInputs())
    g = K.GPUS[9]
    d = K.demand(*job)
    for t, (eff, part, best) in zip(K.times(job, 9), S.combos(g)):
        parts = dict(t.parts)
        n = 0.5 * d.ranks[0].opt_params
        pcie, cpu = n * 2 * 4 / g.host_link[part], n * 28 / g.host_dram[part]
        assert parts["optimizer_offload"] == pytest.approx(pcie + cpu)   # no D2H/H2D overlap asked for
    over = K.times((DENSE, ONE, st, CostInputs(optimizer_offload_overlap=True)), 9)
    assert dict(over[0].parts)["optimizer_offload"] < dict(K.times(job, 9)[0].parts)["optimizer_offload"]


# ----------------------------------------------------------------------------- overlaps and the price
def test_overlaps_follow_bridges_setup():
    lay = replace(ONE, world=8, tp=2, pp=2, vpp=2, sp=True, gbs=8)
    assert tp_overlap(CostInputs(tp_comm_overlap=True), lay)
    assert not tp_overlap(CostInputs(tp_comm_overlap=True), replace(lay, sp=False))   # comm_overlap.py:442-451
    assert p2p_overlap(CostInputs(comm_overlap_setup=True), lay)
    assert not p2p_overlap(CostInputs(comm_overlap_setup=True), replace(lay, vpp=1))
    dist = replace(BF16, dist_optimizer=True)
    assert dp_overlaps(CostInputs(comm_overlap_setup=True), lay, dist) == (True, True)   # DP 2 > 1
    assert dp_overlaps(CostInputs(comm_overlap_setup=True), replace(lay, world=4), dist) == (False, False)


def test_price_is_a_range_with_its_parts():
    job = (DENSE, replace(ONE, world=8, tp=2, sp=True, gbs=16), BF16, CostInputs())
    same = K.price(job, job, 9)
    assert same.low == same.high == 0 and same.flops == 0
    rec = K.price(job, (job[0], job[1], replace(BF16, recompute="selective", modules=("mlp",)), job[3]), 9)
    assert 0 < rec.low <= rec.high and rec.flops > 0
    d = rec.as_dict()
    assert {"text", "low", "high", "rank_key", "flops", "bytes_per_link", "bubble", "parts_seconds", "gpu",
            "efficiency", "efficiency_source"} <= set(d)
    assert set(d["bytes_per_link"]) == {"nvlink", "network", "host"} and d["bytes_per_link"]["nvlink"] > 0
    assert "FLOPs +" in rec.text and "step time" in rec.text
    assert K.cost_range(job, (job[0], job[1], replace(BF16, recompute="selective", modules=("mlp",)), job[3]),
                        9) == (rec.low, rec.high)


def test_gpu_table_and_its_sources():
    for arch in (8, 9, 10):
        g = K.GPUS[arch]
        assert g.bf16[0] > 0 and g.hbm[0] > 0 and g.nvlink > g.network and g.sources
    assert K.GPUS[9].fp8[0] == pytest.approx(2 * K.GPUS[9].bf16[0], rel=1e-3)
    g, note = K.gpu(12)
    assert g is K.GPUS[10] and "compute capability 12" in note
    assert K.gpu(9) == (K.GPUS[9], "")
    # the same change is cheaper on faster compute where it is compute (recompute): priced per GPU
    job = (DENSE, ONE, BF16, CostInputs())
    rec = (DENSE, ONE, replace(BF16, recompute="selective", modules=("mlp",)), CostInputs())
    assert K.price(job, rec, 8).gpu == "A100 SXM4" and K.price(job, rec, 10).gpu == "B200/GB200"


def test_rank_key_orders_by_the_middle_then_the_high_end():
    """The middle of a range is the estimate with no assumption favoured; between equal middles the narrower
    range (the one resting less on overlaps) first."""
    assert K.rank_key(0.0, 0.12) < K.rank_key(0.09, 0.10)
    assert K.rank_key(0.04, 0.06) < K.rank_key(0.0, 0.10)          # same middle: the lower high end first
    assert sorted([(0.0, 0.3), (0.1, 0.1), (0.0, 0.1)], key=lambda r: K.rank_key(*r)) == [(0.0, 0.1), (0.1, 0.1),
                                                                                          (0.0, 0.3)]


# ----------------------------------------------------------------------------- the doctor ranks by it
def test_doctor_ranks_covering_remedies_by_the_computed_cost():
    """doctor/plan.py _rank: the remedies that cover the shortfall, cheapest first by the cost model (whatever the
    ladder's order), then the others by saving; unpriced ones keep their place in front."""
    cheap = {"rank_key": [0.02, 0.01], "text": "cheap"}
    dear = {"rank_key": [0.30, 0.20], "text": "dear"}
    a = DC.Remedy("full_recompute", "a", saves=10 * 2**30, step_cost=dear)
    b = DC.Remedy("selective_recompute", "b", saves=9 * 2**30, step_cost=cheap)
    c = DC.Remedy("dist_optimizer", "c", saves=1 * 2**30, step_cost=cheap)
    env = DC.Remedy("expandable_segments", "e")
    ranked = _rank([env, a, c, b], shortfall=5 * 2**30)
    assert [r.name for r in ranked] == ["expandable_segments", "selective_recompute", "full_recompute",
                                        "dist_optimizer"]


# ----------------------------------------------------------------------------- the ladder ranks by it
def test_ladder_takes_the_cheapest_fitting_option_and_keeps_tp_doubling_last():
    from mbmem_overlays.memory import ladder as L
    options = [{"cost": {"rank_key": [0.2, 0.1]}, "total": 1}, {"cost": {"rank_key": [0.05, 0.0]}, "total": 3},
               {"cost": {"rank_key": [0.05, 0.0]}, "total": 2}]
    assert [o["total"] for o in L._cheapest(options)] == [2, 3, 1]   # cost first, then the memory it leaves
    assert "TP x2" in L.LAST_RESORT and any(r.label == "TP x2" for r in L.LADDER_RUNGS)


# ----------------------------------------------------------------------------- the roofline, NCCL, the host
def test_collectives_follow_nccls_ring_model():
    """NCCL v2.30.7 tuning.cc: base latency + one step latency per ring step (n - 1 for all-gather/reduce-scatter,
    2(n - 1) for all-reduce, the steps crossing nodes at the network's), the fastest protocol; bytes at the
    protocol's share of the link (LL half, capped; LL128 0.92; Simple all)."""
    from mbmem_overlays.memory.cost.gpus import NCCL_BASE_LATENCY, NCCL_STEP_LATENCY
    nvl, net = NCCL_STEP_LATENCY["nvlink"], NCCL_STEP_LATENCY["network"]
    bw = 370.8e9
    # a tiny all-gather over 8 ranks: LL's latency, 6.6 + 7 x 0.6 us, its bytes at LL's capped bandwidth
    assert S.collective_seconds("ag", 8.0, 1, 8, 1, bw, 141e9) == pytest.approx(
        NCCL_BASE_LATENCY[0] + 7 * nvl[0] + 8.0 / min(0.5 * bw, 141e9))
    # a large one: Simple, its latency plus the bytes at the whole bandwidth; ten of them cost ten times one
    big = 1e9
    one = S.collective_seconds("ag", big, 1, 8, 1, bw, 141e9)
    assert one == pytest.approx(NCCL_BASE_LATENCY[2] + 7 * nvl[2] + big / bw)
    assert S.collective_seconds("ag", 10 * big, 10, 8, 1, bw, 141e9) == pytest.approx(10 * one)
    # an all-reduce has twice the steps; across 2 nodes two of them at the network's step latency
    ar = S.collective_seconds("ar", big, 1, 16, 2, 50e9, 141e9)
    assert ar == pytest.approx(NCCL_BASE_LATENCY[2] + (30 - 2) * nvl[2] + 2 * net[2] + big / 50e9)
    assert S.collective_seconds("rs", 0.0, 3, 8, 1, bw) == 0.0


def test_nvlink_is_priced_at_nccls_own_link_figure():
    """topo.h SM90_NVLINK_BW 20.6 GB/s per link x 18 links (H100); the stated peak stays in the table beside it."""
    sp = S._all_speeds(9)[0][0]
    assert sp.bw["nvlink"] == pytest.approx(18 * 20.6e9)
    assert K.GPUS[9].nvlink == pytest.approx(450e9) and K.GPUS[8].nvlink_nccl == pytest.approx(12 * 20.0e9)


def test_compute_bound_bound_covers_every_gpu():
    """work.COMPUTE_BOUND_INTENSITY is above every GPU's steepest ridge point (its fastest tensor rate x the highest
    efficiency / its slowest HBM): a GEMM above it is compute-bound everywhere, and is timed linearly."""
    for g in K.GPUS.values():
        for part in (0, 1):
            peak = max(g.fp8[part], g.bf16[part])
            assert peak * max(K.EFFICIENCY) / min(g.hbm) < W.COMPUTE_BOUND_INTENSITY


def test_gemm_roofline_times_a_small_gemm_by_its_bytes():
    """M x K x N: 2MKN FLOPs; forward reads MK + KN and writes MN; a GEMM of few rows (tokens per expert) is
    bandwidth-bound: its time is its bytes at HBM bandwidth, not its FLOPs at the efficiency."""
    f, fb, wb, fp8 = W.gemm(16, 4096, 4096, False, 2, 4)
    assert f == 2 * 16 * 4096 * 4096 and fb == (16 * 4096 + 4096 * 4096) * 2 + 16 * 4096 * 2
    assert wb == (16 * 4096 + 16 * 4096) * 2 + 2 * 4096 * 4096 * 4 and not fp8
    ph = W._phase([(f, fb, False)], 0.0)
    assert ph[W.PH_SMALL] and ph[W.PH_F16] == 0          # below the intensity bound: the roofline decides
    sp = S._all_speeds(9)[0][0]
    assert S._phase_seconds(ph, 1 / sp.p8, 1 / sp.p16, 1 / sp.hbm) == pytest.approx(fb / sp.hbm)
    big = W.gemm(4096, 4096, 4096, False, 2, 4)
    assert W._phase([big[:2] + (False,)], 0.0)[W.PH_F16] == big[0]    # compute-bound: linear in its FLOPs


def test_fp8_quantizes_the_row_parallel_inputs_and_gradients():
    """Under FP8 TE quantizes what no fused norm produced (the attention output, the activation) and each output
    gradient: read the compute dtype, write FP8 data and its transpose, 3 x D bytes per element."""
    bf = {r.name: r for r in lw().regions}
    f8 = {r.name: r for r in lw(st=replace(BF16, fp8=True)).regions}
    assert f8["proj"].hbm - bf["proj"].hbm == pytest.approx(3 * 2 * TOKENS * H)
    assert f8["act"].hbm - bf["act"].hbm == pytest.approx(3 * 2 * TOKENS * F)
    assert all(e for r in (f8["qkv"], f8["fc1"]) for *_, e in r.gemms)


def test_tp_overlap_hides_each_collective_behind_its_paired_gemm_at_best():
    """With TP comm overlap a collective hides behind the GEMMs of its own region (TE userbuffers pair the
    all-gather with its consumer, the reduce-scatter with its producer): what exceeds them stays exposed."""
    lay = replace(ONE, world=8, tp=8, sp=True)
    w = lw(lay=lay)
    sp = S._all_speeds(9)[0][0]
    ctx = S.Ctx((8, 1, sp.bw["nvlink"]), (1, 1, sp.bw["nvlink"]), (1, 1, sp.bw["nvlink"]), sp.ll_max)
    t = S.layer_times(w, sp, ctx)
    tpf, tpf_h = t[3], t[6]
    gemm_f = sum(S._phase_seconds(ph_f, 1 / sp.p8, 1 / sp.p16, 1 / sp.hbm) for ph_f, *_ in S._summary(w).tp_regions)
    comm = [S._colls_seconds(cf, 8, 1, sp.bw["nvlink"], sp.ll_max) for _, _, cf, _, _ in S._summary(w).tp_regions]
    assert tpf == pytest.approx(sum(comm)) and 0 <= tpf_h < tpf
    assert tpf_h == pytest.approx(sum(max(0.0, c - S._phase_seconds(ph, 1 / sp.p8, 1 / sp.p16, 1 / sp.hbm))
                                      for c, (ph, *_) in zip(comm, S._summary(w).tp_regions)))
    assert gemm_f > 0


TINY = Shape(layers=4, hidden=64, ffn=256, heads=2, groups=2, head_dim=32, vocab=512, gated=True)
TINY_LAY = Layout(world=1, seq=16, mbs=1, gbs=2)


def test_a_layer_shorter_than_its_launches_is_host_bound_and_cuda_graphs_remove_them():
    """Each region's kernels are launched by the host at gpus.LAUNCH_SECONDS: a tiny layer's step is its launches;
    TE-scoped graphs of attn and mlp replay each scope with one launch, a full-iteration graph with none."""
    from mbmem_overlays.memory.cost.gpus import LAUNCH_SECONDS
    eager = (TINY, TINY_LAY, BF16, CostInputs())
    t = K.times(eager, 9)[0]
    parts = dict(t.parts)
    launches = sum(r.kernels[0] + r.kernels[1] for r in W.layer_work(TINY, TINY_LAY, BF16, "attn+mlp").regions)
    assert parts["host"] > parts["compute"] and parts["host"] > 0
    graphed = (TINY, TINY_LAY, replace(BF16, graph_scopes=("attn", "mlp")), CostInputs())
    g = dict(K.times(graphed, 9)[0].parts)
    assert g["host"] < parts["host"]
    one_layer = W.layer_work(TINY, TINY_LAY, replace(BF16, graph_scopes=("attn", "mlp")), "attn+mlp")
    assert all(r.graphed for r in one_layer.regions)
    assert S._summary(one_layer).launches == (0, 0, 0) and S._summary(one_layer).graphs == (2, 2, 0)
    full = (TINY, TINY_LAY, BF16, CostInputs(graph_full_iteration=True))
    assert dict(K.times(full, 9)[0].parts)["host"] == 0
    assert K.price(eager, graphed, 9).high < 0
    # a large layer's GPU work hides its launches: graphs change nothing there
    big = (DENSE, ONE, BF16, CostInputs())
    assert dict(K.times(big, 9)[0].parts)["host"] == 0
    assert launches * LAUNCH_SECONDS > 0


def test_recomputing_a_memory_bound_module_costs_its_bytes():
    """moe_act's replay is one elementwise kernel: its time is its bytes at HBM bandwidth (and its launch)."""
    moe = Shape(layers=4, hidden=H, ffn=F, heads=NH, groups=NH, head_dim=D, vocab=32000, gated=True, experts=8,
                moe_ffn=512, topk=2, moe_layers=4)
    w = lw(moe, kind="attn+moe", st=replace(BF16, recompute="selective", modules=("moe_act",)))
    sp = S._all_speeds(9)[0][0]
    ctx = S.Ctx((1, 1, sp.bw["nvlink"]), (1, 1, sp.bw["nvlink"]), (1, 1, sp.bw["nvlink"]), sp.ll_max)
    assert S.layer_times(w, sp, ctx)[2] == pytest.approx(w.rm / sp.hbm)


def test_deferred_output_wgrad_leaves_the_steady_state():
    """defer_embedding_wgrad_compute: the output layer's weight gradient of the deferred microbatches is not in its
    steady-state backward (it runs after the schedule)."""
    full = W.output_layer_work(DENSE, ONE, BF16)
    half = W.output_layer_work(DENSE, ONE, BF16, wgrad_share=0.5)
    sp = S._all_speeds(9)[0][0]
    i = (1 / sp.p8, 1 / sp.p16, 1 / sp.hbm)
    assert S._phase_seconds(S._summary(half).bwd, *i) < S._phase_seconds(S._summary(full).bwd, *i)
    assert S._phase_seconds(S._summary(half).fwd, *i) == S._phase_seconds(S._summary(full).fwd, *i)


def test_data_parallel_buckets_count_collectives():
    """distributed_data_parallel.py:66-72: with overlap_grad_reduce the gradients go in buckets of max(40M, 1M x dp)
    parameters, one collective each; without it one."""
    lay = replace(ONE, world=4, gbs=8)
    st = replace(BF16, dist_optimizer=True)
    on = K.demand(DENSE, lay, st, CostInputs(overlap_grad_reduce=True)).ranks[0]
    off = K.demand(DENSE, lay, st, CostInputs()).ranks[0]
    params = on.opt_params * 4
    assert on.dp_buckets == max(1, -(-int(params) // 40_000_000)) and off.dp_buckets == 1


def test_candidates_differing_only_in_the_optimizer_share_their_layer_work():
    """layer_work is cached on the settings a layer reads (work.OPTIMIZER_ONLY aside): a search's candidates that
    differ only in the optimizer share one LayerWork, and its timing."""
    a = W.layer_work(DENSE, ONE, BF16, "attn+mlp")
    b = W.layer_work(DENSE, ONE, replace(BF16, dist_optimizer=True, optimizer_offload=0.5), "attn+mlp")
    c = W.layer_work(DENSE, ONE, replace(BF16, fp8=True), "attn+mlp")
    assert a is b and a is not c

"""Issue 31's levers in the plan: each overlay changes the component it claims by the planned amount (the formula
its code gives, written out here), says "saves nothing here" where it cannot, and the plan reads the same
environment as `mbmem apply`.

Figures from the corpus (Megatron-LM's measured runs) are printed by bench/plan_levers.py, not asserted here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mbmem_overlays.core.catalog import Catalog
from mbmem_overlays.memory import levers as L
from mbmem_overlays.memory import model as P

L8 = "llama3_8b_pretrain_config"
DP8 = ("model.context_parallel_size=1",)   # Llama3-8B's recipe on 8 GPUs: TP1 PP1, then DP 8


def plan_of(cfg, world):
    shape, lay, st = P.from_config(cfg, world)
    return shape, lay, st, P.estimate(shape, lay, st)


def steps(recipe, overlays, *sets, world=8, params=None):
    from mbmem_overlays.memory.steps import build_plan
    cfg = recipe(L8, *DP8, *sets)
    locked = {s.split("=")[0]: None for s in sets}
    return build_plan(cfg, list(overlays), world=world, recipe=L8, params=params, locked=locked,
                      catalog=Catalog()).steps


# ----------------------------------------------------------------------------- bf16 moments
@pytest.mark.bridge
def test_bf16_moments_halve_the_adam_moments_and_nothing_else(bridge, recipe):
    base, bf16 = steps(recipe, ["precision_aware_optimizer"])
    a, b = base.breakdown, bf16.breakdown
    shape, lay, st = P.from_config(recipe(L8, *DP8), 8)
    moments = a.optimizer * (P.ADAM_MOMENTS * P.FP32) / (P.FP32 + P.ADAM_MOMENTS * P.FP32)   # fp32 master + 2 moments
    assert b.optimizer == pytest.approx(a.optimizer - moments / 2, rel=1e-9)
    assert (b.parameters, b.gradients, b.activations) == (a.parameters, a.gradients, a.activations)
    assert "saves nothing" not in bf16.note


@pytest.mark.bridge
def test_each_moment_keeps_its_own_dtype(bridge, recipe):
    import torch
    cfg = recipe(L8, "optimizer.use_precision_aware_optimizer=true")
    cfg.optimizer.exp_avg_dtype, cfg.optimizer.exp_avg_sq_dtype = torch.bfloat16, torch.float32
    assert P.from_config(cfg, 8)[2].state_bytes == (P.BF16 + P.FP32) / 2


# ----------------------------------------------------------------------------- Megatron FSDP
@pytest.mark.bridge
def test_megatron_fsdp_shards_weights_and_gradients_and_gathers_two_units(bridge, recipe):
    """optim_grads_params at DP 8: weights and gradients / 8, the gradients in FSDP's own buffer dtype (the
    parameters' bf16, Bridge leaves megatron_fsdp_main_grads_dtype unset), the optimizer state as the distributed
    optimizer already had it; in flight the current and the prefetched layer's weights and one layer's gradients,
    and for the whole job the embedding and output layer all-gathered (outside every FSDP unit: issue 30)."""
    base, fsdp = steps(recipe, ["megatron_fsdp"])
    a, b = base.breakdown, fsdp.breakdown
    shape, lay, st = P.from_config(recipe(L8, *DP8), 8)
    assert lay.dp == 8 and st.grad_bytes == P.FP32
    assert b.parameters == pytest.approx(a.parameters / 8, rel=1e-9)
    assert b.gradients == pytest.approx(a.gradients / 8 * P.BF16 / P.FP32, rel=1e-9)
    assert b.optimizer == pytest.approx(a.optimizer, rel=1e-9)
    unit = P.largest_layer_params(shape, lay, 0)
    _, embed, _ = P.stage_params(shape, lay, True, True, 0)
    assert b.other == pytest.approx(2 * unit * P.BF16 + unit * P.BF16 + P.global_memory_buffer(shape, lay, st, 0)
                                    + embed * P.BF16 + st.gemm_workspace_bytes, rel=1e-9)
    assert "saves nothing" not in fsdp.note and "shards nothing" not in fsdp.note


@pytest.mark.bridge
def test_megatron_fsdp_reads_its_own_buffer_dtypes(bridge, recipe):
    import torch
    cfg = recipe(L8, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")
    st = P.from_config(cfg, 8)[2]
    assert (st.grad_bytes, st.master_bytes) == (P.BF16, P.FP32)   # unset main grads: the bf16 parameters' dtype
    cfg.ddp.megatron_fsdp_main_grads_dtype = torch.float32
    cfg.ddp.megatron_fsdp_main_params_dtype = None                 # the compute weights are the masters
    st = P.from_config(cfg, 8)[2]
    assert (st.grad_bytes, st.master_bytes) == (P.FP32, 0)


@pytest.mark.bridge
def test_megatron_fsdp_at_dp1_shards_nothing_and_says_so(bridge, recipe):
    """World size 1: nothing to shard. With FSDP's gradients kept in fp32 the plan does not move and says "saves
    nothing here"; left to Bridge's default the only change is FSDP's bf16 gradient buffer, and the note says that
    it is a dtype, not sharding."""
    import torch
    sets = ("model.num_layers=4", "model.seq_length=2048", "dataset.seq_length=2048")
    base, fsdp = steps(recipe, ["megatron_fsdp"], *sets, world=1)
    assert "shards nothing here (DP x CP is 1" in fsdp.note and "gradient buffer dtype" in fsdp.note
    assert fsdp.breakdown.parameters == base.breakdown.parameters
    from mbmem_overlays.memory.steps import build_plan
    cfg = recipe(L8, *DP8, *sets)
    cfg.ddp.megatron_fsdp_main_grads_dtype = torch.float32
    plan = build_plan(cfg, ["megatron_fsdp"], world=1, recipe=L8, catalog=Catalog())
    assert plan.steps[1].breakdown.total == pytest.approx(plan.steps[0].breakdown.total, abs=1 << 20)
    assert plan.steps[1].note.startswith("saves nothing here: DP x CP is 1")
    assert plan.as_dict()["steps"][1]["note"] == plan.steps[1].note


# ----------------------------------------------------------------------------- fine-grained offloading
MODULES = ["qkv_linear", "core_attn", "attn_proj"]


@pytest.mark.bridge
def test_fine_grained_offload_removes_the_named_modules_saved_inputs(bridge, recipe):
    """Llama3-8B (TE's fused norm + QKV, bf16), PP1: qkv_linear takes the layer input and the norm output,
    core_attn q, k, v (the softmax statistics are under 1M elements and stay), attn_proj the attention output.
    The peak is the loss beside the last layer, which stays on the GPU (its backward comes next): every other
    layer's offloaded tensors leave. A reloaded layer in backward (one layer, the attention output twice) is
    smaller than the logits. The host holds every layer's, the attention output twice (core_attn's and
    attn_proj's hooks each copy it)."""
    base, off = steps(recipe, ["fine_grained_offload"], params={"fine_grained_offload": {"modules": MODULES}})
    a, b = base.breakdown, off.breakdown
    shape, lay, st = P.from_config(recipe(L8, *DP8), 8)
    terms = P.layer_activation_terms(shape, lay, st)
    tokens = lay.seq * lay.mbs / lay.cp
    assert terms["attention_softmax_stats"] * tokens / P.FP32 < L.MIN_OFFLOADED_ELEMENTS
    per_layer = (terms["attn_layernorm_input"] + terms["attention_layernorm_output"] + terms["attention_qkv"]
                 + terms["attention_output"]) * tokens
    assert a.activations - b.activations == pytest.approx(per_layer * (shape.layers - 1), rel=1e-9)
    assert (b.parameters, b.gradients, b.optimizer) == (a.parameters, a.gradients, a.optimizer)
    host = (per_layer + terms["attention_output"] * tokens) * shape.layers
    assert f"host: {host / 2**30:.2f} GiB of pinned memory per GPU, {8 * host / 2**30:.1f} GiB per node" in off.note


@pytest.mark.bridge
def test_fine_grained_offload_fraction_keeps_the_later_groups(bridge, recipe):
    cfg = recipe(L8, *DP8, "model.fine_grained_activation_offloading=true",
                 f"model.offload_modules=[{','.join(MODULES)}]")
    shape, lay, st = P.from_config(cfg, 8)
    full = L.offloaded_activations(shape, lay, st, 0)
    half = L.offloaded_activations(shape, lay, replace(st, fine_grained_offload=replace(
        st.fine_grained_offload, fraction=0.5)), 0)
    # 96 groups per chunk, the later 48 (16 layers) stay; the working set (a reloaded layer) is the same
    per_layer = sum(L.layer_offload_terms(shape, lay, st, "attn+mlp")[0].values()) * lay.seq * lay.mbs
    assert half.gpu_removed == pytest.approx(full.gpu_removed - 16 * per_layer, rel=1e-9)
    assert half.working == full.working
    assert half.host_per_gpu == full.host_per_gpu   # the warm-up iteration offloads every group


@pytest.mark.bridge
@pytest.mark.parametrize("modules, sets, why", [
    (["mlp_norm"], (), "the dense MLP's norm is fused into linear_fc1"),
    (["expert_fc1", "moe_act"], (), "the model has no MoE layers"),
    (["core_attn"], ("model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"),
     "core_attn is recomputed"),
    (["qkv_linear"], ("model.recompute_granularity=full", "model.recompute_method=uniform",
                      "model.recompute_num_layers=1"), "full recompute keeps only each layer's input"),
])
def test_fine_grained_offload_saves_nothing_where_nothing_is_saved(bridge, recipe, modules, sets, why):
    base, off = steps(recipe, ["fine_grained_offload"], *sets, params={"fine_grained_offload": {"modules": modules}})
    assert off.breakdown.total == pytest.approx(base.breakdown.total, abs=1 << 20)
    assert off.note.startswith("saves nothing here: ") and why in off.note


# ----------------------------------------------------------------------------- offloading a non-fused attention
# An MLA + MoE model like the corpus's two offloading cases (Megatron-LM's functional tests), smaller and in our
# own numbers: unfused attention, the recompute the corpus cases use, every offload module on.
NON_FUSED = P.Shape(layers=8, hidden=1024, ffn=4096, heads=16, groups=16, head_dim=128, vocab=32768, experts=8,
                    moe_ffn=512, topk=2, shared_ffn=512, moe_layers=8, mla=True, qk_head_dim=128, qk_pos_dim=64,
                    v_head_dim=128, kv_lora_rank=512, q_lora_rank=768)
ALL_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


def non_fused(**settings):
    lay = P.Layout(world=8, tp=2, pp=2, ep=2, sp=True, seq=4096, mbs=1, gbs=8)
    st = P.Settings(recompute="selective", modules=("layernorm", "mla_up_proj", "moe_act"), dist_optimizer=True,
                    attention_scores="fused_softmax",
                    fine_grained_offload=L.FineGrainedOffload(ALL_MODULES))
    return NON_FUSED, lay, replace(st, **settings)


def test_offloading_a_non_fused_attention_takes_its_probabilities_and_copies_them_twice():
    """core_attn's hooks capture a non-fused attention's probabilities (the s x s term, the largest of the layer)
    and q, k, v, not its output (linear_proj's input, attn_proj's group). The fused softmax saves its output and
    the bmm with v the same tensor: two copies on the host, two reloaded tensors. With attention dropout the three
    saved tensors are distinct (softmax output, mask, dropped probabilities): one copy each. MLA's up-projection
    recompute drops q, k, v from the stored activations, but core_attn copied them first."""
    shape, lay, st = non_fused()
    terms = P.layer_activation_terms(shape, lay, st, "attn+moe")
    stored = P._selected_terms(shape, lay, st, "attn+moe")
    one = L.layer_offload(shape, lay, st, "attn+moe")
    assert "attention_qkv" not in stored and "attention_qkv" not in one.gpu
    assert one.host["attention_qkv"] == terms["attention_qkv"]
    assert one.gpu["attention_scores"] == terms["attention_scores"]
    assert one.host["attention_scores"] == 2 * terms["attention_scores"]
    assert one.host["attention_output"] == terms["attention_output"]   # attn_proj's copy only
    assert one.scores_transient == P.BF16 * shape.heads / lay.tp * lay.seq
    assert one.attention_live == pytest.approx(sum(terms[n] for n in (
        "attn_layernorm_input", "attention_layernorm_output", "mla_up_proj_inputs", "attention_qkv",
        "attention_scores", "attention_output")), rel=1e-12)
    # what no offload module captures stays: the router's probabilities, the shared expert (and, where the
    # activations model keeps it, the unpermute's input)
    assert set(stored) - set(one.gpu) == set(stored) & {"moe_router", "moe_unpermute_input", "shared_expert"}
    assert {"moe_router", "shared_expert"} <= set(stored)
    dropout = L.layer_offload(*non_fused(attention_dropout=True), "attn+moe")
    assert dropout.host["attention_scores"] == dropout.gpu["attention_scores"]


def test_offload_peak_holds_a_working_layer_and_a_reloaded_layer():
    """Pipeline rank 0 of 2 has two microbatches in flight: once the first backward chunk's last layer is kept
    (the margin), each chunk's reload runs one layer ahead and pre-reloads the next backward chunk's last layer,
    which waits through the next forward beside that forward's working layer (its attention block's tensors and
    the s x s scores beside the probabilities). The last rank (one microbatch in flight) reloads nothing ahead:
    its peak is the larger of the working layer and a reloaded layer in backward beside the probabilities'
    gradient; the loss there runs beside the layer the offload keeps."""
    shape, lay, st = non_fused()
    tokens = lay.seq * lay.mbs
    one = L.layer_offload(shape, lay, st, "attn+moe")
    gpu, host = sum(one.gpu.values()) * tokens, sum(one.host.values()) * tokens
    live = (one.attention_live + one.scores_transient) * tokens
    assert live > one.mlp_live * tokens
    first = L.offloaded_activations(shape, lay, st, 0)
    assert P.in_flight(lay, 0) == 2
    assert first.working == pytest.approx(live + host, rel=1e-12)
    assert first.gpu_removed == pytest.approx(4 * 2 * gpu - first.working, rel=1e-12)
    assert first.host_per_gpu == pytest.approx(4 * 2 * host, rel=1e-12)
    last = L.offloaded_activations(shape, lay, st, 1)
    assert last.working == pytest.approx(max(live, host + one.scores_transient * tokens), rel=1e-12)
    assert last.beside_loss == last.kept_margin == pytest.approx(gpu, rel=1e-12)
    base = replace(st, fine_grained_offload=None)
    acts = P.stage_activations(shape, lay, st, 1)
    stored = P.stage_activations(shape, lay, base, 1).steady
    logits = st.logits_bytes * shape.vocab / lay.tp * tokens
    kept = stored - logits - 4 * gpu
    assert acts.steady == pytest.approx(kept + max(last.working, last.kept_margin + logits), rel=1e-12)
    assert ("fine-grained offload: working layer and reloaded layer", last.working) in acts.detail


def test_offload_never_plans_more_than_keeping_the_activations():
    """One layer, one microbatch: the working set is the whole layer and more (the plan's stored activations
    leave out its transients), so the offload is planned as saving nothing rather than as costing memory."""
    shape, lay, st = non_fused()
    shape = replace(shape, layers=1, moe_layers=1)
    lay = replace(lay, pp=1, world=4)
    off = L.offloaded_activations(shape, lay, st, 0)
    assert (off.gpu_removed, off.working) == (0.0, 0.0) and off.host_per_gpu > 0
    base = replace(st, fine_grained_offload=None)
    assert P.stage_activations(shape, lay, st, 0).steady == P.stage_activations(shape, lay, base, 0).steady


def test_offload_reads_cuda_graph_modules_given_as_one_name():
    """TransformerConfig.cuda_graph_modules is one name ("full" by default) or a list: one name is one module,
    not its letters."""
    from types import SimpleNamespace
    m = SimpleNamespace(fine_grained_activation_offloading=True, offload_modules=["core_attn"],
                        cuda_graph_modules="attn")
    assert L.offload_from_config(m).graph_modules == ("attn",)
    assert L.offload_from_config(SimpleNamespace(**{**vars(m), "cuda_graph_modules": [
        "attn", "moe_router"]})).graph_modules == ("attn", "moe_router")


# megatron-core 0.19.2 lines the offload terms cite (memory/levers.py), checked against the installed package
OFFLOAD_CITED_LINES = [
    ("pipeline_parallel/fine_grained_activation_offload.py", 583, "last_group_with_same_name = {}"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 590, "if self._offload_margin > 0:"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 1008, "for tensor_tag, tensor_on_device in "
                                                                   "group_to_offload._tensors.items():"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 855, "gpu_tensor = torch.empty("),
    ("pipeline_parallel/fine_grained_activation_offload.py", 1064, "self.bulk_reload_group()"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 1097, "self._groups_to_reload.append(group_to_offload)"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 1139,
     "next_backward_chunk = PipelineOffloadManager.get_instance().front_backward_chunk()"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 1146, "next_backward_chunk.pre_reload_last_layer()"),
    ("pipeline_parallel/fine_grained_activation_offload.py", 1202, "self.bulk_reload()"),
    ("transformer/multi_latent_attention.py", 429, "core_attn_out = core_attn_manager.group_offload("),
    ("transformer/multi_latent_attention.py", 456,
     "self.qkv_up_checkpoint.discard_output_and_register_recompute(core_attn_out)"),
    ("transformer/dot_product_attention.py", 210, "attention_probs: Tensor = self.scale_mask_softmax("),
]


def test_offload_cited_lines_hold_the_cited_code():
    import megatron.core
    root = Path(megatron.core.__file__).resolve().parent
    for path, line, text in OFFLOAD_CITED_LINES:
        assert text in (root / path).read_text().splitlines()[line - 1], (path, line)


# ----------------------------------------------------------------------------- the environment apply reads
@pytest.mark.bridge
def test_plan_reads_the_environment_apply_reads(bridge, monkeypatch, capsys):
    """Issue 31: with NVTE_CPU_OFFLOAD_V1=1 exported, `mbmem apply` passes and `mbmem plan` must plan (it refused);
    without it both refuse with the same fix. The plan then counts the offload."""
    from mbmem_overlays.cli import main
    argv = ["--recipe", "llama3_8b_pretrain", "--world-size", "8", "--set", "model.fine_grained_activation_offloading=true",
            "--set", "model.offload_modules=[core_attn,qkv_linear]"]
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    capsys.readouterr()
    assert main(["plan", *argv]) == 1
    assert "export NVTE_CPU_OFFLOAD_V1=1" in capsys.readouterr().err
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    assert main(["apply", *argv, "--no-validate"]) == 0
    capsys.readouterr()
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    baseline = next(line for line in out.splitlines() if line.strip().startswith("baseline"))
    assert float(baseline.split()[-2]) < 67.9   # 67.95 GiB without offloading (issue 31: 72.96 GB)


def test_offload_counts_the_same_schedule_moment_as_the_stage_it_peaks_at():
    """Under Megatron's interleaved schedule each model chunk has its own microbatches in flight
    (pipeline.rank_alive). With a pipeline layout whose last chunk holds only MTP and the loss, the last rank's
    moments are the loss's own (two microbatches per layer chunk and the loss's) and the later steady ones with
    more layer chunks alive and no loss. The offload takes each chunk's layers' bytes at the moment the stage is
    planned at, never those of another moment, and that moment is the one where what stays on the GPU peaks."""
    from mbmem_overlays.memory import stage_activations as S
    from mbmem_overlays.memory.pipeline import rank_alive
    shape, lay, st = non_fused()
    shape = replace(shape, layers=15, moe_layers=15, mtp_layers=1)
    lay = replace(lay, vpp=4, chunk_layers=(3, 2, 2, 2, 2, 2, 2, 0))
    assert set(rank_alive(lay, 1)) == {(2, 2, 2, 1), (3, 2, 2, 0), (4, 2, 1, 0), (4, 3, 0, 0)}
    tokens = lay.seq * lay.mbs / lay.cp
    one = L.layer_offload(shape, lay, st, "attn+moe")
    gpu = sum(one.gpu.values()) * tokens
    off = L.offloaded_activations(shape, lay, st, 1)
    assert off.chunk_removed == pytest.approx((2 * gpu, 2 * gpu, 2 * gpu, 0.0), rel=1e-12)
    for moment in rank_alive(lay, 1):   # each chunk's own layers: the loss-only chunk takes nothing
        at = L.offloaded_activations(shape, lay, st, 1, moment)
        assert at.gpu_removed == pytest.approx(2 * sum(moment[:3]) * gpu - at.working, rel=1e-12)
    layer = P.layer_activation(shape, lay, st, "attn+moe")
    logits = st.logits_bytes * shape.vocab / lay.tp * tokens
    saved = min(logits, S.loss_kept_bytes(st) * shape.vocab / lay.tp * tokens)
    mtp = S.mtp_layer_activation(shape, lay, st) + saved
    inputs = S.loss_chunk_inputs(shape, lay, st)

    def at(moment):   # the last rank's activations at one moment: the loss runs beside the kept (MTP) layer
        n_loss = moment[-1]
        loss = max(0.0, logits + (n_loss - 1) * saved + mtp - off.working) if n_loss else 0.0
        return 2 * sum(moment[:3]) * (layer - gpu) + off.working + n_loss * inputs + loss

    assert P.stage_activations(shape, lay, st, 1).steady == pytest.approx(
        max(at(moment) for moment in rank_alive(lay, 1)), rel=1e-12)


# ----------------------------------------------------------------------------- the precision-aware optimizer's masters
def test_fused_adam_keeps_int16_remainders_of_the_fp32_masters_only_where_it_owns_them():
    """from_config.master_bytes: on megatron-core's no_fp8_or_ds_fp8 path FusedAdam owns the masters of bf16
    parameters and, with store_param_remainders (its default), keeps 16 bits of each; every other path keeps a
    whole master in main_params_dtype (fp32 off the precision-aware optimizer)."""
    from types import SimpleNamespace as NS

    import torch
    from mbmem_overlays.memory.from_config import master_bytes
    opt = dict(use_precision_aware_optimizer=True, main_params_dtype=torch.float32, store_param_remainders=True,
               optimizer_cpu_offload=False)
    bf16, fp16 = NS(params_dtype=torch.bfloat16), NS(params_dtype=torch.float16)
    assert master_bytes(NS(**opt), bf16, True, False, False) == P.BF16
    assert master_bytes(NS(**{**opt, "store_param_remainders": False}), bf16, True, False, False) == P.FP32
    assert master_bytes(NS(**opt), bf16, False, False, False) == P.FP32        # MCore's own fp32 masters
    assert master_bytes(NS(**opt), bf16, True, True, False) == P.FP32         # FP8 / FP4 primary weights
    assert master_bytes(NS(**opt), bf16, True, False, True) == P.FP32         # Megatron FSDP's own buffers
    assert master_bytes(NS(**opt), fp16, True, False, False) == P.FP32        # remainders are for bf16 only
    assert master_bytes(NS(**{**opt, "optimizer_cpu_offload": True}), bf16, True, False, False) == P.FP32
    assert master_bytes(NS(**{**opt, "main_params_dtype": torch.float16}), bf16, True, False, False) == P.BF16
    assert master_bytes(NS(**{**opt, "use_precision_aware_optimizer": False}), bf16, True, False, False) == P.FP32
    assert master_bytes(NS(), bf16, False, False, False) == P.FP32


@pytest.mark.bridge
@pytest.mark.parametrize("fp8, master", [("", P.BF16), (" --fp8-format hybrid --fp8-recipe tensorwise", P.FP32)])
def test_a_precision_aware_megatron_job_is_planned_on_a_host_without_te(bridge, fp8, master):
    """--use-precision-aware-optimizer makes megatron-core's OptimizerConfig import TE's FusedAdam; a host without
    TE still plans the job as its GPU nodes run it: bf16 moments, and int16 master remainders where FusedAdam owns
    the masters (the delayed-scaling default), whole fp32 masters under tensorwise FP8 (MCore keeps them)."""
    from mbmem_overlays.bridge.megatron_args import load_job
    words = ("--tensor-model-parallel-size 2 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
             "--max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 --tokenizer-type NullTokenizer "
             "--vocab-size 1024 --bf16 --use-distributed-optimizer --use-precision-aware-optimizer "
             "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
    job = load_job(words + fp8, world_size=8)
    assert job.config.optimizer.use_precision_aware_optimizer and job.config.optimizer.store_param_remainders
    st = P.from_config(job.config, 8)[2]
    assert (st.master_bytes, st.state_bytes) == (master, P.BF16)


@pytest.mark.bridge
def test_the_as_run_config_keeps_store_param_remainders_as_the_gpu_nodes_te_does(bridge, recipe):
    """optimizer_config.py:438-439 turns store_param_remainders off below TE 2.1; without TE on this host it would
    be turned off in the plan's copy, not in the job."""
    from mbmem_overlays.bridge.as_run import as_run
    cfg = recipe(L8, *DP8, "optimizer.use_precision_aware_optimizer=true")
    assert as_run(cfg, 8).config.optimizer.store_param_remainders is True

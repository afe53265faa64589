"""Issue 38 point 1: the plan reads the configuration Bridge will actually run (bridge/as_run.py), through every
path, and the platform a recipe is named for sets the GPUs it is planned for.

The oracle is Bridge's own ``runtime_config_update`` on a copy (as_run.bridge_runtime_update); bench/plan_as_run.py
runs the same comparison on every recipe Bridge ships."""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
from conftest import mbmem

# The issue's example: Bridge's vanilla GPT recipe keeps fp32 model fields and says bf16 in mixed_precision.
VANILLA = "vanilla_gpt_pretrain_1gpu_h100_bf16_config"
VANILLA_SETS = ("model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
                "model.seq_length=4096", "dataset.seq_length=4096", "train.micro_batch_size=4")
BY_HAND = ("model.bf16=true", "model.params_dtype=bfloat16")


def _sets(*words):
    return [w for s in words for w in ("--set", s)]


# ----------------------------------------------------------------------------- pure: no Bridge import
def test_job_env_keeps_the_jobs_own_variables_over_the_recipes_defaults():
    """apply_environment_variables uses os.environ.setdefault (config.py:1832-1850): the job's value wins."""
    from mbmem_overlays.bridge.as_run import job_env
    cfg = SimpleNamespace(env_vars={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_NVLS_ENABLE": 0,
                                    "BAD": {"not": "scalar"}})
    assert job_env(cfg, None) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_NVLS_ENABLE": "0"}
    assert job_env(cfg, {"PYTORCH_CUDA_ALLOC_CONF": "x"})["PYTORCH_CUDA_ALLOC_CONF"] == "x"
    assert job_env(SimpleNamespace(), {"A": 1}) == {"A": "1"}


@pytest.mark.parametrize("name, platform, arch, where", [
    ("llama3_8b_pretrain_8gpu_gb200_bf16_config", "gb200", 10, "the recipe's name"),
    ("megatron.bridge.perf_recipes.llama.b300.llama3.llama3_8b_pretrain_8gpu_b300_bf16_config", "b300", 10,
     "the recipe's name"),
    pytest.param("megatron.bridge.recipes.nemotronh.gb200.nemotron_3_5_lightning."
                 "nemotron_3_5_lightning_pretrain_8k_config", "gb200", 10, "the recipe's module path",
                 marks=pytest.mark.bridge, id="module-path"),   # the function is looked up: imports Bridge
    ("vanilla_gpt_pretrain_1gpu_h100_bf16_config", "h100", 9, "the recipe's name"),
    ("deepseek_v3_pretrain_256gpu_vr200_bf16_config", "vr200", None, "the recipe's name"),
])
def test_the_platform_a_recipe_is_named_for(name, platform, arch, where):
    from mbmem_overlays.bridge.recipes import recipe_platform
    assert recipe_platform(name) == (platform, arch, where)


def test_gpu_arch_given_wins_and_the_default_is_said():
    from mbmem_overlays.bridge.recipes import gpu_arch_for, recipe_platform
    assert recipe_platform("my_recipes.llama.my_llama_config") is None and recipe_platform("") is None
    gb200 = gpu_arch_for("llama3_8b_pretrain_8gpu_gb200_bf16_config", None)
    assert gb200["compute_capability"] == 10 and gb200["assumption"] == (
        "GPUs of compute capability 10 (GB200) assumed from the recipe's name; --gpu-arch to change")
    assert gpu_arch_for("llama3_8b_pretrain_8gpu_gb200_bf16_config", 9) == {
        "compute_capability": 9, "from": "--gpu-arch", "platform": None, "assumption": None}
    plain = gpu_arch_for("my_recipes.llama.my_llama_config", None)
    assert plain["compute_capability"] == 9 and plain["from"] == "default"
    assert plain["assumption"] == "--gpu-arch not given: GPUs of compute capability 9 (H100/H200) assumed"
    rubin = gpu_arch_for("x_pretrain_8gpu_vr200_bf16_config", None)
    assert rubin["compute_capability"] == 9 and "named for VR200, whose compute capability" in rubin["assumption"]


# ----------------------------------------------------------------------------- as_run on real recipes
@pytest.mark.bridge
def test_a_bare_recipe_name_is_read_from_the_module_bridge_exports_it_from(bridge):
    """Bridge keeps its general recipes under <model>/h100/: llama3_8b_pretrain_config (and train.py's llama3_8b_pretrain)
    is an H100 recipe, said so in the assumption."""
    from mbmem_overlays.bridge.recipes import gpu_arch_for, recipe_platform
    assert recipe_platform("llama3_8b_pretrain_config") == ("h100", 9, "the recipe's module path")
    assert recipe_platform("llama3_8b_pretrain") == ("h100", 9, "the recipe's module path")
    assert recipe_platform("tiny_llama") == ("h100", 9, "the recipe's module path")   # a dotted function
    assert gpu_arch_for("llama3_8b_pretrain", None)["assumption"] == (
        "GPUs of compute capability 9 (H100) assumed from the recipe's module path; --gpu-arch to change")


@pytest.fixture(scope="module")
def vanilla(bridge):
    """(the issue's job as the recipe leaves it, the same job with bf16 set by hand)."""
    cfg = bridge.build_recipe(VANILLA)
    bridge.apply_overrides(cfg, list(VANILLA_SETS))
    hand = copy.deepcopy(cfg)
    bridge.apply_overrides(hand, list(BY_HAND))
    return cfg, hand


@pytest.mark.bridge
def test_as_run_applies_the_preset_on_a_copy_and_touches_nothing_else(vanilla):
    from mbmem_overlays.bridge.as_run import as_run, is_as_run
    cfg, _ = vanilla
    environ = dict(os.environ)
    run = as_run(cfg, 1)
    m = run.config.model
    assert (m.bf16, str(m.params_dtype), str(run.config.optimizer.params_dtype)) == (True, "torch.bfloat16",
                                                                                     "torch.bfloat16")
    assert m.ffn_hidden_size == 4 * 2048 and m.kv_channels == 128   # the model's finalize() ran on the copy
    # the caller's config and this process's environment are as they were
    assert (cfg.model.bf16, str(cfg.model.params_dtype), cfg.mixed_precision, cfg.model.ffn_hidden_size) == (
        False, "torch.float32", "bf16_mixed", None)
    assert dict(os.environ) == environ and "NCCL_NVLS_ENABLE" not in os.environ
    # the recipe's env_vars are the job's environment the plan reads instead
    assert run.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert is_as_run(run.config) and as_run(run.config, 1).config is run.config
    assert as_run(run.config, 2).config is not run.config    # set up for one GPU: for two it is set up again
    assert not is_as_run(copy.deepcopy(run.config)) and not is_as_run(cfg)
    assert run.refused == () and run.host == ()


@pytest.mark.bridge
def test_the_issues_example_is_planned_in_bf16(vanilla):
    """24 layers, h2048, seq 4096, MBS 4 on the vanilla GPT recipe: before, 79.3 GB (fp32 parameters and activations);
    now the plan of the bf16 job, the same as with bf16 set by hand (55.9 GB)."""
    from mbmem_overlays.memory import model as P
    cfg, hand = vanilla
    shape, lay, st = P.from_config(cfg, 1)
    assert st.dtype_bytes == P.BF16 and st.param_bytes == P.BF16 and st.master_bytes == P.FP32
    assert P.from_config(cfg, 1) == P.from_config(hand, 1)
    assert P.estimate(shape, lay, st).total == pytest.approx(55.875e9, rel=1e-3)


@pytest.mark.bridge
def test_every_path_plans_the_issues_example_in_bf16(vanilla):
    """plan, recommend, plan --search and doctor --plan with the recipe: the same bf16 figure."""
    from mbmem_overlays.memory import model as P
    _, hand = vanilla
    bf16 = P.estimate(*P.from_config(hand, 1))
    args = ["--recipe", VANILLA, *_sets(*VANILLA_SETS), "--world-size", "1", "--json"]
    plan = json.loads(mbmem("plan", *args).stdout)
    assert plan["steps"][0]["total_bytes"] == int(bf16.total)
    assert plan["gpu_arch"] == {"compute_capability": 9, "from": "the recipe's name", "platform": "h100"}
    rec = json.loads(mbmem("recommend", *args, "--gpu-memory", "200GiB").stdout)
    assert rec["steps"][0]["step"] == "baseline" and rec["steps"][0]["total_bytes"] == int(bf16.footprint)
    found = json.loads(mbmem("plan", *args, "--gpu-memory", "200GiB", "--search", "--top", "1").stdout)
    assert found["results"][0]["saving_bytes"] + found["results"][0]["total_bytes"] == int(bf16.footprint)


@pytest.mark.bridge
def test_doctor_plan_with_the_recipe_plans_the_issues_example_in_bf16(vanilla, tmp_path):
    from mbmem_overlays.memory import model as M
    _, hand = vanilla
    shape, lay, st = M.from_config(hand, 1)
    log = tmp_path / "job.log"
    log.write_text("[Rank 0] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 40.0 | "
                   "mem-max-allocated-gigabytes: 56.0 | mem-max-reserved-gigabytes: 60.0\n")
    out = mbmem("doctor", str(log), "--plan", "--json", "--recipe", VANILLA, *_sets(*VANILLA_SETS),
                "--world-size", "1", timeout=600)
    run = json.loads(out.stdout)["run"]
    assert run["planned"][0]["planned_peak_bytes"] == int(M.reported_breakdowns(shape, lay, st, 2)[0].total)
    assert run["plan"]["gpu_arch"]["compute_capability"] == 9


@pytest.mark.bridge
def test_a_check_this_host_cannot_run_is_set_aside_and_the_setting_kept(bridge):
    """llama3_8b asks for fused RoPE, which needs Transformer Engine: finalize() runs with it off on the scratch
    copy, and the copy keeps the recipe's True (the GPU nodes run it)."""
    from mbmem_overlays.bridge.as_run import as_run
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    run = as_run(cfg, 8)
    assert run.config.model.apply_rope_fusion is True and run.config.model.recompute_modules == ["core_attn"]
    assert any("model.apply_rope_fusion=False" in n for n in run.host) and run.refused == ()


@pytest.mark.bridge
def test_gpu_only_checks_of_finalize_and_the_comm_overlap_setup_are_passed_as_on_the_gpu_nodes(bridge):
    """GLM-5.2's fused DSA kernel backend asks for a CUDA device in finalize() (megatron-core utils.py:529-533), and
    Qwen3.5-VL 35B's delayed wgrad inside CUDA graphs asserts gradient-accumulation fusion, off by this host's default
    (comm_overlap.py:545-553): neither is a refusal of the job's; each setup runs with the one setting aside, the
    recipe's setting is kept, and what the setup writes (the EP overlap, the delayed wgrad) is planned."""
    from mbmem_overlays.bridge.as_run import as_run
    glm = as_run(bridge.build_recipe("glm52_sft_192gpu_gb200_bf16_config"), 192)
    assert glm.refused == () and glm.config.model.dsa_kernel_backend == "cudnn"
    assert any("model.dsa_kernel_backend='none'" in n for n in glm.host)
    vl = as_run(bridge.build_recipe(
        "megatron.bridge.perf_recipes.qwen_vl.h100.qwen35_vl.qwen35_vl_35b_a3b_pretrain_16gpu_h100_bf16_config"), 16)
    assert vl.refused == () and any("communication-overlap setup ran with model.gradient_accumulation_fusion=True"
                                    in n for n in vl.host)
    assert vl.config.model.delay_wgrad_compute and vl.config.model.overlap_moe_expert_parallel_comm


@pytest.mark.bridge
def test_a_setup_bridge_refuses_is_left_out_and_the_plan_says_so(bridge):
    """comm_overlap with expert-parallel overlap on a dense model at EP 1: comm_overlap.py asserts before it writes,
    so the copy is planned without it; a preset name Bridge does not know: the plan's assumptions name it."""
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    from mbmem_overlays.bridge.as_run import as_run
    from mbmem_overlays.memory.steps import build_plan
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True,
                                         defer_embedding_wgrad_compute=True)
    run = as_run(cfg, 8)
    assert any("overlap_moe_expert_parallel_comm is only supported when expert_model_parallel_size > 1" in n
               for n in run.refused)
    assert not run.config.model.defer_embedding_wgrad_compute
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    cfg.mixed_precision = "bf16_mixd"
    plan = build_plan(cfg, [], world=8, recipe="llama3_8b_pretrain_config")
    assert any(a.startswith("Bridge's setup of this config: mixed_precision 'bf16_mixd' is not one of Bridge's")
               for a in plan.assumptions)


@pytest.mark.bridge
def test_what_finalize_writes_for_unset_still_follows_the_layout(bridge):
    """finalize() writes microbatch_group_size_per_vp_stage = PP where the recipe leaves it unset; the plan reads
    that as Layout's 0 ("the pipeline size"), so plan --search, which varies PP on the dataclasses, varies it too."""
    from mbmem_overlays.bridge.as_run import as_run
    from mbmem_overlays.memory import model as P
    cfg = bridge.build_recipe("megatron.bridge.perf_recipes.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config")
    assert cfg.model.microbatch_group_size_per_vp_stage is None and cfg.model.pipeline_model_parallel_size == 4
    assert as_run(cfg, 32).config.model.microbatch_group_size_per_vp_stage == 4
    assert P.from_config(cfg, 32)[1].vp_group == 0


@pytest.mark.bridge
def test_comm_overlap_writes_what_the_plan_reads(bridge):
    """CommOverlapConfig.setup writes defer_embedding_wgrad_compute into the model (False unless the overlap config
    asks: comm_overlap.py _get_model_comm_overlap_cfgs), which the plan reads there."""
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    from mbmem_overlays.memory import model as P
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    bridge.apply_overrides(cfg, ["model.pipeline_model_parallel_size=2", "model.gradient_accumulation_fusion=true"])
    cfg.model.defer_embedding_wgrad_compute = True   # the model asks; the overlap config, set below, decides
    cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
    assert P.from_config(cfg, 8)[2].deferred_wgrad_microbatches == 0
    cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, defer_embedding_wgrad_compute=True,
                                         wgrad_deferral_limit=2)
    assert P.from_config(cfg, 8)[2].deferred_wgrad_microbatches == 2


@pytest.mark.bridge
def test_gpu_arch_for_a_recipe(bridge):
    """A recipe named for GB200 is planned for compute capability 10 unless --gpu-arch says otherwise."""
    name = "megatron.bridge.perf_recipes.llama.gb200.llama3.llama3_8b_pretrain_8gpu_gb200_bf16_config"
    plan = json.loads(mbmem("plan", "--recipe", name, "--world-size", "8", "--json").stdout)
    assert plan["gpu_arch"] == {"compute_capability": 10, "from": "the recipe's name", "platform": "gb200"}
    assert "GPUs of compute capability 10 (GB200) assumed from the recipe's name; --gpu-arch to change" in \
        plan["assumptions"]
    given = json.loads(mbmem("plan", "--recipe", name, "--world-size", "8", "--json", "--gpu-arch", "H100").stdout)
    assert given["gpu_arch"]["compute_capability"] == 9 and given["gpu_arch"]["from"] == "--gpu-arch"
    assert not any("assumed from the recipe" in a for a in given["assumptions"])


# ----------------------------------------------------------------------------- the recipe-wide check, in the suite
# One recipe per property that Bridge's setup acts on (bench/plan_as_run.py runs every recipe Bridge ships): each
# mixed-precision preset the shipped recipes use, fp32 model fields under a bf16 preset, communication-overlap
# configs, LoRA. The plan of the recipe as shipped must be the plan of a copy Bridge's own runtime_config_update ran
# on (as_run.bridge_runtime_update: WORLD_SIZE set, os.environ restored; a check that needs what this host lacks is
# passed with its setting off on both sides, named in ``aside``).
PERF = "megatron.bridge.perf_recipes"
# Before the plan read through as_run, four of these planned other figures than Bridge's setup gives (bench
# bench/plan_as_run.py on the code before, most-loaded GPU): vanilla GPT (the issue's job) 79.3 GB as shipped vs
# 55.9 GB, OLMoE 7B 46.4 vs 31.3 GB (fp32 model fields under bf16_mixed), Qwen3-30B-A3B's partial-graph MXFP8 recipe
# 188.6 vs 56.1 GB (finalize() turns external_cuda_graph and cuda_graph_scope into TE graphs); the others agreed in
# bytes (their model fields already matched the preset) and differed only in what finalize() writes (the VPP group).
AS_SHIPPED = [
    pytest.param(VANILLA, VANILLA_SETS, 1, id="fp32-fields-bf16_mixed"),
    pytest.param("megatron.bridge.recipes.olmoe.h100.olmoe_7b.olmoe_7b_pretrain_8gpu_h100_bf16_config", (), 8,
                 id="fp32-fields-bf16_mixed-moe"),
    pytest.param(f"{PERF}.qwen.gb200.qwen3_moe.qwen3_30b_a3b_pretrain_16gpu_gb200_fp8mx_partial_cg_dev_config", (), 16,
                 id="mxfp8-external-cuda-graph-finalized"),
    pytest.param("llama3_8b_pretrain_config", (), 8, id="bf16_mixed"),
    pytest.param(f"{PERF}.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config", (), 32,
                 id="fp8-current-scaling-tp_overlap-deferred-wgrad"),
    pytest.param(f"{PERF}.llama.gb200.llama3.llama3_8b_pretrain_8gpu_gb200_fp8mx_config", (), 8, id="mxfp8"),
    pytest.param(f"{PERF}.qwen.h100.qwen3_moe.qwen3_30b_a3b_pretrain_32gpu_h100_fp8sc_dev_config", (), 32,
                 id="fp8-blockwise-moe"),
    pytest.param(f"{PERF}.llama.gb200.llama3.llama3_8b_pretrain_8gpu_gb200_nvfp4_config", (), 8, id="nvfp4"),
    pytest.param("megatron.bridge.recipes.nemotronh.h100.nemotronh.nemotronh_47b_pretrain_8gpu_h100_bf16_config", (),
                 8, id="nemotron_h-fp8-current-scaling-tp_overlap-hybrid"),
    pytest.param("qwen3_8b_peft_config", (), 8, id="lora"),
]


@pytest.mark.bridge
@pytest.mark.parametrize("name, sets, world", AS_SHIPPED)
def test_the_plan_of_a_recipe_as_shipped_is_the_plan_of_what_bridge_runs(bridge, name, sets, world):
    from mbmem_overlays.bridge.as_run import bridge_runtime_update
    from mbmem_overlays.core.paths import write
    from mbmem_overlays.memory import model as P
    cfg = bridge.build_recipe(name)
    if sets:
        bridge.apply_overrides(cfg, list(sets))
    oracle, aside, why = bridge_runtime_update(cfg, world)
    assert oracle is not None, why
    for path, value in aside.items():
        write(cfg, path, value)
    shipped, finalized = P.from_config(cfg, world), P.from_config(oracle, world)
    assert shipped == finalized


@pytest.mark.bridge
def test_gpu_arch_reaches_recommend_and_search(vanilla):
    """--gpu-arch A100 (compute capability 8: 4 MiB TE and 8 MiB torch cuBLAS workspaces instead of 32 MiB each,
    memory/buffers.py gemm_workspaces) moves the figures recommend and --search price, and their JSON says so."""
    from mbmem_overlays.memory import model as P
    _, hand = vanilla
    args = ["--recipe", VANILLA, *_sets(*VANILLA_SETS), "--world-size", "1", "--json", "--gpu-memory", "200GiB"]
    for arch in ("A100", "9"):
        want = int(P.estimate(*P.from_config(hand, 1, arch=8 if arch == "A100" else 9)).footprint)
        rec = json.loads(mbmem("recommend", *args, "--gpu-arch", arch).stdout)
        assert rec["steps"][0]["total_bytes"] == want and rec["gpu_arch"]["from"] == "--gpu-arch"
        found = json.loads(mbmem("plan", *args, "--search", "--top", "1", "--gpu-arch", arch).stdout)
        assert found["results"][0]["total_bytes"] + found["results"][0]["saving_bytes"] == want
        assert found["gpu_arch"]["compute_capability"] == (8 if arch == "A100" else 9)

"""The doctor over its fixture corpus (tests/fixtures/doctor/<family>/), table-driven: verdict, confidence,
remedy order, next command and exit code for every family of issue 16 (§1-4).

The fixtures are written from the public formats (ecosystem-notes.md for PyTorch's message; NCCL's
CUDACHECK / alloc.h warnings; the cuBLAS/cuDNN status enums; the CUDA driver error names; the kernel's
OOM-killer lines; Slurm's oom_kill event; torchrun's failure summary), not copied from anyone's log.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import mbmem

from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"
NOT_FIRST_FRAG = "+mem=expandable_segments"

# fixture, kind, verdict, confidence, first remedies in order, next command (exact), exit code
CASES = [
    # §1 NCCL: NCCL's own buffers, never expandable_segments first
    ("nccl/cuda_failure_2.log", "nccl", "diagnosed", "medium", ["nccl_buffsize", "nccl_nvls_off", "fewer_communicators"],
     ("NCCL_BUFFSIZE=2097152 torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=node-12 train.py "
     "recipe=llama3_8b_pretrain model.tensor_model_parallel_size=2"), 0),
    ("nccl/calloc_nvls.log", "nccl", "diagnosed", "medium", ["nccl_nvls_off", "nccl_buffsize", "fewer_communicators"],
     ("NCCL_NVLS_ENABLE=0 srun --ntasks-per-node=8 --nodes=2 python train.py recipe=llama3_70b_pretrain "
     "model.pipeline_model_parallel_size=4"), 0),
    # §1 cuBLAS / cuDNN workspace: the GPU was full -> capacity ladder
    ("workspace/cublas_create.log", "workspace", "diagnosed", "medium", ["selective_recompute", "micro_batch"],
     ("python -m torch.distributed.run --nproc_per_node=4 train.py recipe=qwen3_8b_sft train.micro_batch_size=4 "
     "+mem=selective_recompute"), 0),
    ("workspace/cudnn_alloc.log", "workspace", "diagnosed", "medium", ["selective_recompute", "dist_optimizer"],
     "python train.py 'recipe=<recipe>' +mem=selective_recompute", 0),
    # §1 CUDA driver level: expandable segment growth (cuMemCreate), memory saver / colocated engine
    ("driver/expandable_cumemcreate.log", "driver", "diagnosed", "medium", ["selective_recompute", "dist_optimizer"],
     ("torchrun --nproc_per_node=8 train.py recipe=llama3_70b_sft model.pipeline_model_parallel_size=4 "
     "+mem=selective_recompute"), 0),
    ("driver/memory_saver_vllm.log", "driver", "diagnosed", "medium", ["inference_engine_share", "other_processes"],
     "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", 0),
    # §1 ibv_reg_mr + NCCL user buffers + expandable segments: turn one off, say who set which
    ("registration/overlay_ib_bad_address.log", "registration", "diagnosed", "high", ["drop_expandable"],
     "torchrun --nproc_per_node=8 --nnodes=4 train.py recipe=llama3_70b_pretrain ddp.nccl_ub=true +mem=dist_optimizer", 0),
    ("registration/env_dmabuf.log", "registration", "diagnosed", "high", ["drop_expandable"],
     "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 srun python train.py recipe=qwen3_30b_a3b_pretrain", 0),
    # §1 host OOM versus device OOM
    ("host_oom/dmesg_oom_kill.log", "host_oom", "diagnosed", "high", ["optimizer_offload_fraction", "host_memory"],
     "srun python train.py recipe=llama3_8b_sft +mem=optimizer_offload mem.optimizer_offload.fraction=0.5", 0),
    ("host_oom/slurm_oom_kill_event.log", "host_oom", "diagnosed", "high", ["host_memory"],
     "sacct -j 991234 --format=JobID,State,ExitCode,MaxRSS,ReqMem", 0),
    ("host_oom/python_memoryerror.log", "host_oom", "diagnosed", "high", ["dataloader_workers", "host_memory"],
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_sft dataset.num_workers=8", 0),
    ("host_oom/bash_killed_137.log", "host_oom", "diagnosed", "medium", ["host_memory"],
     "dmesg -T | grep -iE 'out of memory|oom-kill|killed process'", 0),
    # §2 every historical PyTorch format
    ("allocator/current_fragmentation.log", "fragmentation", "diagnosed", "high", ["expandable_segments"],
     "python -m torch.distributed.run --nproc_per_node=8 --nnodes=4 train.py recipe=llama3_70b_sft +mem=expandable_segments", 0),
    ("allocator/current_capacity.log", "capacity", "diagnosed", "high", ["selective_recompute", "dist_optimizer"],
     ("torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain model.tensor_model_parallel_size=1 "
     "+mem=selective_recompute"), 0),
    ("allocator/expandable_already_capacity.log", "capacity", "diagnosed", "high",
     ["dist_optimizer", "precision_aware_optimizer", "megatron_fsdp"],   # issue 31: then FSDP
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain '+mem=[selective_recompute,dist_optimizer]'", 0),
    ("allocator/torch20_old_format.log", "fragmentation", "diagnosed", "high", ["max_split_size_mb"],
     ("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 python pretrain_gpt.py --tensor-model-parallel-size 2 "
     "--pipeline-model-parallel-size 1 --micro-batch-size 2 --global-batch-size 64"), 0),
    ("allocator/torch1_cached.log", "capacity", "diagnosed", "high", ["selective_recompute"],
     "python train_gpt.py --micro-batch-size 8 --recompute-activations", 0),
    # torch <= 1.3's "X cached" is already reserved minus allocated: 2.56 MiB free + 300 MiB covers 20 MiB
    ("allocator/torch1_cached_fragmentation.log", "fragmentation", "diagnosed", "high", ["upgrade_torch"],
     "pip install 'torch>=2.1'", 0),
    ("allocator/typo21_allowed.log", "fragmentation", "diagnosed", "high", ["expandable_segments"],
     "python train.py 'recipe=<recipe>' +mem=expandable_segments", 0),
    ("allocator/hip_fragmentation.log", "fragmentation", "diagnosed", "high", ["expandable_segments"],
     "python train.py 'recipe=<recipe>' +mem=expandable_segments", 0),
    ("allocator/truncated.log", "allocator_unknown", "unsure", "low", ["expandable_segments", "selective_recompute"],
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain +mem=expandable_segments", 4),
    ("allocator/no_unallocated_clause.log", "allocator_unknown", "unsure", "low", ["expandable_segments"],
     "torchrun --nproc_per_node=2 train.py recipe=qwen3_8b_sft +mem=expandable_segments", 4),
    ("allocator/wrapped.log", "fragmentation", "diagnosed", "high", ["expandable_segments"],
     "torchrun --nproc_per_node=8 --nnodes=2 train.py recipe=llama3_70b_sft +mem=expandable_segments", 0),
    ("allocator/interleaved_ranks.log", "capacity", "diagnosed", "high", ["selective_recompute"],
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain +mem=selective_recompute", 0),
    # issue 23 §3: the request is covered only barely while allocated is near capacity: both, medium, and a
    # capacity remedy right after expandable_segments
    ("allocator/fragmentation_barely_near_capacity.log", "fragmentation", "diagnosed", "medium",
     ["expandable_segments", "selective_recompute"],
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain +mem=expandable_segments", 0),
    # issue 23 §3: every spelling of out-of-memory is an OOM, "unsure" at least, with the numbers it shows
    ("oom_like/abbreviated_torch_message.log", "allocator_unknown", "unsure", "low",
     ["expandable_segments", "selective_recompute"],
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_sft +mem=expandable_segments", 4),
    ("oom_like/memory_saver_curesult_2.log", "driver", "diagnosed", "medium", ["inference_engine_share", "other_processes"],
     "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv", 0),
    ("oom_like/generic_oom_word.log", "oom_unclassified", "unsure", "low", ["expandable_segments", "selective_recompute"],
     "srun python train.py recipe=qwen3_8b_pretrain +mem=expandable_segments", 4),
    ("oom_like/te_cuda_error.log", "driver", "diagnosed", "low", ["selective_recompute", "dist_optimizer"],
     ("torchrun --nproc_per_node=4 train.py recipe=llama3_8b_pretrain model.tensor_model_parallel_size=4 "
      "+mem=selective_recompute"), 0),
    ("oom_like/triton_out_of_resources.log", "oom_unclassified", "unsure", "low", [], None, 4),
    ("oom_like/host_cpu_allocator.log", "host_oom", "diagnosed", "high", ["host_memory"], None, 0),
    # §3 context: torch version, world size, victims, config values
    ("context/torch20_fragmentation_torchrun.log", "fragmentation", "diagnosed", "high", ["max_split_size_mb"],
     ("PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,max_split_size_mb:512 torchrun --nproc_per_node=4 "
     "train.py recipe=llama3_8b_sft"), 0),
    ("context/victims_world_from_torchrun.log", "capacity", "diagnosed", "high", ["selective_recompute"],
     ("torchrun --nnodes=2 --nproc_per_node=8 train.py recipe=llama3_8b_pretrain model.tensor_model_parallel_size=2 "
     "+mem=selective_recompute"), 0),
    ("context/slurm_sbatch_victims.log", "capacity", "diagnosed", "high", ["selective_recompute"],
     "srun python train.py recipe=llama3_8b_pretrain +mem=selective_recompute", 0),
    ("context/cpu_offload_zero_layers.log", "capacity", "diagnosed", "high",
     ["cpu_offload", "precision_aware_optimizer"],
     "python train.py recipe=qwen3_8b_sft +mem=cpu_offload mem.cpu_offload.num_layers=1", 0),
    ("context/megatron_lm_args_table.log", "capacity", "diagnosed", "high", ["sequence_parallel", "selective_recompute"],
     ("torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py --tensor-model-parallel-size 4 "
     "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 512 --bf16 --sequence-parallel"), 0),
    # §4 other processes on the GPU
    ("other_processes/other_pids.log", "other_processes", "diagnosed", "high", ["other_processes"],
     "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv", 0),
    ("other_processes/colocated_sglang.log", "other_processes", "diagnosed", "high",
     ["inference_engine_share", "other_processes"], "actor_rollout_ref.rollout.gpu_memory_utilization=0.75", 0),
    # §4 colocated inference engines that could not reserve their share
    ("inference_engine/vllm_free_memory.log", "inference_engine", "diagnosed", "high",
     ["inference_engine_share", "other_processes"], "actor_rollout_ref.rollout.gpu_memory_utilization=0.35", 0),
    ("inference_engine/sglang_not_enough.log", "inference_engine", "diagnosed", "medium",
     ["inference_engine_share", "engine_smaller_kv"],
     "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --mem-fraction-static 0.6 --tp 1", 0),
    # configuration errors at start-up, and logs with nothing to diagnose
    ("configuration/pp_cpu_offload.log", "configuration", "diagnosed", "high", ["optimizer_offload"],
     ("torchrun --nproc_per_node=8 train.py recipe=llama3_70b_sft model.pipeline_model_parallel_size=4 "
     "+mem=optimizer_offload"), 0),
    ("configuration/nccl_ub_expandable_init.log", "configuration", "diagnosed", "high", ["drop_expandable"],
     "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain ddp.nccl_ub=true", 0),
    ("no_oom/clean_run.log", "none", "no_oom", "high", [], None, 3),
    # "no OOM" is high only for a log that reached the end of training (issue 23 §3): these stopped on errors
    ("no_oom/error_lines.log", "none", "no_oom", "medium", [], None, 3),
    # SIGKILLed by torchrun after another rank's non-memory error: victims, not a host OOM
    ("no_oom/sigkill_victims_of_other_error.log", "none", "no_oom", "medium", [], None, 3),
    # advice that mentions OOM is not an OOM, but "no OOM" is then not said with high confidence
    ("no_oom/oom_hint_mention.log", "none", "no_oom", "medium", [], None, 3),
]


def test_every_family_has_two_fixtures():
    families = {}
    for case in CASES:
        families.setdefault(case[0].split("/")[0], []).append(case[0])
    for family in ("nccl", "workspace", "driver", "registration", "host_oom", "allocator", "context",
                   "other_processes", "inference_engine", "configuration", "no_oom", "oom_like"):
        assert len(families.get(family, [])) >= 2, family
    on_disk = {str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*.log")}
    assert on_disk == {c[0] for c in CASES}, "every fixture is in the table"


@pytest.mark.parametrize("name, kind, verdict, confidence, first, command, code", CASES, ids=[c[0] for c in CASES])
def test_corpus(name, kind, verdict, confidence, first, command, code):
    d = diagnose(scan([str(FIXTURES / name)]))
    assert (d.kind, d.verdict, d.confidence) == (kind, verdict, confidence), d.reasons
    assert [r["name"] for r in d.remedies][:len(first)] == first
    assert d.next_command == command
    assert d.exit_code == code
    if kind in ("capacity", "nccl", "workspace", "other_processes", "registration") and d.next_command:
        assert NOT_FIRST_FRAG not in d.next_command, "expandable_segments only when free + unallocated covers the request"
    if kind == "capacity":
        assert "expandable_segments" not in [r["name"] for r in d.remedies]
    for reason in d.reasons:  # every claim about a number cites its line
        if "GiB" in reason and "savings" not in reason:
            assert "[" in reason and "]" in reason, reason


def reasons(name: str) -> str:
    d = diagnose(scan([str(FIXTURES / name)]))
    return "\n".join(d.reasons + d.notes + d.unknown)


def test_victims_and_world_size_from_the_launcher():
    text = reasons("context/victims_world_from_torchrun.log")
    assert "world size 16" in text          # --nnodes=2 x --nproc_per_node=8, not "highest rank seen" (11)
    assert "rank(s) 8, 9 were stopped by SIGTERM/SIGKILL" in text and "victims" in text


def test_world_size_from_sbatch_lines_and_srun_victims():
    text = reasons("context/slurm_sbatch_victims.log")
    assert "world size 32" in text and "OOM reported by rank(s) 5" in text
    assert "rank(s) 0, 1, 2, 3, 4, 6, 7 were stopped by SIGTERM/SIGKILL" in text


def test_registration_names_who_set_what():
    text = reasons("registration/overlay_ib_bad_address.log")
    assert "expandable_segments was set by: overlay +mem=expandable_segments on the launch command" in text
    assert "`ddp.nccl_ub=true` on the launch command" in text
    text = reasons("registration/env_dmabuf.log")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:512 set in the job's environment" in text
    assert "nccl_ub=true in the printed config" in text


def test_config_values_are_evidence():
    text = reasons("context/cpu_offload_zero_layers.log")
    assert "CPU offloading is enabled but cpu_offloading_num_layers is 0: it offloads nothing" in text


def test_unknown_numbers_are_said_unknown():
    d = diagnose(scan([str(FIXTURES / "allocator/truncated.log")]))
    assert "reserved-but-unallocated" in d.unknown and "the free memory" in d.unknown
    assert "little" not in d.summary and "capacity limit (" in d.summary
    o = scan([str(FIXTURES / "allocator/truncated.log")]).ooms[0]
    assert o.requested == 2 << 30 and o.free is None and o.reserved_unallocated is None and o.partial


def test_torch_before_2_1_gets_no_expandable_segments():
    for name in ("allocator/torch20_old_format.log", "context/torch20_fragmentation_torchrun.log"):
        d = diagnose(scan([str(FIXTURES / name)]))
        assert "expandable_segments" not in d.next_command
        assert any("torch >= 2.1" in r for r in d.reasons)


def test_other_process_memory():
    f = scan([str(FIXTURES / "other_processes/other_pids.log")])
    assert f.ooms[0].processes == [(88121, 30 << 30)] and f.ooms[0].self_in_use == int(47.1 * 2**30)
    assert "other processes hold 30.00 GiB" in reasons("other_processes/other_pids.log")


def test_wrapped_message_is_rejoined_and_cited_over_its_lines():
    f = scan([str(FIXTURES / "allocator/wrapped.log")])
    o = f.ooms[0]
    assert o.wrapped and o.rank == 7 and o.reserved_unallocated == int(7.8 * 2**30) and o.where.endswith(":2-6")


def test_text_names_rank_only_when_known():
    out = mbmem("doctor", str(FIXTURES / "host_oom/bash_killed_137.log"))
    assert "rank None" not in out.stdout and "\nrank:" not in out.stdout
    out = mbmem("doctor", str(FIXTURES / "allocator/current_fragmentation.log"))
    assert "\nrank: 3\n" in out.stdout


def test_json_has_schema_version_and_exit_code():
    out = mbmem("doctor", str(FIXTURES / "allocator/truncated.log"), "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 4 == data["exit_code"] and data["schema_version"] == 3 and data["verdict"] == "unsure"


def test_default_doctor_says_savings_were_not_computed():
    d = diagnose(scan([str(FIXTURES / "allocator/current_capacity.log")]))
    assert d.savings.startswith("savings not computed") and all(r["saves_bytes"] is None for r in d.remedies)
    assert "not validated on the recipe's config" in d.command_check


def test_plan_ranking_puts_covering_remedies_first():
    from mbmem_overlays.doctor.command import Remedy
    from mbmem_overlays.doctor.plan import _rank
    ladder = [Remedy("selective_recompute", "", saves=0.5e9), Remedy("dist_optimizer", "", saves=3e9),
              Remedy("full_recompute", "", saves=9e9), Remedy("optimizer_offload", "", saves=2e9)]
    assert [r.name for r in _rank(ladder, 2.5e9)] == ["dist_optimizer", "full_recompute", "optimizer_offload",
                                                      "selective_recompute"]
    env = Remedy("nccl_buffsize", "")  # not priced by the model: keeps its place in front
    assert _rank([env, *ladder], None)[0] is env


@pytest.mark.bridge
def test_plan_computes_savings_and_validates_with_the_engine():
    out = mbmem("doctor", str(FIXTURES / "allocator/current_capacity.log"), "--plan", "--json", timeout=600)
    data = json.loads(out.stdout)
    assert out.returncode == 0, out.stderr
    assert data["command_check"].startswith("validated by the engine on recipe llama3_8b_pretrain at world size 8")
    saves = [r["saves_bytes"] for r in data["remedies"]]
    assert all(s is not None for s in saves)
    shortfall = (3.91 - 1.05 - 1.12) * 2**30
    covering = [s >= shortfall for s in saves]
    assert covering == sorted(covering, reverse=True)   # every covering remedy ranks above every other
    assert data["next_command"].endswith("+mem=" + data["remedies"][0]["name"])
    # each sized remedy is priced for the job by the cost model, and the covering ones rank cheapest first by it
    priced = [r for r in data["remedies"] if r["saves_bytes"] and r["name"] != "expandable_segments"]
    assert priced and all({"text", "rank_key", "flops", "bytes_per_link", "bubble"} <= set(r["step_cost"])
                          for r in priced)
    keys = [tuple(r["step_cost"]["rank_key"]) for r in data["remedies"] if r["saves_bytes"] is not None
            and r["saves_bytes"] >= shortfall and "step_cost" in r]
    assert keys == sorted(keys)


@pytest.mark.parametrize("line", ["+ export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512,expandable_segments:True",
                                  "[rank0]: env_vars: {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True', 'X': '1'}",
                                  "PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:[256:1,512:2],expandable_segments:True"])
def test_allocator_setting_in_any_printed_form_means_capacity(tmp_path, line):
    oom = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity "
           "of 79.11 GiB of which 100.00 MiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and "
           "8.00 GiB is reserved by PyTorch but unallocated.")
    p = tmp_path / "a.log"
    p.write_text(line + "\n" + oom + "\n")
    assert diagnose(scan([str(p)])).kind == "capacity"   # expandable already on: not fragmentation advice again


def test_continuation_without_a_rank_prefix(tmp_path):
    p = tmp_path / "w.log"
    p.write_text("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total "
                 "capacity of 79.11 GiB of which 100.00 MiB is free.\nIncluding non-PyTorch memory, this process has 78.9 "
                 "GiB memory in use. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 8.00 GiB is reserved "
                 "by PyTorch but unallocated.\n")
    o = scan([str(p)]).ooms[0]
    assert o.wrapped and o.reserved_unallocated == 8 << 30 and o.rank == 0

"""Megatron-LM logs as jobs leave them when they run more than once: a Slurm requeue with --open-mode=append, a
retry appended with `tee -a`, every start printing its own arguments dump into the same file. The latest start is
the job (doctor/parse.py _latest_start): its arguments, config lines, launch command, allocator setting and memory
lines are read, and --plan plans its dump; the failures of every start stay listed. Also the precision-aware
optimizer's Transformer Engine check on a host without TE (bridge/megatron_args.py _fused_adam_as_on_gpu_nodes) and
what the distributed optimizer brings with it (MEGATRON_LM_REQUIRES).

Every log here is written by the test in the format Megatron-LM prints (arguments.py _print_args: two spaces, the
name, 48 - len(name) dots, the value), with our own figures.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import mbmem
from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan

HEADER = "-" * 24 + " arguments " + "-" * 24
FOOTER = "-" * 20 + " end of arguments " + "-" * 21


def dump(prefix: str = "", **values) -> str:
    base = {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024,
            "max_position_embeddings": 1024, "micro_batch_size": 8, "global_batch_size": 64, "world_size": 8,
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 4,
            "fp16": True, "tokenizer_type": "NullTokenizer", "vocab_size": 32000, "use_distributed_optimizer": False,
            "recompute_granularity": None, "lr": 0.0001}
    base.update(values)
    lines = [prefix + HEADER]
    lines += [f"{prefix}  {k} {'.' * (48 - len(k))} {v}" for k, v in sorted(base.items(), key=lambda kv: kv[0].lower())]
    return "\n".join(lines + [prefix + FOOTER]) + "\n"


def memory(rank: int, it: int, peak: float) -> str:
    return (f"[Rank {rank}] (after {it} iterations) memory (MB) | allocated: {peak / 2:.1f} | max allocated: {peak:.1f}"
            f" | reserved: {peak + 900:.1f} | max reserved: {peak + 900:.1f}\n")


OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 39.38 "
       "GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 38.35 GiB memory in use. Of the "
       "allocated memory 36.10 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated. If "
       "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
       "avoid fragmentation.\n")


def two_starts() -> str:
    """Start 1: MBS 8, a memory report after iteration 100, an OOM; start 2 (requeued into the same file): the
    allocator setting exported, its torchrun line, MBS 4, a report after iteration 20 that is lower than start 1's."""
    first = ("+ torchrun --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 8\n"
             "using world size: 8, data-parallel size: 4, tensor-model-parallel size: 2, pipeline-model-parallel size: 1\n"
             + dump(micro_batch_size=8) + memory(0, 100, 30111.5) + "Traceback (most recent call last):\n" + OOM)
    second = ("+ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n"
              "+ torchrun --nproc-per-node 8 pretrain_gpt.py --micro-batch-size 4\n"
              "using world size: 8, data-parallel size: 4, tensor-model-parallel size: 2, pipeline-model-parallel size: 1\n"
              + dump(micro_batch_size=4) + memory(0, 20, 20222.5) + memory(1, 20, 20333.5))
    return first + "slurmstepd: error: *** JOB 4242 ON node7 CANCELLED DUE TO PREEMPTION ***\n" + second


# ----------------------------------------------------------------------------- pure reading (no Bridge)
def test_the_latest_start_of_a_requeued_log_is_the_job(tmp_path):
    log = tmp_path / "slurm-4242.out"
    log.write_text(two_starts())
    f = scan([str(log)])
    assert [w.rpartition(":")[2] for w in f.runs] == ["3", str(two_starts().splitlines().index(HEADER, 3) + 1)]
    assert f.megatron_args.where == f.runs[-1]
    assert f.config["micro_batch_size"].value == "4"                        # start 2's dump, not start 1's
    assert f.alloc_conf["PYTORCH_CUDA_ALLOC_CONF"].value == "expandable_segments:True"
    assert "--micro-batch-size 4" in f.command.value
    assert {k: s.latest.iteration for k, s in f.memory.items()} == {0: 20, 1: 20}   # not start 1's iteration 100
    # start 2 ran without failing: start 1's OOM is named, not diagnosed with start 2's settings
    assert f.ooms == [] and f.earlier_memory == 1 and f.earlier_failures and f.run_read == f.runs[-1]
    assert f.capacity.value == int(39.38 * 2**30) and "an earlier start's OOM message" in f.capacity.line
    d = diagnose(f)
    why = " ".join(d.reasons)
    assert d.verdict == "reported" and "the log holds 2 starts of the job" in why
    assert f"failure(s) [{f.earlier_failures[0]}] and 1 memory report(s) are not this diagnosis's" in why


def test_a_start_that_failed_is_diagnosed_with_its_own_settings(tmp_path):
    """Start 2 fails too: its OOM with its micro-batch and its allocator setting; start 1's OOM is only named."""
    log = tmp_path / "retry.log"
    log.write_text(two_starts() + "Traceback (most recent call last):\n" + OOM.replace("1.50 GiB", "0.75 GiB"))
    f = scan([str(log)])
    assert [o.requested for o in f.ooms] == [int(0.75 * 2**30)] and len(f.earlier_failures) == 1
    d = diagnose(f)
    assert d.kind != "fragmentation" and not any(r["name"] == "expandable_segments" for r in d.remedies)
    micro = next(r for r in d.remedies if r["name"] == "micro_batch")
    assert "4 -> 2" in micro["action"]                                   # start 2's micro-batch, not start 1's 8


def test_a_later_start_that_shows_nothing_yet_is_not_the_job(tmp_path):
    """A requeued start cut right after its dump: the start that ran (and failed) is the one read."""
    first = dump(micro_batch_size=8) + memory(0, 10, 30111.5) + OOM
    log = tmp_path / "cut.log"
    log.write_text(first + "+ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n" + dump(micro_batch_size=4))
    f = scan([str(log)])
    assert len(f.runs) == 2 and f.run_read == f.runs[0] and f.megatron_args.where == f.runs[0]
    assert f.config["micro_batch_size"].value == "8" and "PYTORCH_CUDA_ALLOC_CONF" not in f.alloc_conf
    assert len(f.ooms) == 1 and f.earlier_failures == [] and 0 in f.memory


@pytest.mark.parametrize("text", [
    # every rank prints its dump at start-up, before anything ran: one start
    dump("[default0]:") + dump("[default1]:", micro_batch_size=4) + memory(0, 10, 1000.0),
    # one start whose dump is followed by its reports; no second dump
    dump() + memory(0, 10, 1000.0) + memory(0, 20, 1100.0),
])
def test_dumps_without_a_failure_or_report_between_them_are_one_start(tmp_path, text):
    log = tmp_path / "run.log"
    log.write_text(text)
    f = scan([str(log)])
    assert f.runs == [] and f.config["micro_batch_size"].value == "8" and f.megatron_args.where.endswith(":1")
    assert not any("starts of the job" in r for r in diagnose(f).reasons)


def test_two_logs_each_with_a_dump_are_not_restarts_and_stdin_says_it_cannot_be_read_again(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(dump() + memory(0, 10, 1000.0))
    b.write_text(dump(micro_batch_size=2) + memory(0, 10, 900.0))
    f = scan([str(a), str(b)])
    assert f.runs == [] and f.config["micro_batch_size"].value == "8"
    out = mbmem("doctor", "-", input=two_starts(), timeout=60)
    assert "standard input holds 2 starts of the job" in out.stdout + out.stderr


def _stamped(text: str, stamp) -> str:
    return "".join(stamp(i) + line + "\n" for i, line in enumerate(text.splitlines()))


@pytest.mark.parametrize("stamp", [
    # kubectl logs --timestamps (RFC 3339 with nanoseconds, a zero fraction dropped), per line
    lambda i: f"2025-03-01T08:{i // 60 % 60:02d}:{i % 60:02d}" + (f".{i * 7919 % 10**9}" if i % 3 else "") + "Z ",
    lambda i: f"[{10 + i // 3600}:{i // 60 % 60:02d}:{i % 60:02d}] ",                              # ts / a logger
    lambda i: f"[2025-03-01 08:00:{i % 60:02d},{i * 37 % 1000:03d}][INFO][arguments:{100 + i}] - ",  # logging
])
def test_a_dump_whose_lines_carry_their_own_timestamps_is_read_whole(tmp_path, stamp):
    """Each line's own time of day: the header's prefix is a shape, not a string (bridge/megatron_args.py
    _stamp_shape); before, only the lines stamped like the header were read and the rest fell to defaults."""
    from mbmem_overlays.bridge.megatron_args import dump_values
    plain, _ = dump_values(dump(micro_batch_size=3))
    values, _ = dump_values(_stamped(dump(micro_batch_size=3), stamp))
    assert values == plain and values["micro_batch_size"] == "3"
    log = tmp_path / "stamped.log"
    log.write_text(_stamped(dump(micro_batch_size=3) + OOM, stamp))
    assert scan([str(log)]).config["micro_batch_size"].value == "3"


def test_a_rank_tag_prefix_is_still_taken_as_printed():
    """A prefix without a time ([default0]:) is not a shape: another rank's line inside rank 0's dump is skipped."""
    from mbmem_overlays.bridge.megatron_args import dump_values
    text = dump("[default0]:", micro_batch_size=3).replace(
        "[default0]:  micro_batch_size", "[default5]:  micro_batch_size ..... 99\n[default0]:  micro_batch_size", 1)
    assert dump_values(text)[0]["micro_batch_size"] == "3"


# ----------------------------------------------------------------------------- megatron-core (Bridge)
def test_doctor_plan_plans_the_latest_starts_dump(bridge, tmp_path):
    log = tmp_path / "slurm-4242.out"
    log.write_text(two_starts() + OOM.replace("1.50 GiB", "0.75 GiB"))
    out = mbmem("doctor", str(log), "--plan", "--gpu-arch", "A100", "--json")
    d = json.loads(out.stdout)
    assert "(start 2 of the log's 2, line" in d["savings"], d["savings"]
    # a run report of the same log (start 2 without its failure) plans start 2's dump too
    log.write_text(two_starts())
    run = json.loads(mbmem("doctor", str(log), "--plan", "--gpu-arch", "A100", "--gpu-memory", "40GiB",
                           "--json").stdout)["run"]
    assert "(start 2 of the log's 2, line" in run["plan_status"] and run["plan"]["megatron_args"]["argv"]
    micro = next(r for r in d["remedies"] if r["name"] == "micro_batch")
    assert micro["megatron"]["change"] == [{"flag": "--micro-batch-size", "old": "4", "new": "2"}], micro["megatron"]
    assert "train.py" not in json.dumps(d)


@pytest.mark.skipif("transformer_engine" in sys.modules, reason="the host has Transformer Engine: its own check runs")
def test_a_precision_aware_job_is_planned_on_a_host_without_transformer_engine(bridge):
    import torch

    from mbmem_overlays.bridge.megatron_args import TE_FUSED_ADAM_NOTE, change_job, load_job, te_installed
    if te_installed():
        pytest.skip("Transformer Engine is installed here: its own FusedAdam is checked")
    words = ("torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 "
             "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 16 --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 1024 --use-distributed-optimizer "
             "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
    job = load_job(words)
    opt = job.config.optimizer
    assert opt.use_precision_aware_optimizer and opt.exp_avg_dtype == torch.bfloat16
    assert TE_FUSED_ADAM_NOTE in job.assumptions
    assert not any(name.startswith("transformer_engine") for name in sys.modules)     # nothing left bound
    from megatron.core.optimizer import optimizer_config
    from megatron.core.utils import is_te_min_version
    assert optimizer_config.is_te_min_version is is_te_min_version
    # a change on it is validated and rebuilt, the check saying what was left to the GPU nodes
    change = change_job(job, [("optimizer.exp_avg_sq_dtype", torch.float32)])
    assert change.ok and TE_FUSED_ADAM_NOTE in change.check
    # on GPUs older than TE's support matrix (compute capability < 8) nothing is assumed: the change is refused
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, changed_config
    with pytest.raises(MegatronArgsError, match="support matrix starts at compute capability 8.0: the job's GPUs are 7"):
        changed_config(job, change, arch=7)
    # without the precision-aware optimizer nothing is assumed
    plain = load_job(words.replace(" --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", ""))
    assert TE_FUSED_ADAM_NOTE not in plain.assumptions


@pytest.mark.parametrize("changes, wanted", [
    # optimizer offload needs the precision-aware optimizer (arguments.py validate_args), which needs the
    # distributed optimizer (optimizer_config.py __post_init__): both come with it
    ([("optimizer.optimizer_cpu_offload", True)],
     {"--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-distributed-optimizer"}),
    ([("optimizer.use_precision_aware_optimizer", True)],
     {"--use-precision-aware-optimizer", "--use-distributed-optimizer"}),
])
def test_what_the_optimizer_changes_need_comes_with_them(bridge, changes, wanted):
    from mbmem_overlays.bridge.megatron_args import change_job, load_job, overlay_flags
    job = load_job("torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 256 "
                   "--num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 "
                   "--global-batch-size 16 --bf16 --tokenizer-type NullTokenizer --vocab-size 1024")
    assert wanted <= set(overlay_flags(changes, job.args).words)
    change = change_job(job, changes)
    assert change.ok, change.reason
    # a job that already has the distributed optimizer is not given it again
    sharded = load_job(" ".join(job.argv) + " --use-distributed-optimizer", world_size=2)
    assert "--use-distributed-optimizer" not in overlay_flags(changes, sharded.args).words


def test_a_hf_tokenizer_jobs_remedies_are_priced_with_the_vocabulary_its_log_printed(bridge, tmp_path):
    """A HuggingFaceTokenizer cannot be counted without building it: the vocabulary the log printed (" > padded
    vocab (size: N) ...") loads the job, and every change to it is rebuilt with the same vocabulary (MegatronJob.vocab),
    never refused with "cannot be read without building the tokenizer"."""
    text = (dump(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/models/some-llama", vocab_size=None,
                 bf16=True, fp16=False, micro_batch_size=4, seq_length=4096, max_position_embeddings=4096)
            + " > padded vocab (size: 128000) with 0 dummy tokens (new size: 128000)\n" + OOM)
    log = tmp_path / "hf.log"
    log.write_text(text)
    d = json.loads(mbmem("doctor", str(log), "--plan", "--json").stdout)
    assert d["savings"].startswith("savings from the memory model on the job's own Megatron-LM arguments"), d["savings"]
    assert not any("without building the tokenizer" in json.dumps(r) for r in d["remedies"])
    priced = [r for r in d["remedies"] if r.get("megatron", {}).get("ok")]
    assert {"micro_batch", "full_recompute"} <= {r["name"] for r in priced}
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, change_job, load_job
    job = load_job(text, vocab=128000)
    assert job.vocab == 128000 and change_job(job, [("train.micro_batch_size", 2)]).ok
    with pytest.raises(MegatronArgsError, match="without building the tokenizer"):
        load_job(text)                                      # without the log's figure nothing says the size

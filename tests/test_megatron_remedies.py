"""A Megatron-LM job, from its log to the next command (issue 40): every doctor remedy, ladder step and search result
realized on the job's own configuration, priced by the memory model, written as the job's flags and environment,
and parsed and validated by megatron-core before it is printed (bridge/megatron_args.py change_job,
memory/megatron.py, doctor/megatron_plan.py).

Fixtures (tests/fixtures/megatron_args/):
- ``v100_gpt2_oom.log``: after the log of NVIDIA/Megatron-LM issue #525 (GPT-2 774M on one V100-32GB, torch 2.0.1,
  2023): its "using world size" line, the part of its arguments dump that decides memory (plus one argument
  megatron-core 0.19.2 no longer has), and its OOM message; paths shortened, most of the dump left out.
- ``v100_gpt2_cmdline_oom.log``: the same job launched by the issue's script, its torchrun line as ``bash -x`` prints
  it, and the same OOM message; no dump.
Every flag set printed is checked again here by megatron-core's own parser and validate_args (the oracle), and the
job rebuilt from the printed flags is planned again: the plan of the flags is the plan that priced them.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path

import pytest

from mbmem_overlays.cli import main

HERE = Path(__file__).parent / "fixtures" / "megatron_args"
DUMP_LOG = HERE / "v100_gpt2_oom.log"
COMMAND_LOG = HERE / "v100_gpt2_cmdline_oom.log"
GPT = HERE / "gpt_small.sh"
RUN_LOG = HERE / "gpt_small_job.log"


def run_json(argv: list[str]) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*argv, "--json"])
    return rc, json.loads(buf.getvalue())


def run_text(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def jobs(bridge):
    from mbmem_overlays.bridge.megatron_args import load_job, read_source
    return {"dump": load_job(read_source(str(DUMP_LOG)), arch=7),
            "gpt": load_job(read_source(str(GPT)))}


@pytest.fixture(scope="module")
def doctored(bridge):
    """doctor --plan on the two V100 logs (JSON and text), once per module."""
    out = {}
    for name, log in (("dump", DUMP_LOG), ("command", COMMAND_LOG)):
        rc, data = run_json(["doctor", str(log), "--plan", "--gpu-arch", "V100"])
        _, text = run_text(["doctor", str(log), "--plan", "--gpu-arch", "V100"])
        out[name] = (rc, data, text)
    return out


def validated(m: dict, world: int, env: dict | None = None, arch: int = 7):
    """megatron-core's own parse_args + validate_args on a printed flag set (raises when it refuses them)."""
    from mbmem_overlays.bridge.megatron_args import parse_and_validate
    args, unknown, _ = parse_and_validate(m["argv"], world, {**(env or {}), **m["env"]}, arch)
    return args, unknown


def replanned(job, m: dict, arch: int = 7) -> float:
    """The memory model on the job rebuilt from the printed flags alone (load_job on the changed argv)."""
    from mbmem_overlays.bridge.megatron_args import load_job
    from mbmem_overlays.memory import model as P
    again = load_job(list(m["argv"]), world_size=job.world_size, env={**job.env, **m["env"]}, arch=arch)
    return P.estimate(*P.from_config(again.config, again.world_size, arch=arch, env=dict(again.env))).footprint


# ----------------------------------------------------------------------------- the doctor on an OOM log
def test_an_oom_log_with_a_dump_gets_priced_remedies_and_the_jobs_own_next_command(doctored):
    rc, data, text = doctored["dump"]
    assert rc == 0 and data["kind"] == "fragmentation"
    assert "train.py" not in text and "<recipe>" not in text and "savings not computed" not in text
    # torch 2.0: the allocator setting first, as an export (the job's own environment), checked by megatron-core
    assert data["next_command"] == "export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512"
    assert data["command_check"].startswith("parsed and validated by megatron-core 0.19.2's parse_args + validate_args")
    assert "the arguments dump of" in data["savings"] and "compute capability 7" in data["savings"]
    by_name = {r["name"]: r for r in data["remedies"]}
    for name in ("selective_recompute", "full_recompute", "micro_batch"):
        r = by_name[name]
        assert r["megatron"]["ok"] and r["saves_bytes"] > 0, r
    assert by_name["micro_batch"]["megatron"]["change"] == [{"flag": "--micro-batch-size", "old": "4", "new": "2"}]
    assert by_name["selective_recompute"]["megatron"]["add"] == ["--recompute-granularity", "selective",
                                                                "--recompute-modules", "core_attn"]
    # ranked by the plan: priced ones by saving, the ones no flags can make last, each saying why
    priced = [r["saves_bytes"] for r in data["remedies"] if r["saves_bytes"] is not None]
    assert priced == sorted(priced, reverse=True)
    refused = [i for i, r in enumerate(data["remedies"]) if r.get("megatron", {}).get("ok") is False]
    assert refused and refused == list(range(len(data["remedies"]) - len(refused), len(data["remedies"])))
    assert all(data["remedies"][i]["megatron"]["reason"] for i in refused)
    assert "not possible for this job: " in text and "checked: parsed and validated by megatron-core" in text


def test_each_remedy_costs_what_the_ladder_says_it_costs(doctored):
    from mbmem_overlays.memory.costs import COSTS, full_recompute_cost
    _, data, _ = doctored["dump"]
    by_name = {r["name"]: r for r in data["remedies"]}
    assert by_name["selective_recompute"]["cost"] == COSTS["selective_recompute"][1]
    assert by_name["full_recompute"]["cost"] == full_recompute_cost("uniform", 1, 36)


def test_every_flag_set_the_doctor_prints_validates_and_plans_to_its_saving(doctored, jobs):
    _, data, _ = doctored["dump"]
    job = jobs["dump"]
    from mbmem_overlays.memory import model as P
    base = P.estimate(*P.from_config(job.config, 1, arch=7, env=dict(job.env))).footprint
    checked = 0
    for r in data["remedies"]:
        m = r.get("megatron")
        if not m or not m["ok"]:
            continue
        args, unknown = validated(m, 1)
        assert [w for w in unknown if w.startswith("--")] == [], (r["name"], unknown)
        if r["saves_bytes"] is not None:
            # the job rebuilt from the printed flags alone is planned to the saving the remedy was priced at
            assert replanned(job, m) == pytest.approx(base - r["saves_bytes"], abs=1 << 20), r["name"]
            checked += 1
    assert checked >= 3


def test_a_log_with_a_command_line_gets_its_own_command_back_changed(doctored, jobs):
    rc, data, text = doctored["command"]
    assert rc == 0 and "train.py" not in text and "<recipe>" not in text and "savings not computed" not in text
    words = shlex.split(data["next_command"])
    assert words[0] == "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512" and words[1] == "torchrun"
    script = words.index("../pretrain_gpt.py")
    assert words[2:script] == ["--nproc_per_node", "1", "--nnodes", "1", "--node_rank", "0", "--master_addr",
                               "localhost", "--master_port", "6000"]
    assert "the launch command [" in data["savings"]
    by_name = {r["name"]: r for r in data["remedies"]}
    # the job's arguments fill in what the log does not print: its micro-batch is halved, and the distributed
    # optimizer it already has is not proposed
    assert by_name["micro_batch"]["megatron"]["change"] == [{"flag": "--micro-batch-size", "old": "4", "new": "2"}]
    assert "dist_optimizer" not in by_name
    for r in data["remedies"]:
        m = r.get("megatron")
        if m and m["ok"]:
            validated(m, 1)
            rest = shlex.split(r["command"])
            assert rest[rest.index("../pretrain_gpt.py") + 1:] == m["argv"]


def test_no_megatron_lm_flag_for_a_field_is_said_and_a_derived_one_is_kept(jobs):
    from mbmem_overlays.bridge.megatron_args import change_job
    job = jobs["dump"]
    kept = change_job(job, [("model.cpu_offloading", True), ("model.cpu_offloading_num_layers", 2)], arch=7)
    assert kept.ok and kept.add == ("--cpu-offloading-num-layers", "2")
    assert "Megatron-LM derives model.cpu_offloading=True" in kept.check
    refused = change_job(job, [("model.cpu_offloading_double_buffering", True),
                               ("model.cpu_offloading_num_layers", 2)], arch=7)
    assert not refused.ok
    assert refused.reason == "no Megatron-LM flag for model.cpu_offloading_double_buffering=True"
    peft = change_job(job, [("peft.sequence_parallel_input_regather", True)], arch=7)
    assert not peft.ok and "no Megatron-LM flag for peft.sequence_parallel_input_regather" in peft.reason


def test_a_flag_validate_args_sets_back_is_refused_not_printed(jobs):
    from mbmem_overlays.bridge.megatron_args import change_job
    # validate_args turns sequence parallelism off at TP=1 (arguments.py): the flag would not make the change
    change = change_job(jobs["dump"], [("model.sequence_parallel", True)], arch=7)
    assert not change.ok and change.reason == "megatron-core's validate_args does not keep --sequence-parallel"
    wrong = change_job(jobs["dump"], [("train.micro_batch_size", 3)], arch=7)   # 16 is not a multiple of 3 x DP 1
    assert not wrong.ok and wrong.reason.startswith("megatron-core refuses the flags: ")


def test_argv_edits_change_in_place_append_remove_and_drop_what_a_flag_replaces(bridge):
    from mbmem_overlays.bridge.megatron_args import edit_argv
    argv = ["--num-layers", "8", "--recompute-activations", "--sequence-parallel", "--micro-batch-size=4",
            "--recompute-modules", "core_attn", "mlp", "--no-such-flag", "3"]
    new, added, changed, removed = edit_argv(
        argv, ["--micro-batch-size", "2", "--recompute-granularity", "full", "--recompute-modules", "core_attn",
               "--num-layers-per-virtual-pipeline-stage", "2"], ["--sequence-parallel"])
    assert new == ["--num-layers", "8", "--micro-batch-size", "2", "--recompute-modules", "core_attn",
                   "--no-such-flag", "3", "--recompute-granularity", "full", "--num-layers-per-virtual-pipeline-stage",
                   "2"]
    assert added == ["--recompute-granularity", "full", "--num-layers-per-virtual-pipeline-stage", "2"]
    assert changed == [("--micro-batch-size", "4", "2"), ("--recompute-modules", "core_attn mlp", "core_attn")]
    assert removed == ["--recompute-activations", "--sequence-parallel"]


def test_the_run_report_of_a_megatron_log_prices_its_changes_as_its_flags(bridge):
    rc, data = run_json(["doctor", str(RUN_LOG), "--plan", "--gpu-memory", "80GiB"])
    assert rc == 0 and data["verdict"] == "reported"
    assert "train.py" not in (data["next_command"] or "") and data["next_command"]
    assert "remedies are not priced" not in data["run"]["plan_status"]
    changes = [r for r in data["remedies"] if r.get("megatron")]
    assert changes and all(r["megatron"]["ok"] and r["predicted_peak_bytes"] for r in changes)
    assert data["next_command"] == changes[0]["command"]
    for r in changes:
        validated(r["megatron"], 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, arch=9)


# ----------------------------------------------------------------------------- recommend and --search
def test_recommend_answers_in_the_jobs_flags_each_step_validated(bridge, jobs):
    from mbmem_overlays.memory.costs import COSTS
    rc, data = run_json(["recommend", "--megatron-args", str(DUMP_LOG), "--gpu-memory", "24GiB", "--gpu-arch", "7"])
    assert rc == 0 and data["ok"] and data["megatron"]["ok"]
    assert "train.py" not in data["command"] and data["command"] == data["megatron"]["text"]
    taken = [r for r in data["steps"] if "megatron_flags" in r]
    assert [r["step"] for r in taken][:2] == ["baseline", "expandable_segments"] and len(taken) >= 3
    assert taken[1]["megatron_flags"]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert all(r["validation"] == "our rules + megatron-core 0.19.2's validate_args on the job's flags" for r in taken)
    selective = next(r for r in taken if r["step"] == "selective_recompute")
    # the ladder's own cost fields: the cost model's price for the job, and the documented words beside it
    assert selective["documented"] == COSTS["selective_recompute"][1]
    assert selective["cost"]["text"].endswith("step time; FLOPs +3.6% (A100 SXM4)") and selective["cost"]["high"] > 0
    assert selective["megatron_flags"]["add"] == ["--recompute-granularity", "selective", "--recompute-modules",
                                                  "core_attn"]
    for r in taken:   # each step's flags, on the job's arguments as they are after it (megatron_flags' argv)
        validated(r["megatron_flags"], 1)
    validated(data["megatron"], 1)
    assert replanned(jobs["dump"], data["megatron"]) == pytest.approx(taken[-1]["total_bytes"], abs=1 << 20)
    _, text = run_text(["recommend", "--megatron-args", str(DUMP_LOG), "--gpu-memory", "24GiB", "--gpu-arch", "7"])
    assert "flags: add --recompute-granularity selective --recompute-modules core_attn" in text
    assert "next command (the job's flags; checked: parsed and validated by megatron-core" in text


def test_search_answers_in_the_jobs_flags_each_result_validated(bridge, jobs):
    # six results: the precision-aware optimizer's variants of TP1 PP1 come first (validated here although this
    # host lacks Transformer Engine's FusedAdam: bridge/megatron_args.py _fused_adam_as_on_gpu_nodes), then CP 2
    rc, data = run_json(["plan", "--search", "--megatron-args", str(GPT), "--gpu-memory", "16GiB", "--top", "6"])
    # the job sets --delay-wgrad-compute, which the plan does not model: each layout fits in the modelled part only
    assert rc == 4 and data["fit"] == "unknown" and len(data["results"]) == 6
    for r in data["results"]:
        m = r["megatron"]
        assert m["ok"] and "train.py" not in r["command"] and r["command"] == m["text"]
        args, _ = validated(m, 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, arch=9)
        vpp = args.virtual_pipeline_model_parallel_size or 1
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, vpp,
                args.context_parallel_size) == (r["tp"], r["pp"], r["vpp"], r["cp"])
    assert any("--num-virtual-stages-per-pipeline-rank" in r["command"] or "--context-parallel-size" in r["command"]
               for r in data["results"])


def test_megatron_args_usage_errors_come_before_bridge(capsys):
    assert main(["plan", "--search", "--megatron-args", str(GPT), "--json"]) == 2   # --search needs a capacity
    assert "--gpu-memory is required with --search" in capsys.readouterr().out
    assert main(["recommend", "--megatron-args", str(GPT), "--json"]) == 2
    assert "--gpu-memory" in capsys.readouterr().out
    assert main(["recommend", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "80GiB",
                 "--tokenizer-vocab", "32000", "--json"]) == 2
    assert "--tokenizer-vocab works with --megatron-args" in capsys.readouterr().out


CAPACITY_OOM = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total "
                "capacity of 31.74 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 30.50 "
                "GiB memory in use. Of the allocated memory 29.80 GiB is allocated by PyTorch, and 500.00 MiB is "
                "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def _with_capacity_oom(tmp_path, source: Path) -> Path:
    """The fixture's job with a torch >= 2.1 capacity OOM (1.31 GiB short) instead of its fragmentation one."""
    lines = [line for line in source.read_text().splitlines() if "OutOfMemoryError" not in line
             and "load_entry_point" not in line]
    path = tmp_path / f"capacity_{source.name}"
    path.write_text("\n".join(lines + [CAPACITY_OOM]) + "\n")
    return path


def test_a_capacity_oom_puts_the_remedies_that_cover_the_shortfall_first(bridge, tmp_path):
    log = _with_capacity_oom(tmp_path, DUMP_LOG)
    rc, data = run_json(["doctor", str(log), "--plan", "--gpu-arch", "7"])
    assert rc == 0 and data["kind"] == "capacity"
    assert "the failed request was short by 1.31 GiB" in data["savings"]
    first = data["remedies"][0]
    assert first["saves_bytes"] >= 1.3 * 2**30 and first["megatron"]["ok"]
    assert data["next_command"] == first["command"] == first["megatron"]["text"]
    assert "train.py" not in json.dumps(data)
    validated(first["megatron"], 1)


def test_without_plan_a_megatron_log_is_sent_to_the_plan_not_to_a_train_py_template(capsys):
    for log in (DUMP_LOG,):
        assert main(["doctor", str(log), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert shlex.split(data["next_command"]) == ["mbmem", "doctor", str(log), "--plan"]
        assert "Megatron-LM job (its arguments dump [" in data["command_check"]
        assert "train.py" not in data["next_command"]


def test_a_launch_command_megatron_core_cannot_read_gets_no_train_py_command(bridge, tmp_path):
    log = tmp_path / "placeholders.log"
    log.write_text(COMMAND_LOG.read_text().replace("--num-layers 36", "--num-layers ${NUM_LAYERS}"))
    rc, data = run_json(["doctor", str(log)])
    assert rc == 0 and shlex.split(data["next_command"])[-1] == "--plan"        # a Megatron-LM job: plan it
    rc, data = run_json(["doctor", str(log), "--plan"])
    assert rc == 0 and data["next_command"] is None
    assert not any("train.py" in (r.get("command") or "") for r in data["remedies"])
    assert "a placeholder where a value is needed" in data["savings"]
    assert data["command_check"].startswith("no command: a Megatron-LM job (its launch command [")


def test_the_overlays_flags_plan_prints_are_checked_on_the_job(bridge):
    rc, data = run_json(["plan", "--megatron-args", str(GPT), "--overlay", "selective_recompute,dist_optimizer"])
    assert rc == 0
    check = data["megatron_flags_check"]
    assert check["ok"] and check["add"] == ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    args, _ = validated(check, 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, arch=9)
    assert args.recompute_granularity == "selective" and args.use_distributed_optimizer
    _, text = run_text(["plan", "--megatron-args", str(GPT), "--overlay", "selective_recompute"])
    assert "  checked: parsed and validated by megatron-core 0.19.2's parse_args + validate_args at world size 8" in text


def test_a_dump_on_standard_input_says_to_save_the_log(bridge):
    from conftest import mbmem
    out = mbmem("doctor", "-", "--plan", "--json", input=DUMP_LOG.read_text())
    data = json.loads(out.stdout)
    assert out.returncode == 0 and "standard input, which cannot be read twice" in data["savings"]
    assert data["next_command"] is None or "train.py" not in data["next_command"]

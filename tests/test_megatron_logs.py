"""Real Megatron-LM logs, as users leave them: older releases' dumps and names, launch commands echoed without their
launcher or piped into tee, Megatron-DeepSpeed jobs, ROCm runs. Each fixture's header names the public log whose
format it follows; the figures are our own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import mbmem
from mbmem_overlays.bridge.megatron_args import (FORM_DUMP, dump_header, dump_values, job_words, legacy_values)
from mbmem_overlays.core.text import first_command
from mbmem_overlays.doctor import run_report as RR
from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan

HERE = Path(__file__).parent / "fixtures"
ARGS, RUNS = HERE / "megatron_args", HERE / "runs"
LOG_2020, LOG_2021, LOG_2023 = (ARGS / f"megatron_lm_{y}" for y in ("2020_oom.log", "2021_oom.log", "2023_run.log"))
DEEPSPEED = ARGS / "megatron_deepspeed_polaris.log"
ROCM, BARE = RUNS / "megatron_lm_rocm_tp4_pp2.log", RUNS / "megatron_lm_bare_command.log"


# ----------------------------------------------------------------------------- pure reading (no Bridge)
def test_the_2020_dump_is_read_and_gpt_neox_under_the_same_header_is_not(tmp_path):
    text = LOG_2020.read_text()
    values, count = dump_values(text)
    assert count == 1 and values["batch_size"] == "8" and values["checkpoint_activations"] == "True"
    assert values["split"] == "969, 30, 1" and job_words(text).form == FORM_DUMP
    assert job_words(text).launcher_world == 8                         # the dump's world_size
    neox = ("-------------------- arguments --------------------\n"
            "  attention_dropout ............... 0............................updated\n"
            "  hidden_size ..................... 2048.........................updated\n"
            "  hysteresis ...................... 2............................default\n"
            "---------------- end of arguments ----------------\n")
    assert dump_header(neox) is None and job_words(neox).form != FORM_DUMP
    # the longer header of December 2020 on contains the short one: it is never taken for it
    assert dump_header(LOG_2021.read_text()).group().startswith("-" * 24)
    assert scan([str(LOG_2020)]).megatron_args is not None
    (tmp_path / "neox.log").write_text(neox)
    assert scan([str(tmp_path / "neox.log")]).megatron_args is None


@pytest.mark.parametrize("values, expected, flags", [
    # Megatron-LM <= 2021-08: --checkpoint-activations with its chunk size; 2021-08 .. 2022-05: the method
    ({"checkpoint_activations": "True", "checkpoint_num_layers": "2"},
     {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": "2"}, ["--checkpoint-activations"]),
    ({"activations_checkpoint_method": "block", "activations_checkpoint_num_layers": "4"},
     {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": "4"},
     ["--activations-checkpoint-method"]),
    ({"checkpoint_activations": "False", "checkpoint_num_layers": "1", "activations_checkpoint_method": "None"}, {}, []),
    # a name 0.19.2 has itself wins over the old one
    ({"checkpoint_activations": "True", "recompute_granularity": "selective"}, {"recompute_granularity": "selective"}, []),
    ({"model_parallel_size": "2", "batch_size": "8"}, {"tensor_model_parallel_size": "2", "micro_batch_size": "8"},
     ["--model-parallel-size", "--batch-size"]),
    ({"intra_layer_model_parallel_size": "4", "inter_layer_model_parallel_size": "2"},
     {"tensor_model_parallel_size": "4", "pipeline_model_parallel_size": "2"},
     ["--intra-layer-model-parallel-size", "--inter-layer-model-parallel-size"]),
    ({"batch_size": "8", "micro_batch_size": "4"}, {"micro_batch_size": "4"}, []),
    ({"distribute_checkpointed_activations": "True"}, {"distribute_saved_activations": "True"},
     ["--distribute-checkpointed-activations"]),
])
def test_an_older_releases_names_are_read_as_it_ran_them(values, expected, flags):
    out, notes = legacy_values(values)
    assert out == expected and [n.flag for n in notes] == flags
    assert all("older Megatron-LM" in n.reason for n in notes)


@pytest.mark.parametrize("line, words", [
    ("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2 2>&1 | tee run.log", 6),
    ("python pretrain_gpt.py --lr 1e-4 |& tee logs/out.log", 4),
    ("python pretrain_gpt.py --lr 1e-4 > train.log 2>&1 &", 4),
    ("python pretrain_gpt.py --lr 1e-4 >train.log", 4),
    ("python pretrain_gpt.py --lr 1e-4 && echo done", 4),
    ("python pretrain_gpt.py --lr 1e-4; sleep 1", 4),
    ("python pretrain_gpt.py --lr 1e-4", 4),
])
def test_a_command_line_ends_at_its_first_shell_operator(line, words):
    import shlex
    assert len(first_command(shlex.split(line))) == words
    from mbmem_overlays.bridge.megatron_args import command_words
    assert "tee" not in command_words(line).argv and "|" not in command_words(line).argv


def test_a_launch_command_echoed_without_its_launcher_is_the_jobs(tmp_path):
    f = scan([str(BARE)])
    assert f.command is not None and f.command.value.startswith("pretrain_gpt.py --num-layers 24")
    from mbmem_overlays.doctor.command import parse_launch
    launch = parse_launch(f.command.value)
    assert launch.kind == "megatron-lm" and launch.args[-1] == "--log-throughput"      # `2>&1 | tee` is not its
    assert f.vocab is not None and f.vocab.value == 50277                               # srun's prefix read through
    traceback = tmp_path / "traceback.log"   # a traceback's frame or a line that only names a script is no command
    traceback.write_text('  File "pretrain_gpt.py", line 3, in <module>\n'
                         "see pretrain_gpt.py --help for the flags\n")
    assert scan([str(traceback)]).command is None


def test_selective_recompute_with_modules_unset_is_megatron_cores_core_attn():
    """recompute_modules None is megatron-core's default ["core_attn"] (transformer_config.py): only [] is empty."""
    f = scan([str(ROCM)])
    d = diagnose(f)
    assert not any("nothing is recomputed" in n for n in d.notes)
    from mbmem_overlays.doctor.parse import Seen
    f.config["recompute_modules"] = Seen("[]", "x:1")
    assert any("nothing is recomputed" in n for n in diagnose(f).notes)


def test_a_stage_hot_by_its_reserve_alone_is_not_sent_to_the_layer_split():
    f = scan([str(ROCM)])
    rep = RR.build(f, None, 0.05)
    note = next(n for n in rep.notes if "is the hot stage" in n)
    assert "by its reserve, not its allocations" in note and "num_layers_in_first_pipeline_stage" not in note
    assert "stage 1 allocates the most" in note


def test_no_oom_advice_where_nothing_failed_and_no_halving_of_dp_1():
    f = scan([str(ROCM)])
    f.memory.clear()                       # the same log without its memory lines: no OOM, no report
    d = diagnose(f)
    assert d.verdict == "no_oom" and d.why_not == []
    oom = scan([str(LOG_2020)])
    oom.layout.update({"pp": 2, "dp": 1})
    assert not any("halves DP" in w for w in diagnose(oom).why_not)
    oom.layout["dp"] = 4
    assert any("halves DP (4 -> 2)" in w for w in diagnose(oom).why_not)


# ----------------------------------------------------------------------------- megatron-core's parser (Bridge)
@pytest.fixture(scope="module")
def stack(bridge):
    return bridge


@pytest.mark.parametrize("log", [LOG_2020, LOG_2021, LOG_2023])
def test_older_releases_dumps_plan_the_job_they_ran(stack, log):
    from mbmem_overlays.bridge.megatron_args import load_job
    job = load_job(log.read_text())
    m = job.config.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    assert (m.tensor_model_parallel_size, job.world_size, job.config.train.micro_batch_size) == (2, 8, 8)
    assert job.config.model.num_layers == 24 and not [n for n in job.unknown if n.flag.startswith("checkpoint")]
    if log is not LOG_2023:
        assert job.translated and "read as it ran" in job.translated[0].reason
        assert "translated" in job.as_dict()
    else:                      # 23.04's inference default, refused by 0.19.2 at PP 1, is left at 0.19.2's default
        assert any("--inference-batch-times-seqlen-threshold 512" in a and "left at megatron-core 0.19.2's default"
                   in a for a in job.assumptions)
    if log is LOG_2020:        # 2020's float --warmup, which 0.19.2's parser refuses as an int
        assert any("--warmup 0.01" in a for a in job.assumptions)


def test_a_dumps_refusal_of_a_setting_that_decides_memory_stands(stack):
    """Only what cannot change training memory is left at 0.19.2's default; any other refusal is the answer."""
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, load_job
    text = LOG_2023.read_text()
    with pytest.raises(MegatronArgsError) as err:
        load_job(text.replace("recompute_method ................................ uniform",
                              "recompute_method ................................ sideways"))
    assert "sideways" in err.value.message
    with pytest.raises(MegatronArgsError) as err:    # validate_args' own refusal of a layout, with the neutral one
        load_job(text.replace("world_size ...................................... 8",
                              "world_size ...................................... 3"))
    assert "inference" not in err.value.message


def test_an_old_command_line_is_read_in_0_19_2s_words(stack):
    from mbmem_overlays.bridge.megatron_args import load_job
    job = load_job("torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 256 "
                   "--num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --batch-size 2 "
                   "--global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 1024 --bf16 --model-parallel-size 2 "
                   "--checkpoint-activations --checkpoint-num-layers 2 2>&1 | tee run.log")
    m = job.config.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 2)
    assert m.tensor_model_parallel_size == 2 and job.config.train.micro_batch_size == 2
    assert "--checkpoint-activations" not in job.argv and "--recompute-granularity" in job.argv
    assert [n.flag for n in job.translated] == ["--checkpoint-activations", "--model-parallel-size", "--batch-size"]
    assert not job.unknown
    # validate_args' own aliases are carried into the plan, not "unsupported"
    alias = load_job("pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
                     "--max-position-embeddings 512 --micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1024 "
                     "--recompute-activations --use-rotary-position-embeddings", world_size=1)
    assert alias.config.model.recompute_granularity == "selective"
    assert not {"--recompute-activations", "--use-rotary-position-embeddings"} & {n.flag for n in alias.unsupported}


def test_a_megatron_deepspeed_job_is_named_not_parsed_as_megatron_lm(stack):
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, load_job
    f = scan([str(DEEPSPEED)])
    with pytest.raises(MegatronArgsError) as err:
        load_job(f.command.value, world_size=8)
    assert err.value.rejected and err.value.message.startswith("a Megatron-DeepSpeed job (the deepspeed launcher")
    assert "--zero-stage=2" in err.value.message and "adamw" not in err.value.message


def test_doctor_plan_on_real_log_shapes(stack):
    """The doctor with --plan, as a user runs it on each log."""
    out = mbmem("doctor", str(ROCM), "--plan", "--gpu-memory", "192GiB", "--json")
    d = json.loads(out.stdout)
    # a fragmenting Megatron-LM run: the allocator setting is the next command, in the job's own terms
    assert d["next_command"] == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", d["run"]["plan_status"]
    assert d["run"]["plan_status"].startswith("the memory model on Megatron-LM arguments dump of ")
    assert not any("nothing is recomputed" in n for n in d["notes"])
    out = mbmem("doctor", str(BARE), "--plan", "--gpu-memory", "64GiB", "--world-size", "8", "--json")
    d = json.loads(out.stdout)
    status = d["run"]["plan_status"]
    assert status.startswith("the memory model on Megatron-LM launch command"), status
    assert d["run"]["plan"]["megatron_args"]["argv"][-1] != "tee"
    out = mbmem("doctor", str(BARE), "--plan", "--gpu-memory", "64GiB")
    assert "the world size is not in the arguments" in out.stdout and "--world-size N" in out.stdout
    out = mbmem("doctor", str(LOG_2021), "--plan", "--gpu-arch", "A100", "--json")
    d = json.loads(out.stdout)
    assert "--checkpoint" not in json.dumps(d["remedies"]) and "activations-checkpoint-method" in d["savings"]
    assert not any(r["name"] == "full_recompute" for r in d["remedies"])        # the job already recomputes
    out = mbmem("doctor", str(DEEPSPEED), "--plan", "--gpu-memory", "40GiB", "--json")
    d = json.loads(out.stdout)
    assert "a Megatron-DeepSpeed job" in d["run"]["plan_status"] and "|&" not in d["next_command"]

"""A Megatron-LM job planned from its own arguments (bridge/megatron_args.py, plan --megatron-args, doctor --plan).

Each input form is parsed and validated by megatron-core 0.19.2's own parser; the fixtures are our own jobs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mbmem_overlays.bridge.megatron_args import (DUMP_END, DUMP_HEADER, FORM_COMMAND, FORM_DUMP, FORM_YAML,
                                                 MegatronArgsError, command_words, dump_values, job_words)
from mbmem_overlays.cli import main

HERE = Path(__file__).parent / "fixtures" / "megatron_args"
GPT = HERE / "gpt_small.sh"
MOE = HERE / "moe_model_config.yaml"
LOG = HERE / "gpt_small_job.log"


# ----------------------------------------------------------------------------- pure reading (no Bridge)
def test_a_command_line_gives_the_launchers_world_size_env_and_the_flags_after_the_script():
    w = job_words(GPT.read_text())
    assert w.form == FORM_COMMAND and w.script == "pretrain_gpt.py"
    assert w.launcher_world == 8 and w.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert w.argv[:2] == ("--tensor-model-parallel-size", "2")
    assert "${DATA_PATH}/my_text_document" in w.argv        # never interpolated


def test_an_elastic_or_automatic_launcher_gives_no_world_size():
    assert command_words("torchrun --nnodes 1:4 --nproc-per-node 8 pretrain_gpt.py --bf16").launcher_world is None
    assert command_words("torchrun --nproc_per_node=gpu pretrain_gpt.py --bf16").launcher_world is None
    assert command_words("torchrun --nproc_per_node=4 --nnodes=3 pretrain_gpt.py").launcher_world == 12


def test_model_args_yaml_spells_booleans_lists_and_keeps_placeholders():
    w = job_words(MOE.read_text())
    assert w.form == FORM_YAML and w.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    argv = list(w.argv)
    assert "--sequence-parallel" in argv and "--deterministic-mode" not in argv   # true: the flag; false: left out
    i = argv.index("--recompute-modules")
    assert argv[i + 1:i + 3] == ["core_attn", "moe_act"]
    assert argv[argv.index("--save") + 1] == "${CHECKPOINT_SAVE_PATH}"


def test_a_dump_is_read_through_launcher_prefixes_and_long_names():
    text = "\n".join(["[default0]:" + DUMP_HEADER, "[default0]:  bf16 " + "." * 44 + " True",
                      "[default0]:  a_name_longer_than_forty_eight_characters_is_printed_x  7",
                      "[default3]: a warning from another rank", "[default0]:" + DUMP_END])
    values, count = dump_values(text)
    assert values == {"bf16": "True", "a_name_longer_than_forty_eight_characters_is_printed_x": "7"} and count == 1


def test_a_cut_dump_is_an_error_not_a_guess():
    with pytest.raises(MegatronArgsError, match="end of arguments"):
        dump_values(DUMP_HEADER + "\n  bf16 ... True\n")


def test_a_bad_yaml_is_an_error():
    with pytest.raises(MegatronArgsError, match="does not parse"):
        job_words("MODEL_ARGS:\n  --num-layers: [1,\n")


# ----------------------------------------------------------------------------- parsed by megatron-core (Bridge)
@pytest.fixture(scope="module")
def jobs(bridge):
    from mbmem_overlays.bridge.megatron_args import load_job, read_source
    from mbmem_overlays.memory.coverage import with_coverage   # the plan's one not-modelled list, as the CLI uses it
    return {"cmd": with_coverage(load_job(read_source(str(GPT)))),
            "yaml": with_coverage(load_job(read_source(str(MOE)), world_size=4)),
            "dump": with_coverage(load_job(read_source(str(LOG))))}


def test_the_command_line_maps_to_the_bridge_config(jobs):
    job = jobs["cmd"]
    m = job.config.model
    assert job.world_size == 8 and "nproc" in job.world_from
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.num_layers, m.hidden_size) == (2, 2, 8, 1536)
    assert m.sequence_parallel and job.config.ddp.use_distributed_optimizer
    assert (job.config.train.micro_batch_size, job.config.train.global_batch_size) == (2, 64)
    assert m.vocab_size == 32000 and m.share_embeddings_and_output_weights   # 32000 is a multiple of 128 x TP 2
    assert [n.flag for n in job.unknown] == ["--no-such-flag"] and job.unknown[0].value == "3"
    assert "--delay-wgrad-compute" in [n.flag for n in job.not_modelled]


def test_the_model_args_yaml_maps_moe_gqa_and_pads_the_vocabulary(jobs):
    job = jobs["yaml"]
    m = job.config.model
    assert m.num_moe_experts == 8 and m.moe_layer_freq == [0, 1, 1, 1] and m.num_query_groups == 4
    assert m.gated_linear_unit and not m.share_embeddings_and_output_weights
    assert m.vocab_size == 8192          # 8191 padded to a multiple of 128 x TP 2 (vocab_size_with_padding)
    assert m.recompute_modules == ["core_attn", "moe_act"]
    assert "--an-option-from-elsewhere" in [n.flag for n in job.unknown]
    assert m.attention_backend.name == "unfused" and job.not_modelled == ()   # modelled: the s x s scores


def test_the_log_dump_rebuilds_the_same_job(jobs):
    a, b = jobs["cmd"], jobs["dump"]
    assert b.form == FORM_DUMP and b.world_size == 8
    from mbmem_overlays.memory import model as P
    assert P.estimate(*P.from_config(a.config, 8)).total == P.estimate(*P.from_config(b.config, 8)).total


def test_validate_args_refuses_what_megatron_lm_refuses(bridge):
    from mbmem_overlays.bridge.megatron_args import load_job
    with pytest.raises(MegatronArgsError, match="not divisible") as exc:
        load_job(GPT.read_text(), world_size=6)
    assert exc.value.rejected


def test_a_placeholder_where_a_number_is_needed_is_an_error(bridge):
    from mbmem_overlays.bridge.megatron_args import load_job
    with pytest.raises(MegatronArgsError, match="placeholder"):
        load_job(GPT.read_text().replace("--num-layers 8", "--num-layers ${LAYERS}"))


def test_a_list_expression_that_would_not_fit_in_memory_is_refused_before_eval(bridge):
    from mbmem_overlays.bridge.megatron_args import load_job
    with pytest.raises(MegatronArgsError, match="entries"):
        load_job(GPT.read_text().replace("--num-layers 8", "--num-layers 8 --moe-layer-freq [1]*99999999999"))


def test_overlay_changes_become_the_parsers_own_flags(jobs):
    from mbmem_overlays.bridge.megatron_args import overlay_flags
    flags = overlay_flags([("model.recompute_granularity", "selective"), ("model.recompute_modules", ["core_attn"]),
                           ("$PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")], jobs["cmd"].args)
    assert list(flags.words) == ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    assert dict(flags.env) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


# ----------------------------------------------------------------------------- the commands
def test_plan_megatron_args_names_unknown_and_not_modelled_flags(bridge, capsys):
    rc = main(["plan", "--megatron-args", str(GPT), "--gpu-memory", "80GiB", "--overlay", "selective_recompute"])
    out = capsys.readouterr().out
    assert rc == 4   # the fit is unknown: a flag that changes memory is not modelled (docs/exit-codes.md)
    assert "world size 8 (--nproc-per-node 4 x --nnodes 2)" in out
    assert "verdict: unknown: --delay-wgrad-compute not modelled (it can only add memory)" in out
    assert "--no-such-flag 3" in out
    assert "--mtp-num-layers" not in out.split("verdict:")[1].split("\n")[0]   # MTP is modelled
    assert "Megatron-LM flags for the overlays: --recompute-granularity selective --recompute-modules core_attn" in out


def test_plan_megatron_args_json(bridge, capsys):
    rc = main(["plan", "--megatron-args", str(MOE), "--world-size", "4", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0 and payload["megatron_args"]["form"] == FORM_YAML
    assert "NOT MODELLED" not in payload["megatron_args"]["verdict"]   # unfused attention and MoE are modelled
    assert payload["megatron_args"]["not_modelled"] == []
    assert {n["flag"] for n in payload["megatron_args"]["unknown"]} == {"--an-option-from-elsewhere"}


def test_plan_megatron_args_without_a_world_size_says_what_to_type(bridge, capsys):
    rc = main(["plan", "--megatron-args", str(MOE), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 2 and "--world-size" in json.dumps(payload)


def test_plan_megatron_args_refuses_a_recipe_too(capsys):
    rc = main(["plan", "--megatron-args", str(GPT), "--recipe", "llama3_8b_pretrain", "--json"])
    assert rc == 2 and "give one of them" in capsys.readouterr().out


def test_doctor_plan_uses_the_logs_own_arguments(bridge, capsys):
    rc = main(["doctor", str(LOG), "--plan", "--json"])
    payload = json.loads(capsys.readouterr().out)
    text = json.dumps(payload)
    assert rc == 0, text[:2000]
    assert "Megatron-LM arguments dump" in text and "NOT MODELLED" in text
    assert "--delay-wgrad-compute" in text


# ----------------------------------------------------------------------------- the job's GPU and environment
def _yaml_with_env(tmp_path, extra_env: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(MOE.read_text().replace("ENV_VARS:\n", f"ENV_VARS:\n{extra_env}", 1))
    return path


def test_plan_megatron_args_plans_with_the_jobs_environment_and_gpu_arch(bridge, capsys, tmp_path):
    def plan(*words):
        assert main(["plan", "--megatron-args", *words, "--world-size", "4", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    default = plan(str(MOE))
    small = plan(str(_yaml_with_env(tmp_path, '  CUBLAS_WORKSPACE_CONFIG: ":16:8"\n')))
    a100 = plan(str(MOE), "--gpu-arch", "A100")
    assert "--gpu-arch not given: GPUs of compute capability 9 (H100/H200) assumed" in default["assumptions"]
    assert any("does not set CUBLAS_WORKSPACE_CONFIG" in a for a in default["assumptions"])
    # :16:8 is 8 x 16 KiB per torch cuBLAS workspace instead of 32 MiB on Hopper (memory/buffers.py)
    assert any("CUBLAS_WORKSPACE_CONFIG=:16:8 from the job's environment" in a for a in small["assumptions"])
    assert small["total_bytes"] < default["total_bytes"]
    # an A100 (compute capability 8): smaller torch and Transformer Engine workspaces, and validate_args asked as on it
    assert any("compute capability 8.x" in a for a in a100["assumptions"])
    assert not any("--gpu-arch not given" in a for a in a100["assumptions"])
    assert a100["total_bytes"] < default["total_bytes"]


def test_gpu_arch_is_a_compute_capability_or_a_name():
    from mbmem_overlays.cli.common import gpu_arch_option
    assert [gpu_arch_option(t)[0] for t in ("9", "10.0", "sm_90", "sm100a", "H200", "NVIDIA GB200", "a100")] == \
        [9, 10, 9, 10, 9, 10, 8]
    for bad in ("13", "h9000", "9" * 500, ""):
        value, problem = gpu_arch_option(bad)
        assert value is None and "--gpu-arch 9" in problem.fix


def test_a_bad_gpu_arch_is_a_usage_error_before_bridge(capsys):
    assert main(["plan", "--megatron-args", str(GPT), "--gpu-arch", "Z80", "--json"]) == 2
    assert "--gpu-arch" in capsys.readouterr().out
    assert main(["doctor", str(LOG), "--plan", "--gpu-arch", "Z80", "--json"]) == 2


def test_doctor_plan_plans_the_log_on_the_gpu_it_is_told(bridge, capsys):
    def peaks(*words):
        main(["doctor", str(LOG), "--plan", *words, "--json"])
        payload = json.loads(capsys.readouterr().out)
        return json.dumps(payload), [v for k, v in _walk(payload) if k == "planned_peak_bytes"]

    default_text, default = peaks()
    a100_text, a100 = peaks("--gpu-arch", "8")
    assert "--gpu-arch not given" in default_text and "--gpu-arch not given" not in a100_text
    assert "compute capability 8.x" in a100_text
    assert default and len(default) == len(a100) and all(a < d for a, d in zip(a100, default))


def _walk(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


# ----------------------------------------------------------------------------- distillation, TE version
def test_distillation_flags_are_named_not_modelled_not_unknown(bridge, capsys, tmp_path):
    job = tmp_path / "distill.sh"
    job.write_text(GPT.read_text().replace("--no-such-flag 3", "--export-kd-teacher-load /ckpt/teacher "
                                           "--export-kd-cfg /ckpt/kd.yaml --no-such-flag 3"))
    rc = main(["plan", "--megatron-args", str(job), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0
    verdict = payload["megatron_args"]["verdict"]
    assert "not modelled: " in verdict and "--export-kd-teacher-load" in verdict and "--export-kd-cfg" in verdict
    plan_gaps = {g["name"]: g for g in payload["unmodelled"]}   # the plan's one list has them, each adding memory
    assert plan_gaps["--export-kd-teacher-load"]["moves"] == "up" and plan_gaps["--export-kd-cfg"]["moves"] == "up"
    notes = {n["flag"]: n for n in payload["megatron_args"]["not_modelled"]}
    assert notes["--export-kd-teacher-load"]["value"] == "/ckpt/teacher"
    assert "teacher" in notes["--export-kd-teacher-load"]["reason"]
    assert [n["flag"] for n in payload["megatron_args"]["unknown"]] == ["--no-such-flag"]


def test_a_dumps_distillation_flag_counts_only_when_set():
    from types import SimpleNamespace

    from mbmem_overlays.bridge.megatron_args import FlagNote, MegatronJob
    from mbmem_overlays.memory.coverage import with_coverage
    why = "in the dump but not an argument of megatron-core 0.19.2 (another version's)"
    job = MegatronJob(config=SimpleNamespace(), world_size=8, world_from="dump", form=FORM_DUMP, argv=(), env={},
                      family="gpt", unknown=(FlagNote("export_kd_teacher_load", "/ckpt/teacher", why),
                                             FlagNote("export_kd_cfg", "None", why), FlagNote("other_arg", "3", why)))
    covered = with_coverage(job)
    assert [n.flag for n in covered.not_modelled] == ["--export-kd-teacher-load"]
    assert [n.flag for n in covered.unknown] == ["export_kd_cfg", "other_arg"]   # unset: still only unknown


def test_validate_args_is_asked_with_the_te_version_bridge_pins(bridge):
    from mbmem_overlays.bridge.megatron_args import ASSUMED_TE_VERSION, load_job, te_version
    # delay_wgrad_compute with overlap_grad_reduce needs TE >= 2.8.0 (arguments.py validate_args)
    job = load_job(GPT.read_text().replace("--delay-wgrad-compute", "--delay-wgrad-compute --overlap-grad-reduce"))
    te, installed = te_version()
    assert installed or te == ASSUMED_TE_VERSION == "2.17.1"
    assert any(f"Transformer Engine {te}" in a for a in job.assumptions)
    import megatron.training.arguments as mlm_arguments
    from megatron.core.utils import is_te_min_version
    assert mlm_arguments.is_te_min_version is is_te_min_version   # restored after validation

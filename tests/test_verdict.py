"""The fit verdict every command gives (memory/plan.py judge): never a confident "fits" or "does NOT fit" on what
the plan does not model, a range as honest as the code allows, "unknown" in the JSON and its own exit code; and
the answers a person reads: the plan's assumptions that change this job's figure (memory/assumptions.py
predicates), the rest on request, the same for recommend and the doctor."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mbmem_overlays.core.report import EXIT_OK, EXIT_REJECTED, EXIT_UNKNOWN
from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.assumptions import ASSUMPTION_TABLE, BY_TEXT, applying
from mbmem_overlays.memory.coverage import (DOWN, EITHER, MOVES, NOT_MODELLED, NOT_MODELLED_FLAGS, UP, Gap,
                                            Unmodelled, gaps, not_modelled)
from mbmem_overlays.memory.plan import judge
from mbmem_overlays.memory.vision import VisionTower
from mbmem_overlays.memory.steps import render_plan

GiB = 2**30
B = P.Breakdown(10 * GiB, 10 * GiB, 10 * GiB, 30 * GiB, 1 * GiB)   # 61 GiB
FLEX = "model.moe_token_dispatcher_type=flex: the flex (DeepEP / HybridEP) dispatcher's buffers"
DELAY = "model.delay_wgrad_compute=True: delayed weight gradients keep GEMM inputs and grad outputs longer"
FSDP2 = "ddp.use_torch_fsdp2=True: PyTorch FSDP2 sharding"
BARE = ("fits", "does NOT fit", "fits unless", "does not fit")


def text_of(name: str) -> str:
    return next(a.text for a in ASSUMPTION_TABLE if a.name == name)


def summary_of(name: str) -> str:
    return next(a.summary for a in ASSUMPTION_TABLE if a.name == name)


def _bare(text: str) -> bool:
    """A verdict that names nothing the plan left out."""
    return text in BARE[:2] or (text.startswith(BARE[2]) and "not modelled" not in text)


# ----------------------------------------------------------------------------- judge: pure
def test_a_plan_that_models_everything_keeps_its_plain_verdict_and_codes():
    assert judge(B.footprint, 80 * GiB).text == "fits" and judge(B.footprint, 80 * GiB).exit_code == EXIT_OK
    over = judge(B.footprint, 50 * GiB)
    assert over.text == "does NOT fit" and over.kind == P.DOES_NOT_FIT and over.exit_code == EXIT_REJECTED
    assert judge(B.footprint, None).kind == P.NO_CAPACITY and judge(B.footprint, None).exit_code == EXIT_OK


@pytest.mark.parametrize("limit", [80 * GiB, 50 * GiB])
def test_what_can_move_memory_either_way_leaves_both_ends_open(limit):
    v = judge(B.footprint, limit, (), (FLEX,), B)
    assert v.kind == P.UNKNOWN and v.exit_code == EXIT_UNKNOWN and v.fits is None
    assert v.text.startswith("unknown: model.moe_token_dispatcher_type=flex not modelled")
    assert "both ends are open" in v.text and v.low is None and v.high is None
    d = v.as_dict()
    assert d["fit_verdict"] == "unknown" and d["fit"] == "unknown" and d["fits"] is None
    assert d["modelled_fits"] == (B.footprint <= limit)
    assert d["unmodelled"] == [{"name": "model.moe_token_dispatcher_type", "value": "flex", "moves": EITHER,
                                "reason": "the flex (DeepEP / HybridEP) dispatcher's buffers", "bound_bytes": None}]
    assert d["fit_range"]["open_ends"] == ["low", "high"] and d["fit_range"]["modelled_bytes"] == int(B.footprint)


def test_what_can_only_add_makes_the_modelled_part_a_floor():
    v = judge(B.footprint, 80 * GiB, (), (DELAY,), B)
    assert v.kind == P.UNKNOWN and v.low == B.footprint and v.high is None
    assert "a floor" in v.text and "adds less than 19.00 GiB" in v.text
    # a floor over the limit decides: it cannot fit, and the verdict says why (never bare)
    over = judge(B.footprint, 50 * GiB, (), (DELAY,), B)
    assert over.kind == P.DOES_NOT_FIT and over.exit_code == EXIT_REJECTED
    assert over.text.startswith("does NOT fit; not modelled: model.delay_wgrad_compute=True, which can only add")


def test_what_can_only_lower_is_a_ceiling_and_its_bound_is_the_floor():
    fits = judge(B.footprint, 80 * GiB, (), (FSDP2,), B)
    assert fits.kind == P.FITS and fits.text == "fits; not modelled: ddp.use_torch_fsdp2=True, which can only lower memory"
    # FSDP2 can at most shard away parameters, gradients and optimizer state: 31 GiB remain
    between = judge(B.footprint, 50 * GiB, (), (FSDP2,), B)
    assert between.kind == P.UNKNOWN and between.low == 31 * GiB and between.high == B.footprint
    assert "between 31.00 GiB and 61.00 GiB" in between.text
    assert judge(B.footprint, 30 * GiB, (), (FSDP2,), B).kind == P.DOES_NOT_FIT   # even the floor is over


def test_a_modelled_range_clause_stays_in_an_unknown_verdict():
    from mbmem_overlays.memory.ranges import Range
    imbalance = Range("activations (routed MoE tokens)", "why", P.MOE_BALANCE, "MoE routing is imbalanced",
                      B.footprint, 100 * GiB)
    v = judge(B.footprint, 80 * GiB, (imbalance,), (FLEX,), B)
    assert v.kind == P.UNKNOWN and "fits unless MoE routing is imbalanced" in v.text and v.clauses


@pytest.mark.parametrize("entry", NOT_MODELLED, ids=lambda u: u.path)
def test_no_unmodelled_field_gets_a_bare_verdict(entry):
    text = f"{entry.path}=x: {entry.reason}"
    for limit in (200 * GiB, 62 * GiB, 60 * GiB, 20 * GiB, 1 * GiB):
        v = judge(B.footprint, limit, (), (text,), B)
        assert not _bare(v.text) and entry.path in v.text, v.text
        assert v.kind == P.UNKNOWN or (v.kind == P.FITS and entry.moves == DOWN) or \
            (v.kind == P.DOES_NOT_FIT and entry.moves in (UP, DOWN))


def test_every_entry_says_how_it_moves_memory_and_the_default_is_both_ways():
    assert all(u.moves in MOVES for u in NOT_MODELLED + NOT_MODELLED_FLAGS)
    assert Unmodelled("model.x", "y").moves == EITHER and Unmodelled("model.x", "y").bound is None
    # a plan's texts read back with their entry's data; a text no entry names is both ends open
    (delay,), (fsdp2,), (other,) = gaps([DELAY]), gaps([FSDP2]), gaps(["model.new_thing=3: something"])
    assert delay == Gap("model.delay_wgrad_compute", "True", delay.reason, UP)
    assert fsdp2.moves == DOWN and fsdp2.size(B) == 30 * GiB and other.moves == EITHER and other.size(B) is None
    # a Megatron-LM flag is its field's entry, or one of the flags outside megatron-core's parser
    (flag,) = gaps(["--delay-wgrad-compute=True: delayed weight gradients ... (model.delay_wgrad_compute)"])
    assert flag.moves == UP and flag.setting == "--delay-wgrad-compute"
    assert gaps(["--export-kd-cfg=/ckpt/kd.yaml: knowledge distillation ..."])[0].moves == UP


def _plan(not_modelled=(), capacity=80 * GiB, **kw):
    lay = P.Layout(world=8, tp=1, pp=1, seq=4096, mbs=1, gbs=8)
    return P.Plan("r", 8, lay, (P.Step("baseline", B),), capacity, 0.05, None, not_modelled=not_modelled, **kw)


def test_the_plan_text_and_json_carry_the_one_verdict():
    plan = _plan((FLEX,))
    text = render_plan(plan)
    row = next(line for line in text.splitlines() if line.lstrip().startswith("baseline"))
    assert row.rstrip().endswith("?")
    verdict_line = next(line for line in text.splitlines() if line.startswith("capacity "))
    assert "-> unknown: model.moe_token_dispatcher_type=flex not modelled" in verdict_line
    assert "(it can move memory either way)" in text.split("not modelled (set in")[1]
    d = plan.as_dict()
    assert d["fit_verdict"] == "unknown" and d["fits"] is None and d["steps"][0]["fit"] == "unknown"
    assert plan.judge().exit_code == EXIT_UNKNOWN
    assert _plan().as_dict()["fit_verdict"] == "fits" and _plan().judge().exit_code == EXIT_OK


# ----------------------------------------------------------------------------- assumptions: when each applies
LLAMA = P.Shape(layers=32, hidden=4096, ffn=14336, heads=32, groups=8, head_dim=128, vocab=128256)
MOE = replace(LLAMA, experts=128, moe_ffn=768, topk=8, moe_layers=32)
HYBRID_SHAPE = replace(LLAMA, layer_kinds=("mamba", "attn", "mlp") * 4, mamba_heads=64, mamba_head_dim=64,
                       mamba_groups=8, mamba_state=128)
MAMBA_ONLY = replace(HYBRID_SHAPE, layer_kinds=("mamba",) * 12)
LAY = P.Layout(world=8, seq=4096, mbs=1, gbs=64)
ST = P.Settings(dist_optimizer=True)
# (what it is, shape, settings): configurations the project plans (recipes' settings as from_config reads them)
CATALOGUE = {
    "dense bf16, distributed optimizer": (LLAMA, ST),
    "no distributed optimizer": (LLAMA, P.Settings()),
    "TE CUDA graphs": (LLAMA, replace(ST, graph_scopes=("attn",), graph_warmup_steps=3)),
    "precision-aware optimizer": (LLAMA, replace(ST, precision_aware=True, state_bytes=P.BF16)),
    "hidden dropout": (LLAMA, replace(ST, hidden_dropout=True)),
    "LoRA": (LLAMA, replace(ST, lora_rank=16, lora_targets=("linear_qkv",))),
    "FP8 params": (LLAMA, replace(ST, fp8=True, param_bytes=P.FP8, fp8_weight_copy_bytes=1)),
    "MoE": (MOE, ST),
    "MoE, moe recompute": (MOE, replace(ST, recompute="selective", modules=("moe",))),
    "hybrid Mamba": (HYBRID_SHAPE, ST),
    "Mamba only": (MAMBA_ONLY, ST),
    "activation offload": (LLAMA, replace(ST, cpu_offload_layers=4)),
    "optimizer offload": (LLAMA, replace(ST, optimizer_offload=0.5)),
    "Megatron FSDP": (LLAMA, replace(ST, fsdp="optim_grads_params")),
    "Muon": (LLAMA, replace(ST, optimizer="muon")),
    # a VL model: its ViT and LM frozen, the mergers training (memory/vision.py)
    "VL, frozen language model": (replace(LLAMA, vision=VisionTower("qwen3_vl", 2, 64, 96, 4, 48, 80, 4,
                                                                    image_tokens=64, encoder_trains=False)),
                                  replace(ST, frozen_lm=True)),
}
UNIVERSAL = {"allocated_only", "outside_torch", "headline_phases", "vocabulary"}


@pytest.mark.parametrize("a", ASSUMPTION_TABLE, ids=lambda a: a.name)
def test_each_assumption_applies_to_some_configuration_and_not_to_every_one(a):
    holds = {name: a.holds(s, LAY, st) for name, (s, st) in CATALOGUE.items()}
    assert any(holds.values()), f"{a.name} applies to no configuration: it would never be shown"
    if a.name in UNIVERSAL:
        assert a.applies is None and all(holds.values())
    else:
        assert a.applies is not None and not all(holds.values()), f"{a.name} applies to every configuration"
    assert a.summary and len(a.summary) < 200 and a.text in P.ASSUMPTIONS


def test_every_assumption_a_range_qualifies_is_shown_and_the_table_is_the_plan_list():
    assert P.ASSUMPTIONS == tuple(a.text for a in ASSUMPTION_TABLE) and set(BY_TEXT) == set(P.ASSUMPTIONS)
    dense = applying([(LLAMA, LAY, ST)])
    names = {BY_TEXT[t].name for t in dense}
    assert names == UNIVERSAL | {"attention_kernel", "distributed_optimizer"}
    # a range's assumption is shown even where its predicate would not name it
    from mbmem_overlays.memory.ranges import Range
    plan = _plan(applicable=dense, ranges=(Range("x", "y", P.FP8_TRANSPOSE, "", B.footprint, B.footprint),))
    assert plan.applies(P.FP8_TRANSPOSE) and not plan.applies(text_of("muon"))


def test_the_default_text_names_what_applies_and_verbose_gives_every_assumption_in_full():
    dense = applying([(LLAMA, LAY, ST)])
    plan = _plan(applicable=dense, assumptions=P.ASSUMPTIONS + ("the job's own: GPUs of capability 9 assumed",))
    text, full = render_plan(plan), render_plan(plan, verbose=True)
    assert summary_of("allocated_only") in text and summary_of("cuda_graphs") not in text
    assert "the job's own: GPUs of capability 9 assumed" in text    # a job's own assumption is always shown
    assert all(a in full for a in P.ASSUMPTIONS) and text_of("cuda_graphs") not in text
    assert f"(6 of {len(P.ASSUMPTIONS)}; all in full, with their sources: --assumptions)" in text
    assert len(text) < 2000 < len(full)


# ----------------------------------------------------------------------------- recommend and the doctor: pure
def test_recommend_puts_the_command_first_and_says_when_the_fit_is_unknown():
    from mbmem_overlays.memory.ladder import render_recommendation
    v = judge(B.footprint, 76 * GiB, (), (FLEX,), B)
    rec = {"capacity_bytes": 80 * GiB, "margin": 0.05, "validation": "PASSED", "command": "python train.py x",
           **v.as_dict(), "steps": [
               {"step": "baseline", "total_bytes": int(B.footprint), "fits": None, "modelled_fits": True},
               {"step": "sequence_parallel", "skipped": "needs TP > 1", "kind": "not applicable"},
               {"step": "dist_optimizer", "skipped": "already in effect", "kind": "already in effect"}]}
    text = render_recommendation(rec)
    lines = text.splitlines()
    assert lines[0].startswith("next command, fit unknown (model.moe_token_dispatcher_type=flex not modelled")
    assert lines[1] == "  python train.py x" and lines[3].startswith("verdict: unknown: ")
    assert "  ? baseline" in text and "fit unknown (the modelled part fits)" in text and "FITS" not in text
    assert "skipped, not applicable here: sequence_parallel, dist_optimizer" in text
    assert "skipped: needs TP > 1" not in text and "skipped: needs TP > 1" in render_recommendation(rec, True)


def test_the_doctor_prints_what_to_act_on_and_the_evidence_on_request():
    from mbmem_overlays.doctor.diagnose import diagnose
    from mbmem_overlays.doctor.parse import scan
    from mbmem_overlays.doctor.render import render
    log = Path(__file__).parent / "fixtures" / "doctor" / "allocator" / "current_fragmentation.log"
    f = scan([str(log)])
    d = diagnose(f)
    short, full = render(d, f), render(d, f, verbose=True)
    assert short.splitlines()[0].startswith("diagnosis: allocator fragmentation") and "next command: " in short
    assert "evidence:" not in short and "more with -v: evidence (8)" in short and "not first:" in short
    assert "evidence:" in full and "not first:" in full and "more with -v" not in full
    assert len(short) < len(full)


def test_not_modelled_names_a_field_only_where_it_is_set():
    from types import SimpleNamespace
    cfg = SimpleNamespace(model=SimpleNamespace(moe_token_dispatcher_type="alltoall"), ddp=None)
    assert not_modelled(cfg) == () and gaps(not_modelled(cfg)) == ()


# ----------------------------------------------------------------------------- on real recipes
@pytest.mark.bridge
def test_each_assumption_applies_to_a_real_recipe_and_not_to_another(bridge, recipe):
    """The predicates on configurations Bridge ships (from_config of real recipes with the user's --set words)."""
    llama = "llama3_8b_pretrain_config"
    nano = "nemotron_3_nano_pretrain_config"
    built = {
        "llama": recipe(llama),
        "llama, no distributed optimizer": recipe(llama, "optimizer.use_distributed_optimizer=false",
                                                  "ddp.use_distributed_optimizer=false"),
        "llama, precision-aware": recipe(llama, "optimizer.use_precision_aware_optimizer=true"),
        "llama, hidden dropout": recipe(llama, "model.hidden_dropout=0.1"),
        "llama, offload": recipe(llama, "model.cpu_offloading=true", "model.cpu_offloading_num_layers=4",
                                 "optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5"),
        "llama, FSDP": recipe(llama, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads"),
        "llama, Muon": recipe(llama, "optimizer.optimizer=muon"),
        "llama LoRA": recipe("llama3_8b_peft_config"),
        "llama FP8, CUDA graphs": recipe("megatron.bridge.perf_recipes.llama.h100.llama3."
                                         "llama3_70b_sft_32gpu_h100_fp8cs_config"),
        "qwen3 MoE, moe recompute": recipe("qwen3_30b_a3b_pretrain_config", "model.recompute_granularity=selective",
                                           "model.recompute_modules=[moe]"),
        "nemotron 3 nano": recipe(nano),
        "qwen3-vl, frozen language model": recipe("qwen3_vl_8b_pretrain_4gpu_h100_bf16_mock_config"),
    }
    mamba_only = recipe(nano)
    field = "hybrid_override_pattern" if mamba_only.model.hybrid_override_pattern else "hybrid_layer_pattern"
    pattern = getattr(mamba_only.model, field)
    setattr(mamba_only.model, field, "".join("M" if c in "*-E" else c for c in pattern))
    built["nemotron 3 nano, Mamba blocks only"] = mamba_only
    inputs = {name: P.from_config(cfg, 32) for name, cfg in built.items()}
    for a in ASSUMPTION_TABLE:
        holds = {name: a.holds(*i) for name, i in inputs.items()}
        assert any(holds.values()), f"{a.name}: no real recipe makes it apply"
        assert a.name in UNIVERSAL or not all(holds.values()), f"{a.name}: every recipe makes it apply"


@pytest.mark.bridge
def test_a_dense_recipes_plan_fits_on_one_screen_and_names_what_applies(bridge):
    from conftest import mbmem
    out = mbmem("plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "80GiB")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert len(text) <= 3000, len(text)
    assert summary_of("allocated_only") in text and "capacity 80.0 GiB with a 5% margin -> fits" in text
    for absent in ("cuda_graphs", "graph_warmup", "lora_gemm_inputs", "fp8_transpose", "moe_balance", "mamba_kernel",
                   "muon", "megatron_fsdp", "activation_offload", "optimizer_offload"):
        assert summary_of(absent) not in text and text_of(absent) not in text, absent
    assert "memory lines to expect" in text and "peak of the last step: pipeline rank 0" in text
    full = mbmem("plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "80GiB",
                 "--assumptions")
    assert all(a in full.stdout for a in P.ASSUMPTIONS) and "Bridge's estimate_training_memory" in full.stdout
    data = json.loads(mbmem("plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "80GiB",
                            "--json").stdout)
    # the table's assumptions, then the job's own: the GPU it is planned for (the recipe's platform, or the default)
    assert data["assumptions"][:len(P.ASSUMPTIONS)] == list(P.ASSUMPTIONS)
    assert text_of("allocated_only") in data["assumptions_applying"]
    assert text_of("cuda_graphs") not in data["assumptions_applying"] and data["fit_verdict"] == "fits"


@pytest.mark.bridge
def test_an_unmodelled_dispatcher_backend_is_unknown_in_plan_search_and_recommend(bridge):
    """Bridge's qwen3_30b_a3b H100 perf recipe uses the flex dispatcher; with its NCCL EP backend, which the plan
    does not model, each command says "unknown", --json carries fit_verdict "unknown", and each exits 4, not as a
    rejection."""
    from conftest import mbmem
    name = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"
    common = ("--recipe", name, "--world-size", "16", "--gpu-memory", "80GiB",
              "--set", "model.moe_flex_dispatcher_backend=ncclep")
    out = mbmem("plan", *common)
    assert out.returncode == EXIT_UNKNOWN, out.stderr[-2000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("capacity "))
    assert "-> unknown: model.moe_flex_dispatcher_backend=ncclep not modelled" in line
    data = json.loads(mbmem("plan", *common, "--json").stdout)
    assert data["fit_verdict"] == "unknown" and data["fits"] is None and data["fit_range"]["open_ends"]
    assert [g["name"] for g in data["unmodelled"]] == ["model.moe_flex_dispatcher_backend"]
    rec = mbmem("recommend", *common, "--json")
    payload = json.loads(rec.stdout)
    assert rec.returncode == EXIT_UNKNOWN and payload["fit_verdict"] == "unknown" and payload["ok"] is False
    assert all(s.get("fits") is None for s in payload["steps"] if "total_bytes" in s)
    found = mbmem("plan", *common, "--search", "--top", "1", "--json")
    results = json.loads(found.stdout)
    assert found.returncode == EXIT_UNKNOWN and all(r["fit_verdict"] == "unknown" for r in results["results"])
    # the modelled backends (HybridEP, as shipped) give a known verdict
    assert json.loads(mbmem("plan", *common[:6], "--json").stdout)["fit_verdict"] != "unknown"


@pytest.mark.bridge
def test_a_megatron_lm_job_gets_the_same_verdict_in_its_own_flags(bridge):
    """gpt_small.sh sets --delay-wgrad-compute, which can only add memory: a floor that fits is unknown (exit 4), a
    floor over the limit does not fit (exit 1), and both name the flag."""
    from conftest import mbmem
    job = str(Path(__file__).parent / "fixtures" / "megatron_args" / "gpt_small.sh")
    roomy = mbmem("plan", "--megatron-args", job, "--gpu-memory", "80GiB")
    assert roomy.returncode == EXIT_UNKNOWN, roomy.stderr[-2000:]
    assert "verdict: unknown: --delay-wgrad-compute not modelled (it can only add memory); the modelled part, " \
        in roomy.stdout and "is a floor" in roomy.stdout
    tight = mbmem("plan", "--megatron-args", job, "--gpu-memory", "1GiB")
    assert tight.returncode == EXIT_REJECTED
    assert "verdict: does NOT fit; not modelled: --delay-wgrad-compute, which can only add memory" in tight.stdout


@pytest.mark.bridge
def test_doctor_plan_says_a_changes_fit_is_unknown_where_the_job_is_not_modelled(bridge):
    from conftest import mbmem
    log = str(Path(__file__).parent / "fixtures" / "runs" / "bridge_over_provisioned_recompute_offload.log")
    out = mbmem("doctor", log, "--plan", "--set", "model.heterogeneous_block_specs=true", "--json")
    d = json.loads(out.stdout)
    assert out.returncode == 0 and "NOT MODELLED: model.heterogeneous_block_specs=True" in d["run"]["plan_status"]
    priced = [r for r in d["remedies"] if r.get("predicted_peak_bytes") is not None]
    assert priced and all(r["fits"] is None and r["fit"] == "unknown" for r in priced)
    assert all(r["fit_verdict"].startswith("unknown: model.heterogeneous_block_specs=True not modelled") for r in priced)
    assert d["next_command"] and "unknown: model.heterogeneous_block_specs=True" in d["command_check"]
    text = mbmem("doctor", log, "--plan", "--set", "model.heterogeneous_block_specs=true").stdout
    assert "fit unknown: model.heterogeneous_block_specs=True not modelled" in text and "fits with the margin" not in text

"""mbmem recommend and plan --search: what they print is real.

Every printed command keeps the user's recipe, --set words and overlays, has passed our rules and
Bridge's validation, and runs as printed (pasted into a shell: train.py dry run, exit 0). The ladder
covers what users reach for, without duplicate steps. Argument errors come before the Bridge import,
and --json always prints one object with schema_version. The plot's labels never overlap.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest

from mbmem_overlays.cli import build_parser, main
from mbmem_overlays.core.sizes import parse_size
from mbmem_overlays.memory import model as P

from conftest import ROOT
from conftest import paste as conftest_paste

L8 = "llama3_8b_pretrain"


def cli_json(capsys, *argv) -> tuple[int, dict]:
    """Run ``mbmem`` in this process (Bridge is imported once per test session) and read its JSON."""
    capsys.readouterr()
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def paste(command: str, timeout: int = 600):
    """What a user does with a printed command: paste it into a shell at the repository root. A real bash parses
    it (quotes, ``&&``, variables); the ``python train.py ...`` it starts runs in this process (conftest.paste)."""
    return conftest_paste(command, timeout=timeout)


def words(command: str) -> list[str]:
    return shlex.split(command)


# ----------------------------------------------------------------------------- checks before Bridge
def checked(*argv):
    from mbmem_overlays.cli.plan import checked_args
    args = build_parser().parse_args(["recommend", "--recipe", L8, *argv])
    return checked_args(args, capacity_required="for the test")


@pytest.mark.parametrize("text, expected", [("80G", 80e9), ("80GB", 80e9), ("80 GiB", 80 * 2**30),
                                            ("85899345920", 85899345920)])
def test_gpu_memory_spellings_are_accepted(text, expected):
    assert checked("--world-size", "8", "--gpu-memory", text)["capacity"] == expected


@pytest.mark.parametrize("argv, field", [
    (["--world-size", "8", "--gpu-memory", "abc"], "--gpu-memory"),
    (["--world-size", "8", "--gpu-memory", "1.2.3GiB"], "--gpu-memory"),
    (["--world-size", "8", "--gpu-memory", "nan"], "--gpu-memory"),
    (["--world-size", "0", "--gpu-memory", "80GiB"], "--world-size"),
    (["--world-size", "-1", "--gpu-memory", "80GiB"], "--world-size"),
    (["--world-size", "8", "--gpu-memory", "80GiB", "--plot", "/nonexistent/p.png"], "--plot"),
    (["--world-size", "8"], "--gpu-memory"),
])
def test_bad_arguments_are_usage_errors_naming_the_option(argv, field):
    from mbmem_overlays.cli.common import UsageError
    with pytest.raises(UsageError) as exc:
        checked(*argv)
    assert [p.field for p in exc.value.problems] == [field]


def test_usage_errors_come_before_the_bridge_import_and_as_json():
    """A subprocess, so that sys.modules tells whether Bridge (or torch) was imported."""
    script = ("import sys; from mbmem_overlays.cli import main; "
              "rc = main(sys.argv[1:]); "
              "print('IMPORTED', 'megatron.bridge' in sys.modules or 'torch' in sys.modules, file=sys.stderr); "
              "sys.exit(rc)")
    for command in (["recommend", "--world-size", "0", "--gpu-memory", "abc", "--plot", "/nonexistent/p.png"],
                    ["plan", "--search", "--world-size", "-1", "--gpu-memory", "1.2.3GiB"]):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", script, *command, "--recipe", L8, "--json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "IMPORTED False" in out.stderr
        d = json.loads(out.stdout)
        assert d["schema_version"] == 1 and d["ok"] is False and d["exit_code"] == 2 and d["error"]
        assert {p["field"] for p in d["problems"]} >= {"--world-size", "--gpu-memory"}
        assert time.monotonic() - t0 < 20  # the Bridge import alone takes 20-30 s


# ----------------------------------------------------------------------------- the plot
def test_plot_labels_never_overlap_and_show_capacity_and_fit(tmp_path):
    from mbmem_overlays.core.outfile import figure_bytes
    from mbmem_overlays.memory.steps import draw_bars
    gib = 2**30
    rows = [(f"step {i}: a long layout name TP{2**i} PP4 VPP5 CP2 DP2 [selective_recompute, dist_optimizer]",
             P.Breakdown(8 * gib, 12 * gib, (20 - 2 * i) * gib, (40 - 6 * i) * gib, 0.4 * gib)) for i in range(6)]
    fig = draw_bars(rows, title="test", capacity=80 * gib, margin=0.05)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text()] + [t for t in ax.get_yticklabels() if t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, a in enumerate(boxes):
        for j, b in enumerate(boxes[:i]):
            assert not a.overlaps(b), f"{texts[i].get_text()!r} overlaps {texts[j].get_text()!r}"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"parameters", "gradients", "optimizer", "activations", "other"} <= set(legend)
    assert any(t.startswith("GPU capacity 80.0 GiB") for t in legend)
    verdicts = [t.get_text() for t in ax.texts if "GiB" in t.get_text()]
    assert any(v.endswith("does not fit") for v in verdicts) and any(v.endswith(" fits") for v in verdicts)
    colors = {p.get_facecolor() for p in ax.patches if p.get_height() > 0 and p.get_fill()}
    assert len(colors) >= 5  # one colour per component
    png = figure_bytes(draw_bars(rows, title="test", capacity=80 * gib, margin=0.05), "bars.png")
    assert png[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- the ladder
@pytest.mark.bridge
def test_ladder_covers_sp_mlp_full_recompute_and_optimizer_offload_without_duplicates(bridge, capsys):
    """A capacity nothing reaches, so every rung is tried: each taken step says what it changes and saves."""
    rc, rec = cli_json(capsys, "recommend", "--recipe", L8, "--world-size", "8", "--gpu-memory", "4GiB",
                       "--set", "model.tensor_model_parallel_size=2")
    assert rc == 1 and rec["schema_version"] == 1 and rec["fits"] is False
    taken = [s for s in rec["steps"][1:] if "skipped" not in s]
    names = [s["step"] for s in taken]
    assert "sequence_parallel" in names
    assert "selective_recompute core_attn,mlp" in names
    assert any(n.startswith("full_recompute method=") and "num_layers=" in n for n in names)
    assert any(n.startswith("optimizer_offload fraction=") for n in names)
    for s in taken:
        assert s["changes"] and s["saving_bytes"] > 0 and s["cost"] and "PASSED" in s["validation"]
    changes = [json.dumps(s["changes"], sort_keys=True) for s in taken]
    assert len(changes) == len(set(changes)), "two steps make the same change"
    tp = next(s for s in rec["steps"] if s["step"] == "TP x2")
    assert tp["skipped"] == "you set model.tensor_model_parallel_size yourself"
    assert words(rec["command"])[2:4] == ["recipe=llama3_8b_pretrain", "model.tensor_model_parallel_size=2"]


@pytest.mark.bridge
def test_ladder_keeps_the_users_overlays_and_their_parameters(bridge, capsys):
    rc, rec = cli_json(capsys, "recommend", "--recipe", L8, "--world-size", "8", "--gpu-memory", "60GiB",
                       "--overlay", "recompute", "--set", "mem.recompute.modules=[core_attn]",
                       # issue 31's FSDP step would fit first: kept off, so the ladder reaches the wider recompute
                       "--set", "ddp.use_megatron_fsdp=false")
    taken = [s for s in rec["steps"] if "skipped" not in s]
    assert all("selective_recompute" in s["overlays"] for s in taken)
    wider = next(s for s in rec["steps"] if s["step"].startswith("selective_recompute (wider)"))
    assert "mem.selective_recompute.modules" in wider["skipped"]
    w = words(rec["command"])
    assert "mem.recompute.modules=[core_attn]" in w and any(x.startswith("+mem=[selective_recompute") for x in w)


# ----------------------------------------------------------------------------- the search
@pytest.mark.bridge
def test_search_drops_what_validation_rejects_and_keeps_going(bridge, recipe, capsys):
    """GBS 6 on 8 GPUs: the model alone ranks DP-4 layouts first, which Bridge refuses (6 % 4)."""
    from mbmem_overlays.memory.search import search
    cfg = recipe("llama3_8b_pretrain_config", "train.global_batch_size=6")
    model_only, _, _ = search(cfg, 8, parse_size("80GiB"), top=3)
    assert any(r["dp"] == 4 for r in model_only)  # what used to be printed
    rc, found = cli_json(capsys, "plan", "--recipe", L8, "--world-size", "8", "--gpu-memory", "80GiB", "--search",
                         "--top", "3", "--set", "train.global_batch_size=6")
    assert rc == 0 and found["schema_version"] == 1 and len(found["results"]) == 3
    assert found["dropped"] > 0 and "divisible" in found["dropped_reasons"][0]["reason"]
    for r in found["results"]:
        assert 6 % r["dp"] == 0 and "PASSED" in r["validation"]
        assert words(r["command"])[2:4] == ["recipe=llama3_8b_pretrain", "train.global_batch_size=6"]


@pytest.mark.bridge
def test_search_pins_the_layout_fields_the_user_set(bridge, capsys):
    rc, found = cli_json(capsys, "plan", "--recipe", L8, "--world-size", "8", "--gpu-memory", "80GiB", "--search",
                         "--top", "3", "--set", "model.tensor_model_parallel_size=2", "--overlay", "dist_optimizer")
    assert rc == 0 and found["results"]
    for r in found["results"]:
        assert r["tp"] == 2 and "dist_optimizer" in r["overlays"]
        w = words(r["command"])
        tp_words = [x for x in w if x.startswith("model.tensor_model_parallel_size=")]
        assert tp_words == ["model.tensor_model_parallel_size=2"]  # the user's word, and no second one


@pytest.mark.bridge
def test_search_text_prints_each_results_saving(bridge, capsys):
    from mbmem_overlays.cli import main
    assert main(["plan", "--recipe", L8, "--world-size", "8", "--gpu-memory", "80GiB", "--search", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [i for i, ln in enumerate(lines) if " GiB  saves " in ln]
    # each result's next line is its cost from the cost model: a step-time range and the GPU it is priced on
    assert len(rows) == 2 and all(lines[i + 1].strip().startswith("cost: ") and "step time" in lines[i + 1]
                                  and "H100/H200" in lines[i + 1] for i in rows), lines


# ----------------------------------------------------------------------------- paste what was printed
@pytest.mark.bridge
def test_printed_commands_run_as_pasted(bridge, capsys):
    """The recommendation and the cheapest search result, each pasted into a shell: train.py dry-runs it,
    our rules and Bridge's validation pass, exit 0. (Each paste imports Bridge anew: ~40 s.)"""
    # the recipe's own 128256-token vocabulary, not its NullTokenizer's 32000 (Bridge's setup would use the
    # tokenizer's): the larger logits make the ladder need a recompute step with a parameter
    # bf16 moments kept off, so that the step that fits has a parameter (the cheapest that fits, by the cost model:
    # optimizer offload's fraction, Megatron FSDP's strategy or the recompute modules)
    rc, rec = cli_json(capsys, "recommend", "--recipe", L8, "--world-size", "8", "--gpu-memory", "80G",
                       "--set", "train.train_iters=20", "--set", "tokenizer.use_tokenizer_vocab_size=false",
                       "--set", "optimizer.use_precision_aware_optimizer=false")
    assert rc == 0 and rec["fits"]
    assert any(w.startswith(("mem.megatron_fsdp.strategy=", "mem.optimizer_offload.fraction="))
               or w == "mem.selective_recompute.modules=[core_attn,mlp]"
               for w in words(rec["command"])), rec["command"]   # a parameter the ladder chose
    rc, found = cli_json(capsys, "plan", "--recipe", "llama3_8b_peft", "--world-size", "8", "--gpu-memory", "30GiB",
                         "--search", "--top", "1", "--overlay", "recompute", "--set", "mem.recompute.modules=[core_attn]",
                         "--set", "train.train_iters=20")
    assert rc == 0 and found["results"]
    assert "'mem.recompute.modules=[core_attn]'" in found["results"][0]["command"]  # the user's alias, verbatim
    for command in (rec["command"], found["results"][0]["command"]):
        assert command.startswith("python train.py recipe=") and command.endswith("run.dry_run=true")
        out = paste(command)
        assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert "validation: PASSED" in out.stdout, out.stdout[-3000:]


# ----------------------------------------------------------------------------- issue 25: no empty steps
@pytest.mark.bridge
def test_a_rung_that_saves_nothing_is_listed_apart_never_printed_as_a_step(bridge, recipe):
    """DP x CP = 1 with the distributed optimizer off: that rung has nothing to shard. A capacity nothing reaches,
    so every rung is tried; no printed step saves less than the ladder's minimum (expandable segments aside:
    its saving, fragmentation, is outside the allocated-memory plan)."""
    from mbmem_overlays.memory.ladder import MIN_SAVING, SAVES_NOTHING, recommend, render_recommendation
    from mbmem_overlays.memory.steps import Start
    sets = ("model.tensor_model_parallel_size=2", "model.context_parallel_size=1",
            "optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false")
    cfg = recipe("llama3_8b_pretrain_config", *sets)
    start = Start(L8, sets, locked={s.split("=")[0]: s.split("=")[1] for s in sets})
    rec = recommend(cfg, 2, parse_size("4GiB"), start=start)
    taken = [s for s in rec["steps"][1:] if "skipped" not in s]
    assert taken and all(s["saving_bytes"] >= MIN_SAVING for s in taken if s["step"] != "expandable_segments")
    dist = next(s for s in rec["steps"] if s["step"] == "dist_optimizer")
    assert dist["kind"] == SAVES_NOTHING and "DP x CP is 1" in dist["skipped"]
    text = render_recommendation(rec)
    listed = [line for line in text.splitlines() if line.strip().startswith("skipped: saves nothing here:")]
    assert len(listed) == 1 and "dist_optimizer (DP x CP is 1" in listed[0]
    assert not any(line.lstrip(" -*").startswith("dist_optimizer ") for line in text.splitlines())
    assert rec["fit_verdict"].startswith("does NOT fit")


@pytest.mark.bridge
def test_full_recompute_block_is_a_step_when_it_saves(bridge, recipe):
    """README's ladder: full recompute `block` over the fewest layers that fit comes before `uniform`/1."""
    from mbmem_overlays.memory.ladder import recommend
    # issue 31's levers come before full recompute on the ladder (FSDP alone would fit here): the user keeps them off
    rec = recommend(recipe("llama3_8b_pretrain_config", "tokenizer.use_tokenizer_vocab_size=false"), 8,
                    parse_size("40GiB"), recipe=L8, locked=LEVERS_OFF)
    block = next(s for s in rec["steps"] if s["step"].startswith("full_recompute method=block"))
    assert "skipped" not in block and block["saving_bytes"] > 0 and block["fits"]
    assert {"target": "model.recompute_method", "old": None, "new": "block"} in block["changes"]
    assert "mem.full_recompute.method=block" in rec["command"]
    assert not any(s["step"].startswith("full_recompute method=uniform") for s in rec["steps"])  # block fitted


@pytest.mark.bridge
def test_a_rejection_names_the_field_that_caused_it(bridge, capsys):
    """LoRA with CP > 1: Bridge refuses finetuning with CP > 1 unless calculate_per_token_loss is set. The search
    names model.context_parallel_size, not the overlays that happened to be applied."""
    # --top 3: issue 31's FSDP + offloading rows are cheaper than halving DP for CP 2 and pass first
    rc, found = cli_json(capsys, "plan", "--recipe", "llama3_8b_peft", "--world-size", "8", "--gpu-memory", "20GiB",
                         "--search", "--top", "3")
    reasons = [d["reason"] for d in found["dropped_reasons"]]
    assert rc == 0 and any(r.startswith("model.context_parallel_size=2: ") for r in reasons), reasons
    assert not any("applied:" in r for r in reasons)
    for r in found["results"]:   # each suggested layout carries the plan's saving and verdict
        assert r["saving_bytes"] > 0 and r["fit_verdict"].startswith("fits")


@pytest.mark.bridge
def test_the_search_never_offers_an_overlay_that_saves_nothing(bridge, recipe):
    """At DP x CP = 1 the distributed optimizer shards nothing: it appears only as optimizer offload's
    prerequisite. In general no row keeps an overlay whose removal leaves its footprint unchanged."""
    from mbmem_overlays.memory.search import MIN_SAVING, _refused, _settings, search
    cfg = recipe("llama3_8b_pretrain_config", "optimizer.use_distributed_optimizer=false",
                 "ddp.use_distributed_optimizer=false")
    rows, _, _ = search(cfg, 8, parse_size("80GiB"), top=None)
    shape, base_lay, base_st = P.from_config(cfg, 8)
    single = [r for r in rows if r["dp"] * r["cp"] == 1]
    assert single and all("dist_optimizer" not in r["overlays"] or "optimizer_offload" in r["overlays"]
                          for r in single)
    assert not any({"dist_optimizer", "megatron_fsdp"} <= set(r["overlays"]) for r in rows)   # FSDP implies it
    for r in rows[:200]:
        lay = replace_layout(base_lay, r)
        total = P.estimate(shape, lay, _settings(base_st, set(r["overlays"]), shape)).footprint
        for o in r["overlays"]:
            rest = set(r["overlays"]) - {o}
            if not _refused(rest, r["pp"], r["tp"], base_st.dist_optimizer):
                assert P.estimate(shape, lay, _settings(base_st, rest, shape)).footprint > total + MIN_SAVING


LEVERS_OFF = {"ddp.use_megatron_fsdp": False, "optimizer.use_precision_aware_optimizer": False,
              "model.fine_grained_activation_offloading": False, "optimizer.optimizer_cpu_offload": False}


# ----------------------------------------------------------------------------- issue 31: the levers on the ladder
@pytest.mark.bridge
def test_recommend_reaches_megatron_fsdp_where_dp_is_large_and_the_distributed_optimizer_is_not_enough(bridge,
                                                                                                     capsys):
    """Llama3-8B on 8 GPUs at DP 8: the distributed optimizer is already on and bf16 moments are not enough; Megatron
    FSDP is the first step that fits (before `mlp` recompute, PP doubling and offloading) and the cheapest of those
    that fit by the cost model; its cost is priced for the job, with the documented words beside it."""
    rc, rec = cli_json(capsys, "recommend", "--recipe", L8, "--world-size", "8", "--gpu-memory", "55GiB",
                       "--set", "model.context_parallel_size=1")
    assert rc == 0 and rec["fits"], rec
    taken = [s for s in rec["steps"][1:] if "skipped" not in s]
    assert taken[-1]["step"].startswith("megatron_fsdp strategy=") and taken[-1]["fits"]
    assert not any(s["fits"] for s in taken[:-1])
    assert [s["step"] for s in taken[:-1]][-1] == "precision_aware_optimizer"   # the cheap optimizer step first
    fsdp = taken[-1]
    assert fsdp["saving_bytes"] > 20 * 2**30 and "all-gathers each layer's weights" in fsdp["documented"]
    # priced: its all-gathers and reduce-scatters on NVLink (DP 8 in one node), a range, cheaper than what else fits
    assert fsdp["cost"]["bytes_per_link"]["nvlink"] > 0 and fsdp["cost"]["low"] <= fsdp["cost"]["high"]
    assert fsdp["alternatives"] and all(a["cost"]["rank_key"] >= fsdp["cost"]["rank_key"]
                                        for a in fsdp["alternatives"])
    assert {"target": "ddp.use_megatron_fsdp", "old": False, "new": True} in fsdp["changes"]
    assert "PASSED" in fsdp["validation"] and "megatron_fsdp]" in rec["command"]
    assert any(w.startswith("mem.megatron_fsdp.strategy=") for w in words(rec["command"]))


@pytest.mark.bridge
def test_recommend_reaches_fine_grained_offloading_where_activations_dominate(bridge, capsys):
    """The same model with PP and the recompute modules pinned by the user: after FSDP, activations are the largest
    component and module-level offloading (which works with recompute and PP > 1) is the first step that fits; its
    cost names the host memory per GPU and per node. (Optimizer offload, cheaper by the cost model at this batch, is
    kept off by the user.)"""
    rc, rec = cli_json(capsys, "recommend", "--recipe", L8, "--world-size", "8", "--gpu-memory", "45GiB",
                       "--set", "model.context_parallel_size=1", "--set", "model.pipeline_model_parallel_size=1",
                       "--overlay", "selective_recompute", "--set", "mem.selective_recompute.modules=[core_attn]",
                       "--set", "optimizer.optimizer_cpu_offload=false")
    assert rc == 0 and rec["fits"], rec
    taken = [s for s in rec["steps"][1:] if "skipped" not in s]
    assert [s["step"].split(" ")[0] for s in taken][-3:] == ["precision_aware_optimizer", "megatron_fsdp",
                                                            "fine_grained_offload"]
    offload = taken[-1]
    assert offload["fits"] and not any(s["fits"] for s in taken[:-1]) and offload["saving_bytes"] > 2**30
    assert "per GPU" in offload["documented"] and "per node of 8 GPUs" in offload["documented"]
    assert offload["cost"]["bytes_per_link"]["host"] > 0   # its copies over PCIe, priced
    assert {"target": "model.fine_grained_activation_offloading", "old": False, "new": True} in offload["changes"]
    assert "core_attn" in offload["step"]     # attn_proj needs it, although its recompute bypasses its own offload
    assert "PASSED" in offload["validation"]
    assert "'mem.fine_grained_offload.modules=" in rec["command"]


def replace_layout(lay, row):
    from dataclasses import replace
    return replace(lay, tp=row["tp"], pp=row["pp"], vpp=row["vpp"], cp=row["cp"], sp=row["sp"])


# ----------------------------------------------------------------------------- a fitting job pays for no step it does not need
@pytest.mark.bridge
def test_a_step_the_fitting_job_no_longer_needs_is_dropped(bridge, recipe):
    """Llama 3 8B at 40 GiB: the ladder takes selective recompute (it saves almost nothing with fused attention) and
    bf16 moments while nothing fits, then Megatron FSDP fits on its own: neither earlier step stays in the command,
    and what is left still fits and is validated."""
    from mbmem_overlays.memory.ladder import recommend, render_recommendation
    rec = recommend(recipe("llama3_8b_pretrain_config"), 8, parse_size("40GiB"), recipe=L8)
    dropped = [s["step"] for s in rec["steps"] if s.get("dropped")]
    assert "selective_recompute" in dropped
    assert rec["fits"] is True and "megatron_fsdp" in rec["overlays"]
    assert not set(dropped) & set(rec["overlays"]) and "selective_recompute" not in rec["command"]
    assert all(s["dropped"]["total_bytes"] <= rec["capacity_bytes"] * (1 - rec["margin"])
               for s in rec["steps"] if s.get("dropped"))
    assert "dropped: the job fits without it" in render_recommendation(rec)


def test_a_step_is_taken_out_only_where_no_later_step_changed_what_it_set():
    """_without_step: the step's overlays, parameters and fields go, the fields back to what they were; where a
    later step changed the same field or overlay, taking it out would undo part of that step, so it stays."""
    from mbmem_overlays.memory.ladder import _without_step
    from mbmem_overlays.memory.steps import Candidate
    c0 = Candidate(("expandable_segments",))
    c1 = c0.plus("selective_recompute", params={"modules": ["core_attn"]})
    c2 = c1.plus(sets={"model.micro_batch_size": 1})
    c3 = c2.plus("megatron_fsdp", params={"strategy": "optim_grads_params"})
    out = _without_step(c3, c0, c1)
    assert out.overlays == ("expandable_segments", "megatron_fsdp") and "selective_recompute" not in out.params
    assert out.sets == {"model.micro_batch_size": 1}
    assert _without_step(c3, c1, c2).sets == {} and _without_step(c3, c1, c2).overlays == c3.overlays
    later = c3.plus(sets={"model.micro_batch_size": 2})           # a later step set the same field again
    assert _without_step(later, c1, c2) is None
    widened = c3.plus("selective_recompute", params={"modules": ["core_attn", "mlp"]})
    assert _without_step(widened, c0, c1) is None                 # a later step widened the same overlay
    assert _without_step(c3, c1, c1) is None                      # a step that added nothing: nothing to take out


# ----------------------------------------------------------------------------- the world size a recipe is named for
@pytest.mark.bridge
def test_without_world_size_a_recipe_is_planned_at_the_gpu_count_of_its_name(bridge, capsys):
    """llama3_70b_sft is Bridge's llama3_70b_sft_32gpu_h100_bf16_config: 32 GPUs, said in the assumptions; a recipe
    whose layout does not run on its name's count, or whose name has none, asks for --world-size (exit 2)."""
    from mbmem_overlays.bridge.recipes import named_world_size, recipe_world_size
    rc, d = cli_json(capsys, "plan", "--recipe", "llama3_70b_sft", "--gpu-memory", "80GiB")
    assert rc == 0 and d["world_size"] == 32 and d["layout"]["tp"] * d["layout"]["pp"] * d["layout"]["dp"] == 32
    assert any("world size 32: the 32gpu in the name" in a for a in d["assumptions"])
    rc, r = cli_json(capsys, "recommend", "--recipe", "llama3_8b_pretrain", "--gpu-memory", "200GiB")
    assert rc == 0 and r["world_size"] == 2
    from types import SimpleNamespace as NS
    m = NS(tensor_model_parallel_size=4, pipeline_model_parallel_size=1, context_parallel_size=1)
    assert recipe_world_size(["x.y_6gpu_h100_config"], m)[0] == 4
    world, why = named_world_size("llama3_8b_pretrain", NS(tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                                                           context_parallel_size=1))
    assert world is None and "smallest world it allows is 16" in why
    assert main(["plan", "--recipe", "llama3_8b_pretrain", "--set", "model.tensor_model_parallel_size=4",
                 "--set", "model.pipeline_model_parallel_size=4", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert "--world-size is required for llama3_8b_pretrain" in json.dumps(err)

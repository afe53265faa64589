"""bench/plan_corpus.py: reading Megatron-LM's functional-test layout (on fixtures written here, in our own words
and numbers), planning a case from its own arguments, and a fast subset of the real corpus when the shared copy is
there (skipped with the reason where it is not). The whole corpus runs in the bench, not here."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "corpus"


def _bench():
    spec = importlib.util.spec_from_file_location("plan_corpus", REPO / "bench" / "plan_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plan_corpus", module)   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


B = _bench()
LAST_LINE = re.compile(r"^corpus: \d+ in scope, \d+ within 5%, median \d+\.\d%, worst [+-]\d+\.\d% \(\S+\)$")


def test_a_case_is_read_with_its_last_peak_world_size_and_script():
    cases = {c.name: c for c in B.load_cases(FIXTURE)}
    tiny = cases["tiny_tp2_dropout"]
    # the last step with a number ("nan" at 15 is skipped): the high-water mark from the job's start
    assert (tiny.platform, tiny.step, tiny.figure) == ("dev_dgx_h100", 20, 251e6)
    assert (tiny.world, tiny.script) == (4, "pretrain_gpt.py")   # nodes 1 x gpus 4 from recipes/h100
    assert tiny.others == {"lts_dgx_a100": (10, 240e6)}           # another recording, not the case's figure
    assert B.scope_reason(tiny) == ""
    assert B.scope_reason(cases["tiny_t5"]) == "T5/BERT"


def test_a_folder_of_neither_layout_is_refused(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="neither a corpus copy"):
        B.corpus_dirs(tmp_path)
    assert B.main(["--corpus", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_megatron_lm_checkout_layout_is_read(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    (checkout / "tests" / "functional_tests").mkdir(parents=True)
    (checkout / "tests" / "test_utils").mkdir(parents=True)
    (checkout / "tests" / "functional_tests" / "test_cases").symlink_to(FIXTURE / "test_cases")
    (checkout / "tests" / "test_utils" / "recipes").symlink_to(FIXTURE / "recipes")
    assert {c.name for c in B.load_cases(checkout)} == {"tiny_tp2_dropout", "tiny_t5"}


def test_the_summary_counts_reasons_and_ends_with_the_corpus_line():
    cases = {c.name: c for c in B.load_cases(FIXTURE)}
    inside = B.Result(cases["tiny_tp2_dropout"], plan=260e6, features=("dropout",))
    out = B.Result(cases["tiny_t5"], reason="T5/BERT")
    lines = B.summary([inside, out])
    assert "     1  T5/BERT" in lines
    assert lines[-1] == "corpus: 1 in scope, 1 within 5%, median 3.6%, worst +3.6% (gpt/tiny_tp2_dropout)"
    assert LAST_LINE.match(lines[-1])


@pytest.mark.bridge
def test_a_fixture_case_is_planned_from_its_own_arguments(bridge):
    pytest.importorskip("mbmem_overlays.bridge.megatron_args", reason="needs the Megatron-LM arguments input")
    case = next(c for c in B.load_cases(FIXTURE) if c.name == "tiny_tp2_dropout")
    r = B.plan_case(case)
    assert r.reason == "", r.reason
    assert "dropout" in r.features and "distributed optimizer" not in r.features
    assert r.plan > 0 and r.phase in ("steady 1F1B", "optimizer step")


# A fast subset of the real corpus: small GPT/MoE cases on H100 (seconds each once Bridge is imported).
SUBSET = ("gpt/gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute",   # full recompute
          "gpt/gpt3_mcore_te_tp1_pp4_vp1",                                        # unfused attention, VPP
          "moe/gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer")   # MoE, EP


@pytest.mark.bridge
@pytest.mark.skipif(not B.DEFAULT_CORPUS.is_dir(), reason=f"the corpus copy is not at {B.DEFAULT_CORPUS}")
def test_a_subset_of_the_corpus_is_planned_within_the_goal(bridge):
    pytest.importorskip("mbmem_overlays.bridge.megatron_args", reason="needs the Megatron-LM arguments input")
    cases = {f"{c.family}/{c.name}": c for c in B.load_cases(B.DEFAULT_CORPUS)}
    chosen = [cases[name] for name in SUBSET if name in cases]
    assert chosen, "none of the subset's cases is in the corpus copy"
    results = [B.plan_case(c) for c in chosen]
    for r in results:
        assert r.reason == "", f"{r.case.name}: {r.reason}"
        assert abs(r.err) <= 15, B.case_line(r)
    assert LAST_LINE.match(B.summary(results)[-1])

"""Property-based agreement with Bridge's own validation.

Hypothesis drives the same generator as bench/agreement.py (which runs 2,000 cases); CI runs a fixed,
derandomized set. Every case must agree with Bridge: where we are stricter, only rules Bridge does not enforce
(runtime, docs, composition) may say no, and a Bridge rejection no rule of ours names is a disagreement.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mbmem_overlays.bridge import differential
from mbmem_overlays.bridge.differential import Case, evaluate, generate
from mbmem_overlays.core import rules
from mbmem_overlays.core.catalog import Catalog

pytestmark = pytest.mark.bridge
CATALOG = Catalog()
ALLOWED_STRICTER = set(rules.doc_only_checks()) | {"claims", "field_exists", "param", "env", "field_type"}


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_verdicts_agree_with_bridge(bridge, rng):
    outcome = evaluate(generate(rng, CATALOG), CATALOG)
    assert outcome.verdict != "disagree", (
        f"{outcome.case.describe()}\n ours: {outcome.ours}\n oracle: {outcome.oracle_rule or outcome.oracle}")
    if outcome.verdict == "stricter" and "claims" not in outcome.ours:
        assert set(outcome.ours) <= ALLOWED_STRICTER, outcome.ours


def test_enforced_rules_name_their_oracle_message():
    for c in rules.CHECKS:
        if c.enforced_by in ("megatron-core", "bridge"):
            assert c.oracle, c.id


def test_a_missing_rule_shows_as_a_disagreement(bridge, monkeypatch):
    """The bench can fail: without the world-size rule, Bridge's rejection is unexplained and counted."""
    case = Case("llama3_8b_pretrain_config", 3, (("model.context_parallel_size", 2),), ())
    assert evaluate(case, CATALOG).verdict == "agree"
    monkeypatch.setattr(rules, "CHECKS", [c for c in rules.CHECKS if c.id != "world_size_divisible"])
    monkeypatch.setattr(differential.rules, "CHECKS", rules.CHECKS)
    from mbmem_overlays.core import engine
    monkeypatch.setattr(engine.rules, "CHECKS", rules.CHECKS)
    outcome = evaluate(case, CATALOG)
    assert outcome.verdict == "disagree" and outcome.unexplained, outcome
    summary = differential.summarize([outcome])
    assert summary["agree"] == 0 and summary["decided"] == 1 and len(summary["unexplained"]) == 1


def test_the_oracle_checks_the_config_the_engine_builds(bridge):
    """modules: auto resolves per architecture (MLA -> mla_up_proj); the oracle sees that value, not a stand-in."""
    case = Case("moonlight_16b_pretrain_config", 8, (("model.expert_model_parallel_size", 1),
                                                     ("model.cuda_graph_impl", "none")), ("selective_recompute",))
    cfg = differential.base_config(case)
    fields, _, _ = differential.prospective(cfg, case, CATALOG)
    assert fields["model.recompute_modules"] == ["mla_up_proj"]
    assert evaluate(case, CATALOG).verdict == "agree"


def test_generator_covers_what_users_run():
    rng = random.Random(0)
    cases = [generate(rng, CATALOG) for _ in range(400)]
    keys = {k for c in cases for k, _ in c.overrides}
    assert {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_shared_expert_overlap", "ddp.use_megatron_fsdp",
            "model.fine_grained_activation_offloading", "model.cuda_graph_modules", "model.attention_dropout"} <= keys
    assert {c.recipe for c in cases} == set(differential.RECIPES)
    assert any(c.env for c in cases) and any(p == "dist_optimizer.instances" for c in cases for p, _ in c.params)

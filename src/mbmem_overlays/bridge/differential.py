"""Differential testing: our verdict against Bridge's own validation of the same config.

A case is a real recipe plus a layout and memory settings plus a subset of overlays.
*Ours*: the engine's verdict (``plan_overlays``). *Oracle*: the same settings and
the overlays' fields written straight onto a fresh config (Hydra-like, last one
wins, our engine bypassed), then ``runtime_config_update``.

Verdicts per case:
- ``agree``: both accept, or the oracle rejects with rule X's message and we flag X.
- ``doc-only``: we reject only through rules Bridge does not enforce (listed by rule).
- ``disagree``: the oracle rejects with an enforced rule's message we did not flag,
  or we flag an enforced rule and the oracle accepts.
- ``out of scope``: the oracle stopped at a check that is not a memory rule (e.g. a
  CUDA-graph RNG requirement), before it could see ours.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..core import rules
from ..core.catalog import Catalog
from ..core.engine import plan_overlays, substitute
from ..core.errors import OverlayError
from ..core.paths import write
from .recipes import build_recipe
from .validation import validate_config

RECIPES = {  # name -> (layers, query groups): keeps TP and PP plausible for each model
    "llama3_8b_pretrain_config": (32, 8),
    "llama3_70b_pretrain_config": (80, 8),
    "llama3_8b_peft_config": (32, 8),
    "qwen3_8b_peft_config": (36, 8),
    "qwen3_30b_a3b_pretrain_config": (48, 4),
    "moonlight_16b_pretrain_config": (27, 16),
}
LABELS = sorted(rules.recompute_labels()) + ["attn_everything"]  # one invalid label on purpose
PRESETS = ("bf16_mixed", "bf16_with_fp8_delayed_scaling_mixed", "bf16_with_fp8_current_scaling_mixed")


@dataclass(frozen=True)
class Case:
    recipe: str
    world_size: int
    overrides: tuple[tuple[str, Any], ...]
    overlays: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        sets = " ".join(f"{k}={v}" for k, v in self.overrides)
        ps = " ".join(f"mem.{k}={v}" for k, v in self.params)
        return f"{self.recipe} ws={self.world_size} {sets} +mem=[{','.join(self.overlays)}] {ps}".strip()


def generate(rng: random.Random, catalog: Catalog | None = None) -> Case:
    catalog = catalog or Catalog()
    recipe = rng.choice(list(RECIPES))
    layers, groups = RECIPES[recipe]
    tp = rng.choice([t for t in (1, 2, 4, 8) if groups % t == 0])
    pp = rng.choice((1, 1, 2, 4))
    vpp = rng.choice((None, 2, 4, 5)) if pp > 1 else None
    peft = "peft" in recipe
    cp = 1 if peft else rng.choice((1, 1, 2))  # Bridge: finetuning with CP>1 needs calculate_per_token_loss
    dp = rng.choice((1, 2))
    world = tp * pp * cp * dp + (1 if rng.random() < 0.05 else 0)
    o: dict[str, Any] = {
        "model.tensor_model_parallel_size": tp, "model.pipeline_model_parallel_size": pp,
        "model.virtual_pipeline_model_parallel_size": vpp, "model.context_parallel_size": cp,
        "model.sequence_parallel": rng.random() < 0.5,
    }
    if recipe.startswith("qwen3_30b") or recipe.startswith("moonlight"):
        o["model.expert_model_parallel_size"] = 1
        o["comm_overlap.overlap_moe_expert_parallel_comm"] = False  # needs EP>1 (Bridge comm_overlap.py:478)
    recompute = rng.choice(("none", "none", "selective", "full"))
    if recompute == "selective":
        o["model.recompute_granularity"] = "selective"
        o["model.recompute_modules"] = rng.sample(LABELS, rng.choice((1, 1, 2)))
    elif recompute == "full":
        o["model.recompute_granularity"] = "full"
        o["model.recompute_method"] = rng.choice(("uniform", "block"))
        o["model.recompute_num_layers"] = rng.choice((1, 2, 4))
    if rng.random() < 0.15 and not peft:  # packed-sequence PEFT recipes need extra graph padding settings
        o["model.cuda_graph_impl"] = rng.choice(("transformer_engine", "full_iteration"))
        if o["model.cuda_graph_impl"] == "full_iteration":  # Bridge's prerequisites (config.py:1370-1374, C:2463)
            o["rerun_state_machine.check_for_nan_in_loss"] = False
            o["model.cuda_graph_modules"] = []
    if rng.random() < 0.2:
        o["model.cpu_offloading"] = True
        o["model.cpu_offloading_num_layers"] = rng.choice((1, 2, layers - 1, layers))
    if rng.random() < 0.1:
        o["ddp.nccl_ub"] = True
    if rng.random() < 0.2:
        o["mixed_precision"] = rng.choice(PRESETS)
    if rng.random() < 0.1:
        o["optimizer.use_distributed_optimizer"] = False
        o["ddp.use_distributed_optimizer"] = False
    names = catalog.names()
    overlays = tuple(sorted(rng.sample(names, rng.choice((0, 1, 1, 2, 2, 3)))))
    params: list[tuple[str, Any]] = []
    if "cpu_offload" in overlays and rng.random() < 0.3:
        params.append(("cpu_offload.num_layers", rng.choice((1, layers - 1, layers))))
    if "selective_recompute" in overlays and rng.random() < 0.5:
        params.append(("selective_recompute.modules", rng.sample(LABELS, 1)))
    if "lora_sp_regather" in overlays:
        params.append(("lora_sp_regather.strict", rng.random() < 0.5))
    return Case(recipe, world, tuple(o.items()), overlays, tuple(params))


@dataclass
class Outcome:
    case: Case
    verdict: str                 # agree | doc-only | disagree | out of scope | unbuildable
    ours: tuple[str, ...] = ()   # our failing check ids
    oracle: str | None = None    # oracle error (None = accepted)
    oracle_rule: str | None = None
    detail: str = ""


def _oracle_rule(message: str) -> str | None:
    for c in rules.CHECKS:
        if c.oracle and any(f in message for f in c.oracle):
            return c.id
    return None


def _direct_config(case: Case, catalog: Catalog):
    """The same config with the overlays' fields written straight on, no engine (Hydra-style last wins)."""
    cfg = build_recipe(case.recipe)
    for path, value in case.overrides:
        write(cfg, path, value)
    given = dict(case.params)
    for name in case.overlays:
        spec = catalog.specs[name]
        params = {k: p.default for k, p in spec.params.items()}
        params.update({k.split(".", 1)[1]: v for k, v in given.items() if k.split(".", 1)[0] == name})
        if name == "selective_recompute" and params.get("modules") == "auto":
            params["modules"] = ["core_attn"]
        for path, value in spec.set.items():
            try:
                write(cfg, path, substitute(value, params))
            except AttributeError:  # e.g. peft is None: the field cannot exist on this recipe
                pass
    return cfg


def evaluate(case: Case, catalog: Catalog | None = None) -> Outcome:
    catalog = catalog or Catalog()
    enforced = {c.id for c in rules.CHECKS if c.enforced_by in ("megatron-core", "bridge")}
    try:
        cfg = build_recipe(case.recipe)
        for path, value in case.overrides:
            write(cfg, path, value)
    except Exception as exc:  # noqa: BLE001 — a case the recipe cannot take at all
        return Outcome(case, "unbuildable", detail=str(exc)[:200])
    ours: list[str] = []
    try:
        plan_overlays(cfg, case.overlays, env={}, params=dict(case.params), world_size=case.world_size,
                      catalog=catalog)
    except OverlayError as exc:
        ours = sorted({p.check or "composition" for p in exc.problems})
    result = validate_config(_direct_config(case, catalog), world_size=case.world_size, env={})
    if result.ok and not result.complete:  # the oracle could not decide on this host
        return Outcome(case, "out of scope", tuple(ours), "INCOMPLETE: " + result.not_checkable[-1], None)
    oracle = None if result.ok else (result.error or "")
    rule = _oracle_rule(oracle) if oracle else None
    ours_enforced = [c for c in ours if c in enforced]
    if "claims" in ours:
        # Two overlays claim one field: Hydra-style composition would silently keep the last,
        # so there is no single "same config" for the oracle. Refusing is our composition rule.
        verdict = "doc-only"
    elif oracle is None:
        verdict = "agree" if not ours else ("disagree" if ours_enforced else "doc-only")
    elif rule is not None:
        verdict = "agree" if rule in ours else "disagree"
    else:
        verdict = "out of scope"
    return Outcome(case, verdict, tuple(ours), oracle, rule)


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    counts = Counter(o.verdict for o in outcomes)
    decided = counts["agree"] + counts["disagree"]
    doc_rules = Counter(c for o in outcomes if o.verdict == "doc-only" for c in o.ours
                        if c not in {k.id for k in rules.CHECKS if k.enforced_by in ("megatron-core", "bridge")})
    matrix = Counter((o.oracle_rule or ("accepted" if o.oracle is None else "other"),
                      "rejected" if o.ours else "accepted") for o in outcomes)
    return {"counts": dict(counts), "agree": counts["agree"], "decided": decided,
            "doc_only_rules": dict(doc_rules), "matrix": dict(matrix),
            "disagreements": [o for o in outcomes if o.verdict == "disagree"]}

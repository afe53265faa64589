"""Differential testing: our verdict against Bridge's own validation of exactly the config the engine would build.

A case is a real recipe plus a layout, memory settings, a process environment and a subset of overlays.
*Ours*: the engine's verdict (``plan_overlays``). *Oracle*: the overlays' claims as the engine computes them
(YAML ``set`` with parameters, resolver output such as ``modules: auto``, the merged allocator environment)
written onto a fresh copy of the same config, then Bridge's ``runtime_config_update``.

Every case gets a verdict; nothing is set aside as "out of scope":
- ``agree``: both accept, or the oracle rejects with rule X's message and we flag X.
- ``stricter``: Bridge accepts and we reject only through rules Bridge does not enforce (docs/runtime rules,
  composition checks), or two overlays claim one field with different values (the engine refuses the request
  itself, so there is no single config to compare). Counted as agreement with our documented stance, listed by rule.
- ``disagree``: the oracle rejects with an enforced rule's message we did not flag, we flag an enforced rule the
  oracle accepts, or the oracle rejects with a message no rule of ours explains (a missing rule).
- ``incomplete``: Bridge's validation stopped at a check this host cannot run (needs Transformer Engine), so the
  oracle has no verdict; counted, never agreement.
- ``unbuildable``: the recipe refused the case's settings before any validation (a generator bug); counted.
"""

from __future__ import annotations

import copy
import functools
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..core import allocconf, rules
from ..core.catalog import Catalog
from ..core.engine import FieldClaim, View, plan_overlays, substitute
from ..core.errors import OverlayError
from ..core.paths import path_problem, write
from .recipes import build_recipe
from .validation import validate_config

# name -> (layers, query groups, kind): keeps TP and PP plausible for each model
RECIPES = {
    "llama3_8b_pretrain_config": (32, 8, "dense"),
    "llama3_70b_pretrain_config": (80, 8, "dense"),
    "llama3_8b_peft_config": (32, 8, "dense-lora"),
    "qwen3_8b_peft_config": (36, 8, "dense-lora"),
    "qwen3_30b_a3b_pretrain_config": (48, 4, "moe"),
    "qwen3_30b_a3b_peft_config": (48, 4, "moe-lora"),
    "moonlight_16b_pretrain_config": (27, 16, "mla"),
    "moonlight_16b_peft_config": (27, 16, "mla-lora"),
    "nemotron_3_nano_pretrain_config": (52, 2, "hybrid"),
    "nemotron_3_nano_peft_config": (52, 2, "hybrid-lora"),
}
LABELS = sorted(rules.recompute_labels()) + ["attn_everything"]  # one invalid label on purpose
PRESETS = ("bf16_mixed", "bf16_with_fp8_delayed_scaling_mixed", "bf16_with_fp8_current_scaling_mixed")
GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
OFFLOAD_MODULES = ("core_attn", "attn_proj", "expert_fc1", "moe_act", "attn_norm", "mlp_norm", "qkv_linear",
                   "fused_group_mlp", "bogus")
OPTIMIZER_DTYPES = ("fp32", "fp16", "bf16", "fp8")  # the precision_aware_optimizer overlay's dtype words
PROCESS_ENVS = (
    {},
    {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
    {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"},
    {"NVTE_CPU_OFFLOAD_V1": "1"},
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
)


@dataclass(frozen=True)
class Case:
    recipe: str
    world_size: int
    overrides: tuple[tuple[str, Any], ...]
    overlays: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        sets = " ".join(f"{k}={v}" for k, v in self.overrides)
        ps = " ".join(f"mem.{k}={v}" for k, v in self.params)
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return f"[{env}] {self.recipe} ws={self.world_size} {sets} +mem=[{','.join(self.overlays)}] {ps}".strip()


def generate(rng: random.Random, catalog: Catalog | None = None) -> Case:
    """A configuration of the kind users run, drawn so that each memory rule's trigger comes up regularly."""
    catalog = catalog or Catalog()
    recipe = rng.choice(list(RECIPES))
    layers, groups, kind = RECIPES[recipe]
    lora, moe = kind.endswith("lora"), kind.split("-")[0] in ("moe", "mla", "hybrid")
    tp = rng.choice([t for t in (1, 2, 4, 8) if groups % t == 0])
    pp = rng.choice((1, 1, 2, 4))
    vpp = rng.choice((None, 2, 3, 4)) if pp > 1 else None
    cp = 1 if lora else rng.choice((1, 1, 2))  # Bridge: finetuning with CP>1 needs calculate_per_token_loss
    ep = rng.choice((1, 2, 4)) if moe else 1
    dp = rng.choice((1, 2, 4)) * (ep if ep > 1 and rng.random() < 0.7 else 1)
    world = tp * pp * cp * dp + (1 if rng.random() < 0.04 else 0)
    o: dict[str, Any] = {
        "model.tensor_model_parallel_size": tp, "model.pipeline_model_parallel_size": pp,
        "model.virtual_pipeline_model_parallel_size": vpp, "model.context_parallel_size": cp,
        "model.sequence_parallel": rng.random() < 0.5,
    }
    if moe:
        o["model.expert_model_parallel_size"] = ep
        overlap = ep > 1 and rng.random() < 0.3
        o["comm_overlap.overlap_moe_expert_parallel_comm"] = overlap
        if overlap:
            o["model.moe_token_dispatcher_type"] = "alltoall"  # EP overlap's own prerequisite (comm_overlap.py:486)
            if pp > 1 and vpp is None:
                o["model.virtual_pipeline_model_parallel_size"] = 2
        if rng.random() < 0.2:
            o["model.moe_shared_expert_overlap"] = True
        if rng.random() < 0.1:
            o["model.moe_input_jitter_eps"] = 0.01
        if rng.random() < 0.1:
            o["model.moe_layer_recompute"] = True
    if rng.random() < 0.15:
        o["model.attention_dropout"], o["model.hidden_dropout"] = rng.choice(((0.1, 0.0), (0.0, 0.1), (0.1, 0.1)))
    recompute = rng.choice(("none", "none", "selective", "full"))
    if recompute == "selective":
        o["model.recompute_granularity"] = "selective"
        o["model.recompute_modules"] = rng.sample(LABELS, rng.choice((1, 1, 2)))
        if rng.random() < 0.05:
            o["model.recompute_num_layers"] = 1
    elif recompute == "full":
        o["model.recompute_granularity"] = "full"
        o["model.recompute_method"] = rng.choice(("uniform", "block", "uniform", "block", None))
        o["model.recompute_num_layers"] = rng.choice((1, 2, 4, 4, None, 99))
    if rng.random() < 0.04:
        o["model.distribute_saved_activations"] = True
    if rng.random() < 0.2 and not lora:  # packed-sequence PEFT recipes need extra graph padding settings
        impl = rng.choice(("transformer_engine", "transformer_engine", "full_iteration", "local"))
        o["model.cuda_graph_impl"] = impl
        if impl == "full_iteration":  # Bridge's prerequisites (config.py:1370-1374, C:2463)
            o["rerun_state_machine.check_for_nan_in_loss"] = False
            o["model.cuda_graph_modules"] = []
        elif rng.random() < 0.6:
            o["model.cuda_graph_modules"] = rng.sample(
                [m for m in GRAPH_MODULES if moe or m in ("attn", "mlp")], rng.choice((1, 2)))
    if rng.random() < 0.15:
        o["model.cpu_offloading"] = True
        o["model.cpu_offloading_num_layers"] = rng.choice((0, 1, 2, layers - 1, layers))
    elif rng.random() < 0.1:
        o["model.fine_grained_activation_offloading"] = True
        o["model.offload_modules"] = rng.sample(OFFLOAD_MODULES, rng.choice((1, 2)))
        if rng.random() < 0.3:
            o["model.transformer_impl"] = "local"
    if moe and rng.random() < 0.05:
        o["model.moe_paged_stash"] = True
    if rng.random() < 0.08:
        o["ddp.nccl_ub"] = True
    if rng.random() < 0.15:
        o["mixed_precision"] = rng.choice(PRESETS)
    if rng.random() < 0.1:
        o["optimizer.use_distributed_optimizer"] = rng.random() < 0.5
        o["ddp.use_distributed_optimizer"] = not o["optimizer.use_distributed_optimizer"]
    if rng.random() < 0.08:
        o["ddp.use_megatron_fsdp"] = True
        o["ddp.data_parallel_sharding_strategy"] = rng.choice(("optim", "optim_grads", "optim_grads_params"))
    _fsdp_and_optimizer_settings(rng, o, moe)
    if rng.random() < 0.04:  # Bridge's ProfilingConfig.finalize: the two profilers, the profiling window
        o["profiling.use_pytorch_profiler"] = True
        o["profiling.use_nsys_profiler"] = rng.random() < 0.5
    if rng.random() < 0.04:
        o["profiling.profile_step_start"] = rng.choice((5, 20))
        o["profiling.profile_step_end"] = rng.choice((3, 12))
    names = catalog.names()
    overlays = tuple(sorted(rng.sample(names, rng.choice((0, 1, 1, 2, 2, 3)))))
    params: list[tuple[str, Any]] = []
    if "cpu_offload" in overlays and rng.random() < 0.3:
        params.append(("cpu_offload.num_layers", rng.choice((1, layers - 1, layers))))
    if "selective_recompute" in overlays and rng.random() < 0.5:
        params.append(("selective_recompute.modules", rng.sample(LABELS, 1)))
    if "lora_sp_regather" in overlays:
        params.append(("lora_sp_regather.strict", rng.random() < 0.5))
    if "optimizer_offload" in overlays and rng.random() < 0.5:
        params.append(("optimizer_offload.fraction", rng.choice((0.0, 0.5, 1.5))))
        if rng.random() < 0.3:
            o["optimizer.decoupled_weight_decay"] = False
    if "dist_optimizer" in overlays and rng.random() < 0.4:
        params.append(("dist_optimizer.instances", rng.choice((2, 3, 4))))
    if "megatron_fsdp" in overlays and rng.random() < 0.5:
        params.append(("megatron_fsdp.strategy", rng.choice(("optim", "optim_grads", "optim_grads_params"))))
    if "fine_grained_offload" in overlays and rng.random() < 0.7:
        params.append(("fine_grained_offload.modules", rng.sample(OFFLOAD_MODULES, rng.choice((1, 2, 3)))))
        if rng.random() < 0.3:
            params.append(("fine_grained_offload.fraction", rng.choice((0.0, 0.5, 1.0))))
    if "precision_aware_optimizer" in overlays and rng.random() < 0.6:
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            params.append((f"precision_aware_optimizer.{name}", rng.choice(OPTIMIZER_DTYPES)))
        if rng.random() < 0.3:
            params.append(("precision_aware_optimizer.main_params_dtype", rng.choice(("fp32", "fp16"))))
            params.append(("precision_aware_optimizer.main_grads_dtype", rng.choice(("fp32", "bf16"))))
    if "memory_snapshot" in overlays and rng.random() < 0.6:
        params.append(("memory_snapshot.ranks", rng.choice(("auto", "pipeline_ends", "all", [0, world]))))
        if rng.random() < 0.5:
            params.append(("memory_snapshot.dump_step", rng.choice((5, 100_000))))
    env = rng.choice(PROCESS_ENVS)
    return Case(recipe, world, tuple(o.items()), overlays, tuple(params), tuple(sorted(env.items())))


def _fsdp_and_optimizer_settings(rng: random.Random, o: dict[str, Any], moe: bool) -> None:
    """Settings that meet the Megatron FSDP, fine-grained offloading and precision-aware optimizer rules (with or
    without their overlays): Bridge's FSDP guards, megatron-core's offload sizes and ncclep gate, the optimizer's
    dtype and precision conditions."""
    if rng.random() < 0.05:
        o["dist.use_torch_fsdp2"] = True
    if rng.random() < 0.05:
        o["train.check_weight_hash_across_dp_replicas_interval"] = rng.choice((None, 10))
    if rng.random() < 0.04:
        o["checkpoint.ckpt_format"] = "fsdp_dtensor"
    if rng.random() < 0.04:
        o["checkpoint.save"] = None
        o["checkpoint.load"] = None
    if rng.random() < 0.04:
        o["dist.use_tp_pp_dp_mapping"] = True
    if rng.random() < 0.04:
        o["ddp.fsdp_manual_registration"] = True
    if rng.random() < 0.04:
        o["ddp.disable_symmetric_registration"] = True
    if "model.fine_grained_activation_offloading" in o and rng.random() < 0.2:
        o[rng.choice(("model.min_offloaded_tensor_size", "model.delta_offload_bytes_across_pp_ranks"))] = -1
    if moe and o.get("comm_overlap.overlap_moe_expert_parallel_comm") and rng.random() < 0.3:
        o["model.moe_token_dispatcher_type"] = "flex"
        o["model.moe_flex_dispatcher_backend"] = "ncclep"
        if rng.random() < 0.5:  # megatron-core's gate on offloading expert FC1 under this overlap
            o["model.fine_grained_activation_offloading"] = True
            o["model.offload_modules"] = ["expert_fc1"]
    if rng.random() < 0.03:
        o["optimizer.optimizer"] = "sgd"
    if rng.random() < 0.04:
        o[rng.choice(("optimizer.exp_avg_dtype", "optimizer.main_params_dtype"))] = rng.choice(("bfloat16", "float16"))
    if rng.random() < 0.04:
        o["optimizer.use_precision_aware_optimizer"] = True
        o["optimizer.use_distributed_optimizer"] = o["ddp.use_distributed_optimizer"] = rng.random() < 0.8
    if rng.random() < 0.04:  # no mixed-precision config: the model's and optimizer's own bf16/fp16 flags stand
        o["mixed_precision"] = None
        o["optimizer.bf16"] = rng.random() < 0.5


@dataclass
class Outcome:
    case: Case
    verdict: str                 # agree | stricter | disagree | incomplete | unbuildable
    ours: tuple[str, ...] = ()   # our failing check ids
    oracle: str | None = None    # oracle error (None = accepted)
    oracle_rule: str | None = None
    detail: str = ""
    fired: tuple[str, ...] = ()  # every check that found something (error, warning or note) on the prospective config

    @property
    def unexplained(self) -> bool:
        """Bridge rejected with a message no rule of ours names."""
        return self.oracle is not None and self.oracle_rule is None and self.verdict != "incomplete"


def oracle_rule(message: str) -> str | None:
    for c in rules.CHECKS:
        if c.oracle and any(f in message for f in c.oracle):
            return c.id
    return None


@functools.lru_cache(maxsize=None)
def _recipe(name: str):
    return build_recipe(name)


def base_config(case: Case):
    cfg = copy.deepcopy(_recipe(case.recipe))
    for path, value in case.overrides:
        if path.startswith("comm_overlap.") and cfg.comm_overlap is None:
            path = "model." + path.split(".", 1)[1]  # without a comm-overlap config the model field decides
        if path.endswith("_dtype") and isinstance(value, str):  # torch dtypes, as Bridge's overrides make them
            import torch
            value = getattr(torch, value)
        write(cfg, path, value)
    return cfg


def _params(case: Case, catalog: Catalog) -> dict[str, dict[str, Any]]:
    # Unlike engine.normalize_params, a value the engine refuses is kept: the oracle sees what the user asked for.
    given = dict(case.params)
    out = {}
    for name in case.overlays:
        values = {k: copy.deepcopy(p.default) for k, p in catalog.specs[name].params.items()}
        values.update({k.split(".", 1)[1]: v for k, v in given.items() if k.split(".", 1)[0] == name})
        out[name] = values
    return out


def prospective(cfg, case: Case, catalog: Catalog) -> tuple[dict[str, Any], dict[str, str], dict[str, dict[str, Any]]]:
    """The fields, environment and (resolved) parameters the engine would use for the case's overlays, computed
    the engine's way (parameters substituted, resolvers run on the prospective view, allocator settings merged
    key-wise), even where the engine refuses the combination."""
    env = dict(case.env)
    fields: dict[str, Any] = {}
    params = _params(case, catalog)
    for name in case.overlays:
        spec, values = catalog.specs[name], params[name]
        for path, value in spec.set.items():
            if path_problem(cfg, path, name) is None:
                fields[path] = substitute(value, values)
        for var, value in spec.env.items():
            if isinstance(value, dict):
                try:
                    env[var], _ = allocconf.merged(var, env.get(var), {k: str(v) for k, v in value.items()})
                except allocconf.AllocConfError:
                    pass
            else:
                env[var] = str(value)
    claims = {path: FieldClaim("overlay", path, value) for path, value in fields.items()}
    view = View(cfg, claims, env, case.world_size, tuple(case.overlays), params)
    for name in case.overlays:
        resolver = rules.RESOLVERS.get(name)
        if resolver:
            more_fields, more_env = resolver(view, params[name])
            fields.update(more_fields)
            env.update({k: str(v) for k, v in more_env.items()})
    return fields, env, params


def evaluate(case: Case, catalog: Catalog | None = None) -> Outcome:
    catalog = catalog or Catalog()
    enforced = {c.id for c in rules.CHECKS if c.enforced_by in ("megatron-core", "bridge")}
    try:
        cfg = base_config(case)
    except Exception as exc:  # noqa: BLE001 — a case the recipe cannot take at all
        return Outcome(case, "unbuildable", detail=str(exc)[:200])
    ours: list[str] = []
    try:
        plan_overlays(cfg, case.overlays, env=dict(case.env), params=dict(case.params), world_size=case.world_size,
                      catalog=catalog)
    except OverlayError as exc:
        ours = sorted({p.check or "composition" for p in exc.problems})
    oracle_cfg = copy.deepcopy(cfg)
    fields, env, params = prospective(oracle_cfg, case, catalog)
    for path, value in fields.items():
        write(oracle_cfg, path, copy.deepcopy(value))
    view = View(oracle_cfg, {}, env, case.world_size, case.overlays, params)
    fired = tuple(c.id for c in rules.CHECKS if any(True for _ in c(view)))
    result = validate_config(oracle_cfg, world_size=case.world_size, env=env)
    if result.ok and not result.complete:  # the oracle could not decide on this host
        return Outcome(case, "incomplete", tuple(ours), None, None, result.not_checkable[-1], fired)
    # A field the validation copy had to change on this host (validation.TE_ONLY_CHECKS) that one of our enforced
    # rejections reads: Bridge's acceptance says nothing about that rule (e.g. optimizer.bf16 against the
    # precision-aware optimizer, which the copy turns off when TE's FusedAdam is missing).
    swapped = {entry.split("=", 1)[0] for entry in result.not_checkable}
    by_id = {c.id: c for c in rules.CHECKS}
    if result.ok and any(swapped & set(by_id[c].reads) for c in ours if c in enforced and c in by_id):
        return Outcome(case, "incomplete", tuple(ours), None, None,
                       next(e for e in result.not_checkable if e.split("=", 1)[0] in swapped), fired)
    oracle = None if result.ok else (result.error or "")
    rule = oracle_rule(oracle) if oracle else None
    ours_enforced = [c for c in ours if c in enforced]
    if "claims" in ours and (oracle is None or rule not in ours):
        # Two overlays claim one field with different values: the engine refuses the request itself, so there is
        # no single config to compare; the oracle saw one arbitrary resolution of it.
        verdict = "stricter"
    elif oracle is None:
        verdict = "agree" if not ours else ("disagree" if ours_enforced else "stricter")
    elif rule is not None:
        verdict = "agree" if rule in ours else "disagree"
    else:
        verdict = "disagree"  # Bridge rejects and no rule of ours explains it: a missing rule
    return Outcome(case, verdict, tuple(ours), oracle, rule, fired=fired)


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    counts = Counter(o.verdict for o in outcomes)
    decided = counts["agree"] + counts["stricter"] + counts["disagree"]
    enforced = {c.id for c in rules.CHECKS if c.enforced_by in ("megatron-core", "bridge")}
    stricter_rules = Counter(c for o in outcomes if o.verdict == "stricter" for c in o.ours if c not in enforced)
    matrix = Counter((o.oracle_rule or ("accepted" if o.oracle is None else "unexplained")
                      if o.verdict != "incomplete" else "incomplete",
                      "rejected" if o.ours else "accepted") for o in outcomes)
    triggered = ({c for o in outcomes for c in o.ours + o.fired} | {o.oracle_rule for o in outcomes if o.oracle_rule})
    return {"counts": dict(counts), "agree": counts["agree"] + counts["stricter"], "decided": decided,
            "stricter_rules": dict(stricter_rules), "matrix": dict(matrix),
            "disagreements": [o for o in outcomes if o.verdict == "disagree"],
            "unexplained": [o for o in outcomes if o.unexplained],
            "never_triggered": sorted(c.id for c in rules.CHECKS if c.id not in triggered),
            "never_triggered_enforced": sorted(c for c in enforced if c not in triggered)}

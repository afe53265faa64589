"""The plan against Megatron-LM's functional-test corpus: every case planned from its own arguments.

Usage: .venv/bin/python bench/plan_corpus.py [--corpus DIR] [--case SUBSTRING ...] [--limit N] [--quiet]

The corpus (read-only, never copied here) is ``../shared/reference/megatron-lm-corpus/`` beside the repository
by default, or ``--corpus DIR``: the same layout (``test_cases/<family>/<case>/``, ``recipes/<platform>/*.yaml``)
or a Megatron-LM checkout (``tests/functional_tests/test_cases``, ``tests/test_utils/recipes``).

What each figure is (the corpus's SOURCE.md, checked against megatron/training/training.py and
global_vars.py): ``mem-max-allocated-bytes`` at step N is ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]``
of the tensorboard writer, the LAST rank (last pipeline stage, last tensor-parallel rank), and nothing resets the
peak, so it is the high-water mark of that rank from the job's start to step N. The plan's figure is therefore
the largest allocated total over the phases that rank has been through by iteration N
(``memory.model.reported_phases`` for the last pipeline rank). The world size is the nodes x GPUs per node of the
recipe row that runs the figure's platform (``recipe_index``; a checkpoint-consistency test's first run has its own
GPUs per node, ``run_world``); a case no recipe runs is out with the reason, never given a guessed world size.

Each case is planned through ``bridge/megatron_args.py`` (megatron-core 0.19.2's own parser and
``core_transformer_config_from_args``), the same path as ``mbmem plan --megatron-args``. Nothing in the plan is
fitted to these figures. One line per case (in scope, or the reason it is out), then the errors per feature,
Megatron-LM's ``theoretical_memory_usage`` and Bridge's estimator on the same cases, and last:
``corpus: N in scope, K within 5%, median M%, worst W% (case)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO.parent / "shared" / "reference" / "megatron-lm-corpus"

# Platform -> (compute capability major validate_args is asked about, recipe folder). The main platform is
# dev_dgx_h100; a case without an H100 figure is read from GB200, then A100. lts_* (an older container) and *_2nd
# (a second run) are other recordings of the same case.
PLATFORMS = {"dev_dgx_h100": (9, "h100"), "dev_dgx_gb200": (10, "gb200"), "dev_dgx_a100": (8, "h100")}
GPU_BYTES = {"dev_dgx_h100": 80 * 2**30, "dev_dgx_gb200": 186 * 2**30, "dev_dgx_a100": 80 * 2**30}
OUT_FAMILIES = {"bert": "T5/BERT", "t5": "T5/BERT", "multimodal-llava": "multimodal", "mimo": "multimodal",
                "gpt-nemo": "NeMo run (no Megatron-LM command line)"}
SCRIPTS_IN_SCOPE = re.compile(r"pretrain_(gpt|mamba|hybrid)\.py$")
# A flag that puts a case out: the plan cannot size what it adds (memory/coverage.py NOT_MODELLED_FLAGS names it as
# not modelled in a user's plan too).
OUT_OF_SCOPE_FLAGS = {
    "--export-kd-teacher-load": "knowledge distillation: the teacher model is loaded from a checkpoint "
                                "(--export-kd-teacher-load) whose shape is not in the arguments",
}


@dataclass
class Case:
    family: str
    name: str
    path: Path
    config: dict
    platform: str = ""
    step: int = 0
    figure: float = 0.0
    world: int = 0
    script: str = ""
    others: dict = field(default_factory=dict)   # other platforms' figures at their last step
    commented_in: str = ""    # the recipe file whose entry for it is commented out (when no recipe runs it)


@dataclass
class Result:
    case: Case
    reason: str = ""                 # why out of scope ("" in scope)
    plan: float = 0.0
    phase: str = ""
    features: tuple[str, ...] = ()
    not_modelled: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    mlm: float | None = None         # Megatron-LM's theoretical_memory_usage, bytes
    bridge: float | None = None      # Bridge's estimator, bytes

    @property
    def err(self) -> float:
        return (self.plan - self.case.figure) / self.case.figure * 100


# ----------------------------------------------------------------------------- reading the corpus
def corpus_dirs(root: Path) -> tuple[Path, Path]:
    """(test_cases, recipes) of a corpus copy or a Megatron-LM checkout."""
    for cases, recipes in ((root / "test_cases", root / "recipes"),
                           (root / "tests/functional_tests/test_cases", root / "tests/test_utils/recipes")):
        if cases.is_dir() and recipes.is_dir():
            return cases, recipes
    raise FileNotFoundError(f"{root}: neither a corpus copy (test_cases/, recipes/) nor a Megatron-LM checkout "
                            "(tests/functional_tests/test_cases, tests/test_utils/recipes)")


def _yaml(path: Path) -> Any:
    import yaml
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class RecipeRow:
    """One (test case, environment, platform) a recipe runs, as Megatron-LM's recipe_parser.py flattens it
    (flatten_products / flatten_workload: a product's keys replace the spec's)."""
    file: str                 # recipes/<folder>/<name>.yaml
    environment: str
    platform: str             # dgx_h100, dgx_gb200, dgx_a100 ...
    nodes: int
    gpus_per_node: int
    script: str


_COMMENTED = re.compile(r"^\s*#\s*-\s*test_case:\s*\[([^\]]*)\]", re.M)
_GPUS_IN_SCRIPT = re.compile(r"\bGPUS_PER_NODE=(\d+)\b")


def _one(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def recipe_index(recipes: Path) -> tuple[dict[str, list[RecipeRow]], dict[str, str]]:
    """(test case -> the rows the recipes run it in, test case -> the recipe file where its entry is commented out)
    from recipes/*/*.yaml. The GPUs per node are the recipe's ``gpus`` (its script exports GPUS_PER_NODE={gpus},
    or leaves it to _run_training.sh's default of 8, which the H100 recipes' gpus: 8 equal) unless its script sets
    a number itself (the perf recipes: ``GPUS_PER_NODE=1 bash ...``)."""
    rows: dict[str, list[RecipeRow]] = {}
    commented: dict[str, str] = {}
    for f in sorted(recipes.glob("*/*.yaml")):
        rel = f"recipes/{f.parent.name}/{f.name}"
        try:
            text = f.read_text()
            d = _yaml(f)
        except Exception:  # noqa: BLE001 — a recipe we cannot read gives no world size
            continue
        for m in _COMMENTED.finditer(text):
            for name in m.group(1).split(","):
                commented.setdefault(name.strip().strip("'\""), rel)
        if not isinstance(d, dict) or not isinstance(d.get("spec"), dict):
            continue
        for product in d.get("products") or []:
            if not isinstance(product, dict):
                continue
            names = product.get("test_case") or []
            inner = product.get("products") or [{}]
            for name in names if isinstance(names, list) else [names]:
                for params in inner:
                    keys = [k for k in params if k != "cadence"] if isinstance(params, dict) else []
                    values = [v if isinstance(v, list) else [v] for v in (params[k] for k in keys)]
                    for combo in itertools.product(*values):
                        spec = {**d["spec"], **dict(zip(keys, combo))}
                        script_text = str(spec.get("script", ""))
                        m = re.search(r"TRAINING_SCRIPT_PATH=([\w./-]+)", script_text)
                        fixed = _GPUS_IN_SCRIPT.search(script_text)
                        try:
                            nodes = int(_one(spec.get("nodes", 1)) or 1)
                            gpus = int(fixed.group(1)) if fixed else int(_one(spec.get("gpus", 8)) or 8)
                        except (TypeError, ValueError):
                            continue
                        rows.setdefault(str(name), []).append(RecipeRow(
                            rel, str(_one(spec.get("environment", ""))), str(_one(spec.get("platforms", ""))),
                            nodes, gpus, Path(m.group(1)).name if m else ""))
    return rows, commented


def run_world(case_config: dict, row: RecipeRow) -> int:
    """The world size of the run whose figure the golden file holds. A checkpoint-consistency test runs each
    MODEL_ARGS[_N] with its own MODEL_ENV_VARS.<key>.GPUS_PER_NODE (run_ci_test.sh), and its golden values are
    read from the first run's event file (python_test_utils/common.py read_tb_logs_as_list, index 0): MODEL_ARGS's."""
    if case_config.get("TEST_TYPE") == "checkpoint-consistency":
        own = ((case_config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get("GPUS_PER_NODE")
        if isinstance(own, int) and own > 0:
            return row.nodes * own
    return row.nodes * row.gpus_per_node


def recipe_row(rows: list[RecipeRow], platform: str) -> RecipeRow | None:
    """The row that runs ``platform`` (dev_dgx_h100 ...): that environment and platform, else any row of the
    platform's recipe folder (its spec gives the same nodes and GPUs)."""
    environment, _, gpu = platform.partition("_")
    folder = PLATFORMS[platform][1]
    exact = [r for r in rows if r.environment == environment and r.platform == gpu]
    return (exact or [r for r in rows if r.file.split("/")[1] == folder] or [None])[0]


def last_peak(golden: dict) -> tuple[int, float] | None:
    """(last step, mem-max-allocated-bytes there) of a golden-values file; None without a figure."""
    series = golden.get("mem-max-allocated-bytes")
    if not isinstance(series, dict):
        return None
    values = [(int(k), float(v)) for k, v in (series.get("values") or {}).items()
              if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(values) if values else None


def load_cases(root: Path) -> list[Case]:
    cases_dir, recipes_dir = corpus_dirs(root)
    recipes, commented = recipe_index(recipes_dir)
    out = []
    for config in sorted(cases_dir.glob("*/*/model_config.yaml")):
        d = config.parent
        case = Case(family=d.parent.name, name=d.name, path=d, config={})
        try:
            case.config = _yaml(config) or {}
        except Exception:  # noqa: BLE001 — reported as the case's reason
            case.config = {}
        figures = {}
        for g in sorted(d.glob("golden_values_*.json")):
            platform = g.stem[len("golden_values_"):]
            try:
                peak = last_peak(json.loads(g.read_text()))
            except (ValueError, OSError):
                peak = None
            if peak:
                figures[platform] = peak
        # the first platform (H100, GB200, A100) whose figure a recipe runs; else the first with a figure, out
        with_figure = [p for p in PLATFORMS if p in figures]
        rows = recipes.get(case.name, [])
        main = next((p for p in with_figure if recipe_row(rows, p)), with_figure[0] if with_figure else None)
        if main:
            case.platform, (case.step, case.figure) = main, figures[main]
            row = recipe_row(rows, main)
            if row is not None:
                case.world, case.script = run_world(case.config, row), row.script
        case.commented_in = commented.get(case.name, "") if not rows else ""
        case.others = {p: v for p, v in figures.items() if p != main}
        out.append(case)
    return out


def scope_reason(case: Case) -> str:
    """Why a case is not planned ("" when it is)."""
    if case.family in OUT_FAMILIES:
        return OUT_FAMILIES[case.family]
    if "inference" in case.name or case.config.get("MODE") == "inference":
        return "inference"
    if not case.figure:
        return "no memory figure on a dev H100/GB200/A100 platform"
    if not isinstance(case.config.get("MODEL_ARGS"), dict):
        return "no MODEL_ARGS"
    if case.script and not SCRIPTS_IN_SCOPE.search(case.script):
        return f"not a GPT/hybrid pretraining script ({case.script})"
    flags = case.config["MODEL_ARGS"]
    if any(_given(flags.get(f)) for f in OUT_OF_SCOPE_FLAGS):
        return OUT_OF_SCOPE_FLAGS[next(f for f in OUT_OF_SCOPE_FLAGS if _given(flags.get(f)))]
    if not case.world:
        # Megatron-LM's CI reads the recipes/ folders and a private local_recipes checkout
        # (tests/test_utils/python_scripts/recipe_parser.py load_workloads; .gitlab/stages/04.functional-tests.yml
        # adds it): a case no public recipe runs has no world size here, and is not guessed one
        if str(case.config.get("TEST_TYPE", "")) == "release":
            return ("release test, in no public recipe at this commit: its world size is in Megatron-LM's private "
                    "local_recipes")
        if case.commented_in:
            return f"commented out in the recipes at this commit: not run, figure may be stale ({case.commented_in})"
        return "not in any recipe at this commit: figure may be stale"
    return ""


def _given(value: Any) -> bool:
    return value is not None and value is not False and str(value).strip() not in ("", "None", "false")


# ----------------------------------------------------------------------------- features of a case
def features(a: Any) -> tuple[str, ...]:
    """The features a case exercises, read from its validated namespace (for the per-feature table)."""
    f = []
    g = lambda name, default=None: getattr(a, name, default)  # noqa: E731
    if g("fp8"):
        f.append(f"FP8 {g('fp8_recipe')}")
    if g("fp4"):
        f.append("FP4")
    if not g("bf16") and not g("fp16"):
        f.append("fp32")
    if g("num_experts"):
        f.append("MoE")
        f.append(f"dispatcher {g('moe_token_dispatcher_type')}")
        if g("moe_grouped_gemm"):
            f.append("grouped GEMM")
    if g("multi_latent_attention"):
        f.append("MLA")
    if g("mtp_num_layers"):
        f.append("MTP")
    if g("hybrid_layer_pattern") or g("hybrid_override_pattern"):
        f.append("hybrid Mamba")
    if str(g("cuda_graph_impl", "none")) != "none" or g("enable_cuda_graph") or g("external_cuda_graph"):
        f.append(f"CUDA graphs {g('cuda_graph_impl')}")
    if g("recompute_granularity"):
        f.append(f"recompute {g('recompute_granularity')}"
                 + (f" {g('recompute_method')}" if g("recompute_granularity") == "full" else ""))
    if (g("hidden_dropout") or 0) > 0 or (g("attention_dropout") or 0) > 0:
        f.append("dropout")
    if g("use_megatron_fsdp") or g("use_torch_fsdp2"):
        f.append("FSDP")
    if g("cpu_offloading") or g("fine_grained_activation_offloading") or g("optimizer_cpu_offload"):
        f.append("offloading")
    backend = str(getattr(g("attention_backend"), "name", g("attention_backend")))
    if backend in ("unfused", "local"):
        f.append(f"attention {backend}")
    if (g("pipeline_model_parallel_size") or 1) > 1:
        f.append("PP")
    if g("virtual_pipeline_model_parallel_size"):
        f.append("VPP")
    if g("pipeline_model_parallel_layout"):
        f.append("PP layout")
    if (g("context_parallel_size") or 1) > 1:
        f.append("CP")
    if g("use_distributed_optimizer"):
        f.append("distributed optimizer")
    return tuple(f)


# ----------------------------------------------------------------------------- planning a case
def plan_case(case: Case) -> Result:
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, load_job
    from mbmem_overlays.memory import model as P

    res = Result(case)
    res.reason = scope_reason(case)
    if res.reason:
        return res
    arch = PLATFORMS[case.platform][0]
    source = {"MODEL_ARGS": case.config["MODEL_ARGS"], "ENV_VARS": case.config.get("ENV_VARS") or {}}
    try:
        job = load_job(source, world_size=case.world, arch=arch, script=case.script)
    except MegatronArgsError as e:
        res.reason = f"arguments refused: {e.message}"[:160]
        return res
    except Exception as e:  # noqa: BLE001 — megatron-core's own validation errors say why a case is out
        res.reason = f"arguments refused: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        return res
    args = argparse.Namespace(**dict(job.args))
    res.features = features(args)
    if job.family == "hybrid" and "hybrid Mamba" not in res.features:   # a Mamba script without a pattern
        res.features += ("hybrid Mamba",)
    if str(case.config.get("TEST_TYPE", "")).startswith("frozen"):
        res.features += ("starts from a checkpoint",)
    try:
        shape, lay, st = P.from_config(job.config, case.world, arch=arch, env=dict(job.env))
        # the figure is the last rank's: with optimizer state dealt unevenly over DP ranks (the layer-wise
        # optimizer) plan that rank, not the most loaded one
        st = replace(st, dp_rank=-1)
        last = lay.pp - 1
        phases = P.reported_phases(shape, lay, st, last, max(1, case.step))
        peak = max(phases.values(), key=lambda b: b.total)
        res.plan, res.phase = peak.total, peak.phase
    except Exception as e:  # noqa: BLE001 — a case the model cannot plan is out, with the reason
        res.reason = f"not planned: {type(e).__name__}: {e}"[:160]
        return res
    # what the memory model itself names as not followed (memory/coverage.py), the same list a plan's verdict shows
    from mbmem_overlays.memory.coverage import not_modelled
    res.not_modelled = tuple(n.split(":")[0] for n in not_modelled(job.config))
    # theoretical_memory_usage reads the padded vocabulary the tokenizer build sets (build_tokenizer.py)
    args.padded_vocab_size = shape.vocab
    res.mlm = megatron_theoretical(args, lay.microbatches)
    from mbmem_overlays.memory.steps import bridge_estimate
    res.bridge = bridge_estimate(job.config, case.world)
    return res


MLM_ERRORS: list[str] = []


def megatron_theoretical(args: argparse.Namespace, microbatches: int) -> float | None:
    """Megatron-LM's own estimate (megatron/training/theoretical_memory_usage.py report_theoretical_memory: weights
    and optimizer plus activations, for the first pipeline stage), in bytes; None where it has none (hybrid)."""
    import contextlib
    import io
    try:
        from megatron.training import theoretical_memory_usage as T
        with contextlib.redirect_stdout(io.StringIO()):
            if T.is_hybrid_model(args):
                return None
            weights = T.compute_weight_and_optimizer_memory(args)
            if args.sequence_parallel and args.recompute_granularity == "selective":
                acts = T.compute_activation_memory(args, num_microbatches=microbatches)
            else:
                acts = T.compute_activation_memory_without_sp(args, num_microbatches=microbatches)
        return float(weights + acts)
    except Exception as e:  # noqa: BLE001 — informative only; the first few reasons are printed
        MLM_ERRORS.append(f"{type(e).__name__}: {e}")
        return None


# ----------------------------------------------------------------------------- output
def pct(x: float | None) -> str:
    return "     -" if x is None else f"{x:+6.1f}%"


def case_line(r: Result) -> str:
    c = r.case
    name = f"{c.family}/{c.name}"
    if r.reason:
        return f"  out  {name:<78} {r.reason}"
    gb = 1e9
    mlm = None if r.mlm is None else (r.mlm - c.figure) / c.figure * 100
    bridge = None if r.bridge is None else (r.bridge - c.figure) / c.figure * 100
    flag = "ok " if abs(r.err) <= 5 else "MISS"
    line = (f"  {flag} {name:<78} {c.platform[8:]:>5} w{c.world:<3} it{c.step:<4} {c.figure / gb:7.2f} "
            f"{r.plan / gb:7.2f} {r.err:+6.1f}%  mlm {pct(mlm)} bridge {pct(bridge)}  {r.phase}")
    if r.not_modelled:
        line += "  not modelled: " + ", ".join(r.not_modelled)
    return line


def summary(results: list[Result]) -> list[str]:
    inside = [r for r in results if not r.reason]
    lines = []
    reasons: dict[str, int] = {}
    for r in results:
        if r.reason:
            key = r.reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
    if MLM_ERRORS:
        lines.append(f"Megatron-LM's theoretical_memory_usage failed on {len(MLM_ERRORS)} cases, e.g. "
                     f"{MLM_ERRORS[0][:200]}")
    lines.append("out of scope, by reason:")
    lines += [f"  {n:4d}  {k}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    lines.append("errors by feature (plan; Megatron-LM theoretical_memory_usage; Bridge estimator), |err| median / "
                 "worst:")
    feats: dict[str, list[Result]] = {"all": inside}
    for r in inside:
        for f in r.features:
            feats.setdefault(f, []).append(r)
    lines.append(f"  {'feature':<34} {'cases':>5} {'within 5%':>9} {'median':>7} {'worst':>7} {'mlm med':>8} "
                 f"{'bridge med':>10}")
    for f, rs in sorted(feats.items(), key=lambda kv: (kv[0] != "all", kv[0])):
        if not rs:
            continue
        errs = [abs(r.err) for r in rs]
        mlm = [abs((r.mlm - r.case.figure) / r.case.figure * 100) for r in rs if r.mlm is not None]
        br = [abs((r.bridge - r.case.figure) / r.case.figure * 100) for r in rs if r.bridge is not None]
        worst = max(rs, key=lambda r: abs(r.err))
        lines.append(f"  {f:<34} {len(rs):5d} {sum(e <= 5 for e in errs):9d} {statistics.median(errs):6.1f}% "
                     f"{worst.err:+6.1f}% {statistics.median(mlm) if mlm else float('nan'):7.1f}% "
                     f"{statistics.median(br) if br else float('nan'):9.1f}%")
    if inside:
        worst = max(inside, key=lambda r: abs(r.err))
        med = statistics.median(abs(r.err) for r in inside)
        lines.append(f"corpus: {len(inside)} in scope, {sum(abs(r.err) <= 5 for r in inside)} within 5%, "
                     f"median {med:.1f}%, worst {worst.err:+.1f}% ({worst.case.family}/{worst.case.name})")
    else:
        lines.append("corpus: 0 in scope, 0 within 5%, median -, worst - (-)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                    help="a corpus copy or a Megatron-LM checkout (default: %(default)s)")
    ap.add_argument("--case", action="append", default=[], help="only cases whose family/name contains this")
    ap.add_argument("--limit", type=int, default=0, help="at most this many cases (after --case)")
    ap.add_argument("--quiet", action="store_true", help="no line per case")
    ns = ap.parse_args(argv)
    try:
        cases = load_cases(ns.corpus)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.case:
        cases = [c for c in cases if any(s in f"{c.family}/{c.name}" for s in ns.case)]
    if ns.limit:
        cases = cases[:ns.limit]
    print(f"corpus: {ns.corpus} ({len(cases)} cases); importing Megatron Bridge (about 30 s) ...", flush=True)
    from mbmem_overlays.bridge.stack import prepare
    prepare()
    print("  ok/MISS case                                                                        platf world  step "
          "figure    plan    err   (GB = 1e9 bytes; figure: the last rank's allocated peak at that step)")
    results = []
    for c in cases:
        r = plan_case(c)
        results.append(r)
        if not ns.quiet:
            print(case_line(r), flush=True)
    for line in summary(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

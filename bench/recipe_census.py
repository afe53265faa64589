"""A census of Bridge's recipes: every recipe function Bridge ships, built offline and planned at its own world size.

Usage: .venv/bin/python bench/recipe_census.py [SUBSTRING ...] [--json] [--timeout S] [--list]

Which functions: every public function of ``megatron.bridge.recipes`` and ``megatron.bridge.perf_recipes`` (every
module under them, imported once) that is defined there and returns a ``ConfigContainer`` (its return annotation),
one row per function object: an alias (``qwen3_8b_pretrain_config`` for ``qwen3_8b_pretrain_1gpu_h100_bf16_config``)
is the same object and counted once, under the name it was defined with. ``SUBSTRING``s keep the functions any of
whose names contains one of them.

How each is built and planned, as the CLI does: ``bridge/recipes.py build_recipe`` (Bridge imported once by
``bridge/stack.prepare``, the shipped ``hf_configs`` as an offline hub cache, nothing downloaded), then
``memory/steps.py build_plan`` with no overlays at the recipe's own world size (``recipe_world_size``: the ``Ngpu``
of its name when the layout divides it, else the smallest world the layout allows). Each recipe runs in a forked
child of the process that imported Bridge, so a recipe that hangs is killed after ``--timeout`` seconds and named,
and one that changes global state cannot change the next.

What is printed per recipe: built or not (and why, classified: ``classify_failure``), the planned peak of the most
loaded GPU, and the features the plan does not model: the NOT_MODELLED fields it sets where they matter
(memory/coverage.py ``not_modelled``), and every other provider field it sets away from its default that the model
does not read and that memory/coverage.py does not classify (``unclassified_fields``; named "unclassified"). Then
the features by count, the build failures by reason, and last:
``recipes: N functions, B build offline, M fully modelled, U with unmodelled features (top: feature count, ...)``.
``--json`` prints one JSON object instead: the rows and that line.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import os
import pkgutil
import re
import select
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mbmem_overlays.bridge.recipes import BRIDGE_RECIPE_PACKAGES, recipe_world_size  # noqa: E402,F401

DEFAULT_TIMEOUT_S = 60.0


@dataclass
class Row:
    name: str                           # the name the function was defined with (its module.qualname in `where`)
    where: str
    aliases: list[str] = field(default_factory=list)
    built: bool = False
    failure: str = ""                   # classified reason (classify_failure) when not built or not planned
    error: str = ""                     # the exception's type and first line
    seconds: float = 0.0
    world: int | None = None
    world_from: str = ""
    layout: str = ""
    planned: bool = False
    peak_bytes: int | None = None
    rejected: str = ""                  # our rules' (engine) refusal of the recipe as shipped, when planned anyway
    not_modelled: list[str] = field(default_factory=list)     # NOT_MODELLED fields set where they matter
    unclassified: list[str] = field(default_factory=list)     # non-default fields nobody has classified

    @property
    def features(self) -> list[str]:
        return [feature_name(n) for n in self.not_modelled] + [f"unclassified {feature_name(u)}" for u in self.unclassified]


def feature_name(entry: str) -> str:
    """The feature of a ``path=value: reason`` entry, as the summary counts it."""
    path = entry.split("=")[0]
    return "not a decoder LM" if path == "model" else path.removeprefix("model.")


# ----------------------------------------------------------------------------- which functions
def _returns_config(fn: Any) -> bool:
    annotation = inspect.signature(fn).return_annotation
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return name.strip("'\"").rpartition(".")[2] == "ConfigContainer"


def recipe_functions() -> dict[Any, list[str]]:
    """{function: every dotted name it is exported under}, for every recipe function of Bridge's recipe packages."""
    found: dict[Any, list[str]] = collections.defaultdict(list)
    modules = []
    for package in BRIDGE_RECIPE_PACKAGES:
        root = importlib.import_module(package)
        modules.append(root)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            modules.append(importlib.import_module(info.name))
    for module in modules:
        for attr, value in vars(module).items():
            if attr.startswith("_") or not inspect.isfunction(value):
                continue
            home = getattr(value, "__module__", "") or ""
            if not any(home == p or home.startswith(p + ".") for p in BRIDGE_RECIPE_PACKAGES):
                continue
            if _returns_config(value):
                found[value].append(f"{module.__name__}.{attr}")
    return found


# ----------------------------------------------------------------------------- world size and GPU
def recipe_gpu_arch(fn: Any) -> int:
    """The compute capability a recipe is planned at: the GPU of the platform its name or defining module names
    (bridge/recipes.py named_platform, the lookup `mbmem plan --recipe` makes), else the CLI's default (H100)."""
    from mbmem_overlays.bridge.recipes import named_platform
    from mbmem_overlays.cli.common import DEFAULT_GPU_ARCH
    found = named_platform(fn.__name__, fn.__module__ or "")
    return found[1] if found and found[1] is not None else DEFAULT_GPU_ARCH


# ----------------------------------------------------------------------------- why a recipe does not build
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _root_cause(exc: BaseException) -> BaseException:
    """The original exception behind our OverlayError (build_recipe raises it ``from None``, which keeps the
    original as ``__context__``)."""
    seen = 0
    while exc.__context__ is not None and seen < 10 and type(exc).__name__ == "OverlayError":
        exc = exc.__context__
        seen += 1
    return exc


def shipped_config_problem(hub: str) -> str:
    """Why a config.json we ship for ``hub`` cannot load here ("" when nothing explains it)."""
    import json

    from mbmem_overlays.bridge import hf_offline
    path = hf_offline.available_models().get(hub)
    if path is None:
        return ""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type in CONFIG_MAPPING_NAMES or model_type in _bridge_registered_types():
        return ""
    code = (cfg.get("auto_map") or {}).get("AutoConfig")
    if code:
        return (f"needs the model's own code: model type {model_type!r} is unknown to transformers, and its config "
                f"names {code.split('.')[0]}.py (auto_map) for trust_remote_code, a file we do not ship")
    return f"model type {model_type!r} is unknown to this transformers and to Bridge's registrations"


def _bridge_registered_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return set(getattr(CONFIG_MAPPING, "_extra_content", {}) or {})


def _bridge_frame(tb: str) -> str:
    """The last frame of the traceback inside Megatron Bridge, as ``path:line (function)``."""
    frames = re.findall(r'File ".*?megatron/bridge/([^"]+)", line (\d+), in (\w+)', tb)
    return f"{frames[-1][0]}:{frames[-1][1]} ({frames[-1][2]})" if frames else ""


def hub_ids_of(fn: Any) -> list[str]:
    """The hub ids a recipe function passes to ``from_hf_pretrained`` or ``AutoConfig.from_pretrained`` (a literal, or
    a module constant)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return []
    out = []
    for arg in re.findall(r"(?:from_hf_pretrained|AutoConfig\.from_pretrained)\(\s*([\"'][^\"']+[\"']|\w+)", source):
        value = arg.strip("\"'") if arg[0] in "\"'" else getattr(fn, "__globals__", {}).get(arg)
        if isinstance(value, str) and "/" in value:
            out.append(value)
    return out


def classify_failure(exc: BaseException, tb: str, fn: Any = None) -> str:
    """One short reason, the same for every recipe that fails the same way."""
    from mbmem_overlays.bridge import hf_offline
    from mbmem_overlays.bridge.recipes import _hub_id_from_error
    root = _root_cause(exc)
    text = f"{type(root).__name__}: {root}"
    low = text.lower()
    hub = _hub_id_from_error(str(exc)) or _hub_id_from_error(str(root))
    if hub is None:
        m = re.search(r"([\w.-]+/[\w.-]+) does not appear to have a file named ([\w./-]+)", text)
        hub = m.group(1) if m else None
    if hub is None and fn is not None and ("couldn't find them in the cached files" in text or "offline" in low):
        hub = next((h for h in hub_ids_of(fn) if h not in hf_offline.model_files()), None)
    if hub:
        if hub not in hf_offline.model_files():
            return f"no config.json: {hub} (no public source found)"
        why = shipped_config_problem(hub)
        return f"{hub}: {why}" if why else f"{hub}: the shipped config did not load ({text.splitlines()[0][:160]})"
    m = re.search(r"architecture '(\w+)' is not yet supported", text)
    if m:
        return f"Bridge 0.6.2 has no bridge for the architecture {m.group(1)} of the shipped config"
    if "trust_remote_code" in low:
        return f"needs trust_remote_code: {text.splitlines()[0][:160]}"
    if any(k in low for k in ("cuda", "nvidia driver", "no gpu", "nccl")) or "torch.cuda" in tb:
        return f"needs a GPU: {_bridge_frame(tb) or 'the recipe'} queries CUDA while the recipe builds"
    if isinstance(root, FileNotFoundError) and "megatron/bridge/" in str(root):
        return f"Bridge 0.6.2's wheel lacks {str(root).split('megatron/bridge/')[-1].rstrip(chr(39))}, which the recipe reads"
    m = re.search(r"unexpected keyword argument '(\w+)'", text)
    if m:
        return f"needs a field this megatron-core does not have: {m.group(1)}"
    if isinstance(root, NotImplementedError):
        return "the recipe refuses by design: " + str(root).splitlines()[0][:200]
    return text.splitlines()[0][:200]


# ----------------------------------------------------------------------------- one recipe (in a child)
def outside_plan(model: Any) -> str:
    """Why the plan cannot size this provider at all ("" when it can): it sizes GPT and hybrid (Mamba) decoders
    (memory/from_config.py), and a diffusion or other model is neither."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    if isinstance(model, (GPTModelProvider, HybridModelProvider)):
        return ""
    return (f"model={type(model).__name__} ({type(model).__module__}): not a GPT or hybrid decoder, which is what "
            "the plan sizes")


def _problem_text(exc: BaseException) -> str:
    problems = getattr(exc, "problems", None)
    if problems:
        return " ".join(str(problems[0].message).split())[:300]
    return _first_line(exc)


def census_one(fn: Any, names: list[str]) -> Row:
    from mbmem_overlays.bridge.recipes import build_recipe
    from mbmem_overlays.core.errors import OverlayError
    from mbmem_overlays.memory import model as P
    from mbmem_overlays.memory.coverage import not_modelled, unclassified_fields
    from mbmem_overlays.memory.steps import build_plan, layout_text
    name = f"{fn.__module__}.{fn.__name__}"
    row = Row(fn.__name__, name, sorted({n.rpartition(".")[2] for n in names} - {fn.__name__}))
    t0 = time.monotonic()
    try:
        cfg = build_recipe(name)
    except BaseException as exc:  # noqa: BLE001 — every failure is a row
        row.failure, row.error = (classify_failure(exc, "".join(traceback.format_exception(_root_cause(exc))), fn),
                                  _first_line(_root_cause(exc)))
        row.seconds = time.monotonic() - t0
        return row
    row.built = True
    all_names = [name, *names]
    outside = outside_plan(cfg.model)
    row.not_modelled = [*([outside] if outside else []), *not_modelled(cfg)]
    row.unclassified = [f"{path}={value}" for path, value in unclassified_fields(cfg)]
    try:
        row.world, row.world_from = recipe_world_size(all_names, cfg.model)
        arch = recipe_gpu_arch(fn)
        try:
            plan = build_plan(cfg, [], world=row.world, recipe=fn.__name__, arch=arch)
            lay, peak = plan.layout, plan.total
            blind = list(plan.not_modelled)   # read as Bridge's setup runs the recipe, as the plan reads it
        except OverlayError as exc:
            # our rules (or the engine) refuse the recipe as shipped at this world size: named, and the peak of the
            # config as it stands is still planned, as memory/steps.py breakdown_of does
            row.rejected = _problem_text(exc)
            from mbmem_overlays.bridge.as_run import as_run
            run = as_run(cfg, row.world)
            shape, lay, st = P.from_config(run.config, row.world, arch=arch)
            peak = P.estimate(shape, lay, st).total
            blind = not_modelled(run.config)
        row.not_modelled = [*([outside] if outside else []), *blind]
        row.layout, row.peak_bytes, row.planned = layout_text(lay), int(peak), True
    except BaseException as exc:  # noqa: BLE001
        row.failure, row.error = "plan: " + classify_plan_failure(exc, cfg), _first_line(exc)
    row.seconds = time.monotonic() - t0
    return row


def classify_plan_failure(exc: BaseException, cfg: Any) -> str:
    m = cfg.model
    unset = [f for f in ("num_layers", "hidden_size", "num_attention_heads") if not getattr(m, f, None)]
    if unset:
        return (f"the recipe leaves the model's shape unset ({', '.join(f'{f}={getattr(m, f, None)}' for f in unset)}): "
                "nothing to plan until the user sets it")
    return _problem_text(exc)


def _skip_config_retry_waits() -> None:
    """Bridge's config loader retries a config it cannot load 3 times, 1 + 2 + 4 s apart
    (models/hf_pretrained/safe_config_loader.py:84-125), which offline only delays the same error. In the census's
    children (never in the library) the loader's waits are skipped: the outcome is the same, 7 s sooner."""
    import types
    loader = sys.modules.get("megatron.bridge.models.hf_pretrained.safe_config_loader")
    if loader is not None and getattr(loader, "time", None) is time:
        waitless = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
        waitless["sleep"] = lambda seconds: None
        loader.time = types.SimpleNamespace(**waitless)


def run_forked(fn: Any, names: list[str], timeout: float) -> Row:
    """``census_one`` in a forked child (Bridge already imported), killed after ``timeout`` seconds."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        code = 0
        try:
            _skip_config_retry_waits()
            row = census_one(fn, names)
            payload = json.dumps(asdict(row)).encode()
        except BaseException as exc:  # noqa: BLE001
            payload, code = json.dumps({"error": _first_line(exc)}).encode(), 1
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(code)
    os.close(write_end)
    chunks, deadline, eof = [], time.monotonic() + timeout, False
    with os.fdopen(read_end, "rb") as src:
        while not eof:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([src], [], [], left)
            if ready:
                chunk = os.read(src.fileno(), 1 << 20)
                chunks.append(chunk)
                eof = not chunk
    name = f"{fn.__module__}.{fn.__name__}"
    if not eof:  # still running at the deadline: named, not waited on
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return Row(fn.__name__, name, failure=f"timed out after {timeout:.0f} s (killed)", seconds=timeout)
    _, status = os.waitpid(pid, 0)  # the pipe closed: the child is exiting
    data = b"".join(chunks)
    try:
        payload = json.loads(data)
    except ValueError:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        return Row(fn.__name__, name, failure=f"the build process died ({how})")
    if "name" not in payload:
        return Row(fn.__name__, name, failure=f"census error: {payload.get('error')}")
    return Row(**payload)


# ----------------------------------------------------------------------------- the report
def summary_line(rows: list[Row], top: int = 6) -> str:
    built = [r for r in rows if r.built]
    unmodelled = [r for r in built if r.features]
    fully = [r for r in built if r.planned and not r.features]
    counts = collections.Counter(f for r in built for f in dict.fromkeys(r.features))
    tops = ", ".join(f"{f} {k}" for f, k in counts.most_common(top)) or "none"
    return (f"recipes: {len(rows)} functions, {len(built)} build offline, {len(fully)} fully modelled, "
            f"{len(unmodelled)} with unmodelled features (top: {tops})")


def gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.1f} GiB"


def render(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        if not r.built:
            lines.append(f"NOT BUILT  {r.name}: {r.failure}")
            continue
        state = "planned" if r.planned else "NOT PLANNED"
        feats = "; ".join([*r.not_modelled, *(f"unclassified: {u}" for u in r.unclassified)])
        lines.append(f"{state:<10} {r.name}: {r.world} GPUs {r.layout} peak {gib(r.peak_bytes)}"
                     + (f" [{r.failure}]" if r.failure else "") + (f" [our rules refuse it: {r.rejected}]" if r.rejected else "")
                     + (f"; not modelled: {feats}" if feats else ""))
    built = [r for r in rows if r.built]
    counts = collections.Counter(f for r in built for f in dict.fromkeys(r.features))
    lines.append("\nfeatures not modelled (recipes):")
    lines += [f"  {k:>4}  {f}" for f, k in counts.most_common()] or ["  none"]
    failures = collections.Counter(r.failure for r in rows if not r.built)
    lines.append("\nnot built (recipes, by reason):")
    lines += [f"  {k:>4}  {f}" for f, k in failures.most_common()] or ["  none"]
    unplanned = collections.Counter(r.failure for r in rows if r.built and not r.planned)
    if unplanned:
        lines.append("\nbuilt but not planned:")
        lines += [f"  {k:>4}  {f}" for f, k in unplanned.most_common()]
    refused = collections.Counter(r.rejected for r in rows if r.rejected)
    if refused:
        lines.append("\nplanned, but our rules refuse the recipe as shipped at its world size:")
        lines += [f"  {k:>4}  {f}" for f, k in refused.most_common()]
    lines.append(summary_line(rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("filters", nargs="*", metavar="SUBSTRING", help="keep recipes any of whose names contains one")
    ap.add_argument("--json", action="store_true", help="one JSON object: the per-recipe rows and the summary line")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                    help=f"seconds one recipe may take to build and plan (default {DEFAULT_TIMEOUT_S:.0f})")
    ap.add_argument("--list", action="store_true", help="only list the recipe functions")
    ap.add_argument("--quiet", action="store_true", help="no progress line per recipe on stderr")
    args = ap.parse_args(argv)
    os.environ.setdefault("MBMEM_QUIET", "1")
    from mbmem_overlays.bridge.stack import prepare
    prepare()
    functions = recipe_functions()
    chosen = sorted(((fn, names) for fn, names in functions.items()
                     if not args.filters or any(s in n for s in args.filters for n in [*names, fn.__name__])),
                    key=lambda item: (item[0].__module__, item[0].__name__))
    if args.list:
        for fn, names in chosen:
            print(f"{fn.__module__}.{fn.__name__}")
        print(f"{len(chosen)} recipe functions")
        return 0
    import gc
    gc.collect()
    gc.freeze()  # the children do not copy the parent's objects on their first garbage collection
    rows = []
    for i, (fn, names) in enumerate(chosen, 1):
        row = run_forked(fn, names, args.timeout)
        rows.append(row)
        if not args.quiet:
            print(f"[{i}/{len(chosen)}] {row.name}: {'built' if row.built else row.failure} ({row.seconds:.1f} s)",
                  file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "summary": summary_line(rows)}, indent=1))
    else:
        print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""NeMo-Run: overlays where Megatron Bridge users already launch (issue 18).

Two parts:
- word forms of a Report for Bridge's launcher (``--env KEY=VALUE`` and ``KEY=VALUE`` overrides); plain
  functions that need neither NeMo-Run nor Bridge, shared by ``mbmem args`` and the plugin;
- ``MemoryOverlays``, a NeMo-Run plugin (``pip install mbmem-overlays[run]``). It is built on first access
  (PEP 562 module ``__getattr__``), so importing this module, the package or ``mbmem args`` never imports
  ``nemo_run``.

The plugin is a thin layer over ``mbmem_overlays.apply_overlay``: the same engine, the same Bridge validation,
the same messages. NeMo-Run calls ``Plugin.setup(task, executor)`` inside ``Experiment.add`` (nemo_run
run/experiment.py ``_add_single_job``), before anything is submitted, so a refusal raised there stops the launch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.engine import Report
from ..core.errors import OverlayError, Problem


# ----------------------------------------------------------------------------- word forms (no NeMo-Run)
def hydra_word(path: str, value: Any) -> str:
    """``path=value`` that Hydra's override parser (what Bridge's run_recipe.py uses) reads back as ``value``.

    The plain form (``[a,b]``, ``true``, ``null``) is tried first; a text Hydra would read as something else
    (``1e-4``, ``a:b``) is single-quoted. The round trip is checked with Hydra's own parser."""
    from ..bridge.overrides import parse_override
    from ..core.errors import short_repr
    from ..core.values import MAX_OVERRIDE_CHARS, hydra_text, plain
    key = f"++{path[2:]}" if path.startswith("++") else path
    if len(f"{key}={hydra_text(value)}") > MAX_OVERRIDE_CHARS:  # one line, never the value whole (issue 33 #19)
        raise OverlayError([too_long_problem(path.lstrip("+"), value, len(f"{key}={hydra_text(value)}"))])
    for text in (hydra_text(value), _quoted(value)):
        if text is None:
            continue
        word = f"{key}={text}"
        try:
            if parse_override(word.lstrip("+"))[1] == plain(value):
                return word
        except OverlayError:
            continue
    raise OverlayError([Problem(("launcher",), path.lstrip("+"), value,
                                f"{short_repr(value)} has no KEY=VALUE form that Hydra reads back unchanged",
                                "set this field in a recipe instead of on the launcher's command line")])


def too_long_problem(path: str, value: Any, length: int) -> Problem:
    """A value too long for one launcher override (core/values.py MAX_OVERRIDE_CHARS): the rank list of
    ``memory_snapshot ranks=all`` past about 900 GPUs, for one. Bridge's ProfilingConfig.profile_ranks is a plain
    list (``rank in profile_ranks``), so no shorter override means "every rank"."""
    from ..core.values import MAX_OVERRIDE_CHARS
    count = f" ({len(value)} entries)" if isinstance(value, (list, tuple)) else ""
    fix = ("use mem.memory_snapshot.ranks=auto or pipeline_ends, or name the ranks you need; or launch with train.py "
           "or mbmem slurm, which resolve ranks=all inside the job" if path == "profiling.profile_ranks"
           else f"set {path} in a recipe instead of on the launcher's command line")
    return Problem(("launcher",), path, f"<{type(value).__name__}{count}>",
                   f"{path}{count} needs {length:,} characters as a launcher override, more than the "
                   f"{MAX_OVERRIDE_CHARS:,} one override may have", fix, check="launcher")


def _quoted(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def launcher_overrides(report: Report) -> list[str]:
    """The report's config changes as trailing ``KEY=VALUE`` words for run_recipe.py.

    ``env_vars.<VAR>`` is a dict entry: Bridge parses overrides in OmegaConf struct mode, where a key the
    recipe lacks needs ``+`` (bridge-config-surface.md §4 "CLI overrides", step 2); ``++`` adds or replaces,
    so it is right whether or not the recipe has the entry. The process-environment targets (``$VAR``) are
    not overrides: they are ``env_words``."""
    words = []
    for change in report.field_changes:
        path = f"++{change.target}" if change.target.startswith("env_vars.") else change.target
        words.append(hydra_word(path, launcher_value(change.new)))
    return words


def launcher_value(value: Any) -> Any:
    """``value`` as Bridge's override machinery takes it from text: a torch dtype by its name (``bfloat16``, which
    Bridge turns back into ``torch.bfloat16``; +mem=precision_aware_optimizer writes dtypes), anything else as is."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    return value


def env_words(env: Mapping[str, str]) -> list[str]:
    """``--env KEY=VALUE`` pairs for setup_experiment.py, which forwards only the names given with ``--env``
    (bridge-config-surface.md §6): the allocator setting must reach the process before it starts."""
    words: list[str] = []
    for key, value in sorted(env.items()):
        words += ["--env", f"{key}={value}"]
    return words


# ----------------------------------------------------------------------------- the plugin (needs nemo_run)
def _script_overrides(args: Sequence[str]) -> list[str]:
    """The trailing KEY=VALUE words of a run_recipe.py command line (its ``_collect_overrides`` takes every
    word with '=' that does not start with '-'; bridge-config-surface.md §4 "Notes on run_recipe.py")."""
    return [a for a in args if "=" in a and not a.startswith("-")]


def _executor_world_size(executor: Any) -> int | None:
    try:
        return int(executor.nnodes()) * int(executor.nproc_per_node())
    except Exception:  # noqa: BLE001  an executor without a layout: the recipe's smallest, as apply_overlay
        return None


def _task_config(task: Any) -> Any:
    """The ConfigContainer a ``run.Partial(fn, config=cfg)`` carries, or None."""
    try:
        cfg = task.config
    except (AttributeError, ValueError):
        return None
    return cfg if hasattr(cfg, "model") and hasattr(cfg, "to_dict") else None


def _apply_to_script(plugin: Any, task: Any, world: int | None, job_env: dict[str, str] | None = None) -> Report:
    """A ``run.Script`` (Bridge's run_recipe.py, or any script taking its overrides): build the recipe with the
    script's own overrides (they are the user's: locked), apply, append the overlays' overrides to its args."""
    from ..api import apply_overlay
    from ..bridge.overrides import check_overrides, write_all
    from ..bridge.recipes import load_recipe
    if not plugin.recipe:
        raise OverlayError([Problem(("nemo_run",), "recipe", None,
                                    "a run.Script task needs the recipe to validate against",
                                    "pass MemoryOverlays(recipe='llama3_8b_pretrain_config', ...)")])
    from ..bridge.stack import prepare
    user = _script_overrides(task.args)
    prepare()  # the Transformer Engine shim and offline HF configs, as cli.common.build_with_overrides
    cfg = load_recipe(plugin.recipe)
    changes, problems = check_overrides(cfg, user)
    if problems:
        raise OverlayError(problems)
    write_all(cfg, changes)
    report = apply_overlay(cfg, plugin.overlays, env=dict(job_env or {}), params=plugin.params, world_size=world,
                           locked={path: new for path, _, new in changes}, validate=plugin.validate)
    task.args = [*task.args, *launcher_overrides(report)]
    return report


def _setup(plugin: Any, task: Any, executor: Any) -> None:
    """``Plugin.setup``: apply to the task's config (or script), then put the report's environment on the
    executor; raises (nothing submitted) on any problem or Bridge rejection, with apply_overlay's message."""
    from ..api import apply_overlay
    world = plugin.world_size or _executor_world_size(executor)
    # The allocator variables the job will have (this process's, which a local executor passes on, then the
    # executor's own): the overlays' keys are merged into the one torch reads (core/allocconf.py, issue 33 #9).
    from ..core.allocconf import allocator_env
    job_env = {**allocator_env(os.environ), **allocator_env(getattr(executor, "env_vars", None) or {})}
    cfg = _task_config(task)
    if cfg is not None:
        report = apply_overlay(cfg, plugin.overlays, env=dict(job_env), params=plugin.params, world_size=world,
                               validate=plugin.validate)
    elif hasattr(task, "inline") and hasattr(task, "args"):
        report = _apply_to_script(plugin, task, world, job_env)
    else:
        raise OverlayError([Problem(("nemo_run",), "task", type(task).__name__,
                                    "the task carries no ConfigContainer (run.Partial(fn, config=cfg)) and is not "
                                    "a run.Script", "pass run.Partial(pretrain, config=cfg) or "
                                    "run.Script('scripts/training/run_recipe.py', args=[...])")])
    needs = report.validation.launch_requirements if report.validation is not None else []
    if needs:  # a placeholder stood in during validation; the job has none (as mbmem slurm and mbmem args)
        raise OverlayError([Problem(("nemo_run",), r.split("=", 1)[0], None, f"the job needs {r}",
                                    f"add {r.split(' (', 1)[0]} to the task's overrides") for r in needs])
    executor.env_vars.update(report.env_to_export)
    plugin.report = report


def _offline_hub_first() -> None:
    """nemo_run imports huggingface_hub (through leptonai), which reads HF_HOME/HF_HUB_OFFLINE once, at import.
    Bridge's recipes need our offline HF configs (bridge/stack.py ``prepare``), so point the hub at them first,
    under the same condition as ``prepare``; when the user imported nemo_run before us, it is too late (README)."""
    import os
    import sys
    if "huggingface_hub" not in sys.modules and not os.environ.get("MBMEM_USE_USER_HF"):
        from ..bridge import hf_offline
        hf_offline.activate()


def _build_plugin_class():
    from dataclasses import dataclass, field

    _offline_hub_first()
    import nemo_run as run

    @dataclass(kw_only=True)
    class MemoryOverlays(run.Plugin):
        """Apply memory overlays to a NeMo-Run task and its executor, validated by Bridge, before submission.

        - ``overlays``: names (aliases accepted), ``params``: as ``apply_overlay``'s;
        - ``world_size``: GPUs to validate for (default: executor nodes x processes per node);
        - ``recipe``: for a ``run.Script`` task (Bridge's run_recipe.py): the recipe it runs, to validate;
        - after ``setup``, ``report`` holds the engine's Report.
        """
        overlays: list[str] = field(default_factory=list)
        params: dict[str, Any] = field(default_factory=dict)
        world_size: int | None = None
        recipe: str | None = None
        validate: bool = True
        report: Any = field(init=False, default=None, repr=False)

        def setup(self, task, executor):
            _setup(self, task, executor)

    MemoryOverlays.__module__ = __name__
    MemoryOverlays.__qualname__ = "MemoryOverlays"
    return MemoryOverlays


def __getattr__(name: str):
    if name == "MemoryOverlays":
        cls = globals()["MemoryOverlays"] = _build_plugin_class()  # cached: pickle finds it by name
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""``mbmem args``: the overlays as arguments for Megatron Bridge's own launcher, after the same validation as
``mbmem apply``.

Bridge's ``scripts/training/train.sh`` -> ``setup_experiment.py`` (NeMo-Run) takes ``--env KEY=VALUE`` for the
job's environment and trailing ``KEY=VALUE`` ConfigContainer overrides that ``run_recipe.py`` hands to
``omegaconf_utils.process_config_with_overrides`` (shared/reference/bridge-config-surface.md §4 "CLI overrides",
§6 "setup_experiment.py"). The allocator setting must be an ``--env`` pair: setup_experiment forwards only the
names given with ``--env``, and PyTorch reads PYTORCH_CUDA_ALLOC_CONF once, before the first CUDA allocation
(ecosystem-notes.md), so setting it inside the process is too late.

Everything printed is derived from the engine's Report (``report.changes``, ``report.env_to_export``); the word
forms live in ``launch/nemo_run.py`` (importable without NeMo-Run) so the plugin and this command agree.
"""

from __future__ import annotations

import os
import shlex
import sys

from ..core import allocconf
from ..core.text import shown

from .common import (
    EXIT_INCOMPLETE,
    EXIT_REJECTED,
    EXIT_USAGE,
    UsageError,
    add_recipe_options,
    build_with_overrides,
    read_request,
)


def register(sub) -> None:
    p = sub.add_parser("args", help="the overlays as --env pairs and KEY=VALUE overrides for Bridge's launcher "
                                     "(run_recipe.py / setup_experiment.py), validated like mbmem apply")
    add_recipe_options(p, world_size="optional")
    p.add_argument("--overlay", "-O", action="append", default=[], help="overlay names, comma-separated or repeated")
    p.add_argument("--param", action="append", default=[], metavar="OVERLAY.PARAM=VALUE")
    p.add_argument("--only", choices=("env", "overrides"),
                   help="print only the --env pairs (setup_experiment.py) or only the overrides (run_recipe.py)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (errors included)")
    p.set_defaults(fn=run)


def ranks_all_problem(catalog, names: list[str], params: dict[str, object], world_size: int | None):
    """``memory_snapshot`` with ``ranks=all`` at a world size whose rank list no launcher override can carry
    (launch/nemo_run.py too_long_problem), found from the command line alone; None when it fits or is unknown."""
    from ..core.values import hydra_text
    from ..launch.nemo_run import too_long_problem
    try:
        selected = {catalog.resolve(n).name: n for n in names}
    except Exception:  # noqa: BLE001  an unknown name was already refused by read_request
        return None
    if "memory_snapshot" not in selected or not world_size:
        return None
    given = [v for k, v in params.items() if k.rsplit(".", 1)[0] in ("memory_snapshot", selected["memory_snapshot"])
             and k.rsplit(".", 1)[-1] == "ranks"]
    if given != ["all"]:
        return None
    ranks = list(range(world_size))
    length = len(f"profiling.profile_ranks={hydra_text(ranks)}")
    from ..core.values import MAX_OVERRIDE_CHARS
    return too_long_problem("profiling.profile_ranks", ranks, length) if length > MAX_OVERRIDE_CHARS else None


def run(args) -> int:
    from ..api import apply_overlay
    from ..bridge.recipes import world_size_for
    from ..core.errors import OverlayError, ValidationRejected
    from ..core.report import exit_code, json_text, to_dict, validation_lines
    from ..launch.nemo_run import env_words, launcher_overrides
    catalog, names, user_overrides, params = read_request(args)
    early = ranks_all_problem(catalog, names, params, args.world_size)
    if early is not None:  # before the 20-30 s import: the rank list could never be passed (issue 33 #19)
        raise UsageError([early])
    cfg, changes, problems = build_with_overrides(args.recipe, user_overrides)
    if problems:
        raise OverlayError(problems)
    world, _ = world_size_for(cfg, args.world_size)
    try:
        # The job's environment does not depend on the shell that prints the arguments (as mbmem slurm), except for
        # the allocator variables: their keys are kept in the one torch will read (core/allocconf.py, issue 33 #9).
        report = apply_overlay(cfg, names, env=allocconf.allocator_env(os.environ), params=params, world_size=world,
                               locked={path: new for path, _, new in changes}, validate=True, catalog=catalog)
    except ValidationRejected as exc:
        report = exc.report
    code = exit_code(report)
    v = report.validation
    if code == EXIT_REJECTED:
        if args.json:
            print(json_text(to_dict(report, recipe=args.recipe)))
        print("\n".join(["mbmem args: nothing printed for the launcher:", *validation_lines(v)]), file=sys.stderr)
        return code
    if v.launch_requirements:  # a placeholder stood in during validation; the job has none (as mbmem slurm)
        lines = ["mbmem args: the job needs what validation only had a placeholder for:"]
        lines += [f"  - {r}\n    fix: add --set {shlex.quote(r.split(' (', 1)[0])}" for r in v.launch_requirements]
        print("\n".join(lines), file=sys.stderr)
        return EXIT_USAGE
    env = dict(sorted(report.env_to_export.items()))
    try:
        overrides = [*user_overrides, *launcher_overrides(report)]
    except OverlayError as exc:  # a value no launcher override can carry: the command line asked for it (exit 2)
        raise UsageError(exc.problems) from None
    words = {"env": env_words(env), "overrides": overrides}
    argv = words[args.only] if args.only else [*words["env"], *overrides]
    if args.json:
        print(json_text(to_dict(report, recipe=args.recipe, world_size=world,
                                launcher={"env": env, "overrides": overrides, "argv": argv})))
    else:
        print(" ".join(shlex.quote(w) for w in argv))
    print(f"# validated for world size {world}: {v.verdict}", file=sys.stderr)
    note = allocconf.in_effect_note(env)
    if note:  # which allocator variable the job's torch reads (a PYTORCH_ALLOC_CONF given beside it is ignored)
        print(f"# {shown(note)}", file=sys.stderr)
    if code == EXIT_INCOMPLETE:
        print("\n".join(validation_lines(v)[1:]), file=sys.stderr)
    return code

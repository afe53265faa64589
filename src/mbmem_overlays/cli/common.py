"""What several commands share: exit codes, list/``--set`` parsing, building the user's recipe."""

from __future__ import annotations

from typing import Any

# Exit codes of mbmem apply/slurm/plan/recommend and train.py (documented in README, "Exit codes").
EXIT_OK = 0          # passed: our rules and Bridge's validation accept the config
EXIT_REJECTED = 1    # rejected by our rules or by Bridge's validation; nothing was changed
EXIT_USAGE = 2       # bad arguments or input files
EXIT_INCOMPLETE = 3  # our rules passed, but Bridge's validation stopped at a check this host cannot run


def csv_list(values: list[str] | None) -> list[str]:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]`` (repeated and comma-separated options)."""
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def split_sets(sets: list[str]) -> tuple[list[str], dict[str, object]]:
    """``--set`` values: ``mem.<overlay>.<param>=v`` are overlay parameters, the rest Bridge overrides."""
    from ..core.values import parse_value
    overrides, params = [], {}
    for s in sets:
        key, sep, raw = s.partition("=")
        if key.startswith("mem.") and sep and key.count(".") >= 2:
            params[key[4:]] = parse_value(raw)
        else:
            overrides.append(s)
    return overrides, params


def recipe_with_overrides(recipe: str, sets: list[str]) -> tuple[Any, dict[str, Any], dict[str, object]]:
    """(config, the fields the user set, overlay parameters) from ``--recipe`` and ``--set`` (imports Bridge)."""
    from ..bridge.overrides import apply_overrides
    from ..bridge.recipes import load_recipe
    overrides, params = split_sets(sets)
    cfg = load_recipe(recipe)
    locked = apply_overrides(cfg, overrides)
    return cfg, locked, params


def add_recipe_options(p, *, world_size: str | None) -> None:
    """--recipe, --set and (``world_size``: "required", "optional" or None) --world-size, worded the same for
    every command that builds a config."""
    p.add_argument("--recipe", required=True,
                   help="recipes/ name (llama3_70b_pretrain) or Bridge recipe function (llama3_70b_pretrain_config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Bridge override (model.tensor_model_parallel_size=4) or overlay parameter "
                        "(mem.cpu_offload.num_layers=2)")
    if world_size:
        p.add_argument("--world-size", type=int, required=world_size == "required", default=None)

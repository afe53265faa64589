"""The public API: the core engine, with Bridge's own validation composed in on request.

The engine never imports Bridge; ``validate=True`` hands it Bridge's validator (which imports Bridge
when it runs). Everything else is ``mbmem_overlays.core.engine``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from .core import engine
from .core.catalog import Catalog
from .core.errors import OverlayError


def bridge_validator(cfg: Any, world_size: int | None, env: MutableMapping[str, str] | None):
    """Bridge's ``runtime_config_update`` on a copy of ``cfg`` (see bridge/validation.py)."""
    from .bridge.validation import validate_config
    return validate_config(cfg, world_size=world_size, env=env)


def apply_overlay(cfg: Any, overlays: str | Iterable[str] = (), *, env: MutableMapping[str, str] | None = None,
                  params: Mapping[str, Any] | None = None, world_size: int | None = None,
                  locked: Mapping[str, Any] | None = None, validate: bool = False,
                  overlay_dirs: list[str] | None = None, catalog: Catalog | None = None) -> engine.Report:
    """Apply overlays to a Bridge ``ConfigContainer`` (and ``env``, when given) atomically.

    - ``overlays``: a name or a list of names; order never matters; aliases accepted. The default,
      ``()``, selects nothing: nothing is changed, the config is still checked, and the report's
      notes say that nothing was selected. ``None`` is not a selection (it is an error).
    - ``env``: a mutable mapping of text to text (e.g. ``os.environ`` or a dict) to receive
      environment changes. When None, the process environment is read but not written; the report's
      ``env_to_export`` lists what to export, and cfg.env_vars carries it.
    - ``params``: ``{"cpu_offload": {"num_layers": 2}}``, ``{"cpu_offload.num_layers": 2}``,
      or, with a single overlay, ``{"num_layers": 2}``. An alias names the same overlay; giving one
      parameter through two spellings with different values is an error.
    - ``world_size``: the number of GPUs, an ``int`` from 1 to 2^20 (None: the recipe's smallest layout).
    - ``locked``: fields the user set explicitly; an overlay that changes one is refused.
    - ``validate``: also run Bridge's own validation (imports Bridge) on a copy of the config with the
      changes applied, before anything is written; see ``report.validation``.
    - ``overlay_dirs`` / ``catalog``: where user overlays come from (a list of directories; a caller's
      catalogue is reused). A broken user overlay that is not selected only adds a warning.

    Raises ``OverlayError`` listing every problem — wrong argument types and values included
    (a plain ``dict`` as ``cfg``, ``world_size="8"`` or above 2^20, ``env="x"``, ``params=[...]``,
    ``overlays=None``, non-text env values, ``validate="yes"``; a parameter value with ``${...}``, a number out of
    range or a control character), all checked before anything else runs. With ``validate=True``, a config
    that Bridge rejects raises
    ``ValidationRejected`` (an OverlayError whose ``.report`` holds the report and
    ``.report.validation`` Bridge's verdict). Whenever it raises, cfg and env are unchanged.
    Applying the same overlays twice equals applying them once.
    """
    if not isinstance(validate, bool):  # validate="yes" / "false" / 1 would be read as truthy (issue 22 #8)
        flag = engine.argument_problem("validate", validate, f"validate must be True or False, got "
                                       f"{type(validate).__name__}", "pass validate=True (run Bridge's validation) "
                                       "or validate=False")
        others = engine.argument_problems(cfg, overlays, env, params, world_size, locked, overlay_dirs, catalog)[1]
        raise OverlayError([flag, *others])  # every wrong argument at once, nothing touched
    return engine.apply_overlay(cfg, overlays, env=env, params=params, world_size=world_size, locked=locked,
                                validator=bridge_validator if validate else None, overlay_dirs=overlay_dirs,
                                catalog=catalog)


plan_overlays = engine.plan_overlays

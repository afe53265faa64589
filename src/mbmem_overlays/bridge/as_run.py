"""The configuration Bridge will actually run: a copy of a ConfigContainer set up the way Bridge's setup sets it up.

A recipe's ConfigContainer is not what trains. Before anything is built, ``runtime_config_update`` (Bridge 0.6.2
megatron/bridge/training/config.py:1853-1888) applies the recipe's environment defaults
(``apply_environment_variables``, :1832-1850), resolves ``cfg.mixed_precision`` (a preset name or a
MixedPrecisionConfig) and writes its fields into the model, optimizer and DDP configs (training/mixed_precision.py
``MixedPrecisionConfig.finalize`` :97-111 and ``setup`` :113-135 through ``update_config_with_precision_overrides``
:138-160), sets the data-parallel size (:1029-1041), applies ``cfg.comm_overlap`` (training/comm_overlap.py
``CommOverlapConfig.finalize`` and ``setup``: the model's tp_comm_overlap, defer_embedding_wgrad_compute,
wgrad_deferral_limit, overlap_moe_expert_parallel_comm and delay_wgrad_compute, the DDP's overlap and bucket
settings), then ``validate()`` finalizes the DDP, optimizer and model configs (:1252-1262: megatron-core's deferred
``__post_init__``, which derives the fields a recipe leaves unset) and, under Megatron FSDP, turns the distributed
optimizer on (:1065-1094, :1309-1314, ``_validate_and_sync_distributed_optimizer_settings`` :1891-1914).

``vanilla_gpt_pretrain_1gpu_h100_bf16_config`` is the example: its model says ``bf16=False, params_dtype=float32``,
its ``mixed_precision`` is ``'bf16_mixed'``, and the job trains in bf16. A plan must read what Bridge runs, so
``as_run`` returns that copy, and every planning path reads through it (memory/from_config.py calls it first).

What it does differently from ``runtime_config_update``, and why:

- It never writes ``os.environ``: the recipe's ``env_vars`` are merged *under* the job environment the plan was given
  (``job_env``: the job's own variables win, as ``os.environ.setdefault`` lets them), and the data-parallel size is
  computed from the plan's world size (``get_data_parallel_size``) instead of ``WORLD_SIZE``.
- It runs Bridge's own ``setup`` and ``finalize`` functions, not copies of them, but only the steps of validate()
  that change what a plan reads; its other checks (datasets, checkpoints, schedulers, deterministic mode, the flex
  dispatcher's GPU query) are the oracle's business (bridge/validation.py), and none of them writes a field the plan
  reads.
- A check that this host cannot run does not stop it. Transformer Engine's version is asked as on the GPU nodes
  (megatron_args.te_version: the installed TE, else v2.17.1, the one Bridge 0.6.x pins), so comm_overlap's TP
  overlap and delayed-wgrad checks pass as they would there. A model check that needs what this host lacks
  (``host_checks``: the fused RoPE or permutation kernels of TE, validation.TE_ONLY_CHECKS; this host's
  gradient-accumulation-fusion default) is passed with that one setting off in a scratch copy and the setting put
  back afterwards: the memory-relevant setup is applied even then, and a note says so.
- A step Bridge refuses for a reason of the user's (a real rejection) is left out with a note; the plan reads the
  config without it. Bridge's validation (``validate=True``, bridge/validation.py) reports the rejection itself.

The copy is marked, so reading it again costs nothing (``is_as_run``); a copy *of* it (a deepcopy made to change it)
is not marked and is set up afresh. Nothing here needs CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ..core.paths import MISSING, read, write

# (weakref to the marked object itself, the world size it was set up for or None for any, refused, host notes): a
# deepcopy keeps the weakref, which then points at another object, so a copy is never taken for a set-up config
_MARK = "_mbmem_as_run"


@dataclass(frozen=True)
class AsRun:
    """``config``: the set-up copy (never the caller's object unless it already was one); ``env``: the job
    environment the plan reads (the recipe's env_vars under the given variables); ``refused``: setup steps Bridge
    refuses for this config, left out (the plan says so); ``host``: steps that ran here with a Transformer Engine
    check set aside, or stopped at one (the GPU nodes run them; nothing the plan reads is lost)."""
    config: Any
    env: dict[str, str]
    refused: tuple[str, ...] = ()
    host: tuple[str, ...] = ()


class _Notes:
    """What the steps say: a refusal of Transformer Engine's (``_te_only``) is this host's, any other Bridge's."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.host: list[str] = []

    def add(self, text: str, exc: BaseException | None = None, *, host: bool = False) -> None:
        (self.host if host or (exc is not None and _te_only(exc)) else self.refused).append(text)


def is_as_run(cfg: Any, world: int | None = None) -> bool:
    """Whether ``cfg`` is itself a copy that ``as_run`` (or ``mark_as_run``) set up, for ``world`` GPUs when given
    (the data-parallel size, and with it the communication-overlap setup, depends on it)."""
    mark = getattr(cfg, "__dict__", {}).get(_MARK)
    return mark is not None and mark[0]() is cfg and (world is None or mark[1] is None or mark[1] == int(world))


def mark_as_run(cfg: Any, world: int | None = None, refused: tuple[str, ...] = (), host: tuple[str, ...] = ()) -> Any:
    """Declare ``cfg`` already set up as Bridge runs it for ``world`` GPUs (None: for any), e.g. a copy Bridge's own
    runtime_config_update ran on: ``as_run`` then returns it unchanged. Returns ``cfg``."""
    cfg.__dict__[_MARK] = (weakref.ref(cfg), None if world is None else int(world), tuple(refused), tuple(host))
    return cfg


def job_env(cfg: Any, env: dict[str, str] | None) -> dict[str, str]:
    """The job's environment as ``apply_environment_variables`` leaves it (config.py:1832-1850): each of the
    recipe's ``env_vars`` (a scalar, written as ``str(value)``) where the job's own environment ``env`` does not set
    it (``os.environ.setdefault``). ``env`` None: nothing known of the job's own environment."""
    out: dict[str, str] = {}
    recipe_env = getattr(cfg, "env_vars", None)
    if isinstance(recipe_env, dict):
        for name, value in recipe_env.items():
            if isinstance(name, str) and name and isinstance(value, (str, int, float, bool)):
                out[name] = str(value)
    out.update({str(k): str(v) for k, v in (env or {}).items()})
    return out


def as_run(cfg: Any, world: int, env: dict[str, str] | None = None) -> AsRun:
    """A deep copy of ``cfg`` set up for ``world`` GPUs as Bridge's ``runtime_config_update`` sets it up (see the
    module's docstring); ``cfg`` and ``os.environ`` are left exactly as they were. A config that already is such a
    copy for the same world size is returned as it is (one set up for another is set up again, on a copy)."""
    if is_as_run(cfg, world):
        _, _, refused, host = cfg.__dict__[_MARK]
        return AsRun(cfg, job_env(cfg, env), refused, host)
    work = copy.deepcopy(cfg)
    notes = _Notes()
    if hasattr(work, "model") and hasattr(work, "optimizer") and hasattr(work, "ddp"):
        with _quiet(), _te_as_on_gpu_nodes():
            _mixed_precision(work, notes)
            if _data_parallel(work, world, notes):
                _comm_overlap(work, notes)
            _finalize_in_place(work, "ddp", notes)
            _finalize_in_place(work, "optimizer", notes)
            _cuda_graph_guard(work, notes)
            _finalize_model(work, notes)
            _distributed_optimizer(work, notes)
    mark_as_run(work, world, tuple(notes.refused), tuple(notes.host))
    return AsRun(work, job_env(work, env), tuple(notes.refused), tuple(notes.host))


# ----------------------------------------------------------------------------- the steps, in Bridge's order
def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _mixed_precision(work: Any, notes: _Notes) -> None:
    """config.py:1872-1877: a preset name becomes Bridge's preset; finalize(); setup(model, optimizer, ddp)."""
    mp = getattr(work, "mixed_precision", None)
    if mp is None:
        return
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config
    if isinstance(mp, str):
        try:
            mp = get_mixed_precision_config(mp)
        except ValueError as exc:
            notes.add(f"mixed_precision {mp!r} is not one of Bridge's presets ({_one_line(exc)}): the plan reads "
                      "the model's own precision fields")
            return
        work.mixed_precision = mp
    try:
        mp.finalize()
    except Exception as exc:  # noqa: BLE001 — fp4 with fp8: Bridge refuses; setup still says what each would set
        notes.add(f"Bridge refuses the mixed-precision config ({_one_line(exc)}); its fields are applied as "
                  "setup() would apply them", exc)
    mp.setup(work.model, work.optimizer, work.ddp)


def _data_parallel(work: Any, world: int, notes: _Notes) -> bool:
    """set_data_parallel_size (config.py:1029-1041) with the plan's world size instead of WORLD_SIZE."""
    try:
        dp = work.get_data_parallel_size(int(world))
    except Exception as exc:  # noqa: BLE001 — world not divisible by TP x PP x CP: Bridge refuses
        notes.add(f"no data-parallel size for world size {world} ({_one_line(exc)}): the communication-overlap "
                  "setup, which reads it, is not applied")
        return False
    work.data_parallel_size = dp
    if getattr(work, "comm_overlap", None) is not None:
        work.comm_overlap.data_parallel_size = dp
    return True


def _comm_overlap(work: Any, notes: _Notes) -> None:
    """config.py:1882-1885: CommOverlapConfig.finalize() and setup(model, optimizer, ddp), on scratch copies adopted
    when they pass. Its checks all run before it writes anything (comm_overlap.py _get_model_comm_overlap_cfgs), so a
    refusal leaves the copy as it was; a check that needs what this host lacks (``host_checks``: e.g. CUDA graphs
    with delayed wgrad need gradient-accumulation fusion, whose default Bridge takes from the host) is passed with
    its one model setting changed, put back afterwards (``_on_gpu_nodes``)."""
    if getattr(work, "comm_overlap", None) is None:
        return

    def setup(model: Any) -> Callable[[], None]:
        overlap, optimizer, ddp = copy.deepcopy((work.comm_overlap, work.optimizer, work.ddp))
        overlap.finalize()
        overlap.setup(model, optimizer, ddp)

        def adopt() -> None:
            work.comm_overlap, work.optimizer, work.ddp = overlap, optimizer, ddp
        return adopt

    _on_gpu_nodes(work, setup, notes, "Bridge's communication-overlap setup",
                  "the plan reads the config without it")


def _finalize_in_place(work: Any, section: str, notes: _Notes) -> None:
    """validate()'s ``self.ddp.finalize()`` / ``self.optimizer.finalize()`` (config.py:1252-1255): megatron-core's
    deferred __post_init__, whose assignments come before its checks; a check that fails is noted."""
    target = getattr(work, section, None)
    if target is None or not hasattr(target, "finalize"):
        return
    try:
        target.finalize()
    except Exception as exc:  # noqa: BLE001
        notes.add(f"{section}.finalize() stops at a check ({_one_line(exc)}){_te_only(exc)}; what it derives before "
                  "the check is applied", exc)


def _te_only(exc: BaseException) -> str:
    from .validation import TE_MARKERS
    return ": a check of Transformer Engine, which this host does not have" if any(
        m in str(exc) for m in TE_MARKERS) else ""


def _cuda_graph_guard(work: Any, notes: _Notes) -> None:
    """validate()'s ``validate_cuda_graph_configuration(self.model)`` before the model's finalize (config.py:1259-1261,
    utils/cuda_graph.py): with ``cuda_graph_impl`` still "none" it clears the graph modules and scope. That matters:
    a recipe that asks for graphs through the deprecated ``external_cuda_graph`` with a ``cuda_graph_scope``
    (Qwen3-30B-A3B's partial-graph MXFP8 recipe) has its scope cleared here, and finalize then turns the flag into
    TE graphs of the whole layer."""
    from megatron.bridge.training import config as bridge_config
    guard = getattr(bridge_config, "validate_cuda_graph_configuration", None)
    model = getattr(work, "model", None)
    if guard is None or model is None:
        return
    try:
        guard(model)
    except Exception as exc:  # noqa: BLE001 — a graph combination Bridge does not support
        notes.add(f"Bridge's CUDA-graph check refuses this config ({_one_line(exc)})", exc)


def _finalize_model(work: Any, notes: _Notes) -> None:
    """validate()'s ``self.model.finalize()`` (config.py:1262; models/transformer_config.py finalize: the
    pipeline dtype, sequence parallel off at TP 1, the expert TP default, then megatron-core's
    TransformerConfig.__post_init__) on a scratch copy, adopted when it passes (``_on_gpu_nodes``); any other refusal
    leaves the model as the recipe set it."""
    model = getattr(work, "model", None)
    if model is None or not hasattr(model, "finalize"):
        return
    _on_gpu_nodes(work, lambda trial: trial.finalize(), notes, "model.finalize()",
                  "the plan reads the model fields as the recipe set them")


def _on_gpu_nodes(work: Any, step: Callable[[Any], Any], notes: _Notes, what: str, otherwise: str) -> None:
    """Run one setup ``step`` on a scratch copy of ``work.model`` and adopt the copy (and what ``step`` returns, when
    it is callable) when it passes. A check that needs what this host lacks (``host_checks``) is passed with its one
    model setting changed in the scratch copy, and the setting is put back afterwards, as the GPU nodes keep it; any
    other refusal is noted and changes nothing."""
    model = work.model
    checks = _model_te_checks()
    aside: dict[str, Any] = {}   # model field -> the value it is set up with (the recipe's is put back)
    for _ in range(len(checks) + 1):
        trial = copy.deepcopy(model)
        for name, value in aside.items():
            setattr(trial, name, value)
        try:
            adopt = step(trial)
        except Exception as exc:  # noqa: BLE001
            safe = next((s for marker, s in checks if marker in str(exc)
                         and any(n not in aside and hasattr(model, n) for n in s)), None)
            if safe is None:
                notes.add(f"{what} refuses this config ({_one_line(exc)}){_te_only(exc)}: {otherwise}", exc)
                return
            aside.update({n: v for n, v in safe.items() if hasattr(model, n)})
            continue
        for name in aside:
            setattr(trial, name, getattr(model, name))
        if aside:
            notes.add(f"{what} ran with " + ", ".join(f"model.{n}={v!r}" for n, v in aside.items())
                      + " (its check needs what this host does not have); the recipe's "
                      + ", ".join(f"model.{n}={getattr(model, n)!r}" for n in aside) + " is kept, as on the GPU "
                      "nodes", host=True)
        work.model = trial
        if callable(adopt):
            adopt()
        return


def host_checks() -> tuple[tuple[str, dict[str, Any]], ...]:
    """The checks this host fails where the GPU nodes pass: (fragment of the error, {path: value that passes}).

    validation.TE_ONLY_CHECKS (a kernel or version of Transformer Engine); and, where this host can fuse gradient
    accumulation neither through TE nor APEX, megatron-core's refusal to defer the embedding's weight gradient without
    that fusion (model_parallel_config.py:550-553): Bridge's GPTModelProvider takes its default from the host it is
    built on (gpt_provider.py:205 ``fusions.can_enable_gradient_accumulation_fusion``), off here and on wherever TE is
    installed, so a recipe that defers the wgrad (Llama 3 70B's perf recipes) passes with it on."""
    from .validation import TE_ONLY_CHECKS
    out = [(marker, {p: (v() if callable(v) else v) for p, v in safe.items()}) for marker, safe in TE_ONLY_CHECKS]
    try:
        from megatron.bridge.utils.fusions import can_enable_gradient_accumulation_fusion
        fusion_here = can_enable_gradient_accumulation_fusion()
    except Exception:  # noqa: BLE001 — a Bridge without the helper: nothing to add
        fusion_here = True
    if not fusion_here:
        out.append(("Cannot defer embedding wgrad compute when gradient accumulation fusion is not used",
                    {"model.gradient_accumulation_fusion": True}))
        # comm_overlap.py:545-553: delayed wgrad inside a CUDA-graph scope asserts the same host default
        out.append(("CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion",
                    {"model.gradient_accumulation_fusion": True}))
    return tuple(out)


def _model_te_checks() -> tuple[tuple[str, dict[str, Any]], ...]:
    """host_checks() that the model's finalize raises: (marker, {model field: value that passes})."""
    out = []
    for marker, safe in host_checks():
        fields_ = {p.partition(".")[2]: v for p, v in safe.items() if p.startswith("model.")}
        if fields_ and "NVIDIA driver" not in marker:   # the flex dispatcher's GPU query is not in finalize()
            out.append((marker, fields_))
    return tuple(out)


def _distributed_optimizer(work: Any, notes: _Notes) -> None:
    """What validate() turns on: Megatron FSDP's distributed-optimizer flags and its other memory-relevant switches
    (``_validate_and_apply_megatron_fsdp_configs``, config.py:1065-1094, which writes before it checks), then the
    DDP/optimizer distributed-optimizer sync (``_validate_and_sync_distributed_optimizer_settings``)."""
    from megatron.bridge.training import config as bc
    dist, ddp = getattr(work, "dist", None), getattr(work, "ddp", None)
    if getattr(dist, "use_megatron_fsdp", False) or getattr(ddp, "use_megatron_fsdp", False):
        try:
            work._validate_and_apply_megatron_fsdp_configs()
        except Exception as exc:  # noqa: BLE001 — its checks (checkpoint format, CUDA_DEVICE_MAX_CONNECTIONS)
            notes.add(f"Bridge's Megatron FSDP checks refuse this config ({_one_line(exc)}); the settings they "
                      "apply first are applied", exc)
    sync = getattr(bc, "_validate_and_sync_distributed_optimizer_settings", None)
    if sync is not None:
        try:
            sync(work)
        except Exception as exc:  # noqa: BLE001
            notes.add(f"the distributed-optimizer sync refuses this config ({_one_line(exc)})", exc)


# ----------------------------------------------------------------------------- the host
@contextlib.contextmanager
def _quiet():
    """Bridge's setup prints (print_rank_0) and warns; stdout carries our report and --json one object."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# The modules of Bridge's setup that ask Transformer Engine's version (is_te_min_version) or whether it is installed
# (HAVE_TE): comm_overlap.py:21/:28-34 (TP overlap is switched off without TE, delayed wgrad asserts TE >= 2.7),
# mixed_precision.py:22 (fp4 asserts TE >= 2.7), transformer_config.py:37 (MoE FP8 and grouped-GEMM version checks),
# optimizer_config.py:9, :438-439 (the precision-aware optimizer's store_param_remainders, turned off below TE 2.1:
# without TE here it would be, and the plan would count a 4-byte master where the job's TE keeps 2).
TE_ASKING_MODULES = ("megatron.bridge.training.comm_overlap", "megatron.bridge.training.mixed_precision",
                     "megatron.core.transformer.transformer_config", "megatron.core.optimizer.optimizer_config")


@contextlib.contextmanager
def _te_as_on_gpu_nodes():
    """Transformer Engine's version and presence as the GPU nodes have them (megatron_args.te_version), for the
    duration of the setup; restored on exit whatever happens. Nothing changes where TE is installed."""
    from .megatron_args import _te_min_version, te_version
    version, installed_here = te_version()
    if installed_here:
        yield
        return
    patched = []
    try:
        for name in TE_ASKING_MODULES:
            module = sys.modules.get(name)
            if module is None:
                continue
            if hasattr(module, "is_te_min_version"):
                patched.append((module, "is_te_min_version", module.is_te_min_version))
                module.is_te_min_version = _te_min_version(version)
            if hasattr(module, "HAVE_TE"):
                patched.append((module, "HAVE_TE", module.HAVE_TE))
                module.HAVE_TE = True
        yield
    finally:
        for module, attr, original in reversed(patched):
            setattr(module, attr, original)


# ----------------------------------------------------------------------------- the oracle: Bridge's own setup
def bridge_runtime_update(cfg: Any, world: int) -> tuple[Any | None, dict[str, Any], str | None]:
    """(copy after Bridge's own ``runtime_config_update``, the settings put aside for it, why it could not run):
    the oracle ``as_run`` is checked against (tests/test_plan_as_run.py, bench/plan_as_run.py). Run as
    bridge/validation.py runs it: ``WORLD_SIZE`` set, ``os.environ`` restored afterwards, placeholder folders for the
    paths Bridge checks are given (a PEFT recipe's pretrained checkpoint, a fast-cache dataset's path_to_cache);
    Transformer Engine's version asked as on the GPU nodes (``_te_as_on_gpu_nodes``, as megatron_args asks validate_args), the
    flex dispatcher's GPU query skipped (``_no_gpu_query``); and a check that needs what this host lacks
    (``host_checks``) passed with its setting off, which the second value names so that the caller sets it on its side
    too (the two sides stay comparable). The copy is marked as run (``mark_as_run``): planning it reads it as it
    is."""
    import shutil
    import tempfile

    from megatron.bridge.training import config as bridge_config

    from .validation import TE_MARKERS, _preserved_environ
    # the flex dispatcher's check asks the GPU (validate_flex_dispatcher_backend, the last step of validate(), after
    # everything a plan reads is set): skipped here rather than answered by another dispatcher
    checks = tuple((m, s) for m, s in host_checks() if "NVIDIA driver" not in m)
    put_aside: dict[str, Any] = {}
    base = copy.deepcopy(cfg)
    placeholders = []   # paths Bridge checks exist, which a plan has no need of (validation.py does the same)
    for path, needed in (("checkpoint.pretrained_checkpoint", read(base, "peft", None) is not None),
                         # BlendedMegatronDatasetConfig.__post_init__ asserts --data-cache-path with these
                         ("dataset.path_to_cache", bool(read(base, "dataset.fast_cache_load", False)
                                                         or read(base, "dataset.defer_npy_index_mmap", False)))):
        if needed and read(base, path, MISSING) is None:
            placeholders.append((path, tempfile.mkdtemp(prefix="mbmem-placeholder-")))
            write(base, path, placeholders[-1][1])
    try:
        for _ in range(len(checks) + 1):
            attempt = copy.deepcopy(base)
            with _preserved_environ(), _te_as_on_gpu_nodes(), _no_gpu_query(bridge_config), \
                    contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                os.environ["WORLD_SIZE"] = str(int(world))
                try:
                    bridge_config.runtime_config_update(attempt)
                except Exception as exc:  # noqa: BLE001
                    for marker, safe in checks:
                        first = next(iter(safe))
                        if marker in str(exc) and read(base, first, MISSING) is not MISSING \
                                and read(base, first, None) != safe[first]:
                            for path, value in safe.items():
                                if read(base, path, MISSING) is not MISSING:
                                    put_aside[path] = value
                                    write(base, path, value)
                            break
                    else:
                        why = _one_line(exc) + (" (needs Transformer Engine)" if any(m in str(exc) for m in TE_MARKERS)
                                                else "")
                        return None, put_aside, why
                    continue
            for path, _ in placeholders:
                write(attempt, path, None)
            return mark_as_run(attempt, world), put_aside, None
        return None, put_aside, "too many TE-only checks"
    finally:
        for _, folder in placeholders:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _no_gpu_query(bridge_config):
    """Bridge's flex-dispatcher check reads the GPU's properties (flex_dispatcher_backend.py:103-120), which a CPU host
    does not have: for the oracle it does nothing, and is put back on exit."""
    original = getattr(bridge_config, "validate_flex_dispatcher_backend", None)
    if original is None:
        yield
        return
    bridge_config.validate_flex_dispatcher_backend = lambda model_config: None
    try:
        yield
    finally:
        bridge_config.validate_flex_dispatcher_backend = original

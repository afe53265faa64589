"""``mbmem doctor --plan`` on a Megatron-LM job's log: the job from its own arguments (the ``arguments`` dump at
the head of its log, else the launch command the log shows), every remedy realized on that job's configuration
through the engine, priced by the memory model, and written as the job's own flags and environment, each set
parsed and validated by megatron-core (memory/megatron.py ``MegatronTarget``, bridge/megatron_args.py
``change_job``). A ``train.py`` command is for a Bridge recipe only; none is printed here.

Imports Megatron Bridge and megatron-core (only with ``--plan``): the default doctor never imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.values import ascii_int
from . import command as C

GiB = 1 << 30


@dataclass
class FoundJob:
    """The Megatron-LM job a log carries, with where it was read and, for a launch command, the words before its
    flags (a printed command keeps them)."""
    job: Any
    source: str                       # "the arguments dump of LOG", "the launch command [LOG:3]"
    prefix: tuple[str, ...] = ()      # launcher words up to the script; () when only the flags can be printed


def megatron_dump(paths: list[str], at: str | None = None) -> tuple[str, str] | None:
    """(path, text) of the first log whose head holds Megatron-LM's ``arguments`` dump (read again, bounded, by
    bridge/megatron_args.py read_source; standard input cannot be read twice), None when none does. ``at``: where
    the doctor's scan saw the latest start's dump (``Findings.megatron_args``, "LOG:LINE"; a log that holds several
    starts of the job, parse.py _new_start): that log's text from that line on, so its dump is the one read."""
    from ..bridge.megatron_args import MegatronArgsError, dump_header, read_source
    for path in paths:
        if path == "-":
            continue
        try:
            text = read_source(path)
        except MegatronArgsError:
            continue
        if at is not None and at.rpartition(":")[0] == path:
            line = ascii_int(at.rpartition(":")[2], 12) or 1
            cut = _line_offset(text, line)
            if cut is not None and dump_header(text[cut:]) is not None:
                return path, text[cut:]
        if dump_header(text) is not None:
            return path, text
    return None


def _line_offset(text: str, line: int) -> int | None:
    """Offset of the start of 1-based ``line`` in ``text``, None past its end."""
    pos = 0
    for _ in range(line - 1):
        pos = text.find("\n", pos)
        if pos < 0:
            return None
        pos += 1
    return pos


def find_job(paths: list[str], f, world_size: int | None, arch: int | None) -> tuple[FoundJob | None, str]:
    """(the job, "") from the first log whose head holds Megatron-LM's arguments dump, else from the log's launch
    command when it runs a Megatron-LM script; (None, why) when neither gives a job megatron-core accepts, (None,
    "") when the log shows neither. The world size: --world-size, else the dump's or the launcher's, else the one
    the log shows."""
    from ..bridge.megatron_args import DEFAULT_ARCH, MegatronArgsError, job_words, load_job
    from ..memory.coverage import with_coverage
    from .diagnose import launch_problem
    latest = f.run_read if len(getattr(f, "runs", ())) > 1 else None
    dump = megatron_dump(paths, latest)
    sources = []
    why = []
    if dump is not None:
        source = f"the arguments dump of {dump[0]}"
        if latest is not None and latest.rpartition(":")[0] == dump[0]:
            source += (f" (start {f.runs.index(latest) + 1} of the log's {len(f.runs)}, line "
                       f"{latest.rpartition(':')[2]}: the one the diagnosis reads)")
        sources.append((dump[1], source, ()))
    elif "-" in paths and getattr(f, "megatron_args", None) is not None:
        why.append("its arguments dump came on standard input, which cannot be read twice: save the log to a file "
                   "and give its path")
    command = f.command.value if f.command else None
    launch = C.parse_launch(command) if command else None
    if launch is not None and launch.kind == "megatron-lm":
        # the launcher words are printed again only when the doctor may reuse them (no control text, no ${...})
        prefix = tuple(launch.launcher) if launch_problem(command) is None else ()
        sources.append((command, f"the launch command [{f.command.where}]", prefix))
    for text, source, prefix in sources:
        try:
            words = job_words(text)
            world = world_size or (None if words.launcher_world else (f.world.value if f.world else None))
            # the tokenizer's size the job printed ("padded vocab (size: N)") is the one it trained with
            vocab = f.vocab.value if getattr(f, "vocab", None) is not None else None
            job = with_coverage(load_job(words, world_size=world, arch=arch or DEFAULT_ARCH, vocab=vocab))
        except MegatronArgsError as exc:
            fix = "" if not exc.fix or world_size or exc.flag != "--world-size" else f" ({exc.fix})"
            why.append(f"{source}: {exc.message}{fix}")
            continue
        return FoundJob(job, source, prefix), ""
    return None, "; ".join(why)


# The job's arguments the doctor's remedies read from the log's own config lines (diagnose.py capacity_remedies,
# config_notes, turn_off_remedies): filled from the job where the log does not print them (a command line).
CONFIG_KEYS = ("micro_batch_size", "recompute_granularity", "recompute_modules", "sequence_parallel",
               "use_distributed_optimizer", "use_precision_aware_optimizer", "use_megatron_fsdp",
               "fine_grained_activation_offloading", "optimizer_cpu_offload", "cpu_offloading",
               "cpu_offloading_num_layers", "num_workers")
LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "cp": "context_parallel_size", "dp": "data_parallel_size",
               "vpp": "virtual_pipeline_model_parallel_size"}


def enrich(f, found: FoundJob) -> None:
    """What the job's validated arguments say, added to the findings where the log itself does not say it, cited
    to where the arguments were read: the remedies are then the ones for this job (no distributed optimizer
    proposed to a job that has it, the micro-batch a command line gives)."""
    from .parse import Seen
    args = found.job.args
    where = found.source.rsplit("[", 1)[-1].rstrip("]") if "[" in found.source else found.source
    for key in CONFIG_KEYS:
        if key not in f.config and key in args:
            value = args[key]
            f.config[key] = Seen(" ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value), where)
    for short, key in LAYOUT_KEYS.items():
        value = args.get(key)
        if short not in f.layout and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            f.layout[short] = value
            f.layout_where[short] = where


def price_remedies(found: FoundJob, remedies: list[C.Remedy], *, arch: int | None,
                   overlay_dirs: list[str] | None = None) -> tuple[list[C.Remedy], float]:
    """Each remedy realized on the job's configuration: its saving (the memory model, on the job's GPUs and
    environment), its step-time cost for the job (memory/cost/, ``Remedy.step_cost``, which ranks it) beside the
    documented words (memory/costs.py, as the ladder words it) and the job's flags as its command
    (``Remedy.command``, ``Remedy.megatron``), validated by megatron-core. Returns (the remedies no flags can make,
    or that change nothing for this job; the plan's peak of the job as it ran)."""
    from ..core.catalog import Catalog
    from ..memory import cost as K
    from ..memory.megatron import MegatronTarget, documented_cost
    from ..memory.steps import Candidate, Rejected

    job = found.job
    target = MegatronTarget(job, arch=arch)
    catalog = Catalog(overlay_dirs)
    start = target.start()
    per_stage = max(1, job.config.model.num_layers // job.config.model.pipeline_model_parallel_size)
    base = target.footprint(job.config)
    base_job = K.job_of(job.config, job.world_size, arch=target.arch, env=target.env)
    refused: list[C.Remedy] = []
    for r in remedies:
        if r.command:      # not a change of the job (nvidia-smi, an upgrade): kept as it is
            continue
        if r.env and not (r.overlay or r.overrides):
            change = target.env_change(r.env)
        elif r.overlay or r.overrides:
            params = {k: C._typed(v) for k, v in r.params.items()}
            cand = Candidate().plus(r.overlay, params=params or None, sets=dict(r.overrides))
            try:
                work, report = target.realize(job.config, start, cand, job.world_size, catalog=catalog)
            except Rejected as exc:
                r.megatron = {"ok": False, "reason": exc.reason, "text": None}
                refused.append(r)
                continue
            change = report.megatron
            if r.overlay != "expandable_segments":    # fragmentation is outside the allocated-memory plan
                r.saves = max(0.0, base - target.footprint(work))
            r.cost = documented_cost(cand, per_stage) or r.cost
            try:
                r.step_cost = K.price(base_job, K.job_of(work, job.world_size, arch=target.arch, env=target.env),
                                      target.arch).as_dict()
            except (ValueError, TypeError, ArithmeticError, KeyError):   # unpriced, never raised
                r.step_cost = None
        else:
            continue
        if not change.ok or change.empty:
            reason = change.reason or "already in effect in the job's arguments"
            r.megatron, r.saves = {**change.as_dict(), "ok": False, "reason": reason}, None
            refused.append(r)
            continue
        full = found.prefix and not any("$" in w for w in change.argv)
        r.command = change.command(found.prefix) if full else change.text()
        r.command_note, r.megatron = change.check, change.as_dict()
    return refused, base


def status(found: FoundJob, base: float, shortfall: float | None, arch: int | None) -> str:
    """The savings line of a Megatron-LM job's diagnosis: what was planned, on which GPUs, and what the plan does
    not follow."""
    from ..bridge.megatron_args import DEFAULT_ARCH
    job = found.job
    m = job.config.model
    dp = job.world_size // max(1, m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                               * m.context_parallel_size)
    text = (f"savings from the memory model on the job's own Megatron-LM arguments ({found.source}), world size "
            f"{job.world_size} (TP{m.tensor_model_parallel_size} PP{m.pipeline_model_parallel_size} "
            f"CP{m.context_parallel_size} DP{dp}), GPUs of compute capability {arch or DEFAULT_ARCH}"
            + ("" if arch else " (--gpu-arch not given)") + f": the plan's peak {base / GiB:.2f} GiB"
            + (f"; the failed request was short by {shortfall / GiB:.2f} GiB" if shortfall else "")
            + "; each remedy's flags parsed and validated by megatron-core 0.19.2's validate_args")
    if job.translated:
        text += "; " + "; ".join(n.text() for n in job.translated)
    if job.not_modelled:
        text += "; NOT MODELLED: " + ", ".join(n.flag for n in job.not_modelled)
    if job.unknown:
        text += "; unknown to megatron-core 0.19.2: " + ", ".join(n.flag for n in job.unknown[:8])
    return text

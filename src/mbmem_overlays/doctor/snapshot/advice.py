"""The next step from a snapshot's verdict: remedies in order, and the first one as a checked command.

The same kind of command as the log doctor's (doctor/command.py): a train.py command with the remedy's
overlay, checked against the overlay catalogue without Bridge, and validated by the engine on the recipe
with ``--plan``. A snapshot does not hold the launch command, so the command is the train.py template for
``--recipe`` (or ``recipe=<recipe>``): keep your own overrides and overlays beside it.

Which remedy comes first follows the snapshot: fragmentation -> expandable segments (zero cost); a capacity
limit -> the lever for what filled the GPU at the OOM (activations -> recompute, optimizer state -> the
distributed optimizer), then the memory-tuning skill's ladder; other processes -> find them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import command as C
from ..diagnose import COST, NVIDIA_SMI
from .analyze import Report

# (overlays, parameters, command text) -> (status text, whether the overlay changes nothing in the recipe's config)
Validator = Callable[[list[str], dict, str], tuple[str, bool]]


@dataclass(frozen=True)
class Advice:
    remedies: tuple[C.Remedy, ...]
    next_command: str | None
    command_check: str
    reasons: tuple[str, ...]


def _overlay(name: str, action: str, **kw) -> C.Remedy:
    return C.Remedy(name, action, overlay=name, cost=COST.get(name, ""), **kw)


LADDER = ("selective_recompute", "dist_optimizer", "full_recompute", "optimizer_offload")
ACTIONS = {
    "selective_recompute": "recompute the narrowest module in backward (selective recompute)",
    "dist_optimizer": "shard optimizer state (and the fp32 master copy) across data-parallel ranks",
    "full_recompute": "recompute whole layers (full recompute)",
    "optimizer_offload": "keep optimizer state on the CPU (last resort)",
}


def capacity_remedies(report: Report) -> tuple[list[C.Remedy], list[str]]:
    """The ladder, led by the lever for the largest plan component live at the OOM (or the peak)."""
    m = report.moment
    parts = m.components if m else {}
    total = sum(parts.values()) or 1
    order = list(LADDER)
    reasons = []
    if parts:
        top, top_bytes = max(parts.items(), key=lambda kv: kv[1])
        share = f"{top_bytes / total:.0%} of the live memory"
        if top == "optimizer":
            order = ["dist_optimizer", "selective_recompute", "full_recompute", "optimizer_offload"]
            reasons.append(f"optimizer state is the largest part ({share}): shard it first")
        elif top == "activations":
            reasons.append(f"activations are the largest part ({share}): recompute first")
        elif top == "parameters+gradients":
            order = ["dist_optimizer", *[o for o in LADDER if o != "dist_optimizer"]]
            reasons.append(f"parameters and gradient buffers are the largest part ({share}); more tensor or pipeline "
                           "parallelism divides them, the distributed optimizer shards the fp32 master and the "
                           "optimizer state beside them")
    return [_overlay(name, ACTIONS[name]) for name in order], reasons


def remedies_for(report: Report) -> tuple[list[C.Remedy], list[str]]:
    kind = report.kind
    if kind == "fragmentation":
        if report.torch_predates_expandable:
            first = C.Remedy("max_split_size_mb", "stop the allocator splitting large blocks (this snapshot's format "
                             "is from a torch that may predate expandable_segments, torch >= 2.1)",
                             env=C.merged_alloc_env(None, "max_split_size_mb", "512"), cost=COST["max_split_size_mb"])
        else:
            first = _overlay("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the overlay "
                             "merges it with your other allocator keys)")
        rest, why = capacity_remedies(report)
        return [first, *rest], ["memory-tuning skill, Quick Decision step 1: fragmentation first, at zero cost", *why]
    if kind == "capacity":
        return capacity_remedies(report)
    if kind == "other_processes":
        rest, why = capacity_remedies(report)
        return [C.Remedy("other_processes", "stop or move the other processes on this GPU (one training process per "
                         "GPU)", cost="none for training", command=NVIDIA_SMI,
                         command_note="lists the processes holding the GPU; nothing to validate"), *rest], why
    if kind == "oom_unknown":
        rest, why = capacity_remedies(report)
        lead = report.lead_device
        if lead is not None and lead.dump.reserved and lead.dump.reserved - lead.dump.allocated < 0.02 * lead.dump.reserved:
            return rest, why   # hardly anything reserved was unallocated: not a fragmentation remedy
        return [_overlay("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, the zero-cost "
                         "first step while the verdict is unknown"), *rest], why
    return [], []


def advise(report: Report, recipe: str | None, validator: Validator | None = None) -> Advice:
    """The remedies and the first one as a checked command; with a validator (``--plan``), a remedy the recipe's
    config already has (the engine changes nothing) gives way to the next one."""
    remedies, reasons = remedies_for(report)
    if not remedies:
        return Advice((), None, "nothing to change: no OOM", tuple(reasons))
    catalog, catalog_error = C.load_catalog()
    launch = C.parse_launch(None, "", recipe)
    fill = "" if recipe else "fill in <recipe>; "
    keep = "keep your job's own overrides and overlays beside it"
    skipped: list[str] = []
    for i, remedy in enumerate(remedies):
        if remedy.command:
            return Advice(tuple(remedies), remedy.command, remedy.command_note, tuple(reasons))
        tokens, overlays = C.apply_remedy(launch, remedy, catalog)
        text = C.render_tokens(tokens)
        if not remedy.overlay:
            return Advice(tuple(remedies), text, f"{fill}environment change only: no overlay to validate; {keep}",
                          tuple(reasons))
        params = C.params_in(C.parse_launch(text))
        problems = C.check_catalog(overlays, params, {}, catalog) if catalog else [catalog_error or "no catalogue"]
        if problems:
            return Advice(tuple(remedies), text, "NOT VALID: " + "; ".join(problems), tuple(reasons))
        if validator is None:
            return Advice(tuple(remedies), text,
                          f"{fill}checked against the overlay catalogue (names, parameters, no two overlays writing one "
                          "field); not validated on the recipe's config: add --plan --recipe R with Megatron Bridge "
                          "installed; " + keep, tuple(reasons))
        status, no_op = validator(overlays, params, text)
        if no_op and i + 1 < len(remedies):
            skipped.append(f"{remedy.name} is already in effect in the recipe's config (the engine changes nothing): "
                           "the next remedy is proposed")
            continue
        return Advice(tuple(remedies[i:]), text, f"{status}; {keep}", (*reasons, *skipped))
    return Advice((), None, "every remedy is already in effect in the recipe's config", (*reasons, *skipped))


def with_replay(advice: Advice, report: Report, what_if) -> Advice:
    """The verdict backed (or questioned) by --what-if's replay of the failing device (whatif.py): fragmentation
    by the setting that serves the failing request, capacity by no setting serving it."""
    from dataclasses import replace as _replace

    from .whatif import verdict_line as what_if_verdict
    oom = report.oom
    device = next((d for d in what_if if oom is not None and d.device == oom.device and d.request is not None), None)
    if device is None:
        return advice
    line = what_if_verdict(device)
    tried = ", ".join(s.label for s in device.scenarios[1:]) or "none (give --what-if all)"
    fits = device.fitting()
    if device.baseline.served or device.capacity is None:
        text = f"replayed: {line}"
    elif report.kind == "fragmentation":
        text = (line if fits else
                f"replayed: none of the settings tried serves the failing request ({tried}): the fragmentation "
                "reading is not confirmed by the replay")
    elif report.kind == "capacity":
        text = (f"no allocator setting serves it (replayed; tried: {tried})" if not fits else
                f"replayed: {line}; the figures read capacity, the replay finds a setting that fits")
    else:
        text = f"replayed: {line}"
    return _replace(advice, reasons=(*advice.reasons, text))

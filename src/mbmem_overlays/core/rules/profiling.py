"""Bridge's profiling settings: the profilers, their step window, and PyTorch memory-history recording.

What Bridge 0.6.2 does with them (runtime-outputs.md, Memory snapshots): ``ProfilingConfig.finalize`` refuses both
profilers at once and a step window that runs backwards; ``start_memory_history_recording`` (training/setup.py:377,
before the model is built) records on the ranks in ``profile_ranks`` only, by plain membership; an OOM observer
writes ``<base>_oom_rank-<R><ext>`` and ``training_log`` writes ``<base>_<R><ext>`` at ``profile_step_end``, both
with a bare ``open(..., "wb")`` that creates no folder.
"""

from __future__ import annotations

import os
import re

from ..console import CWD_FIX, CWD_GONE, cwd_missing
from ..text import quoted_word as q
from .facts import data_parallel_size
from .registry import check, resolver

OUTPUTS = "runtime-outputs.md, Memory snapshots"
TRAIN_UTILS = "megatron/bridge/training/utils/train_utils.py"
FINALIZE = "Bridge config.py:755-763 ProfilingConfig.finalize"
SNAPSHOT_FILE = "memory_snapshot.pickle"
NEMO_RUN_MOUNT = "/nemo_run"    # Bridge's default memory_snapshot_path lives here: NeMo-Run's container mount
RING_ENTRIES = 100_000          # Bridge's trace_alloc_max_entries (train_utils.py start_memory_history_recording)
LAYOUT_READS = ("model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
                "model.context_parallel_size", "dist.use_tp_pp_dp_mapping")
_RANK_LIST = re.compile(r"\[?\s*\d+(\s*[,\s]\s*\d+)*\s*\]?")


# ----------------------------------------------------------------------------- the overlay's logic
def run_folder(view) -> str:
    """The run's output folder as Bridge's recipes lay it out: ``<run>/checkpoints`` (checkpoint.save) and
    ``<run>/tb_logs`` (logger.tensorboard_dir), recipes/common.py. Their common parent when both are set; else
    the parent of a folder named checkpoints/tb_logs, or the folder itself; else the recipes' own default,
    ``<cwd>/nemo_experiments/default`` (never /nemo_run, which exists only inside a NeMo-Run container)."""
    dirs = [d for d in (view.get("checkpoint.save"), view.get("logger.tensorboard_dir")) if isinstance(d, str) and d]
    if len(dirs) == 2 and os.path.isabs(dirs[0]) == os.path.isabs(dirs[1]):
        common = os.path.commonpath([os.path.normpath(d) for d in dirs])
        if common not in ("", os.sep, "."):
            return common
    if dirs:
        folder = os.path.normpath(dirs[0])
        return os.path.dirname(folder) if os.path.basename(folder) in ("checkpoints", "tb_logs") else folder
    try:
        cwd = os.getcwd()
    except FileNotFoundError:  # a deleted working directory: memory_snapshot_folder refuses the relative path
        return os.path.join("nemo_experiments", "default")
    return os.path.join(cwd, "nemo_experiments", "default")


def pipeline_stage_first_ranks(view) -> tuple[int, int] | None:
    """(first rank of the first stage, first rank of the last stage), or None without a world size or PP.

    Megatron-core's rank order is tp-cp-ep-dp-pp (pp varies slowest: stage s holds ranks s*world/pp ...), or
    tp-cp-ep-pp-dp with dist.use_tp_pp_dp_mapping (Bridge initialize.py:820)."""
    pp = view.get("model.pipeline_model_parallel_size") or 1
    dp = data_parallel_size(view)
    if view.world_size is None or dp is None or pp <= 1:
        return None
    if view.get("dist.use_tp_pp_dp_mapping"):
        tp, cp = view.get("model.tensor_model_parallel_size") or 1, view.get("model.context_parallel_size") or 1
        return 0, (pp - 1) * tp * cp
    return 0, (pp - 1) * (view.world_size // pp)


def parse_ranks(spec, view) -> tuple[list[int] | None, str]:
    """The ranks the ``ranks`` parameter names, and a note on how (None: the text names no ranks)."""
    if isinstance(spec, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in spec):
        return list(dict.fromkeys(spec)), ""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return [spec], ""
    if not isinstance(spec, str):
        return None, ""
    text = spec.strip()
    if text == "auto":
        return [0], ("rank 0 is in the first pipeline stage, which 1F1B makes the hottest (it holds the most "
                     "microbatches in flight)")
    if text == "pipeline_ends":
        ends = pipeline_stage_first_ranks(view)
        if ends is None:
            return [0], "pipeline_ends: one pipeline stage (or no world size), so rank 0 only"
        return sorted(set(ends)), "the first rank of the first and of the last pipeline stage"
    if text == "all":
        if view.world_size is None:
            return [0], "all: the world size is unknown, so rank 0 only"
        return list(range(view.world_size)), "every rank (each one pays the recording cost and writes a file)"
    if len(text) <= 4096 and _RANK_LIST.fullmatch(text):
        return list(dict.fromkeys(int(x) for x in re.findall(r"\d+", text))), ""
    return None, ""


@resolver("memory_snapshot", writes=("profiling.memory_snapshot_path", "profiling.profile_ranks",
                                     "profiling.profile_step_end", "profiling.profile_step_start"))
def memory_snapshot(view, params):
    """``path: auto`` is ``<run folder>/memory_snapshot.pickle`` (the run folder: the common parent of
    checkpoint.save and logger.tensorboard_dir, as Bridge's recipes lay them out); ``ranks`` becomes
    profiling.profile_ranks (auto: [0], the first pipeline stage); ``dump_step`` > 0 sets profile_step_end (and
    lowers profile_step_start to it when needed, as finalize requires end >= start)."""
    fields = {}
    path = params["path"]
    if path == "auto":
        path = os.path.join(run_folder(view), SNAPSHOT_FILE)
        params["path"] = path
    fields["profiling.memory_snapshot_path"] = path
    ranks, _ = parse_ranks(params["ranks"], view)
    if ranks is not None:  # text that names no ranks is reported by profile_ranks_in_world
        fields["profiling.profile_ranks"] = ranks
    step = params["dump_step"]
    if step > 0:
        fields["profiling.profile_step_end"] = step
        start = view.get("profiling.profile_step_start")
        if isinstance(start, int) and start > step:
            fields["profiling.profile_step_start"] = step
    return fields, {}


# ----------------------------------------------------------------------------- rules
@check(enforced_by="bridge", oracle="Exactly one of pytorch or nsys profiler should be enabled",
       source=f"{FINALIZE} (assert not (use_pytorch_profiler and use_nsys_profiler))",
       reads=("profiling.use_pytorch_profiler", "profiling.use_nsys_profiler"))
def profilers_exclusive(view, c):
    """The PyTorch profiler and the nsys profiler exclude each other."""
    if view.get("profiling.use_pytorch_profiler") and view.get("profiling.use_nsys_profiler"):
        yield c.problem(view.parties("profiling.use_pytorch_profiler", "profiling.use_nsys_profiler"),
                        "profiling.use_nsys_profiler", True,
                        "Exactly one of pytorch or nsys profiler should be enabled, not both, when ProfilingConfig is "
                        "active", "set profiling.use_pytorch_profiler=false or profiling.use_nsys_profiler=false")


@check(enforced_by="bridge", oracle=("profile_step_start must be >= 0", "profile_step_end must be >= 0",
                                     "must be >= profile_step_start"),
       source=f"{FINALIZE} (start >= 0, end >= 0, end >= start)",
       reads=("profiling.profile_step_start", "profiling.profile_step_end"))
def profile_steps_ordered(view, c):
    """The profiling window has 0 <= profile_step_start <= profile_step_end."""
    start, end = view.get("profiling.profile_step_start"), view.get("profiling.profile_step_end")
    if not (isinstance(start, int) and isinstance(end, int)):
        return
    who = view.parties("profiling.profile_step_start", "profiling.profile_step_end")
    if start < 0:
        yield c.problem(who, "profiling.profile_step_start", start, f"profile_step_start must be >= 0, got {start}",
                        "set profiling.profile_step_start to an iteration number >= 0")
    if end < 0:
        yield c.problem(who, "profiling.profile_step_end", end, f"profile_step_end must be >= 0, got {end}",
                        "set profiling.profile_step_end (mem.memory_snapshot.dump_step) to an iteration >= 0")
    elif end < start:
        yield c.problem(who, "profiling.profile_step_end", end,
                        f"profile_step_end ({end}) must be >= profile_step_start ({start})",
                        f"set profiling.profile_step_start<={end} or profiling.profile_step_end>={start}")


@check(enforced_by="runtime",
       source=f"{OUTPUTS}; {TRAIN_UTILS} start_memory_history_recording and training_log test "
              "`rank in profile_ranks` when the job runs: a rank outside the world never matches, so nothing is "
              "recorded and no snapshot is ever written (nothing fails)",
       reads=("profiling.record_memory_history", "profiling.profile_ranks", *LAYOUT_READS))
def profile_ranks_in_world(view, c):
    """Memory history is recorded on at least one rank, and every profiled rank is in the world."""
    if not view.get("profiling.record_memory_history"):
        return
    who = view.parties("profiling.profile_ranks")
    if "memory_snapshot" in view.selected:
        spec = view.params.get("memory_snapshot", {}).get("ranks")
        if parse_ranks(spec, view)[0] is None:
            yield c.problem(("memory_snapshot",), "mem.memory_snapshot.ranks", spec,
                            f"ranks {spec!r} names no ranks: use auto, pipeline_ends, all, or rank numbers",
                            "e.g. mem.memory_snapshot.ranks=auto or mem.memory_snapshot.ranks=\"'0,8'\"")
            return
    ranks = view.get("profiling.profile_ranks")
    if not isinstance(ranks, (list, tuple)):
        return
    if not ranks:
        yield c.problem(who, "profiling.profile_ranks", list(ranks),
                        "profile_ranks is empty: Bridge records memory history on no rank, so no snapshot is written",
                        "set mem.memory_snapshot.ranks=auto (rank 0) or name the ranks")
        return
    bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or r < 0
           or (view.world_size is not None and r >= view.world_size)]
    if bad:
        world = f"the world has ranks 0..{view.world_size - 1}" if view.world_size else "ranks are >= 0"
        yield c.problem(who, "profiling.profile_ranks", list(ranks),
                        f"profile_ranks {bad} name no process ({world}): Bridge would record and write nothing "
                        "for them", f"use ranks below {view.world_size}" if view.world_size else "use ranks >= 0")


@check(enforced_by="runtime",
       source=f"{OUTPUTS}; {TRAIN_UTILS} _oom_observer and training_log open(<base>_..., 'wb') without creating "
              "the folder; an OOM then loses its snapshot",
       reads=("profiling.record_memory_history", "profiling.memory_snapshot_path"))
def memory_snapshot_folder(view, c):
    """The snapshot path's folder exists (or can be created) and is writable; ~ is not expanded."""
    if not view.get("profiling.record_memory_history"):
        return
    path = view.get("profiling.memory_snapshot_path")
    who = view.parties("profiling.memory_snapshot_path")
    fix = "set mem.memory_snapshot.path to a file in a folder the job can write, e.g. /path/to/run/snapshot.pickle"
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        yield c.problem(who, "profiling.memory_snapshot_path", path, "the snapshot path is not a file name", fix)
        return
    if path.startswith("~"):
        yield c.problem(who, "profiling.memory_snapshot_path", path,
                        "the snapshot path starts with ~, which Bridge does not expand (open() takes it literally)",
                        "give an absolute path, e.g. mem.memory_snapshot.path=$HOME/runs/snapshot.pickle")
        return
    if path == NEMO_RUN_MOUNT or path.startswith(NEMO_RUN_MOUNT + "/"):
        if not os.path.isdir(NEMO_RUN_MOUNT):
            yield (f"memory snapshots go to {q(path)}: {NEMO_RUN_MOUNT} exists only inside a NeMo-Run container "
                   "(Bridge's default); elsewhere set mem.memory_snapshot.path (or leave it auto)")
        return
    if not os.path.isabs(path) and cwd_missing():
        yield c.problem(who, "profiling.memory_snapshot_path", path,
                        f"the snapshot path {q(path)} is relative, and {CWD_GONE}", CWD_FIX)
        return
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        yield c.problem(who, "profiling.memory_snapshot_path", path, f"{q(path)} is a folder, not a file name",
                        f"name a file inside it, e.g. mem.memory_snapshot.path={q(os.path.join(path, SNAPSHOT_FILE))}")
        return
    existing = next((p for p in (folder, *_parents(folder)) if os.path.exists(p)), None)
    if existing is not None and not os.path.isdir(existing):
        yield c.problem(who, "profiling.memory_snapshot_path", path,
                        f"{q(existing)} is a file, so the snapshot folder {q(folder)} cannot exist", fix)
    elif existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == folder else f"cannot be created ({q(existing)} is not writable)"
        yield c.problem(who, "profiling.memory_snapshot_path", path, f"the snapshot folder {q(folder)} {what} here",
                        fix + " (checked on this host; a job node must see the same folder)")
    elif existing != folder:
        yield (f"memory snapshots: the folder {q(folder)} does not exist yet; Bridge opens the file without creating "
               f"folders, so create it before the job starts (mkdir -p -- {q(folder)}) or an OOM loses its snapshot")
    if not os.path.isabs(path):
        yield (f"note: the snapshot path {q(path)} is relative: it is resolved against the job's working directory "
               f"(here that is {q(target)})")


def _parents(folder: str) -> list[str]:
    out, p = [], folder
    while os.path.dirname(p) != p:
        p = os.path.dirname(p)
        out.append(p)
    return out


@check(enforced_by="silent",
       source=f"{TRAIN_UTILS} training_log: the scheduled dump runs only at iteration == profile_step_end; the "
              "nsys/PyTorch profilers stop at the same step (training/profiling.py)",
       reads=("profiling.record_memory_history", "profiling.profile_step_end", "train.train_iters",
              "profiling.use_pytorch_profiler", "profiling.use_nsys_profiler"))
def memory_snapshot_dump_step(view, c):
    """The scheduled memory-snapshot dump falls inside the run (warned), and shares its step with the profilers."""
    if not view.get("profiling.record_memory_history"):
        return
    end, iters = view.get("profiling.profile_step_end"), view.get("train.train_iters")
    if isinstance(end, int) and isinstance(iters, int) and end > iters:
        yield (f"memory snapshots: profile_step_end={end} is after the last iteration (train.train_iters={iters}), "
               f"so only an OOM writes a snapshot; set mem.memory_snapshot.dump_step<={iters} for a scheduled dump")
    if view.get("profiling.use_pytorch_profiler") or view.get("profiling.use_nsys_profiler"):
        yield (f"note: profile_step_end={end} is both the memory-snapshot dump step and the end of the profiler's "
               "window, and profile_ranks selects the profiled ranks for both")


@check(enforced_by="docs",
       source=f"{OUTPUTS}; {TRAIN_UTILS} start_memory_history_recording (trace_alloc_max_entries=100_000, "
              "trace_alloc_record_context=True); torch cuda/memory.py _dump_snapshot (several KB per entry)",
       reads=("profiling.record_memory_history", "profiling.profile_ranks", "profiling.memory_snapshot_path",
              *LAYOUT_READS))
def memory_history_cost(view, c):
    """What recording memory history costs and where the snapshots land (noted)."""
    if not view.get("profiling.record_memory_history"):
        return
    ranks = view.get("profiling.profile_ranks")
    path = view.get("profiling.memory_snapshot_path")
    if not isinstance(path, str) or not isinstance(ranks, (list, tuple)) or not ranks:
        return
    base, ext = os.path.splitext(path)
    shown = ", ".join(map(str, list(ranks)[:8])) + (", ..." if len(ranks) > 8 else "")
    how = parse_ranks(view.params.get("memory_snapshot", {}).get("ranks", ""), view)[1] \
        if "memory_snapshot" in view.selected else ""
    yield (f"note: memory history on rank(s) {shown}" + (f" ({how})" if how else "") + ": a Python stack is "
           f"captured at every allocation (the last {RING_ENTRIES:,} events are kept), which slows "
           "allocation-heavy steps on those ranks; each snapshot holds every segment and block plus that ring, up "
           f"to hundreds of MB. Files: {q(base + '_oom_rank-')}<R>{q(ext) if ext else ''} on OOM, {q(base + '_')}<R>"
           f"{q(ext) if ext else ''} at iteration profile_step_end; read them with "
           f"`mbmem doctor {q(base + '_')}*{q(ext) if ext else ''}`")

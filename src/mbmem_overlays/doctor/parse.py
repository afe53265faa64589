"""What a job log shows, for the doctor: failures of every OOM family, configuration errors, and the
context needed to judge them (torch version, world size, layout, config values, the launch command).

Streams any number of logs (read.py: plain or gzip, files, globs or stdin) and parses only the lines
holding a trigger literal, each bounded in length, with the linear patterns of patterns.py. Every value
keeps the file and line it was read from, so each claim of the diagnosis can cite it. A number that
was not in the log stays None ("unknown"); nothing is filled in by guessing.

Never imports torch or Megatron Bridge. Sources: patterns.py (message formats), known.py (the rules'
configuration error fragments), nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md (Failure Diagnosis).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..core.values import ascii_int
from . import memlines as ML
from . import patterns as P
from . import read
from .known import config_fragments

MAX_EVIDENCE = 40
MAX_RECORDS = 256          # OOM messages and events kept per kind (a log can repeat one a million times)
MAX_LINE_KEPT = 400        # characters of a cited line kept in the report

# Literals any interesting line contains: bytes.find scans at memchr speed (read.py), one pass per literal
# per block, so there are few. FAILURE literals are looked for everywhere; CONTEXT literals only in the head
# of each log (read.HEAD_BYTES), where versions, config dumps and the launch command are printed. "Error"
# alone is not one: a flood of it collapsed the throughput (issue 15, item 17); exceptions carry "Error: ".
FAILURE_TRIGGERS = (
    b"WORKSPACE",    # CUDNN_STATUS_NOT_ENOUGH_WORKSPACE
    b"xit",          # exitcode, exit code, Exit code, exit status, ExitCode
    b"SIG",          # SIGKILL, SIGTERM, Signals.SIGKILL
    b"illed",        # Killed, OOMKilled
    b"NCCL WARN", b"ibv_reg", b"local_rank",
    b"Error: ",      # exceptions: the configuration errors' fragments are matched on these lines
    b"CUresult",     # memory-saver allocators' driver errors ("CUresult error result=2")
    b"training is done",   # the end of a normal run (Megatron-LM / Bridge print "after training is done")
)
# Matched in any case (read.trigger_lines lower-cases each block once for them).
FOLDED_TRIGGERS = (
    b"emory",        # out of memory, OutOfMemoryError, CUDA_ERROR_OUT_OF_MEMORY, MemoryAllocation, memory lines
    b"alloc",        # *_ALLOC_FAILED, PYTORCH_CUDA_ALLOC_CONF, bad_alloc, calloc/malloc, failed to allocate
    b"oom",          # OOM in any wording (issue 23 §3), oom-kill, oom_kill, invoked oom-killer
)
CONTEXT_TRIGGERS = (
    b"ersion", b"orch==", b".py ", b"orld", b"ORLD", b"SLURM_", b"arallel", b"batch_size", b"ecompute", b"ffload",
    b"_optimizer", b"nccl_ub", b"num_layers", b"seq_length", b"mem_fraction", b"sleep", b"cuda_graph", b"P=", b"P:",
    b"NVLS", b"LLM", b"llm", b"lang", b"verl", b"WorkerDict", b"recipe", b"egister", b"cuMem",
    b"SBATCH", b"--nodes", b"erminated", b"num_workers", b"MiB /", b"total_memory=", b"_mapping", b"Non-default",
    b"nproc", b"nnodes", b"ntasks",   # launcher lines that end in the script's name (no ".py " to find them by)
    b" arguments ---",                # the header of Megatron-LM's arguments dump
    b"padded vocab",                  # Megatron-LM's tokenizer size: " > padded vocab (size: N) with K dummy tokens"
)
TRIGGERS = FAILURE_TRIGGERS + CONTEXT_TRIGGERS + FOLDED_TRIGGERS


@dataclass
class Seen:
    value: Any
    where: str
    line: str = ""


@dataclass
class OOM:
    """One PyTorch caching-allocator OOM message. None = the number was not in the log."""
    rank: int | None
    where: str
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    private_pools: int | None = None
    allowed: int | None = None
    self_in_use: int | None = None
    processes: list = field(default_factory=list)       # [(pid, bytes)] as printed, self possibly among them
    device: str = "CUDA"
    format: str = ""
    gpu: int | None = None
    partial: bool = False
    wrapped: bool = False
    line: str = ""


@dataclass
class Event:
    """A failure line that is not the allocator's message, or a kill signal."""
    family: str           # nccl | workspace | driver | engine | registration | host_oom | host_killed | sigkill | sigterm
    #                       | oom_like (says out of memory in a wording no family above claims)
    rank: int | None
    where: str
    line: str
    detail: str = ""


@dataclass
class Findings:
    files: list[str] = field(default_factory=list)
    ooms: list[OOM] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    config_errors: list[tuple[str, str, str]] = field(default_factory=list)   # (rule id, where, line)
    alloc_conf: dict[str, Seen] = field(default_factory=dict)                 # var -> value seen
    config: dict[str, Seen] = field(default_factory=dict)                     # config key -> value printed
    layout: dict[str, int] = field(default_factory=dict)
    layout_where: dict[str, str] = field(default_factory=dict)
    torch_version: Seen | None = None                                         # value: (major, minor)
    world: Seen | None = None                                                 # value: int; line says how
    command: Seen | None = None                                               # value: the launch command text
    megatron_args: Seen | None = None                                         # where Megatron-LM's arguments dump starts
    vocab: Seen | None = None      # value: the tokenizer's vocabulary Megatron-LM printed before padding it (int)
    recipe: str | None = None
    slurm_job: str | None = None
    inference_engine: Seen | None = None
    memory_saver: Seen | None = None
    nvls: Seen | None = None
    engine_command: Seen | None = None                                        # a vLLM/SGLang server command line
    verl: Seen | None = None
    ranks_seen: set[int] = field(default_factory=set)
    failed_ranks: dict[int, Seen] = field(default_factory=dict)               # torchrun summary: rank -> exitcode
    problems: list[str] = field(default_factory=list)
    bytes_read: int = 0
    unreadable: int = 0
    long_lines: int = 0
    evidence: list[str] = field(default_factory=list)
    _world_rank: int = 99
    slurm_nodes: Seen | None = None
    slurm_tasks_per_node: Seen | None = None
    # The run's own memory lines (memlines.py): the latest report per rank, the ones that could not be used.
    memory: dict = field(default_factory=dict)                               # rank (or file) -> RankSeries
    memory_unreadable: list = field(default_factory=list)                    # MemoryReport, the first ones
    memory_unreadable_count: int = 0
    memory_dropped: int = 0                                                  # reports not kept (memlines.MAX_RANKS)
    memory_left_out: ML.Dropped = field(default_factory=ML.Dropped)          # which ranks: the coolest
    world_sizes: list = field(default_factory=list)                          # every distinct claim (WorldClaim)
    theoretical: list = field(default_factory=list)                          # memlines.Theoretical
    capacity: Seen | None = None                                             # value: bytes per GPU; line says how
    ended: Seen | None = None                                                # "after training is done"
    oom_mentions: list = field(default_factory=list)                         # (where, line): hints, not failures
    bridge_summary: Seen | None = None                                       # Bridge's non-default config summary
    incomplete: int = 0                                                      # inputs whose read failed part-way
    # A log that holds several starts of the job (a Slurm requeue with --open-mode=append, `tee -a`, a retry
    # appended to the same file): each start prints its own arguments dump. The latest start is the job: its
    # arguments, config lines, launch command, allocator settings, failures and memory lines are the ones read
    # (_latest_start); the other starts' failures are only named. dumps: (path, line) of every dump header seen (bounded);
    # activity: (path, line) of failures and memory reports (bounded); runs: where each start's dump began (two or
    # more: the log was read again for the start that is the job); earlier_memory: the other starts' memory
    # reports, not used.
    dumps: list = field(default_factory=list)
    activity: set = field(default_factory=set)
    runs: list[str] = field(default_factory=list)
    run_read: str = ""                    # where the dump of the start that was read begins
    earlier_memory: int = 0
    earlier_failures: list[str] = field(default_factory=list)   # where the other starts' failures were

    @property
    def alloc_where(self) -> str:
        return next((s.where for s in self.alloc_conf.values()), "")

    def cite(self, where: str, line: str) -> None:
        entry = f"{where}: {clip(line)}"
        if len(self.evidence) < MAX_EVIDENCE and entry not in self.evidence:
            self.evidence.append(entry)


def clip(line: str) -> str:
    line = line.strip()
    return line if len(line) <= MAX_LINE_KEPT else line[:MAX_LINE_KEPT] + " [...]"


MAX_DUMPS_KEPT = 64
MAX_ACTIVITY_KEPT = 1 << 17


def scan(paths: list[str]) -> Findings:
    findings = Findings()
    fragments = config_fragments()
    for path in read.expand(paths):
        findings.files.append(path)
        _scan_file(path, findings, fragments)
    _world_from_sbatch(findings)
    _check_recipe(findings)
    _latest_start(findings, fragments)
    return findings


def _scan_file(path: str, findings: Findings, fragments: dict[str, str], first_line: int = 1,
               end_line: int | None = None) -> None:
    """One input into ``findings``; lines before ``first_line`` and from ``end_line`` on are read past, not parsed
    (_latest_start)."""
    src = read.Source(path)
    stream = read.open_log(path, src)
    if stream is None:
        findings.problems += src.problems
        findings.unreadable += 1
        return
    state: dict[str, Any] = {}
    try:
        try:
            head = stream.peek(8192)[:8192] if hasattr(stream, "peek") else b""
        except read.READ_ERRORS as exc:  # a corrupted gzip header or first block (zlib.error, BadGzipFile)
            src.problems.append(f"{path}: not a readable log ({type(exc).__name__}: {exc}); if it is a damaged "
                                "gzip, fetch it again or pass the uncompressed log")
            findings.unreadable += 1
            return
        # Logs carry no NUL bytes at their start (a crashed node can leave NULs at the end, which is fine).
        if head.count(b"\0") >= 8:
            findings.unreadable += 1
            src.problems.append(f"{path}: looks like a binary file, not a log (NUL bytes); skipped")
            return
        for lineno, raw, after in read.trigger_lines(stream, FAILURE_TRIGGERS, src, CONTEXT_TRIGGERS,
                                                     FOLDED_TRIGGERS):
            if lineno < first_line or (end_line is not None and lineno >= end_line):
                continue
            findings.ranks_seen.update(int(r) for r in P.RANK_PREFIXES.findall(raw[:64]))
            parse_line(raw.decode("utf-8", errors="replace"), f"{path}:{lineno}", findings, fragments, state,
                       after)
        if src.bytes_read == 0 and not src.problems:
            src.problems.append(f"{path}: empty")
        if src.long_lines:
            src.problems.append(f"{path}: {src.long_lines} line(s) longer than {read.MAX_LINE // 1024} KiB were "
                                "parsed only around their trigger words")
    finally:
        findings.bytes_read += src.bytes_read
        findings.long_lines += src.long_lines
        findings.problems += src.problems
        if src.bomb:
            findings.unreadable += 1   # not a log: like a binary file, it rules nothing out
        elif any("read failed" in p for p in src.problems):
            if src.bytes_read == 0:
                findings.unreadable += 1
            else:
                findings.incomplete += 1
        if path != "-":
            try:
                stream.close()
            except read.READ_ERRORS:
                pass


def _latest_start(f: Findings, fragments: dict[str, str]) -> None:
    """When the log that holds the job's arguments dump holds another dump after a failure or memory report (the
    job started again in the same file), the job is the latest start that shows a failure or a memory report
    after its dump. That file is read again from the first line after the previous start's last failure or report
    (the new start's `export` and launch lines come before its dump) up to where the next start begins: what that
    read finds (config, layout, launch command, dump, allocator settings, torch version, world size, failures,
    memory lines, end of training) replaces the whole log's; the other starts' failures are named in
    ``earlier_failures`` only. Standard input cannot be read twice: there everything stays, and the problems say so."""
    if f.megatron_args is None:
        return
    path = f.megatron_args.where.rpartition(":")[0]
    heads = sorted({line for p, line in f.dumps if p == path})
    busy = sorted(line for p, line in f.activity if p == path)
    starts, begins = [heads[0]], [1]
    for prev, head in zip(heads, heads[1:]):
        inside = [line for line in busy if prev < line < head]
        if inside:
            starts.append(head)
            begins.append(inside[-1] + 1)
    if len(starts) < 2:
        return
    if path == "-":
        f.problems.append(f"standard input holds {len(starts)} starts of the job (an arguments dump each); only a "
                          "file can be read again start by start: what every start printed is read together")
        return
    pick = max((k for k, head in enumerate(starts) if any(line > head for line in busy)), default=len(starts) - 1)
    end = begins[pick + 1] if pick + 1 < len(begins) else None
    g = Findings()
    _scan_file(path, g, fragments, begins[pick], end)
    if g.megatron_args is None:
        return
    mine = {o.where for o in g.ooms} | {e.where for e in g.events}
    if g.capacity is None and f.capacity is None:   # the GPU an earlier start's OOM message names: the same
        # partition's GPUs, said as where it was read (run_report.capacity_of)
        told = next((o for o in f.ooms if o.capacity), None)
        if told is not None:
            g.capacity = Seen(int(told.capacity), told.where, "an earlier start's OOM message's total capacity")
    f.earlier_failures = [w for w in dict.fromkeys([o.where for o in f.ooms] + [e.where for e in f.events])
                          if w not in mine][:MAX_RECORDS]
    f.earlier_memory = max(0, sum(s.reports for s in f.memory.values()) - sum(s.reports for s in g.memory.values()))
    for name in ("config", "layout", "layout_where", "alloc_conf", "ooms", "events", "config_errors", "failed_ranks",
                 "oom_mentions", "memory", "memory_unreadable", "memory_unreadable_count", "memory_dropped",
                 "memory_left_out", "theoretical", "ended", "megatron_args"):
        setattr(f, name, getattr(g, name))
    for name in ("command", "torch_version", "world", "vocab", "bridge_summary", "capacity"):
        if getattr(g, name) is not None:
            setattr(f, name, getattr(g, name))
    if g.world_sizes:
        f.world_sizes = g.world_sizes
    f.runs = [f"{path}:{line}" for line in starts]
    f.run_read = f"{path}:{starts[pick]}"

def _check_recipe(f: Findings) -> None:
    """A recipe name read from the log reaches printed commands: only a name that could be a recipe is kept."""
    if f.recipe:
        from ..bridge.recipes import recipe_name_problem
        if recipe_name_problem(f.recipe) is not None:
            f.problems.append(f"the recipe name {f.recipe!r} in the log is not a recipe name; not used")
            f.recipe = None


def _world_from_sbatch(f: Findings) -> None:
    """#SBATCH --nodes=4 and #SBATCH --ntasks-per-node=8 on separate lines (slurm-and-launch.md)."""
    if f.world is None and f.slurm_nodes and f.slurm_tasks_per_node:
        f.world = Seen(f.slurm_nodes.value * f.slurm_tasks_per_node.value,
                       f"{f.slurm_nodes.where}, {f.slurm_tasks_per_node.where}", f.slurm_nodes.line)
        _claim(f, WorldClaim(f.world.value, "sbatch", f"#SBATCH --nodes={f.slurm_nodes.value} --ntasks-per-node="
                             f"{f.slurm_tasks_per_node.value}", f.world.where))


def rank_of(line: str) -> tuple[int | None, str]:
    """(rank from the line's prefix, the line without it)."""
    m = P.RANK_PREFIX.match(line)
    if not m:
        m = P.RANK_TAG.search(line, 0, 160)  # "i.finetune/0 [default3]:[rank3]: ..." (launcher prefixes first)
        if not m:
            return None, line
    return int(next(g for g in m.groups() if g is not None)), line[m.end():]


def parse_line(line: str, where: str, f: Findings, fragments: dict[str, str], state: dict, after: bytes = b"") -> None:
    rank, body = rank_of(line)
    if rank is not None:
        f.ranks_seen.add(rank)
    if "memory (" in body and _memory_lines(body, where, rank, f) and "out of memory" not in body:
        return  # a report of the run's memory, nothing else: the failure patterns need not run on it
    if "Theoretical memory footprints" in body:
        theory = ML.parse_theoretical(body, where)
        if theory is not None and len(f.theoretical) < MAX_THEORY:
            f.theoretical.append(theory)
        return
    if "out of memory. " in body and P.TORCH_ANCHOR.search(body):
        _torch_oom(body, where, rank, f, after)
    elif "OutOfMemoryError" in body and "Tried to allocate" in body and "out of memory" not in body:
        _torch_oom_abbreviated(body, where, rank, f)
    elif "OutOfMemoryError" in body and "out of memory" not in body:
        # the exception's class alone (a traceback line): the message line usually follows and wins; if it
        # does not, this line alone still makes the log an OOM (issue 23 §3)
        _add_event(f, Event("oom_like", rank, where, clip(body), "OutOfMemoryError"))
    elif not _other_failures(body, where, rank, f):
        _oom_like(body, where, rank, f)
    if f.ended is None and "training is done" in body and P.END_OF_TRAINING.search(body):
        f.ended = Seen("after training is done", where, clip(body))
    _signals(body, where, rank, f, state)
    for frag, rule in fragments.items():
        if frag in body:
            if not any(r == rule for r, _, _ in f.config_errors):
                f.config_errors.append((rule, where, clip(body)))
                f.cite(where, line)
            break
    _context(body, where, f, after)


MAX_THEORY = 8
MAX_UNREADABLE_KEPT = 16


def _memory_lines(body: str, where: str, rank: int | None, f: Findings) -> bool:
    """Read the memory reports on a line (memlines.py); True when it held at least one."""
    reports = ML.parse_reports(body, where, rank)
    for r in reports:
        if r.unreadable:
            f.memory_unreadable_count += 1
            if len(f.memory_unreadable) < MAX_UNREADABLE_KEPT:
                f.memory_unreadable.append(r)
            continue
        key = r.rank if r.rank is not None else f"? ({where.rpartition(':')[0]})"
        _active(f, where)
        if not ML.add_report(f.memory, key, r, f.memory_left_out):
            f.memory_dropped += 1
        if r.values.get("num_ooms"):  # a user's memory_keys logging torch's num_ooms: the allocator failed
            _add_event(f, Event("oom_like", r.rank, where, clip(body), f"num_ooms {r.values['num_ooms']}"))
    return bool(reports)


def _oom_like(body: str, where: str, rank: int | None, f: Findings) -> None:
    """A line no family claimed that still says out of memory (issue 23 §3): a failure, unless the words
    before it make it advice or a hypothesis ("to avoid OOM", "if you run out of memory")."""
    low = body.lower()
    if not P.may_say_out_of_memory(low):  # plain substring tests: the regexes below cost ~1 ms per KB of text
        return
    m = P.OOM_WORDS.search(body)
    if m is None:
        m = P.ALLOC_WORDS.search(body)
        if m is None or not P.MEMORY_WORDS.search(body):
            return
    if P.MENTION.search(body, max(0, m.start() - 60), m.start()):
        if len(f.oom_mentions) < MAX_EVIDENCE:
            f.oom_mentions.append((where, clip(body)))
        return
    _add_event(f, Event("oom_like", rank, where, clip(body), m.group(0)))


def _torch_oom_abbreviated(body: str, where: str, rank: int | None, f: Findings) -> None:
    """"OutOfMemoryError: Tried to allocate 12.60 GiB. GPU had 12.44 GiB free of 79.19": PyTorch's exception,
    its message shortened by whoever pasted it. The numbers it shows are read; the rest stay unknown."""
    text = body[body.find("OutOfMemoryError"):][:P.MESSAGE_WINDOW]
    requested = P._size(P.REQUESTED, text)
    free = capacity = None
    if m := P.FREE_OF.search(text):
        free = P.to_bytes(m.group(1), m.group(2))
        if m.group(3):
            capacity = P.to_bytes(m.group(3), m.group(4) or m.group(2))
    oom = OOM(rank, where, requested, capacity, free, None, None, None, None, None, [], "CUDA",
              "abbreviated (numbers cut by the reporter)", None, partial=True, line=clip(body))
    _active(f, where)
    if len(f.ooms) < MAX_RECORDS:
        f.ooms.append(oom)
        f.cite(where, body)


def _add_event(f: Findings, ev: Event) -> None:
    _active(f, ev.where)
    if sum(1 for e in f.events if e.family == ev.family) < MAX_RECORDS:
        f.events.append(ev)
        f.cite(ev.where, ev.line)


def _torch_oom(body: str, where: str, rank: int | None, f: Findings, after: bytes) -> None:
    fields = P.torch_oom_fields(body)
    wrapped = False
    if not fields["complete"] and after:
        joined = _join_wrapped(body, after, rank)
        if joined is not None:
            more = P.torch_oom_fields(joined[0])
            if sum(v is not None for v in more.values()) > sum(v is not None for v in fields.values()):
                fields, wrapped = more, True
                path, _, lineno = where.rpartition(":")
                first = ascii_int(lineno)
                where = f"{path}:{lineno}-{first + joined[1]}" if first is not None else where
    oom = OOM(rank, where, fields["requested"], fields.get("capacity"), fields.get("free"), fields.get("allocated"),
              fields.get("reserved_unallocated"), fields.get("private_pools"), fields["allowed"],
              fields["self_in_use"], fields["processes"], fields["device"], fields["format"], fields.get("gpu"),
              partial=not fields["complete"], wrapped=wrapped, line=clip(body))
    key = (oom.rank, oom.requested, oom.reserved_unallocated, oom.free)
    _active(f, where)
    if len(f.ooms) < MAX_RECORDS and not any((o.rank, o.requested, o.reserved_unallocated, o.free) == key for o in f.ooms):
        f.ooms.append(oom)
        f.cite(where, body)


# Words of the allocator's message (ecosystem-notes.md): a wrap that cut one of them is rejoined without a space.
_MESSAGE_WORDS = frozenset(re.findall(r"[A-Za-z-]+", "CUDA HIP out of memory Tried to allocate GPU has a total capacity capacty "
                                      "of which is free Including non-PyTorch this process Process memory in use allowed "
                                      "Of the allocated memory is allocated by PyTorch with private pools and reserved "
                                      "but unallocated If large try setting expandable_segments avoid fragmentation "
                                      "already in total cached"))
_NEW_RECORD = re.compile(r"^\s{0,8}(?:Traceback|File \"|iteration|\[|[\w.]{0,40}Error\b|[\w.]{0,40}Exception\b|\d{4}-\d\d-\d\d)")


def _join_wrapped(body: str, after: bytes, rank: int | None) -> tuple[str, int] | None:
    """The message with the following lines that continue it: same rank prefix (other ranks' lines may be
    interleaved), not the start of a new record, at most 8 lines; a word cut by the wrap is rejoined."""
    out, taken, last = body.rstrip(), 0, 0
    for index, raw in enumerate(after.split(b"\n")[:12], start=1):
        text = raw.decode("utf-8", errors="replace")
        r, rest = rank_of(text)
        if r is not None and r != rank:
            continue  # another rank's line interleaved between the pieces (a line without a prefix may continue)
        if not rest.strip() or _NEW_RECORD.match(rest) or "out of memory" in rest or taken >= 8:
            break
        rest = rest.strip()
        left, right = re.search(r"[A-Za-z-]*$", out).group(0), re.match(r"[A-Za-z-]*", rest).group(0)
        glue = "" if left and right and left + right in _MESSAGE_WORDS and left not in _MESSAGE_WORDS else " "
        out += glue + rest
        taken, last = taken + 1, index
        if "but unallocated" in out or "reserved in total" in out or "cached)" in out:
            break
    return (out, last) if taken else None


def _other_failures(body: str, where: str, rank: int | None, f: Findings) -> bool:
    """Record the line's failure if a family claims it; True when one did."""
    if "emory" in body and (m := P.ENGINE_FREE.search(body) or P.ENGINE_SHARE_TOO_SMALL.search(body)):
        _add_event(f, Event("engine", rank, where, clip(body), m.group(0)))
        return True
    if ("ibv_reg" in body or "egister" in body or "ncclMemAlloc" in body) and (m := P.REGISTRATION.search(body)):
        _add_event(f, Event("registration", rank, where, clip(body), m.group(1)))
        return True
    # Each pattern runs only behind a cheap substring test (the per-line work of a flood stays small).
    if ("NCCL" in body or "nccl" in body or "Cuda failure" in body) and P.NCCL_OOM.search(body):
        nb = P.NCCL_BYTES.search(body)
        _add_event(f, Event("nccl", rank, where, clip(body), nb.group(1) if nb else ""))
        return True
    if ("ALLOC_FAILED" in body or "WORKSPACE" in body or "memory_error" in body) and (m := P.WORKSPACE.search(body)):
        _add_event(f, Event("workspace", rank, where, clip(body), m.group(1)))
        return True
    if ("OUT_OF_MEMORY" in body or "MemoryAllocation" in body or "out of memory" in body or "cuMem" in body
            or "cu_mem" in body or "OutOfMemory" in body or "CUresult" in body or "cudaError" in body) \
            and (m := P.DRIVER.search(body)):
        saver = P.MEMORY_SAVER.search(body)
        _add_event(f, Event("driver", rank, where, clip(body), m.group(1) + (f" ({saver.group(0)})" if saver else "")))
        return True
    if ("oom" in body or "OOM" in body or "emory" in body or "bad_alloc" in body) \
            and (m := P.HOST_OOM.search(body)):
        _add_event(f, Event("host_oom", rank, where, clip(body), m.group(1)))
        return True
    if "Killed" in body and P.SHELL_KILLED.search(body):
        _add_event(f, Event("host_killed", rank, where, clip(body), "Killed"))
        return True
    return False


def _signals(body: str, where: str, rank: int | None, f: Findings, state: dict) -> None:
    tm = P.TORCHRUN_RANK.match(body)
    if tm:
        state["torchrun_rank"] = int(tm.group(1))
        return
    em = P.TORCHRUN_EXIT.match(body)
    if em and state.get("torchrun_rank") is not None:
        failed, code = state.pop("torchrun_rank"), int(em.group(1))
        f.failed_ranks[failed] = Seen(code, where, clip(body))
        if code in (-9, -15):  # torchrun's failure summary: the rank died of SIGKILL / SIGTERM
            _add_event(f, Event("sigkill" if code == -9 else "sigterm", failed, where, clip(body), f"exitcode {code}"))
        return
    if "task" in body and ("Terminated" in body or "Exited" in body) and (sm := P.SRUN_TASKS.search(body)):
        if sm.group(2) == "Terminated":  # srun's summary: these tasks were stopped after another one failed
            for task in _task_ranks(sm.group(1)):
                _add_event(f, Event("sigterm", task, where, clip(body), "srun: Terminated"))
        return
    if ("SIG" in body or "exit" in body or "Exit" in body or "Signal" in body) and "Killed" not in body:
        if P.SIGTERM_VICTIM.search(body):
            _add_event(f, Event("sigterm", rank, where, clip(body), "SIGTERM"))
        elif P.EXIT_137.search(body):
            _add_event(f, Event("sigkill", rank, where, clip(body), "SIGKILL / exit 137"))


def _task_ranks(text: str, limit: int = 4096) -> list[int]:
    """'0-2,4-7' -> [0, 1, 2, 4, 5, 6, 7] (bounded)."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = ascii_int(lo, 7), ascii_int(hi or lo, 7)
        if a is not None and b is not None:
            out += range(a, min(b, a + limit) + 1)
        if len(out) >= limit:
            break
    return out[:limit]


def _megatron_2020(after: bytes) -> bool:
    """Whether the lines after 2020's short dump header are Megatron-LM's (``'  {name} {dots} {value}'``), not
    GPT-NeoX's, whose NeoXArgs print the same header with ``....default`` / ``....updated`` after each value."""
    lines = after[:4096].decode("utf-8", errors="replace").splitlines()[:8]
    return bool(lines) and any(P.DUMP_VALUE_LINE.match(x) for x in lines) and not any(
        P.NEOX_VALUE.search(x) for x in lines)


def _context(body: str, where: str, f: Findings, after: bytes = b"") -> None:
    if " arguments ---" in body and (
            P.MEGATRON_ARGS_DUMP.search(body) or (P.MEGATRON_ARGS_DUMP_2020.search(body) and _megatron_2020(after))):
        if f.megatron_args is None:
            f.megatron_args = Seen("arguments dump", where, clip(body))
        if len(f.dumps) < MAX_DUMPS_KEPT:
            f.dumps.append(_file_line(where))
    if f.vocab is None and "padded vocab" in body and (vm := P.PADDED_VOCAB.search(body)):
        size = ascii_int(vm.group(1), 9)
        if size:
            f.vocab = Seen(size, where, clip(body))
    # The OOM message's own hint ("try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid
    # fragmentation"), whole or wrapped, is not the job's setting.
    if "ALLOC_CONF" in body and "try setting" not in body and "avoid fragmentation" not in body \
            and "If reserved but unallocated" not in body:
        for var, value in P.ALLOC_SET.findall(body):
            if value and not value.startswith("$"):
                f.alloc_conf[var] = Seen(value, where, clip(body))
                f.cite(where, body)
    if "orch" in body and f.torch_version is None and (vm := P.TORCH_VERSION.search(body)):
        major, minor = int(vm.group(1)), int(vm.group(2))
        if 1 <= major <= 9:
            f.torch_version = Seen((major, minor), where, clip(body))
            f.cite(where, body)
    if any(k in body for k in _WORLD_HINTS):
        _world(body, where, f)
        if "--nodes" in body or " -N" in body or "--ntasks-per-node" in body:
            if f.slurm_nodes is None and (m := P.SLURM_NODES.search(body)):
                f.slurm_nodes = Seen(int(m.group(1)), where, clip(body))
            if f.slurm_tasks_per_node is None and (m := P.SLURM_TASKS_PER_NODE.search(body)):
                f.slurm_tasks_per_node = Seen(int(m.group(1)), where, clip(body))
    if any(k in body for k in _CONFIG_HINTS):
        values = [(m.group(1), m.group(2).strip("'\"")) for m, _ in zip(P.CONFIG_VALUE.finditer(body), range(64))]
        for key, value in values:
            if key not in f.config:
                f.config[key] = Seen(value, where, clip(body))
        _layout(body, where, f, values)
    elif "P=" in body or "P:" in body or "P =" in body:
        _layout(body, where, f, [])
    if (f.command is None or "train.py" in body) and ".py" in body:
        _command(body, where, f)
    if "recipe" in body and not f.recipe and (rm := re.search(r"(?:--recipe[= ]|recipe=|recipe\.function=)([\w.]{1,120})", body)):
        f.recipe = rm.group(1)
    if "SLURM_JOB_ID" in body or "StepId=" in body:
        jm = P.SLURM_JOB.search(body)
        if jm and not f.slurm_job:
            f.slurm_job = next(g for g in jm.groups() if g)
    if f.inference_engine is None and any(k in body for k in _ENGINE_HINTS) and (im := P.INFERENCE_ENGINE.search(body)):
        f.inference_engine = Seen(im.group(1), where, clip(body))
    if f.engine_command is None and ("launch_server" in body or "vllm serve" in body or "entrypoints" in body) \
            and 'File "' not in body and (lm := re.search(r"(?:python3?\s+-m\s+\S+|vllm serve)[^\n]{0,2000}", body)):
        f.engine_command = Seen(lm.group(0).strip(), where, clip(body))
    if f.bridge_summary is None and "Non-default values (vs Mcore" in body:
        f.bridge_summary = Seen("Bridge configuration summary", where, clip(body))
    if f.capacity is None and ("MiB /" in body or "MiB/" in body or "total_memory=" in body):
        _capacity(body, where, f)
    if f.nvls is None and "NVLS" in body:
        f.nvls = Seen("NVLS", where, clip(body))
    if f.verl is None and ("WorkerDict" in body or "TaskRunner" in body or "verl" in body):
        f.verl = Seen("verl", where, clip(body))
    if f.memory_saver is None and ("saver" in body or "sleep" in body) and (sm := P.MEMORY_SAVER.search(body)):
        f.memory_saver = Seen(sm.group(0), where, clip(body))


def _capacity(body: str, where: str, f: Findings) -> None:
    """GPU capacity printed by the job: torch's device properties (exact), or an nvidia-smi table row."""
    if (m := P.TORCH_DEVICE_MEMORY.search(body)) and int(m.group(1)) > 0:
        f.capacity = Seen(int(m.group(1)) * ML.MiB, where, "torch device properties total_memory=" + m.group(1) + "MB")
    elif (m := P.NVIDIA_SMI_MEMORY.search(body)) and 0 < int(m.group(2)) and int(m.group(1)) <= int(m.group(2)):
        f.capacity = Seen(int(m.group(2)) * ML.MiB, where, f"nvidia-smi {m.group(2)}MiB total")
    if f.capacity is not None:
        f.cite(where, body)


# Cheap substring gates: a pattern runs only on lines that can hold its match (the per-line work of a flood).
_WORLD_HINTS = ("orld", "ORLD", "nproc", "nnodes", "SLURM_", "ntasks", "--nodes", " -N")
_CONFIG_HINTS = ("_size", "parallel", "recompute", "offload", "_optimizer", "nccl_ub", "seq_length", "num_layers",
                 "utilization", "mem_fraction", "sleep_mode", "cuda_graph", "use_te", "num_workers", "_mapping")
_ENGINE_HINTS = ("llm", "LLM", "lang", "Lang", "TensorRT", "lmdeploy")


MAX_WORLD_CLAIMS = 8
_WORLD_SOURCE = {"launcher": "the launcher or Megatron (WORLD_SIZE, world size, using world size)",
                 "torchrun": "torchrun (--nproc-per-node x --nnodes)", "slurm": "Slurm (tasks)"}


@dataclass(frozen=True)
class WorldClaim:
    """One world size the log states, where, and as what (the first line of each distinct value and kind)."""
    value: int
    kind: str          # launcher | torchrun | slurm | sbatch
    text: str          # what was matched, as printed (bounded)
    where: str


def _claim(f: Findings, claim: WorldClaim) -> None:
    if len(f.world_sizes) < MAX_WORLD_CLAIMS and not any(
            c.value == claim.value and c.kind == claim.kind for c in f.world_sizes):
        f.world_sizes.append(claim)


def _world(body: str, where: str, f: Findings) -> None:
    """The world size: the first line of the highest-trust kind is used (P.WORLD's order); every distinct
    value any line states is kept too, so a log that contradicts itself says so (issue 33 #18)."""
    for priority, (kind, rx) in enumerate(P.WORLD):
        m = rx.search(body)
        if not m:
            continue
        groups = [int(g) for g in m.groups()]
        value = groups[0] if len(groups) == 1 else groups[0] * groups[1]
        if value >= 1:
            _claim(f, WorldClaim(value, kind, clip(m.group(0))[:120], where))
            if priority < f._world_rank:
                f.world = Seen(value, where, clip(body))
                f._world_rank = priority
                f.cite(where, body)
        return


def world_disagreement(f: Findings) -> list[str]:
    """One line per distinct world size the log states, and which one is used; [] when they agree."""
    if len({c.value for c in f.world_sizes}) < 2:
        return []
    used = f.world.value if f.world else None
    rows = [f"{c.value} from {_WORLD_SOURCE.get(c.kind, c.kind)}: {c.text!r} [{c.where}]"
            + (" <- used" if c.value == used and c.where == (f.world.where if f.world else None) else "")
            for c in f.world_sizes]
    rows.append(f"the doctor uses {used} (the launcher's or Megatron's own line first, then torchrun's, then "
                "Slurm's; the first line of that kind); with --plan, --world-size N overrides it" if used is not None
                else "none is used")
    return rows


_LAYOUT_KEYS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
                "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
                "expert_model_parallel_size": "ep", "data_parallel_size": "dp"}


def _layout(body: str, where: str, f: Findings, values: list[tuple[str, str]]) -> None:
    found = [(_LAYOUT_KEYS[k], ascii_int(v, 6)) for k, v in values if k in _LAYOUT_KEYS and ascii_int(v, 6) is not None]
    found += [(m.group(1)[0].lower() + "p", int(m.group(2))) for m in P.MEGATRON_LM_SIZES.finditer(body)]
    found += [(m.group(1).lower(), int(m.group(2))) for m in P.LAYOUT_SHORT.finditer(body)]
    for short, value in found:
        if short not in f.layout:
            f.layout[short] = value
            f.layout_where[short] = where


def _file_line(where: str) -> tuple[str, int]:
    """("LOG", 12) of "LOG:12" or "LOG:12-14" (a joined message)."""
    path, _, line = where.rpartition(":")
    return path, ascii_int(line.split("-")[0], 12) or 0


def _active(f: Findings, where: str) -> None:
    """A failure or a memory report at ``where``: a dump after it is another start of the job (_latest_start)."""
    if len(f.activity) < MAX_ACTIVITY_KEPT:
        f.activity.add(_file_line(where))


def _command(body: str, where: str, f: Findings) -> None:
    if 'File "' in body or "Traceback" in body:
        return
    m = P.LAUNCH.search(body)
    if not m or not P.SCRIPT.search(body, m.end()):
        # the command a launcher ran, echoed without its launcher (`pretrain_gpt.py --num-layers 24 ...`, srun's
        # `[host:0]:` prefix, `bash -x`'s `+ `): a line that starts with a script and its flags
        bare = P.BARE_SCRIPT.match(body)
        if not bare:
            return
        text = body[bare.start("cmd"):].strip()
    else:
        text = body[m.start():].strip()
    if f.command is None or "train.py" in text or "recipe" in text:
        f.command = Seen(text, where, clip(body))
        f.cite(where, body)


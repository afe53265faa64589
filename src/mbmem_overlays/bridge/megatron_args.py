"""A Megatron-LM job from its own arguments: a command line, a functional test's ``MODEL_ARGS`` block, or the
``arguments`` dump at the top of its log, parsed by megatron-core's own parser and mapped to the Bridge
``ConfigContainer`` the memory plan reads for a recipe.

Three steps, each pure or bounded:

1. :func:`read_source` reads the text (a file or ``-``, bounded in bytes; a log's head holds the dump).
2. :func:`job_words` turns it into Megatron-LM words without importing anything heavy: the form is
   recognised (a dump's header line, a YAML mapping of ``--flag: value``, else a shell command line), the
   launcher's world size is read (``torchrun --nproc-per-node N --nnodes M``), leading ``VAR=value`` words
   and ``ENV_VARS`` become the job's environment. ``${...}`` is never interpolated: it stays a word.
3. :func:`load_job` parses the words with megatron-core 0.19.2's ``add_megatron_arguments`` parser, runs its
   ``validate_args`` (world size from the caller, the launcher or the dump), and maps the result the way
   Megatron-LM builds its own configs: ``core_transformer_config_from_args`` for the transformer
   (megatron/training/argument_utils.py), ``get_megatron_optimizer_config`` / ``get_megatron_ddp_config``
   (megatron/training/training.py) for the optimizer and DDP, fields of the same name for the training,
   tokenizer (Bridge's ``mlm_compat/arguments.py _tokenizer_config_from_args``), scheduler and distributed
   configs, and a Bridge model provider (``GPTModelProvider``, ``MLAModelProvider`` or, for a hybrid pattern,
   ``MambaModelProvider``) filled from that transformer config, as Bridge's ``mlm_compat/model.py`` builds
   its models from the same namespace.

The result (:class:`MegatronJob`) is frozen and keeps what was not planned as data: ``unknown`` (words
the parser does not know), ``unsupported`` (recognised flags this mapping does not carry into the config,
outside the groups that cannot change memory), ``not_modelled`` (flags that change memory and that the
memory model does not follow: filled by the plan layer from its one list, memory/coverage.py ``with_coverage``,
since this layer sits below the model) and ``assumptions``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import gzip
import io
import math
import os
import re
import shlex
import stat
import sys
import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..core import safeyaml
from ..core.text import first_command
from ..core.values import MAX_INT, MAX_PLAN_LAYERS, MAX_PLAN_PIPELINE, MAX_PLAN_SCHEDULE, ascii_int

FORM_COMMAND = "command line"
FORM_YAML = "MODEL_ARGS YAML"
FORM_DUMP = "arguments dump"

MAX_BYTES = 8 << 20        # a command line or YAML block is a few KiB; a log's dump is in its first lines
MAX_WORDS = 4_096          # words of a job (Megatron-LM has ~900 flags; argparse's time grows with the square of
                           # the options given: 20,000 words took half a minute)
MAX_DUMP_LINES = 20_000    # lines between a dump's header and its end (one per argument, ~1,100 in 0.19.2)
DUMP_HEADER = "------------------------ arguments ------------------------"   # arguments.py _print_args
DUMP_END = "-------------------- end of arguments ---------------------"
# Megatron-LM's 2020 releases (v1.0, NVIDIA/Megatron-LM 94e2ca575c, 2020-03-27, to 98989693a2, 2020-12-02, which
# lengthened both lines and the names' padding from 32 to 48) print a shorter header and end line. GPT-NeoX's NeoXArgs
# print the same short header, but each value is followed by dots and "default" or "updated": such a dump is not
# Megatron-LM's (its names and meanings are another framework's), and is not read as one.
DUMP_HEADER_2020 = re.compile(r"(?<!-)-{20} arguments -{20}(?!-)")
_DUMP_HEADERS = re.compile(r"(?<!-)(?:-{24} arguments -{24}|-{20} arguments -{20})(?!-)")
_DUMP_END_LINE = re.compile(r"-{8,} end of arguments -{8,}")
_NEOX_VALUE = re.compile(r"\.{2,}(?:default|updated)\s*$")
_DUMP_LINE = re.compile(r"^\s+([A-Za-z_][A-Za-z0-9_]*) \.* (.*)$")   # '  {name} {dots} {value}', dots may be ''
_ENV_WORD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
GPT2_VOCAB = 50257          # GPT-2's vocab.json (GPT2BPETokenizer), used when the vocab file is not readable here
DEFAULT_ARCH = 9            # compute capability major of the GPU validate_args is asked about: Hopper (H100)
# The Transformer Engine version validate_args is asked about (its is_te_min_version checks) where TE is not installed
# here (a CPU host: megatron.core.utils.get_te_version then says 0.0.0 and every such check fails): v2.17.1, the tag
# Megatron Bridge 0.6.x's uv.lock pins (the TE source memory/assumptions.py ADDED_TERMS cites). Where TE is
# installed, its own version is asked.
ASSUMED_TE_VERSION = "2.17.1"

# The argparse groups of megatron-core 0.19.2's parser whose flags cannot change GPU memory during training:
# flags of these groups that the mapping does not carry are "ignored", not "unsupported".
NEUTRAL_GROUPS = frozenset({
    "learning rate and weight decay", "regularization", "checkpointing", "validation", "data and dataloader",
    "logging", "straggler", "workload inspector", "one logger", "In-process restart", "ft_package", "rerun engine",
    "msc", "autoresume", "fault injector", "RNG and initialization", "profiling", "distributed init",
})

# Environment variables validate_args reads (arguments.py validate_args): the job's values, never ours.
JOB_ENV_KEYS = ("CUDA_DEVICE_MAX_CONNECTIONS", "NVTE_CPU_OFFLOAD_V1", "PYTORCH_CUDA_ALLOC_CONF",
                "NCCL_GRAPH_REGISTER", "CUDA_GRAPHS_USE_NODE_PRIORITY", "NCCL_PROTO", "WORLD_SIZE", "RANK",
                "LOCAL_RANK")
# What Megatron-LM's launch scripts set when the job's environment was not given (validate_args asserts them;
# they choose kernels and streams, not memory). Only ever filled in where the job's own environment is silent.
# Megatron-LM's pretrain_gpt.py and pretrain_mamba.py call pretrain(..., args_defaults={'tokenizer_type':
# 'GPT2BPETokenizer'}), which validate_args writes into every argument still None (arguments.py validate_args).
PRETRAIN_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
ENV_REQUIREMENTS = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVTE_CPU_OFFLOAD_V1": "1"}
# validate_args asks CUDA_DEVICE_MAX_CONNECTIONS=1 for TP/CP on Hopper and before, but the opposite under FSDP
# ("FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset") and nothing under EP-comm overlap (it warns): for those
# jobs Megatron-LM's scripts leave it unset, and so do we.
LEAVE_CONNECTIONS_UNSET = ("--use-megatron-fsdp", "--use-torch-fsdp2", "--overlap-moe-expert-parallel-comm")


def env_requirements(argv: Sequence[str]) -> dict[str, str]:
    """What the launch scripts set where the job's environment is silent, for this job's words."""
    if any(w in LEAVE_CONNECTIONS_UNSET for w in argv):
        return {k: v for k, v in ENV_REQUIREMENTS.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    return dict(ENV_REQUIREMENTS)


class MegatronArgsError(ValueError):
    """The arguments cannot be read, parsed or validated; ``fix`` says what to type."""

    def __init__(self, message: str, fix: str = "", flag: str = "--megatron-args", rejected: bool = False):
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.flag = flag
        self.rejected = rejected     # megatron-core's validate_args refused a job it could read (exit 1, not 2)


@dataclass(frozen=True)
class FlagNote:
    """One flag of the job with its value as given and why it is listed."""
    flag: str
    value: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"flag": self.flag, "value": self.value, "reason": self.reason}

    def text(self) -> str:
        value = f" {self.value}" if self.value not in ("", "True") else ""
        return f"{self.flag}{value}: {self.reason}"


@dataclass(frozen=True)
class JobWords:
    """The job as Megatron-LM words, before megatron-core parses them."""
    form: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    launcher_world: int | None = None
    launcher: str = ""                  # how the launcher's world size was read ("" when none was)
    script: str = ""                    # pretrain_gpt.py, pretrain_mamba.py ... ("" when not named)
    dump: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))   # name -> printed value
    notes: tuple[str, ...] = ()
    launcher_words: tuple[str, ...] = ()  # a command line's words before the script's flags (the launcher's)


@dataclass(frozen=True)
class MegatronJob:
    """A Megatron-LM job mapped to a Bridge ConfigContainer (``config``), with what was not planned as data."""
    config: Any
    world_size: int
    world_from: str
    form: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    family: str                          # "gpt" or "hybrid"
    unknown: tuple[FlagNote, ...] = ()
    unsupported: tuple[FlagNote, ...] = ()
    not_modelled: tuple[FlagNote, ...] = ()   # memory/coverage.py with_coverage fills it
    ignored: tuple[str, ...] = ()        # recognised flags of the groups that cannot change memory
    assumptions: tuple[str, ...] = ()
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))   # validated namespace
    translated: tuple[FlagNote, ...] = ()     # an older Megatron-LM release's names, read in 0.19.2's (legacy_values)
    # the tokenizer's vocabulary the job was loaded with when it was given (load_job's ``vocab``: --tokenizer-vocab,
    # the log's "padded vocab (size: N)"): every change to the job is rebuilt with it (change_job, changed_config),
    # since a tokenizer that must be built to count (HuggingFaceTokenizer) cannot be counted here
    vocab: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"form": self.form, "world_size": self.world_size, "world_from": self.world_from,
                "family": self.family, "argv": list(self.argv),
                "translated": [n.as_dict() for n in self.translated],
                "unknown": [n.as_dict() for n in self.unknown],
                "unsupported": [n.as_dict() for n in self.unsupported],
                "not_modelled": [n.as_dict() for n in self.not_modelled],
                "ignored": list(self.ignored), "assumptions": list(self.assumptions)}


# ----------------------------------------------------------------------------- 1. reading, bounded
MAX_ENV_VALUE = 32 << 10   # one environment value (a path list, an allocator setting); Linux's MAX_ARG_STRLEN is 128 KiB


def job_environment(env: Mapping[Any, Any]) -> dict[str, str]:
    """The job's environment as ``os.environ`` can hold it, or MegatronArgsError naming the first variable it could
    not: a name of letters, digits and ``_`` not starting with a digit (``A=B`` or an empty name cannot be a
    variable: posix putenv splits at ``=``), a text value without a NUL byte that the file system encoding can
    write, of at most MAX_ENV_VALUE characters. Every job environment passes here before validate_args sees it."""
    from ..core.text import bounded, shown
    out: dict[str, str] = {}
    for key, value in env.items():
        name = key if isinstance(key, str) else _yaml_text(key)
        if not _ENV_NAME.fullmatch(name):
            raise MegatronArgsError(f"the job's environment names {shown(bounded(name, 80))!r}, which is not an "
                                    "environment variable name", "give variables as NAME=value (NAME: letters, "
                                    "digits and _, not starting with a digit)")
        text = value if isinstance(value, str) else _yaml_text(value)
        why = ("holds a NUL byte" if "\x00" in text else
               f"is {len(text):,} characters long (at most {MAX_ENV_VALUE:,})" if len(text) > MAX_ENV_VALUE else
               None)
        if why is None:
            try:
                os.fsencode(text)
            except UnicodeError:
                why = "holds a character the file system encoding cannot write (a lone surrogate)"
        if why:
            raise MegatronArgsError(f"the job's environment variable {name} {why}: no process can be given it",
                                    f"give {name} a plain text value")
        out[name] = text
    return out


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_source(path: str, *, stdin: Any = None, limit: int = MAX_BYTES) -> str:
    """The text of ``path`` (``-``: standard input), at most ``limit`` bytes, gzip read through.

    Only a regular file is opened (a fifo or a device could block or never end). An input longer than ``limit``
    is read only when its head holds a whole arguments dump (a log: the dump is printed before training starts, and
    the rest of the log is not the job's arguments); a longer command line or YAML is refused, never cut (the words
    after the cut would be lost without a word)."""
    if path == "-":
        source = stdin or getattr(sys.stdin, "buffer", sys.stdin)
        try:
            raw = source.read(limit + 1)     # None: no standard input at all (the shell closed it)
        except (AttributeError, OSError, ValueError) as exc:
            raise MegatronArgsError(f"standard input cannot be read ({type(exc).__name__})",
                                    "pipe the job's arguments in, or give a file") from None
        return _within(raw if isinstance(raw, bytes) else str(raw).encode(), limit, "standard input")
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:    # ValueError: a NUL byte in the name
        raise MegatronArgsError(f"cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}",
                                "give a file with the job's arguments (a command line, MODEL_ARGS YAML or a log)")
    if not stat.S_ISREG(st.st_mode):
        raise MegatronArgsError(f"{path!r} is not a regular file", "give a regular file, or - for standard input")
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
            fh.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=fh) as gz:
                    raw = gz.read(limit + 1)
            else:
                raw = fh.read(limit + 1)
    except (OSError, EOFError, ValueError, zlib.error) as exc:   # zlib.error: a damaged gzip stream
        from ..core.text import bounded
        raise MegatronArgsError(f"cannot read {path!r}: {bounded(exc, 300)}", "give a readable file")
    return _within(raw, limit, repr(path))


def _within(raw: bytes, limit: int, name: str) -> str:
    """The text of ``raw`` when it is within ``limit`` bytes, or when its first ``limit`` bytes hold a whole
    arguments dump (header to end line); refused otherwise."""
    if len(raw) <= limit:
        return _decode(raw)
    text = _decode(raw[:limit])
    header = dump_header(text)
    if header is not None and _DUMP_END_LINE.search(text, header.end()):
        return text
    raise MegatronArgsError(f"{name} is over {limit >> 20} MiB and its head holds no whole arguments dump: a command "
                            "line or MODEL_ARGS YAML that long is not read (cutting it would drop the flags after the "
                            "cut)", "give the job's own command line, MODEL_ARGS block or the head of its log")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


MAX_DUMP_HEADERS = 64      # header lines looked at for the first Megatron-LM dump (a log holds one per restart)


def dump_header(text: str) -> re.Match | None:
    """The header of the first Megatron-LM arguments dump in ``text``: the one printed since December 2020, or
    2020's shorter one when its lines are Megatron-LM's (``'  {name} {dots} {value}'``; GPT-NeoX's NeoXArgs print
    the same short header with ``....default`` / ``....updated`` after each value). None when there is none."""
    for k, m in enumerate(_DUMP_HEADERS.finditer(text)):
        if k >= MAX_DUMP_HEADERS:
            return None
        if m.group().startswith("-" * 24):
            return m
        following = text[m.end():m.end() + 4096].splitlines()[1:9]
        if following and not any(_NEOX_VALUE.search(line) for line in following):
            return m
    return None


# ----------------------------------------------------------------------------- 2. words, pure
def job_words(source: str | Sequence[str] | Mapping[str, Any]) -> JobWords:
    """The job's Megatron-LM words from any of the three forms (text, an argv list, or a parsed mapping)."""
    if isinstance(source, Mapping):
        return yaml_words(source)
    if not isinstance(source, str):
        return command_words(list(source))
    if dump_header(source) is not None:
        return dump_words(source)
    if re.search(r"^(MODEL_ARGS|\s*--[\w-]+)\s*:(\s|$)", source, re.M):   # a YAML key, never a shell word
        try:
            # a functional test's harness reads the file with PyYAML, where a repeated flag's last value wins
            data = safeyaml.load(source, duplicates="last")
        except (safeyaml.YamlRefused, ValueError) as exc:
            raise MegatronArgsError(f"the MODEL_ARGS YAML is refused: {exc}", "give a smaller, plain YAML mapping")
        except Exception as exc:  # noqa: BLE001 - yaml.YAMLError and its kin: a syntax error of the user's file
            raise MegatronArgsError(f"the MODEL_ARGS YAML does not parse: {' '.join(str(exc).split())[:300]}",
                                    "fix the YAML, or give the job's command line instead")
        if isinstance(data, Mapping):
            return yaml_words(data)
    return command_words(source)


def yaml_words(data: Mapping[str, Any]) -> JobWords:
    """A functional test's model_config.yaml (``MODEL_ARGS`` and ``ENV_VARS``) or a bare ``--flag: value`` mapping.

    ``true`` is the flag alone, ``false`` leaves it out, an empty value (YAML null) is the flag alone, a list
    gives one word per item; anything else is its text (``1.0e-5`` as YAML reads it)."""
    args = data.get("MODEL_ARGS", data) if isinstance(data.get("MODEL_ARGS", data), Mapping) else None
    if args is None:
        raise MegatronArgsError("MODEL_ARGS is not a mapping of --flag: value",
                                "write MODEL_ARGS as a mapping, e.g. `--num-layers: 2`")
    argv: list[str] = []
    notes: list[str] = []
    for key, value in args.items():
        flag = str(key)
        if not flag.startswith("-"):
            if flag in ("ENV_VARS", "TEST_TYPE", "METRICS", "LAUNCHER", "MODE", "ARGUMENTS"):
                continue
            raise MegatronArgsError(f"{flag!r} in MODEL_ARGS is not a flag (it should start with --)",
                                    f"write it as --{flag}")
        if value is False:
            continue
        argv.append(flag)
        if value is True or value is None:
            continue
        if isinstance(value, list):
            argv += [_yaml_text(v) for v in value]
        elif isinstance(value, str) and _BRACKET_WORDS.fullmatch(value.strip()):
            # "[attn mlp moe_router]": the functional tests' spelling of several words for one flag
            argv += value.strip()[1:-1].split()
        elif isinstance(value, Mapping):
            raise MegatronArgsError(f"{flag} has a mapping as its value", f"give {flag} a value or a list")
        else:
            argv.append(_yaml_text(value))
    env_block = data.get("ENV_VARS") if "MODEL_ARGS" in data else None
    env = {str(k): _yaml_text(v) for k, v in env_block.items()} if isinstance(env_block, Mapping) else {}
    return JobWords(FORM_YAML, tuple(argv), MappingProxyType(env), notes=tuple(notes))


_BRACKET_WORDS = re.compile(r"\[[^,\[\]]*\]")


def _yaml_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def command_words(source: str | list[str]) -> JobWords:
    """A shell command line (``torchrun ... pretrain_gpt.py --flag v ...``, ``VAR=value`` words first, line
    continuations and comments allowed) or just its flags; an argv list is taken word for word."""
    if isinstance(source, str):
        text = source.replace("\\\r\n", " ").replace("\\\n", " ")
        try:
            words = shell_words(text)
        except MegatronArgsError:
            raise
        except ValueError as exc:
            raise MegatronArgsError(f"the command line does not split into words: {exc}",
                                    "close the quote, or give the arguments as MODEL_ARGS YAML")
    else:
        words = [str(w) for w in source]
    env: dict[str, str] = {}
    i = 0
    while i < len(words) and words[i] in ("env", "export"):
        i += 1
    while i < len(words) and _ENV_WORD.match(words[i]) and not words[i].startswith("-"):
        name, value = _ENV_WORD.match(words[i]).groups()
        env[name] = value
        i += 1
    words = words[i:]
    words = first_command(words)
    script_at = next((k for k, w in enumerate(words) if w.endswith(".py") and not w.startswith("-")), None)
    world, launcher, script = None, "", ""
    before: list[str] = []
    if script_at is not None:
        script = os.path.basename(words[script_at])
        before = words[:script_at]
        world, launcher = _launcher_world(before)
        words = words[script_at + 1:]
    elif words and not words[0].startswith("-"):
        first_flag = next((k for k, w in enumerate(words) if w.startswith("--")), len(words))
        before = words[:first_flag]
        world, launcher = _launcher_world(before)
    return JobWords(FORM_COMMAND, tuple(words), MappingProxyType(env), world, launcher, script,
                    launcher_words=tuple(before))


# A word as bash reads it: unquoted characters, a backslash and the character it escapes, a single-quoted run,
# a double-quoted run (where a backslash escapes only \\ " $ ` and a newline). Possessive, so matching is linear:
# shlex builds each word a character at a time by string concatenation, quadratic in the word's length (one
# 8 MB word took minutes).
_SHELL_WORD = re.compile(r'(?:[^\s\'"\\]++|\\.|\'[^\']*+\'|"(?:[^"\\]++|\\.)*+")++', re.S)
_SHELL_PIECE = re.compile(r'([^\'"\\]+)|\\(.)|\'([^\']*)\'|"((?:[^"\\]|\\.)*)"', re.S)
_DOUBLE_QUOTED_ESCAPE = re.compile(r'\\([\\"$`\n])')


def shell_words(text: str) -> list[str]:
    """``text`` split into words as bash splits a simple command (no expansion: ``${...}`` stays as written), in
    linear time: whitespace separates words, ``#`` at the start of a word comments out the rest of its line, and
    quotes and backslashes as bash reads them. Raises ValueError for an unclosed quote or a trailing backslash,
    MegatronArgsError past MAX_WORDS words."""
    words: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return words
        if text[i] == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        m = _SHELL_WORD.match(text, i)
        if m is None or (m.end() < n and not text[m.end()].isspace()):
            raise ValueError("No closing quotation" if text[m.end() if m else i] in "'\"" else "No escaped character")
        words.append("".join(p[0] or p[1] or p[2] or _DOUBLE_QUOTED_ESCAPE.sub(r"\1", p[3])
                             for p in _SHELL_PIECE.findall(m.group())))
        if len(words) > MAX_WORDS:
            raise MegatronArgsError(f"the command line has more than {MAX_WORDS:,} words (a Megatron-LM job has a few "
                                    "hundred)", "give the job's own command line")
        i = m.end()


def _launcher_world(words: list[str]) -> tuple[int | None, str]:
    """GPUs the launcher starts: torchrun's --nproc-per-node x --nnodes (a fixed count; 'gpu', 'auto' or an
    elastic min:max range are not a number of processes we can know)."""
    if not any(os.path.basename(w) in _LAUNCHERS or w in _LAUNCHERS for w in words):
        return None, ""
    opts: dict[str, str] = {}
    for k, w in enumerate(words):
        name, eq, value = w.partition("=")
        key = name.lstrip("-").replace("_", "-")
        if key in ("nproc-per-node", "nnodes") and name.startswith("--"):
            opts[key] = value if eq else (words[k + 1] if k + 1 < len(words) else "")
    nproc, nnodes = opts.get("nproc-per-node", "1"), opts.get("nnodes", "1")
    if ":" in nnodes:
        low, _, high = nnodes.partition(":")
        nnodes = low if low == high else ""
    procs, nodes = ascii_int(nproc, 7), ascii_int(nnodes, 7)    # "gpu", "auto", "\u00b2": not a count we know
    if not procs or not nodes:
        return None, ""
    return procs * nodes, f"--nproc-per-node {procs} x --nnodes {nodes}"


def dump_values(text: str) -> tuple[dict[str, str], int]:
    """(name -> printed value, number of dumps) from the first ``arguments`` dump of a log.

    Megatron-LM prints ``'  {name} {dots} {value}'`` with ``48 - len(name)`` dots (``32 - len(name)`` in 2020),
    sorted, between the header and ``end of arguments`` (arguments.py _print_args); a launcher may prefix every line (``[default0]:``,
    ``0: ``), which is taken from the header line and stripped. A line of another rank's output inside the
    dump is skipped."""
    header = dump_header(text)
    if header is None:
        raise MegatronArgsError("no Megatron-LM arguments dump in the text", "give the head of the job's log")
    count = sum(1 for _ in zip(_DUMP_HEADERS.finditer(text), range(MAX_DUMP_HEADERS)))
    line_start = text.rfind("\n", 0, header.start()) + 1
    prefix = text[line_start:header.start()]
    stamped = _stamp_shape(prefix)
    lines = text[header.end():].splitlines()
    values: dict[str, str] = {}
    for line in lines[1:1 + MAX_DUMP_LINES]:
        if _DUMP_END_LINE.search(line):
            break
        if prefix and line.startswith(prefix):
            line = line[len(prefix):]
        elif stamped is not None and (m := stamped.match(line)):
            line = line[m.end():]
        m = _DUMP_LINE.match(line.rstrip("\r"))
        if m and m.group(1) not in values:
            values[m.group(1)] = m.group(2)
    else:
        raise MegatronArgsError("the arguments dump has no 'end of arguments' line (the log is cut inside it)",
                                "give the whole head of the log")
    return values, count


_CLOCK = re.compile(r"\d{1,2}:\d{2}:\d{2}")


def _stamp_shape(prefix: str) -> re.Pattern | None:
    """The shape of a dump header's prefix that holds a time of day (``kubectl logs --timestamps``' RFC 3339 stamp,
    ``docker logs -t``, ``ts``, a logging format's ``[10:50:42]``), whose digits change from line to line: the prefix
    with each run of digits any run of digits, and a fraction of a second optional (RFC 3339 with nanoseconds drops
    a zero fraction). None for a prefix without a time (``[default0]:``, ``0: ``): those are taken as printed, so
    another rank's line inside the dump is never read as the dump's."""
    if not _CLOCK.search(prefix) or len(prefix) > 256:
        return None
    shape = re.sub(r"\\\.\d+|,\d+|\d+", lambda m: r"(?:[.,]\d+)?" if m.group()[0] in "\\," else r"\d+",
                   re.escape(prefix))
    clock = r"\d+:\d+:\d+"   # a time of day printed without its fraction may carry one on the next line
    shape = re.sub(re.escape(clock) + r"(?!\(\?:\[\.,\]\\d\+\)\?)", lambda m: clock + r"(?:[.,]\d+)?", shape)
    return re.compile(shape)


def dump_words(text: str) -> JobWords:
    """The dump's values; they become words in :func:`load_job`, where the parser says which flag each is."""
    values, count = dump_values(text)
    world = ascii_int(values.get("world_size"), 7) or None
    notes = (f"the log holds {count} arguments dumps; the first is used",) if count > 1 else ()
    return JobWords(FORM_DUMP, (), MappingProxyType({}), world, "the dump's world_size" if world else "", "",
                    MappingProxyType(values), notes)


# ----------------------------------------------------------------------------- 3. megatron-core's parser
class _Parser(argparse.ArgumentParser):
    """megatron-core's parser that raises instead of exiting (a bad value is the user's error, not an exit)."""

    def error(self, message):  # noqa: D401 - argparse's hook
        from ..core.text import bounded
        raise MegatronArgsError(f"Megatron-LM's parser refuses the arguments: {bounded(message, 400)}",
                                "fix the flag named above (megatron-core 0.19.2's arguments.py)")

    def exit(self, status=0, message=None):
        from ..core.text import bounded
        raise MegatronArgsError(f"Megatron-LM's parser stopped: {bounded(message or status, 400)}", "remove -h/--help")


_PARSER: list[argparse.ArgumentParser] = []


def megatron_parser() -> argparse.ArgumentParser:
    """megatron-core 0.19.2's own Megatron-LM parser (megatron/training/arguments.py add_megatron_arguments),
    without -h (a help flag in a job's arguments is an unknown word, not an exit). Built once per process:
    parsing does not change it."""
    if not _PARSER:
        from megatron.training.arguments import add_megatron_arguments
        parser = _Parser(description="Megatron-LM Arguments", allow_abbrev=False, exit_on_error=False,
                         add_help=False)
        with _quiet():
            parser = add_megatron_arguments(parser)
        for action in parser._actions:
            if getattr(action.type, "__name__", "") in _PATTERN_TYPES:
                action.type = _checked_pattern_type(flag_of(action), action.type)
        _PARSER.append(parser)
    return _PARSER[0]


def flag_of(action: argparse.Action) -> str:
    """The long option string of an action (the first ``--`` one, as Megatron-LM's docs name it)."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    return (longs or list(action.option_strings) or [action.dest])[0]


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.option_strings and a.dest not in out:
            out[a.dest] = a
    return out


def group_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> the title of its argparse group."""
    return {a.dest: g.title or "" for g in parser._action_groups for a in g._group_actions}


def flag_words(action: argparse.Action, value: Any) -> list[str] | None:
    """The words that set ``action`` to ``value`` (a Python value, as in the validated namespace), or None when
    no words can (a value only validation sets, such as None for a flag with a default)."""
    flag = flag_of(action)
    if action.nargs == 0:
        if action.const is True:
            return [flag] if value is True else ([] if value is False else None)
        if action.const is False:
            return [flag] if value is False else ([] if value is True else None)
        return [flag] if value == action.const else None
    if value is None:
        return None
    if isinstance(value, bool):
        return [flag, str(value).lower()]
    if isinstance(value, (list, tuple)) and action.nargs not in (None, "?"):
        return [flag, *(_word(v) for v in value)]
    if isinstance(value, (list, tuple)):     # a pattern the flag's type evaluates (moe_freq_type: no spaces)
        return [flag, "[" + ",".join(_word(v) for v in value) + "]"]
    return [flag, _choice_word(action, value)]


def _choice_word(action: argparse.Action, value: Any) -> str:
    """``value`` as the word the parser takes: among its choices where it has them (a torch dtype, which
    validate_args made of the choice, back to the choice: torch.bfloat16 -> bf16)."""
    word = _word(value)
    if action.choices and word not in action.choices and _DTYPE_CHOICE.get(word) in action.choices:
        return _DTYPE_CHOICE[word]
    return word


def _word(value: Any) -> str:
    if hasattr(value, "name") and type(value).__module__ != "builtins" and not isinstance(value, (int, float)):
        return str(value.name)    # an Enum (AttnBackend.flash -> flash)
    return str(value)


# validate_args's dtype_map (arguments.py, "dtype_map = {'fp32': torch.float32, ...}"), read backwards.
_DTYPE_CHOICE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.uint8": "fp8"}


def _dump_value(action: argparse.Action, text: str) -> Any:
    """The Python value a printed dump value stands for, as the action would hold it; raises ValueError when
    the text cannot be read back."""
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text.startswith(("[", "(")):
        if len(text) > MAX_PATTERN_CHARS:
            raise ValueError(text[:80])
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            if action.nargs in (None, "?"):
                return text         # a pattern the flag's own type reads, e.g. moe_layer_freq "([1]*3+[0])"
            raise ValueError(text[:80]) from None
    if text in _DTYPE_CHOICE and action.choices and _DTYPE_CHOICE[text] in action.choices:
        return _DTYPE_CHOICE[text]      # validate_args turned the choice into a torch dtype (dtype_map)
    if "." in text and re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", text) and not text.startswith("torch."):
        return text.rsplit(".", 1)[1]   # an Enum printed as Class.member
    return text


def _dump_argv(values: Mapping[str, str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str], list[str]]:
    """(argv, names not parser flags, notes) that rebuild a printed dump: each flag whose printed value differs
    from the parser's default, written as the words that set it."""
    actions = actions_by_dest(parser)
    argv: list[str] = []
    others: list[str] = []
    notes: list[str] = []
    for name, text in values.items():
        action = actions.get(name)
        if action is None:
            others.append(name)
            continue
        if text == str(action.default) or _derived(name, text, values):
            continue
        try:
            value = _dump_value(action, text)
        except (ValueError, SyntaxError):
            notes.append(f"the dump's {name} = {text[:80]} cannot be read back; its default is used")
            continue
        words = flag_words(action, value)
        if words is None:
            continue
        argv += words
    return argv, others, notes


# ----------------------------------------------------------------------------- older releases' names
# Arguments Megatron-LM renamed or replaced (the history of NVIDIA/Megatron-LM's megatron/arguments.py): a dump or a
# command line of an older release names them. megatron-core 0.19.2's parser does not know some of them and refuses
# the others in validate_args ("--batch-size argument is no longer valid, use --micro-batch-size instead", an exit()
# for --checkpoint-activations), so each is read as the job's own release ran it, written in 0.19.2's words, and
# listed (MegatronJob.translated): an old job is planned as it ran, never as if the setting were absent.
#   model_parallel_size: the only (tensor) model parallelism until pipeline parallelism (v1.0, 2020-04; 0.19.2's
#     validate_args: "use --tensor-model-parallel-size instead"); intra_/inter_layer_model_parallel_size: tensor and
#     pipeline parallelism until 52a5f2f272 (2020-10-20, "Intra-layer MP -> Tensor MP, Inter-layer MP -> Pipeline MP").
#   batch_size: the micro-batch until 9019bbf400 (2020-12-06, "Rename --batch-size to --micro-batch-size").
#   checkpoint_activations (+ checkpoint_num_layers, default 1): every transformer layer's input kept and the layers
#     recomputed in uniform chunks of checkpoint_num_layers, until c1e0689d92 (2021-08-10); validate_args itself then
#     read the flag as activations-checkpoint-method uniform, and from bbab79f869 (2022-05-16) as
#     recompute_granularity full + recompute_method uniform, until 3e71ad9c62 (2023-04-26) made it an exit().
#   activations_checkpoint_method / activations_checkpoint_num_layers: full recompute by that method, renamed
#     recompute_method / recompute_num_layers (with recompute_granularity full) by bbab79f869 (2022-05-16).
#   distribute_checkpointed_activations: renamed distribute_saved_activations by d19e8ad7ab (2022-05-16).
_RENAMED = {"model_parallel_size": "tensor_model_parallel_size",
            "intra_layer_model_parallel_size": "tensor_model_parallel_size",
            "inter_layer_model_parallel_size": "pipeline_model_parallel_size",
            "batch_size": "micro_batch_size",
            "distribute_checkpointed_activations": "distribute_saved_activations"}
_RECOMPUTE_LAYERS_OLD = ("activations_checkpoint_num_layers", "checkpoint_num_layers")
_SWITCHES_OLD = ("checkpoint_activations", "distribute_checkpointed_activations")
_LEGACY = frozenset(_RENAMED) | frozenset(("checkpoint_activations", "activations_checkpoint_method",
                                           *_RECOMPUTE_LAYERS_OLD))


def _absent(text: Any) -> bool:
    return text is None or str(text) in ("None", "False", "")


def legacy_values(values: Mapping[str, str], present: frozenset[str] = frozenset()
                  ) -> tuple[dict[str, str], list[FlagNote]]:
    """(values in megatron-core 0.19.2's names, what was translated) for ``values`` keyed by argument name (a dump's
    printed texts; a command line's old flags, "True" for a switch): an older release's name is read as that release
    ran it (the table above). A 0.19.2 name the job sets itself (in ``values`` or ``present``) wins over an old one;
    old names the job leaves unset are dropped."""
    out = {k: v for k, v in values.items() if k not in _LEGACY}
    notes: list[FlagNote] = []
    old = method = None
    if not _absent(values.get("activations_checkpoint_method")):
        old, method = "activations_checkpoint_method", str(values["activations_checkpoint_method"])
    elif str(values.get("checkpoint_activations")) == "True":
        old, method = "checkpoint_activations", "uniform"
    if old and _absent(out.get("recompute_granularity")) and "recompute_granularity" not in present:
        layers = next((str(values[k]) for k in _RECOMPUTE_LAYERS_OLD if not _absent(values.get(k))), "1")
        out["recompute_granularity"], out["recompute_method"] = "full", method
        if _absent(out.get("recompute_num_layers")) and "recompute_num_layers" not in present:
            out["recompute_num_layers"] = layers
        notes.append(FlagNote("--" + old.replace("_", "-"), "" if old == "checkpoint_activations" else method,
                              "an older Megatron-LM's full recompute, read as it ran: --recompute-granularity full "
                              f"--recompute-method {method} --recompute-num-layers "
                              f"{out.get('recompute_num_layers', layers)}"))
    for name, new in _RENAMED.items():
        if _absent(values.get(name)) or not _absent(out.get(new)) or new in present:
            continue
        out[new] = values[name]
        notes.append(FlagNote("--" + name.replace("_", "-"), "" if name in _SWITCHES_OLD else str(values[name]),
                              f"an older Megatron-LM's name, read as --{new.replace('_', '-')}"))
    return out, notes


def legacy_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[FlagNote]]:
    """A command line's older Megatron-LM flags (``--checkpoint-activations``, ``--batch-size``,
    ``--activations-checkpoint-method``, ...) rewritten in megatron-core 0.19.2's words (:func:`legacy_values`), after
    the job's other words, which keep their order."""
    flags = {"--" + n.replace("_", "-"): n for n in _LEGACY}
    if not any(w.startswith("--") and w.partition("=")[0] in flags for w in argv):
        return list(argv), []
    kept: list[str] = []
    old: dict[str, str] = {}
    k = 0
    while k < len(argv):
        flag, eq, inline = argv[k].partition("=")
        name = flags.get(flag) if argv[k].startswith("--") else None
        if name is None:
            kept.append(argv[k])
            k += 1
        elif name in _SWITCHES_OLD:
            old[name], k = "True", k + 1
        elif eq:
            old[name], k = inline, k + 1
        elif k + 1 < len(argv):
            old[name], k = argv[k + 1], k + 2
        else:                      # a value-taking flag without its value: left for the parser to refuse
            kept.append(argv[k])
            k += 1
    dest_of = {o: a.dest for a in parser._actions for o in a.option_strings}
    present = frozenset(d for w in kept if w.startswith("-") and (d := dest_of.get(w.partition("=")[0])))
    translated, notes = legacy_values(old, present)
    actions = actions_by_dest(parser)
    words: list[str] = []
    for dest, value in translated.items():
        action = actions.get(dest)
        if action is not None:
            words += flag_words(action, True if action.nargs == 0 else value) or []
    return kept + words, notes


# Arguments validate_args writes from another one, which it then refuses to be given alongside it (arguments.py
# validate_args: "cannot have both num-layers and encoder-num-layers specified", "assert args.encoder_seq_length
# is None", "assert args.start_weight_decay is None" under a constant weight decay, the deprecated hybrid_override_pattern copied into hybrid_layer_pattern).
_DERIVED = {"encoder_num_layers": "num_layers", "encoder_seq_length": "seq_length",
            "hybrid_override_pattern": "hybrid_layer_pattern", "start_weight_decay": "weight_decay",
            "end_weight_decay": "weight_decay"}


def _derived(name: str, text: str, values: Mapping[str, str]) -> bool:
    """Whether a dump's value is one validate_args wrote from another argument of the same value."""
    source = _DERIVED.get(name)
    return source is not None and values.get(source) == text


@contextlib.contextmanager
def _quiet():
    """megatron-core prints from the parser and validate_args (print_rank_0, warnings): kept off our stdout."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield sink


def te_version() -> tuple[str, bool]:
    """(the Transformer Engine version validate_args is asked about, whether it is the installed one)."""
    from megatron.core.utils import get_te_version
    from packaging.version import Version
    installed = get_te_version()
    if installed > Version("0.0.0"):
        return str(installed), True
    return ASSUMED_TE_VERSION, False


def _te_min_version(te: str):
    """megatron.core.utils.is_te_min_version against ``te`` instead of the installed package."""
    from packaging.version import Version

    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        return Version(te) >= Version(version) if check_equality else Version(te) > Version(version)
    return is_te_min_version


# Transformer Engine's FusedAdam, as megatron-core's OptimizerConfig.__post_init__ asks for it when the
# precision-aware optimizer is on (core/optimizer/optimizer_config.py:446-467: it imports
# transformer_engine.pytorch.optimizers.FusedAdam and asserts these keyword names in its signature). TE lives on the
# job's GPU nodes, not on a planning host: there the import fails and the job would be refused for what this host
# lacks. TE >= 2.1 (ASSUMED_TE_VERSION) takes them all.
_FUSED_ADAM_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers")
TE_MIN_ARCH = 8   # Transformer Engine's support matrix starts at compute capability 8.0 (Ampere)
TE_FUSED_ADAM_NOTE = ("Transformer Engine's FusedAdam check (megatron-core optimizer_config.py:446-467) is left to "
                      f"the GPU nodes: TE is not installed here, TE {ASSUMED_TE_VERSION}'s is assumed")


def te_installed() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _fused_adam_as_on_gpu_nodes(args: argparse.Namespace, arch: int = DEFAULT_ARCH):
    """While megatron-core builds the OptimizerConfig of a job with the precision-aware optimizer (and no optimizer
    offload, which skips the check) on a host without TE, for GPUs TE supports (compute capability >= 8: TE's
    support matrix, nvidia.github.io/TransformerEngine/support_matrix.html, starts at Ampere): its FusedAdam check
    sees the signature TE has on the GPU nodes, and its is_te_min_version the assumed TE version (as validate_args
    is asked, validation_env). Only the three module names the check imports are bound, only for this block, and
    only when TE is not installed; using the placeholder raises. Restored whatever happens. On older GPUs nothing is
    assumed: megatron-core's own refusal stands."""
    if not getattr(args, "use_precision_aware_optimizer", False) or getattr(args, "optimizer_cpu_offload", False) \
            or te_installed() or arch < TE_MIN_ARCH:
        yield
        return
    import types

    import megatron.core.optimizer.optimizer_config as optimizer_config
    te_version()   # megatron-core caches the installed version (0.0.0) before anything is bound

    def FusedAdam(params=None, *, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None,  # noqa: N802
                  use_decoupled_grad=False, **kwargs):
        from .te_compat import TransformerEngineMissing
        raise TransformerEngineMissing("FusedAdam needs Transformer Engine, which is not installed on this host")

    bound = [name for name in _FUSED_ADAM_MODULES if name not in sys.modules]
    modules = {name: types.ModuleType(name) for name in bound}
    if "transformer_engine.pytorch.optimizers" in modules:
        modules["transformer_engine.pytorch.optimizers"].FusedAdam = FusedAdam
    original = optimizer_config.is_te_min_version
    try:
        sys.modules.update(modules)
        optimizer_config.is_te_min_version = _te_min_version(ASSUMED_TE_VERSION)
        yield
    finally:
        optimizer_config.is_te_min_version = original
        for name in bound:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def validation_env(job_env: Mapping[str, str], arch: int, requirements: Mapping[str, str] = ENV_REQUIREMENTS):
    """validate_args as on the job's GPUs: the job's own values of the variables it reads (ours removed), the
    launch scripts' requirements where the job is silent, the GPU's compute capability (it asks torch.cuda
    and get_device_arch_version) and Transformer Engine's version (it asks is_te_min_version: te_version, the
    installed TE or the one Bridge pins). Everything is restored on exit, whatever happens; an environment
    ``os.environ`` could not hold is refused before anything is written (job_environment). Yields the text
    megatron-core printed meanwhile."""
    import torch

    import megatron.training.arguments as mlm_arguments
    job_env = job_environment(job_env)
    saved = {k: os.environ.get(k) for k in set(JOB_ENV_KEYS) | set(job_env) | set(ENV_REQUIREMENTS)}
    patched = [(torch.cuda, "get_device_capability"), (mlm_arguments, "get_device_arch_version"),
               (mlm_arguments, "is_te_min_version")]
    originals = [(obj, name, getattr(obj, name)) for obj, name in patched]
    try:
        for k in JOB_ENV_KEYS:
            os.environ.pop(k, None)
        for k, v in job_env.items():
            os.environ[k] = v
        for k, v in requirements.items():
            os.environ.setdefault(k, v)
        torch.cuda.get_device_capability = lambda device=None: (arch, 0)
        mlm_arguments.get_device_arch_version = lambda: arch
        mlm_arguments.is_te_min_version = _te_min_version(te_version()[0])
        with _quiet() as sink:
            yield sink
    finally:
        for obj, name, original in originals:
            setattr(obj, name, original)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- files the arguments name
# megatron-core opens files named in the arguments while it parses, validates and builds the config: validate_args
# reads --heterogeneous-layers-config-path (Path.read_text, arguments.py validate_model_config_args_from_heterogeneous_
# config), core_transformer_config_from_args loads --te-precision-config-file (quantization/quant_config.py
# RecipeConfig.from_yaml_file: open + yaml.load), and we count --vocab-file's entries. While megatron-core runs here,
# every file opened for reading goes through read_named_file (a regular file, at most MAX_NAMED_FILE bytes, opened
# without blocking, so a fifo or a device is refused at once) and every yaml.load through core/safeyaml.py (the
# bounded reader of every user YAML: an alias bomb is refused while it is composed).
MAX_NAMED_FILE = 16 << 20
MAX_VOCAB_FILE = 64 << 20    # GPT-2's vocab.json is 1 MiB; the largest BPE vocabularies are a few MiB


def read_named_file(path: Any, limit: int = MAX_NAMED_FILE) -> bytes:
    """The bytes of the file ``path`` names, when it is a regular file of at most ``limit`` bytes; raises OSError
    as open() would (a missing file) and _Refusal for a fifo, device, folder or a larger file."""
    from ..core.text import bounded, shown
    name = shown(bounded(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path), 200))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))   # a fifo opens without a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refusal(MegatronArgsError(f"{name!r}, named in the arguments, is not a regular file (a fifo, device "
                                             "or folder): it is not read", "name a regular file"))
        if st.st_size > limit:
            raise _Refusal(MegatronArgsError(f"{name!r}, named in the arguments, is {st.st_size:,} bytes (at most "
                                             f"{limit:,} are read)", "name the job's own, smaller file"))
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:    # it grew after fstat
            raise _Refusal(MegatronArgsError(f"{name!r}, named in the arguments, grows past {limit:,} bytes",
                                             "name a file that is not being written"))
        return b"".join(chunks)
    finally:
        os.close(fd)


class _NamedBytes(io.BytesIO):
    """A file's bytes read by read_named_file, with the file's name as open() gives it."""

    def __init__(self, data: bytes, name: str):
        super().__init__(data)
        self.name = name


def _bounded_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True,
                  opener=None):
    """open() for reading while megatron-core runs here: the whole file read through read_named_file first."""
    raw = _NamedBytes(read_named_file(file), os.fsdecode(file))
    if "b" in mode:
        return raw
    return io.TextIOWrapper(raw, encoding=encoding or "utf-8", errors=errors, newline=newline)


def _bounded_yaml(stream, *args, **kwargs):
    """yaml.load (any Loader) while megatron-core runs here: plain data through core/safeyaml.py's bounds."""
    name = getattr(stream, "name", "a YAML document")
    text = stream if isinstance(stream, (str, bytes)) else stream.read()
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        return safeyaml.load(text, duplicates="last")
    except (safeyaml.YamlRefused, ValueError, RecursionError) as exc:
        from ..core.text import bounded, shown
        raise _Refusal(MegatronArgsError(f"{shown(bounded(name, 200))}, which megatron-core reads as YAML, is refused: "
                                         f"{bounded(' '.join(str(exc).split()), 300)}",
                                         "give a plain YAML file (no alias bombs, at most "
                                         f"{safeyaml.MAX_NODES:,} nodes)")) from None


@contextlib.contextmanager
def _bounded_reads():
    """Every open() for reading and every yaml.load of megatron-core's while it parses, validates and builds
    the job's config here goes through read_named_file and core/safeyaml.py; restored on exit."""
    import builtins

    import yaml
    real_open = builtins.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if isinstance(file, int) or not isinstance(mode, str) or any(c in mode for c in "wax+"):
            return real_open(file, mode, *args, **kwargs)
        return _bounded_open(file, mode, *args, **kwargs)

    loaders = {name: getattr(yaml, name) for name in ("load", "safe_load", "full_load", "unsafe_load")
               if hasattr(yaml, name)}
    saved_io_open = io.open
    try:
        builtins.open = io.open = guarded_open
        for name in loaders:
            setattr(yaml, name, _bounded_yaml)
        yield
    finally:
        builtins.open = real_open
        io.open = saved_io_open
        for name, loader in loaders.items():
            setattr(yaml, name, loader)


# ----------------------------------------------------------------------------- numbers the plan reads
# Integer arguments that are sizes or counts: megatron-core divides by them (world_size % (tp x pp x cp),
# hidden_size % num_attention_heads, global_batch_size % (micro_batch_size x dp), the vocabulary padding) or the plan
# multiplies them into memory, so given, each is at least 1 (a negative --num-layers was planned as a job that fits).
POSITIVE = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "num_layers", "encoder_num_layers",
    "decoder_num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "encoder_seq_length", "decoder_seq_length", "max_position_embeddings", "micro_batch_size",
    "global_batch_size", "eval_micro_batch_size", "eval_global_batch_size", "vocab_size", "padded_vocab_size",
    "make_vocab_size_divisible_by", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_shared_expert_intermediate_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "microbatch_group_size_per_vp_stage", "mamba_state_dim",
    "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "kv_lora_rank", "q_lora_rank", "linear_conv_kernel_dim", "num_distributed_optimizer_instances",
    "moe_latent_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
})
# Integer arguments that megatron-core reads with a negative meaning: their default (-1: none / off) or -1 as
# 'automatic' (arguments.py validate_args, inference_dynamic_batching_num_cuda_graphs).
SIGNED = frozenset({"rl_default_top_k", "null_tokenizer_pad_id", "inference_batch_times_seqlen_threshold",
                    "inference_dynamic_batching_num_cuda_graphs"})


def _number_problem(action: argparse.Action, value: Any, neutral: bool) -> str | None:
    """Why a parsed value of ``action`` is refused, or None."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):
            if v.bit_length() > 63:
                return f"is an integer of {v.bit_length()} bits, out of range (at most {MAX_INT:,}, a 64-bit integer)"
            if action.dest in POSITIVE and v < 1:
                return f"is {v}: a size or count megatron-core divides by or the plan multiplies, at least 1"
            if neutral:      # a negative logging interval or checkpoint count cannot change memory
                continue
            if v < 0 and action.dest not in SIGNED and not (isinstance(action.default, int) and action.default < 0):
                return f"is {v}: megatron-core gives this argument no negative meaning"
        elif isinstance(v, float) and not math.isfinite(v):
            return f"is {v}, not a finite number"
    return None


def _check_numbers(args: argparse.Namespace, dests: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """The numbers the words gave, checked before validate_args divides by them (every problem at once)."""
    from ..core.text import bounded
    actions, groups = actions_by_dest(parser), group_of(parser)
    problems = []
    for dest in dests:
        action = actions.get(dest)
        if action is None or action.nargs == 0:
            continue
        why = _number_problem(action, getattr(args, dest, None), groups.get(dest) in NEUTRAL_GROUPS)
        if why:
            problems.append(f"{flag_of(action)} {why}")
    if problems:
        raise MegatronArgsError("; ".join(bounded(p, 300) for p in problems[:10])
                                + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""),
                                "give each flag named a value in range: a finite number, and for sizes and counts "
                                "a whole number of at least 1")


def _check_plan_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The validated namespace (validate_args derives sizes: ffn_hidden_size, kv_channels, ...) within what the plan
    reads: every size at least 1, the layers and pipeline ranks within the plan's limits."""
    actions = actions_by_dest(parser)
    problems = []
    for dest in sorted(POSITIVE):
        value = getattr(args, dest, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1 and dest in actions:
            problems.append(f"{flag_of(actions[dest])} is {value} after megatron-core's validation (at least 1)")
    layers = getattr(args, "num_layers", None)
    if isinstance(layers, int) and layers > MAX_PLAN_LAYERS:
        problems.append(f"--num-layers {layers:,} is past the plan's limit of {MAX_PLAN_LAYERS:,} layers (it "
                        "plans each layer)")
    pp = getattr(args, "pipeline_model_parallel_size", None)
    if isinstance(pp, int) and pp > MAX_PLAN_PIPELINE:
        problems.append(f"--pipeline-model-parallel-size {pp:,} is past the plan's limit of {MAX_PLAN_PIPELINE:,} "
                        "pipeline stages (it plans each stage)")
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if isinstance(pp, int) and 1 < pp <= MAX_PLAN_PIPELINE and vpp > 1:
        dp = max(1, args.world_size // (pp * args.tensor_model_parallel_size * args.context_parallel_size))
        microbatches = max(1, (args.global_batch_size or 1) // ((args.micro_batch_size or 1) * dp))
        group = max(pp, min(args.microbatch_group_size_per_vp_stage or pp, max(pp, microbatches)))
        if pp * group * vpp > MAX_PLAN_SCHEDULE:   # memory/pipeline.py vp_group, and the replay it bounds
            problems.append(f"the interleaved schedule the plan replays per stage (pipeline {pp} x microbatch group "
                            f"{group} x virtual stages {vpp} = {pp * group * vpp:,} steps) is past its limit of "
                            f"{MAX_PLAN_SCHEDULE:,}")
    if problems:
        raise MegatronArgsError("; ".join(problems), "plan a job within these limits")


# ----------------------------------------------------------------------------- parse and validate
def _exc_text(exc: BaseException, printed: str = "") -> str:
    """One bounded line for an exception megatron-core raised (its message, or where it was raised)."""
    from ..core.text import bounded
    if isinstance(exc, SystemExit):
        lines = [line.strip() for line in printed.splitlines() if line.strip()]
        said = lines[-1] if lines else f"exit code {exc.code}"
        return bounded(f"it calls exit() ({' '.join(said.split())})", 400)
    try:
        text = " ".join(str(exc).split())
    except Exception:  # noqa: BLE001 - a message that cannot be shown
        text = ""
    if not text:
        text = _where(exc)
    elif not isinstance(exc, AssertionError):   # validate_args' asserts say what is wrong; other errors say less
        text = f"{type(exc).__name__}: {text}"
    return bounded(text, 400)


def parse_and_validate(argv: Sequence[str], world: int, env: Mapping[str, str], arch: int,
                       parser: argparse.ArgumentParser | None = None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(validated namespace, unknown words, notes) exactly as Megatron-LM's parse_args + validate_args, with the rank and
    world size it would read from the launcher's environment.

    Every failure is a MegatronArgsError: the parser's (an unknown choice, a converter's KeyError: a usage error),
    a number out of range (before validate_args divides by it), a file it names that cannot be read here, and
    validate_args' own refusal whatever it raises, its exit() included (``rejected``: exit 1)."""
    parser = parser or megatron_parser()
    if len(argv) > MAX_WORDS:
        raise MegatronArgsError(f"the job has {len(argv):,} words, more than {MAX_WORDS:,} (a Megatron-LM job has a "
                                "few hundred)", "give the job's own arguments")
    argv, placeholders = _placeholders(argv, parser)
    with validation_env(env, arch, env_requirements(argv)) as printed, _bounded_reads():
        try:
            args, unknown = parser.parse_known_args(list(argv))
        except _Refusal as exc:
            raise exc.error from None
        except MegatronArgsError:
            raise
        except argparse.ArgumentError as exc:
            raise MegatronArgsError(f"Megatron-LM's parser refuses the arguments: {_exc_text(exc)}",
                                    "fix the flag named above (megatron-core 0.19.2's arguments.py)") from None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a converter's own error (KeyError, ...)
            raise MegatronArgsError(f"Megatron-LM's parser refuses the arguments: {_exc_text(exc, printed.getvalue())}",
                                    "fix the flag named above (megatron-core 0.19.2's arguments.py)") from None
        _check_numbers(args, _given_dests(argv, parser), parser)
        # parse_and_validate_args (arguments.py) before validate_args: the checkpoint's arguments need a directory
        if args.use_checkpoint_args and args.load is None and args.pretrained_checkpoint is None:
            raise MegatronArgsError("--use-checkpoint-args requires --load or --pretrained-checkpoint argument "
                                    "(Megatron-LM's parse_and_validate_args)", "add --load DIR, or drop "
                                    "--use-checkpoint-args", rejected=True)
        args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
        args.rank, args.world_size = 0, world
        from megatron.training.arguments import validate_args
        try:
            validate_args(args, dict(PRETRAIN_DEFAULTS))
        except _Refusal as exc:
            raise exc.error from None
        except MegatronArgsError:
            raise
        except OSError as exc:   # a file the arguments name, missing here
            raise MegatronArgsError(f"megatron-core's validate_args cannot read a file the arguments name: "
                                    f"{_exc_text(exc)}", "plan where the file is, or give its path here") from None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever validate_args raises is its refusal
            raise MegatronArgsError(f"Megatron-LM's validate_args rejects the job at world size {world}: "
                                    f"{_exc_text(exc, printed.getvalue())}",
                                    "fix the arguments (or the world size) as the message says",
                                    rejected=True) from None
        _check_plan_sizes(args, parser)
    return args, unknown, placeholders


def _where(exc: BaseException) -> str:
    """An assertion without a message, as the line of megatron-core that raised it."""
    import traceback
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    if last is None:
        return type(exc).__name__
    return f"{type(exc).__name__} at {os.path.basename(last.filename)}:{last.lineno}: {(last.line or '').strip()}"


_PLACEHOLDER = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def _placeholders(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(argv without the ``${VAR}`` values of typed flags, notes). A path may be ``${DATA_PATH}/...`` and stays
    a word; a number cannot be, and ``${...}`` is never interpolated. Such a flag of a group that cannot change
    memory keeps its default (a note says so); any other is an error: its value decides the plan."""
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    groups = group_of(parser)
    out: list[str] = []
    notes: list[str] = []
    words = list(argv)
    k = 0
    while k < len(words):
        w = words[k]
        action = by_option.get(w)
        if action is not None and action.nargs is None and action.type not in (None, str) and k + 1 < len(words) \
                and _PLACEHOLDER.search(words[k + 1]):
            if groups.get(action.dest) in NEUTRAL_GROUPS:
                notes.append(f"{w} {words[k + 1]} is a placeholder; its default is used (it does not change memory)")
                k += 2
                continue
            raise MegatronArgsError(f"{w} {words[k + 1]}: a placeholder where a value is needed; ${{...}} is never "
                                    "interpolated", f"write the value of {w} itself")
        out.append(w)
        k += 1
    return out, notes


# Flag types that eval() a list expression (arguments.py _eval_pattern: digits, brackets, parentheses, commas, + and *,
# so ** too): "[0]*10**10" passes its character check and would allocate without bound. megatron_parser wraps each
# such type with _check_pattern, so every way a value reaches it (a word, --flag=value, a YAML list, a dump's value)
# is measured before megatron-core evaluates it.
_PATTERN_TYPES = ("moe_freq_type", "la_freq_type", "no_rope_freq_type")
MAX_PATTERN = 1_000_000    # list entries (one per layer)
MAX_PATTERN_CHARS = 100_000


class _Unbounded(Exception):
    """A pattern whose size cannot be known before evaluating it."""


def _pattern_size(node: ast.AST, depth: int = 0) -> tuple[str, int]:
    """("list", entries counted through nested lists) or ("int", value) of a pattern expression, computed from
    its syntax tree without building anything; raises MegatronArgsError past the bounds and _Unbounded for a form
    that is not a list expression of integers (megatron-core's own type then says what is wrong)."""
    if depth > 100:
        raise _Unbounded
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return "int", node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        total = 0
        for elt in node.elts:
            kind, n = _pattern_size(elt, depth + 1)
            total += n if kind == "list" else 1
        return "list", total
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult, ast.Pow)):
        (ka, a), (kb, b) = _pattern_size(node.left, depth + 1), _pattern_size(node.right, depth + 1)
        if isinstance(node.op, ast.Add):
            if ka != kb:
                raise _Unbounded          # list + int: a TypeError megatron-core's type reports
            out = a + b
        elif isinstance(node.op, ast.Pow):
            if ka != "int" or kb != "int":
                raise _Unbounded
            # |a| ** b stays within 64 bits only for small exponents: bounded by bit length before computing
            if b > 0 and abs(a) > 1 and b * (abs(a).bit_length() - 1) > 63:
                raise _TooLarge(f"an integer past 64 bits ({a}**{b})")
            out = a ** b if b >= 0 else 0
        elif ka == kb == "list":
            raise _Unbounded
        else:
            out = a * b if ka == kb else max(a, 0) * max(b, 0)
            kind = "list" if "list" in (ka, kb) else "int"
            if abs(out) > (MAX_PATTERN if kind == "list" else MAX_INT):
                raise _TooLarge(f"{out:,} entries" if kind == "list" else "an integer past 64 bits")
            return kind, out
        if abs(out) > (MAX_PATTERN if ka == "list" else MAX_INT):
            raise _TooLarge(f"{out:,} entries" if ka == "list" else "an integer past 64 bits")
        return ka, out
    raise _Unbounded


class _TooLarge(Exception):
    pass


def _check_pattern(flag: str, text: Any) -> None:
    """Refuse, before megatron-core's eval(), a layer pattern that would build more than MAX_PATTERN entries (or
    compute an integer past 64 bits, or whose size cannot be known from its syntax)."""
    from ..core.text import bounded, shown
    if not isinstance(text, str) or "[" not in text:
        return
    if len(text) > MAX_PATTERN_CHARS:
        raise MegatronArgsError(f"{flag} is a pattern of {len(text):,} characters (at most {MAX_PATTERN_CHARS:,})",
                                f"give {flag} one entry per layer, e.g. ([1]*3+[0])*4")
    if re.search(r"[^,\d\[\]()+*\s]", text):
        return          # megatron-core's own character check refuses it, before any eval
    try:
        kind, n = _pattern_size(ast.parse(text.strip(), mode="eval").body)
    except _TooLarge as exc:
        raise MegatronArgsError(f"{flag} {shown(bounded(text, 60))} expands to {exc} (at most {MAX_PATTERN:,} entries, "
                                "one per layer)", f"give {flag} one entry per layer") from None
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Unbounded):
        raise MegatronArgsError(f"{flag} {shown(bounded(text, 60))} is not a list expression of integers whose size "
                                "can be read before evaluating it", f"give {flag} a list such as ([1]*3+[0])*4 or "
                                "[0,1,1,1]") from None
    if kind == "list" and n > MAX_PATTERN:
        raise MegatronArgsError(f"{flag} {shown(bounded(text, 60))} expands to {n:,} entries (one per layer)",
                                f"give {flag} one entry per layer")


def _checked_pattern_type(flag: str, convert):
    """``convert`` (megatron-core's pattern type) measuring its text first (_check_pattern)."""
    import functools

    @functools.wraps(convert)
    def checked(text):
        try:
            _check_pattern(flag, text)
        except MegatronArgsError as exc:
            raise _Refusal(exc) from None    # not a ValueError: argparse would put its own words in its place
        return convert(text)
    return checked


class _Refusal(Exception):
    """Our refusal raised inside megatron-core's parser or validate_args, carried out unchanged."""

    def __init__(self, error: MegatronArgsError):
        super().__init__(error.message)
        self.error = error


# ----------------------------------------------------------------------------- the mapping
def _by_name(cls: type, args: argparse.Namespace, used: set[str], **extra: Any) -> Any:
    """``cls`` built from the namespace's values of the same name (megatron/training/training.py builds its
    OptimizerConfig and DDP config this way), plus ``extra``."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in vars(args) and f.name not in extra:
            kwargs[f.name] = getattr(args, f.name)
            used.add(f.name)
    kwargs.update(extra)
    return cls(**kwargs)


# Flags core_transformer_config_from_args (argument_utils.py) reads under another name.
_RENAMED_BY_MCORE = ("no_persist_layer_norm", "overlap_p2p_comm", "num_experts", "rotary_interleaved",
                     "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "fp8_param_gather",
                     "fp4_param_gather", "swiglu", "bias_swiglu_fusion", "bias_gelu_fusion", "squared_relu",
                     "quick_geglu", "init_method_xavier_uniform", "group_query_attention", "config_logger_dir",
                     "cp_comm_type", "hybrid_layer_pattern", "seed", "moe_latent_size", "te_precision_config_file",
                     "params_dtype")
# Flags get_megatron_ddp_config (training.py) reads under another name.
_RENAMED_BY_DDP = ("accumulate_allreduce_grads_in_fp32", "check_for_nan_in_loss_and_grad", "check_for_large_grads",
                   "ddp_num_buckets", "ddp_bucket_size", "ddp_pad_buckets_for_high_nccl_busbw",
                   "ddp_reduce_scatter_with_fp32_accumulation", "ddp_param_name_patterns_for_fp32_local_accumulation",
                   "ddp_average_in_collective", "use_precision_aware_optimizer", "use_torch_fsdp2",
                   "torch_fsdp2_reshard_after_forward", "grad_reduce_in_bf16")
# Flags this module reads itself (vocabulary, provider fields under other names, the model family).
_READ_HERE = ("untie_embeddings_and_output_weights", "use_rope_scaling", "te_rng_tracker", "vocab_size",
              "make_vocab_size_divisible_by", "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
              "tiktoken_num_special_tokens", "spec", "hybrid_override_pattern", "max_position_embeddings",
              "transformer_impl", "mtp_hybrid_override_pattern", "padded_vocab_size", "pad_vocab_size")


def tokenizer_vocab(args: argparse.Namespace, given: int | None = None) -> tuple[int, str]:
    """(the tokenizer's vocabulary, how it was found), as build_tokenizer (megatron/core/tokenizers/utils/
    build_tokenizer.py) would see it, without building the tokenizer: NullTokenizer and TikTokenizer take
    --vocab-size (TikTokenizer's default is DEFAULT_TIKTOKEN_MAX_VOCAB); GPT2BPETokenizer counts its vocab.json
    (GPT-2's 50257 when the file is not readable here). Raises MegatronArgsError when nothing says the size."""
    kind = args.tokenizer_type
    if given:
        return int(given), "given"
    if kind in ("NullTokenizer", "NullMultimodalTokenizer"):
        if not args.vocab_size:
            raise MegatronArgsError(f"{kind} needs --vocab-size", "add --vocab-size N to the arguments")
        return int(args.vocab_size), f"{kind} --vocab-size"
    if kind == "TikTokenizer":
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import DEFAULT_TIKTOKEN_MAX_VOCAB
        return (int(args.vocab_size), "TikTokenizer --vocab-size") if args.vocab_size else \
            (DEFAULT_TIKTOKEN_MAX_VOCAB, "TikTokenizer's default vocabulary (tiktoken_tokenizer.py)")
    if kind == "GPT2BPETokenizer":
        count = _json_keys(args.vocab_file)
        if count:
            return count, f"GPT2BPETokenizer, {args.vocab_file}"
        return GPT2_VOCAB, f"GPT2BPETokenizer: GPT-2's {GPT2_VOCAB} (the vocab file is not readable here)"
    raise MegatronArgsError(
        f"the vocabulary of {kind} ({args.tokenizer_model or args.vocab_file}) cannot be read without building "
        "the tokenizer", "give the tokenizer's vocabulary size (mbmem plan --tokenizer-vocab N)")


def _json_keys(path: Any, limit: int = MAX_VOCAB_FILE) -> int:
    """Entries of a GPT-2 style vocab.json, 0 when it is not here (a path on the cluster; ``${...}`` is a name).
    A file that is here must be the job's vocabulary: a fifo, a device, a file over ``limit`` or one that is not a
    JSON object (or nests past Python's recursion limit) is refused, as the tokenizer would fail on it."""
    if not isinstance(path, str) or "$" in path:
        return 0
    from ..core.text import bounded, shown
    try:
        data = read_named_file(path, limit)
    except FileNotFoundError:
        return 0
    except _Refusal as exc:
        raise exc.error from None
    except OSError as exc:
        raise MegatronArgsError(f"--vocab-file {shown(bounded(path, 200))!r} cannot be read: {exc.strerror or exc}",
                                "give the tokenizer's vocab.json, or its size with --tokenizer-vocab N") from None
    import json
    try:
        entries = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise MegatronArgsError(f"--vocab-file {shown(bounded(path, 200))!r} is not a JSON vocabulary: "
                                f"{bounded(type(exc).__name__ + ': ' + ' '.join(str(exc).split()), 200)}",
                                "give the tokenizer's vocab.json, or its size with --tokenizer-vocab N") from None
    if not isinstance(entries, dict):
        raise MegatronArgsError(f"--vocab-file {shown(bounded(path, 200))!r} is JSON but not an object of tokens",
                                "give the tokenizer's vocab.json, or its size with --tokenizer-vocab N")
    return len(entries)


def padded_vocab(vocab: int, args: argparse.Namespace) -> int:
    """build_tokenizer.py vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by x TP (in whole
    numbers: a float quotient overflows past 1e308)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    if multiple < 1 or vocab < 1:
        raise MegatronArgsError(f"the vocabulary ({vocab}) or its padding multiple ({multiple}: "
                                "--make-vocab-size-divisible-by x TP) is not positive",
                                "give --vocab-size and --make-vocab-size-divisible-by of at least 1")
    return -(-vocab // multiple) * multiple


def model_family(args: argparse.Namespace, script: str = "") -> str:
    """"hybrid" for a hybrid layer pattern or a Mamba/hybrid script (pretrain_mamba.py, pretrain_hybrid.py),
    else "gpt"; a script of another model (BERT, T5, vision, multimodal) is refused."""
    if script and not re.fullmatch(r"pretrain_(gpt|mamba|hybrid)\w*\.py|train\.py|pretrain\.py", script):
        raise MegatronArgsError(f"{script} is not a GPT or hybrid (Mamba) pretraining script; the plan covers those",
                                "plan a pretrain_gpt.py or pretrain_mamba.py job")
    if args.hybrid_layer_pattern or getattr(args, "hybrid_override_pattern", None) or "mamba" in script \
            or "hybrid" in script:
        return "hybrid"
    return "gpt"


def config_from_args(args: argparse.Namespace, family: str, vocab: int,
                     arch: int = DEFAULT_ARCH) -> tuple[Any, set[str]]:
    """(Bridge ConfigContainer, names of the namespace it read) for a validated Megatron-LM namespace, on GPUs of
    compute capability ``arch``."""
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.models.mamba.mamba_provider import MambaModelProvider
    from megatron.bridge.models.mla_provider import MLAModelProvider
    from megatron.bridge.training import config as bc
    from megatron.bridge.training.mlm_compat.arguments import _tokenizer_config_from_args

    used: set[str] = set(_RENAMED_BY_MCORE) | set(_RENAMED_BY_DDP) | set(_READ_HERE)
    if family == "hybrid":
        cls = MambaModelProvider
    elif args.multi_latent_attention:
        cls = MLAModelProvider
    else:
        cls = GPTModelProvider
    # megatron-core's own mapping, into the Bridge provider class (whose megatron-core checks wait for finalize(),
    # so a TE-only check cannot stop a plan on a host without TE). core_transformer_config_from_args swaps the
    # class for MLA/heterogeneous configs itself; the provider already is the MLA one, so it is shown a namespace
    # without the switch.
    shown = argparse.Namespace(**{**vars(args), "multi_latent_attention": False,
                                  "heterogeneous_layers_config_path": None})
    with _quiet():
        model = core_transformer_config_from_args(shown, config_class=cls)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        used |= names & set(vars(args))
        for name, value in (("share_embeddings_and_output_weights", not args.untie_embeddings_and_output_weights),
                            ("vocab_size", vocab), ("should_pad_vocab", False),
                            ("multi_latent_attention", bool(args.multi_latent_attention)),
                            ("rope_scaling", args.use_rope_scaling), ("use_te_rng_tracker", args.te_rng_tracker),
                            ("mtp_enabled", bool(args.mtp_num_layers))):
            if name in names:
                setattr(model, name, value)
        if family == "hybrid":
            model.hybrid_override_pattern = None
        with _fused_adam_as_on_gpu_nodes(args, arch):
            opt, _ = get_megatron_optimizer_config(args)
        optimizer = bc.OptimizerConfig(**{f.name: getattr(opt, f.name) for f in dataclasses.fields(opt) if f.init
                                          and f.name in {g.name for g in dataclasses.fields(bc.OptimizerConfig)}})
        used |= {f.name for f in dataclasses.fields(opt) if f.name in vars(args)}
        ddp_src = get_megatron_ddp_config(args)
        ddp_names = {g.name for g in dataclasses.fields(bc.DistributedDataParallelConfig) if g.init}
        ddp = bc.DistributedDataParallelConfig(**{f.name: getattr(ddp_src, f.name) for f in dataclasses.fields(ddp_src)
                                                  if f.init and f.name in ddp_names})
        used |= {f.name for f in dataclasses.fields(ddp_src) if f.name in vars(args)}
        train = _by_name(bc.TrainingConfig, args, used)
        dist = _by_name(bc.DistributedInitConfig, args, used)
        scheduler = _by_name(bc.SchedulerConfig, args, used)
        tokenizer = _tokenizer_config_from_args(args)
        used |= {f.name for f in dataclasses.fields(tokenizer) if f.name in vars(args)}
        dataset = bc.MockGPTDatasetConfig(seq_length=args.seq_length, random_seed=args.seed,
                                          reset_position_ids=args.reset_position_ids,
                                          reset_attention_mask=args.reset_attention_mask,
                                          eod_mask_loss=args.eod_mask_loss)
        cfg = bc.ConfigContainer(train=train, model=model, optimizer=optimizer, ddp=ddp, scheduler=scheduler,
                                 dataset=dataset, logger=bc.LoggerConfig(), tokenizer=tokenizer,
                                 checkpoint=bc.CheckpointConfig(), dist=dist, rng=bc.RNGConfig(seed=args.seed))
    return cfg, used


def _mapped(args: argparse.Namespace, family: str, vocab: int, arch: int = DEFAULT_ARCH) -> tuple[Any, set[str]]:
    """config_from_args, whatever megatron-core's config classes raise on a namespace validate_args passed (their
    own __post_init__ checks) as one MegatronArgsError (exit 1), files they read bounded (_bounded_reads)."""
    try:
        with _bounded_reads():
            return config_from_args(args, family, vocab, arch)
    except _Refusal as exc:
        raise exc.error from None
    except MegatronArgsError:
        raise
    except OSError as exc:
        raise MegatronArgsError(f"megatron-core cannot read a file the arguments name while it builds the job's "
                                f"config: {_exc_text(exc)}", "plan where the file is, or give its path here") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - megatron-core's config refuses the job
        if "FusedAdam from TransformerEngine" in str(exc) and arch < TE_MIN_ARCH and not te_installed():
            raise MegatronArgsError(
                f"the precision-aware optimizer needs Transformer Engine's FusedAdam (megatron-core "
                f"optimizer_config.py:446-467), and TE's support matrix starts at compute capability {TE_MIN_ARCH}.0: "
                f"the job's GPUs are {arch}.x", "give --gpu-arch if the GPUs are newer", rejected=True) from None
        raise MegatronArgsError(f"megatron-core's configuration refuses the job: {_exc_text(exc)}",
                                "fix the arguments as the message says", rejected=True) from None


def changed_config(job: MegatronJob, change: JobChange, vocab: int | None = None, arch: int = DEFAULT_ARCH) -> Any:
    """The job's configuration after a validated change, rebuilt from the arguments megatron-core validated
    (``change.args``) as load_job builds it: what the printed flags train, including what Megatron-LM needs beyond
    the change itself (``MEGATRON_LM_REQUIRES``: ``--use-precision-aware-optimizer`` with optimizer offload), so a
    plan of it is the plan of the words printed. Raises MegatronArgsError."""
    args = argparse.Namespace(**dict(change.args or {}))
    size, _ = tokenizer_vocab(args, vocab or job.vocab)
    cfg, _ = _mapped(args, job.family, padded_vocab(size, args), arch)
    return cfg


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_word(v) for v in value)
    return _word(value)


# ----------------------------------------------------------------------------- the whole job
def load_job(source: str | Sequence[str] | Mapping[str, Any] | JobWords, *, world_size: int | None = None,
             env: Mapping[str, str] | None = None, arch: int = DEFAULT_ARCH, vocab: int | None = None,
             script: str = "") -> MegatronJob:
    """The job of ``source`` (text in any of the three forms, an argv list, a parsed model_config.yaml mapping,
    or :class:`JobWords`) as a Bridge ConfigContainer with what was not planned.

    ``world_size`` wins over the launcher's and the dump's; without any the job is refused (Megatron-LM reads
    it from the launcher). ``env`` adds to the job's own environment (ENV_VARS, leading VAR=value words).
    ``arch``: the compute capability major validate_args is asked about (9: H100, 10: GB200). ``vocab``: the
    tokenizer's vocabulary when it cannot be read from the arguments.

    Raises MegatronArgsError, and nothing else: whatever an input makes fail on the way (megatron-core's parser,
    validate_args, its config classes, our reading and mapping) is one line (``rejected``: megatron-core refused a
    job it could read, exit 1; else a usage error, exit 2)."""
    try:
        return _load_job(source, world_size=world_size, env=env, arch=arch, vocab=vocab, script=script)
    except _Refusal as exc:
        raise exc.error from None
    except MegatronArgsError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - an input no check above foresaw: one line, not a traceback
        raise MegatronArgsError(f"the job's arguments cannot be read: {_exc_text(exc)}",
                                "check the arguments file (a command line, MODEL_ARGS YAML or a log's dump)") from None


def _load_job(source, *, world_size, env, arch, vocab, script) -> MegatronJob:
    words = source if isinstance(source, JobWords) else job_words(source)
    deepspeed = _deepspeed(words)
    if deepspeed:
        raise MegatronArgsError(
            f"a Megatron-DeepSpeed job ({deepspeed}): DeepSpeed's ZeRO partitions the optimizer state, gradients and "
            "weights its own way, and its fork's arguments are not megatron-core's; the plan reads Megatron-LM jobs "
            "only", "plan it with DeepSpeed's own estimators (deepspeed.runtime.zero.stage_1_and_2 / stage3 "
            "estimate_zero*_model_states_mem_needs), or give the Megatron-LM job it corresponds to "
            "(--use-distributed-optimizer shards the optimizer state as ZeRO-1 does)", rejected=True)
    job_env = job_environment({**words.env, **(env or {})})
    if world_size is not None:
        world, world_from = int(world_size), "given"
    elif words.launcher_world:
        world, world_from = words.launcher_world, words.launcher
    else:
        raise MegatronArgsError("the world size is not in the arguments (no launcher command, no dump)",
                                "give it: --world-size N (the number of GPUs of the job)", flag="--world-size")
    if world < 1:
        raise MegatronArgsError(f"world size {world} is not a positive number of GPUs", "give --world-size N",
                                flag="--world-size")
    from .stack import prepare
    prepare()
    parser = megatron_parser()
    notes = list(words.notes)
    argv = list(words.argv)
    unknown_names: list[str] = []
    dump = dict(words.dump)
    if words.form == FORM_DUMP:
        dump, translated = legacy_values(words.dump)
        argv, others, dump_notes = _dump_argv(dump, parser)
        notes += dump_notes
        unknown_names = others
    else:
        argv, translated = legacy_argv(argv, parser)
    argv, args, unknown, placeholder_notes, dropped_notes = _validated(argv, words.form, world, job_env, arch, parser)
    notes += dropped_notes
    notes += placeholder_notes
    if words.form == FORM_DUMP:     # names neither a flag nor set by validate_args: another version's argument
        # (one the dump prints unset, None or False, is not the job's setting)
        unknown = [n for n in unknown_names if n not in vars(args) and not _absent(dump.get(n))]
    family = model_family(args, script or words.script)
    size, how = tokenizer_vocab(args, vocab)
    padded = padded_vocab(size, args)
    cfg, used = _mapped(args, family, padded, arch)
    groups = group_of(parser)
    actions = actions_by_dest(parser)
    given = _given_dests(argv, parser)
    unsupported, ignored = [], []
    for dest in given:
        # validate_args deletes the deprecated aliases it has read into another argument (recompute_activations ->
        # recompute_granularity selective, ...); use_rotary_position_embeddings sets position_embedding_type
        # (arguments.py validate_args, "Legacy RoPE arguments")
        if dest in used or dest not in vars(args) or _ALIAS_OF.get(dest) in used:
            continue
        if groups.get(dest) in NEUTRAL_GROUPS:
            ignored.append(flag_of(actions[dest]))
        else:
            unsupported.append(FlagNote(flag_of(actions[dest]), _shown(getattr(args, dest, "")),
                                        f"recognised (group '{groups.get(dest)}') but not carried into the plan's "
                                        "configuration"))
    assumptions = [f"vocabulary {size} ({how}), padded to {padded} (make-vocab-size-divisible-by "
                   f"{args.make_vocab_size_divisible_by} x TP {args.tensor_model_parallel_size})",
                   f"GPUs of compute capability {arch}.x: validate_args is asked as on them, and the plan sizes "
                   "the cuBLAS and Transformer Engine workspaces for them"]
    workspace = job_env.get("CUBLAS_WORKSPACE_CONFIG")
    assumptions.append(f"CUBLAS_WORKSPACE_CONFIG={workspace} from the job's environment sizes torch's cuBLAS "
                       "workspaces" if workspace else "the job's environment does not set CUBLAS_WORKSPACE_CONFIG: "
                       "torch's default cuBLAS workspace size")
    te, installed = te_version()
    assumptions.append(f"validate_args asked as with Transformer Engine {te} where it checks TE's version"
                       + ("" if installed else " (TE is not installed here: the version Megatron Bridge 0.6.2 pins)"))
    if getattr(args, "use_precision_aware_optimizer", False) and not getattr(args, "optimizer_cpu_offload", False) \
            and not te_installed() and arch >= TE_MIN_ARCH:
        assumptions.append(TE_FUSED_ADAM_NOTE)
    required = env_requirements(argv)
    silent = [k for k in required if k not in job_env]
    if silent:
        assumptions.append("the job's environment does not set " + ", ".join(silent) + "; validated with "
                           + ", ".join(f"{k}={required[k]}" for k in silent) + " as Megatron-LM's launch "
                           "scripts set them")
    assumptions += notes
    return MegatronJob(
        config=cfg, world_size=world, world_from=world_from, form=words.form, argv=tuple(argv),
        env=MappingProxyType(dict(job_env)), family=family,
        unknown=_unknown_notes(unknown, words.form, dump), translated=tuple(translated),
        unsupported=tuple(unsupported), ignored=tuple(ignored),
        assumptions=tuple(assumptions), args=MappingProxyType(dict(vars(args))), vocab=int(vocab) if vocab else None)


# Flags validate_args reads into another argument and keeps (arguments.py validate_args, "Legacy RoPE arguments":
# use_rotary_position_embeddings sets position_embedding_type 'rope').
_ALIAS_OF = {"use_rotary_position_embeddings": "position_embedding_type"}
# The argparse groups a dump's values may be dropped from when megatron-core 0.19.2 refuses them (_load_job): those
# that cannot change memory during training, and inference's (read by the inference engine, not by training).
DUMP_NEUTRAL_GROUPS = NEUTRAL_GROUPS | {"inference"}
# Megatron-DeepSpeed's own arguments (megatron/arguments.py of microsoft/Megatron-DeepSpeed: deepspeed.add_config_
# arguments adds --deepspeed and --deepspeed_config; _add_zero_args --zero-stage), and its launcher.
_DEEPSPEED_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepspeed-config", "--zero-stage", "--deepspeed-activation-checkpointing")
_DEEPSPEED_NAMES = ("deepspeed", "deepspeed_config", "zero_stage")


def _deepspeed(words: JobWords) -> str:
    """What says the job is Megatron-DeepSpeed's ("--deepspeed, --zero-stage=2"), "" when nothing does."""
    seen = [w for w in words.argv if w.partition("=")[0] in _DEEPSPEED_FLAGS]
    if words.form == FORM_DUMP:
        seen += [f"{n} {words.dump[n]}" for n in _DEEPSPEED_NAMES if not _absent(words.dump.get(n))]
    if any(os.path.basename(w) == "deepspeed" for w in words.launcher_words[:4]):
        seen.insert(0, "the deepspeed launcher")
    return ", ".join(dict.fromkeys(seen[:4]))


MAX_DUMP_RETRIES = 8


def _short(text: str, limit: int = 240) -> str:
    from ..core.text import bounded
    return bounded(text, limit)

_NAMED_FLAG = re.compile(r"--[A-Za-z][\w-]{0,80}|\bargs\.([A-Za-z_]\w{0,80})")


def _validated(argv: list[str], form: str, world: int, env: Mapping[str, str], arch: int,
               parser: argparse.ArgumentParser) -> tuple[list[str], argparse.Namespace, list[str], list[str], list[str]]:
    """parse_and_validate, and for a dump (which prints every argument with its own release's default) the
    arguments megatron-core 0.19.2 refuses that cannot change training memory (DUMP_NEUTRAL_GROUPS: an inference or
    learning-rate default of another release, e.g. 23.04's inference_batch_times_seqlen_threshold 512, which
    0.19.2's validate_args says "requires --pipeline-model-parallel-size > 1", or 2020's float --warmup) left at
    0.19.2's defaults, one refusal at a time, each said; any other refusal stands. Returns (argv as validated, the
    namespace, unknown words, notes of placeholders, notes of what was left at its default)."""
    groups = group_of(parser)
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    first: MegatronArgsError | None = None
    dropped: list[str] = []
    for _ in range(MAX_DUMP_RETRIES + 1):
        try:
            args, unknown, placeholder_notes = parse_and_validate(argv, world, env, arch, parser)
            break
        except MegatronArgsError as exc:
            first = first or exc
            if form != FORM_DUMP:
                raise
            segments = argv_segments(argv, parser)
            given = {dest: seg for dest, seg in segments if dest is not None}
            named = [by_option.get(m.group(0)) if m.group(0).startswith("--") else m.group(1)
                     for m in _NAMED_FLAG.finditer(exc.message)]
            dest = next((d for d in named if d in given and groups.get(d) in DUMP_NEUTRAL_GROUPS), None)
            if dest is None:
                raise first from None
            dropped.append(f"{given[dest][0].partition('=')[0]} {_value_words(given[dest])}".strip())
            argv = [w for d, seg in segments if d != dest for w in seg]
    else:
        raise first from None
    notes = [f"the dump's {'; '.join(dropped)}: left at megatron-core 0.19.2's default (an argument that cannot change "
             f"training memory, printed with its own release's value, which 0.19.2 refuses: {_short(first.message)})"] \
        if dropped and first is not None else []
    return argv, args, unknown, placeholder_notes, notes


def _given_dests(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """The dests of the flags the words name, in order (``--flag value`` and ``--flag=value``)."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    out: list[str] = []
    for w in argv:
        if w.startswith("-"):
            dest = by_option.get(w.split("=", 1)[0])
            if dest and dest not in out:
                out.append(dest)
    return out


def _unknown_notes(unknown: Sequence[str], form: str, dump: Mapping[str, str] | None = None) -> tuple[FlagNote, ...]:
    """Words the parser left, as flags with the words after them (``--foo 3``); a stray word is its own note. A
    dump's unknown name keeps its printed value (``None`` when the job did not set it)."""
    why = ("in the dump but not an argument of megatron-core 0.19.2 (another version's)" if form == FORM_DUMP
           else "not a flag of megatron-core 0.19.2's Megatron-LM parser")
    notes: list[list[str]] = []
    for w in unknown:
        if form == FORM_DUMP or w.startswith("-") or not notes:
            notes.append([w])
        else:
            notes[-1].append(w)
    from ..core.text import bounded
    if form == FORM_DUMP:
        return tuple(FlagNote(bounded(n[0], 200), bounded(str((dump or {}).get(n[0], "")), 200), why) for n in notes)
    return tuple(FlagNote(bounded(n[0], 200), bounded(" ".join(n[1:]), 200), why) for n in notes)


# ----------------------------------------------------------------------------- overlays as Megatron-LM flags
# Config fields whose Megatron-LM argument has another name (the inverse of core_transformer_config_from_args,
# get_megatron_ddp_config and this module's provider fields); every other field is looked up as a parser dest of
# the same name.
_FIELD_TO_DEST = {
    "model.num_moe_experts": "num_experts", "model.fp8_param": "fp8_param_gather",
    "model.num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "model.num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "model.use_te_rng_tracker": "te_rng_tracker", "model.rope_scaling": "use_rope_scaling",
    "ddp.grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",
    "ddp.check_for_nan_in_grad": "check_for_nan_in_loss_and_grad", "ddp.num_buckets": "ddp_num_buckets",
    "ddp.bucket_size": "ddp_bucket_size", "ddp.average_in_collective": "ddp_average_in_collective",
    # validate_args derives virtual_pipeline_model_parallel_size from this flag (arguments.py: "no CLI argument exists"
    # for the field itself, _add_network_size_args)
    "model.virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
}


@dataclass(frozen=True)
class OverlayFlags:
    """What to add to a Megatron-LM job for a set of overlays: flags (words), environment variables, flags the
    job has and must drop, and the config fields Megatron-LM has no flag for."""
    words: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    remove: tuple[str, ...] = ()
    no_flag: tuple[tuple[str, str], ...] = ()     # (field, value)

    def as_dict(self) -> dict[str, Any]:
        return {"add": list(self.words), "env": dict(self.env), "remove": list(self.remove),
                "no_flag": [{"field": f, "value": v} for f, v in self.no_flag]}

    def command_text(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return " ".join(x for x in (env, " ".join(shlex.quote(w) for w in self.words)) if x)


def dest_for_field(path: str, parser: argparse.ArgumentParser | None = None) -> str | None:
    """The parser dest that sets a Bridge config field (``model.recompute_granularity`` -> recompute_granularity),
    None when Megatron-LM has no flag for it."""
    actions = actions_by_dest(parser or megatron_parser())
    dest = _FIELD_TO_DEST.get(path, path.rsplit(".", 1)[-1])
    return dest if dest in actions else None


# What Megatron-LM's validate_args requires of a job beyond what Bridge checks, as (dest, value) -> the flags it then
# needs: Bridge asserts the checkpoint format only when the job saves or loads, Megatron-LM always ("Megatron-FSDP
# requires the `fsdp_dtensor` checkpointing format.", arguments.py validate_args); Megatron-LM's hybrid CPU optimizer
# reuses the precision-aware optimizer's path ("The optimizer cpu offload must be used in conjunction with
# `--use-precision-aware-optimizer`", arguments.py validate_args), which Bridge's optimizer config does not ask.
MEGATRON_LM_REQUIRES: tuple[tuple[tuple[str, Any], tuple[tuple[str, Any], ...]], ...] = (
    (("use_megatron_fsdp", True), (("ckpt_format", "fsdp_dtensor"),)),
    (("optimizer_cpu_offload", True), (("use_precision_aware_optimizer", True),)),
    # megatron-core optimizer_config.py:433-436: "--use-precision-aware-optimizer only supported with distributed
    # optimizer" (after the entry above, so optimizer offload brings both)
    (("use_precision_aware_optimizer", True), (("use_distributed_optimizer", True),)),
)


def overlay_flags(changes: Sequence[tuple[str, Any]], job_args: Mapping[str, Any]) -> OverlayFlags:
    """The Megatron-LM flags that make the same changes as an overlay's (``[(field or $VAR, new value)]``, from
    the engine's report) on a job whose validated arguments are ``job_args``. A value the job already has adds
    nothing; a switch the change turns off that the job turned on is listed to remove. Each parser argument is
    written once (two config fields of one flag, ddp. and optimizer.use_distributed_optimizer, are one flag; the
    last change wins), a config ``env_vars`` entry is an environment variable, a dtype is written as the parser's
    choice (bf16, not torch.bfloat16), and what Megatron-LM's validate_args requires beyond Bridge
    (MEGATRON_LM_REQUIRES) is added. tests/test_hostile_round5.py parses and validates every overlay's set."""
    parser = megatron_parser()
    actions = actions_by_dest(parser)
    by_dest: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    env: dict[str, str] = {}
    remove: list[str] = []
    no_flag: list[tuple[str, str]] = []

    def add(target: str, dest: str, value: Any) -> None:
        action = actions[dest]
        current = job_args.get(dest)
        values[dest] = value
        by_dest.pop(dest, None)
        if _same(current, value, action):
            return
        flag = flag_words(action, value)
        if flag is None or (flag == [] and action.nargs == 0):
            if action.nargs == 0 and current == action.const:
                if flag_of(action) not in remove:
                    remove.append(flag_of(action))
            else:
                no_flag.append((target, _shown(value)))
            return
        by_dest[dest] = flag

    for target, value in changes:
        if target.startswith("$") or target.startswith("env_vars."):
            name = target[1:] if target.startswith("$") else target.split(".", 1)[1]
            env[name] = value if isinstance(value, str) else _env_text(value)
            continue
        dest = dest_for_field(target, parser)
        if dest is None:
            no_flag.append((target, _shown(value)))
            continue
        add(target, dest, value)
    for (dest, value), needs in MEGATRON_LM_REQUIRES:
        if _same(values.get(dest, job_args.get(dest)), value):
            for need, wanted in needs:
                if need in actions and not _same(values.get(need, job_args.get(need)), wanted, actions[need]):
                    add(need, need, wanted)
    words = [w for flag in by_dest.values() for w in flag]
    return OverlayFlags(tuple(words), MappingProxyType(env), tuple(remove), tuple(no_flag))


def _same(current: Any, value: Any, action: argparse.Action | None = None) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(current, (list, tuple)):
        return [_word(v) for v in current] == [_word(v) for v in value]
    if action is not None and action.choices and current is not None and value is not None:
        return _choice_word(action, current) == _choice_word(action, value)
    return current == value or (current is not None and _word(current) == _word(value) and not isinstance(value, bool))


def _env_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


# ----------------------------------------------------------------------------- a change, as the job's own flags
# Flags validate_args refuses beside another one, or lets win over it: when a change gives the first, the job's
# words for the others go (arguments.py validate_args: "--recompute-activations" rewrites recompute_granularity to
# 'selective'; only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank).
_REPLACES = {"recompute_granularity": ("recompute_activations",),
             "num_virtual_stages_per_pipeline_rank": ("num_layers_per_virtual_pipeline_stage",),
             "num_layers_per_virtual_pipeline_stage": ("num_virtual_stages_per_pipeline_rank",)}


@dataclass(frozen=True)
class JobChange:
    """The job's arguments after a change, as Megatron-LM words: the flags to add, to change and to remove and the
    environment to export, with the whole argv they give, parsed and validated by megatron-core's own parser and
    ``validate_args`` (:func:`change_job`). ``ok`` is False, with ``reason``, when megatron-core refuses the words,
    when they do not make the change (validate_args sets the value back) or when a field has no Megatron-LM flag."""
    add: tuple[str, ...] = ()                       # words appended: each flag with its values
    change: tuple[tuple[str, str, str], ...] = ()   # (flag, old value words, new value words)
    remove: tuple[str, ...] = ()                    # flags the job has and drops
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    argv: tuple[str, ...] = ()                      # the job's whole argv after the change
    ok: bool = True
    reason: str = ""
    check: str = ""                                 # how the words were checked
    derived: tuple[str, ...] = ()                   # fields without a flag that Megatron-LM derives from the flags
    args: Mapping[str, Any] | None = None           # the validated namespace (None when refused)

    @property
    def empty(self) -> bool:
        return not (self.add or self.change or self.remove or self.env)

    def words(self) -> list[str]:
        """The flags to give (added and changed), in order: appended to the job's command they win, as argparse
        keeps the last value of a flag."""
        out = list(self.add)
        for flag, _, new in self.change:
            out += [flag, *shlex.split(new)] if new else [flag]
        return out

    def text(self) -> str:
        """The change in the job's own terms: ``export VAR=value; add --flag v; change --flag a -> b; remove
        --flag``."""
        parts = []
        if self.env:
            parts.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items()))
        if self.add:
            parts.append("add " + " ".join(shlex.quote(w) for w in self.add))
        if self.change:
            parts.append("change " + ", ".join(f"{flag} {old or '(set)'} -> {new or '(set)'}"
                                                for flag, old, new in self.change))
        if self.remove:
            parts.append("remove " + " ".join(self.remove))
        return "; ".join(parts) or "no change to the job's arguments"

    def command(self, prefix: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        """The whole command: the environment (the job's leading assignments with this change's merged in), the
        launcher words up to the script (``prefix``), then the changed argv; every word quoted."""
        merged = {**(env or {}), **self.env}
        words = [w for w in prefix if not (_ENV_WORD.match(w) and _ENV_WORD.match(w).group(1) in merged)]
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in merged.items()), *(shlex.quote(w) for w in words),
                         *(shlex.quote(w) for w in self.argv)])

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text(), "add": list(self.add),
                "change": [{"flag": f, "old": o, "new": n} for f, o, n in self.change], "remove": list(self.remove),
                "env": dict(self.env), "ok": self.ok, "reason": self.reason, "check": self.check,
                "derived": list(self.derived), "argv": list(self.argv)}


def argv_segments(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[tuple[str | None, list[str]]]:
    """The words as argparse groups them: (dest, [flag, values...]) per option, (None, [word]) for a word that is
    no option of the parser. The values a flag takes follow its ``nargs`` (``--flag=value`` is one word)."""
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    out: list[tuple[str | None, list[str]]] = []
    words = list(argv)
    k = 0
    while k < len(words):
        w = words[k]
        action = by_option.get(w.split("=", 1)[0]) if w.startswith("-") else None
        if action is None:
            out.append((None, [w]))
            k += 1
            continue
        take = 0
        if "=" not in w:
            rest = words[k + 1:]
            if action.nargs is None:
                take = 1 if rest else 0
            elif isinstance(action.nargs, int):
                take = action.nargs
            elif action.nargs == "?":
                take = 1 if rest and not rest[0].startswith("--") else 0
            elif action.nargs in ("*", "+"):
                while take < len(rest) and not (rest[take].startswith("--") or rest[take].split("=", 1)[0]
                                                 in by_option):
                    take += 1
        out.append((action.dest, words[k:k + 1 + take]))
        k += 1 + take
    return out


def _value_words(segment: list[str]) -> str:
    first = segment[0]
    values = [first.split("=", 1)[1]] if "=" in first else []
    return " ".join(shlex.quote(v) for v in values + segment[1:])


def edit_argv(argv: Sequence[str], words: Sequence[str], remove: Sequence[str],
              parser: argparse.ArgumentParser | None = None) -> tuple[list[str], list[str], list[tuple[str, str, str]],
                                                                      list[str]]:
    """(new argv, words added, (flag, old, new) changed, flags removed): ``words`` (flags with their values) set
    in ``argv`` where the job gives the same argument, appended where it does not; the flags in ``remove`` and
    the ones a new flag replaces (:data:`_REPLACES`) dropped."""
    parser = parser or megatron_parser()
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    segments = argv_segments(argv, parser)
    added: list[str] = []
    changed: list[tuple[str, str, str]] = []
    removed: list[str] = []

    def drop(dest: str) -> None:
        for i in reversed(range(len(segments))):
            if segments[i][0] == dest:
                removed.append(segments[i][1][0].split("=", 1)[0])
                del segments[i]

    for dest, seg in argv_segments(words, parser):
        if dest is None:
            continue
        for other in _REPLACES.get(dest, ()):
            drop(other)
        at = [i for i, (d, _) in enumerate(segments) if d == dest]
        if not at:
            segments.append((dest, list(seg)))
            added += seg
            continue
        old = segments[at[0]][1]
        flag = seg[0].split("=", 1)[0]
        changed.append((flag if old[0].split("=", 1)[0] == flag else f"{old[0].split('=', 1)[0]} -> {flag}",
                        _value_words(old), _value_words(seg)))
        segments[at[0]] = (dest, list(seg))
        for i in reversed(at[1:]):
            del segments[i]
    for flag in remove:
        action = by_option.get(flag)
        if action is not None:
            drop(action.dest)
    return [w for _, seg in segments for w in seg], added, changed, list(dict.fromkeys(removed))


def change_job(job: MegatronJob, changes: Sequence[tuple[str, Any]], *, arch: int = DEFAULT_ARCH,
               vocab: int | None = None) -> JobChange:
    """The job with ``changes`` (``[(config field or $VAR, new value)]``, what the engine changed on
    ``job.config``), as Megatron-LM flags and environment, parsed and validated by megatron-core 0.19.2's parser
    and ``validate_args`` at the job's world size.

    The words come from :func:`overlay_flags`. A change is kept only when the validated arguments hold it: a flag
    validate_args sets back, or a field without a flag that Megatron-LM does not derive from the others
    (checked on the configuration rebuilt from the validated arguments, :func:`config_from_args`), makes the
    change refused with the field named ("no Megatron-LM flag for model.x=..."). A field set to None whose flag
    the job gives drops that flag."""
    from ..core.paths import MISSING, read
    parser = megatron_parser()
    actions = actions_by_dest(parser)
    fields = {t: v for t, v in changes if not t.startswith("$")}
    flags = overlay_flags(list(changes), job.args)
    env = {k: v for k, v in flags.env.items() if job.env.get(k) != v}
    given = {d for d, _ in argv_segments(job.argv, parser)}
    remove = list(flags.remove)
    unset: list[tuple[str, Any]] = []
    for target, _ in flags.no_flag:
        value = fields.get(target)
        dest = dest_for_field(target, parser)
        if dest is not None and value is None:
            if dest in given:
                remove.append(flag_of(actions[dest]))
            continue
        unset.append((target, value))
    argv, added, changed, removed = edit_argv(job.argv, flags.words, remove, parser)
    base = {"add": tuple(added), "change": tuple(changed), "remove": tuple(removed), "env": MappingProxyType(env),
            "argv": tuple(argv)}
    world = job.world_size
    try:
        args, _, _ = parse_and_validate(argv, world, {**job.env, **env}, arch, parser)
    except MegatronArgsError as exc:
        return JobChange(**base, ok=False, reason=f"megatron-core refuses the flags: {exc.message}",
                         check=f"refused by megatron-core 0.19.2's parse_args + validate_args at world size {world}")
    kept = overlay_flags([(t, v) for t, v in fields.items() if dest_for_field(t, parser)], vars(args))
    lost = list(kept.words) + list(kept.remove)
    check = (f"parsed and validated by megatron-core 0.19.2's parse_args + validate_args at world size {world} "
             f"(compute capability {arch}), on the job's {job.form} with this change")
    if lost:
        return JobChange(**base, ok=False, check=check, args=MappingProxyType(vars(args)),
                         reason="megatron-core's validate_args does not keep " + " ".join(lost))
    derived: list[str] = []
    missing: list[str] = []
    if unset:
        size, _ = tokenizer_vocab(args, vocab or job.vocab)
        rebuilt, _ = config_from_args(args, job.family, padded_vocab(size, args), arch)
        for target, value in unset:
            current = read(rebuilt, target, MISSING)
            if current is not MISSING and _same(current, value):
                derived.append(f"{target}={_shown(value)}")
            else:
                missing.append(f"{target}={_shown(value)}")
    if missing:
        return JobChange(**base, ok=False, check=check, args=MappingProxyType(vars(args)),
                         derived=tuple(derived), reason="no Megatron-LM flag for " + ", ".join(missing))
    if derived:
        check += "; Megatron-LM derives " + ", ".join(derived) + " from these flags"
    if args.use_precision_aware_optimizer and not args.optimizer_cpu_offload and not te_installed() \
            and arch >= TE_MIN_ARCH:
        check += "; " + TE_FUSED_ADAM_NOTE
    return JobChange(**base, ok=True, check=check, derived=tuple(derived), args=MappingProxyType(vars(args)))

"""Shared fixtures. Behaviour tests build real Bridge recipes offline and use Bridge's own
validation (runtime_config_update) as the oracle; nothing here mocks a ConfigContainer."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def bridge():
    """The Bridge adapter's functions the tests use, with the stack prepared once (imports Bridge)."""
    from types import SimpleNamespace

    from mbmem_overlays.bridge import hf_offline, overrides, recipes, stack, validation
    stack.prepare()
    return SimpleNamespace(build_recipe=recipes.build_recipe, load_recipe=recipes.load_recipe,
                           apply_overrides=overrides.apply_overrides, validate_config=validation.validate_config,
                           prepare=stack.prepare, hf_offline=hf_offline)


@pytest.fixture
def recipe(bridge):
    """recipe("llama3_8b_pretrain_config", "model.tensor_model_parallel_size=2", ...) -> fresh ConfigContainer."""
    def build(name, *overrides):
        cfg = bridge.build_recipe(name)
        if overrides:
            bridge.apply_overrides(cfg, list(overrides))
        return cfg
    return build


@pytest.fixture
def clean_env(monkeypatch):
    """An environment dict without allocator/NCCL settings from the machine running the tests."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTORCH_", "NCCL_", "WORLD_SIZE"))}
    return env


def run_cmd(args, timeout=300, env=None, cwd=ROOT):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def train_process(*args, timeout=300, env=None):
    """``python train.py ...`` in a new process: for tests about the process itself (exit before the Bridge
    import, the environment it exports, the console entry)."""
    return run_cmd([sys.executable, "train.py", *args], timeout=timeout, env=env)


def mbmem_process(*args, timeout=300, env=None):
    """``python -m mbmem_overlays.cli ...`` in a new process (see train_process)."""
    return run_cmd([sys.executable, "-m", "mbmem_overlays.cli", *args], timeout=timeout, env=env)


class InProcessTimeout(subprocess.TimeoutExpired):
    """An in-process call ran past its ``timeout`` (raised like subprocess.run's, so tests read the same)."""


@dataclass
class Completed:
    """What subprocess.run(capture_output=True, text=True) returns, for an in-process call."""
    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class _Stream(io.TextIOWrapper):
    """A text stream with a ``.buffer``, like sys.stdout/stdin of a real process (UTF-8, as here), that never
    closes: a library that kept a reference to the call's stdout or stderr (a logging handler, a console made
    at import) may still write after the call, and must find a stream, not a closed file."""

    def close(self) -> None:
        self.flush()

    def __del__(self) -> None:
        pass


_STREAMS: list[_Stream] = []  # kept alive for the same reason (a TextIOWrapper closes itself when collected)


def _stream(data: bytes = b"") -> _Stream:
    stream = _Stream(io.BytesIO(data), encoding="utf-8", write_through=True)
    _STREAMS.append(stream)
    return stream


def in_process(entry, argv: list[str], *, timeout=300, env=None, cwd=ROOT, input: str | bytes | None = None,
               argv0: str = "mbmem") -> Completed:
    """Run ``entry(argv) -> exit code`` in this process as a fresh process would see it: its own argv, cwd,
    stdin/stdout/stderr and environment (``{**os.environ, **env}``), all restored afterwards. SystemExit is the
    exit code; an uncaught exception is a traceback on stderr and exit 1, as in a real process. The Bridge
    import is paid once per test session instead of once per call (issue 21)."""
    import logging

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    saved = (dict(os.environ), os.getcwd(), sys.argv, sys.stdin, sys.stdout, sys.stderr)
    # Hydra's process-wide singletons: a run that ends early (--cfg job, --help, a refusal) leaves HydraConfig set,
    # and a later test's compose() + run() would then read that run's (missing) output folder
    hydra_cfg, hydra_was_global = HydraConfig.instance().cfg, GlobalHydra.instance().is_initialized()
    # Hydra (train.py) configures logging with dictConfig, which flushes and *closes* every handler that exists
    # (logging.config._clearExistingHandlers), pytest's capture handlers included, and leaves the root logger
    # writing to this call's stdout. So the handlers that exist now are hidden from that sweep, and the root
    # logger is put back afterwards.
    root_logging = (logging.root.handlers[:], logging.root.level)
    handler_refs, named_handlers = logging._handlerList[:], dict(logging._handlers)
    logging._handlerList[:] = []
    data = input.encode() if isinstance(input, str) else (input or b"")
    out, err = _stream(), _stream()
    code = 0
    previous_handler = None
    if timeout and threading.current_thread() is threading.main_thread():
        def expire(signum, frame):
            raise InProcessTimeout([argv0, *argv], timeout)
        previous_handler = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        sys.argv = [argv0, *argv]
        sys.stdin, sys.stdout, sys.stderr = _stream(data), out, err
        try:
            code = entry(list(argv))
        except SystemExit as exc:
            code = exc.code
        except InProcessTimeout:
            raise
        except BaseException:  # noqa: BLE001  what a process would print before dying
            traceback.print_exc(file=err)
            code = 1
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=err)
            code = 1
    finally:
        if previous_handler is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_handler)
        env_before, cwd_before, sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
        logging.root.handlers[:] = root_logging[0]
        logging.root.setLevel(root_logging[1])
        logging._handlerList[:] = handler_refs + logging._handlerList
        logging._handlers.update(named_handlers)
        HydraConfig.instance().cfg = hydra_cfg
        if not hydra_was_global and GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        os.chdir(cwd_before)
        if dict(os.environ) != env_before:
            os.environ.clear()
            os.environ.update(env_before)
    return Completed([argv0, *argv], code, _drain(out), _drain(err))


def _drain(stream: _Stream) -> str:
    """What was written to ``stream``; its buffer is emptied, since the stream itself stays alive."""
    stream.flush()
    text = stream.buffer.getvalue().decode("utf-8", "replace")
    stream.buffer.seek(0)
    stream.buffer.truncate()
    return text


def _mbmem_main(argv: list[str]) -> int:
    from mbmem_overlays.cli import main
    return main(argv)


def _train_main(argv: list[str]) -> int:
    """``python train.py ARGV``: train.py itself runs as ``__main__`` (its startup, Hydra's main, finish), in this
    process, after clearing what a previous run left in Hydra's and train.py's module state."""
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    from mbmem_overlays.launch import hydra_entry
    hydra_entry.JOBS.clear()
    GlobalHydra.instance().clear()
    sys.argv = ["train.py", *argv]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    finally:
        GlobalHydra.instance().clear()
    return 0  # train.py always leaves through sys.exit(finish()); reaching here means it returned normally


def script(path, *args, timeout=300, env=None, input=None, cwd=ROOT):
    """``python PATH ARGS`` (an example or bench script run as ``__main__``), in this process (see ``in_process``)."""
    import runpy

    def run(argv):
        runpy.run_path(str(path), run_name="__main__")
        return 0
    return in_process(run, list(args), timeout=timeout, env=env, input=input, cwd=cwd, argv0=str(path))


def train(*args, timeout=300, env=None, input=None, cwd=ROOT):
    """train.py's behaviour, in this process (see ``in_process``): returncode, stdout and stderr."""
    return in_process(_train_main, list(args), timeout=timeout, env=env, input=input, cwd=cwd, argv0="train.py")


def mbmem(*args, timeout=300, env=None, input=None, cwd=ROOT):
    """mbmem's behaviour, in this process (see ``in_process``): returncode, stdout and stderr."""
    return in_process(_mbmem_main, list(args), timeout=timeout, env=env, input=input, cwd=cwd)


# Shell functions that stand in for the programs a printed command runs: they record what the shell would start
# (folder, argv, environment) instead of starting it, so a pasted command is parsed, quoted and expanded by a
# real shell and then run in this process (issue 21: one Bridge import per session, not one per paste).
_PASTE_SHIM = r"""
_mbmem_record() { { printf '%s\0' "$PWD" "$#" "$@"; env -0; printf '\0'; } >> "$MBMEM_PASTE_RECORD"; }
python() { _mbmem_record python "$@"; }
python3() { _mbmem_record python "$@"; }
mbmem() { _mbmem_record mbmem "$@"; }
"""


def shell_invocations(command: str, *, env=None, cwd=ROOT, timeout=60) -> list[tuple[str, list[str], dict]]:
    """What a real shell would start for ``command``: [(folder, argv, environment)] for each ``python``/``mbmem``
    it runs (anything else in the command, e.g. an injected ``touch``, really runs)."""
    import tempfile
    with tempfile.NamedTemporaryFile(prefix="paste-", delete=False) as f:
        record = f.name
    try:
        shell_env = {**os.environ, **(env or {}), "MBMEM_PASTE_RECORD": record}
        subprocess.run(["bash", "-c", _PASTE_SHIM + command], cwd=cwd, env=shell_env, timeout=timeout,
                       capture_output=True, check=False)
        fields = Path(record).read_bytes().decode("utf-8", "surrogateescape").split("\0")
    finally:
        os.unlink(record)
    calls, i = [], 0
    while i + 1 < len(fields) and fields[i]:
        folder, count = fields[i], int(fields[i + 1])
        argv = fields[i + 2:i + 2 + count]
        i += 2 + count
        environment = {}
        while i < len(fields) and fields[i]:
            key, _, value = fields[i].partition("=")
            environment[key] = value
            i += 1
        i += 1
        environment.pop("MBMEM_PASTE_RECORD", None)
        calls.append((folder, argv, environment))
    return calls


def paste(command: str, *, env=None, cwd=ROOT, timeout=300) -> Completed:
    """``command`` as a user pastes it into bash: the shell parses it (quotes, variables, ``&&``), and each
    ``python train.py ...`` / ``mbmem ...`` / ``python -m mbmem_overlays.cli ...`` it starts runs in this process
    with the folder and environment the shell gave it. Returns the last one's result (exit 127 if it started
    none of them)."""
    result = Completed([command], 127, "", "paste: the command started no python train.py or mbmem")
    for folder, argv, environment in shell_invocations(command, env=env, cwd=cwd):
        shell_own = ("PWD", "OLDPWD", "SHLVL", "_")  # what bash itself sets: not the command's environment
        extra = {k: v for k, v in environment.items() if os.environ.get(k) != v and k not in shell_own}
        removed = [k for k in os.environ if k not in environment and k not in shell_own]
        if argv[:2] == ["python", "train.py"] or (argv[0] == "python" and argv[1:2]
                                                   and Path(folder, argv[1]).resolve() == ROOT / "train.py"):
            entry, args, name = _train_main, argv[2:], "train.py"
        elif argv[0] == "mbmem":
            entry, args, name = _mbmem_main, argv[1:], "mbmem"
        elif argv[:3] == ["python", "-m", "mbmem_overlays.cli"]:
            entry, args, name = _mbmem_main, argv[3:], "mbmem"
        else:
            return Completed(argv, 127, "", f"paste: not a command this helper runs: {argv}")
        saved = {k: os.environ.pop(k) for k in removed}
        try:
            result = in_process(entry, args, timeout=timeout, env=extra, cwd=folder, argv0=name)
        finally:
            os.environ.update(saved)
        if result.returncode != 0:
            break
    return result


@contextlib.contextmanager
def imports_of(*packages: str):
    """Every import of ``packages`` (and their submodules) attempted inside the block, as a list of module names.
    They are taken out of ``sys.modules`` for the block, so an import an earlier test already made is seen again,
    and put back afterwards as they were."""
    import importlib.abc

    def ours(name: str) -> bool:
        return name.split(".", 1)[0] in packages

    saved = {name: sys.modules.pop(name) for name in [n for n in sys.modules if ours(n)]}
    seen: list[str] = []

    class Watch(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if ours(fullname):
                seen.append(fullname)
            return None

    watch = Watch()
    sys.meta_path.insert(0, watch)
    try:
        yield seen
    finally:
        sys.meta_path.remove(watch)
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def snapshot(cfg) -> str:
    """A byte-comparable rendering of a whole ConfigContainer (Bridge's own to_dict)."""
    import json
    return json.dumps(cfg.to_dict(), sort_keys=True, default=repr)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real one-node Slurm (tests/slurm_cluster.py), started once for every test that submits a job (its
    start is the slow part) and stopped at the end of the session. Fails in CI when it cannot start, skips
    elsewhere."""
    from slurm_cluster import Cluster, available
    reason = available()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm integration test cannot run in CI: {reason}")
        pytest.skip(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()

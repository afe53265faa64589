"""Shared fixtures. Behaviour tests build real Bridge recipes offline and use Bridge's own
validation (runtime_config_update) as the oracle; nothing here mocks a ConfigContainer."""

from __future__ import annotations

import os
import subprocess
import sys
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


def train(*args, timeout=300, env=None):
    """train.py's behaviour: returns an object with returncode, stdout and stderr."""
    return train_process(*args, timeout=timeout, env=env)


def mbmem(*args, timeout=300, env=None):
    """mbmem's behaviour: returns an object with returncode, stdout and stderr."""
    return mbmem_process(*args, timeout=timeout, env=env)


def snapshot(cfg) -> str:
    """A byte-comparable rendering of a whole ConfigContainer (Bridge's own to_dict)."""
    import json
    return json.dumps(cfg.to_dict(), sort_keys=True, default=repr)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real one-node Slurm (tests/slurm_cluster.py) for the module's tests; stopped when the module ends, so
    the next module's cluster can take the same ports. Fails in CI when it cannot start, skips elsewhere."""
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

"""scripts/gpu_check and scripts/gpu_wheels on a CPU host: the dry run CI runs (the wheel set complete for the
device, the size of what travels, every step's command line), and the device run's own machinery (steps stopped
at their budget without costing the others their outputs, packing into what comes back, unpacking into
tests/data/gpu_runs/) exercised with stand-in steps. docs/gpu-check.md."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check"


def load_script():
    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up while the file runs
    loader.exec_module(module)
    return module


gc = load_script()


def test_dry_run_passes_and_names_the_device_call():
    """What CI runs: downloads the wheels on a clean clone (PyPI is reachable there), offline when they are present."""
    start = time.monotonic()
    res = subprocess.run([str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    out = res.stdout
    for check in ("lock", "wheels", "size", "resolver", "requirements", "compile", "step bench", "step smoke",
                  "step snapshot", "step oom", "overlays", "device call", "install", "imports", "job snapshot",
                  "job oom", "torchrun snapshot", "bench cases"):
        assert f"ok   {check} " in out, (check, out[-4000:])
    assert "dry run: passed" in out
    assert f"carry={gc.CARRY}" in out and f"timeout_s={gc.DEVICE_TIMEOUT_S}" in out
    print(f"dry run: {time.monotonic() - start:.1f} s")


def test_lock_notes_and_provided(tmp_path):
    lock = gc.parse_lock("a-b==1.0  # sdist-only: why\nc==2  # metadata-ignored: why\nd==3  # unneeded: e f (why)\n"
                         "# provided: torch==2.11.0 numpy\n# a comment\n")
    pins = {p.name: p for p in lock.pins}
    assert pins["a-b"].sdist_only and pins["c"].metadata_ignored and pins["d"].unneeded == {"e", "f"}
    assert lock.provided == {"torch": "2.11.0", "numpy": None}
    with pytest.raises(SystemExit, match="pinned twice"):
        gc.parse_lock("x==1\nX==2\n")
    with pytest.raises(SystemExit, match="provided by the device"):
        gc.parse_lock("torch==2.11.0\n# provided: torch==2.11.0\n")
    with pytest.raises(SystemExit, match="not NAME==VERSION"):
        gc.parse_lock("torch>=2\n")


def test_the_lock_carries_what_the_device_lacks():
    lock = gc.parse_lock(gc.LOCK.read_text())
    names = {p.key for p in lock.pins}
    assert {"megatron-bridge", "megatron-core", "omegaconf", "hydra-core", "antlr4-python3-runtime",
            "humanfriendly", "nvidia-resiliency-ext"} <= names
    assert {"torch", "transformers", "pytest", "jinja2", "numpy"} <= set(lock.provided)
    stack = {gc.norm(x.split("==")[0]): x.split("==")[1] for x in (ROOT / "requirements" / "stack.lock").read_text()
             .splitlines() if "==" in x and not x.startswith("#")}
    assert {p.key: p.version for p in lock.pins if p.key in stack} == {k: stack[k] for k in names & set(stack)}


@pytest.mark.parametrize("name, why", [
    ("x-1.0-py3-none-any.whl", None),
    ("x-1.0-cp312-cp312-manylinux_2_39_x86_64.whl", None),
    ("x-1.0-cp310-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", None),
    ("x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "python tag"),
    ("x-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", "python tag"),
    ("x-1.0-cp312-cp312-manylinux_2_40_x86_64.whl", "platform tag"),
    ("x-1.0-cp312-cp312-manylinux_2_17_aarch64.whl", "platform tag"),
    ("x-1.0-cp312-cp312-macosx_11_0_arm64.whl", "platform tag"),
    ("x-1.0.tar.gz", "not a wheel"),
])
def test_wheels_the_device_can_install(name, why):
    got = gc.wheel_fits_device(name)
    assert (got is None) if why is None else (why in got)


def test_step_budgets_fit_the_deadline_and_the_device_call():
    steps = gc.steps("python3", Path("/tmp/w"))
    bridge = max(s.budget_s for s in steps if s.group == "bridge")
    serial = sum(s.budget_s for s in steps if not s.group) + bridge
    assert serial + gc.PACK_RESERVE_S <= gc.DEADLINE_S <= 8 * 60  # the issue: within 8 minutes on one H200
    assert gc.DEADLINE_S < gc.DEVICE_TIMEOUT_S <= 600             # the device README: 10 minutes a command
    assert len(gc.DEVICE_COMMAND) <= 2000 and len(gc.CARRY) <= 8
    assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", *gc.CARRY]).returncode == 0


def _stand_in(name, code, budget, work, **kw):
    return gc.Step(name, budget, [sys.executable, "-c", code], cwd=work, outputs=kw.pop("outputs", []), **kw)


def test_a_step_past_its_budget_is_stopped_and_the_others_keep_their_outputs(tmp_path):
    work = tmp_path / "work"
    (work / "steps").mkdir(parents=True)
    group = [_stand_in("slow", "import time; print('started', flush=True); time.sleep(60)", 2, work, group="g"),
             _stand_in("good", "open('good.txt', 'w').write('x')", 30, work, group="g", outputs=["good.txt"]),
             _stand_in("bad", "import sys; sys.exit(3)", 30, work, group="g")]
    start = time.monotonic()
    results = {r.name: r for r in gc.run_group(group, work, dict(os.environ), time.monotonic() + 120)}
    assert time.monotonic() - start < 30
    assert results["slow"].status == "timeout" and "budget 2 s" in results["slow"].detail
    assert results["good"].status == "passed" and (work / "good.txt").read_text() == "x"
    assert results["bad"].status == "failed" and results["bad"].rc == 3
    assert "started" in (work / "steps" / "slow.log").read_text()


def test_pack_fits_what_comes_back_and_import_restores_it(tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "snapshot").mkdir(parents=True)
    (work / "overlays.txt").write_text("table\n")
    (work / "snapshot" / "memory_snapshot_0.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    (work / "noise.bin").write_bytes(os.urandom(20 * gc.MiB))  # incompressible: the archive must be split
    summary = {"date": "2031-01-02", "steps": [{"name": "install", "status": "passed"}]}
    files = gc.pack(work, out, summary)
    assert len(files) <= gc.MAX_FILES and all(gc.SAFE_NAME.fullmatch(f) for f in files)
    assert all((out / f).stat().st_size <= gc.MAX_FILE for f in files)
    assert sum(f.startswith("gpu-check.tar.gz.part") for f in files) == 2
    assert json.loads((out / "summary.json").read_text())["files"] == files
    monkeypatch.setattr(gc, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(gc, "ROOT", tmp_path)
    args = gc.argparse.Namespace(import_results=str(out), date=None, force=False)
    assert gc.cmd_import(args) == 0
    dest = tmp_path / "runs" / "2031-01-02"
    assert (dest / "overlays.txt").read_text() == "table\n" and (dest / "summary.json").is_file()
    assert (dest / "snapshot" / "memory_snapshot_0.pickle.gz").is_file()
    assert not (dest / "snapshot" / "memory_snapshot_0.pickle").exists()
    assert gc.cmd_import(args) == 2  # never over a committed run without --force


def test_a_run_without_wheels_still_writes_its_summary(tmp_path):
    """No GPU and no wheels: the install step fails, nothing else starts, and the summary says why (exit 1)."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    res = subprocess.run([str(SCRIPT), "--out", str(tmp_path / "out"), "--wheels", str(empty)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] is False
    assert summary["steps"][0]["name"] == "install" and summary["steps"][0]["status"] == "error"
    assert "no wheels" in summary["steps"][0]["detail"]
    with tarfile.open(tmp_path / "out" / "gpu-check.tar.gz") as tar:
        assert "env.json" in tar.getnames()


def test_usage_errors_exit_2():
    res = subprocess.run([str(SCRIPT), "--only", "bench,nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown steps" in res.stderr
    res = subprocess.run([str(SCRIPT), "--import-results", "/nonexistent"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "summary.json" in res.stdout


def test_gpu_wheels_is_one_command():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_wheels")]).returncode == 0
    make = (ROOT / "Makefile").read_text()
    assert "gpu-wheels:" in make and "scripts/gpu_wheels" in make


def test_the_dry_run_builds_each_bench_model_on_cpu_and_reports_one_that_cannot_be_built():
    """bench/gpu_overlays.py --dry-run builds every case's megatron-core model (local spec) on CPU, so a field the
    TE-free path cannot take (here persist_layer_norm, which the torch norm refuses) fails here, not on the GPU."""
    loader = importlib.machinery.SourceFileLoader("gpu_overlays_bench", str(ROOT / "bench" / "gpu_overlays.py"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = bench
    loader.exec_module(bench)
    model = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "kv_channels": 16,
             "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
             "activation_func": {"__callable__": ["torch.nn.functional", "silu"]}}
    gpt = {"vocab": 256, "seq": 32, "position_embedding_type": "rope", "rotary_base": 10000.0, "share": False}
    rows = [{"name": "fine", "spec": {"model": model, "gpt": gpt}},
            {"name": "refused", "spec": {"model": model | {"persist_layer_norm": True}, "gpt": gpt}},
            {"name": "listed", "skipped": "needs >= 2 GPUs"}]
    got = {r["name"]: r for r in bench.construct_on_cpu(rows)}
    assert got["fine"].get("built_on_cpu") is True and "error" not in got["fine"]
    assert "persist_layer_norm" in got["refused"]["error"]
    assert got["listed"] == rows[2]

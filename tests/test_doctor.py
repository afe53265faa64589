"""The OOM doctor on a corpus of realistic logs built from the documented formats
(ecosystem-notes.md: current, torch<=2.0, ~2.1 typo, newer doc link, ROCm/HIP; multi-rank
prefixes; torchrun failure summaries) with noise, interleaving, truncation and bad bytes."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
from conftest import ROOT, mbmem

from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan

NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU {gpu} has a total capacity of 79.11 GiB "
       "of which {free} is free. Including non-PyTorch memory, this process has 77.98 GiB memory in use. Of the allocated "
       "memory {alloc} is allocated by PyTorch, and {ru} is reserved by PyTorch but unallocated. If reserved but "
       "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
       "See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
NEWER_LINK = NEW.replace("(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
                         "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
PRIVATE = NEW.replace("is allocated by PyTorch, and", "is allocated by PyTorch, with 3.00 GiB allocated in private pools (e.g., CUDA Graphs), and")
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 70.10 GiB already "
       "allocated; 1.20 GiB free; 75.00 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try "
       "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
TYPO21 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacty of "
          "79.15 GiB of which 300.00 MiB is free. Process 1234 has 78.80 GiB memory in use. Of the allocated memory 60.00 GiB "
          "is allocated by PyTorch, and 18.00 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
          "is large try setting max_split_size_mb to avoid fragmentation.")
HIP = (NEW.replace("CUDA out of memory", "HIP out of memory").replace("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"))
NOISE = ["[rank{r}]: iteration {i:>6}/ 100000 | consumed samples: {s} | elapsed time per iteration (ms): 5123.4 | loss 2.31",
         "[rank{r}]: [2026-11-30 04:11:02] INFO megatron.core: some message about NCCL with ALLOC in it (no conf)",
         "random slurm line: srun: Job step aborted"]
TORCHRUN = ["Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-30_04:12:01", "  host      : node-017",
            "  rank      : {r} (local_rank: {r})", "  exitcode  : 1 (pid: 4242)"]


def oom(template=NEW, req="1.96 GiB", gpu=0, free="1.12 GiB", alloc="54.76 GiB", ru="21.63 GiB"):
    return template.format(req=req, gpu=gpu, free=free, alloc=alloc, ru=ru)


def log(tmp_path, name, lines, raw=b""):
    p = tmp_path / name
    p.write_bytes("\n".join(lines).encode() + b"\n" + raw)
    return str(p)


def noise(ranks=8, n=40):
    return [NOISE[i % 3].format(r=i % ranks, i=i, s=i * 32) for i in range(n)]


def test_current_format_fragmentation(tmp_path):
    f = scan([log(tmp_path, "a.log", noise() + ["[rank3]: " + oom(gpu=3)] + noise())])
    d = diagnose(f, "llama3_70b_sft")
    assert d.kind == "fragmentation" and d.confidence == "high"
    assert d.next_command == "python train.py recipe=llama3_70b_sft +mem=expandable_segments"
    o = f.ooms[0]
    assert o.rank == 3 and o.requested == int(1.96 * 2**30) and o.reserved_unallocated == int(21.63 * 2**30)
    assert o.capacity == int(79.11 * 2**30) and o.allocated == int(54.76 * 2**30)
    # The world size is never guessed from the highest rank seen (issue 16 §3): no launcher line, unknown.
    assert any("world size unknown" in r for r in d.reasons)
    assert any("a.log:41" in e for e in d.evidence)  # file and line number of the OOM


def test_expandable_already_set_means_capacity(tmp_path):
    lines = ["+ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", *noise(), "[rank0]: " + oom(ru="120.00 MiB")]
    d = diagnose(scan([log(tmp_path, "b.log", lines)]), "llama3_8b_pretrain")
    # Capacity: the ladder's first remedy on the user's command, never expandable_segments again.
    assert d.kind == "capacity" and d.next_command == "python train.py recipe=llama3_8b_pretrain +mem=selective_recompute"
    assert any("expandable_segments is already on" in r for r in d.reasons)
    assert "mbmem recommend --recipe llama3_8b_pretrain" in d.savings


def test_hint_in_the_oom_message_is_not_mistaken_for_the_setting(tmp_path):
    d = diagnose(scan([log(tmp_path, "c.log", ["[rank0]: " + oom()])]))
    assert d.kind == "fragmentation"


@pytest.mark.parametrize("template, ru", [(OLD, 75.0 - 70.1), (TYPO21, 18.0), (NEWER_LINK, 21.63), (PRIVATE, 21.63),
                                          (HIP, 21.63)])
def test_message_variants(tmp_path, template, ru):
    f = scan([log(tmp_path, "v.log", ["[rank1]: " + oom(template)])])
    assert len(f.ooms) == 1 and not f.ooms[0].partial
    assert abs(f.ooms[0].reserved_unallocated - ru * 2**30) < 2**22
    assert diagnose(f).kind == "fragmentation"
    if template is PRIVATE:
        assert f.ooms[0].private_pools == 3 * 2**30
    if template is HIP:
        assert f.ooms[0].device == "HIP"


def test_the_oldest_cached_figure_is_already_reserved_minus_allocated(tmp_path):
    # torch <= 1.3: "X cached)" printed amount_cached - amount_allocated (THCCachingAllocator), so it can be far
    # below "already allocated"; here 2.56 MiB free + 300 MiB cached serves the 20 MiB request: fragmentation
    line = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.73 GiB total capacity; 9.59 GiB "
            "already allocated; 2.56 MiB free; 300.00 MiB cached)")
    f = scan([log(tmp_path, "old.log", [line])])
    assert f.ooms[0].reserved_unallocated == 300 * 2**20
    d = diagnose(f)
    assert d.kind == "fragmentation"
    assert any("torch <= 1.3 (from the message format)" in r for r in d.reasons)
    f = scan([log(tmp_path, "old2.log", ["[rank1]: " + oom(OLD)])])
    assert any("torch <= 2.0 (from the message format)" in r for r in diagnose(f).reasons)
    f = scan([log(tmp_path, "new.log", ["[rank1]: " + oom()])])
    assert any("torch >= 2.1 (from the message format)" in r for r in diagnose(f).reasons)


def test_a_cut_message_whose_request_exceeds_the_gpu_is_capacity(tmp_path):
    line = ("OOM: Ran out of memory with exception: CUDA out of memory. Tried to allocate 93.75 GiB (GPU 4; 79.17 GiB "
            "total capacity; 1.52 GiB already allocated; 74.14 GiB free; 1.54 GiB reser")
    d = diagnose(scan([log(tmp_path, "cut.log", [line])]))
    assert (d.kind, d.verdict) == ("capacity", "diagnosed")
    assert any("more than the GPU's whole 79.17 GiB capacity" in r for r in d.reasons)
    # cut right after "reserved in total": the figure is there
    f = scan([log(tmp_path, "cut2.log", [line.replace("1.54 GiB reser", "1.54 GiB reserved in total")])])
    assert f.ooms[0].reserved_unallocated == int(1.54 * 2**30) - int(1.52 * 2**30)
    # a smaller request with the numbers cut stays unsure
    d = diagnose(scan([log(tmp_path, "cut3.log", [line.replace("93.75 GiB (GPU", "9.75 GiB (GPU")])]))
    assert d.verdict == "unsure"


def test_interleaved_ranks_truncation_and_bad_bytes(tmp_path):
    truncated = ("[rank5]: " + oom())[:140]  # cut mid-message
    lines = noise(16, 200) + [truncated] + noise(16, 50) + ["[rank2]: " + oom(gpu=2, ru="30.00 GiB")]
    p = log(tmp_path, "mixed.log", lines, raw=b"\xff\xfe garbage \x80 bytes\n[rank9]: tail\n")
    f = scan([p])
    d = diagnose(f)
    assert {o.rank for o in f.ooms} == {2, 5}
    assert any(o.partial for o in f.ooms) and d.kind == "fragmentation"


def test_torchrun_summary_and_slurm_prefixes(tmp_path):
    lines = ["0: starting", "1: starting", "3: " + oom(gpu=3), *[t.format(r=3) for t in TORCHRUN]]
    f = scan([log(tmp_path, "slurm-123.out", lines)])
    assert f.ooms[0].rank == 3 and 3 in f.failed_ranks


def test_gzip_and_stdin(tmp_path):
    p = tmp_path / "job.log.gz"
    p.write_bytes(gzip.compress(("\n".join(noise() + ["[rank0]: " + oom()]) + "\n").encode()))
    assert diagnose(scan([str(p)])).kind == "fragmentation"
    out = subprocess.run([sys.executable, "-m", "mbmem_overlays.cli", "doctor", "-"], input=("[rank0]: " + oom()).encode(),
                         capture_output=True, cwd=ROOT, timeout=60, check=False)
    assert out.returncode == 0 and b"allocator fragmentation" in out.stdout


def test_globs_and_several_files(tmp_path):
    log(tmp_path, "r0.log", noise())
    log(tmp_path, "r1.log", ["[rank1]: " + oom()])
    f = scan([str(tmp_path / "r*.log")])
    assert len(f.files) == 2 and f.ooms[0].rank == 1


@pytest.mark.parametrize("line, rule, command", [
    ("ValueError: Currently there is no support for Pipeline parallelism with CPU offloading", "cpu_offload_pipeline",
     "+mem=optimizer_offload"),
    (("ValueError: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is currently not supported with nccl_ub due to "
     "compatibility issue with torch.cuda.MemPool API."), "expandable_segments_nccl_ub", None),
    (("AssertionError: Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."), "expandable_segments_cuda_graphs", "+mem=expandable_segments"),
    ("ValueError: CPU offloading does not work when activation recomputation is enabled", "cpu_offload_recompute", None),
])
def test_configuration_errors(tmp_path, line, rule, command):
    d = diagnose(scan([log(tmp_path, "cfg.log", noise() + ["[rank0]: " + line])]), "llama3_70b_sft")
    assert d.kind == "configuration" and rule in d.summary and d.confidence == "high"
    if command:
        assert d.next_command.endswith(command)


def test_skill_eval_question(tmp_path):
    """Llama3-70B SFT, 32xH100, TP4 PP4 VPP5 DP2, OOM around 58.8 GB (memory-tuning skill evals.json)."""
    lines = ["+ export CUDA_DEVICE_MAX_CONNECTIONS=1", "+ export NVTE_ALLOW_NONDETERMINISTIC_ALGO=1",
             "python -m torch.distributed.run --nproc_per_node=8 --nnodes=4 train.py recipe=llama3_70b_sft",
             "[rank0]: > parallel layout TP=4 PP=4 VPP=5 DP=2 (world size 32)",
             *noise(32, 300),
             "[rank0]: " + oom(req="1.50 GiB", free="620.00 MiB", alloc="54.70 GiB", ru="4.10 GiB"),
             *[t.format(r=0) for t in TORCHRUN]]
    out = mbmem("doctor", log(tmp_path, "llama70b-sft.log", lines))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # The launcher seen in the log is kept (issue 16, Remedies).
    assert ("next command: python -m torch.distributed.run --nproc_per_node=8 --nnodes=4 train.py recipe=llama3_70b_sft "
            "+mem=expandable_segments") in text
    assert "not VPP" in text and "throughput knob" in text
    assert "not TP=8" in text and "-28%" in text
    assert "not CPU offloading" in text and "PP=4 > 1" in text


@pytest.mark.parametrize("content, kind, code", [
    (b"", "none", 3),
    (b"just an ordinary training log\nloss 1.0\n", "none", 3),
    (bytes(range(256)) * 64, "unreadable", 2),
])
def test_bad_input_gets_a_clear_answer(tmp_path, content, kind, code):
    p = tmp_path / "input.bin"
    p.write_bytes(content)
    out = mbmem("doctor", str(p), "--json")
    assert out.returncode == code and "Traceback" not in out.stderr
    data = json.loads(out.stdout)
    assert data["kind"] == kind and "no CUDA/HIP out-of-memory message" in data["summary"]
    if content.count(b"\0") > 16:
        assert any("binary" in p for p in data["problems"])
    if not content:
        assert any("empty" in p for p in data["problems"])


def test_missing_file(tmp_path):
    out = mbmem("doctor", str(tmp_path / "nope.log"))
    assert out.returncode == 2 and "cannot read" in out.stdout and "Traceback" not in out.stderr


def test_doctor_imports_neither_torch_nor_bridge(tmp_path):
    p = log(tmp_path, "x.log", ["[rank0]: " + oom()])
    code = (f"import sys; from mbmem_overlays.cli import main; main(['doctor', {p!r}]);"
            "print('LEAK' if any(m.startswith(('megatron','torch')) for m in sys.modules) else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert out.stdout.strip().endswith("CLEAN"), out.stdout + out.stderr

"""Hostile input, round 5 (issue 39): the Megatron-LM argument reader (``plan --megatron-args`` and ``doctor --plan``
on a log's arguments dump), the what-if replay, the overlays' Megatron-LM flags, and two regressions of round 4.

Each class is fed inputs beyond the issue's own examples. ``BASE`` is a small valid job; each case changes one thing.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

import snapshot_gen as G
from conftest import ROOT, mbmem

BASE = ("--tensor-model-parallel-size 2 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
        "--max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 --tokenizer-type NullTokenizer "
        "--vocab-size 1024 --bf16")
LOG = ROOT / "tests" / "fixtures" / "megatron_args" / "gpt_small_job.log"
DOCUMENTED = {0, 1, 2, 3}
MiB = 1 << 20


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity (what a strict JSON reader does)."""
    def bad(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=bad)


def plan(tmp_path, text: str, *extra: str, world: str | None = "8", timeout: int = 60, name: str = "job.sh"):
    path = tmp_path / name
    path.write_text(text)
    argv = ["plan", "--megatron-args", str(path), *(["--world-size", world] if world else []), *extra]
    started = time.perf_counter()
    out = mbmem(*argv, timeout=timeout)
    out.seconds = time.perf_counter() - started
    assert out.seconds < 0.9 * timeout, out.seconds   # a hang the reader's refusal swallowed is still a failure
    return out


def refused(out, code: int | None = None) -> str:
    """The answer of a refusal: a documented code, no traceback; the problem's text."""
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-1500:]
    assert out.returncode in ({code} if code is not None else {1, 2}), (out.returncode, out.stderr[-800:])
    return out.stderr + out.stdout


def refused_json(tmp_path, text: str, *extra: str, code: int | None = None) -> dict:
    out = plan(tmp_path, text, *extra, "--json")
    refused(out, code)
    payload = strict_json(out.stdout)
    assert payload["ok"] is False and payload["exit_code"] == out.returncode
    return payload


@pytest.fixture(scope="module")
def stack(bridge):
    return bridge


def with_dump(tmp_path, **changes: str) -> Path:
    """The fixture log with some of its dump's printed values replaced (``name=value``)."""
    from mbmem_overlays.bridge.megatron_args import DUMP_END
    lines = LOG.read_text().splitlines()
    out, seen = [], set()
    for line in lines:
        name = line.strip().split(" ", 1)[0]
        if name in changes and " ...." in line:
            line = line[:line.rindex(" ") + 1] + changes[name]
            seen.add(name)
        if DUMP_END in line:   # a name the dump does not print: added, as a hostile log could
            out += [f"  {k} {'.' * max(1, 48 - len(k))} {v}" for k, v in changes.items() if k not in seen]
        out.append(line)
    path = tmp_path / "job.log"
    path.write_text("\n".join(out) + "\n")
    return path


def doctor_plan(path: Path, *extra: str) -> dict:
    out = mbmem("doctor", str(path), "--plan", "--json", *extra, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr[-1500:]
    assert out.returncode in (0, 2, 3, 4), out.stderr[-800:]
    return strict_json(out.stdout)


def plan_status(payload: dict) -> str:
    return json.dumps(payload)


# ----------------------------------------------------------------------------- class 1: every failure is one line
ONE_LINE = {
    "tensor parallel 0": BASE.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 0"),
    "context parallel 0": BASE + " --context-parallel-size 0",
    "expert parallel 0": BASE + " --num-experts 4 --expert-model-parallel-size 0",
    "eval micro batch 0": BASE + " --eval-micro-batch-size 0",
    "eval global batch 0": BASE + " --eval-global-batch-size 0",
    "attention heads 0": BASE.replace("--num-attention-heads 8", "--num-attention-heads 0"),
    "query groups 0": BASE + " --group-query-attention --num-query-groups 0",
    "cuda graph module bogus": BASE + " --cuda-graph-modules bogus",
    "cuda graph module attn and bogus": BASE + " --cuda-graph-modules attn nothing_of_that_name",
    "attention backend bogus": BASE + " --attention-backend nope",
    "exit signal bogus": BASE + " --exit-signal SIGNOPE",
    "heterogeneous config {}": BASE + " --heterogeneous-layers-config-encoded-json '{}'",
    "heterogeneous config []": BASE + " --heterogeneous-layers-config-encoded-json '[]'",
    "heterogeneous config not JSON": BASE + " --heterogeneous-layers-config-encoded-json 'not json'",
    "heterogeneous config deep": BASE + " --heterogeneous-layers-config-encoded-json '" + "[" * 100_000 + "'",
    "te precision config missing": BASE + " --te-precision-config-file missing.yaml",
    "heterogeneous config path missing": BASE + " --heterogeneous-layers-config-path /no/such/file.json",
    "heads do not divide hidden": BASE.replace("--num-attention-heads 8", "--num-attention-heads 7"),
    "window size not a tuple": BASE + " --window-size a,b",
    "world size the layout cannot hold": BASE + " --pipeline-model-parallel-size 3",
}


@pytest.mark.parametrize("case", sorted(ONE_LINE))
def test_every_failure_of_the_megatron_lm_reader_is_one_line_with_a_documented_code(stack, tmp_path, case):
    """ZeroDivisionError, KeyError, AttributeError, FileNotFoundError and RecursionError escaped megatron-core's
    parser, validate_args and our mapping as tracebacks; each is now one refusal (exit 1 when validate_args
    refuses a job it could read, 2 otherwise), and under --json one strict error object."""
    out = plan(tmp_path, ONE_LINE[case])
    text = refused(out)
    problem = [ln for ln in out.stderr.splitlines() if ln.startswith("[argument]")]
    assert len(problem) == 1 and len(problem[0]) < 1200, out.stderr
    payload = refused_json(tmp_path, ONE_LINE[case])
    assert payload["problems"] and payload["problems"][0]["message"] in text


def test_a_vocab_file_that_nests_past_the_recursion_limit_is_one_line(stack, tmp_path):
    for body in ("[" * 200_000, "{\"a\":" * 200_000, "\"x\"", "[1, 2, 3]", "\x00\xff" * 10):
        vocab = tmp_path / "vocab.json"
        vocab.write_text(body)
        job = BASE.replace("--tokenizer-type NullTokenizer --vocab-size 1024",
                           f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file {vocab}")
        assert "vocab.json" in refused(plan(tmp_path, job), 2)
    vocab.write_text(json.dumps({f"t{i}": i for i in range(5000)}))
    out = plan(tmp_path, job, "--json")
    assert out.returncode == 0 and "5000 (GPT2BPETokenizer" in out.stdout


# ----------------------------------------------------------------------------- class 2: values the mapping must bound
@pytest.mark.parametrize("flag, value", [
    ("--make-vocab-size-divisible-by", "0"), ("--make-vocab-size-divisible-by", "-128"),
    ("--vocab-size", "9" * 400), ("--hidden-size", "8" * 400), ("--ffn-hidden-size", "7" * 100),
    ("--seq-length", "5" * 30), ("--num-layers", "4" * 25), ("--train-iters", "9" * 40),
    ("--global-batch-size", "8" * 300), ("--num-experts", "2" * 50), ("--seed", "1" * 200)])
def test_values_megatron_core_passes_through_are_bounded_before_the_mapping(stack, tmp_path, flag, value):
    """0 or a 400-digit number raised ZeroDivisionError / OverflowError in our vocabulary padding and the plan."""
    job = f"{BASE} {flag} {value}"
    payload = refused_json(tmp_path, job, code=2)
    assert flag in payload["problems"][0]["message"]


@pytest.mark.parametrize("count", ["\u00b2", "\u0668", "\uff18", "1_0", " 8", "8 ", "+8", "0x8", "\u0038\u0308", ""])
def test_world_sizes_are_ascii_digits_everywhere(count):
    """'\u00b2' passed isdigit() and then failed int(); '\u0668' and '\uff18' are digits int() reads: none is a
    number a user typed. One rule (core/values.py ascii_int) for the launcher, the dump and the log."""
    from mbmem_overlays.bridge.megatron_args import DUMP_END, DUMP_HEADER, command_words, dump_words
    from mbmem_overlays.core.values import ascii_int
    from mbmem_overlays.doctor.parse import scan
    assert ascii_int(count) is None
    words = command_words(["torchrun", "--nproc-per-node", count, "--nnodes", "1", "pretrain_gpt.py", "--bf16"])
    assert words.launcher_world is None
    words = command_words(["torchrun", "--nproc-per-node", "4", f"--nnodes={count}", "pretrain_gpt.py", "--bf16"])
    assert words.launcher_world is None
    dump = dump_words(f"{DUMP_HEADER}\n  world_size {'.' * 38} {count}\n{DUMP_END}\n")
    assert dump.launcher_world is None
    assert command_words("torchrun --nproc-per-node 4 --nnodes 2 pretrain_gpt.py --bf16").launcher_world == 8
    if any(c.isascii() and c.isdigit() for c in count) or count.isascii():
        return          # a log's "world size:  8" is read with its spaces
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "job.log")
        log.write_text(f"world size: {count}\nWORLD_SIZE={count}\nTP={count} PP=2\n")
        found = scan([str(log)])
        assert found.world is None and "tp" not in found.layout


def test_a_superscript_world_size_in_a_dump_is_a_usage_error_not_a_traceback(stack, tmp_path):
    out = mbmem("plan", "--megatron-args", str(with_dump(tmp_path, world_size="\u00b2")), "--json", timeout=120)
    refused(out, 2)
    assert "--world-size" in out.stdout
    job = f"torchrun --nproc-per-node \u00b2 pretrain_gpt.py {BASE}"
    assert "--world-size" in refused(plan(tmp_path, job, world=None), 2)


@pytest.mark.parametrize("env_yaml", [
    '  "A=B": 1\n', '  "": x\n', '  "1X": y\n', '  "A B": z\n', '  "X": "a\\0b"\n', '  "Y": "\\ud800"\n',
    '  "Z": "' + "v" * 40_000 + '"\n', '  "-X": 1\n'])
def test_an_environment_os_environ_cannot_hold_is_refused_before_anything_is_written(stack, tmp_path, env_yaml):
    """ENV_VARS {"A=B": 1} or a NUL byte in a value failed when written into os.environ (a traceback, with the
    variables before it already exported); the job's environment is checked first and refused whole."""
    flags = "".join(f"  {a}: {b}\n" for a, b in zip(BASE.split()[::2], BASE.split()[1::2]))
    text = "ENV_VARS:\n" + env_yaml + "MODEL_ARGS:\n" + flags.replace("  --bf16: --", "  --bf16: true\n  --")
    before = dict(os.environ)
    out = plan(tmp_path, text + "  --bf16: true\n", name="job.yaml")
    assert "environment" in refused(out, 2)
    assert dict(os.environ) == before


def test_a_nul_byte_in_an_exported_value_is_refused(stack, tmp_path):
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, job_environment, load_job
    for env in ({"X": "a\x00b"}, {"A=B": "1"}, {"X\x00": "1"}, {"X": "\udcff\ud800"}):
        with pytest.raises(MegatronArgsError, match="environment"):
            job_environment(env)
        with pytest.raises(MegatronArgsError, match="environment"):
            load_job(BASE, world_size=8, env=env)
    assert "environment" in refused(plan(tmp_path, "X=a\x00b " + BASE), 2)


# ----------------------------------------------------------------------------- class 3: validate_args' exit()
def test_validate_args_exit_is_a_rejection_on_plan_and_doctor(stack, tmp_path):
    """--checkpoint-activations makes validate_args print and call exit(): mbmem exited 0 with no output. The flag
    itself is now read as the full recompute older releases ran it as (test_megatron_logs.py), so the exit() is
    reached by validating the words as they are."""
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, parse_and_validate
    with pytest.raises(MegatronArgsError) as err:
        parse_and_validate(BASE.split() + ["--checkpoint-activations"], 8, {}, 9)
    assert err.value.rejected and "exit()" in err.value.message and "--recompute-activations" in err.value.message
    out = plan(tmp_path, BASE + " --checkpoint-activations")
    assert out.returncode == 0 and "--recompute-granularity full" in out.stdout, out.stderr[-800:]
    doctor = doctor_plan(with_dump(tmp_path, checkpoint_activations="True"))
    assert "checkpoint-activations" in plan_status(doctor) and "exit()" not in plan_status(doctor)


def test_no_exit_of_megatron_core_ends_the_doctor_silently(stack, tmp_path):
    from mbmem_overlays.bridge import megatron_args as MA

    def leaves(*_args, **_kwargs):
        raise SystemExit(3)
    import megatron.training.arguments as mlm
    real = mlm.validate_args
    mlm.validate_args = leaves
    try:
        with pytest.raises(MA.MegatronArgsError, match="exit"):
            MA.load_job(BASE, world_size=8)
        doctor = doctor_plan(LOG)
        assert "not planned" in plan_status(doctor)
    finally:
        mlm.validate_args = real


# ----------------------------------------------------------------------------- class 4: patterns bounded before eval
@pytest.mark.parametrize("pattern", [
    "[1]*10**9", "[1]*2**2**2**2**2", "[1]*9**9**9", "([1]*10**4)*10**4", "[[1]*10**7]", "[1]*(10**3*10**4)",
    "[0]+[1]*9**12", "[1]*10**6*10", "[1][0]*10**12", "[1]*(1)(2)", "[1]**2", "[1]*" + "9" * 30, "[" * 5000 + "]" * 5000,
    "[1," * 200_000 + "1]"])
def test_a_layer_pattern_is_measured_before_megatron_core_evaluates_it(pattern):
    """'[1]*10**9' passed the size guard (it missed **) and built a list of GBs in megatron-core's eval."""
    from mbmem_overlays.bridge.megatron_args import MegatronArgsError, _check_pattern
    started = time.perf_counter()
    with pytest.raises(MegatronArgsError):
        _check_pattern("--moe-layer-freq", pattern)
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("pattern", ["([1]*3+[0])*4", "[0,1,1,1]", "[1]*24", "[0]*2**3", "([1]+[0]*23)", "7"])
def test_the_patterns_megatron_lm_users_write_still_pass(pattern):
    from mbmem_overlays.bridge.megatron_args import _check_pattern
    _check_pattern("--moe-layer-freq", pattern)


@pytest.mark.parametrize("spelling", ["--moe-layer-freq '[1]*10**9'", "--moe-layer-freq=[1]*10**9",
                                      "--moe-layer-freq ([1]*10)**9", "--no-rope-freq [1]*4**20",
                                      "--linear-attention-freq [0]*8**10"])
def test_every_way_a_pattern_reaches_the_parser_is_measured(stack, tmp_path, spelling):
    out = plan(tmp_path, f"{BASE} --num-experts 4 {spelling}", timeout=30)
    refused(out, 2)
    assert out.seconds < 10


def test_a_pattern_in_a_yaml_or_a_dump_is_measured_too(stack, tmp_path):
    flags = "".join(f"  {a}: {b}\n" for a, b in zip(BASE.split()[::2], BASE.split()[1::2]))
    yaml = "MODEL_ARGS:\n" + flags.replace("  --bf16: --", "  --bf16: true\n  --") + \
        "  --bf16: true\n  --num-experts: 4\n  --moe-layer-freq: '[1]*10**10'\n"
    refused(plan(tmp_path, yaml, name="job.yaml", timeout=30), 2)
    doctor = doctor_plan(with_dump(tmp_path, num_experts="4", moe_layer_freq="[1]*10**10"))
    assert "moe-layer-freq" in plan_status(doctor) and "not planned" in plan_status(doctor)


# ----------------------------------------------------------------------------- class 5: files named in the arguments
FILE_FLAGS = ("--heterogeneous-layers-config-path", "--te-precision-config-file")
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


@pytest.fixture
def hostile_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(17 * MiB)   # sparse: 17 MiB of zeros, past the 16 MiB read
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000)
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"a fifo": fifo, "/dev/zero": Path("/dev/zero"), "/dev/urandom": Path("/dev/urandom"), "a folder": folder,
            "a 17 MiB file": big, "an alias bomb": bomb, "deep YAML": deep}


@pytest.mark.parametrize("flag", FILE_FLAGS)
@pytest.mark.parametrize("kind", ["a fifo", "/dev/zero", "/dev/urandom", "a folder", "a 17 MiB file", "an alias bomb",
                                  "deep YAML"])
def test_a_file_named_in_the_arguments_is_read_bounded_and_never_blocks(stack, tmp_path, hostile_files, flag, kind):
    """/dev/zero grew without limit, a 500-byte alias bomb past 1.6 GB, a fifo blocked forever."""
    if flag == "--heterogeneous-layers-config-path" and kind in ("an alias bomb", "deep YAML"):
        pytest.skip("megatron-core reads that file as JSON")
    out = plan(tmp_path, f"{BASE} {flag} {hostile_files[kind]}", timeout=30)
    text = refused(out)
    assert out.seconds < 10
    assert str(hostile_files[kind]) in text or "YAML" in text


@pytest.mark.parametrize("kind", ["a fifo", "/dev/zero", "a folder", "a 17 MiB file"])
def test_a_vocab_file_that_is_not_a_regular_file_is_refused(stack, tmp_path, hostile_files, kind):
    job = BASE.replace("--tokenizer-type NullTokenizer --vocab-size 1024",
                       f"--tokenizer-type GPT2BPETokenizer --vocab-file {hostile_files[kind]}")
    out = plan(tmp_path, job, timeout=30)
    refused(out, 2)
    assert out.seconds < 10


def test_files_megatron_core_reads_are_bounded_only_while_it_runs():
    import builtins
    import io

    import yaml

    from mbmem_overlays.bridge.megatron_args import _Refusal, _bounded_reads
    before = (builtins.open, io.open, yaml.load, yaml.safe_load)
    with _bounded_reads():
        with pytest.raises(_Refusal):
            open("/dev/zero", "rb")
        with open(__file__) as f:
            assert "class 5" in f.read()
        with pytest.raises(_Refusal):
            yaml.safe_load(ALIAS_BOMB)
        assert yaml.safe_load("a: [1, 2]") == {"a": [1, 2]}
    assert (builtins.open, io.open, yaml.load, yaml.safe_load) == before


# ----------------------------------------------------------------------------- class 6: the plan's work is bounded
@pytest.mark.parametrize("change, world", [
    ("--num-layers 100000000", "8"), ("--num-layers 400000 --pipeline-model-parallel-size 4 "
                                      "--num-virtual-stages-per-pipeline-rank 2", "8"),
    ("--num-layers 100001", "8"),
    ("--num-layers 8192 --pipeline-model-parallel-size 2048 --num-virtual-stages-per-pipeline-rank 2 "
     "--global-batch-size 8192", "4096"),
    ("--num-layers 16384 --pipeline-model-parallel-size 8192", "16384")])
def test_a_job_past_the_plans_limits_is_refused_fast_with_the_limit(stack, tmp_path, change, world):
    """--num-layers 100000000 (which megatron-core accepts) made the plan build one entry per layer for minutes."""
    job = BASE.replace("--num-layers 4", "").replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
    out = plan(tmp_path, f"{job} {change}", world=world, timeout=60)
    assert "limit" in refused(out, 2)
    assert out.seconds < 5


@pytest.mark.parametrize("change, world", [
    ("--num-layers 20000", "8"),
    ("--num-layers 16 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
     "--global-batch-size 4000000000", "8"),
    ("--num-layers 4096 --pipeline-model-parallel-size 4096", "4096"),
    ("--num-layers 1024 --pipeline-model-parallel-size 256 --num-virtual-stages-per-pipeline-rank 4 "
     "--global-batch-size 1024", "256")])
def test_large_jobs_within_the_limits_answer_fast(stack, tmp_path, change, world):
    """4 billion microbatches replayed step by step (the schedule loop), and the rank splits were O(stages x
    layers): now the schedule is replayed one period and the splits per rank."""
    job = BASE.replace("--num-layers 4", "").replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
    out = plan(tmp_path, f"{job} {change}", "--gpu-memory", "80GiB", world=world, timeout=120)
    assert out.returncode in (0, 1) and "Traceback" not in out.stderr, out.stderr[-800:]
    assert "verdict:" in out.stdout
    assert out.seconds < 20


@pytest.mark.parametrize("pp, vpp, m, group", [(4, 3, 100, 4), (4, 2, 101, 5), (2, 4, 97, 2), (8, 2, 64, 8),
                                               (3, 5, 50, 7), (4, 2, 10, 12), (2, 3, 1000, 2)])
def test_the_schedule_replayed_one_period_is_megatrons_own(pp, vpp, m, group):
    """Many microbatches, checked against megatron-core's own get_pp_rank_microbatches / get_schedule_table."""
    from test_plan_pipeline import _megatron_alive

    from mbmem_overlays.memory.pipeline import alive_chunk_microbatches
    for rank in range(pp):
        ours = alive_chunk_microbatches.__wrapped__(pp, vpp, rank, m, group)
        theirs = _megatron_alive(pp, vpp, rank, m, group)
        assert set(ours) <= theirs
        assert all(any(all(a >= b for a, b in zip(o, t)) for o in ours) for t in theirs)
    started = time.perf_counter()
    alive_chunk_microbatches.__wrapped__(pp, vpp, 0, 10 ** 12, group)
    assert time.perf_counter() - started < 0.5


def test_the_model_refuses_what_it_cannot_plan_on_every_path(stack):
    """The recipe path too (from_config): a layer count past the limit, a non-positive size."""
    from mbmem_overlays.bridge.megatron_args import load_job
    from mbmem_overlays.core.errors import OverlayError
    from mbmem_overlays.memory import model as P
    job = load_job(BASE, world_size=8)
    for path, value in (("num_layers", 10 ** 8), ("num_layers", -4), ("num_layers", 0), ("hidden_size", -256),
                        ("seq_length", -512), ("num_attention_heads", 0), ("vocab_size", -1024),
                        ("pipeline_model_parallel_size", 10 ** 5), ("moe_layer_freq", [1] * 200_000)):
        import copy
        cfg = copy.deepcopy(job.config)
        setattr(cfg.model, path, value)
        started = time.perf_counter()
        with pytest.raises(OverlayError):
            P.from_config(cfg, 8)
        assert time.perf_counter() - started < 2
    cfg = copy.deepcopy(job.config)
    cfg.train.micro_batch_size = -1
    with pytest.raises(OverlayError, match="micro_batch_size"):
        P.from_config(cfg, 8)


# ----------------------------------------------------------------------------- class 7: over the limit: refused
def test_an_argument_file_over_the_limit_is_refused_never_cut(stack, tmp_path):
    """$BASE, 9 MiB of spaces, then --pipeline-model-parallel-size 2 --num-layers 8 was planned as PP1, 4 layers."""
    tail = " --pipeline-model-parallel-size 2 --num-layers 8"
    for body in (BASE + " " * (9 * MiB) + tail, BASE + "\\\n" * (5 * MiB) + tail,
                 "MODEL_ARGS:\n  --num-layers: 4\n" + "#" * (9 * MiB) + "\n  --bf16: true\n"):
        out = plan(tmp_path, body)
        assert "8 MiB" in refused(out, 2)
    gz = tmp_path / "job.sh.gz"
    gz.write_bytes(gzip.compress((BASE + " " * (9 * MiB) + tail).encode()))
    assert "8 MiB" in refused(mbmem("plan", "--megatron-args", str(gz), "--world-size", "8", timeout=60), 2)
    out = mbmem("plan", "--megatron-args", "-", "--world-size", "8", input=BASE + " " * (9 * MiB) + tail, timeout=60)
    assert "8 MiB" in refused(out, 2)


def test_a_damaged_or_cut_gzip_is_one_line(stack, tmp_path):
    data = gzip.compress(BASE.encode() * 50)
    for name, body in (("damaged.gz", data[:20] + b"\xff" * 40 + data[60:]), ("cut.gz", data[:30]),
                       ("empty.gz", b"\x1f\x8b")):
        path = tmp_path / name
        path.write_bytes(body)
        out = mbmem("plan", "--megatron-args", str(path), "--world-size", "8", "--json", timeout=60)
        assert "cannot read" in refused(out, 2)
        doctor = mbmem("doctor", str(path), "--plan", "--json", timeout=60)
        assert "Traceback" not in doctor.stderr and doctor.returncode in (2, 3)


def test_a_closed_standard_input_is_one_line():
    out = subprocess.run(["bash", "-c", f"{sys.executable} -m mbmem_overlays.cli plan --megatron-args - --world-size 8 "
                          "--json <&-"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-800:]
    assert "standard input" in strict_json(out.stdout)["error"]


def test_a_long_log_whose_head_holds_the_dump_is_still_read():
    from mbmem_overlays.bridge.megatron_args import DUMP_HEADER, read_source
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "big.log")
        log.write_text(LOG.read_text() + "iteration 1 | loss 1.0\n" * (500_000))
        assert log.stat().st_size > 8 * MiB
        assert DUMP_HEADER in read_source(str(log))


def test_a_long_word_or_many_words_answer_fast(stack, tmp_path):
    """shlex built each word a character at a time (an 8 MB word took minutes) and argparse's time grows with the
    square of the options (20,000 words took half a minute): the words are split in linear time and counted."""
    out = plan(tmp_path, BASE + " --data-path '" + "x y" * 2_000_000 + "'", timeout=60)
    assert out.returncode == 0 and out.seconds < 10, out.stderr[-500:]
    for body in (BASE + " --bf16" * 5000, "MODEL_ARGS:\n  --recompute-modules: [" + ", ".join(["core_attn"] * 6000) + "]\n"):
        out = plan(tmp_path, body, name="job.yaml" if body.startswith("MODEL") else "job.sh", timeout=60)
        assert "4,096" in refused(out, 2) and out.seconds < 10


def test_the_words_split_as_bash_splits_them():
    from mbmem_overlays.bridge.megatron_args import shell_words
    assert shell_words("A='x y' torchrun --x \"a b\" c\\ d # comment\n--y 'it''s' e#f \"\\$H\\n\"") == \
        ["A=x y", "torchrun", "--x", "a b", "c d", "--y", "its", "e#f", "$H\\n"]
    for bad in ("'open", "\"open", "end\\"):
        with pytest.raises(ValueError):
            shell_words(bad)


# ----------------------------------------------------------------------------- class 8: --use-checkpoint-args
@pytest.mark.parametrize("load", ["--load /ckpt/run", "--pretrained-checkpoint /ckpt/base",
                                  "--load /ckpt/run --pretrained-checkpoint /ckpt/base"])
def test_use_checkpoint_args_says_the_plan_is_not_the_jobs(stack, tmp_path, load):
    """It was listed as 'no effect on memory': Megatron-LM replaces the model's arguments with the checkpoint's."""
    out = plan(tmp_path, f"{BASE} --use-checkpoint-args {load}", "--gpu-memory", "80GiB", "--json")
    payload = strict_json(out.stdout)
    notes = {n["flag"]: n for n in payload["megatron_args"]["not_modelled"]}
    assert "--use-checkpoint-args" in notes and "checkpoint's arguments replace" in notes["--use-checkpoint-args"]["reason"]
    assert "--use-checkpoint-args" not in payload["megatron_args"]["ignored"]
    assert "NOT MODELLED" in payload["megatron_args"]["verdict"] or "unknown" in payload["megatron_args"]["verdict"]


def test_a_yaml_config_that_replaces_the_arguments_is_named_too(stack, tmp_path):
    """The same kind: --yaml-cfg makes Megatron-LM's parse_args replace every argument with the file's."""
    out = plan(tmp_path, f"{BASE} --yaml-cfg /cluster/job.yaml", "--json")
    payload = strict_json(out.stdout)
    assert "--yaml-cfg" in {n["flag"] for n in payload["megatron_args"]["not_modelled"]}


def test_use_checkpoint_args_without_a_checkpoint_is_megatron_lms_refusal_and_a_dump_says_it_too(stack, tmp_path):
    assert "--load" in refused(plan(tmp_path, f"{BASE} --use-checkpoint-args"), 1)
    out = plan(tmp_path, f"{BASE} --load /ckpt/run", "--json")    # --load alone: the arguments given are the model
    assert out.returncode == 0 and "--use-checkpoint-args" not in json.dumps(strict_json(out.stdout)["megatron_args"]
                                                                             ["not_modelled"])
    doctor = doctor_plan(with_dump(tmp_path, use_checkpoint_args="True", load="/ckpt/run"))
    assert "--use-checkpoint-args" in plan_status(doctor) and "NOT MODELLED" in plan_status(doctor)


# ----------------------------------------------------------------------------- class 9: negative sizes
@pytest.mark.parametrize("change", [
    ("--num-layers 4", "--num-layers -4"), ("--hidden-size 256", "--hidden-size -256"),
    ("--bf16", "--bf16 --ffn-hidden-size -1024"), ("--vocab-size 1024", "--vocab-size -1024"),
    ("--seq-length 512", "--seq-length -512"), ("--seq-length 512", "--seq-length 0"),
    ("--micro-batch-size 1", "--micro-batch-size -1"), ("--global-batch-size 8", "--global-batch-size -8"),
    ("--bf16", "--bf16 --ffn-hidden-size 0"), ("--bf16", "--bf16 --kv-channels -32"),
    ("--bf16", "--bf16 --num-experts -2"), ("--bf16", "--bf16 --num-experts 4 --moe-ffn-hidden-size -64"),
    ("--bf16", "--bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers -1"),
    ("--bf16", "--bf16 --max-position-embeddings -1"), ("--bf16", "--bf16 --padded-vocab-size -4"),
    ("--bf16", "--bf16 --num-experts 4 --moe-router-topk -2")])
def test_non_positive_sizes_are_refused_never_planned(stack, tmp_path, change):
    """--num-layers -4, --hidden-size -256, ... each gave 'verdict: fits', exit 0."""
    out = plan(tmp_path, BASE.replace(*change), "--gpu-memory", "80GiB")
    refused(out)
    assert "fits" not in out.stdout


# ----------------------------------------------------------------------------- class 10: strict JSON
@pytest.mark.parametrize("extra", ["--activation-offload-fraction nan", "--activation-offload-fraction inf",
                                   "--lr=-inf", "--init-method-std NaN", "--hidden-dropout 1e999"])
def test_json_is_strict_even_for_a_nan_the_user_gave(stack, tmp_path, extra):
    out = plan(tmp_path, f"{BASE} {extra}", "--json")
    refused(out, 2)
    payload = strict_json(out.stdout)     # NaN put a bare NaN in the error object
    assert "finite" in payload["problems"][0]["message"]


def test_the_one_json_writer_is_strict_for_any_value():
    from mbmem_overlays.core.report import json_text
    text = json_text({"a": float("nan"), "b": [float("inf"), 10 ** 5000, (1, -float("inf"))], 3: {"c": object()},
                      "d": [[[[float("nan")]]]]})
    payload = strict_json(text)
    assert payload["a"] is None and payload["b"][0] is None and payload["b"][2] == [1, None]
    assert len(payload["b"][1]) < 200 and payload["d"] == [[[[None]]]] and "3" in payload


# ----------------------------------------------------------------------------- class 11: the job's own environment
@pytest.mark.parametrize("form", ["command", "export", "env", "yaml"])
def test_the_jobs_own_environment_is_what_the_overlay_rules_check(stack, tmp_path, form):
    """NVTE_CPU_OFFLOAD_V1=1 in the job was rejected with 'fix: export NVTE_CPU_OFFLOAD_V1=1'."""
    offload = " --fine-grained-activation-offloading --offload-modules core_attn"
    flags = "".join(f"  {a}: {b}\n" for a, b in zip(BASE.split()[::2], BASE.split()[1::2]))
    texts = {"command": f"NVTE_CPU_OFFLOAD_V1=1 {BASE}{offload}",
             "export": f"export NVTE_CPU_OFFLOAD_V1=1 torchrun --nproc-per-node 8 pretrain_gpt.py {BASE}{offload}",
             "env": f"env NVTE_CPU_OFFLOAD_V1=1 python pretrain_gpt.py {BASE}{offload}",
             "yaml": "ENV_VARS:\n  NVTE_CPU_OFFLOAD_V1: 1\nMODEL_ARGS:\n" + flags.replace("  --bf16: --", "  --bf16: true\n  --")
             + "  --bf16: true\n  --fine-grained-activation-offloading: true\n  --offload-modules: core_attn\n"}
    out = plan(tmp_path, texts[form], "--gpu-memory", "80GiB", "--overlay", "selective_recompute",
               name="job.yaml" if form == "yaml" else "job.sh")
    assert out.returncode == 0, out.stderr[-1000:]
    silent = plan(tmp_path, f"{BASE}{offload}", "--gpu-memory", "80GiB")
    assert "NVTE_CPU_OFFLOAD_V1=1" in refused(silent, 1)


# ----------------------------------------------------------------------------- class 12: printed flags validate
OVERLAYS = sorted(p.stem for p in (ROOT / "overlays" / "mem").glob("*.yaml"))
NO_MEGATRON_LM = {"lora_sp_regather": "peft"}    # LoRA is Bridge's (Megatron-LM has no PEFT): the engine refuses it


@pytest.fixture(scope="module")
def base_job(stack):
    from mbmem_overlays.bridge.megatron_args import load_job
    return load_job("NVTE_CPU_OFFLOAD_V1=1 " + BASE, world_size=8)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlays_megatron_lm_flags_pass_megatron_cores_parser_and_validate_args(base_job, overlay):
    """precision_aware_optimizer printed --exp-avg-dtype torch.bfloat16 (not a choice); megatron_fsdp printed
    --use-distributed-optimizer --use-megatron-fsdp twice and no --ckpt-format fsdp_dtensor, which validate_args
    requires. Every overlay's flags, added to the job, are parsed and validated by megatron-core here."""
    from mbmem_overlays.bridge.megatron_args import parse_and_validate
    from mbmem_overlays.cli.plan import megatron_overlay_flags
    from mbmem_overlays.core.catalog import Catalog
    from mbmem_overlays.core.errors import OverlayError
    if overlay in NO_MEGATRON_LM:
        with pytest.raises(OverlayError, match=NO_MEGATRON_LM[overlay]):
            megatron_overlay_flags(base_job, [overlay], Catalog())
        return
    flags = megatron_overlay_flags(base_job, [overlay], Catalog())
    words = list(flags.words)
    flag_names = [w for w in words if w.startswith("--")]
    assert len(flag_names) == len(set(flag_names)), words          # each flag once
    argv = [w for w in base_job.argv if w not in flags.remove] + words
    args, unknown, _ = parse_and_validate(argv, 8, {**base_job.env, **flags.env}, 9)
    assert not unknown
    changed = {w.lstrip("-").replace("-", "_") for w in flag_names}
    assert changed or flags.env or flags.no_flag, overlay
    for name in changed:
        assert name in vars(args) or name.startswith("no_"), name


def test_the_dtype_and_fsdp_flags_are_the_parsers_own(base_job):
    from mbmem_overlays.cli.plan import megatron_overlay_flags
    from mbmem_overlays.core.catalog import Catalog
    words = list(megatron_overlay_flags(base_job, ["precision_aware_optimizer"], Catalog()).words)
    assert words[words.index("--exp-avg-dtype") + 1] == "bf16"
    fsdp = list(megatron_overlay_flags(base_job, ["megatron_fsdp"], Catalog()).words)
    assert fsdp.count("--use-megatron-fsdp") == 1 and fsdp.count("--use-distributed-optimizer") == 1
    assert fsdp[fsdp.index("--ckpt-format") + 1] == "fsdp_dtensor"


# ----------------------------------------------------------------------------- class 13: modules named twice
def test_an_offload_module_named_twice_counts_once():
    """[core_attn]*4 planned 4x the pinned host memory of [core_attn]; megatron-core only checks membership."""
    from dataclasses import replace

    from mbmem_overlays.memory import levers
    from mbmem_overlays.memory import model as P
    from mbmem_overlays.memory.from_config import recompute_modules
    shape = P.Shape(layers=8, hidden=1024, ffn=4096, heads=8, groups=8, head_dim=128, vocab=32000)
    lay = P.Layout(world=8, tp=2, pp=2, seq=2048, mbs=2, gbs=64)
    for modules in (("core_attn",), ("core_attn", "attn_proj"), ("qkv_linear", "core_attn")):
        once = replace(P.Settings(), fine_grained_offload=levers.FineGrainedOffload(modules))
        repeated = replace(P.Settings(), fine_grained_offload=levers.FineGrainedOffload(modules * 4 + modules[::-1]))
        assert repeated.fine_grained_offload.modules == modules
        for rank in range(lay.pp):
            assert levers.offloaded_activations(shape, lay, repeated, rank) == \
                levers.offloaded_activations(shape, lay, once, rank)
        assert P.estimate(shape, lay, repeated).total == P.estimate(shape, lay, once).total
    from types import SimpleNamespace
    assert recompute_modules(SimpleNamespace(recompute_modules=["core_attn", "mlp", "core_attn"]), ()) == \
        ("core_attn", "mlp")


# ----------------------------------------------------------------------------- class 14: FSDP written in other cases
@pytest.mark.parametrize("word, fsdp", [
    ("ddp.use_megatron_fsdp=TRUE", True), ("dist.use_megatron_fsdp=tRuE", True), ("+ddp.use_megatron_fsdp=True", True),
    ("++dist.use_megatron_fsdp=true", True), (" ddp.use_megatron_fsdp=TRUE ", True),
    ("ddp.use_megatron_fsdp=FALSE", False), ("ddp.use_megatron_fsdp='true'", False), ("ddp.use_megatron_fsdp=1", False),
    ("ddp.use_megatron_fsdp=null", False), ("model.use_megatron_fsdp=TRUE", False)])
def test_slurm_without_validation_reads_fsdp_as_hydra_does(word, fsdp):
    """ddp.use_megatron_fsdp=TRUE (true to Hydra) still exported CUDA_DEVICE_MAX_CONNECTIONS=1, which Bridge
    refuses under FSDP."""
    from mbmem_overlays.launch.slurm import standard_env
    env = standard_env(None, sets=[word])
    assert ("CUDA_DEVICE_MAX_CONNECTIONS" not in env) is fsdp


def test_the_rendered_script_leaves_the_connections_unset_for_fsdp_in_capitals(tmp_path):
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "8", "--no-validate",
                "--set", "ddp.use_megatron_fsdp=TRUE", "--set", "dist.use_megatron_fsdp=TRUE", timeout=60)
    assert out.returncode == 0, out.stderr[-800:]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out.stdout


# ----------------------------------------------------------------------------- class 15: the what-if replay is linear
def _one_entry(n: int) -> dict:
    snap = G.expandable_snapshot(n)
    snap["device_traces"] = [snap["device_traces"][0][-1:]]
    return snap


@pytest.mark.parametrize("shape", [_one_entry, G.expandable_snapshot], ids=["segments", "segment_map pairs"])
def test_the_what_if_replay_is_linear(tmp_path, shape):
    """28,000 expandable segments took over 33 s with --what-if (start_state scanned every segment per mapped
    range), 20,000 segment_map + alloc pairs over 25 s (_unmapped_containing scanned every unmapped block)."""
    def cost(n: int) -> float:
        path = tmp_path / f"s{n}.pickle"
        path.write_bytes(pickle.dumps(shape(n), protocol=4))
        best = 1e9
        for _ in range(2):
            started = time.perf_counter()
            out = mbmem("doctor", str(path), "--json", "--what-if", "expandable_segments:False", timeout=300)
            best = min(best, time.perf_counter() - started)
        assert out.returncode == 0, out.stderr[-500:]
        proof = strict_json(out.stdout)["what_if"][0]["proof"]
        assert proof["not_proven"] or proof["agreement"] == 1.0
        return best
    small, large = cost(1000), cost(4000)
    assert large < 8 * small + 0.5, (small, large)   # linear: ~4x; the scans were ~16x


def test_the_address_index_finds_what_the_scan_found():
    from mbmem_overlays.doctor.snapshot.allocator import Block, Pool
    pool = Pool(False, (0, 0))
    blocks = []
    for ptr, size, stream in ((1000, 100, 0), (1200, 50, 1), (5000, 1000, 0), (300, 10, 2)):
        b = Block(ptr, size, stream, pool, mapped=False)
        pool.insert_unmapped(b)
        blocks.append(b)
    for address in (0, 299, 300, 309, 310, 999, 1000, 1099, 1100, 1200, 1249, 1250, 5999, 6000):
        scan = next((b for b in pool.unmapped.values() if b.ptr <= address < b.ptr + b.size), None)
        assert pool.unmapped_holding(address) is scan, address
    pool.erase_unmapped(blocks[2])
    assert pool.unmapped_holding(5500) is None and pool.unmapped_holding(1010) is blocks[0]
    assert pool.unmapped_holding(1010, besides=blocks[0]) is None


# ----------------------------------------------------------------------------- class 16: a refused value, bounded
@pytest.mark.parametrize("text", ["max_split_size_mb:" + "9" * 100_000, "max_split_size_mb:" + "x" * 100_000,
                                  "garbage_collection_threshold:" + "5" * 100_000,
                                  "roundup_power2_divisions:" + "7" * 5000, "k" * 100_000 + ":1",
                                  "per_process_memory_fraction:" + "\x1b[31m" * 20_000,
                                  "max_non_split_rounding_mb:" + "1" * 6000])
def test_a_refused_what_if_value_is_echoed_bounded(tmp_path, text):
    """A 100,000-digit max_split_size_mb printed a 100 KB line."""
    from mbmem_overlays.doctor.snapshot import allocator as A
    from mbmem_overlays.doctor.snapshot.whatif import WhatIfError, parse_what_if
    with pytest.raises(WhatIfError) as exc:
        parse_what_if(text, A.Settings())
    assert len(str(exc.value)) < 1500 and "\x1b" not in str(exc.value)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(G.expandable_snapshot(3), protocol=4))
    out = mbmem("doctor", str(path), "--what-if", text, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert max(len(line) for line in (out.stderr + out.stdout).splitlines()) < 2000


# ----------------------------------------------------------------------------- regressions of round 4
def _in_a_deleted_folder(tmp_path, commands: list[str]) -> list[tuple[int, str]]:
    """(exit code, stderr) of each mbmem command, all run from one working directory deleted before they start."""
    import shlex
    gone, logs = tmp_path / "gone", tmp_path / "logs"
    logs.mkdir()
    python = f"PYTHONPATH={shlex.quote(str(ROOT / 'src'))} {shlex.quote(sys.executable)} -m mbmem_overlays.cli"
    script = f"mkdir -p {shlex.quote(str(gone))} && cd {shlex.quote(str(gone))} && rmdir {shlex.quote(str(gone))}\n"
    for k, args in enumerate(commands):
        script += f"{python} {args} >/dev/null 2>{logs}/{k}.err; echo $? >{logs}/{k}.rc\n"
    env = {k: v for k, v in os.environ.items() if k != "MBMEM_OVERLAY_DIRS"}
    subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, env=env)
    return [(int((logs / f"{k}.rc").read_text()), (logs / f"{k}.err").read_text()) for k in range(len(commands))]


def test_commands_that_need_no_working_directory_work_in_a_deleted_one(tmp_path):
    """mbmem list and mbmem doctor /absolute/file.pickle exited 2 in a deleted working directory (round 4 refused
    every command there); a command whose paths are all absolute needs no working directory."""
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(G.expandable_snapshot(3), protocol=4))
    works = ["list --json", "explain selective_recompute", f"doctor {snap} --json", f"doctor {LOG}",
             f"doctor {snap} --html {tmp_path / 'page.html'}"]
    needs = ["doctor relative.log", f"doctor {snap} --html page.html", "--overlay-dir my_overlays list",
             "plan --recipe llama3_8b_pretrain --world-size 8"]
    results = _in_a_deleted_folder(tmp_path, works + needs)
    for args, (code, err) in zip(works, results):
        assert code == 0 and "no longer exists" not in err and "Traceback" not in err, (args, code, err[-600:])
    for args, (code, err) in zip(needs, results[len(works):]):
        assert code == 2 and "the working directory no longer exists" in err, (args, code, err[-600:])


def test_one_unreadable_allocator_setting_leaves_the_rest_readable(tmp_path):
    """A 5,000-digit integer in allocator_settings refused the whole snapshot (the reader's integer bound); it is
    named as unreadable and left out, and the rest of the file is read."""
    G._FRAMES.clear()
    snap = G.dump([G.peak_run()])
    snap["allocator_settings"] = {"max_split_size": 10 ** 5000, "expandable_segments": True,
                                  "garbage_collection_threshold": 0.5, "some_new_key": -(10 ** 4000),
                                  "roundup_power2_divisions": {"1": 10 ** 3000, "2": 4}}
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    out = mbmem("doctor", str(path), "--json", timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    payload = strict_json(out.stdout)
    assert payload["allocator_settings"] == {"expandable_segments": True, "garbage_collection_threshold": 0.5,
                                             "roundup_power2_divisions": {"2": 4}}
    problems = " ".join(payload["problems"])
    for name in ("max_split_size", "some_new_key", "roundup_power2_divisions['1']"):
        assert f"{name} is an integer of" in problems and "unreadable" in problems, (name, problems)
    # a file that is only such an integer is still no snapshot (round 4's bombs keep exit 2)
    path.write_bytes(b"\x80\x04\x8b\x00\x08\x00\x00" + b"\x01" * 2048 + b".")
    assert mbmem("doctor", str(path), timeout=60).returncode == 2

"""Hypothesis fuzzing of the entry points' argument space (issue 15, "Acceptance"): `mbmem apply` and
train.py's body never raise and never print a traceback; they answer with a message and a documented
exit code. Bounded so that CI runs it in seconds: every generated command line carries at least one
mistake that is caught before Bridge is imported (that path is what the fuzzing explores; the paths
through Bridge are covered case by case in test_hostile_cli.py).
"""

from __future__ import annotations

import contextlib
import io
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mbmem_overlays.cli import main as mbmem_main
from mbmem_overlays.core.report import EXIT_USAGE, SCHEMA_VERSION
from mbmem_overlays.core.sizes import parse_size
from mbmem_overlays.launch import hydra_entry

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hostile_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "=", "..", "$(id)", "x; rm -rf ~", "`touch /tmp/x`", "{{SRUN_EXTRA}}", "nan", "-1", "0",
                     "1.2.3GiB", "9" * 80, "[1,", "${oc.env:HOME}", "__class__", "\x00", "é", "a=b=c"]),
)
# Each of these alone makes the command line wrong before Bridge would be imported.
bad_recipes = st.sampled_from(["os.system", "builtins.exit", "os.getcwd", "subprocess.run", "x; rm -rf ~",
                               "megatron.bridge.recipes.__init__", "_private", "a..b", "megatron.bridge.recipesx.f"])
overlay_names = st.one_of(st.sampled_from(["expandable", "cpu_offload", "selective_recompute", "lora_regather",
                                           "nope", ""]), hostile_text)
set_values = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["model.tensor_model_parallel_size", "model..x",
                                                        "mem.cpu_offload.num_layers", "mem.nope.x", "train",
                                                        "model.__class__", "", "mem.cpu_offload"]), hostile_text),
    hostile_text)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mbmem_main(argv)
    return code, out.getvalue(), err.getvalue()


@FUZZ
@given(recipe=bad_recipes, overlays=st.lists(overlay_names, max_size=3), sets=st.lists(set_values, max_size=3),
       world=st.one_of(st.none(), hostile_text, st.integers(-5, 64).map(str)), as_json=st.booleans(),
       verbose=st.booleans())
def test_apply_argument_space_never_raises(recipe, overlays, sets, world, as_json, verbose):
    argv = ["apply", "--recipe", recipe]
    for name in overlays:
        argv += ["--overlay", name]
    for s in sets:
        argv.append(f"--set={s}")   # the = form: a value starting with '-' stays a value
    if world is not None:
        argv.append(f"--world-size={world}")
    argv += ["--json"] * as_json + ["-v"] * verbose
    code, out, err = run_cli(argv)
    assert code == EXIT_USAGE, (argv, code, err)
    assert "Traceback" not in out + err and "importing Megatron Bridge" not in err
    if as_json:
        doc = json.loads(out)
        assert doc["schema_version"] == SCHEMA_VERSION and doc["exit_code"] == EXIT_USAGE


@FUZZ
@given(words=st.lists(st.one_of(hostile_text, st.sampled_from(["--json", "--recipe", "--set", "--world-size", "-O",
                                                                "--overlay-dir", "apply", "explain", "list"])),
                      max_size=6))
def test_any_command_line_without_a_valid_recipe_never_raises(words):
    argv = [w for w in words if w not in ("-h", "--help")]
    if "apply" in argv and "--recipe" in argv:  # keep every apply off the Bridge path: its recipe is refused
        argv[argv.index("--recipe") + 1:argv.index("--recipe") + 1] = ["os.system"]
    code, out, err = run_cli(argv)
    assert isinstance(code, int) and code in (0, 1, 2, 3), (argv, code)
    assert "Traceback" not in out + err


@FUZZ
@given(run=st.dictionaries(st.sampled_from(["dry_run", "world_size", "validate", "json", "plan", "gpu_memory",
                                            "verbose"]),
                           st.one_of(st.none(), st.booleans(), st.integers(-3, 10**13), hostile_text,
                                     st.lists(st.integers(), max_size=2)), max_size=7),
       mem=st.one_of(st.none(), st.integers(), hostile_text,
                     st.dictionaries(overlay_names, st.one_of(st.none(), st.integers(), hostile_text,
                                                              st.dictionaries(hostile_text, hostile_text, max_size=2)),
                                     max_size=3)),
       recipe=bad_recipes, bridge=st.dictionaries(hostile_text, hostile_text, max_size=3))
def test_train_body_never_raises(run, mem, recipe, bridge):
    """train.py's job body on any composed config: a clear error and exit 2, all problems together."""
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"recipe": {"function": recipe, "kwargs": {}}, "run": run, "mem": mem, "bridge": bridge})
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = hydra_entry.run(cfg)
    assert code == EXIT_USAGE, err.getvalue()
    assert "Traceback" not in out.getvalue() + err.getvalue()
    assert "outside the recipe modules" in err.getvalue() or "not a recipe function name" in err.getvalue() \
        or "is private" in err.getvalue()


@FUZZ
@given(argv=st.lists(st.one_of(hostile_text, st.builds(lambda k, v: f"{k}={v}", hostile_text, hostile_text)),
                     max_size=5))
def test_hydra_argv_rewrite_never_raises(argv):
    out = hydra_entry.hydra_argv(["train.py", *argv])
    assert out[0] == "train.py" and len(out) == len(argv) + 1


@FUZZ
@given(text=st.one_of(hostile_text, st.builds(lambda n, u: f"{n}{u}", st.floats(allow_nan=True, allow_infinity=True),
                                               st.sampled_from(["", "B", "KiB", "GiB", "GB", "G", " TiB", "PiB"]))))
def test_parse_size_is_a_positive_float_or_a_value_error(text):
    try:
        value = parse_size(text)
    except ValueError as exc:
        assert "memory size" in str(exc)
    else:
        assert isinstance(value, float) and 0 < value < 2**50


# ============================================================================ issue 22: every entry point's inputs
# "Make the next round find nothing": option values of every command (sizes, integers, paths, names), overrides and
# overlay parameters with interpolations, control characters and huge numbers, user YAML with anchors, aliases,
# tags and deep nesting, and every kind of output path. The property, for each: it finishes within a time bound,
# prints no traceback, exits with a documented code (JSON when asked), writes nothing when it refuses, and
# changes neither the environment nor any file. Every generated command line carries at least one mistake found
# before Bridge is imported, so each example costs milliseconds.
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from mbmem_overlays.core.report import EXIT_OUTPUT  # noqa: E402

BOUNDED = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIME_BOUND = 10.0   # seconds per example, on a loaded two-core machine; a hang or exponential walk takes minutes
DOCUMENTED = {0, 1, 2, 3, EXIT_OUTPUT}

huge_numbers = st.one_of(st.integers(2**63, 10**30).map(str), st.just("9" * 4301), st.just("1" * 5000),
                         st.sampled_from(["1e999", "-1e999", "nan", "inf", str(10**21), "1_000", "٨", "0x10", "-0"]))
controls = st.sampled_from(["\x1b[2J", "\x1b]0;t\x07", "\u202e", "\u2066", "\x00", "\r", "\u200b", "\x7f", "\x9b"])
interpolations = st.sampled_from(["${oc.env:HOME}", "${oc.env:MBMEM_FUZZ_SECRET}", "${now:%H}", "${a.b}",
                                  "\\${escaped}", "x${y}z", "${oc.decode:'1'}", "${"])
deep_or_long = st.one_of(st.integers(33, 1500).map(lambda n: "[" * n + "1" + "]" * n),
                         st.integers(33, 400).map(lambda n: "{a:" * n + "1" + "}" * n),
                         st.integers(4097, 20_000).map(lambda n: "x" * n))
nasty_values = st.one_of(hostile_text, huge_numbers, interpolations, deep_or_long,
                         st.builds(lambda a, c, b: f"{a}{c}{b}", st.text(max_size=4), controls, st.text(max_size=4)))
sizes = st.one_of(nasty_values, st.sampled_from(["80GiB", "80 GB", "0", "-1G", "1PiB", "80XB", "9" * 70 + "GiB"]))
counts = st.one_of(nasty_values, st.integers(-3, 2**21).map(str))
keys = st.sampled_from(["train.train_iters", "model.tensor_model_parallel_size", "logger.wandb_exp_name",
                        "mem.cpu_offload.num_layers", "mem.selective_recompute.modules", "mem.nope.x", "optimizer.lr"])
bad_sets = st.builds(lambda k, v: f"{k}={v}", keys, st.one_of(huge_numbers, interpolations, deep_or_long,
                                                             st.builds(lambda c: f"a{c}b", controls)))
PATH_KINDS = ("new", "existing", "link", "dangling link", "fifo", "folder", "missing folder", "device", "too long",
              "below a file")


def make_path(root: Path, kind: str, suffix: str) -> str:
    """A path of ``kind`` under ``root`` (created now), ending in ``suffix``."""
    target = root / f"out{suffix}"
    if kind == "existing":
        target.write_bytes(b"keep")
    elif kind == "link":
        (root / "victim").write_bytes(b"keep")
        target.symlink_to(root / "victim")
    elif kind == "dangling link":
        target.symlink_to(root / "nowhere")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    elif kind == "missing folder":
        return str(root / "no" / f"out{suffix}")
    elif kind == "device":
        return "/dev/null"
    elif kind == "too long":                          # ENAMETOOLONG from every call on it
        return str(root / ("a" * 300) / f"out{suffix}")
    elif kind == "below a file":                      # ENOTDIR
        (root / "plain").write_bytes(b"keep")
        return str(root / "plain" / f"out{suffix}")
    return str(target)


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``root``: its mode and, for regular files, its bytes (what "writes nothing" compares)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st_ = p.lstat()
        out[str(p.relative_to(root))] = (st_.st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


def command_line(draw, command: str, out_path: str) -> list[str]:
    """A command line for ``command`` with hostile option values and at least one mistake found before Bridge."""
    recipe = draw(st.one_of(bad_recipes, st.just("llama3_8b_pretrain")))
    argv = [command, "--recipe", recipe]
    argv += [f"--set={s}" for s in draw(st.lists(st.one_of(set_values, bad_sets), max_size=3))]
    argv += [f"--overlay={n}" for n in draw(st.lists(overlay_names, max_size=2))]
    if command in ("apply", "args"):
        argv += [f"--param={p}" for p in draw(st.lists(st.one_of(bad_sets.map(lambda s: s.removeprefix("mem.")),
                                                                 hostile_text), max_size=2))]
        if draw(st.booleans()):
            argv.append(f"--world-size={draw(counts)}")
    if command in ("plan", "recommend"):
        argv += [f"--world-size={draw(counts)}", f"--margin={draw(st.one_of(nasty_values, st.just('0.05')))}"]
        if draw(st.booleans()):
            argv.append(f"--gpu-memory={draw(sizes)}")
        if command == "plan" and draw(st.booleans()):
            argv += ["--search", f"--top={draw(counts)}"]
        argv += [f"--plot={out_path}", *(["--force"] if draw(st.booleans()) else [])]
    if command == "slurm":
        argv += [f"--nodes={draw(counts)}", f"--gpus-per-node={draw(counts)}", "--no-validate", f"-o={out_path}",
                 *(["--force"] if draw(st.booleans()) else [])]
        for option in ("--cpus-per-task", "--partition", "--python", "--workdir", "--job-name"):
            if draw(st.booleans()):
                argv.append(f"{option}={draw(nasty_values)}")
    # The mistake that keeps every example off the Bridge path (and must be reported, with the others).
    argv.append(draw(st.sampled_from(["--set=logger.wandb_exp_name=${oc.env:MBMEM_FUZZ_SECRET}",
                                      f"--set=train.train_iters={'9' * 4301}", "--set=model..x=1"])))
    return argv + (["--json"] if draw(st.booleans()) else [])


@BOUNDED
@given(data=st.data(), command=st.sampled_from(["apply", "args", "plan", "recommend", "slurm"]),
       kind=st.sampled_from(PATH_KINDS), suffix=st.sampled_from([".png", ".svg", ".sh", ""]))
def test_every_command_refuses_hostile_option_values_cleanly(data, command, kind, suffix):
    with tempfile.TemporaryDirectory(prefix="mbmem-fuzz-") as tmp:
        root = Path(tmp)
        out_path = make_path(root, kind, suffix)
        argv = command_line(data.draw, command, out_path)
        before, env_before = tree(root), dict(os.environ)
        start = time.monotonic()
        code, out, err = run_cli(argv)
        assert time.monotonic() - start < TIME_BOUND, argv
        assert code == EXIT_USAGE, (argv, code, err[-2000:])
        assert "Traceback" not in out + err and "importing Megatron Bridge" not in err
        assert "\x1b" not in err and "\u202e" not in err          # user text is shown escaped
        if "--json" in argv:
            doc = json.loads(out)
            assert doc["schema_version"] == SCHEMA_VERSION and doc["exit_code"] == EXIT_USAGE and not doc["ok"]
        assert tree(root) == before and dict(os.environ) == env_before   # refused: nothing written or exported


def alias_document(draw) -> str:
    """YAML text built from anchors that alias earlier anchors (wide, deep, merged, tagged, self-referencing)."""
    lines, anchors = [], []
    for i in range(draw(st.integers(0, 12))):
        width = draw(st.integers(1, 12))
        items = [f"*a{draw(st.sampled_from(anchors))}" if anchors and draw(st.booleans())
                 else draw(st.sampled_from(["1", "x", "!!str 2", "!!binary aGk=", "!!timestamp 2020-01-01", "[]",
                                            "{}", "~", "!!float .nan", "9" * 30, "'${oc.env:HOME}'"]))
                 for _ in range(width)]
        if draw(st.integers(0, 9)) == 0:
            items.append(f"*a{i}")                     # an alias inside the node it names
        if anchors and draw(st.booleans()):
            lines.append(f"m{i}: &a{i} {{<<: *a{draw(st.sampled_from(anchors))}, k{i}: 1}}"
                         if draw(st.booleans()) else f"a{i}: &a{i} [{', '.join(items)}]")
        else:
            lines.append(f"a{i}: &a{i} [{', '.join(items)}]")
        anchors.append(i)
    depth = draw(st.integers(0, 60))
    lines.append("deep: " + "[" * depth + "1" + "]" * depth)
    tag = draw(st.sampled_from(["", "!!python/object:os.system ", "!custom ", "!!map ", "!!omap "]))
    overlay = draw(st.sampled_from(["{summary: fuzz}", "{summary: fuzz, set: {train.micro_batch_size: *a0}}",
                                    "{set: {model.num_layers: *a1}}", "{summary: *a0}"]))
    if "*a0" in overlay and 0 not in anchors or "*a1" in overlay and 1 not in anchors:
        overlay = "{summary: fuzz}"
    return "\n".join(lines) + f"\noverlay: {tag}{overlay}\n"


@BOUNDED
@given(data=st.data(), header=st.sampled_from(["# @package mem.fuzz\n", "", "# @package mem.other\n", "# @ x y z\n"]))
def test_user_yaml_with_anchors_aliases_tags_and_depth_is_bounded_everywhere(data, header):
    from mbmem_overlays.core.catalog import Catalog
    text = header + alias_document(data.draw)
    with tempfile.TemporaryDirectory(prefix="mbmem-fuzz-") as tmp:
        (Path(tmp) / "mem").mkdir()
        (Path(tmp) / "mem" / "fuzz.yaml").write_text(text, encoding="utf-8")
        start = time.monotonic()
        cat = Catalog([tmp])
        assert time.monotonic() - start < 2.0, text[:500]
        assert all(p.render() for p in cat.problems)
        for argv in (["list"], ["explain", "fuzz"], ["apply", "--recipe", "os.system", "-O", "fuzz", "--json"]):
            start = time.monotonic()
            code, out, err = run_cli(["--overlay-dir", tmp, *argv])
            assert time.monotonic() - start < TIME_BOUND and code in DOCUMENTED, (argv, code, err[-2000:])
            assert "Traceback" not in out + err
        # train.py's first step reads the same file with the same loader, before Hydra could
        saved = os.environ.get("MBMEM_OVERLAY_DIRS")
        os.environ["MBMEM_OVERLAY_DIRS"] = tmp
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                hydra_entry.startup(["train.py", "recipe=llama3_8b_pretrain", "+mem=fuzz", "run.world_size=0"])
        except SystemExit as exc:
            assert exc.code == EXIT_USAGE
        else:
            raise AssertionError("run.world_size=0 must be refused")
        finally:
            os.environ.pop("MBMEM_OVERLAY_DIRS") if saved is None else os.environ.update(MBMEM_OVERLAY_DIRS=saved)
        assert "Traceback" not in err.getvalue()
        assert "fuzz" in cat.names() or "fuzz.yaml" in err.getvalue()   # a refused file is named, as in mbmem


train_words = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["train.train_iters", "logger.wandb_exp_name", "run.world_size",
                                                        "run.gpu_memory", "run.json", "recipe", "recipe.function",
                                                        "recipe.kwargs.x", "mem.cpu_offload.num_layers",
                                                        "+mem.cpu_offload.num_layers", "++mem.nope.x", "+mem", "mem",
                                                        "run.nope", "hydra.job.name", "model..x"]),
              nasty_values),
    st.sampled_from(["+mem=[cpu_offload,nope]", "+mem=cpu_offload,selective_recompute", "recipe=nope", "+mem=",
                     "run.world_size=0", "-m", "--cfg", "job"]),
    hostile_text)


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(words=st.lists(train_words, max_size=5))
def test_train_startup_never_raises_and_never_resolves(words):
    """train.py's first step on any command line: returns the argv for Hydra, or exits 2 with every problem;
    never a traceback, never the environment's secret, within the time bound."""
    os.environ["MBMEM_FUZZ_SECRET"] = "hunter2"
    env_before = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            argv = hydra_entry.startup(["train.py", "recipe=llama3_8b_pretrain", *words, "run.world_size=0",
                                        "run.json=true"])
    except SystemExit as exc:
        assert exc.code in (EXIT_USAGE, EXIT_OUTPUT), err.getvalue()[-2000:]
        doc = json.loads(out.getvalue())
        assert doc["exit_code"] == exc.code and doc["schema_version"] == SCHEMA_VERSION
    else:
        raise AssertionError(f"run.world_size=0 must be refused, got {argv}")
    finally:
        os.environ.pop("MBMEM_FUZZ_SECRET", None)
    env_before.pop("MBMEM_FUZZ_SECRET")
    assert time.monotonic() - start < TIME_BOUND
    assert "Traceback" not in out.getvalue() + err.getvalue() and "hunter2" not in out.getvalue() + err.getvalue()
    assert dict(os.environ) == env_before


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(kind=st.sampled_from(PATH_KINDS), force=st.booleans(), data=st.binary(max_size=64),
       suffix=st.sampled_from([".png", ".sh", ".json", ""]))
def test_the_one_output_writer_on_every_kind_of_path(kind, force, data, suffix):
    from mbmem_overlays.core.errors import OverlayError
    from mbmem_overlays.core.outfile import output_problems, write_output
    with tempfile.TemporaryDirectory(prefix="mbmem-fuzz-") as tmp:
        root = Path(tmp)
        path = make_path(root, kind, suffix)
        before = tree(root)
        allowed = kind == "new" or (kind == "existing" and force)
        assert (output_problems(path, "-o", force=force) == []) is allowed
        try:
            write_output(path, data, "-o", force=force)
        except OverlayError as exc:
            assert not allowed and exc.problems[0].field == "-o"
            assert tree(root) == before                               # refused: nothing written, no temp file
        else:
            assert allowed and Path(path).read_bytes() == data and not Path(path).is_symlink()
            assert sorted(os.listdir(root)) == sorted({*before, Path(path).name})  # no temporary file left
        if kind == "link":
            assert (root / "victim").read_bytes() == b"keep"          # never written through
        shutil.rmtree(root / "no", ignore_errors=True)

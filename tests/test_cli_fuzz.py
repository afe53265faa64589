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

"""Hostile input against the core (issue 15): the catalogue, the engine, config paths, allocator
settings and the Python API. Every case: a clear OverlayError (or none, where the input is valid),
never another exception, and on failure the config and environment byte-identical."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest

from mbmem_overlays import OverlayError, apply_overlay
from mbmem_overlays.core import allocconf, engine, paths, rules
from mbmem_overlays.core.catalog import Catalog
from mbmem_overlays.core.errors import Problem, ValidationRejected, short_repr

from conftest import snapshot

L8 = "llama3_8b_pretrain_config"
ALLOC = "PYTORCH_CUDA_ALLOC_CONF"


def write_overlay(base: Path, name: str, text: str, header: bool = True) -> Path:
    """``base/mem/<name>.yaml`` with ``text`` after Hydra's ``# @package mem.<name>`` line (``header``)."""
    (base / "mem").mkdir(parents=True, exist_ok=True)
    path = base / "mem" / f"{name}.yaml"
    path.write_text(f"# @package mem.{name}\n{text}" if header else text)
    return path


# ============================================================================ catalogue (no Bridge)
# (file text, fragment of the one problem it must produce). Each was a traceback or a silent
# misreading before (issue 15 #10 and "Also").
MALFORMED = [
    ("p: hello\noverlay:\n  params: {p: hello}\n", "description of parameter p must be a mapping"),
    ("p: 1\noverlay:\n  params: {p: {type: int, choices: 5}}\n", "choices of p must be a non-empty list"),
    ("overlay:\n  set: [a]\n", "overlay.set must be a mapping"),
    ("overlay:\n  env: hello\n", "overlay.env must be a mapping"),
    ("overlay:\n  env: [1]\n", "overlay.env must be a mapping"),
    ("overlay:\n  sources: 5\n", "overlay.sources must be a list"),
    ("overlay:\n  aliases: abc\n", "overlay.aliases must be a list"),
    ("overlay:\n  summary: [1, 2]\n", "overlay.summary must be text"),
    ("overlay: [unclosed\n", "not valid YAML"),
    ("just: a value\n", "no 'overlay:' mapping"),
    ("overlay:\n  sett: {}\n", "unknown key 'sett'"),
    ("overlay:\n  set:\n    model.x: '@nope'\n", "unknown parameter @nope"),
    ("n: 1\noverlay:\n  params:\n    n: {type: complex}\n", "has type 'complex'"),
    ("n: 1\noverlay:\n  params:\n    n: {type: int, min: 5}\n", "the default of n must be >= 5"),
    ("n: x\noverlay:\n  params:\n    n: {type: int}\n", "the default of n must be an integer"),
    ("overlay:\n  params:\n    n: {type: int}\n", "described but has no default"),
    ("overlay:\n  env: {my.var: '1'}\n", "'my.var' is not a valid environment variable name"),
    ("overlay:\n  env: {'X=1; touch /tmp/pwned #': '1'}\n", "is not a valid environment variable name"),
    ("overlay:\n  env: {NCCL_X: true}\n", "must be text or a number"),
    ("overlay:\n  env: {NCCL_X: {a: b}}\n", "is not an allocator variable"),
    ("overlay:\n  env: {PYTORCH_CUDA_ALLOC_CONF: {expandable_segments: maybe}}\n", "must be True or False"),
    ("overlay:\n  set: {model.__dataclass_fields__: 1}\n", "names a Python internal"),
    ("overlay:\n  set: {'model..x': 1}\n", "is not a dotted config path"),
    # OmegaConf's loader (Hydra's, and ours) reads a bare 2020-01-01 as text; an explicit tag still makes a date
    ("overlay:\n  set: {model.num_layers: !!timestamp 2020-01-01}\n", "holds a date"),
    ("x: &a [*a]\noverlay:\n  params: {x: {type: labels}}\n", "refers to itself"),
    (f"x: {'1' * 5000}\noverlay: {{}}\n", "not valid YAML"),
    ("overlay: {}\n" + "# padding\n" * 120_000, "larger than"),
]


@pytest.mark.parametrize("text, fragment", MALFORMED, ids=[f"malformed{i}" for i in range(len(MALFORMED))])
def test_malformed_user_overlay_is_one_clear_problem_and_breaks_nothing_else(tmp_path, text, fragment):
    write_overlay(tmp_path, "bad", text)
    write_overlay(tmp_path, "good", "overlay:\n  summary: fine\n")
    cat = Catalog([tmp_path])                                   # loading never raises
    assert "good" in cat.names() and "bad" not in cat.names()   # the rest still lists
    assert len(cat.problems) == 1 and fragment in cat.problems[0].message, [p.message for p in cat.problems]
    assert cat.problems[0].overlays == ("bad",) and str(tmp_path) in cat.problems[0].field
    with pytest.raises(OverlayError, match="bad.yaml") as exc:   # naming it is the error
        cat.resolve("bad")
    assert fragment in str(exc.value)


def test_every_problem_of_a_file_at_once(tmp_path):
    write_overlay(tmp_path, "bad", "overlay:\n  aliases: abc\n  sources: 5\n  env: {my.var: '1', 9X: '1'}\n  sett: 1\n")
    assert len(Catalog([tmp_path]).problems) == 5


def test_directory_named_like_an_overlay(tmp_path):
    (tmp_path / "mem" / "x.yaml").mkdir(parents=True)
    cat = Catalog([tmp_path])
    assert "not a regular file" in cat.problems[0].message
    with pytest.raises(OverlayError, match="not a regular file"):
        cat.resolve("x")


def test_aliases_string_is_not_three_aliases(tmp_path):
    write_overlay(tmp_path, "mine", "overlay:\n  aliases: abc\n")
    cat = Catalog([tmp_path])
    assert not {"a", "b", "c"} & set(cat.aliases)


def test_yaml_boolean_merge_value_is_the_allocator_spelling(tmp_path):
    # `true` used to stay a bool and compare unequal to "True": "already has X:True; needs X:True".
    write_overlay(tmp_path, "es", "overlay:\n  env: {PYTORCH_CUDA_ALLOC_CONF: {expandable_segments: true}}\n")
    spec = Catalog([tmp_path]).resolve("es")
    assert spec.env == {ALLOC: {"expandable_segments": "True"}}
    assert allocconf.merged(ALLOC, "expandable_segments:True", spec.env[ALLOC]) == ("expandable_segments:True", {})


def test_missing_overlay_dir_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("MBMEM_OVERLAY_DIRS", "/nonexistent")
    cat = Catalog()
    assert "expandable_segments" in cat.names()
    assert any("/nonexistent does not exist" in p.message for p in cat.problems)
    with pytest.raises(OverlayError, match="(?s)unknown overlay 'mine'.*/nonexistent does not exist"):
        cat.resolve("mine")


def test_hydra_search_path_plugin_skips_a_missing_dir(monkeypatch):
    from hydra.core.config_search_path import ConfigSearchPath  # noqa: F401 (the interface the plugin fills)
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra_plugins.mbmem_overlays import MbmemOverlaysSearchPathPlugin
    monkeypatch.setenv("MBMEM_OVERLAY_DIRS", "/nonexistent")
    search_path = ConfigSearchPathImpl()
    MbmemOverlaysSearchPathPlugin().manipulate_search_path(search_path)
    assert [e.provider for e in search_path.get_path()] == ["mbmem-overlays"]


# (user file name, its text, the name that must be refused, fragment)
COLLISIONS = [
    ("mine", "overlay:\n  aliases: [expandable_segments]\n", "expandable_segments", "already the built-in overlay"),
    ("mine", "overlay:\n  aliases: [expandable]\n", "expandable", "already the built-in overlay"),
    ("expandable", "overlay:\n  summary: x\n", "expandable", "already the built-in overlay"),
    ("cpu_offload", "overlay:\n  summary: x\n", "cpu_offload", "already the built-in overlay"),
]


@pytest.mark.parametrize("name, text, refused, fragment", COLLISIONS)
def test_user_overlay_may_not_take_a_builtin_name_or_alias(tmp_path, name, text, refused, fragment):
    write_overlay(tmp_path, name, text)
    cat = Catalog([tmp_path])
    assert cat.specs["expandable_segments"].builtin and cat.specs["cpu_offload"].builtin
    assert len(cat.problems) == 1 and fragment in cat.problems[0].message
    with pytest.raises(OverlayError, match=fragment):
        cat.resolve(refused)
    assert cat.resolve("selective_recompute").builtin  # the rest is untouched


def test_user_user_collision_refuses_the_contested_name(tmp_path):
    write_overlay(tmp_path, "a_first", "overlay:\n  aliases: [shared]\n")
    write_overlay(tmp_path, "b_second", "overlay:\n  aliases: [shared]\n")
    cat = Catalog([tmp_path])
    with pytest.raises(OverlayError, match="already the user overlay a_first"):
        cat.resolve("shared")
    with pytest.raises(OverlayError, match="already the user overlay a_first"):
        cat.resolve("b_second")


# ============================================================================ allocator settings
@pytest.mark.parametrize("text, parsed", [
    ("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", {"roundup_power2_divisions": "[256:1,512:2,1024:4,>:8]"}),
    ("max_split_size_mb:128, roundup_power2_divisions:[256:1, >:8],expandable_segments:True",
     {"max_split_size_mb": "128", "roundup_power2_divisions": "[256:1, >:8]", "expandable_segments": "True"}),
    ("roundup_power2_divisions:4", {"roundup_power2_divisions": "4"}),
])
def test_bracketed_list_values_parse(text, parsed):
    # PyTorch's ConfigTokenizer (c10/core/AllocatorConfig.h): a value is one token or '[' ... ']'.
    assert allocconf.parse(ALLOC, text) == parsed


def test_bracketed_list_merges():
    new, conflicts = allocconf.merged(ALLOC, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                                      {"expandable_segments": "True"})
    assert new == "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True" and conflicts == {}


@pytest.mark.parametrize("text, fragment", [
    ("a:[1,2", "never closed"), ("a:1]", "without a matching"), ("a:[[1]]", "do not nest"),
    ("a:[]", "not key:value"), ("a:b:c", "not key:value"),
])
def test_malformed_lists_are_refused(text, fragment):
    with pytest.raises(allocconf.AllocConfError, match=fragment):
        allocconf.parse(ALLOC, text)


# ============================================================================ config paths (plain dataclasses)
@dataclasses.dataclass
class Inner:
    size: int = 1

    @property
    def doubled(self) -> int:
        return 2 * self.size

    def finalize(self) -> None:
        pass


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    env_vars: dict = dataclasses.field(default_factory=dict)


@pytest.mark.parametrize("path", ["inner.finalize", "inner.doubled", "inner.__class__", "inner.__dataclass_fields__",
                                  "inner.__dict__", "inner..size", "inner.size.real"])
def test_only_declared_fields_are_config_paths(path):
    cfg = Outer()
    assert paths.read(cfg, path) is paths.MISSING
    problem = paths.path_problem(cfg, path, "override")
    assert problem is not None and problem.check == "field_exists"


def test_declared_fields_and_mapping_keys_stay_paths():
    cfg = Outer()
    assert paths.read(cfg, "inner.size") == 1 and paths.path_problem(cfg, "inner.size", "o") is None
    assert paths.path_problem(cfg, "env_vars.NEW_VAR", "o") is None


def test_a_sub_config_cannot_be_replaced_by_a_scalar():
    assert "config object" in paths.type_problem(Inner(), 5)
    assert paths.type_problem(Inner(), None) is None and paths.type_problem(Inner(), Inner(2)) is None


def test_problem_render_never_fails_on_hostile_values():
    huge = 10 ** 5000  # repr() of this raises ValueError (int max str digits)
    text = Problem(("x",), "f", huge, "m", "fix").render()
    assert "fix" in text and len(text) < 400
    looped: list = []
    looped.append(looped)
    assert short_repr(looped)


# ============================================================================ engine and API (real recipe)
@pytest.fixture(scope="module")
def base_cfg(bridge):
    """One real Llama3-8B ConfigContainer per module; each test gets its own deep copy."""
    return bridge.build_recipe(L8)


@pytest.fixture
def cfg(base_cfg):
    return copy.deepcopy(base_cfg)


def unchanged(cfg, env, before_cfg, before_env) -> bool:
    return snapshot(cfg) == before_cfg and dict(env) == before_env




@pytest.mark.bridge
@pytest.mark.parametrize("kwargs, field, fragment", [
    ({"world_size": "8"}, "world_size", "whole number of GPUs, got str"),
    ({"world_size": 8.0}, "world_size", "whole number of GPUs, got float"),
    ({"world_size": True}, "world_size", "whole number of GPUs, got bool"),
    ({"world_size": 0}, "world_size", "at least 1 GPU"),
    ({"world_size": -8}, "world_size", "at least 1 GPU"),
    ({"env": "x"}, "env", "env must be a mutable mapping"),
    ({"env": {"NCCL_X": 1}}, "env", "maps to int"),
    ({"params": ["num_layers", 2]}, "params", "params must be a mapping"),
    ({"params": {1: 2}}, "params", "keys must be text"),
    ({"locked": ["model.x"]}, "locked", "locked must be a mapping"),
    ({"overlays": None}, "overlays", "got NoneType"),
    ({"overlays": 5}, "overlays", "got int"),
    ({"overlays": [None]}, "overlays", "every overlay name must be text"),
    ({"overlays": {"cpu_offload": 1}}, "overlays", "got dict"),
    ({"overlay_dirs": "/tmp"}, "overlay_dirs", "list of directories"),
    ({"catalog": "x"}, "catalog", "must be a Catalog"),
])
def test_wrong_api_arguments_raise_overlay_error_before_touching_anything(cfg, clean_env, kwargs, field, fragment):
    kwargs = {"overlays": ["selective_recompute", "expandable_segments"], "env": clean_env, **kwargs}
    env = kwargs["env"] if isinstance(kwargs["env"], dict) else clean_env
    before_cfg, before_env = snapshot(cfg), dict(env)
    with pytest.raises(OverlayError) as exc:
        apply_overlay(cfg, **kwargs)
    assert any(p.field == field and fragment in p.message for p in exc.value.problems), str(exc.value)
    assert unchanged(cfg, env, before_cfg, before_env)


@pytest.mark.bridge
def test_wrong_cfg_type(clean_env):
    with pytest.raises(OverlayError, match="cfg must be a config object"):
        apply_overlay("not a config", "expandable_segments", env=clean_env)


@pytest.mark.bridge
def test_no_overlays_selects_nothing(cfg, clean_env):
    before_cfg, before_env = snapshot(cfg), dict(clean_env)
    for report in (apply_overlay(cfg, env=clean_env), apply_overlay(cfg, [], env=clean_env)):
        assert report.overlays == () and report.changes == []
        assert any("no overlays selected" in n for n in report.notes)
    assert unchanged(cfg, clean_env, before_cfg, before_env)


@pytest.mark.bridge
@pytest.mark.parametrize("world_size", [0, 10 ** 12])
def test_absurd_world_size_with_validation_changes_nothing(cfg, monkeypatch, world_size):
    # world size 0: the engine refuses it. 10**12: Bridge's runtime_config_update rejects it (eval
    # batch not divisible by DP), and so does our batch-divisibility rule once it exists; either way
    # an OverlayError, and nothing stays applied (issue 15 #6).
    monkeypatch.delenv(ALLOC, raising=False)
    before_cfg, before_env = snapshot(cfg), dict(os.environ)
    with pytest.raises(OverlayError) as exc:
        apply_overlay(cfg, ["selective_recompute", "optimizer_offload", "expandable_segments"], env=os.environ,
                      world_size=world_size, validate=True)
    assert unchanged(cfg, os.environ, before_cfg, before_env)
    if world_size == 0:
        assert [p.field for p in exc.value.problems] == ["world_size"]
    if isinstance(exc.value, ValidationRejected):
        assert exc.value.problems[0].overlays == ("bridge",) and not exc.value.report.validation.ok


# Configs Bridge's runtime_config_update rejects. Our own rules grow; the test uses the first one
# they do not (yet) catch, so the rejection really comes from Bridge.
BRIDGE_ONLY = [["model.seq_length=4096"], ["dataset.seq_length=4096"], ["train.micro_batch_size=3"]]


@pytest.mark.bridge
def test_bridge_rejection_rolls_back_cfg_and_os_environ(bridge, monkeypatch):
    monkeypatch.delenv(ALLOC, raising=False)
    overlays = ["selective_recompute", "optimizer_offload", "expandable_segments"]
    for overrides in BRIDGE_ONLY:
        cfg = bridge.build_recipe(L8)
        bridge.apply_overrides(cfg, overrides)
        try:
            engine.plan_overlays(cfg, overlays, env=dict(os.environ), world_size=2)
        except OverlayError:
            continue  # our rules catch this one before Bridge
        break
    else:
        pytest.fail("every candidate in BRIDGE_ONLY is now caught by our rules; add one only Bridge rejects")
    before_cfg, before_env = snapshot(cfg), dict(os.environ)
    with pytest.raises(ValidationRejected) as exc:
        apply_overlay(cfg, overlays, env=os.environ, world_size=2, validate=True)
    assert unchanged(cfg, os.environ, before_cfg, before_env)
    problem = exc.value.problems[0]
    assert problem.overlays == ("bridge",) and exc.value.report.validation.error in problem.message
    assert not exc.value.report.validation.ok and exc.value.report.changes  # what would have changed


@pytest.mark.bridge
def test_passing_validation_still_applies(cfg, clean_env):
    report = apply_overlay(cfg, ["selective_recompute"], env=clean_env, world_size=2, validate=True)
    assert report.validation.ok and cfg.model.recompute_granularity == "selective"


@pytest.mark.bridge
def test_validator_exception_leaves_everything_unchanged(cfg, clean_env):
    before_cfg, before_env = snapshot(cfg), dict(clean_env)

    def exploding(cfg_copy, world_size, env):
        raise RuntimeError("validator exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        engine.apply_overlay(cfg, ["selective_recompute", "expandable_segments"], env=clean_env, validator=exploding)
    assert unchanged(cfg, clean_env, before_cfg, before_env)


@pytest.mark.bridge
@pytest.mark.parametrize("world_size", [0, -1, True])
def test_absurd_world_sizes_are_refused_by_plan(cfg, clean_env, world_size):
    with pytest.raises(OverlayError) as exc:
        engine.plan_overlays(cfg, "expandable_segments", env=clean_env, world_size=world_size)
    assert exc.value.problems[0].field == "world_size"


@pytest.mark.bridge
def test_user_overlay_with_dotted_env_var_changes_nothing(cfg, clean_env, tmp_path):
    # Before: KeyError after the field writes, and the undo raised KeyError again (issue 15 #5).
    write_overlay(tmp_path, "dotted", "overlay:\n  set: {model.recompute_granularity: selective}\n  env: {my.var: '1'}\n")
    before_cfg, before_env = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError, match="'my.var' is not a valid environment variable name"):
        apply_overlay(cfg, ["dotted"], env=clean_env, overlay_dirs=[str(tmp_path)])
    assert unchanged(cfg, clean_env, before_cfg, before_env)


@pytest.mark.bridge
@pytest.mark.parametrize("var", ["my.var", "X=1; touch /tmp/pwned #", "9LIVES", ""])
def test_resolver_output_env_names_are_checked(cfg, clean_env, tmp_path, monkeypatch, var):
    write_overlay(tmp_path, "resolved", "overlay:\n  set: {model.recompute_granularity: selective}\n")

    def resolver(view, params):
        return {}, {var: "1"}

    monkeypatch.setitem(rules.RESOLVERS, "resolved", resolver)
    before_cfg, before_env = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError) as exc:
        apply_overlay(cfg, ["resolved"], env=clean_env, overlay_dirs=[str(tmp_path)])
    problem = exc.value.problems[0]
    assert problem.overlays == ("resolved",) and "not a valid environment variable name" in problem.message
    assert unchanged(cfg, clean_env, before_cfg, before_env)


class FailingEnv(dict):
    """An environment whose second write fails (as os.environ does for a value the OS refuses)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.writes = 0

    def __setitem__(self, key, value):
        self.writes += 1
        if self.writes == 2:
            raise OSError("the OS refused this variable")
        super().__setitem__(key, value)


@pytest.mark.bridge
def test_failure_while_writing_env_rolls_back_fields_and_env(cfg, clean_env, tmp_path):
    write_overlay(tmp_path, "two_vars", "overlay:\n  set: {model.recompute_granularity: selective}\n"
                  "  env: {MBMEM_A: '1', MBMEM_B: '2'}\n")
    env = FailingEnv(clean_env)
    before_cfg, before_env = snapshot(cfg), dict(env)
    with pytest.raises(OSError, match="refused"):
        apply_overlay(cfg, ["two_vars"], env=env, overlay_dirs=[str(tmp_path)])
    assert unchanged(cfg, env, before_cfg, before_env)


@pytest.mark.bridge
@pytest.mark.parametrize("params, ok", [
    ({"lora_regather.strict": True, "lora_sp_regather.strict": False}, False),
    ({"lora_regather": {"strict": False}, "lora_sp_regather.strict": True}, False),
    ({"strict": False, "lora_regather.strict": True}, False),
    ({"strict": 1, "lora_sp_regather.strict": True}, False),   # 1 is not True for a bool parameter
    ({"lora_regather.strict": False, "lora_sp_regather.strict": False}, True),
])
def test_alias_and_canonical_parameter_conflicts(bridge, clean_env, params, ok):
    cfg = bridge.build_recipe("llama3_8b_peft_config")
    bridge.apply_overrides(cfg, ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"])
    if ok:
        report = apply_overlay(cfg, "lora_regather", env=clean_env, params=params)
        assert report.params["lora_sp_regather"]["strict"] is False
        return
    before_cfg, before_env = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError, match="given twice with different values") as exc:
        apply_overlay(cfg, "lora_regather", env=clean_env, params=params)
    assert exc.value.problems[0].field == "mem.lora_sp_regather.strict"
    assert unchanged(cfg, clean_env, before_cfg, before_env)


@pytest.mark.bridge
@pytest.mark.parametrize("setting, fragment", [
    ("model.finalize: 1", "has no field 'finalize'"),
    ("model.validate_parallelism: 1", "has no field 'validate_parallelism'"),
    ("model: 5", "config object"),
    ("optimizer: {lr: 1}", "config object"),
    ("model.__class__: 1", "names a Python internal"),
])
def test_methods_dunders_and_whole_sections_are_not_settable(cfg, clean_env, tmp_path, setting, fragment):
    write_overlay(tmp_path, "hostile", f"overlay:\n  set: {{{setting}}}\n")
    before_cfg, before_env = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError, match=fragment):
        apply_overlay(cfg, ["hostile"], env=clean_env, overlay_dirs=[str(tmp_path)])
    assert unchanged(cfg, clean_env, before_cfg, before_env)
    assert callable(cfg.model.finalize)


@pytest.mark.bridge
def test_real_config_methods_are_not_paths(cfg):
    for path in ("model.finalize", "model.__dataclass_fields__", "model.__class__", "finalize", "validate"):
        assert paths.read(cfg, path) is paths.MISSING
        assert paths.path_problem(cfg, path, "override") is not None


@pytest.mark.bridge
def test_bracketed_allocator_setting_merges_in_apply(cfg, clean_env):
    clean_env[ALLOC] = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    report = apply_overlay(cfg, "expandable_segments", env=clean_env)
    assert clean_env[ALLOC] == "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True"
    assert report.env_to_export[ALLOC] == clean_env[ALLOC]


@pytest.mark.bridge
def test_broken_unselected_user_overlay_is_a_warning(cfg, clean_env, tmp_path):
    write_overlay(tmp_path, "broken", "overlay:\n  env: hello\n")
    report = apply_overlay(cfg, "selective_recompute", env=clean_env, overlay_dirs=[str(tmp_path)])
    assert any("overlay.env must be a mapping" in w for w in report.warnings)
    with pytest.raises(OverlayError, match="overlay.env must be a mapping"):
        apply_overlay(cfg, "broken", env=clean_env, overlay_dirs=[str(tmp_path)])


@pytest.mark.bridge
def test_user_overlay_alias_cannot_replace_a_builtin_in_apply(cfg, clean_env, tmp_path):
    write_overlay(tmp_path, "mine", "overlay:\n  aliases: [expandable_segments]\n  set: {model.num_layers: 1}\n")
    before_cfg, before_env = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError, match="already the built-in overlay expandable_segments"):
        apply_overlay(cfg, "expandable_segments", env=clean_env, overlay_dirs=[str(tmp_path)])
    assert unchanged(cfg, clean_env, before_cfg, before_env)

"""Fuzzing user overlay files (issue 15, acceptance): random YAML structures in a temporary overlay
directory. Loading, listing, resolving and applying never raise anything but OverlayError, and a
failed apply leaves the config and the environment byte-identical.

Bounded and derandomized (CI runs everything in 90 minutes): a fixed sequence of examples per run,
about 20 s here after the one Bridge import. The structures are drawn near the schema (the keys and
value shapes an overlay file has, plausible and hostile names) so most examples get past YAML
parsing into the checks, the engine and the apply."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mbmem_overlays import OverlayError, apply_overlay
from mbmem_overlays.core.catalog import PARAM_TYPES, Catalog

from conftest import snapshot

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
overlay_names = st.sampled_from(["fuzz", "fuzz_two", "expandable", "cpu_offload", "lora_regather", "x y", "9x",
                                 "my-overlay", "recompute"])
param_names = st.sampled_from(["p", "q", "num_layers", "overlay", "1x", "a.b"])
field_paths = st.one_of(st.sampled_from([
    "model.num_layers", "model.recompute_granularity", "model.recompute_modules", "train.micro_batch_size",
    "model.finalize", "model.__class__", "model.__dataclass_fields__", "model", "optimizer", "optimizer.lr",
    "env_vars.FOO", "env_vars", "model..x", "peft.dim", "ddp.use_distributed_optimizer", "model.cpu_offloading",
    "mixed_precision", "model.seq_length"]), st.text(max_size=16))
env_names = st.one_of(st.sampled_from(["NCCL_X", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "my.var",
                                       "X=1; touch /tmp/pwned #", "9A", "", "CUDA_DEVICE_MAX_CONNECTIONS"]),
                      st.text(max_size=8))
alloc_keys = st.sampled_from(["expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
                              "garbage_collection_threshold", "bad key", ""])
alloc_values = st.one_of(scalars, st.sampled_from(["True", "False", "[256:1,>:8]", "[", "a:b", "128", "1,2"]))
set_values = st.one_of(values, st.sampled_from(["@p", "@q", "@nope", "selective", "full", ["core_attn"], 2]))
param_info = st.one_of(values, st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.sampled_from([*PARAM_TYPES, "complex"]), values), "choices": values,
    "min": scalars, "max": scalars, "help": values, "extra": values}))
declaration = st.fixed_dictionaries({}, optional={
    "summary": values,
    "aliases": st.one_of(values, st.lists(overlay_names, max_size=3)),
    "params": st.one_of(values, st.dictionaries(param_names, param_info, max_size=3)),
    "set": st.one_of(values, st.dictionaries(field_paths, set_values, max_size=4)),
    "env": st.one_of(values, st.dictionaries(env_names, st.one_of(
        scalars, st.dictionaries(alloc_keys, alloc_values, max_size=3)), max_size=3)),
    "sources": st.one_of(values, st.lists(st.text(max_size=10), max_size=2)),
    "effect": values,
    "sett": values,
})
# Well-formed files with real claims (some still refused by the engine: a method, a whole section, a
# type mismatch, a dotted variable), so the planning and the apply run on most examples, not only the schema.
plausible = st.fixed_dictionaries({"summary": st.just("fuzz")}, optional={
    "set": st.dictionaries(st.sampled_from([
        "model.recompute_granularity", "model.recompute_modules", "model.recompute_method", "model.recompute_num_layers",
        "train.micro_batch_size", "model.num_layers", "model.cpu_offloading", "optimizer.lr", "model.finalize",
        "model", "env_vars.FUZZ_VAR", "model.seq_length", "ddp.use_distributed_optimizer"]),
        st.sampled_from([1, 2, 0, -1, 0.5, True, False, None, "selective", "full", "uniform", ["core_attn"], ["mlp"],
                         "@p", "@num_layers"]), max_size=3),
    "env": st.fixed_dictionaries({}, optional={
        "NCCL_FUZZ": st.sampled_from(["1", "0"]), "CUDA_DEVICE_MAX_CONNECTIONS": st.sampled_from(["1", "32"]),
        "PYTORCH_CUDA_ALLOC_CONF": st.dictionaries(
            st.sampled_from(["expandable_segments", "max_split_size_mb", "roundup_power2_divisions"]),
            st.sampled_from(["True", "False", "128", "[256:1,>:8]"]), min_size=1, max_size=2)}),
    "aliases": st.lists(st.sampled_from(["fz", "fuzzy", "expandable"]), max_size=1),
})
hostile_documents = st.fixed_dictionaries({"overlay": st.one_of(declaration, values)},
                                          optional={"p": set_values, "q": values, "num_layers": scalars})
plausible_documents = st.fixed_dictionaries({"overlay": plausible},
                                            optional={"p": st.integers(0, 4), "num_layers": st.integers(0, 4)})
documents = st.one_of(plausible_documents, hostile_documents)
file_names = st.one_of(st.sampled_from(["fuzz", "fuzz_two", "my-overlay"]), overlay_names)
plausible_files = st.dictionaries(st.sampled_from(["fuzz", "fuzz_two", "my-overlay"]),
                                  plausible_documents.map(yaml.safe_dump), min_size=1, max_size=2)
hostile_files = st.dictionaries(file_names, documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                                min_size=1, max_size=3)


def catalogue_of(files: dict[str, str]) -> Catalog:
    """The catalogue with ``files`` as one user directory (read at once; the folder is then removed)."""
    with tempfile.TemporaryDirectory(prefix="mbmem-fuzz-") as tmp:
        (Path(tmp) / "mem").mkdir()
        for name, text in files.items():  # Hydra's header first, so the checks after it are what is fuzzed
            (Path(tmp) / "mem" / f"{name}.yaml").write_text(f"# @package mem.{name}\n{text}", encoding="utf-8")
        return Catalog([tmp])


def exercise_catalogue(cat: Catalog, candidates: list[str]) -> None:
    """What `mbmem list` and `explain` do: names, summaries, aliases, problems, resolve."""
    for name in cat.names():
        spec = cat.specs[name]
        assert isinstance(spec.summary, str) and all(isinstance(a, str) for a in spec.aliases)
    for problem in cat.problems:
        assert problem.render()
    for name in candidates:
        try:
            cat.resolve(name)
        except OverlayError as exc:
            assert str(exc)


@settings(max_examples=150, **SETTINGS)
@given(files=hostile_files)
def test_random_overlay_structures_load_and_list(files):
    cat = catalogue_of(files)
    exercise_catalogue(cat, list(files))


@settings(max_examples=100, **SETTINGS)
@given(text=st.one_of(st.text(max_size=200), st.sampled_from([
    "overlay: {}\n", "overlay:\n  set: {a: &x [*x]}\n", "&a [*a]", "overlay: !!python/object:os.system {}\n",
    "overlay: !!binary aGVsbG8=\n", "overlay:\n  set: {model.num_layers: !!set {a, b}}\n", "\x00", "---\n---\n",
    "overlay:\n  env: {A: \"\\0\"}\n"])))
def test_random_text_files_load_and_list(text):
    cat = catalogue_of({"fuzz": text})
    exercise_catalogue(cat, ["fuzz"])


@pytest.fixture(scope="module")
def base_cfg(bridge):
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    return cfg, snapshot(cfg)


@pytest.mark.bridge
@settings(max_examples=120, **SETTINGS)
@given(files=st.one_of(plausible_files, hostile_files),
       params=st.one_of(st.none(), st.dictionaries(st.sampled_from(["p", "fuzz.p", "fuzz.q", "num_layers"]),
                                                   scalars, max_size=2)),
       alloc=st.sampled_from([None, "", "max_split_size_mb:128", "roundup_power2_divisions:[256:1,>:8]",
                              "expandable_segments:False", "garbage"]))
def test_random_overlays_apply_atomically(base_cfg, files, params, alloc):
    cfg_template, before = base_cfg
    cat = catalogue_of(files)
    for selection in ([*files], [*files, "expandable_segments", "selective_recompute"]):
        cfg = copy.deepcopy(cfg_template)
        env = {} if alloc is None else {"PYTORCH_CUDA_ALLOC_CONF": alloc}
        env_before = dict(env)
        try:
            report = apply_overlay(cfg, selection, env=env, params=params, world_size=8, catalog=cat)
        except OverlayError as exc:
            event("refused")  # --hypothesis-show-statistics shows how many applies got how far
            assert str(exc)
            assert snapshot(cfg) == before and env == env_before
        else:
            event("applied with changes" if report.changes else "applied, nothing to change")

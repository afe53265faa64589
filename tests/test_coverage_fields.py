"""memory/coverage.py's field classification (FIELD_CLASSES) and the scan that finds fields nobody has classified,
and bench/recipe_census.py's pure parts (world size, the summary line)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbmem_overlays.memory import coverage as C

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Base:
    num_layers: int = 1
    rotary_base: float = 10000.0
    some_new_knob: bool = False
    modules: list = field(default_factory=list)


_Base.__module__ = "megatron.core.transformer.fake"   # stands for megatron-core's TransformerConfig


@dataclass
class _Provider(_Base):
    rotary_base: float = 500000.0      # a provider that changes a base default sets a feature as a recipe does
    global_kv_channels: int = 512      # a field the provider adds: set at its own default, still an architecture
    hf_model_id: str = ""


def test_non_default_fields_compares_with_the_first_declaration_and_sees_undeclared_attributes():
    p = _Provider()
    assert dict(C.non_default_fields(p)) == {"rotary_base": 500000.0, "global_kv_channels": 512}
    p.global_kv_channels = 0
    assert dict(C.non_default_fields(p)) == {"rotary_base": 500000.0, "global_kv_channels": 0}
    p.some_new_knob, p.modules = True, ["x"]
    p.use_fused_mhc = True                         # set on an instance whose class does not declare it
    assert dict(C.non_default_fields(p)) == {"rotary_base": 500000.0, "global_kv_channels": 0, "some_new_knob": True,
                                             "modules": ["x"], "use_fused_mhc": True}


def test_unclassified_fields_leaves_out_what_is_read_listed_or_classified():
    p = _Provider(num_layers=4, global_kv_channels=0)   # model.num_layers: read by the plan
    p.some_new_knob = True                         # nobody has classified it
    p.moe_latent_size = 512                        # NOT_MODELLED
    cfg = SimpleNamespace(model=p)
    assert "model.rotary_base" in C.FIELD_CLASSES
    # global_kv_channels: Gemma 4 dense's full-attention head size, a NOT_MODELLED entry now
    assert C.unclassified_fields(cfg) == (("model.some_new_knob", "True"),)


def test_a_conditional_entry_names_its_field_only_where_it_changes_memory():
    def cfg(parallel_output, tp, fp8=None, mtp_bf16=False):
        return SimpleNamespace(model=SimpleNamespace(parallel_output=parallel_output, tensor_model_parallel_size=tp,
                                                     fp8=fp8, keep_mtp_spec_in_bf16=mtp_bf16))
    named = lambda c: [n.split("=")[0] for n in C.conditional_unmodelled(c)]  # noqa: E731
    assert named(cfg(False, 4)) == ["model.parallel_output"]
    assert named(cfg(False, 1)) == [] and named(cfg(True, 4)) == []
    assert named(cfg(True, 1, fp8=None, mtp_bf16=True)) == []            # bf16 job: MTP "kept in bf16" is no change
    # keep_mtp_spec_in_bf16 is read by nothing (megatron-core's MTP takes the global FP8 context): never named
    assert named(cfg(True, 1, fp8="hybrid", mtp_bf16=True)) == []


def test_an_encoder_built_from_the_hf_config_is_named_as_adding_memory():
    """Qwen2-Audio's provider builds its audio tower from hf_config.audio_config (qwen_audio/modeling_qwen2_audio.py
    :137), Ministral 3 its vision tower from hf_config.vision_config; neither carries model.vision_config, so the
    plan names the encoder (moves up) and, frozen, the language model's state it still counts (moves down)."""
    def cfg(**hf):
        return SimpleNamespace(model=SimpleNamespace(hf_config=SimpleNamespace(**hf), freeze_language_model=True,
                                                     vision_config=None))
    gaps = {g.name: g for g in C.gaps(C.not_modelled(cfg(audio_config={"d_model": 1280})))}
    assert gaps["model.hf_config"].moves == C.UP and gaps["model.freeze_language_model"].moves == C.DOWN
    assert "model.hf_config" in {g.name for g in C.gaps(C.not_modelled(cfg(vision_config={})))}
    assert not C.not_modelled(SimpleNamespace(model=SimpleNamespace(hf_config=SimpleNamespace(text_config={}))))
    planned = cfg(vision_config={})
    planned.model.vision_config = SimpleNamespace()   # a VL provider: its encoder and freeze flags are planned
    assert not {"model.hf_config", "model.freeze_language_model"} & {g.name for g in C.gaps(C.not_modelled(planned))}


def test_the_classification_table_is_consistent():
    listed = {u.path for u in C.NOT_MODELLED}
    assert not set(C.FIELD_CLASSES) & (C.MODEL_READS | listed), "a field is classified twice"
    for path, fc in C.FIELD_CLASSES.items():
        assert fc.kind in ("neutral", "covered", "bounded", "conditional") and fc.reason, path
        assert (fc.when is not None) == (fc.kind == "conditional"), path
        if fc.kind == "covered":
            assert fc.covered_by in listed or fc.covered_by in C.FIELD_CLASSES, f"{path} -> {fc.covered_by}"


def test_a_sub_config_object_is_shown_by_its_type_not_its_repr():
    class VisionConfig:
        def __repr__(self):
            return "{\n  a very long multi-line repr\n}"
    cfg = SimpleNamespace(model=SimpleNamespace(vision_config=VisionConfig()))
    assert "model.vision_config=<VisionConfig>: a vision encoder" in C.not_modelled(cfg)[0]


def _census():
    spec = importlib.util.spec_from_file_location("recipe_census", ROOT / "bench" / "recipe_census.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("recipe_census", module)   # its dataclasses resolve their annotations through it
    spec.loader.exec_module(sys.modules["recipe_census"])
    module = sys.modules["recipe_census"]
    return module


def test_census_world_size_is_the_names_gpu_count_when_the_layout_divides_it():
    rc = _census()
    m = SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, context_parallel_size=1,
                        expert_model_parallel_size=8, expert_tensor_parallel_size=1)
    assert rc.recipe_world_size(["x.llama_pretrain_64gpu_h100_bf16_config"], m)[0] == 64
    world, why = rc.recipe_world_size(["x.llama_pretrain_12gpu_h100_bf16_config"], m)
    assert world == 32 and "not a multiple" in why          # lcm(TP*PP*CP=8, EP*ETP*PP=32)
    assert rc.recipe_world_size(["x.llama_pretrain_config"], m) == (32, rc.recipe_world_size(["x.y"], m)[1])


def test_census_summary_line_has_the_form_the_issue_asks_for():
    rc = _census()
    rows = [rc.Row("a", "m.a", built=True, planned=True),
            rc.Row("b", "m.b", built=True, planned=True, not_modelled=["model.moe_token_dispatcher_type=flex: x"]),
            rc.Row("c", "m.c", failure="no config.json: org/m (no public source found)")]
    assert rc.summary_line(rows) == ("recipes: 3 functions, 2 build offline, 1 fully modelled, 1 with unmodelled "
                                     "features (top: moe_token_dispatcher_type 1)")


@pytest.fixture(scope="module")
def shipped_recipes(bridge):
    names = ("llama3_8b_pretrain_config", "qwen3_30b_a3b_pretrain_config", "nemotron_3_nano_pretrain_config")
    return {n: bridge.build_recipe(n) for n in names}


@pytest.mark.bridge
def test_every_field_bridge_recipes_set_is_classified(shipped_recipes):
    """Dense, MoE and hybrid recipes as Bridge ships them: no model field is left unclassified (the census checks all
    ~740; a field a new Bridge adds shows up here first)."""
    for name, cfg in shipped_recipes.items():
        assert C.unclassified_fields(cfg) == (), name

"""What answers for the host while a Bridge recipe builds (bridge/build_stand_ins.py): the GPU query of
``apply_flex_dispatcher_backend`` and the file Bridge's wheel lacks, each scoped to the build and restored after it,
and the platform a recipe is named for (bridge/recipes.py platform_of_recipe_function). The pure parts need neither
Bridge nor a GPU; the last test builds the recipes that needed them (marked bridge)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from mbmem_overlays.bridge import build_stand_ins as S
from mbmem_overlays.bridge.recipes import platform_of_recipe_function

torch = pytest.importorskip("torch")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a host with CUDA is asked as Bridge asks it")


def _fn(name: str, module: str):
    f = types.FunctionType((lambda: None).__code__, {}, name)
    f.__module__ = module
    return f


def test_platform_is_read_from_the_name_then_the_module_path():
    assert platform_of_recipe_function(_fn("qwen3_vl_30b_a3b_sft_8gpu_config",
                                           "megatron.bridge.recipes.qwen_vl.h100.qwen3_vl")) == "h100"
    assert platform_of_recipe_function(_fn("llama3_8b_pretrain_8gpu_gb200_bf16_config",
                                           "megatron.bridge.perf_recipes.llama.common")) == "gb200"
    assert platform_of_recipe_function(_fn("nemotron_3_super_pretrain_64gpu_vr200_nvfp4_config",
                                           "megatron.bridge.perf_recipes.nemotronh.vr200.nemotronh")) == "vr200"
    assert platform_of_recipe_function(_fn("my_recipe_config", "my_recipes.module")) is None


def test_planned_gpu_answers_only_what_bridge_reads():
    gb200, b300 = S.planned_gpu("gb200"), S.planned_gpu("b300")
    assert (gb200.major, gb200.minor, b300.major, b300.minor) == (10, 0, 10, 3)
    assert b300.name.startswith("NVIDIA B300")          # flex_dispatcher_backend.py:62's prefix test
    assert S.planned_gpu(None).name == "NVIDIA H100"    # no platform: the plan's default GPU
    assert S.planned_gpu("vr200") is None               # a compute capability the table does not hold
    with pytest.raises(AttributeError, match="total_memory"):
        S.planned_gpu("h100").total_memory               # never an invented figure


@cpu_only
def test_the_gpu_query_is_answered_inside_the_build_only_and_restored_after_an_error():
    real = torch.cuda.get_device_properties
    with pytest.raises(RuntimeError):
        real(0)                                          # what a recipe build hits on this host without it
    with S.recipe_build_stand_ins("gb300", modules={}) as notes:
        assert notes == []                               # nothing asked yet, nothing said
        assert torch.cuda.get_device_properties(0).major == 10
    assert torch.cuda.get_device_properties is real
    assert len(notes) == 1 and "NVIDIA GB300" in notes[0] and "10.3" in notes[0]
    with pytest.raises(ValueError), S.recipe_build_stand_ins("h100", modules={}):
        raise ValueError("the recipe failed")
    assert torch.cuda.get_device_properties is real
    with S.recipe_build_stand_ins("vr200", modules={}) as notes:
        assert torch.cuda.get_device_properties is real  # unknown platform: no stand-in, the failure stays
    assert notes == []


def test_a_missing_bridge_file_is_read_from_our_copy_during_the_build_only(tmp_path):
    root, shipped = tmp_path / "bridge", tmp_path / "ours"
    (shipped / "perf_recipes" / "x").mkdir(parents=True)
    (shipped / "perf_recipes" / "x" / "quant.cfg").write_text("configs: {}\n")
    (root / "perf_recipes" / "x").mkdir(parents=True)
    present = root / "perf_recipes" / "x" / "present.cfg"
    present.write_text("mine\n")
    missing = root / "perf_recipes" / "x" / "quant.cfg"
    other = root / "perf_recipes" / "x" / "not_ours.cfg"
    module = types.SimpleNamespace(_CFG=missing, _PRESENT=present, _OTHER=other, _TEXT=str(missing))
    modules = {"megatron.bridge.perf_recipes.x.common": module, "unrelated.module": types.SimpleNamespace(P=missing)}
    found = S.missing_bridge_files(modules, root, shipped)
    assert [(name, rel) for _, name, _, _, rel in found] == [("_CFG", "perf_recipes/x/quant.cfg")]

    with S.recipe_build_stand_ins("h100", modules=modules, root=root, shipped=shipped) as notes:
        assert Path(str(module._CFG)).read_text() == "configs: {}\n"
        assert module._PRESENT == present and module._OTHER == other
    assert module._CFG is missing                        # restored
    assert any("perf_recipes/x/quant.cfg" in n and "wheel lacks" in n for n in notes)


def test_the_shipped_copy_is_bridges_own_file():
    """bridge_files/ holds Bridge's te_quant.cfg unchanged (git blob 646ff9e6..., bridge_files/NOTICE)."""
    import hashlib
    data = (S.SHIPPED_BRIDGE_FILES / "perf_recipes" / "nemotronh" / "te_quant.cfg").read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == "646ff9e6ed5670a4bd2e5e3db0cfdf9f5e67c91c"
    assert "646ff9e6ed5670a4bd2e5e3db0cfdf9f5e67c91c" in (S.SHIPPED_BRIDGE_FILES / "NOTICE").read_text()


@pytest.mark.bridge
@cpu_only
def test_the_recipes_that_needed_them_build_and_say_so():
    """Qwen3-VL's SFT recipe (apply_flex_dispatcher_backend with backend None: Bridge's warning, the config as it
    was) and the Nemotron 3 Super NVFP4 recipe on VR200 (which builds on the GB300 recipe and reads te_quant.cfg)."""
    from mbmem_overlays.bridge.recipes import build_notes, build_recipe
    real = torch.cuda.get_device_properties
    vl = build_recipe("megatron.bridge.recipes.qwen_vl.h100.qwen3_vl.qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config")
    assert torch.cuda.get_device_properties is real
    assert (vl.model.moe_token_dispatcher_type, vl.model.moe_flex_dispatcher_backend) == ("alltoall", None)
    assert [n for n in build_notes(vl) if "NVIDIA H100" in n]
    import copy
    assert build_notes(copy.deepcopy(vl)) == build_notes(vl)   # travels with the config through the planner's copies
    super_ = build_recipe("megatron.bridge.perf_recipes.nemotronh.vr200.nemotronh."
                          "nemotron_3_super_pretrain_64gpu_vr200_nvfp4_config")
    assert super_.model.quant_recipe is not None
    assert [n for n in build_notes(super_) if "te_quant.cfg" in n]
    import megatron.bridge.perf_recipes.nemotronh.gb300.nemotronh as gb300
    assert not isinstance(gb300._TE_QUANT_CFG_PATH, S._ShippedCopy)

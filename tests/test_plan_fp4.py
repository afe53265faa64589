"""NVFP4 (model.fp4), the MXFP8 output projection (fp8_output_proj) and keep_mtp_spec_in_bf16, each term pinned to
the code it comes from (megatron-core 0.19.2 as installed; TE v2.17.1's NVFP4 layout by its formulas)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.activations import quantized_bytes
from mbmem_overlays.memory.buffers import NVFP4_TILE_STATS
from mbmem_overlays.memory.from_config import fp8_weight_copy_bytes, job_fp4, output_proj_copy_bytes, output_proj_fp8
from mbmem_overlays.memory.inputs import FP4, FP4_LAYOUT, FP4_SCALES
from mbmem_overlays.memory.stage_activations import loss_chunk_inputs, mtp_layer_activation

DENSE = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=2, head_dim=128, vocab=2048)
LAY = P.Layout(world=8, seq=4096, mbs=1, gbs=8)
FP4_ST = P.Settings(fp8=True, fp4=True, quant_bytes=FP4_LAYOUT)
FP8_ST = P.Settings(fp8=True)


def _site() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


CITED = [
    ("megatron/core/fp4_utils.py", 76, "packed[-1] = packed[-1] // 2"),
    ("megatron/core/fp4_utils.py", 262, "elif layer_no >= 0 and config.first_last_layers_bf16 and (is_first_layer or is_last_layer):"),
    ("megatron/core/transformer/multi_token_prediction.py", 1181, "if self.config.fp8:"),
    ("megatron/core/optimizer/distrib_optimizer.py", 2843, "elif self.ddp_config.fp4_param_gather:"),
    ("megatron/core/distributed/param_and_grad_buffer.py", 1176,
     "numel = self.nvfp4_packed_numel if self.has_nvfp4_params else self.numel"),
    ("megatron/core/models/gpt/gpt_model.py", 266, "if is_mxfp8_output_proj_active(config)"),
    ("megatron/core/extensions/transformer_engine.py", 1626, "with get_fp8_context(self.config):"),
]


@pytest.mark.parametrize("path,line,text", CITED)
def test_the_cited_lines_say_what_the_terms_read(path, line, text):
    assert text in (_site() / path).read_text().splitlines()[line - 1]


def test_nvfp4_bytes_are_packed_nibbles_with_one_e4m3_scale_per_16():
    assert (FP4, FP4_SCALES, FP4_LAYOUT) == (0.5, 1 / 16, 0.5625)
    assert quantized_bytes("nvfp4") == quantized_bytes("nvfp4", weight=True) == FP4_LAYOUT
    assert NVFP4_TILE_STATS == 8 / 256


def test_weight_copies_under_nvfp4():
    # NVFP4 primary weights: rowwise scales + the columnwise layout beside the packed data in the param buffer
    assert fp8_weight_copy_bytes(True, True, False, fp4=True) == FP4_SCALES + FP4_LAYOUT
    # bf16 weights with NVFP4 compute: TE's cached workspace in both layouts, none with the cache disabled
    assert fp8_weight_copy_bytes(True, False, False, fp4=True) == 2 * FP4_LAYOUT
    assert fp8_weight_copy_bytes(True, False, True, fp4=True) == 0
    assert fp8_weight_copy_bytes(True, True, False) == 1      # FP8 unchanged


def test_fp4_gemm_inputs_are_smaller_than_fp8s_and_bf16_layers_stay_bf16():
    f4 = P.layer_activation_terms(DENSE, LAY, FP4_ST, "attn+mlp")
    f8 = P.layer_activation_terms(DENSE, LAY, FP8_ST, "attn+mlp")
    assert f4["attention_output_fp8"] == pytest.approx(f8["attention_output_fp8"] * FP4_LAYOUT)
    assert P.layer_activation(DENSE, LAY, FP4_ST, "attn+mlp") < P.layer_activation(DENSE, LAY, FP8_ST, "attn+mlp")
    assert P.layer_activation(DENSE, LAY, FP4_ST, "attn+mlp@bf16") == P.layer_activation(
        DENSE, LAY, P.Settings(), "attn+mlp")


def test_job_fp4_reads_fp4_and_fp4_param_and_never_with_fp8():
    assert job_fp4(NS(model=NS(fp4="e2m1", fp8=None, fp4_param=True))) == (True, True)
    assert job_fp4(NS(model=NS(fp4="e2m1", fp8=None, fp4_param=False))) == (True, False)
    assert job_fp4(NS(model=NS(fp4=None, fp8="hybrid", fp4_param=False))) == (False, False)


def test_mtp_layers_of_an_fp4_job_run_in_bf16():
    s = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=2, head_dim=128, vocab=2048, mtp_layers=1)
    assert mtp_layer_activation(s, LAY, FP4_ST) == mtp_layer_activation(s, LAY, P.Settings())
    dense, _ = P.stage_bf16_params(s, LAY, FP4_ST, LAY.pp - 1)
    assert dense > 0 and P.stage_bf16_params(s, LAY, FP8_ST, LAY.pp - 1) == (0.0, 0.0)


def test_fp8_output_proj_keeps_an_mxfp8_input_and_weight_workspace():
    assert output_proj_fp8(NS(fp8_output_proj=True), "mxfp8") and not output_proj_fp8(NS(fp8_output_proj=True), "")
    assert output_proj_copy_bytes(True, False) == 2 * quantized_bytes("mxfp8", weight=True)
    assert output_proj_copy_bytes(True, True) == 0
    on = P.Settings(fp8=True, output_proj_fp8=True, output_proj_copy_bytes=output_proj_copy_bytes(True, False))
    tokens = LAY.seq * LAY.mbs
    assert loss_chunk_inputs(DENSE, LAY, on) == pytest.approx((2 + quantized_bytes("mxfp8")) * DENSE.hidden * tokens)
    assert loss_chunk_inputs(DENSE, LAY, P.Settings()) == pytest.approx(4 * DENSE.hidden * tokens)
    assert P.estimate(DENSE, LAY, on).parameters > P.estimate(DENSE, LAY, FP8_ST).parameters


def test_coverage_names_fp4_only_where_still_blind():
    from mbmem_overlays.memory.coverage import FIELD_CLASSES, MODEL_READS
    assert {"model.fp4", "model.fp4_param", "model.fp8_output_proj"} <= MODEL_READS
    assert FIELD_CLASSES["model.keep_mtp_spec_in_bf16"].kind == "neutral"
    assert "model.fp8_output_proj" not in FIELD_CLASSES


@pytest.mark.bridge
def test_a_shipped_nvfp4_recipe_is_planned_below_its_bf16_sibling_at_the_same_micro_batch(bridge):
    """llama3_8b_pretrain_8gpu_b200: the NVFP4 recipe runs MBS 4 where the bf16 one runs 2, so its whole figure is
    higher; at the bf16 recipe's micro-batch its FP4 weights and GEMM inputs put it below, and fp4 is not named."""
    from mbmem_overlays.bridge.as_run import as_run
    from mbmem_overlays.bridge.overrides import apply_overrides
    from mbmem_overlays.memory.coverage import not_modelled
    base = "megatron.bridge.perf_recipes.llama.b200.llama3.llama3_8b_pretrain_8gpu_b200_"
    bf16 = bridge.build_recipe(base + "bf16_config")
    fp4 = bridge.build_recipe(base + "nvfp4_config")
    assert (bf16.train.micro_batch_size, fp4.train.micro_batch_size) == (2, 4)
    apply_overrides(fp4, ["train.micro_batch_size=2"])
    low, high = (P.estimate(*P.from_config(c, 8, arch=10)) for c in (fp4, bf16))
    assert low.parameters < high.parameters and low.activations < high.activations and low.footprint < high.footprint
    run = as_run(fp4, 8)   # the preset's fp4 on the model, as Bridge's setup leaves it
    assert run.config.model.fp4 and not [n for n in not_modelled(run.config) if n.startswith("model.fp4")]

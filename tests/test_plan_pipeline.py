"""What a pipeline rank holds at its peak: the microbatches alive per model chunk, step by step through
Megatron's schedules (checked against megatron-core's own schedule functions), the last stage's loss chunk, and
megatron-core's global memory buffer under its own attention. Small shapes of our own; the figures are the
formulas the cited code gives."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.pipeline import alive_chunk_microbatches, vp_group
from mbmem_overlays.memory.stage_activations import loss_chunk_inputs

GPT = P.Shape(layers=6, hidden=256, ffn=1024, heads=4, groups=4, head_dim=64, vocab=4096, gated=False)


def _megatron_alive(pp: int, vpp: int, rank: int, m: int, group: int) -> set[tuple[int, ...]]:
    """The alive counts after each forward, replayed from megatron-core's own get_pp_rank_microbatches and
    get_schedule_table (schedules.py), the way forward_backward_pipelining_with_interleaving walks them."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=vpp)
    total, _, warmup, remaining = get_pp_rank_microbatches(m, vpp, group, p2p_communicator=comm)
    chunks = [c for _, c in get_schedule_table(m, vpp, group)]
    alive, seen = [0] * vpp, set()
    for k in range(warmup):
        alive[chunks[k]] += 1
        seen.add(tuple(alive))
    for k in range(remaining):
        alive[chunks[warmup + k]] += 1
        seen.add(tuple(alive))
        alive[vpp - 1 - chunks[k]] -= 1   # get_model_chunk_id(k, forward=False)
    assert total == m * vpp
    return seen


@pytest.mark.parametrize("pp, vpp, m, group", [
    (4, 3, 4, 4), (4, 3, 5, 5), (4, 2, 8, 4), (2, 4, 4, 2), (2, 2, 5, 3), (4, 2, 12, 6), (8, 5, 16, 8)])
def test_the_alive_counts_are_megatrons_schedule(pp, vpp, m, group):
    for rank in range(pp):
        ours, theirs = set(alive_chunk_microbatches(pp, vpp, rank, m, group)), _megatron_alive(pp, vpp, rank, m, group)
        # ours are megatron's moments, less those another moment matches or exceeds in every chunk
        assert ours <= theirs
        assert all(any(all(a >= b for a, b in zip(o, t)) for o in ours) for t in theirs)
        assert not any(o != p and all(a >= b for a, b in zip(o, p)) for o in ours for p in ours)


def test_non_interleaved_1f1b_keeps_pp_minus_rank_microbatches():
    assert alive_chunk_microbatches(4, 1, 0, 8, 4) == ((4,),)
    assert alive_chunk_microbatches(4, 1, 3, 8, 4) == ((1,),)
    assert alive_chunk_microbatches(4, 1, 0, 2, 4) == ((2,),)   # fewer microbatches than stages


def test_even_chunks_give_the_interleaved_warm_up_count():
    # (pp - rank - 1) x 2 + (vpp - 1) x group + 1 chunk-microbatches, each 1/vpp of the stage
    lay = P.Layout(world=8, pp=4, vpp=3, mbs=4, gbs=32, seq=1024)   # dp 2: 4 microbatches
    assert P.in_flight(lay, 3) == pytest.approx(9 / 3)
    assert P.in_flight(lay, 0) == pytest.approx(12 / 3)               # all in warm-up: m x vpp
    # microbatch_group_size_per_vp_stage 5 with 5 microbatches: the last rank runs 2 x 5 warm-up forwards
    tunable = replace(lay, gbs=40, vp_group=5)
    assert P.in_flight(tunable, 3) == pytest.approx(11 / 3)
    assert vp_group(lay) == 4 and vp_group(tunable) == 5
    assert vp_group(replace(lay, vp_group=2)) == 4                    # megatron-core refuses a group below pp


def test_a_chunk_without_layers_weighs_nothing_but_its_loss():
    # 6 layers, PP4 VPP2, embedding and loss counted as layers: chunks (0, 1, 1, 1, 1, 1, 1, 0); the last rank
    # holds one layer (chunk 3) and the loss chunk (7). Warm-up (vpp - 1) x pp = 4 forwards of its layer chunk,
    # then the loss chunk: 4 layer-microbatches beside one loss, not 2.5 stage-units of one layer.
    lay = P.Layout(world=8, pp=4, vpp=2, mbs=4, gbs=32, seq=1024, chunk_layers=(0, 1, 1, 1, 1, 1, 1, 0))
    st = P.Settings()
    assert P.rank_chunks(GPT, lay, 3) == (("attn+mlp",), ())
    layer = P.layer_activation(GPT, lay, st)
    tokens = lay.seq * lay.mbs
    logits = st.logits_bytes * GPT.vocab * tokens
    acts = P.stage_activations(GPT, lay, st, 3).steady
    assert acts == pytest.approx(4 * layer + logits + 2 * P.BF16 * GPT.hidden * tokens, rel=1e-12)
    before = P.stage_activations(GPT, lay, replace(st, without=frozenset({"interleaved_schedule"})), 3).steady
    assert before == pytest.approx(2.5 * layer + logits + 2 * P.BF16 * GPT.hidden * tokens, rel=1e-12)


def test_a_shorter_last_group_can_hold_two_losses():
    # m = 5, group 3 (pp 2): the last group has 2 microbatches, and the last rank runs a second loss chunk's
    # forward before the first one's backward; that one keeps the fp32 softmax the loss saved
    assert max(c[-1] for c in alive_chunk_microbatches(2, 2, 1, 5, 3)) == 2
    lay = P.Layout(world=2, pp=2, vpp=2, mbs=1, gbs=5, seq=512, vp_group=3)
    st = P.Settings()
    detail = dict(P.stage_activations(GPT, lay, st, 1).detail)
    tokens = lay.seq * lay.mbs
    one = st.logits_bytes * GPT.vocab * tokens
    assert detail["loss: logits and their fp32 softmax/gradient (last stage)"] in (
        pytest.approx(one), pytest.approx(one + P.FP32 * GPT.vocab * tokens))


def test_the_loss_chunk_keeps_the_final_norm_and_output_layer_inputs():
    lay = P.Layout(world=4, tp=2, sp=True, pp=2, seq=1024, mbs=2, gbs=8)
    st = P.Settings()
    local = P.BF16 * GPT.hidden * lay.seq * lay.mbs / lay.tp   # sequence-local under SP
    assert loss_chunk_inputs(GPT, lay, st) == pytest.approx(2 * local)
    detail = dict(P.stage_activations(GPT, lay, st, 1).detail)
    assert detail["final norm and output layer inputs (last stage)"] == pytest.approx(2 * local)
    assert "final norm and output layer inputs (last stage)" not in dict(P.stage_activations(GPT, lay, st, 0).detail)
    off = replace(st, without=frozenset({"loss_chunk_inputs"}))
    gain = P.stage_activations(GPT, lay, st, 1).steady - P.stage_activations(GPT, lay, off, 1).steady
    assert gain == pytest.approx(2 * local)


def test_megatron_attention_scores_live_in_the_global_memory_buffer():
    lay = P.Layout(world=4, tp=2, pp=2, seq=1024, mbs=4, gbs=16)
    st = P.Settings(mcore_attention=True, attention_scores="fused_softmax")
    scores = P.BF16 * lay.mbs * GPT.heads // lay.tp * lay.seq * lay.seq
    assert P.global_memory_buffer(GPT, lay, st, 0) == pytest.approx(scores)      # every rank with attention
    assert P.global_memory_buffer(GPT, lay, replace(st, mcore_attention=False), 0) == 0
    # the output layer's SP gather asks for the same name and dtype: one buffer, the larger request
    sp = replace(lay, sp=True)
    gather = P.BF16 * GPT.hidden * lay.seq * lay.mbs
    assert P.global_memory_buffer(GPT, sp, st, 1) == pytest.approx(max(scores, gather))
    assert P.global_memory_buffer(GPT, sp, replace(st, deferred_wgrad_microbatches=2), 1) == pytest.approx(
        max(scores, gather) + gather)                                            # + the drain's "mpu_0"
    assert P.global_memory_buffer(GPT, sp, replace(st, without=frozenset({"mcore_attention_buffer"})), 1) == (
        pytest.approx(gather))
    mamba = replace(GPT, layer_kinds=("mamba",) * 6)
    assert P.global_memory_buffer(mamba, lay, st, 0) == 0                        # no attention layer there


@pytest.mark.bridge
def test_megatron_lm_arguments_reach_the_schedule_and_the_attention(bridge):
    from mbmem_overlays.bridge.megatron_args import load_job
    argv = ["--num-layers", "12", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512",
            "--max-position-embeddings", "512", "--micro-batch-size", "4", "--global-batch-size", "40",
            "--train-iters", "10", "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--bf16",
            "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
    _, lay, st = P.from_config(load_job(argv + ["--microbatch-group-size-per-virtual-pipeline-stage", "5"],
                                        world_size=8).config, 8)
    assert (lay.pp, lay.vpp, lay.microbatches, lay.vp_group) == (4, 3, 5, 5)
    assert not st.mcore_attention
    _, lay, st = P.from_config(load_job(argv[:-4] + ["--transformer-impl", "local"], world_size=1).config, 1)
    assert lay.vp_group == 0 and st.mcore_attention   # unset: the pipeline size (finalize writes it, 0 reads it)

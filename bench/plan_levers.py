"""Issue 31's levers against the measured runs that use them: Megatron-LM's functional-test corpus
(shared/reference/megatron-lm-corpus, SOURCE.md), each case rebuilt as a Bridge recipe with --set overrides, planned,
and put beside its measured `mem-max-allocated-bytes` (torch's allocated_bytes.all.peak on the LAST rank, the last
pipeline stage's last tensor-parallel rank; the value at the last logged step is the job's high-water mark).

Usage: .venv/bin/python bench/plan_levers.py
Nothing is fitted: the plan is printed as it is, with and without the levers' own terms (memory/levers.py
apply_config: Megatron FSDP's gradient and master dtypes, the precision-aware optimizer's per-moment dtypes,
fine-grained offloading), and the difference between two world sizes of the same case, which isolates what FSDP
shards (the activations are the same at every DP).

What the corpus has, and what is compared:
- Megatron FSDP (optim_grads_params): gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor on 8 GPUs (H100, A100, GB200:
  DP 4) and its _1node twin on 4 GB200 (DP 2). The rebuilt recipe keeps what the plan reads (12 layers, hidden
  512, 8 heads, GELU FFN 2048, tied embeddings, GPT-2 BPE vocabulary padded to 50432, MBS 4, GBS 32, seq 1024,
  TP2, fp32 FSDP main weights and gradients); it differs in what the plan does not read (LayerNorm and biases
  instead of RMSNorm without, learned position embeddings, dropout 0.1, deterministic attention).
- Fine-grained activation offloading: the two gpt3_moe_..._fine_grained_offloading cases are MLA + MoE models with
  MTP, an uneven pipeline layout (Et*3|(tt|)*6mL) and the unfused attention backend, none of which the plan models:
  they are listed, not compared.
- The precision-aware optimizer: no corpus case turns it on (the two nemotron3_5 cases set fp32 moments).
"""

import json
import sys
from pathlib import Path

from mbmem_overlays.bridge.overrides import apply_overrides
from mbmem_overlays.bridge.recipes import build_recipe
from mbmem_overlays.bridge.stack import prepare
from mbmem_overlays.memory import levers
from mbmem_overlays.memory import model as P

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "reference" / "megatron-lm-corpus" / "test_cases"
GB = 1e9
GPT3_FSDP = ["model.num_layers=12", "model.hidden_size=512", "model.num_attention_heads=8", "model.num_query_groups=8",
             "model.kv_channels=64", "model.ffn_hidden_size=2048", "model.gated_linear_unit=false",
             "model.share_embeddings_and_output_weights=true", "model.seq_length=1024", "dataset.seq_length=1024",
             "train.micro_batch_size=4", "train.global_batch_size=32", "model.tensor_model_parallel_size=2",
             "model.sequence_parallel=false", "model.context_parallel_size=1", "model.vocab_size=50432", "tokenizer.use_tokenizer_vocab_size=false",
             "model.cross_entropy_loss_fusion=false", "model.add_bias_linear=true",
             "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
             "ddp.megatron_fsdp_main_params_dtype=torch.float32", "ddp.megatron_fsdp_main_grads_dtype=torch.float32"]
ROWS = [  # label, corpus case, golden-values platform, world size, overrides
    ("GPT-3 12L FSDP TP2 DP4 (H100)", "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor", "dev_dgx_h100", 8, GPT3_FSDP),
    ("  A100", "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor", "dev_dgx_a100", 8, GPT3_FSDP),
    ("  GB200", "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor", "dev_dgx_gb200", 8, GPT3_FSDP),
    ("  DP2 (4 GB200, _1node)", "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor_1node", "dev_dgx_gb200", 4, GPT3_FSDP),
]
NOT_COMPARED = [
    ("moe/gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading",
     "MLA + MoE with MTP, an uneven pipeline layout and the unfused attention backend (none modelled)"),
    ("moe/gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading",
     "MLA + MoE, an uneven pipeline layout and the unfused attention backend (not modelled)"),
]


def measured(case: str, platform: str) -> float:
    values = json.loads((CORPUS / case / f"golden_values_{platform}.json").read_text())[
        "mem-max-allocated-bytes"]["values"]
    return max(float(v) for v in values.values() if v == v)   # the high-water mark; NaN steps skipped


def plan(overrides: list[str], world: int, with_levers: bool) -> P.Breakdown:
    cfg = build_recipe("llama3_8b_pretrain_config")
    apply_overrides(cfg, list(overrides))
    original = levers.apply_config
    if not with_levers:   # the model as it was before issue 31's terms
        levers.apply_config = lambda cfg, st: st
    try:
        shape, lay, st = P.from_config(cfg, world)
    finally:
        levers.apply_config = original
    return P.stage_breakdowns(shape, lay, st)[-1]   # the last pipeline stage, which the corpus measures


def main() -> int:
    prepare()
    print(f"{'case':<34}{'measured':>10}{'before':>9}{'err':>8}{'after':>9}{'err':>8}   after: params grads optim "
          "activ other (GB = 1e9 bytes)")
    after_rows = {}
    for label, case, platform, world, sets in ROWS:
        m = measured(case, platform)
        before, after = plan(sets, world, False), plan(sets, world, True)
        after_rows[label] = (m, after)
        parts = " ".join(f"{getattr(after, k) / GB:.3f}" for k in ("parameters", "gradients", "optimizer",
                                                                    "activations", "other"))
        print(f"{label:<34}{m / GB:>10.3f}{before.total / GB:>9.3f}{(before.total / m - 1):>+8.1%}"
              f"{after.total / GB:>9.3f}{(after.total / m - 1):>+8.1%}   {parts}")
    (m4, a4), (m2, a2) = after_rows["  GB200"], after_rows["  DP2 (4 GB200, _1node)"]
    state = lambda b: b.parameters + b.gradients + b.optimizer   # noqa: E731
    print(f"FSDP DP2 -> DP4 on GB200 (the same model and batch): measured {(m2 - m4) / GB:.3f} GB less, planned "
          f"{(state(a2) - state(a4)) / GB:.3f} GB less in sharded state, {(a2.total - a4.total) / GB:.3f} GB in total "
          f"({((a2.total - a4.total) / (m2 - m4) - 1):+.1%})")
    for case, why in NOT_COMPARED:
        print(f"not compared: {case}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

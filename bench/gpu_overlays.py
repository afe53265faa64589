"""One GPU, under ~5 minutes: each single-GPU overlay's peak memory and step time vs baseline,
next to the memory plan's prediction (table + JSON).

Usage: .venv/bin/python bench/gpu_overlays.py [--json out.json] [--steps 8]
Needs: one CUDA GPU, torch and megatron-core (both in requirements/stack.lock). It does NOT need
Transformer Engine or nvidia-resiliency-ext: it trains at the megatron-core level — a GPTModel built
from the tiny recipe's dimensions with the *local* layer spec, forward/backward/AdamW steps with the
overlay's settings applied to the TransformerConfig — because Bridge's pretrain() cannot run without
those packages. Every number printed says which path produced it ("mcore-local").
cpu_offload is skipped (megatron-core asserts TE for it); multi-GPU overlays (lora_sp_regather,
dist_optimizer) are covered by tests/gpu on a multi-GPU node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# overlay -> (TransformerConfig fields, environment)
CASES = {
    "baseline": ({}, {}),
    "selective_recompute[core_attn]": ({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, {}),
    "selective_recompute[mlp]": ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, {}),
    "full_recompute": ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, {}),
    "expandable_segments": ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
}
TINY = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=3584, num_attention_heads=16, num_query_groups=4,
            kv_channels=64, seq=2048, mbs=4, vocab=32000)

CHILD = r"""
import json, os, sys, time
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
fields, tiny, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29517")
torch.distributed.init_process_group("nccl", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1234)
cfg = TransformerConfig(num_layers=tiny["num_layers"], hidden_size=tiny["hidden_size"],
    ffn_hidden_size=tiny["ffn_hidden_size"], num_attention_heads=tiny["num_attention_heads"],
    num_query_groups=tiny["num_query_groups"], kv_channels=tiny["kv_channels"], gated_linear_unit=True,
    activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False, bf16=True,
    params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, **fields)
model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=tiny["vocab"],
                 max_sequence_length=tiny["seq"], position_embedding_type="rope").cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, tiny["vocab"], (tiny["mbs"], tiny["seq"]), device="cuda")
pos = torch.arange(tiny["seq"], device="cuda").unsqueeze(0).expand_as(ids)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
times, losses = [], []
for i in range(steps):
    t = time.perf_counter()
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t); losses.append(loss.item())
steady = sorted(times[2:]) or times
print(json.dumps({"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
                  "step_time": steady[len(steady) // 2], "losses": losses, "device": torch.cuda.get_device_name(),
                  "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}))
"""


def predictions() -> dict[str, float]:
    """The plan model for the same tiny shape (activations use the same terms as `mbmem plan`)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from mbmem_overlays.memory import model as P
    s = P.Shape(layers=TINY["num_layers"], hidden=TINY["hidden_size"], ffn=TINY["ffn_hidden_size"],
                heads=TINY["num_attention_heads"], groups=TINY["num_query_groups"], head_dim=TINY["kv_channels"],
                vocab=TINY["vocab"])
    lay = P.Layout(world=1, seq=TINY["seq"], mbs=TINY["mbs"], gbs=TINY["mbs"])
    # torch AdamW on bf16 params: bf16 grads and bf16 moments, no fp32 master copy
    base = P.Settings(grad_bytes=P.BF16, state_bytes=P.BF16, master_bytes=0)
    out = {}
    for name, (fields, _) in CASES.items():
        st = P.Settings(**{**base.__dict__, "recompute": fields.get("recompute_granularity"),
                           "modules": tuple(fields.get("recompute_modules", ())),
                           "recompute_method": fields.get("recompute_method")})
        out[name] = P.estimate(s, lay, st).total
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # noqa: BLE001
        print(f"bench/gpu_overlays.py needs one CUDA GPU with torch and megatron-core ({exc}); nothing measured.")
        return 2
    pred = predictions()
    results = {}
    for name, (fields, env) in CASES.items():  # one process each: the allocator reads its settings at start-up
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(fields), json.dumps(TINY), str(args.steps)],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            results[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1]) | {"path": "mcore-local",
                                                                             "predicted_bytes": pred[name]}
    base = results.get("baseline", {})
    print(f"{'overlay':<32}{'peak alloc':>12}{'x base':>8}{'reserved':>10}{'step s':>9}{'x base':>8}"
          f"{'plan':>10}{'path':>13}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<32} failed: {r['error']}")
            continue
        ra = r["peak_allocated"] / base["peak_allocated"] if base.get("peak_allocated") else float("nan")
        rt = r["step_time"] / base["step_time"] if base.get("step_time") else float("nan")
        print(f"{name:<32}{r['peak_allocated'] / 2**30:>10.2f}Gi{ra:>8.2f}{r['peak_reserved'] / 2**30:>8.2f}Gi"
              f"{r['step_time']:>9.3f}{rt:>8.2f}{r['predicted_bytes'] / 2**30:>8.2f}Gi{r['path']:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tiny_model": TINY, "results": results}, f, indent=2)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The cost model beside the memory model: what a memory saving costs this job in extra FLOPs, bytes moved per
link and pipeline bubble, and the step time those imply on the GPU it runs on, as a range.

Pure functions over the memory model's frozen dataclasses (Shape, Layout, Settings) and one more
(inputs.CostInputs: the communication overlaps the job asks for), in closed form: a search prices thousands of
candidates. Every term names the code that does the work (megatron-core 0.19.2 as installed, Transformer Engine
v2.17.1, Megatron Bridge 0.6.2); docs/cost-model.md lists them with the GPU table and the bench that holds the
model against NVIDIA's measured throughput effects (bench/cost_accuracy.py).

- ``gpus``: the GPUs (keyed by compute capability, ``--gpu-arch``), their stated peaks with sources, EFFICIENCY,
  NCCL's own link figures and latency model (NCCL_SOURCE), the host's time per launch (LAUNCH_SECONDS)
- ``inputs``: CostInputs and the overlaps Bridge's setup turns on per layout
- ``work``: one layer's demand per microbatch, region by region (GEMM shapes, memory-bound bytes, collectives
  with their count, host launches), and what each recompute label replays
- ``step``: a step's time per assumption, and ``price(before, after)``: a :class:`Cost`
"""

from __future__ import annotations

from typing import Any

from .gpus import (EFFICIENCY, EFFICIENCY_SOURCE, GPUS, LAUNCH_SECONDS, LAUNCH_SOURCE, NCCL_SOURCE, Gpu,  # noqa: F401
                   gpu)
from .inputs import CostInputs, cost_inputs  # noqa: F401
from .step import Cost, Job, cost_range, demand, evaluate, flops_share, price, rank_key, times  # noqa: F401


def job_of(cfg: Any, world: int, *, arch: int | None = None, env: dict[str, str] | None = None) -> Job:
    """(Shape, Layout, Settings, CostInputs) of a Bridge ConfigContainer, as the memory model reads it."""
    from ..from_config import from_config
    shape, lay, st = from_config(cfg, world, arch=arch or 9, env=env)
    return shape, lay, st, cost_inputs(cfg)


def price_configs(before: Any, after: Any, world: int, *, arch: int | None = None,
                  env: dict[str, str] | None = None) -> Cost:
    """The cost of turning config ``before`` into config ``after`` (both realized Bridge configs)."""
    return price(job_of(before, world, arch=arch, env=env), job_of(after, world, arch=arch, env=env), arch)


def cost_text(cost: Any) -> str:
    """A row's cost as one line, whether it is a Cost, its as_dict(), or words (a cost the model does not price)."""
    if isinstance(cost, Cost):
        return cost.text
    if isinstance(cost, dict):
        return str(cost.get("text", ""))
    return str(cost or "")

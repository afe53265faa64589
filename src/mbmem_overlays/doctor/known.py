"""The configuration errors the doctor recognises in a log: the rules' own error fragments, plus a few
raised outside validation, each with its diagnosis and fix."""

from __future__ import annotations

from ..core import rules

CONFIG_FIXES = {  # rule id -> (diagnosis, fix, overlay command fragment)
    "cpu_offload_pipeline": ("activation CPU offloading with PP>1", ("set model.pipeline_model_parallel_size=1, or offload "
                             "optimizer state instead"), "+mem=optimizer_offload"),
    "cpu_offload_recompute": ("activation CPU offloading combined with recompute", "use one of them", "+mem=selective_recompute"),
    "cpu_offload_cuda_graphs": ("activation CPU offloading with CUDA graphs", ("set model.cuda_graph_impl=none, or offload "
                                "optimizer state instead"), "+mem=optimizer_offload"),
    "cpu_offload_num_layers": ("cpu_offloading_num_layers out of range", "use 1 <= mem.cpu_offload.num_layers < num_layers", ""),
    "expandable_segments_nccl_ub": ("NCCL user buffers with expandable segments (torch<2.11)",
                                    "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF or set ddp.nccl_ub=false", ""),
    "precision_aware_optimizer_needs_dist_opt": ("precision-aware optimizer without the distributed optimizer",
                                                 "enable the distributed optimizer", "+mem=dist_optimizer"),
}
EXTRA_CONFIG = {  # errors raised outside validate(), with their fix
    "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access": (
        "expandable_segments_cuda_graphs", "CUDA graphs with expandable segments need NCCL_GRAPH_REGISTER=0",
        "export NCCL_GRAPH_REGISTER=0 (+mem=expandable_segments sets it)", "+mem=expandable_segments"),
}


def config_fragments() -> dict[str, str]:
    table = {frag: c.id for c in rules.CHECKS for frag in c.oracle}
    table.update({frag: v[0] for frag, v in EXTRA_CONFIG.items()})
    return table

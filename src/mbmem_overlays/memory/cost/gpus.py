"""The GPUs the step-time model knows, keyed by compute capability major (``--gpu-arch``), with the public source
of every number, and the one efficiency constant the model uses.

Every figure is a vendor's stated peak per GPU: dense tensor-core throughput (the datasheets print FP8/BF16 with
2:4 sparsity; dense is half), HBM bandwidth, NVLink and host-link bandwidth per direction (the datasheets print
both directions together), the network bandwidth of the GPU's own NIC in NVIDIA's reference system, and that
system's host DRAM bandwidth shared by its GPUs. Where one compute capability covers two parts (H100 and H200,
B200 and GB200) a figure that differs is a (low, high) pair and the cost's range covers both.
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16: tuple[float, float]          # dense BF16 tensor-core FLOP/s
    fp8: tuple[float, float]           # dense FP8 tensor-core FLOP/s (0: no FP8 tensor cores; BF16 is used)
    hbm: tuple[float, float]           # HBM bytes/s
    nvlink: float                      # NVLink bytes/s per direction, per GPU
    host_link: tuple[float, float]     # host <-> device bytes/s per direction (PCIe, or NVLink-C2C)
    network: float                     # the GPU's own NIC, bytes/s per direction
    host_dram: tuple[float, float]     # host DRAM bytes/s available per GPU (the system's, over its GPUs)
    nvlink_domain: int                 # GPUs one NVLink domain holds (a node of the reference system)
    sources: tuple[str, ...]
    # NCCL's own figure for what NVLink delivers per GPU (its per-link bandwidth x the GPU's links), and its cap on
    # the LL protocol's bandwidth (see NCCL_SOURCE); 0: the stated peak
    nvlink_nccl: float = 0.0
    nccl_ll_max: float = 0.0


GPUS: dict[int, Gpu] = {
    8: Gpu("A100 SXM4", bf16=(312 * TERA, 312 * TERA), fp8=(0.0, 0.0), hbm=(1555 * GIGA, 2039 * GIGA),
           nvlink=300 * GIGA, host_link=(32 * GIGA, 32 * GIGA), network=25 * GIGA,
           host_dram=(409.6 * GIGA / 8, 409.6 * GIGA / 8), nvlink_domain=8,
           sources=("NVIDIA A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312 TFLOPS dense (624 sparse), HBM2e "
                    "1,555 GB/s (40GB) / 2,039 GB/s (80GB), NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions)",
                    "NVIDIA DGX A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
                    "nvidia-dgx-a100-datasheet.pdf): 8x ConnectX-6 200 Gb/s HDR (one per GPU), 2x AMD EPYC 7742 "
                    "(8 channels DDR4-3200 each: 2 x 204.8 GB/s)",
                    "A100: 12 third-generation NVLinks; NCCL SM80_NVLINK_BW 20.0 GB/s per link (NCCL_SOURCE)"),
           nvlink_nccl=12 * 20.0 * GIGA, nccl_ll_max=87.7 * GIGA),
    9: Gpu("H100/H200 SXM", bf16=(989.4 * TERA, 989.4 * TERA), fp8=(1978.9 * TERA, 1978.9 * TERA),
           hbm=(3350 * GIGA, 4800 * GIGA), nvlink=450 * GIGA, host_link=(64 * GIGA, 64 * GIGA), network=50 * GIGA,
           host_dram=(614.4 * GIGA / 8, 614.4 * GIGA / 8), nvlink_domain=8,
           sources=("NVIDIA H100 (nvidia.com/en-us/data-center/h100/): H100 SXM BF16 1,979 and FP8 3,958 TFLOPS "
                    "with sparsity (989.4 / 1,978.9 dense), HBM3 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s "
                    "(both directions)",
                    "NVIDIA H200 (nvidia.com/en-us/data-center/h200/): the same Tensor Core figures, HBM3e 4.8 TB/s",
                    "NVIDIA DGX H100 user guide (docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html): "
                    "8x ConnectX-7 400 Gb/s for the compute fabric (one per GPU), 2x Intel Xeon Platinum 8480C "
                    "(Intel ark: 8 channels DDR5-4800 each: 2 x 307.2 GB/s)",
                    "H100: 18 fourth-generation NVLinks; NCCL SM90_NVLINK_BW 20.6 GB/s per link (NCCL_SOURCE)"),
           nvlink_nccl=18 * 20.6 * GIGA, nccl_ll_max=141.0 * GIGA),
    10: Gpu("B200/GB200", bf16=(2250 * TERA, 2500 * TERA), fp8=(4500 * TERA, 5000 * TERA),
            hbm=(7700 * GIGA, 8000 * GIGA), nvlink=900 * GIGA, host_link=(64 * GIGA, 450 * GIGA), network=50 * GIGA,
            host_dram=(716.8 * GIGA / 8, 512 * GIGA / 2), nvlink_domain=8,
            sources=("NVIDIA DGX B200 (nvidia.com/en-us/data-center/dgx-b200/) and HGX B200: BF16 2.25, FP8 4.5 "
                     "PFLOPS dense per GPU, HBM3e 7.7-8 TB/s, NVLink 5 1.8 TB/s (both directions), PCIe Gen5 x16 to "
                     "the host, 8x ConnectX-7 400 Gb/s, 2x Intel Xeon Platinum 8570 (8 channels DDR5-5600 each)",
                     "NVIDIA GB200 NVL72 (nvidia.com/en-us/data-center/gb200-nvl72/): BF16 2.5, FP8 5 PFLOPS dense "
                     "per GPU, HBM3e 8 TB/s, NVLink-C2C 900 GB/s (both directions) to a Grace CPU shared by two GPUs "
                     "(LPDDR5X up to 512 GB/s); the NVL72 NVLink domain (72 GPUs) is not used: 8 assumed",
                     "per-part figures as collected in glennklockwood.com/garden/processors/B200",
                     "B200: 18 fifth-generation NVLinks; NCCL SM100_NVLINK_BW 40.1 GB/s per link (NCCL_SOURCE)"),
            nvlink_nccl=18 * 40.1 * GIGA, nccl_ll_max=2 * 141.0 * GIGA),
}

# The fraction of a tensor-core peak the GEMMs and attention kernels reach: megatron-core 0.19.2's own published
# end-to-end utilization on H100, "MFU increases from 41% to 47-48% with model size", "throughputs include all
# operations (data loading, optimizer steps, communication, and logging)" (.venv megatron_core-0.19.2.dist-info/
# METADATA, Performance Benchmarking, lines 176-197). One value (this range) for every row and GPU. Being
# end-to-end, it already holds some of what the model counts on its own (the bubble, exposed communication), so
# compute time is if anything long and a communication share low. Bandwidths (HBM, links, host) are used at their
# stated peaks: their times are lower bounds.
EFFICIENCY = (0.41, 0.48)
EFFICIENCY_SOURCE = ("megatron-core 0.19.2 METADATA (Performance Benchmarking): 41% to 47-48% end-to-end MFU on H100; "
                     "used as the tensor-core efficiency of every kernel, bandwidths at their stated peaks")


# Collectives (step.py collective_seconds): NCCL's own tuning model, NVIDIA/nccl v2.30.7 (the version torch
# 2.14.1 installs here: nvidia_nccl_cu13-2.30.7), src/graph/tuning.cc and src/graph/topo.h:
# - bandwidth: NCCL's topology figure for one NVLink (topo.h:21-24 SM80_NVLINK_BW 20.0, SM90_NVLINK_BW 20.6,
#   SM100_NVLINK_BW 40.1 GB/s) times the GPU's links (Gpu.nvlink_nccl; against the datasheets' 25 / 25 / 50 GB/s
#   per link and direction: 80%, 82%, 80%), the same for every collective on that GPU; across nodes the NIC's
#   stated rate (NCCL reads the NIC's speed). Per protocol (tuning.cc:327-329): LL at half of it, capped at
#   llMaxBws (:177-182: Ampere 87.7, Hopper 141 GB/s; Blackwell twice Hopper), LL128 at 0.92 of it, Simple all;
# - latency of a ring collective (tuning.cc:384-412): baseLat (:151, ring LL / LL128 / Simple 6.6 / 14.0 / 8.4 us)
#   plus one hwLat per ring step (NVLink :159 0.6 / 1.9 / 3.4 us, network :171 2.7 / 4.0 / 14.0 us; the steps
#   crossing nodes at the network's), nsteps = 2(n - 1) for an all-reduce, n - 1 for an all-gather or a
#   reduce-scatter (:289-291);
# - NCCL runs each collective with its fastest protocol for the size: the model takes the smallest of the three.
NCCL_BASE_LATENCY = (6.6e-6, 14.0e-6, 8.4e-6)          # ring LL, LL128, Simple
NCCL_STEP_LATENCY = {"nvlink": (0.6e-6, 1.9e-6, 3.4e-6), "network": (2.7e-6, 4.0e-6, 14.0e-6)}
NCCL_PROTOCOL_BW = (0.5, 0.92, 1.0)
NCCL_SOURCE = ("NVIDIA/nccl v2.30.7-1 src/graph/topo.h:21-24 (NVLink bandwidth per link by compute capability), "
               "src/graph/tuning.cc:151-182 (base and per-step ring latencies, LL bandwidth caps), :289-291 "
               "(ring steps), :327-329 (protocol bandwidth), :384-412 (latency of a ring collective)")

# Host time per kernel launch (step.py): PyTorch's own published per-call overhead of a torch function on
# torch.Tensor, "on the order of 2 microseconds" (pytorch/pytorch benchmarks/overrides_benchmark/README.md), taken
# for every launch the host makes for a layer (work.py KERNELS) and for one CUDA graph replay. It is the
# dispatcher's floor: the Python of the modules around each op (TE's quantizer and module setup, autograd) is
# not in it, so host time is a lower bound.
LAUNCH_SECONDS = 2e-6
LAUNCH_SOURCE = ("pytorch/pytorch benchmarks/overrides_benchmark/README.md: overhead for torch functions on "
                 "torch.Tensor 'on the order of 2 microseconds'; per host launch (work.py KERNELS) and per graph "
                 "replay")


def gpu(arch: int | None) -> tuple[Gpu, str]:
    """(the table's GPU for compute capability ``arch``, a note when the table has none and the nearest is used)."""
    arch = 9 if arch is None else int(arch)
    if arch in GPUS:
        return GPUS[arch], ""
    nearest = max((a for a in GPUS if a <= arch), default=min(GPUS))
    return GPUS[nearest], (f"no figures for compute capability {arch}: priced at {GPUS[nearest].name}'s "
                           f"(compute capability {nearest})")

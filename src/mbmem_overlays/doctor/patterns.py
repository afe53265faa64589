"""The messages the doctor reads, one small pattern per field, each linear in its input.

Every pattern starts with a literal, has bounded quantifiers and no nested or lazy wildcards, and
runs on bounded text (read.MAX_LINE; a message window of MESSAGE_WINDOW bytes), so no input line can
make it slow (issue 15, item 15: the old single pattern with ``.*?`` went quadratic on a line of
repeated "Of the allocated memory" clauses). A number is read only when it is a whole, sane number:
``1.2.3 GiB`` and a 400-digit capacity are "unknown", never a wrong value or an OverflowError
(issue 15, item 16).

Sources of the formats:
- PyTorch caching allocator: shared/reference/ecosystem-notes.md, "The PyTorch OOM message" (current,
  ~2.1 "capacty" typo, torch <= 2.0 "(GPU 0; X total capacity; ...)", older "cached"), c10/cuda/CUDACachingAllocator.cpp.
- NCCL: ``NCCL WARN Cuda failure 2 'out of memory'`` and ``ncclUnhandledCudaError`` (NCCL's CUDACHECK
  macro prints ``Cuda failure <code> '<cudaGetErrorString>'``; cudaErrorMemoryAllocation is 2).
- cuBLAS/cuDNN: status enums CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED (their API docs).
- CUDA driver/runtime: CUDA_ERROR_OUT_OF_MEMORY (driver API, e.g. from cuMemCreate/cuMemMap, which
  expandable segments and memory-saver allocators call), cudaErrorMemoryAllocation, "CUDA error: out of memory".
- InfiniBand verbs: ``ibv_reg_mr`` / ``ibv_reg_dmabuf_mr`` failures as NCCL's net plugin reports them.
- Linux OOM killer: ``Out of memory: Killed process N (python)``, ``oom-kill:``, Slurm's
  ``Detected N oom_kill event``, a shell's ``Killed``, exit status 137 / torchrun ``exitcode: -9``.
"""

from __future__ import annotations

import re

from ..core.sizes import UNITS

MESSAGE_WINDOW = 2048
MAX_PROCESSES = 16

# A size as PyTorch prints it: a whole number of at most 12 digits with at most 6 decimals, then a unit.
# The look-behind refuses to start inside a longer number; the look-ahead refuses "1.2.3".
_NUM = r"(?<![\d.])(\d{1,12}(?:\.\d{1,6})?)(?![\d.]\d)"
SIZE = _NUM + r"\s?(bytes|[KMGT]iB|[KMGT]B)\b"


def to_bytes(value: str | None, unit: str | None) -> int | None:
    if value is None or unit is None:
        return None
    try:
        return int(float(value) * UNITS[unit.lower()])
    except (ValueError, OverflowError, KeyError):
        return None


def _size(rx: re.Pattern, text: str, group: int = 1) -> int | None:
    m = rx.search(text)
    return to_bytes(m.group(group), m.group(group + 1)) if m else None


# --- the PyTorch caching allocator's message, field by field -------------------------------------
TORCH_ANCHOR = re.compile(r"(CUDA|HIP) out of memory\. ")
REQUESTED = re.compile(r"Tried to allocate " + SIZE)
TOTAL_NEW = re.compile(r"GPU (\d{1,4}) has a total capac(i?)ty of " + SIZE)
FREE_NEW = re.compile(r"of which " + SIZE + r" is free")
SELF_USE = re.compile(r"this process has " + SIZE + r" memory in use")
PROCESS_USE = re.compile(r"Process (\d{1,10}) has " + SIZE + r" memory in use")
ALLOWED = re.compile(SIZE + r" allowed;")
ALLOC_NEW = re.compile(r"Of the allocated memory " + SIZE + r" is allocated by PyTorch")
PRIVATE = re.compile(r"with " + SIZE + r" allocated in private pools")
RESERVED_UNALLOC = re.compile(r"and " + SIZE + r" is reserved by PyTorch but unallocated")
TOTAL_OLD = re.compile(r"\(GPU (\d{1,4}); " + SIZE + r" total capacity")
ALLOC_OLD = re.compile(SIZE + r" already allocated")
FREE_OLD = re.compile(SIZE + r" free;")
RESERVED_OLD = re.compile(SIZE + r" reserved in total(?: by PyTorch|\s{0,8}\Z)")   # a cut line may end at "total"
CACHED_OLD = re.compile(SIZE + r" cached\)")


def torch_oom_fields(text: str) -> dict:
    """The numbers of one PyTorch OOM message (``text`` starts at its "out of memory"); None = not read."""
    m = TORCH_ANCHOR.search(text)
    if m:  # a second message on the same line is parsed on its own
        nxt = TORCH_ANCHOR.search(text, m.end())
        text = text[m.start():nxt.start() if nxt else m.start() + MESSAGE_WINDOW]
    else:
        text = text[:MESSAGE_WINDOW]
    out: dict = {"device": m.group(1) if m else ("HIP" if "HIP" in text else "CUDA"),
                 "requested": _size(REQUESTED, text)}
    new = TOTAL_NEW.search(text)
    old = TOTAL_OLD.search(text)
    if new or "is reserved by PyTorch but unallocated" in text or "Of the allocated memory" in text:
        out["format"] = "torch 2.1 (capacty typo)" if new and not new.group(2) else "torch >= 2.1"
        out["gpu"] = int(new.group(1)) if new else None
        out["capacity"] = to_bytes(new.group(3), new.group(4)) if new else None
        out["free"] = _size(FREE_NEW, text)
        out["allocated"] = _size(ALLOC_NEW, text)
        out["private_pools"] = _size(PRIVATE, text)
        out["reserved_unallocated"] = _size(RESERVED_UNALLOC, text)
        out["complete"] = "but unallocated" in text
    elif old or "already allocated" in text:
        out["gpu"] = int(old.group(1)) if old else None
        out["capacity"] = to_bytes(old.group(2), old.group(3)) if old else None
        out["free"] = _size(FREE_OLD, text)
        out["allocated"] = _size(ALLOC_OLD, text)
        reserved = _size(RESERVED_OLD, text)
        # torch <= 1.3 printed "X cached)" as the cache's amount minus the allocated one (THCCachingAllocator:
        # format_size(stats.amount_cached - stats.amount_allocated), "memory held by the allocator but not used
        # by the program"): already the reserved-but-unallocated figure; 1.4 to 2.0 print the reserved total.
        cached = _size(CACHED_OLD, text) if reserved is None else None
        out["format"] = "torch <= 1.3 (cached)" if cached is not None else "torch <= 2.0"
        if cached is not None:
            out["reserved_unallocated"] = cached
        else:
            out["reserved_unallocated"] = (max(0, reserved - out["allocated"])
                                           if reserved is not None and out["allocated"] is not None else None)
        out["complete"] = reserved is not None or cached is not None
    else:
        out["format"] = "unknown (truncated before the numbers)"
        out["complete"] = False
    out["allowed"] = _size(ALLOWED, text)
    out["self_in_use"] = _size(SELF_USE, text)
    out["processes"] = [(int(p.group(1)), to_bytes(p.group(2), p.group(3)))
                        for p, _ in zip(PROCESS_USE.finditer(text), range(MAX_PROCESSES))]
    return out


# Fields that a wrapped message continues with (a wrapping log collector, or a rank prefix per piece).
CONTINUATION = re.compile(r"^\s{0,8}(?:GPU \d|of which|Including non-PyTorch|this process|Process \d|Of the allocated|"
                          r"is allocated|with \d|and \d|is reserved|reserved|unallocated|If reserved|\d{1,12}(?:\.\d{1,6})?\s?"
                          r"(?:bytes|[KMGT]iB)|[a-z]{1,12} (?:of|has|is|memory|by|in)\b|[\d.]{1,12}\s?(?:bytes|[KMGT]iB)\b)")

# --- other families ---------------------------------------------------------------------------------
NCCL_OOM = re.compile(r"(?:Cuda failure (?:2|'out of memory')|NCCL WARN[^\n]{0,300}?(?:out of memory|Failed to CUDA "
                      r"(?:calloc|malloc|host alloc)|cuMem\w{0,16} failed)|ncclUnhandledCudaError[^\n]{0,300}?out of memory|"
                      r"NCCL error[^\n]{0,200}?out of memory)")
NCCL_BYTES = re.compile(r"(?:Failed to CUDA (?:calloc|malloc)|cuMemCreate|alloc(?:ate)?)[^\n]{0,40}?(\d{1,15}) bytes")
WORKSPACE = re.compile(r"(CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE|"
                       r"HIPBLAS_STATUS_ALLOC_FAILED|MIOPEN_STATUS_ALLOC_FAILED|rocblas_status_memory_error)")
# CUresult / cudaError code 2 is CUDA_ERROR_OUT_OF_MEMORY / cudaErrorMemoryAllocation (CUDA driver and runtime API
# enums); memory-saver libraries print it as "CUresult error result=2" or "CUresult error: 2 (out of memory)".
DRIVER = re.compile(r"(CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|hipErrorMemoryAllocation|"
                    r"CUDA (?:driver )?(?i:error): out of memory|"
                    r"hipErrorOutOfMemory|HIP error: out of memory|CUresult(?: error)?[:=\s]{1,4}(?:result=)?2\b|"
                    r"cudaError(?:_t)?[:=\s]{1,4}2\b|"
                    r"cuMem(?:Create|Map|SetAccess|AddressReserve)\b[^\n]{0,200}?(?:fail|error|out of memory|\b2\b)|"
                    r"cu_mem_(?:create|map)\b[^\n]{0,200}?(?:fail|error|out of memory|\b2\b))")
MEMORY_SAVER = re.compile(r"(?i:torch_memory_saver|memory[_ ]saver|sleep[_ ]mode|wake[_ ]up|CuMemAllocator)")
REGISTRATION = re.compile(r"(ibv_reg_(?:dmabuf_)?mr|ncclCommRegister|ncclMemAlloc|NCCL_USER_BUFFER|register (?:user )?buffer)"
                          r"[^\n]{0,300}?(?:Bad address|failed|error|errno|EFAULT)")
HOST_OOM = re.compile(r"(Out of memory: Kill(?:ed)? process \d{1,10}|oom-kill(?:er)?:|invoked oom-killer|Memory cgroup out of memory|"
                      r"Detected \d{1,9} oom[_-]kill events?|oom_kill event|OOM Killed|OOMKilled|"
                      r"Some of your processes may have been killed by the cgroup out-of-memory handler|"
                      # the process's own host allocations failing: Python, NumPy, C++, errno ENOMEM
                      r"(?<![A-Za-z])MemoryError\b|_ArrayMemoryError|std::bad_alloc|\[Errno 12\] Cannot allocate memory|"
                      # torch's CPU allocator (c10/core/impl/alloc_cpu.cpp): "DefaultCPUAllocator: can't allocate memory"
                      r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory))")
SHELL_KILLED = re.compile(r"(?:^\s{0,8}|: |\d )Killed(?:\s{2,60}\S[^\n]{0,300})?\s{0,4}$")
EXIT_137 = re.compile(r"(?:exit(?:ed with)? (?:code|status)[ :=]{0,3}137\b|exitcode\s{0,8}:\s{0,4}-9\b|"
                      r"Signal 9 \(SIGKILL\)|died with <Signals\.SIGKILL: 9>|ExitCode(?:=| )9:0|signal 9\b|Exit code 137)")
SIGTERM_VICTIM = re.compile(r"(?:Signal 15 \(SIGTERM\)|exitcode\s{0,8}:\s{0,4}-15\b|<Signals\.SIGTERM: 15>|"
                            r"Sending process \d{1,10} closing signal SIGTERM|received SIGTERM|exit(?:ed with)? code 143\b)")

# --- anything else that says out of memory (issue 23 §3) --------------------------------------------------
# A line that says it in any usual spelling is an OOM, "unsure" at least, even when no family above claims it:
# "no OOM" may never be said with confidence about a log that holds one. The allocation wordings need a word
# about memory on the line ("failed to allocate a port" is not an OOM).
OOM_WORDS = re.compile(r"((?i:out[ _-]?of[ _-]?memory|cannot allocate memory|(?:not enough|insufficient) "
                       r"(?:(?:gpu|device|cuda|free|host|pinned) )?memory|out of resource)|"
                       r"(?<![A-Za-z_])OOM(?![A-Za-z])|MemoryAllocation|_ALLOC_FAILED|OutOfResources|"
                       r"CUresult(?: error)?[:=\s]{1,4}(?:result=)?2\b|cudaError(?:_t)?[:=\s]{1,4}2\b)")
ALLOC_WORDS = re.compile(r"(?i:(?:failed|unable|could not|cannot) to allocate|(?:failed|unable|could not|cannot) allocate|"
                         r"alloc(?:ation)? (?:failed|failure|error))")
MEMORY_WORDS = re.compile(r"(?i:memory|bytes|\d\s?[KMGT]i?B\b|cuda|gpu|device|calloc|malloc|workspace|buffer|tensor|hbm|vram)")
# What every match of OOM_WORDS or ALLOC_WORDS contains, as lower-case substrings: a line without any of them is
# passed over before the (case-insensitive, so slower) regexes run; 1 MB lines of allocator clauses are mostly such.
_OOM_LITERALS = ("oom", "out of resource", "outofresources", "memoryallocation", "_alloc_failed", "curesult",
                 "cudaerror")
_OUT_OF_MEMORY_WORDS = ("out", "cannot allocate", "enough", "insufficient")
_ALLOC_FAILURE_WORDS = ("fail", "unable", "could not", "cannot", "error")


def may_say_out_of_memory(low: str) -> bool:
    """False only when ``low`` (a line, lower-cased) cannot match OOM_WORDS or ALLOC_WORDS."""
    if any(w in low for w in _OOM_LITERALS):
        return True
    if "memory" in low and any(w in low for w in _OUT_OF_MEMORY_WORDS):
        return True
    return "alloc" in low and any(w in low for w in _ALLOC_FAILURE_WORDS)


# Words before the match that make it a mention, not a report ("to avoid OOM", "may run out of memory").
MENTION = re.compile(r"(?i:\b(?:avoid(?:s|ing)?|prevent(?:s|ing)?|reduc(?:e|es|ing)|risk|may|might|could|would|if|"
                     r"whether|in case|help(?:s)?|without|fewer|less likely|to save|suggest|recommend|tip|hint|"
                     r"try|consider|when)\b)")
# The abbreviated message some reporters paste: "OutOfMemoryError: Tried to allocate X. GPU had Y free of Z".
FREE_OF = re.compile(SIZE + r" free(?: of (\d{1,12}(?:\.\d{1,6})?)(?:\s?([KMGT]iB|[KMGT]B))?)?")
# Megatron-LM and Bridge print this when training returns (training.py / pretrain.py "after training is done").
END_OF_TRAINING = re.compile(r"after training is done")

# --- capacity per GPU ------------------------------------------------------------------------------------
NVIDIA_SMI_MEMORY = re.compile(r"\|\s{0,40}(\d{1,7})MiB\s{0,4}/\s{0,4}(\d{1,7})MiB\s{0,4}\|")
# torch's _CudaDeviceProperties repr: total_memory in MiB ("total_memory=81079MB").
TORCH_DEVICE_MEMORY = re.compile(r"total_memory=(\d{1,9})MB\b")

# --- context ------------------------------------------------------------------------------------------
TORCH_VERSION = re.compile(r"(?i:\b(?:py)?torch)(?:[ _]version)?\s{0,4}(?:==|[:=]|\s)\s{0,4}v?(\d{1,2})\.(\d{1,3})(?:\.\d{1,4})?")
RANK_PREFIX = re.compile(r"^\s{0,4}(?:\[?\d{4}-\d\d-\d\d[ T][\d:.,]{8,15}\]?\s{1,4})?"
                         r"(?:\[(?:rank|default)(\d{1,6})\]:|(\d{1,6}): |\[1,(\d{1,6})\]<std(?:out|err)>:)")
RANK_TAG = re.compile(r"\[(?:rank|default)(\d{1,6})\]:")       # anywhere in a line's head (NeMo-Run adds its own)
RANK_PREFIXES = re.compile(rb"\[(?:rank|default)(\d{1,6})\]:")
TORCHRUN_RANK = re.compile(r"^\s{0,8}rank\s{0,8}:\s{0,4}(\d{1,6})")
TORCHRUN_EXIT = re.compile(r"^\s{0,8}exitcode\s{0,8}:\s{0,4}(-?\d{1,4})")
# The counts below are read in ASCII digits only ((?a): `\d` also takes other scripts' digits, which int() reads):
# one rule for every world size and layout a log states (core/values.py ascii_int, issue 39 #2).
WORLD = [  # (pattern, how to read the world size), first match of the highest-priority kind wins
    ("launcher", re.compile(r"(?a)\b(?:WORLD_SIZE|world[_ ]size|using world size)\s{0,4}[=:]?\s{0,4}(\d{1,7})\b")),
    ("launcher", re.compile(r"(?a)\bworld_size\s{1,4}\.{2,80}\s{1,4}(\d{1,7})\b")),      # Megatron-LM's arguments dump
    ("torchrun", re.compile(r"(?a)--nproc[_-]per[_-]node[= ]{1,3}(\d{1,4})\b[^\n]{0,400}?--nnodes[= ]{1,3}(\d{1,6})\b")),
    ("torchrun", re.compile(r"(?a)--nnodes[= ]{1,3}(\d{1,6})\b[^\n]{0,400}?--nproc[_-]per[_-]node[= ]{1,3}(\d{1,4})\b")),
    ("torchrun", re.compile(r"(?a)(?:torchrun|distributed\.run)\b[^\n]{0,400}?--nproc[_-]per[_-]node[= ]{1,3}(\d{1,4})\b")),
    ("slurm", re.compile(r"(?a)\bSLURM_(?:NTASKS|NPROCS)\s{0,2}[=:]\s{0,2}(\d{1,7})\b")),
    ("slurm", re.compile(r"(?a)(?:--ntasks|(?<![\w-])-n)[= ](\d{1,7})\b")),
    ("slurm", re.compile(r"(?a)(?:--nodes|(?<![\w-])-N)[= ](\d{1,6})\b[^\n]{0,400}?--ntasks-per-node[= ](\d{1,4})\b")),
    ("slurm", re.compile(r"(?a)--ntasks-per-node[= ](\d{1,4})\b[^\n]{0,400}?(?:--nodes|(?<![\w-])-N)[= ](\d{1,6})\b")),
]
SLURM_NODES = re.compile(r"(?a)(?:--nodes|(?<![\w-])-N)[= ](\d{1,6})\b")
SLURM_TASKS_PER_NODE = re.compile(r"(?a)--ntasks-per-node[= ](\d{1,4})\b")
# srun's summary of tasks that ended: "srun: error: node-7: tasks 0-2,4-7: Terminated"
SRUN_TASKS = re.compile(r"(?a)tasks? ([\d,-]{1,200}): (Terminated|Killed|Exited with exit code \d{1,3})")
# Config values printed in the log: Bridge/Megatron-core dataclass dumps (``key: value``), Megatron-LM's
# argument table (``key ........ value``), Hydra overrides (``model.key=value``). Names: megatron-core's
# TransformerConfig / DDP / optimizer fields (bridge-config-surface.md §1), inference-engine knobs.
CONFIG_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size", "expert_model_parallel_size", "data_parallel_size", "micro_batch_size",
               "global_batch_size", "seq_length", "recompute_granularity", "recompute_method", "recompute_num_layers",
               "recompute_modules", "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_activations",
               "use_distributed_optimizer", "nccl_ub", "sequence_parallel", "optimizer_cpu_offload",
               "optimizer_offload_fraction", "num_layers", "gpu_memory_utilization", "mem_fraction_static",
               "enable_sleep_mode", "cuda_graph_impl", "use_te_rng_tracker", "num_workers", "use_tp_pp_dp_mapping")
CONFIG_VALUE = re.compile(r"(?a)(?<![\w])(" + "|".join(CONFIG_KEYS) + r")(?![\w])"
                          r"(?:\s{0,4}[=:]\s{0,4}|\s{1,4}\.{2,80}\s{1,4}|\s{1,4})"
                          r"(\[[^\]\n]{0,200}\]|'[^'\n]{0,60}'|\"[^\"\n]{0,60}\"|[\w.+-]{1,40})")
# The header of the arguments dump Megatron-LM prints before training (arguments.py _print_args, since December
# 2020; bridge/megatron_args.py reads it): the job's whole configuration is in the log (doctor --plan reads it). The
# shorter header of 2020's Megatron-LM is GPT-NeoX's too: it marks a Megatron-LM dump only when the lines after it
# are Megatron-LM's ('  {name} {dots} {value}'), not NeoXArgs' ('  {name} {dots} {value}{dots}default').
MEGATRON_ARGS_DUMP = re.compile(r"(?<!-)-{24} arguments -{24}(?!-)")
# Megatron-LM's tokenizer size before padding (training/tokenizer/tokenizer.py _vocab_size_with_padding, every release
# since 2019): " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)".
PADDED_VOCAB = re.compile(r"(?a)padded vocab \(size: (\d{1,9})\) with \d{1,9} dummy tokens \(new size: \d{1,9}\)")
MEGATRON_ARGS_DUMP_2020 = re.compile(r"(?<!-)-{20} arguments -{20}(?!-)")
DUMP_VALUE_LINE = re.compile(r"^(?:\S{0,64}: ?)?\s{1,4}[A-Za-z_]\w{0,120} \.* \S")
NEOX_VALUE = re.compile(r"\.{2,}(?:default|updated)\s*$")
MEGATRON_LM_SIZES = re.compile(r"(?a)(?<![\w-])(tensor|pipeline|data|context|expert)-(?:model-)?parallel size: (\d{1,6})")
LAYOUT_SHORT = re.compile(r"(?a)(?<![\w])(TP|PP|VPP|CP|EP|DP)\s{0,2}[=:]\s{0,2}(\d{1,6})\b")
# "export PYTORCH_CUDA_ALLOC_CONF=a:b", "PYTORCH_CUDA_ALLOC_CONF: a:b", and a printed dict
# "{'PYTORCH_CUDA_ALLOC_CONF': 'a:b'}" (Bridge's cfg.env_vars).
ALLOC_SET = re.compile(r"(?:^|[\s'\"{])(?:export\s{1,4})?(PYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF)['\"]?\s{0,2}[=:]\s{0,2}['\"]?"
                       r"([^'\"\s,}]{1,300}(?:,[^'\"\s,}]{1,300}){0,30})")
LAUNCH = re.compile(r"(?<![\w/.-])(srun|torchrun|python3?|uv run|mpirun|deepspeed|accelerate launch|bash)\s")
SCRIPT = re.compile(r"[\w./-]{0,200}\.py\b")
# A training script and its flags at the start of a line, without a launcher word (an echoed command).
BARE_SCRIPT = re.compile(r"\s{0,8}(?:\+{1,3}\s)?(?P<cmd>[\w./-]{1,200}\.py\s{1,8}--[A-Za-z])")
SLURM_JOB = re.compile(r"\bSLURM_JOB_ID\s{0,2}[=:]\s{0,2}(\d{1,12})\b|\bStepId=(\d{1,12})\b|\bslurm-(\d{1,12})\.out\b|"
                       r"\bjob (\d{1,12})\b")
# Colocated inference engines reserving their share at start-up (vLLM's worker and SGLang's memory pool errors).
ENGINE_FREE = re.compile(r"Free memory on device \((\d{1,6}(?:\.\d{1,4})?)/(\d{1,6}(?:\.\d{1,4})?) GiB\) on startup is less "
                         r"than desired GPU memory utilization \((\d?\.\d{1,4}|1), (\d{1,6}(?:\.\d{1,4})?) GiB\)")
ENGINE_SHARE_TOO_SMALL = re.compile(r"(No available memory for the cache blocks|larger than the maximum number of tokens "
                                    r"that can be stored in KV cache|Not enough memory\. Please try to increase "
                                    r"--mem-fraction-static)")
INFERENCE_ENGINE = re.compile(r"(?i:\b(vllm|sglang|tensorrt[-_]llm|lmdeploy)\b)")

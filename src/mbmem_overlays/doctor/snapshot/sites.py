"""Who allocated a block: its allocation site and its category, read from the recorded stack.

Frames are innermost first. The site is the first frame of user or Megatron code: C++ frames (the
allocator, ``torch::unwind::unwind()``, dispatcher wrappers, the CPython interpreter) and framework
internals (``torch/``, Transformer Engine, Apex, Triton, the Python standard library) are skipped, so a
stack recorded with C++ frames (``stacks="all"``) attributes like a Python-only one. A stack with no such
frame falls back to its innermost Python frame, then to its first C++ frame that is not allocator
plumbing. The category comes from the first frame, innermost first, that a category rule matches.

Frames are the file's own objects, shared between entries (torch dedups them); results are cached by
object identity, and at most MAX_FRAMES frames of one stack are looked at, so the cost stays linear.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MAX_FRAMES = 512
NO_STACK = "<no stack: allocated before history recording started, or recorded without context>"

# Python files that are framework internals, not the caller's code.
_INTERNAL_PY = re.compile(r"(^|/)(torch|transformer_engine|apex|triton|nvfuser|thunder|torchao|_pytest|pluggy)/"
                          r"|(^|/)lib/python3[^/]*/(?!site-packages/|dist-packages/)|^<|/<frozen ")
# C++ frames that are allocation plumbing (_memory_viz's _frame_filter list, plus the dispatcher and allocator).
_PLUMBING = ("unwind::unwind", "CapturedTraceback", "gather_with_cpp", "_start", "__libc_start", "PyEval_",
             "PyObject_", "PyFunction_", "_PyEval", "_Py", "Py_", "PyRun_", "PyCode_", "CUDACachingAllocator",
             "c10::impl::", "at::_ops::", "at::detail::", "c10::Dispatcher", "wrapper_", "at::empty",
             "at::native::empty", "c10::cuda::", "torch::autograd::VariableType", "??")


# In a C++-only stack (autograd's thread, stacks="all"), the autograd node names the operation better than the
# ATen helper that allocated for it ("MmBackward0::apply" rather than "at::(anonymous namespace)::create_out").
_AUTOGRAD_NODE = re.compile(r"\b\w+Backward\d*::apply\b")


@dataclass(frozen=True)
class Site:
    text: str             # "megatron/core/transformer/attention.py:512 (forward)"
    category: str


def _frame(f: Any) -> tuple[str, int, str] | None:
    if type(f) is not dict:
        return None
    filename, line, name = f.get("filename"), f.get("line"), f.get("name")
    if type(filename) is not str or type(name) is not str:
        return None
    # a line number past any file's (a many-thousand-digit integer cannot even be printed) reads as unknown: 0
    return filename[:500], line if type(line) is int and 0 <= line < 1 << 31 else 0, name[:300]


def _short(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + len(marker):]
    i = filename.find("megatron/")
    if i >= 0:
        return filename[i:]
    return "/".join(filename.split("/")[-3:])


def is_python(filename: str) -> bool:
    return filename.endswith(".py")


def is_internal(filename: str) -> bool:
    return bool(_INTERNAL_PY.search(filename))


# (category, file pattern, function-name pattern or None); first rule matching a frame wins, innermost frame first.
_MODULES = (("attention", r"transformer/(attention|dot_product_attention|multi_latent_attention)\.py"
                          r"|extensions/.*attention"),
            ("mlp", r"transformer/mlp\.py"), ("moe", r"transformer/moe/"), ("mamba", r"megatron/core/ssm/"),
            ("embedding", r"models/common/embeddings/|language_model_embedding"),
            ("output layer and loss", r"tensor_parallel/cross_entropy\.py|fusions/fused_cross_entropy"
                                      r"|models/gpt/gpt_model\.py|models/common/language_module/"),
            ("layernorm", r"fusions/fused_layer_norm|transformer/torch_norm"),
            ("transformer layer", r"transformer/transformer_layer\.py"),
            ("transformer block", r"transformer/transformer_block\.py"))
_RULES = [
    ("CUDA graphs", re.compile(r"transformer/cuda_graphs\.py|torch/cuda/graphs\.py"), None),
    ("communication buffers", re.compile(r"tensor_parallel/mappings\.py|pipeline_parallel/p2p_communication\.py"
                                         r"|torch/distributed/|megatron/core/distributed/.*(fsdp|bucket)"), None),
    ("communication buffers", re.compile(r"megatron/core/distributed/param_and_grad_buffer\.py"),
     re.compile(r"grad_sync|param_sync|reduce|gather")),
    ("optimizer state", re.compile(r"megatron/core/optimizer/|torch/optim/|apex/optimizers/"
                                   r"|transformer_engine/pytorch/optimizers/|emerging_optimizers/"), None),
    ("parameters and gradient buffers", re.compile(r"megatron/core/distributed/(param_and_grad_buffer|"
                                                   r"distributed_data_parallel)\.py|torch/nn/parameter\.py"
                                                   r"|megatron/bridge/models/|training/checkpointing\.py"), None),
    ("parameters and gradient buffers", re.compile(r"megatron/core/(tensor_parallel/layers|transformer/|models/)"
                                                   r"|torch/nn/modules/module\.py"),
     re.compile(r"^(__init__|_initialize_affine_weight\w*|_apply|to|cuda|reset_parameters)$")),
    ("activations: recompute", re.compile(r"tensor_parallel/random\.py"), re.compile(r"checkpoint|backward")),
    *((f"activations: {label}", re.compile(pattern), None) for label, pattern in _MODULES),
    ("backward (gradients and temporaries)", re.compile(r"torch/autograd/"), re.compile(r"backward|_engine_run")),
    ("backward (gradients and temporaries)", re.compile(r"pipeline_parallel/schedules\.py"), re.compile(r"backward")),
    ("inputs (batch)", re.compile(r"gpt_step\.py|training/utils/batch|megatron/bridge/data/|get_batch"), None),
    # Hugging Face stacks (snapshots of non-Megatron jobs read the same way)
    ("optimizer state", re.compile(r"bitsandbytes/optim/"), None),
    ("parameters and gradient buffers", re.compile(r"transformers/modeling_utils\.py|accelerate/(big_modeling|utils/"
                                                   r"modeling)\.py"), None),
    ("activations: PEFT adapters", re.compile(r"peft/tuners/"), re.compile(r"forward")),
    ("activations: transformers model", re.compile(r"transformers/models/[^/]+/modeling_"), re.compile(r"forward")),
    ("activations: other", re.compile(r"pipeline_parallel/schedules\.py"), re.compile(r"forward")),
]
_CPP_RULES = (("communication buffers", ("ProcessGroupNCCL", "c10d::", "nccl")),
              ("backward (gradients and temporaries)", ("torch::autograd::Engine",)))
PRIVATE_POOL = "CUDA graphs (private memory pool)"
PLAN_COMPONENT = {"parameters and gradient buffers": "parameters+gradients", "optimizer state": "optimizer"}


def plan_component(category: str) -> str:
    """The memory model's component a snapshot category belongs to (memory/model.py Breakdown)."""
    if category in PLAN_COMPONENT:
        return PLAN_COMPONENT[category]
    if category.startswith(("activations", "backward", "inputs")):
        return "activations"
    return "other"


class Attributor:
    """Sites and categories of stacks, cached by the identity of the file's frame objects: a stack is keyed by the
    ids of its frames (computed in C), so the many entries that share one code path cost one scan."""

    def __init__(self):
        self._frame_cache: dict[int, tuple] = {}
        self._stack_cache: dict[tuple, Site] = {}
        self._list_cache: dict[int, Site] = {}   # the same list object again (an alloc and its free)
        self._keep: list = []   # the frames behind cached ids stay alive, so their ids stay theirs

    def _info(self, f: Any) -> tuple:
        parsed = _frame(f)
        if parsed is None:
            hit: tuple = (None, False, False, None)
        else:
            filename, line, name = parsed
            py = is_python(filename)
            if py:
                category = next((cat for cat, fpat, npat in _RULES
                                 if fpat.search(filename) and (npat is None or npat.search(name))), None)
            else:
                category = next((cat for cat, needles in _CPP_RULES if any(n in name for n in needles)), None)
            hit = (parsed, py, py and not is_internal(filename), category)
        self._frame_cache[id(f)] = hit
        self._keep.append(f)
        return hit

    def site(self, frames: Any, private_pool: bool = False) -> Site:
        if type(frames) is not list or not frames:
            hit = Site(NO_STACK, "unknown (no stack)")
        else:
            hit = self._list_cache.get(id(frames))
            if hit is None:
                head = frames[:MAX_FRAMES]
                key = tuple(map(id, head))
                hit = self._stack_cache.get(key)
                if hit is None:
                    hit = self._scan(head)
                    self._stack_cache[key] = hit
                    self._keep.append(head)
                self._list_cache[id(frames)] = hit
                self._keep.append(frames)
        return Site(hit.text, PRIVATE_POOL) if private_pool else hit

    def _scan(self, frames: list) -> Site:
        """One pass: the first user frame (the site) and the first frame a category rule matches."""
        cached = self._frame_cache.get
        text = category = first_py = first_cpp = first_node = None
        for f in frames:
            info = cached(id(f)) or self._info(f)
            parsed, py, user, cat = info
            if parsed is None:
                continue
            if category is None and cat is not None:
                category = cat
            if text is None:
                if user:
                    text = _text(parsed)
                elif py and first_py is None:
                    first_py = parsed
                elif not py and first_node is None and _AUTOGRAD_NODE.search(parsed[2]):
                    first_node = parsed
                elif not py and first_cpp is None and not any(p in parsed[2] for p in _PLUMBING):
                    first_cpp = parsed
            if text is not None and category is not None:
                break
        if text is None:
            cpp = first_node or first_cpp
            text = (_text(first_py) if first_py is not None else
                    f"(C++) {cpp[2][:160]}" if cpp is not None else NO_STACK)
        return Site(text, category or "other")


def _text(parsed: tuple[str, int, str]) -> str:
    filename, line, name = parsed
    return f"{_short(filename)}:{line} ({name})"

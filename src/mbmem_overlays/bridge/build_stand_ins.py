"""What a recipe function asks of the host while it builds, answered on a CPU host as the recipe's platform would.

Two things stop Bridge 0.6.2 recipes from building on a host without a GPU or from the installed wheel, neither of
them a property of the job:

1. **The GPU query of ``apply_flex_dispatcher_backend``.** Bridge's training/flex_dispatcher_backend.py:53-59 asks
   ``torch.cuda.get_device_properties(0)`` whenever the backend named is not one of deepep / hybridep / ncclep
   (those take a CPU shortcut at :53-57), and reads the answer's ``major`` and ``name`` (:60-88) to decide whether
   the named backend runs on that GPU. The Qwen3-VL 30B / 235B SFT and PEFT recipes call it with
   ``moe_flex_dispatcher_backend=None`` (recipes/qwen_vl/h100/qwen3_vl.py:241, :382, :523, :672, :822, :972), which
   on any GPU reaches the ``else`` branch (:89-95): a warning, and the config unchanged. While such a recipe builds,
   and only then, ``torch.cuda.get_device_properties`` answers with ``PlannedGPU``: the GPU of the platform the
   recipe is named for (``PLATFORM_GPUS``; H100 for a recipe named for none, the plan's default GPU), with the two
   attributes Bridge reads, and nothing else (any other attribute raises, so a recipe that needs more of the device
   fails as before instead of reading an invented figure). It is restored when the build returns or raises. A host
   with CUDA is asked as Bridge asks it. A platform whose compute capability the table does not hold (Rubin:
   r100 / vr200) gets no stand-in.
2. **Files Bridge's wheel lacks.** The Nemotron 3 Super NVFP4 perf recipes read
   ``perf_recipes/nemotronh/te_quant.cfg`` (perf_recipes/nemotronh/common.py:37, ``_TE_QUANT_CFG_PATH``; read by
   perf_recipes/nemotronh/{b200,b300,gb200,gb300}/nemotronh.py, ``load_quantization_recipe``). The file is in
   Bridge's repository (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/perf_recipes/nemotronh/te_quant.cfg, blob
   ``646ff9e6ed5670a4bd2e5e3db0cfdf9f5e67c91c``, the same at tag v0.6.0 and on branch r0.6.0 at
   ``6124fbe38a68eea9c4f4be3aa5e084bd5d461d98``, and the only content the file has ever had), but the 0.6.2 wheel
   carries only ``.py`` files: its pyproject.toml finds packages (``[tool.setuptools.packages.find]``) and declares no
   package data, so the ``.cfg`` is left out (a packaging bug). It is data (a YAML table of Transformer Engine
   quantization matchers), under Bridge's Apache-2.0 license, and ships here unchanged as
   ``bridge_files/perf_recipes/nemotronh/te_quant.cfg`` (bridge_files/NOTICE). While a recipe builds, a module
   global of its function that is a ``Path`` to a missing file inside the installed ``megatron/bridge`` package, and
   whose path there we ship, points to our copy; restored afterwards. An installed Bridge that has the file is read
   as it is.

Each stand-in that answered is returned as a sentence for the plan's assumptions (``build_notes``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHIPPED_BRIDGE_FILES = Path(__file__).with_name("bridge_files")

# The GPU of each platform a Bridge recipe is named for: the name prefix NVIDIA gives it and its compute capability
# (NVIDIA's CUDA GPU table, developer.nvidia.com/cuda-gpus: A100 8.0, H100 / H200 / GH200 9.0, B200 / GB200 10.0,
# B300 / GB300 10.3). The driver reports longer names ("NVIDIA H100 80GB HBM3"); Bridge reads only their prefix
# (flex_dispatcher_backend.py:62, ``name.startswith(("NVIDIA B200", "NVIDIA B300"))``).
PLATFORM_GPUS: dict[str, tuple[str, int, int]] = {
    "a100": ("NVIDIA A100", 8, 0), "h100": ("NVIDIA H100", 9, 0), "h200": ("NVIDIA H200", 9, 0),
    "gh200": ("NVIDIA GH200", 9, 0), "b200": ("NVIDIA B200", 10, 0), "gb200": ("NVIDIA GB200", 10, 0),
    "b300": ("NVIDIA B300", 10, 3), "gb300": ("NVIDIA GB300", 10, 3),
}
DEFAULT_PLATFORM = "h100"   # the plan's default GPU (cli/common.py DEFAULT_GPU_ARCH = 9)


@dataclass(frozen=True)
class PlannedGPU:
    """The answer to ``torch.cuda.get_device_properties`` while a recipe builds on a host without CUDA."""
    name: str
    major: int
    minor: int
    platform: str

    def __getattr__(self, attribute: str) -> Any:   # only for attributes the dataclass does not have
        raise AttributeError(f"the recipe asked the GPU for {attribute!r}, which mbmem's stand-in for "
                             f"torch.cuda.get_device_properties does not answer (it answers name, major and minor of "
                             f"the {self.platform.upper()} the recipe is named for)")


def planned_gpu(platform: str | None) -> PlannedGPU | None:
    """The stand-in GPU for a recipe named for ``platform`` (None: the default); None for a platform not in
    ``PLATFORM_GPUS``."""
    key = platform or DEFAULT_PLATFORM
    if key not in PLATFORM_GPUS:
        return None
    name, major, minor = PLATFORM_GPUS[key]
    return PlannedGPU(name, major, minor, key)


def _bridge_root() -> Path | None:
    """The installed Bridge package's folder, when Bridge is imported (never imports it)."""
    bridge = sys.modules.get("megatron.bridge")
    location = getattr(bridge, "__file__", None)
    return Path(location).resolve().parent if location else None


def missing_bridge_files(modules: dict[str, Any] | None = None, root: Path | None = None,
                         shipped: Path | None = None) -> list[tuple[dict, str, Path, Path, str]]:
    """(module globals, name, the missing path, our copy, its path inside Bridge's package) for each global of a
    loaded ``megatron.bridge`` module (``modules``: sys.modules) that is a ``Path`` to a file inside the installed
    Bridge package (``root``) that does not exist and that we ship under the same relative path (``shipped``). Every
    loaded module, not only the recipe function's: a recipe may build on another platform's
    (perf_recipes/nemotronh/vr200/nemotronh.py:173 calls the gb300 recipe, which reads its own module's global)."""
    modules = sys.modules if modules is None else modules
    root = _bridge_root() if root is None else root
    shipped = SHIPPED_BRIDGE_FILES if shipped is None else shipped
    found: list[tuple[dict, str, Path, Path, str]] = []
    if root is None:
        return found
    for module_name, module in list(modules.items()):
        if module is None or not (module_name == "megatron.bridge" or module_name.startswith("megatron.bridge.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if not isinstance(value, Path) or value.exists():
                continue
            try:
                rel = value.resolve().relative_to(root)
            except ValueError:
                continue
            ours = shipped / rel
            if ours.is_file():
                found.append((namespace, name, value, ours, rel.as_posix()))
    return found


@contextlib.contextmanager
def recipe_build_stand_ins(platform: str | None, *, modules: dict[str, Any] | None = None,
                           root: Path | None = None, shipped: Path | None = None) -> Iterator[list[str]]:
    """Run a recipe function's build inside this (``platform``: the one the recipe is named for, None for none):
    yields the list the stand-ins that answered append their sentence to (the file stand-ins on the way out).
    Everything is restored on the way out, however the build ends. ``modules`` / ``root`` / ``shipped``:
    see ``missing_bridge_files``."""
    import torch
    notes: list[str] = []
    restore: list[Any] = []
    read: list[str] = []
    try:
        for namespace, name, missing, ours, rel in missing_bridge_files(modules, root, shipped):
            namespace[name] = _ShippedCopy(ours, rel, read)
            restore.append(lambda namespace=namespace, name=name, missing=missing: namespace.__setitem__(name, missing))
        gpu = None if torch.cuda.is_available() else planned_gpu(platform)
        if gpu is not None:
            real = torch.cuda.get_device_properties

            def get_device_properties(device: Any = None) -> PlannedGPU:
                if not any(gpu.name in n for n in notes):
                    notes.append(f"the recipe queried the GPU while it built (torch.cuda.get_device_properties); "
                                 f"answered as {gpu.name} (compute capability {gpu.major}.{gpu.minor}), the GPU of the "
                                 f"{'platform the recipe is named for' if platform else 'plan by default'} "
                                 f"(bridge/build_stand_ins.py)")
                return gpu

            torch.cuda.get_device_properties = get_device_properties
            restore.append(lambda: setattr(torch.cuda, "get_device_properties", real))
        yield notes
    finally:
        for undo in reversed(restore):
            undo()
        for rel in dict.fromkeys(read):
            notes.append(f"the recipe uses Bridge's {rel}, which Bridge's installed wheel lacks (a packaging bug: "
                         f"the file is in Bridge's repository); read from mbmem's unchanged copy of Bridge's own file "
                         f"(bridge/build_stand_ins.py)")


class _ShippedCopy(type(Path())):
    """Our copy of a file Bridge's wheel lacks, standing in for the missing path: records that the recipe read it
    (``str`` / ``os.fspath`` / ``open``, as ``load_quantization_recipe(str(path))`` does)."""

    def __init__(self, path: Path, bridge_relative: str, read: list[str]):
        super().__init__(path)
        self._bridge_relative, self._read = bridge_relative, read

    def with_segments(self, *segments):   # derived paths are plain paths
        return Path(*segments)

    def __str__(self) -> str:
        self._read.append(self._bridge_relative)
        return super().__str__()

    def __fspath__(self) -> str:
        self._read.append(self._bridge_relative)
        return super().__fspath__()

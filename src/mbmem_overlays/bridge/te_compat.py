"""Let ``megatron.bridge`` import on a host without Transformer Engine (TE).

Why: Bridge 0.6.2's ``megatron/bridge/peft/lora_layers.py:20`` does an
unconditional ``import transformer_engine.pytorch as te`` that is reached from
``megatron/bridge/__init__.py``, so a login node or CI runner (no GPU, no TE)
cannot even import Bridge to validate a config (shared/reference/stack-on-cpu.md,
"Transformer Engine (TE) is absent on CPU hosts").

What: exactly that one import, in exactly that one module, binds an inert
placeholder. ``transformer_engine`` stays unimportable for everybody else, so
megatron-core keeps reporting ``HAVE_TE = False`` and its TE-availability checks
keep firing (a global fake package would flip them and break megatron-core).
Using a placeholder raises a clear error instead of silently doing nothing.

When TE is installed (every real GPU node) ``install()`` does nothing.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# Bridge 0.6.x imports TE unconditionally in lora_layers.py:20 only; 0.5.1 also in peft/lora.py:22 (docs/install.md).
_TARGET_MODULES = ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")
_STUBBED_IMPORT = "transformer_engine"


class TransformerEngineMissing(RuntimeError):
    """Raised when code tries to *use* a Transformer Engine placeholder."""


class _PlaceholderMeta(type):
    # Attribute access yields further placeholder classes, so class-level uses
    # such as annotations (``-> te.ops.Sequential``) and ``isinstance(x, te.Linear)``
    # work (the latter is always False); instantiating or calling raises.
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(f"{cls.__name__}.{name}", (_Placeholder,), {})


class _Placeholder(metaclass=_PlaceholderMeta):
    def __new__(cls, *args, **kwargs):
        raise TransformerEngineMissing(
            f"{cls.__name__} needs Transformer Engine, which is not installed on this host. "
            "Planning and validation work without it; training needs a GPU node with TE."
        )


def _placeholder_module() -> type:
    return _PlaceholderMeta(_STUBBED_IMPORT, (_Placeholder,), {})


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == _STUBBED_IMPORT or name.startswith(_STUBBED_IMPORT + ".")):
        return _placeholder_module()
    return builtins.__import__(name, globals, locals, fromlist, level)


class _StubbingLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module):
        # The module gets its own builtins whose __import__ knows the placeholder;
        # every other module keeps the real import machinery.
        module_builtins = dict(vars(builtins))
        module_builtins["__import__"] = _guarded_import
        module.__dict__["__builtins__"] = module_builtins
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGET_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _StubbingLoader(spec.loader.name, spec.loader.path)
        return spec


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec(_STUBBED_IMPORT) is not None


def install() -> bool:
    """Install the finder if TE is missing. Returns True when the shim is active."""
    if transformer_engine_installed():
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True

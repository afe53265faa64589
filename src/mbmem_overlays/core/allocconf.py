"""Parse and merge PyTorch allocator settings (``PYTORCH_CUDA_ALLOC_CONF`` and friends).

The allocator reads the whole string at once, so writing one key by replacing
the string silently drops the user's other keys (shared/reference/ecosystem-notes.md,
"The allocator config string is parsed as a whole ... Merge keys."). We parse
``key:value,key:value`` strictly, merge key-wise, and refuse malformed input
instead of guessing what the allocator would make of it.
"""

from __future__ import annotations

import re

# Megatron-Core's checks read only PYTORCH_CUDA_ALLOC_CONF (bridge-config-surface.md §1.1);
# newer torch also reads PYTORCH_ALLOC_CONF, ROCm builds PYTORCH_HIP_ALLOC_CONF
# (ecosystem-notes.md). A key-wise claim on the first also applies to the others
# when the user has set them, so the process never sees two different answers.
PRIMARY_VAR = "PYTORCH_CUDA_ALLOC_CONF"
SIBLING_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
ALLOCATOR_VARS = (PRIMARY_VAR, *SIBLING_VARS)

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BOOL_KEYS = {"expandable_segments", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
              "pinned_use_background_threads", "graph_capture_record_stream_reuse"}


class AllocConfError(ValueError):
    """A malformed allocator setting string."""


def parse(var: str, text: str) -> dict[str, str]:
    """``"a:1,b:2"`` -> ``{"a": "1", "b": "2"}`` (order kept). Empty string -> ``{}``."""
    text = text.strip()
    if not text:
        return {}
    out: dict[str, str] = {}
    for position, item in enumerate(text.split(","), start=1):
        item = item.strip()
        if not item:
            raise AllocConfError(
                f"{var}={text!r}: entry {position} is empty (a stray or trailing comma). "
                f"Write it as comma-separated key:value pairs, e.g. {var}=expandable_segments:True")
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.match(key) or not value:
            raise AllocConfError(
                f"{var}={text!r}: entry {item!r} is not key:value. "
                f"Write it as comma-separated key:value pairs, e.g. {var}=expandable_segments:True")
        if key in out:
            raise AllocConfError(
                f"{var}={text!r}: key {key!r} appears twice ({key}:{out[key]} and {key}:{value}); "
                "the allocator would silently use one of them. Keep exactly one.")
        if key in _BOOL_KEYS and value not in ("True", "False"):
            raise AllocConfError(
                f"{var}={text!r}: {key} must be True or False (case-sensitive), not {value!r}. "
                f"Use {key}:True.")
        out[key] = value
    return out


def render(settings: dict[str, str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in settings.items())


def merged(var: str, current: str | None, wanted: dict[str, str]) -> tuple[str, dict[str, tuple[str, str]]]:
    """Merge ``wanted`` into ``current``. Returns (new string, {key: (existing, wanted)} conflicts)."""
    settings = parse(var, current or "")
    conflicts = {k: (settings[k], v) for k, v in wanted.items() if k in settings and settings[k] != v}
    for k, v in wanted.items():
        settings.setdefault(k, v)
    return render(settings), conflicts


def expandable_segments_on(env: dict[str, str]) -> bool:
    """Megatron-Core's own test (DDP check: comma-split exact token; bridge-config-surface.md §1.1)."""
    return "expandable_segments:True" in env.get(PRIMARY_VAR, "").split(",")

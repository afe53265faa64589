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


def _entries(var: str, text: str) -> list[str]:
    """Split at the commas between entries, not at those inside a bracketed list value.

    PyTorch's ConfigTokenizer (c10/core/AllocatorConfig.h) makes ',', ':', '[' and ']' tokens of
    their own and reads a value either as one token or as '[' ... ']' (no nesting), so
    ``roundup_power2_divisions:[256:1,512:2,1024:4,>:8]`` is one entry whose value holds ':' and ','.
    """
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise AllocConfError(f"{var}={text!r}: a list value contains another '[' (lists do not nest). "
                                     f"Write a list as key:[a,b,c], e.g. {var}=roundup_power2_divisions:[256:1,>:8]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise AllocConfError(f"{var}={text!r}: ']' without a matching '['. "
                                     f"Write a list as key:[a,b,c], e.g. {var}=roundup_power2_divisions:[256:1,>:8]")
        elif ch == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise AllocConfError(f"{var}={text!r}: '[' is never closed with ']'. "
                             f"Write a list as key:[a,b,c], e.g. {var}=roundup_power2_divisions:[256:1,>:8]")
    entries.append(text[start:])
    return entries


def _valid_value(value: str) -> bool:
    """One token (no ':' or brackets) or a non-empty bracketed list of tokens (ConfigTokenizer::skipKey)."""
    if value.startswith("[") and value.endswith("]"):
        inner = value[1:-1]
        return bool(inner.strip()) and all(item.strip() for item in inner.split(","))
    return bool(value) and not any(ch in value for ch in ":[]")


def parse(var: str, text: str) -> dict[str, str]:
    """``"a:1,b:2"`` -> ``{"a": "1", "b": "2"}`` (order kept). Empty string -> ``{}``.

    A value may be a bracketed list: ``"roundup_power2_divisions:[256:1,>:8]"`` ->
    ``{"roundup_power2_divisions": "[256:1,>:8]"}``.
    """
    if not isinstance(text, str):
        raise AllocConfError(f"{var}={text!r}: expected a string of key:value pairs, got {type(text).__name__}")
    text = text.strip()
    if not text:
        return {}
    out: dict[str, str] = {}
    for position, item in enumerate(_entries(var, text), start=1):
        item = item.strip()
        if not item:
            raise AllocConfError(
                f"{var}={text!r}: entry {position} is empty (a stray or trailing comma). "
                f"Write it as comma-separated key:value pairs, e.g. {var}=expandable_segments:True")
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.match(key) or not _valid_value(value):
            raise AllocConfError(
                f"{var}={text!r}: entry {item!r} is not key:value (or key:[a,b,...]). "
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

"""Parse and merge PyTorch allocator settings (``PYTORCH_CUDA_ALLOC_CONF`` and friends).

The allocator reads the whole string at once, so writing one key by replacing
the string silently drops the user's other keys (shared/reference/ecosystem-notes.md,
"The allocator config string is parsed as a whole ... Merge keys."). We parse
``key:value,key:value`` strictly, merge key-wise, and refuse malformed input
instead of guessing what the allocator would make of it.

Two facts of torch 2.14.1 shape the rest (issue 33 #9-#11), both read in its source and checked against its own
parser (``torch._C._accelerator_setAllocatorSettings``, tests/test_allocconf.py):

- which variable is read: ``CUDAAllocatorConfig::instance()`` (c10/cuda/CUDAAllocatorConfig.h) takes
  PYTORCH_CUDA_ALLOC_CONF if it is *set* (even empty), else (ROCm builds) PYTORCH_HIP_ALLOC_CONF, else
  PYTORCH_ALLOC_CONF; the others are ignored. A key merged into PYTORCH_CUDA_ALLOC_CONF therefore starts from the
  value torch reads now (:func:`base_value`), so a user's ``PYTORCH_ALLOC_CONF=max_split_size_mb:512`` is kept;
- which values are accepted: ``AcceleratorAllocatorConfig::parseArgs`` (c10/core/AllocatorConfig.cpp) and
  ``CUDAAllocatorConfig::parseArgs`` (c10/cuda/CUDAAllocatorConfig.cpp) refuse unknown keys and out-of-range
  values at the first CUDA allocation; :func:`torch_value_problem` refuses them before anything is exported.
"""

from __future__ import annotations

import re

from .errors import short_repr
from .text import MAX_MESSAGE_CHARS, bounded

# Megatron-Core's checks read only PYTORCH_CUDA_ALLOC_CONF (bridge-config-surface.md §1.1);
# newer torch also reads PYTORCH_ALLOC_CONF, ROCm builds PYTORCH_HIP_ALLOC_CONF
# (ecosystem-notes.md). A key-wise claim on the first also applies to the others
# when the user has set them, so the process never sees two different answers.
PRIMARY_VAR = "PYTORCH_CUDA_ALLOC_CONF"
SIBLING_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
ALLOCATOR_VARS = (PRIMARY_VAR, *SIBLING_VARS)
# The order torch 2.14.1 looks them up in (CUDAAllocatorConfig::instance(); HIP only on ROCm builds): the first
# one present in the environment, even empty, is the one read.
READ_ORDER = (PRIMARY_VAR, "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FIX_OTHER = "Fix or remove {key} in {var}."
_FIXES = {
    "expandable_segments": "Use {key}:True or {key}:False in {var}.",
    "max_split_size_mb": "Use e.g. {key}:512 in {var}, or remove it.",
    "garbage_collection_threshold": "Use e.g. {key}:0.8 in {var}, or remove it.",
    "roundup_power2_divisions": "Use e.g. {key}:4 or {key}:[256:1,512:2,>:8] in {var}, or remove it.",
    "backend": "Use backend:native (the caching allocator) or backend:cudaMallocAsync in {var}.",
}


class AllocConfError(ValueError):
    """A malformed allocator setting string. Every value it echoes is bounded where it is put in the message
    (errors.short_repr, text.bounded: a 100,000-digit value was printed whole, issue 39 #16), and the whole
    message once more here."""

    def __init__(self, message: str):
        super().__init__(bounded(message, 4 * MAX_MESSAGE_CHARS))


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
                raise AllocConfError(f"{var}={short_repr(text)}: a list value contains another '[' (lists do not nest). "
                                     f"Write a list as key:[a,b,c], e.g. {var}=roundup_power2_divisions:[256:1,>:8]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise AllocConfError(f"{var}={short_repr(text)}: ']' without a matching '['. "
                                     f"Write a list as key:[a,b,c], e.g. {var}=roundup_power2_divisions:[256:1,>:8]")
        elif ch == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise AllocConfError(f"{var}={short_repr(text)}: '[' is never closed with ']'. "
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
        raise AllocConfError(f"{var}={short_repr(text)}: expected a string of key:value pairs, got {type(text).__name__}")
    text = text.strip()
    if not text:
        return {}
    out: dict[str, str] = {}
    for position, item in enumerate(_entries(var, text), start=1):
        item = item.strip()
        if not item:
            raise AllocConfError(
                f"{var}={short_repr(text)}: entry {position} is empty (a stray or trailing comma). "
                f"Write it as comma-separated key:value pairs, e.g. {var}=expandable_segments:True")
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.match(key) or not _valid_value(value):
            raise AllocConfError(
                f"{var}={short_repr(text)}: entry {short_repr(item)} is not key:value (or key:[a,b,...]). "
                f"Write it as comma-separated key:value pairs, e.g. {var}=expandable_segments:True")
        if key in out:
            said = bounded(key, 60)
            raise AllocConfError(
                f"{var}={short_repr(text)}: key {short_repr(key)} appears twice ({said}:{bounded(out[key], 60)} and "
                f"{said}:{bounded(value, 60)}); the allocator would silently use one of them. Keep exactly one.")
        why = torch_value_problem(key, value, out)
        if why is not None:
            said = bounded(key, 60)
            raise AllocConfError(f"{var}={short_repr(text)}: {said} {why}. "
                                 f"{_FIXES.get(key, _FIX_OTHER).format(var=var, key=said)}")
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


# ----------------------------------------------------------------------------- what torch 2.14.1 accepts
# Keys of AcceleratorAllocatorConfig::parseArgs (c10/core/AllocatorConfig.cpp) and CUDAAllocatorConfig::getKeys
# (c10/cuda/CUDAAllocatorConfig.h); ROCm spellings (hip) are accepted by the CUDA build too.
_LARGE_BUFFER_MB = 20  # kLargeBuffer (20 MiB), the default large_segment_size_mb
_BOOL = "True or False (case-sensitive)"
_SIZE_T_MAX = (1 << 64) - 1
_PINNED_MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads()
BACKENDS = ("native", "cudaMallocAsync")  # CUDAAllocatorConfig::parseAllocatorConfig (non-ROCm build)
# Keys the cudaMallocAsync backend ignores (parseArgs sets used_native_specific_option and warns).
NATIVE_ONLY_KEYS = frozenset({
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc"})
KNOWN_KEYS = frozenset({
    # AcceleratorAllocatorConfig (device)
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments",
    # AcceleratorAllocatorConfig (host / pinned)
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    # CUDAAllocatorConfig::getKeys
    "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all",
    "throw_on_cudamalloc_oom"})
BOOL_KEYS = frozenset({
    "expandable_segments", "pinned_use_background_threads", "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom"})

# std::stoull / std::stod read the longest valid prefix (strtoull / strtod) and fail only when there is none or
# the number is out of range; "20abc" is 20 to torch.
_ULL_PREFIX = re.compile(r"[+-]?\d+")
_DOUBLE_PREFIX = re.compile(r"[+-]?(?:0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?"
                            r"|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.IGNORECASE)


def _stoull(text: str) -> int | None:
    """std::stoull's value (a minus sign wraps, as strtoull does), or None where it throws."""
    m = _ULL_PREFIX.match(text)
    if m is None or len(m.group()) > 40:
        return None
    number = int(m.group())
    if abs(number) > _SIZE_T_MAX:
        return None
    return number % (1 << 64)


def _stod(text: str) -> float | None:
    """std::stod's value, or None where it throws (no number, or out of range: overflow and underflow)."""
    m = _DOUBLE_PREFIX.match(text)
    if m is None or len(m.group()) > 400:
        return None
    token = m.group()
    try:
        value = float.fromhex(token) if "x" in token.lower() and "n" not in token.lower() else float(token)
    except (ValueError, OverflowError):
        return None
    if value in (float("inf"), float("-inf")) and "inf" not in token.lower():
        return None  # ERANGE overflow
    if value == 0 and re.search(r"[1-9]", token.split("e")[0].split("E")[0].split("p")[0].split("P")[0]):
        return None  # ERANGE underflow: a non-zero number that rounds to 0
    return value


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _list_items(value: str) -> list[str] | None:
    return [item.strip() for item in value[1:-1].split(",")] if value.startswith("[") else None


def _roundup_problem(value: str) -> str | None:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions: a power of two, or a list of
    ``interval:divisions`` (interval a power of two or '>', divisions a power of two or 0)."""
    items = _list_items(value)
    if items is None:
        n = _stoull(value)
        return None if n is not None and _power_of_two(n) else \
            f"must be a power of two (e.g. 4) or a list like [256:1,512:2,>:8], not {short_repr(value)}"
    for item in items:
        if not item:
            continue  # torch skips an empty trailing entry ("[256:1,]")
        interval, sep, divisions = item.partition(":")
        n = _stoull(divisions) if sep else None
        if n is None or not (n == 0 or _power_of_two(n)):
            return f"list entry {short_repr(item)}: the divisions after ':' must be a power of two or 0"
        if interval != ">":
            size = _stoull(interval)
            if size is None or not _power_of_two(size):
                return f"list entry {short_repr(item)}: the interval before ':' must be a power of two (MB) or '>'"
    return None


def torch_value_problem(key: str, value: str, earlier: dict[str, str] | None = None) -> str | None:
    """Why torch 2.14.1's allocator-config parser would refuse ``key:value`` (None when it accepts it).

    ``earlier``: the settings before this one in the same string; ``max_split_size_mb`` and
    ``max_non_split_rounding_mb`` must be at least the large segment size in effect when they are read
    (parseMaxSplitSize / parseMaxNonSplitRoundingSize: ``>= large_segment_size_mb``, 20 by default)."""
    if key not in KNOWN_KEYS:
        return ("is not a setting torch knows (torch 2.14.1 stops at the first CUDA allocation with "
                f"\"Unrecognized key\"); known keys: {', '.join(sorted(KNOWN_KEYS))}")
    is_list = value.startswith("[")
    if key == "roundup_power2_divisions":
        return _roundup_problem(value)
    if is_list:
        return "takes one value, not a [list]"
    if key in BOOL_KEYS:
        return None if value in ("True", "False") else f"must be {_BOOL}, not {short_repr(value)}"
    if key == "backend":
        return None if value in BACKENDS else f"must be one of {', '.join(BACKENDS)}, not {short_repr(value)}"
    if key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        number = _stod(value)
        if number is None:
            return f"must be a number, not {short_repr(value)}"
        if key == "garbage_collection_threshold" and not 0 < number < 1:
            return f"must be strictly between 0 and 1 (e.g. 0.8), not {bounded(value, 60)}"
        if key == "per_process_memory_fraction" and not 0 <= number <= 1:
            return f"must be between 0 and 1 (e.g. 0.9), not {bounded(value, 60)}"
        return None
    number = _stoull(value)
    if number is None:
        return f"must be a whole number, not {short_repr(value)}"
    if key == "large_segment_size_mb" and number <= 10:
        return f"must be more than 10 (MB), not {bounded(value, 60)}"
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        floor = _stoull((earlier or {}).get("large_segment_size_mb", "")) or _LARGE_BUFFER_MB
        if number < floor:
            return (f"must be at least {floor} (MB, the large segment size"
                    f"{'' if floor == _LARGE_BUFFER_MB else ' set by large_segment_size_mb'}), not {bounded(value, 60)}")
    if key == "pinned_num_register_threads" and not (_power_of_two(number) and number <= _PINNED_MAX_REGISTER_THREADS):
        return f"must be a power of two up to {_PINNED_MAX_REGISTER_THREADS}, not {bounded(value, 60)}"
    if key == "pinned_reserve_segment_size_mb" and number == 0:
        return "must be more than 0"
    return None


# ----------------------------------------------------------------------------- which variable torch reads
def var_in_effect(env: dict[str, str]) -> str | None:
    """The allocator variable torch 2.14.1 reads from ``env`` (the first of READ_ORDER that is set, even empty),
    or None when none is set."""
    return next((v for v in READ_ORDER if v in env), None)


def base_value(var: str, env: dict[str, str], process: dict[str, str] | None = None) -> str | None:
    """What a key-wise merge into ``var`` starts from, ``env`` being what the job will have (the recipe's env_vars
    under the process's environment) and ``process`` the process's own environment, when known.

    For PYTORCH_CUDA_ALLOC_CONF not set in the process: the keys of the variable torch reads there now (the user's
    PYTORCH_ALLOC_CONF), so that creating PYTORCH_CUDA_ALLOC_CONF does not make torch drop them; when the recipe's
    env_vars also set PYTORCH_CUDA_ALLOC_CONF (which would shadow the user's variable at launch), its keys are added,
    the user's winning a key both name (the process's environment wins over env_vars, as Bridge's setdefault)."""
    if var != PRIMARY_VAR:
        return env.get(var)
    if process is not None and PRIMARY_VAR not in process:
        user = var_in_effect(process)
        if user is not None:
            if PRIMARY_VAR not in env:
                return process[user]
            try:
                theirs, recipe = parse(user, process[user]), parse(PRIMARY_VAR, env[PRIMARY_VAR])
            except AllocConfError:
                return process[user]  # refused with its own message when the merge parses it
            return render({**theirs, **{k: v for k, v in recipe.items() if k not in theirs}})
    if PRIMARY_VAR in env:
        return env[PRIMARY_VAR]
    current = var_in_effect(env)
    return env[current] if current is not None else None


def merge_targets(var: str, env: dict[str, str]) -> list[str]:
    """The variables a key-wise claim on allocator variable ``var`` is merged into: PYTORCH_CUDA_ALLOC_CONF (torch
    reads it first, Megatron-Core's checks read only it) and every other allocator variable that is set, so the
    process never sees two different answers. A claim on any other variable stays where it is."""
    if var not in ALLOCATOR_VARS:
        return [var]
    return [PRIMARY_VAR, *(v for v in SIBLING_VARS if env.get(v))]


def in_effect_note(env: dict[str, str]) -> str | None:
    """One line naming the variable torch reads and the ones it ignores (None when no allocator variable is set)."""
    var = var_in_effect(env)
    if var is None:
        return None
    ignored = [v for v in ALLOCATOR_VARS if v != var and v in env and v != "PYTORCH_HIP_ALLOC_CONF"]
    from .text import shown
    line = f"torch reads {var}={shown(env[var]) or chr(39) * 2}"
    if ignored:
        line += (f"; it ignores {', '.join(ignored)} while {var} is set (even empty): torch 2.14.1 reads "
                 f"{' before '.join(v for v in READ_ORDER if v != 'PYTORCH_HIP_ALLOC_CONF')}")
    return line


def async_backend(settings: dict[str, str]) -> bool:
    """``backend:cudaMallocAsync``: the native caching allocator, and every NATIVE_ONLY_KEYS setting, is unused."""
    return settings.get("backend") == "cudaMallocAsync"


def allocator_env(environ) -> dict[str, str]:
    """The allocator variables of ``environ`` (a shell's, an executor's), text only: what a rendered launch (mbmem
    args, mbmem slurm, the NeMo-Run plugin) starts its merge from, so the keys torch reads in the environment the job
    comes from are kept in the variable it will read there (issue 33 #9). Nothing else of ``environ`` is used."""
    try:
        return {v: str(environ[v]) for v in ALLOCATOR_VARS if v in environ}
    except Exception:  # noqa: BLE001  an executor whose env_vars is not a mapping: nothing to carry
        return {}

"""An offline Hugging Face cache holding only ``config.json`` files.

Bridge recipes call ``AutoBridge.from_hf_pretrained(<hub id>)``, which needs the
model's ``config.json`` (shared/reference/stack-on-cpu.md, "Recipes offline").
Planning needs architecture numbers only, so we ship those files
(``hf_configs/<org>--<name>/config.json``) and lay them out as an HF hub cache
(``models--org--name/refs/main`` + ``snapshots/<rev>/config.json``), then point
``HF_HOME`` there with ``HF_HUB_OFFLINE=1``. Nothing is ever downloaded.

Users add their own models with ``MBMEM_HF_CONFIGS=dir1:dir2`` (same layout).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

FIXTURE_DIR = Path(__file__).with_name("hf_configs")
USER_DIRS_ENV = "MBMEM_HF_CONFIGS"


def fixture_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(USER_DIRS_ENV, "").split(os.pathsep) if p]
    return extra + [FIXTURE_DIR]


def available_models() -> dict[str, Path]:
    """hub id -> config.json, user directories first (they win)."""
    found: dict[str, Path] = {}
    for base in reversed(fixture_dirs()):
        if not base.is_dir():
            continue
        for cfg in sorted(base.glob("*--*/config.json")):
            found[cfg.parent.name.replace("--", "/", 1)] = cfg
    return found


def model_files() -> dict[str, dict[str, Path]]:
    """hub id -> {path in the repository: file} of every config.json shipped for it, at its top or one folder down:
    a diffusers pipeline keeps its transformer's config in ``transformer/config.json`` (Bridge's PreTrainedFlux
    reads it with ``subfolder="transformer"``, diffusion/conversion/flux/flux_hf_pretrained.py:66-68). User
    directories win, per model."""
    found: dict[str, dict[str, Path]] = {}
    for base in reversed(fixture_dirs()):
        if not base.is_dir():
            continue
        for model_dir in sorted(p for p in base.glob("*--*") if p.is_dir()):
            files = {cfg.relative_to(model_dir).as_posix(): cfg
                     for cfg in sorted([*model_dir.glob("config.json"), *model_dir.glob("*/config.json")])}
            if files:
                found[model_dir.name.replace("--", "/", 1)] = files
    return found


def _pinned_revisions() -> dict[str, str]:
    pins: dict[str, str] = {}
    for base in reversed(fixture_dirs()):
        f = base / "pinned_revisions.json"
        if f.is_file():
            pins.update({k: v for k, v in json.loads(f.read_text()).items() if not k.startswith("_")})
    return pins


def expected_path(hub_id: str) -> Path:
    """Where a user should put the config.json for ``hub_id``."""
    return (fixture_dirs()[0] if os.environ.get(USER_DIRS_ENV) else FIXTURE_DIR) / hub_id.replace("/", "--", 1) / "config.json"


# Bumped when what the cache serves for the same fixtures changes (native_configs.served_config).
_SERVED_FORM = b"served-form-2"


def served_bytes(cfg: Path) -> bytes:
    """What the cache serves for a shipped ``config.json``: the file itself, or, for a model type whose file names
    the repository's own configuration code and that bridge/native_configs.py serves with a transformers class,
    the file without ``auto_map["AutoConfig"]`` (the shipped fixture stays as found)."""
    raw = cfg.read_bytes()
    if cfg.name != "config.json":
        return raw
    try:
        data = json.loads(raw)
    except ValueError:
        return raw   # a malformed user file is served as it is: transformers names the problem when it loads it
    from .native_configs import served_config
    served = served_config(data) if isinstance(data, dict) else data
    return raw if served is data else (json.dumps(served, indent=2) + "\n").encode()


def build_cache(root: Path | None = None) -> Path:
    """Materialize the cache (idempotent; keyed by the fixtures' content) and return HF_HOME."""
    models = model_files()
    pins = _pinned_revisions()
    digest = hashlib.sha1(_SERVED_FORM)
    for hub_id, files in sorted(models.items()):
        for rel, cfg in sorted(files.items()):
            digest.update(hub_id.encode() + b"\0" + rel.encode() + b"\0" + cfg.read_bytes())
    digest.update(json.dumps(pins, sort_keys=True).encode())
    key = digest.hexdigest()
    base = root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mbmem-overlays"
    home = base / f"hf-{key[:16]}"
    if (home / ".complete").is_file():
        return home
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=base, prefix=".hf-staging-"))
    for hub_id, files in models.items():
        dirname = hub_id.replace("/", "--", 1)
        repo = staging / "hub" / f"models--{dirname}"
        main_rev = hashlib.sha1(b"".join(files[rel].read_bytes() for rel in sorted(files))).hexdigest()
        for rev in {main_rev, pins.get(dirname, main_rev)}:
            for rel, cfg in files.items():
                target = repo / "snapshots" / rev / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(served_bytes(cfg))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(pins.get(dirname, main_rev))
    (staging / ".complete").write_text(key)
    try:
        staging.rename(home)  # atomic: concurrent builders race harmlessly
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return home


def activate() -> Path:
    """Point this process at the offline cache: the environment for what is imported later, and
    huggingface_hub's constants when it is imported already (``import nemo_run`` imports it), since the hub
    reads HF_HOME and HF_HUB_OFFLINE once, at its import (huggingface_hub/constants.py)."""
    home = build_cache()
    from .native_configs import register
    register()   # kimi_k2 / kimi_k25 as transformers classes (their served files name no code)
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    repoint_imported_hub(home)
    return home


def repoint_imported_hub(home: Path) -> None:
    """Give an already imported huggingface_hub the values it would have read from the environment above. Every
    download path reads them as ``constants.HF_HUB_CACHE`` / ``constants.HF_HUB_OFFLINE`` when it runs
    (file_download.py, transformers/utils/hub.py); the cache scanner took its own copy at import."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is None:
        return
    hub_cache = str(home / "hub")
    constants.HF_HOME, constants.HF_HUB_CACHE, constants.HUGGINGFACE_HUB_CACHE = str(home), hub_cache, hub_cache
    constants.HF_HUB_OFFLINE = True
    scanner = sys.modules.get("huggingface_hub.utils._cache_manager")
    if scanner is not None and hasattr(scanner, "HF_HUB_CACHE"):
        scanner.HF_HUB_CACHE = hub_cache

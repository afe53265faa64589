"""The shipped Hugging Face configs (bridge/hf_configs): each loads offline, each has its source in SOURCES.md, and
pinned_revisions.json holds every model revision a Bridge recipe pins. Read from the installed sources; nothing here
imports Bridge or builds a recipe (bench/recipe_census.py builds them all)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from mbmem_overlays.bridge import hf_offline

HF = hf_offline.FIXTURE_DIR
SOURCES = (HF / "SOURCES.md").read_text()
HEX40 = re.compile(r"[0-9a-f]{40}")


def _bridge_root() -> Path:
    for entry in sys.path:
        root = Path(entry, "megatron", "bridge")
        if (root / "recipes").is_dir():
            return root
    pytest.skip("Megatron Bridge's sources are not installed")


def _recipe_sources() -> dict[Path, str]:
    root = _bridge_root()
    return {p: p.read_text() for d in ("recipes", "perf_recipes") for p in sorted((root / d).rglob("*.py"))}


def _entries() -> dict[str, str]:
    """SOURCES.md: hub id -> its section (from one ``## `org/name` `` heading to the next)."""
    parts = re.split(r"^## `([^`]+)`.*$", SOURCES, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


SHIPPED = sorted(p.name.replace("--", "/", 1) for p in HF.iterdir() if p.is_dir())


def test_something_is_shipped():
    assert len(SHIPPED) >= 60 and "meta-llama/Meta-Llama-3-8B" in SHIPPED


@pytest.mark.parametrize("hub_id", [h for h in SHIPPED if (HF / h.replace("/", "--", 1) / "config.json").is_file()])
def test_shipped_config_loads_offline(hub_id, monkeypatch, tmp_path):
    """transformers.AutoConfig builds it offline as the cache serves it (no hub, no remote code): a config whose model
    type transformers does not know and that names its own code (auto_map) is served without that code and built
    by the class bridge/native_configs.py registers (Kimi K2 / K2.5), and SOURCES.md says so."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from mbmem_overlays.bridge import native_configs
    directory = HF / hub_id.replace("/", "--", 1)
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("model_type") not in CONFIG_MAPPING_NAMES:
        assert (raw.get("auto_map") or {}).get("AutoConfig"), f"{hub_id}: unknown model type and no code named"
        assert "trust_remote_code" in _entries()[hub_id], f"{hub_id}: SOURCES.md must say what happens offline"
        assert raw["model_type"] in native_configs.NATIVE_MODEL_TYPES, f"{hub_id}: no class serves it offline"
        native_configs.register()
        served = tmp_path / "served"
        served.mkdir()
        (served / "config.json").write_bytes(hf_offline.served_bytes(directory / "config.json"))
        assert "AutoConfig" not in (json.loads((served / "config.json").read_text()).get("auto_map") or {})
        directory = served
    config = AutoConfig.from_pretrained(str(directory))
    assert config.model_type == raw["model_type"]


def test_every_shipped_model_and_every_model_a_recipe_names_has_an_entry():
    entries = _entries()
    named = set()
    for text in _recipe_sources().values():
        named |= set(re.findall(r'"([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)"', text))
    models = {n for n in named if not n.startswith((".", "intro/", "math/")) and not n.endswith("-SFT-Data")}
    assert len(models) > 80
    missing = sorted((models | set(SHIPPED)) - set(entries))
    assert not missing, f"SOURCES.md has no entry for {missing}"
    for hub_id in SHIPPED:
        assert "**Source:**" in entries[hub_id], f"{hub_id}: its entry names no source"
    for hub_id in sorted(models - set(SHIPPED)):
        assert "no public source found" in entries[hub_id].lower() or "not shipped" in entries[hub_id].lower(), hub_id


def _model_pins() -> dict[str, str]:
    """hub id -> revision for every ``*_REVISION = "<sha>"`` constant of a recipe module that pins a model: the one
    whose ``*_ID`` twin names a hub id. A revision used only for a dataset (``load_kwargs``) is a dataset's."""
    pins: dict[str, str] = {}
    for path, text in _recipe_sources().items():
        for name, sha in re.findall(r'^(_?[A-Z0-9_]*REVISION)\s*=\s*"([0-9a-f]{40})"', text, flags=re.M):
            uses = [line for line in text.splitlines() if name in line and not line.lstrip().startswith(name)]
            if uses and all("dataset" in line or "load_kwargs" in line for line in uses):
                continue
            twin = re.search(rf'^{name[:-len("REVISION")]}ID\s*=\s*"([^"]+)"', text, flags=re.M)
            assert twin, f"{path}: {name} pins a revision of no hub id this test can find"
            pins[twin.group(1)] = sha
        for hub_id, sha in re.findall(r'from_hf_pretrained\(\s*"([^"]+)"[^)]*?revision\s*=\s*"([0-9a-f]{40})"', text):
            pins[hub_id] = sha
    return pins


def test_pinned_revisions_hold_every_revision_a_recipe_pins():
    pins = _model_pins()
    assert {"Qwen/Qwen3-8B", "zai-org/GLM-5.2", "moonshotai/Moonlight-16B-A3B"} <= set(pins)
    shipped = {k: v for k, v in json.loads((HF / "pinned_revisions.json").read_text()).items() if not k.startswith("_")}
    for hub_id, sha in pins.items():
        assert shipped.get(hub_id.replace("/", "--", 1)) == sha, f"{hub_id} is pinned at {sha}"
        assert sha in _entries()[hub_id], f"SOURCES.md's entry for {hub_id} does not name the pinned revision"


def test_the_offline_cache_serves_subfolder_configs_and_pins(tmp_path):
    """A diffusers model's transformer/config.json sits in the snapshot where the hub keeps it, and a pinned model
    is served at its pinned revision (refs/main points there)."""
    home = hf_offline.build_cache(tmp_path)
    flux = home / "hub" / "models--black-forest-labs--FLUX.1-dev"
    rev = (flux / "refs" / "main").read_text()
    assert json.loads((flux / "snapshots" / rev / "transformer" / "config.json").read_text())["num_single_layers"] == 38
    glm = home / "hub" / "models--zai-org--GLM-5.2"
    pinned = json.loads((HF / "pinned_revisions.json").read_text())["zai-org--GLM-5.2"]
    assert (glm / "refs" / "main").read_text() == pinned
    assert (glm / "snapshots" / pinned / "config.json").is_file()

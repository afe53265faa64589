"""Transformers' own configuration classes for model types whose ``config.json`` names the repository's code.

Kimi K2 (``moonshotai/Kimi-K2-Instruct``) and Kimi K2.5 (``moonshotai/Kimi-K2.5``) have model types transformers
5.12.1 does not know (``kimi_k2``, ``kimi_k25``), and their ``config.json`` names the repository's own configuration
code (``auto_map``: ``configuration_deepseek.DeepseekV3Config``, ``configuration_kimi_k25.KimiK25Config``), which
Bridge's recipes load with ``trust_remote_code=True`` (recipes/kimi/h100/kimi_k2.py:99-101,
recipes/kimi_vl/h100/kimi_k25_vl.py:61-64). Offline, with ``config.json`` alone, that code is not there, and we never
download or run it. What the recipes read from the config object is plain data:

- Kimi K2: the fields of a DeepSeek-V3 configuration. Its ``auto_map`` names DeepSeek's ``DeepseekV3Config``, the
  class transformers ships natively as ``transformers.DeepseekV3Config`` with the same field names; every key of the
  file becomes an attribute of either class (PretrainedConfig keeps unknown keys as attributes). Bridge reads them
  through ``hf_config_to_provider_kwargs`` (models/conversion/model_bridge.py:529-561) and the DeepSeek-style bridges
  (models/kimi/kimi_bridge.py:44-86: ``first_k_dense_replace``, ``num_hidden_layers``, ``moe_intermediate_size``,
  ``n_shared_experts``).
- Kimi K2.5: a composite whose ``text_config`` is that same DeepSeek-V3 configuration (its own ``auto_map`` names
  ``configuration_deepseek.DeepseekV3Config``) and whose ``vision_config`` Bridge only stores on the provider
  (models/kimi_vl/kimi_k25_vl_bridge.py:62-64, 132: ``provider.vision_config = vision_config``); the vision tower is
  built from it when the model is constructed, which planning never does. The top-level token ids are read with
  ``getattr`` defaults (kimi_k25_vl_bridge.py:138-142).

``register()`` registers these classes with ``AutoConfig`` under the files' own model types, and the offline cache
(bridge/hf_offline.py) serves those files without the ``auto_map["AutoConfig"]`` entry (the one entry that sends
``AutoConfig`` to the repository's code; the other entries, which Bridge reads as class names to choose its bridge,
models/conversion/auto_bridge.py:1903-1906, stay). Only in the offline mode: with ``MBMEM_USE_USER_HF`` the user's own cache and code
are used as they are.
"""

from __future__ import annotations

# model type -> (the configuration class its auto_map names, what serves it here)
NATIVE_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "kimi_k2": ("configuration_deepseek.DeepseekV3Config", "transformers.DeepseekV3Config (same field names)"),
    "kimi_k25": ("configuration_kimi_k25.KimiK25Config",
                 "a composite: text_config as transformers.DeepseekV3Config, vision_config as a plain "
                 "PretrainedConfig holding the file's numbers"),
}

_registered = False


def config_classes() -> dict[str, type]:
    """model type -> the transformers configuration class that serves it (imports transformers)."""
    from transformers import DeepseekV3Config, PretrainedConfig

    class KimiK2Config(DeepseekV3Config):
        """Kimi K2's configuration: DeepSeek-V3's fields under the file's own model type."""
        model_type = "kimi_k2"

    class KimiK25Config(PretrainedConfig):
        """Kimi K2.5's configuration: a DeepSeek-V3 text model and the vision tower's numbers, as data."""
        model_type = "kimi_k25"
        sub_configs = {"text_config": KimiK2Config, "vision_config": PretrainedConfig}

        def __init__(self, text_config=None, vision_config=None, **kwargs):
            self.text_config = (KimiK2Config(**text_config) if isinstance(text_config, dict)
                                else text_config if text_config is not None else KimiK2Config())
            self.vision_config = (PretrainedConfig(**vision_config) if isinstance(vision_config, dict)
                                  else vision_config if vision_config is not None else PretrainedConfig())
            super().__init__(**kwargs)

    return {"kimi_k2": KimiK2Config, "kimi_k25": KimiK25Config}


def register() -> None:
    """Register the classes with ``AutoConfig`` (once per process; a model type transformers already knows is left
    to transformers)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    for model_type, cls in config_classes().items():
        if model_type not in CONFIG_MAPPING:
            AutoConfig.register(model_type, cls)
    _registered = True


def served_config(config: dict) -> dict:
    """The ``config.json`` the offline cache serves for a shipped one: unchanged, except that a model type listed in
    ``NATIVE_MODEL_TYPES`` loses ``auto_map["AutoConfig"]``, so that ``AutoConfig`` builds the registered class
    instead of looking for the repository's code."""
    if config.get("model_type") not in NATIVE_MODEL_TYPES or "AutoConfig" not in (config.get("auto_map") or {}):
        return config
    served = dict(config)
    served["auto_map"] = {k: v for k, v in config["auto_map"].items() if k != "AutoConfig"}
    return served

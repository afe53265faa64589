"""The Bridge adapter: stack preparation (TE-less import, offline HF configs), recipes, overrides, validation.

Importing this package does not import Megatron Bridge; the functions that need it call
``stack.prepare()`` first (15-20 s, once per process).
"""

from .overrides import apply_overrides
from .recipes import build_recipe, load_recipe
from .stack import prepare
from .validation import ValidationResult, validate_config

__all__ = ["apply_overrides", "build_recipe", "load_recipe", "prepare", "validate_config", "ValidationResult"]

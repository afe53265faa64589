"""mbmem-overlays: composable, validated memory overlays for Megatron Bridge.

Importing this package does not import Megatron Bridge or torch.
"""

from .engine import Report, apply_overlay, plan_overlays
from .errors import OverlayError, Problem

__all__ = ["apply_overlay", "plan_overlays", "OverlayError", "Problem", "Report"]
__version__ = "0.1.0"

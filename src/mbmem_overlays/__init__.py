"""mbmem-overlays: composable, validated memory overlays for Megatron Bridge.

Importing this package does not import Megatron Bridge or torch. The layers, lowest first
(docs/architecture.md): core, bridge, api, memory, doctor, launch, cli.
"""

from .api import apply_overlay, plan_overlays
from .core.engine import Report
from .core.errors import OverlayError, Problem

__all__ = ["apply_overlay", "plan_overlays", "OverlayError", "Problem", "Report"]
__version__ = "0.1.0"

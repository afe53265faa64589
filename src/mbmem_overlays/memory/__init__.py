"""The memory layer: the per-GPU memory model, the plan steps, the layout search and the recommendation ladder.

Pure functions over frozen dataclasses (model.py); the others apply overlays through the core engine.
"""

"""The core layer: config paths, the overlay catalogue, allocator settings, errors, the rules and the engine.

Imports nothing above it, and never Megatron Bridge or torch.
"""

"""Every documented rule, one topic per module; importing this package registers them all.

To add a rule: write one function in its topic's module, named after the rule, decorated with
``@check(enforced_by=..., source=..., reads=(...))`` (see ``registry.py``). Nothing else changes.
"""

from . import offload, recompute, cuda_graphs, parallelism, peft, allocator, optimizer, profiling  # noqa: F401  (registers, in this order)
from .facts import mixed_precision_config, recompute_labels
from .peft import REGATHER_SURFACES, regather_fallbacks
from .registry import CHECKS, RESOLVERS, Check, Resolver, doc_only_checks, markdown_table

TOPICS = (offload, recompute, cuda_graphs, parallelism, peft, allocator, optimizer, profiling)

__all__ = ["CHECKS", "RESOLVERS", "Check", "Resolver", "doc_only_checks", "mixed_precision_config",
           "recompute_labels", "REGATHER_SURFACES", "regather_fallbacks", "TOPICS", "markdown_table"]

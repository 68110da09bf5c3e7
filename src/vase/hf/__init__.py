"""The Hugging Face ``transformers`` integration: :class:`EvictingCache` for ``model.generate`` and model loading.

Thin over the eviction core (:mod:`vase.core`): the cache stores slots, runs the schedule and calls
:func:`vase.core.evict.evict_layer` at each compaction; attention is hooked through transformers' public attention
and mask registries (:mod:`vase.hf.attention`), hybrid models keep their other layers as transformers holds them
(:mod:`vase.hf.hybrid`).
"""

from .cache import EvictingCache
from .compiled import compile_config
from .models import load_model
from .stats import CacheStats

__all__ = ["CacheStats", "EvictingCache", "compile_config", "load_model"]

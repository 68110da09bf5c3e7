"""The Hugging Face ``transformers`` integration: :class:`EvictingCache` for ``model.generate`` and model loading.

Thin over the eviction core (:mod:`vase.core`): the cache stores slots, runs the schedule and calls
:func:`vase.core.evict.evict_layer` at each compaction; attention is hooked through transformers' public attention
and mask registries (:mod:`vase.hf.attention`), hybrid models keep their other layers as transformers holds them
(:mod:`vase.hf.hybrid`).
"""

import transformers as _transformers
from packaging.version import Version as _Version

MIN_TRANSFORMERS = "5.24"
if _Version(_transformers.__version__).release[:2] < _Version(MIN_TRANSFORMERS).release[:2]:
    raise ImportError(
        f"vase's transformers integration needs transformers >= {MIN_TRANSFORMERS}; this environment has "
        f"{_transformers.__version__} (pinned by vLLM?): use vase.vllm here, or another environment for vase.hf"
    )

from .cache import EvictingCache  # noqa: E402
from .compiled import compile_config  # noqa: E402
from .models import load_model  # noqa: E402
from .stats import CacheStats  # noqa: E402

__all__ = ["CacheStats", "EvictingCache", "compile_config", "load_model"]

"""The Hugging Face ``transformers`` integration: :class:`EvictingCache` for ``model.generate`` and model loading.

Thin over the eviction core (:mod:`vase.core`): the cache stores slots, runs the schedule and calls
:func:`vase.core.evict.evict_layer` at each compaction; attention is hooked through transformers' public attention
and mask registries (:mod:`vase.hf.attention`), hybrid models keep their other layers as transformers holds them
(:mod:`vase.hf.hybrid`).
"""

import transformers as _transformers
from packaging.version import Version as _Version

MIN_TRANSFORMERS = "5.17"  # the oldest release tested (pyproject.toml pins the range; vase.hf.compat: what differs)
if _Version(_transformers.__version__).release[:2] < _Version(MIN_TRANSFORMERS).release[:2]:
    raise ImportError(
        f"vase's transformers integration needs transformers >= {MIN_TRANSFORMERS}; this environment has "
        f"{_transformers.__version__}: pip install 'transformers>={MIN_TRANSFORMERS},<5.25'"
    )

from .cache import EvictingCache  # noqa: E402
from .compat import cache_kwargs  # noqa: E402
from .compiled import compile_config  # noqa: E402
from .confidence import ConfidenceFeed  # noqa: E402
from .models import load_model  # noqa: E402
from .stats import CacheStats  # noqa: E402

__all__ = ["CacheStats", "ConfidenceFeed", "EvictingCache", "cache_kwargs", "compile_config", "load_model"]

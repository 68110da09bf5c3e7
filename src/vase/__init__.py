"""vase: bounded KV cache for long reasoning generation with Hugging Face transformers.

Value-Aware Stochastic Eviction (VaSE, arXiv 2606.03928) and the usual baselines, behind one cache class::

    import vase
    cache = vase.EvictingCache(model, policy="vase", budget=1024)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)
    print(cache.stats().line())
"""

from .cache import CacheStats, EvictingCache
from .policies import POLICY_NAMES, make_policy, policy_table
from .policy import Policy

__version__ = "0.1.0"

__all__ = ["CacheStats", "EvictingCache", "POLICY_NAMES", "Policy", "make_policy", "policy_table", "__version__"]

"""vase: bounded KV cache for long reasoning generation with Hugging Face transformers.

Value-Aware Stochastic Eviction (VaSE, arXiv 2606.03928) and the usual baselines, behind one cache class::

    import vase
    cache = vase.EvictingCache(model, policy="vase", budget=1024)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)
    print(cache.stats().line())

Compiled decoding (one graph per decode step, CUDA graphs on a GPU)::

    cache = vase.EvictingCache(model, policy="vase", budget=1024, compileable=True)
    out = model.generate(**inputs, cache=cache, compile_config=vase.compile_config(model.device))
"""

from .cache import CacheStats, EvictingCache
from .generation import compile_config
from .policies import POLICY_NAMES, make_policy, policy_table
from .policy import Policy

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "EvictingCache",
    "POLICY_NAMES",
    "Policy",
    "compile_config",
    "make_policy",
    "policy_table",
    "__version__",
]

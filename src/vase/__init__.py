"""vase: bounded KV cache for long reasoning generation.

Value-Aware Stochastic Eviction (VaSE, arXiv 2606.03928) and the usual baselines, behind one cache class::

    import vase
    cache = vase.EvictingCache(model, policy="vase", budget=1024)
    out = model.generate(**inputs, cache=cache, max_new_tokens=4096)  # any release: **vase.cache_kwargs(cache)
    print(cache.stats().line())

Or in one call, batched: ``vase.generate(model, tokenizer, prompts, policy="vase", compression_ratio=4)``.

Layers (docs/ARCHITECTURE.md): :mod:`vase.core` is the algorithm, with torch alone; :mod:`vase.hf` the transformers
integration; :mod:`vase.harness` the experiments; :mod:`vase.cli` the command line. ``import vase`` imports none of
them: each name below loads its module on first use, so ``import vase.core`` works without transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CacheStats": "vase.hf.stats",
    "EvictingCache": "vase.hf.cache",
    "compile_config": "vase.hf.compiled",
    "load_model": "vase.hf.models",
    "cache_kwargs": "vase.hf.compat",
    "generate": "vase.harness.generation",
    "POLICY_NAMES": "vase.core.policies",
    "make_policy": "vase.core.policies",
    "policy_table": "vase.core.policies",
    "Policy": "vase.core.policy",
    "VaseConfig": "vase.core.config",
    "evict_layer": "vase.core.evict",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vase' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)

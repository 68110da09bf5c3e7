"""``rkv``: redundancy-aware selection, ``lam * importance - (1 - lam) * redundancy``, top-k.

Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv 2505.24133, Sec. 3.
Importance from the last 8 queries, max-pooled over 7 tokens; redundancy from key cosine similarity; lambda 0.1.
The paper compresses every 128 steps: pass ``buffer=128`` to the cache for that schedule.
"""

from ..policy import Policy, compose
from ..scoring import RedundancyAware

NAME = "rkv"
SOURCE = "Cai et al. 2025, R-KV, arXiv 2505.24133, Sec. 3"
KEEPS = "sinks + recent + important and non-redundant tokens"
DEFAULTS = {"window": 8, "kernel": 7, "lam": 0.1, "value_weight": "none"}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, RedundancyAware, DEFAULTS, options)

"""``vase``: Value-Aware Stochastic Eviction.

arXiv 2606.03928. Sec. 3.1, value-magnitude guard: per (layer, KV head) the candidates with the largest value range
(max - min over head_dim) are protected, 25% of the budget; the 4 sink tokens are always kept. Sec. 3.2, stochastic
eviction: the rest of the budget is sampled without replacement in proportion to the importance score (attention of
the last 64 post-RoPE queries, mean over the window, average-pooled over 5 positions, mean over the GQA group).
"""

from ..policy import Policy, compose
from ..scoring import WindowAttention

NAME = "vase"
SOURCE = "VaSE, arXiv 2606.03928, Sec. 3.1-3.2"
KEEPS = "sinks + recent + largest-range values (25% of budget) + sampled by window attention"
DEFAULTS = {"window": 64, "kernel": 5, "pool": "avg"}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(
        NAME,
        SOURCE,
        KEEPS,
        WindowAttention,
        DEFAULTS,
        options,
        selector="sample",
        guard="range",
        protect_share=0.25,
    )

"""``snapkv``: observation-window attention, pooled, top-k; applied at decode time.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469, Sec. 4. The
defaults (window 64, average pooling 5) are the importance score VaSE builds on (arXiv 2606.03928, Sec. 3.2), so
that ``snapkv`` -> ``snapkv --selector sample`` -> ``vase`` is the paper's ablation path; SnapKV's own prefill
setting is ``window=32, kernel=7``. ``pool_edge='zero'`` pools over the slots before the recent window only, with zero
padding at the boundary (as kvpress and the VaSE reference code do); the default pools through it.
"""

from ..policy import Policy, compose
from ..scoring import WindowAttention

NAME = "snapkv"
SOURCE = "Li et al. 2024, SnapKV, arXiv 2404.14469, Sec. 4"
KEEPS = "sinks + recent + top-k pooled window attention"
DEFAULTS = {
    "window": 64,
    "kernel": 5,
    "pool": "avg",
    "softmax": "all",
    "pool_edge": "through",
    "pool_order": "position",
    "attention_temperature": 1.0,
    "value_weight": "none",
}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, WindowAttention, DEFAULTS, options)

"""``knorm``: keep the keys with the lowest L2 norm, top-k (no queries needed).

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430,
Sec. 3-4: a low key norm goes with high attention, so the entries with the largest key norms are dropped first. The
sinks and the recent window are kept as in every policy.
"""

from ..key_scoring import KeyNorm
from ..policy import Policy, compose

NAME = "knorm"
SOURCE = "Devoto et al. 2024, L2 norm of keys, arXiv 2406.11430, Sec. 3-4"
KEEPS = "sinks + recent + the lowest-norm keys"
DEFAULTS: dict = {}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, KeyNorm, DEFAULTS, options)

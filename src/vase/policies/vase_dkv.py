"""``vase_dkv``: leverage ``||K G||^2 * ||V G||^2`` with the Gaussian projection (rank 20) drawn afresh at every
eviction, top-k.

VaSE, arXiv 2606.03928, Sec. 3.3 (the resampled variant of CurDKV).
"""

from functools import partial

from ..policy import Policy, compose
from ..scoring import Leverage

NAME = "vase_dkv"
SOURCE = "VaSE-DKV, arXiv 2606.03928, Sec. 3.3"
KEEPS = "sinks + recent + highest key-value leverage (projection redrawn each eviction)"
DEFAULTS = {"rank": 20}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, partial(Leverage, fresh=True), DEFAULTS, options)

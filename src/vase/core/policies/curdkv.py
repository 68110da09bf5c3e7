"""``curdkv``: leverage ``||K G||^2 * ||V G||^2`` under a Gaussian projection fixed for the whole sequence, top-k.

Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (CurDKV),
arXiv 2509.15038, Sec. 3.
"""

from functools import partial

from ..key_scoring import Leverage
from ..policy import Policy, compose

NAME = "curdkv"
SOURCE = "Sengupta et al. 2025, CurDKV, arXiv 2509.15038, Sec. 3"
KEEPS = "sinks + recent + highest key-value leverage (fixed projection)"
DEFAULTS = {"rank": 20}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, partial(Leverage, fresh=False), DEFAULTS, options)

"""``random``: uniform random eviction (the control of VaSE's ablation, arXiv 2606.03928, Sec. 5)."""

from ..key_scoring import Constant
from ..policy import Policy, compose

NAME = "random"
SOURCE = "uniform random eviction (control), VaSE arXiv 2606.03928, Sec. 5"
KEEPS = "sinks + recent + a uniform random subset"
DEFAULTS: dict = {}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, Constant, DEFAULTS, options, selector="sample")

"""``keydiff``: keep the keys least similar to the mean key direction (no queries needed).

Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364, Sec. 3.
"""

from ..key_scoring import KeyDiversity
from ..policy import Policy, compose

NAME = "keydiff"
SOURCE = "Park et al. 2025, KeyDiff, arXiv 2504.15364, Sec. 3"
KEEPS = "sinks + recent + the most distinctive keys"
DEFAULTS: dict = {}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, KeyDiversity, DEFAULTS, options)

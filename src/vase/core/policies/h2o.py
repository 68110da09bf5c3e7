"""``h2o``: heavy hitters, the tokens with the largest attention accumulated over all past queries.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048, Sec. 3. The running sum is kept per cached token and updated at each eviction from the saved
queries (``window`` should be >= the buffer so that every decode query is counted).
"""

from ..policy import Policy, compose
from ..scoring import AccumulatedAttention

NAME = "h2o"
SOURCE = "Zhang et al. 2023, H2O, arXiv 2306.14048, Sec. 3"
KEEPS = "sinks + recent + largest accumulated attention"
DEFAULTS = {"window": 64, "value_weight": "none"}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, AccumulatedAttention, DEFAULTS, options)

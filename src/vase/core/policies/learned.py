"""``learned``: a linear model per (layer, KV head) predicting each entry's future attention; top-k by default.

After TrimKV ("Make Each Token Count", arXiv 2605.09649) and KVpop (arXiv 2607.05061), which train a retention
scorer against the attention of future queries; vase's is a ridge regression on eight features of each entry
(window attention, pooled attention, key and value norms, value range, age, relative position, key direction), see
:mod:`vase.core.learned`. ``weights=PATH`` loads a file made by ``vase train-scorer``; without it the scorer is its
prior, the window attention alone. Every guard, selector and budget option composes with it, for example
``learned:weights=w.pt:guard=range:selector=sample:step_budget=confidence`` (the stack).
"""

from ..learned import LearnedScore
from ..policy import Policy, compose

NAME = "learned"
SOURCE = "learned retention score after TrimKV (arXiv 2605.09649) and KVpop (arXiv 2607.05061); vase.core.learned"
KEEPS = "sinks + recent + top-k predicted future attention"
DEFAULTS = {"weights": None, "window": 64}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, an invalid value, or a weights file that is missing or
            not a learned-scorer file.
    """
    return compose(NAME, SOURCE, KEEPS, LearnedScore, DEFAULTS, options)

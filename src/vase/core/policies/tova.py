"""``tova``: Token Omission Via Attention, the attention of the last query averaged over the heads of the layer.

Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104, Sec. 4. vase evicts in batches every
``buffer`` steps using the newest query, rather than one token per step.
"""

from functools import partial

from ..policy import Policy, compose
from ..scoring import WindowAttention

NAME = "tova"
SOURCE = "Oren et al. 2024, TOVA, arXiv 2401.06104, Sec. 4"
KEEPS = "sinks + recent + highest attention from the newest query (layer-wide)"
DEFAULTS = {"value_weight": "none"}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(
        NAME,
        SOURCE,
        KEEPS,
        partial(WindowAttention, window=1, kernel=1, pool="avg", head_reduce="layer"),
        DEFAULTS,
        options,
    )

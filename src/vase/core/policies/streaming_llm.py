"""``streaming_llm``: attention sinks + the most recent tokens.

Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453, Sec. 3.2.
"""

from ..key_scoring import Recency
from ..policy import Policy, compose

NAME = "streaming_llm"
SOURCE = "Xiao et al. 2024, StreamingLLM, arXiv 2309.17453, Sec. 3.2"
KEEPS = "4 sink tokens + the most recent tokens"
DEFAULTS: dict = {}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, Recency, DEFAULTS, options)

"""``quest``: query-aware sparse attention over the whole cache (selection, not eviction).

Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774, Sec. 3.
Nothing is evicted: the cache holds every token (its buffers grow like ``full``'s) plus, per page of ``page`` tokens
(16), the element-wise min and max of the page's keys per KV head. At each step after the prefill, each query token
and query head attends to its own page, the sink pages and the pages with the largest upper bound of ``q . k``
within the budget, which here means tokens attended per step (see :mod:`vase.core.pages`). The budget of the evicting
policies means tokens kept (they attend to ``budget`` to ``budget + buffer`` tokens); quest attends to at most
``budget``.
"""

from dataclasses import replace

from ..pages import PageSelection
from ..policy import Policy, compose

NAME = "quest"
SOURCE = "Tang et al. 2024, Quest, arXiv 2406.10774, Sec. 3"
KEEPS = "every token (whole cache + page min/max keys); attends to sink + current + top pages by q.k bound"
DEFAULTS = {"page": 16}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or a page that is not a positive integer.
    """
    policy = compose(NAME, SOURCE, KEEPS, None, DEFAULTS, options)
    sparse = PageSelection(page=policy.options["page"])
    sparse.check(None, 0)
    return replace(policy, sparse=sparse)

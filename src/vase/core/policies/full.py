"""``full``: the full cache, never evicts (the reference every policy is measured against).

Inside an :class:`vase.EvictingCache` its buffers grow by one budget at a time when full; for the plain transformers
cache use ``transformers.DynamicCache``. With ``kv_bits`` it stores every token older than its recent window in
``kv_bits``-bit integers (quantization alone, KIVI-style: arXiv 2402.02750, Sec. 3), in blocks of ``buffer`` tokens,
and with ``protect_precision=guard`` (and ``guard=range``) keeps the ``protect_share`` of them with the largest values
in full precision (see :mod:`vase.core.quant`).
"""

from ..policy import Policy, compose

NAME = "full"
SOURCE = "full KV cache (no eviction)"
KEEPS = "every token"
DEFAULTS: dict = {}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, or an invalid value.
    """
    return compose(NAME, SOURCE, KEEPS, None, DEFAULTS, options, quantizable=True)

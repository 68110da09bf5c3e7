"""Feeding the model's confidence to the cache inside ``model.generate`` (for ``step_budget='confidence'``).

:class:`ConfidenceFeed` is a transformers logits processor that passes the scores of each step to
:meth:`vase.EvictingCache.observe_confidence` and returns them unchanged. transformers runs the processors passed to
``generate`` before its sampling warpers (temperature, top-k, top-p), so the confidence is the model's own
distribution's (after any repetition penalty), whatever the sampling settings.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..core.confidence import top_probability


def masked_top(logits: torch.Tensor, mask: torch.Tensor | None, batch: int | None) -> torch.Tensor:
    """The top next-token probability of each real position, NaN at padding (see
    :meth:`vase.EvictingCache.observe_confidence` for the shapes).

    Raises:
        ValueError: ``logits`` whose batch is not ``batch`` (the cache's), or a mask of another shape.
    """
    if batch is None or logits.shape[0] != batch:
        raise ValueError(
            f"observe_confidence: logits for {logits.shape[0]} rows, the cache holds {batch}: pass the logits "
            "of the forward pass that used this cache"
        )
    top = top_probability(logits)
    if mask is not None:
        if tuple(mask.shape) != tuple(top.shape):
            raise ValueError(f"observe_confidence: mask of shape {tuple(mask.shape)}, expected {tuple(top.shape)}")
        top = top.masked_fill(~mask.to(torch.bool, non_blocking=True), float("nan"))
    return top


class ConfidenceFeed(LogitsProcessor):
    """Passes each step's next-token scores to ``cache`` (see the module docstring).

    Example::

        cache = vase.EvictingCache(model, policy="vase:step_budget=confidence", budget=512)
        model.generate(**inputs, cache=cache, logits_processor=[vase.hf.ConfidenceFeed(cache)])

    Args:
        cache: the :class:`vase.EvictingCache` the generation uses.
    """

    def __init__(self, cache):
        self.cache = cache

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.cache.observe_confidence(scores)
        return scores

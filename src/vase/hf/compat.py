"""What differs between the supported transformers versions (5.17 to 5.24), found by feature rather than by number.

The one difference a caller sees is the keyword that hands a cache to ``model.generate`` and ``model(...)``:
``cache=`` in the newer releases (``past_key_values=`` still accepted there, with a ``FutureWarning``),
``past_key_values=`` in the older ones (which reject ``cache=`` as an unused model keyword). Code that runs under
both writes ``model.generate(**inputs, **vase.cache_kwargs(cache))``.
"""

from __future__ import annotations

from transformers.generation import utils as _generation_utils

# transformers lists the keywords that may hold a cache, the current one first ("cache" from the release that
# renamed it, "past_key_values" before)
CACHE_KEYWORD: str = getattr(_generation_utils, "ALL_CACHE_NAMES", ["cache"])[0]


def cache_kwargs(cache) -> dict:
    """The keyword arguments that hand ``cache`` to ``model.generate`` or a model's forward in this transformers:
    ``{"cache": cache}`` or, before transformers renamed it, ``{"past_key_values": cache}``.

    Args:
        cache: any transformers ``Cache`` (an :class:`vase.EvictingCache`, a ``DynamicCache``, ...).
    """
    return {CACHE_KEYWORD: cache}


# the arguments of a kept layer's class, by layer type, where transformers gives one set for all layers (5.17)
_LAYER_ARGUMENTS = {
    "sliding_attention": ("sliding_window",),
    "chunked_attention": ("sliding_window",),
    "conv": ("number_of_states",),
    "linear_attention": ("number_of_states",),
    "hybrid": ("number_of_states",),
    "hybrid_sliding": ("sliding_window", "number_of_states"),
}


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """transformers' reading of a decoder's layer kinds: ``(types, kwargs)``, one layer type and one dict of cache
    layer arguments per layer (``get_layer_types_and_kwargs``; where it returns one dict for every layer, 5.17, each
    layer gets the arguments its own type takes)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    types = list(types)
    if isinstance(kwargs, dict):
        kwargs = [{k: kwargs[k] for k in _LAYER_ARGUMENTS.get(t, ()) if k in kwargs} for t in types]
    return types, list(kwargs)

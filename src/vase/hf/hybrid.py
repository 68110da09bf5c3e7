"""Hybrid models: evicting full-attention layers beside the sliding-window and linear-attention layers of a model.

Several reasoning models mix layer types (transformers 5.24): gpt-oss alternates sliding-window layers (128 tokens)
with full attention, Gemma 3 and OLMo 3 have mostly sliding-window layers and some full (global) ones, Qwen3-Next and
Qwen3.5 have gated-delta-net linear-attention layers and a full-attention layer in four. Only the full-attention
layers hold a cache that grows with the sequence; the others hold a bounded state already (the last
``sliding_window - 1`` keys and values, or a convolution state and a recurrent state of fixed size).

An :class:`~vase.EvictingCache` therefore builds, layer by layer, what transformers' own default cache
(``DynamicCache(config=model.config)``) would build, except that each full-attention layer becomes an evicting layer:
the other layers are instances of transformers' own classes (``DynamicSlidingWindowLayer``, ``LinearAttentionLayer``)
made with the same arguments, so their state is exactly the default cache's. This module decides, from the model's
config, which layers evict and which are kept as transformers makes them, and refuses the layer kinds vase cannot
handle yet, saying which and why.

Source of the layer kinds and their arguments: ``transformers.cache_utils.get_layer_types_and_kwargs`` and
``DYNAMIC_LAYER_TYPE_MAPPING`` (the mapping ``DynamicCache(config=...)`` dispatches with).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    CacheLayerMixin,
    LinearAttentionCacheLayerMixin,
)

from .compat import layer_types_and_kwargs

EVICTING_LAYER_TYPES = ("full_attention",)
"""Layer types whose cache vase bounds by eviction."""

KEPT_LAYER_TYPES = ("sliding_attention", "linear_attention")
"""Layer types kept as transformers' default cache holds them (their state is bounded already)."""

UNSUPPORTED_LAYER_TYPES = {
    "chunked_attention": "chunked (block-local) attention layers have not been verified with vase's masks yet",
    "conv": "short-convolution layers (LFM2-style) have not been verified with vase yet",
    "hybrid": "the layer keeps a linear-attention state and a growing full-attention cache in one transformers cache "
    "layer, which vase cannot evict inside",
    "hybrid_sliding": "the layer keeps a linear-attention state and a sliding-window cache in one transformers cache "
    "layer, which has not been verified with vase yet",
    "indexed_attention": "the layer's indexer selects keys over the whole cache by itself (sparse attention); evicting "
    "under it would change what the indexer sees",
    "compressed_sparse_attention": "the layer compresses its keys with its own cache logic",
    "heavily_compressed_attention": "the layer compresses its keys with its own cache logic",
    "dummy": "the layer holds no cache of its own",
}
"""Layer types refused, with the reason given in the error."""

SHARING_REASON = (
    "later layers reuse the keys and values of an earlier layer (KV sharing, as in Gemma 3n and the small Gemma 4 "
    "models); an eviction would change them under the layers that share them"
)


@dataclass(frozen=True)
class LayerPlan:
    """What a cache holds for one decoder layer.

    Attributes:
        index: the layer's index in the model (``layer_idx`` of its attention module).
        layer_type: transformers' layer type (``full_attention``, ``sliding_attention``, ``linear_attention``).
        evicts: True for the layers vase bounds by eviction (full attention).
        kwargs: arguments of transformers' layer class for a kept layer (``sliding_window``, ``number_of_states``).
        kv_heads, head_dim: the keys an evicting layer expects (from the layer's own config: Gemma 4's global
            layers have their own), None for kept layers.
    """

    index: int
    layer_type: str
    evicts: bool
    kwargs: dict = field(default_factory=dict)
    kv_heads: int | None = None
    head_dim: int | None = None


def plan_layers(config) -> list[LayerPlan]:
    """One :class:`LayerPlan` per decoder layer of ``config`` (a text/decoder config).

    Layer types come from transformers' own reading of the config (``get_layer_types_and_kwargs``: explicit
    ``layer_types``, else a per-layer ``sliding_window`` or ``attention_chunk_size``, else full attention).

    Raises:
        ValueError: a layer type listed in :data:`UNSUPPORTED_LAYER_TYPES` or unknown (the message names it, its
            layers and the reason), KV sharing between layers, no full-attention layer at all (nothing to evict:
            the model's default cache is bounded already), or a model without ``num_key_value_heads``.
    """
    model_type = getattr(config, "model_type", "?")
    modes = getattr(config, "kv_sharing_modes", None)
    # older transformers (5.19) name only how many of the last layers reuse earlier layers' keys and values
    shared_layers = getattr(config, "num_kv_shared_layers", 0) or 0
    if (modes is not None and any(m == "reuse" for m in modes)) or (modes is None and shared_layers > 0):
        raise ValueError(
            f"this model ({model_type}) shares keys and values between layers: {SHARING_REASON}. Load a variant "
            "without KV sharing (e.g. num_kv_shared_layers=0)"
        )
    # explicit layer types are checked before transformers reads the arguments of their layer classes (a chunked
    # layer needs attention_chunk_size...); without them transformers infers the types from the config
    types = list(getattr(config, "layer_types", None) or [])
    kwargs = None
    if not types:
        types, kwargs = layer_types_and_kwargs(config)
    bad: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if t not in EVICTING_LAYER_TYPES and t not in KEPT_LAYER_TYPES:
            bad.setdefault(t, []).append(i)
    if bad:
        lines = "; ".join(
            f"{t} (layers {', '.join(map(str, idx))}): {UNSUPPORTED_LAYER_TYPES.get(t, 'an unknown layer type')}"
            for t, idx in sorted(bad.items())
        )
        raise ValueError(
            f"this model ({model_type}) has layer type(s) EvictingCache cannot handle: {lines}. Supported: "
            f"{', '.join(EVICTING_LAYER_TYPES)} layers (evicted) beside {', '.join(KEPT_LAYER_TYPES)} layers (kept as "
            "transformers holds them)"
        )
    if EVICTING_LAYER_TYPES[0] not in types:
        raise ValueError(
            f"this model ({model_type}) has no full-attention layer (layer types: {', '.join(sorted(set(types)))}): "
            "its default cache is bounded already and EvictingCache would have nothing to evict. Use the model's "
            "default cache, or a model with full-attention layers"
        )
    if kwargs is None:
        kwargs = layer_types_and_kwargs(config)[1]
    per_layer = config.per_layer_config
    plan = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        if t in EVICTING_LAYER_TYPES:
            layer_cfg = per_layer[i]
            heads = getattr(layer_cfg, "num_key_value_heads", None)
            if heads is None:
                raise ValueError(f"model type {model_type!r} has no num_key_value_heads: not a supported decoder")
            dim = getattr(layer_cfg, "head_dim", None) or layer_cfg.hidden_size // layer_cfg.num_attention_heads
            plan.append(LayerPlan(i, t, True, {}, int(heads), int(dim)))
        else:
            plan.append(LayerPlan(i, t, False, dict(kw)))
    return plan


def kept_layer(plan: LayerPlan):
    """A new, empty transformers cache layer for a kept (non-evicting) layer: the class and arguments
    ``DynamicCache(config=...)`` would use (``DynamicSlidingWindowLayer(sliding_window=...)``,
    ``LinearAttentionLayer(number_of_states=...)``)."""
    return DYNAMIC_LAYER_TYPE_MAPPING[plan.layer_type](**plan.kwargs)


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def state_bytes(layer) -> int:
    """Bytes a transformers cache layer holds now: its key and value tensors (attention layers), its convolution and
    recurrent states (linear-attention layers), both for a layer that has both; a layer with a ``storage_bytes()``
    method (vase's quantized layer) says itself."""
    storage = getattr(layer, "storage_bytes", None)
    if callable(storage):  # a quantized evicting layer: its packed stores (vase.hf.quantized)
        return storage()
    total = 0
    if isinstance(layer, CacheLayerMixin):
        total += _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for states in (layer.conv_states, layer.recurrent_states):
            total += sum(_tensor_bytes(t) for t in states.values())
    return total

"""Attention plumbing: save the post-RoPE queries, own the mask, then call the model's usual attention function.

:func:`install` registers, in transformers' attention-function registry, a wrapper ``vase_<impl>`` around the
model's current implementation (``sdpa``, ``eager``, ``flash_attention_2``/``3``) and switches the model to it; it also
registers a forward pre-hook on the decoder that hands the 2-D padding mask to an :class:`~vase.EvictingCache`. No
model code is copied and no forward is patched.

When the keys handed to the wrapper come from an :class:`~vase.hf.layer.EvictingLayer` write (checked by identity), the
wrapper (1) saves the queries in that layer's ring, (2) passes a mask over the physical slots instead of the logical
one, (3) calls the base function, (4) lets the layer write staged tokens and evict. A decode step of a layer stored
with ``kv_bits`` reads the quantized codes instead of calling the base function (``EvictingLayer.attend_codes``).
With any other cache (or none) it calls the base function
unchanged, so one model can serve a ``DynamicCache`` and an ``EvictingCache``. The kept layers of a hybrid model
(sliding window; see :mod:`vase.hf.hybrid`) are marked by the cache's ``update`` as passed
through: the wrapper calls the base function with transformers' own mask and every keyword the model gives (gpt-oss's
``s_aux`` sinks, Gemma's ``scaling`` and ``softcap``, ``sliding_window``).

The mask function registered under the same ``vase_<impl>`` name builds transformers' usual mask, except during a
forward pass that uses an :class:`~vase.EvictingCache` (flagged by the pre-hook) for a mask sized against an evicting
layer (the cache says so when transformers asks it for the mask's sizes): then it builds nothing and returns None,
since the wrapper would discard that mask (``[B, 1, q, seen + q]``, as large as the attention weights of a prefill in
eager) for its own. The sliding-window mask of a hybrid model, sized against its sliding layer, is built as usual.

Compiled decoding (``EvictingCache(..., compileable=True)``, see :class:`vase.EvictingCache`): the same wrapper and
hook run inside the compiled step, where the cache takes its fixed-shape path. ``generate`` builds each step's mask
outside the compiled forward when the cache is compileable; the cache then hands the mask function an override
(:func:`mask_for`): the physical-slot mask of the decode step, or, before the prefill, the 2-D padding mask itself.
The per-thread state is set in full from the start, so that a compiled graph guards on values, not on attributes
appearing later.
"""

from __future__ import annotations

import sys
import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..core.masks import mask_in_kind  # noqa: F401  (re-exported: the integration's mask helper)

BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
_MASK_KIND = {"sdpa": "bool", "eager": "additive", "flash_attention_2": "padding", "flash_attention_3": "padding"}
_PREFIX = "vase_"


class _ThreadState(threading.local):
    """Per-thread state. Every attribute exists from the start, so a compiled graph that reads one guards on its value,
    not on whether it has been set yet (a guard that would fail, and recompile, once another cache sets it)."""

    def __init__(self):
        self.item = None  # hand-off: (EvictingLayer or _PASS, key tensor) from a cache update to the next attention
        self.evicting = False  # the decoder forward pass in progress on this thread uses an EvictingCache
        self.mask_evicting = True  # the next mask transformers builds is for an evicting layer
        self.mask_override = None  # what the next mask function call returns instead (see mask_for)


_handoff = _ThreadState()
_forward = _ThreadState()
_PASS = object()  # hand-off marker of a kept (non-evicting) layer of an EvictingCache


def hand_off(layer, key: torch.Tensor) -> None:
    """Called by an EvictingLayer's write (or compiled decoding's, with its static call object): the next attention
    call with this very ``key`` tensor is its."""
    _handoff.item = (layer, key)


def pass_through(key: torch.Tensor) -> None:
    """Called by an EvictingCache after updating one of its kept layers (sliding window): the next attention call with
    this very ``key`` tensor runs the base function unchanged, with transformers' mask."""
    _handoff.item = (_PASS, key)


def mask_for(evicting: bool, override=None) -> None:
    """Called by an EvictingCache when transformers asks it for the sizes of the next mask: whether that mask is for
    an evicting layer (not built; see :func:`_make_mask_function`) or a kept one (built as usual).

    ``override(kind, dtype, kwargs)``: what the mask function returns instead, for a mask transformers builds outside
    a forward pass (``generate`` with a compileable cache builds it before each step): the physical-slot mask of a
    compiled decode step, or the 2-D padding mask itself before the prefill (so vase's pre-hook still gets it)."""
    _forward.mask_evicting = evicting
    _forward.mask_override = override


def _take(key: torch.Tensor):
    item = _handoff.item
    if item is not None and item[1] is key:
        _handoff.item = None
        return item[0]
    return None


def evicting_forward() -> bool:
    """Whether the decoder forward pass running on this thread uses an :class:`~vase.EvictingCache`."""
    return _forward.evicting


def _fallback_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain eager attention (used only if a model's modeling file defines no ``eager_attention_forward``)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def _base_function(base: str, module):
    if base == "eager":
        modeling = sys.modules.get(type(module).__module__)
        return getattr(modeling, "eager_attention_forward", None) or _fallback_eager
    return AttentionInterface._global_mapping[base]


def _make_wrapper(base: str):
    kind = _MASK_KIND[base]

    def vase_attention(module, query, key, value, attention_mask, **kwargs):
        layer = _take(key)
        fn = _base_function(base, module)
        if layer is _PASS:
            return fn(module, query, key, value, attention_mask, **kwargs)
        if layer is None:
            if evicting_forward():
                raise RuntimeError(
                    "vase's attention got keys that did not come from its EvictingCache during a forward pass that "
                    f"uses one ({type(module).__name__}): this model's attention is not supported by vase"
                )
            return fn(module, query, key, value, attention_mask, **kwargs)
        layer.record_queries(query, kwargs.get("scaling"))
        if layer.codes:  # a decode step over quantized entries: read the codes, no workspace
            out = layer.attend_codes(query, kwargs)
            if out is not None:
                layer.after_attention()
                return out
            key, value = layer.attention_inputs()
        mask = layer.attention_mask(kind, query.dtype, query)
        out = fn(module, query, key, value, mask, **kwargs)
        layer.after_attention()
        return out

    vase_attention.__name__ = f"vase_{base}_attention"
    vase_attention.__doc__ = f"vase wrapper around transformers' {base!r} attention (see vase.hf.attention)."
    return vase_attention


def _make_mask_function(base: str):
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS[base]
    kind = _MASK_KIND[base]

    def vase_mask(*args, **kwargs):
        override = _forward.mask_override
        if override is not None:
            _forward.mask_override = None
            if not evicting_forward():
                return override(kind, kwargs.get("dtype", torch.float32), kwargs)
        if evicting_forward():
            evicting = _forward.mask_evicting
            _forward.mask_evicting = True
            if evicting:
                return None  # the attention wrapper builds the mask over physical slots itself
        return base_mask(*args, **kwargs)

    vase_mask.__name__ = f"vase_{base}_mask"
    vase_mask.__doc__ = (
        f"transformers' {base!r} mask; None for an evicting layer in a forward with an EvictingCache "
        "(vase.hf.attention)."
    )
    return vase_mask


def _post_hook(module, args, kwargs, output):
    _forward.evicting = False
    _forward.mask_evicting = True
    return None


def _pre_hook(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    begin = getattr(cache, "_begin_forward", None)
    _forward.evicting = begin is not None
    if begin is None:
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    if ref is None:
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict):  # generate's masks per layer type (a compileable cache): vase's own 2-D one
        mask = mask.get("full_attention")
    begin(model=module, batch=ref.shape[0], q=ref.shape[1], attention_mask=mask)
    return None


def base_implementation(model) -> str:
    """The attention implementation vase wraps on ``model`` (``sdpa``, ``eager``, ...)."""
    impl = model.config._attn_implementation
    return impl[len(_PREFIX) :] if impl and impl.startswith(_PREFIX) else impl


def install(model) -> str:
    """Make ``model`` use vase's attention wrapper around its current implementation; idempotent.

    Returns the registered implementation name (``vase_sdpa``, ...).

    Raises:
        ValueError: if the model's attention implementation is not one vase can wrap.
    """
    base = base_implementation(model)
    if base not in BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {base!r} is not supported by vase; load the model with "
            f"attn_implementation one of {', '.join(BASE_IMPLEMENTATIONS)}"
        )
    name = _PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _make_wrapper(base))
        mask_base = "eager" if base == "eager" else ("sdpa" if base == "sdpa" else "flash_attention_2")
        AttentionMaskInterface.register(name, _make_mask_function(mask_base))
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    decoder = decoder if decoder is not None else model
    if not getattr(decoder, "_vase_hooked", False):
        decoder.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        decoder.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
        decoder._vase_hooked = True
    return name


def uninstall(model) -> None:
    """Switch ``model`` back to its base attention implementation (the hook stays; it is inert without a vase cache)."""
    base = base_implementation(model)
    if model.config._attn_implementation != base:
        model.set_attn_implementation(base)

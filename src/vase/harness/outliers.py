"""Planted value outliers: a controlled test of the mechanism VaSE is about.

VaSE (arXiv 2606.03928, Sec. 3.1) protects the few cached entries whose value vectors have abnormally large
magnitude, because evicting them derails the model. A model without such entries (the embedded SmolLM2 has none:
docs/RESULTS.md) cannot show that. :class:`PlantedValues` makes some: forward hooks on the value projections of chosen
layers rescale the value vectors of chosen token positions so that, in every KV head, their range (max - min over
head_dim) is ``scale`` times the head's median range. Keys (so attention weights) are untouched. The hooks act the
same way whatever cache the model uses, so the full-cache reference and the policies see the same model.

Positions are logical positions in the sequence (``cache.get_seq_length()`` at the start of each forward, plus the
index of the token in the step). Meant for batch-1 replays (:func:`vase.harness.fidelity.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PlantedValues:
    """Scale the value vectors of ``positions`` in ``layers`` to ``scale`` x the head's median value range.

    The median range of each (layer, KV head) is measured on the first forward pass after :meth:`attach` or
    :meth:`reset` (the prompt), over its tokens, and kept for the rest of the sequence.

    Args:
        layers: decoder layer indices.
        positions: logical token positions (0-based) to plant.
        scale: target range as a multiple of the head's median range (the paper's outliers are tens of times the
            median).

    Raises:
        ValueError: empty ``layers``/``positions``, ``scale <= 0``; at :meth:`attach`, a layer index the model does
            not have or a model without ``layers.<i>.self_attn.v_proj`` modules.
    """

    def __init__(self, layers: Sequence[int], positions: Sequence[int], scale: float = 20.0):
        if not layers or not positions:
            raise ValueError("give at least one layer and one position to plant value outliers")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.layers = sorted(set(int(x) for x in layers))
        self.positions = sorted(set(int(p) for p in positions))
        self.scale = float(scale)
        self._handles: list = []
        self._start = 0
        self._median: dict[int, torch.Tensor] = {}
        self.kv_heads = 0

    def attach(self, model) -> PlantedValues:
        """Register the hooks on ``model`` (returns self; use :meth:`detach` to remove them)."""
        config = model.config.get_text_config(decoder=True)
        self.kv_heads = config.num_key_value_heads
        modules = dict(model.named_modules())
        found = {}
        for name, mod in modules.items():
            parts = name.split(".")
            if len(parts) >= 4 and parts[-1] == "v_proj" and parts[-2] == "self_attn" and parts[-4] == "layers":
                found[int(parts[-3])] = mod
        if not found:
            raise ValueError("this model has no layers.<i>.self_attn.v_proj modules: cannot plant value outliers")
        missing = [i for i in self.layers if i not in found]
        if missing:
            raise ValueError(f"layer(s) {missing} not in the model (it has {len(found)} layers: 0-{len(found) - 1})")
        decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
        self._handles.append(decoder.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        for i in self.layers:
            self._handles.append(found[i].register_forward_hook(self._make_hook(i)))
        return self

    def detach(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset(self) -> None:
        """Forget the measured medians (call before a new sequence if the model is reused)."""
        self._median = {}

    def _pre_hook(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._start = cache.get_seq_length() if cache is not None else 0
        if self._start == 0:
            self._median = {}
        return None

    def _make_hook(self, layer: int):
        def hook(module, inputs, output):
            b, q, width = output.shape
            h = self.kv_heads
            v = output.view(b, q, h, width // h)
            rng = (v.amax(-1) - v.amin(-1)).float()  # [b, q, H]
            if layer not in self._median:
                self._median[layer] = rng.reshape(-1, h).median(0).values  # [H]
            pos = torch.arange(self._start, self._start + q, device=output.device)
            hit = torch.isin(pos, torch.tensor(self.positions, device=output.device))
            if not bool(hit.any()):
                return output
            target = self._median[layer].to(output.device) * self.scale  # [H]
            factor = (target.view(1, 1, h) / rng.clamp_min(1e-6)).to(output.dtype)  # [b, q, H]
            factor = torch.where(hit.view(1, q, 1), factor, torch.ones_like(factor))
            return (v * factor.unsqueeze(-1)).reshape(b, q, width)

        return hook


def kept_share(cache, layers: Sequence[int], positions: Sequence[int]) -> float:
    """Share of the planted (layer, KV head, position) entries an :class:`~vase.EvictingCache` (batch 1) still holds,
    in [0, 1]; entries whose positions are newer than the last eviction count as held."""
    held = total = 0
    for i in layers:
        pos = cache.layers[i].positions[0]  # [H, capacity]
        for p in positions:
            hit = (pos == p).any(-1)  # [H]
            held += int(hit.sum())
            total += hit.numel()
    return held / total if total else 1.0


def full_precision_share(cache, layers: Sequence[int], positions: Sequence[int]) -> float | None:
    """Share of the planted (layer, KV head, position) entries an :class:`~vase.EvictingCache` (batch 1) holds that
    it holds in full precision (not quantized: the guard's entries with ``protect_precision='guard'``, and the recent
    tokens), in [0, 1]; None without ``kv_bits`` or when it holds none of them."""
    if not getattr(cache, "quantized", False):
        return None
    held = full = 0
    for i in layers:
        layer = cache.layers[i]
        pos = layer.positions[0]  # [H, capacity]
        lim = layer.storage.qmask.shape[-1]
        for p in positions:
            hit = pos == p  # [H, capacity]
            held += int(hit.sum())
            quantized = hit[:, :lim] & layer.storage.qmask[0]
            full += int(hit.sum()) - int(quantized.sum())
    return full / held if held else None

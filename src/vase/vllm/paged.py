"""vLLM's CPU attention backend's paged KV cache, read off its own cache write.

One layer's cache is ``[num_blocks, H_kv, block_size, 2 * D]`` (``v1/worker/utils.py`` ``allocate_kv_cache``); how
the bytes of a (block, KV head) are packed depends on the kernel's ISA (``vec`` / ``vec16``: keys transposed then
values; ``amx``: packed for its tiles). :func:`cpu_layout` probes it through vLLM's own write,
``cpu_attn_reshape_and_cache`` (which skips slots < 0), once per builder: see :mod:`vase.vllm.layout`.
"""

from __future__ import annotations

import functools

import torch

from .layout import HeadMajorKT, PagedLayout, probe
from .seam import cpu_attn_reshape_and_cache


def cpu_write(isa: str, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """vLLM's CPU cache write: ``keys`` / ``values`` ``[T, H, D]`` at physical ``slots`` ``[T]`` (int64, < 0
    skipped) of one layer's cache, packed for the kernel's ``isa`` (the model's dtype: ``kv_cache_dtype='auto'``, so
    no scale applies)."""
    nb, h, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, bs * 2, -1).chunk(2, dim=2)
    cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


@functools.lru_cache(maxsize=16)
def cpu_layout(isa: str, heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PagedLayout:
    """The layout of the CPU backend's cache for the kernel's ``isa`` (probed once per shape). Where the probe finds
    the layout vLLM's source describes for ``vec`` / ``vec16`` (keys transposed, then values), its view-based reader
    (:class:`vase.vllm.layout.HeadMajorKT`: no index gather) is returned, writing through vLLM's write all the same.

    Raises:
        vase.vllm.layout.LayoutError: a layout the write does not store element by element.
    """
    writer = functools.partial(cpu_write, isa)
    probed = probe(writer, heads, block_size, head_dim, dtype, f"CPU attention, ISA {isa}")
    d, bs = head_dim, block_size
    slot, dim = torch.arange(bs).view(bs, 1), torch.arange(d).view(1, d)
    if torch.equal(probed.key_map, dim * bs + slot) and torch.equal(probed.value_map, bs * d + slot * d + dim):
        return HeadMajorKT(writer)
    return probed

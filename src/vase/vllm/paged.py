"""Reading and writing a request's entries in vLLM's CPU paged KV cache.

One layer's cache is ``[num_blocks, H_kv, block_size, 2 * D]`` (``v1/worker/utils.py`` ``allocate_kv_cache``).
Inside one (block, KV head), for the ``vec`` / ``vec16`` kernels (the ISAs checked; others are refused), the keys are
stored transposed, ``[D, block_size]``, followed by the values ``[block_size, D]``. Writes go through vLLM's own
``cpu_attn_reshape_and_cache`` (which skips slots < 0), so only reads depend on that layout.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops

CHECKED_ISAS = ("vec", "vec16")


def gather(kv_cache: torch.Tensor, block_rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, H_kv, length, D]`` of the first ``length`` physical slots of each row.

    Args:
        kv_cache: one layer's cache ``[num_blocks, H_kv, block_size, 2 * D]``.
        block_rows: ``[B, nb]`` int64 block ids of each row, in order (at least ``ceil(length / block_size)``).
        length: slots to read (tokens).
    """
    _, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    nb = -(-length // bs)
    b = block_rows.shape[0]
    blk = kv_cache[block_rows[:, :nb]].view(b, nb, h, 2 * bs * d)
    keys = blk[..., : bs * d].reshape(b, nb, h, d, bs).permute(0, 2, 1, 4, 3).reshape(b, h, nb * bs, d)
    values = blk[..., bs * d :].reshape(b, nb, h, bs, d).permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, d)
    return keys[:, :, :length], values[:, :, :length]


def front_slots(block_rows: torch.Tensor, count: int, block_size: int) -> torch.Tensor:
    """Physical slots ``0 .. count-1`` of each row: ``[B, count]`` int64."""
    j = torch.arange(count)
    return block_rows[:, j // block_size] * block_size + j % block_size


def write_front(
    kv_cache: torch.Tensor,
    block_rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer,
    kv_cache_dtype: str,
) -> None:
    """Write ``keys`` / ``values`` ``[B, H_kv, K, D]`` into physical slots ``0 .. K-1`` of each row's blocks.

    Each KV head may hold a different token in the same slot (heads keep different tokens): slot ``j`` of a row
    receives ``keys[:, :, j]``, one vector per head, as if it were one token.
    """
    nb_all, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    b, _, k, _ = keys.shape
    slots = front_slots(block_rows, k, bs).reshape(-1)
    key_cache, value_cache = kv_cache.view(nb_all, h, bs * 2, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys.permute(0, 2, 1, 3).reshape(b * k, h, d).contiguous(),
        values.permute(0, 2, 1, 3).reshape(b * k, h, d).contiguous(),
        key_cache,
        value_cache,
        slots,
        layer.isa,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=kv_cache_dtype,
    )

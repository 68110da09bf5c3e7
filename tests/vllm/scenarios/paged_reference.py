"""Plain-torch paged attention from exactly the arguments vLLM's GPU attention backends hand their kernels (used by
``tests/vllm/test_paged_layout.py`` and ``tests/vllm/scenarios/gpu_backends.py``)."""

from __future__ import annotations

import torch


def paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale):
    """Plain-torch paged attention from exactly what vLLM's GPU backends take: ``query`` ``[T, Hq, D]``, key / value
    caches ``[blocks, block_size, H, D]`` (``kv_cache.transpose(1, 2).split(D, -1)``), ``block_table`` ``[R, nb]``,
    ``seq_lens`` ``[R]`` (tokens in the cache, the new ones included), ``query_start_loc`` ``[R + 1]``; query ``i``
    of a row's ``q`` attends its first ``seq_len - q + i + 1`` slots (causal). ``[T, Hq, D]``, float32 math."""
    bs, h = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    for r in range(len(seq_lens)):
        n, q0, q1 = int(seq_lens[r]), int(query_start_loc[r]), int(query_start_loc[r + 1])
        if q1 == q0:
            continue
        j = torch.arange(n)
        blocks, offsets = block_table[r, j // bs].long(), j % bs
        k, v = key_cache[blocks, offsets].float(), value_cache[blocks, offsets].float()  # [n, H, D]
        q = query[q0:q1].float()  # [q, Hq, D]
        group = q.shape[1] // h
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", q, k) * scale
        allowed = j.view(1, -1) <= (n - (q1 - q0) + torch.arange(q1 - q0)).view(-1, 1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out


def write_slots(key, value, key_cache, value_cache, slot_mapping):
    """What the GPU backends' cache writes do: token ``i``'s key and value at slot ``slot_mapping[i]`` of
    ``[blocks, block_size, H, D]`` caches (slots < 0 skipped)."""
    bs = key_cache.shape[1]
    n = len(slot_mapping)
    ok = slot_mapping >= 0
    slots = slot_mapping[ok].long()
    key_cache[slots // bs, slots % bs] = key[:n][ok].to(key_cache.dtype)
    value_cache[slots // bs, slots % bs] = value[:n][ok].to(value_cache.dtype)

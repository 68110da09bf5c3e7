"""The paged layouts vase reads and writes (:mod:`vase.vllm.layout`): the CPU backend's (as vLLM's source lays out
its ``vec`` ISA, and as probed off vLLM's own cache write for every ISA this machine runs, ``amx`` included) and the
GPU backends' (a token's key then value, token-major or head-major in memory).

The same eviction on the same entries keeps bit-exact the same entries in every layout: the entries written at
random slots, gathered for scoring, chosen by the policy (:func:`vase.core.evict.evict_layer`), packed
(:func:`vase.core.evict.gather_kept`) and written back to each row's first slots in place, overlapping the slots
they were read from. Pure torch, any environment; the probe runs in ``.venv-vllm`` (skipped without it).
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm.scenarios.paged_reference import paged_attention
from tests.vllm.test_vllm import _run_script, needs_vllm
from vase.core.config import VaseConfig
from vase.core.evict import evict_layer, gather_kept
from vase.vllm.layout import HeadMajorKT, SplitKV

H, BS, D, BLOCKS = 2, 16, 8, 10
LAYOUTS = {
    "cpu-vec": (HeadMajorKT(), "HN"),
    "split-token-major": (SplitKV(), "NH"),
    "split-head-major": (SplitKV(), "HN"),
}


def empty_cache(layout, blocks: int, heads: int, block_size: int, head_dim: int, dtype, order: str) -> torch.Tensor:
    """A zeroed cache, logically ``[blocks, H, block_size, 2 D]``; ``order='NH'`` lays it out token-major in memory
    (``[blocks, block_size, H, 2D]``, as the GPU backends hold it), ``'HN'`` head-major."""
    if order == "NH":
        return torch.zeros(blocks, block_size, heads, 2 * head_dim, dtype=dtype).transpose(1, 2)
    return torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=dtype)


def _evicted(layout, order: str, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 70 entries (blocks 0, 3, 5, 7, 9 and 8, 6, 4, 2, 1) written at their slots, evicted to a budget
    of 24 by ``vase`` (sampled, value guard) and written back in place; their first 24 slots read back, and what
    the eviction chose."""
    return _evicted_in(layout, order, dtype)[2:]


ROWS = torch.tensor([[0, 3, 5, 7, 9], [8, 6, 4, 2, 1]])


def _evicted_in(layout, order: str, dtype=torch.float32):
    """:func:`_evicted`, with the cache and the rows' block ids first."""
    g = torch.Generator().manual_seed(3)
    cache = empty_cache(layout, BLOCKS, H, BS, D, dtype, order)
    rows = ROWS
    n = 70
    j = torch.arange(n)
    slots = rows[:, j // BS] * BS + j % BS  # [2, n]
    keys = torch.randn(2, n, H, D, generator=g).to(dtype)
    values = torch.randn(2, n, H, D, generator=g).to(dtype)
    layout.write_slots(cache, slots.reshape(-1), keys.reshape(-1, H, D), values.reshape(-1, H, D))
    held_k, held_v = layout.gather(cache, rows, n)
    assert torch.equal(held_k, keys.transpose(1, 2)) and torch.equal(held_v, values.transpose(1, 2))
    cfg = VaseConfig.resolve("vase", budget=24, buffer=8, sinks=2)
    positions = torch.arange(n).view(1, 1, n).expand(2, H, n).contiguous()
    ev = evict_layer(
        cfg.policy, held_k, held_v, positions, torch.ones(2, n, dtype=torch.bool), budget=24, slots=24, sinks=2,
        recent=8, row_keys=torch.tensor([11, 12]), eviction_index=torch.zeros(2, dtype=torch.long),
        latest_query=torch.full((2,), n - 1), queries=torch.randn(2, 2 * H, 8, D, generator=g).to(dtype),
        query_positions=torch.arange(n - 8, n).view(1, 8).expand(2, 8).contiguous(),
        query_valid=torch.ones(2, 8, dtype=torch.bool),
    )  # fmt: skip
    kk, vv, _, _ = gather_kept(ev.indices, ev.keep, held_k, held_v, positions, ev.state)
    layout.write_front(cache, rows, kk, vv)  # in place: slots 0..23 of the blocks just read
    got_k, got_v = layout.gather(cache, rows, 24)
    return cache, rows, got_k, got_v, ev.indices


def test_the_same_eviction_keeps_the_same_entries_in_every_layout():
    """Bit-exact: the kept entries read back from each layout are the entries the eviction chose (the moves overlap
    the slots read), and every layout keeps the same."""
    out = {name: _evicted(*lay) for name, lay in LAYOUTS.items()}
    ref_k, ref_v, ref_idx = out["cpu-vec"]
    for name, (k, v, idx) in out.items():
        assert torch.equal(idx, ref_idx), name
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v), name
    g = torch.Generator().manual_seed(3)  # the entries as written: row r's slot i holds keys[r, i]
    keys = torch.randn(2, 70, H, D, generator=g).transpose(1, 2)
    expect = torch.gather(keys, 2, ref_idx.unsqueeze(-1).expand(-1, -1, -1, D))
    assert torch.equal(ref_k, expect)


def test_token_major_split_layout_is_what_the_gpu_backends_read():
    """The GPU backends read ``kv_cache.transpose(1, 2).split(D, -1)``: ``[blocks, block_size, H, D]`` keys and
    values; what :class:`SplitKV` writes at a slot is where they read it, in a token-major tensor."""
    layout = SplitKV()
    cache = empty_cache(layout, 3, H, BS, D, torch.float32, "NH")
    assert cache.transpose(1, 2).is_contiguous()  # token-major in memory
    k, v = torch.randn(1, H, D), torch.randn(1, H, D)
    layout.write_slots(cache, torch.tensor([BS + 5]), k, v)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(key_cache[1, 5], k[0]) and torch.equal(value_cache[1, 5], v[0])
    assert key_cache.abs().sum() == k.abs().sum()  # nothing else written


def test_attention_over_the_token_major_cache_after_eviction_is_over_the_kept_entries():
    """After an eviction compacted in place in the GPU backends' token-major cache and a decode step written at the
    plan's physical slot, paged attention computed from the backend's own arguments (its view of the cache, the
    block table, physical ``seq_lens``, ``query_start_loc``) equals attention over exactly the kept entries and the
    new token; the CPU backend's layout gives the same."""
    g = torch.Generator().manual_seed(5)
    new_k, new_v = torch.randn(2, H, D, generator=g), torch.randn(2, H, D, generator=g)
    query = torch.randn(2, 2 * H, D, generator=g)  # one decode token per row, GQA groups of 2
    seq_lens, qsl = torch.tensor([25, 25]), torch.tensor([0, 1, 2])
    slot = ROWS[:, 24 // BS] * BS + 24 % BS  # each row's physical fill after the eviction to 24
    outs = {}
    for name, (layout, order) in LAYOUTS.items():
        cache, rows, kept_k, kept_v, _ = _evicted_in(layout, order)
        layout.write_slots(cache, slot, new_k, new_v)
        key_cache, value_cache = layout.views(cache)  # [blocks, H, bs, D]
        if name.startswith("split"):
            key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # as the Triton backend reads it
        else:
            key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
        outs[name] = paged_attention(query, key_cache, value_cache, rows, seq_lens, qsl, D**-0.5)
        k = torch.cat([kept_k, new_k.unsqueeze(2)], dim=2).repeat_interleave(2, dim=1)  # [R, Hq, 25, D]
        v = torch.cat([kept_v, new_v.unsqueeze(2)], dim=2).repeat_interleave(2, dim=1)
        dense = torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(2), k, v).squeeze(2)
        torch.testing.assert_close(outs[name], dense, rtol=1e-5, atol=1e-6)
    assert torch.equal(outs["split-token-major"], outs["cpu-vec"])


@needs_vllm
def test_the_cpu_layout_read_off_vllms_own_write(tmp_path):
    """For every ISA of vLLM's CPU kernel this machine runs (``vec`` float32 and bfloat16, head dim 64 and 256,
    ``vec16``, and ``amx`` bfloat16 where the CPU has AMX): the probed layout is the documented one for ``vec`` /
    ``vec16``, and entries written through vLLM's write come back exactly, also after a compaction in place."""
    res = _run_script("layouts", {}, tmp_path)
    assert len(res["cases"]) == (6 if res["amx"] else 4)
    for c in res["cases"]:
        assert c["round_trip"] and c["compaction"], c
        assert c.get("as_documented", True), c


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bfloat16_entries_round_trip(name):
    layout, order = LAYOUTS[name]
    k, v, _ = _evicted(layout, order, torch.bfloat16)
    assert k.dtype == torch.bfloat16 and k.shape == (2, H, 24, D)

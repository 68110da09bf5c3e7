"""What one attention layer does after vLLM's kernel ran over the paged cache: save queries, attend rows that do
not fit, evict.

Called by :class:`vase.vllm.backend.VaseCPUAttentionImpl` for each layer of a step that has a plan, in this order
(the same as :meth:`vase.hf.layer.EvictingLayer.after_attention`, so the same inputs reach the eviction core):

1. the step's saved post-RoPE queries go to the sequence model's query ring;
2. the *dense* rows (their entries do not fit in their capped blocks: a prompt longer than the cap, or a chunk of
   one) are attended by vLLM's kernel over a scratch cache holding their held entries and their new ones (causal,
   at their offset; the paged call left them out, :class:`DenseSplit`), so that every row's attention is the
   kernel's and none is computed twice;
3. the rows whose fill reached their limit (and every dense row) are compacted: their entries are gathered from the
   paged cache (or taken from the dense pass), the sequence model chooses ``budget`` per KV head
   (:meth:`vase.core.sequence.Sequences.evict`), :func:`vase.core.evict.gather_kept` packs them, and they are written
   to the row's first slots; their positions and per-slot state go back to the row tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.evict import gather_kept
from ..core.sequence import budget_groups
from .paged import gather, write_front
from .state import GroupLayout, PagedStep, WorkerState


def save_queries(ws: WorkerState, li: int, q: torch.Tensor, plan: PagedStep) -> None:
    """Write the step's saved queries (post-RoPE ``q`` ``[T, H_q, D]``, the tokens ``plan.ring_tok``) to layer
    ``li``'s ring."""
    ring = ws.seq.ring
    if ring is not None and plan.ring is not None and plan.ring_tok.numel():
        ring.write(li, plan.ring, q[plan.ring_tok])


@dataclass
class DenseSplit:
    """A step with dense rows, split for vLLM's kernel (built once per step by the metadata builder).

    The rows that fit in their blocks (``paged`` ``[P]`` batch rows; ``paged_tok`` their tokens, ``paged_qsl``
    ``[P+1]`` int32 their query start locations once packed) are attended over the paged cache; the dense ones
    (``rows``, ``dense_tok`` their tokens) over a scratch cache of ``blocks`` blocks holding each one's held entries
    then its new tokens from a block boundary: ``qsl`` ``[D+1]`` and ``seq_lens`` ``[D]`` int32 (held + new),
    ``block_table`` ``[D, nb]`` int32 scratch block ids, ``slots`` ``[sum seq_lens]`` int64 the scratch slot of each
    held and new entry, row after row."""

    rows: list[int]
    paged: torch.Tensor
    paged_tok: torch.Tensor
    paged_qsl: torch.Tensor
    dense_tok: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    blocks: int


def split_dense(plan: PagedStep, block_size: int) -> DenseSplit:
    """The :class:`DenseSplit` of a step with dense rows."""
    dense = plan.dense
    rows = np.nonzero(dense)[0]
    paged = np.nonzero(~dense)[0]
    tok_row = np.repeat(np.arange(len(plan.n)), plan.n)
    lengths = plan.fill_before[rows] + plan.n[rows]
    nb = -(-lengths // block_size)
    first = np.concatenate([[0], np.cumsum(nb)[:-1]])
    table = first[:, None] + np.arange(nb.max())[None, :]
    slots = np.concatenate([f * block_size + np.arange(s) for f, s in zip(first, lengths)])

    def starts(counts):
        return torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))

    return DenseSplit(
        rows=rows.tolist(),
        paged=torch.from_numpy(paged),
        paged_tok=torch.from_numpy(np.nonzero(~dense[tok_row])[0]),
        paged_qsl=starts(plan.n[paged]),
        dense_tok=torch.from_numpy(np.nonzero(dense[tok_row])[0]),
        qsl=starts(plan.n[rows]),
        seq_lens=torch.from_numpy(lengths.astype(np.int32)),
        block_table=torch.from_numpy(table.astype(np.int32)),
        slots=torch.from_numpy(slots.astype(np.int64)),
        blocks=int(nb.sum()),
    )


def attend_dense(impl, layer, ws, li, q, k, v, kv_cache, output, plan: PagedStep, layout: GroupLayout, split, md):
    """Attention of the step's dense rows over their held entries and their new ones, written into ``output``;
    returns, per dense batch row ``r``, its keys, values ``[H_kv, S, D]``, positions ``[H_kv, S]`` and state for
    the eviction that follows.

    The held entries (gathered from the row's blocks) and the new tokens go to a scratch cache in vLLM's layout
    (``split``: :class:`DenseSplit`), over which vLLM's kernel attends the row's queries (``md.vase_dense``):
    the new tokens attend causally at their offset (query ``i`` sees the held entries and new tokens ``<= i``), as
    transformers' attention over the cache and the new tokens does before vase compresses them, and learned sinks
    (gpt-oss) are the kernel's, as for every other row.
    """
    h = k.shape[1]
    out, kt, vt = {}, [], []
    for r in split.rows:
        fb = int(plan.fill_before[r])
        a, b = int(plan.qsl[r]), int(plan.qsl[r + 1])
        n = b - a
        rk, rv = k[a:b], v[a:b]  # token-major [S, H, D]: held entries, then the new tokens
        if fb:
            kh, vh = gather(kv_cache, layout.block_rows[r : r + 1], fb)
            rk, rv = torch.cat([kh[0].transpose(0, 1), rk]), torch.cat([vh[0].transpose(0, 1), rv])
        kt.append(rk)
        vt.append(rv)
        keys, values = rk.transpose(0, 1), rv.transpose(0, 1)  # [H, S, D] for the eviction
        held_pos, held_state = _held(ws, li, plan, [r], fb)
        new_pos = torch.from_numpy(plan.logical_before[r] + np.arange(n)).expand(h, n)
        positions = torch.cat([held_pos[0], new_pos], dim=1)
        state = {name: torch.cat([t[0], torch.zeros(h, n)], dim=1) for name, t in held_state.items()}
        out[r] = (keys, values, positions, state)
    _, _, bs, d2 = kv_cache.shape
    scratch = kv_cache.new_zeros((split.blocks, h, bs, d2))
    impl.do_kv_cache_update(layer, torch.cat(kt).contiguous(), torch.cat(vt).contiguous(), scratch, split.slots)
    tok = split.dense_tok
    o = output.new_empty((tok.numel(), *output.shape[1:]))
    impl.attend_scratch(layer, q[tok], scratch, md.vase_dense, o)
    output[tok] = o
    return out


def _held(ws: WorkerState, li: int, plan: PagedStep, batch_rows: list[int], length: int):
    """``(positions [r, H, length], state)`` of the first ``length`` slots of the batch rows ``batch_rows`` (a row
    never compacted holds position ``i`` in slot ``i``: the tables may be narrower than its dense prompt)."""
    sched = plan.schedule
    rows = plan.rows[torch.tensor(batch_rows, dtype=torch.long)]
    fresh = [sched.evictions_before[i] == 0 for i in batch_rows]
    return ws.seq.tables.held(li, rows, length, never_evicted=fresh)


def evict_rows(
    ws, li, layer, kv_cache, plan: PagedStep, layout: GroupLayout, dense: dict, scale: float, kv_cache_dtype: str
) -> None:
    """Compact the evicting rows of the step in layer ``li`` (its KV cache group's ``layout``; see the module
    docstring): one eviction per budget among them (requests with budgets of their own, ``vase_budget``)."""
    for group in budget_groups(plan.schedule, list(plan.schedule.evict), ws.seq.schedule):
        _evict_group(ws, li, layer, kv_cache, plan, layout, dense, scale, kv_cache_dtype, group)


def _evict_group(ws, li, layer, kv_cache, plan, layout, dense: dict, scale, kv_cache_dtype, ev: list[int]) -> None:
    """Compact the rows ``ev`` (batch rows sharing a budget) in layer ``li``."""
    rows = plan.rows[torch.tensor(ev, dtype=torch.long)]
    lengths = [int(plan.fill_before[r] + plan.n[r]) for r in ev]
    b, s = len(ev), max(lengths)
    h = kv_cache.shape[1]
    d = kv_cache.shape[3] // 2
    keys = torch.zeros(b, h, s, d, dtype=kv_cache.dtype)
    values = torch.zeros_like(keys)
    valid = torch.arange(s).view(1, s) < torch.tensor(lengths).view(b, 1)
    positions, state = _held(ws, li, plan, ev, s)
    beyond = ~valid.unsqueeze(1).expand(b, h, s)  # slots past a row's length hold nothing
    positions.masked_fill_(beyond, -1)
    for t in state.values():
        t.masked_fill_(beyond, 0.0)
    paged = [i for i, r in enumerate(ev) if not plan.dense[r]]
    if paged:
        sp = max(lengths[i] for i in paged)
        kp, vp = gather(kv_cache, layout.block_rows[torch.tensor([ev[i] for i in paged])], sp)
        keys[paged, :, :sp], values[paged, :, :sp] = kp, vp
    for i, r in enumerate(ev):
        if plan.dense[r]:
            length = lengths[i]
            kd, vd, pd, sd = dense[r]
            keys[i, :, :length], values[i, :, :length], positions[i, :, :length] = kd, vd, pd
            for name, t in sd.items():
                state[name][i, :, :length] = t
    res = ws.seq.evict(li, plan.schedule, ev, keys, values, positions, valid, state, scaling=scale, rows=rows)
    kk, vv, pp, st = gather_kept(res.indices, res.keep, keys, values, positions, res.state)
    write_front(kv_cache, layout.write_rows[torch.tensor(ev, dtype=torch.long)], kk, vv, layer, kv_cache_dtype)
    ws.seq.tables.write_kept(li, rows, pp, st)

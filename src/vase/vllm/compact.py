"""What one attention layer does after vLLM's kernel ran over the paged cache: save queries, attend rows that do
not fit, evict.

Called by :class:`vase.vllm.backend.VaseCPUAttentionImpl` for each layer of a step that has a plan, in this order
(the same as :meth:`vase.hf.layer.EvictingLayer.after_attention`, so the same inputs reach the eviction core):

1. the step's saved post-RoPE queries go to the sequence model's query ring;
2. the *dense* rows (their entries do not fit in their capped blocks: a prompt longer than the cap, or a chunk of
   one) are attended by vLLM's kernel over a scratch cache holding their held entries and their new ones (causal,
   at their offset; the paged call left them out, :class:`DenseSplit`), so that every row's attention is the
   kernel's and none is computed twice;
3. the dense rows are compacted now (their entries exist only in this layer's dense pass): the sequence model
   chooses ``budget`` per KV head (:meth:`vase.core.sequence.Sequences.evict`), :func:`vase.core.evict.gather_kept`
   packs them, and they are written to the row's first slots; their positions and per-slot state go back to the row
   tables;
4. the other rows whose fill reached their limit are compacted after the forward, every layer together
   (:func:`evict_deferred`): their entries are gathered from each layer's paged cache and the layers are stacked
   into few calls of :meth:`vase.core.sequence.Sequences.evict_layers`. A layer's cache is read again only at the
   next step, so the result is the same as evicting in each layer right after its attention; a decode step's rows
   reach their limit one or two at a time, and one call per layer would cost mostly its per-operation overhead.
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


# the most elements of one stacked eviction's attention weights (rows x query heads x window x slots): past it the
# tensors outgrow the caches and a row costs more than alone
STACK_ELEMENTS = 1 << 21


@dataclass
class DeferredLayer:
    """A layer whose paged evicting rows are compacted after the forward (:func:`evict_deferred`)."""

    li: int
    layer: object
    kv_cache: torch.Tensor
    layout: GroupLayout
    scale: float
    kv_cache_dtype: str


def evict_rows(
    ws, li, layer, kv_cache, plan: PagedStep, layout: GroupLayout, dense: dict, scale: float, kv_cache_dtype: str
) -> None:
    """Compact the evicting rows of the step in layer ``li`` (its KV cache group's ``layout``; see the module
    docstring): the dense ones now, one eviction per budget among them (requests with budgets of their own,
    ``vase_budget``); the others are left to :func:`evict_deferred`."""
    now = [i for i in plan.schedule.evict if plan.dense[i]]
    if len(now) < len(plan.schedule.evict):
        plan.deferred.append(DeferredLayer(li, layer, kv_cache, layout, scale, kv_cache_dtype))
    for group in budget_groups(plan.schedule, now, ws.seq.schedule):
        _evict_group(ws, li, layer, kv_cache, plan, layout, dense, scale, kv_cache_dtype, group)


def evict_deferred(ws: WorkerState, plan: PagedStep) -> None:
    """After the step's forward: compact the evicting rows that fit in their blocks in every layer that deferred them
    (:func:`evict_rows`), the layers stacked into as few :meth:`vase.core.sequence.Sequences.evict_layers` calls as
    budgets, attention scales and :data:`STACK_ELEMENTS` allow."""
    deferred, plan.deferred = plan.deferred, []
    if not deferred:
        return
    ev = [i for i in plan.schedule.evict if not plan.dense[i]]
    hq, window = ws.dims[2], max(ws.seq.config.window or 0, 1)
    by_key: dict = {}  # layers that can share a call: the same budget and attention scale
    for d in deferred:
        by_key.setdefault((ws.seq.layer_budgets[d.li], d.scale), []).append(d)
    for group in budget_groups(plan.schedule, ev, ws.seq.schedule):
        s = max(int(plan.fill_before[r] + plan.n[r]) for r in group)
        per = max(1, STACK_ELEMENTS // (len(group) * hq * window * s))  # layers per call
        for layers in by_key.values():
            for i in range(0, len(layers), per):
                _evict_layers(ws, plan, layers[i : i + per], group)


def _evict_layers(ws, plan: PagedStep, layers: list[DeferredLayer], ev: list[int]) -> None:
    """Compact the rows ``ev`` (batch rows that fit in their blocks, sharing a budget) in ``layers`` in one call."""
    which = torch.tensor(ev, dtype=torch.long)
    rows = plan.rows[which]
    lengths = torch.tensor([int(plan.fill_before[r] + plan.n[r]) for r in ev])
    b, s = len(ev), int(lengths.max())
    valid = torch.arange(s).view(1, s) < lengths.view(b, 1)
    beyond = ~valid.unsqueeze(1)  # [b, 1, s]: slots past a row's length hold nothing
    keys, values, positions, states = [], [], [], []
    for d in layers:
        k, v = gather(d.kv_cache, d.layout.block_rows[which], s)
        p, st = _held(ws, d.li, plan, ev, s)
        keys.append(k)
        values.append(v)
        positions.append(p.masked_fill_(beyond, -1))
        states.append({name: t.masked_fill_(beyond, 0.0) for name, t in st.items()})
    n = len(layers)
    keys, values, positions = torch.cat(keys), torch.cat(values), torch.cat(positions)
    state = {name: torch.cat([st[name] for st in states]) for name in states[0]}
    res = ws.seq.evict_layers(
        [d.li for d in layers],
        plan.schedule,
        ev,
        keys,
        values,
        positions,
        valid.repeat(n, 1),
        state,
        scaling=layers[0].scale,
        rows=rows,
    )
    kk, vv, pp, st = gather_kept(res.indices, res.keep, keys, values, positions, res.state)
    for i, d in enumerate(layers):
        part = slice(i * b, (i + 1) * b)
        write_front(d.kv_cache, d.layout.write_rows[which], kk[part], vv[part], d.layer, d.kv_cache_dtype)
        ws.seq.tables.write_kept(d.li, rows, pp[part], {name: t[part] for name, t in st.items()})


def _evict_group(ws, li, layer, kv_cache, plan, layout, dense: dict, scale, kv_cache_dtype, ev: list[int]) -> None:
    """Compact the dense rows ``ev`` (batch rows sharing a budget) in layer ``li``, from their entries of this
    layer's dense pass (``dense``: :func:`attend_dense`)."""
    rows = plan.rows[torch.tensor(ev, dtype=torch.long)]
    lengths = [int(plan.fill_before[r] + plan.n[r]) for r in ev]
    b, s = len(ev), max(lengths)
    h = kv_cache.shape[1]
    d = kv_cache.shape[3] // 2
    keys = torch.zeros(b, h, s, d, dtype=kv_cache.dtype)
    values = torch.zeros_like(keys)
    valid = torch.arange(s).view(1, s) < torch.tensor(lengths).view(b, 1)
    positions = torch.full((b, h, s), -1, dtype=torch.long)  # slots past a row's length hold nothing
    state = {name: torch.zeros(b, h, s) for name in ws.seq.policy.state_names}
    for i, r in enumerate(ev):
        length = lengths[i]
        kd, vd, pd, sd = dense[r]
        keys[i, :, :length], values[i, :, :length], positions[i, :, :length] = kd, vd, pd
        for name, t in sd.items():
            state[name][i, :, :length] = t
    res = ws.seq.evict(li, plan.schedule, ev, keys, values, positions, valid, state, scaling=scale, rows=rows)
    kk, vv, pp, st = gather_kept(res.indices, res.keep, keys, values, positions, res.state)
    write_front(kv_cache, layout.write_rows[torch.tensor(ev, dtype=torch.long)], kk, vv, layer, kv_cache_dtype)
    ws.seq.tables.write_kept(li, rows, pp, st)

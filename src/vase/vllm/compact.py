"""What one attention layer does after vLLM's kernel ran: save queries, attend rows that do not fit, evict.

Called by :class:`vase.vllm.backend.VaseCPUAttentionImpl` for each layer of a step that has a plan, in this order
(the same as :meth:`vase.hf.layer.EvictingLayer.after_attention`, so the same inputs reach the eviction core):

1. the step's saved post-RoPE queries go to the sequence model's query ring;
2. a *dense* row (its entries do not fit in its capped blocks: a prompt longer than the cap, or a chunk of one) is
   attended in torch over its held entries and its new ones (causal, at their offset), and its kernel output (run
   over the null block) is replaced;
3. the rows whose fill reached their limit (and every dense row) are compacted: their entries are gathered from the
   paged cache (or taken from the dense pass), the sequence model chooses ``budget`` per KV head
   (:meth:`vase.core.sequence.Sequences.evict`), :func:`vase.core.evict.gather_kept` packs them, and they are written
   to the row's first slots; their positions and per-slot state go back to the row tables.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

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


def attend_dense(
    ws, li, q, k, v, kv_cache, output, plan: PagedStep, layout: GroupLayout, r: int, scale: float, sinks=None
):
    """Attention of dense row ``r`` over its held entries and its new ones, written into ``output``; returns its
    keys, values ``[H_kv, S, D]``, positions ``[H_kv, S]`` and state for the eviction that follows.

    The new tokens attend causally at their offset (query ``i`` sees the held entries and new tokens ``<= i``), as
    transformers' attention over the cache and the new tokens does before vase compresses them. ``sinks``: a learned
    sink logit per query head (gpt-oss), one more term of each softmax's denominator, as vLLM's kernel computes it.
    """
    fb = int(plan.fill_before[r])
    a, b = int(plan.qsl[r]), int(plan.qsl[r + 1])
    n = b - a
    h, hq = k.shape[1], q.shape[1]
    if fb:
        kh, vh = gather(kv_cache, layout.block_rows[r : r + 1], fb)
        kh, vh = kh[0], vh[0]
    else:
        kh = vh = k.new_zeros(h, 0, k.shape[-1])
    keys = torch.cat([kh, k[a:b].transpose(0, 1)], dim=1)  # [H, S, D]
    values = torch.cat([vh, v[a:b].transpose(0, 1)], dim=1)
    g = hq // h
    qh = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kr = keys.repeat_interleave(g, dim=0).unsqueeze(0)
    vr = values.repeat_interleave(g, dim=0).unsqueeze(0)
    mask = torch.arange(fb + n).view(1, -1) <= (fb + torch.arange(n)).view(-1, 1)
    if sinks is not None:
        logits = torch.matmul(qh.float(), kr.float().transpose(-1, -2)) * scale
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = sinks.float().view(1, hq, 1, 1).expand(1, hq, n, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(probs, vr.float())
    elif fb == 0:
        o = F.scaled_dot_product_attention(qh, kr, vr, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask, scale=scale)
    output[a:b] = o[0].transpose(0, 1).reshape(output[a:b].shape).to(output.dtype)
    held_pos, held_state = _held(ws, li, plan, [r], fb)
    new_pos = torch.from_numpy(plan.logical_before[r] + np.arange(n)).expand(h, n)
    positions = torch.cat([held_pos[0], new_pos], dim=1)
    state = {name: torch.cat([t[0], torch.zeros(h, n)], dim=1) for name, t in held_state.items()}
    return keys, values, positions, state


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

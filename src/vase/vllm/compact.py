"""What one attention layer does after vLLM's kernel ran: save queries, attend rows that do not fit, evict.

Called by :class:`vase.vllm.backend.VaseCPUAttentionImpl` for each layer of a step that has a plan, in this order
(the same as :meth:`vase.hf.layer.EvictingLayer.after_attention`, so the same inputs reach the eviction core):

1. the step's last ``window`` post-RoPE queries of each request go to its query ring;
2. a *dense* row (its entries do not fit in its capped blocks: a prompt longer than the cap, or a chunk of one) is
   attended in torch over its held entries and its new ones (causal, at their offset), and its kernel output (run
   over the null block) is replaced;
3. the rows whose fill reached their limit (and every dense row) are compacted: their entries are gathered from the
   paged cache (or taken from the dense pass), :func:`vase.core.evict.evict_layer` chooses ``budget`` per KV head,
   :func:`vase.core.evict.gather_kept` packs them, and they are written to the row's first slots, with their logical
   positions and per-slot state.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..core.evict import evict_layer, gather_kept
from .paged import gather, write_front
from .state import StepPlan, WorkerState


def save_queries(ws: WorkerState, li: int, q: torch.Tensor, plan: StepPlan) -> None:
    """Write the step's saved queries (``plan.ring_tok``, post-RoPE ``q`` ``[T, H_q, D]``) to layer ``li``'s ring."""
    if ws.ring is not None and plan.ring_tok is not None and plan.ring_tok.numel():
        ws.ring[li][plan.ring_row, :, plan.ring_slot] = q[plan.ring_tok].to(ws.ring.dtype)


def _held_positions(ws: WorkerState, li: int, row: int, length: int) -> torch.Tensor:
    """``[H_kv, length]`` logical positions of a row's first ``length`` slots (before its first eviction slot ``i``
    holds position ``i``; the table may be narrower than a dense prompt)."""
    h = ws.positions.shape[2]
    if ws.evictions[row] == 0:
        return torch.arange(length).expand(h, length)
    return ws.positions[li, row, :, :length]


def _held_state(ws: WorkerState, li: int, row: int, length: int) -> dict[str, torch.Tensor]:
    """``{name: [H_kv, length]}`` per-slot state of a row's first ``length`` slots (zero before its first eviction)."""
    h = ws.positions.shape[2]
    if ws.evictions[row] == 0:
        return {n: torch.zeros(h, length) for n in ws.state}
    return {n: t[li, row, :, :length] for n, t in ws.state.items()}


def attend_dense(ws, li, q, k, v, kv_cache, output, plan: StepPlan, r: int, scale: float):
    """Attention of dense row ``r`` over its held entries and its new ones, written into ``output``; returns its
    keys, values ``[H_kv, S, D]``, positions ``[H_kv, S]`` and state for the eviction that follows.

    The new tokens attend causally at their offset (query ``i`` sees the held entries and new tokens ``<= i``), as
    transformers' attention over the cache and the new tokens does before vase compresses them.
    """
    fb = int(plan.fill_before[r])
    a, b = int(plan.qsl[r]), int(plan.qsl[r + 1])
    n = b - a
    h, hq = k.shape[1], q.shape[1]
    row = int(plan.rows[r])
    if fb:
        kh, vh = gather(kv_cache, plan.block_rows[r : r + 1], fb)
        kh, vh = kh[0], vh[0]
    else:
        kh = vh = k.new_zeros(h, 0, k.shape[-1])
    keys = torch.cat([kh, k[a:b].transpose(0, 1)], dim=1)  # [H, S, D]
    values = torch.cat([vh, v[a:b].transpose(0, 1)], dim=1)
    g = hq // h
    qh = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kr = keys.repeat_interleave(g, dim=0).unsqueeze(0)
    vr = values.repeat_interleave(g, dim=0).unsqueeze(0)
    if fb == 0:
        o = F.scaled_dot_product_attention(qh, kr, vr, is_causal=True, scale=scale)
    else:
        mask = torch.arange(fb + n).view(1, -1) <= (fb + torch.arange(n)).view(-1, 1)
        o = F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask, scale=scale)
    output[a:b] = o[0].transpose(0, 1).reshape(output[a:b].shape).to(output.dtype)
    new_pos = torch.from_numpy(plan.logical_before[r] + np.arange(n)).expand(h, n)
    positions = torch.cat([_held_positions(ws, li, row, fb), new_pos], dim=1)
    state = {name: torch.cat([t, torch.zeros(h, n)], dim=1) for name, t in _held_state(ws, li, row, fb).items()}
    return keys, values, positions, state


def evict_rows(ws, li, layer, kv_cache, plan: StepPlan, dense: dict, scale: float, kv_cache_dtype: str) -> None:
    """Compact the evicting rows of the step in layer ``li`` through :func:`vase.core.evict.evict_layer`."""
    cfg = ws.s.config
    ev = np.nonzero(plan.evict)[0]
    rows = plan.rows[torch.from_numpy(ev)]
    rows_np = rows.numpy()
    lengths = [int(plan.fill_before[r] + plan.n[r]) for r in ev]
    b, s = len(ev), max(lengths)
    h = kv_cache.shape[1]
    d = kv_cache.shape[3] // 2
    keys = torch.zeros(b, h, s, d, dtype=kv_cache.dtype)
    values = torch.zeros_like(keys)
    positions = torch.full((b, h, s), -1, dtype=torch.int64)
    state = {n: torch.zeros(b, h, s) for n in ws.state}
    paged = [i for i, r in enumerate(ev) if not plan.dense[r]]
    if paged:
        sp = max(lengths[i] for i in paged)
        kp, vp = gather(kv_cache, plan.block_rows[torch.from_numpy(ev[paged])], sp)
        keys[paged, :, :sp], values[paged, :, :sp] = kp, vp
    for i, r in enumerate(ev):
        length = lengths[i]
        if plan.dense[r]:
            kd, vd, pd, sd = dense[r]
            keys[i, :, :length], values[i, :, :length], positions[i, :, :length] = kd, vd, pd
            for name, t in sd.items():
                state[name][i, :, :length] = t
            continue
        positions[i, :, :length] = _held_positions(ws, li, int(rows_np[i]), length)
        for name, t in _held_state(ws, li, int(rows_np[i]), length).items():
            state[name][i, :, :length] = t
    valid = torch.arange(s).view(1, s) < torch.tensor(lengths).view(b, 1)
    queries = qpos = qvalid = None
    if ws.ring is not None:
        queries, qpos, qvalid = ws.ring[li][rows], ws.ring_pos[rows], ws.ring_valid[rows]
    budget = cfg.budget
    res = evict_layer(
        cfg.policy,
        keys,
        values,
        positions,
        valid,
        budget=budget,
        slots=budget,
        sinks=cfg.sinks,
        recent=cfg.recent,
        row_keys=torch.from_numpy(ws.row_key[rows_np]),
        eviction_index=torch.from_numpy(ws.evictions[rows_np]),
        latest_query=torch.from_numpy(plan.logical_before[ev] + plan.n[ev] - 1),
        queries=queries,
        query_positions=qpos,
        query_valid=qvalid,
        scaling=scale,
        state=state,
        memo={"acc_upto": ws.memo[li][rows]},
        layer_idx=li,
    )
    kk, vv, pp, st = gather_kept(res.indices, res.keep, keys, values, positions, res.state)
    write_front(kv_cache, plan.block_rows[torch.from_numpy(ev)], kk, vv, layer, kv_cache_dtype)
    ws.positions[li, rows, :, :budget] = pp
    ws.positions[li, rows, :, budget:] = -1
    for name, t in st.items():
        ws.state[name][li, rows, :, :budget] = t
        ws.state[name][li, rows, :, budget:] = 0.0
    ws.memo[li, rows] = res.memo["acc_upto"]

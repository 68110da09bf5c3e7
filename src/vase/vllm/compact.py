"""What one attention layer does after vLLM's kernel ran over the paged cache: save queries, attend rows that do
not fit, evict.

Called by :class:`vase.vllm.backend.VaseCPUAttentionImpl` for each layer of a step that has a plan, in this order
(the same as :meth:`vase.hf.layer.EvictingLayer.after_attention`, so the same inputs reach the eviction core):

1. the step's saved post-RoPE queries go to the sequence model's query ring;
2. the *dense* rows (their entries do not fit in their capped blocks: a prompt longer than the cap, or a chunk of
   one) are attended by vLLM's kernel over a scratch cache holding their held entries and their new ones (causal,
   at their offset; the paged calls leave them out, :class:`DenseSplit`), so that every row's attention is the
   kernel's and none is computed twice;
3. the evicting rows are compacted after the step, every layer together (:func:`evict_deferred`, run by the worker
   for each row at the start of the next step that schedules it, once the step's tokens have been sampled and sent; a
   request just prefilled may sit out one step, ``prefill_first``): rows that fit in their blocks
   gathered from each layer's paged cache, dense rows from their entries of each layer's dense pass (held until
   then, within :data:`DEFER_BYTES`; past it they are compacted in their layer). The sequence model chooses
   ``budget`` per KV head (:meth:`vase.core.sequence.Sequences.evict_layers`, layers stacked into few calls),
   :func:`vase.core.evict.gather_kept` packs them, they are written to each row's first slots, and their positions
   and per-slot state go back to the row tables. A row's cache, tables and saved queries are read again only by the
   next forward that schedules it, so every row keeps what it would have kept had it been evicted in its layer right
   after its attention; meanwhile the step's first tokens leave (a prompt's compression is not in its time to first
   token), and a step's rows reaching their limit one or two at a time cost one call, not one per layer (mostly
   per-operation overhead).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.evict import gather_kept
from ..core.sequence import budget_groups
from .layout import PagedLayout
from .state import GroupLayout, PagedStep, WorkerState
from .store import HeldBuffer, entry_bytes


def save_queries(ws: WorkerState, li: int, q: torch.Tensor, plan: PagedStep) -> None:
    """Write the step's saved queries (post-RoPE ``q`` ``[T, H_q, D]``, the tokens ``plan.ring_tok``) to layer
    ``li``'s ring."""
    ring = ws.seq.ring
    if ring is not None and plan.ring is not None and plan.ring_tok.numel():
        picked = plan.work.get("ring_q")  # the step's selected queries, one reused tensor for every layer
        if picked is None or picked.dtype != q.dtype:
            shape = (plan.ring_tok.numel(), *q.shape[1:])
            picked = plan.work["ring_q"] = ws.reusable("ring_q", shape, q.dtype)
        ring.write(li, plan.ring, torch.index_select(q, 0, plan.ring_tok, out=picked))


@dataclass
class DenseSplit:
    """A step with dense rows, split for vLLM's kernel (built once per step by the metadata builder).

    The batch is cut into ``runs`` of adjacent rows of one kind, each attended by its own kernel call over views of
    the step's queries and output (tokens ``[a, b)``: no query is copied out nor any output copied back): a run of
    rows that fit in their blocks over the paged cache, a run of dense rows over a scratch cache of ``blocks`` blocks
    holding each dense row's held entries then its new tokens from a block boundary. The dense rows, ``rows``, in
    batch order: ``qsl`` ``[D+1]`` and ``seq_lens`` ``[D]`` int32 (held + new), ``block_table`` ``[D, nb]`` int32
    scratch block ids, ``slots`` ``[sum seq_lens]`` int64 the scratch slot of each held and new entry, row after row.
    """

    rows: list[int]
    runs: list[Run]
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    blocks: int


@dataclass
class Run:
    """Adjacent batch rows ``[r0, r1)`` of one kind (``dense`` or not), their tokens ``[a, b)`` in the step; for a
    dense run, ``[j0, j1)`` its rows' places in :attr:`DenseSplit.rows`."""

    dense: bool
    r0: int
    r1: int
    a: int
    b: int
    j0: int = 0
    j1: int = 0


def split_dense(plan: PagedStep, block_size: int) -> DenseSplit:
    """The :class:`DenseSplit` of a step with dense rows."""
    dense = plan.dense
    rows = np.nonzero(dense)[0]
    lengths = plan.fill_before[rows] + plan.n[rows]
    nb = -(-lengths // block_size)
    first = np.concatenate([[0], np.cumsum(nb)[:-1]])
    table = first[:, None] + np.arange(nb.max())[None, :]
    slots = np.concatenate([f * block_size + np.arange(s) for f, s in zip(first, lengths)])
    cuts = [0, *(np.nonzero(dense[1:] != dense[:-1])[0] + 1).tolist(), len(dense)]
    runs, j = [], 0
    for r0, r1 in zip(cuts[:-1], cuts[1:]):
        run = Run(bool(dense[r0]), r0, r1, int(plan.qsl[r0]), int(plan.qsl[r1]))
        if run.dense:
            run.j0, run.j1 = j, j + r1 - r0
            j = run.j1
        if run.b > run.a:
            runs.append(run)
    return DenseSplit(
        rows=rows.tolist(),
        runs=runs,
        qsl=torch.from_numpy(np.concatenate([[0], np.cumsum(plan.n[rows])]).astype(np.int32)),
        seq_lens=torch.from_numpy(lengths.astype(np.int32)),
        block_table=torch.from_numpy(table.astype(np.int32)),
        slots=torch.from_numpy(slots.astype(np.int64)),
        blocks=int(nb.sum()),
    )


def attend_dense(
    impl, layer, ws, li, q, k, v, kv_cache, output, plan: PagedStep, layout: GroupLayout, split, md, paged: PagedLayout
):
    """Attention of the step's dense rows over their held entries and their new ones, written into ``output``;
    returns, per dense batch row ``r``, its keys, values ``[H_kv, S, D]``, positions ``[H_kv, S]`` and state for
    the eviction that follows.

    The held entries (gathered from the row's blocks) and the new tokens go to a scratch cache in vLLM's layout
    (``split``: :class:`DenseSplit`), over which vLLM's kernel attends the row's queries (a call per run of dense
    rows, ``md.vase_runs``, on views of ``q`` and ``output``): the new tokens attend causally at their offset (query
    ``i`` sees the held entries and new tokens ``<= i``), as transformers' attention over the cache and the new tokens
    does before vase compresses them, and learned sinks (gpt-oss) are the kernel's, as for every other row.
    """
    h = k.shape[1]
    _, _, bs, d2 = kv_cache.shape
    # one scratch cache for the step's layers, zeroed at the first (no stale value in a block's unread tail; every
    # layer writes the same slots), in memory the worker reuses step after step
    key = ("scratch", tuple(kv_cache.shape[1:]))
    scratch = plan.work.get(key)
    if scratch is None:
        scratch = plan.work[key] = ws.reusable(key, (split.blocks, h, bs, d2), kv_cache.dtype).zero_()
    names = ws.seq.tables.state[li].keys()
    out, start = {}, 0
    for r in split.rows:
        fb = int(plan.fill_before[r])
        a, b = int(plan.qsl[r]), int(plan.qsl[r + 1])
        n = b - a
        slots = split.slots[start : start + fb + n]  # the row's scratch slots: held entries, then the new tokens
        start += fb + n
        rk, rv = k[a:b], v[a:b]  # token-major [S, H, D]
        new_pos = torch.from_numpy(plan.logical_before[r] + np.arange(n)).expand(h, n)
        if fb:  # entries held from earlier chunks: written before the new tokens
            kh, vh = paged.gather(kv_cache, layout.block_rows[r : r + 1], fb)
            rk, rv = torch.cat([kh[0].transpose(0, 1), rk]), torch.cat([vh[0].transpose(0, 1), rv])
            held_pos, held_state = _held(ws, li, plan, [r], fb)
            positions = torch.cat([held_pos[0], new_pos], dim=1)
            state = {name: torch.cat([t[0], torch.zeros(h, n)], dim=1) for name, t in held_state.items()}
        else:  # a prompt's first chunk: nothing held, the new tokens at their positions, state zero
            positions, state = new_pos.contiguous(), {name: torch.zeros(h, n) for name in names}
        impl.do_kv_cache_update(layer, rk, rv, scratch, slots)
        out[r] = (rk.transpose(0, 1), rv.transpose(0, 1), positions, state)  # [H, S, D] for the eviction
    for run, run_md in md.vase_runs:
        if run.dense:
            impl.attend_scratch(layer, q[run.a : run.b], scratch, run_md, output[run.a : run.b])
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
# the most bytes of dense rows' entries (keys, values, positions, state, all layers) held until their evictions run
# after the step (with those of steps still waiting); a step over it (a long prompt in one step) evicts its dense rows
# in each layer instead. The buffers holding them are reused from step to step (vase.vllm.store keeps the two largest)
DEFER_BYTES = 256 << 20


@dataclass
class DeferredLayer:
    """A layer whose evicting rows are compacted after the step (:func:`evict_deferred`): the rows that fit in
    their blocks are read from ``kv_cache`` (laid out as ``paged`` says, :mod:`vase.vllm.layout`); ``dense`` holds the
    dense rows' entries of this layer's dense pass (batch row -> keys, values ``[H_kv, S, D]``, positions ``[H_kv, S]``,
    state), empty when they were evicted in the layer."""

    li: int
    layer: object
    kv_cache: torch.Tensor
    layout: GroupLayout
    scale: float
    paged: PagedLayout
    dense: dict = field(default_factory=dict)


def defers_dense(ws: WorkerState, plan: PagedStep) -> bool:
    """Whether the step's evicting dense rows are compacted after the step with the others (their entries of every
    layer held until then, in one buffer of ``ws.store``: within :data:`DEFER_BYTES`, less what the steps still
    waiting hold), rather than in each layer."""
    if "defer_dense" not in plan.cache:
        rows = [i for i in plan.schedule.evict if plan.dense[i]]
        tokens = sum(int(plan.fill_before[r] + plan.n[r]) for r in rows)
        layers, h, _, d, dtype = ws.dims
        need = entry_bytes(tokens, len(rows), h, d, dtype.itemsize, len(ws.seq.policy.state_names), layers)
        held = sum(p.cache.get("dense_bytes", 0) for p in ws.pending)
        plan.cache["dense_bytes"] = need
        plan.cache["defer_dense"] = held + need <= DEFER_BYTES
        if not plan.cache["defer_dense"]:
            plan.cache["dense_bytes"] = 0
    return plan.cache["defer_dense"]


def evict_rows(
    ws, li, layer, kv_cache, plan: PagedStep, layout: GroupLayout, dense: dict, scale: float, paged: PagedLayout
) -> None:
    """Compact the evicting rows of the step in layer ``li`` (its KV cache group's ``layout``; see the module
    docstring): the rows that fit in their blocks are left to :func:`evict_deferred`, and so are the dense ones
    (their entries kept from this layer's dense pass, ``dense``) within :data:`DEFER_BYTES`; past it the dense rows
    are compacted now, one eviction per budget among them (requests with budgets of their own, ``vase_budget``).
    Nothing without an evicting row; the time goes to ``ws.stats['t_evict']``."""
    if not plan.evict.any():
        return
    t = time.perf_counter()
    _evict_rows(ws, li, layer, kv_cache, plan, layout, dense, scale, paged)
    ws.stats["t_evict"] += time.perf_counter() - t


def full_attention_layer(ws, layer, plain: bool) -> int:
    """The index of ``layer`` among vase's layers (``ws.layer_index``), once its attention is checked to be plain
    full attention (``plain``: no sliding window, ALiBi or logit soft-cap, as the backend's impl holds them).

    Raises:
        ValueError: it is not (the eviction scores would not see what the kernel computes)."""
    if not plain:
        raise ValueError(
            f"vase: layer {layer.layer_name} uses a sliding window, ALiBi or a logit soft-cap, which eviction "
            "does not support in a full-attention layer"
        )
    return ws.layer_index[layer.layer_name]


def _evict_rows(ws, li, layer, kv_cache, plan, layout, dense, scale, paged) -> None:
    dense_ev = [i for i in plan.schedule.evict if plan.dense[i]]
    later = defers_dense(ws, plan)
    if later or len(dense_ev) < len(plan.schedule.evict):
        held = {}
        if later and dense_ev:
            if "held" not in plan.cache:  # the step's buffer, opened at its first layer (closed by WorkerState.flush)
                plan.cache["held"] = ws.store.open(plan.cache["dense_bytes"])
            held = {r: _held_copy(plan.cache["held"], dense[r]) for r in dense_ev}
        plan.deferred.append(DeferredLayer(li, layer, kv_cache, layout, scale, paged, held))
    if not later:
        now = DeferredLayer(li, layer, kv_cache, layout, scale, paged, dense)
        for group in budget_groups(plan.schedule, dense_ev, ws.seq.schedule):
            _evict_layers(ws, plan, [now], group, dense=True)


def _held_copy(buf: HeldBuffer, entry):
    """A dense row's entries of one layer copied into the step's buffer (:mod:`vase.vllm.store`): out of the step's
    tensors (views of the whole batch's keys and values, which would otherwise stay alive until the evictions run),
    and out of the heap between the forward's activations."""
    keys, values, positions, state = entry
    return buf.copy(keys), buf.copy(values), buf.copy(positions), {name: buf.copy(t) for name, t in state.items()}


def evict_deferred(ws: WorkerState, plan: PagedStep, requests) -> None:
    """Compact the evicting rows of the requests ``requests`` (ids) that every layer of ``plan``'s step deferred
    (:func:`evict_rows`), the layers stacked into as few :meth:`vase.core.sequence.Sequences.evict_layers` calls as
    budgets, attention scales and :data:`STACK_ELEMENTS` allow. The other rows are left as they are (their evictions
    run later, or never: finished, aborted or preempted requests are released unread); ``plan.deferred`` is kept.

    The worker runs this at the start of the next step that schedules the requests, before that step's plan reads the
    tables (or when its counters are read): each row chooses what it would have chosen right after its layer's
    attention (no cache, table or saved query it reads changes in between), and the step's sampled tokens leave the
    engine first."""
    deferred = plan.deferred
    if not deferred:
        return
    hq, window = ws.dims[2], max(ws.seq.config.window or 0, 1)
    by_key: dict = {}  # layers that can share a call: the same budget and attention scale
    for d in deferred:
        by_key.setdefault((ws.seq.layer_budgets[d.li], d.scale), []).append(d)
    for dense in (False, True):
        ev = [i for i in plan.schedule.evict if plan.req_ids[i] in requests and bool(plan.dense[i]) == dense]
        if dense:
            ev = [i for i in ev if i in deferred[0].dense]  # past DEFER_BYTES they were evicted in their layer
        for group in budget_groups(plan.schedule, ev, ws.seq.schedule):
            s = max(int(plan.fill_before[r] + plan.n[r]) for r in group)
            per = max(1, STACK_ELEMENTS // (len(group) * hq * window * s))  # layers per call
            for layers in by_key.values():
                for i in range(0, len(layers), per):
                    _evict_layers(ws, plan, layers[i : i + per], group, dense=dense)


def _evict_layers(ws, plan: PagedStep, layers: list[DeferredLayer], ev: list[int], dense: bool) -> None:
    """Compact the rows ``ev`` (batch rows sharing a budget) in ``layers`` in one call: rows that fit in their blocks
    read from each layer's paged cache, dense rows (``dense``) from each layer's entries of its dense pass."""
    which = torch.tensor(ev, dtype=torch.long)
    rows = plan.rows[which]
    lengths = torch.tensor([int(plan.fill_before[r] + plan.n[r]) for r in ev])
    b, s = len(ev), int(lengths.max())
    valid = torch.arange(s).view(1, s) < lengths.view(b, 1)
    beyond = ~valid.unsqueeze(1)  # [b, 1, s]: slots past a row's length hold nothing
    keys, values, positions, states = [], [], [], []
    for d in layers:
        if dense:
            k, v, p, st = _padded(ws, d, ev, lengths, s)
        else:
            k, v = d.paged.gather(d.kv_cache, d.layout.block_rows[which], s)
            p, st = _held(ws, d.li, plan, ev, s)
            p = p.masked_fill_(beyond, -1)
            st = {name: t.masked_fill_(beyond, 0.0) for name, t in st.items()}
        keys.append(k)
        values.append(v)
        positions.append(p)
        states.append(st)
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
        d.paged.write_front(d.kv_cache, d.layout.write_rows[which], kk[part], vv[part])
        ws.seq.tables.write_kept(d.li, rows, pp[part], {name: t[part] for name, t in st.items()})


def _padded(ws, d: DeferredLayer, ev: list[int], lengths: torch.Tensor, s: int):
    """The dense rows ``ev``'s entries of layer ``d`` (its dense pass), padded to ``s`` slots: keys, values
    ``[b, H, s, D]``, positions ``[b, H, s]`` (-1 past a row's length) and state."""
    b = len(ev)
    h, _, dim = d.dense[ev[0]][0].shape
    keys = torch.zeros(b, h, s, dim, dtype=d.dense[ev[0]][0].dtype)
    values = torch.zeros_like(keys)
    positions = torch.full((b, h, s), -1, dtype=torch.long)
    state = {name: torch.zeros(b, h, s) for name in ws.seq.policy.state_names}
    for i, r in enumerate(ev):
        length = int(lengths[i])
        kd, vd, pd, sd = d.dense[r]
        keys[i, :, :length], values[i, :, :length], positions[i, :, :length] = kd, vd, pd
        for name, t in sd.items():
            state[name][i, :, :length] = t
    return keys, values, positions, state

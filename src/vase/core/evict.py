"""The one entry point of an eviction: which held entries of one layer to keep (torch only).

The sequence model (:meth:`vase.core.sequence.Sequences.evict`, what every integration calls) runs
:func:`evict_layer` for one layer at a time, with the rows (sequences) that evict now: the transformers cache
(:mod:`vase.hf`) with its slot buffers, the vLLM plugin with each request's entries gathered from its blocks. It
scores, guards and selects as the policy says (:func:`vase.core.selection.select`), gives per-head counts with
adaptive budgets (AdaKV, :func:`vase.core.budgets.head_counts`), advances the policy's state, and returns the kept
slot indices. :func:`gather_kept` then gathers the kept entries; the caller writes them back where it stores them
(in place: memory stays static).

Shapes: ``b`` rows evicting, ``H`` KV heads, ``Hq`` query heads (a multiple of ``H``: the GQA group), ``S`` slots
held per (row, KV head), ``W`` saved queries, ``D`` head dim, ``K`` = ``slots`` kept slots (the width of the result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import budgets
from .policy import Policy
from .scoring import EvictionContext
from .selection import structural_masks


@dataclass
class LayerEviction:
    """What :func:`evict_layer` decided for one layer.

    Attributes:
        indices: ``[b, H, K]`` int64 slot indices to keep, ascending (so in position order); entries at ranks >=
            ``keep`` are padding (0) and stand for free slots.
        keep: ``[b]`` int64 kept per row (every head alike), or ``[b, H]`` per head with ``head_budget='adakv'``.
        state: the policy's per-slot state after this eviction, ``{name: [b, H, S]}`` float32 over the input slots
            (H2O's attention accumulated up to the newest query): gather it with the kept slots.
        memo: the per-row memo after this eviction, ``{name: [b]}`` (H2O: ``acc_upto``, the newest query counted).
        protected: ``[b, H, S]`` bool slots the value guard protected (or demoted), or None without a guard.
        scores: ``[b, H, S]`` float32 policy scores.
        forced: ``[b, S]`` (``[b, H, S]`` with per-head validity) bool, sinks and recent window.
        context: the :class:`vase.core.scoring.EvictionContext` the policy saw (for inspection).
    """

    indices: torch.Tensor
    keep: torch.Tensor
    state: dict[str, torch.Tensor]
    memo: dict[str, torch.Tensor]
    protected: torch.Tensor | None
    scores: torch.Tensor | None
    forced: torch.Tensor
    context: EvictionContext


def evict_layer(
    policy: Policy,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *,
    budget: int,
    slots: int,
    sinks: int,
    recent: int,
    row_keys: torch.Tensor,
    eviction_index: torch.Tensor,
    latest_query: torch.Tensor,
    queries: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    scaling: float | None = None,
    state: dict[str, torch.Tensor] | None = None,
    memo: dict[str, torch.Tensor] | None = None,
    layer_idx: int | torch.Tensor = 0,
    head_offset: int = 0,
    keep: torch.Tensor | None = None,
) -> LayerEviction:
    """Choose which entries of one layer each evicting row keeps: ``budget`` tokens per (row, KV head) on average.

    Per (row, KV head): the first ``sinks`` valid entries and the last ``recent`` stay; the policy chooses the rest
    (its scorer, its value guard, its selector: VaSE, arXiv 2606.03928, Sec. 3; the baselines as their papers). With
    ``head_budget='adakv'`` the heads of a row keep different counts (AdaKV, arXiv 2407.11550, Sec. 3), each at most
    ``slots``.

    Args:
        policy: an evicting :class:`vase.Policy` (``policy.evicts``).
        keys, values: ``[b, H, S, D]`` held entries (keys post-RoPE), any float dtype.
        positions: ``[b, H, S]`` int64 logical position of each slot (its token's index among the real tokens of
            its row); -1 for a free or dead slot. Valid slots of a (row, head) are in increasing position order.
        valid: ``[b, S]`` bool, slots holding a token; or ``[b, H, S]`` when heads hold different counts.
        budget: tokens to keep per (row, KV head) on average (this layer's budget).
        slots: width ``K`` of the result, at least ``budget`` (the physical slots for kept tokens: ``budget``, or the
            cap of adaptive budgets).
        sinks, recent: tokens always kept at the start and the end of each row.
        row_keys: ``[b]`` int64 random key of each row (:func:`vase.core.rng.row_key` of its seed): the random
            choices of a row depend on it alone, not on the batch.
        eviction_index: ``[b]`` int64 evictions each row had before this one.
        latest_query: ``[b]`` int64 logical position of each row's newest token.
        queries: ``[b, Hq, W, D]`` saved post-RoPE queries (None for a policy whose scorer needs none), with
            ``query_positions`` ``[b, W]`` int64 and ``query_valid`` ``[b, W]`` bool.
        scaling: attention logit scale (default ``D ** -0.5``).
        state: the policy's per-slot state, ``{name: [b, H, S]}`` float32 for each name of ``policy.state_names``
            (zeros for new tokens; a missing name starts at zeros); updated in place and returned in ``state``.
        memo: the per-row memo, ``{name: [b]}`` (H2O: ``acc_upto``, -1 at the start).
        layer_idx: the layer's index (keys the random choices; PyramidKV's depth is in ``budget``), or ``[b]`` int64
            the layer of each row when one call evicts the rows of several layers sharing a budget (each row's result
            is the one its layer's own call gives: :meth:`vase.core.sequence.Sequences.evict_layers`).
        head_offset: the model's index of the first KV head of ``keys`` (a tensor-parallel rank's share of the heads;
            keys the random choices, so that every rank draws what one worker would).
        keep: ``[b]`` int64 tokens each row keeps per KV head at this eviction, at most ``slots`` (a confidence step
            budget, :mod:`vase.core.confidence`), lowered to what the row's heads hold; default ``budget``.

    Returns:
        A :class:`LayerEviction`.

    Raises:
        ValueError: a policy that never evicts, or AdaKV counts that cannot fit ``slots``.
    """
    if not policy.evicts:
        raise ValueError(f"the policy {policy.name!r} never evicts: there is nothing to select")
    state = {} if state is None else state
    for name in policy.state_names:  # a new sequence: its state starts at zero
        if name not in state:
            state[name] = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    forced, candidates = structural_masks(valid, sinks, recent)
    ctx = EvictionContext(
        keys=keys,
        values=values,
        positions=positions,
        valid=valid,
        candidates=candidates,
        queries=queries,
        query_positions=query_positions,
        query_valid=query_valid,
        scaling=scaling if scaling is not None else keys.shape[-1] ** -0.5,
        layer_idx=layer_idx,
        budget=budget,
        row_keys=row_keys,
        eviction_index=eviction_index,
        state=state,
        sinks=sinks,
        buffer=recent,
        memo={"latest_query": latest_query, **(memo or {})},
        head_offset=head_offset,
    )
    b = keys.shape[0]
    if keep is None:
        keep = torch.full((b,), budget, dtype=torch.long, device=keys.device)
    # a row keeps at most what each of its heads holds: one that kept fewer before (a confidence step budget), or a
    # layer whose own budget exceeds what the step's schedule let it hold (layer_budget=pyramid's first layers)
    keep = torch.minimum(keep, valid.view(b, -1, valid.shape[-1]).sum(-1).min(-1).values)
    adakv = policy.options.get("head_budget", "uniform") == "adakv"
    allocate = _adakv_allocator(policy, forced, slots) if adakv else None
    sel = policy.select(ctx, keep, slots, forced, allocate)
    new_memo = {
        n: torch.as_tensor(ctx.memo[n], dtype=m.dtype, device=m.device).expand(b) for n, m in (memo or {}).items()
    }
    return LayerEviction(
        indices=sel.indices,
        keep=sel.keep,
        state=ctx.state,
        memo=new_memo,
        protected=sel.protected,
        scores=sel.scores,
        forced=forced,
        context=ctx,
    )


def _adakv_allocator(policy: Policy, forced: torch.Tensor, slots: int):
    """AdaKV counts for :func:`vase.core.selection.select`: each head keeps its forced slots (sinks, recent window)
    plus its share of the layer's ``H * (budget - forced)`` chosen ones (:func:`vase.core.budgets.head_counts`, one
    top-k over the layer's heads), at most ``slots`` in all."""
    n_forced = forced.sum(-1).view(forced.shape[0], -1)  # [b, 1] or [b, H] (the same for every head in practice)

    def allocate(ctx: EvictionContext, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        most = n_forced.max(-1).values
        n_choose = (keep - most).clamp_min(0)
        floor = float(policy.options.get("head_floor", budgets.FLOOR_SHARE))
        cap = slots - most.max()  # a device scalar: no host read
        counts = budgets.head_counts(scores, ctx.candidates, n_choose, floor, cap, check=False)  # fit by construction
        return n_forced + counts

    return allocate


def gather_kept(
    indices: torch.Tensor,
    keep: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    state: dict[str, torch.Tensor] | None = None,
):
    """The kept entries, packed: what slots ``[0, K)`` of each (row, KV head) hold after the eviction.

    Args:
        indices: ``[b, H, K]`` from :attr:`LayerEviction.indices`; keep: ``[b]`` or ``[b, H]`` (entries past it are
            freed).
        keys, values: ``[b, H, S, D]``; positions: ``[b, H, S]``; state: ``{name: [b, H, S]}``.

    Returns:
        ``(keys [b, H, K, D], values [b, H, K, D], positions [b, H, K] (-1 where freed), state {name: [b, H, K]}
        (0 where freed))``.
    """
    r, h, k = indices.shape
    kk = keys.gather(2, indices.unsqueeze(-1).expand(r, h, k, keys.shape[-1]))
    vv = values.gather(2, indices.unsqueeze(-1).expand(r, h, k, values.shape[-1]))
    free = torch.arange(k, device=indices.device).view(1, 1, k) >= keep.view(r, -1, 1)
    pp = positions.gather(2, indices).masked_fill(free, -1)
    st = {n: s.gather(2, indices).masked_fill(free, 0.0) for n, s in (state or {}).items()}
    return kk, vv, pp, st

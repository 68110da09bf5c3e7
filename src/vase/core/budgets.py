"""Adaptive budgets: how many tokens each KV head and each layer keeps, the total held static.

This module holds the allocation rules, the physical layout and the per-head attention mask (see "Integration"
below for how :class:`vase.EvictingCache` uses them).

* :func:`head_counts`: per-head allocation within a layer, AdaKV (Feng et al. 2024, arXiv 2407.11550, Sec. 3,
  Algorithm 1): one top-k over the scores of all the layer's KV heads, so that a head whose attention is
  concentrated gives slots to a head whose attention is spread; a share ``floor_share`` of each head's count is
  given uniformly first (the paper's safeguard, alpha = 0.2 there).
* :func:`pyramid_budgets`: per-layer allocation, PyramidKV (Cai et al. 2024, arXiv 2406.02069, Sec. 3): the
  chosen part of the budget decreases linearly with depth, from ``2 * mean - mean / beta`` in the first layer to
  ``mean / beta`` in the last (beta = 20 there); the sum over layers is the uniform sum, exactly.
* :func:`head_mask`: the attention mask when the heads of a row hold different counts, for sdpa and eager;
  :func:`check_head_budgets_supported` refuses flash-attention with a clear error.

Integration (:class:`vase.EvictingCache`, policy options ``head_budget``, ``layer_budget``, ``budget_cap``,
``head_floor``, ``pyramid_beta``): every (layer, KV head) has the same ``slots`` physical slots for its kept tokens
(:func:`layout`: ``budget_cap * budget`` with AdaKV, the largest layer budget with PyramidKV alone), so the shared
schedule stays: after a compaction every row's fill is ``slots``, decode tokens are written at ``slots, slots + 1,
...`` for all heads alike, and the next compaction comes ``buffer`` tokens later. A head keeping ``n < slots`` tokens
holds them packed at ``[0, n)`` in position order; slots ``[n, slots)`` are dead (logical position -1): masked per
head in attention (sdpa, eager), left out of the next eviction's candidates and of the scorers' softmax (per-head
``valid`` ``[b, H, S]``). The buffers are allocated once at ``slots + buffer`` per head: the memory held is that of
the cap, not of the budget.
"""

from __future__ import annotations

import torch

from .masks import mask_in_kind

FLOOR_SHARE = 0.2
PYRAMID_BETA = 20.0
BUDGET_CAP = 2.0  # default physical slots per (layer, KV head), as a multiple of the budget


def head_counts(
    scores: torch.Tensor,
    candidates: torch.Tensor,
    n_choose: torch.Tensor,
    floor_share: float = FLOOR_SHARE,
    cap: int | torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Per-head counts of chosen candidates, AdaKV (arXiv 2407.11550, Sec. 3, Algorithm 1).

    Every head first gets ``floor(floor_share * n_choose)`` (its best candidates); the remaining
    ``H * (n_choose - floor)`` go to the best remaining candidates of the whole layer, one top-k over all heads,
    without giving any head more than ``cap`` in total. The scores must be comparable across heads (attention
    weights, or the value-aware weights of :func:`vase.core.scoring.weight_by_value`, which keep each head's attention
    mass). Ties are broken by head, then slot (earlier first).

    Args:
        scores: ``[b, H, S]`` float policy scores (higher = keep).
        candidates: ``[b, S]`` bool, the slots the policy chooses among, or ``[b, H, S]`` per head (heads holding
            different tokens after an adaptive eviction).
        n_choose: ``[b]`` int64, average number of candidates to keep per head (uniform allocation).
        floor_share: share of ``n_choose`` every head keeps whatever the others' scores, in [0, 1].
        cap: most candidates one head may keep (default: no limit but its candidates); an int or a 0-d tensor.
        check: verify that the counts can be met (a host read of device values: the eviction path on a GPU, whose
            counts fit by construction, turns it off to avoid a synchronization per eviction).

    Returns:
        ``[b, H]`` int64 counts; each row sums to ``H * n_choose``.

    Raises:
        ValueError: ``floor_share`` outside [0, 1], a row choosing more than its heads' candidates can hold (each
            head at most ``min(candidates, cap)``), or a cap below ``n_choose`` (the uniform allocation would not
            fit).
    """
    if not 0.0 <= floor_share <= 1.0:
        raise ValueError(f"floor_share must be in [0, 1], got {floor_share}")
    b, h, s = scores.shape
    cand = candidates.view(b, -1, s).expand(b, h, s)
    n_cand = cand.sum(-1)  # [b, H]
    if check and cap is not None and bool((n_choose > cap).any()):
        raise ValueError(f"cap ({int(cap)}) must be at least the uniform count ({n_choose.max().item()})")
    limit = n_cand if cap is None else n_cand.clamp_max(cap)
    floor = (floor_share * n_choose.double()).floor().long()  # [b]
    m = (n_choose - floor) * h  # [b] slots given by the layer-wide top-k
    room = (limit - floor.view(b, 1)).clamp_min(0).sum(-1)
    if check and (bool((floor.view(b, 1) > limit).any()) or bool((room < m).any())):
        per_head = n_cand.tolist() if candidates.dim() == 3 else n_cand[:, 0].tolist()
        raise ValueError(f"cannot choose {n_choose.tolist()} of {per_head} candidates per head")
    # finite scores, so that a candidate always ranks before a non-candidate within its head
    x = scores.float().nan_to_num(0.0).clamp(-3e38, 3e38).masked_fill(~cand, float("-inf"))
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s, device=x.device).expand(b, h, s))
    free = cand & (rank >= floor.view(b, 1, 1)) & (rank < limit.view(b, h, 1))
    flat = torch.where(free, x, torch.full_like(x, float("-inf"))).reshape(b, h * s)
    top = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    take = torch.arange(h * s, device=x.device).view(1, -1) < m.view(b, 1)
    picked = torch.zeros((b, h * s), dtype=torch.bool, device=x.device).scatter_(-1, top, take)
    picked &= free.reshape(b, h * s)
    return floor.view(b, 1) + picked.view(b, h, s).sum(-1)


def pyramid_budgets(budget: int, layers: int, fixed: int = 0, beta: float = PYRAMID_BETA) -> list[int]:
    """Per-layer budgets, PyramidKV (arXiv 2406.02069, Sec. 3): the chosen part ``budget - fixed`` (``fixed``: the
    sinks and recent window every layer keeps) decreases linearly from the first layer to the last, from
    ``2 * mean - mean / beta`` to ``mean / beta``; rounded so that the sum is exactly ``layers * budget``.

    Raises:
        ValueError: ``layers < 1``, ``beta < 1``, or ``budget <= fixed``.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if not beta >= 1:
        raise ValueError(f"beta must be >= 1 (1 = uniform budgets), got {beta}")
    mean = budget - fixed
    if mean < 1:
        raise ValueError(f"budget ({budget}) must be larger than the tokens every layer keeps ({fixed})")
    if layers == 1:
        return [budget]
    top = mean / beta
    bottom = 2 * mean - top
    exact = [bottom - (bottom - top) * i / (layers - 1) for i in range(layers)]
    chosen = [int(v) for v in exact]  # floors; then the largest remainders get the missing tokens
    missing = mean * layers - sum(chosen)
    for i in sorted(range(layers), key=lambda i: (chosen[i] - exact[i], i))[:missing]:
        chosen[i] += 1
    return [fixed + c for c in chosen]


def head_mask(fill: torch.Tensor, kv_len: int, group: int, kind: str = "bool", dtype=torch.float32) -> torch.Tensor:
    """Attention mask for one decode query per row when the KV heads of a row hold different counts: head ``h`` of
    row ``b`` sees slots ``[0, fill[b, h])``.

    Args:
        fill: ``[b, H]`` int64 filled slots per (row, KV head), the new token included.
        kv_len: slots handed to the kernel (``>= fill.max()``).
        group: query heads per KV head (the mask is per query head, after ``repeat_kv``).
        kind: 'bool' (sdpa: True = attend) or 'additive' (eager: 0 / dtype min).

    Returns:
        ``[b, H * group, 1, kv_len]``.
    """
    b, h = fill.shape
    seen = torch.arange(kv_len, device=fill.device).view(1, 1, kv_len) < fill.view(b, h, 1)
    return mask_in_kind(seen.repeat_interleave(group, dim=1).unsqueeze(2), kind, dtype)


def layout(options: dict, budget: int, layers: int, fixed: int) -> tuple[list[int], int]:
    """Per-layer budgets and the physical slots per (layer, KV head) for kept tokens, from a policy's options.

    Args:
        options: the policy's resolved options (``head_budget``, ``layer_budget``, ``budget_cap``, ``pyramid_beta``).
        budget: the cache budget, tokens per (layer, KV head) on average.
        layers: cached layers.
        fixed: tokens every head keeps whatever its scores (sinks + recent window).

    Returns:
        ``(layer_budgets, slots)``: ``layers`` budgets summing to ``layers * budget`` (all ``budget`` unless
        ``layer_budget='pyramid'``), and ``slots`` >= each of them: ``floor(budget_cap * budget)`` with
        ``head_budget='adakv'`` or ``step_budget='confidence'`` (the most one head or one eviction may keep), the
        largest layer budget otherwise.

    Raises:
        ValueError: ``floor(budget_cap * budget)`` below the first layer's pyramid budget (PyramidKV with
            ``budget_cap`` close to 1).
    """
    pyramid = options.get("layer_budget", "uniform") == "pyramid"
    adakv = options.get("head_budget", "uniform") == "adakv" or options.get("step_budget", "fixed") == "confidence"
    if pyramid:
        per_layer = pyramid_budgets(budget, layers, fixed, float(options.get("pyramid_beta", PYRAMID_BETA)))
    else:
        per_layer = [budget] * layers
    if not (pyramid or adakv):
        return per_layer, budget
    cap = int(float(options.get("budget_cap", BUDGET_CAP)) * budget)
    if max(per_layer) > cap:
        raise ValueError(
            f"budget_cap {options.get('budget_cap')} allows {cap} tokens per head, but the pyramid gives its first "
            f"layer {max(per_layer)} (budget {budget}, {layers} layers): raise budget_cap to at least "
            f"{max(per_layer) / budget:.3g}"
        )
    return per_layer, (cap if adakv else max(per_layer))


def check_cap(options: dict, budget: int, fixed: int) -> None:
    """The check of :func:`layout` that needs no layer count, for a configuration validated before the model is
    known: with PyramidKV, the first layer of any model of two or more layers keeps at least ``fixed +
    floor(2 * mean - mean / beta)`` tokens (``mean = budget - fixed``), which ``budget_cap`` must allow.

    Raises:
        ValueError: as :func:`layout`, when no layer count could fit.
    """
    if options.get("layer_budget", "uniform") != "pyramid" or budget <= fixed:
        return
    mean = budget - fixed
    first = fixed + int(2 * mean - mean / float(options.get("pyramid_beta", PYRAMID_BETA)))
    cap = int(float(options.get("budget_cap", BUDGET_CAP)) * budget)
    if first > cap:
        raise ValueError(
            f"budget_cap {options.get('budget_cap')} allows {cap} tokens per head, but the pyramid gives its first "
            f"layer at least {first} (budget {budget}): raise budget_cap to at least {first / budget:.3g}"
        )


def check_head_budgets_supported(attn_implementation: str) -> None:
    """Per-head budgets need a per-head mask: sdpa and eager take one.

    Raises:
        ValueError: for flash-attention (its padding mask is one per row, shared by the heads; the varlen path
            would need one sequence per (row, head)) or any other kernel.
    """
    base = attn_implementation.removeprefix("vase_")
    if base not in ("sdpa", "eager"):
        raise ValueError(
            f"per-head budgets need attention with a per-head mask (sdpa or eager), not {attn_implementation!r}: "
            "flash-attention's padding mask is per row. Load the model with attn_implementation='sdpa'"
        )

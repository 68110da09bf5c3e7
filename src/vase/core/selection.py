"""Guards and selectors, and the one function that turns them into the slots to keep.

An eviction keeps, per (batch row, KV head), ``keep[row]`` slots out of ``S``:

1. forced: the first ``sinks`` valid tokens of the row (attention sinks) and its last ``buffer`` valid tokens
   (the recent window);
2. protected: the candidates with the largest value magnitude, a fixed share of the budget, if the policy has a
   :class:`ValueGuard` (VaSE, arXiv 2606.03928, Sec. 3.1), or (``rule='outlier'``) only those whose magnitude is an
   outlier of their head, at most that share: then the count differs between heads and rows;
3. the rest of the count from the remaining candidates, by the :class:`Selector`: deterministic top-k of the scores,
   or sampling without replacement with probability proportional to ``score ** (1 / temperature)`` (VaSE, Sec. 3.2),
   done as Gumbel-top-k, which has exactly that distribution.

Every row keeps the same count for all its heads (unless ``keep`` is given per head); kept slots come back sorted by
slot index, that is by logical position, so pooling over slots stays pooling over neighbouring tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from . import rng
from .scoring import STREAM_GUARD, STREAM_SAMPLE, EvictionContext

_FORCED = float("inf")
_PROTECTED = 1e38
_KEY_LIMIT = 1e37
_DEMOTED = -1e38
_INVALID = float("-inf")

GUARD_METRICS = ("range", "l2", "var", "random")
GUARD_MODES = ("protect", "evict")
GUARD_SINKS = ("outside", "inside")
GUARD_RULES = ("share", "outlier")


@dataclass(frozen=True)
class ValueGuard:
    """Protects (or, for the ablation, evicts first) the cached entries with the largest value magnitude.

    VaSE (arXiv 2606.03928, Sec. 3.1): a few value states have abnormally large magnitude; evicting them sends the
    model into repetitive loops. Per (row, layer, KV head) the ``round(share * budget)`` candidates with the largest
    ``metric`` are protected: ``range`` = max - min over head_dim (default), ``l2`` = Euclidean norm, ``var`` =
    variance over head_dim, ``random`` = random slots (the paper's control). ``mode='evict'`` demotes those entries
    below every other candidate instead (the paper's "evict the largest values first" ablation).

    ``sinks='inside'`` counts the sink tokens inside the protected share, as the reference code does
    (``round(share * budget) - sinks`` value slots are protected); ``'outside'`` protects ``round(share * budget)``
    value slots on top of the sinks.

    ``rule='outlier'`` (adaptive guard, a vase extension) protects only the candidates whose ``metric`` exceeds
    ``factor`` times the median of that metric over the candidates of their (row, KV head) (the lower median for an
    even count), the largest first, at most the count above (:meth:`count`, the cap). A head without outliers
    protects none and leaves its whole choice to the selector; rows and heads may protect different counts, while
    every head still keeps exactly the row's budget. ``factor`` is on the metric itself: for ``var`` (a squared
    quantity) ``factor`` 36 matches ``factor`` 6 on ``l2``. ``rule='share'`` (default) is the fixed count of the
    paper.

    Raises:
        ValueError: for an unknown metric, mode, sinks rule or rule, a share outside [0, 1), a factor below 1, or
            ``rule='outlier'`` with the ``random`` metric (it has no outliers to test).
    """

    metric: str = "range"
    share: float = 0.25
    mode: str = "protect"
    sinks: str = "outside"
    rule: str = "share"
    factor: float = 6.0

    def __post_init__(self):
        if self.metric not in GUARD_METRICS:
            raise ValueError(f"unknown value-guard metric {self.metric!r}; choose one of {', '.join(GUARD_METRICS)}")
        if self.mode not in GUARD_MODES:
            raise ValueError(f"unknown value-guard mode {self.mode!r}; choose one of {', '.join(GUARD_MODES)}")
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"protected share must be in [0, 1), got {self.share}")
        if self.sinks not in GUARD_SINKS:
            raise ValueError(f"guard_sinks must be one of {', '.join(GUARD_SINKS)}, got {self.sinks!r}")
        check_guard_rule(self.rule, self.factor, self.metric)

    def count(self, budget: int, sinks: int = 0) -> int:
        """Number of value slots protected per (row, KV head), for a budget and a sink count in tokens (with
        ``rule='outlier'``: the most that may be protected)."""
        n = int(round(self.share * budget))
        return max(n - sinks, 0) if self.sinks == "inside" else n

    def magnitude(self, ctx: EvictionContext) -> torch.Tensor:
        """``[b, H, S]`` float32 value magnitude of every slot under ``metric``."""
        v = ctx.values
        if self.metric == "range":
            return (v.amax(-1) - v.amin(-1)).float()
        if self.metric == "l2":
            return v.float().norm(dim=-1)
        if self.metric == "var":
            return v.float().var(-1)
        return rng.uniform(*ctx.noise_parts(STREAM_GUARD)).float()

    def describe(self) -> str:
        verb = "protects" if self.mode == "protect" else "evicts first"
        where = ", sinks inside the share" if self.sinks == "inside" else ""
        if self.rule == "outlier":
            return (
                f"value guard ({verb} {self.metric} outliers, > {self.factor:g}x the head's median, at most "
                f"{self.share:.0%} of budget{where})"
            )
        return f"value guard ({verb} top {self.share:.0%} of budget by {self.metric}{where})"


def check_guard_rule(rule: str, factor, metric: str | None) -> None:
    """The adaptive guard's options (``guard_rule``, ``outlier_factor``).

    Raises:
        ValueError: an unknown rule, a factor that is not a number >= 1, or the outlier rule with the ``random``
            metric.
    """
    if rule not in GUARD_RULES:
        raise ValueError(f"guard_rule must be one of {', '.join(GUARD_RULES)}, got {rule!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 <= factor < float("inf"):
        raise ValueError(
            f"outlier_factor must be a number >= 1 (a multiple of the head's median value magnitude), got {factor!r}"
        )
    if rule == "outlier" and metric == "random":
        raise ValueError("guard_rule='outlier' needs a magnitude metric (range, l2 or var), not guard='random'")


class Selector:
    """Turns scores into sort keys: the candidates with the largest keys are kept."""

    def keys(self, scores: torch.Tensor, ctx: EvictionContext) -> torch.Tensor:  # pragma: no cover - interface
        """Sort keys ``[b, H, S]`` float32 from scores ``[b, H, S]``; the largest keys are kept."""
        raise NotImplementedError


class TopK(Selector):
    """Deterministic: keep the highest scores."""

    def keys(self, scores: torch.Tensor, ctx: EvictionContext) -> torch.Tensor:
        return scores

    def describe(self) -> str:
        return "top-k"


class Sample(Selector):
    """Sampling without replacement, probability proportional to ``score ** (1 / temperature)`` (VaSE, Sec. 3.2).

    ``temperature`` here is the policy option ``sampling_temperature``: an exponent on the scores (1 = proportional
    to the score, as the paper; -> 0 approaches top-k). It is not the reference code's ``temperature``, which divides
    the attention logits (the option ``attention_temperature`` of window-attention scorers).

    Implemented as Gumbel-top-k: ``log(score) / temperature + Gumbel``; the noise comes from :mod:`vase.core.rng`, keyed
    on the row's seed, the layer, the row's eviction count, the head and the token's position. Scores <= 0 are never
    drawn before a positive one. The order of the kept slots by decreasing key is a valid draw order of sequential
    sampling without replacement (``torch.multinomial(..., replacement=False)``).

    Raises:
        ValueError: if ``temperature <= 0``.
    """

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"sampling_temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def keys(self, scores: torch.Tensor, ctx: EvictionContext) -> torch.Tensor:
        noise = rng.gumbel(*ctx.noise_parts(STREAM_SAMPLE))
        logp = torch.log(scores.clamp_min(1e-38)) / self.temperature
        return torch.where(scores > 0, logp + noise, torch.full_like(logp, -_KEY_LIMIT))

    def describe(self) -> str:
        return f"sampling without replacement (sampling temperature {self.temperature:g})"


@dataclass
class Selection:
    """Result of one eviction of one layer.

    Attributes:
        indices: ``[b, H, kmax]`` int64 slot indices to keep, ascending; entries at ranks >= ``keep[row]`` are
            padding (index 0) and must be treated as free.
        forced: ``[b, S]`` (or ``[b, H, S]``) bool, sinks and recent window.
        protected: ``[b, H, S]`` bool slots the guard protected (or demoted), or None.
        scores: ``[b, H, S]`` float32 policy scores, or None when the policy was not consulted.
        keep: ``[b]`` or ``[b, H]`` int64 slots kept (per row, or per head with adaptive budgets), or None.
    """

    indices: torch.Tensor
    forced: torch.Tensor
    protected: torch.Tensor | None
    scores: torch.Tensor | None
    keep: torch.Tensor | None = None


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis with ties broken by slot index (earlier first), so the choice does not depend on
    the tensor's length or the kernel. Values cannot tie in theory, but do in practice: in the first layer equal
    tokens have bit-identical values (no RoPE on values)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def structural_masks(valid: torch.Tensor, sinks: int, buffer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinks and recent window of each row from its valid slots (valid slots are in position order).

    Args:
        valid: ``[b, S]`` bool, or ``[b, H, S]`` per KV head (adaptive budgets: each head's own valid slots).
    Returns:
        ``(forced, candidates)``, both bool of the shape of ``valid``.
    """
    rank = valid.long().cumsum(-1) - 1
    n_valid = valid.sum(-1, keepdim=True)
    forced = valid & ((rank < sinks) | (rank >= n_valid - buffer))
    return forced, valid & ~forced


def pack_valid(valid: torch.Tensor, heads: int, kmax: int) -> torch.Tensor:
    """Slot indices ``[b, heads, kmax]`` of the valid slots of each row, in order (no eviction, only packing); past
    a row's valid count they are padding (invalid slots, or 0 where ``kmax`` exceeds the ``S`` slots)."""
    b, s = valid.shape
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)[:, :kmax]
    if kmax > s:
        order = torch.nn.functional.pad(order, (0, kmax - s))
    return order.unsqueeze(1).expand(b, heads, kmax)


def select(
    scorer,
    selector: Selector,
    guard: ValueGuard | None,
    ctx: EvictionContext,
    keep: torch.Tensor,
    kmax: int,
    forced: torch.Tensor,
    allocate=None,
) -> Selection:
    """Choose the slots to keep.

    Args:
        ctx: the eviction context (``ctx.candidates`` are the slots the policy chooses among).
        keep: ``[b]`` int64, slots to keep per row (``<=`` its valid count), or ``[b, H]`` per (row, KV head)
            (adaptive per-head budgets, :mod:`vase.core.budgets`).
        kmax: at least ``max(keep)``, as a Python int (the width of the returned indices).
        forced: ``[b, S]`` (or per head ``[b, H, S]``) bool sinks and recent window.
        allocate: optional ``allocate(ctx, scores, keep) -> [b, H]``: the per-head counts to keep, from the
            policy's scores ``[b, H, S]`` and ``keep`` (AdaKV, :func:`vase.core.budgets.head_counts`); used instead of
            ``keep``.
    Returns:
        A :class:`Selection` (``keep`` holds the counts used).
    """
    b, h, s = ctx.positions.shape
    cand = ctx.candidates.view(b, -1, s).expand(b, h, s)
    with record_function("vase.score"):
        scores = scorer.score(ctx)
    if allocate is not None:
        with record_function("vase.allocate"):
            keep = allocate(ctx, scores, keep)
    with record_function("vase.select"):
        key = selector.keys(scores, ctx).clamp(-_KEY_LIMIT, _KEY_LIMIT)
        pr = torch.where(cand, key, torch.full_like(key, _INVALID))
        pr = torch.where(forced.view(b, -1, s), torch.full_like(pr, _FORCED), pr)

    protected = mag = None
    n_protect = guard.count(ctx.budget, ctx.sinks) if guard is not None else 0
    if n_protect > 0:
        protected, pr, mag = _apply_guard(guard, ctx, pr, cand, keep, forced, n_protect)

    with record_function("vase.select"):
        k_sel = min(kmax, s)
        top = _top(pr, k_sel)[1]
        rank_ok = torch.arange(k_sel, device=top.device).view(1, 1, k_sel) < keep.view(b, -1, 1)
        idx = torch.where(rank_ok, top, torch.full_like(top, s)).sort(dim=-1).values
        idx = idx.masked_fill(idx == s, 0)
        if "order" in ctx.state:
            _record_slot_order(ctx, key, protected, mag, idx, rank_ok, forced)
        if kmax > k_sel:  # a layout wider than the slots scored (adaptive budgets): more padding
            idx = torch.nn.functional.pad(idx, (0, kmax - k_sel))
    return Selection(indices=idx, forced=forced, protected=protected, scores=scores, keep=keep)


def _record_slot_order(ctx, key, protected, mag, idx, rank_ok, forced) -> None:
    """Write, into the per-slot state ``order``, the place each kept slot would take in the physical layout of the
    reference code of VaSE after this compaction: sinks first (by position), then the protected values by decreasing
    magnitude, then the other kept candidates by decreasing selection key (the draw order when sampling). These get
    ``rank - budget`` (negative); the recent window gets 0, meaning "ordered by position, after all of those".
    Pooling with ``pool_order='slot'`` then follows the reference's layout (the arXiv 2606.03928 reference code).
    """
    b, h, s = key.shape
    kept = torch.zeros((b, h, s), dtype=torch.bool, device=key.device)
    kept.scatter_(-1, idx, rank_ok.expand_as(idx))
    sink = ctx.sink_mask().view(b, -1, s).expand(b, h, s)
    recent = forced.view(b, -1, s).expand(b, h, s) & ~sink
    prot = protected if protected is not None else torch.zeros_like(kept)
    tier = torch.zeros((b, h, s), dtype=torch.long, device=key.device)
    tier = torch.where(kept & ~recent, torch.ones_like(tier), tier)
    tier = torch.where(kept & prot, torch.full_like(tier, 2), tier)
    tier = torch.where(sink, torch.full_like(tier, 3), tier)
    within = key.double()
    if mag is not None:
        within = torch.where(prot, mag.double(), within)
    within = torch.where(sink, -ctx.positions.double(), within)
    within = torch.where(tier > 0, within, torch.full_like(within, float("-inf")))
    by_within = torch.sort(within, dim=-1, descending=True, stable=True).indices
    by_tier = torch.sort(tier.gather(-1, by_within), dim=-1, descending=True, stable=True).indices
    order = by_within.gather(-1, by_tier)  # slots in the reference's layout order
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s, device=key.device).expand(b, h, s))
    new = torch.where(tier > 0, (rank - ctx.budget).float(), torch.zeros((b, h, s), device=key.device))
    ctx.state["order"].copy_(new)


@record_function("vase.guard")
def _apply_guard(guard, ctx, pr, cand, keep, forced, n_protect):
    """Protect (or demote) the top ``n_protect`` candidates by value magnitude (with the outlier rule, only those
    above ``factor`` x their head's median); returns (mask ``[b, H, S]``, priorities, magnitudes)."""
    b, h, s = pr.shape
    n_choose = (keep.view(b, -1) - forced.sum(-1).view(b, -1)).clamp_min(0)  # [b, 1] or [b, H]
    cap = torch.minimum(n_choose, torch.full_like(n_choose, n_protect))
    mag = guard.magnitude(ctx).masked_fill(~cand, float("-inf"))
    k = min(n_protect, s)
    top_v, top_i = _top(mag, k)
    ok = (torch.arange(k, device=mag.device).view(1, 1, k) < cap.view(b, -1, 1)) & torch.isfinite(top_v)
    if guard.rule == "outlier":
        median = mag.masked_fill(~cand, float("nan")).nanmedian(-1, keepdim=True).values  # [b, H, 1], NaN if none
        ok = ok & (top_v > guard.factor * median)
    protected = torch.zeros((b, h, s), dtype=torch.bool, device=mag.device)
    protected.scatter_(-1, top_i, ok)
    tier = _PROTECTED if guard.mode == "protect" else _DEMOTED
    pr = torch.where(protected, torch.full_like(pr, tier), pr)
    return protected, pr, mag

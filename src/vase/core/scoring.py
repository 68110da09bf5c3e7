"""Scorers: one importance score per cached entry, per (batch row, KV head).

A scorer looks at an :class:`EvictionContext` (the cached keys and values, their logical positions, the saved
post-RoPE queries) and returns ``scores`` of shape ``[b, kv_heads, slots]`` (float32; higher = more worth keeping).
Scorers never need attention weights from the attention kernel: attention-based scores are recomputed here from the
saved post-RoPE queries (:mod:`vase.core.ring`). The scorers that read keys, values and positions only are in
:mod:`vase.core.key_scoring`.

Shapes used throughout: ``b`` batch rows taking part in the eviction, ``H`` KV heads, ``G`` query heads per KV head
(GQA group), ``S`` slots (cached entries considered), ``W`` saved queries, ``D`` head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Noise streams, so that different uses of randomness in one eviction are independent.
STREAM_SAMPLE = 0
STREAM_GUARD = 1
STREAM_PROJECTION = 2


@dataclass
class EvictionContext:
    """Everything a scorer, guard or selector may look at during one eviction of one layer.

    Attributes:
        keys: ``[b, H, S, D]`` cached keys (post-RoPE, model dtype).
        values: ``[b, H, S, D]`` cached values.
        positions: ``[b, H, S]`` int64 logical position of each slot: the index of its token among the real
            (non-padding) tokens of its row. Within a (row, head), valid slots are in increasing position order.
        valid: ``[b, S]`` bool, which slots hold a real token (padding and free slots are False); ``[b, H, S]``
            per KV head when the heads of a row hold different counts (adaptive budgets, :mod:`vase.core.budgets`: a
            head holding fewer tokens than the shared layout has dead slots). Code reading ``valid``, ``candidates`` or
            the masks derived from them handles both shapes (``mask.view(b, -1, S)`` broadcasts over heads).
        candidates: ``[b, S]`` (or ``[b, H, S]``, as ``valid``) bool, valid slots that are neither sinks nor in the
            recent window: the ones the policy chooses among.
        queries: ``[b, Hq, W, D]`` saved post-RoPE queries, or None when the policy needs none.
        query_positions: ``[b, W]`` int64 logical position of each saved query.
        query_valid: ``[b, W]`` bool, which saved queries are real (not padding, not yet written).
        scaling: attention scaling (usually ``head_dim ** -0.5``).
        layer_idx: index of the layer being compacted, or ``[b]`` int64 the layer of each row (one call evicting the
            rows of several layers: :meth:`vase.core.sequence.Sequences.evict_layers`); read it with :meth:`layer`.
        budget: this layer's budget in tokens per KV head on average (the cache budget, or the layer's PyramidKV
            budget with ``layer_budget='pyramid'``).
        row_keys: ``[b]`` int64 random keys of the rows (see :mod:`vase.core.rng`).
        eviction_index: ``[b]`` int64, how many evictions each row has had before this one.
        state: per-slot state of the scorer, tensors ``[b, H, S]`` that move with their tokens.
        memo: per-layer scalars a scorer may keep between evictions (e.g. how far H2O has accumulated); the cache
            sets ``memo["latest_query"]`` (``[b]``, the position of each row's newest query) before each eviction.
        sinks: the first ``sinks`` valid tokens of each row are attention sinks (always kept).
        buffer: the last ``buffer`` valid tokens of each row are the recent window (always kept): the policy option
            ``recent`` when it is set, else the cache's buffer (the compaction interval).
        head_offset: the model's index of the first KV head here (a tensor-parallel rank holds a share of the heads):
            random choices are keyed by the model's head index, so every rank draws what one worker would.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    candidates: torch.Tensor
    queries: torch.Tensor | None
    query_positions: torch.Tensor | None
    query_valid: torch.Tensor | None
    scaling: float
    layer_idx: int | torch.Tensor
    budget: int
    row_keys: torch.Tensor
    eviction_index: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    memo: dict = field(default_factory=dict)
    sinks: int = 0
    buffer: int = 0
    head_offset: int = 0

    def layer(self, dims: int = 3) -> int | torch.Tensor:
        """The layer index as a hash part broadcasting over ``dims`` dimensions: the int, or ``[b, 1, ...]``."""
        if isinstance(self.layer_idx, torch.Tensor):
            return self.layer_idx.view(-1, *([1] * (dims - 1)))
        return self.layer_idx

    def older(self) -> torch.Tensor:
        """``[b, S]`` bool (``[b, H, S]`` with per-head ``valid``): valid slots before the recent window (sinks
        included), the part of the cache that the reference code of VaSE scores (its softmax and its pooling run over
        these slots only)."""
        rank = self.valid.long().cumsum(-1) - 1
        n_valid = self.valid.sum(-1, keepdim=True)
        return self.valid & (rank < n_valid - self.buffer)

    def sink_mask(self) -> torch.Tensor:
        """``[b, S]`` bool (``[b, H, S]`` with per-head ``valid``): the sink slots (the first ``sinks`` valid slots
        of each row)."""
        rank = self.valid.long().cumsum(-1) - 1
        return self.valid & (rank < self.sinks)

    def noise_parts(self, stream: int) -> tuple:
        """Hash inputs that give one independent value per (row, head, slot) for this eviction and stream."""
        b, h, _ = self.positions.shape
        heads = torch.arange(self.head_offset, self.head_offset + h, device=self.positions.device).view(1, h, 1)
        return (
            self.row_keys.view(b, 1, 1),
            self.layer(3),
            self.eviction_index.view(b, 1, 1),
            heads,
            self.positions,
            stream,
        )


class Scorer:
    """Base class. ``window`` is how many recent queries the scorer needs saved (0: none); ``state_names`` the
    per-slot state it keeps (moved with each token); ``memo_names`` the per-row memo it keeps between evictions, as
    ``(name, initial value)`` pairs (the integrations allocate both from these names: :mod:`vase.core.tables`)."""

    window: int = 0
    state_names: tuple[str, ...] = ()
    memo_names: tuple[tuple[str, int], ...] = ()
    # whether a KV head's scores read that head (and its GQA group of query heads) alone: False for a score reduced
    # over every head of the layer (TOVA), which a tensor-parallel worker holding some of the heads cannot compute
    per_kv_head: bool = True

    def score(self, ctx: EvictionContext) -> torch.Tensor:  # pragma: no cover - interface
        """Scores ``[b, H, S]`` float32 for every slot of ``ctx`` (only candidates are used); higher = keep."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for logs and ``Policy.describe``."""
        return type(self).__name__


def window_attention(
    ctx: EvictionContext,
    since: int | torch.Tensor | None = None,
    domain: torch.Tensor | None = None,
    temperature: float = 1.0,
    value_weight: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the saved queries over the cached keys, recomputed in float32.

    Each query attends causally (to slots whose logical position is <= its own) over the slots of ``domain``
    (``[b, S]`` or per head ``[b, H, S]`` bool, default: every valid slot, as the model itself did), with logits
    ``q k^T * scaling / temperature``. Returns ``probs`` ``[b, H, G, W, S]`` (rows of invalid queries and columns
    outside the domain are zero) and ``seen`` ``[b, H, S]``: how many valid queries can see each slot (the causal
    count a mean over queries divides by). With ``since`` (an int or ``[b]`` tensor), only queries at positions >
    ``since`` count.

    ``value_weight`` other than 'none' returns the value-aware weights of :func:`weight_by_value` in place of the
    attention probabilities (same shape and zeros); every attention-based scorer gets the option through here.
    """
    q = ctx.queries
    b, hq, w, d = q.shape
    h, s = ctx.keys.shape[1], ctx.keys.shape[2]
    g = hq // h
    logits = torch.matmul(q.float().reshape(b, h, g * w, d), ctx.keys.float().transpose(-1, -2))
    logits = logits.view(b, h, g, w, s).mul_(ctx.scaling / temperature)  # in place: one [b, H, G, W, S] buffer
    qvalid = ctx.query_valid
    if since is not None:
        since = torch.as_tensor(since, device=qvalid.device).view(-1, 1)
        qvalid = qvalid & (ctx.query_positions > since)
    domain = ctx.valid if domain is None else domain
    visible = (ctx.positions.view(b, h, 1, 1, s) <= ctx.query_positions.view(b, 1, 1, w, 1)) & qvalid.view(
        b, 1, 1, w, 1
    )  # [b, H, 1, W, S]
    allowed = domain.view(b, -1, 1, 1, s) & visible
    logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    del logits
    if value_weight != "none":
        probs = weight_by_value(probs, ctx.values, value_weight)
    return probs, visible.sum(3).squeeze(2)


VALUE_WEIGHTS = ("none", "l1", "output_error")


def weight_by_value(probs: torch.Tensor, values: torch.Tensor, how: str) -> torch.Tensor:
    """Value-aware importance of each (query, slot) pair, from the attention ``probs`` ``[b, H, G, W, S]`` (each
    query's row sums to 1 over the slots it attends to, or is all zero) and the cached ``values`` ``[b, H, S, D]``.

    * ``'l1'``: ``a_i * ||v_i||_1``, attention times the L1 norm of the token's value vector (VATP, Guo et al. 2024,
      arXiv 2406.12335, Sec. 3).
    * ``'output_error'``: ``a_i / (1 - a_i) * ||v_i - o||_2`` with ``o = sum_j a_j v_j`` the query's attention output
      over the same slots: the norm of the change of that output when token i alone is removed and the remaining
      weights renormalised, ``o - (o - a_i v_i) / (1 - a_i) = a_i (v_i - o) / (1 - a_i)`` (CAOTE, Goel et al. 2025,
      arXiv 2504.14051, Sec. 3; ``1 - a_i`` is clamped at 1e-6: a token holding all of a query's attention has
      ``v_i = o``, so its error is 0). Per query head, before any mean over queries or heads.

    Both are then divided by one positive constant per (row, KV head), ``sum(weighted) / sum(probs)`` over its query
    heads, queries and slots: the weighted attention keeps the head's total attention mass, so its scale is that of
    attention (what R-KV's ``lam`` balances, what a layer-wide mean over heads adds up), while top-k and sampling
    within a head choose exactly as with the papers' unnormalised scores (a constant factor per head changes neither).

    Returns:
        ``[b, H, G, W, S]`` float32, zero where ``probs`` is zero.

    Raises:
        ValueError: for an unknown ``how``.
    """
    if how == "none":
        return probs
    if how not in VALUE_WEIGHTS:
        raise ValueError(f"value_weight must be one of {', '.join(VALUE_WEIGHTS)}, got {how!r}")
    b, h, g, w, s = probs.shape
    v = values.float()  # [b, H, S, D]
    mass = probs.sum((2, 3, 4), keepdim=True)  # [b, H, 1, 1, 1]
    if how == "l1":
        norm = v.abs().sum(-1).view(b, h, 1, 1, s)
        total = (probs.sum((2, 3), keepdim=True) * norm).sum(-1, keepdim=True)
        return probs * (norm * _mass_scale(mass, total))
    out = torch.matmul(probs.view(b, h, g * w, s), v)  # [b, H, G*W, D] attention output of each query
    # ||v_i - o||^2 = ||v_i||^2 - 2 v_i.o + ||o||^2, without materialising [b, H, G*W, S, D]
    err = torch.matmul(out, v.transpose(-1, -2)).mul_(-2.0)
    err.add_(v.pow(2).sum(-1).unsqueeze(2)).add_(out.pow(2).sum(-1, keepdim=True)).clamp_min_(0.0).sqrt_()
    weighted = torch.rsub(probs, 1.0).clamp_min_(1e-6)
    torch.div(probs, weighted, out=weighted).mul_(err.view(b, h, g, w, s))  # a / (1 - a) * ||v - o||
    return weighted.mul_(_mass_scale(mass, weighted.sum((2, 3, 4), keepdim=True)))


def _mass_scale(mass: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Per (row, KV head) factor that brings ``total`` back to the attention ``mass`` (1 where total is 0)."""
    return torch.where(total > 0, mass / total.clamp_min(1e-30), torch.ones_like(total))


def pool_tokens(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """1-D pooling along the last (token) axis with 'same' padding; ``kind`` is 'avg' or 'max'."""
    if kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    if kind == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out[..., : shape[-1]].reshape(shape)


def pool_in_order(x: torch.Tensor, domain: torch.Tensor, order: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """Pool ``x`` ``[b, H, G, S]`` along the slots of ``domain`` (``[b, S]`` or ``[b, H, S]`` bool) taken in
    increasing ``order``
    (``[b, H, S]``), with zero padding at both ends of the domain: slots outside the domain are neither pooled nor
    pooled into. Entries outside the domain come back as 0.
    """
    b, h, g, s = x.shape
    domain = domain.view(b, -1, s)  # [b, 1 or H, S]
    if kernel <= 1:
        return x * domain[:, :, None, :]
    key = torch.where(domain, order.float(), torch.full_like(order, float("inf"), dtype=torch.float32))
    perm = torch.sort(key, dim=-1, stable=True).indices  # [b, H, S]: domain slots first, in order
    inside = domain.expand(b, h, s).gather(-1, perm)
    perm_g = perm[:, :, None, :].expand(b, h, g, s)
    xs = x.gather(-1, perm_g) * inside[:, :, None, :]
    pooled = pool_tokens(xs, kernel, kind) * inside[:, :, None, :]
    return torch.zeros_like(x).scatter_(-1, perm_g, pooled)


def reduce_heads(x: torch.Tensor, how: str) -> torch.Tensor:
    """``[b, H, G, S]`` -> ``[b, H, S]``: mean over each GQA group ('group') or all heads of the layer ('layer')."""
    if how == "group":
        return x.mean(2)
    return x.mean((1, 2), keepdim=True).squeeze(2).expand(x.shape[0], x.shape[1], x.shape[3])


def _describe_weight(how: str) -> str:
    return {"none": "", "l1": ", x ||v||_1 (VATP)", "output_error": ", output error (CAOTE)"}[how]


SOFTMAX_DOMAINS = ("all", "older")
POOL_EDGES = ("through", "zero")
POOL_ORDERS = ("position", "slot")


class WindowAttention(Scorer):
    """Observation-window attention, pooled over positions: SnapKV (Li et al. 2024, arXiv 2404.14469, Sec. 4) and the
    importance score of VaSE (arXiv 2606.03928, Sec. 3.2).

    Score = mean over the last ``window`` queries of softmax(q k^T * scaling / ``attention_temperature``), pooled
    along the token axis (``pool`` 'avg' or 'max', ``kernel`` wide), then averaged over the query heads of each GQA
    group (``head_reduce='group'``) or of the whole layer (``'layer'``, as TOVA does). The mean over queries is
    causal: a slot's attention is divided by the number of window queries that can see it, so a slot newer than some
    window queries is not penalised for the votes it could not get.

    Where the reference code of VaSE differs, an option chooses (the published setting in brackets):

    * ``softmax``: the softmax runs over every held slot, ``'all'``, or only over the slots before the recent window
      (sinks included), ``'older'`` [older];
    * ``pool_edge``: pooling runs across the whole cache, so the last candidates also average the recent window's
      attention, ``'through'``, or only over the slots before the recent window with zero padding at both ends,
      ``'zero'`` [zero];
    * ``pool_order``: pooling neighbours are the neighbouring tokens, ``'position'``, or the neighbouring slots of
      the reference's physical layout after its compactions (sinks, then protected values by decreasing magnitude,
      then the sampled tokens in draw order, then newer tokens), ``'slot'`` [slot]; ``'slot'`` keeps that layout in
      the per-slot state ``order`` and needs ``pool_edge='zero'``.

    ``value_weight`` ('none', 'l1', 'output_error'; see :func:`weight_by_value`) replaces each query's attention by
    its value-aware weight before the mean over the window, the pooling and the mean over heads.
    """

    def __init__(
        self,
        window: int = 64,
        kernel: int = 5,
        pool: str = "avg",
        head_reduce: str = "group",
        softmax: str = "all",
        pool_edge: str = "through",
        pool_order: str = "position",
        attention_temperature: float = 1.0,
        value_weight: str = "none",
    ):
        for name, value, allowed in (
            ("softmax", softmax, SOFTMAX_DOMAINS),
            ("pool_edge", pool_edge, POOL_EDGES),
            ("pool_order", pool_order, POOL_ORDERS),
            ("value_weight", value_weight, VALUE_WEIGHTS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if pool_order == "slot" and pool_edge != "zero":
            raise ValueError("pool_order='slot' (the reference's slot layout) needs pool_edge='zero'")
        if not float(attention_temperature) > 0:
            raise ValueError(f"attention_temperature must be > 0, got {attention_temperature}")
        self.window, self.kernel, self.pool, self.head_reduce = window, kernel, pool, head_reduce
        self.per_kv_head = head_reduce != "layer"
        self.softmax, self.pool_edge, self.pool_order = softmax, pool_edge, pool_order
        self.attention_temperature = float(attention_temperature)
        self.value_weight = value_weight
        self.state_names = ("order",) if pool_order == "slot" else ()

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        older = ctx.older() if (self.softmax == "older" or self.pool_edge == "zero") else None
        probs, seen = window_attention(
            ctx,
            domain=older if self.softmax == "older" else None,
            temperature=self.attention_temperature,
            value_weight=self.value_weight,
        )
        mean = probs.sum(3) / seen.clamp_min(1).unsqueeze(2).to(probs.dtype)  # [b, H, G, S]
        if self.pool_edge == "through" and ctx.valid.dim() == 3:
            # per-head validity (adaptive budgets): pool over each head's live slots in position order, skipping its
            # dead slots; with one contiguous block of valid slots this is exactly pool_tokens
            pooled = pool_in_order(mean, ctx.valid, ctx.positions.float(), self.kernel, self.pool)
        elif self.pool_edge == "through":
            pooled = pool_tokens(mean, self.kernel, self.pool)
        else:
            order = ctx.positions.float()
            if self.pool_order == "slot":
                stored = ctx.state["order"]
                order = torch.where(stored < 0, stored, order)
            pooled = pool_in_order(mean, older, order, self.kernel, self.pool)
        return reduce_heads(pooled, self.head_reduce)

    def describe(self) -> str:
        extra = ""
        if (self.softmax, self.pool_edge, self.pool_order) != ("all", "through", "position"):
            extra = f", softmax over {self.softmax}, pool edge {self.pool_edge}, pool order {self.pool_order}"
        if self.attention_temperature != 1.0:
            extra += f", attention temperature {self.attention_temperature:g}"
        extra += _describe_weight(self.value_weight)
        return (
            f"window attention (window {self.window}, {self.pool}-pool {self.kernel}, mean over {self.head_reduce}"
            f"{extra})"
        )


class AccumulatedAttention(Scorer):
    """Heavy hitters: attention accumulated over all past queries, per KV head. H2O (Zhang et al. 2023,
    arXiv 2306.14048, Sec. 3).

    The running sum lives in per-slot state ``acc`` and moves with its token. At each eviction the saved queries
    newer than the previous eviction are added (so with ``window >= buffer`` every decode query is counted).

    With ``value_weight`` (see :func:`weight_by_value`) the value-aware weights are accumulated instead: with 'l1'
    this is H2O with VATP (arXiv 2406.12335, Sec. 3: accumulated attention times ``||v||_1``), up to the per-head
    normalisation of each eviction's new queries; with 'output_error' the CAOTE error of every past query, summed.
    """

    state_names = ("acc",)
    memo_names = (("acc_upto", -1),)  # the newest query accumulated so far (-1: none yet)

    def __init__(self, window: int = 64, value_weight: str = "none"):
        if value_weight not in VALUE_WEIGHTS:
            raise ValueError(f"value_weight must be one of {', '.join(VALUE_WEIGHTS)}, got {value_weight!r}")
        self.window, self.value_weight = window, value_weight

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        since = ctx.memo.get("acc_upto", -1)
        probs, _ = window_attention(ctx, since=since, value_weight=self.value_weight)
        acc = ctx.state["acc"]
        acc += probs.sum(3).mean(2)
        ctx.memo["acc_upto"] = ctx.memo["latest_query"]
        return acc.clone()

    def describe(self) -> str:
        return f"accumulated attention (H2O{_describe_weight(self.value_weight)})"


class RedundancyAware(Scorer):
    """R-KV (Cai et al. 2025, arXiv 2505.24133, Sec. 3): ``lam * importance - (1 - lam) * redundancy``.

    Importance: window attention of the last ``window`` queries (or its value-aware weight, ``value_weight``),
    max-pooled (``kernel``). Redundancy: for each key,
    the mean cosine similarity to the *later* valid keys of the same head, so that of a group of near-duplicates the
    most recent one is not penalised; then a softmax over the valid slots. Scores may be negative: use it with top-k.
    """

    def __init__(self, window: int = 8, kernel: int = 7, lam: float = 0.1, value_weight: str = "none"):
        self.window, self.kernel, self.lam, self.value_weight = window, kernel, lam, value_weight
        self._importance = WindowAttention(window, kernel, "max", value_weight=value_weight)

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        importance = self._importance.score(ctx)
        # Valid slots are in increasing position order, so "later" means "at a higher slot": the sum of the cosine
        # similarities to the later keys is k_i . (sum of the later normalised keys), a suffix sum over the slots.
        # O(S * D) instead of materialising the [b, H, S, S] similarity matrix.
        b, s = ctx.keys.shape[0], ctx.keys.shape[2]
        valid_h = ctx.valid.view(b, -1, s)  # [b, 1 or H, S]
        kn = F.normalize(ctx.keys.float(), dim=-1) * valid_h.unsqueeze(-1)
        suffix = kn.flip(-2).cumsum(-2).flip(-2)  # [b,H,S,D]: sum over slots >= i
        later_sum = F.pad(suffix[..., 1:, :], (0, 0, 0, 1))  # sum over slots > i
        valid = valid_h.float()
        n_later = F.pad(valid.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1)).clamp_min(1)  # [b,1 or H,S]
        red = (kn * later_sum).sum(-1) / n_later
        red = red.masked_fill(~valid_h, float("-inf"))
        red = torch.softmax(red, dim=-1).nan_to_num_(0.0)
        return self.lam * importance - (1.0 - self.lam) * red

    def describe(self) -> str:
        weight = _describe_weight(self.value_weight)
        return f"R-KV (importance window {self.window}, max-pool {self.kernel}, lambda {self.lam}{weight})"

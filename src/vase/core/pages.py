"""Query-aware page selection over a whole KV cache (Quest: Tang et al. 2024, arXiv 2406.10774, Sec. 3).

The cache keeps every token. Its slots are cut into pages of ``page`` consecutive tokens of a row (page ``j`` holds
the tokens at logical positions ``[j * page, (j + 1) * page)``: a row's slots are its real tokens packed in order, so
a row's pages are the same in a ragged batch as alone). Each page stores the element-wise minimum and maximum of its
keys per KV head (:class:`PageTable`), updated when its slots are written. At each step, for every query token and
query head, the upper bound of ``q . k`` over a page (Quest, Sec. 3.2)::

    bound(q, page) = sum_d max(q_d * min_d, q_d * max_d)

ranks the candidate pages, and the query attends only to the pages it selects (:func:`select_pages`):

* the prefill (the first forward of a cache) is dense, as Quest selects at decode only;
* every later query, at logical position ``t`` (one decode token, or each token of a multi-token chunk: a chat
  continuation, or the teacher-forced chunk of :func:`vase.harness.fidelity.replay`), always attends to its own page
  (the tokens ``page * (t // page) .. t``) and to the sink pages (the pages holding the first ``sinks`` tokens); the
  candidates are the complete pages before its own page; the token budget left after those forced tokens is filled
  with whole candidate pages by decreasing bound (ties: the earlier page). So a query attends to at most ``budget``
  tokens, and a chunk selects exactly what token-by-token decoding selects.

Selection is per *query head* (Quest's granularity: the heads of a GQA group may pick different pages), with the
bound of a query head computed against the page metadata of its KV head. Attention then runs over all held slots
with a mask ``[B, q_heads, q, kv_len]`` (sdpa: bool, eager: additive), which is what this CPU implementation does: it
saves no attention work, only shows which entries a query may use. A kernel that gathers the selected pages would
be the fast path (on a GPU); flash-attention takes no per-head mask, so the cache refuses it for this policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import mask_in_kind

FLASH = ("flash_attention_2", "flash_attention_3")


def page_bound(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q . k`` over each page: ``sum_d max(q_d * min_d, q_d * max_d)`` (Quest, Sec. 3.2).

    Args:
        query: ``[B, q_heads, q, D]`` (post-RoPE).
        kmin, kmax: ``[B, kv_heads, pages, D]`` element-wise key minimum / maximum of each page; ``q_heads`` must be
            a multiple of ``kv_heads`` (query head ``h`` uses KV head ``h // (q_heads // kv_heads)``, as
            transformers' ``repeat_kv``).

    Returns:
        ``[B, q_heads, q, pages]`` float32. Computed as ``q+ . max + q- . min`` (``q+ = max(q, 0)``,
        ``q- = min(q, 0)``), which equals the formula term by term.

    Raises:
        ValueError: if the head counts do not divide.
    """
    b, hq, q, d = query.shape
    hk, n = kmin.shape[1], kmin.shape[2]
    if hq % hk:
        raise ValueError(f"{hq} query heads are not a multiple of {hk} KV heads")
    g = hq // hk
    qf = query.float().reshape(b, hk, g * q, d)
    hi = qf.clamp_min(0) @ kmax.float().transpose(-1, -2)
    lo = qf.clamp_max(0) @ kmin.float().transpose(-1, -2)
    return (hi + lo).view(b, hq, q, n)


def select_pages(bounds: torch.Tensor, positions: torch.Tensor, page: int, sinks: int, budget: int) -> torch.Tensor:
    """The pages each query attends to: its own page, the sink pages, and the top candidate pages by bound.

    Args:
        bounds: ``[B, H, q, pages]`` page scores of each query (see :func:`page_bound`); entries of pages that are
            not candidates of a query are ignored (they may be anything, NaN included).
        positions: ``[B, q]`` int64 logical position ``t`` of each query token.
        page: tokens per page; sinks: the first ``sinks`` tokens of a row are always attended (their pages are);
        budget: tokens a query may attend to, forced pages included.

    Returns:
        ``[B, H, q, pages]`` bool: page ``j`` is attended by the query at ``t`` iff ``j == t // page``, or ``j`` is a
        sink page ``< t // page``, or ``j`` is among the ``(budget - forced) // page`` candidate pages (complete
        pages before ``t // page`` that are not sink pages) with the largest bound, where ``forced = t % page + 1
        + page * (sink pages before t // page)``. Ties go to the earlier page.
    """
    n = bounds.shape[-1]
    dev = bounds.device
    j = torch.arange(n, device=dev).view(1, 1, n)
    own = (positions // page).unsqueeze(-1)  # [B, q, 1]
    sink_pages = -(-sinks // page)
    sink = (j < sink_pages) & (j < own)
    cand = (j < own) & (j >= sink_pages)  # [B, q, pages]
    forced_tokens = positions % page + 1 + page * own.squeeze(-1).clamp_max(sink_pages)
    take = ((budget - forced_tokens) // page).clamp_min(0)  # [B, q] candidate pages each query may add
    scores = bounds.float().masked_fill(~cand.unsqueeze(1), float("-inf"))
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=dev).expand_as(order))
    chosen = (rank < take[:, None, :, None]) & cand.unsqueeze(1)
    return chosen | (sink | (j == own)).unsqueeze(1)


class PageTable:
    """Page metadata of one layer: per (row, KV head, page) the element-wise min and max of the page's keys.

    Tensors ``kmin``, ``kmax``: ``[B, kv_heads, pages, D]`` in the keys' dtype; a page not written yet holds
    ``+inf`` / ``-inf``. Sized to cover the slots of the layer's buffers (grown with them): 1/``page`` of the bytes
    of the keys and values. Updated incrementally: writing keys only folds them into the min/max of their own pages
    (:meth:`write`).
    """

    def __init__(self, page: int):
        self.page = page
        self.kmin: torch.Tensor | None = None
        self.kmax: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the metadata held (both tensors)."""
        if self.kmin is None:
            return 0
        return 2 * self.kmin.numel() * self.kmin.element_size()

    def _ensure(self, keys: torch.Tensor, pages: int) -> None:
        b, h, _, d = keys.shape
        have = 0 if self.kmin is None else self.kmin.shape[2]
        if have >= pages:
            return
        size = pages
        kmin = torch.full((b, h, size, d), float("inf"), dtype=keys.dtype, device=keys.device)
        kmax = torch.full((b, h, size, d), float("-inf"), dtype=keys.dtype, device=keys.device)
        if have:
            kmin[:, :, :have] = self.kmin
            kmax[:, :, :have] = self.kmax
        self.kmin, self.kmax = kmin, kmax

    @torch.no_grad()
    def write(
        self, keys: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None, last: int, slots: int = 0
    ) -> None:
        """Fold new keys into the metadata of their pages.

        Args:
            keys: ``[B, kv_heads, q, D]`` the keys of this step's new tokens (post-RoPE).
            positions: ``[B, q]`` int64 logical position of each; valid: ``[B, q]`` bool (False: padding, ignored),
                or None (all real).
            last: the largest position written over all rows (host int: sizes the table without a device sync).
            slots: the slots of the layer's buffers (tokens): the table covers at least as many, so it grows with
                them, not at every page.
        """
        b, h, q, d = keys.shape
        self._ensure(keys, max(last, slots - 1) // self.page + 1)
        pg = (positions // self.page).view(b, 1, q, 1).expand(b, h, q, d)
        lo = hi = keys
        if valid is not None:
            pad = ~valid.view(b, 1, q, 1)
            lo = keys.masked_fill(pad, float("inf"))
            hi = keys.masked_fill(pad, float("-inf"))
        if q == 1:  # a decode token: one page per row
            cur_lo, cur_hi = self.kmin.gather(2, pg), self.kmax.gather(2, pg)
            self.kmin.scatter_(2, pg, torch.minimum(cur_lo, lo))
            self.kmax.scatter_(2, pg, torch.maximum(cur_hi, hi))
        else:
            self.kmin.scatter_reduce_(2, pg, lo, reduce="amin", include_self=True)
            self.kmax.scatter_reduce_(2, pg, hi, reduce="amax", include_self=True)


@dataclass(frozen=True)
class PageSelection:
    """Quest's per-step page selection, as a policy's attention rule (:attr:`vase.Policy.sparse`).

    The :class:`~vase.EvictingCache` calls :meth:`check` when it is made, :meth:`write` when a layer's tokens are
    written and :meth:`mask` when a layer's attention mask is built. ``page``: tokens per page.
    """

    page: int = 16

    def describe(self) -> str:
        """One line on what each query attends to."""
        return (
            f"attends per query head to its own page, the sink pages and the top pages of {self.page} tokens by "
            "q.k bound"
        )

    def check(self, budget: int | None, sinks: int, attn: str | None = None) -> None:
        """Raise a clear ValueError for sizes or an attention implementation this selection cannot take.

        Raises:
            ValueError: a page that is not a positive integer; a budget (tokens attended per step) smaller than the
                forced pages (sink pages + the query's own page); flash-attention (no per-head mask).
        """
        if isinstance(self.page, bool) or not isinstance(self.page, int) or self.page < 1:
            raise ValueError(f"page must be a positive number of tokens, got {self.page!r}")
        forced = (-(-sinks // self.page) + 1) * self.page
        if budget is not None and budget < forced:
            raise ValueError(
                f"budget ({budget}) is smaller than the pages always attended (sink pages + the current page = "
                f"{forced} tokens with page {self.page}, sinks {sinks}): raise the budget to at least {forced}"
            )
        if attn in FLASH:
            raise ValueError(
                f"quest selects pages per query head with an attention mask, which {attn} does not take: load the "
                "model with attn_implementation='sdpa' or 'eager'"
            )

    def write(self, layer, step, keys: torch.Tensor) -> None:
        """Fold the step's new keys ``[B, kv_heads, q, D]`` into ``layer.pages`` (created at the first write)."""
        if layer.pages is None:
            layer.pages = PageTable(self.page)
        last = max(r + c for r, c in zip(step.real_before, step.counts)) - 1
        layer.pages.write(keys, step.new_positions(), step.new_valid, max(last, 0), layer.keys.shape[2])

    def mask(self, layer, step, query: torch.Tensor, kind: str, dtype: torch.dtype, budget: int, sinks: int):
        """The attention mask of this layer's step: the step's own mask at prefill and when every query may attend
        to all its tokens (``budget`` >= its position + 1); else the per-query-head page mask.

        Args:
            query: ``[B, q_heads, q, D]`` post-RoPE queries of the step.
            kind: 'bool' (sdpa) or 'additive' (eager).

        Returns:
            None or the step's mask (see ``_Step.mask``), or ``[B, q_heads, q, kv_len]`` bool / additive ``dtype``.

        Raises:
            ValueError: for kind 'padding' (flash-attention).
        """
        longest = max(r + c for r, c in zip(step.real_before, step.counts))
        if step.seen_before == 0 or longest <= budget:
            return step.mask(kind, dtype)
        if kind == "padding":
            raise ValueError("quest needs an attention mask per query head: use sdpa or eager, not flash-attention")
        b, q = query.shape[0], query.shape[2]
        dev = query.device
        qpos = step.new_positions()  # [B, q]
        if step.append:
            kv_pos = layer.positions[:, 0, : step.p_old + 1]  # the new token is already in its slot
        else:
            new = qpos if step.new_valid is None else qpos.masked_fill(~step.new_valid, -1)
            kv_pos = torch.cat([layer.positions[:, 0, : step.p_old], new], dim=1)
        pages = layer.pages
        n = longest // pages.page + (1 if longest % pages.page else 0)
        bounds = page_bound(query, pages.kmin[:, :, :n], pages.kmax[:, :, :n])
        chosen = select_pages(bounds, qpos, pages.page, sinks, budget)  # [B, Hq, q, n]
        kv_len = kv_pos.shape[1]
        kv_page = (kv_pos.clamp_min(0) // pages.page).view(b, 1, 1, kv_len).expand(b, chosen.shape[1], q, kv_len)
        m = chosen.gather(-1, kv_page)
        m &= ((kv_pos >= 0).view(b, 1, kv_len) & (kv_pos.view(b, 1, kv_len) <= qpos.view(b, q, 1))).unsqueeze(1)
        if step.new_valid is not None:  # a padding query attends to itself only, so no row is empty (no NaN)
            j = torch.arange(kv_len, device=dev).view(1, 1, kv_len)
            i = torch.arange(q, device=dev).view(1, q, 1)
            m |= ((j - step.p_old == i) & ~step.new_valid.view(b, q, 1)).unsqueeze(1)
        return mask_in_kind(m, kind, dtype)

"""The saved post-RoPE queries of one evicting layer: a ring of the last ``window`` real queries of each row.

Attention-based scorers (VaSE, SnapKV, H2O, TOVA, R-KV) recompute attention from these queries at each eviction, so
no attention weights are needed from the kernel (VaSE, arXiv 2606.03928, Sec. 3.3).
"""

from __future__ import annotations

import torch

from .step import StepPlan, expand_rows


class QueryRing:
    """The last ``window`` post-RoPE queries of each row of one layer, its real ones only.

    Tensors (allocated at the first record, never reallocated):
        queries: ``[B, q_heads, window, head_dim]`` model dtype.
        positions: ``[B, window]`` int64 logical position of each saved query (-1: empty).
        valid: ``[B, window]`` bool, which entries hold a real query.

    One write pointer ``next`` serves all rows: the entry it points at is the oldest query (or an empty entry) of
    every row. A step with padding keeps this true with :meth:`record_padded`.
    """

    def __init__(self, window: int):
        self.window = window
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.next = 0

    def _allocate(self, query: torch.Tensor) -> None:
        b, hq, _, d = query.shape
        w, dev = self.window, query.device
        self.queries = torch.zeros((b, hq, w, d), dtype=query.dtype, device=dev)
        self.positions = torch.full((b, w), -1, dtype=torch.long, device=dev)
        self.valid = torch.zeros((b, w), dtype=torch.bool, device=dev)

    @torch.no_grad()
    def record(self, query: torch.Tensor, step: StepPlan) -> None:
        """Save the last ``window`` queries ``[B, q_heads, q, head_dim]`` of the step ``step``."""
        w = self.window
        if w == 0:
            return
        if self.queries is None:
            self._allocate(query)
        if step.new_valid is not None:
            self.record_padded(query, step)
            return
        q = query.shape[2]
        m = min(q, w)
        if m == 1:
            i = self.next
            self.queries[:, :, i : i + 1].copy_(query[:, :, -1:])
            if len(set(step.real_before)) == 1:
                self.positions[:, i].fill_(step.real_before[0] + q - 1)
            else:
                self.positions[:, i].copy_(step.new_positions()[:, -1])
            self.valid[:, i] = True
        else:
            idx = torch.arange(self.next, self.next + m, device=query.device) % w
            self.queries.index_copy_(2, idx, query[:, :, -m:])
            self.positions.index_copy_(1, idx, step.new_positions()[:, -m:])
            self.valid.index_fill_(1, idx, True)
        self.next = (self.next + m) % w

    def record_padded(self, query: torch.Tensor, step: StepPlan) -> None:
        """Ring update for a multi-token step with padding (a ragged prefill or continuation).

        Padding columns must not push a row's earlier real queries out of the ring: each row keeps the newest
        ``window`` of its saved real queries and its real new ones, rewritten oldest first from entry 0 with the
        empty entries before them (so the write pointer, reset to 0, again points at each row's oldest entry). Works
        on ``[B, q_heads, 2 * window, head_dim]`` at most, whatever the step's length.
        """
        w = self.window
        hq, d = query.shape[1], query.shape[3]
        m = min(step.q, w)
        dev = query.device
        # the last m real columns of each row, in order (empty columns first where a row has fewer)
        cols = torch.argsort(step.new_valid.to(torch.int8), dim=1, stable=True)[:, -m:]  # [B, m]
        age = (torch.arange(w, device=dev) + self.next) % w  # ring entries, oldest first
        cand_q = torch.cat([self.queries.index_select(2, age), query.gather(2, expand_rows(cols, hq, d))], 2)
        cand_p = torch.cat([self.positions.index_select(1, age), step.new_positions().gather(1, cols)], 1)
        cand_v = torch.cat([self.valid.index_select(1, age), step.new_valid.gather(1, cols)], 1)
        keep = torch.argsort(cand_v.to(torch.int8), dim=1, stable=True)[:, -w:]  # [B, w]: the newest w real last
        self.queries.copy_(cand_q.gather(2, expand_rows(keep, hq, d)))
        self.positions.copy_(cand_p.gather(1, keep))
        self.valid.copy_(cand_v.gather(1, keep))
        self.next = 0

    def record_static(self, query: torch.Tensor, at: torch.Tensor, position: torch.Tensor) -> None:
        """Compiled decoding: save the step's query ``[B, q_heads, 1, D]`` at the entry ``at`` (a ``[1]`` int64
        device tensor, the write pointer), its rows at logical positions ``position`` ``[B]``; no host value read."""
        if self.queries is None:
            return
        self.queries.index_copy_(2, at, query)
        self.positions.index_copy_(1, at, position.view(-1, 1))
        self.valid.index_fill_(1, at, True)

    def advance(self) -> None:
        """Move the write pointer by one entry (after a compiled step wrote at it)."""
        if self.queries is not None:
            self.next = (self.next + 1) % self.window

    def tensors(self) -> list[torch.Tensor]:
        """The ring's tensors (empty before the first record)."""
        return [] if self.queries is None else [self.queries, self.positions, self.valid]

    def rows(self, index: torch.Tensor | None):
        """``(queries, positions, valid)`` of the rows ``index`` (all rows for None), or three Nones when empty."""
        if self.queries is None:
            return None, None, None
        if index is None:
            return self.queries, self.positions, self.valid
        return tuple(t.index_select(0, index) for t in (self.queries, self.positions, self.valid))

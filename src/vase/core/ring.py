"""The saved post-RoPE queries of a set of sequences: the last ``window`` real queries of each row (torch only).

Attention-based scorers (VaSE, SnapKV, H2O, TOVA, R-KV) recompute attention from these queries at each eviction, so
no attention weights are needed from the attention kernel (VaSE, arXiv 2606.03928, Sec. 3.3: the observation window
is the last queries). Per layer ``l``: ``queries[l]`` ``[R, Hq, W, D]`` in the model's dtype; shared by the layers
(every layer saves the same tokens): ``positions`` ``[R, W]`` int64, the logical position of each saved query (-1:
empty), and ``valid`` ``[R, W]`` bool.

Each row has its own write pointer ``next[r]``, the entry of its oldest saved query: a row writes its newest
``min(n, W)`` real queries of a step of ``n`` new tokens at ``next[r], next[r] + 1, ...`` (mod ``W``), whatever the
other rows of its batch do (padding columns take no entry), so a row's ring is exactly what it would be alone.

One step: the integration asks for a :class:`RingWrite` (:meth:`QueryRing.plan`, which also writes the saved
queries' positions), gives each layer's queries in the layout the plan names (:meth:`QueryRing.write`), then
:meth:`QueryRing.commit` s the pointers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .transfer import upload


@dataclass
class RingWrite:
    """Where one step's saved queries go.

    ``kind`` tells the layout :meth:`QueryRing.write` expects for the values:

    * ``'column'``: every row of the ring saves one query at entry ``slot``: values ``[R, Hq, 1, D]``;
    * ``'block'``: every row saves its last ``m`` queries at the entries ``index`` ``[m]``: values ``[R, Hq, m, D]``;
    * ``'scatter'``: entry ``slots[i]`` of row ``rows[i]``: values ``[N, Hq, D]``, one per saved query, in the order
      of :attr:`source` (row ``step_rows[i]`` of the step, its ``offset[i]``-th new real token).

    Attributes:
        kind, slot, index, rows, slots: see above (``rows``, ``slots`` ``[N]`` int64 for every kind).
        step_rows, offsets: per saved query, its row's place in the step and its rank among that row's new real
            tokens (host lists): an integration maps them to its own query layout.
        saved: queries saved per row of the step (host list), for :meth:`QueryRing.commit`.
        ring_rows: the ring rows of the step (host list).
    """

    kind: str
    rows: torch.Tensor
    slots: torch.Tensor
    step_rows: list[int]
    offsets: list[int]
    saved: list[int]
    ring_rows: list[int]
    slot: int = 0
    index: torch.Tensor | None = None


class QueryRing:
    """The last ``window`` post-RoPE queries of each row, per layer (see the module docstring).

    Args:
        layers: evicting layers.
        window: queries saved per row (at least 1).
    """

    def __init__(self, layers: int, window: int):
        if window < 1:
            raise ValueError(f"a query ring needs a window of at least 1 query, got {window}")
        self.window = window
        self.queries: list[torch.Tensor | None] = [None] * layers
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.next: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.next)

    def prepare(self, rows: int, device) -> None:
        """Positions and validity for ``rows`` rows on ``device`` (allocated once; more rows keep the old ones)."""
        if self.positions is not None and self.positions.shape[0] >= rows:
            return
        pos = torch.full((rows, self.window), -1, dtype=torch.long, device=device)
        valid = torch.zeros((rows, self.window), dtype=torch.bool, device=device)
        if self.positions is not None:
            n = self.positions.shape[0]
            pos[:n], valid[:n] = self.positions, self.valid
        self.positions, self.valid = pos, valid
        self.next.extend([0] * (rows - len(self.next)))

    def allocate(self, layer: int, q_heads: int, head_dim: int, dtype, device) -> None:
        """Layer ``layer``'s queries ``[R, q_heads, window, head_dim]`` (zeros), for the rows :meth:`prepare`\\ d."""
        self.queries[layer] = torch.zeros((self.rows, q_heads, self.window, head_dim), dtype=dtype, device=device)

    def grow(self, rows: int) -> None:
        """Room for ``rows`` rows in every allocated layer, the saved queries copied over."""
        self.prepare(rows, self.positions.device)
        for i, q in enumerate(self.queries):
            if q is not None and q.shape[0] < rows:
                new = q.new_zeros((rows, *q.shape[1:]))
                new[: q.shape[0]] = q
                self.queries[i] = new

    def reset_row(self, row: int) -> None:
        """Forget ``row``'s saved queries (a new sequence in that row)."""
        self.next[row] = 0
        self.positions[row] = -1
        self.valid[row] = False

    # -------------------------------------------------------------------------------------------------- steps
    def plan(self, rows: list[int], counts: list[int], seen_before: list[int], scatter: bool = False) -> RingWrite:
        """Where the step's saved queries go, and their positions written: row ``rows[i]``, with ``counts[i]`` new
        real tokens at logical positions ``seen_before[i] ...``, saves its last ``min(counts[i], window)``.
        ``scatter``: always the ``'scatter'`` layout (an integration whose queries are one flat list of tokens)."""
        w, dev = self.window, self.positions.device
        saved = [min(c, w) for c in counts]
        whole = not scatter and list(rows) == list(range(self.rows))
        same = whole and len(set(saved)) == 1 and len({self.next[r] for r in rows}) == 1
        if same and saved and saved[0] == 1:  # a decode step: one entry per row, at the same slot
            slot = self.next[rows[0]]
            last = [s + c - 1 for s, c in zip(seen_before, counts)]
            col = self.positions[:, slot]
            if len(set(last)) == 1:
                col.fill_(last[0])
            else:
                col.copy_(upload(last, dev))
            self.valid[:, slot].fill_(True)  # a view filled in place: no host tensor copied
            return RingWrite("column", _none(dev), _none(dev), [], [], saved, list(rows), slot=slot)
        step_rows, offsets, dest_rows, dest_slots, pos = [], [], [], [], []
        for i, (r, c, m, s) in enumerate(zip(rows, counts, saved, seen_before)):
            for j in range(m):
                step_rows.append(i)
                offsets.append(c - m + j)
                dest_rows.append(r)
                dest_slots.append((self.next[r] + j) % w)
                pos.append(s + c - m + j)
        rt, st = upload(dest_rows, dev), upload(dest_slots, dev)
        self.positions[rt, st] = upload(pos, dev)
        self.valid[rt, st] = self.valid.new_ones(())  # a device scalar: True would be copied from the host (a sync)
        if same:  # every row saves its last m queries at the same entries
            m = saved[0]
            index = st[:m]
            return RingWrite("block", rt, st, step_rows, offsets, saved, list(rows), index=index)
        return RingWrite("scatter", rt, st, step_rows, offsets, saved, list(rows))

    def write(self, layer: int, write: RingWrite, values: torch.Tensor) -> None:
        """Save layer ``layer``'s queries of the step, ``values`` in the layout ``write.kind`` names (see
        :class:`RingWrite`). The layer's queries must be allocated (:meth:`allocate`)."""
        q = self.queries[layer]
        values = values.to(q.dtype)
        if write.kind == "column":
            q[:, :, write.slot : write.slot + 1].copy_(values)
        elif write.kind == "block":
            q.index_copy_(2, write.index.to(q.device), values)
        elif write.rows.numel():
            q[write.rows.to(q.device), :, write.slots.to(q.device)] = values

    def commit(self, write: RingWrite) -> None:
        """After the step: each row's write pointer moves past the queries it saved."""
        for r, m in zip(write.ring_rows, write.saved):
            self.next[r] = (self.next[r] + m) % self.window

    # -------------------------------------------------------------------------------------------------- reads
    def read(self, layer: int, rows: torch.Tensor | None = None):
        """``(queries [r, Hq, W, D], positions [r, W], valid [r, W])`` of ``rows`` (None: every row) in layer
        ``layer``, or three Nones before its first write."""
        q = self.queries[layer]
        if q is None:
            return None, None, None
        pos, valid = self.positions, self.valid
        if pos.device != q.device:  # a layer on another device than the ring's positions (a model split over devices)
            pos, valid = pos.to(q.device), valid.to(q.device)
        if rows is None:
            return q, pos, valid
        rows = rows.to(q.device)
        return q.index_select(0, rows), pos.index_select(0, rows), valid.index_select(0, rows)

    def nbytes(self) -> int:
        """Bytes of the saved queries and their positions."""
        total = sum(q.nbytes for q in self.queries if q is not None)
        return total + (0 if self.positions is None else self.positions.nbytes + self.valid.nbytes)


def _none(device) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long, device=device)

"""The row tables of a set of sequences: what each held slot is, per (layer, row, KV head) (torch only).

An integration stores keys and values its own way (dense buffers, quantized codes, paged blocks); what the eviction
core needs to know about each held slot is kept here, once, for every integration:

* ``positions[l]`` ``[R, H, W]`` int64: the logical position (index among the row's real tokens) of the token slot
  ``s`` of KV head ``h`` of row ``r`` holds in layer ``l``, -1 for a free or dead slot. Heads keep different tokens
  (VaSE decides per KV head: arXiv 2606.03928, Sec. 3), so positions are per head. A row's held slots are packed at
  the front in position order.
* ``state[l]`` ``{name: [R, H, W]}`` float32: the policy's per-slot state (:attr:`vase.Policy.state_names`: H2O's
  accumulated attention ``acc``, the published code's slot ``order``), zero for a new token, moved with its token.
* ``memo[l]`` ``{name: [R]}`` int64: the policy's per-row memo, keyed by the names its scorer declares
  (:attr:`vase.Policy.memo_names`: H2O's ``acc_upto``, the newest query it has accumulated).
* ``row_keys`` (host, one int per row): the random key of each row (:func:`vase.core.rng.row_key` of its seed), so a
  row's sampled choices depend on its seed alone, not on its batch.

``W`` (the width) is the slots an integration addresses per (row, layer, KV head); ``R`` the rows it has room for.
Layers are numbered ``0 .. L-1`` here (the evicting layers, in model order); :attr:`RowTables.layer_ids` gives each
one's index in the model (it keys the random choices). Each layer's tables are allocated on its own device, when the
integration first knows it (:meth:`RowTables.allocate`).
"""

from __future__ import annotations

import torch

from . import rng
from .transfer import upload


class RowTables:
    """Positions, per-slot state and memo of every held slot (see the module docstring).

    Args:
        layer_ids: the model index of each evicting layer, in order.
        state_names: the policy's per-slot state names (:attr:`vase.Policy.state_names`).
        memo_init: the policy's memo names and their initial values (:attr:`vase.Policy.memo_names`).
    """

    def __init__(self, layer_ids: list[int], state_names=(), memo_init: dict[str, int] | None = None):
        self.layer_ids = list(layer_ids)
        self.state_names = tuple(state_names)
        self.memo_init = dict(memo_init or {})
        n = len(self.layer_ids)
        self.positions: list[torch.Tensor | None] = [None] * n
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        self.memo: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        self.row_keys: list[int] = []
        self._keys_on: dict = {}  # device -> row keys as a tensor

    # --------------------------------------------------------------------------------------------- allocation
    def allocate(self, layer: int, rows: int, heads: int, width: int, device) -> None:
        """Tables of ``layer`` for ``rows`` rows, ``heads`` KV heads and ``width`` slots on ``device``, empty."""
        self.positions[layer] = torch.full((rows, heads, width), -1, dtype=torch.long, device=device)
        self.state[layer] = {
            n: torch.zeros((rows, heads, width), dtype=torch.float32, device=device) for n in self.state_names
        }
        self.memo[layer] = {
            n: torch.full((rows,), v, dtype=torch.long, device=device) for n, v in self.memo_init.items()
        }

    def allocated(self, layer: int) -> bool:
        return self.positions[layer] is not None

    def grow(self, layer: int, rows: int | None = None, width: int | None = None) -> None:
        """Larger tables for ``layer`` (more rows, a larger width, or both), the held values copied over: for the
        rows of a growing request pool, or the slots of a policy that never evicts (rare, amortized)."""
        old_pos, old_state, old_memo = self.positions[layer], self.state[layer], self.memo[layer]
        r0, h, w0 = old_pos.shape
        self.allocate(layer, rows or r0, h, width or w0, old_pos.device)
        self.positions[layer][:r0, :, :w0] = old_pos
        for n, t in old_state.items():
            self.state[layer][n][:r0, :, :w0] = t
        for n, t in old_memo.items():
            self.memo[layer][n][:r0] = t

    def width(self, layer: int) -> int:
        return self.positions[layer].shape[2] if self.allocated(layer) else 0

    # ------------------------------------------------------------------------------------------------- rows
    def reserve(self, rows: int) -> None:
        """Room for the random keys of ``rows`` rows (new rows get theirs at admission, :meth:`set_seeds`)."""
        self.row_keys.extend([0] * (rows - len(self.row_keys)))
        self._keys_on = {}

    def set_seeds(self, rows: list[int], seeds: list[int]) -> None:
        """The random key of each of ``rows`` from its seed (:func:`vase.core.rng.row_key`)."""
        self.reserve(max(rows, default=-1) + 1)
        for r, s in zip(rows, seeds):
            self.row_keys[r] = rng.row_key(int(s))
        self._keys_on = {}

    def keys_tensor(self, device, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[R]`` (or ``[len(rows)]``) int64 row keys on ``device``, uploaded once per device and seed change."""
        key = torch.device(device)
        t = self._keys_on.get(key)
        if t is None or t.numel() != len(self.row_keys):
            t = upload(self.row_keys, device)
            self._keys_on[key] = t
        return t if rows is None else t.index_select(0, rows.to(t.device))

    def reset_row(self, row: int) -> None:
        """Empty ``row`` in every allocated layer: no slot held, state zero, memo at its initial values."""
        for layer in range(len(self.layer_ids)):
            if not self.allocated(layer):
                continue
            self.positions[layer][row] = -1
            for t in self.state[layer].values():
                t[row] = 0.0
            for n, t in self.memo[layer].items():
                t[row] = self.memo_init[n]

    # New tokens written in place. A free slot's state is zero already (allocation and compaction clear it), so only
    # positions are written.
    def put_column(self, layer: int, slot: int, positions: int | torch.Tensor) -> None:
        """Slot ``slot`` of every row holds a new token at logical position ``positions`` (an int for every row, or
        ``[R]`` int64), in every KV head."""
        col = self.positions[layer][:, :, slot]
        if isinstance(positions, int):
            col.fill_(positions)
        else:
            col.copy_(positions.view(-1, 1).expand_as(col))

    def put_span(self, layer: int, start: int, positions: torch.Tensor) -> None:
        """Slots ``[start, start + n)`` of every row hold new tokens at logical positions ``positions`` ``[R, n]``
        (every KV head alike); their state starts at zero."""
        n = positions.shape[1]
        span = self.positions[layer][:, :, start : start + n]
        span.copy_(positions.unsqueeze(1).expand_as(span))
        for t in self.state[layer].values():
            t[:, :, start : start + n].zero_()

    def put_positions(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Slot ``slots[i]`` of row ``rows[i]`` holds a new token at logical position ``positions[i]`` in every KV
        head; ``rows``, ``slots``, ``positions``: ``[N]`` int64."""
        self.positions[layer][rows, :, slots] = positions.view(-1, 1)

    # ------------------------------------------------------------------------------------------------- reads
    def held(self, layer: int, rows: torch.Tensor | None, length: int, never_evicted: list[bool] | None = None):
        """``(positions [r, H, length], state {name: [r, H, length]})`` of the first ``length`` slots of ``rows``
        (None: every row), copies.

        ``never_evicted`` (one flag per row): rows compacted never before, whose slot ``i`` holds position ``i`` and
        state zero (nothing has moved yet); their values are made, not read, so a table narrower than a dense prompt
        (an integration that sizes its tables by the steady cap) still serves them.
        """
        pos, state = self.positions[layer], self.state[layer]
        w = pos.shape[2]
        sel = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        n = pos.shape[0] if rows is None else rows.numel()
        h = pos.shape[1]
        out_p = torch.full((n, h, length), -1, dtype=torch.long, device=pos.device)
        out_s = {k: torch.zeros((n, h, length), dtype=torch.float32, device=pos.device) for k in state}
        m = min(w, length)
        out_p[:, :, :m] = sel(pos[:, :, :m])
        for k, t in state.items():
            out_s[k][:, :, :m] = sel(t[:, :, :m])
        if never_evicted is not None and any(never_evicted):
            which = [i for i, f in enumerate(never_evicted) if f]
            fresh = upload(which, pos.device)  # row indices, not a host bool mask: no synchronization
            ident = torch.arange(length, device=pos.device).expand(len(which), h, length)
            out_p.index_copy_(0, fresh, ident.contiguous())
            for t in out_s.values():
                t.index_fill_(0, fresh, 0.0)
        return out_p, out_s

    def memo_of(self, layer: int, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The memo of ``rows`` (None: every row), ``{name: [r]}``."""
        memo = self.memo[layer]
        return dict(memo) if rows is None else {n: m.index_select(0, rows) for n, m in memo.items()}

    # ------------------------------------------------------------------------------------------------ writes
    def set_memo(self, layer: int, rows: torch.Tensor | None, memo: dict[str, torch.Tensor]) -> None:
        """Write back the memo of ``rows`` (None: every row) after an eviction."""
        for n, m in self.memo[layer].items():
            if rows is None:
                m.copy_(memo[n])
            else:
                m.index_copy_(0, rows, memo[n])

    def write_kept(
        self,
        layer: int,
        rows: torch.Tensor | None,
        positions: torch.Tensor,
        state: dict[str, torch.Tensor],
    ) -> None:
        """After a compaction or a packed write: ``rows`` (None: every row) now hold ``positions`` ``[r, H, K]``
        (-1 past each head's count) and ``state`` in slots ``[0, K)``; their slots past ``K`` are freed.

        The values come from :func:`vase.core.evict.gather_kept` (kept slots, packed, in position order)."""
        k = positions.shape[2]
        pos = self.positions[layer]
        if rows is None:
            pos[:, :, :k].copy_(positions)
            pos[:, :, k:].fill_(-1)
            for n, s in state.items():
                self.state[layer][n][:, :, :k].copy_(s)
                self.state[layer][n][:, :, k:].zero_()
            return
        # fill values as 0-d device tensors: a Python scalar stored through an index tensor is copied from the host,
        # which synchronizes with a GPU
        pos[rows, :, :k] = positions
        pos[rows, :, k:] = pos.new_full((), -1)
        for n, s in state.items():
            self.state[layer][n][rows, :, :k] = s
            self.state[layer][n][rows, :, k:] = s.new_zeros(())

    def nbytes(self) -> int:
        """Bytes of the allocated tables (positions, state, memo)."""
        total = 0
        for layer in range(len(self.layer_ids)):
            if self.allocated(layer):
                total += self.positions[layer].nbytes
                total += sum(t.nbytes for t in self.state[layer].values())
                total += sum(t.nbytes for t in self.memo[layer].values())
        return total

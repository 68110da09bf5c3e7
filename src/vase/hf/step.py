"""One forward pass through an :class:`~vase.EvictingCache`: :class:`ForwardStep`, planned once, run by every layer.

The sequence model's decision for the step (:class:`vase.core.schedule.StepSchedule`: fills, who evicts, where the
saved queries go) plus what transformers' padded layout adds: ``q`` columns per row, some of them padding (a ragged
prefill or chat continuation), a decode token written in place or several tokens staged, and the small device
tensors derived from them (new positions, slot validity, the attention mask over physical slots), each uploaded once
per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..core.masks import mask_in_kind
from ..core.ring import RingWrite
from ..core.schedule import StepSchedule
from ..core.transfer import upload


@dataclass
class ForwardStep:
    """The plan of one forward pass, computed at its first evicting layer and executed by every evicting layer.

    Attributes:
        schedule: the sequence model's step (rows ``0 .. B-1`` in batch order).
        q: columns per row (new tokens, padding included).
        append: one token per row, written in place (a decode step); else staged: attended over the held entries
            and the new ones together, then written packed.
        new_valid: ``[B, q]`` bool, which columns are real tokens (None: all).
        uniform: every row has the same fill and no padding (no mask needed for a decode step).
        seen_before: the cache's logical length before the step (padding columns included).
        capacity: slots allocated per row after the step.
        ring: where the step's saved queries go (None: the policy saves none).
        on_done: called once the last evicting layer is done (the cache commits the step).
    """

    schedule: StepSchedule
    q: int
    append: bool
    new_valid: torch.Tensor | None
    uniform: bool
    seen_before: int
    device: torch.device
    capacity: int
    ring: RingWrite | None = None
    on_done: Callable[[ForwardStep], None] | None = None
    layers: int = 1
    layers_done: int = 0
    _memo: dict = field(default_factory=dict)

    # the schedule's lists, under the names the layers read
    @property
    def fill_before(self) -> list[int]:
        return self.schedule.fill_before

    @property
    def counts(self) -> list[int]:
        """Real new tokens per row."""
        return self.schedule.counts

    @property
    def keep(self) -> list[int]:
        """Filled slots per row after this step."""
        return self.schedule.keep

    @property
    def evict_rows(self) -> list[int]:
        return self.schedule.evict

    @property
    def real_before(self) -> list[int]:
        """Real tokens each row had seen: the logical position of its next token."""
        return self.schedule.seen_before

    @property
    def qlimit(self) -> list[int] | None:
        """``kv_bits``: logical slots below which each row's entries are quantized after the step."""
        return self.schedule.qlimit

    @property
    def flush_rows(self) -> list[int]:
        """``kv_bits``: rows quantizing their recent tokens without evicting."""
        return self.schedule.flush

    @property
    def p_old(self) -> int:
        return max(self.fill_before) if self.fill_before else 0

    def layer_done(self) -> None:
        """Called by each evicting layer after its attention; the last one commits the step."""
        self.layers_done += 1
        if self.layers_done == self.layers and self.on_done is not None:
            self.on_done(self)

    def tensor(self, name, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the step's device, uploaded once per step under ``name``."""
        if name not in self._memo:
            self._memo[name] = upload(values, self.device)
        return self._memo[name]

    def rows_tensor(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as an int64 tensor on the step's device (once per step and row set)."""
        return self.tensor(("rows", tuple(rows)), rows)

    def new_positions(self) -> torch.Tensor:
        """``[B, q]`` int64 logical position of each new token in its row (padding repeats its neighbour's)."""
        if "new_positions" not in self._memo:
            base = self.tensor("real_before", self.real_before).view(-1, 1)
            if self.new_valid is None:
                offs = torch.arange(self.q, device=self.device).view(1, -1)
            else:
                offs = (self.new_valid.long().cumsum(-1) - 1).clamp_min(0)
            self._memo["new_positions"] = base + offs
        return self._memo["new_positions"]

    def latest_positions(self) -> torch.Tensor:
        """``[B]`` logical position of each row's newest token after this step."""
        return self.tensor("latest", self.schedule.latest)

    def ring_values(self, query: torch.Tensor) -> torch.Tensor:
        """The step's saved queries out of ``query`` ``[B, q_heads, q, D]``, in the layout of :attr:`ring`."""
        ring = self.ring
        if ring.kind == "column":
            return query[:, :, -1:]
        if ring.kind == "block":
            return query[:, :, -ring.index.numel() :]
        if "ring_src" not in self._memo:
            rows = upload(ring.step_rows, self.device)
            offsets = upload(ring.offsets, self.device)
            if self.new_valid is None:  # no padding: a row's k-th new token is column k
                cols = offsets
            else:  # the column of each row's k-th real token: where the running count of real tokens reaches k + 1
                valid = self.new_valid.index_select(0, rows)
                rank = valid.long().cumsum(-1) - 1
                cols = ((rank == offsets.view(-1, 1)) & valid).long().argmax(-1)  # argmax: no nonzero(), no sync
            self._memo["ring_src"] = (rows, cols)
        rows, cols = self._memo["ring_src"]
        return query[rows, :, cols]

    def kv_valid(self) -> torch.Tensor | None:
        """``[B, kv_len]`` bool validity of the key/value slots the attention kernel sees this step."""
        if "kv_valid" not in self._memo:
            fill = self.tensor("fill_before", self.fill_before)
            if self.append:
                p = self.p_old + 1
                valid = torch.arange(p, device=self.device).view(1, p) <= fill.view(-1, 1)
            else:
                old = torch.arange(self.p_old, device=self.device).view(1, -1) < fill.view(-1, 1)
                new = self.new_valid
                if new is None:
                    new = torch.ones((len(self.fill_before), self.q), dtype=torch.bool, device=self.device)
                valid = torch.cat([old, new], dim=1)
            self._memo["kv_valid"] = valid
        return self._memo["kv_valid"]

    def mask(self, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The attention mask over physical slots, in the form the base attention function expects.

        ``kind`` 'bool': ``[B, 1, q, kv_len]`` (sdpa); 'additive': same shape, 0 / dtype-min (eager);
        'padding': ``[B, kv_len]`` int (flash-attention). None when no mask is needed.
        """
        if self.uniform and (self.append or kind == "padding" or (self.p_old == 0 and kind == "bool")):
            # No mask needed: one new token sees every slot; flash-attention aligns causality bottom-right; sdpa's
            # is_causal is right when there is no past. Eager has no causal flag: it gets a mask for several tokens.
            return None
        key = (kind, dtype)
        if key in self._memo:
            return self._memo[key]
        valid = self.kv_valid()
        if kind == "padding":
            out = valid.to(torch.int32)
        else:
            if self.append:
                m = valid[:, None, None, :]
            else:
                p, q = self.p_old, self.q
                i = torch.arange(q, device=self.device).view(q, 1)
                j = torch.arange(p + q, device=self.device).view(1, p + q)
                causal = (j < p) | (j - p <= i)
                m = valid[:, None, None, :] & causal
                m = m | (j - p == i)  # a padding query attends to itself only, so no row is empty (no NaN)
            out = mask_in_kind(m, kind, dtype)
        self._memo[key] = out
        return out


def expand_rows(idx: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``[B, n]`` indices along the token axis as ``[B, heads, n, dim]``, to gather from ``[B, heads, T, dim]``."""
    return idx.view(idx.shape[0], 1, idx.shape[1], 1).expand(idx.shape[0], heads, idx.shape[1], dim)

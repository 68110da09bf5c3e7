"""The plan of one forward pass through an :class:`~vase.EvictingCache`: computed once at its first evicting layer
and executed by every evicting layer (they all see the same tokens on the same schedule).

Host-side bookkeeping (fills, counts, rows that evict) plus the small device tensors derived from it (new positions,
slot validity, the attention mask over physical slots), each uploaded once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core.masks import mask_in_kind


def upload(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor from host values, without a host-device synchronization (pinned, non-blocking)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class StepPlan:
    """The plan of one forward pass, computed once and executed by every layer."""

    q: int
    append: bool  # one token per row written in place; else staged (attend over old + new, then write packed)
    fill_before: list[int]
    counts: list[int]  # real new tokens per row
    keep: list[int]  # filled slots per row after this step
    evict_rows: list[int]
    seen_before: int
    real_before: list[int]  # real tokens each row had seen: the logical position of its next token
    new_valid: torch.Tensor | None  # [B, q] bool, None = all real
    uniform: bool  # all rows have the same fill and no padding: no mask needed
    device: torch.device
    capacity: int
    layers_done: int = 0
    qlimit: list[int] | None = None  # kv_bits: logical slots below which each row's entries are quantized after it
    flush_rows: list[int] = field(default_factory=list)  # kv_bits: rows quantizing their recent tokens, no eviction
    _memo: dict = field(default_factory=dict)

    @property
    def p_old(self) -> int:
        return max(self.fill_before) if self.fill_before else 0

    def tensor(self, name, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the step's device, uploaded once per step under ``name``."""
        if name not in self._memo:
            self._memo[name] = upload(values, self.device)
        return self._memo[name]

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
        return self.tensor("latest", [r + c - 1 for r, c in zip(self.real_before, self.counts)])

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

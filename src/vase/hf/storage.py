"""Where an evicting layer's keys and values live: :class:`DenseStorage`, buffers in the model's dtype.

A storage is the strategy an :class:`~vase.hf.layer.EvictingLayer` holds for its entries (the other one is
:class:`vase.hf.quantized.QuantizedStorage`, ``kv_bits``). Keys and values live in buffers ``[B, H, capacity, D]``
allocated once, in the model's dtype and on its device; they never move or grow while generating (VaSE, arXiv
2606.03928, Sec. 3.3). A row's real tokens are packed at the front of its slots in position order. Every storage
offers the same operations, in the order a forward pass calls them:

* :meth:`~DenseStorage.before`: before the layer's entries are read (a quantized store dequantizes here);
* :meth:`~DenseStorage.append` (a decode token in place at each row's fill) or :meth:`~DenseStorage.staged` (the held
  entries followed by several new ones): what attention reads;
* :meth:`~DenseStorage.rows` (the held entries of the rows that evict), :meth:`~DenseStorage.put_front` (the kept
  entries into slots ``[0, K)``): a compaction, or the packed write of a multi-token step;
* :meth:`~DenseStorage.after`: after the layer's write or compaction (a quantized store stores what changed).
"""

from __future__ import annotations

import torch

from .step import ForwardStep


class DenseStorage:
    """Keys and values ``[B, H, capacity, D]`` in the model's dtype (see the module docstring)."""

    quantized = False

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def allocate(self, batch: int, heads: int, capacity: int, head_dim: int, v_dim: int, dtype, device) -> None:
        self.keys = torch.zeros((batch, heads, capacity, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros((batch, heads, capacity, v_dim), dtype=dtype, device=device)

    def grow(self, capacity: int, step: ForwardStep | None = None) -> None:
        """Only for a policy that never evicts (``full``): larger buffers, the entries where they were."""
        old_k, old_v = self.keys, self.values
        b, h, n, d = old_k.shape
        self.allocate(b, h, capacity, d, old_v.shape[-1], old_k.dtype, old_k.device)
        self.keys[:, :, :n] = old_k
        self.values[:, :, :n] = old_v

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def before(self, step: ForwardStep) -> None:
        """Nothing: the buffers hold the entries."""

    def after(self, step: ForwardStep) -> None:
        """Nothing: the writes went to the buffers."""

    def append(self, step: ForwardStep, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one new token per row ``[B, H, 1, D]`` at each row's fill; returns views ``[B, H, P, D]`` of the
        buffers (``P`` = largest fill + 1)."""
        p = step.p_old + 1
        if step.uniform:
            f = step.fill_before[0]
            self.keys[:, :, f : f + 1].copy_(k)
            self.values[:, :, f : f + 1].copy_(v)
        else:
            b, h = k.shape[:2]
            slot = step.tensor("fill_before", step.fill_before).view(b, 1, 1, 1)
            self.keys.scatter_(2, slot.expand(b, h, 1, k.shape[-1]), k)
            self.values.scatter_(2, slot.expand(b, h, 1, v.shape[-1]), v)
        return self.keys[:, :, :p], self.values[:, :, :p]

    def staged(self, step: ForwardStep, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The held entries (slots ``[0, P)``, ``P`` = largest fill) followed by the step's new ones ``[B, H, q,
        D]``: what attention reads in a multi-token step (written packed after it, :meth:`put_front`)."""
        p = step.p_old
        if p == 0:
            return k, v
        return torch.cat([self.keys[:, :, :p], k], dim=2), torch.cat([self.values[:, :, :p], v], dim=2)

    def rows(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held entries of ``rows`` (None: the buffers themselves; else copies), ``[r, H, capacity, D]``."""
        if rows is None:
            return self.keys, self.values
        return self.keys.index_select(0, rows), self.values.index_select(0, rows)

    def put_front(self, step, rows: list[int] | None, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``, ``v`` ``[r, H, K, D]`` (gathered at ``idx`` ``[r, H, K]`` from what attention read) into slots
        ``[0, K)`` of ``rows`` (None: every row), in place: addresses never change."""
        kmax = k.shape[2]
        if rows is None:
            self.keys[:, :, :kmax].copy_(k)
            self.values[:, :, :kmax].copy_(v)
        else:
            rt = step.rows_tensor(rows)
            self.keys[rt, :, :kmax] = k
            self.values[rt, :, :kmax] = v

    def put_span(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The fast path of a multi-token step into an empty cache: ``k``, ``v`` ``[B, H, n, D]`` at slots
        ``[start, start + n)`` of every row."""
        n = k.shape[2]
        self.keys[:, :, start : start + n].copy_(k)
        self.values[:, :, start : start + n].copy_(v)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads, ``[B, H, capacity, D]`` (the buffers themselves)."""
        return self.keys, self.values

    def nbytes(self) -> int:
        """Bytes of the buffers."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def entry_bytes(self) -> int:
        """Bytes of one token's key and value in one KV head."""
        return (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()

    def live_bytes(self, positions: torch.Tensor) -> int:
        """Bytes of the entries holding a token now (``positions`` ``[B, H, capacity]``, -1 where free)."""
        return int((positions >= 0).sum()) * self.entry_bytes()

    def reset(self) -> None:
        self.keys = self.values = None

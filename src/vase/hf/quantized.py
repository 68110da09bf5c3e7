"""Quantized storage of an evicting layer (policy option ``kv_bits``): packed integers and scales, allocated once.

What each evicting layer holds with ``kv_bits`` (see :mod:`vase.core.quant` for the quantization itself), per (row,
KV head):

* **quantized store**, ``L = capacity - buffer`` logical slots (the budget after a compaction): key and value codes
  ``[B, H, L, D * bits / 8]`` uint8 with their float16 steps and minima ``[B, H, L, D / group]``, and the key
  channel factors ``[B, H, D]`` float32. Slot ``i`` of the store is logical slot ``i`` of the layer (the slot order of
  :class:`~vase.hf.layer.EvictingLayer`, position order), so the entries the guard keeps in full precision leave
  their quantized slot unused;
* **full-precision store** ``[B, H, P + buffer, D]`` (model dtype): ``P`` entries kept in full precision by the value
  guard (``protect_precision='guard'``; their logical slots in ``protected``), then the row's recent tokens, those
  written since its last quantization (KIVI's full-precision residual, arXiv 2402.02750, Sec. 3.2).

Each row quantizes at every compaction (what it keeps, less the guard's full-precision entries) and, in between, each
time ``buffer`` new tokens have arrived since its last quantization (before its first eviction, and always for the
``full`` policy), up to ``L`` slots: a row's entries below its ``qlimit`` (host-side, per row, shared by the layers)
are quantized. An entry is quantized once, from its full-precision value; at later compactions its codes and scales
move with it unchanged (no re-quantization, so no error accumulates). An entry the guard keeps in full precision after
it was quantized keeps its dequantized value.

**Attention reads a workspace.** sdpa and eager attention take keys and values in the model's dtype, so before each
layer's forward the layer dequantizes its entries into a workspace ``[B, H, capacity, D]`` shared by all the layers
of the cache (layers run one after another): ``self.keys`` / ``self.values`` are views of it, and every step of
:class:`~vase.hf.layer.EvictingLayer` (the in-place write of a new token, the compaction through the eviction core,
the staged writes) runs on it unchanged; afterwards the layer stores back what changed (:meth:`QuantizedLayer._stored`).
The workspace is one layer's worth of full-precision entries (``CacheStats.bytes_workspace``), and dequantizing every
step costs time (``CacheStats.dequant_seconds``); a fused GPU kernel would dequantize the codes inside the attention
kernel, tile by tile, and need neither. Compiled decoding is refused with ``kv_bits``.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from ..core import quant
from .layer import EvictingLayer

_STORES = ("kq", "ks", "kz", "vq", "vs", "vz", "kf", "fp_k", "fp_v")


class QuantizedCacheMixin:
    """The cache-level part of ``kv_bits`` in an :class:`~vase.EvictingCache`: each row's quantization limit (host
    side), when rows quantize, the shared dequantization workspace, and the time spent dequantizing."""

    @property
    def quantized(self) -> bool:
        """Whether kept entries are stored quantized (policy option ``kv_bits``)."""
        return self.kv_bits is not None

    def _plan_quantization(self, keep: list[int], evict_rows: list[int], append: bool):
        """Each row's quantization limit after the step being planned, and the rows that quantize their recent tokens
        without evicting (a decode step). Rows that evict quantize what they keep (``slots``); a row whose recent tokens
        reach ``buffer`` quantizes them (whole multiples of ``buffer`` after a multi-token step), up to ``L``."""
        if len(self._qlimit) != len(keep):
            self._qlimit = [0] * len(keep)
        limits = self._quantization_limits()
        evicting = set(evict_rows)
        out, flush = [], []
        for i, (n, q, lim) in enumerate(zip(keep, self._qlimit, limits)):
            if i in evicting:
                new = min(self.slots, lim)
            elif n - q >= self.buffer and q < lim:
                new = min(q + (n - q) // self.buffer * self.buffer, lim)
                if append:
                    flush.append(i)
            else:
                new = q
            out.append(new)
        return out, flush

    def _quantization_limits(self) -> list[int]:
        """The most logical slots each row may hold quantized: for an evicting policy, its eviction limit less the
        buffer (its own, so that a row of a ragged batch quantizes as it would alone); for ``full``, every slot."""
        if not self.policy.evicts:
            return [self.capacity] * len(self._fill or self._qlimit)
        return [lim - self.buffer for lim in self._limits()]

    def _quantization_room(self) -> list[int]:
        """Tokens each row can take before its next eviction or quantization (see :meth:`room`)."""
        limits = self._limits() if self.policy.evicts else None
        out = []
        qs = self._qlimit or [0] * len(self._fill)
        for i, (f, q, lim) in enumerate(zip(self._fill, qs, self._quantization_limits())):
            nxt = q + self.buffer - f
            if limits is not None:
                nxt = min(limits[i] - f, nxt) if q < lim else limits[i] - f
            out.append(nxt)
        return out

    def _workspace_for(self, shape: tuple, v_dim: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        """The shared dequantization workspace ``(keys [B, H, capacity, D], values [B, H, capacity, Dv])``, allocated
        once (again only when the ``full`` policy's buffers grow)."""
        ws = self._workspace
        if ws is None or ws[0].shape[2] < shape[2] or ws[0].shape[:2] != shape[:2]:
            b, h, cap, d = shape
            ws = (
                torch.zeros((b, h, cap, d), dtype=dtype, device=device),
                torch.zeros((b, h, cap, v_dim), dtype=dtype, device=device),
            )
            self._workspace = ws
        return ws

    def workspace_bytes(self) -> int:
        """Bytes of the dequantization workspace (0 without ``kv_bits`` or before the first forward)."""
        return 0 if self._workspace is None else sum(t.nbytes for t in self._workspace)


class QuantizedLayer(EvictingLayer):
    """An :class:`~vase.hf.layer.EvictingLayer` whose kept entries are stored in ``kv_bits``-bit integers (see the
    module docstring). Created by the cache for ``kv_bits`` policies; not meant to be built directly.

    Tensors (allocated at the first update, never reallocated, except by the growing ``full`` policy):
        kq, vq: ``[B, H, L, D * bits / 8]`` uint8 packed key / value codes of logical slots ``[0, L)``.
        ks, kz, vs, vz: ``[B, H, L, D / group]`` float16 steps and minima.
        kf: ``[B, H, D]`` float32 key channel factors (1 until the row's first quantization).
        fp_k, fp_v: ``[B, H, P + buffer, D]`` model dtype: the guard's full-precision entries, then the recent ones.
        qmask: ``[B, H, L]`` bool, logical slots stored quantized.
        protected: ``[B, H, P]`` int64 logical slot of each full-precision entry of the guard (unused: the row's
            quantization limit).
        positions, state, row_memo, ring: as :class:`~vase.hf.layer.EvictingLayer`.
    """

    def __init__(self, cache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self._moved = None
        self._factor_set: list[bool] = []
        for name in _STORES:
            setattr(self, name, None)

    # ----------------------------------------------------------------------------------------------- allocation
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        group = self.cache.kv_group
        if key_states.shape[-1] % group or value_states.shape[-1] % group:
            raise ValueError(
                f"kv_group {group} does not divide the head dim ({key_states.shape[-1]}): use kv_group "
                f"{min(group, key_states.shape[-1] & -key_states.shape[-1])} or another power of two dividing it"
            )
        super().lazy_initialization(key_states, value_states)

    def _sizes(self, capacity: int) -> tuple[int, int]:
        """``(L, P)``: quantized slots and guard full-precision slots for ``capacity`` logical slots."""
        c = self.cache
        lim = capacity - c.buffer if c.policy.evicts else capacity
        if c.protect_precision != "guard":
            return lim, 0
        share_of = c.layer_budgets[self.layer_idx] if c.policy.evicts else lim
        return lim, min(quant.protected_slots(c.policy.guard, share_of, c.sinks), lim)

    def _allocate(self, capacity: int, dtype: torch.dtype, v_dim: int) -> None:
        c = self.cache
        b, h, dev, d = self.batch_size, self.num_heads, self.device, self.head_dim
        bits, group = c.kv_bits, c.kv_group
        lim, p = self._sizes(capacity)
        self.kq = torch.zeros((b, h, lim, d * bits // 8), dtype=torch.uint8, device=dev)
        self.vq = torch.zeros((b, h, lim, v_dim * bits // 8), dtype=torch.uint8, device=dev)
        self.ks, self.kz = (torch.zeros((b, h, lim, d // group), dtype=quant.SCALE_DTYPE, device=dev) for _ in "sz")
        self.vs, self.vz = (torch.zeros((b, h, lim, v_dim // group), dtype=quant.SCALE_DTYPE, device=dev) for _ in "sz")
        self.kf = torch.ones((b, h, d), dtype=torch.float32, device=dev)
        self.fp_k = torch.zeros((b, h, p + c.buffer, d), dtype=dtype, device=dev)
        self.fp_v = torch.zeros((b, h, p + c.buffer, v_dim), dtype=dtype, device=dev)
        self.qmask = torch.zeros((b, h, lim), dtype=torch.bool, device=dev)
        self.protected = torch.zeros((b, h, p), dtype=torch.long, device=dev)
        self.positions = torch.full((b, h, capacity), -1, dtype=torch.long, device=dev)
        self.state = {n: torch.zeros((b, h, capacity), dtype=torch.float32, device=dev) for n in c.policy.state_names}
        self.row_memo = {"acc_upto": torch.full((b,), -1, dtype=torch.long, device=dev)}
        self._factor_set = [False] * b
        self._bind(capacity, dtype, v_dim)

    def _bind(self, capacity: int, dtype: torch.dtype, v_dim: int) -> None:
        """Point ``keys`` / ``values`` at ``capacity`` slots of the cache's shared workspace."""
        ws = self.cache._workspace_for(
            (self.batch_size, self.num_heads, capacity, self.head_dim), v_dim, dtype, self.device
        )
        self.keys, self.values = ws[0][:, :, :capacity], ws[1][:, :, :capacity]

    def _grow(self, capacity: int) -> None:
        """Only for the ``full`` policy: larger stores, the entries kept where they are (the recent full-precision
        ones move behind the larger guard region)."""
        old = {n: getattr(self, n) for n in (*_STORES, "qmask", "protected", "positions")}
        state, factor = self.state, self._factor_set
        p_old = old["protected"].shape[2]
        self._allocate(capacity, old["fp_k"].dtype, old["fp_v"].shape[-1])
        for n in ("kq", "ks", "kz", "vq", "vs", "vz", "qmask", "positions"):
            getattr(self, n)[:, :, : old[n].shape[2]] = old[n]
        self.kf.copy_(old["kf"])
        self._factor_set = factor
        p_new = self.protected.shape[2]
        for n in ("fp_k", "fp_v"):
            new = getattr(self, n)
            new[:, :, :p_old] = old[n][:, :, :p_old]
            new[:, :, p_new:] = old[n][:, :, p_old:]
        q = torch.tensor(self.cache._qlimit, dtype=torch.long, device=self.device).view(-1, 1, 1)
        self.protected[:] = q
        self.protected[:, :, :p_old] = old["protected"]
        for k, v in state.items():
            self.state[k][:, :, : v.shape[2]] = v

    @property
    def capacity(self) -> int:
        return self.positions.shape[2] if self.is_initialized else 0

    def storage_bytes(self) -> int:
        """Bytes this layer stores: packed codes, float16 steps and minima, key channel factors, the full-precision
        store (the guard's entries and the recent tokens). The workspace is the cache's (``bytes_workspace``)."""
        return sum(getattr(self, n).nbytes for n in _STORES if getattr(self, n) is not None)

    def live_bytes(self) -> int:
        """Bytes of the entries holding a token now: quantized ones at their codes and scales, the others at full
        precision."""
        if not self.is_initialized:
            return 0
        b, h, lim = self.qmask.shape
        per_q = sum(getattr(self, n).nbytes for n in ("kq", "ks", "kz", "vq", "vs", "vz")) // max(b * h * lim, 1)
        per_fp = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        n_q = int(self.qmask.sum())
        return n_q * per_q + (int((self.positions >= 0).sum()) - n_q) * per_fp

    # ------------------------------------------------------------------------------------------ dequantization
    def _ready(self, step) -> None:
        """Dequantize this layer's entries into the workspace (slots ``[0, fill)`` of each row)."""
        c = self.cache
        self._bind(self.capacity, self.fp_k.dtype, self.fp_v.shape[-1])
        if not c._fill or max(c._fill) == 0:
            return
        t0 = time.perf_counter()
        with record_function("vase.dequantize"):
            self._dequantize_into(self.keys, self.values)
        c._dequant_seconds += time.perf_counter() - t0

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values as attention sees them, ``[B, H, capacity, D]`` (new tensors, model dtype;
        slots past a row's fill hold no token): for tests and inspection (``self.keys`` is the shared workspace)."""
        keys = torch.zeros_like(self.keys)
        values = torch.zeros_like(self.values)
        if self.cache._fill and max(self.cache._fill):
            self._dequantize_into(keys, values)
        return keys, values

    def _dequantize_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        c = self.cache
        qmax = min(max(c._qlimit), self.kq.shape[2])
        if qmax:
            bits = c.kv_bits
            k = quant.dequantize(self.kq[:, :, :qmax], self.ks[:, :, :qmax], self.kz[:, :, :qmax], bits)
            keys[:, :, :qmax] = k * self.kf.unsqueeze(2)
            values[:, :, :qmax] = quant.dequantize(
                self.vq[:, :, :qmax], self.vs[:, :, :qmax], self.vz[:, :, :qmax], bits
            )
        p = self.protected.shape[2]
        if p:
            idx = self.protected.unsqueeze(-1)
            keys.scatter_(2, idx.expand(-1, -1, -1, keys.shape[-1]), self.fp_k[:, :, :p])
            values.scatter_(2, idx.expand(-1, -1, -1, values.shape[-1]), self.fp_v[:, :, :p])
        self._copy_recent(c._qlimit, c._fill, to_workspace=True, out=(keys, values))

    def _copy_recent(self, qlimit: list[int], fills: list[int], to_workspace: bool, rows=None, out=None) -> None:
        """Move each row's recent tokens (logical slots ``[qlimit, fill)``) between the full-precision store (from
        slot ``P``) and the workspace (or ``out``, a pair of tensors shaped like it)."""
        p = self.protected.shape[2]
        ws_k, ws_v = out if out is not None else (self.keys, self.values)
        rows = range(len(fills)) if rows is None else rows
        spans = [(r, qlimit[r], fills[r] - qlimit[r]) for r in rows if fills[r] > qlimit[r]]
        if not spans:
            return
        if len(spans) == len(fills) and len({(q, n) for _, q, n in spans}) == 1:
            _, q, n = spans[0]
            pairs = [(slice(None), q, n)]
        else:
            pairs = spans
        for r, q, n in pairs:
            for ws, fp in ((ws_k, self.fp_k), (ws_v, self.fp_v)):
                if to_workspace:
                    ws[r, ..., q : q + n, :] = fp[r, ..., p : p + n, :]
                else:
                    fp[r, ..., p : p + n, :] = ws[r, ..., q : q + n, :]

    # ---------------------------------------------------------------------------------------------- storage
    def _write(self, step, rows, idx: torch.Tensor, keep, keys, values, positions, state) -> None:
        """The base write into the workspace; remembers where each kept entry came from (:meth:`_stored`)."""
        super()._write(step, rows, idx, keep, keys, values, positions, state)
        self._moved = (rows, idx, self.capacity if step.append else step.p_old)

    def _stored(self, step) -> None:
        """Store what this forward pass changed: the new token of each row in the full-precision store, and, for the
        rows that evicted, quantized their recent tokens or took several tokens, their whole layout again."""
        c = self.cache
        moved, self._moved = self._moved, None
        b = self.positions.shape[0]
        if step.append:
            whole = set(step.evict_rows) | set(step.flush_rows)
            others = [i for i in range(b) if i not in whole]
            if others:
                self._copy_recent(c._qlimit, step.keep, to_workspace=False, rows=others)
            rows = sorted(whole)
        else:
            rows = list(range(b))
        if rows:
            t0 = time.perf_counter()
            with record_function("vase.quantize"):
                self._store_rows(step, rows, moved)
            c._quant_seconds += time.perf_counter() - t0

    def _move(self, step, rows: list[int], moved) -> torch.Tensor:
        """Move the quantized entries of the rows a write gathered (a compaction, a multi-token step) to their new
        logical slots, codes and scales unchanged; returns ``[r, H, L]`` bool: which logical slots of ``rows`` now hold
        the codes of an entry quantized before."""
        h, lim = self.num_heads, self.qmask.shape[2]
        rt = torch.tensor(rows, dtype=torch.long, device=self.device)
        from_q = self.qmask.index_select(0, rt)
        if moved is None:
            if not step.append:  # the fast path of an empty cache: every entry is new
                from_q.zero_()
            return from_q
        w_rows, idx, n_old = moved
        at = {row: k for k, row in enumerate(range(self.positions.shape[0]) if w_rows is None else w_rows)}
        sel = [k for k, row in enumerate(rows) if row in at]
        if not sel:
            return from_q
        st = torch.tensor(sel, dtype=torch.long, device=self.device)
        src_rows = torch.tensor([rows[k] for k in sel], dtype=torch.long, device=self.device)
        ix = idx.index_select(0, torch.tensor([at[rows[k]] for k in sel], dtype=torch.long, device=self.device))
        w = min(ix.shape[2], lim)
        ix = ix[:, :, :w]
        was_q = torch.zeros((len(sel), h, max(self.capacity + step.q, lim)), dtype=torch.bool, device=self.device)
        n = min(n_old, lim)
        was_q[:, :, :n] = from_q.index_select(0, st)[:, :, :n]
        moved_q = torch.zeros((len(sel), h, lim), dtype=torch.bool, device=self.device)
        moved_q[:, :, :w] = was_q.gather(2, ix)
        from_q.index_copy_(0, st, moved_q)
        src = ix.clamp(max=lim - 1).unsqueeze(-1)
        for name in ("kq", "ks", "kz", "vq", "vs", "vz"):
            t = getattr(self, name)
            held = t.index_select(0, src_rows)
            held[:, :, :w] = held.gather(2, src.expand(-1, -1, -1, t.shape[-1]))
            t.index_copy_(0, src_rows, held)
        return from_q

    def _store_rows(self, step, rows: list[int], moved) -> None:
        """Store ``rows`` from the workspace after a compaction, a quantization of recent tokens or a multi-token
        step: entries below the row's new limit are quantized (those quantized before keep their codes, moved with
        them), the guard's largest stay in full precision, the recent ones go to the full-precision store."""
        c = self.cache
        lim, p, h = self.qmask.shape[2], self.protected.shape[2], self.num_heads
        q_new = [step.qlimit[i] for i in rows]
        from_q = self._move(step, rows, moved)
        rt = torch.tensor(rows, dtype=torch.long, device=self.device)
        whole = len(rows) == self.positions.shape[0]
        keys, values = (self.keys, self.values) if whole else (self.keys[rt], self.values[rt])
        qn = torch.tensor(q_new, dtype=torch.long, device=self.device)
        slot = torch.arange(lim, device=self.device).view(1, 1, lim)
        eligible = (slot < qn.view(-1, 1, 1)).expand(len(rows), h, lim)
        new_rows = [k for k, row in enumerate(rows) if not self._factor_set[row] and q_new[k] > 0]
        if new_rows:  # the row's first quantization fixes its key channel factors
            nt = torch.tensor(new_rows, dtype=torch.long, device=self.device)
            factors = quant.channel_scale(keys[:, :, :lim].index_select(0, nt), eligible.index_select(0, nt))
            self.kf.index_copy_(0, rt.index_select(0, nt), factors)
            for k in new_rows:
                self._factor_set[rows[k]] = True
        prot = torch.zeros_like(eligible)
        if p:
            count = [min(p, quant.protected_slots(c.policy.guard, q, c.sinks)) for q in q_new]
            prot = quant.precision_mask(
                c.policy.guard, values[:, :, :lim], eligible, torch.tensor(count, device=self.device)
            )
        isq = eligible & ~prot
        need = isq & ~from_q  # entries quantized now, from their full-precision values
        width = int(need.sum(-1).max()) if need.numel() else 0
        if width:
            order = torch.argsort((~need).to(torch.int8), dim=-1, stable=True)[:, :, :width]  # [r, H, width]
            ok = torch.arange(width, device=self.device).view(1, 1, width) < need.sum(-1, keepdim=True)
            at = (rt.view(-1, 1, 1), torch.arange(h, device=self.device).view(1, -1, 1), order)
            kf = self.kf.index_select(0, rt).unsqueeze(2)
            for ws, stores, factor in ((keys, ("kq", "ks", "kz"), kf), (values, ("vq", "vs", "vz"), None)):
                x = ws.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, ws.shape[-1])).float()
                fresh = quant.quantize(x / factor if factor is not None else x, c.kv_bits, c.kv_group)
                for name, t in zip(stores, fresh):
                    held = getattr(self, name)
                    held[at] = torch.where(ok.unsqueeze(-1), t, held[at])
        self.qmask[rt] = isq
        if p:
            first = torch.where(prot, slot, slot + lim).sort(-1).values[:, :, :p]
            idx = torch.where(first < lim, first, qn.view(-1, 1, 1).expand_as(first))
            self.protected[rt] = idx
            for ws, fp in ((keys, self.fp_k), (values, self.fp_v)):
                fp[rt, :, :p] = ws.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, ws.shape[-1]))
        full_q = list(c._qlimit) if c._qlimit else [0] * self.positions.shape[0]
        full_f = list(c._fill) if c._fill else [0] * self.positions.shape[0]
        for k, row in enumerate(rows):
            full_q[row], full_f[row] = q_new[k], step.keep[row]
        self._copy_recent(full_q, full_f, to_workspace=False, rows=rows)

    def reset(self) -> None:
        super().reset()
        for name in (*_STORES, "qmask", "protected"):
            setattr(self, name, None)
        self._factor_set = []
        self._moved = None

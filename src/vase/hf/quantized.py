"""Quantized storage of an evicting layer (policy option ``kv_bits``): :class:`QuantizedStorage`, allocated once.

What each evicting layer holds with ``kv_bits`` (see :mod:`vase.core.quant` for the quantization itself), per (row,
KV head):

* **quantized store**, ``L = capacity - buffer - R`` logical slots (the budget after a compaction, less the
  full-precision window ``R = kv_window``, 0 by default): key and value codes
  ``[B, H, L, D * bits / 8]`` uint8 with their float16 steps and minima ``[B, H, L, D / group]``, and the key
  channel factors ``[B, H, D]`` float32. Slot ``i`` of the store is logical slot ``i`` of the layer (position order),
  so the entries the guard keeps in full precision leave their quantized slot unused;
* **full-precision store** ``[B, H, P + R + buffer, D]`` (model dtype): ``P`` entries kept in full precision by the
  value guard (``protect_precision='guard'``; their logical slots in ``protected``), then the row's recent tokens,
  those above its quantization limit (KIVI's full-precision residual, arXiv 2402.02750, Sec. 3.2): the tokens written
  since its last quantization, and with a window the newest ``R`` always.

Each row quantizes at every compaction (what it keeps, less the guard's full-precision entries) and, in between, each
time ``buffer`` new tokens have arrived since its last quantization (before its first eviction, and always for the
``full`` policy), up to ``L`` slots: a row's entries below its quantization limit (the sequence model's
:attr:`vase.core.schedule.Schedule.qlimit`) are quantized. An entry is quantized once, from its full-precision value;
at later compactions its codes and scales move with it unchanged (no re-quantization, so no error accumulates). An
entry the guard keeps in full precision after it was quantized keeps its dequantized value.

**A decode step reads the codes** (``kv_attention='codes'``, the default): when no row evicts or quantizes in the
step, the new token goes straight to the full-precision store and attention is computed from the codes, steps,
minima and channel factors (:func:`vase.core.codes.decode_attention`: a C++ kernel on CPU, Triton on CUDA), with no
dequantized copy (:meth:`QuantizedStorage.codes_step`, :meth:`QuantizedStorage.attend`). Selection policies (quest)
and attention with a logit soft cap take the workspace path below.

**Otherwise attention reads a workspace.** sdpa and eager attention take keys and values in the model's dtype, so
before each such forward the storage dequantizes its entries into a :class:`Workspace` ``[B, H, capacity, D]`` shared
by all the layers of the cache (layers run one after another): the in-place write of a new token, the compaction and the
staged writes run on it as on dense buffers (:class:`vase.hf.storage.DenseStorage` over the workspace); afterwards
the storage stores back what changed (:meth:`QuantizedStorage.after`). The workspace is one layer's worth of
full-precision entries (``CacheStats.bytes_workspace``), and dequantizing every step costs time
(``CacheStats.dequant_seconds``). Compiled decoding is refused with ``kv_bits``.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from ..core import codes as codes_attention
from ..core import quant
from ..core.config import VaseConfig
from ..core.schedule import Schedule
from ..core.transfer import upload
from .step import ForwardStep
from .storage import DenseStorage

_STORES = ("kq", "ks", "kz", "vq", "vs", "vz", "kf", "fp_k", "fp_v")
_CODES = ("kq", "ks", "kz", "vq", "vs", "vz")


class Workspace:
    """The dequantization workspace shared by the quantized layers of one cache: keys and values ``[B, H, capacity,
    D]`` in the model's dtype, allocated once (again only when the ``full`` policy's buffers grow), and the time spent
    dequantizing and quantizing (seconds)."""

    def __init__(self):
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.dequant_seconds = 0.0
        self.quant_seconds = 0.0
        self.codes_seconds = 0.0  # attention over the codes (decode steps that read no workspace)

    def get(self, shape: tuple, v_dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self.tensors
        if ws is None or ws[0].shape[2] < shape[2] or ws[0].shape[:2] != shape[:2]:
            b, h, cap, d = shape
            ws = (
                torch.zeros((b, h, cap, d), dtype=dtype, device=device),
                torch.zeros((b, h, cap, v_dim), dtype=dtype, device=device),
            )
            self.tensors = ws
        return ws

    def nbytes(self) -> int:
        return 0 if self.tensors is None else sum(t.nbytes for t in self.tensors)


class QuantizedStorage:
    """The entries of one evicting layer in ``kv_bits``-bit integers (see the module docstring).

    Args:
        config: the cache's configuration (``kv_bits``, ``kv_group``, ``protect_precision``, the guard, sizes).
        budget: this layer's budget (the guard's full-precision share is of it).
        schedule: the cache's sequence schedule (each row's fill and quantization limit, read, never written).
        workspace: the cache's shared :class:`Workspace`.

    Tensors (allocated once, except by the growing ``full`` policy):
        kq, vq: ``[B, H, L, D * bits / 8]`` uint8 packed key / value codes of logical slots ``[0, L)``.
        ks, kz, vs, vz: ``[B, H, L, D / group]`` float16 steps and minima.
        kf: ``[B, H, D]`` float32 key channel factors (1 until the row's first quantization).
        fp_k, fp_v: ``[B, H, P + R + buffer, D]`` model dtype: the guard's full-precision entries, then the recent
            ones.
        qmask: ``[B, H, L]`` bool, logical slots stored quantized.
        protected: ``[B, H, P]`` int64 logical slot of each full-precision entry of the guard (unused: the row's
            quantization limit).
        keys, values: the workspace views attention reads.
    """

    quantized = True

    def __init__(self, config: VaseConfig, budget: int, schedule: Schedule, workspace: Workspace):
        self.config, self.budget, self.schedule, self.workspace = config, budget, schedule, workspace
        self.work = DenseStorage()  # the dense operations, over the workspace
        self._moved = None
        self._codes = False  # this step's new token went to the full-precision store directly (codes path)
        self._factor_set: list[bool] = []
        self._capacity = 0
        for name in (*_STORES, "qmask", "protected"):
            setattr(self, name, None)

    @property
    def keys(self) -> torch.Tensor | None:
        return self.work.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.work.values

    @property
    def capacity(self) -> int:
        return self._capacity

    def _qlimit(self) -> list[int]:
        return self.schedule.qlimit[: self.batch]

    def _fill(self) -> list[int]:
        return self.schedule.fill[: self.batch]

    # ----------------------------------------------------------------------------------------------- allocation
    def check(self, head_dim: int, v_dim: int) -> None:
        """Raises a clear ValueError when ``kv_group`` does not divide the head dim."""
        group = self.config.kv_group
        if head_dim % group or v_dim % group:
            raise ValueError(
                f"kv_group {group} does not divide the head dim ({head_dim}): use kv_group "
                f"{min(group, head_dim & -head_dim)} or another power of two dividing it"
            )

    def _sizes(self, capacity: int) -> tuple[int, int]:
        """``(L, P)``: quantized slots and guard full-precision slots for ``capacity`` logical slots."""
        c = self.config
        lim = max((capacity - c.buffer if c.policy.evicts else capacity) - c.kv_window, 0)
        if c.protect_precision != "guard":
            return lim, 0
        share_of = self.budget if c.policy.evicts else lim
        return lim, min(quant.protected_slots(c.policy.guard, share_of, c.sinks), lim)

    def allocate(self, batch: int, heads: int, capacity: int, head_dim: int, v_dim: int, dtype, device) -> None:
        self.check(head_dim, v_dim)
        c = self.config
        self.batch, self.heads, self.head_dim, self.v_dim, self.device = batch, heads, head_dim, v_dim, device
        b, h, dev, d = batch, heads, device, head_dim
        bits, group = c.kv_bits, c.kv_group
        lim, p = self._sizes(capacity)
        self.kq = torch.zeros((b, h, lim, d * bits // 8), dtype=torch.uint8, device=dev)
        self.vq = torch.zeros((b, h, lim, v_dim * bits // 8), dtype=torch.uint8, device=dev)
        self.ks, self.kz = (torch.zeros((b, h, lim, d // group), dtype=quant.SCALE_DTYPE, device=dev) for _ in "sz")
        self.vs, self.vz = (torch.zeros((b, h, lim, v_dim // group), dtype=quant.SCALE_DTYPE, device=dev) for _ in "sz")
        self.kf = torch.ones((b, h, d), dtype=torch.float32, device=dev)
        recent = c.kv_window + c.buffer  # the most recent tokens a row holds above its quantization limit
        self.fp_k = torch.zeros((b, h, p + recent, d), dtype=dtype, device=dev)
        self.fp_v = torch.zeros((b, h, p + recent, v_dim), dtype=dtype, device=dev)
        self.qmask = torch.zeros((b, h, lim), dtype=torch.bool, device=dev)
        self.protected = torch.zeros((b, h, p), dtype=torch.long, device=dev)
        self._factor_set = [False] * b
        self._capacity = capacity
        self._bind()

    def _bind(self) -> None:
        """Point the dense operations at ``capacity`` slots of the shared workspace."""
        cap = self._capacity
        ws = self.workspace.get((self.batch, self.heads, cap, self.head_dim), self.v_dim, self.fp_k.dtype, self.device)
        self.work.keys, self.work.values = ws[0][:, :, :cap], ws[1][:, :, :cap]

    def grow(self, capacity: int, step: ForwardStep | None = None) -> None:
        """Only for the ``full`` policy: larger stores, the entries kept where they are (the recent full-precision
        ones move behind the larger guard region)."""
        old = {n: getattr(self, n) for n in (*_STORES, "qmask", "protected")}
        factor = self._factor_set
        p_old = old["protected"].shape[2]
        self.allocate(self.batch, self.heads, capacity, self.head_dim, self.v_dim, old["fp_k"].dtype, self.device)
        for n in (*_CODES, "qmask"):
            getattr(self, n)[:, :, : old[n].shape[2]] = old[n]
        self.kf.copy_(old["kf"])
        self._factor_set = factor
        p_new = self.protected.shape[2]
        for n in ("fp_k", "fp_v"):
            new = getattr(self, n)
            new[:, :, :p_old] = old[n][:, :, :p_old]
            new[:, :, p_new:] = old[n][:, :, p_old:]
        q = upload(self._qlimit(), self.device).view(-1, 1, 1)
        self.protected[:] = q
        self.protected[:, :, :p_old] = old["protected"]

    def nbytes(self) -> int:
        """Bytes this layer stores: packed codes, float16 steps and minima, key channel factors, the full-precision
        store (the guard's entries and the recent tokens). The workspace is the cache's (``bytes_workspace``)."""
        return sum(getattr(self, n).nbytes for n in _STORES if getattr(self, n) is not None)

    def entry_bytes(self) -> int:
        """Bytes of one token's key and value in one KV head at full precision."""
        return (self.head_dim + self.v_dim) * self.fp_k.element_size()

    def live_bytes(self, positions: torch.Tensor) -> int:
        """Bytes of the entries holding a token now: quantized ones at their codes and scales, the others at full
        precision."""
        b, h, lim = self.qmask.shape
        per_q = sum(getattr(self, n).nbytes for n in _CODES) // max(b * h * lim, 1)
        n_q = int(self.qmask.sum())
        return n_q * per_q + (int((positions >= 0).sum()) - n_q) * self.entry_bytes()

    # --------------------------------------------------------------------------------------- dense operations
    def append(self, step, k, v):
        return self.work.append(step, k, v)

    def staged(self, step, k, v):
        return self.work.staged(step, k, v)

    def rows(self, rows):
        return self.work.rows(rows)

    def put_front(self, step, rows, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The dense write into the workspace; remembers where each kept entry came from (:meth:`after`)."""
        self.work.put_front(step, rows, idx, k, v)
        self._moved = (rows, idx, self._capacity if step.append else step.p_old)

    def put_span(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.work.put_span(start, k, v)

    # -------------------------------------------------------------------------------------- attention over codes
    def codes_step(self, step: ForwardStep, sparse: bool) -> bool:
        """Whether this step's attention reads the codes (:mod:`vase.core.codes`): ``kv_attention='codes'``, one new
        token per row, no row evicting or quantizing its recent tokens, no selection policy (``sparse``)."""
        return (
            self.config.kv_attention == "codes"
            and step.append
            and not sparse
            and not step.evict_rows
            and not step.flush_rows
            and self.kq is not None
            and self.kq.device.type in ("cpu", "cuda")
        )

    def append_codes(self, step: ForwardStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """The decode token ``[B, H, 1, D]`` of each row into its recent slot of the full-precision store (slot ``P +
        fill - qlimit``), where :meth:`attend` reads it and where :meth:`after` would have stored it."""
        p = self.protected.shape[2]
        qlimit = self._qlimit()
        offs = [p + f - q for f, q in zip(step.fill_before, qlimit)]
        if len(set(offs)) == 1:
            o = offs[0]
            self.fp_k[:, :, o : o + 1].copy_(k)
            self.fp_v[:, :, o : o + 1].copy_(v)
        else:
            b, h = k.shape[:2]
            slot = step.tensor(("fp_slot", p), offs).view(b, 1, 1, 1)
            self.fp_k.scatter_(2, slot.expand(b, h, 1, k.shape[-1]), k)
            self.fp_v.scatter_(2, slot.expand(b, h, 1, v.shape[-1]), v)
        self._codes = True

    def attend(self, step: ForwardStep, query: torch.Tensor, positions: torch.Tensor, scaling: float, sinks=None):
        """Attention of the step's token ``query`` ``[B, q_heads, 1, D]`` over this layer's codes and full-precision
        store (:func:`vase.core.codes.decode_attention`); returns ``[B, 1, q_heads, D]`` as transformers' attention
        functions do."""
        qlimit = self._qlimit()
        ql = step.tensor("qlimit_now", qlimit)
        recent = step.tensor("recent_now", [f + 1 - q for f, q in zip(step.fill_before, qlimit)])
        t0 = time.perf_counter()
        with record_function("vase.codes_attention"):
            out = codes_attention.decode_attention(
                query[:, :, 0],
                self.kf,
                scaling,
                (self.kq, self.ks, self.kz, self.vq, self.vs, self.vz),
                self.qmask,
                positions,
                self.fp_k,
                self.fp_v,
                self.protected,
                ql,
                recent,
                self.config.kv_bits,
                sinks,
            )
        self.workspace.codes_seconds += time.perf_counter() - t0
        return out.unsqueeze(1)

    def leave_codes(self, step: ForwardStep, k: torch.Tensor, v: torch.Tensor):
        """Back to the workspace path within a codes step (the attention call needs what the kernel does not do, e.g.
        a logit soft cap): dequantize, append the new token there; returns what attention reads."""
        self._codes = False
        self.before(step)
        return self.work.append(step, k, v)

    # ------------------------------------------------------------------------------------------ dequantization
    def before(self, step: ForwardStep) -> None:
        """Dequantize this layer's entries into the workspace (slots ``[0, fill)`` of each row)."""
        self._bind()
        fill = self._fill()
        if not fill or max(fill) == 0:
            return
        t0 = time.perf_counter()
        with record_function("vase.dequantize"):
            self._dequantize_into(self.keys, self.values)
        self.workspace.dequant_seconds += time.perf_counter() - t0

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values as attention sees them, ``[B, H, capacity, D]`` (new tensors, model dtype;
        slots past a row's fill hold no token): for tests and inspection (``keys`` is the shared workspace)."""
        keys = torch.zeros_like(self.keys)
        values = torch.zeros_like(self.values)
        fill = self._fill()
        if fill and max(fill):
            self._dequantize_into(keys, values)
        return keys, values

    def _dequantize_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        qlimit = self._qlimit()
        qmax = min(max(qlimit), self.kq.shape[2])
        if qmax:
            bits = self.config.kv_bits
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
        self._copy_recent(qlimit, self._fill(), to_workspace=True, out=(keys, values))

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
    def after(self, step: ForwardStep) -> None:
        """Store what this forward pass changed: the new token of each row in the full-precision store, and, for the
        rows that evicted, quantized their recent tokens or took several tokens, their whole layout again."""
        moved, self._moved = self._moved, None
        b = self.batch
        if self._codes:  # the new tokens are in the full-precision store already, nothing else changed
            self._codes = False
            return
        if step.append:
            whole = set(step.evict_rows) | set(step.flush_rows)
            others = [i for i in range(b) if i not in whole]
            if others:
                self._copy_recent(self._qlimit(), step.keep, to_workspace=False, rows=others)
            rows = sorted(whole)
        else:
            rows = list(range(b))
        if rows:
            t0 = time.perf_counter()
            with record_function("vase.quantize"):
                self._store_rows(step, rows, moved)
            self.workspace.quant_seconds += time.perf_counter() - t0

    def _move(self, step, rows: list[int], moved) -> torch.Tensor:
        """Move the quantized entries of the rows a write gathered (a compaction, a multi-token step) to their new
        logical slots, codes and scales unchanged; returns ``[r, H, L]`` bool: which logical slots of ``rows`` now hold
        the codes of an entry quantized before."""
        h, lim = self.heads, self.qmask.shape[2]
        rt = upload(rows, self.device)
        from_q = self.qmask.index_select(0, rt)
        if moved is None:
            if not step.append:  # the fast path of an empty cache: every entry is new
                from_q.zero_()
            return from_q
        w_rows, idx, n_old = moved
        at = {row: k for k, row in enumerate(range(self.batch) if w_rows is None else w_rows)}
        sel = [k for k, row in enumerate(rows) if row in at]
        if not sel:
            return from_q
        st = upload(sel, self.device)
        src_rows = upload([rows[k] for k in sel], self.device)
        ix = idx.index_select(0, upload([at[rows[k]] for k in sel], self.device))
        w = min(ix.shape[2], lim)
        ix = ix[:, :, :w]
        was_q = torch.zeros((len(sel), h, max(self._capacity + step.q, lim)), dtype=torch.bool, device=self.device)
        n = min(n_old, lim)
        was_q[:, :, :n] = from_q.index_select(0, st)[:, :, :n]
        moved_q = torch.zeros((len(sel), h, lim), dtype=torch.bool, device=self.device)
        moved_q[:, :, :w] = was_q.gather(2, ix)
        from_q.index_copy_(0, st, moved_q)
        src = ix.clamp(max=lim - 1).unsqueeze(-1)
        for name in _CODES:
            t = getattr(self, name)
            held = t.index_select(0, src_rows)
            held[:, :, :w] = held.gather(2, src.expand(-1, -1, -1, t.shape[-1]))
            t.index_copy_(0, src_rows, held)
        return from_q

    def _store_rows(self, step, rows: list[int], moved) -> None:
        """Store ``rows`` from the workspace after a compaction, a quantization of recent tokens or a multi-token
        step: entries below the row's new limit are quantized (those quantized before keep their codes, moved with
        them), the guard's largest stay in full precision, the recent ones go to the full-precision store."""
        c = self.config
        lim, p, h = self.qmask.shape[2], self.protected.shape[2], self.heads
        q_new = [step.qlimit[i] for i in rows]
        from_q = self._move(step, rows, moved)
        rt = upload(rows, self.device)
        whole = len(rows) == self.batch
        keys, values = (self.keys, self.values) if whole else (self.keys[rt], self.values[rt])
        qn = upload(q_new, self.device)
        slot = torch.arange(lim, device=self.device).view(1, 1, lim)
        eligible = (slot < qn.view(-1, 1, 1)).expand(len(rows), h, lim)
        new_rows = [k for k, row in enumerate(rows) if not self._factor_set[row] and q_new[k] > 0]
        if new_rows:  # the row's first quantization fixes its key channel factors
            nt = upload(new_rows, self.device)
            # Without eviction, from the first block of `buffer` slots only: a prompt fed whole quantizes several
            # blocks at once, fed in chunks one at a time, and the factors must not depend on that. A compaction takes
            # every entry it keeps (what it keeps depends on the chunking anyway).
            evicting = set(step.evict_rows)
            span = [q_new[k] if rows[k] in evicting else min(q_new[k], c.buffer) for k in new_rows]
            basis = slot < upload(span, self.device).view(-1, 1, 1)
            factors = quant.channel_scale(keys[:, :, :lim].index_select(0, nt), basis)
            self.kf.index_copy_(0, rt.index_select(0, nt), factors)
            for k in new_rows:
                self._factor_set[rows[k]] = True
        prot = torch.zeros_like(eligible)
        if p:
            count = [min(p, quant.protected_slots(c.policy.guard, q, c.sinks)) for q in q_new]
            prot = quant.precision_mask(c.policy.guard, values[:, :, :lim], eligible, upload(count, self.device))
        isq = eligible & ~prot
        need = isq & ~from_q  # entries quantized now, from their full-precision values
        # the one host read of a compaction (every `buffer` steps): how many entries to quantize now
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
        full_q, full_f = list(self._qlimit()), list(self._fill())
        for k, row in enumerate(rows):
            full_q[row], full_f[row] = q_new[k], step.keep[row]
        self._copy_recent(full_q, full_f, to_workspace=False, rows=rows)

    def reset(self) -> None:
        for name in (*_STORES, "qmask", "protected"):
            setattr(self, name, None)
        self.work.reset()
        self._codes = False
        self._factor_set = []
        self._moved = None
        self._capacity = 0

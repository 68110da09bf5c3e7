"""Slot storage and compaction of one evicting layer of an :class:`~vase.EvictingCache`.

Keys and values live in buffers ``[batch, kv_heads, capacity, head_dim]`` allocated once, in the model's dtype and on
its device; they never move or grow while generating (VaSE, arXiv 2606.03928, Sec. 3.3). A row's real tokens are
packed at the front of its slots in position order. A decode token is written in place at the row's fill; several new
tokens (prefill, chat continuation) are attended together with the cache, then written packed. Which entries stay
at a compaction is decided by the eviction core (:func:`vase.core.evict.evict_layer`); this module gathers them back
into the same buffers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function
from transformers.cache_utils import CacheLayerMixin

from ..core.evict import evict_layer, gather_kept
from ..core.masks import mask_in_kind
from ..core.selection import pack_valid
from . import attention as attn
from .compiled import StaticLayerMixin
from .queries import QueryRing
from .step import StepPlan

if TYPE_CHECKING:
    from .cache import EvictingCache


class EvictingLayer(StaticLayerMixin, CacheLayerMixin):
    """One layer of an :class:`~vase.EvictingCache`. Created by the cache; not meant to be built directly.

    Tensors (allocated at the first update, never reallocated, except by the growing ``full`` policy):
        keys, values: ``[B, kv_heads, capacity, head_dim]`` model dtype.
        positions: ``[B, kv_heads, capacity]`` int64 logical position of each slot (-1: free or dead).
        queries: ``[B, q_heads, window, head_dim]`` ring of the last ``window`` post-RoPE queries of each row, its
            real ones only (if the policy needs them), with ``query_positions`` and ``query_valid`` ``[B, window]``
            (:class:`vase.hf.queries.QueryRing`).
        state: per-slot scorer state, ``{name: [B, kv_heads, capacity]}`` float32, moved with its tokens.
        row_memo: per-row scorer memo, ``{name: [B]}`` (``acc_upto``: the newest query H2O has accumulated).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: EvictingCache, layer_idx: int):
        super().__init__()
        self._cache_ref = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.positions: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.row_memo: dict[str, torch.Tensor] = {}
        self.ring = QueryRing(cache.window)
        self.scaling: float | None = None
        self._staged = None
        self._awaiting_attention = False
        self.last_eviction: dict | None = None
        self.pages = None  # page metadata of a selection policy (quest: vase.core.pages.PageTable)

    @property
    def cache(self) -> EvictingCache:
        return self._cache_ref()

    @property
    def queries(self) -> torch.Tensor | None:
        """``[B, q_heads, window, head_dim]`` saved post-RoPE queries, or None."""
        return self.ring.queries

    @property
    def query_positions(self) -> torch.Tensor | None:
        """``[B, window]`` int64 logical position of each saved query."""
        return self.ring.positions

    @property
    def query_valid(self) -> torch.Tensor | None:
        """``[B, window]`` bool, which saved queries are real."""
        return self.ring.valid

    # ----------------------------------------------------------------------------------------------- allocation
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        c = self.cache
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.head_dim = key_states.shape[-1]
        self._allocate(c.capacity, key_states.dtype, value_states.shape[-1])
        self.is_initialized = True

    def _allocate(self, capacity: int, dtype: torch.dtype, v_dim: int) -> None:
        b, h, dev = self.batch_size, self.num_heads, self.device
        self.keys = torch.zeros((b, h, capacity, self.head_dim), dtype=dtype, device=dev)
        self.values = torch.zeros((b, h, capacity, v_dim), dtype=dtype, device=dev)
        self.positions = torch.full((b, h, capacity), -1, dtype=torch.long, device=dev)
        self.state = {
            n: torch.zeros((b, h, capacity), dtype=torch.float32, device=dev) for n in self.cache.policy.state_names
        }
        self.row_memo = {"acc_upto": torch.full((b,), -1, dtype=torch.long, device=dev)}

    def _grow(self, capacity: int) -> None:
        """Only for the non-evicting ``full`` policy: move to larger buffers."""
        old = (self.keys, self.values, self.positions, self.state)
        n = self.keys.shape[2]
        self._allocate(capacity, self.keys.dtype, self.values.shape[-1])
        self.keys[:, :, :n] = old[0]
        self.values[:, :, :n] = old[1]
        self.positions[:, :, :n] = old[2]
        for k, v in old[3].items():
            self.state[k][:, :, :n] = v

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    # -------------------------------------------------------------------------------------------------- update
    @torch.no_grad()
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take the new keys/values ``[B, kv_heads, q, head_dim]`` (post-RoPE) and return what attention must see.

        One decode token per row: written in place, returns views ``[B, kv_heads, P, head_dim]`` of the buffers
        (P = largest fill + 1). Several tokens: returns the old entries concatenated with the new ones; they are
        written (and the cache compressed if needed) right after the attention.

        Raises:
            RuntimeError: if vase's attention function did not run after the previous update (the model's
                attention implementation was changed after the cache was made).
            ValueError: keys whose KV heads or head dim differ from the model's layer the cache was made for.
        """
        c = self.cache
        if c._static_forward:
            return self._static_update(key_states, value_states)
        if self._awaiting_attention:
            raise RuntimeError(
                "vase's attention function did not run after the last cache update of layer "
                f"{self.layer_idx}: the model's attention implementation was changed after the EvictingCache was "
                "created. Build the cache again with EvictingCache(model, ...), or call "
                "vase.hf.attention.install(model)."
            )
        c._check_keys(self.layer_idx, key_states)
        step = c._step_for(key_states.shape[0], key_states.shape[2], key_states.device)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.capacity < step.capacity and not c.policy.evicts:
            self._grow(step.capacity)
        self._ready(step)
        if c.policy.sparse is not None:
            c.policy.sparse.write(self, step, key_states)
        if step.append:
            out_k, out_v = self._append(step, key_states, value_states)
        else:
            p = step.p_old
            if p == 0:
                out_k, out_v = key_states, value_states
            else:
                out_k = torch.cat([self.keys[:, :, :p], key_states], dim=2)
                out_v = torch.cat([self.values[:, :, :p], value_states], dim=2)
            self._staged = (out_k, out_v)
        self._awaiting_attention = True
        attn.hand_off(self, out_k)
        return out_k, out_v

    def _append(self, step: StepPlan, k: torch.Tensor, v: torch.Tensor):
        p = step.p_old + 1
        if step.uniform:
            f = step.fill_before[0]
            self.keys[:, :, f : f + 1].copy_(k)
            self.values[:, :, f : f + 1].copy_(v)
            if len(set(step.real_before)) == 1:
                self.positions[:, :, f].fill_(step.real_before[0])
            else:
                self.positions[:, :, f : f + 1].copy_(step.new_positions().unsqueeze(1).expand(-1, k.shape[1], 1))
        else:
            b, h = k.shape[:2]
            slot = step.tensor("fill_before", step.fill_before).view(b, 1, 1)
            self.keys.scatter_(2, slot.view(b, 1, 1, 1).expand(b, h, 1, k.shape[-1]), k)
            self.values.scatter_(2, slot.view(b, 1, 1, 1).expand(b, h, 1, v.shape[-1]), v)
            self.positions.scatter_(2, slot.expand(b, h, 1), step.new_positions().unsqueeze(1).expand(b, h, 1))
        return self.keys[:, :, :p], self.values[:, :, :p]

    # -------------------------------------------------------------------------------- called by vase.hf.attention
    @torch.no_grad()
    def record_queries(self, query: torch.Tensor, scaling: float | None) -> None:
        """Save the last ``window`` post-RoPE queries ``[B, q_heads, q, head_dim]`` of this step in the ring."""
        c = self.cache
        if c._static_forward:
            self.ring.record_static(query, c._qnext_t, c._real_t)
            return
        self._q_heads = query.shape[1]
        self.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        self.ring.record(query, c._step)

    def attention_mask(self, kind: str, dtype: torch.dtype, query: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mask over physical slots for this step (see :meth:`StepPlan.mask`); a selection policy (quest) narrows
        it per query head from the step's post-RoPE ``query`` ``[B, q_heads, q, head_dim]`` (see
        :mod:`vase.core.pages`); with adaptive budgets it is per head too (:meth:`_head_mask`)."""
        c = self.cache
        if c._static_forward:
            return self._static_mask(kind, dtype)
        if c.policy.sparse is not None:
            return c.policy.sparse.mask(self, c._step, query, kind, dtype, c.budget, c.sinks)
        if c.adaptive:
            return self._head_mask(c._step, kind, dtype)
        return c._step.mask(kind, dtype)

    def _head_mask(self, step: StepPlan, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Adaptive budgets: ``[B, q_heads, q, kv_len]`` (bool for sdpa, 0 / dtype-min for eager), each query head
        seeing only the live slots of its KV head (logical position >= 0: its kept tokens, not the dead slots
        ``[n, slots)`` of a head keeping ``n``) and, for several new tokens, the new ones causally (the row mask of
        :meth:`StepPlan.mask`). Same as :meth:`StepPlan.mask` when the cache holds nothing yet."""
        p = step.p_old
        if p == 0 or kind == "padding":
            return step.mask(kind, dtype)
        b, h = self.positions.shape[:2]
        if step.append:  # the new token's position is written already: slots past each row's fill are -1
            m = (self.positions[:, :, : p + 1] >= 0).unsqueeze(2)
        else:
            q = step.q
            old = (self.positions[:, :, :p] >= 0).unsqueeze(2).expand(b, h, q, p)
            m = torch.cat([old, old.new_ones((b, h, q, q))], -1) & step.mask("bool", torch.bool)
        return mask_in_kind(m.repeat_interleave(self._q_heads // h, dim=1), kind, dtype)

    @torch.no_grad()
    def after_attention(self) -> None:
        """Write staged tokens and compact the rows that reached capacity; then mark this layer done."""
        c = self.cache
        if c._static_forward:
            self._static_after()
            return
        step = c._step
        self._awaiting_attention = False
        with c._timed(step.evict_rows, self.keys.device):
            if step.append:
                if step.evict_rows:
                    self._compact_rows(step)
            else:
                self._write_staged(step)
            self._stored(step)
        self._staged = None
        c._layer_done(self)

    def _ready(self, step: StepPlan) -> None:
        """Before this layer's entries are read or written in a forward pass: nothing here (the buffers hold them);
        a quantized layer (:class:`vase.hf.quantized.QuantizedLayer`) dequantizes them into its workspace."""

    def _stored(self, step: StepPlan) -> None:
        """After this layer's write or compaction of a forward pass: nothing here; a quantized layer stores what
        changed (:class:`vase.hf.quantized.QuantizedLayer`)."""

    def live_bytes(self) -> int:
        """Bytes of this layer's key/value entries holding a token now (see :attr:`vase.CacheStats.bytes_live`)."""
        entry = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        return int((self.positions >= 0).sum()) * entry

    # ----------------------------------------------------------------------------------------------- eviction
    def _select(self, step, rows, keys, values, positions, valid, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The eviction core's choice (:func:`vase.core.evict.evict_layer`) for ``rows`` (None = all); returns slot
        indices ``[r, H, slots]`` and the counts kept (``[r]``, or ``[r, H]`` with AdaKV; entries of the indices past
        a head's count are padding).

        ``keys``, ``values`` ``[r, H, S, D]``, ``positions`` ``[r, H, S]``, ``valid`` ``[r, S]`` (``[r, H, S]`` with
        adaptive budgets) hold the ``r`` rows scored (copies when only some rows are). ``state`` maps each of the
        policy's state names to ``[r, H, S]`` float32: the scorer updates it in place or replaces its entries, so on
        return ``state`` holds the new state of those rows' slots, and the caller must write it back with them (see
        :meth:`_write`). The per-row memo (``row_memo``, e.g. how far H2O has accumulated) is written back here, for
        exactly these rows.
        """
        c = self.cache
        sel_rows = None if rows is None else step.tensor(("rows", tuple(rows)), rows)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if sel_rows is None else t.index_select(0, sel_rows)

        q, qp, qv = self.ring.rows(sel_rows)
        ev = evict_layer(
            c.policy,
            keys,
            values,
            positions,
            valid,
            budget=c.layer_budgets[self.layer_idx],
            slots=c.slots,
            sinks=c.sinks,
            recent=c.recent,
            row_keys=pick(c._row_keys_tensor(keys.device)),
            eviction_index=pick(step.tensor("row_evictions", c._row_evictions)),
            latest_query=pick(step.latest_positions()),
            queries=q,
            query_positions=qp,
            query_valid=qv,
            scaling=self.scaling or self.head_dim**-0.5,
            state=state,
            memo={n: pick(m) for n, m in self.row_memo.items()},
            layer_idx=self.layer_idx,
        )
        if ev.protected is not None:
            c._protected = c._protected + ev.protected.sum()  # a device tensor: no synchronisation here
        for n, m in self.row_memo.items():
            if sel_rows is None:
                m.copy_(ev.memo[n])
            else:
                m.index_copy_(0, sel_rows, ev.memo[n])
        if c.record_evictions:
            self.last_eviction = self._eviction_record(ev, rows, keys, values, positions, valid)
        return ev.indices, ev.keep

    def _eviction_record(self, ev, rows, keys, values, positions, valid) -> dict:
        """The details of an eviction kept with ``record_evictions`` (tests, inspection)."""
        c, ctx = self.cache, ev.context
        r = keys.shape[0]
        n_protected = None if ev.protected is None else ev.protected.sum(-1)  # [r, H]
        return {
            "rows": list(range(r)) if rows is None else list(rows),
            "positions": positions.clone(),
            "keys": keys.clone(),
            "values": values.clone(),
            "queries": None if ctx.queries is None else ctx.queries.clone(),
            "query_positions": None if ctx.query_positions is None else ctx.query_positions.clone(),
            "query_valid": None if ctx.query_valid is None else ctx.query_valid.clone(),
            "scaling": ctx.scaling,
            "valid": valid.clone(),
            "candidates": ctx.candidates.clone(),
            "forced": ev.forced.clone(),
            "protected": None if ev.protected is None else ev.protected.clone(),
            "scores": None if ev.scores is None else ev.scores.clone(),
            "kept": ev.indices.clone(),
            "kept_positions": positions.gather(2, ev.indices),
            "n_protect": c.policy.guard.count(ctx.budget, c.sinks) if c.policy.guard is not None else 0,
            "n_protected": torch.zeros(ev.indices.shape[:2], dtype=torch.long, device=keys.device)
            if n_protected is None
            else n_protected,
            "keep": ev.keep.clone(),
        }

    @record_function("vase.compact")
    def _write(self, step, rows, idx: torch.Tensor, keep, keys, values, positions, state) -> None:
        """Gather ``idx`` ``[r, H, kmax]`` from the source tensors into slots ``[0, kmax)`` of ``rows`` in place.

        ``keep``: slots kept per row (a list), or a tensor ``[r]`` / ``[r, H]`` (per head, adaptive budgets); the
        entries of ``idx`` past it are freed (position -1)."""
        r, _, kmax = idx.shape
        if not isinstance(keep, torch.Tensor):
            keep = step.tensor(("keep", rows is None), keep)
        k, v, p, st = gather_kept(idx, keep, keys, values, positions, state)
        if rows is None:
            self.keys[:, :, :kmax].copy_(k)
            self.values[:, :, :kmax].copy_(v)
            self.positions[:, :, :kmax].copy_(p)
            self.positions[:, :, kmax:].fill_(-1)
            for n, s in st.items():
                self.state[n][:, :, :kmax].copy_(s)
                self.state[n][:, :, kmax:].zero_()
        else:
            rt = step.tensor(("rows", tuple(rows)), rows)
            self.keys[rt, :, :kmax] = k
            self.values[rt, :, :kmax] = v
            self.positions[rt, :, :kmax] = p
            self.positions[rt, :, kmax:] = -1
            for n, s in st.items():
                self.state[n][rt, :, :kmax] = s
                self.state[n][rt, :, kmax:] = 0.0

    def _compact_rows(self, step: StepPlan) -> None:
        """Decode-time eviction: rows whose fill reached capacity go back to ``budget`` slots."""
        c = self.cache
        rows = step.evict_rows
        whole = len(rows) == self.keys.shape[0]
        if whole:
            keys, values, positions = self.keys, self.values, self.positions
            state = dict(self.state)
        else:
            rt = step.tensor(("rows", tuple(rows)), rows)
            keys, values = self.keys.index_select(0, rt), self.values.index_select(0, rt)
            positions = self.positions.index_select(0, rt)
            state = {n: s.index_select(0, rt) for n, s in self.state.items()}
        filled = step.tensor(("filled", tuple(rows)), [step.fill_before[i] + step.counts[i] for i in rows])
        valid = torch.arange(keys.shape[2], device=keys.device).view(1, -1) < filled.view(-1, 1)
        if c.adaptive:  # per head: dead slots (position -1) of heads that kept fewer than the slots
            valid = valid.unsqueeze(1) & (positions >= 0)
        idx, kept = self._select(step, None if whole else rows, keys, values, positions, valid, state)
        keep = kept if c.adaptive else [c.budget] * len(rows)
        self._write(step, None if whole else rows, idx, keep, keys, values, positions, state)

    def _write_staged(self, step: StepPlan) -> None:
        """After a multi-token step: write the new real tokens packed, compressing rows that do not fit."""
        c = self.cache
        new_k, new_v = self._staged
        q, p = step.q, step.p_old
        if step.uniform and p == 0 and not step.evict_rows and self.keys.shape[2] >= q:
            # fast path: empty cache, no padding, fits
            f = step.fill_before[0]
            self.keys[:, :, f : f + q].copy_(new_k[:, :, -q:])
            self.values[:, :, f : f + q].copy_(new_v[:, :, -q:])
            self.positions[:, :, f : f + q].copy_(step.new_positions().unsqueeze(1).expand_as(new_k[..., 0]))
            for s in self.state.values():
                s[:, :, f : f + q].zero_()
            return
        b, h = new_k.shape[:2]
        new_pos = step.new_positions().unsqueeze(1).expand(b, h, q)
        positions = torch.cat([self.positions[:, :, :p], new_pos], dim=2)
        state = {
            n: torch.cat([s[:, :, :p], torch.zeros((b, h, q), dtype=s.dtype, device=s.device)], dim=2)
            for n, s in self.state.items()
        }
        valid = step.kv_valid()
        kmax = max(step.keep)
        idx = pack_valid(valid, h, kmax).clone()  # dead slots (adaptive budgets) move along, still dead
        keep = step.keep
        if step.evict_rows:
            rows = step.evict_rows
            whole = len(rows) == b
            if c.adaptive:  # per head: the scorers and the selection see each head's live slots only
                valid = valid.unsqueeze(1) & (positions >= 0)
                keep = step.tensor("keep", step.keep).view(b, 1).expand(b, h).clone()
            if whole:
                sub = (new_k, new_v, positions, valid, state)
            else:
                rt = step.tensor(("rows", tuple(rows)), rows)
                sub = (
                    new_k.index_select(0, rt),
                    new_v.index_select(0, rt),
                    positions.index_select(0, rt),
                    valid.index_select(0, rt),
                    {n: s.index_select(0, rt) for n, s in state.items()},
                )
            sel, kept = self._select(step, None if whole else rows, *sub)
            if whole:
                idx[:, :, : c.slots] = sel
            else:
                idx[rt, :, : c.slots] = sel
                for n, s in sub[4].items():  # the scored rows' state (H2O: attention just accumulated)
                    state[n].index_copy_(0, rt, s)
            if c.adaptive:
                keep[rows if not whole else slice(None)] = kept.view(len(rows), -1)
        self._write(step, None, idx, keep, new_k, new_v, positions, state)

    # ------------------------------------------------------------------------------------------ Cache protocol
    def get_seq_length(self) -> int:
        """Logical length (tokens seen), shared by all layers."""
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Logical sizes: the default mask transformers builds is replaced by vase's own over physical slots.
        return self.cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity if self.is_initialized else -1

    def reset(self) -> None:
        """Drop the buffers; the next update allocates them again."""
        self.keys = self.values = self.positions = None
        self.state, self.row_memo = {}, {}
        self.ring = QueryRing(self.cache.window)
        self._staged = None
        self._awaiting_attention = False
        self.last_eviction = None
        self.pages = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictingCache does not support beam search; use sampling or greedy decoding")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("EvictingCache cannot be cropped (evicted tokens are gone); no assisted decoding")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("EvictingCache cannot be expanded after prefill; repeat the inputs instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("EvictingCache does not support selecting batch rows after prefill")

"""One evicting layer of an :class:`~vase.EvictingCache`: its writes, the attention hooks' side, its compactions.

A layer holds a storage strategy for its keys and values (:class:`vase.hf.storage.DenseStorage`, or
:class:`vase.hf.quantized.QuantizedStorage` with ``kv_bits``) and its index in the cache's sequence model
(:class:`vase.core.sequence.Sequences`: the row tables with each slot's logical position and policy state, the query
ring, the schedule). Each forward pass hands it the step's plan (:class:`vase.hf.step.ForwardStep`): a decode token is
written in place at the row's fill; several new tokens (prefill, chat continuation) are attended together with the
cache, then written packed. Which entries stay at a compaction is decided by the sequence model
(:meth:`vase.core.sequence.Sequences.evict`); this module gathers the kept entries back into the same buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from transformers.cache_utils import CacheLayerMixin

from ..core.evict import gather_kept
from ..core.masks import mask_in_kind
from ..core.selection import pack_valid
from ..core.sequence import Sequences
from . import attention as attn
from .step import ForwardStep


@dataclass
class Counters:
    """What the evicting layers of one cache add up: eviction time (seconds), guarded slots (a device tensor or 0),
    and whether to synchronize the GPU around evictions (``profile``)."""

    profile: bool = False
    eviction_seconds: float = 0.0
    protected: torch.Tensor | int = 0

    def timed(self, evicts: bool, device: torch.device):
        return _Timed(self, evicts, device)


class _Timed:
    """Around a layer's write (``evicts`` falsy) or eviction: profiler label; for an eviction, its wall time added to
    ``eviction_seconds`` (the GPU synchronized first with ``profile``)."""

    def __init__(self, counters: Counters, evicts: bool, device: torch.device):
        self.c, self.evicts, self.device = counters, evicts, device
        self.label = record_function("vase.evict" if evicts else "vase.write")

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.label.__enter__()

    def __exit__(self, *exc):
        self.label.__exit__(*exc)
        if self.evicts:
            if self.c.profile and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.c.eviction_seconds += time.perf_counter() - self.t0
        return False


class EvictingLayer(CacheLayerMixin):
    """One layer of an :class:`~vase.EvictingCache`. Created by the cache; not meant to be built directly.

    Args:
        seq: the cache's sequence model; index: this layer's index in it (the evicting layers in order).
        layer_idx: the model's index of this layer.
        storage: where its keys and values live (dense or quantized).
        length: the cache's logical length (tokens seen), for the Cache protocol.
        counters: the cache's :class:`Counters`.
        record: keep the details of the last eviction in :attr:`last_eviction` (tests, inspection).

    Tensors (allocated at the first update, never reallocated, except by the growing ``full`` policy):
        keys, values: ``[B, kv_heads, capacity, head_dim]`` what attention reads (the storage's buffers, or the
            quantized storage's workspace).
        positions: ``[B, kv_heads, capacity]`` int64 logical position of each slot (-1: free or dead), from the row
            tables.
        state: per-slot scorer state, ``{name: [B, kv_heads, capacity]}`` float32, moved with its tokens.
        row_memo: per-row scorer memo, ``{name: [B]}`` (``acc_upto``: the newest query H2O has accumulated).
        queries, query_positions, query_valid: the saved post-RoPE queries ``[B, q_heads, window, head_dim]``, their
            positions and validity ``[B, window]`` (the query ring), or None.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, seq: Sequences, index: int, layer_idx: int, storage, length: Callable[[], int], counters):
        # CacheLayerMixin.__init__ would set keys/values, which are the storage's here
        self.is_initialized = False
        self.seq, self.index, self.layer_idx, self.storage = seq, index, layer_idx, storage
        self._length, self.counters = length, counters
        self.record = False
        self.scaling: float | None = None
        self._step: ForwardStep | None = None
        self.last_eviction: dict | None = None
        self.pages = None  # page metadata of a selection policy (quest: vase.core.pages.PageTable)
        self._q_heads = 0
        self.codes = False  # this step's attention reads the quantized codes (see write)
        self._new = None

    # ------------------------------------------------------------------------------------------------ views
    @property
    def keys(self) -> torch.Tensor | None:
        return self.storage.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.storage.values

    @property
    def positions(self) -> torch.Tensor | None:
        return self.seq.tables.positions[self.index]

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.seq.tables.state[self.index]

    @property
    def row_memo(self) -> dict[str, torch.Tensor]:
        return self.seq.tables.memo[self.index]

    @property
    def queries(self) -> torch.Tensor | None:
        return None if self.seq.ring is None else self.seq.ring.queries[self.index]

    @property
    def query_positions(self) -> torch.Tensor | None:
        return None if self.queries is None else self.seq.ring.read(self.index)[1]

    @property
    def query_valid(self) -> torch.Tensor | None:
        return None if self.queries is None else self.seq.ring.read(self.index)[2]

    @property
    def capacity(self) -> int:
        return self.storage.capacity if self.is_initialized else 0

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads, ``[B, H, capacity, D]`` (with ``kv_bits``: dequantized into new
        tensors, for tests and inspection)."""
        return self.storage.entries()

    def storage_bytes(self) -> int:
        """Bytes the storage holds (read by :func:`vase.hf.hybrid.state_bytes`)."""
        return self.storage.nbytes()

    def live_bytes(self) -> int:
        """Bytes of the entries holding a token now (see :attr:`vase.CacheStats.bytes_live`)."""
        return self.storage.live_bytes(self.positions)

    # ----------------------------------------------------------------------------------------------- writes
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int = 0) -> None:
        """Allocate the storage and this layer's row tables for the batch of ``key_states`` and ``capacity`` slots."""
        self.device = key_states.device
        b, h = key_states.shape[:2]
        self.head_dim = key_states.shape[-1]
        self.storage.allocate(b, h, capacity, self.head_dim, value_states.shape[-1], key_states.dtype, self.device)
        self.seq.tables.allocate(self.index, b, h, capacity, self.device)
        self.is_initialized = True

    def grow(self, capacity: int, step: ForwardStep | None = None) -> None:
        """Only for a policy that never evicts (``full``): larger buffers and tables, the entries where they were."""
        self.storage.grow(capacity, step)
        self.seq.tables.grow(self.index, width=capacity)

    @torch.no_grad()
    def write(self, step: ForwardStep, key_states: torch.Tensor, value_states: torch.Tensor):
        """Take the step's new keys/values ``[B, kv_heads, q, head_dim]`` (post-RoPE); return what attention reads.

        One decode token per row: written in place, returns views ``[B, kv_heads, P, head_dim]`` of the buffers
        (P = largest fill + 1). Several tokens: returns the held entries concatenated with the new ones; they are
        written (and the rows that do not fit compressed) right after the attention (:meth:`after_attention`).

        Raises:
            RuntimeError: if vase's attention function did not run after the previous update (the model's attention
                implementation was changed after the cache was made).
        """
        if self._step is not None:
            raise RuntimeError(
                "vase's attention function did not run after the last cache update of layer "
                f"{self.layer_idx}: the model's attention implementation was changed after the EvictingCache was "
                "created. Build the cache again with EvictingCache(model, ...), or call "
                "vase.hf.attention.install(model)."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states, step.capacity)
        elif self.capacity < step.capacity and not self.seq.policy.evicts:
            self.grow(step.capacity, step)
        sparse = self.seq.policy.sparse
        self.codes = self.storage.quantized and self.storage.codes_step(step, sparse is not None)
        if self.codes:  # attention reads the quantized store itself (vase.core.codes): no workspace to fill
            self.storage.append_codes(step, key_states, value_states)
            self._put_positions(step)
            self._step = step
            self._new = (key_states, value_states)
            attn.hand_off(self, key_states)
            return key_states, value_states
        self.storage.before(step)
        if sparse is not None:
            sparse.write(self, step, key_states)
        if step.append:
            out_k, out_v = self.storage.append(step, key_states, value_states)
            self._put_positions(step)
        else:
            out_k, out_v = self.storage.staged(step, key_states, value_states)
            self._staged = (out_k, out_v)
        self._step = step
        attn.hand_off(self, out_k)
        return out_k, out_v

    def _put_positions(self, step: ForwardStep) -> None:
        """The decode token's logical position in each row's slot at its fill."""
        tables, i = self.seq.tables, self.index
        if step.uniform:
            real = step.real_before
            tables.put_column(i, step.fill_before[0], real[0] if len(set(real)) == 1 else step.new_positions()[:, 0])
        else:
            b = len(step.fill_before)
            tables.put_positions(
                i,
                step.tensor("batch_rows", list(range(b))),
                step.tensor("fill_before", step.fill_before),
                step.new_positions()[:, 0],
            )

    # ---------------------------------------------------------------------------- called by vase.hf.attention
    @torch.no_grad()
    def record_queries(self, query: torch.Tensor, scaling: float | None) -> None:
        """Save this step's post-RoPE queries ``[B, q_heads, q, head_dim]`` in the query ring."""
        self._q_heads = query.shape[1]
        self.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        ring, step = self.seq.ring, self._step
        if ring is None:
            return
        if ring.queries[self.index] is None:
            ring.allocate(self.index, query.shape[1], query.shape[-1], query.dtype, query.device)
        ring.write(self.index, step.ring, step.ring_values(query))

    def attend_codes(self, query: torch.Tensor, kwargs: dict):
        """The step's attention over the quantized store (:meth:`vase.hf.quantized.QuantizedStorage.attend`), as
        ``(output [B, 1, q_heads, D], None)``; None when the call needs what that path does not do (a logit soft cap,
        dropout): the layer then falls back to the workspace, and :meth:`attention_inputs` gives what to read."""
        if kwargs.get("softcap") is not None or kwargs.get("dropout", 0.0):
            k, v = self._new
            self._fallback = self.storage.leave_codes(self._step, k, v)
            self.codes = False
            return None
        sinks = kwargs.get("s_aux")
        out = self.storage.attend(self._step, query, self.positions, self.scaling, sinks)
        return out, None

    def attention_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After :meth:`attend_codes` declined: the workspace's keys and values, the new token appended."""
        out, self._fallback = self._fallback, None
        return out

    def attention_mask(self, kind: str, dtype: torch.dtype, query: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mask over physical slots for this step (see :meth:`ForwardStep.mask`); a selection policy (quest)
        narrows it per query head from the step's post-RoPE ``query`` ``[B, q_heads, q, head_dim]`` (see
        :mod:`vase.core.pages`); with adaptive budgets it is per head too (:meth:`_head_mask`)."""
        step, policy = self._step, self.seq.policy
        if policy.sparse is not None:
            return policy.sparse.mask(self, step, query, kind, dtype, self.seq.config.budget, self.seq.config.sinks)
        if policy.adaptive_budgets:
            return self._head_mask(step, kind, dtype)
        return step.mask(kind, dtype)

    def _head_mask(self, step: ForwardStep, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Adaptive budgets: ``[B, q_heads, q, kv_len]`` (bool for sdpa, 0 / dtype-min for eager), each query head
        seeing only the live slots of its KV head (logical position >= 0: its kept tokens, not the dead slots
        ``[n, slots)`` of a head keeping ``n``) and, for several new tokens, the new ones causally (the row mask of
        :meth:`ForwardStep.mask`). Same as :meth:`ForwardStep.mask` when the cache holds nothing yet."""
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
        """Write staged tokens and compact the rows that reached their limit; then mark this layer done."""
        step, self._step = self._step, None
        self.codes, self._new = False, None
        with self.counters.timed(bool(step.evict_rows), self.keys.device):
            if step.append:
                if step.evict_rows:
                    self.compact(step)
            else:
                self._write_staged(step)
            self.storage.after(step)
        self._staged = None
        step.layer_done()

    # ----------------------------------------------------------------------------------------------- eviction
    def _evict(self, step, rows, keys, values, positions, valid, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence model's choice for ``rows`` (None = all); returns slot indices ``[r, H, slots]`` and the counts
        kept (``[r]``, or ``[r, H]`` with AdaKV; entries of the indices past a head's count are padding).

        ``keys``, ``values`` ``[r, H, S, D]``, ``positions`` ``[r, H, S]``, ``valid`` ``[r, S]`` (``[r, H, S]`` with
        adaptive budgets) hold the ``r`` rows scored (copies when only some rows are). ``state`` maps each of the
        policy's state names to ``[r, H, S]`` float32: on return it holds the new state of those rows' slots, which
        the caller writes back with them (:meth:`_write`)."""
        which = list(range(len(step.fill_before))) if rows is None else list(rows)
        ev = self.seq.evict(
            self.index,
            step.schedule,
            which,
            keys,
            values,
            positions,
            valid,
            state,
            scaling=self.scaling or self.head_dim**-0.5,
            rows=None if rows is None else step.rows_tensor(rows),
        )
        if ev.protected is not None:
            self.counters.protected = self.counters.protected + ev.protected.sum()  # a device tensor: no sync
        if self.record:
            self.last_eviction = self._eviction_record(ev, rows, keys, values, positions, valid)
        return ev.indices, ev.keep

    def _eviction_record(self, ev, rows, keys, values, positions, valid) -> dict:
        """The details of an eviction kept with ``record_evictions`` (tests, inspection)."""
        ctx, policy = ev.context, self.seq.policy
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
            "n_protect": policy.guard.count(ctx.budget, self.seq.config.sinks) if policy.guard is not None else 0,
            "n_protected": torch.zeros(ev.indices.shape[:2], dtype=torch.long, device=keys.device)
            if n_protected is None
            else n_protected,
            "keep": ev.keep.clone(),
        }

    @record_function("vase.compact")
    def _write(self, step, rows, idx: torch.Tensor, keep, keys, values, positions, state) -> None:
        """Gather ``idx`` ``[r, H, kmax]`` from the source tensors into slots ``[0, kmax)`` of ``rows`` in place (the
        storage's entries, the tables' positions and state).

        ``keep``: slots kept per row (a list), or a tensor ``[r]`` / ``[r, H]`` (per head, adaptive budgets); the
        entries of ``idx`` past it are freed (position -1)."""
        if not isinstance(keep, torch.Tensor):
            keep = step.tensor(("keep", rows is None), keep)
        k, v, p, st = gather_kept(idx, keep, keys, values, positions, state)
        self.storage.put_front(step, rows, idx, k, v)
        self.seq.tables.write_kept(self.index, None if rows is None else step.rows_tensor(rows), p, st)

    def compact(self, step: ForwardStep) -> None:
        """Decode-time eviction: rows whose fill reached their limit go back to ``slots``."""
        rows = step.evict_rows
        whole = len(rows) == self.keys.shape[0]
        rt = None if whole else step.rows_tensor(rows)
        keys, values = self.storage.rows(rt)
        if whole:
            positions, state = self.positions, dict(self.state)
        else:
            positions = self.positions.index_select(0, rt)
            state = {n: s.index_select(0, rt) for n, s in self.state.items()}
        filled = step.tensor(("filled", tuple(rows)), [step.fill_before[i] + step.counts[i] for i in rows])
        valid = torch.arange(keys.shape[2], device=keys.device).view(1, -1) < filled.view(-1, 1)
        adaptive = self.seq.policy.adaptive_budgets
        if adaptive:  # per head: dead slots (position -1) of heads that kept fewer than the slots
            valid = valid.unsqueeze(1) & (positions >= 0)
        idx, kept = self._evict(step, None if whole else rows, keys, values, positions, valid, state)
        keep = kept if adaptive else [self.seq.config.budget] * len(rows)
        self._write(step, None if whole else rows, idx, keep, keys, values, positions, state)

    def _write_staged(self, step: ForwardStep) -> None:
        """After a multi-token step: write the new real tokens packed, compressing rows that do not fit."""
        seq = self.seq
        new_k, new_v = self._staged
        q, p = step.q, step.p_old
        if step.uniform and p == 0 and not step.evict_rows and self.keys.shape[2] >= q:
            # fast path: empty cache, no padding, fits
            f = step.fill_before[0]
            self.storage.put_span(f, new_k[:, :, -q:], new_v[:, :, -q:])
            seq.tables.put_span(self.index, f, step.new_positions())
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
            adaptive = seq.policy.adaptive_budgets
            if adaptive:  # per head: the scorers and the selection see each head's live slots only
                valid = valid.unsqueeze(1) & (positions >= 0)
                keep = step.tensor("keep", step.keep).view(b, 1).expand(b, h).clone()
            if whole:
                sub = (new_k, new_v, positions, valid, state)
            else:
                rt = step.rows_tensor(rows)
                sub = (
                    new_k.index_select(0, rt),
                    new_v.index_select(0, rt),
                    positions.index_select(0, rt),
                    valid.index_select(0, rt),
                    {n: s.index_select(0, rt) for n, s in state.items()},
                )
            sel, kept = self._evict(step, None if whole else rows, *sub)
            if whole:
                idx[:, :, : seq.slots] = sel
            else:
                idx[rt, :, : seq.slots] = sel
                for n, s in sub[4].items():  # the scored rows' state (H2O: attention just accumulated)
                    state[n].index_copy_(0, rt, s)
            if adaptive:
                keep[rows if not whole else slice(None)] = kept.view(len(rows), -1)
        self._write(step, None, idx, keep, new_k, new_v, positions, state)

    # ------------------------------------------------------------------------------------------ Cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("an evicting layer is updated through its EvictingCache (cache.update), not directly")

    def get_seq_length(self) -> int:
        """Logical length (tokens seen), shared by all layers."""
        return self._length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Logical sizes: the default mask transformers builds is replaced by vase's own over physical slots.
        return self._length() + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity if self.is_initialized else -1

    def reset(self) -> None:
        """Drop the storage; the next update allocates it again (the cache resets the tables and the ring)."""
        self.storage.reset()
        self._step = None
        self._staged = None
        self.codes, self._new = False, None
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

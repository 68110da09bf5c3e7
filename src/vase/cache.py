"""The evicting KV cache: a ``transformers`` :class:`~transformers.Cache` with a static footprint.

Per layer, keys and values live in buffers ``[batch, kv_heads, budget + buffer, head_dim]`` allocated once, in the
model's dtype and on its device; they never move or grow while generating (VaSE, arXiv 2606.03928, Sec. 3.3).

Hybrid models (gpt-oss, Gemma 3, OLMo 3, Qwen3-Next, Qwen3.5): only the full-attention layers are evicting layers;
the sliding-window and linear-attention layers are transformers' own cache layers, built as ``DynamicCache(config=...)``
builds them, in the same cache object (:mod:`vase.hybrid`). Everything below is about the evicting layers.

Bookkeeping, shared by all evicting layers because every layer sees the same tokens on the same schedule:

* the *logical* length (tokens seen, padding columns included) drives RoPE positions and ``get_seq_length``;
* the *physical* fill of each row (slots holding real tokens, packed at the front in position order);
* each slot remembers the logical position of its token, its index among the real tokens of its row (per layer and
  KV head, since heads keep different tokens).

Schedule. A decode step writes its token in place at the row's fill. After the attention of that step, a row whose
fill reached ``budget + buffer`` is compacted in place back to ``budget``: its first ``sinks`` tokens and its last
``buffer`` tokens stay, the policy chooses the rest, per (layer, KV head), the same count for every head. Several new
tokens at once (prefill, chat continuation) are attended together with the cache, then written packed: padding takes
no slot, and a row that does not fit is compressed by the same policy right away (observation window = the last
queries of the prompt). ``compress_prompt=False`` keeps the prompt dense instead (capacity = max(prompt, budget) +
buffer, as the paper's code does) and evicts from the first compaction on.

Each row evicts on its own schedule with its own random key, so a row of a ragged batch behaves exactly as it would
alone. Scoring needs no attention weights from the kernel: :mod:`vase.attention` saves the post-RoPE queries.

Adaptive budgets (policy options ``head_budget='adakv'``, ``layer_budget='pyramid'``; :mod:`vase.budgets`): heads and
layers keep different counts while the schedule stays shared. Every (layer, KV head) has ``slots`` physical slots for
kept tokens (``budget_cap * budget`` with AdaKV, the largest layer budget with PyramidKV alone); a compaction leaves
every row at fill ``slots``, a head keeping ``n`` holding its tokens at ``[0, n)`` and dead slots (position -1) at
``[n, slots)``; the row next evicts at ``slots + buffer``, that is ``buffer`` tokens later as in the uniform case.
Dead slots are masked per head in attention (``[B, q_heads, q, kv_len]``, sdpa and eager; flash-attention is refused
at creation) and left out of the next eviction (per-head ``valid`` ``[b, H, S]`` in the :class:`EvictionContext`).
The first eviction still comes at ``budget + buffer`` tokens (the schedule of the uniform cache). The buffers are
allocated for ``slots + buffer``: ``stats().bytes_held`` is that, ``stats().bytes_live`` what attention reads.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers.cache_utils import Cache, CacheLayerMixin

from . import attention as attn
from . import budgets, hybrid, rng
from .policies import make_policy
from .policy import Policy
from .scoring import EvictionContext
from .selection import pack_valid, structural_masks

SUPPORTED_LAYER_TYPES = hybrid.EVICTING_LAYER_TYPES + hybrid.KEPT_LAYER_TYPES


def upload(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor from host values, without a host-device synchronization (pinned, non-blocking)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class CacheStats:
    """What a cache holds and has done, for a user to read after a run.

    Attributes:
        policy: policy name.
        budget, buffer: tokens.
        batch: batch rows.
        layers: evicting (full-attention) layers.
        tokens_seen: logical length (tokens per row, padding columns included).
        real_tokens: real (non-padding) tokens seen by each row.
        slots_held: largest number of filled slots of a row, right now (tokens; with adaptive budgets the dead slots
            of heads keeping fewer than the cap count too).
        capacity: slots allocated per row and layer (tokens).
        evictions: forward passes in which at least one row evicted.
        tokens_evicted: tokens dropped, summed over rows (each counted once, not per layer).
        bytes_held: bytes held now, all layers: the key/value buffers allocated for the evicting layers, plus the
            state the other layers of a hybrid model hold (``bytes_other``); with the page metadata of ``quest``.
        bytes_full: bytes the model's default cache (``DynamicCache(config=...)``) would hold for the same tokens:
            the full-attention layers' keys and values for every token seen (padding columns included), plus
            ``bytes_other`` (the other layers' state is the default cache's own). With adaptive budgets the evicting
            buffers are allocated for the cap (``budget_cap`` x budget + buffer slots per head), so ``bytes_held`` is
            more than the budget's bytes.
        eviction_seconds: wall time spent scoring, selecting and compacting (seconds).
        protected: value slots the guard protected (or, with ``guard_mode='evict'``, demoted), summed over evictions,
            layers, rows and KV heads (0 without a guard); with ``guard_rule='outlier'`` the count varies per head.
        other_layers: layers of a hybrid model kept as transformers holds them (sliding-window, linear attention).
        bytes_other: bytes those layers hold now (keys/values of a sliding window, convolution and recurrent states).
        bytes_live: bytes of the evicting layers' key/value entries holding a token right now: what attention reads
            there (below their buffers by the free slots and, with adaptive budgets, the dead ones).
    """

    policy: str
    budget: int
    buffer: int
    batch: int
    layers: int
    tokens_seen: int
    real_tokens: list[int]
    slots_held: int
    capacity: int
    evictions: int
    tokens_evicted: int
    bytes_held: int
    bytes_full: int
    eviction_seconds: float
    protected: int = 0
    other_layers: int = 0
    bytes_other: int = 0
    bytes_live: int = 0

    @property
    def compression(self) -> float:
        """Full-cache bytes over bytes held (>1 means savings)."""
        return self.bytes_full / self.bytes_held if self.bytes_held else 1.0

    def line(self) -> str:
        """A one-line human summary (hybrid models: what the kept layers hold, counted in both totals, too)."""
        mib = 2.0**20
        kept = (
            f" (each incl. {self.bytes_other / mib:.1f} MiB in {self.other_layers} sliding/linear layers)"
            if self.other_layers
            else ""
        )
        return (
            f"policy {self.policy}, budget {self.budget}+{self.buffer}: {self.evictions} evictions, "
            f"{self.tokens_seen} tokens seen, {self.slots_held}/{self.capacity} slots held, "
            f"KV {self.bytes_held / mib:.1f} MiB vs full {self.bytes_full / mib:.1f} MiB ({self.compression:.2f}x)"
            f"{kept}"
        )


@dataclass
class _Step:
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
            out = attn.mask_in_kind(m, kind, dtype)
        self._memo[key] = out
        return out


def _expand(idx: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``[B, n]`` indices along the token axis as ``[B, heads, n, dim]``, to gather from ``[B, heads, T, dim]``."""
    return idx.view(idx.shape[0], 1, idx.shape[1], 1).expand(idx.shape[0], heads, idx.shape[1], dim)


class EvictingLayer(CacheLayerMixin):
    """One layer of an :class:`EvictingCache`. Created by the cache; not meant to be built directly.

    Tensors (allocated at the first update, never reallocated, except by the growing ``full`` policy):
        keys, values: ``[B, kv_heads, capacity, head_dim]`` model dtype.
        positions: ``[B, kv_heads, capacity]`` int64 logical position of each slot.
        queries: ``[B, q_heads, window, head_dim]`` ring of the last ``window`` post-RoPE queries of each row, its
            real ones only (if the policy needs them), with ``query_positions`` and ``query_valid`` ``[B, window]``.
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
        self.queries = self.query_positions = self.query_valid = None
        self._q_next = 0
        self.scaling: float | None = None
        self._staged = None
        self._awaiting_attention = False
        self.last_eviction: dict | None = None
        self.pages = None  # page metadata of a selection policy (quest: vase.pages.PageTable)

    @property
    def cache(self) -> EvictingCache:
        return self._cache_ref()

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
                "created. Build the cache again with EvictingCache(model, ...), or call vase.attention.install(model)."
            )
        c._check_keys(self.layer_idx, key_states)
        step = c._step_for(key_states.shape[0], key_states.shape[2], key_states.device)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.capacity < step.capacity and not c.policy.evicts:
            self._grow(step.capacity)
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

    def _append(self, step: _Step, k: torch.Tensor, v: torch.Tensor):
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

    # -------------------------------------------------------------------------------- called by vase.attention
    @torch.no_grad()
    def record_queries(self, query: torch.Tensor, scaling: float | None) -> None:
        """Save the last ``window`` post-RoPE queries ``[B, q_heads, q, head_dim]`` of this step in the ring.

        The ring holds, per row, that row's last ``window`` real queries: one write pointer serves all rows, and the
        slot it points at is the oldest query (or an empty slot) of every row. A step with padding keeps this true
        with :meth:`_record_padded`.
        """
        c = self.cache
        if c._static_forward:
            self._static_record(query)
            return
        step = c._step
        self._q_heads = query.shape[1]
        self.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        w = c.window
        if w == 0:
            return
        b, hq, q, d = query.shape
        if self.queries is None:
            self.queries = torch.zeros((b, hq, w, d), dtype=query.dtype, device=query.device)
            self.query_positions = torch.full((b, w), -1, dtype=torch.long, device=query.device)
            self.query_valid = torch.zeros((b, w), dtype=torch.bool, device=query.device)
        if step.new_valid is not None:
            self._record_padded(query, step)
            return
        m = min(q, w)
        if m == 1:
            i = self._q_next
            self.queries[:, :, i : i + 1].copy_(query[:, :, -1:])
            if len(set(step.real_before)) == 1:
                self.query_positions[:, i].fill_(step.real_before[0] + q - 1)
            else:
                self.query_positions[:, i].copy_(step.new_positions()[:, -1])
            self.query_valid[:, i] = True
        else:
            idx = torch.arange(self._q_next, self._q_next + m, device=query.device) % w
            self.queries.index_copy_(2, idx, query[:, :, -m:])
            self.query_positions.index_copy_(1, idx, step.new_positions()[:, -m:])
            self.query_valid.index_fill_(1, idx, True)
        self._q_next = (self._q_next + m) % w

    def _record_padded(self, query: torch.Tensor, step: _Step) -> None:
        """Ring update for a multi-token step with padding (a ragged prefill or continuation).

        Padding columns must not push a row's earlier real queries out of the ring: each row keeps the newest
        ``window`` of its saved real queries and its real new ones, rewritten oldest first from slot 0 with the empty
        slots before them (so the write pointer, reset to 0, again points at each row's oldest entry). Works on
        ``[B, q_heads, 2 * window, head_dim]`` at most, whatever the step's length.
        """
        w = self.queries.shape[2]
        hq, d = query.shape[1], query.shape[3]
        m = min(step.q, w)
        dev = query.device
        # the last m real columns of each row, in order (empty columns first where a row has fewer)
        cols = torch.argsort(step.new_valid.to(torch.int8), dim=1, stable=True)[:, -m:]  # [B, m]
        age = (torch.arange(w, device=dev) + self._q_next) % w  # ring slots, oldest first
        cand_q = torch.cat([self.queries.index_select(2, age), query.gather(2, _expand(cols, hq, d))], 2)
        cand_p = torch.cat([self.query_positions.index_select(1, age), step.new_positions().gather(1, cols)], 1)
        cand_v = torch.cat([self.query_valid.index_select(1, age), step.new_valid.gather(1, cols)], 1)
        keep = torch.argsort(cand_v.to(torch.int8), dim=1, stable=True)[:, -w:]  # [B, w]: the newest w real last
        self.queries.copy_(cand_q.gather(2, _expand(keep, hq, d)))
        self.query_positions.copy_(cand_p.gather(1, keep))
        self.query_valid.copy_(cand_v.gather(1, keep))
        self._q_next = 0

    def attention_mask(self, kind: str, dtype: torch.dtype, query: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mask over physical slots for this step (see :meth:`_Step.mask`); a selection policy (quest) narrows it
        per query head from the step's post-RoPE ``query`` ``[B, q_heads, q, head_dim]`` (see :mod:`vase.pages`);
        with adaptive budgets it is per head too (:meth:`_head_mask`)."""
        c = self.cache
        if c._static_forward:
            return self._static_mask(kind, dtype)
        if c.policy.sparse is not None:
            return c.policy.sparse.mask(self, c._step, query, kind, dtype, c.budget, c.sinks)
        if c.adaptive:
            return self._head_mask(c._step, kind, dtype)
        return c._step.mask(kind, dtype)

    def _head_mask(self, step: _Step, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Adaptive budgets: ``[B, q_heads, q, kv_len]`` (bool for sdpa, 0 / dtype-min for eager), each query head
        seeing only the live slots of its KV head (logical position >= 0: its kept tokens, not the dead slots
        ``[n, slots)`` of a head keeping ``n``) and, for several new tokens, the new ones causally (the row mask of
        :meth:`_Step.mask`). Same as :meth:`_Step.mask` when the cache holds nothing yet."""
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
        return attn.mask_in_kind(m.repeat_interleave(self._q_heads // h, dim=1), kind, dtype)

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
        self._staged = None
        c._layer_done(self)

    # ------------------------------------------------------------------------------------- compiled decoding
    # One decode step of a compileable cache (see EvictingCache, "Compiled decoding"): fixed shapes, no Python value
    # that changes from step to step, no host-device synchronization. The eager part (eviction, bookkeeping) runs
    # before the step, in EvictingCache.prepare_decode.
    def _static_update(self, k: torch.Tensor, v: torch.Tensor):
        """Write the step's token ``[B, kv_heads, 1, D]`` at each row's fill; return the whole buffers
        ``[B, kv_heads, capacity, D]`` (the slots past a row's fill are masked by :meth:`_static_mask`)."""
        c = self.cache
        b, h, _, d = k.shape
        slot = c._fill_t.view(b, 1, 1, 1)
        self.keys.scatter_(2, slot.expand(b, h, 1, d), k)
        self.values.scatter_(2, slot.expand(b, h, 1, v.shape[-1]), v)
        self.positions.scatter_(2, slot.view(b, 1, 1).expand(b, h, 1), c._real_t.view(b, 1, 1).expand(b, h, 1))
        attn.hand_off(self, self.keys)
        return self.keys, self.values

    def _static_record(self, query: torch.Tensor) -> None:
        """Save the step's query ``[B, q_heads, 1, D]`` at the ring's write pointer (a device tensor)."""
        c = self.cache
        if self.queries is None:
            return
        i = c._qnext_t
        self.queries.index_copy_(2, i, query)
        self.query_positions.index_copy_(1, i, c._real_t.view(-1, 1))
        self.query_valid.index_fill_(1, i, True)

    def _static_mask(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, 1, capacity]`` (``[B, q_heads, 1, capacity]`` with adaptive budgets): the slots holding a token,
        the new one included; bool for sdpa, 0 / dtype-min for eager."""
        c = self.cache
        if c.adaptive:
            h = self.positions.shape[1]
            m = (self.positions >= 0).unsqueeze(2).repeat_interleave(self._q_heads // h, dim=1)
        else:
            m = c._decode_slot_mask()
        return attn.mask_in_kind(m, kind, dtype)

    def _static_after(self) -> None:
        """After the last evicting layer: advance the device counters (fill, position, ring pointer)."""
        c = self.cache
        if self.layer_idx != c._evicting[-1]:
            return
        c._fill_t.add_(1)
        c._real_t.add_(1)
        c._seen_t.add_(1)
        if c.window:
            c._qnext_t.add_(1).remainder_(c.window)
        c._static_forward = False
        c._phase = "ran"

    # ----------------------------------------------------------------------------------------------- eviction
    def _context(self, step, rt, keys, values, positions, valid, state, memo) -> EvictionContext:
        c = self.cache
        forced, candidates = structural_masks(valid, c.sinks, c.recent)
        pick = (lambda t: t) if rt is None else (lambda t: t.index_select(0, rt))
        q = qp = qv = None
        if self.queries is not None:
            q, qp, qv = pick(self.queries), pick(self.query_positions), pick(self.query_valid)
        evs = step.tensor("row_evictions", c._row_evictions)
        ctx = EvictionContext(
            keys=keys,
            values=values,
            positions=positions,
            valid=valid,
            candidates=candidates,
            queries=q,
            query_positions=qp,
            query_valid=qv,
            scaling=self.scaling or self.head_dim**-0.5,
            layer_idx=self.layer_idx,
            budget=c.layer_budgets[self.layer_idx],
            row_keys=pick(c._row_keys_tensor(keys.device)),
            eviction_index=pick(evs),
            state=state,
            sinks=c.sinks,
            buffer=c.recent,
            memo={"latest_query": pick(step.latest_positions()), **memo},
        )
        return ctx, forced

    def _select(self, step, rows, keys, values, positions, valid, state) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy selection for ``rows`` (None = all); returns slot indices ``[r, H, slots]`` and the counts kept
        (``[r]``, or ``[r, H]`` with AdaKV; entries of the indices past a head's count are padding).

        ``keys``, ``values`` ``[r, H, S, D]``, ``positions`` ``[r, H, S]``, ``valid`` ``[r, S]`` (``[r, H, S]`` with
        adaptive budgets) hold the ``r`` rows scored (copies when only some rows are). ``state`` maps each of the
        policy's state names to ``[r, H, S]`` float32: the scorer updates it in place or replaces its entries, so on
        return ``state`` holds the new state of those rows' slots, and the caller must write it back with them (see
        :meth:`_write`). The per-row memo (``row_memo``, e.g. how far H2O has accumulated) is written back here, for
        exactly these rows.
        """
        c = self.cache
        sel_rows = None if rows is None else step.tensor(("rows", tuple(rows)), rows)
        memo = {n: m if sel_rows is None else m.index_select(0, sel_rows) for n, m in self.row_memo.items()}
        ctx, forced = self._context(step, sel_rows, keys, values, positions, valid, state, memo)
        r = keys.shape[0]
        keep = torch.full((r,), ctx.budget, dtype=torch.long, device=keys.device)
        sel = c.policy.select(ctx, keep, c.slots, forced, self._allocator(forced) if c.adakv else None)
        n_protected = None if sel.protected is None else sel.protected.sum(-1)  # [r, H]
        if n_protected is not None:
            c._protected = c._protected + n_protected.sum()  # a device tensor: no synchronisation here
        for n, m in self.row_memo.items():
            new = torch.as_tensor(ctx.memo[n], dtype=m.dtype, device=m.device).expand(r)
            if sel_rows is None:
                m.copy_(new)
            else:
                m.index_copy_(0, sel_rows, new)
        if c.record_evictions:
            self.last_eviction = {
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
                "forced": forced.clone(),
                "protected": None if sel.protected is None else sel.protected.clone(),
                "scores": None if sel.scores is None else sel.scores.clone(),
                "kept": sel.indices.clone(),
                "kept_positions": positions.gather(2, sel.indices),
                "n_protect": c.policy.guard.count(ctx.budget, c.sinks) if c.policy.guard is not None else 0,
                "n_protected": torch.zeros(sel.indices.shape[:2], dtype=torch.long, device=keys.device)
                if n_protected is None
                else n_protected,
                "keep": sel.keep.clone(),
            }
        return sel.indices, sel.keep

    def _allocator(self, forced: torch.Tensor):
        """AdaKV counts for :func:`vase.selection.select`: each head keeps its forced slots (sinks, recent window)
        plus its share of the layer's ``H * (budget - forced)`` chosen ones (:func:`vase.budgets.head_counts`, one
        top-k over the layer's heads), at most ``slots`` in all."""
        c = self.cache
        n_forced = forced.sum(-1).view(forced.shape[0], -1)  # [r, 1] or [r, H] (the same for every head in practice)

        def allocate(ctx: EvictionContext, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            most = n_forced.max(-1).values
            n_choose = (keep - most).clamp_min(0)
            floor = float(c.policy.options.get("head_floor", budgets.FLOOR_SHARE))
            counts = budgets.head_counts(scores, ctx.candidates, n_choose, floor, c.slots - int(most.max()))
            return n_forced + counts

        return allocate

    @record_function("vase.compact")
    def _write(self, step, rows, idx: torch.Tensor, keep, keys, values, positions, state) -> None:
        """Gather ``idx`` ``[r, H, kmax]`` from the source tensors into slots ``[0, kmax)`` of ``rows`` in place.

        ``keep``: slots kept per row (a list), or a tensor ``[r]`` / ``[r, H]`` (per head, adaptive budgets); the
        entries of ``idx`` past it are freed (position -1)."""
        r, h, kmax = idx.shape
        k = keys.gather(2, idx.unsqueeze(-1).expand(r, h, kmax, keys.shape[-1]))
        v = values.gather(2, idx.unsqueeze(-1).expand(r, h, kmax, values.shape[-1]))
        p = positions.gather(2, idx)
        if isinstance(keep, torch.Tensor):
            keep_t = keep.view(r, -1, 1)
        else:
            keep_t = step.tensor(("keep", rows is None), keep).view(r, 1, 1)
        free = torch.arange(kmax, device=idx.device).view(1, 1, kmax) >= keep_t
        p = p.masked_fill(free, -1)
        st = {n: s.gather(2, idx).masked_fill(free, 0.0) for n, s in state.items()}
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

    def _compact_rows(self, step: _Step) -> None:
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

    def _write_staged(self, step: _Step) -> None:
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
        self.queries = self.query_positions = self.query_valid = None
        self._q_next = 0
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


class EvictingCache(Cache):
    """A KV cache held at ``budget + buffer`` tokens per layer by an eviction policy.

    Example::

        cache = vase.EvictingCache(model, policy="vase", budget=1024)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)   # or cache=cache
        print(cache.stats().line())

    Creating the cache installs vase's attention function on ``model`` (:func:`vase.attention.install`): it saves
    the post-RoPE queries for scoring, then calls the model's own sdpa / eager / flash_attention_2 function with a
    mask over physical slots. The kept layers of a hybrid model get transformers' own mask and attention, unchanged
    (learned sinks, soft-capping, sliding windows, per-layer RoPE all stay the model's). Scoring recomputes attention
    from saved queries with the layer's own ``scaling`` (Gemma's ``query_pre_attn_scalar``, Gemma 4's 1.0), but
    without gpt-oss's learned sinks or a logit soft-cap. Neither changes the order of one query's weights over the
    keys (a soft-cap is increasing in the logit; a sink only adds to the softmax denominator), only their scale, hence
    how much each saved query counts in the mean over the window; the model's attention applies both.

    Args:
        model: a ``transformers`` causal LM: full-attention layers (Llama, Qwen3, DeepSeek-R1-Distill, ...), or a
            hybrid model whose other layers are sliding-window or linear attention (gpt-oss, Gemma 3, OLMo 3,
            Qwen3-Next, Qwen3.5): only the full-attention layers evict; the others keep the state transformers'
            default cache gives them, in the same cache object (see :mod:`vase.hybrid`).
        policy: a policy name (see :data:`vase.POLICY_NAMES`) or a built :class:`vase.Policy`.
        budget: tokens kept per (row, layer, KV head) after each eviction (on average over the heads and layers with
            the policy options ``head_budget='adakv'`` / ``layer_budget='pyramid'``, at most ``budget_cap`` x budget
            each; the buffers then hold ``budget_cap`` x budget + buffer slots per head, see the module docstring);
            for the selection policy ``quest``, which keeps every token, the tokens each query attends to (see
            :mod:`vase.pages`).
        buffer: recent window in tokens, always kept; the cache is compacted every ``buffer`` decode steps. The
            policy option ``recent`` keeps another count of newest tokens instead (see :func:`recent_window`).
        sinks: first tokens of each row always kept (attention sinks), default 4.
        window: saved queries per layer for attention-based scorers (default: the policy's window; the buffer for
            the published preset).
        seed: int (row ``b`` uses ``seed + b``) or one int per row: keys the random choices of each row.
        compress_prompt: compress a prompt longer than the budget at prefill; False keeps it dense until the first
            eviction, as the paper's code does: the first eviction then comes at the first multiple of ``buffer``
            tokens above the prompt (and at least at ``budget + buffer``). Default: the policy's option ``prompt``
            ('compress' unless the policy says 'dense', as ``preset='paper'`` does).
        record_evictions: keep the details of each layer's last eviction in ``layer.last_eviction`` (tests,
            inspection; ``n_protect`` is the guard's count or cap, ``n_protected`` ``[rows, KV heads]`` how many
            each head protected).
        profile: synchronize the GPU around evictions so ``eviction_seconds`` is exact (slower).
        compileable: decode steps as fixed-shape graphs for ``torch.compile`` / CUDA graphs (see "Compiled
            decoding" below); ``is_compileable`` is then True.
        max_cache_len: with ``compileable``, for a policy that never evicts (``full``): tokens its buffers hold
            from the start (prompt + new tokens + 1), so they never grow (a growth means a new graph).
        **policy_options: options of the policy (window, kernel, pool, guard, protect_share, guard_mode, selector,
            temperature, lam, rank, head_budget, layer_budget, budget_cap; see :func:`vase.make_policy`).

    Compiled decoding (``compileable=True``): a decode step (one token per row, after the first forward) is a
    fixed-shape graph. Each evicting layer writes the token at its row's fill (``_fill_t``, a ``[B]`` int64 device
    tensor), returns its whole buffers ``[B, kv_heads, capacity, head_dim]``, and attends with a mask built from
    ``_fill_t`` (``[B, 1, 1, capacity]``; per KV head from the slot positions with adaptive budgets); the query goes
    into the ring at a device pointer; the counters advance in place after the last layer. No Python value that
    changes from step to step is read inside the step and nothing in it synchronizes with the host. The eager part
    runs before the step in :meth:`prepare_decode`: the compaction of the rows the previous step filled (every
    ``buffer`` steps, the same code and result as the uncompiled cache) and the host bookkeeping.
    ``model.generate(..., compile_config=vase.compile_config(device))`` calls it through the mask transformers builds
    before each compiled step (vase's mask function then returns its own mask); an uncompiled forward calls it from
    vase's pre-hook. Greedy outputs equal the uncompiled cache's token for token (``tests/test_compile.py``), with one
    graph per model, batch size and buffer size (a policy with saved queries and one without differ). Not for
    flash-attention, hybrid models or ``quest`` (clear errors).

    Raises:
        ValueError: budget not larger than sinks + buffer, buffer < 1, sinks < 0, window < 1, an unknown policy
            or policy option, protected share outside [0, 1), sampling temperature <= 0, for the published preset
            (``preset='paper'``) a budget that is not a multiple of the buffer or a window other than the buffer,
            a model with a layer kind vase cannot hold (see :func:`check_model_supported`), adaptive budgets with an
            attention other than sdpa or eager (flash-attention has no per-head mask) or a ``budget_cap`` below the
            first layer's pyramid budget, for ``quest`` a budget below its forced pages or a flash-attention model,
            or, at the first forward, keys of another shape than the model's, a cache reused for another model or
            batch size, or reused without :meth:`reset` for a new prompt no longer than the tokens it holds; with
            ``compileable``, see :func:`check_compileable`.
    """

    def __init__(
        self,
        model,
        policy: str | Policy = "vase",
        budget: int = 1024,
        buffer: int = 64,
        sinks: int = 4,
        window: int | None = None,
        seed: int | Sequence[int] = 0,
        compress_prompt: bool | None = None,
        record_evictions: bool = False,
        profile: bool = False,
        compileable: bool = False,
        max_cache_len: int | None = None,
        **policy_options,
    ):
        check_sizes(budget, buffer, sinks, window)
        if isinstance(seed, (list, tuple)):
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in seed) or not seed:
                raise ValueError(f"seed must be an int or a non-empty list of ints, got {seed!r}")
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int or a list of ints, got {seed!r}")
        self.policy = make_policy(policy, **policy_options)
        config = model.config.get_text_config(decoder=True)
        check_model_supported(config)
        self.budget, self.buffer, self.sinks = budget, buffer, sinks
        self.recent = recent_window(self.policy, budget, buffer, sinks)
        # the published method scores with the last `buffer` queries: its window follows the buffer
        default_window = buffer if self.policy.published else self.policy.window
        self.window = window if window is not None else default_window
        if not self.policy.window:
            self.window = 0
        self.seed = seed
        self.compress_prompt = self.policy.compress_prompt if compress_prompt is None else bool(compress_prompt)
        if self.policy.published:
            check_published(self.policy, budget, buffer, self.window)
        if self.policy.sparse is not None:
            self.policy.sparse.check(budget, sinks, attn.base_implementation(model))
        self.record_evictions = record_evictions
        self.profile = profile
        # One entry per decoder layer: full-attention layers evict, the others (sliding window, linear attention) are
        # transformers' own layer classes, as in DynamicCache(config=...) (see vase.hybrid).
        self._plan = hybrid.plan_layers(config)
        self._evicting = [p.index for p in self._plan if p.evicts]
        first = self._plan[self._evicting[0]]
        self.num_kv_heads, self.head_dim = first.kv_heads, first.head_dim
        self.num_layers = len(self._evicting)  # evicting layers: a forward pass is done when all of them are
        # adaptive budgets (policy options head_budget / layer_budget): the budget of each evicting layer (by model
        # layer index; PyramidKV's depth runs over the evicting layers) and the physical slots per (layer, KV head)
        # for kept tokens; uniform: every layer keeps `budget` in `budget` slots
        per_layer, self.slots = budgets.layout(self.policy.options, budget, self.num_layers, sinks + self.recent)
        self.layer_budgets = dict(zip(self._evicting, per_layer))
        self.adaptive = self.policy.adaptive_budgets
        self.adakv = self.adaptive and self.policy.options.get("head_budget") == "adakv"
        if self.adaptive:
            budgets.check_head_budgets_supported(attn.base_implementation(model))
        self.compileable = bool(compileable)
        self.max_cache_len = max_cache_len
        if self.compileable:
            check_compileable(self.policy, self._plan, attn.base_implementation(model), max_cache_len)
        self._model_ref = weakref.ref(model)
        layers = [EvictingLayer(self, p.index) if p.evicts else hybrid.kept_layer(p) for p in self._plan]
        super().__init__(layers=layers)
        attn.install(model)
        self._clear()

    def _clear(self) -> None:
        self.batch: int | None = None
        self.capacity: int | None = None
        self._row_limit: list[int] = []
        self._fill: list[int] = []
        self._seen = 0
        self._real: list[int] = []
        self._row_evictions: list[int] = []
        self._evictions = 0
        self._tokens_evicted = 0
        self._eviction_seconds = 0.0
        self._protected: torch.Tensor | int = 0
        self._row_keys: torch.Tensor | None = None
        self._step: _Step | None = None
        self._pending_mask: torch.Tensor | None = None
        # compiled decoding (compileable=True): see "Compiled decoding" in the class docstring
        self._decode_ok = False  # decode steps take the static path (compileable, after the first forward)
        self._phase = "idle"  # 'planned' by prepare_decode, 'ran' after the step, 'idle' once flushed
        self._static_step: _Step | None = None
        self._static_forward = False
        self._counters_synced = False
        self._fill_t = self._real_t = self._seen_t = self._qnext_t = self._slot_ids = None

    def reset(self) -> None:
        """Empty the cache so it can be used again (any batch size) with the same model."""
        for p in self._plan:
            if p.evicts:
                self.layers[p.index].reset()
            else:  # transformers' reset zeroes a layer's tensors in place (same batch size): start afresh instead
                self.layers[p.index] = hybrid.kept_layer(p)
        self._clear()

    # ------------------------------------------------------------------------------------- compiled decoding
    def prepare_decode(self) -> None:
        """The eager part of the next decode step (one token per row) of a compileable cache: evict the rows the last
        step filled, update the host bookkeeping, plan the step. Idempotent until the step runs.

        ``model.generate(..., compile_config=...)`` calls it for you (through the mask transformers builds before each
        compiled step), and so does an uncompiled forward. A hand-written loop around a compiled forward should call
        it before each step (and pass ``position_ids``): otherwise the compiled forward calls it itself, at the cost
        of a graph break at the start of each step.

        Raises:
            RuntimeError: for a cache made without ``compileable=True``, or before the first forward (the prefill).
        """
        if not self.compileable:
            raise RuntimeError("prepare_decode() is for a cache made with EvictingCache(..., compileable=True)")
        if not self._decode_ok:
            raise RuntimeError("prepare_decode() comes after the first forward pass (the prefill), before each decode")
        if self._phase == "planned":
            return
        self._flush()
        layer = self.layers[self._evicting[0]]
        self._step = None
        self._static_step = self._step_for(self.batch, 1, layer.keys.device)
        self._step = None
        if layer.capacity < self._static_step.capacity:  # `full` past its max_cache_len: larger buffers (recompiles)
            warnings.warn(
                f"the {self.policy.name!r} policy's buffers grow from {layer.capacity} to "
                f"{self._static_step.capacity} slots: compiled decode steps are compiled again for the new shape; "
                "give EvictingCache(..., max_cache_len=prompt + new tokens + 1) to allocate them once",
                stacklevel=2,
            )
            for i in self._evicting:
                self.layers[i]._grow(self._static_step.capacity)
            self._counters_synced = False
        if not self._counters_synced:
            self._sync_counters(layer)
        self._phase = "planned"

    def _flush(self) -> None:
        """After a compiled decode step ran: evict the rows it filled (eagerly, outside the graph) and commit it."""
        if self._phase != "ran":
            return
        step, self._static_step = self._static_step, None
        self._phase = "idle"
        if step.evict_rows:
            for i in self._evicting:
                with self._timed(True, self._fill_t.device):
                    self.layers[i]._compact_rows(step)
        self._commit(step)
        for i in self._evicting:
            layer = self.layers[i]
            if layer.queries is not None:
                layer._q_next = (layer._q_next + 1) % layer.queries.shape[2]
        if step.evict_rows:
            self._fill_t.copy_(upload(self._fill, self._fill_t.device))

    @contextmanager
    def _timed(self, evicts, device: torch.device):
        """Around a layer's write (``evicts`` falsy) or eviction: profiler label; for an eviction, its wall time added
        to ``eviction_seconds`` (the GPU synchronized first with ``profile``)."""
        t0 = time.perf_counter()
        with record_function("vase.evict" if evicts else "vase.write"):
            yield
        if evicts:
            if self.profile and device.type == "cuda":
                torch.cuda.synchronize(device)
            self._eviction_seconds += time.perf_counter() - t0

    def _sync_counters(self, layer: EvictingLayer) -> None:
        """Device copies of the host counters, allocated once (their addresses never change, as CUDA graphs need);
        the cache's buffers are marked as static inputs of compiled graphs."""
        dev = layer.keys.device
        values = {
            "_fill_t": upload(self._fill, dev),
            "_real_t": upload(self._real, dev),
            "_seen_t": upload([self._seen], dev).view(()),
            "_qnext_t": upload([layer._q_next], dev),
            "_slot_ids": torch.arange(layer.capacity, device=dev),
        }
        for name, value in values.items():
            held = getattr(self, name)
            if held is None or held.shape != value.shape or held.device != value.device:
                setattr(self, name, value)
                torch._dynamo.mark_static_address(value)
            else:
                held.copy_(value)
        for i in self._evicting:
            lay = self.layers[i]
            tensors = [lay.keys, lay.values, lay.positions, lay.queries, lay.query_positions, lay.query_valid]
            for t in tensors + list(lay.state.values()) + list(lay.row_memo.values()):
                if t is not None:
                    torch._dynamo.mark_static_address(t)
        self._counters_synced = True

    def _begin_static(self) -> None:
        """Start of a compiled decode step (vase's forward pre-hook, inside the graph)."""
        if self._phase != "planned":
            if torch.compiler.is_compiling():
                _prepare_outside_graph(self)
            else:
                self.prepare_decode()
        self._static_forward = True

    # ---------------------------------------------------------------------------------------- step planning
    def _begin_forward(self, model, batch: int, q: int, attention_mask: torch.Tensor | None) -> None:
        """Called by vase's forward pre-hook before a forward pass: validate and stash the padding mask (a decode
        step of a compileable cache: see :meth:`_begin_static`)."""
        if q == 1 and self._decode_ok:
            self._begin_static()
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a compiled forward got several tokens per row on a compileable EvictingCache: compile the decode "
                "steps only (one token per row); the prefill runs uncompiled, as model.generate does"
            )
        self._flush()
        self._phase, self._static_step = "idle", None  # a decode step planned but not run is dropped
        if model is not None and self._model_ref() is not None and model is not _decoder(self._model_ref()):
            raise ValueError(
                "this EvictingCache was created for another model; create one per model with EvictingCache(model, ...)"
            )
        self._check_batch(batch)
        if self._step is not None:
            self._abandon_step()
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("EvictingCache needs a 2-D attention_mask [batch, tokens] (or none), not a 4-D one")
        self._check_continuation(q, attention_mask)
        self._pending_mask = attention_mask

    def _check_continuation(self, q: int, attention_mask: torch.Tensor | None) -> None:
        """Refuse a forward that cannot continue the sequence this cache holds: a cache filled by an earlier
        ``generate`` and reused for a new prompt.

        ``generate`` keeps only the input tokens past ``get_seq_length()`` (it takes the cached ones for a prefix of
        the input): a new prompt no longer than the tokens held leaves nothing (``q == 0``). A direct forward with its
        own 2-D mask must cover the tokens held plus the new ones, as transformers' masks do. (A new prompt longer
        than the tokens held looks like a continuation from the inputs alone: reset the cache between prompts.)
        """
        held = self._seen
        advice = "call cache.reset() or create a new EvictingCache for each new prompt"
        if q == 0 and held:
            raise ValueError(
                f"this EvictingCache already holds {held} tokens of an earlier sequence and the input adds none to "
                f"them (a new prompt of at most {held} tokens?): {advice}"
            )
        if q == 0:
            raise ValueError("EvictingCache got an empty input (0 tokens): give at least one token")
        if attention_mask is not None and held and attention_mask.shape[-1] != held + q:
            raise ValueError(
                f"this EvictingCache already holds {held} tokens, but the attention_mask covers "
                f"{attention_mask.shape[-1]} tokens for {q} new ones ({held} + {q} expected; a new prompt on a "
                f"filled cache?): {advice}"
            )

    def _check_batch(self, batch: int) -> None:
        if self.batch is not None and batch != self.batch:
            raise ValueError(
                f"this EvictingCache holds a batch of {self.batch} rows but got {batch}; call cache.reset() or "
                "create a new cache for a different batch size"
            )

    def _abandon_step(self) -> None:
        if self._step.layers_done > 0:
            raise RuntimeError(
                "a previous forward pass stopped midway through the cache (an exception inside the model?); "
                "the cache is inconsistent: call cache.reset() and start again"
            )
        self._step = None

    def _check_keys(self, layer_idx: int, key_states: torch.Tensor) -> None:
        plan = self._plan[layer_idx]
        h, d = key_states.shape[1], key_states.shape[-1]
        if h != plan.kv_heads or d != plan.head_dim:
            raise ValueError(
                f"got keys with {h} KV heads of dim {d} in layer {layer_idx}, but this EvictingCache was made for a "
                f"model with {plan.kv_heads} KV heads of dim {plan.head_dim} there: create one per model"
            )

    def _step_for(self, b: int, q: int, device: torch.device) -> _Step:
        """The plan of the forward pass in progress (made at its first layer): ``b`` rows of ``q`` new tokens."""
        if self._step is not None:
            return self._step
        self._check_batch(b)
        mask, self._pending_mask = self._pending_mask, None
        if self.batch is None:
            self.batch = b
            self._fill = [0] * b
            self._real = [0] * b
            self._row_evictions = [0] * b
        new_valid = None
        if mask is not None and q > 1:
            new_valid = mask[:, -q:].to(device=device, dtype=torch.bool)
            counts = new_valid.sum(-1).tolist()
            if all(cnt == q for cnt in counts):
                new_valid = None
        else:
            counts = [q] * b
        fill = list(self._fill)
        n = [f + cnt for f, cnt in zip(fill, counts)]
        if self.capacity is None:
            # A row evicts when its fill reaches its limit: budget + buffer; with a dense prompt, until its first
            # eviction, the first multiple of the buffer above its prompt (as the reference code: it compacts when
            # the length exceeds the budget and is a multiple of the buffer), at least budget + buffer. Per row, so
            # rows stay independent.
            self._row_limit = [self._first_limit(cnt) for cnt in n]
            self.capacity = max(self._row_limit)
            if self.policy.evicts:  # after a compaction a row holds `slots` (> budget with adaptive budgets)
                self.capacity = max(self.capacity, self.slots + self.buffer)
            elif self.max_cache_len:  # a never-evicting policy with a known length: allocated once
                self.capacity = max(self.capacity, self.max_cache_len)
        if self.policy.evicts:
            limit = self._limits()
            evict_rows = [i for i, (cnt, lim) in enumerate(zip(n, limit)) if cnt >= lim]
            keep = [self.slots if cnt >= lim else cnt for cnt, lim in zip(n, limit)]
        else:
            evict_rows, keep = [], n
            if max(n) >= self.capacity:
                self.capacity = max(n) + self.budget
        append = q == 1 and self.layers[self._evicting[0]].is_initialized
        uniform = new_valid is None and len(set(fill)) == 1
        self._step = _Step(
            q=q,
            append=append,
            fill_before=fill,
            counts=counts,
            keep=keep,
            evict_rows=evict_rows,
            seen_before=self._seen,
            real_before=list(self._real),
            new_valid=new_valid,
            uniform=uniform,
            device=device,
            capacity=self.capacity,
        )
        return self._step

    def _first_limit(self, prompt: int) -> int:
        """Fill (tokens) at which a row holding ``prompt`` tokens after its prefill first evicts."""
        if self.compress_prompt and self.policy.evicts:
            return self.budget + self.buffer
        if not self.policy.evicts:
            return max(self.budget, prompt) + self.buffer
        return max(self.budget, (prompt // self.buffer) * self.buffer) + self.buffer

    def room(self) -> list[int]:
        """Tokens each row can take before its next eviction (the eviction happens at the token that fills it).

        Known after the first forward pass; used by :func:`vase.fidelity.replay` to cut teacher-forced chunks exactly
        where token-by-token decoding would evict.

        Raises:
            RuntimeError: before the first forward pass, or for a policy that never evicts.
        """
        if self.capacity is None or not self.policy.evicts:
            raise RuntimeError("room() is known after the first forward pass, for an evicting policy")
        self._flush()
        return [lim - f for lim, f in zip(self._limits(), self._fill)]

    def _limits(self) -> list[int]:
        """Fill (slots) at which each row evicts next: its first limit until its first eviction, then
        slots + buffer (slots = budget, unless adaptive budgets hold up to ``budget_cap`` x budget per head)."""
        return [self.slots + self.buffer if e else lim for e, lim in zip(self._row_evictions, self._row_limit)]

    def _layer_done(self, layer: EvictingLayer) -> None:
        step = self._step
        step.layers_done += 1
        if step.layers_done < self.num_layers:
            return
        self._commit(step)
        self._step = None
        self._counters_synced = False  # an eager step: the device counters of compiled decoding are stale

    def _commit(self, step: _Step) -> None:
        """The host bookkeeping of a finished forward pass: fills, positions, eviction counts."""
        if step.evict_rows:
            # tokens held per (layer, KV head) on average: the fill, less the dead slots of a row compacted before
            gap = [self.slots - self.budget if self._row_evictions[i] else 0 for i in step.evict_rows]
            self._evictions += 1
            self._tokens_evicted += sum(
                step.fill_before[i] + step.counts[i] - g - self.budget for i, g in zip(step.evict_rows, gap)
            )
        for i in step.evict_rows:
            self._row_evictions[i] += 1
        self._fill = list(step.keep)
        self._real = [r + c for r, c in zip(self._real, step.counts)]
        self._seen += step.q
        self._decode_ok = self.compileable

    def _row_keys_tensor(self, device) -> torch.Tensor:
        if self._row_keys is None or self._row_keys.device != device:
            seeds = self.seed if isinstance(self.seed, (list, tuple)) else [self.seed + i for i in range(self.batch)]
            if len(seeds) != self.batch:
                raise ValueError(f"got {len(seeds)} seeds for a batch of {self.batch} rows: give one per row")
            self._row_keys = upload([rng.row_key(s) for s in seeds], device)
        return self._row_keys

    # ------------------------------------------------------------------------------------------ Cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The model's cache update for layer ``layer_idx``: an evicting layer (see :meth:`EvictingLayer.update`), or
        a kept layer of a hybrid model, whose returned keys vase's attention function then passes through unchanged
        with transformers' own mask."""
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not self._plan[layer_idx].evicts:
            attn.pass_through(keys)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical length: tokens seen so far (padding columns included), as RoPE positions need (inside a compiled
        decode step: a 0-d int64 device tensor, so the graph does not depend on the value)."""
        if torch.compiler.is_compiling() and self._decode_ok:
            return self._seen_t
        self._flush()
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """Sizes of the mask transformers builds for ``layer_idx``: logical ones for an evicting layer (vase's attention
        function replaces that mask by its own over physical slots, so none is built), the layer's own for a kept
        sliding-window layer (its usual mask is built and used)."""
        evicts = not isinstance(self.layers[layer_idx], CacheLayerMixin) or self._plan[layer_idx].evicts
        if self._decode_ok and query_length == 1:
            if torch.compiler.is_compiling():  # inside a compiled step (a hand-written loop): no mask is built
                attn.mask_for(True)
                return self.capacity, 0
            if not attn.evicting_forward():
                # transformers' mask creation before a compiled decode step (model.generate with a compileable
                # cache): the eager part of the step runs now, and the mask handed to the graph is vase's own
                self.prepare_decode()
                attn.mask_for(True, override=self._eager_mask)
                return self.capacity, 0
        if self.compileable and not attn.evicting_forward() and evicts:
            # the same mask creation before the (uncompiled) prefill: keep the 2-D padding mask for vase's pre-hook
            attn.mask_for(True, override=lambda kind, dtype, kwargs: kwargs.get("attention_mask"))
            return self._seen + query_length, 0
        attn.mask_for(evicts)
        if evicts:
            return self._seen + query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def _eager_mask(self, kind: str, dtype: torch.dtype, kwargs: dict) -> torch.Tensor:
        """``[B, 1, 1, capacity]``: the slots each row holds in the planned decode step, the new token's included, built
        before the compiled step. It stands in for the mask transformers would build; vase's attention builds its own
        in the graph (per KV head with adaptive budgets, where each layer's is different)."""
        return attn.mask_in_kind(self._decode_slot_mask(), kind, dtype)

    def _decode_slot_mask(self) -> torch.Tensor:
        """``[B, 1, 1, capacity]`` bool: the slots each row holds in the decode step, its new token's included."""
        b, cap = self._fill_t.shape[0], self._slot_ids.shape[0]
        return (self._slot_ids.view(1, cap) <= self._fill_t.view(b, 1)).view(b, 1, 1, cap)

    @property
    def is_compileable(self) -> bool:
        """True for a cache made with ``compileable=True``: ``model.generate(..., compile_config=...)`` then compiles
        its decode steps (see "Compiled decoding" in the class docstring)."""
        return self.compileable

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def fill(self) -> list[int]:
        """Filled slots of each row (tokens)."""
        self._flush()
        return list(self._fill)

    def stats(self) -> CacheStats:
        """Current :class:`CacheStats` (bytes: see its attributes; the kept layers of a hybrid model count in both
        ``bytes_held`` and ``bytes_full``)."""
        self._flush()
        held = full = other = live = 0
        for p in self._plan:
            layer = self.layers[p.index]
            if not p.evicts:
                other += hybrid.state_bytes(layer)
            elif layer.is_initialized:
                held += hybrid.state_bytes(layer)
                held += layer.pages.nbytes if layer.pages is not None else 0  # quest's page metadata
                b, h = layer.keys.shape[:2]
                entry = (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
                full += b * h * self._seen * entry
                live += int((layer.positions >= 0).sum()) * entry
        held += other
        full += other
        batch = self.batch or 0
        return CacheStats(
            policy=self.policy.name,
            budget=self.budget,
            buffer=self.buffer,
            batch=batch,
            layers=self.num_layers,
            tokens_seen=self._seen,
            real_tokens=list(self._real),
            slots_held=max(self._fill, default=0),
            capacity=self.capacity or 0,
            evictions=self._evictions,
            tokens_evicted=self._tokens_evicted,
            bytes_held=held,
            bytes_full=full,
            eviction_seconds=self._eviction_seconds,
            protected=int(self._protected),
            other_layers=len(self._plan) - len(self._evicting),
            bytes_other=other,
            bytes_live=live,
        )


@torch.compiler.disable
def _prepare_outside_graph(cache: EvictingCache) -> None:
    """:meth:`EvictingCache.prepare_decode` run eagerly from inside a compiled forward (a graph break)."""
    cache.prepare_decode()


def check_compileable_policy(policy: Policy) -> None:
    """Raise a clear ValueError for a policy compiled decoding cannot take: the selection policy ``quest``."""
    if policy.sparse is not None:
        raise ValueError(f"compiled decoding does not support the selection policy {policy.name!r}: use another one")


def check_compileable(policy: Policy, plan, attn_impl: str, max_cache_len: int | None) -> None:
    """The rules of compiled decoding (``EvictingCache(..., compileable=True)``), as clear errors.

    Raises:
        ValueError: flash-attention (its padded path is not a fixed-shape graph: use sdpa), a hybrid model (its
            sliding-window layers are transformers' dynamic ones), the selection policy ``quest`` (its page table
            grows with the sequence), a ``max_cache_len`` that is not a positive integer.
    """
    if attn_impl not in ("sdpa", "eager"):
        raise ValueError(
            f"compiled decoding needs sdpa or eager attention, not {attn_impl!r}: load the model with "
            "attn_implementation='sdpa'"
        )
    if any(not p.evicts for p in plan):
        raise ValueError(
            "compiled decoding supports models whose layers are all full attention; this hybrid model's "
            "sliding-window or linear layers are kept by transformers' dynamic layers: use compileable=False"
        )
    check_compileable_policy(policy)
    if max_cache_len is not None and (not _is_int(max_cache_len) or max_cache_len < 1):
        raise ValueError(f"max_cache_len must be a positive number of tokens, got {max_cache_len!r}")


def _decoder(model):
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    return dec if dec is not None else model


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(budget: int | None, buffer: int, sinks: int, window: int | None = None) -> None:
    """The size rules of an :class:`EvictingCache` (tokens; ``budget`` None: not known yet, e.g. from a ratio).

    Raises:
        ValueError: a non-integer size, buffer < 1, sinks < 0, budget not larger than sinks + buffer, window < 1.
    """
    for name, value in (("budget", budget), ("buffer", buffer), ("sinks", sinks)):
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be an integer number of tokens, got {value!r}")
    if buffer < 1:
        raise ValueError(f"buffer must be >= 1 token, got {buffer}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0 tokens, got {sinks}")
    if budget is not None and budget <= sinks + buffer:
        raise ValueError(
            f"budget ({budget}) must be larger than sinks + buffer ({sinks} + {buffer} = {sinks + buffer}): "
            "raise the budget or lower the buffer"
        )
    if window is not None and (not _is_int(window) or window < 1):
        raise ValueError(f"window must be a positive number of queries, got {window!r}")


def recent_window(policy: Policy, budget: int | None, buffer: int, sinks: int) -> int:
    """The newest tokens each eviction keeps: the policy option ``recent``, or ``buffer`` when it is not set.

    ``recent`` below the buffer lets the policy evict some of the tokens written since the last compaction (as
    kvpress does with its own window); above it, protects more than one compaction interval.

    Raises:
        ValueError: ``sinks + recent`` not below the budget (nothing would be left to choose).
    """
    recent = buffer if policy.recent is None else policy.recent
    if budget is not None and sinks + recent >= budget:
        raise ValueError(
            f"recent ({recent}) + sinks ({sinks}) must be below the budget ({budget}): lower recent or raise the budget"
        )
    return recent


def published_budget(budget: int, buffer: int) -> int:
    """``budget`` rounded to the nearest multiple of ``buffer`` (at least two buffers): the budgets the published
    method can take, for budgets derived from a compression ratio."""
    return max(round(budget / buffer), 2) * buffer


def ratio_budget(total_tokens: float, ratio: float, buffer: int, sinks: int = 4, published: bool = False) -> int:
    """The budget (tokens per KV head) that compresses ``total_tokens`` (prompt + new tokens) by ``ratio``:
    ``ceil(total / ratio)``, at least ``sinks + buffer + 1`` (room for one candidate); with ``published`` (a run
    holding the published method, ``preset='paper'``) rounded by :func:`published_budget`, for every policy of the
    run alike. Used by ``vase generate --ratio``, the evaluation sweeps and the fidelity replays."""
    budget = max(math.ceil(total_tokens / ratio), sinks + buffer + 1)
    return published_budget(budget, buffer) if published else budget


def check_published(policy: Policy, budget: int, buffer: int, window: int) -> None:
    """The rules the published method's code needs (``preset='paper'``), as clear errors.

    Raises:
        ValueError: a budget that is not a multiple of the buffer (the reference compacts when the cache length is a
            multiple of the buffer, so it only ever holds such budgets), or an observation window other than the
            buffer (the reference keeps the last ``buffer`` queries).
    """
    if budget % buffer:
        lo, hi = (budget // buffer) * buffer, (budget // buffer + 1) * buffer
        hint = f"{lo} or {hi}" if lo > buffer else f"{hi}"
        raise ValueError(
            f"the published method ({policy.name}:preset=paper) needs a budget that is a multiple of the buffer "
            f"({buffer}); got {budget}: use {hint}"
        )
    if policy.window and window != buffer:
        raise ValueError(
            f"the published method ({policy.name}:preset=paper) scores with the last `buffer` queries: window must "
            f"equal the buffer ({buffer}), got {window}"
        )


def check_model_supported(config) -> None:
    """Raise a clear ValueError if ``config`` (a decoder config) has layers an :class:`EvictingCache` cannot hold.

    Full-attention layers are evicted; sliding-window and linear-attention layers (gpt-oss, Gemma 3, OLMo 3,
    Qwen3-Next, Qwen3.5) are kept as transformers' default cache holds them. Refused, with the reason: chunked
    attention, short-convolution and combined linear/attention layers, sparse-indexer layers, KV sharing between
    layers, and models without any full-attention layer (see :func:`vase.hybrid.plan_layers`).
    """
    hybrid.plan_layers(config)

"""The eviction schedule of an :class:`~vase.EvictingCache`: when each row evicts, and the plan of each forward.

Bookkeeping, shared by all evicting layers because every layer sees the same tokens on the same schedule:

* the *logical* length (tokens seen, padding columns included) drives RoPE positions and ``get_seq_length``;
* the *physical* fill of each row (slots holding real tokens, packed at the front in position order);
* each slot remembers the logical position of its token (per layer and KV head, since heads keep different tokens).

A decode step writes its token in place at the row's fill. After the attention of that step, a row whose fill reached
``slots + buffer`` is compacted in place back to ``slots`` (``budget``, or the cap of adaptive budgets): its first
``sinks`` tokens and its last ``recent`` tokens stay, the policy chooses the rest, per (layer, KV head). Several new
tokens at once (prefill, chat continuation) are attended together with the cache, then written packed: padding takes
no slot, and a row that does not fit is compressed by the same policy right away (observation window = the last
queries of the prompt). With a dense prompt (``compress_prompt=False``, as the paper's code) a row first evicts at the
first multiple of ``buffer`` above its prompt (at least ``budget + buffer``). Each row evicts on its own schedule with
its own random key, so a row of a ragged batch behaves exactly as it would alone.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from ..core import rng
from ..core.config import compiled_capacity
from .step import StepPlan, upload

if TYPE_CHECKING:
    from .layer import EvictingLayer


def decoder_of(model):
    """The decoder module of a causal LM (where vase's forward hooks sit), or the model itself."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    return dec if dec is not None else model


class ScheduleMixin:
    """Step planning and host bookkeeping of an :class:`~vase.EvictingCache` (see the module docstring)."""

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
        if model is not None and self._model_ref() is not None and model is not decoder_of(self._model_ref()):
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

    def _step_for(self, b: int, q: int, device: torch.device) -> StepPlan:
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
                self.capacity = self._graph_capacity(max(self.capacity, self.slots + self.buffer))
            elif self.max_cache_len:  # a never-evicting policy with a known length: allocated once
                self.capacity = self._graph_capacity(max(self.capacity, self.max_cache_len))
        if self.policy.evicts:
            limit = self._limits()
            evict_rows = [i for i, (cnt, lim) in enumerate(zip(n, limit)) if cnt >= lim]
            keep = [self.slots if cnt >= lim else cnt for cnt, lim in zip(n, limit)]
        else:
            evict_rows, keep = [], n
            if max(n) >= self.capacity:
                self.capacity = self._graph_capacity(max(n) + self.budget)
        append = q == 1 and self.layers[self._evicting[0]].is_initialized
        uniform = new_valid is None and len(set(fill)) == 1
        quant = self._plan_quantization(keep, evict_rows, append) if self.quantized else (None, [])
        self._step = StepPlan(
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
            qlimit=quant[0],
            flush_rows=quant[1],
        )
        return self._step

    def _graph_capacity(self, needed: int) -> int:
        """Slots to allocate for ``needed``: itself, except in compiled decoding when ``needed`` follows the prompt
        (the ``full`` policy, a budget from a compression ratio, a dense prompt longer than the budget), where it is
        rounded up to a power of two (:func:`vase.core.config.compiled_capacity`) so that one process compiles at
        most one decode graph per power of two, whatever the prompt lengths."""
        if not self.compileable:
            return needed
        fixed = self.slots + self.buffer if self.policy.evicts and self.config.ratio is None else 0
        return needed if needed <= fixed else compiled_capacity(needed)

    def _first_limit(self, prompt: int) -> int:
        """Fill (tokens) at which a row holding ``prompt`` tokens after its prefill first evicts."""
        if self.compress_prompt and self.policy.evicts:
            return self.budget + self.buffer
        if not self.policy.evicts:
            return max(self.budget, prompt) + self.buffer
        return max(self.budget, (prompt // self.buffer) * self.buffer) + self.buffer

    def room(self) -> list[int]:
        """Tokens each row can take before its next eviction (the eviction happens at the token that fills it); with
        ``kv_bits``, before its next eviction or quantization of its recent tokens, whichever comes first (the
        ``full`` policy included).

        Known after the first forward pass; used by :func:`vase.harness.fidelity.replay` to cut teacher-forced chunks
        exactly where token-by-token decoding would evict (or quantize).

        Raises:
            RuntimeError: before the first forward pass, or for a policy that never evicts (without ``kv_bits``).
        """
        if self.capacity is None or not (self.policy.evicts or self.quantized):
            raise RuntimeError("room() is known after the first forward pass, for an evicting or quantizing policy")
        self._flush()
        if self.quantized:
            return self._quantization_room()
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

    def _commit(self, step: StepPlan) -> None:
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
        if step.qlimit is not None:
            self._qlimit = list(step.qlimit)
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

"""The forward passes of an :class:`~vase.EvictingCache`: checked at their start, planned once, committed at the end.

transformers' side of the sequence model (:mod:`vase.core.sequence`): the cache's rows are the batch rows ``0 ..
B-1``; a forward pass brings ``q`` columns per row, some of them padding (left padding of a ragged prompt, a chat
continuation with its 2-D mask); the logical length transformers reads (``get_seq_length``, RoPE positions) counts
the columns, the schedule the real tokens. :class:`ForwardPlanner` turns a forward into the sequence model's step
(:meth:`vase.core.schedule.Schedule.plan`, :meth:`vase.core.ring.QueryRing.plan`) plus the padded layout
(:class:`vase.hf.step.ForwardStep`), sizes the buffers (the capacity), and commits the step after the last layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.sizes import compiled_capacity
from .step import ForwardStep

if TYPE_CHECKING:
    from .cache import EvictingCache


def decoder_of(model):
    """The decoder module of a causal LM (where vase's forward hooks sit), or the model itself."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    return dec if dec is not None else model


class ForwardPlanner:
    """The per-forward bookkeeping of one cache (see the module docstring).

    Attributes:
        batch: rows (None before the first forward); capacity: slots allocated per row and layer; seen: the logical
        length (columns seen, padding included); step: the forward in progress (None between forwards).
    """

    def __init__(self, cache: EvictingCache):
        self.cache = cache
        self.clear()

    def clear(self) -> None:
        self.batch: int | None = None
        self.capacity: int | None = None
        self.seen = 0
        self.step: ForwardStep | None = None
        self.pending_mask: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------ checks
    def begin(self, model, batch: int, q: int, attention_mask: torch.Tensor | None) -> None:
        """Before a forward pass (vase's pre-hook): validate it and keep its 2-D padding mask; a decode step of a
        compileable cache starts its compiled path instead."""
        c = self.cache
        compiled = c.compiled
        if compiled is not None and q == 1 and compiled.decode_ok:
            compiled.begin()
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a compiled forward got several tokens per row on a compileable EvictingCache: compile the decode "
                "steps only (one token per row); the prefill runs uncompiled, as model.generate does"
            )
        if compiled is not None:
            compiled.flush()
            compiled.phase, compiled.step = "idle", None  # a decode step planned but not run is dropped
        if model is not None and c._model_ref() is not None and model is not decoder_of(c._model_ref()):
            raise ValueError(
                "this EvictingCache was created for another model; create one per model with EvictingCache(model, ...)"
            )
        self.check_batch(batch)
        if self.step is not None:
            if self.step.layers_done > 0:
                raise RuntimeError(
                    "a previous forward pass stopped midway through the cache (an exception inside the model?); "
                    "the cache is inconsistent: call cache.reset() and start again"
                )
            self.step = None
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("EvictingCache needs a 2-D attention_mask [batch, tokens] (or none), not a 4-D one")
        self.check_continuation(q, attention_mask)
        self.pending_mask = attention_mask

    def check_continuation(self, q: int, attention_mask: torch.Tensor | None) -> None:
        """Refuse a forward that cannot continue the sequence this cache holds: a cache filled by an earlier
        ``generate`` and reused for a new prompt.

        ``generate`` keeps only the input tokens past ``get_seq_length()`` (it takes the cached ones for a prefix of
        the input): a new prompt no longer than the tokens held leaves nothing (``q == 0``). A direct forward with its
        own 2-D mask must cover the tokens held plus the new ones, as transformers' masks do. (A new prompt longer
        than the tokens held looks like a continuation from the inputs alone: reset the cache between prompts.)
        """
        held = self.seen
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

    def check_batch(self, batch: int) -> None:
        if self.batch is not None and batch != self.batch:
            raise ValueError(
                f"this EvictingCache holds a batch of {self.batch} rows but got {batch}; call cache.reset() or "
                "create a new cache for a different batch size"
            )

    def check_keys(self, layer_idx: int, key_states: torch.Tensor) -> None:
        plan = self.cache._plan[layer_idx]
        h, d = key_states.shape[1], key_states.shape[-1]
        if h != plan.kv_heads or d != plan.head_dim:
            raise ValueError(
                f"got keys with {h} KV heads of dim {d} in layer {layer_idx}, but this EvictingCache was made for a "
                f"model with {plan.kv_heads} KV heads of dim {plan.head_dim} there: create one per model"
            )

    # ------------------------------------------------------------------------------------------------- steps
    def plan(self, b: int, q: int, device: torch.device) -> ForwardStep:
        """The plan of the forward pass in progress (made at its first evicting layer): ``b`` rows of ``q`` new
        columns."""
        if self.step is not None:
            return self.step
        c, seq = self.cache, self.cache.seq
        sched = seq.schedule
        self.check_batch(b)
        mask, self.pending_mask = self.pending_mask, None
        new_valid = None
        if mask is not None and q > 1:
            new_valid = mask[:, -q:].to(device=device, dtype=torch.bool)
            counts = new_valid.sum(-1).tolist()
            if all(cnt == q for cnt in counts):
                new_valid = None
        else:
            counts = [q] * b
        rows = list(range(b))
        if self.batch is None:  # the first forward: each row's first limit follows its prompt
            seeds = c.row_seeds(b)
            self.batch = b
            for r, cnt in enumerate(counts):
                seq.admit(r, cnt, seeds[r])
            self.capacity = self._first_capacity()
        fill = sched.fill[:b]
        if not seq.policy.evicts:
            n = [f + cnt for f, cnt in zip(fill, counts)]
            if max(n) >= self.capacity:
                self.capacity = self._graph_capacity(max(n) + c.budget)
        first = c.layers[c.evicting[0]]
        append = q == 1 and first.is_initialized
        schedule = sched.plan(rows, counts, append=append, capacity=self.capacity)
        ring = seq.ring
        if ring is not None:
            ring.prepare(b, device)
        self.step = ForwardStep(
            schedule=schedule,
            q=q,
            append=append,
            new_valid=new_valid,
            uniform=new_valid is None and len(set(fill)) == 1,
            seen_before=self.seen,
            device=device,
            capacity=self.capacity,
            ring=None if ring is None else ring.plan(rows, counts, schedule.seen_before),
            on_done=self.commit,
            layers=len(c.evicting),
        )
        return self.step

    def _first_capacity(self) -> int:
        """Slots per row and layer, from the rows' first limits: the largest first limit; for an evicting policy at
        least ``slots + buffer`` (after a compaction a row holds ``slots``, more than the budget with adaptive
        budgets); for a never-evicting one with a known length (compiled decoding), that length."""
        c, sched = self.cache, self.cache.seq.schedule
        capacity = max(sched.first[: self.batch])
        if c.policy.evicts:
            return self._graph_capacity(max(capacity, c.slots + c.buffer))
        if c.full_length:  # a never-evicting policy with a known length: allocated once
            return self._graph_capacity(max(capacity, c.full_length))
        return capacity

    def _graph_capacity(self, needed: int) -> int:
        """Slots to allocate for ``needed``: itself, except in compiled decoding when ``needed`` follows the prompt
        (the ``full`` policy, a budget from a compression ratio, a dense prompt longer than the budget), where it is
        rounded up to a power of two (:func:`vase.core.sizes.compiled_capacity`) so that one process compiles at
        most one decode graph per power of two, whatever the prompt lengths."""
        c = self.cache
        if not c.compileable:
            return needed
        fixed = c.slots + c.buffer if c.policy.evicts and c.config.ratio is None else 0
        return needed if needed <= fixed else compiled_capacity(needed)

    def commit(self, step: ForwardStep, eager: bool = True) -> None:
        """After the last evicting layer (or, for a compiled step, once its evictions ran): the sequence model's
        bookkeeping, the logical length."""
        c = self.cache
        c.seq.commit(step.schedule, step.ring)
        self.seen += step.q
        self.step = None
        if c.compiled is not None:
            c.compiled.decode_ok = True
            if eager:
                c.compiled.synced = False  # an eager step: the device counters of compiled decoding are stale

"""The sequence model every integration runs: schedule, row tables and query ring, and one call per eviction.

An integration (the transformers cache :mod:`vase.hf`, the vLLM plugin :mod:`vase.vllm`, or a third engine) owns
where keys and values are stored and how its attention reads them. Everything a sequence carries between evictions
is here, written once (torch and the standard library only, no device assumption):

* :class:`vase.core.schedule.Schedule`: when each row evicts, its fill and tokens seen, eviction counts;
* :class:`vase.core.tables.RowTables`: per (layer, row, KV head) the logical position and policy state of every held
  slot, the policy's per-row memo, each row's random key;
* :class:`vase.core.ring.QueryRing`: the last ``window`` post-RoPE queries of each row (for attention-based scorers);
* :meth:`Sequences.evict`: for one layer, the rows of a step that reach their limit: the policy's choice
  (:func:`vase.core.evict.evict_layer`) from the held entries the integration gathered, the tables written back, and
  the kept slot indices returned, so the integration moves its own entries (:func:`vase.core.evict.gather_kept`).

What an integration does each step (see docs/ARCHITECTURE.md, "What an integration provides"):

1. ``step = seq.schedule.plan(rows, counts)``; ``ring_write = seq.ring.plan(rows, counts, step.seen_before)``;
2. per evicting layer: write the new keys and values at each row's fill (slots ``[fill, fill + n)``) and their
   positions (:meth:`RowTables.put_positions`), attend, save the step's queries (:meth:`QueryRing.write`), then for
   the rows ``step.evict``: gather their held entries, ``ev = seq.evict(layer, step, ...)``, write the kept entries
   ``gather_kept(ev.indices, ...)`` to the row's first slots;
3. ``seq.commit(step, ring_write)``.

With a confidence step budget (``step_budget='confidence'``), the integration also feeds each step's next-token top
probabilities (:meth:`Sequences.observe_confidence`); each eviction's count per row then follows them.
"""

from __future__ import annotations

import warnings

import torch

from .confidence import CONFIDENCE_FLOOR, ConfidenceTracker
from .config import VaseConfig
from .evict import LayerEviction, evict_layer
from .ring import QueryRing, RingWrite
from .schedule import Schedule, StepSchedule
from .tables import RowTables
from .transfer import upload


class Sequences:
    """The sequence model of one integration instance (a cache, a worker): see the module docstring.

    Args:
        config: the resolved configuration (its budget fixed).
        layer_ids: the model index of each evicting layer, in order (they key the random choices).
        layer_budgets: the budget of each evicting layer (PyramidKV's differ; default: the budget for all).
        slots: physical slots per (row, layer, KV head) for kept tokens (default: the budget).
        head_offset: the model's index of the first KV head this integration holds (a tensor-parallel rank's share;
            keys the random choices).

    Attributes:
        schedule, tables, ring (None for a policy that needs no saved queries), config, policy.

    Raises:
        ValueError: a configuration whose budget is not fixed yet (a ratio: apply it with ``config.for_length``).
    """

    def __init__(
        self,
        config: VaseConfig,
        layer_ids: list[int],
        layer_budgets: list[int] | None = None,
        slots: int | None = None,
        head_offset: int = 0,
    ):
        if config.budget is None:
            raise ValueError("the sequence model needs a fixed budget: apply the ratio first (config.for_length)")
        self.config, self.policy = config, config.policy
        self.layer_ids = list(layer_ids)
        self.layer_budgets = list(layer_budgets) if layer_budgets is not None else [config.budget] * len(layer_ids)
        self.slots = config.budget if slots is None else slots
        self.head_offset = head_offset
        self.schedule = Schedule(
            budget=config.budget,
            buffer=config.buffer,
            slots=self.slots,
            evicts=self.policy.evicts,
            compress_prompt=config.compress_prompt,
            quantize=config.kv_bits is not None,
            window=config.kv_window,
        )
        self.tables = RowTables(self.layer_ids, self.policy.state_names, self.policy.memo_names)
        self.ring = QueryRing(len(self.layer_ids), config.window) if config.window else None
        self.confidence = (
            ConfidenceTracker(
                float(self.policy.options.get("confidence_floor", CONFIDENCE_FLOOR)),
                self.slots / config.budget,
            )
            if self.policy.confidence_budget
            else None
        )
        self._unfed_warned = False

    # ----------------------------------------------------------------------------------------------- rows
    def admit(self, row: int, prompt_tokens: int, seed: int, budget: int | None = None, evicts: bool = True) -> None:
        """A new sequence in ``row``: its schedule from its prompt's length, its tables emptied, its ring forgotten,
        its random key from ``seed``; ``budget`` / ``evicts``: its own budget, or no eviction at all
        (:meth:`vase.core.schedule.Schedule.admit`)."""
        self.schedule.admit(row, prompt_tokens, budget, evicts)
        self.tables.reset_row(row)
        self.tables.set_seeds([row], [seed])
        if self.ring is not None and row < self.ring.rows:
            self.ring.reset_row(row)
        if self.confidence is not None:
            self.confidence.reset_row(row)

    def observe_confidence(self, rows: list[int], top: torch.Tensor) -> None:
        """The top next-token probabilities the rows just predicted (``[len(rows)]`` or ``[len(rows), T]``, NaN for
        padding): what a confidence step budget follows (:class:`vase.core.confidence.ConfidenceTracker`); ignored
        by other policies."""
        if self.confidence is not None:
            self.confidence.observe(rows, top)

    def hold(self, row: int, tokens: int) -> None:
        """A fresh row whose first ``tokens`` are already held (a prefix-cache hit): slot ``i`` holds position ``i``,
        as before any eviction (:meth:`vase.core.schedule.Schedule.hold`)."""
        self.schedule.hold(row, tokens)

    def set_budget(self, row: int, budget: int) -> None:
        """A live row's new budget from its next step on (:meth:`vase.core.schedule.Schedule.set_budget`); its held
        entries, tables and ring are untouched until its next eviction.

        Raises:
            ValueError: see :meth:`vase.core.schedule.Schedule.set_budget`.
        """
        self.schedule.set_budget(row, budget)

    def commit(self, step: StepSchedule, ring_write: RingWrite | None = None) -> None:
        """After a step's last layer: the schedule and the ring's pointers move on."""
        self.schedule.commit(step)
        if self.confidence is not None:
            for i in step.evict:
                self.confidence.evicted(step.rows[i])
        if ring_write is not None and self.ring is not None:
            self.ring.commit(ring_write)

    # ------------------------------------------------------------------------------------------- eviction
    def evict(
        self,
        layer: int,
        step: StepSchedule,
        which: list[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        scaling: float | None = None,
        rows: torch.Tensor | None = None,
    ) -> LayerEviction:
        """The policy's choice for the rows ``which`` of ``step`` (positions in its row order) in layer ``layer``.

        The integration gives those rows' held entries and their slot tables (from :meth:`RowTables.held`, or
        built with the step's new tokens appended for a multi-token step); this call adds what the sequence model
        holds (the layer's budget, the physical slots, sinks, recent window, row keys, eviction counts, the newest
        position, the saved queries, the memo), runs :func:`vase.core.evict.evict_layer`, and writes the rows' memo
        back. It does not write positions and state: the caller gathers them with the kept indices
        (:func:`vase.core.evict.gather_kept`) into the slots it writes its entries to, then
        :meth:`RowTables.write_kept`.

        Args:
            keys, values: ``[b, H, S, D]`` the held entries of the ``b = len(which)`` rows (post-RoPE keys).
            positions: ``[b, H, S]`` int64 logical position of each slot (-1: free or dead).
            valid: ``[b, S]`` (or ``[b, H, S]``) bool, slots holding a token.
            state: ``{name: [b, H, S]}`` float32 per-slot state (updated in place by the scorer; the result's
                ``state`` holds the new state of these slots).
            scaling: the layer's attention logit scale (default ``D ** -0.5``).
            rows: ``[b]`` int64 table rows on the layer's device (default: built from ``step`` and ``which``; None
                together with ``which`` covering every row of the tables means all rows, no selection).

        Returns:
            The :class:`vase.core.evict.LayerEviction` (kept indices ``[b, H, slots]``, counts kept, new state).

        Raises:
            ValueError: rows admitted with different budgets (split them with :func:`budget_groups`).
        """
        return self.evict_layers(
            [layer], step, which, keys, values, positions, valid, state, scaling=scaling, rows=rows
        )

    def evict_layers(
        self,
        layers: list[int],
        step: StepSchedule,
        which: list[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        scaling: float | None = None,
        rows: torch.Tensor | None = None,
    ) -> LayerEviction:
        """:meth:`evict` for several layers in one call: the rows ``which`` of ``step`` in each of ``layers``
        (indices among the evicting layers, sharing a budget: :meth:`layer_groups`), stacked layer-major: batch row
        ``i * b + j`` is row ``which[j]`` in layer ``layers[i]``.

        Each row's choice is the one :meth:`evict` makes for its layer alone (the policy works row by row; the
        random choices are keyed by each row's layer), so an integration may defer a step's evictions to its last
        layer and run them together: one call instead of one per layer, which is most of the cost when a decode
        step's rows reach their limit one at a time (a few rows of a few hundred slots: the per-operation cost, not
        the arithmetic, dominates).

        Args:
            layers: ``n`` evicting-layer indices (the order of the stacking).
            keys, values: ``[n * b, H, S, D]``; positions: ``[n * b, H, S]``; valid: ``[n * b, S]`` (or
                ``[n * b, H, S]``); state: ``{name: [n * b, H, S]}``; the rest as :meth:`evict` (``rows``: ``[b]``).

        Returns:
            The :class:`vase.core.evict.LayerEviction` of the ``n * b`` rows, in the same order (each layer's memo
            written back).

        Raises:
            ValueError: layers with different budgets (PyramidKV: see :meth:`layer_groups`), or rows with different
                budgets (:func:`budget_groups`).
        """
        layers = list(layers)
        dev = keys.device
        n = len(layers)
        table_rows = [step.rows[i] for i in which]
        own = {self.schedule.row_budget[r] for r in table_rows}
        if len(own) > 1:
            raise ValueError(f"the rows of one eviction call must share a budget, got {sorted(own)}: see budget_groups")
        row_budget = own.pop() if own else self.config.budget
        if row_budget == self.config.budget:
            layer_budgets = {self.layer_budgets[li] for li in layers}
            if len(layer_budgets) > 1:
                got = sorted(layer_budgets)
                raise ValueError(f"the layers of one eviction call must share a budget, got {got}: see layer_groups")
            budget, slots = layer_budgets.pop(), self.slots
        else:  # a row's own budget (uniform budgets only: Schedule.admit)
            budget = slots = row_budget
        every = table_rows == list(range(len(self.tables.row_keys))) and rows is None
        if rows is None and not every:
            rows = upload(table_rows, dev)
        sel = None if every else rows

        def stacked(parts):  # per-layer tensors (or None) stacked layer-major
            return parts[0] if n == 1 or parts[0] is None else torch.cat(parts)

        queries = qpos = qvalid = None
        if self.ring is not None:
            reads = [self.ring.read(li, sel) for li in layers]
            queries, qpos, qvalid = (stacked([r[i] for r in reads]) for i in range(3))
        memos = [self.tables.memo_of(li, sel) for li in layers]
        memo = {name: stacked([m[name] for m in memos]) for name in memos[0]}
        keep = None
        if self.confidence is not None and row_budget == self.config.budget:
            fixed = self.config.sinks + self.config.recent
            keep = upload([self.confidence.keep(r, budget, slots, fixed) for r in table_rows] * n, dev)
            decoded = [r for r in table_rows if self.schedule.seen[r] > self.schedule.prompt[r]]
            if decoded and not self._unfed_warned and not any(self.confidence.fed(r) for r in decoded):
                self._unfed_warned = True
                warnings.warn(
                    "step_budget=confidence, but no next-token distribution was fed: every eviction keeps the budget. "
                    "Feed each step's logits (EvictingCache.observe_confidence, or logits_processor="
                    "[vase.hf.ConfidenceFeed(cache)] in model.generate)",
                    stacklevel=3,
                )
        row_keys = self.tables.keys_tensor(dev, sel)
        layer_idx = (
            self.layer_ids[layers[0]]
            if n == 1
            else upload([self.layer_ids[li] for li in layers for _ in table_rows], dev)
        )
        ev = evict_layer(
            self.policy,
            keys,
            values,
            positions,
            valid,
            budget=budget,
            slots=slots,
            sinks=self.config.sinks,
            recent=self.config.recent,
            row_keys=row_keys if n == 1 else row_keys.repeat(n),
            eviction_index=upload([step.evictions_before[i] for i in which] * n, dev),
            latest_query=upload([step.seen_before[i] + step.counts[i] - 1 for i in which] * n, dev),
            queries=queries,
            query_positions=qpos,
            query_valid=qvalid,
            scaling=scaling,
            state=state,
            memo=memo,
            layer_idx=layer_idx,
            head_offset=self.head_offset,
            keep=keep,
        )
        b = len(which)
        for i, li in enumerate(layers):
            self.tables.set_memo(li, sel, {name: m[i * b : (i + 1) * b] for name, m in ev.memo.items()})
        return ev

    def layer_groups(self, layers: list[int]) -> list[list[int]]:
        """``layers`` (evicting-layer indices) split into groups sharing a budget, in order of first appearance:
        one :meth:`evict_layers` call per group (one group unless ``layer_budget='pyramid'``)."""
        groups: dict[int, list[int]] = {}
        for li in layers:
            groups.setdefault(self.layer_budgets[li], []).append(li)
        return list(groups.values())


def budget_groups(step: StepSchedule, which: list[int], schedule) -> list[list[int]]:
    """``which`` (positions in ``step``'s row order) split into groups of rows that share a budget, in order of first
    appearance: one :meth:`Sequences.evict` call per group when rows have budgets of their own."""
    groups: dict[int, list[int]] = {}
    for i in which:
        groups.setdefault(schedule.row_budget[step.rows[i]], []).append(i)
    return list(groups.values())

"""The eviction schedule of a set of sequences: when each row evicts, and what it holds after each step (host ints).

Every integration runs the same schedule (VaSE, arXiv 2606.03928, Sec. 3.3: static memory, compaction every
``buffer`` steps). Per row (one sequence: a batch row of the transformers cache, a request of the vLLM plugin):

* ``fill``: the physical length, slots holding a token (packed at the front of the row's slots, in position order);
* ``seen``: real tokens the row has seen (the logical position of its next token);
* ``evictions``: how many times it was compacted;
* its **limit**: the fill at which it evicts. A row evicts when a step brings its fill to its limit or past it; after
  that step's attention it is compacted back to ``slots`` (``budget``, or the cap of adaptive budgets). The steady
  limit is ``slots + buffer``. Until its first eviction the limit is :func:`first_limit` of its prompt: ``budget +
  buffer`` when a prompt longer than the budget is compressed at prefill; with a dense prompt (``compress_prompt=
  False``, the published code) the first multiple of the buffer above the prompt, at least ``budget + buffer`` (the
  reference compacts when the length exceeds the budget and is a multiple of the buffer). Per row, so a row of a
  ragged batch evicts exactly as it would alone.

With quantized storage (``kv_bits``, :mod:`vase.core.quant`) each row also has a **quantization limit** ``qlimit``:
its slots below it hold quantized entries. A row quantizes what it keeps at each compaction, and in between each time
``buffer`` tokens have arrived since its last quantization, up to ``L`` slots (its eviction limit less the buffer; for
a policy that never evicts, every slot allocated).

The schedule holds no tensors and knows nothing of storage: an integration asks it for a :class:`StepSchedule`
(:meth:`Schedule.plan`), runs the step (writes, attention, the evictions it names, see
:class:`vase.core.sequence.Sequences`), then :meth:`Schedule.commit` s it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def first_limit(prompt: int, *, budget: int, buffer: int, evicts: bool, compress_prompt: bool) -> int:
    """Fill (tokens) at which a row holding ``prompt`` tokens after its prefill first evicts (see the module
    docstring); for a policy that never evicts, the slots its buffers first hold (``max(budget, prompt) + buffer``)."""
    if not evicts:
        return max(budget, prompt) + buffer
    if compress_prompt:
        return budget + buffer
    return max(budget, (prompt // buffer) * buffer) + buffer


@dataclass
class StepSchedule:
    """What the schedule decided for one step of ``rows`` (host values, in the step's row order).

    Attributes:
        rows: the rows of the step (indices of the schedule's rows).
        counts: real new tokens of each row.
        fill_before: each row's fill before the step.
        keep: each row's fill after the step: ``slots`` for a row that evicts, else ``fill_before + counts``.
        evict: the positions (in the step's row order) of the rows that evict after this step's attention.
        seen_before: real tokens each row had seen: the logical position of its first new token.
        evictions_before: evictions each row had before this step (keys the random choices of its next one).
        qlimit_before, qlimit: with quantized storage, each row's quantization limit before and after the step
            (None without).
        flush: with quantized storage, the positions of the rows that quantize their recent tokens in this step
            without evicting (a decode step).
    """

    rows: list[int]
    counts: list[int]
    fill_before: list[int]
    keep: list[int]
    evict: list[int]
    seen_before: list[int]
    evictions_before: list[int]
    qlimit_before: list[int] | None = None
    qlimit: list[int] | None = None
    flush: list[int] = field(default_factory=list)

    @property
    def fill_after(self) -> list[int]:
        """Each row's fill after its new tokens are written, before any eviction."""
        return [f + c for f, c in zip(self.fill_before, self.counts)]

    @property
    def latest(self) -> list[int]:
        """Logical position of each row's newest token after this step."""
        return [s + c - 1 for s, c in zip(self.seen_before, self.counts)]


class Schedule:
    """The schedule of a set of rows (see the module docstring).

    Args:
        budget: tokens kept per (row, layer, KV head) after an eviction (on average with adaptive budgets).
        buffer: tokens written between two evictions.
        slots: physical slots per (row, layer, KV head) for kept tokens (``budget``, or the cap of adaptive budgets).
        evicts: False for a policy that never evicts (``full``, ``quest``): rows then never evict.
        compress_prompt: compress a prompt longer than the budget at prefill (see :func:`first_limit`).
        quantize: quantized storage (``kv_bits``): plan each row's quantization limit.

    Raises:
        ValueError: ``slots`` below ``budget``, or a buffer below 1.
    """

    def __init__(self, *, budget: int, buffer: int, slots: int, evicts: bool, compress_prompt: bool, quantize=False):
        if buffer < 1 or slots < budget:
            raise ValueError(f"a schedule needs buffer >= 1 and slots >= budget, got {buffer} and {slots} < {budget}")
        self.budget, self.buffer, self.slots = budget, buffer, slots
        self.evicts, self.compress_prompt, self.quantize = evicts, compress_prompt, quantize
        self.fill: list[int] = []
        self.seen: list[int] = []
        self.evictions: list[int] = []
        self.first: list[int] = []  # each row's first limit
        self.qlimit: list[int] = []
        self.eviction_steps = 0  # steps in which at least one row evicted
        self.rows_evicted = 0
        self.tokens_evicted = 0  # tokens dropped, summed over rows (per layer and KV head on average)

    # ------------------------------------------------------------------------------------------------- rows
    @property
    def rows(self) -> int:
        """Rows the schedule has room for."""
        return len(self.fill)

    def resize(self, rows: int) -> None:
        """Room for ``rows`` rows (new rows empty; never shrinks)."""
        for name in ("fill", "seen", "evictions", "first", "qlimit"):
            table = getattr(self, name)
            table.extend([0] * (rows - len(table)))

    def admit(self, row: int, prompt_tokens: int) -> None:
        """Start ``row`` afresh for a sequence whose prompt has ``prompt_tokens`` real tokens (its first limit follows
        it with a dense prompt)."""
        if row >= self.rows:
            self.resize(row + 1)
        self.fill[row] = self.seen[row] = self.evictions[row] = self.qlimit[row] = 0
        self.first[row] = self.first_limit(prompt_tokens)

    def first_limit(self, prompt: int) -> int:
        """:func:`first_limit` with this schedule's sizes."""
        return first_limit(
            prompt, budget=self.budget, buffer=self.buffer, evicts=self.evicts, compress_prompt=self.compress_prompt
        )

    def limit(self, row: int) -> int:
        """Fill at which ``row`` evicts next: its first limit until its first eviction, then ``slots + buffer``."""
        return self.slots + self.buffer if self.evictions[row] else self.first[row]

    def limits(self, rows=None) -> list[int]:
        """:meth:`limit` of each of ``rows`` (default: every row)."""
        return [self.limit(r) for r in (range(self.rows) if rows is None else rows)]

    # ------------------------------------------------------------------------------------------------- steps
    def plan(
        self,
        rows: list[int],
        counts: list[int],
        *,
        append: bool = False,
        capacity: int = 0,
        seen_before: list[int] | None = None,
    ) -> StepSchedule:
        """The schedule of a step in which each of ``rows`` gets ``counts`` real new tokens.

        Args:
            seen_before: the logical position of each row's first new token when the integration holds it (an
                engine's computed-token counts); default: the tokens the schedule has seen.
            append: a decode step (one token per row written in place): with quantized storage, the rows whose recent
                tokens reach ``buffer`` are listed in ``flush``.
            capacity: slots allocated per row, for the quantization limit of a policy that never evicts.
        """
        fill = [self.fill[r] for r in rows]
        keep, evict = [], []
        for i, (r, f, n) in enumerate(zip(rows, fill, counts)):
            if self.evicts and f + n >= self.limit(r):
                evict.append(i)
                keep.append(self.slots)
            else:
                keep.append(f + n)
        step = StepSchedule(
            rows=list(rows),
            counts=list(counts),
            fill_before=fill,
            keep=keep,
            evict=evict,
            seen_before=[self.seen[r] for r in rows] if seen_before is None else list(seen_before),
            evictions_before=[self.evictions[r] for r in rows],
        )
        if self.quantize:
            self._plan_quantization(step, append, capacity)
        return step

    def _plan_quantization(self, step: StepSchedule, append: bool, capacity: int) -> None:
        """Each row's quantization limit after ``step``: rows that evict quantize what they keep (``slots``); a row
        whose recent tokens reach ``buffer`` quantizes them (whole multiples of ``buffer`` after a multi-token step),
        up to its most quantized slots :meth:`quantization_limit`."""
        evicting = set(step.evict)
        before = [self.qlimit[r] for r in step.rows]
        out = []
        for i, (r, n, q) in enumerate(zip(step.rows, step.keep, before)):
            most = self.quantization_limit(r, capacity)
            if i in evicting:
                new = min(self.slots, most)
            elif n - q >= self.buffer and q < most:
                new = min(q + (n - q) // self.buffer * self.buffer, most)
                if append:
                    step.flush.append(i)
            else:
                new = q
            out.append(new)
        step.qlimit_before, step.qlimit = before, out

    def quantization_limit(self, row: int, capacity: int) -> int:
        """The most slots ``row`` may hold quantized: its eviction limit less the buffer (its own, so that a row of a
        ragged batch quantizes as it would alone); for a policy that never evicts, every slot (``capacity``)."""
        return self.limit(row) - self.buffer if self.evicts else capacity

    def commit(self, step: StepSchedule) -> None:
        """After the step ran: fills, tokens seen, eviction counts and quantization limits move on."""
        if step.evict:
            self.eviction_steps += 1
            self.rows_evicted += len(step.evict)
            for i in step.evict:
                r = step.rows[i]
                # tokens held per (layer, KV head) on average: the fill, less the dead slots of a row compacted before
                gap = self.slots - self.budget if self.evictions[r] else 0
                self.tokens_evicted += step.fill_before[i] + step.counts[i] - gap - self.budget
                self.evictions[r] += 1
        for i, r in enumerate(step.rows):
            self.fill[r] = step.keep[i]
            self.seen[r] = step.seen_before[i] + step.counts[i]
            if step.qlimit is not None:
                self.qlimit[r] = step.qlimit[i]

    def room(self, rows=None, capacity: int = 0) -> list[int]:
        """Tokens each of ``rows`` can take before its next eviction (the eviction happens at the token that fills
        it); with quantized storage, before its next eviction or quantization of its recent tokens, whichever comes
        first (a policy that never evicts included)."""
        rows = range(self.rows) if rows is None else rows
        out = []
        for r in rows:
            f = self.fill[r]
            if not self.quantize:
                out.append(self.limit(r) - f)
                continue
            q, most = self.qlimit[r], self.quantization_limit(r, capacity)
            nxt = q + self.buffer - f
            if self.evicts:
                nxt = min(self.limit(r) - f, nxt) if q < most else self.limit(r) - f
            out.append(nxt)
        return out

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
* its own **budget** (a serving engine's per-request budget, :meth:`Schedule.admit`): the schedule's by default; a row
  may also never evict (a request served with the full cache).

With quantized storage (``kv_bits``, :mod:`vase.core.quant`) each row also has a **quantization limit** ``qlimit``:
its slots below it hold quantized entries. A row quantizes what it keeps at each compaction, and in between each time
``buffer`` tokens have arrived since its last quantization, up to ``L`` slots (its eviction limit less the buffer; for
a policy that never evicts, every slot allocated). With a full-precision window of ``R`` tokens (``kv_window``, KIVI's
sliding residual) a row keeps its newest ``R`` tokens out of it: a compaction quantizes ``slots - R``, a row quantizes
``buffer`` more each time ``R + buffer`` tokens are above its limit, up to ``L - R``.

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
        window: with quantized storage, the newest tokens each row always holds in full precision (``kv_window``).

    Raises:
        ValueError: ``slots`` below ``budget``, a buffer below 1, or a window below 0 or, for an evicting policy, not
            below ``slots``.
    """

    def __init__(
        self,
        *,
        budget: int,
        buffer: int,
        slots: int,
        evicts: bool,
        compress_prompt: bool,
        quantize=False,
        window: int = 0,
    ):
        if buffer < 1 or slots < budget:
            raise ValueError(f"a schedule needs buffer >= 1 and slots >= budget, got {buffer} and {slots} < {budget}")
        if window < 0 or (evicts and window >= slots):
            raise ValueError(f"a schedule's full-precision window must be in [0, slots = {slots}), got {window}")
        self.window = window
        self.budget, self.buffer, self.slots = budget, buffer, slots
        self.evicts, self.compress_prompt, self.quantize = evicts, compress_prompt, quantize
        self.fill: list[int] = []
        self.row_budget: list[int] = []  # each row's budget (the schedule's unless admitted with its own)
        self.row_slots: list[int] = []  # each row's slots after an eviction
        self.row_evicts: list[bool] = []  # False for a row that never evicts
        self.seen: list[int] = []
        self.evictions: list[int] = []
        self.first: list[int] = []  # each row's first limit
        self.prompt: list[int] = []  # each row's prompt tokens (its first limit follows them with a dense prompt)
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
        grow = rows - len(self.fill)
        for name in ("fill", "seen", "evictions", "first", "prompt", "qlimit"):
            getattr(self, name).extend([0] * grow)
        self.row_budget.extend([self.budget] * grow)
        self.row_slots.extend([self.slots] * grow)
        self.row_evicts.extend([self.evicts] * grow)

    def admit(self, row: int, prompt_tokens: int, budget: int | None = None, evicts: bool = True) -> None:
        """Start ``row`` afresh for a sequence whose prompt has ``prompt_tokens`` real tokens (its first limit follows
        it with a dense prompt).

        Args:
            budget: the row's own budget (tokens; default: the schedule's), its slots after an eviction.
            evicts: False: the row never evicts (a request served with the full cache).

        Raises:
            ValueError: a budget of its own with adaptive budgets (``slots`` above the budget), or below 1.
        """
        if row >= self.rows:
            self.resize(row + 1)
        if budget is not None and budget != self.budget:
            if self.slots != self.budget or budget < 1:
                raise ValueError(
                    f"a row's own budget needs uniform budgets (slots = budget) and at least 1 token, got {budget}"
                )
            self.row_budget[row] = self.row_slots[row] = budget
        else:
            self.row_budget[row], self.row_slots[row] = self.budget, self.slots
        self.row_evicts[row] = self.evicts and evicts
        self.fill[row] = self.seen[row] = self.evictions[row] = self.qlimit[row] = 0
        self.prompt[row] = prompt_tokens
        self.first[row] = self.first_limit(prompt_tokens, self.row_budget[row], self.row_evicts[row])

    def hold(self, row: int, tokens: int) -> None:
        """A row admitted with its first ``tokens`` already in its cache (a serving engine's prefix-cache hit): its
        fill and tokens seen start there, in slots ``0 .. tokens - 1``.

        Raises:
            ValueError: ``tokens`` negative or at or past the row's first limit (a hit never reaches an eviction).
        """
        if not 0 <= tokens < self.first[row] or self.evictions[row] or self.seen[row]:
            raise ValueError(f"a fresh row can hold [0, {self.first[row]}) tokens of a cache hit, got {tokens}")
        self.fill[row] = self.seen[row] = tokens

    def set_budget(self, row: int, budget: int) -> None:
        """Give a live ``row`` a new budget (a serving engine's pool-aware budget, :mod:`vase.vllm.scheduler`): its
        slots after its next eviction and its limit follow it at once. A row whose fill is at or past its new limit
        evicts at its next step (to the new budget); a larger budget lets it grow further before its next eviction.
        Its tables and entries are untouched until then.

        Raises:
            ValueError: adaptive budgets (``slots`` above the budget), quantized storage, a row that never evicts, or
                a budget below 1.
        """
        if self.slots != self.budget or self.quantize or budget < 1:
            raise ValueError(
                f"a row's budget can change only with uniform budgets, full-precision storage and a budget >= 1, got "
                f"{budget}"
            )
        if not self.row_evicts[row]:
            raise ValueError(f"row {row} never evicts: it has no budget to change")
        self.row_budget[row] = self.row_slots[row] = budget
        self.first[row] = self.first_limit(self.prompt[row], budget, True)

    def first_limit(self, prompt: int, budget: int | None = None, evicts: bool | None = None) -> int:
        """:func:`first_limit` with this schedule's sizes (``budget``, ``evicts``: a row's own)."""
        return first_limit(
            prompt,
            budget=self.budget if budget is None else budget,
            buffer=self.buffer,
            evicts=self.evicts if evicts is None else evicts,
            compress_prompt=self.compress_prompt,
        )

    def limit(self, row: int) -> int:
        """Fill at which ``row`` evicts next: its first limit until its first eviction, then ``slots + buffer``."""
        return self.row_slots[row] + self.buffer if self.evictions[row] else self.first[row]

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
            if self.row_evicts[r] and f + n >= self.limit(r):
                evict.append(i)
                keep.append(self.row_slots[r])
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
        """Each row's quantization limit after ``step``: rows that evict quantize what they keep (``slots``) less the
        window; a row whose recent tokens reach ``window + buffer`` quantizes ``buffer`` of them (whole multiples of
        ``buffer`` after a multi-token step, the newest ``window`` left), up to its most quantized slots
        :meth:`quantization_limit`."""
        evicting = set(step.evict)
        before = [self.qlimit[r] for r in step.rows]
        out = []
        w, g = self.window, self.buffer
        for i, (r, n, q) in enumerate(zip(step.rows, step.keep, before)):
            most = self.quantization_limit(r, capacity)
            if i in evicting:
                new = min(self.row_slots[r] - w, most)
            elif n - q >= w + g and q < most:
                new = min(q + (n - q - w) // g * g, most)
                if append:
                    step.flush.append(i)
            else:
                new = q
            out.append(new)
        step.qlimit_before, step.qlimit = before, out

    def quantization_limit(self, row: int, capacity: int) -> int:
        """The most slots ``row`` may hold quantized: its eviction limit less the buffer (its own, so that a row of a
        ragged batch quantizes as it would alone); for a policy that never evicts, every slot (``capacity``); both
        less the full-precision window."""
        most = self.limit(row) - self.buffer if self.row_evicts[row] else capacity
        return max(most - self.window, 0)

    def commit(self, step: StepSchedule) -> None:
        """After the step ran: fills, tokens seen, eviction counts and quantization limits move on."""
        if step.evict:
            self.eviction_steps += 1
            self.rows_evicted += len(step.evict)
            for i in step.evict:
                r = step.rows[i]
                # tokens held per (layer, KV head) on average: the fill, less the dead slots of a row compacted before
                gap = self.row_slots[r] - self.row_budget[r] if self.evictions[r] else 0
                self.tokens_evicted += step.fill_before[i] + step.counts[i] - gap - self.row_budget[r]
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
            nxt = q + self.window + self.buffer - f
            if self.row_evicts[r]:
                nxt = min(self.limit(r) - f, nxt) if q < most else self.limit(r) - f
            out.append(nxt)
        return out

"""Confidence-driven step budgets: each eviction keeps fewer tokens when the model has been confident (torch only).

Policy option ``step_budget='confidence'``, open to every evicting policy (every scorer, guard and selector). The idea
is Conf-KV's (Li and Miao 2026, arXiv 2605.24786, Sec. 3): the next-token distribution gives a confidence signal at
every decoding step, and the cache keeps more context while the model is uncertain and less while it is confident.
vase's rule, inside the static memory of its adaptive budgets (:mod:`vase.core.budgets`):

* the signal of one token is its uncertainty ``u = 1 - max_v p(v)`` (the next-token distribution's top probability);
* at an eviction, a row keeps ``n = budget * clip(u_window / u_row, confidence_floor, budget_cap)`` tokens per
  (layer, KV head), where ``u_window`` is the mean uncertainty of the tokens since the row's previous eviction and
  ``u_row`` the mean over every token it has seen: the budget follows the row's confidence *relative to its own
  average*, so a row of constant confidence keeps exactly ``budget`` (the fixed rule), and over a generation the
  count kept stays near ``budget`` on average where the uncertainty is spread;
* the buffers are allocated once at ``floor(budget_cap * budget)`` slots (+ the buffer), never exceeded; a row that
  keeps fewer holds dead slots, masked in attention as with AdaKV (:mod:`vase.core.budgets`). With ``budget_cap=1``
  the rule only ever keeps fewer than the budget.

Conf-KV maps an absolute confidence to the budget; the relative rule here needs no per-model threshold and makes the
fixed budget its special case. A row with nothing observed (no confidence fed, or its first eviction at prefill) keeps
``budget``. The integration feeds the signal: :meth:`vase.EvictingCache.observe_confidence` with the step's logits
(:class:`vase.hf.ConfidenceFeed` does it inside ``model.generate``).
"""

from __future__ import annotations

import torch

STEP_BUDGETS = ("fixed", "confidence")
CONFIDENCE_FLOOR = 0.25  # the least share of the budget a confident stretch keeps


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """The next-token distribution's largest probability, ``max_v softmax(logits)_v``, in float32.

    Args:
        logits: ``[..., V]`` scores over the vocabulary (any float dtype; ``-inf`` allowed, as after a logits
            processor masked some tokens).

    Returns:
        ``[...]`` float32 in (0, 1].
    """
    x = logits.float()
    return 1.0 / torch.exp(x - x.max(-1, keepdim=True).values).sum(-1)


class ConfidenceTracker:
    """Per-row uncertainty sums of one integration instance (rows as in :class:`vase.core.sequence.Sequences`).

    Args:
        floor: ``confidence_floor``, the least share of the budget an eviction keeps, in (0, 1].
        cap: ``budget_cap``, the most, as a multiple of the budget (>= 1).
    """

    def __init__(self, floor: float = CONFIDENCE_FLOOR, cap: float = 2.0):
        self.floor, self.cap = float(floor), float(cap)
        self.window_sum: list[float] = []  # uncertainty of the tokens since the row's previous eviction
        self.window_n: list[int] = []
        self.total_sum: list[float] = []  # of every token the row has seen
        self.total_n: list[int] = []
        # observations on a GPU wait on the device until a count is read (one copy to the host per eviction rather
        # than one synchronization per decode step)
        self._pending: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []

    def reset_row(self, row: int) -> None:
        """A new sequence in ``row`` (room made as needed)."""
        self._fold()
        grow = row + 1 - len(self.window_sum)
        if grow > 0:
            for name in ("window_sum", "total_sum"):
                getattr(self, name).extend([0.0] * grow)
            for name in ("window_n", "total_n"):
                getattr(self, name).extend([0] * grow)
        self.window_sum[row] = self.total_sum[row] = 0.0
        self.window_n[row] = self.total_n[row] = 0

    def observe(self, rows: list[int], top: torch.Tensor) -> None:
        """Record the top probabilities of tokens the rows predicted.

        Args:
            rows: the table row of each entry of ``top``.
            top: ``[len(rows)]`` or ``[len(rows), T]`` float in (0, 1] (:func:`top_probability`); NaN entries (padding
                positions) are left out.

        Raises:
            ValueError: a row never admitted, or a shape that does not match ``rows``.
        """
        if not rows:
            return
        if top.numel() == 0 or top.numel() % len(rows):
            raise ValueError(f"observe: {len(rows)} rows but top probabilities of shape {tuple(top.shape)}")
        for r in rows:
            if r >= len(self.window_sum):
                raise ValueError(f"observe: row {r} was never admitted")
        top = top.detach().float().reshape(len(rows), -1)
        real = ~torch.isnan(top)
        self._pending.append((list(rows), (1.0 - top).masked_fill(~real, 0.0).sum(-1), real.sum(-1)))
        if top.device.type == "cpu":
            self._fold()

    def _fold(self) -> None:
        """Add the pending observations into the host sums (one copy from the device for all of them)."""
        if not self._pending:
            return
        rows = [r for batch, _, _ in self._pending for r in batch]
        sums = torch.cat([s for _, s, _ in self._pending]).tolist()
        counts = torch.cat([n for _, _, n in self._pending]).tolist()
        self._pending.clear()
        for r, s, n in zip(rows, sums, counts):
            self.window_sum[r] += s
            self.window_n[r] += n
            self.total_sum[r] += s
            self.total_n[r] += n

    def fed(self, row: int) -> bool:
        """Whether any token of ``row`` was observed since it was admitted."""
        self._fold()
        return row < len(self.total_n) and self.total_n[row] > 0

    def evicted(self, row: int) -> None:
        """The row evicted: its next window starts."""
        self._fold()
        self.window_sum[row], self.window_n[row] = 0.0, 0

    def ratio(self, row: int) -> float:
        """``clip(u_window / u_row, floor, cap)``; 1.0 with nothing observed since the previous eviction or a row that
        has always been certain."""
        self._fold()
        if row >= len(self.window_n) or not self.window_n[row] or not self.total_n[row]:
            return 1.0
        mean_row = self.total_sum[row] / self.total_n[row]
        if mean_row <= 1e-9:
            return 1.0
        mean_window = self.window_sum[row] / self.window_n[row]
        return min(max(mean_window / mean_row, self.floor), self.cap)

    def keep(self, row: int, budget: int, slots: int, fixed: int) -> int:
        """Tokens the row keeps per (layer, KV head) at this eviction: ``round(budget * ratio)``, at least ``fixed``
        (the sinks and the recent window, always kept) and at most ``slots``."""
        return max(min(round(budget * self.ratio(row)), slots), min(fixed, slots))

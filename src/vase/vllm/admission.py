"""Elastic admission: every request that fits at the floor is admitted now, at the largest budget the pool allows.

With a fixed budget per request (admission ``reserve``), a request waits until its whole cap is free: at a tight pool
a burst of long requests leaves the last ones queued until earlier ones finish, minutes of time to first token.
Elastic admission (the default) trades budget for admission instead. Each step that has requests waiting, the
scheduler (:class:`vase.vllm.scheduler.VaseScheduler`) calls :func:`plan_admission` with what the pool holds:

1. **Who is admitted**: the waiting requests, in queue order, as long as every running request and each of them
   fits at its floor (``min_budget``, or its own smaller budget); the rest wait (as many as ``max_num_seqs`` allows).
2. **At what budget**: one water level ``L`` for all of them, the largest at which the blocks of the running and the
   admitted requests, each at the largest budget of its ladder at most ``L`` (never above its own target), fit the
   pool (free blocks plus those the running requests hold, less vLLM's watermark).
3. **Running requests above the level shrink** to it: their worker evicts them to the new budget at their next step
   (:meth:`vase.core.schedule.Schedule.set_budget`), after which their blocks past the new cap go back to the pool,
   where the newly admitted requests take them one step later.

Every request keeps a static footprint between changes (blocks for ``budget + buffer``, allocated once), none is
preempted, and none waits longer than one step while the pool holds everyone at the floor. Budgets only shrink: a
request does not grow back when the pool frees up (vLLM hands a worker a request's block ids only by appending, so
the blocks returned cannot be taken back); requests admitted later get the larger budget the pool then allows.
A request that cannot shrink now (still in its prefill, or holding a dense prompt until its first eviction) counts
with the blocks it holds.

This module is pure Python (no vLLM import), tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Demand:
    """What one request may hold: ``options``, ``(budget, blocks)`` ascending (its floor first, the largest budget it
    may hold now last; a request that cannot shrink has one option, what it holds)."""

    req_id: str
    options: tuple[tuple[int, int], ...]

    def at(self, level: int) -> tuple[int, int]:
        """The largest option whose budget is at most ``level`` (the floor below every option)."""
        best = self.options[0]
        for opt in self.options:
            if opt[0] > level:
                break
            best = opt
        return best

    @property
    def floor_blocks(self) -> int:
        return self.options[0][1]


@dataclass
class Admission:
    """The plan of one step: ``level`` (the water level, tokens; None: nobody to admit), ``admit`` (request id ->
    budget, blocks: the waiting requests admitted, in queue order), ``shrink`` (request id -> budget, blocks: running
    requests above the level), ``blocks`` (blocks held by the running and admitted requests under the plan)."""

    level: int | None
    admit: dict[str, tuple[int, int]]
    shrink: dict[str, tuple[int, int]]
    blocks: int


def plan_admission(running: list[Demand], waiting: list[Demand], usable: int, current: dict[str, int]) -> Admission:
    """The water level for ``running`` and as many of ``waiting`` as fit at their floors (see the module docstring).

    Args:
        running: the running requests (a request that cannot shrink has one option: what it holds).
        waiting: the waiting requests in queue order, at most as many as may still run.
        usable: blocks the plan may use: the pool's free blocks plus those the running requests hold, less the
            watermark vLLM keeps free when it admits.
        current: each running request's budget now (a running request is shrunk only below it).

    Returns:
        The :class:`Admission`; with nobody waiting, or nobody that fits, the running requests keep their budgets.
    """
    total = sum(d.floor_blocks for d in running)
    chosen: list[Demand] = []
    for w in waiting:
        if total + w.floor_blocks > usable:
            break
        total += w.floor_blocks
        chosen.append(w)
    if not chosen:
        held = sum(d.options[-1][1] for d in running)
        return Admission(level=None, admit={}, shrink={}, blocks=held)
    everyone = running + chosen
    levels = sorted({b for d in everyone for b, _ in d.options}, reverse=True)
    level = levels[-1]
    for cand in levels:
        if sum(d.at(cand)[1] for d in everyone) <= usable:
            level = cand
            break
    admit = {w.req_id: w.at(level) for w in chosen}
    shrink = {}
    for d in running:
        budget, blocks = d.at(level)
        if budget < current.get(d.req_id, budget):
            shrink[d.req_id] = (budget, blocks)
    used = sum(d.at(level)[1] for d in everyone)
    return Admission(level=level, admit=admit, shrink=shrink, blocks=used)

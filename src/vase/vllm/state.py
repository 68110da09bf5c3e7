"""Worker-side state: each request's row in the sequence model, and the plan of one engine step.

One :class:`WorkerState` per worker process, created by the worker when vase is configured. Each running request
has a row of the sequence model (:class:`vase.core.sequence.Sequences`: its schedule, its slot tables per layer and KV
head, its saved queries, its random key), taken from a pool of rows grown by doubling up to ``max_num_seqs`` and
never shrunk. The tables are as wide as the steady cap of the largest budget a request may ask for (``max_budget +
buffer`` in whole blocks): before a request's first eviction slot ``i`` holds position ``i`` (nothing was moved yet),
so a dense prompt holding more needs no wider table (:meth:`vase.core.tables.RowTables.held`). A request's own budget
(``vase_budget``, :func:`request_budget`) is its row's budget in the sequence model; a request served with the full
cache has a row that never evicts.

The scheduler and the worker share no data at run time: the worker reproduces each request's physical fill from the
token counts it is given each step (the schedule's ``fill += n``; a fill reaching the limit becomes ``budget``).
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ..core.ring import RingWrite
from ..core.schedule import StepSchedule
from ..core.sequence import Sequences
from . import metrics
from .settings import FULL, EngineSettings, check_fields
from .store import HeldStore

# vLLM configures the loggers under "vllm" only: a child of it prints with vLLM's format, in the worker's process
logger = logging.getLogger("vllm.plugins.vase")
# vLLM fans a request with n > 1 out into child requests named "{index}_{parent id}" (v1/engine/parallel_sampling.py)
_CHILD_ID = re.compile(r"(\d+)_")


def child_index(req_id: str) -> int:
    """The index of a child of a parallel-sampling request (``SamplingParams(n=...)``) from its engine request id,
    0 for any other request. vLLM's own ids (``LLM.generate``'s counters, the OpenAI server's ``cmpl-...``) never
    start with digits and an underscore; a request id of one's own that does is read as a child's."""
    m = _CHILD_ID.match(req_id)
    return int(m.group(1)) if m else 0


def request_budget(settings: EngineSettings, req_id: str, sampling_params) -> int | None:
    """A request's budget (:meth:`vase.vllm.settings.EngineSettings.request_budget`; None: the full cache), the same
    in the scheduler and the worker. A request over the engine's limits (refused by the front end's check; an engine
    started without it goes on) gets the engine's budget, logged."""
    try:
        return settings.request_budget(getattr(sampling_params, "extra_args", None))
    except ValueError as exc:
        logger.warning("vase: request %s: %s (served with the engine's budget)", req_id, exc)
        return settings.budget


def eviction_seed(req_id: str, sampling_params) -> int:
    """The seed of a request's sampled eviction: ``extra_args["vase_seed"]`` plus its child index (children of one
    parallel-sampling request draw apart), else ``SamplingParams.seed`` (vLLM gives child ``i`` the parent's seed
    plus ``i``), else the child index (0 for a single request)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    try:
        check_fields(extra)  # checked at admission by vase's request check; an engine started without it goes on
    except ValueError as exc:
        logger.warning("vase: request %s: %s (its eviction draws without vase_seed)", req_id, exc)
        extra = {}
    index = child_index(req_id)
    if extra.get("vase_seed") is not None:
        return int(extra["vase_seed"]) + index
    seed = getattr(sampling_params, "seed", None)
    return index if seed is None else int(seed)


@dataclass
class GroupLayout:
    """Where a step's rows live in one KV cache group of full-attention layers (each group has its own block ids;
    the caps, fills and slots are the same in every group). ``block_rows`` ``[R, nb]`` the block ids of each row's
    physical slots now (read, written, attended); ``write_rows`` ``[R, nb]`` those after an eviction in this step
    (past the row's front blocks, with prefix caching); ``slot_mapping`` ``[T]`` int64 the physical slot of each new
    token (-1 for dense rows: not written)."""

    block_rows: torch.Tensor
    write_rows: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class PagedStep:
    """What one engine step does in the paged cache, per batch row ``r`` (the runner's ``input_batch`` order) and per
    new token: the sequence model's step plus the physical layout.

    ``schedule``: the sequence model's step (its rows are the pool rows, in batch order). Row arrays (numpy, ``[R]``):
    ``n`` new tokens, ``logical_before`` (RoPE position of the first new token), ``fill_before`` / ``fill_after``
    (physical), ``keep`` (physical after the step), ``evict`` (bool: the row is compacted back to ``budget`` after this
    step's attention), ``dense`` (bool: the row's entries do not fit in its blocks, so it is attended outside the
    paged cache and compressed), ``shifted`` (bool: the row's physical slot 0 is past its front blocks, kept for the
    prefix cache: :meth:`vase.vllm.settings.EngineSettings.front_blocks`), ``qsl`` ``[R+1]`` query start locations.
    Tensors: ``rows`` ``[R]`` pool rows; ``layouts``: KV cache group -> :class:`GroupLayout` (block ids and slots
    of each full-attention group); ``seq_lens`` ``[R]`` int32 for the kernel (physical; for dense rows ``n``, unused:
    the kernel attends them over a scratch cache, :class:`vase.vllm.compact.DenseSplit`); ``positions`` ``[T]``
    logical. ``ring``: where the step's saved queries go (:class:`vase.core.ring.RingWrite`), ``ring_tok`` ``[N]``: the
    token of each. ``deferred``: the layers whose evicting rows are compacted after the step, all layers together
    (:func:`vase.vllm.compact.evict_deferred`, each row's at the start of the next step that schedules it:
    :meth:`WorkerState.flush`); ``gone``: the requests finished, aborted or preempted since (their rows are skipped);
    ``done``: the requests whose evictions have run.
    """

    schedule: StepSchedule
    num_reqs: int
    req_ids: list
    rows: torch.Tensor
    qsl: np.ndarray
    n: np.ndarray
    logical_before: np.ndarray
    fill_before: np.ndarray
    fill_after: np.ndarray
    keep: np.ndarray
    evict: np.ndarray
    dense: np.ndarray
    layouts: dict
    shifted: np.ndarray
    seq_lens: torch.Tensor
    positions: torch.Tensor
    ring: RingWrite | None = None
    ring_tok: torch.Tensor | None = None
    cache: dict = field(default_factory=dict)  # tensors shared by the layers of this step (built on first use)
    work: dict = field(default_factory=dict)  # this step's views of the worker's reusable tensors, until it commits
    deferred: list = field(default_factory=list)  # the layers whose rows evict after the step
    gone: set = field(default_factory=set)  # requests finished, aborted or preempted while its evictions wait
    done: set = field(default_factory=set)  # requests whose deferred evictions have run (the others wait)

    @cached_property
    def evicting(self) -> frozenset:
        """The request ids of the rows this step evicts."""
        return frozenset(self.req_ids[i] for i in self.schedule.evict)

    def waiting_ids(self) -> frozenset:
        """The request ids whose deferred evictions of this step have not run and are still to run."""
        return self.evicting - self.gone - self.done


class WorkerState:
    """The requests of one worker in the sequence model (see the module docstring).

    Args:
        settings: the engine's vase settings.
        max_reqs: the most requests the engine runs at once (``max_num_seqs``).
        reports: whether this worker's counts go to ``/metrics`` (the first of a tensor-parallel group: every rank
            evicts the same requests).
        engine: the engine core's data-parallel index (the ``engine`` label of its metrics).
    """

    def __init__(self, settings: EngineSettings, max_reqs: int, reports: bool = True, engine: str = "0"):
        self.s = settings
        self.max_reqs = max_reqs
        self.reports = reports  # counts on /metrics (one worker of a tensor-parallel group)
        self.engine = engine
        self.row_of: dict[str, int] = {}
        self.capacity = 0
        self.free_rows: list[int] = []
        self.front = np.zeros(0, dtype=np.int64)  # per row: blocks never rewritten (settings.front_blocks)
        self.layer_index: dict[str, int] = {}
        self.groups: dict[int, list[str]] = {0: []}  # KV cache group -> its evicting layers
        self.layer_group: dict[str, int] = {}
        self.dims: tuple | None = None
        self.seq: Sequences | None = None
        self.plan: PagedStep | None = None
        self.pending: list[PagedStep] = []  # committed steps whose deferred evictions wait (flush), oldest first
        self.store = HeldStore()  # the buffers of the dense rows' entries those steps hold
        self.buffers: dict = {}  # (key, dtype) -> the memory behind reusable(), kept step after step
        self.stats = {
            "steps": 0,
            "admitted": 0,
            "released": 0,
            "live_max": 0,
            "rows_evicted": 0,
            "dense_rows": 0,
            "compressed_at_prefill": 0,
            "shrunk": 0,
            "flushes_waited": 0,
            "partial_flushes": 0,
            "max_fill": 0,
            "max_blocks_per_row": 0,
            "t_plan": 0.0,
            "t_build": 0.0,
            "t_after": 0.0,
            "t_evict": 0.0,
            "t_step": 0.0,
        }

    # ------------------------------------------------------------------------------------------------ tables
    def allocate(
        self,
        layer_names: list[str],
        kv_heads: int,
        q_heads: int,
        head_dim: int,
        dtype,
        layer_ids: list[int] | None = None,
        head_offset: int = 0,
        groups: dict[int, list[str]] | None = None,
        rows: int = 16,
    ) -> None:
        """Set the layers (in model order; ``layer_ids``: their model indices, which key the random choices, default
        ``0 .. L-1``) and the shapes (``kv_heads``, ``q_heads``: this worker's share with tensor parallelism,
        ``head_offset``: the model's index of its first KV head; ``groups``: the KV cache groups of these layers,
        group index -> layer names, default one group 0); the tables and the query ring are made for ``rows`` rows
        at once (at least 16, at most ``max_reqs``; more grow by doubling, a copy on the step that admits them: sized
        by :meth:`vase.vllm.settings.EngineSettings.concurrent_rows`, a burst of requests does not pay it)."""
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.groups = dict(groups) if groups else {0: list(layer_names)}
        self.layer_group = {name: g for g, names in self.groups.items() for name in names}
        self.dims = (len(layer_names), kv_heads, q_heads, head_dim, dtype)
        ids = list(range(len(layer_names))) if layer_ids is None else list(layer_ids)
        self.seq = Sequences(self.s.config, ids, head_offset=head_offset)
        self._grow(min(self.max_reqs, max(rows, 16)))

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` rows, the old rows copied over (a doubling: rare, amortized)."""
        L, h, hq, d, dtype = self.dims
        seq, old = self.seq, self.capacity
        for layer in range(L):
            if seq.tables.allocated(layer):
                seq.tables.grow(layer, rows=capacity)
            else:
                seq.tables.allocate(layer, capacity, h, self.s.table_tokens, "cpu")
        seq.schedule.resize(capacity)
        seq.tables.reserve(capacity)
        if seq.ring is not None:
            if seq.ring.positions is None:
                seq.ring.prepare(capacity, "cpu")
                for layer in range(L):
                    seq.ring.allocate(layer, hq, d, dtype, "cpu")
            else:
                seq.ring.grow(capacity)
        self.free_rows = list(range(capacity - 1, old - 1, -1)) + self.free_rows
        self.front = np.concatenate([self.front, np.zeros(capacity - old, dtype=np.int64)])
        self.capacity = capacity

    # ------------------------------------------------------------------------------------------- lifecycle
    def admit(
        self,
        req_id: str,
        sampling_params,
        prompt_tokens: int,
        assigned: int | str | None = None,
        computed: int = 0,
    ) -> None:
        """A request (new, or resumed after a preemption: recomputed from its first token) gets a fresh row.

        Its seed: :func:`eviction_seed` (``vase_seed``, else ``SamplingParams.seed``, else 0; the children of an
        ``n > 1`` request draw apart); its budget: ``assigned`` (the scheduler's, ``SchedulerOutput.vase_budgets``:
        tokens, or ``"full"``), else :func:`request_budget`; ``computed``: tokens already in its blocks (a
        prefix-cache hit); its front blocks (:meth:`vase.vllm.settings.EngineSettings.front_blocks`).
        """
        self.release(req_id)
        if not self.free_rows:
            self._grow(min(max(self.capacity * 2, 1), max(self.max_reqs, self.capacity + 1)))
        r = self.free_rows.pop()
        self.row_of[req_id] = r
        if assigned is None:
            budget = request_budget(self.s, req_id, sampling_params)
        else:
            budget = None if assigned == FULL else int(assigned)
        self.seq.admit(r, prompt_tokens, eviction_seed(req_id, sampling_params), budget, evicts=budget is not None)
        if computed:
            self.seq.hold(r, computed)
        self.front[r] = self.s.front_blocks(prompt_tokens) if budget is not None else 0
        self.stats["admitted"] += 1
        self.stats["live_max"] = max(self.stats["live_max"], len(self.row_of))

    def set_budget(self, req_id: str, budget: int) -> None:
        """A running request's new budget (elastic admission shrank it): it evicts to it at its next step if its fill
        is at or past the new limit (:meth:`vase.core.sequence.Sequences.set_budget`); unknown ids are ignored."""
        r = self.row_of.get(req_id)
        if r is not None:
            self.seq.set_budget(r, int(budget))
            self.stats["shrunk"] += 1

    def release(self, req_id: str) -> None:
        """Free a request's row (finished, aborted, preempted); unknown ids are ignored."""
        r = self.row_of.pop(req_id, None)
        if r is not None:
            self.free_rows.append(r)
            self.stats["released"] += 1

    def seed_of(self, req_id: str) -> int:
        """The random key of a live request (tests)."""
        return int(self.seq.tables.row_keys[self.row_of[req_id]])

    def limit_of(self, req_id: str) -> int:
        """The fill at which a live request evicts next (tests)."""
        return self.seq.schedule.limit(self.row_of[req_id])

    def reusable(self, key, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` for the layers of one step (its contents whatever its last user left),
        in memory the worker keeps from step to step under ``key`` and grows when a step needs more: a step's
        per-layer work tensors (scratch cache, selected queries) neither come new from the heap for each layer, between
        the forward's activations, nor fault in fresh pages at each step."""
        n = math.prod(shape)
        buf = self.buffers.get((key, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffers[(key, dtype)] = torch.empty(n + n // 4, dtype=dtype)  # room to grow a little
        return buf[:n].view(shape)

    # ---------------------------------------------------------------------------------------------- commit
    def flush(self, skip=frozenset(), touched=None) -> None:
        """Run the evictions the committed steps deferred (:func:`vase.vllm.compact.evict_deferred`), oldest step
        first, leaving out the requests in ``skip`` (finished, aborted or preempted since); the worker calls it at the
        start of each step, before the step's plan, and before its counters are read.

        ``touched``: the request ids the coming step schedules or changes (None: every request). Only their evictions
        run; the others wait on (the step reads and writes none of their rows, blocks or tables, and vLLM gives back
        a request's trimmed blocks only when it schedules it again), each step's ``skip`` remembered for them: a
        request that sat out a step (``prefill_first``) is compressed at the start of the step that schedules it, and
        when a prompt split across two steps is scheduled again, the compressions of the prompts prefilled beside it
        do not add to this step (nor to the time to first token of the prompts it prefills). A step's buffer of held
        entries goes back once none of its rows waits."""
        from .compact import evict_deferred  # compact reads this module's types

        if not self.pending:
            return
        t = time.perf_counter()
        waiting, ran = [], False
        for p in self.pending:
            p.gone.update(skip)
            due = p.waiting_ids() if touched is None else p.waiting_ids() & touched
            if due:
                evict_deferred(self, p, due)
                p.done.update(due)
                ran = True
            if p.waiting_ids():
                waiting.append(p)
                self.stats["partial_flushes"] += bool(due)
            else:  # every row evicted or gone: the step's held entries are read no more
                p.deferred = []
                self.store.close(p.cache.pop("held", None))
        self.pending = waiting
        if waiting:
            self.stats["flushes_waited"] += 1
        if ran:
            self.stats["t_evict"] += time.perf_counter() - t

    def commit(self) -> None:
        """After a step's forward: the sequence model moves on (fills, eviction counts, ring pointers, limits); the
        evictions its layers deferred wait for :meth:`flush` (nothing the next step's scheduling reads depends on
        them: the fills are the schedule's)."""
        p = self.plan
        if p is None:
            return
        self.plan = None
        p.work.clear()  # the reusable tensors are the next step's
        if p.deferred:
            self.pending.append(p)
        self.seq.commit(p.schedule, p.ring)
        st = self.stats
        n_ev = int(p.evict.sum())
        if n_ev and not st["rows_evicted"]:
            logger.info(
                "vase: first eviction (%d request(s) back to %d entries per layer and KV head)", n_ev, self.s.budget
            )
        # a dense row not evicted before: its prompt (or its first chunk that did not fit) is compressed now
        compressed = sum(1 for d, e in zip(p.dense, p.schedule.evictions_before) if d and not e)
        st["steps"] += 1
        st["rows_evicted"] += n_ev
        st["compressed_at_prefill"] += compressed
        if self.reports:
            metrics.record_step(n_ev, compressed, self.engine)
        st["dense_rows"] += int(p.dense.sum())
        st["max_fill"] = max(st["max_fill"], int(p.fill_after[~p.dense].max(initial=0)))

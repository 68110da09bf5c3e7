"""Worker-side state: each request's eviction state, and the plan of one engine step.

One :class:`WorkerState` per worker process, created by the worker when vase is configured. It holds, per request
(a row of a pool of tables, grown by doubling up to ``max_num_seqs`` rows, never shrunk):

* ``fill``: the physical length (entries held in its blocks); ``evictions``: how many it had; ``row_key``: its
  random key (:func:`vase.core.rng.row_key` of its seed), so sampled eviction depends on the request alone;
* ``positions`` ``[L, rows, H_kv, cap]`` int64: the logical position of each held slot per layer and KV head (heads
  keep different tokens). Before a request's first eviction slot ``i`` holds position ``i`` (nothing was moved yet),
  so the table is only needed up to the steady cap, also for a dense prompt that holds more;
* ``state[name]`` ``[L, rows, H_kv, cap]`` float32: the policy's per-slot state (``policy.state_names``: H2O's
  ``acc``, VaSE's slot ``order``), moved with its entries; ``memo`` ``[L, rows]`` int64: H2O's ``acc_upto``;
* the query ring ``[L, rows, H_q, window, D]`` (model dtype): the last ``window`` post-RoPE queries of the request,
  with their logical positions and validity ``[rows, window]`` (the same for every layer).

The scheduler and the worker share no data at run time: the worker reproduces each request's physical fill from the
token counts it is given each step (``fill += n``; a fill reaching the limit becomes ``budget``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core import rng
from .settings import EngineSettings

# vLLM configures the loggers under "vllm" only: a child of it prints with vLLM's format, in the worker's process
logger = logging.getLogger("vllm.plugins.vase")
# The state of this process's worker (one per process: tensor parallelism is refused). The attention backend reads the
# step's plan from it; in an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) tests and benchmarks read its stats.
ACTIVE: WorkerState | None = None


@dataclass
class StepPlan:
    """What one engine step does, per batch row ``r`` (the runner's ``input_batch`` order) and per new token.

    Row arrays (numpy, ``[R]``): ``n`` new tokens, ``logical_before`` (RoPE position of the first new token),
    ``fill_before`` / ``fill_after`` (physical), ``keep`` (physical after the step), ``evict`` (bool: the row is
    compacted back to ``budget`` after this step's attention), ``dense`` (bool: the row's entries do not fit in its
    blocks, so it is attended outside the paged cache and compressed), ``qsl`` ``[R+1]`` query start locations.
    Tensors: ``rows`` ``[R]`` pool rows; ``block_rows`` ``[R, nb]`` block ids; ``seq_lens`` ``[R]`` int32 for the
    kernel (physical; ``n`` for dense rows, which the kernel runs over the null block and whose output is replaced);
    ``slot_mapping`` ``[T]`` int64 physical slots (-1 for dense rows: not written); ``positions`` ``[T]`` logical;
    ``ring_tok``, ``ring_row``, ``ring_slot``: which new queries go to which ring entry.
    """

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
    block_rows: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    ring_tok: torch.Tensor | None = None
    ring_row: torch.Tensor | None = None
    ring_slot: torch.Tensor | None = None
    cache: dict = field(default_factory=dict)  # tensors shared by the layers of this step (built on first use)


class WorkerState:
    """Per-request eviction state of one worker (see the module docstring).

    Args:
        settings: the engine's vase settings.
        max_reqs: the most requests the engine runs at once (``max_num_seqs``).
    """

    def __init__(self, settings: EngineSettings, max_reqs: int):
        self.s = settings
        self.max_reqs = max_reqs
        self.row_of: dict[str, int] = {}
        self.capacity = 0
        self.free_rows: list[int] = []
        self.fill = np.zeros(0, dtype=np.int64)
        self.evictions = np.zeros(0, dtype=np.int64)
        self.row_key = np.zeros(0, dtype=np.int64)
        self.limit = np.zeros(0, dtype=np.int64)  # fill of the next eviction
        self.ring_next = np.zeros(0, dtype=np.int64)
        self.layer_index: dict[str, int] = {}
        self.dims: tuple | None = None
        self.positions: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.memo: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None
        self.ring_pos: torch.Tensor | None = None
        self.ring_valid: torch.Tensor | None = None
        self.plan: StepPlan | None = None
        self.stats = {
            "steps": 0,
            "admitted": 0,
            "released": 0,
            "live_max": 0,
            "rows_evicted": 0,
            "dense_rows": 0,
            "max_fill": 0,
            "max_blocks_per_row": 0,
            "t_plan": 0.0,
            "t_build": 0.0,
            "t_after": 0.0,
            "t_evict": 0.0,
            "t_step": 0.0,
        }

    # ------------------------------------------------------------------------------------------------ tables
    def allocate(self, layer_names: list[str], kv_heads: int, q_heads: int, head_dim: int, dtype) -> None:
        """Set the layers (in model order) and the shapes; the tables are made for the first rows."""
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.dims = (len(layer_names), kv_heads, q_heads, head_dim, dtype)
        self._grow(min(self.max_reqs, 16))

    def _grow(self, capacity: int) -> None:
        """Tables for ``capacity`` rows, the old rows copied over (a doubling: rare, amortized)."""
        L, h, hq, d, dtype = self.dims
        old = self.capacity
        width, window = self.s.cap_tokens, self.s.config.window

        def grown(t: torch.Tensor | None, shape, fill, dim: int, dt) -> torch.Tensor:
            new = torch.full(shape, fill, dtype=dt)
            if t is not None:
                new.narrow(dim, 0, old).copy_(t)
            return new

        self.positions = grown(self.positions, (L, capacity, h, width), -1, 1, torch.int64)
        names = self.s.config.policy.state_names
        self.state = {n: grown(self.state.get(n), (L, capacity, h, width), 0.0, 1, torch.float32) for n in names}
        self.memo = grown(self.memo, (L, capacity), -1, 1, torch.int64)
        if window:
            self.ring = grown(self.ring, (L, capacity, hq, window, d), 0.0, 1, dtype)
            self.ring_pos = grown(self.ring_pos, (capacity, window), -1, 0, torch.int64)
            self.ring_valid = grown(self.ring_valid, (capacity, window), False, 0, torch.bool)
        for name in ("fill", "evictions", "row_key", "limit", "ring_next"):
            arr = np.zeros(capacity, dtype=np.int64)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self.free_rows = list(range(capacity - 1, old - 1, -1)) + self.free_rows
        self.capacity = capacity

    # ------------------------------------------------------------------------------------------- lifecycle
    def admit(self, req_id: str, sampling_params, prompt_tokens: int) -> None:
        """A request (new, or resumed after a preemption: recomputed from its first token) gets a fresh row.

        Its seed: ``sampling_params.extra_args["vase_seed"]``, else ``sampling_params.seed``, else 0.
        """
        self.release(req_id)
        if not self.free_rows:
            self._grow(min(max(self.capacity * 2, 1), max(self.max_reqs, self.capacity + 1)))
        r = self.free_rows.pop()
        self.row_of[req_id] = r
        extra = getattr(sampling_params, "extra_args", None) or {}
        seed = extra.get("vase_seed", getattr(sampling_params, "seed", None))
        self.row_key[r] = rng.row_key(0 if seed is None else int(seed))
        self.fill[r] = 0
        self.evictions[r] = 0
        self.limit[r] = self.s.first_limit(prompt_tokens)
        self.ring_next[r] = 0
        self.positions[:, r] = -1
        for t in self.state.values():
            t[:, r] = 0.0
        self.memo[:, r] = -1
        if self.ring is not None:
            self.ring_pos[r] = -1
            self.ring_valid[r] = False
        self.stats["admitted"] += 1
        self.stats["live_max"] = max(self.stats["live_max"], len(self.row_of))

    def release(self, req_id: str) -> None:
        """Free a request's row (finished, aborted, preempted); unknown ids are ignored."""
        r = self.row_of.pop(req_id, None)
        if r is not None:
            self.free_rows.append(r)
            self.stats["released"] += 1

    def seed_of(self, req_id: str) -> int:
        """The random key of a live request (tests)."""
        return int(self.row_key[self.row_of[req_id]])

    # ---------------------------------------------------------------------------------------------- commit
    def commit(self) -> None:
        """After a step's forward: fills, eviction counts, ring pointers and limits move on."""
        p = self.plan
        if p is None:
            return
        self.plan = None
        rows = p.rows.numpy()
        self.fill[rows] = p.keep
        ev = rows[p.evict]
        self.evictions[ev] += 1
        self.limit[ev] = self.s.limit  # after the first eviction every request evicts at budget + buffer
        if self.ring is not None:
            self.ring_next[rows] = (self.ring_next[rows] + np.minimum(p.n, self.s.config.window)) % self.s.config.window
        st = self.stats
        if ev.size and not st["rows_evicted"]:
            logger.info(
                "vase: first eviction (%d request(s) back to %d entries per layer and KV head)", ev.size, self.s.budget
            )
        st["steps"] += 1
        st["rows_evicted"] += int(p.evict.sum())
        st["dense_rows"] += int(p.dense.sum())
        st["max_fill"] = max(st["max_fill"], int(p.fill_after[~p.dense].max(initial=0)))

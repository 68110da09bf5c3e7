"""Scheduler side: vLLM's ``Scheduler`` whose full-attention KV managers never give a request more than its cap.

Hook: ``scheduler_cls="vase.vllm.scheduler.VaseScheduler"``. ``VaseScheduler.__init__`` re-classes each
``FullAttentionManager`` of ``kv_cache_manager.coordinator.single_type_managers`` to
:class:`CappedFullAttentionManager` (the same instance state; three methods bound the token count by the request's
cap). Everything else is vLLM's: ``num_computed_tokens`` stays the logical length (RoPE positions, ``max_model_len``,
stop conditions); only the blocks follow the physical bound ``budget + buffer``.

* A request's cap is ``ceil((budget + buffer) / block_size)`` blocks; with a dense prompt (``compress_prompt=False``,
  ``vase:preset=paper``) it follows the prompt until the request's first eviction, after which the blocks past the
  steady cap are returned to the pool (swapped for the null block in place, as vLLM frees a sliding window's blocks,
  so the request's block list keeps its length).
* A request with its own budget (``vase_budget``, :func:`vase.vllm.state.request_budget`) has the cap of that
  budget; one served with the full cache (``vase_budget="full"``) has its whole length as its cap, as plain vLLM.
* Admission ``reserve`` (default): a request is given all the blocks it may ever hold (its cap, or fewer if its prompt
  + ``max_tokens`` need fewer) when it is admitted; vLLM's admission gate then admits it only if they are free, and it
  is never preempted for memory. ``grow``: blocks are added as the request grows, up to its cap, as vLLM does.

Memory is freed by vLLM itself when a request finishes, is aborted or is preempted (``_free_request`` /
``_preempt_request`` -> ``kv_cache_manager.free``); :meth:`CappedFullAttentionManager.free` also drops the cap.
"""

from __future__ import annotations

import math

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from . import metrics
from .settings import EngineSettings, settings_from
from .state import request_budget

logger = init_logger("vllm.plugins.vase")


class CappedFullAttentionManager(FullAttentionManager):
    """A ``FullAttentionManager`` that allocates a request at most its cap (see the module docstring).

    Set by :class:`VaseScheduler` (never constructed): ``vase`` (the settings), ``vase_caps`` (request id -> cap in
    tokens), ``vase_first`` (request id -> fill of its first eviction and its steady cap in blocks, for dense
    prompts), ``vase_stats``.
    """

    vase: EngineSettings
    vase_caps: dict
    vase_first: dict
    vase_stats: dict

    def _vase_tokens(self, request_id: str, num_tokens: int) -> int:
        cap = self.vase_caps.get(request_id, self.vase.cap_tokens)
        if self.vase.admission == "reserve":
            return cap  # every block the request may hold, from the start
        return min(num_tokens, cap)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
        return super().get_num_blocks_to_allocate(
            request_id, self._vase_tokens(request_id, num_tokens), *args, **kwargs
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        n = self._vase_tokens(request_id, num_tokens)
        out = super().allocate_new_blocks(request_id, n, min(num_tokens_main_model, n))
        held = len(self.req_to_blocks[request_id])
        live = held - sum(1 for b in self.req_to_blocks[request_id] if b.is_null)
        stats = self.vase_stats
        stats["max_blocks_held"] = max(stats["max_blocks_held"], live)
        cap_blocks = self.vase_caps.get(request_id, self.vase.cap_tokens) // self.block_size
        stats["max_over_cap"] = max(stats["max_over_cap"], live - cap_blocks)
        return out

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        """After the first eviction of a request with a dense prompt, return its blocks past the steady cap."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        first = self.vase_first.get(request_id)
        if first is None or processed_computed_tokens < first[0]:
            return
        del self.vase_first[request_id]
        steady = first[1]
        self.vase_caps[request_id] = steady * self.block_size
        self._remove_blocks_in_range(request_id, steady, len(self.req_to_blocks.get(request_id, ())))
        self.vase_stats["trimmed"] += 1

    def free(self, request_id: str) -> None:
        self.vase_caps.pop(request_id, None)
        self.vase_first.pop(request_id, None)
        super().free(request_id)


class VaseScheduler(Scheduler):
    """vLLM's scheduler with per-request block caps (see the module docstring) and a few counters.

    ``vase_stats``: ``max_blocks_held`` (the most live blocks one request held), ``max_over_cap`` (the most blocks
    a request held above its cap: 0 or less), ``peak_running``, ``preemptions``, ``trimmed`` (dense prompts cut back
    to the cap), ``cap_blocks``, ``kv_blocks_held`` / ``kv_blocks_without_eviction`` (the pool's blocks the running
    requests hold after the last step, and ``ceil(tokens / block_size)`` summed over them: what plain vLLM would
    hold) and their peaks ``peak_kv_blocks_held`` / ``peak_kv_blocks_without_eviction``; the same on ``/metrics``
    (:mod:`vase.vllm.metrics`). Without vase in ``additional_config`` it is the stock scheduler plus these counters
    (the benchmark's plain engine uses it that way).

    Raises:
        VaseConfigError: at engine start, for a configuration :func:`vase.vllm.settings.settings_from` refuses.
        ValueError: a KV cache manager other than full attention (a model with other layer kinds).
    """

    def __init__(self, vllm_config, *args, **kwargs):
        self.vase = settings_from(vllm_config)  # a clear error at engine start
        super().__init__(vllm_config, *args, **kwargs)
        self.vase_stats = {
            "max_blocks_held": 0,
            "max_over_cap": -(10**9),
            "peak_running": 0,
            "preemptions": 0,
            "trimmed": 0,
            "cap_blocks": None,
            "kv_blocks_held": 0,
            "kv_blocks_without_eviction": 0,
            "peak_kv_blocks_held": 0,
            "peak_kv_blocks_without_eviction": 0,
        }
        self._vase_managers: list[CappedFullAttentionManager] = []
        if self.vase is None or not self.vase.evicts:
            return
        for m in self.kv_cache_manager.coordinator.single_type_managers:
            if type(m) is not FullAttentionManager:
                raise ValueError(f"vase: KV cache manager {type(m).__name__} is not full attention")
            m.__class__ = CappedFullAttentionManager
            m.vase, m.vase_caps, m.vase_first, m.vase_stats = self.vase, {}, {}, self.vase_stats
            self._vase_managers.append(m)
        self.vase_stats["cap_blocks"] = self.vase.cap_blocks
        logger.info("vase: %s", self.vase.describe())

    def add_request(self, request) -> None:
        if self._vase_managers:
            s = self.vase
            budget = request_budget(s, request.request_id, request.sampling_params)
            max_len = min(self.max_model_len, request.num_prompt_tokens + max(int(request.max_tokens or 0), 1))
            cap = s.request_cap_tokens(request.num_prompt_tokens, max_len, budget, full=budget is None)
            for m in self._vase_managers:
                m.vase_caps[request.request_id] = cap
                # a dense prompt: its blocks past the steady cap go after its first eviction
                if budget is not None and cap > s.cap_blocks_for(budget) * s.block_size:
                    first = s.first_eviction(request.num_prompt_tokens, budget)
                    m.vase_first[request.request_id] = (first, s.cap_blocks_for(budget))
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        st = self.vase_stats
        st["peak_running"] = max(st["peak_running"], len(self.running))
        if out.preempted_req_ids:
            st["preemptions"] += len(out.preempted_req_ids)
        if self._vase_managers:
            bs = self.vase.block_size
            held = blocks_in_use(self)
            without = sum(-(-r.num_tokens // bs) for r in self.running)  # ceil: as plain vLLM's blocks
            st["kv_blocks_held"], st["kv_blocks_without_eviction"] = held, without
            st["peak_kv_blocks_held"] = max(st["peak_kv_blocks_held"], held)
            st["peak_kv_blocks_without_eviction"] = max(st["peak_kv_blocks_without_eviction"], without)
            metrics.record_blocks(held, without)
        return out


def blocks_in_use(scheduler) -> int:
    """Blocks of the pool held by requests now (the pool's size less its free blocks and the null block)."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def cap_blocks_for(settings: EngineSettings, prompt_tokens: int, max_len: int) -> int:
    """Blocks a request may hold (see :meth:`vase.vllm.settings.EngineSettings.request_cap_tokens`)."""
    return math.ceil(settings.request_cap_tokens(prompt_tokens, max_len) / settings.block_size)

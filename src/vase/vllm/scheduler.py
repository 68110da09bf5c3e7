"""Scheduler side: vLLM's ``Scheduler`` whose full-attention KV managers never give a request more than its cap.

Hook: ``scheduler_cls="vase.vllm.scheduler.VaseScheduler"``. vLLM builds the KV cache manager of each group from
its spec through its KV cache spec registry (``KVCacheSpecRegistry``, the extension point for out-of-tree specs):
``VaseScheduler.__init__`` registers :class:`CappedFullAttentionManager` for vase's full-attention spec
(:class:`vase.vllm.spec.VaseFullAttentionSpec`) before vLLM builds them, then hands each one its settings (three
methods bound the token count by the request's cap). Everything else is vLLM's: ``num_computed_tokens`` stays the
logical length (RoPE positions, ``max_model_len``, stop conditions); only the blocks follow the physical bound
``budget + buffer``.

* A request's cap is ``ceil((budget + buffer) / block_size)`` blocks; with a dense prompt (``compress_prompt=False``,
  ``vase:preset=paper``) it follows the prompt until the request's first eviction, after which the blocks past the
  steady cap are returned to the pool (swapped for the null block in place, as vLLM frees a sliding window's blocks,
  so the request's block list keeps its length).
* A request with its own budget (``vase_budget``, :func:`vase.vllm.state.request_budget`) has the cap of that
  budget; one served with the full cache (``vase_budget="full"``) has its whole length as its cap, as plain vLLM.
* Admission ``elastic`` (default, :mod:`vase.vllm.admission`): a request is given all the blocks of its budget when it
  is admitted, and the budget is the largest the pool allows for the running and waiting requests, down to a floor
  (``min_budget``); running requests above that level shrink to it (their worker evicts them to the new budget at
  their next step, and the blocks past their new cap then go back to the pool). ``reserve``: a request is given all
  the blocks of its own budget (its cap, or fewer if its prompt + ``max_tokens`` need fewer) when it is admitted, and
  waits until they are free. Neither is ever preempted for memory. ``grow``: blocks are added as the request grows, up
  to its cap, as vLLM does (vLLM preempts when the pool runs out).
* ``prefill_first`` (default): a request whose prefill has just ended sits out its first decode step when that step
  admits new prompts (vLLM's ``Request.next_decode_eligible_step``, as its own schedulers use it), so that the step
  carries the waiting prompts' prefill and none of the new requests' decodes; a prompt compressed at prefill then has
  its compression deferred by the worker to the start of the next step that schedules it
  (:meth:`vase.vllm.state.WorkerState.flush`), so the prompts admitted behind it do not wait for it either. The
  request decodes one step later; at most once per request.
* ``prefill_priority`` (default): a step whose elastic plan admits new prompts, with no running request shrinking,
  carries their prefill alone: every decoding request sits it out (``next_decode_eligible_step`` again), never two
  steps in a row (the step after always decodes), and prefills still in progress (chunks) go on. A request arriving
  beside many decoding ones then waits for the step under way and its prefill, not for their decodes as well
  (vLLM V0's order: prefills first); each arrival delays the running requests by that one step. Not with shrinks: the
  blocks they give back come only after the shrunk requests' next step, so the prompt could not be admitted yet.
* The worker hears each request's budget from the scheduler: ``SchedulerOutput.vase_budgets`` (request id -> budget,
  or ``"full"``) names the budget of every request scheduled for the first time and of every request shrunk in this
  step (the step's output reaches the worker before the step runs).

Memory is freed by vLLM itself when a request finishes, is aborted or is preempted (``_free_request`` /
``_preempt_request`` -> ``kv_cache_manager.free``); :meth:`CappedFullAttentionManager.free` also drops the cap. Blocks
a request gives back early (a dense prompt's after its first eviction, a shrunk request's past its new cap) are freed
in ``remove_skipped_blocks``, which vLLM calls with the tokens already processed: only once the step that evicted has
run.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import metrics
from .admission import Demand, plan_admission
from .manager import CappedFullAttentionManager, register_capped_manager
from .seam import Scheduler, SlidingWindowManager, init_logger
from .settings import FULL, settings_from
from .state import request_budget

logger = init_logger("vllm.plugins.vase")


@dataclass
class _Request:
    """What the scheduler keeps of a request: its prompt, the most tokens it may hold (prompt + max_tokens, at most
    the model's length), the budget it asked for (``target``; None: the full cache) and the one it holds now."""

    prompt: int
    max_len: int
    target: int | None
    budget: int | None


class VaseScheduler(Scheduler):
    """vLLM's scheduler with per-request block caps, elastic budgets (see the module docstring) and a few counters.

    ``vase_stats``: ``max_blocks_held`` (the most live blocks one request held), ``max_over_cap`` (the most blocks
    a request held above its cap: 0 or less), ``peak_running``, ``preemptions``, ``trimmed`` (blocks given back
    early: dense prompts cut back to the cap, shrunk requests), ``shrinks`` (running requests whose budget was lowered),
    ``admitted_below_budget`` (requests admitted below the budget they asked for), ``min_budget_held`` (the smallest
    budget a request held), ``held_back`` (requests that sat out their first decode step, ``prefill_first``),
    ``prefill_alone`` (steps that admitted new prompts with the decodes paused, ``prefill_priority``) and
    ``decodes_paused`` (decodes they left out),
    ``groups_capped`` / ``groups_sliding`` (KV cache groups vase caps, sliding-window groups
    left to vLLM), ``cap_blocks``, ``kv_blocks_held`` / ``kv_blocks_without_eviction`` (the pool's blocks the
    running requests hold after the last step, and ``ceil(tokens / block_size)`` summed over them: what plain vLLM
    would hold) and their peaks ``peak_kv_blocks_held`` / ``peak_kv_blocks_without_eviction``; the same on
    ``/metrics`` (:mod:`vase.vllm.metrics`). Without vase in ``additional_config`` it is the stock scheduler plus these
    counters (the benchmark's plain engine uses it that way).

    Only the full-attention KV cache groups are capped; a hybrid model's sliding-window groups stay vLLM's (their
    blocks out of the window go back as the request moves on), and elastic admission counts their window with each
    request.

    Raises:
        VaseConfigError: at engine start, for a configuration :func:`vase.vllm.settings.settings_from` refuses.
        ValueError: a KV cache manager other than full attention or a sliding window (a model with other layer
            kinds), or no full-attention layer.
    """

    def __new__(cls, vllm_config, *args, **kwargs):
        # vLLM builds the configured scheduler_cls; under its async scheduling (decided with the final configuration)
        # the async variant, vase.vllm.async_scheduler.VaseAsyncScheduler
        if cls is VaseScheduler and vllm_config.scheduler_config.async_scheduling:
            from .async_scheduler import VaseAsyncScheduler

            cls = VaseAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config, *args, **kwargs):
        self.vase = settings_from(vllm_config)  # a clear error at engine start
        if self.vase is not None and self.vase.evicts:
            register_capped_manager()
        super().__init__(vllm_config, *args, **kwargs)
        self._vase_engine = str(vllm_config.parallel_config.data_parallel_index)  # the label of its metrics
        self.vase_stats = {
            "max_blocks_held": 0,
            "max_over_cap": -(10**9),
            "peak_running": 0,
            "preemptions": 0,
            "trimmed": 0,
            "shrinks": 0,
            "admitted_below_budget": 0,
            "held_back": 0,
            "prefill_alone": 0,
            "decodes_paused": 0,
            "min_budget_held": None,
            "cap_blocks": None,
            "kv_blocks_held": 0,
            "kv_blocks_without_eviction": 0,
            "peak_kv_blocks_held": 0,
            "peak_kv_blocks_without_eviction": 0,
        }
        self._vase_managers: list[CappedFullAttentionManager] = []
        self._vase_reqs: dict[str, _Request] = {}
        self._vase_shrinking: set[str] = set()
        self._vase_held: set[str] = set()  # requests that sat out their first decode step (prefill_first)
        self._vase_admits = False  # whether the elastic plan of this step admits a waiting request
        self._vase_alone = False  # whether the last step paused the decodes (prefill_priority)
        if self.vase is None or not self.vase.evicts:
            return
        self._vase_others = []  # sliding-window managers: vLLM bounds them (blocks out of the window go back)
        for m in self.kv_cache_manager.coordinator.single_type_managers:
            if type(m) is SlidingWindowManager:
                self._vase_others.append(m)
                continue
            if type(m) is not CappedFullAttentionManager:
                raise ValueError(
                    f"vase: KV cache manager {type(m).__name__} is neither vase's capped full attention nor a sliding "
                    "window (which vLLM bounds)"
                )
            m.vase, m.vase_caps, m.vase_trims, m.vase_fronts, m.vase_stats = self.vase, {}, {}, {}, self.vase_stats
            m.vase_release = self._vase_release
            self._vase_managers.append(m)
        if not self._vase_managers:
            raise ValueError("vase: the model has no full-attention layer to evict")
        self._vase_all = self._vase_managers + self._vase_others
        # the first capped group's index among the coordinator's groups (its prefix-cache hits)
        self._vase_group = list(self.kv_cache_manager.coordinator.single_type_managers).index(self._vase_managers[0])
        self.vase_stats["groups_capped"] = len(self._vase_managers)
        self.vase_stats["groups_sliding"] = len(self._vase_others)
        self._vase_window_specs = [m.kv_cache_spec for m in self._vase_others]
        self.vase_stats["cap_blocks"] = self.vase.cap_blocks
        logger.info("vase: %s", self.vase.describe())

    def _vase_release(self, blocks: list) -> None:
        """Blocks a trim gives back (tail first): to the pool now; with ``defer_block_free`` (async scheduling) once
        the last step scheduled, whose block table still lists them, is processed (vLLM's deferred frees)."""
        if self.defer_block_free and self.sched_step_seq > self.processed_step_seq:
            self.deferred_frees.append((self.sched_step_seq, blocks[::-1]))  # drained in reverse: tail first
        else:
            self.kv_cache_manager.block_pool.free_blocks(blocks)

    def add_request(self, request) -> None:
        if self._vase_managers:
            s, rid = self.vase, request.request_id
            budget = request_budget(s, rid, request.sampling_params)
            max_len = min(self.max_model_len, request.num_prompt_tokens + max(int(request.max_tokens or 0), 1))
            self._vase_reqs[rid] = _Request(request.num_prompt_tokens, max_len, budget, budget)
            self._vase_assign(rid, budget)
        super().add_request(request)

    def _vase_blocks(self, req: _Request, budget: int | None) -> int:
        """Blocks a request holds at ``budget`` (None: the full cache), with its dense prompt until its first
        eviction (:meth:`vase.vllm.settings.EngineSettings.request_cap_tokens`)."""
        s = self.vase
        return s.request_cap_tokens(req.prompt, req.max_len, budget, full=budget is None) // s.block_size

    def _vase_assign(self, rid: str, budget: int | None) -> None:
        """The cap of a request not yet running, at ``budget``; a dense prompt's blocks past the steady cap go after
        its first eviction."""
        s, req = self.vase, self._vase_reqs[rid]
        req.budget = budget
        cap = self._vase_blocks(req, budget) * s.block_size
        front = s.front_blocks(req.prompt) if budget is not None else 0
        for m in self._vase_managers:
            m.vase_caps[rid] = cap
            m.vase_trims.pop(rid, None)
            if budget is not None:
                m.vase_fronts[rid] = front
            steady = s.cap_blocks_for(budget) if budget is not None else 0
            if budget is not None and (front or cap > steady * s.block_size):
                # its dense prompt's blocks past the steady cap (and with prefix caching its front blocks) go back
                # after its first eviction
                m.vase_trims[rid] = (s.first_eviction(req.prompt, budget), front, front + steady)

    def _vase_extra(self, req: _Request | None) -> int:
        """Blocks a request's sliding-window groups hold at most (its window plus the tokens of its prefill step, at
        most its length; vLLM's own bound): elastic admission counts them."""
        if req is None or not self._vase_window_specs:
            return 0
        whole = -(-req.max_len // self.vase.block_size)
        step = max(1, min(req.prompt, self.scheduler_config.max_num_batched_tokens))
        return sum(
            min(whole, w.max_admission_blocks_per_request(step, self.max_model_len)) for w in self._vase_window_specs
        )

    def _vase_elastic(self) -> dict:
        """The step's elastic plan (:func:`vase.vllm.admission.plan_admission`): caps of the waiting requests it
        admits, shrinks of running requests; returns ``{request id: new budget}`` of the shrunk ones.

        Blocks are counted as the pool holds them: a block shared by ``k`` requests (a prompt prefix, with prefix
        caching) counts ``1 / k`` for each, and a waiting request's prefix-cache hits on blocks in use cost nothing;
        the sliding-window groups of a hybrid model count with each request's window."""
        s, m = self.vase, self._vase_managers[0]
        groups = len(self._vase_managers)  # every full-attention group holds the same caps
        room = self.max_num_active_reqs - len(self.running)
        if room <= 0:
            return {}
        waiting = [r for _, r in zip(range(room), self.waiting) if r.request_id in self._vase_reqs]
        if not waiting:
            return {}
        running, current = [], {}
        for r in self.running:
            rid = r.request_id
            req = self._vase_reqs.get(rid)
            extra = self._vase_extra(req)
            if rid in self._vase_shrinking and rid not in m.vase_trims:
                self._vase_shrinking.discard(rid)  # its trim is done
            if req is None or req.budget is None:
                running.append(Demand(rid, ((0, _share(self._vase_all, rid)),)))
            elif rid in self._vase_shrinking:  # its blocks past the new cap go back before anyone is admitted
                _, first, end = m.vase_trims[rid]
                running.append(Demand(rid, ((req.budget, (end - first) * groups + extra),)))
            elif rid in m.vase_trims or r.num_computed_tokens < r.num_prompt_tokens:
                # a dense prompt until its first eviction, a prefill: cannot shrink now, counts what it holds
                running.append(Demand(rid, ((req.budget, _share(self._vase_all, rid) + extra),)))
            else:
                steps = [b for b in s.ladder(req.target) if b <= req.budget]
                running.append(Demand(rid, tuple((b, self._vase_cap(req, b) * groups + extra) for b in steps)))
                current[rid] = req.budget
        queued = []
        for r in waiting:
            req = self._vase_reqs[r.request_id]
            extra = self._vase_extra(req) - self._vase_shared_hits(r) * groups
            if req.target is None:
                queued.append(Demand(r.request_id, ((0, self._vase_blocks(req, None) * groups + extra),)))
            else:
                steps = s.ladder(req.target)
                queued.append(
                    Demand(r.request_id, tuple((b, self._vase_blocks(req, b) * groups + extra) for b in steps))
                )
        pool = self.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1 - self.kv_cache_manager.watermark_blocks  # free and held, less the watermark
        plan = plan_admission(running, queued, usable, current)
        self._vase_admits = bool(plan.admit)
        for rid, (budget, _) in plan.admit.items():
            if self._vase_reqs[rid].target is not None:
                self._vase_assign(rid, budget)
        hold = (pool.num_gpu_blocks + 1) * s.block_size  # more than the pool: vLLM's own admission check fails
        for r in waiting:  # the plan's word is final: a request it did not admit waits, even if its first blocks fit
            if r.request_id not in plan.admit:
                for mgr in self._vase_managers:
                    mgr.vase_caps[r.request_id] = hold
        changes = {}
        for rid, (budget, _) in plan.shrink.items():
            req, own = self.requests[rid], self._vase_reqs[rid]
            own.budget = budget
            front, cap = s.front_blocks(own.prompt), self._vase_cap(own, budget)
            for mgr in self._vase_managers:  # once its next step has run, it holds `cap` blocks after its front
                mgr.vase_trims[rid] = (req.num_computed_tokens + 1, front, front + cap)
            self._vase_shrinking.add(rid)
            changes[rid] = budget
        self.vase_stats["shrinks"] += len(changes)
        return changes

    def _vase_cap(self, req: _Request, budget: int) -> int:
        """Blocks of one full-attention group a request holds past its first eviction at ``budget``."""
        return min(self.vase.cap_blocks_for(budget), -(-req.max_len // self.vase.block_size))

    def _vase_shared_hits(self, request) -> int:
        """A waiting request's prefix-cache hits on blocks other requests hold now (prefix caching): they cost it no
        block of the pool."""
        if not self.vase.prefix_caching or request.num_computed_tokens:
            return 0
        blocks, hit, *_ = self._get_local_prefix_cache_hit(request)
        if not hit:
            return 0
        g = self._vase_group
        return sum(1 for b in blocks.blocks[g] if b.ref_cnt > 0) if g < len(blocks.blocks) else 0

    def _get_local_prefix_cache_hit(self, request):
        """vLLM's prefix-cache hit, at most the prompt less its last ``window`` tokens (their queries score the
        request's first eviction, so they are computed even when their blocks are cached): the same scores with or
        without a hit.

        A shorter hit is looked up again at that length, not cut from the longer one: a sliding-window group's hit is
        null blocks followed by the real blocks of the window before the hit's end, so the longer hit cut short would
        end in null blocks where the tokens after the shorter end read their window. The lookup at the shorter length
        is the hit vLLM itself makes for a prompt of that length, in every KV cache group. For it to find the window
        before that length, a model with sliding-window groups names it as the request's shared-prefix boundary
        (vLLM's ``Request.shared_prefix_boundary``, the junction its sparse retention keeps the window's blocks
        cached at): the next request with this prompt then hits up to it in every group."""
        blocks, hit, boundary, *rest = super()._get_local_prefix_cache_hit(request)
        req = self._vase_reqs.get(request.request_id)
        if not self._vase_managers or req is None or req.target is None:
            return (blocks, hit, boundary, *rest)
        bs = self.vase.block_size
        most = max(request.num_prompt_tokens - self.vase.config.window, 0) // bs * bs
        if self._vase_others and most:
            boundary = max(boundary, most)
        if hit <= most:
            return (blocks, hit, boundary, *rest)
        manager = self.kv_cache_manager
        if most == 0:
            return (manager.empty_kv_cache_blocks, 0, boundary, *rest)
        groups, shorter, uncached = manager.coordinator.find_longest_cache_hit(request.block_hashes, most)
        if uncached:  # as vLLM's own lookup pins a lagging group's junction
            boundary = max(boundary, shorter + uncached)
        return (manager.create_kv_cache_blocks(groups), shorter, boundary, *rest)

    def _vase_hold_back(self) -> None:
        """``prefill_first``: the requests whose prefill ended in the last step (their first token out; a compressed
        prompt's compression deferred by the worker) sit out this step, which admits new prompts; once per request."""
        for r in self.running:
            rid = r.request_id
            if rid not in self._vase_reqs or rid in self._vase_held:
                continue
            if r.num_output_tokens != 1 or r.num_computed_tokens != r.num_prompt_tokens:
                continue  # not right after its prefill
            # schedule() advances current_step before it checks eligibility: + 2 skips this step alone
            r.next_decode_eligible_step = max(r.next_decode_eligible_step, self.current_step + 2)
            self._vase_held.add(rid)
            self.vase_stats["held_back"] += 1

    def _vase_pause_decodes(self) -> None:
        """``prefill_priority``: every running request past its prompt sits out this step, which admits new prompts
        (requests still prefilling go on)."""
        paused = 0
        for r in self.running:
            if r.num_computed_tokens >= r.num_prompt_tokens:
                # schedule() advances current_step before it checks eligibility: + 2 skips this step alone
                r.next_decode_eligible_step = max(r.next_decode_eligible_step, self.current_step + 2)
                paused += 1
        if paused:
            self.vase_stats["prefill_alone"] += 1
            self.vase_stats["decodes_paused"] += paused
        self._vase_alone = paused > 0

    def schedule(self, *args, **kwargs):
        self._vase_admits = False
        changes = self._vase_elastic() if self._vase_managers and self.vase.elastic and self.waiting else {}
        alone, self._vase_alone = self._vase_alone, False
        if self._vase_managers and self.vase.prefill_first and self.waiting:
            if self._vase_admits or not self.vase.elastic:
                self._vase_hold_back()
        if self._vase_managers and self.vase.prefill_priority and self._vase_admits and not alone:
            if not changes and not self._vase_shrinking:
                self._vase_pause_decodes()
        out = super().schedule(*args, **kwargs)
        st = self.vase_stats
        st["peak_running"] = max(st["peak_running"], len(self.running))
        if out.preempted_req_ids:
            st["preemptions"] += len(out.preempted_req_ids)
        if self._vase_managers:
            budgets = dict(changes)
            started = [nr.req_id for nr in out.scheduled_new_reqs]
            started += list(out.scheduled_cached_reqs.resumed_req_ids)
            for rid in started:
                req = self._vase_reqs.get(rid)
                if req is None:
                    continue
                budgets[rid] = FULL if req.budget is None else req.budget
                if req.budget is not None and req.target is not None and req.budget < req.target:
                    st["admitted_below_budget"] += 1
            for b in budgets.values():
                if b != FULL:
                    st["min_budget_held"] = b if st["min_budget_held"] is None else min(st["min_budget_held"], b)
            out.vase_budgets = budgets  # read by the worker (vase.vllm.worker) before the step runs
            bs = self.vase.block_size
            held = blocks_in_use(self)
            without = sum(-(-r.num_tokens // bs) for r in self.running)  # ceil: as plain vLLM's blocks
            st["kv_blocks_held"], st["kv_blocks_without_eviction"] = held, without
            st["peak_kv_blocks_held"] = max(st["peak_kv_blocks_held"], held)
            st["peak_kv_blocks_without_eviction"] = max(st["peak_kv_blocks_without_eviction"], without)
            metrics.record_blocks(held, without, self._vase_engine)
            metrics.record_admission(len(changes), self._vase_engine)
        return out

    def finish_requests(self, *args, **kwargs):
        out = super().finish_requests(*args, **kwargs)
        self._vase_forget()
        return out

    def update_from_output(self, *args, **kwargs):
        out = super().update_from_output(*args, **kwargs)
        self._vase_forget()
        return out

    def _vase_forget(self) -> None:
        """Drop what the scheduler kept of requests vLLM no longer knows (finished, aborted)."""
        if len(self._vase_reqs) > len(self.requests):
            for rid in [r for r in self._vase_reqs if r not in self.requests]:
                del self._vase_reqs[rid]
                self._vase_shrinking.discard(rid)
                self._vase_held.discard(rid)


def _share(managers, request_id: str) -> float:
    """Blocks of the pool a request holds in the given KV cache groups, a block shared by ``k`` requests counting
    ``1 / k``."""
    return sum(1 / max(b.ref_cnt, 1) for m in managers for b in m.req_to_blocks.get(request_id, ()) if not b.is_null)


def blocks_in_use(scheduler) -> int:
    """Blocks of the pool held by requests now (the pool's size less its free blocks and the null block)."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

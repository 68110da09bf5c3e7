"""Worker side: vLLM's CPU worker whose model runner keeps each request's eviction state and plans each step.

Hook: ``worker_cls="vase.vllm.worker.VaseCPUWorker"``. With vase configured, the worker's model runner is a
:class:`VaseCPUModelRunner` (built in place of vLLM's: vLLM's ``CPUWorker.init_device`` names its runner class
directly, so the worker replaces the runner it built, before any model is loaded into it), whose state is a
:class:`vase.vllm.state.WorkerState` handed to the attention metadata builders it builds (no global state), and which
overrides these methods of vLLM's V1 runner (``v1/worker/gpu_model_runner.py``), calling each original:

* ``get_kv_cache_spec``: full-attention layers get :class:`vase.vllm.spec.VaseFullAttentionSpec` (memory by the cap);
  sliding-window layers keep vLLM's spec (vLLM frees their blocks out of the window itself);
* ``initialize_kv_cache``: the evicting layers (those of the full-attention KV cache groups), in model order, and the
  shapes of the per-request tables;
* ``_update_states``: finished, aborted and preempted requests free their row; new and resumed ones get a fresh row
  (a resumed request is recomputed from its first token, so its state starts over);
* ``_prepare_inputs``: once the batch rows are final (``input_batch.req_ids``) and the block table committed, the
  step's plan: each row's physical fill before and after, who evicts, who does not fit, the physical slot of every
  new token, the kernel's physical ``seq_lens``, which queries go to the ring;
* ``execute_model``: the plan is committed once the forward has run; the evictions its layers deferred run at the
  start of the next step that schedules (or changes the budget of) one of their requests
  (:meth:`vase.vllm.state.WorkerState.flush`), once the step's tokens have been sampled and sent.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import state as st
from .rules import check_learned
from .seam import (
    CPUModelRunner,
    CPUWorker,
    FullAttentionSpec,
    SlidingWindowSpec,
    extract_layer_index,
    get_tensor_model_parallel_rank,
    init_logger,
)
from .settings import VaseConfigError, settings_from
from .spec import VaseFullAttentionSpec

logger = init_logger("vllm.plugins.vase")


class VaseCPUWorker(CPUWorker):
    """vLLM's ``CPUWorker`` with :class:`VaseCPUModelRunner` when vase is configured (stock otherwise).

    Raises:
        VaseConfigError: at engine start, for a configuration :func:`vase.vllm.settings.settings_from` refuses.
    """

    def __init__(self, vllm_config, *args, **kwargs):
        self.vase = settings_from(vllm_config)  # a clear error at engine start, before the model loads
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self):
        super().init_device()
        if self.vase is not None and self.vase.evicts:
            first = get_tensor_model_parallel_rank() == 0
            engine = str(self.parallel_config.data_parallel_index)
            state = st.WorkerState(self.vase, self.scheduler_config.max_num_seqs, first, engine=engine)
            # vLLM's runner, built by the call above, is dropped before any model or cache is put in it
            self.model_runner = VaseCPUModelRunner(self.vllm_config, self.device, state)

    def vase_stats(self) -> dict | None:
        """This worker's counters (``LLM.collective_rpc("vase_stats")``, one dict per worker, any executor): rows
        admitted and released, evictions, the most blocks a row held, times in seconds; ``live_rows`` (requests it
        holds now), ``layers`` (its evicting layers), ``head_offset`` (the model's index of its first KV head),
        ``held_buffers`` (buffers allocated for dense rows' entries held until their deferred eviction: reused step
        after step, :mod:`vase.vllm.store`), ``flushes_waited`` (steps that left some deferred evictions waiting for
        a later step that schedules their requests) and ``partial_flushes`` (of those, the ones that ran some of the
        same step's rows); None without vase."""
        ws = getattr(self.model_runner, "vase_state", None)
        if ws is None:
            return None
        ws.flush()
        return {
            **ws.stats,
            "live_rows": len(ws.row_of),
            "layers": len(ws.layer_index),
            "head_offset": ws.seq.head_offset if ws.seq else 0,
            "held_buffers": ws.store.allocations,
        }


class VaseCPUModelRunner(CPUModelRunner):
    """vLLM's ``CPUModelRunner`` plus per-request eviction state and a per-step plan (see the module docstring).

    Args:
        vllm_config, device: as vLLM's runner.
        state: the worker's :class:`vase.vllm.state.WorkerState`.
    """

    def __init__(self, vllm_config, device, state: st.WorkerState):
        super().__init__(vllm_config, device)
        self.vase_state = state

    def get_kv_cache_spec(self):
        specs = super().get_kv_cache_spec()
        settings = self.vase_state.s
        cap = settings.table_tokens  # the largest cap a request may ask for
        if not settings.config.compress_prompt or settings.allow_full:  # a request may hold up to the model length
            cap = 0
        out, full = {}, 0
        for name, spec in specs.items():
            if type(spec) is FullAttentionSpec and spec.sliding_window is None:
                out[name] = VaseFullAttentionSpec.from_spec(spec, cap)
                full += 1
            elif type(spec) is SlidingWindowSpec:
                out[name] = spec  # a sliding window: vLLM bounds it itself (its blocks out of the window go back)
            else:
                raise ValueError(
                    f"vase: layer {name} has a {type(spec).__name__}: vase evicts full-attention layers and leaves "
                    "sliding-window layers to vLLM; other layer kinds are not supported"
                )
        if not full:
            raise ValueError(
                "vase: this model has no full-attention layer to evict (every layer uses a sliding-window, which vLLM "
                "bounds itself): serve it without vase"
            )
        return out

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        for groups_of_one_cache in self.attn_groups:  # the builders read each step's plan from the worker's state
            for group in groups_of_one_cache:
                for builder in group.metadata_builders:
                    builder.vase_state = self.vase_state
        groups = {
            g: list(group.layer_names)
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            if isinstance(group.kv_cache_spec, VaseFullAttentionSpec)
        }
        names = sorted((n for layer_names in groups.values() for n in layer_names), key=extract_layer_index)
        mc, pc = self.model_config, self.parallel_config
        ids = [extract_layer_index(name) for name in names]
        problems = check_learned(self.vase_state.s.config, ids, mc.get_total_num_kv_heads(), mc.get_head_size())
        if problems:  # weights for another model's layers (the config could not tell before the weights loaded)
            raise VaseConfigError("vase cannot run with this engine configuration:\n  - " + "\n  - ".join(problems))
        # with tensor parallelism this worker holds a share of the KV heads (rank r: from head r * total / tp; a
        # head is replicated when there are fewer heads than ranks): random choices are keyed by the model's index
        offset = get_tensor_model_parallel_rank() * mc.get_total_num_kv_heads() // pc.tensor_parallel_size
        self.vase_state.allocate(
            names,
            mc.get_num_kv_heads(pc),
            mc.get_num_attention_heads(pc),
            mc.get_head_size(),
            mc.dtype,
            layer_ids=ids,
            head_offset=offset,
            groups=groups,
            rows=self.vase_state.s.concurrent_rows(kv_cache_config.num_blocks),
        )
        others = len(kv_cache_config.kv_cache_groups) - len(groups)
        kept = f", {others} sliding-window group(s) left to vLLM" if others else ""
        logger.info("vase: %s; %d layers evict%s", self.vase_state.s.describe(), len(names), kept)

    def _update_states(self, scheduler_output):
        s = self.vase_state
        budgets = getattr(scheduler_output, "vase_budgets", None) or {}  # set by vase's scheduler
        for rid in scheduler_output.finished_req_ids:
            s.release(rid)
        for rid in scheduler_output.preempted_req_ids or ():
            s.release(rid)
        started = set()
        for nr in scheduler_output.scheduled_new_reqs:
            prompt = len(nr.prompt_token_ids or ())
            s.admit(nr.req_id, nr.sampling_params, prompt, budgets.get(nr.req_id), nr.num_computed_tokens)
            started.add(nr.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                req = self.requests[rid]
                prompt = len(req.prompt_token_ids or ())
                s.admit(rid, req.sampling_params, prompt, budgets.get(rid), cached.num_computed_tokens[i])
                started.add(rid)
        for rid, budget in budgets.items():  # elastic admission: running requests shrunk in this step
            if rid not in started:
                s.set_budget(rid, budget)
        return super()._update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        t = time.perf_counter()
        self.vase_state.plan = self._vase_plan(num_scheduled_tokens)
        self.vase_state.stats["t_plan"] += time.perf_counter() - t
        return out

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        t = time.perf_counter()
        try:
            # the previous step's evictions, now that its tokens have left the engine (rows released unread skipped)
            gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
            touched = set(scheduler_output.num_scheduled_tokens)
            touched.update(getattr(scheduler_output, "vase_budgets", None) or ())
            self.vase_state.flush(gone, touched)
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self.vase_state.stats["t_step"] += time.perf_counter() - t
            self.vase_state.commit()

    def _vase_plan(self, num_scheduled_tokens: np.ndarray) -> st.PagedStep:
        """The plan of this step (see :class:`vase.vllm.state.PagedStep`): the sequence model's step for the batch's
        rows, and where its tokens go in the paged cache."""
        s = self.vase_state
        seq = s.seq
        R = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:R])
        rows = np.array([s.row_of[r] for r in req_ids], dtype=np.int64)
        n = num_scheduled_tokens[:R].astype(np.int64)
        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        logical_before = self.input_batch.num_computed_tokens_cpu[:R].astype(np.int64)
        schedule = seq.schedule.plan(rows.tolist(), n.tolist(), seen_before=logical_before.tolist())
        groups = list(s.groups)  # the KV cache groups of full-attention layers: the same caps, their own block ids
        bt = self.input_batch.block_table[groups[0]]
        bs = bt.block_size
        held = bt.num_blocks_per_row[:R].astype(np.int64)
        s.stats["max_blocks_per_row"] = max(s.stats["max_blocks_per_row"], int(held.max(initial=0)))
        fill_before = np.asarray(schedule.fill_before, dtype=np.int64)
        fill_after = fill_before + n
        evict = np.zeros(R, dtype=bool)
        evict[schedule.evict] = True
        keep = np.asarray(schedule.keep, dtype=np.int64)
        # with prefix caching, a row's full prompt blocks are never rewritten: from its first eviction on, its
        # physical slot 0 is the first slot after them (settings.front_blocks)
        front = s.front[rows]
        shifted = front * (np.asarray(schedule.evictions_before) > 0)
        dense = fill_after > (held - shifted) * bs
        if (dense & ~evict).any():
            bad = [req_ids[i] for i in np.nonzero(dense & ~evict)[0]]
            raise RuntimeError(f"vase: requests {bad} do not fit in their blocks and do not evict (a bug)")
        nb = max(int(held.max(initial=1)), 1)
        # physical slot of each new token: fill_before + j in the row's blocks; dense rows write nothing now
        T = int(qsl[-1])
        tok_row = np.repeat(np.arange(R), n)
        j = np.arange(T) - qsl[:-1][tok_row]
        phys = fill_before[tok_row] + j
        dense_tok = dense[tok_row]
        phys_in = np.where(dense_tok, 0, phys)
        layouts = {}
        for g in groups:
            table = self.input_batch.block_table[g].block_table.np[:R, :nb].astype(np.int64)
            block_rows = write_rows = table
            if front.any():
                cols = np.arange(nb)
                block_rows = np.take_along_axis(table, np.minimum(shifted[:, None] + cols, nb - 1), axis=1)
                write_rows = np.take_along_axis(table, np.minimum(front[:, None] + cols, nb - 1), axis=1)
            slots = np.where(dense_tok, -1, block_rows[tok_row, phys_in // bs] * bs + phys_in % bs)
            layouts[g] = st.GroupLayout(
                block_rows=torch.from_numpy(block_rows),
                write_rows=torch.from_numpy(write_rows),
                slot_mapping=torch.from_numpy(slots.astype(np.int64)),
            )
        logical = logical_before[tok_row] + j
        # the logical position of each token written in place, in every layer (compaction then moves each layer's
        # own copy); slots past the tables' width belong to a dense prompt not yet evicted (position = slot)
        put = ~dense_tok & (phys < s.s.table_tokens)
        if put.any():
            put_rows = torch.from_numpy(rows[tok_row[put]])
            put_slots, put_pos = torch.from_numpy(phys[put]), torch.from_numpy(logical[put])
            for layer in range(len(s.layer_index)):
                seq.tables.put_positions(layer, put_rows, put_slots, put_pos)
        plan = st.PagedStep(
            schedule=schedule,
            num_reqs=R,
            req_ids=req_ids,
            rows=torch.from_numpy(rows),
            qsl=qsl,
            n=n,
            logical_before=logical_before,
            fill_before=fill_before,
            fill_after=fill_after,
            keep=keep,
            evict=evict,
            dense=dense,
            layouts=layouts,
            shifted=shifted > 0,
            seq_lens=torch.from_numpy(np.where(dense, n, fill_after).astype(np.int32)),
            positions=torch.from_numpy(logical),
        )
        if seq.ring is not None:
            # each request saves its last `window` queries (the sequence model says where); token of each in the batch
            plan.ring = seq.ring.plan(rows.tolist(), n.tolist(), schedule.seen_before, scatter=True)
            step_rows = np.asarray(plan.ring.step_rows, dtype=np.int64)
            plan.ring_tok = torch.from_numpy(qsl[step_rows] + np.asarray(plan.ring.offsets, dtype=np.int64))
        return plan

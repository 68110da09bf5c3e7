"""Blocks per request, preemption and abort on a tiny pool: every block comes back, none is held past the cap.

Job: ``{"model", "prompts": [[ids]], "max_tokens", "vase": engine_args kwargs (without admission), "blocks": pool
size with vLLM's null block, "abort_step"}``. Runs admission ``grow`` (requests preempted as they grow), ``reserve``
and ``elastic`` (never preempted); per engine: the most blocks a request held (from the scheduler's block lists, each
step), blocks still held by preempted or aborted requests, free blocks at the end, worker rows still held.
"""

from __future__ import annotations

import common

from vase.vllm import state as vstate

if __name__ == "__main__":
    spec, out = common.job()
    result = {}
    for admission in ("grow", "reserve", "elastic"):
        llm = common.make_llm(
            spec["model"], {**spec["vase"], "admission": admission}, num_gpu_blocks_override=spec["blocks"]
        )
        eng, sched = llm.llm_engine, common.scheduler(llm)
        mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
        pool = sched.kv_cache_manager.block_pool
        ids = {}
        for k, p in enumerate(spec["prompts"]):
            ids[f"r{k}"] = eng.add_request(f"r{k}", common.tokens_prompt(p), common.params(spec["max_tokens"]))
        finished, step, aborted = {}, 0, None
        max_held, preempted_holding, preempted_seen, aborted_holding = 0, 0, 0, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = len(o.outputs[0].token_ids)
            step += 1
            live = {r: sum(not b.is_null for b in blocks) for r, blocks in mgr.req_to_blocks.items()}
            max_held = max([max_held, *live.values()])
            for req in sched.waiting:  # preempted requests wait with no blocks
                if req.status.name == "PREEMPTED":
                    preempted_seen += 1
                    preempted_holding = max(preempted_holding, live.get(req.request_id, 0))
            if aborted is not None and aborted_holding is None:
                aborted_holding = live.get(aborted, 0)
            if step == spec["abort_step"]:
                eng.abort_request(["r1"])
                aborted = ids["r1"]
        rows_before = len(vstate.ACTIVE.row_of)  # the worker hears of the last finishes one step late
        # one more short request: the worker learns of the last finishes at the next step
        llm.generate([common.tokens_prompt(spec["prompts"][0][:8])], common.params(1), use_tqdm=False)
        ws = vstate.ACTIVE
        result[admission] = {
            "finished": finished,
            "max_blocks_held": max_held,
            "preempted_holding": preempted_holding,
            "preempted_seen": preempted_seen,
            "aborted_holding": aborted_holding,
            "free_blocks": pool.get_num_free_blocks(),
            "pool_blocks": pool.num_gpu_blocks - 1,
            "req_to_blocks": {k: len(v) for k, v in mgr.req_to_blocks.items()},
            "worker_rows_before": rows_before,
            "worker_rows_after": len(ws.row_of),
            "stats": common.stats(llm),
        }
        common.write(out, result)
        common.free(llm)

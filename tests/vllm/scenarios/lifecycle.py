"""Blocks per request, preemption and abort on a tiny pool: every block comes back, none is held past the cap.

Job: ``{"model", "prompts": [[ids]], "max_tokens", "vase": engine_args kwargs (without admission), "blocks": pool
size with vLLM's null block, "abort_step", "admissions" (default all three), "kw": LLM kwargs}``. Runs admission
``grow`` (requests preempted as they grow), ``reserve`` and ``elastic`` (never preempted); per engine: the most
blocks a request held in the capped group (from the scheduler's block lists, each step), blocks still held (in every
KV cache group) by preempted or aborted requests, free blocks at the end, rows still held by each worker (several
with tensor parallelism).
"""

from __future__ import annotations

import common

if __name__ == "__main__":
    spec, out = common.job()
    result = {}
    for admission in spec.get("admissions", ("grow", "reserve", "elastic")):
        llm = common.make_llm(
            spec["model"],
            {**spec["vase"], "admission": admission},
            num_gpu_blocks_override=spec["blocks"],
            **spec.get("kw", {}),
        )
        eng, sched = llm.llm_engine, common.scheduler(llm)
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        mgr = next(m for m in managers if hasattr(m, "vase_caps"))  # the capped (full-attention) group
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
            capped = {r: sum(not b.is_null for b in blocks) for r, blocks in mgr.req_to_blocks.items()}
            max_held = max([max_held, *capped.values()])
            live = {}  # blocks held in every group (sliding-window groups included)
            for m in managers:
                for r, blocks in m.req_to_blocks.items():
                    live[r] = live.get(r, 0) + sum(not b.is_null for b in blocks)
            for req in sched.waiting:  # preempted requests wait with no blocks
                if req.status.name == "PREEMPTED":
                    preempted_seen += 1
                    preempted_holding = max(preempted_holding, live.get(req.request_id, 0))
            if aborted is not None and aborted_holding is None:
                aborted_holding = live.get(aborted, 0)
            if step == spec["abort_step"]:
                eng.abort_request(["r1"])
                aborted = ids["r1"]
        rows_before = [w["live_rows"] for w in common.stats(llm)["workers"]]  # they hear of finishes a step late
        # one more short request: the workers learn of the last finishes at the next step
        llm.generate([common.tokens_prompt(spec["prompts"][0][:8])], common.params(1), use_tqdm=False)
        stats = common.stats(llm)
        result[admission] = {
            "finished": finished,
            "max_blocks_held": max_held,
            "preempted_holding": preempted_holding,
            "preempted_seen": preempted_seen,
            "aborted_holding": aborted_holding,
            "free_blocks": pool.get_num_free_blocks(),
            "pool_blocks": pool.num_gpu_blocks - 1,
            "req_to_blocks": {k: len(v) for m in managers for k, v in m.req_to_blocks.items()},
            "worker_rows_before": rows_before,
            "worker_rows_after": [w["live_rows"] for w in stats["workers"]],
            "stats": stats,
        }
        common.write(out, result)
        common.free(llm)

"""Elastic admission on a small pool: requests arriving while the pool is full are admitted at once, at a lower budget,
and the running ones shrink to it.

Job: ``{"model", "first": [[ids]], "later": [[ids]], "join_step", "max_tokens", "vase": engine_args kwargs (without
admission), "blocks": pool size with vLLM's null block, "admissions": [...]}``. Per admission mode: each request's
tokens, the step it arrived and the step it was first scheduled, each budget change the worker applied with the
number of output tokens the request had before that step, the most live blocks a request held above its cap, blocks
free at the end, the counters, and the prompts by name.
"""

from __future__ import annotations

import common

import vase.vllm

if __name__ == "__main__":
    spec, out = common.job()
    result = {}
    for admission in spec["admissions"]:
        llm = common.make_llm(
            spec["model"], {**spec["vase"], "admission": admission}, num_gpu_blocks_override=spec["blocks"]
        )
        eng, sched = llm.llm_engine, common.scheduler(llm)
        mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
        pool = sched.kv_cache_manager.block_pool
        names = {}  # engine request id -> our name

        def add(name, prompt, eng=eng, names=names):
            rid = eng.add_request(name, common.tokens_prompt(prompt), common.params(spec["max_tokens"]))
            names[rid if isinstance(rid, str) else name] = name

        for k, p in enumerate(spec["first"]):
            add(f"a{k}", p)
        arrived = {f"a{k}": 0 for k in range(len(spec["first"]))}
        started, budgets, tokens = {}, {}, {}
        over_cap, step = 0, 0
        while eng.has_unfinished_requests() or step <= spec["join_step"]:
            if step == spec["join_step"]:
                for k, p in enumerate(spec["later"]):
                    add(f"b{k}", p)
                    arrived[f"b{k}"] = step
            before = {names.get(r, r): sched.requests[r].num_output_tokens for r in sched.requests}
            for o in eng.step():
                if o.finished:
                    tokens[names.get(o.request_id, o.request_id)] = list(o.outputs[0].token_ids)
            ws = vase.vllm.worker_state(llm)
            for rid, row in ws.row_of.items():
                name = names.get(rid, rid)
                started.setdefault(name, step)
                b = ws.seq.schedule.row_budget[row]
                if not budgets.get(name) or budgets[name][-1][1] != b:
                    budgets.setdefault(name, []).append((before.get(name, 0), b))
            for rid, blocks in mgr.req_to_blocks.items():
                live = sum(not b.is_null for b in blocks)
                over_cap = max(over_cap, live - mgr.vase_caps.get(rid, 0) // 32)
            step += 1
        result[admission] = {
            "prompts": {
                **{f"a{k}": p for k, p in enumerate(spec["first"])},
                **{f"b{k}": p for k, p in enumerate(spec["later"])},
            },
            "tokens": tokens,
            "arrived": arrived,
            "started": started,
            "budgets": budgets,
            "over_cap": over_cap,
            "free_blocks": pool.get_num_free_blocks(),
            "pool_blocks": pool.num_gpu_blocks - 1,
            "stats": common.stats(llm),
        }
        common.write(out, result)
        common.free(llm)

"""Prefix caching with a policy that keeps the prompt dense: requests sharing a long prefix, with and without it.

Job: ``{"model", "prompts": [[ids]] (sharing a prefix), "join_steps": [step each prompt is added], "max_tokens",
"engines": [{"name", "vase": engine_args kwargs, "kw": LLM kwargs}]}``. Per engine: each request's tokens and the
prefix-cache hits vLLM counted for it (``RequestOutput.num_cached_tokens``), the most block ids two requests shared
at once, the most live blocks a request held after its first eviction, free blocks at the end, the counters.
"""

from __future__ import annotations

import common

import vase.vllm

if __name__ == "__main__":
    spec, out = common.job()
    result = {}
    for e in spec["engines"]:
        llm = common.make_llm(spec["model"], e["vase"], **e.get("kw", {}))
        eng, sched = llm.llm_engine, common.scheduler(llm)
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        # the first capped full-attention group (a hybrid model's first group may be a sliding window's)
        mgr = next((m for m in managers if hasattr(m, "vase_trims")), managers[0])
        trims = getattr(mgr, "vase_trims", {})
        pool = sched.kv_cache_manager.block_pool
        names, tokens, cached = {}, {}, {}
        shared, after_first, step = 0, 0, 0
        joins = spec["join_steps"]
        while eng.has_unfinished_requests() or step <= max(joins):
            for k, at in enumerate(joins):
                if at == step:
                    p = common.params(spec["max_tokens"], extra_args={"vase_seed": 100 + k})
                    rid = eng.add_request(f"p{k}", common.tokens_prompt(spec["prompts"][k]), p)
                    names[rid if isinstance(rid, str) else f"p{k}"] = f"p{k}"
            for o in eng.step():
                if o.finished:
                    name = names.get(o.request_id, o.request_id)
                    tokens[name] = list(o.outputs[0].token_ids)
                    cached[name] = o.num_cached_tokens or 0
            lists = {r: [b.block_id for b in blocks if not b.is_null] for r, blocks in mgr.req_to_blocks.items()}
            ids = list(lists.values())
            for i in range(len(ids)):
                for j in range(i + 1, len(ids)):
                    shared = max(shared, len(set(ids[i]) & set(ids[j])))
            ws = vase.vllm.worker_state(llm)
            if ws is not None:
                for rid, row in ws.row_of.items():
                    if ws.seq.schedule.evictions[row] and rid in lists and rid not in trims:
                        after_first = max(after_first, len(lists[rid]))
            step += 1
        result[e["name"]] = {
            "tokens": tokens,
            "cached": cached,
            "shared_blocks": shared,
            "max_blocks_after_first_eviction": after_first,
            "free_blocks": pool.get_num_free_blocks(),
            "pool_blocks": pool.num_gpu_blocks - 1,
            "stats": common.stats(llm),
        }
        common.write(out, result)
        common.free(llm)

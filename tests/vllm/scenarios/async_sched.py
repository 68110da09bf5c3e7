"""vase's scheduler under vLLM's async scheduling, at the scheduler level (vLLM's CPU platform turns async scheduling
off, so no engine runs it here): an engine is started for its configuration, KV cache configuration and structured
output manager, then schedulers are built from them with ``async_scheduling`` on and driven by a stand-in runner that
returns step N's output only after step N+1 is scheduled (sync: at once).

Per mode, the result: the class vLLM's construction gives, each step's block tables (request -> live block ids), the
steps in flight when each was scheduled, vase's counters and the free blocks at the end. ``async-undeferred`` is the
planted fault: the async scheduler with vLLM's deferred freeing turned off again; ``async-trims-now`` another: only
the blocks trims give back go to the pool at once. The test must catch both.
"""

from __future__ import annotations

import random

from common import free, job, make_llm, scheduler, write

TOKEN = 7  # what the stand-in runner samples


def drive(s, hasher, prompts: list[list[int]], max_tokens: list[int], arrivals: list[int], abort: dict, depth: int):
    """Run ``s`` to the end (``hasher``: the engine's block hasher, for prefix caching): request i is added before
    step ``arrivals[i]``; ``abort`` maps a request to the step before which it is aborted (while in flight); at most
    ``depth`` steps are in flight (1: sync)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    steps, inflight, step, aborted = [], [], 0, []

    def process(entry):
        out, index = entry
        ids = list(out.num_scheduled_tokens)
        ran = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)}, sampled_token_ids=[[TOKEN] for _ in ids]
        )
        s.update_from_output(out, ran)
        steps[index]["processed_before"] = step

    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or s.has_unfinished_requests() or inflight:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            sp = SamplingParams(max_tokens=max_tokens[i], ignore_eos=True, temperature=0)
            s.add_request(Request(f"r{i}", prompts[i], sp, None, arrival_time=float(step), block_hasher=hasher))
        for rid, when in abort.items():
            if when == step and rid in s.requests:
                aborted.append({"request": rid, "in_flight": any(rid in steps[i]["tables"] for _, i in inflight)})
                s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        if out.total_num_scheduled_tokens:
            tables = {}
            for rid in out.num_scheduled_tokens:
                groups = s.kv_cache_manager.coordinator.get_blocks(rid)
                tables[rid] = sorted(b.block_id for g in groups for b in g if not b.is_null)
            steps.append({"step": step, "tables": tables, "in_flight": [i for _, i in inflight]})
            inflight.append((out, len(steps) - 1))
        if len(inflight) >= depth or (inflight and not out.total_num_scheduled_tokens):
            process(inflight.pop(0))
        step += 1
        if step > 5000:
            raise RuntimeError("the scheduler did not finish the requests")
    pool = s.kv_cache_manager.block_pool
    return {
        "class": type(s).__name__,
        "mro": [c.__name__ for c in type(s).__mro__],
        "steps": steps,
        "stats": {k: v for k, v in s.vase_stats.items() if isinstance(v, int | float | type(None))},
        "free_blocks": pool.get_num_free_blocks(),
        "pool_blocks": pool.num_gpu_blocks,
        "deferred_left": len(s.deferred_frees),
        "aborted": aborted,
    }


def main():
    j, out = job()
    llm = make_llm(j["model"], vase_kw=j["vase"], num_gpu_blocks_override=j["blocks"], max_num_seqs=j["max_num_seqs"])
    base = scheduler(llm)
    cfg = base.vllm_config
    rng = random.Random(0)
    n = j["requests"]
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(*j["prompt_range"]))] for _ in range(n)]
    max_tokens = [rng.randrange(*j["gen_range"]) for _ in range(n)]
    arrivals = [0 if i < j["burst"] else j["burst"] + 9 * (i - j["burst"]) for i in range(n)]
    abort = {f"r{i}": step for i, step in j["abort"].items()}
    result = {}
    cls = type(base)
    for mode, depth in (("sync", 1), ("async", 2), ("async-undeferred", 2), ("async-trims-now", 2)):
        cfg.scheduler_config.async_scheduling = mode != "sync"
        s = cls(
            vllm_config=cfg,
            kv_cache_config=base.kv_cache_config,
            structured_output_manager=base.structured_output_manager,
            block_size=base.block_size,
            hash_block_size=base.hash_block_size,
            include_finished_set=False,
            log_stats=True,
        )
        if mode == "async-undeferred":
            s.defer_block_free = False  # planted fault: every block back at once
        if mode == "async-trims-now":
            for m in s._vase_managers:  # planted fault: a trim's blocks back at once (finishes still deferred)
                m.vase_release = s.kv_cache_manager.block_pool.free_blocks
        hasher = llm.llm_engine.engine_core.engine_core.request_block_hasher
        result[mode] = drive(s, hasher, prompts, max_tokens, arrivals, {k: v for k, v in abort.items()}, depth)
    cfg.scheduler_config.async_scheduling = False
    free(llm)
    write(out, result)


if __name__ == "__main__":
    main()

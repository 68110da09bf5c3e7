"""Sampled eviction is per request: a request's tokens alone and with other requests joining the batch at different
steps; the seed from ``SamplingParams.seed`` when ``vase_seed`` is not given; parallel sampling (``n`` > 1, with
logprobs): each child against a single request with the child's seeds; chunked prefill (per-chunk compression).

Job: ``{"model", "prompts": [[ids]] (the first is the request watched), "max_tokens", "vase": engine_args kwargs,
"join_steps": [step at which each other prompt joins], "waits": the other prompt (index) whose compression at
prefill waits a step while the others' evictions of that step run, "prefill_first": [[ids, vase_seed], [ids,
vase_seed]] (a prompt compressed at prefill, then one that arrives a step later; also used for the arrivals of
``prefill_priority``)}``.
"""

from __future__ import annotations

import dataclasses

import common

if __name__ == "__main__":
    spec, out = common.job()
    prompts, n = spec["prompts"], spec["max_tokens"]
    result = {}
    llm = common.make_llm(spec["model"], spec["vase"])
    watched = common.tokens_prompt(prompts[0])
    result["alone"] = list(
        llm.generate([watched], common.params(n, extra_args={"vase_seed": 7}), use_tqdm=False)[0].outputs[0].token_ids
    )
    result["other_seed"] = list(
        llm.generate([watched], common.params(n, extra_args={"vase_seed": 8}), use_tqdm=False)[0].outputs[0].token_ids
    )
    result["sampling_seed"] = list(
        llm.generate([watched], common.params(n, seed=7), use_tqdm=False)[0].outputs[0].token_ids
    )
    # the same request while others arrive (before it and after it) and leave, on the same engine
    eng = llm.llm_engine

    def joined():
        """The watched request, the others joining at their steps; every request's tokens."""
        joins = dict(zip(spec["join_steps"], range(1, len(prompts))))
        done, step = {}, 0
        eng.add_request("watched", watched, common.params(n, extra_args={"vase_seed": 7}))
        while eng.has_unfinished_requests() or joins:
            if step in joins:
                k = joins.pop(step)
                eng.add_request(
                    f"other{k}",
                    common.tokens_prompt(prompts[k]),
                    common.params(n + 13 * k, extra_args={"vase_seed": 100 + k}),
                )
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
        return done

    # the join steps are chosen for vLLM's own order (decodes beside each prefill): prefill_priority off
    sched = common.scheduler(llm)
    default = sched.vase
    sched.vase = dataclasses.replace(default, prefill_priority=False)
    done = joined()
    result["in_batch"] = done["watched"]
    result["batch_stats"] = common.stats(llm)
    sched.vase = default  # and with it (the default): each arrival prefilled alone
    result["in_batch_priority"] = joined()["watched"]
    result["priority_stats"] = common.stats(llm)
    # the request whose compression at prefill waited while the step after evicted the others' rows: alone
    k = spec["waits"]
    result["waited"] = next(v for name, v in done.items() if name.startswith(f"other{k}"))
    params = common.params(n + 13 * k, extra_args={"vase_seed": 100 + k})
    result["waited_alone"] = list(
        llm.generate([common.tokens_prompt(prompts[k])], params, use_tqdm=False)[0].outputs[0].token_ids
    )

    def arrivals(names, specs, at):
        """Requests ``names`` with (prompt ids, vase_seed) ``specs``, each added before step ``at[i]``; tokens
        produced per step by each (the first eight steps), outputs, counters before and after."""
        before, counts, done = common.stats(llm), [], {}
        while eng.has_unfinished_requests() or len(counts) <= max(at):
            for name, (ids, seed), when in zip(names, specs, at):
                if when == len(counts):
                    eng.add_request(name, common.tokens_prompt(ids), common.params(n, extra_args={"vase_seed": seed}))
            seen = {}
            for o in eng.step():
                seen[o.request_id] = len(o.outputs[0].token_ids)
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
            counts.append(seen)
        return {"outputs": done, "counts": counts[:8], "before": before, "after": common.stats(llm)}

    # prefill_first: the first request's prompt is compressed at prefill; the second arrives after that step, so the
    # first sits out its first decode step while the second is prefilled (its compression waits for its next step)
    compressed, plain = spec["prefill_first"]
    result["prefill_first"] = arrivals(["first", "second"], [compressed, plain], [0, 1])
    # a prompt not compressed sits out its first decode step alike (the step carries the new prompt's prefill only)
    result["prefill_first"]["plain"] = arrivals(["plain", "late"], [plain, compressed], [0, 1])

    # prefill_priority: a request decoding alone, then one arriving at its fifth step (prefilled alone: the first
    # request's decode sits that step out), then another at the next step (never two such steps in a row: it is
    # prefilled beside the first one's decode, while the one just prefilled sits out, prefill_first)
    result["prefill_priority"] = arrivals(["p1", "c2", "p3"], [plain, compressed, plain], [0, 4, 5])
    first, second = compressed[0], plain[0]
    first_seed, second_seed = compressed[1], plain[1]
    # the same, the first aborted while it waits: its compression never runs, nothing of it stays held
    import vase.vllm

    eng.add_request("held", common.tokens_prompt(first), common.params(n, extra_args={"vase_seed": first_seed}))
    eng.step()
    eng.add_request("next", common.tokens_prompt(second), common.params(n, extra_args={"vase_seed": second_seed}))
    eng.step()

    def held():  # the engine's own id of a request is the given one plus a suffix
        return sum(any(r.startswith("held") for r in p.evicting) for p in vase.vllm.worker_state(llm).pending)

    waiting = held()
    eng.abort_request(["held"])
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    pool = common.scheduler(llm).kv_cache_manager.block_pool
    result["prefill_first"]["aborted"] = {
        "waiting": waiting,
        "left": held(),
        "outputs": done,
        "free_blocks": pool.get_num_free_blocks(),
        "pool_blocks": pool.num_gpu_blocks - 1,
    }

    # parallel sampling: child i draws with sampling seed 21 + i (vLLM's rule) and eviction seed 7 + i (vase's)
    def sampled(**kw):
        outs = llm.generate([watched], common.params(n, temperature=0.8, top_p=0.95, logprobs=1, **kw), use_tqdm=False)
        return [
            (list(c.token_ids), [c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)])
            for c in outs[0].outputs
        ]

    result["children"] = sampled(n=3, seed=21, extra_args={"vase_seed": 7})
    result["children_alone"] = [sampled(seed=21 + i, extra_args={"vase_seed": 7 + i})[0] for i in range(3)]
    result["child1_parent_vase_seed"] = sampled(seed=22, extra_args={"vase_seed": 7})[0]
    result["children_seeded"] = sampled(n=2, seed=31)  # no vase_seed: the child's own seed, 31 + i
    result["children_seeded_alone"] = [sampled(seed=31 + i)[0] for i in range(2)]
    common.free(llm)
    # chunked prefill: a long prompt split into chunks, each compressed against what the previous ones kept
    llm = common.make_llm(spec["model"], spec["vase"], enable_chunked_prefill=True, max_num_batched_tokens=32)
    outs = llm.generate([common.tokens_prompt(p) for p in prompts], common.params(n), use_tqdm=False)
    result["chunked"] = [list(o.outputs[0].token_ids) for o in outs]
    result["chunked_stats"] = common.stats(llm)
    common.write(out, result)
    common.free(llm)

"""Replays of two peers' faults on blocks given back early, in an in-process engine watched step by step.

1. ``deferred_plain`` / ``deferred_cached`` (prefix caching off / on): a deferred eviction against the blocks handed
   out under ``prefill_priority``. Request ``a`` (a dense prompt, the published preset) reaches its first eviction;
   ``b`` arrives at the next step (prefilled alone: ``a`` sits it out, its eviction still deferred) and ``c`` one
   step later, on a pool that holds ``a``'s dense prompt and ``b`` but not ``c`` until ``a`` gives its dense
   prompt's blocks back. After every step: no block is held by two requests (in the scheduler's lists), and no
   block a waiting deferred eviction will read is held by another request. Each request's tokens, then each alone
   on the same engine.
2. ``early_return``: prefix caching, the published preset: ``p``'s full prompt blocks are given back (to the prefix
   cache) at its first eviction; their contents in every layer, read after its prefill and again after it has
   evicted several more times, and once ``q`` (the same prompt) has hit them; ``q``'s tokens and ``q`` on an engine
   without prefix caching.

Job: ``{"model", "paper": engine_args kwargs, "long": ids, "short": ids, "max_tokens", "blocks": {"plain",
"cached"}: the pool of the first replay without and with prefix caching (vLLM's null block included)}``.
"""

from __future__ import annotations

import math

import common
import torch

import vase.vllm
import vase.vllm.seam


def _held(managers) -> dict[str, list[int]]:
    """Request id -> the pool blocks it holds in every KV cache group (its lists less the null block)."""
    out: dict[str, list[int]] = {}
    for m in managers:
        for rid, blocks in m.req_to_blocks.items():
            out.setdefault(rid, []).extend(b.block_id for b in blocks if not b.is_null)
    return out


def _pending_reads(ws) -> dict[str, set[int]]:
    """Request id -> the blocks its deferred eviction (still waiting) will read, in every KV cache group."""
    out: dict[str, set[int]] = {}
    for p in ws.pending:
        for rid in p.waiting_ids():
            i = p.req_ids.index(rid)
            if p.dense[i]:  # a dense row's entries are held in the step's buffer, not read from blocks
                continue
            nb = math.ceil(int(p.fill_before[i] + p.n[i]) / ws.s.block_size)
            for layout in p.layouts.values():
                out.setdefault(rid, set()).update(int(b) for b in layout.block_rows[i, :nb])
    return out


def deferred(spec, prefix_caching: bool) -> dict:
    vase_kw = {**spec["paper"], "prefix_caching": prefix_caching}
    blocks = spec["blocks"]["cached" if prefix_caching else "plain"]
    kw = {"num_gpu_blocks_override": blocks, "max_model_len": 416, "enable_prefix_caching": prefix_caching}
    llm = common.make_llm(spec["model"], vase_kw, **kw)
    eng, sched = llm.llm_engine, common.scheduler(llm)
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    n = spec["max_tokens"]
    names, tokens, shared, stale, step, added, started = {}, {}, 0, 0, 0, {}, {}
    waited = None  # the step at which a's first eviction was seen waiting

    def add(name, ids, seed):
        rid = eng.add_request(name, common.tokens_prompt(ids), common.params(n, extra_args={"vase_seed": seed}))
        names[rid if isinstance(rid, str) else name] = name
        added[name] = step

    add("a", spec["long"], 1)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                tokens[names.get(o.request_id, o.request_id)] = list(o.outputs[0].token_ids)
        step += 1
        ws = vase.vllm.worker_state(llm)
        reads = _pending_reads(ws)
        if waited is None and any(names.get(r) == "a" for r in reads):
            waited = step
            add("b", spec["short"], 2)
        elif waited is not None and "c" not in added and step == waited + 1:
            add("c", spec["short"][:-3], 3)
        for r in sched.running:
            started.setdefault(names.get(r.request_id, r.request_id), step)
        held = _held(managers)
        owners: dict[int, str] = {}
        for rid, blocks in held.items():
            for b in blocks:
                shared += b in owners and owners[b] != rid
                owners[b] = rid
        for rid, blocks in reads.items():
            stale += sum(1 for b in blocks if owners.get(b, rid) != rid)
    stats = common.stats(llm)
    alone = {}
    for name, ids, seed in (("a", spec["long"], 1), ("b", spec["short"], 2), ("c", spec["short"][:-3], 3)):
        out = llm.generate(
            [common.tokens_prompt(ids)], common.params(n, extra_args={"vase_seed": seed}), use_tqdm=False
        )
        alone[name] = list(out[0].outputs[0].token_ids)
    pool = sched.kv_cache_manager.block_pool
    result = {
        "tokens": tokens,
        "alone": alone,
        "waited": waited,
        "added": added,
        "started": started,
        "shared": shared,
        "stale_reads": stale,
        "free_blocks": pool.get_num_free_blocks(),
        "pool_blocks": pool.num_gpu_blocks - 1,
        "stats": stats,
    }
    common.free(llm)
    return result


def _contents(llm, blocks: list[int]) -> torch.Tensor:
    """The bytes of ``blocks`` in every layer's KV cache (in-process engine)."""
    runner = vase.vllm.seam.driver_worker(llm).model_runner
    return torch.stack([kv[blocks].clone() for kv in runner.kv_caches])


def early_return(spec) -> dict:
    kw = {"enable_prefix_caching": True}
    llm = common.make_llm(spec["model"], {**spec["paper"], "prefix_caching": True}, **kw)
    eng, sched = llm.llm_engine, common.scheduler(llm)
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    mgr = next(m for m in managers if hasattr(m, "vase_trims"))
    n, ids = spec["max_tokens"], spec["long"]
    front = len(ids) // 32
    rid = eng.add_request("p", common.tokens_prompt(ids), common.params(n, extra_args={"vase_seed": 5}))
    rid = rid if isinstance(rid, str) else "p"
    eng.step()  # its prefill
    prompt_blocks = [b.block_id for b in mgr.req_to_blocks[rid][:front]]
    before = _contents(llm, prompt_blocks)
    returned, evictions_then, steps = None, 0, 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        blocks = mgr.req_to_blocks.get(rid, [])
        if returned is None and blocks and all(b.is_null for b in blocks[:front]):
            returned = steps
            evictions_then = common.stats(llm)["worker"]["rows_evicted"]
    evictions = common.stats(llm)["worker"]["rows_evicted"]
    pool = sched.kv_cache_manager.block_pool
    still_cached = sum(1 for b in prompt_blocks if pool.blocks[b].block_hash is not None)
    after = _contents(llm, prompt_blocks)
    out = eng.add_request("q", common.tokens_prompt(ids), common.params(n, extra_args={"vase_seed": 6}))
    hit, q_tokens = None, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                hit, q_tokens = o.num_cached_tokens, list(o.outputs[0].token_ids)
    result = {
        "front_blocks": front,
        "returned_at_step": returned,
        "evictions_when_returned": evictions_then,
        "evictions": evictions,
        "still_cached": still_cached,
        "unchanged": bool(torch.equal(before, after)),
        "q_hit": hit,
        "q_tokens": q_tokens,
        "q_request": out if isinstance(out, str) else "q",
    }
    common.free(llm)
    fresh = common.make_llm(spec["model"], {**spec["paper"], "prefix_caching": False})
    outs = fresh.generate([common.tokens_prompt(ids)], common.params(n, extra_args={"vase_seed": 6}), use_tqdm=False)
    result["q_fresh"] = list(outs[0].outputs[0].token_ids)
    common.free(fresh)
    return result


if __name__ == "__main__":
    job, path = common.job()
    result = {f"deferred_{'cached' if pc else 'plain'}": deferred(job, pc) for pc in (False, True)}
    common.write(path, {**result, "early_return": early_return(job)})

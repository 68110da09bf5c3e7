"""Time to first token of prompts arriving one at a time while many requests decode, with and without
``prefill_priority`` (docs/SERVING.md, admission), offline, both engines side by side.

Each configuration runs in its own process (``.venv-vllm``'s Python, an in-process engine, one thread), both at once,
one per core: ``--running`` requests decode for ``--warm`` steps, then ``--arrivals`` prompts arrive, one every
``--gap`` steps; an arrival's time to first token is the wall time from its ``add_request`` to the step that returns
its first token. Prints the median and each arrival's time, the median and mean step time, and the scheduler's
counters (``prefill_alone``: steps that prefilled arrivals alone; ``decodes_paused``: decodes they left out).

    .venv-vllm/bin/python benchmarks/vllm_arrival_ttft.py              # the figures of docs/SERVING.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

from vllm_serving import FAST_ENV, ROOT, child_result, prompts


def run_one(args) -> dict:
    """One engine: the running requests, then the arrivals; returns the figures."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vase.vllm

    kw = vase.vllm.engine_args("vase", budget=args.budget, buffer=args.buffer, prefill_priority=args.priority == "on")
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_num_seqs=64,
        max_model_len=4096,
        num_gpu_blocks_override=args.blocks,  # a pool for every request at once (two engines share the memory)
        gpu_memory_utilization=0.3,  # vLLM CPU checks this share of memory is free: two engines share it
        **kw,
    )
    eng = llm.llm_engine
    ids = prompts(llm.get_tokenizer(), args.running + 2 * args.arrivals)
    long = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=4000, ignore_eos=True)
    for i in range(args.running):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids[i]), long)
    for _ in range(args.warm):
        eng.step()
    ttft, steps = [], []
    short = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=64, ignore_eos=True)
    for k in range(args.arrivals):
        a = args.running + 2 * k
        eng.add_request(f"a{k}", TokensPrompt(prompt_token_ids=ids[a] + ids[a + 1]), short)
        t, first = time.perf_counter(), None
        for _ in range(args.gap):
            s = time.perf_counter()
            outs = eng.step()
            steps.append(time.perf_counter() - s)
            if first is None and any(o.request_id == f"a{k}" for o in outs):
                first = time.perf_counter() - t
        ttft.append(first)
    sched = vase.vllm.engine_stats(llm)["scheduler"]
    return {
        "prefill_priority": args.priority,
        "ttft_ms": [round(x * 1e3) for x in ttft],
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3),
        "step_p50_ms": round(statistics.median(steps) * 1e3, 1),
        "step_mean_ms": round(statistics.mean(steps) * 1e3, 1),
        "prefill_alone": sched["prefill_alone"],
        "decodes_paused": sched["decodes_paused"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "build" / "vllm" / "smollm2"))
    ap.add_argument("--running", type=int, default=16, help="requests decoding when the arrivals come")
    ap.add_argument("--warm", type=int, default=200, help="their decode steps before the first arrival")
    ap.add_argument("--arrivals", type=int, default=8)
    ap.add_argument("--gap", type=int, default=20, help="steps between arrivals")
    ap.add_argument("--blocks", type=int, default=2000, help="KV pool of each engine, blocks of 32 tokens")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--priority", default="", help=argparse.SUPPRESS)  # one configuration (a child process)
    args = ap.parse_args()
    if args.priority:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    env = {**os.environ, **FAST_ENV, "OMP_NUM_THREADS": "1"}

    def child(priority: str) -> dict:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--priority", priority]
        return child_result(cmd, env, f"prefill_priority={priority}", cwd=ROOT)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side, one core each
        on, off = pool.map(child, ["on", "off"])
    print("| prefill_priority | TTFT p50 ms | x off | step p50 ms | step mean ms | prefill-alone steps | TTFTs ms |")
    print("|---|---|---|---|---|---|---|")
    for r in (on, off):
        ratio = r["ttft_p50_ms"] / off["ttft_p50_ms"]
        print(
            f"| {r['prefill_priority']} | {r['ttft_p50_ms']} | {ratio:.2f}x | {r['step_p50_ms']} | {r['step_mean_ms']} "
            f"| {r['prefill_alone']} | {', '.join(map(str, r['ttft_ms']))} |"
        )


if __name__ == "__main__":
    main()

"""Where a decode step's time goes, stock vLLM against vLLM + vase at the same batch, offline, side by side.

Each engine runs in its own process (``.venv-vllm``'s Python, an in-process engine, one thread), both at once, one per
core (each keeps running, unmeasured, until the other has measured its steps: a machine's speed drifts over
minutes): ``--requests`` prompts are admitted at once and every one decodes for ``--steps`` steps (end-of-sequence
ignored; temperature 0.6, top-p 0.95, as in the served benchmark). Stock vLLM gets a pool that holds every request
whole (no preemption), vase its budget (``--budget`` + ``--buffer`` entries per layer and KV head). Over the steps from
``--skip`` on (every request decoding) it splits the mean step into:

* ``forward``: the model's forward pass without vase's own work (weight matrix products, vLLM's attention kernel);
* ``vase``: vase's work in the forward (its step plan and metadata, the saved queries, the evictions), and of it
  ``evict``: the evictions deferred from the step before (scoring, selection, compaction; most of a step's eviction);
* ``sampler``: vLLM's sampler (top-p's sort over the vocabulary, the Gumbel draw);
* ``rest``: the engine around them (scheduling, the sampled tokens' bookkeeping, output processing).

A cost paid per sampled token by both engines (the sampler) bounds what a larger batch can gain: stock vLLM at a tight
pool runs small batches, vase large ones, and the served ratio follows the ratio of their tokens per second of step
(less the prefill and the tail of a run). Raises SystemExit with a child's output when its engine fails.

    .venv-vllm/bin/python benchmarks/vllm_step_split.py                 # 24 requests (docs/SERVING.md)
    .venv-vllm/bin/python benchmarks/vllm_step_split.py --stock-requests 6  # stock vLLM as at a tight pool
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_serving import FAST_ENV, ROOT, STOCK_BLOCK, child_result, prompts

MAX_MODEL_LEN = 4096  # both engines' model length (prompts and --steps stay well inside it)
PARTS = ("forward", "vase", "sampler", "rest")


def _timed(obj, name: str, acc: list):
    """Wrap the method ``obj.name`` (of an instance, or of a class: every instance) so that each call's wall time is
    appended to ``acc`` (seconds)."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc.append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def run_one(args) -> dict:
    """One engine (``args.engine``: stock or vase): the split of its mean decode step, in milliseconds."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.sampler import Sampler

    torch.set_num_threads(1)
    sampled: list[float] = []
    _timed(Sampler, "forward", sampled)  # this process only: a measurement, the engine unchanged
    if args.engine == "vase":
        import vase.vllm

        kw = vase.vllm.engine_args("vase", budget=args.budget, buffer=args.buffer)
        blocks = -(-args.requests * (args.budget + args.buffer + 128) // 32)  # each request's cap, with its prompt
    else:
        # every request whole, and at least one of the longest (vLLM checks it at start; its pool keeps one block
        # back, the null block), in stock vLLM's own blocks
        bs = STOCK_BLOCK
        kw, blocks = {}, max(-(-args.requests * (args.steps + 128) // bs) + args.requests, MAX_MODEL_LEN // bs + 1)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        seed=0,
        max_num_seqs=max(64, args.requests),
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=blocks,
        gpu_memory_utilization=0.3,  # vLLM CPU checks this share of memory is free: two engines share it
        **kw,
    )
    eng = llm.llm_engine
    executor = eng.engine_core.engine_core.model_executor
    executed: list[float] = []
    _timed(executor, "execute_model", executed)
    flushed: list[float] = []
    if args.engine == "vase":
        from vase.vllm.state import WorkerState

        _timed(WorkerState, "flush", flushed)
    params = SamplingParams(temperature=0.6, top_p=0.95, max_tokens=args.steps + 8, ignore_eos=True)
    ids = prompts(llm.get_tokenizer(), args.requests)
    for i, x in enumerate(ids):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=x), params)
    steps = []
    for k in range(args.steps):
        for acc in (sampled, executed, flushed):
            acc.clear()
        before = dict(vase.vllm.worker_state(llm).stats) if args.engine == "vase" else None
        t = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t
        if k < args.skip:
            continue
        own = evicted = 0.0
        if before is not None:
            after = vase.vllm.worker_state(llm).stats
            evicted = sum(flushed)
            own = evicted + sum(after[x] - before[x] for x in ("t_after", "t_plan", "t_build"))
        fwd, smp = sum(executed) - own, sum(sampled)
        steps.append(
            {
                "step": total,
                "forward": fwd,
                "vase": own,
                "evict": evicted,
                "sampler": smp,
                "rest": total - fwd - own - smp,
            }
        )
    # the machine's speed drifts over minutes: keep loading it, unmeasured, until the other engine is done too, so that
    # each engine's steps were measured beside the other's
    Path(args.sync, args.engine).touch()
    rounds, measured = 0, sum(s["step"] for s in steps)
    deadline = time.perf_counter() + max(600.0, 3 * measured)  # the other engine failed: stop anyway
    while not all(Path(args.sync, e).exists() for e in ("stock", "vase")) and time.perf_counter() < deadline:
        if not eng.has_unfinished_requests():
            rounds += 1
            for i, x in enumerate(ids):
                eng.add_request(f"r{i}-{rounds}", TokensPrompt(prompt_token_ids=x), params)
        eng.step()
    mean = {p: statistics.mean(s[p] for s in steps) * 1e3 for p in ("step", *PARTS, "evict")}
    return {
        "engine": args.engine,
        "requests": args.requests,
        "steps": len(steps),
        "step_p50_ms": round(statistics.median(s["step"] for s in steps) * 1e3, 1),
        **{f"{p}_ms": round(v, 1) for p, v in mean.items()},
        "tok_s": round(args.requests / (mean["step"] / 1e3), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "build" / "vllm" / "smollm2"))
    ap.add_argument("--dtype", default="float32", help="the model's dtype in the engines (float32, bfloat16)")
    ap.add_argument("--requests", type=int, default=24, help="requests decoding together")
    ap.add_argument(
        "--stock-requests",
        type=int,
        default=0,
        help="stock vLLM's requests, if other than --requests (its batch at a tight pool)",
    )
    ap.add_argument("--steps", type=int, default=600, help="decode steps of each request")
    ap.add_argument("--skip", type=int, default=8, help="first steps left out (the prompts' prefill)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--engine", default="", help=argparse.SUPPRESS)  # one configuration (a child process)
    ap.add_argument("--sync", default="", help=argparse.SUPPRESS)  # where the children mark their measurement done
    args = ap.parse_args()
    if args.skip >= args.steps:
        ap.error(f"--skip ({args.skip}) must be below --steps ({args.steps})")
    for name in ("requests", "stock_requests", "steps", "budget", "buffer"):
        if getattr(args, name) < (0 if name == "stock_requests" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)})")
    if args.engine:
        if args.engine == "stock" and args.stock_requests:
            args.requests = args.stock_requests
        try:
            result = run_one(args)
        except BaseException:
            Path(args.sync, args.engine).touch()  # the other engine stops its unmeasured load now
            raise
        print("RESULT " + json.dumps(result), flush=True)
        return
    env = {**os.environ, **FAST_ENV, "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_PLUGINS", None)

    sync = tempfile.mkdtemp(prefix="vase-step-split-")

    def child(engine: str) -> dict:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--engine", engine, "--sync", sync]
        return child_result(cmd, {**env, **({"VLLM_PLUGINS": "none"} if engine == "stock" else {})}, engine, cwd=ROOT)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side, one core each
            stock, vase = pool.map(child, ["stock", "vase"])
    finally:
        shutil.rmtree(sync, ignore_errors=True)
    print(f"decode steps {args.skip}-{args.steps} (mean ms; step p50 for reference)")
    cols = [
        "engine",
        "requests",
        "step_ms",
        "step_p50_ms",
        "forward_ms",
        "vase_ms",
        "evict_ms",
        "sampler_ms",
        "rest_ms",
    ]
    print("| " + " | ".join(c.replace("_", " ") for c in cols) + " | sampler share | tok/s |")
    print("|---" * (len(cols) + 2) + "|")
    for r in (stock, vase):
        share = r["sampler_ms"] / r["step_ms"]
        print("| " + " | ".join(str(r[c]) for c in cols) + f" | {share:.0%} | {r['tok_s']} |")
    print(f"vase's tokens per second of step against stock vLLM's: {vase['tok_s'] / stock['tok_s']:.2f}x")


if __name__ == "__main__":
    main()

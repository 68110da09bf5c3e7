"""Eviction cost of policy options as a share of decode time, without the profiler.

For each policy spec, in one process: a prompt of budget + buffer + 1 tokens (compressed at prefill, so the cache
is full from the start), then ``--steps`` greedy decode steps; the cache times its evictions itself
(``stats().eviction_seconds``: scoring, guard, selection and compaction, all layers). Prints, per spec, the
milliseconds per eviction and the share of the decode wall time. With ``--repeats N`` the specs are measured in N
interleaved rounds (spec 1, spec 2, ..., spec 1, spec 2, ...) so that a drift of the machine's speed touches
every spec alike, and each column is the median over the rounds (the share's range over the rounds beside it).
``vase bench profile`` gives the same total split by component, but keeps every profiler event of the run in
memory (8 GB for one policy at budget 1024 here), which this measurement avoids.

Usage::

    OMP_WAIT_POLICY=PASSIVE VASE_THREADS=1 .venv/bin/python benchmarks/eviction_cost.py \\
        --policies vase,vase:value_weight=l1,knorm --budget 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vase.harness.measure import DEFAULT_PROMPT, _make_cache, _repeated_prompt
from vase.hf.compat import cache_kwargs
from vase.hf.models import load_model


@torch.inference_mode()
def measure(lm, policy: str, budget: int, buffer: int, steps: int) -> dict:
    """Decode ``steps`` tokens after a full prefill; eviction time and decode wall time (seconds)."""
    ids = _repeated_prompt(lm, DEFAULT_PROMPT, budget + buffer + 1)
    cache = _make_cache(lm.model, policy, budget, buffer)
    nxt = lm.model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    before = cache.stats()
    start = time.perf_counter()
    for _ in range(steps):
        nxt = lm.model(input_ids=nxt, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    wall = time.perf_counter() - start
    after = cache.stats()
    evictions = after.evictions - before.evictions
    seconds = after.eviction_seconds - before.eviction_seconds
    return {"policy": policy, "evictions": evictions, "eviction_s": seconds, "wall_s": wall, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", required=True, help="comma-separated policy specs")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the specs; medians reported")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    lm = load_model(args.model)
    specs = args.policies.split(",")
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    for rnd in range(args.repeats):
        for spec in specs:
            runs[spec].append(measure(lm, spec, args.budget, args.buffer, args.steps))
            if args.repeats > 1:
                r = runs[spec][-1]
                print(f"round {rnd + 1}/{args.repeats} {spec}: {100 * r['eviction_s'] / r['wall_s']:.2f}%", flush=True)
    print(f"\nbudget {args.budget}, buffer {args.buffer}, {args.steps} decode steps after a full prefill", end="")
    print(f", median of {args.repeats} interleaved rounds\n" if args.repeats > 1 else "\n")
    share = "eviction share of decode" + (" (range)" if args.repeats > 1 else "")
    print(f"| policy | evictions | ms per eviction (all layers) | decode tok/s | {share} |")
    print("|---|---|---|---|---|")
    for spec in specs:
        rs = runs[spec]
        per = statistics.median(1e3 * r["eviction_s"] / max(r["evictions"], 1) for r in rs)
        speed = statistics.median(r["steps"] / r["wall_s"] for r in rs)
        shares = [100 * r["eviction_s"] / r["wall_s"] for r in rs]
        spread = f" ({min(shares):.2f}-{max(shares):.2f})" if len(rs) > 1 else ""
        print(
            f"| `{spec}` | {rs[0]['evictions']} | {per:.1f} | {speed:.2f} | {statistics.median(shares):.2f}%{spread} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""One decode step of the embedded model against the bandwidth limit of the bytes it must read (CPU, float32).

A decode step reads every weight once (the tied embedding as the output projection included) and every KV entry
the cache holds once, so its floor is ``(weight bytes + KV bytes) / memory bandwidth``. This script measures the
bandwidth (a 1 GiB copy, best of five, read + write bytes counted), the step of `vase` at the given contexts and the
step of transformers' own ``DynamicCache`` at a short context and at the slots `vase` holds, then splits one `vase`
step under the torch profiler: weight matmuls, attention, the other operators, and the time between operators
(Python and dispatch: wall time minus operator time).

    .venv/bin/python benchmarks/decode_step_limit.py --contexts 4096,8192 --budget 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median_high as median  # the upper middle, as the figures were taken

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vase.harness.measure import _make_cache, _repeated_prompt, kv_bytes  # noqa: E402
from vase.hf.compat import cache_kwargs  # noqa: E402
from vase.hf.models import load_model  # noqa: E402

PROMPT = "Explain step by step how to compute 17 * 23 and then check the answer."


def bandwidth(gib: float = 1.0) -> float:
    """Copy bandwidth in bytes/s (read + write), best of five copies of ``gib`` GiB of float32."""
    x = torch.empty(int(gib * 2**30) // 4).normal_()
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best


def weight_bytes(model) -> int:
    """Bytes of the distinct parameter storages (a tied embedding counted once: it is read once per step, as the
    output projection; the input embedding reads one row)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class Stepper:
    """Greedy decoding with ``policy``'s cache after a ``context``-token prompt; :meth:`steps` times each step."""

    def __init__(self, lm, policy: str, context: int, budget: int, buffer: int):
        self.model = lm.model
        self.cache = _make_cache(lm.model, policy, budget, buffer)
        ids = _repeated_prompt(lm, PROMPT, context)
        self.nxt = self.model(input_ids=ids, **cache_kwargs(self.cache)).logits[:, -1:].argmax(-1)

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            logits = self.model(input_ids=self.nxt, **cache_kwargs(self.cache)).logits
            self.nxt = logits[:, -1:].argmax(-1)
            out.append(time.perf_counter() - t)
        return out


def split(stepper: Stepper, n: int, step_ms: float) -> dict:
    """Milliseconds per step by kind of operator, from the torch profiler's self times over ``n`` steps; the time
    between operators is the unprofiled step ``step_ms`` minus the operators' time (the profiler inflates it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stepper.steps(n)
    kinds = {"weight matmuls": 0.0, "attention": 0.0, "other operators": 0.0}
    for ev in prof.key_averages():
        if ev.key.startswith("aten::") or ev.key.startswith("vase."):
            us = ev.self_cpu_time_total
            if ev.key in ("aten::mm", "aten::addmm"):
                kinds["weight matmuls"] += us
            elif "attention" in ev.key or "codes" in ev.key:
                kinds["attention"] += us
            else:
                kinds["other operators"] += us
    ms = {k: v / 1e3 / n for k, v in kinds.items()}
    ms["between operators (Python, dispatch)"] = max(0.0, step_ms - sum(ms.values()))
    ms["step (unprofiled median)"] = step_ms
    return ms


def main(argv: list[str] | None = None, lm=None) -> dict:
    """Run the measurement and print its two tables; returns ``{"bandwidth", "weight_bytes", "rows", "split"}``
    (bytes/s, bytes, one dict per configuration with times in seconds, ms per step by part). ``lm``: an already
    loaded embedded model (tests)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,8192", help="prompt lengths for `vase`, comma separated")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--policy", default="vase")
    ap.add_argument("--steps", type=int, default=128, help="timed steps per configuration (after one buffer)")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--short", type=int, default=200, help="the full cache's short context")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the copy that measures bandwidth")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]

    bw = bandwidth(args.bandwidth_gib)
    lm = lm or load_model()
    wb = weight_bytes(lm.model)
    print(f"memory bandwidth (copy, best of 5): {bw / 1e9:.1f} GB/s; weights {wb / 1e6:.0f} MB float32")
    print("| cache | context | KV MB held | bytes / step (MB) | limit (ms) | step (ms, median) | × limit |")
    print("|---|---|---|---|---|---|---|")
    plan = [("full", args.short), ("full", args.budget + args.buffer // 2)] + [(args.policy, c) for c in contexts]
    rows, ms = [], {}
    with torch.inference_mode():
        for policy, context in plan:
            s = Stepper(lm, policy, context, args.budget, args.buffer)
            s.steps(args.buffer + 6)  # past the first eviction
            step = median(s.steps(args.steps))
            kv = kv_bytes(s.cache)
            limit = (wb + kv) / bw
            rows.append({"cache": policy, "context": context, "kv_bytes": kv, "limit_s": limit, "step_s": step})
            print(
                f"| {policy} | {context} | {kv / 1e6:.1f} | {(wb + kv) / 1e6:.0f} | {limit * 1e3:.1f} | "
                f"{step * 1e3:.1f} | {step / limit:.2f} |"
            )
            if policy == args.policy and context == contexts[-1]:
                ms = split(s, args.profile_steps, step * 1e3)
    print(f"\n`{args.policy}` at {contexts[-1]} tokens, one step under the profiler ({args.profile_steps} steps):")
    print("| part | ms per step |\n|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.1f} |")
    return {"bandwidth": bw, "weight_bytes": wb, "rows": rows, "split": ms}


if __name__ == "__main__":
    main()

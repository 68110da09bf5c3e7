"""A burst's time to first token in the engine alone: stock vLLM against vLLM + vase, alternating, repeated.

What a burst's p99 time to first token is made of, without the servers' front ends and with the machine's drift
averaged out: the same prompts arrive at once (``LLM.generate``, in-process), and each request's time to first token
is vLLM's own (``RequestOutput.metrics.first_token_latency``). Each engine runs in its own process (``taskset`` to one
core, one thread), ``--rounds`` times in turn (stock, vase, stock, vase, ...), and measures ``--repeats`` bursts after a
warm-up burst; the table gives each engine's median over all its bursts of the p50, p99 and last time to first token,
and vase's against stock vLLM's. The pool is ``--pool-tokens`` in each engine's own block size (128 for stock vLLM,
32 for vase), prefix caching as each engine has it by default (stock vLLM's cache is reset between bursts: every
burst is prefilled in full). ``--request-budget`` gives each vase request that budget (``vase_budget``), the level
elastic admission gives a 1,024-token burst at this pool, so that as many prompts are compressed at prefill as there
(a burst of short outputs alone would be admitted at the full budget).

    .venv-vllm/bin/python benchmarks/vllm_burst_ttft.py --out runs/burst-ttft --request-budget 128   # docs/SERVING.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def _child(args) -> None:
    """One engine, ``args.repeats`` bursts after a warm-up; prints one JSON line per burst."""
    from vllm import LLM, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in Path(args.dataset).read_text().splitlines()]
    common = dict(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,  # the per-request times
    )
    stock = args.child == "stock"
    if stock:
        llm = LLM(**common, num_gpu_blocks_override=args.pool_tokens // 128)
        extra = None
    else:
        import vase.vllm

        # a spec string as the serving benchmark takes it, its engine keys included
        llm = LLM(**common, num_gpu_blocks_override=args.pool_tokens // 32, **vase.vllm.engine_args(args.child))
        extra = {"vase_budget": args.request_budget} if args.request_budget else None
    params = SamplingParams(max_tokens=args.gen, temperature=0.6, top_p=0.95, ignore_eos=True, extra_args=extra)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-touch costs, compiled graphs
    for _ in range(args.repeats):
        if stock:
            llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        ttft = [o.metrics.first_token_latency for o in outs]
        stats = vase.vllm.engine_stats(llm)["worker"] if not stock else None
        print("BURST " + json.dumps({"ttft": ttft, "wall": wall, "worker": stats}), flush=True)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", default=str(ROOT / "build" / "vllm" / "smollm2"))
    ap.add_argument("--engines", nargs="+", default=["vllm=stock", "vase=vase:budget=256:buffer=64"],
                    help="NAME=SPEC: 'stock' (vLLM, no plugin) or a vase spec (engine keys included)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--gen", type=int, default=8, help="output tokens per request")
    ap.add_argument("--pool-tokens", type=int, default=5120)
    ap.add_argument("--request-budget", type=int, default=0, help="each vase request's budget (0: the engine's)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per engine, in turn")
    ap.add_argument("--repeats", type=int, default=3, help="bursts per process after its warm-up")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vLLM's prefill chunk (the server's)")
    ap.add_argument("--task", default="math500")
    ap.add_argument("--core", default="1", help="the core each engine process is pinned to")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return {}
    if args.out is None:
        ap.error("--out is required")
    sys.path.insert(0, str(Path(__file__).parent))
    import vllm_serve_bench as serve

    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "prompts.jsonl"
    ns = argparse.Namespace(model=args.model, task=args.task, prompts=args.prompts, system_prompt=0)
    source = serve._dataset(ns, dataset, 0)
    engines = [e.split("=", 1) for e in args.engines]
    bursts: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for rnd in range(args.rounds):
        for name, spec in engines:
            env = {**os.environ, **ENV}
            if spec == "stock":
                env["VLLM_PLUGINS"] = "none"  # stock vLLM, as users run it, though vase is installed
            cmd = ["taskset", "-c", args.core, sys.executable, __file__, "--child", spec, "--dataset", str(dataset)]
            cmd += ["--model", args.model, "--gen", str(args.gen), "--pool-tokens", str(args.pool_tokens)]
            cmd += ["--request-budget", str(args.request_budget), "--repeats", str(args.repeats)]
            cmd += ["--max-model-len", str(args.max_model_len)]
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
            log = args.out / f"{name}-{rnd}.log"
            print(f"[burst-ttft] round {rnd + 1}/{args.rounds}: {name} ({spec})", flush=True)
            with log.open("w") as f:
                rc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True)
            lines = [line[6:] for line in rc.stdout.splitlines() if line.startswith("BURST ")]
            if rc.returncode or len(lines) != args.repeats:
                raise SystemExit(f"{name}: the engine process failed (exit {rc.returncode}); see {log}")
            for line in lines:
                b = json.loads(line)
                b["round"] = rnd
                bursts[name].append(b)
    summary = {}
    for name, runs in bursts.items():
        summary[name] = {
            "ttft_p50": statistics.median(_percentile(b["ttft"], 0.5) for b in runs),
            "ttft_p99": statistics.median(_percentile(b["ttft"], 0.99) for b in runs),
            "ttft_last": statistics.median(max(b["ttft"]) for b in runs),
            "p99_each": [round(_percentile(b["ttft"], 0.99), 3) for b in runs],
            "bursts": len(runs),
        }
    first = engines[0][0]
    rows = ["| engine | bursts | TTFT p50 s | TTFT p99 s | last first token s | p99 x first | p99 of each burst s |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, s in summary.items():
        ratio = s["ttft_p99"] / summary[first]["ttft_p99"]
        rows.append(
            f"| {name} | {s['bursts']} | {s['ttft_p50']:.2f} | {s['ttft_p99']:.2f} | {s['ttft_last']:.2f} | "
            f"{ratio:.3f}x | {', '.join(f'{x:.2f}' for x in s['p99_each'])} |"
        )
    table = "\n".join(rows)
    results = {"settings": {k: str(v) for k, v in vars(args).items()}, "source": source, "summary": summary}
    results["bursts"] = bursts
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()

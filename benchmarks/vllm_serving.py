"""vLLM serving with and without vase, side by side, on the embedded model (docs/SERVING.md).

Many concurrent requests generating long outputs against a KV pool that holds only a few of them at full length:
requests/s, output tokens/s, peak running requests and preemptions for plain vLLM and for vLLM + vase at each
budget; then the same with a pool that holds every request (the cost of eviction); and the quality side, each vase
run's greedy tokens against plain vLLM's (requests identical, token agreement).

Each configuration runs in its own process (a fresh engine, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
``.venv-vllm``'s Python, one thread each; ``--parallel 2`` runs two at a time, one per core, in the order listed
(plain vLLM beside the first vase budget), so that the configurations compared share the machine alike; the process's
CPU seconds are given beside the wall time. The plain engine uses vase's scheduler class without a vase
configuration (vLLM's scheduler plus counters) so that preemptions and peak running are counted the same way. An
interrupted run resumes: configurations already in ``OUT/results.json`` are kept.

    .venv-vllm/bin/python benchmarks/vllm_serving.py --out runs/serving-2k --gen 2048 --tight-blocks 268 --ample-gib 4 \
        --parallel 2                                                      # the figures of docs/SERVING.md
    .venv-vllm/bin/python benchmarks/vllm_serving.py --requests 4 --gen 64 --buffer 16 --budgets 64 --ample-budgets 64 \
        --tight-blocks 8 --ample-gib 1 --out /tmp/s                                     # a quick check
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAST_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
TOPICS = [
    "dragons", "photosynthesis", "the planets", "the Roman Empire", "volcanoes", "jazz music", "chess", "the ocean",
    "bees", "computers", "bridges", "coffee", "mountains", "trains", "rain", "libraries", "glaciers", "the printing "
    "press", "honey", "deserts", "lighthouses", "clocks", "the moon", "forests", "submarines", "kites", "salt",
    "windmills", "owls", "paper", "maps", "bicycles",
]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]
STOCK_BLOCK = 128  # vLLM's default KV block size on CPU (tokens)


def child_result(cmd: list[str], env: dict, what: str, cwd=None) -> dict:
    """Run one configuration in its own process (``cmd``), which prints its figures as a ``RESULT {json}`` line;
    returns them. Exits with the child's output tail, naming ``what``, when it fails or prints none."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{what} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts of different lengths (about 40 to 90 tokens), as token ids."""
    out = []
    for k in range(n):
        text = f"Write a long, detailed essay about {TOPICS[k % len(TOPICS)]}. " + "Be thorough. " * ((k % 5) * 4)
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(list(tokenizer.encode(chat, add_special_tokens=False)))
    return out


def run_one(args) -> dict:
    """One engine, one batch of requests; returns the figures and the generated tokens."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vase.vllm

    kw = dict(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        block_size=32,
    )
    if args.blocks:
        kw["num_gpu_blocks_override"] = args.blocks
    if args.budget:
        kw.update(vase.vllm.engine_args(args.policy, budget=args.budget, buffer=args.buffer))
    else:  # plain vLLM, with the scheduler's counters only (no additional_config: stock behaviour)
        kw["scheduler_cls"] = vase.vllm.SCHEDULER_CLS
    llm = LLM(**kw)
    ids = prompts(llm.get_tokenizer(), args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = vase.vllm.engine_stats(llm)
    sched = stats["scheduler"]
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "engine": f"vase {args.policy} {args.budget}+{args.buffer}" if args.budget else "plain vLLM",
        "pool_blocks": pool - 1,
        "requests": args.requests,
        "gen": args.gen,
        "prompt_tokens": [min(map(len, ids)), max(map(len, ids))],
        "wall_s": round(wall, 1),
        "req_s": round(args.requests / wall, 4),
        "out_tok_s": round(tokens / wall, 1),
        # CPU seconds of the engine's process: with one thread, the wall time on an idle core, whatever else runs
        "cpu_s": round(cpu, 1),
        "out_tok_cpu_s": round(tokens / cpu, 1),
        "peak_running": sched["peak_running"],
        "preemptions": sched["preemptions"],
        "max_blocks_held": sched["max_blocks_held"] if args.budget else None,
        "vllm": vllm.__version__,
        "threads": os.environ.get("OMP_NUM_THREADS"),
    }
    worker = stats["worker"]
    if worker is not None:
        res["evictions"] = worker["rows_evicted"]
        res["t_step_s"] = round(worker["t_step"], 1)
        res["t_vase_s"] = round(worker["t_plan"] + worker["t_build"] + worker["t_after"], 2)
        res["t_evict_s"] = round(worker["t_evict"], 2)
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    return res


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    """Share of positions where two token lists agree, and the first position where they differ (len if none)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return sum(x == y for x, y in zip(a, b)) / max(n, 1), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "build" / "vllm" / "smollm2"))
    ap.add_argument("--out", default="runs/serving")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gen", type=int, default=1024)
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--policy", default="vase")
    ap.add_argument("--tight-blocks", type=int, default=144, help="the small pool, in blocks of 32 tokens")
    ap.add_argument("--ample-gib", default="2", help="the large pool (VLLM_CPU_KVCACHE_SPACE, GiB; 0: not run)")
    ap.add_argument("--ample-budgets", default="256", help="vase budgets also run with the large pool")
    ap.add_argument("--parallel", type=int, default=1, help="configurations run at a time (2: one per core)")
    ap.add_argument("--threads", default="1", help="OMP threads per engine (1: CPU time = wall time on an idle core)")
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # one configuration (a child process)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.max_model_len = args.max_model_len or 128 * ((args.gen + 100) // 128 + 1)
    if args.run:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    ample = [int(b) for b in args.ample_budgets.split(",") if b]
    configs = [("tight", 0), *[("tight", b) for b in budgets]]
    if args.ample_gib != "0":
        configs += [("ample", 0), *[("ample", b) for b in ample]]
    # an interrupted run resumes: configurations already measured with the same requests and lengths are kept
    saved = out / "results.json"
    results = [
        r
        for r in (json.loads(saved.read_text()) if saved.exists() else [])
        if (r["requests"], r["gen"]) == (args.requests, args.gen)
    ]
    done = {(r["pool"], r.get("budget", 0)) for r in results}

    def measure(pool: str, budget: int) -> dict:
        env = {
            **os.environ,
            **FAST_ENV,
            "OMP_NUM_THREADS": args.threads,
            "VLLM_CPU_KVCACHE_SPACE": args.ample_gib if args.ample_gib != "0" else "1",
        }
        cmd = [sys.executable, __file__, "--run", "--model", args.model, "--requests", str(args.requests)]
        cmd += ["--gen", str(args.gen), "--budget", str(budget), "--buffer", str(args.buffer)]
        cmd += ["--policy", args.policy, "--max-model-len", str(args.max_model_len)]
        if pool == "tight":
            cmd += ["--blocks", str(args.tight_blocks + 1)]  # + vLLM's null block
        t = time.time()
        res = {**child_result(cmd, env, f"configuration {pool} budget {budget}"), "pool": pool, "budget": budget}
        print(
            f"[{time.time() - t:6.0f} s] {pool:5s} {res['engine']:22s} "
            + json.dumps({k: v for k, v in res.items() if k not in ("outputs", "engine", "pool")}),
            flush=True,
        )
        return res

    # --parallel 2: two configurations at a time, one per core, in the order listed (plain beside the first vase
    # budget), so that the configurations compared ran on the same machine at the same time
    todo = [c for c in configs if c not in done]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool_:
        for res in pool_.map(lambda c: measure(*c), todo):
            results.append(res)
            (out / "results.json").write_text(json.dumps(results))
    plain = next(r for r in results[::-1] if r["engine"] == "plain vLLM")["outputs"]  # the ample pool's if run
    order = {c: k for k, c in enumerate(configs)}
    results.sort(key=lambda r: order.get((r["pool"], r.get("budget", 0)), len(order)))
    for r in results:
        pairs = [agreement(a, b) for a, b in zip(r["outputs"], plain)]
        r["agreement"] = round(sum(p[0] for p in pairs) / len(pairs), 3)
        firsts = sorted(p[1] for p in pairs)
        r["first_divergence_median"] = firsts[len(firsts) // 2]
        r["identical"] = sum(p[1] == len(r["outputs"][0]) for p in pairs)
    (out / "results.json").write_text(json.dumps(results))
    base = {r["pool"]: r for r in results if r["engine"] == "plain vLLM"}
    lines = [
        "| pool | engine | wall s | out tok/s | vs plain | CPU s | peak running | preemptions | blocks / request | "
        "vase time / step time | requests identical to plain | token agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        pool = f"{r['pool_blocks']} blocks" if r["pool"] == "tight" else f"{args.ample_gib} GiB ({r['pool_blocks']})"
        share = f"{100 * r['t_vase_s'] / r['t_step_s']:.1f}%" if r.get("t_step_s") else ""
        ratio = r["out_tok_s"] / base[r["pool"]]["out_tok_s"]
        cap = r["max_blocks_held"] or f"up to {-(-(r['gen'] + r['prompt_tokens'][1]) // 32)}"
        lines.append(
            f"| {pool} | {r['engine']} | {r['wall_s']} | {r['out_tok_s']} | {ratio:.2f}x | {r.get('cpu_s', '')} | "
            f"{r['peak_running']} | {r['preemptions']} | {cap} | {share} | "
            f"{r['identical']} / {len(r['outputs'])} | {r['agreement']:.3f} |"
        )
    table = "\n".join(lines)
    (out / "SERVING.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

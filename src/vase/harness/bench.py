"""``vase bench sweep``: decode speed, KV bytes, process memory and eviction cost, full cache vs policies, side by
side, each configuration in its own process.

Each configuration (policy, budget) runs in a fresh subprocess (``python -m vase.harness.bench ARGS``, this module's
worker), so its peak RSS is its own; the measurement is :func:`vase.harness.measure.decode_run`. Results go to
``bench.json`` as each configuration finishes (an interrupted sweep resumes) and the tables
(:func:`vase.harness.bench_markdown.bench_markdown`) to ``BENCH.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from .bench_markdown import bench_markdown
from .measure import DEFAULT_PROMPT, decode_run


def worker(args: dict) -> dict:
    """One configuration in this process (called in a subprocess by :func:`run_bench`)."""
    from ..hf.models import load_model
    from .generation import encode_prompts

    if args.get("threads"):
        torch.set_num_threads(args["threads"])
    lm = load_model(args.get("model"), device=args.get("device", "auto"))
    ids = encode_prompts(lm.tokenizer, [args.get("prompt", DEFAULT_PROMPT)])["input_ids"].to(lm.device)
    # a short warm-up so one-time costs (allocator, kernels) are not billed to the first bucket
    decode_run(lm.model, ids, args["policy"], args["budget"], args["buffer"], 8, [8])
    res = decode_run(lm.model, ids, args["policy"], args["budget"], args["buffer"], max(args["marks"]), args["marks"])
    res["model"] = lm.name
    res["device"] = str(lm.device)
    res["threads"] = torch.get_num_threads()
    return res


def run_bench(
    out: Path,
    policies: list[str],
    budgets: list[int],
    marks: list[int],
    buffer: int = 64,
    model: str | None = None,
    device: str = "auto",
    prompt: str = DEFAULT_PROMPT,
) -> dict:
    """Run every configuration in its own subprocess, write ``bench.json`` and ``BENCH.md`` into ``out``.

    Results of configurations already in ``out/bench.json`` (same marks and buffer) are reused, so an interrupted
    benchmark resumes.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    if previous.get("marks") != marks or previous.get("buffer") != buffer:
        previous = {}
    results = previous.get("runs", [])
    done = {(r["policy"], r["budget"]) for r in results}
    from tqdm.auto import tqdm

    configs = [("full", None)] + [(p, b) for b in budgets for p in policies if p != "full"]
    bar = tqdm(total=len(configs), initial=len(done & set(configs)), desc="bench", unit="config", dynamic_ncols=True)
    for policy, budget in configs:
        if (policy, budget) in done:
            continue
        bar.set_postfix_str(f"{policy}" + (f" budget {budget}" if budget else ""))
        args = {
            "policy": policy,
            "budget": budget or 0,
            "buffer": buffer,
            "marks": marks,
            "model": model,
            "device": device,
            "prompt": prompt,
            "threads": torch.get_num_threads(),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "vase.harness.bench", json.dumps(args)],
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark worker failed for {policy} {budget}: {proc.stderr.strip()[-2000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        path.write_text(json.dumps({"marks": marks, "buffer": buffer, "runs": results}, indent=1))
        bar.update(1)
    bar.close()
    data = {"marks": marks, "buffer": buffer, "runs": results}
    (out / "BENCH.md").write_text(bench_markdown(data))
    return data


if __name__ == "__main__":  # worker mode: one configuration, JSON on the last stdout line
    result = worker(json.loads(sys.argv[1]))
    print(json.dumps(result))

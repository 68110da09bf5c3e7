"""GPU benchmark: a random-weight model with Qwen3-4B's shape, full cache vs vase, batch 16, 16K new tokens.

The VaSE paper (arXiv 2606.03928) reports, for Qwen3-14B, 132.9 vs 333.4 tokens/s and 68.7 vs 39.6 GB peak memory
(full vs VaSE). This script measures the same two quantities for Qwen3-4B's shape on whatever GPU it runs on, with
random weights (config only: no hub access needed), bf16, flash_attention_2 when flash-attn is installed, else sdpa.

It is sized for one 10-minute call: vase runs first, then the full cache with the time that is left; a run cut short
reports what it reached. Results go to a JSON file (default ``$OUT/gpu_bench.json`` when ``$OUT`` is set).

    python benchmarks/gpu_qwen3_4b.py                   # on an H100/H200
    python benchmarks/gpu_qwen3_4b.py --compile         # + compiled decode steps (CUDA graphs), 4 runs, sdpa
    python benchmarks/gpu_qwen3_4b.py --tiny --device cpu   # the same code path at toy size (tests)
    python benchmarks/gpu_qwen3_4b.py --prompt-tokens 16384 --tokens 2048   # decode steps at 16K-18K context

A long prompt stands in for a long chain of thought where time is short: the decode steps then run at the context
length a long generation reaches late (vase compresses the prompt to its budget at prefill). ``peak_gb`` is the peak
during decoding (the peak is reset after prefill), ``prefill_peak_gb`` the prefill's.

With ``--compile`` it runs vase and the full cache each compiled (``torch.compile(model, mode='reduce-overhead',
fullgraph=True)``: vase's ``EvictingCache(..., compileable=True)``, transformers' ``StaticCache`` for the full cache)
and not, 4096 new tokens by default, and prints every run's speed as a ratio to the full cache, compiled and not.
Compilation and CUDA-graph capture happen in untimed warm-up steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vase.hf.compat import cache_kwargs  # noqa: E402

QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build_model(shape: dict, device: str, dtype: torch.dtype, attn: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, attn_implementation=attn)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


MODES = ("vase", "full")
COMPILED_MODES = ("vase+compile", "vase", "full+compile", "full")


def make_cache(model, mode: str, budget: int, buffer: int, max_len: int):
    """``full``: DynamicCache; ``full+compile``: StaticCache of ``max_len`` tokens; ``vase`` (``+compile``): vase's
    EvictingCache (compileable)."""
    from transformers import DynamicCache, StaticCache

    import vase

    compiled = mode.endswith("+compile")
    if mode.startswith("full"):
        return (
            StaticCache(config=model.config, max_cache_len=max_len) if compiled else DynamicCache(config=model.config)
        )
    return vase.EvictingCache(model, policy="vase", budget=budget, buffer=buffer, compileable=compiled)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run_mode(
    model,
    prompt: torch.Tensor,
    mode: str,
    tokens: int,
    budget: int,
    buffer: int,
    device: str,
    deadline: float,
    marks: list[int],
    compiled=None,
    warmup: int = 8,
) -> dict:
    """Greedy decode ``tokens`` steps for the whole batch; stop early at ``deadline`` (time.perf_counter). A mode
    ending in ``+compile`` runs ``compiled`` (the compiled model) after ``warmup`` untimed steps (compilation)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    length = prompt.shape[1]
    cache = make_cache(model, mode, budget, buffer, length + warmup + tokens + 1)
    use_compiled = mode.endswith("+compile")
    prepare = getattr(cache, "prepare_decode", None) if use_compiled else None

    def step(nxt: torch.Tensor, position: int) -> torch.Tensor:
        if not use_compiled:
            return model(input_ids=nxt, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        if prepare is not None:
            prepare()
        pos = torch.full((nxt.shape[0], 1), position, dtype=torch.long, device=nxt.device)
        return compiled(input_ids=nxt, **cache_kwargs(cache), position_ids=pos).logits[:, -1:].argmax(-1)

    t0 = time.perf_counter()
    # logits of the last position only: a long prompt's full logits (batch x prompt x 151,936) would not fit
    nxt = model(input_ids=prompt, logits_to_keep=1, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    sync(device)
    prefill = time.perf_counter() - t0
    prefill_peak = torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()  # decode's peak apart from prefill's activations
    skip = warmup if use_compiled else 0
    for i in range(skip):
        nxt = step(nxt, length + i)
    sync(device)
    compile_s = time.perf_counter() - t0 - prefill
    start = time.perf_counter()
    rows, done, last_t, last_i = [], 0, start, 0
    for i in range(1, tokens + 1):
        nxt = step(nxt, length + skip + i - 1)
        done = i
        if i in marks or i == tokens or (i % 256 == 0 and time.perf_counter() > deadline):
            sync(device)
            now = time.perf_counter()
            rows.append(
                {
                    "tokens": i,
                    "tok_s": prompt.shape[0] * (i - last_i) / (now - last_t),
                    "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None,
                }
            )
            last_t, last_i = now, i
            if now > deadline:
                break
    sync(device)
    seconds = time.perf_counter() - start
    return {
        "mode": mode,
        "tokens_done": done,
        "complete": done == tokens,
        "decode_s": seconds,
        "prefill_s": prefill,
        "warmup_s": compile_s,
        "tok_s": prompt.shape[0] * done / seconds,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None,
        "prefill_peak_gb": prefill_peak,
        "marks": rows,
        "stats": cache.stats().line() if mode.startswith("vase") else None,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="new tokens (default 16384; 4096 with --compile)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn", default="auto", help="auto: flash_attention_2 if flash-attn is installed, else sdpa")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole script")
    ap.add_argument("--tiny", action="store_true", help="toy shape, batch 2, 64 tokens (CPU test of the code path)")
    ap.add_argument("--compile", action="store_true", help="also compiled decode steps (CUDA graphs on a GPU)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend with --compile")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = 4096 if args.compile else 16384  # with --compile, four runs in one call
    begin = time.perf_counter()
    if args.tiny:
        shape, args.batch, args.tokens, args.budget, args.buffer, args.prompt_tokens = TINY, 2, 64, 32, 8, 16
    else:
        shape = QWEN3_4B
    attn = args.attn
    if args.compile and attn == "auto":
        attn = "sdpa"  # compiled decoding: sdpa (flash-attention's padded path is not a fixed-shape graph)
    if attn == "auto":
        attn = (
            "flash_attention_2" if args.device.startswith("cuda") and importlib.util.find_spec("flash_attn") else "sdpa"
        )
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    model = build_model(shape, args.device, dtype, attn)
    prompt = torch.randint(0, shape["vocab_size"], (args.batch, args.prompt_tokens), device=args.device)
    marks = [m for m in (1024, 2048, 4096, 8192, 16384) if m < args.tokens] + [args.tokens]
    results = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "attn": attn,
        "dtype": str(dtype),
        "shape": "tiny" if args.tiny else "Qwen3-4B",
        "batch": args.batch,
        "tokens": args.tokens,
        "budget": args.budget,
        "buffer": args.buffer,
        "runs": [],
    }
    modes = COMPILED_MODES if args.compile else MODES
    compiled = None
    if args.compile:
        cmode = "reduce-overhead" if args.device.startswith("cuda") else "default"
        compiled = torch.compile(model, backend=args.backend, mode=cmode, fullgraph=True, dynamic=False)
        results.update(compile_mode=cmode, backend=args.backend)
    setup = time.perf_counter() - begin
    remaining = args.time_limit - setup
    for j, mode in enumerate(modes):
        share = remaining / (len(modes) - j)  # each run gets an equal share of what is left
        deadline = time.perf_counter() + share
        res = run_mode(
            model, prompt, mode, args.tokens, args.budget, args.buffer, args.device, deadline, marks, compiled
        )
        results["runs"].append(res)
        remaining = args.time_limit - (time.perf_counter() - begin)
        print(json.dumps({k: v for k, v in res.items() if k != "marks"}), flush=True)
    by_mode = {r["mode"]: r for r in results["runs"]}
    v, f = by_mode["vase"], by_mode["full"]
    results["speedup"] = v["tok_s"] / f["tok_s"]
    if v["peak_gb"] and f["peak_gb"]:
        results["memory_ratio"] = f["peak_gb"] / v["peak_gb"]
    if args.compile:
        fc = by_mode["full+compile"]
        results["vs_full"] = {m: r["tok_s"] / f["tok_s"] for m, r in by_mode.items()}
        results["vs_full_compiled"] = {m: r["tok_s"] / fc["tok_s"] for m, r in by_mode.items()}
        for m, r in by_mode.items():
            print(
                f"{m:>14}: {r['tok_s']:8.1f} tok/s, {results['vs_full'][m]:.2f}x full, "
                f"{results['vs_full_compiled'][m]:.2f}x full+compile, peak {r['peak_gb']} GB, "
                f"{r['tokens_done']} tokens{'' if r['complete'] else ' (cut short)'}",
                flush=True,
            )
    out = args.out or (
        Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT") else Path("runs/gpu_bench.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(
        f"wrote {out}: vase {v['tok_s']:.1f} tok/s vs full {f['tok_s']:.1f} tok/s "
        f"({results['speedup']:.2f}x); peak GB vase {v['peak_gb']} full {f['peak_gb']}"
    )
    return results


if __name__ == "__main__":
    main()

"""GPU benchmark: a random-weight model with Qwen3-4B's shape, full cache vs vase, batch 16, 16K new tokens.

The VaSE paper (arXiv 2606.03928) reports, for Qwen3-14B, 132.9 vs 333.4 tokens/s and 68.7 vs 39.6 GB peak memory
(full vs VaSE). This script measures the same two quantities for Qwen3-4B's shape on whatever GPU it runs on, with
random weights (config only: no hub access needed), bf16, flash_attention_2 when flash-attn is installed, else sdpa.

It is sized for one 10-minute call: vase runs first, then the full cache with the time that is left; a run cut short
reports what it reached. Results go to a JSON file (default ``$OUT/gpu_bench.json`` when ``$OUT`` is set).

    python benchmarks/gpu_qwen3_4b.py                   # on an H100/H200
    python benchmarks/gpu_qwen3_4b.py --tiny --device cpu   # the same code path at toy size (tests)
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
) -> dict:
    """Greedy decode ``tokens`` steps for the whole batch; stop early at ``deadline`` (time.perf_counter)."""
    from transformers import DynamicCache

    import vase

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = (
        DynamicCache(config=model.config)
        if mode == "full"
        else vase.EvictingCache(model, policy="vase", budget=budget, buffer=buffer)
    )
    t0 = time.perf_counter()
    nxt = model(input_ids=prompt, cache=cache).logits[:, -1:].argmax(-1)
    sync(device)
    prefill = time.perf_counter() - t0
    start = time.perf_counter()
    rows, done, last_t, last_i = [], 0, start, 0
    for i in range(1, tokens + 1):
        nxt = model(input_ids=nxt, cache=cache).logits[:, -1:].argmax(-1)
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
        "tok_s": prompt.shape[0] * done / seconds,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None,
        "marks": rows,
        "stats": cache.stats().line() if mode != "full" else None,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn", default="auto", help="auto: flash_attention_2 if flash-attn is installed, else sdpa")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole script")
    ap.add_argument("--tiny", action="store_true", help="toy shape, batch 2, 64 tokens (CPU test of the code path)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    begin = time.perf_counter()
    if args.tiny:
        shape, args.batch, args.tokens, args.budget, args.buffer, args.prompt_tokens = TINY, 2, 64, 32, 8, 16
    else:
        shape = QWEN3_4B
    attn = args.attn
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
    setup = time.perf_counter() - begin
    remaining = args.time_limit - setup
    for j, mode in enumerate(("vase", "full")):
        share = remaining / (2 - j)  # vase gets half of what is left, full the rest
        deadline = time.perf_counter() + share
        res = run_mode(model, prompt, mode, args.tokens, args.budget, args.buffer, args.device, deadline, marks)
        results["runs"].append(res)
        remaining = args.time_limit - (time.perf_counter() - begin)
        print(json.dumps({k: v for k, v in res.items() if k != "marks"}), flush=True)
    v, f = results["runs"]
    results["speedup"] = v["tok_s"] / f["tok_s"]
    if v["peak_gb"] and f["peak_gb"]:
        results["memory_ratio"] = f["peak_gb"] / v["peak_gb"]
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

"""GPU benchmark of decode attention over quantized codes: one attention layer of Qwen3-4B's shape (8 KV heads of dim
128, 32 query heads), random entries, bf16, batch 1 and 16, 8K to 32K slots per (row, KV head).

Per configuration, in one process and side by side, the time of one decode step's attention of one layer:

* ``codes``: :func:`vase.core.codes.decode_attention` (the Triton kernel on CUDA, its slots split over programs to
  fill the GPU) over the 4-bit store; on CUDA also ``codes_one_split``: the kernel with one program per (row, KV head);
* ``dequantize``: what ``kv_attention=dequantize`` does: dequantize the store into a bf16 workspace, then sdpa;
* ``dense``: sdpa over a bf16 store of the same slots (unquantized eviction at the same budget).

    python benchmarks/gpu_codes_attention.py              # on the GPU; writes $OUT/gpu_codes.json or runs/
    python benchmarks/gpu_codes_attention.py --tiny --device cpu   # the code path at toy size (tests)
    python benchmarks/gpu_codes_attention.py --device cpu --shape smollm2 --slots 1024 --batch 1  # the CPU kernel,
        # float32, at the embedded model's attention shape (3 KV heads of dim 64, 3 query heads each)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vase.core import codes, quant  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def one(batch: int, slots: int, heads: int, group: int, dim: int, bits: int, device: str, dtype, reps: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, h, d, recent = batch, heads, dim, 64
    keys = torch.randn(b, h, slots, d, generator=gen).to(device)
    values = torch.randn(b, h, slots, d, generator=gen).to(device)
    factors = torch.ones(b, h, d, device=device)
    kq, ks, kz = quant.quantize(keys, bits, 32)
    vq, vs, vz = quant.quantize(values, bits, 32)
    query = torch.randn(b, h * group, d, generator=gen).to(device, dtype)
    fp_k = torch.randn(b, h, recent, d, generator=gen).to(device, dtype)
    fp_v = torch.randn(b, h, recent, d, generator=gen).to(device, dtype)
    args = dict(
        query=query,
        factors=factors,
        scaling=d**-0.5,
        codes=(kq, ks, kz, vq, vs, vz),
        qmask=torch.ones(b, h, slots, dtype=torch.bool, device=device),
        positions=torch.arange(slots + recent, device=device).expand(b, h, -1).contiguous(),
        fp_k=fp_k,
        fp_v=fp_v,
        protected=torch.zeros(b, h, 0, dtype=torch.long, device=device),
        qlimit=torch.full((b,), slots, device=device),
        recent=torch.full((b,), recent, device=device),
        bits=bits,
    )
    work_k = torch.empty(b, h, slots + recent, d, device=device, dtype=dtype)
    work_v = torch.empty_like(work_k)
    dense_k, dense_v = keys.to(dtype), values.to(dtype)
    dense_k = torch.cat([dense_k, fp_k], 2)
    dense_v = torch.cat([dense_v, fp_v], 2)
    q4 = query.view(b, h * group, 1, d)

    def dequantize():
        work_k[:, :, :slots] = quant.dequantize(kq, ks, kz, bits, dtype)
        work_v[:, :, :slots] = quant.dequantize(vq, vs, vz, bits, dtype)
        work_k[:, :, slots:] = fp_k
        work_v[:, :, slots:] = fp_v
        return torch.nn.functional.scaled_dot_product_attention(q4, work_k, work_v, enable_gqa=True)

    def dense():
        return torch.nn.functional.scaled_dot_product_attention(q4, dense_k, dense_v, enable_gqa=True)

    out = {"batch": batch, "slots": slots, "bits": bits}
    out["codes_ms"] = 1e3 * timed(lambda: codes.decode_attention(**args), device, reps)
    if device.startswith("cuda"):
        from vase.core.kernels.codes_triton import decode_attention_triton, split_count

        plain = [args[k] for k in ("query", "factors", "scaling", "codes", "qmask", "positions", "fp_k", "fp_v")]
        plain += [args[k] for k in ("protected", "qlimit", "recent", "bits")]
        out["splits"] = split_count(b * h, slots, 32, torch.device(device))
        out["codes_one_split_ms"] = 1e3 * timed(lambda: decode_attention_triton(*plain, splits=1), device, reps)
    out["dequantize_ms"] = 1e3 * timed(dequantize, device, reps)
    out["dense_ms"] = 1e3 * timed(dense, device, reps)
    ref = dequantize().view(b, h * group, d).float()
    out["max_abs_diff"] = float((codes.decode_attention(**args).float() - ref).abs().max())
    out["codes_vs_dense"] = out["dense_ms"] / out["codes_ms"]
    out["codes_vs_dequantize"] = out["dequantize_ms"] / out["codes_ms"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (CPU test of the code path)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--shape", choices=("qwen3-4b", "smollm2"), default="qwen3-4b")
    ap.add_argument("--slots", default="8192,16384,32768", help="comma-separated slots per (row, KV head)")
    ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bfloat16 on CUDA")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        shape, grid, reps, dtype = dict(heads=2, group=2, dim=32), [(1, 256), (2, 512)], 3, torch.float32
    else:
        shape = dict(heads=8, group=4, dim=128) if args.shape == "qwen3-4b" else dict(heads=3, group=3, dim=64)
        grid = [(int(b), int(s)) for b in args.batch.split(",") for s in args.slots.split(",")]
        cuda = args.device.startswith("cuda")
        reps, dtype = 20, getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    rows = []
    for batch, slots in grid:
        row = one(batch, slots, **shape, bits=args.bits, device=args.device, dtype=dtype, reps=reps)
        rows.append(row)
        split = f" ({row['splits']} splits; one split {row['codes_one_split_ms']:.3f} ms)" if "splits" in row else ""
        print(
            f"batch {batch:>2} slots {slots:>6}: codes {row['codes_ms']:.3f} ms{split}, "
            f"dequantize {row['dequantize_ms']:.3f} ms, dense {row['dense_ms']:.3f} ms "
            f"(codes {row['codes_vs_dense']:.2f}x dense's speed, "
            f"{row['codes_vs_dequantize']:.2f}x dequantize's; max |diff| {row['max_abs_diff']:.2e})",
            flush=True,
        )
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "rows": rows}
    out = args.out or Path(os.environ.get("OUT", "runs")) / "gpu_codes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

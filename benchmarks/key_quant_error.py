"""Relative round-trip error of the embedded model's keys and values under three quantization layouts, the figure
behind vase's choice for keys (docs/GUIDE.md, "Quantized storage").

Usage::

    python benchmarks/key_quant_error.py [--tokens 1024] [--group 32]

The first ``--tokens`` tokens of tinyshakespeare go through the model once with transformers' ``DynamicCache``; for
every layer the keys ``[1, KV heads, tokens, head_dim]`` are quantized and dequantized at 8, 4 and 2 bits
(:func:`vase.core.quant.quantize`, groups of ``--group``) in three ways: per token (groups of channels), per token
after dividing each channel by its largest magnitude (vase's layout: :func:`vase.core.quant.channel_scale`), and per
channel over groups of ``--group`` consecutive tokens (KIVI's layout for keys, arXiv 2402.02750, Sec. 3.1, which
eviction breaks: it needs the group's tokens to stay together). Values per token for reference. Prints the mean over
layers of ``||x - x'|| / ||x||``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import DynamicCache

from vase.core import quant
from vase.hf.compat import cache_kwargs
from vase.hf.models import load_model

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "tinyshakespeare.txt"


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / x.norm()).item()


def per_channel(k: torch.Tensor, bits: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI's keys: per channel over groups of ``tokens`` consecutive tokens (the tail shorter than a group dropped)."""
    b, h, s, d = k.shape
    n = s // tokens * tokens
    g = k[:, :, :n].reshape(b, h, n // tokens, tokens, d).transpose(-1, -2)
    back = quant.dequantize(*quant.quantize(g, bits, tokens), bits).transpose(-1, -2).reshape(b, h, n, d)
    return k[:, :, :n], back


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--text", type=Path, default=TEXT)
    args = ap.parse_args()
    lm = load_model()
    ids = lm.tokenizer(args.text.read_text(encoding="utf-8")[: args.tokens * 8], return_tensors="pt")["input_ids"]
    cache = DynamicCache(config=lm.model.config)
    lm.model(input_ids=ids[:, : args.tokens], **cache_kwargs(cache))
    g = args.group
    head = ["bits", "keys per token", "keys per token, channel factors (vase)", "keys per channel (KIVI)", "values"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|---|---|")
    for bits in quant.KV_BITS:
        errs = {"tok": [], "chan": [], "kivi": [], "val": []}
        for layer in cache.layers:
            k, v = layer.keys.float(), layer.values.float()
            errs["tok"].append(rel(k, quant.dequantize(*quant.quantize(k, bits, g), bits)))
            f = quant.channel_scale(k, torch.ones(k.shape[:-1], dtype=torch.bool)).unsqueeze(2)
            errs["chan"].append(rel(k, quant.dequantize(*quant.quantize(k / f, bits, g), bits) * f))
            errs["kivi"].append(rel(*per_channel(k, bits, g)))
            errs["val"].append(rel(v, quant.dequantize(*quant.quantize(v, bits, g), bits)))
        m = {n: sum(x) / len(x) for n, x in errs.items()}
        print(f"| {bits} | {m['tok']:.4f} | {m['chan']:.4f} | {m['kivi']:.4f} | {m['val']:.4f} |")


if __name__ == "__main__":
    main()

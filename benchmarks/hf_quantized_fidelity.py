"""transformers' own ``QuantizedCache`` (optimum-quanto backend) on the sources of a ``vase fidelity`` run: the external
reference for quantization alone.

Usage::

    .venv/bin/pip install -e '.[quanto]'   # optimum-quanto 0.2.7, with the pinned torch 2.13.0 (no other torch)
    python benchmarks/hf_quantized_fidelity.py runs/kvq-text --nbits 4,2 --group 32

For each source of ``RUN/sources.jsonl`` (and the model, dtype, buffer and bucket of ``RUN/config.json``), it replays
the continuation teacher-forced through ``QuantizedCache(backend="quanto", nbits, q_group_size, residual_length =
buffer)``, in chunks of ``residual_length`` tokens after the prompt (the cache quantizes when its full-precision
residual reaches that length, so each token sees what it would see decoding one token at a time), compares with the
full cache as ``vase fidelity`` does (:func:`vase.harness.fidelity.compare`), and appends one record per source to
``RUN/hf_quantized.jsonl`` with policy ``hf-quanto:<nbits>``, the bytes it holds at the end (packed data, scales and
zero points of the quanto tensors, plus the full-precision residual) and ``memory_compression`` (full-cache bytes
over those). Resumable: sources already in the file are skipped.

transformers' cache re-quantizes every token it holds at each flush (it dequantizes, concatenates the residual and
quantizes again), keys and values alike along the axis given (``axis_key`` / ``axis_value``, 0 by default: groups of
``q_group_size`` consecutive channels of a token).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from vase.harness.evaluate import read_records
from vase.harness.fidelity import compare, replay
from vase.hf.compat import cache_kwargs
from vase.hf.models import load_model


def quanto_bytes(cache) -> int:
    """Bytes a ``QuantizedCache`` holds: each layer's quantized keys and values (packed data, scale, shift) and its
    full-precision residual."""
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values"):
            qt = getattr(layer, name, None)
            if qt is None:
                continue
            for part in ("_data", "_scale", "_shift"):
                t = getattr(qt, part, None)
                if t is not None:
                    # quanto packs 2- and 4-bit data in a PackedTensor whose `_data` is the uint8 storage
                    inner = getattr(t, "_data", t)
                    total += inner.numel() * inner.element_size()
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.inference_mode()
def hf_replay(model, prompt: torch.Tensor, cont: torch.Tensor, nbits: int, group: int, residual: int):
    """Teacher-forced log-probabilities ``[T, vocab]`` through ``QuantizedCache``; returns (logprobs, bytes held)."""
    from transformers import QuantizedCache

    cache = QuantizedCache(
        backend="quanto", config=model.config, nbits=nbits, q_group_size=group, residual_length=residual
    )
    out = [torch.log_softmax(model(input_ids=prompt.view(1, -1), **cache_kwargs(cache)).logits[0, -1:].float(), -1)]
    fed = cont[:-1]
    for start in range(0, fed.numel(), residual):
        chunk = fed[start : start + residual].view(1, -1)
        out.append(torch.log_softmax(model(input_ids=chunk, **cache_kwargs(cache)).logits[0].float(), -1))
    return torch.cat(out), quanto_bytes(cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a folder written by `vase fidelity` (its sources and configuration)")
    ap.add_argument("--nbits", default="4,2", help="comma-separated: quanto takes 2 and 4")
    ap.add_argument("--group", type=int, default=32, help="q_group_size (channels per group)")
    args = ap.parse_args()
    cfg = json.loads((args.run / "config.json").read_text())
    sources = read_records(args.run / "sources.jsonl")[: cfg["prompts"]]
    lm = load_model(cfg["model"], dtype=cfg["dtype"], attn=cfg["attn"])
    path = args.run / "hf_quantized.jsonl"
    done = {(r["source"], r["policy"]) for r in read_records(path)}
    elem = next(lm.model.parameters()).element_size()
    text = lm.model.config.get_text_config(decoder=True)
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * elem
    with path.open("a", encoding="utf-8") as fh:
        for s in sources:
            prompt, cont = torch.tensor(s["prompt"]), torch.tensor(s["continuation"])
            ref = None
            for nbits in (int(x) for x in args.nbits.split(",")):
                policy = f"hf-quanto:{nbits}"
                if (s["id"], policy) in done:
                    continue
                if ref is None:
                    ref = replay(lm.model, prompt, cont, "full", len(prompt) + len(cont), cfg["buffer"], cfg["seed"])
                pol, held = hf_replay(lm.model, prompt, cont, nbits, args.group, cfg["buffer"])
                length = prompt.numel() + cont.numel()
                full = (length - 1) * per_token  # the last continuation token is never fed
                rec = {
                    "source": s["id"],
                    "policy": policy,
                    "budget": length,
                    "ratio": None,
                    "compression": full / held,
                    "prompt_tokens": prompt.numel(),
                    "tokens": cont.numel(),
                    **compare(ref, pol, cont, cfg["bucket"]),
                    "kv_bits": nbits,
                    "bytes_held": held,
                    "bytes_full": full,
                    "memory_compression": full / held,
                }
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
                print(f"{s['id']} {policy}: KL {rec['kl_mean']:.4f}, {rec['memory_compression']:.2f}x", flush=True)


if __name__ == "__main__":
    main()

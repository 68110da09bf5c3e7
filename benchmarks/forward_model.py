"""A model whose forward pass dominates a decode step: Qwen3-0.6B's layers, the embedded model's vocabulary.

The embedded SmolLM2-135M spends about 30% of a large batch's decode step in vLLM's sampler (top-p sorts its
49,152-token vocabulary per request), a cost both engines pay per token, which caps any throughput ratio near 2x and
says little about the reasoning models vase is for. This script writes a model with a real reasoning model's layers
(Qwen3-0.6B: 28 layers, hidden size 1,024, 16 query and 8 KV heads of dim 128, MLP 3,072, q/k norms) and the
embedded model's tokenizer and vocabulary (a 151K-token vocabulary would make the sampler's share larger, not
smaller), random weights (seeded; the outputs are meaningless, so benchmarks force their length with ``ignore_eos``),
saved in bfloat16 as a folder vLLM loads::

    .venv/bin/python benchmarks/forward_model.py --out build/vllm/qwen3-0.6b-shape
    .venv-vllm/bin/python benchmarks/vllm_step_split.py --model build/vllm/qwen3-0.6b-shape --requests 8 --steps 200

About 1 GB; a few seconds to write.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {  # Qwen3-0.6B's config.json (the layers; the vocabulary is the embedded model's)
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "vllm" / "qwen3-0.6b-shape")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "build" / "vllm" / "smollm2",
                    help="a folder with the tokenizer to use (make vllm writes the embedded model's)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").is_file():
        raise SystemExit(
            f"error: no tokenizer in {args.tokenizer}: run `make vllm` first (it converts the embedded model)"
        )
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = Qwen3Config(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SHAPE,
    )
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    cfg = json.loads((args.out / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    params = sum(p.numel() for p in model.parameters())
    print(f"[bench] written {args.out}: {params / 1e6:.0f}M parameters, vocabulary {len(tok)}")
    return args.out


if __name__ == "__main__":
    main()

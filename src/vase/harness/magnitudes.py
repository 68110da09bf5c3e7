"""``vase inspect``: value and key magnitudes per layer and KV head.

VaSE (arXiv 2606.03928, Sec. 3.1) protects the cached entries whose values have abnormally large magnitude. This
module measures whether a model has such entries: for every (layer, KV head) it computes, per token, the value range
(max - min over head_dim) and L2 norm, and the key L2 norm, then reports max / median ratios, the tokens holding
the largest values, and a heat-map of value range over (layer, head) x token position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..hf.compat import cache_kwargs


@torch.inference_mode()
def collect_kv(
    lm, text: str, generate_tokens: int = 0
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Token ids, and per full-attention layer the keys and values ``[kv_heads, T, head_dim]`` (float32, post-RoPE
    keys) of ``text`` through the chat template, optionally followed by ``generate_tokens`` greedy tokens (full
    cache), with those layers' indices in the model. A hybrid model's sliding-window and linear-attention layers,
    which vase does not evict (:mod:`vase.hf.hybrid`), are left out."""
    from transformers import DynamicCache

    from ..hf.hybrid import plan_layers
    from .generation import encode_prompts

    enc = encode_prompts(lm.tokenizer, [text]).to(lm.device)
    ids = enc["input_ids"]
    if generate_tokens > 0:
        ids = lm.model.generate(
            **enc, max_new_tokens=generate_tokens, do_sample=False, **cache_kwargs(DynamicCache(config=lm.model.config))
        )
    cache = DynamicCache(config=lm.model.config)
    lm.model(input_ids=ids, **cache_kwargs(cache))
    layers = [p.index for p in plan_layers(lm.model.config.get_text_config(decoder=True)) if p.evicts]
    keys = [cache.layers[i].keys[0].float().cpu() for i in layers]
    values = [cache.layers[i].values[0].float().cpu() for i in layers]
    return ids[0].tolist(), keys, values, layers


def magnitude_table(
    keys: list[torch.Tensor], values: list[torch.Tensor], top: int = 5, layers: list[int] | None = None
) -> list[dict]:
    """One row per (layer, KV head): max/median of value range, value L2 and key L2, and the positions of the
    ``top`` largest value ranges. ``layers``: the model's index of each entry (default 0, 1, ...)."""
    rows = []
    for layer, k, v in zip(layers if layers is not None else range(len(keys)), keys, values):
        v_range = v.amax(-1) - v.amin(-1)  # [H, T]
        v_l2, k_l2 = v.norm(dim=-1), k.norm(dim=-1)
        for h in range(v.shape[0]):

            def ratio(x, h=h):
                return (x[h].max() / x[h].median().clamp_min(1e-12)).item()

            order = torch.argsort(v_range[h], descending=True)[:top]
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "v_range_max_over_median": ratio(v_range),
                    "v_l2_max_over_median": ratio(v_l2),
                    "k_l2_max_over_median": ratio(k_l2),
                    "top_positions": order.tolist(),
                    "top_ranges": v_range[h, order].tolist(),
                    "median_range": v_range[h].median().item(),
                }
            )
    return rows


def heatmap(values: list[torch.Tensor], path: Path, title: str) -> None:
    """PNG: value range / per-row median, rows = (layer, head), columns = token positions, log colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    rows = []
    for v in values:
        r = v.amax(-1) - v.amin(-1)
        rows.append(r / r.median(-1, keepdim=True).values.clamp_min(1e-12))
    grid = torch.cat(rows).numpy()
    heads = values[0].shape[0]
    fig, ax = plt.subplots(figsize=(12, max(4, 0.12 * grid.shape[0])))
    im = ax.imshow(
        grid, aspect="auto", interpolation="nearest", cmap="magma", norm=LogNorm(vmin=0.1, vmax=max(grid.max(), 1.1))
    )
    ax.set_xlabel("token position")
    ax.set_ylabel(f"layer (x {heads} KV heads)")
    ticks = list(range(0, grid.shape[0], heads * max(1, len(values) // 10)))
    ax.set_yticks(ticks, [str(t // heads) for t in ticks])
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="value range / median of its (layer, head)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def inspect_model(lm, text: str, out: Path, generate_tokens: int = 0, top: int = 5) -> str:
    """Measure, write ``magnitudes.json`` and ``value_range_heatmap.png`` into ``out``; return a text report."""
    out.mkdir(parents=True, exist_ok=True)
    ids, keys, values, layer_ids = collect_kv(lm, text, generate_tokens)
    rows = magnitude_table(keys, values, top, layer_ids)
    (out / "magnitudes.json").write_text(json.dumps({"model": lm.name, "tokens": len(ids), "rows": rows}, indent=1))
    heatmap(values, out / "value_range_heatmap.png", f"{lm.name}: value range per token ({len(ids)} tokens)")
    tok = lm.tokenizer

    def show(pos):
        return f"{pos}:{tok.decode([ids[pos]])!r}"

    lines = [
        f"{lm.name}, {len(ids)} tokens; max/median per layer (worst KV head)",
        f"{'layer':>5} {'V range':>8} {'V L2':>7} {'K L2':>7}  largest value ranges (position:token)",
    ]
    for layer in layer_ids:
        lr = [r for r in rows if r["layer"] == layer]
        worst = max(lr, key=lambda r: r["v_range_max_over_median"])
        lines.append(
            f"{layer:>5} {worst['v_range_max_over_median']:>8.2f} {max(r['v_l2_max_over_median'] for r in lr):>7.2f} "
            f"{max(r['k_l2_max_over_median'] for r in lr):>7.2f}  "
            + ", ".join(show(p) for p in worst["top_positions"][:top])
        )
    best = max(rows, key=lambda r: r["v_range_max_over_median"])
    lines.append(
        f"largest value outlier: layer {best['layer']} head {best['head']}, token {show(best['top_positions'][0])}, "
        f"range {best['v_range_max_over_median']:.1f}x the median; files in {out}/"
    )
    return "\n".join(lines)

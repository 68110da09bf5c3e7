"""``vase train-scorer``: fit the learned retention score (:mod:`vase.core.learned`) on a model's own traces.

The sources are a ``vase fidelity`` run's (its prompts and continuations: the model's own reasoning traces or text
windows). For each source the full cache is run once in eager attention (attention weights GQA-averaged per KV head,
post-RoPE keys, values). At checkpoints every ``stride`` tokens (``t`` from ``window + buffer`` to the end less
``k``), every candidate entry (past the sinks, older than the recent window) gives one sample per (layer, KV head):
its features as an eviction at ``t`` would compute them over the full history
(:func:`vase.core.learned.entry_features`), and the target ``log(mean attention of the next k queries + 1e-6)``. At
most ``samples`` candidates per checkpoint are drawn (seeded), then one ridge regression per (layer, KV head)
(:func:`vase.core.learned.fit_ridge`, deterministic) on all but a held-out fifth of the samples, whose R^2 is
reported. The same seed and sources give the same file.

The features at a real eviction are computed over the entries still held, not the full history (attention
renormalised over fewer entries, the mean key of the kept ones): the regression is fitted where the histories are
whole, the usual shortcut of trained retention scorers.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from ..core.learned import EPS, FEATURES, LearnedWeights, entry_features, fit_ridge


class TrainConfig(BaseModel):
    """What decides a learned scorer's weights (recorded in the file's ``info``)."""

    sources: str  # a `vase fidelity` results folder
    model: str = "smollm2"
    dtype: str = "auto"
    prompts: int | None = None
    window: int = Field(64, ge=1)
    k: int = Field(64, ge=1)
    stride: int = Field(64, ge=1)
    samples: int = Field(256, ge=1)
    sinks: int = Field(4, ge=0)
    buffer: int = Field(64, ge=1)
    ridge: float = Field(1e-2, ge=0.0)
    seed: int = 0


@torch.inference_mode()
def full_entries(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full cache over ``ids`` ``[N]`` with an eager-attention model: attention weights ``[L, kv_heads, N, N]``
    (float32, each GQA group's query heads averaged), post-RoPE keys and values ``[L, kv_heads, N, head_dim]``."""
    from transformers import DynamicCache

    from ..hf.compat import cache_kwargs

    cache = DynamicCache()
    out = model(input_ids=ids.view(1, -1), output_attentions=True, **cache_kwargs(cache))
    kv = cache.layers[0].keys.shape[1]
    attn = torch.stack([a[0].float().unflatten(0, (kv, -1)).mean(1) for a in out.attentions])
    keys = torch.stack([layer.keys[0].float() for layer in cache.layers])
    values = torch.stack([layer.values[0].float() for layer in cache.layers])
    return attn, keys, values


def source_samples(
    attn: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    config: TrainConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one source (see the module docstring).

    Args:
        attn: ``[L, H, N, N]`` attention (row: query, column: key); keys, values: ``[L, H, N, D]``.

    Returns:
        ``(features [L, H, n, F], targets [L, H, n])`` float32 (``n`` may be 0 for a short source).
    """
    n_layers, h, n, _ = keys.shape
    feats, targets = [], []
    for t in range(config.window + config.buffer, n - config.k + 1, config.stride):
        cand = torch.arange(config.sinks, t - config.buffer)
        if not len(cand):
            continue
        q = torch.arange(t - config.window, t)
        seen = (q.view(-1, 1) >= torch.arange(t).view(1, -1)).sum(0).clamp_min(1)  # window queries that see each key
        window_att = attn[:, :, t - config.window : t, :t].sum(2) / seen  # [L, H, t]
        positions = torch.arange(t).view(1, 1, t).expand(n_layers, h, t)
        valid = torch.ones(n_layers, t, dtype=torch.bool)
        latest = torch.full((n_layers,), t - 1, dtype=torch.long)
        f = entry_features(keys[:, :, :t], values[:, :, :t], positions, valid, window_att, latest)
        future = attn[:, :, t : t + config.k, :t].mean(2)  # [L, H, t]
        pick = cand[torch.randperm(len(cand), generator=generator)[: config.samples]]
        feats.append(f[:, :, pick])
        targets.append(torch.log(future[:, :, pick] + EPS))
    if not feats:
        return torch.zeros(n_layers, h, 0, len(FEATURES)), torch.zeros(n_layers, h, 0)
    return torch.cat(feats, 2), torch.cat(targets, 2)


def fit(features: torch.Tensor, targets: torch.Tensor, config: TrainConfig, generator: torch.Generator) -> dict:
    """One ridge regression per (layer, KV head) on a seeded four fifths of the samples; R^2 on the rest.

    Args:
        features: ``[L, H, n, F]``; targets: ``[L, H, n]``.

    Returns:
        ``{"mean", "std", "weight": [L, H, F], "bias": [L, H], "r2": [L, H] held-out R^2, "samples": n}``.

    Raises:
        ValueError: fewer than 10 samples (sources too short for ``window + buffer + k`` tokens).
    """
    n_layers, h, n, f = features.shape
    if n < 10:
        raise ValueError(
            f"only {n} training samples: the sources need more than window + buffer + k = "
            f"{config.window + config.buffer + config.k} tokens each, or give more sources"
        )
    order = torch.randperm(n, generator=generator)
    test, train = order[: n // 5], order[n // 5 :]
    out = {name: torch.zeros(n_layers, h, f) for name in ("mean", "std", "weight")}
    out["bias"], out["r2"] = torch.zeros(n_layers, h), torch.zeros(n_layers, h)
    for li in range(n_layers):
        for hi in range(h):
            x, y = features[li, hi], targets[li, hi]
            mean, std, w, b = fit_ridge(x[train], y[train], config.ridge)
            out["mean"][li, hi], out["std"][li, hi], out["weight"][li, hi], out["bias"][li, hi] = mean, std, w, b
            pred = ((x[test] - mean) / std) @ w + b
            resid = ((y[test] - pred) ** 2).sum()
            total = ((y[test] - y[test].mean()) ** 2).sum().clamp_min(1e-12)
            out["r2"][li, hi] = 1.0 - resid / total
    out["samples"] = n
    return out


def train_scorer(config: TrainConfig, out: Path, lm=None, progress: bool = True, device: str = "auto") -> Path:
    """Train the learned scorer on ``config.sources`` and write the weights file ``out``; returns its path.

    ``lm``: the model loaded in eager attention (default: loaded from ``config``).

    Raises:
        ValueError: a folder without sources, sources too short to give samples.
    """
    from tqdm.auto import tqdm

    from ..hf.hybrid import plan_layers
    from ..hf.models import load_model
    from .mechanism import read_sources

    sources = read_sources(Path(config.sources), config.prompts)
    lm = lm or load_model(config.model, dtype=config.dtype, device=device, attn="eager")
    model = lm.model if hasattr(lm, "model") else lm
    plan = plan_layers(model.config.get_text_config(decoder=True))
    evicting = [p.index for p in plan if p.evicts]
    generator = torch.Generator().manual_seed(config.seed)
    feats, targets = [], []
    start = time.perf_counter()
    for source in tqdm(sources, desc="train-scorer: traces", disable=not progress):
        ids = torch.cat([torch.tensor(source["prompt"]), torch.tensor(source["continuation"])[:-1]])
        attn, keys, values = full_entries(model, ids.to(next(model.parameters()).device))
        f, t = source_samples(attn[evicting].cpu(), keys[evicting].cpu(), values[evicting].cpu(), config, generator)
        feats.append(f)
        targets.append(t)
    fitted = fit(torch.cat(feats, 2), torch.cat(targets, 2), config, generator)
    first = plan[evicting[0]]
    weights = LearnedWeights(
        layer_ids=evicting,
        kv_heads=first.kv_heads,
        head_dim=first.head_dim,
        mean=fitted["mean"],
        std=fitted["std"],
        weight=fitted["weight"],
        bias=fitted["bias"],
        model=config.model,
        window=config.window,
        info={
            "config": config.model_dump(),
            "sources": len(sources),
            "samples_per_head": fitted["samples"],
            "held_out_r2_mean": float(fitted["r2"].mean()),
            "held_out_r2_per_layer": [round(float(x), 4) for x in fitted["r2"].mean(1)],
            "seconds": round(time.perf_counter() - start, 1),
        },
    )
    return weights.save(out)

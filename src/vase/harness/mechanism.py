"""``vase analyze``: why sampled eviction is closer to the full cache than top-k, measured on a fidelity run's
sources (the quantities of :mod:`vase.harness.analysis`).

For each source, the full cache is run once in eager attention (its attention weights, GQA-averaged per KV head,
and its post-RoPE keys) and once teacher-forced like every policy (its next-token log-probabilities). Each policy
and compression ratio is then replayed teacher-forced (:func:`vase.harness.fidelity.replay`, chunks ending where
decoding evicts) for each seed (one run for a deterministic top-k policy), and after each eviction the positions every
(layer, KV head) holds are read from the cache. One record per (source, policy, ratio), in ``analysis.jsonl``,
appended as it is made (a run resumes):

- ``kl``: KL(full ‖ run) of each seed; ``kl_mixture``: of the mixture of the seeds' next-token distributions;
- ``recall``: for k in ``ks``, the share of the full cache's attention mass of the next k queries that falls on the
  entries held after an eviction (over the positions that existed then);
- ``survived_p90`` (the 90th percentile of the evictions a position survives once it takes part), ``dropped_first``
  (share of positions evicted at the first eviction they take part in), ``held_at_end``, ``age`` (mean age of the
  held entries, tokens);
- ``overlap``: the share of the entries chosen at one eviction (older than the recent window) still held after the
  next; ``settled``: the share of (layer, KV head) whose kept set stops changing (overlap >= 0.99 from some eviction
  on);
- ``cosine_distance`` / ``logdet``: diversity of the held keys (the full cache's keys at the held positions).

Seeds, layers and KV heads are averaged; the report averages over sources with standard errors.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from pydantic import Field, field_validator

from ..core.config import VaseConfig
from .analysis import ensemble_kl, hold_stats, key_diversity
from .evaluate import RunConfig, append_records, check_same_config, prepare_dir, read_records

RECORDS = "analysis.jsonl"
DEFAULT_POLICIES = ["snapkv", "snapkv:selector=sample", "vase:selector=topk", "vase", "random", "random:prompt=dense"]


class AnalyzeConfig(RunConfig):
    """What decides the results of ``vase analyze``: the sources (a fidelity run's folder), policies, ratios, seeds."""

    sources: str  # a `vase fidelity` results folder: its sources.jsonl and model
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES))
    ratios: list[float] = Field(default_factory=lambda: [4.0, 8.0, 16.0])
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2, 3])
    prompts: int | None = None
    ks: list[int] = Field(default_factory=lambda: [1, 16, 64, 256])

    @field_validator("ks", "seeds")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("give at least one value")
        return v

    @field_validator("ks")
    @classmethod
    def _positive(cls, v):
        if any(k < 1 for k in v):
            raise ValueError(f"every k must be >= 1, got {v}")
        return v


def is_sampled(policy: str) -> bool:
    """Whether a policy's selection draws (seeds give different runs) rather than taking the top-k."""
    from ..core.policies import make_policy
    from ..core.selection import TopK

    return not isinstance(make_policy(policy).selector, TopK)


def read_sources(folder: Path, prompts: int | None) -> list[dict]:
    """The sources of a `vase fidelity` results folder (the first ``prompts``).

    Raises:
        ValueError: if the folder has no sources (not a fidelity run, or one that made none yet).
    """
    from .traces import SOURCES_FILE

    sources = read_records(folder / SOURCES_FILE)
    if not sources:
        raise ValueError(
            f"{folder} holds no {SOURCES_FILE}: give the folder of a `vase fidelity` run (it keeps its sources there)"
        )
    return sources[:prompts]


@torch.inference_mode()
def full_reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full cache's attention and keys over ``ids`` ``[N]`` with an eager-attention model: attention weights
    ``[L, kv_heads, N, N]`` (float32, the query heads of each GQA group averaged) and post-RoPE keys
    ``[L, kv_heads, N, head_dim]``."""
    from transformers import DynamicCache

    from ..hf.compat import cache_kwargs

    cache = DynamicCache()
    out = model(input_ids=ids.view(1, -1), output_attentions=True, **cache_kwargs(cache))
    kv = cache.layers[0].keys.shape[1]
    attn = torch.stack([a[0].float().unflatten(0, (kv, -1)).mean(1) for a in out.attentions])
    keys = torch.stack([layer.keys[0].float() for layer in cache.layers])
    return attn, keys


def held_masks(cache, seen: int, row: int = 0) -> torch.Tensor:
    """bool ``[L, kv_heads, seen]``: the positions each evicting layer's KV head holds in batch row ``row``, whose
    ``seen`` tokens they are drawn from."""
    rows = []
    for layer in cache.layers:
        pos = getattr(layer, "positions", None)
        if pos is None:
            continue
        p = pos[row]
        m = torch.zeros(p.shape[0], seen + 1, dtype=torch.bool)
        m.scatter_(1, torch.where(p >= 0, p, seen).long().cpu(), True)
        rows.append(m[:, :seen])
    return torch.stack(rows)


def run_metrics(snaps: list[tuple[int, torch.Tensor]], attn, keys, ks, sinks: int, recent: int) -> dict:
    """The quantities of one replay from its snapshots ``[(seen, held [L, H, seen])]`` taken after each eviction."""
    L, H = snaps[0][1].shape[:2]
    recall = {k: [] for k in ks}
    overlaps, diversity = [], []
    for i, (n, held) in enumerate(snaps):
        for k in ks:
            rows = attn[:, :, n : n + k, :n]
            if rows.shape[2]:
                mass = rows.sum(-1).clamp_min(1e-30)
                recall[k].append(((rows * held[:, :, None, :]).sum(-1) / mass).mean().item())
        if i + 1 < len(snaps):
            chosen = held.clone()
            chosen[:, :, :sinks] = False
            chosen[:, :, max(n - recent, 0) :] = False  # the recent window is kept by rule, not chosen
            after = snaps[i + 1][1][:, :, :n]
            kept = chosen.sum(-1)
            overlaps.append(torch.where(kept > 0, (chosen & after).sum(-1) / kept.clamp_min(1), math.nan))
        if i % 4 == 0 or i == len(snaps) - 1:
            d = [key_diversity(keys[layer, h, :n][held[layer, h]]) for layer in range(L) for h in range(H)]
            diversity.append([(x["cosine_distance"], x["logdet"]) for x in d])
    holds = [
        hold_stats([s[1][layer, h] for s in snaps], first=sinks, recent=recent) for layer in range(L) for h in range(H)
    ]
    over = torch.stack(overlaps) if overlaps else torch.full((1, L, H), math.nan)  # [E-1, L, H]
    settled = [
        _settles(over[:, layer, h].tolist()) for layer in range(L) for h in range(H)
    ]  # a head whose chosen set stops changing
    # the mean is fixed by the budget (each eviction holds the same number): the tail says who is never let go
    survived = [float(h["survived"][sinks:].float().quantile(0.9)) for h in holds]
    div = torch.tensor(diversity).mean((0, 1))
    return {
        "recall": {str(k): _mean(v) for k, v in recall.items()},
        "survived_p90": _mean(survived),
        "dropped_first": _mean([h["dropped_first"] for h in holds]),
        "held_at_end": _mean([h["held_at_end"] for h in holds]),
        "age": _mean([a for h in holds for a in h["age"] if a == a]),
        "overlap": float(over.nanmean()),
        "settled": _mean(settled),
        "cosine_distance": float(div[0]),
        "logdet": float(div[1]),
        "evictions": len(snaps),
    }


def _settles(overlaps: list[float]) -> float:
    from .analysis import settled_at

    clean = [o for o in overlaps if o == o]
    at = settled_at(clean)
    return float(len(clean) > 1 and at is not None and at < len(clean) - 1)


def _mean(values) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else math.nan


def run_analysis(
    config: AnalyzeConfig, out: Path, device: str = "auto", progress: bool = True, lm=None, eager=None
) -> Path:
    """Run (or resume) ``vase analyze`` into ``out/analysis.jsonl``; returns its path.

    ``lm``: the loaded model (default: loaded from ``config``); ``eager``: the same weights in eager attention, for
    the full cache's attention weights (default: loaded again with ``attn='eager'``).

    Raises:
        ValueError: a folder without sources, another configuration in ``out``, an unknown policy, a ratio <= 1.
    """
    from tqdm.auto import tqdm

    from ..hf.models import load_model
    from .fidelity import FidelityConfig, replay, replay_budget

    sources = read_sources(Path(config.sources), config.prompts)
    fid = FidelityConfig.model_validate_json((Path(config.sources) / "config.json").read_text())
    for r in config.ratios:
        if not r > 1:
            raise ValueError(f"compression ratio must be > 1, got {r}")
    ident = config.model_copy(update={"prompts": None})  # more sources later extend a run: not its identity
    check_same_config(out, ident)
    lm = lm or load_model(config.model, dtype=config.dtype, device=device, attn=config.attn)
    eager = eager or load_model(config.model, dtype=config.dtype, device=device, attn="eager")
    prepare_dir(out, ident)
    path = out / RECORDS
    done = {(r["source"], r["policy"], r["ratio"]) for r in read_records(path)}
    grid = [(s, p, r) for s in sources for p in config.policies for r in config.ratios]
    todo = [g for g in grid if (g[0]["id"], g[1], g[2]) not in done]
    bar = tqdm(total=len(grid), initial=len(grid) - len(todo), desc=f"analyze {out.name}", disable=not progress)
    sinks = VaseConfig.resolve(config.policies[0], budget=10_000, buffer=config.buffer).sinks
    reference = None
    with path.open("a", encoding="utf-8") as fh:
        for source, policy, ratio in todo:
            prompt, cont = torch.tensor(source["prompt"]), torch.tensor(source["continuation"])
            if reference is None or reference[0] != source["id"]:
                ids = torch.cat([prompt, cont[:-1]]).to(lm.device)
                attn, keys = full_reference(eager.model, ids)
                full = replay(lm.model, prompt, cont, "full", budget=len(ids) + 1, buffer=config.buffer)
                reference = (source["id"], attn.cpu(), keys.cpu(), full)
            _, attn, keys, full = reference
            budget = replay_budget(fid, source, "ratio", ratio)
            cfg = VaseConfig.resolve(policy, budget=budget, buffer=config.buffer)
            start = time.perf_counter()
            runs, metrics = [], []
            for seed in config.seeds if is_sampled(policy) else config.seeds[:1]:
                snaps: list = []

                def snap(cache, seen, snaps=snaps):
                    held = held_masks(cache, seen)
                    if held.numel() and int(held.sum(-1).max()) < seen:  # evicting (or compressed) by now
                        snaps.append((seen, held))

                runs.append(replay(lm.model, prompt, cont, config=cfg, seed=seed, on_chunk=snap))
                metrics.append(run_metrics(snaps, attn, keys, config.ks, sinks, config.buffer) if snaps else None)
            ens = ensemble_kl(full, torch.stack(runs))
            got = [m for m in metrics if m is not None]
            rec = {
                "source": source["id"],
                "policy": policy,
                "ratio": ratio,
                "budget": budget,
                "seeds": len(runs),
                "kl": ens["runs"],
                "kl_mean": ens["mean_run"],
                "kl_mixture": ens["mixture"],
                **_average(got),
                "seconds": round(time.perf_counter() - start, 2),
            }
            append_records(fh, [rec])
            bar.update(1)
    bar.close()
    return path


def _average(metrics: list[dict]) -> dict:
    """The mean over seeds of each quantity (recall per k); NaN where no run evicted."""
    if not metrics:
        return {}
    out = {k: _mean([m[k] for m in metrics]) for k in metrics[0] if k != "recall"}
    out["recall"] = {k: _mean([m["recall"][k] for m in metrics]) for k in metrics[0]["recall"]}
    return out

"""``vase analyze``: the mechanism of sampled eviction, measured on a fidelity run's sources."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .common import DeviceOpt, friendly, parse_csv, parse_policies, set_threads


@friendly
def analyze(
    sources: Path = typer.Argument(..., help="a `vase fidelity` results folder: its sources and its model are used"),
    out: Path = typer.Option(..., "--out", "-o", help="results directory (resumes if it exists)"),
    policies: str = typer.Option(
        "snapkv,snapkv:selector=sample,vase:selector=topk,vase,random,random:prompt=dense",
        help="comma-separated: top-k and sampled variants side by side",
    ),
    ratios: str = typer.Option("4,8,16", help="comma-separated compression ratios"),
    seeds: str = typer.Option("0,1,2,3", help="seeds of the sampled policies (a top-k policy runs once)"),
    prompts: int | None = typer.Option(None, help="the first N sources of the folder (default: all)"),
    ks: str = typer.Option("1,16,64,256", "--ks", help="future-attention recall over the next k queries"),
    buffer: int | None = typer.Option(None, help="recent window / eviction interval (default: the fidelity run's)"),
    device: str = DeviceOpt,
):
    """Why sampling beats top-k: ensemble KL, starvation and coverage, future-attention recall, key diversity and
    kept-set overlap, per policy and ratio (see docs/RESULTS.md)."""
    from ..harness.mechanism import AnalyzeConfig, read_sources, run_analysis

    config_file = sources / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{sources} is not a `vase fidelity` results folder (no config.json)")
    fid = json.loads(config_file.read_text())
    if prompts is not None and prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {prompts}")
    read_sources(sources, prompts)
    set_threads()
    config = AnalyzeConfig(
        model=fid.get("model", "smollm2"),
        dtype=fid.get("dtype", "auto"),
        attn=fid.get("attn", "sdpa"),
        buffer=buffer or fid.get("buffer", 64),
        sources=str(sources),
        policies=parse_policies(policies),
        ratios=parse_csv(ratios, float),
        seeds=parse_csv(seeds, int),
        prompts=prompts,
        ks=parse_csv(ks, int),
    )
    path = run_analysis(config, out, device=device)
    typer.echo(f"[vase] records in {path}; tables and plots: vase report {out}")


@friendly
def train_scorer(
    sources: Path = typer.Argument(..., help="a `vase fidelity` results folder: its sources and its model are used"),
    out: Path = typer.Option(..., "--out", "-o", help="the weights file to write (.pt)"),
    prompts: int | None = typer.Option(None, help="the first N sources of the folder (default: all)"),
    window: int = typer.Option(64, help="queries of the window-attention features (use window=N with the policy)"),
    k: int = typer.Option(64, "-k", help="the target: attention of the next k queries"),
    stride: int = typer.Option(64, help="tokens between two training checkpoints of a source"),
    samples: int = typer.Option(256, help="candidate entries drawn per checkpoint"),
    ridge: float = typer.Option(1e-2, help="L2 penalty of the regression (on standardised features)"),
    seed: int = typer.Option(0, help="seeds the draws and the held-out split: the same seed gives the same file"),
    device: str = DeviceOpt,
):
    """Fit the learned retention score (policy `learned:weights=FILE`) on a fidelity run's traces: one ridge
    regression per (layer, KV head) from eight features of each entry to the attention of the next k queries."""
    from ..harness.learned import TrainConfig
    from ..harness.learned import train_scorer as train
    from ..harness.mechanism import read_sources

    config_file = sources / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{sources} is not a `vase fidelity` results folder (no config.json)")
    if prompts is not None and prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {prompts}")
    if out.exists() and out.is_dir():
        raise ValueError(f"--out {out} is a folder: give the path of the weights file to write, e.g. {out}/scorer.pt")
    fid = json.loads(config_file.read_text())
    read_sources(sources, prompts)
    set_threads()
    config = TrainConfig(
        sources=str(sources),
        model=fid.get("model", "smollm2"),
        dtype=fid.get("dtype", "auto"),
        prompts=prompts,
        window=window,
        k=k,
        stride=stride,
        samples=samples,
        buffer=fid.get("buffer", 64),
        ridge=ridge,
        seed=seed,
    )
    path = train(config, out, device=device)
    from ..core.learned import LearnedWeights

    info = LearnedWeights.load(path).info
    typer.echo(
        f"[vase] weights in {path}: {info['samples_per_head']} samples per (layer, KV head) from {info['sources']} "
        f"sources, held-out R^2 {info['held_out_r2_mean']:.3f} ({info['seconds']} s); use "
        f"--policies learned:weights={path}"
    )

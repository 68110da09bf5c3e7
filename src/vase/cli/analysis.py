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

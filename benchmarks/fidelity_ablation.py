"""Paired comparison of fidelity runs: each policy spec against a baseline spec, per (run, budget).

Usage::

    python benchmarks/fidelity_ablation.py runs/abl-gsm8k runs/abl-text --baseline vase:preset=paper

For every policy and budget: mean KL(full || policy) over the sources, and the paired difference to the baseline
(mean over the same sources, +- its standard error), so that a deviation from the published method can be called
better or worse against the spread between sources. Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(run: Path) -> dict[tuple[str, int], dict[str, float]]:
    """(policy, budget) -> {source: kl_mean} from ``run/fidelity.jsonl``."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for line in (run / "fidelity.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault((r["policy"], r["budget"]), {})[r["source"]] = r["kl_mean"]
    return out


def table(run: Path, baseline: str) -> list[str]:
    data = load(run)
    budgets = sorted({b for _, b in data}, reverse=True)
    policies = sorted({p for p, _ in data}, key=lambda p: (p != baseline, p))
    comp = {}
    for line in (run / "fidelity.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            comp.setdefault(r["budget"], []).append(r["compression"])
    head = " | ".join(f"budget {b} (~{statistics.mean(comp[b]):.1f}x): KL, diff to baseline" for b in budgets)
    lines = [f"`{run}` (baseline `{baseline}`)", "", f"| policy | {head} |", "|---|" + "---|" * len(budgets)]
    for p in policies:
        cells = []
        for b in budgets:
            mine, base = data.get((p, b), {}), data.get((baseline, b), {})
            common = sorted(set(mine) & set(base))
            if not mine:
                cells.append("-")
                continue
            mean = statistics.mean(mine.values())
            if p == baseline or len(common) < 2:
                cells.append(f"{mean:.4f} (n={len(mine)})")
                continue
            d = [mine[s] - base[s] for s in common]
            se = statistics.stdev(d) / len(d) ** 0.5
            cells.append(f"{mean:.4f}, {statistics.mean(d):+.4f} ± {se:.4f} (n={len(d)})")
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    return lines


def planted_table(run: Path) -> list[str]:
    """Mean KL and share of planted value outliers still held at the end, per policy and budget."""
    recs = [json.loads(x) for x in (run / "fidelity.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "planted_kept" in r]
    if not recs:
        return []
    budgets = sorted({r["budget"] for r in recs}, reverse=True)
    policies = sorted({r["policy"] for r in recs})
    head = " | ".join(f"budget {b}: KL | held (%)" for b in budgets)
    lines = [f"`{run}`: planted value outliers", "", f"| policy | {head} |", "|---|" + "---|---|" * len(budgets)]
    for p in policies:
        cells = []
        for b in budgets:
            rs = [r for r in recs if r["policy"] == p and r["budget"] == b]
            if not rs:
                cells += ["-", "-"]
                continue
            cells.append(f"{statistics.mean(r['kl_mean'] for r in rs):.4f}")
            cells.append(f"{100 * statistics.mean(r['planted_kept'] for r in rs):.1f}")
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--baseline", default="vase:preset=paper")
    args = ap.parse_args()
    for run in args.runs:
        print("\n".join(table(run, args.baseline)) + "\n")
        planted = planted_table(run)
        if planted:
            print("\n".join(planted) + "\n")


if __name__ == "__main__":
    main()

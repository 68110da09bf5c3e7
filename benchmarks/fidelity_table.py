"""Fidelity tables by compression ratio, merged over several run folders of the same sources, with a goal check: is a
candidate at or below the best baseline's mean KL at every ratio, on every source?

Usage::

    python benchmarks/fidelity_table.py gsm8k=runs/f11-gsm8k-base,runs/f11-gsm8k-new \\
        text=runs/f11-text-base,runs/f11-text-new --baselines snapkv,h2o,tova,rkv,streaming_llm,curdkv,keydiff,knorm

Each argument is ``label=dir[,dir...]``: folders written by ``vase fidelity --ratios ...`` on the same sources (copy
``sources.jsonl`` into a new folder to add policies to an earlier sweep). Per label and ratio it prints the mean
KL(full || policy) over sources and top-1 agreement; then, for each policy that is not a baseline, the paired
difference to the best baseline at that ratio (mean over the same sources +- its standard error), whether its mean
is at or below the best baseline's everywhere, and whether it is everywhere below or less than one standard error
above (a difference the sources cannot tell from zero). Only the sources that every policy and ratio of a label has
are used (an interrupted sweep counts up to its last complete source). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vase.harness.stats import Paired, kl_text
from vase.harness.stats import paired_diff as _paired_values


def load(dirs: list[Path]) -> dict[tuple[str, float], dict[str, dict]]:
    """(policy, ratio) -> {source: record}; records without a ratio are keyed by budget (as a negative number)."""
    out: dict[tuple[str, float], dict[str, dict]] = {}
    for d in dirs:
        path = d / "fidelity.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} not found: give folders written by `vase fidelity`")
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                size = r["ratio"] if r.get("ratio") is not None else -float(r["budget"])
                out.setdefault((r["policy"], size), {})[r["source"]] = r
    return out


def _size(s: float) -> str:
    return f"{s:g}x" if s > 0 else f"budget {int(-s)}"


def paired_diff(mine: dict[str, dict], ref: dict[str, dict]) -> Paired | None:
    """``mine - ref`` KL over the sources both have ({source: record} each): mean, standard error, count, and on how
    many of them ``mine`` is lower (:func:`vase.harness.stats.paired_diff`, the one used by ``vase report``; None below
    2 sources)."""
    return _paired_values({k: r["kl_mean"] for k, r in mine.items()}, {k: r["kl_mean"] for k, r in ref.items()})


def paired(label: str, dirs: list[Path], policy: str, others: list[str]) -> list[str]:
    """Markdown: ``policy`` minus each of ``others``, paired over the sources both have, per ratio."""
    data = load(dirs)
    sizes = sorted({s for _, s in data}, key=lambda s: (s < 0, s))
    lines = [f"`{policy}` minus each policy, paired over the same sources ({label}; negative = `{policy}` closer):", ""]
    lines += ["| minus | " + " | ".join(_size(s) for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for other in others:
        cells = []
        for s in sizes:
            diff = paired_diff(data.get((policy, s), {}), data.get((other, s), {}))
            cells.append(
                "-"
                if diff is None
                else f"{kl_text(diff.mean, True)} ± {kl_text(diff.se)} (lower on {diff.lower} of {diff.n})"
            )
        lines.append(f"| `{other}` | " + " | ".join(cells) + " |")
    return lines


def tables(label: str, dirs: list[Path], baselines: list[str]) -> tuple[list[str], dict]:
    """Markdown lines for one source group, and {policy: {ratio: meets}} for the goal check."""
    data = load(dirs)
    # only the sources every (policy, size) has, so that every mean is over the same sources
    common = set.intersection(*(set(recs) for recs in data.values())) if data else set()
    data = {k: {src: r for src, r in recs.items() if src in common} for k, recs in data.items()}
    sizes = sorted({s for _, s in data}, key=lambda s: (s < 0, s))
    policies = sorted({p for p, _ in data}, key=lambda p: (p not in baselines, p))
    lines = [f"**{label}** ({', '.join(str(d) for d in dirs)}; the {len(common)} sources all runs have)", ""]
    lines += ["| policy | " + " | ".join(f"{_size(s)}: KL, top-1 %" for s in sizes) + " |"]
    lines += ["|---|" + "---|" * len(sizes)]
    best: dict[float, str] = {}
    for s in sizes:
        means = {p: statistics.mean(r["kl_mean"] for r in data[(p, s)].values()) for p in baselines if (p, s) in data}
        if means:
            best[s] = min(means, key=means.get)
    for p in policies:
        cells = []
        for s in sizes:
            recs = data.get((p, s))
            if not recs:
                cells.append("-")
                continue
            kl = statistics.mean(r["kl_mean"] for r in recs.values())
            top1 = 100 * statistics.mean(r["top1"] for r in recs.values())
            mark = " (best baseline)" if best.get(s) == p else ""
            cells.append(f"{kl_text(kl)}, {top1:.1f}{mark}")
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    lines += ["", f"Paired difference to the best baseline at each ratio ({label}; negative = lower KL):", ""]
    head = " | ".join(f"{_size(s)} vs `{best.get(s, '-')}`" for s in sizes)
    lines += [f"| policy | {head} | at or below | below or within 1 s.e. |", "|---|" + "---|" * (len(sizes) + 2)]
    goal: dict[str, dict[float, tuple[bool, bool]]] = {}
    for p in policies:
        if p in baselines:
            continue
        cells, ok = [], {}
        for s in sizes:
            diff = paired_diff(data.get((p, s), {}), data.get((best.get(s), s), {}))
            if diff is None:
                cells.append("-")
                continue
            cells.append(f"{kl_text(diff.mean, True)} ± {kl_text(diff.se)}")
            ok[s] = (diff.mean <= 0, diff.within)
        goal[p] = ok
        full = len(ok) == len(sizes)
        strict = "yes" if full and all(a for a, _ in ok.values()) else "no"
        loose = "yes" if full and all(b for _, b in ok.values()) else "no"
        lines.append(f"| `{p}` | " + " | ".join(cells) + f" | {strict} | {loose} |")
    return lines, goal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("groups", nargs="+", help="label=dir[,dir...]")
    ap.add_argument("--baselines", default="snapkv,h2o,tova,rkv,streaming_llm,curdkv,keydiff,knorm")
    ap.add_argument("--against", default="", help="a policy spec: also print it minus each policy of --minus")
    ap.add_argument("--minus", default="", help="comma-separated policy specs for --against")
    args = ap.parse_args()
    baselines = [b for b in args.baselines.split(",") if b]
    overall: dict[str, list[tuple[bool, bool]]] = {}
    for g in args.groups:
        label, eq, dirs = g.partition("=")
        if not eq:
            raise SystemExit(f"expected label=dir[,dir...], got {g!r}")
        lines, goal = tables(label, [Path(d) for d in dirs.split(",") if d], baselines)
        print("\n".join(lines) + "\n")
        if args.against:
            others = [o for o in args.minus.split(",") if o]
            print("\n".join(paired(label, [Path(d) for d in dirs.split(",") if d], args.against, others)) + "\n")
        for p, ok in goal.items():
            overall.setdefault(p, []).extend(ok.values() if ok else [(False, False)])
    for i, what in enumerate(("At or below", "Below or within one standard error of")):
        meets = sorted(p for p, oks in overall.items() if oks and all(o[i] for o in oks))
        listed = ", ".join(f"`{p}`" for p in meets) or "none"
        print(f"{what} the best baseline at every ratio of every group: {listed}")


if __name__ == "__main__":
    main()

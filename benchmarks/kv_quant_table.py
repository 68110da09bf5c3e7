"""Tables of docs/RESULTS.md "Quantize what is kept, protect what is large": evict-only, quantize-only and
evict + quantize at equal KV bytes, with the goal check.

Usage::

    python benchmarks/kv_quant_table.py gsm8k=runs/kvq-gsm8k text=runs/kvq-text [--ratios 8,16]

Each argument is ``label=dir``: a folder written by ``vase fidelity --byte-ratios ...`` (``benchmarks/kv_quant.sh``),
with ``hf_quantized.jsonl`` from ``benchmarks/hf_quantized_fidelity.py`` when present. Per label it prints the mean
KL(full || policy) over the sources ± its standard error at each byte ratio, grouped as evict-only (no ``kv_bits``),
quantize-only (``full`` with ``kv_bits``, and transformers' ``QuantizedCache``: they keep every token, so their
compression is their own, given once) and evict + quantize, with the budgets and the compression of every byte held
(``memory_compression``, the recent buffer and everything else included). Then, at each ratio of ``--ratios`` and
each label: the best evict-only configuration, the best quantize-only configuration whose own compression reaches
the ratio (none may), and each evict + quantize configuration's paired difference to both (mean over the same sources
± standard error, and on how many sources it is lower); the configurations below both everywhere; finally each
``protect_precision=guard`` configuration against the same without it (paired). ``--summary``: one table of every
label; ``--protect``: only the last table; ``--window``: each ``kv_window`` configuration against the same without
its window (paired). Prints markdown.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

from vase.harness.stats import kl_text, mean_se, paired_diff


@functools.cache
def load(run: Path) -> tuple[dict, dict]:
    """``({(policy, byte ratio): {source: record}}, {policy: {source: record}})``: the byte-ratio records of the run,
    and its records of policies that keep every token (quantize-only: ``full`` with ``kv_bits``, and the
    ``QuantizedCache`` records of ``hf_quantized.jsonl``), whose results do not depend on the ratio; only the sources
    every configuration has (a run stopped part-way is compared on the sources it finished). Read once per run folder
    (cached; the tables only read the dicts)."""
    sized: dict = {}
    whole: dict = {}
    for name in ("fidelity.jsonl", "hf_quantized.jsonl"):
        path = run / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r["policy"] == "full":
                continue
            if r["policy"].startswith(("full:", "hf-")):
                whole.setdefault(r["policy"], {})[r["source"]] = r
            elif r.get("byte_ratio") is not None:
                sized.setdefault((r["policy"], r["byte_ratio"]), {})[r["source"]] = r
    # a run stopped part-way holds some sources for some configurations only: compare on the ones all of them have
    groups = [*sized.values(), *whole.values()]
    common = set.intersection(*(set(recs) for recs in groups)) if groups else set()
    sized = {k: {src: r for src, r in recs.items() if src in common} for k, recs in sized.items()}
    whole = {k: {src: r for src, r in recs.items() if src in common} for k, recs in whole.items()}
    return sized, whole


def _kl(recs: dict) -> tuple[float, float]:
    return mean_se(r["kl_mean"] for r in recs.values())


def _own(recs: dict) -> float:
    """The compression a quantize-only configuration keeps at: its kept bytes (QuantizedCache: every byte held)."""
    key = "kept_compression" if "kept_compression" in next(iter(recs.values())) else "memory_compression"
    return statistics.mean(r[key] for r in recs.values())


def _mem(recs: dict) -> float:
    return statistics.mean(r["memory_compression"] for r in recs.values())


def kind(policy: str) -> str:
    if policy.startswith(("full:", "hf-")):
        return "quantize-only"
    return "evict + quantize" if "kv_bits" in policy else "evict-only"


def tables(label: str, run: Path) -> list[str]:
    sized, whole = load(run)
    ratios = sorted({r for _, r in sized})
    n = len({s for recs in sized.values() for s in recs})
    lines = [
        f"**{label}** (`{run}`, {n} sources): mean KL(full ‖ policy) ± s.e.; in brackets the budgets (tokens per KV "
        "head) and the compression of every byte held at the end (recent buffer included)",
        "",
        "| kind | configuration | " + " | ".join(f"{r:g}x bytes" for r in ratios) + " |",
        "|---|---|" + "---|" * len(ratios),
    ]
    for pol, recs in sorted(whole.items(), key=lambda kv: -_own(kv[1])):
        m, se = _kl(recs)
        cell = f"{kl_text(m)} ± {kl_text(se)} (own {_own(recs):.2f}x; all bytes {_mem(recs):.2f}x)"
        lines.append(f"| {kind(pol)} | `{pol}` | {cell} (any ratio) |" + " |" * (len(ratios) - 1))
    policies = sorted({p for p, _ in sized}, key=lambda p: (kind(p) != "evict-only", p))
    for pol in policies:
        cells = []
        for r in ratios:
            recs = sized.get((pol, r))
            if not recs:
                cells.append("—")
                continue
            m, se = _kl(recs)
            b = sorted({x["budget"] for x in recs.values()})
            bt = f"{b[0]}" if b[0] == b[-1] else f"{b[0]}-{b[-1]}"
            cells.append(f"{kl_text(m)} ± {kl_text(se)} ({bt}; {_mem(recs):.2f}x)")
        lines.append(f"| {kind(pol)} | `{pol}` | " + " | ".join(cells) + " |")
    return lines + [""]


def goal(runs: dict[str, Path], ratios: list[float]) -> list[str]:
    """The goal check: per ratio and label, the best evict-only and quantize-only configurations and each evict +
    quantize configuration's paired difference to them; the configurations below both in every cell."""
    lines = []
    below_all: dict[str, bool] = {}
    for r in ratios:
        for label, run in runs.items():
            sized, whole = load(run)
            evict = {p: recs for (p, x), recs in sized.items() if x == r and kind(p) == "evict-only"}
            quant = {p: recs for p, recs in whole.items() if _own(recs) >= r * 0.95}
            both = {p: recs for (p, x), recs in sized.items() if x == r and kind(p) == "evict + quantize"}
            if not evict or not both:
                continue
            best_e = min(evict, key=lambda p: _kl(evict[p])[0])
            best_q = min(quant, key=lambda p: _kl(quant[p])[0]) if quant else None
            qtext = f"`{best_q}` {kl_text(_kl(quant[best_q])[0])}" if best_q else "none keeps every token at this ratio"
            lines += [
                f"{label}, {r:g}x bytes: best evict-only `{best_e}` {kl_text(_kl(evict[best_e])[0])}; best "
                f"quantize-only {qtext}",
                "",
                "| evict + quantize | KL | − best evict-only (lower on) | − best quantize-only (lower on) |",
                "|---|---|---|---|",
            ]
            for p in sorted(both, key=lambda p: _kl(both[p])[0]):
                m = _kl(both[p])[0]
                de = paired_diff(_by_source(both[p]), _by_source(evict[best_e]))
                dq = paired_diff(_by_source(both[p]), _by_source(quant[best_q])) if best_q else None
                ok = m < _kl(evict[best_e])[0] and (best_q is None or m < _kl(quant[best_q])[0])
                below_all[p] = below_all.get(p, True) and ok
                lines.append(f"| `{p}` | {kl_text(m)} | {_pd(de)} | {_pd(dq) if dq else '—'} |")
            lines.append("")
    winners = [p for p, ok in below_all.items() if ok]
    lines.append(
        "Below both the best evict-only and the best quantize-only configuration in every cell above: "
        + (", ".join(f"`{p}`" for p in sorted(winners)) if winners else "none")
    )
    return lines + [""]


def unprotected(policy: str) -> str:
    """The configuration a ``protect_precision=guard`` one is compared with: the same without the guard options
    (``guard=``, ``protect_share=``, ``protect_precision=``; for ``vase`` its default guard and share)."""
    drop = ("guard=", "protect_share=", "protect_precision=")
    return ":".join(p for p in policy.split(":") if not p.startswith(drop))


def unwindowed(policy: str) -> str:
    """The configuration a ``kv_window`` one is compared with: the same without its full-precision window."""
    return ":".join(p for p in policy.split(":") if not p.startswith("kv_window="))


def _paired(runs: dict[str, Path], ratios: list[float], option: str, base, title: str) -> list[str]:
    """Each configuration with ``option`` against ``base(configuration)`` (the same without it), paired over the
    sources per label and ratio of ``ratios`` (at its own compression for quantize-only): :func:`_vs`."""
    heads, cells = [], {}
    for label, run in runs.items():
        sized, whole = load(run)
        for r in ratios:
            heads.append(f"{label} {r:g}x")
            for (p, x), recs in sized.items():
                if x == r and option in p and (base(p), r) in sized:
                    cells.setdefault(p, {})[heads[-1]] = _vs(recs, sized[(base(p), r)])
            for p, recs in whole.items():
                if option in p and base(p) in whole:
                    cells.setdefault(p, {})[heads[-1]] = _vs(recs, whole[base(p)])
    lines = [title, "", "| configuration | compared with | " + " | ".join(heads) + " |"]
    lines.append("|---|---|" + "---|" * len(heads))
    for p in sorted(cells, key=lambda p: (kind(p), p)):
        row = [cells[p].get(h, "—") for h in heads]
        lines.append(f"| `{p}` | `{base(p)}` | " + " | ".join(row) + " |")
    return lines + [""]


def protect(runs: dict[str, Path], ratios: list[float]) -> list[str]:
    """Does keeping the guard's entries unquantized pay? Each ``protect_precision=guard`` configuration against the
    same without it (:func:`unprotected`), with on how many sources it is lower."""
    return _paired(
        runs,
        ratios,
        "protect_precision=guard",
        unprotected,
        "Keeping the guard's entries unquantized: KL with `protect_precision=guard` minus KL without (paired over "
        "the sources ± s.e.; on how many it is lower; the median over the sources of KL with / KL without)",
    )


def window(runs: dict[str, Path], ratios: list[float]) -> list[str]:
    """Does a sliding full-precision window pay at equal bytes? Each ``kv_window`` configuration against the same
    without it (:func:`unwindowed`)."""
    return _paired(
        runs,
        ratios,
        "kv_window=",
        unwindowed,
        "A full-precision window: KL with `kv_window` minus KL without (paired over the sources ± s.e.; on how many "
        "it is lower; the median over the sources of KL with / KL without)",
    )


def _vs(mine: dict, ref: dict) -> str:
    """Paired difference of mean KL (:func:`_pd`) and the median per-source ratio ``mine / ref``: robust to one
    source where everything fails."""
    a, b = _by_source(mine), _by_source(ref)
    ratios = [a[k] / b[k] for k in sorted(set(a) & set(b)) if b[k] > 0]
    d = paired_diff(a, b)
    if d is None or not ratios:
        return "—"
    return f"{kl_text(d.mean, signed=True)} ± {kl_text(d.se)} ({d.lower}/{d.n}; ×{statistics.median(ratios):.2f})"


def _by_source(recs: dict) -> dict[str, float]:
    return {k: v["kl_mean"] for k, v in recs.items()}


def summary(runs: dict[str, Path], ratios: list[float], median: bool = False) -> list[str]:
    """One table for all labels: mean KL ± s.e. per configuration at each ratio of ``ratios`` over the sources every
    configuration of the label has run on (their number in the header); quantize-only configurations at their own
    compression, whatever the column; with planted value outliers, the share of planted entries kept and held
    unquantized. ``median``: the median KL over the sources instead (robust to one source where everything fails)."""
    loaded = {}
    for label, run in runs.items():  # the sources every configuration has run on (an interrupted run: fewer)
        sized, whole = load(run)
        done = set.intersection(*(set(recs) for recs in [*sized.values(), *whole.values()]))
        loaded[label] = (
            {k: {s: r for s, r in recs.items() if s in done} for k, recs in sized.items()},
            {k: {s: r for s, r in recs.items() if s in done} for k, recs in whole.items()},
        )
    heads, cols = [], []
    for label, (sized, _) in loaded.items():
        n = len({s for recs in sized.values() for s in recs})
        for r in ratios:
            heads.append(f"{label} {r:g}x ({n})")
            cols.append((label, r))
    policies = sorted(
        {p for sized, whole in loaded.values() for p in [*whole, *(p for p, _ in sized)]},
        key=lambda p: (["evict-only", "quantize-only", "evict + quantize"].index(kind(p)), p),
    )
    lines = ["| kind | configuration | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for pol in policies:
        cells = []
        for label, r in cols:
            sized, whole = loaded[label]
            recs = whole.get(pol) if kind(pol) == "quantize-only" else sized.get((pol, r))
            if not recs:
                cells.append("—")
                continue
            own = f" (at {_own(recs):.1f}x)" if kind(pol) == "quantize-only" else ""
            if median:
                cells.append(f"{kl_text(statistics.median(r['kl_mean'] for r in recs.values()))}{own}")
                continue
            m, se = _kl(recs)
            cells.append(f"{kl_text(m)} ± {kl_text(se)}{own}{_planted(recs)}")
        lines.append(f"| {kind(pol)} | `{pol}` | " + " | ".join(cells) + " |")
    return lines + [""]


def _planted(recs: dict) -> str:
    """With planted value outliers: the mean share of planted entries kept at the end, and of those held unquantized
    (the records' ``planted_kept`` and ``planted_full_precision``), or ``""``."""
    if next(iter(recs.values())).get("planted_kept") is None:
        return ""
    kept = statistics.mean(r["planted_kept"] for r in recs.values())
    text = f"; planted kept {100 * kept:.0f}%"
    fps = [r["planted_full_precision"] for r in recs.values() if r.get("planted_full_precision") is not None]
    if fps:  # of the planted entries held: none held gives None
        text += f", {100 * statistics.mean(fps):.0f}% of those unquantized"
    return text


def _pd(d) -> str:
    return "—" if d is None else f"{kl_text(d.mean, signed=True)} ± {kl_text(d.se)} ({d.lower}/{d.n})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="label=dir, or dir (labelled by its name)")
    ap.add_argument("--ratios", default="8,16", help="byte ratios of the goal check")
    ap.add_argument("--summary", action="store_true", help="only one table of every label at --ratios")
    ap.add_argument("--median", action="store_true", help="with --summary: median KL over the sources, not mean ± s.e.")
    ap.add_argument("--protect", action="store_true", help="only the protect_precision=guard paired differences")
    ap.add_argument("--window", action="store_true", help="only the kv_window paired differences")
    args = ap.parse_args()
    runs = {}
    for a in args.runs:
        label, _, folder = a.rpartition("=") if "=" in a else (Path(a).name, "", a)
        if not (Path(folder) / "fidelity.jsonl").exists():
            raise SystemExit(f"{folder}: no fidelity.jsonl there (a folder written by vase fidelity --byte-ratios)")
        runs[label] = Path(folder)
    if args.summary:
        print("\n".join(summary(runs, [float(x) for x in args.ratios.split(",")], median=args.median)))
        return
    if args.protect:
        print("\n".join(protect(runs, [float(x) for x in args.ratios.split(",")])))
        return
    if args.window:
        print("\n".join(window(runs, [float(x) for x in args.ratios.split(",")])))
        return
    out = []
    for label, run in runs.items():
        out += tables(label, run)
    out += goal(runs, [float(x) for x in args.ratios.split(",")])
    out += protect(runs, [float(x) for x in args.ratios.split(",")])
    print("\n".join(out))


if __name__ == "__main__":
    main()

"""``vase report RESULTS_DIR``: markdown tables and PNG plots from ``vase eval`` and ``vase fidelity`` results."""

from __future__ import annotations

from pathlib import Path

MIB = 2.0**20


def _fmt_size(row: dict) -> str:
    return f"{row['ratio']:g}x (budget {row['budget']})" if row.get("ratio") is not None else f"budget {row['budget']}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PERCENT_LIMITS = (-3.0, 103.0)  # y range of every percentage plot: 0-100 with room for markers at the ends


def compression(row: dict) -> float:
    """The compression of a summary row, the one definition used by the tables and the plots: full-cache bytes
    (a dense cache holding every prompt and generated token) over the KV bytes the policy's buffers hold, means
    over the row's completions. The ``full`` policy is the reference: 1.0 by definition (its buffers grow in steps
    of the budget, so they may hold a few % more than the dense bytes; that slack is shown as "KV held", not
    counted as compression below 1)."""
    if row["policy"] == "full":
        return 1.0
    return row["kv_bytes_full"] / row["kv_bytes"] if row["kv_bytes"] else float("nan")


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _compression_axis(ax, xs: list[float]) -> None:
    """x from 0 to past the largest compression (at least 1.5x), so that 1x and equal values never collapse."""
    ax.set_xlim(0.0, max(1.5, 1.1 * max(xs, default=1.0)))


def _flat_axis(ax, values: list[float], lo: float | None = None, hi: float | None = None) -> None:
    """Give a y axis whose values are all (nearly) equal a visible range of +-1 around them (within [lo, hi]),
    instead of matplotlib's +-4% of the value (pass@1 from -0.04 to 0.04)."""
    if values and max(values) - min(values) < 1e-9:
        v = values[0]
        bottom, top = v - 1.0, v + 1.0
        if lo is not None and bottom < lo:
            bottom, top = lo, lo + 2.0
        if hi is not None and top > hi:
            bottom, top = hi - 2.0, hi
        ax.set_ylim(bottom, top)


def eval_figure(rows: list[dict], task: str):
    """The plots of one task's summary rows: pass@1 and loop rate (%) against :func:`compression`, both y axes fixed
    at 0-100 %. Returns the matplotlib figure (the caller saves and closes it)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs, markers = [], "os^vD<>pXh*P"
    for i, policy in enumerate(sorted({r["policy"] for r in rows}, key=lambda p: (p != "full", p))):
        pr = sorted((r for r in rows if r["policy"] == policy), key=compression)
        x = [compression(r) for r in pr]
        xs += x
        se = [0.0 if r["se"] != r["se"] else r["se"] for r in pr]  # NaN (one problem) -> no error bar
        style = dict(marker=markers[i % len(markers)], label=policy, alpha=0.8)
        ax1.errorbar(x, [r["pass1"] for r in pr], yerr=se, capsize=3, **style)
        ax2.plot(x, [r["loop_rate"] for r in pr], **style)
    for ax, name in ((ax1, "pass@1 (%)"), (ax2, "loop rate (%)")):
        ax.set(xlabel="compression (full-cache bytes / KV bytes held; full = 1)", ylabel=name, ylim=PERCENT_LIMITS)
        _compression_axis(ax, xs)
    ax1.set_title(f"{task}: accuracy")
    ax2.set_title(f"{task}: loops (cut at the limit while repeating)")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return fig


def eval_section(records: list[dict], out: Path) -> list[str]:
    """Accuracy table (compression, pass@1 +- standard error, loop rates, share cut by the token limit, mean length,
    KV memory) and plots, per task. Loop flags are recomputed from the stored text
    (:func:`vase.harness.evaluate.loop_flags`)."""
    from .evaluate import summarize

    rows = summarize(records)
    lines = []
    plt = _plt()
    for task in sorted({r["task"] for r in rows}):
        trows = [r for r in rows if r["task"] == task]
        n_problems = max(r["problems"] for r in trows)
        lines += [
            f"### {task}: accuracy ({n_problems} problems)",
            "",
            "| policy | cache size | compression | pass@1 (%) | loop rate (%) | paper regex loop rate (%) "
            "| cut at limit (%) | mean tokens | KV held (MiB) | full cache (MiB) | completions |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(trows, key=lambda r: (r["policy"] != "full", r["policy"], r["budget"])):
            lines.append(
                f"| {r['policy']} | {_fmt_size(r)} | {compression(r):.2f}x | {r['pass1']:.1f} ± {r['se']:.1f} | "
                f"{r['loop_rate']:.1f} | {_pct(r['paper_loop_rate'])} | {_pct(r['limit_rate'])} | "
                f"{r['mean_tokens']:.0f} | {r['kv_bytes'] / MIB:.2f} | {r['kv_bytes_full'] / MIB:.2f} | "
                f"{r['completions']} |"
            )
        lines += [
            "",
            "Compression: full-cache bytes (a dense cache of every prompt and generated token) / KV bytes held, means "
            "over the completions; `full` is the reference, 1.00x by definition (its buffers grow in steps of the "
            "budget, so its KV held can exceed the full-cache bytes). Loop rate: cut by the token limit while ending "
            "in 3+ near-identical repetitions of a 5-300 character unit (`vase.harness.loops.loop_flag`; error rates "
            "in docs/RESULTS.md). Paper regex loop rate: `(.{10,40})\\1{4,}` found in the last 500 characters, "
            "finished or not (the VaSE reference check). Both are recomputed from the stored text.",
            "",
        ]
        fig = eval_figure(trows, task)
        name = f"eval_{task}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        lines += [f"![{task} accuracy and loop rate]({name})", ""]
    return lines


def fidelity_section(records: list[dict], out: Path) -> list[str]:
    """Fidelity tables (KL, top-1, perplexity change per policy and size; KL per position bucket) and plots."""
    from .fidelity import summarize

    rows = summarize(records)
    sizes = sorted({r["size"] for r in rows}, key=lambda s: (s[0] != "ratio", s[1]))
    policies = sorted({r["policy"] for r in rows}, key=lambda p: (p != "full", p))
    by = {(r["policy"], r["size"]): r for r in rows}
    n_sources = max(r["sources"] for r in rows)

    def label(s):
        return f"{s[1]:g}x" if s[0] == "ratio" else f"budget {int(s[1])}"

    lines = [f"### Fidelity to the full cache ({n_sources} sources, {records[0]['tokens']} tokens each)", ""]
    for title, key, fmt in (
        ("mean KL(full ‖ policy), nats per token (lower is better)", "kl", "{:.4f}"),
        ("top-1 agreement with the full cache, % (higher is better)", "top1", "{:.1f}"),
        ("perplexity change of the continuation vs the full cache, % (lower is better)", "ppl_change", "{:+.1f}"),
    ):
        lines += [
            f"{title}:",
            "",
            "| policy | " + " | ".join(label(s) for s in sizes) + " |",
            "|---" * (len(sizes) + 1) + "|",
        ]
        for p in policies:
            cells = []
            for s in sizes:
                r = by.get((p, s))
                cells.append("—" if r is None else fmt.format(r[key]))
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Best policy (lowest mean KL, `full` excluded):", ""]
    for s in sizes:
        cands = [by[(p, s)] for p in policies if p != "full" and (p, s) in by]
        if cands:
            ranked = sorted(cands, key=lambda r: r["kl"])
            runner = f", then {ranked[1]['policy']} ({ranked[1]['kl']:.4f})" if len(ranked) > 1 else ""
            lines.append(f"- {label(s)}: **{ranked[0]['policy']}** (KL {ranked[0]['kl']:.4f}){runner}")
    lines.append("")

    # KL per position bucket, at each size
    for s in sizes:
        srows = [by[(p, s)] for p in policies if (p, s) in by and p != "full"]
        if not srows or not srows[0]["buckets"]:
            continue
        buckets = srows[0]["buckets"]
        lines += [
            f"KL by position in the continuation at {label(s)}:",
            "",
            "| policy | " + " | ".join(f"{b['start']}-{b['end']}" for b in buckets) + " |",
            "|---" * (len(buckets) + 1) + "|",
        ]
        for r in sorted(srows, key=lambda r: r["kl"]):
            lines.append(f"| {r['policy']} | " + " | ".join(f"{b['kl']:.4f}" for b in r["buckets"]) + " |")
        lines.append("")

    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = "os^vD<>pXh*P"
    for i, p in enumerate(x for x in policies if x != "full"):
        pts = sorted((by[(p, s)] for s in sizes if (p, s) in by), key=lambda r: r["compression"])
        style = dict(
            marker=markers[i % len(markers)],
            linewidth=2.5 if p.startswith("vase") else 1.2,
            color=plt.get_cmap("tab20")(i % 20),
        )
        ax1.plot([r["compression"] for r in pts], [r["kl"] for r in pts], label=p, **style)
        ax2.plot([r["compression"] for r in pts], [r["top1"] for r in pts], label=p, **style)
    ax1.set(
        xlabel="compression ratio (context tokens / budget, as asked by --ratios)",
        ylabel="mean KL(full ‖ policy) (nats)",
        yscale="log",
        title="divergence from the full cache",
    )
    ax2.set(
        xlabel="compression ratio (context tokens / budget, as asked by --ratios)",
        ylabel="top-1 agreement (%)",
        title="agreement with the full cache",
    )
    _flat_axis(ax2, [r["top1"] for r in rows if r["policy"] != "full"], lo=0.0, hi=100.0)
    ax1.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "fidelity.png", dpi=110)
    plt.close(fig)
    lines += ["![fidelity against compression](fidelity.png)", ""]
    return lines


def write_report(results: Path, out: Path) -> Path:
    """Write ``REPORT.md`` (and PNGs) for the results directory ``results`` into ``out``; returns its path.

    Raises:
        ValueError: if ``results`` holds neither eval nor fidelity records.
    """
    from .evaluate import all_records, read_records
    from .fidelity import RECORDS as FIDELITY_RECORDS

    if not results.is_dir():
        raise ValueError(f"results directory not found: {results}")
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# vase report: {results.name}", ""]
    evals = all_records(results)
    fid = read_records(results / FIDELITY_RECORDS)
    if not evals and not fid:
        raise ValueError(f"{results} holds no records (records*.jsonl from `vase eval` or fidelity.jsonl)")
    if evals:
        lines += eval_section(evals, out)
    if fid:
        lines += fidelity_section(fid, out)
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path

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


def eval_section(records: list[dict], out: Path) -> list[str]:
    """Accuracy table (pass@1 +- standard error, loop rate, mean length, KV memory) and plots, per task."""
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
            "| policy | cache size | pass@1 (%) | loop rate (%) | mean tokens | KV held (MiB) | full cache (MiB) "
            "| completions |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(trows, key=lambda r: (r["policy"] != "full", r["policy"], r["budget"])):
            lines.append(
                f"| {r['policy']} | {_fmt_size(r)} | {r['pass1']:.1f} ± {r['se']:.1f} | {r['loop_rate']:.1f} | "
                f"{r['mean_tokens']:.0f} | {r['kv_bytes'] / MIB:.2f} | {r['kv_bytes_full'] / MIB:.2f} | "
                f"{r['completions']} |"
            )
        lines.append("")
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for policy in sorted({r["policy"] for r in trows}):
            pr = sorted((r for r in trows if r["policy"] == policy), key=lambda r: r["kv_bytes_full"] / r["kv_bytes"])
            # the full cache is the reference point (1x), whatever slack its growing buffers have
            x = [1.0 if policy == "full" else r["kv_bytes_full"] / max(r["kv_bytes"], 1) for r in pr]
            ax1.errorbar(x, [r["pass1"] for r in pr], yerr=[r["se"] for r in pr], marker="o", capsize=3, label=policy)
            ax2.plot(x, [r["loop_rate"] for r in pr], marker="o", label=policy)
        ax1.set(xlabel="compression (full-cache bytes / bytes held)", ylabel="pass@1 (%)", title=f"{task}: accuracy")
        ax2.set(xlabel="compression (full-cache bytes / bytes held)", ylabel="loop rate (%)", title=f"{task}: loops")
        ax1.legend(fontsize=8)
        fig.tight_layout()
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
        xlabel="compression ratio",
        ylabel="mean KL(full ‖ policy) (nats)",
        yscale="log",
        title="divergence from the full cache",
    )
    ax2.set(xlabel="compression ratio", ylabel="top-1 agreement (%)", title="agreement with the full cache")
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

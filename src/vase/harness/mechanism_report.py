"""The tables and plot of ``vase analyze`` results (:mod:`vase.harness.mechanism`) in ``vase report``."""

from __future__ import annotations

from pathlib import Path

from .plots import policy_styles, pyplot, save
from .ranking import policy_order
from .stats import mean_se

QUANTITIES = [  # (record field, column, format)
    ("kl_mean", "KL, each run", "{:.4f}"),
    ("kl_mixture", "KL, mixture of runs", "{:.4f}"),
    ("dropped_first", "dropped at first eviction (%)", "pct"),
    ("survived_p90", "evictions survived (p90)", "{:.1f}"),
    ("held_at_end", "held at end (%)", "pct"),
    ("age", "mean age (tokens)", "{:.0f}"),
    ("overlap", "kept set kept next eviction (%)", "pct"),
    ("settled", "heads whose kept set settles (%)", "pct"),
    ("cosine_distance", "key cosine distance", "{:.3f}"),
    ("logdet", "key log-det per key", "{:.2f}"),
]


def summarize(records: list[dict]) -> list[dict]:
    """One row per (policy, ratio): the mean ± standard error over sources of each quantity (``{name: (mean, se)}``),
    ``recall`` per k, the mixture's gain (mean over sources of kl_mixture / kl_mean) and the sources counted."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["policy"], r["ratio"]), []).append(r)
    order = policy_order(r["policy"] for r in records)
    rows = []
    for (policy, ratio), recs in sorted(groups.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        row = {"policy": policy, "ratio": ratio, "sources": len(recs), "seeds": max(r["seeds"] for r in recs)}
        for field, _, _ in QUANTITIES:
            vals = [r[field] for r in recs if r.get(field) is not None and r[field] == r[field]]
            row[field] = mean_se(vals) if vals else (float("nan"), float("nan"))
        row["gain"] = mean_se([r["kl_mixture"] / r["kl_mean"] for r in recs if r["kl_mean"] > 0] or [float("nan")])
        ks = sorted({k for r in recs for k in r.get("recall", {})}, key=int)
        row["recall"] = {k: mean_se([r["recall"][k] for r in recs if k in r.get("recall", {})]) for k in ks}
        rows.append(row)
    return rows


def _fmt(value: tuple[float, float], how: str) -> str:
    mean, se = value
    if mean != mean:
        return "-"
    scale = 100 if how == "pct" else 1
    text = ("{:.1f}" if how == "pct" else how).format(mean * scale)
    return text if se != se else f"{text} ± {('{:.1f}' if how == 'pct' else how).format(se * scale)}"


def analysis_section(records: list[dict], out: Path) -> list[str]:
    """The tables (one per ratio: the quantities and the recall of each k) and the recall plot."""
    rows = summarize(records)
    lines = []
    for ratio in sorted({r["ratio"] for r in rows}):
        rr = [r for r in rows if r["ratio"] == ratio]
        ks = sorted({k for r in rr for k in r["recall"]}, key=int)
        lines += [
            f"### Mechanism at {ratio:g}x ({max(r['sources'] for r in rr)} sources)",
            "",
            "| policy | runs | " + " | ".join(c for _, c, _ in QUANTITIES) + " | mixture / run |"
            + "".join(f" recall@{k} (%) |" for k in ks),
            "|---|---|" + "---|" * (len(QUANTITIES) + 1 + len(ks)),
        ]  # fmt: skip
        for r in rr:
            cells = [_fmt(r[f], how) for f, _, how in QUANTITIES] + [_fmt(r["gain"], "{:.2f}")]
            cells += [_fmt(r["recall"][k], "pct") for k in ks]
            lines.append(f"| {r['policy']} | {r['seeds']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "Means ± standard errors over sources (each source: the mean over its seeds, layers and KV heads). KL: "
        "KL(full ‖ policy) in nats per token, of each seed's run and of the mixture of the seeds' next-token "
        "distributions; mixture / run < 1: the runs' average is closer than each run (an ensemble). Dropped at first "
        "eviction: the share of positions evicted at the first eviction they take part in (past the sinks, older "
        "than the recent window). Kept set kept next eviction: the share of the entries chosen at one eviction "
        "still held after the next; a head settles when that stays >= 99% to the end. Key diversity: of the full "
        "cache's keys at the held positions. Recall@k: the share of the full cache's attention mass of the next k "
        "queries on the entries held.",
        "",
    ]
    fig = recall_figure(rows)
    save(fig, out / "analysis_recall.png")
    return lines + ["![future-attention recall](analysis_recall.png)", ""]


def recall_figure(rows: list[dict]):
    """Future-attention recall against k, one panel per ratio, a line per policy."""
    plt = pyplot()
    ratios = sorted({r["ratio"] for r in rows})
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios), 3.6), squeeze=False, sharey=True)
    styles = policy_styles(policy_order(r["policy"] for r in rows))
    for ax, ratio in zip(axes[0], ratios):
        for r in (r for r in rows if r["ratio"] == ratio):
            ks = sorted(r["recall"], key=int)
            ax.errorbar(
                [int(k) for k in ks], [100 * r["recall"][k][0] for k in ks],
                yerr=[100 * (r["recall"][k][1] if r["recall"][k][1] == r["recall"][k][1] else 0) for k in ks],
                label=r["policy"], capsize=2, **styles[r["policy"]],
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_title(f"{ratio:g}x")
        ax.set_xlabel("next k queries")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("attention mass on kept entries (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig

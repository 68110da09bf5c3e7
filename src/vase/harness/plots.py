"""The plots of ``vase report``: one fixed colour and marker per policy, axes that read at a glance (plain ticks,
compression from 0, KL linear or log, percentages within 0-100), error bars dodged sideways, the legend below, and
the eval and fidelity figures. matplotlib is imported on first use (the Agg backend: files only, no window).
"""

from __future__ import annotations

import math
from pathlib import Path

from .ranking import compression, policy_order

PERCENT_LIMITS = (-3.0, 103.0)  # y range of every percentage plot: 0-100 with room for markers at the ends
DPI = 110

# One fixed color and marker per policy, in every plot (a qualitative palette: tab10 and a few more; black = full).
POLICY_COLORS = {
    "full": "#000000",
    "vase": "#d62728",
    "h2o": "#1f77b4",
    "snapkv": "#ff7f0e",
    "tova": "#2ca02c",
    "rkv": "#9467bd",
    "streaming_llm": "#8c564b",
    "curdkv": "#e377c2",
    "keydiff": "#bcbd22",
    "knorm": "#17becf",
    "quest": "#7f7f7f",
    "vase_dkv": "#393b79",
    "random": "#b0b0b0",
}
POLICY_MARKERS = {
    "full": "*",
    "vase": "o",
    "h2o": "s",
    "snapkv": "^",
    "tova": "v",
    "rkv": "D",
    "streaming_llm": "<",
    "curdkv": ">",
    "keydiff": "p",
    "knorm": "h",
    "quest": "X",
    "vase_dkv": "P",
    "random": "d",
}
# policy specs with options (``vase:recent=32``) take these, in order of appearance, with a dashed line
SPARE_COLORS = ["#006d77", "#000080", "#ffb703", "#00c49a", "#8338ec", "#9c6644", "#e07a5f", "#ff006e", "#606c38"]
SPARE_MARKERS = "o^sDv<>phXP*d"


def policy_styles(policies: list[str]) -> dict[str, dict]:
    """Matplotlib style (``color``, ``marker``, ``linestyle``, ``linewidth``) of each policy: a fixed color and
    marker per policy name (:data:`POLICY_COLORS`, :data:`POLICY_MARKERS`), so that a policy looks the same in every
    plot of every report; specs with options and unknown names get the spare colors in order, dashed."""
    styles, spare = {}, 0
    used = {POLICY_COLORS[p] for p in policies if p in POLICY_COLORS}
    spare_colors = [c for c in SPARE_COLORS if c not in used]
    for p in policies:
        if p in POLICY_COLORS:
            styles[p] = dict(color=POLICY_COLORS[p], marker=POLICY_MARKERS[p], linestyle="-", linewidth=1.8)
            if p == "full":
                styles[p]["markersize"] = 10  # a star at the default size reads as a dot
        else:
            color = spare_colors[spare % len(spare_colors)] if spare_colors else "#444444"
            marker = SPARE_MARKERS[spare % len(SPARE_MARKERS)]
            styles[p] = dict(color=color, marker=marker, linestyle="--", linewidth=1.8)
            spare += 1
    return styles


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    """Write ``fig`` as a PNG at ``path`` (110 dpi) and close it."""
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)


def _se0(x: float) -> float:
    """A standard error for an error bar: NaN (one source or problem) draws none."""
    return 0.0 if x != x else x


def _plain(value: float, _pos=None) -> str:
    """A tick label in plain decimals (``0.04``, ``0.00012``, ``8``): no offset, no scientific notation."""
    import numpy as np

    return np.format_float_positional(float(f"{value:.6g}"), trim="-")


def _plain_ticks(ax) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(_plain))
        axis.set_minor_formatter(NullFormatter())


def _compression_axis(ax, xs: list[float]) -> None:
    """x from 0 to past the largest compression (at least 1.5x), so that 1x and equal values never collapse."""
    finite = [x for x in xs if x == x]
    ax.set_xlim(0.0, max(1.5, 1.1 * max(finite, default=1.0)))


def _kl_axis(ax, values: list[float]) -> None:
    """Linear from 0 when the KLs span less than 20x (plain ticks read at a glance), log when they span more; the
    range is set by hand (``values``: means, and means + errors) because the dodged series are not autoscaled."""
    pos = [v for v in values if v == v and v > 0]
    if pos and max(pos) / min(pos) > 20:
        ax.set_yscale("log")
        ax.set_ylim(min(pos) / 2, max(pos) * 1.5)
    else:
        ax.set_ylim(0.0, 1.15 * max(pos, default=1.0))


def _percent_axis(ax, points: list[tuple[float, float]]) -> None:
    """A y range around ``(value, error)`` points in % (bars included, 10% of the span as margin, at least 1 point),
    within 0-100: set by hand because the dodged series (:func:`_dodge`) are not autoscaled."""
    if not points:
        return
    lo = min(v - e for v, e in points)
    hi = max(v + e for v, e in points)
    pad = max(0.1 * (hi - lo), 1.0)
    ax.set_ylim(max(lo - pad, 0.0), min(hi + pad, 101.0))


def _mark_sizes(ax, sizes: dict[tuple, dict]) -> None:
    """A dotted vertical line at each size's measured compression, named on a top axis (``4x``, ``8x asked``,
    ``budget 128``), so that a ratio whose measured compression differs is seen where it was measured."""
    ticks, names = [], []
    for (kind, value), info in sizes.items():
        name = (
            f"{value:g}x" if kind == "ratio" else (f"{value:g}x bytes" if kind == "bytes" else f"budget {int(value)}")
        )
        if kind == "ratio" and "asked" in info["label"]:
            name += " asked"
        ax.axvline(info["compression"], color="0.6", linestyle=":", linewidth=1, zorder=0)
        ticks.append(info["compression"])
        names.append(name)
    top = ax.secondary_xaxis("top")
    top.set_xticks(ticks, names, fontsize=8, color="0.3")
    top.tick_params(length=0)


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


def _dodge(ax, fig, i: int, n: int):
    """A transform that shifts series ``i`` of ``n`` sideways by a few points, so that error bars at the same x do
    not hide each other (the data, and so the x values read back, stay exact)."""
    from matplotlib.transforms import offset_copy

    return offset_copy(ax.transData, fig=fig, x=4.0 * (i - (n - 1) / 2), y=0.0, units="points")


def _legend(fig, axes, n: int) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(n, 4), fontsize=8, frameon=False)


def eval_figure(rows: list[dict], task: str, model: str | None = None):
    """The plots of one task's summary rows: pass@1 and loop rate (%, with their standard errors over problems as
    error bars) against :func:`~vase.harness.ranking.compression`, both y axes fixed at 0-100 %; the title names the
    task, the model (when given) and the number of problems. Returns the matplotlib figure (the caller saves it with
    :func:`save`)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8), layout="constrained")
    policies = policy_order(r["policy"] for r in rows)
    styles = policy_styles(policies)
    xs = []
    for i, policy in enumerate(policies):
        pr = sorted((r for r in rows if r["policy"] == policy), key=compression)
        x = [compression(r) for r in pr]
        xs += x
        for ax, key, se_key in ((ax1, "pass1", "se"), (ax2, "loop_rate", "loop_se")):
            se = [_se0(r.get(se_key, math.nan)) for r in pr]
            ax.errorbar(
                x,
                [r[key] for r in pr],
                yerr=se,
                capsize=3,
                label=policy,
                alpha=0.85,
                transform=_dodge(ax, fig, i, len(policies)),
                **styles[policy],
            )
    for ax, name in ((ax1, "pass@1 (%)"), (ax2, "loop rate (%)")):
        ax.set(xlabel="compression (full-cache bytes / KV bytes held; full = 1)", ylabel=name, ylim=PERCENT_LIMITS)
        _compression_axis(ax, xs)
        _plain_ticks(ax)
        ax.grid(alpha=0.3)
    n_problems = max(r["problems"] for r in rows)
    ax1.set_title("accuracy (± s.e. over problems)", fontsize=10)
    ax2.set_title("loops: cut at the limit while repeating (± s.e.)", fontsize=10)
    fig.suptitle(f"{task} · {model or 'model unknown'} · {n_problems} problem{'s' * (n_problems != 1)}")
    _legend(fig, (ax1, ax2), len(policies))
    return fig


def fidelity_figure(rows: list[dict], sizes: dict[tuple, dict], title: str):
    """The fidelity plots: mean KL and top-1 agreement (± standard error over sources) of each evicting policy against
    the measured compression (context tokens / budget, mean over sources), with ``title`` above both. Returns the
    matplotlib figure (the caller saves it with :func:`save`)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    policies = [p for p in policy_order(r["policy"] for r in rows) if p != "full"]
    styles = policy_styles(policies)
    by = {(r["policy"], r["size"]): r for r in rows}
    for i, p in enumerate(policies):
        pts = sorted((by[(p, s)] for s in sizes if (p, s) in by), key=lambda r: r["compression"])
        x = [r["compression"] for r in pts]
        for ax, key in ((ax1, "kl"), (ax2, "top1")):
            ax.errorbar(
                x,
                [r[key] for r in pts],
                yerr=[_se0(r[key + "_se"]) for r in pts],
                capsize=3,
                label=p,
                alpha=0.85,
                transform=_dodge(ax, fig, i, len(policies)),
                **styles[p],
            )
    evicting = [r for r in rows if r["policy"] != "full"]
    xlabel = "compression measured (context tokens / budget, mean over sources)"
    ax1.set(xlabel=xlabel, ylabel="mean KL(full ‖ policy) (nats per token)")
    ax1.set_title("divergence from the full cache (lower is better; ± s.e.)", fontsize=10)
    ax2.set(xlabel=xlabel, ylabel="top-1 agreement (%)")
    ax2.set_title("agreement with the full cache (higher is better; ± s.e.)", fontsize=10)
    _kl_axis(ax1, [r["kl"] for r in evicting] + [r["kl"] + _se0(r["kl_se"]) for r in evicting])
    _percent_axis(ax2, [(r["top1"], _se0(r["top1_se"])) for r in evicting])
    for ax in (ax1, ax2):
        _compression_axis(ax, [r["compression"] for r in evicting])
        _plain_ticks(ax)
        ax.grid(alpha=0.3)
        _mark_sizes(ax, sizes)
    fig.suptitle(title)
    _legend(fig, (ax1, ax2), len(policies))
    return fig


def overlap_figure(curves: dict[str, tuple[list[int], list[float]]]):
    """The kept-set overlap of looped completions around the loop's onset (:func:`vase.harness.dynamics.
    aligned_overlap`): one line per policy and size, generated tokens relative to the onset on x (bin starts), the mean
    overlap of the evictions in each bin on y (0-1), a vertical line at the onset. Returns the figure."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    labels = sorted(curves)
    styles = policy_styles(policy_order(label.split(" @ ")[0] for label in labels))
    sizes = sorted({label.split(" @ ")[1] for label in labels}, key=lambda s: float(s.rstrip("x")))
    for label in labels:
        x, y = curves[label]
        policy, size = label.split(" @ ")
        style = dict(styles[policy], linestyle=("-", "--", ":", "-.")[sizes.index(size) % 4])  # a line style per size
        ax.plot(x, y, label=label, alpha=0.85, **style)
    ax.axvline(0, color="#444444", linewidth=1)
    ax.set(
        xlabel="generated tokens relative to the loop's onset (bins of 64)",
        ylabel="overlap of consecutive kept sets",
        ylim=(-0.03, 1.03),
    )
    ax.set_title("kept-set overlap of looped completions around the onset", fontsize=10)
    _plain_ticks(ax)
    ax.grid(alpha=0.3)
    fig.legend(
        *ax.get_legend_handles_labels(), loc="outside lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False
    )
    return fig

"""``vase report RESULTS_DIR``: markdown tables and PNG plots from ``vase eval`` and ``vase fidelity`` results.

The report opens with a header of what decides the numbers (source or tasks, model, policies, the budgets replayed,
buffer, sinks; from the folder's ``config.json`` and the records), so that two runs that differ only there cannot be
confused. Every mean comes with its standard error over sources (fidelity) or problems (eval); fidelity tables add,
beside a reference policy, the paired difference of each policy's KL over the sources both have
(:mod:`vase.harness.stats`), and a best policy is named only when it is ahead of every other by more than one paired
standard error. A size whose measured compression differs from the ratio asked by more than 5% is labelled with both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..core.config import DEFAULT_SINKS
from .stats import kl_text, paired_diff, paired_text, pm, rank

MIB = 2.0**20
MEASURED_TOLERANCE = 0.05  # a measured compression this far (relative) from the ratio asked is shown in the label
PERCENT_LIMITS = (-3.0, 103.0)  # y range of every percentage plot: 0-100 with room for markers at the ends

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


def _order(policies) -> list[str]:
    return sorted(set(policies), key=lambda p: (p != "full", p))


def budget_text(budgets: list[int]) -> str:
    """``budget 69``, or ``budget 83-93`` when the sources were given different budgets (a ratio of each length)."""
    lo, hi = min(budgets), max(budgets)
    return f"budget {lo}" if lo == hi else f"budget {lo}-{hi}"


def size_label(ratio: float | None, measured: float, budgets: list[int]) -> str:
    """What a cache size is called in tables and plots: ``4x (budget 144)`` when the measured compression is within
    5% of the ratio asked, else ``8x asked, 4.6x measured (budget 69)``; a size given as a budget is
    ``budget 128 (4.5x measured)`` (``measured``: mean compression, NaN when unknown)."""
    if ratio is None:
        return budget_text(budgets) + ("" if measured != measured else f" ({measured:.1f}x measured)")
    if measured == measured and abs(measured / ratio - 1) > MEASURED_TOLERANCE:
        return f"{ratio:g}x asked, {measured:.1f}x measured ({budget_text(budgets)})"
    return f"{ratio:g}x ({budget_text(budgets)})"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def compression(row: dict) -> float:
    """The compression of a summary row, the one definition used by the tables and the plots: full-cache bytes
    (a dense cache holding every prompt and generated token) over the KV bytes the policy's buffers hold, means
    over the row's completions. The ``full`` policy is the reference: 1.0 by definition (its buffers grow in steps
    of the budget, so they may hold a few % more than the dense bytes; that slack is shown as "KV held", not
    counted as compression below 1)."""
    if row["policy"] == "full":
        return 1.0
    return row["kv_bytes_full"] / row["kv_bytes"] if row["kv_bytes"] else float("nan")


def _fmt_size(row: dict) -> str:
    """The cache size of an eval summary row (:func:`size_label` with :func:`compression` as the measure)."""
    if row.get("ratio") is None:
        return f"budget {row['budget']}"
    if row["policy"] == "full":
        return "full cache"
    return size_label(row["ratio"], compression(row), [row["budget"]])


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _signed1(x: float) -> str:
    return f"{x:+.1f}"


def _one(x: float) -> str:
    return f"{x:.1f}"


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


def read_config(results: Path) -> dict | None:
    """The run's configuration (``config.json`` of the results folder, see
    :func:`vase.harness.evaluate.prepare_dir`) as a dict, or None when the folder has none or it is unreadable."""
    path = results / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _sinks(config: dict | None) -> int:
    return int((config or {}).get("sinks", DEFAULT_SINKS))


def buffer_warning(label: str, budget: int, buffer: int | None, sinks: int) -> str | None:
    """The warning line for a size whose policy chooses fewer than a quarter of the budget (budget - sinks - buffer
    < budget / 4: the recent window, the buffer by default, and the sinks are kept whatever the scores); None
    otherwise or when the buffer is unknown."""
    if buffer is None:
        return None
    chosen = budget - sinks - buffer
    if chosen >= budget / 4:
        return None
    return (
        f"**Warning**, {label}: the policy chooses only {max(chosen, 0)} of the {budget} tokens kept (budget − "
        f"{sinks} sinks − {buffer} buffer), fewer than a quarter: small runs are dominated by the buffer (longer "
        "sources or a smaller --buffer leave the policy more to choose)."
    )


def eval_figure(rows: list[dict], task: str, model: str | None = None):
    """The plots of one task's summary rows: pass@1 and loop rate (%, with their standard errors over problems as
    error bars) against :func:`compression`, both y axes fixed at 0-100 %; the title names the task, the model (when
    given) and the number of problems. Returns the matplotlib figure (the caller saves and closes it)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8), layout="constrained")
    policies = _order(r["policy"] for r in rows)
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


def eval_section(records: list[dict], out: Path, config: dict | None = None) -> list[str]:
    """Accuracy table (compression, pass@1 +- standard error, loop rates, share cut by the token limit, mean length,
    KV memory) and plots, per task. Loop flags are recomputed from the stored text
    (:func:`vase.harness.evaluate.loop_flags`). ``config``: the run's configuration (:func:`read_config`), for the
    plot titles and the buffer warning."""
    from .evaluate import summarize

    rows = summarize(records)
    lines = []
    plt = _plt()
    buffer = (config or {}).get("buffer")
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
        for r in sorted(trows, key=lambda r: (r["policy"] != "full", r["policy"], r.get("ratio") or 0, r["budget"])):
            lines.append(
                f"| {r['policy']} | {_fmt_size(r)} | {compression(r):.2f}x | {pm(r['pass1'], r['se'], _one)} | "
                f"{pm(r['loop_rate'], r.get('loop_se', math.nan), _one)} | {_pct(r['paper_loop_rate'])} | "
                f"{_pct(r['limit_rate'])} | "
                f"{r['mean_tokens']:.0f} | {r['kv_bytes'] / MIB:.2f} | {r['kv_bytes_full'] / MIB:.2f} | "
                f"{r['completions']} |"
            )
        lines.append("")
        for budget in sorted({r["budget"] for r in trows if r["policy"] != "full"}):
            warn = buffer_warning(f"budget {budget}", budget, buffer, _sinks(config))
            if warn:
                lines += [warn, ""]
        lines += [
            "pass@1 and loop rate ± their standard errors over problems (none with one problem). "
            "Compression: full-cache bytes (a dense cache of every prompt and generated token) / KV bytes held, means "
            "over the completions; `full` is the reference, 1.00x by definition (its buffers grow in steps of the "
            "budget, so its KV held can exceed the full-cache bytes); a ratio asked is labelled with the measured "
            "compression too when they differ by more than 5%. Loop rate: cut by the token limit while ending "
            "in 3+ near-identical repetitions of a 5-300 character unit (`vase.harness.loops.loop_flag`; error rates "
            "in docs/RESULTS.md). Paper regex loop rate: `(.{10,40})\\1{4,}` found in the last 500 characters, "
            "finished or not (the VaSE reference check). Both are recomputed from the stored text.",
            "",
        ]
        fig = eval_figure(trows, task, model=(config or {}).get("model"))
        name = f"eval_{task}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        lines += [f"![{task} accuracy and loop rate]({name})", ""]
    return lines


def _fidelity_sizes(rows: list[dict]) -> dict[tuple, dict]:
    """size -> {"label", "compression" (mean measured over the evicting policies' rows), "budgets"}."""
    out = {}
    for s in sorted({r["size"] for r in rows}, key=lambda s: (s[0] != "ratio", s[0], s[1])):
        srows = [r for r in rows if r["size"] == s and r["policy"] != "full"] or [r for r in rows if r["size"] == s]
        measured = sum(r["compression"] for r in srows) / len(srows)
        budgets = sorted({b for r in srows for b in r["budgets"]})
        ratio = s[1] if s[0] in ("ratio", "bytes") else None
        label = size_label(ratio, measured, budgets)
        if s[0] == "bytes":  # a byte ratio: each policy holds the budget its bytes buy at its kv_bits
            label = f"{s[1]:g}x bytes ({budget_text(budgets)})"
        out[s] = {"label": label, "compression": measured, "budgets": budgets}
    return out


def _winner_line(label: str, cands: dict[str, dict]) -> str:
    """One bullet of the "best policy" list: a policy is named only when it is ahead of every other by more than one
    paired standard error (:func:`vase.harness.stats.rank`), else the tie is said."""
    if len(cands) == 1:
        ((p, r),) = cands.items()
        return f"- {label}: only {p} (KL {pm(r['kl'], r['kl_se'])})"
    rk = rank({p: r["kl_by_source"] for p, r in cands.items()})

    def kl_of(p):
        return pm(cands[p]["kl"], cands[p]["kl_se"])

    runner = rk.order[1]
    d = rk.diffs[runner]
    versus = f"{rk.best} − {runner} = " + (
        "— (under 2 common sources)"
        if d is None
        else f"{kl_text(d.mean, True)} ± {kl_text(d.se)}, lower on {d.lower} of {d.n} sources"
    )
    if all(d is None for d in rk.diffs.values()):
        listed = ", then ".join(f"{p} ({kl_of(p)})" for p in rk.order)
        return (
            f"- {label}: lowest mean KL {listed}; under 2 sources in common: no paired standard error, so no best "
            "policy is named"
        )
    if rk.winner:
        return (
            f"- {label}: **{rk.winner}** (KL {kl_of(rk.winner)}), ahead of every other policy by more than one paired "
            f"standard error; next {runner} ({kl_of(runner)}): {versus}"
        )
    behind = [p for p in rk.order if p not in rk.tied]
    tail = f"; behind them: {', '.join(f'{p} ({kl_of(p)})' for p in behind)}" if behind else ""
    return (
        f"- {label}: no single best, tied within one paired standard error: "
        f"{', '.join(f'{p} ({kl_of(p)})' for p in rk.tied)}; {versus}{tail}"
    )


def fidelity_figure(rows: list[dict], sizes: dict[tuple, dict], title: str):
    """The fidelity plots: mean KL and top-1 agreement (± standard error over sources) of each evicting policy against
    the measured compression (context tokens / budget, mean over sources), with ``title`` above both. Returns the
    matplotlib figure (the caller saves and closes it)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    policies = [p for p in _order(r["policy"] for r in rows) if p != "full"]
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


def fidelity_section(
    records: list[dict], out: Path, config: dict | None = None, against: str | None = None
) -> list[str]:
    """Fidelity tables and plots: mean ± standard error over sources of KL, top-1 and perplexity change per policy
    and size; the paired KL difference of each policy to a reference over the sources both have (``against``, or by
    default the evicting policy with the lowest mean KL at each size); the best policy at each size, or the tie; KL
    per position bucket. ``config``: the run's configuration (:func:`read_config`), for the titles and the buffer
    warning.

    Raises:
        ValueError: ``against`` is not a policy of the records.
    """
    from .fidelity import summarize

    rows = summarize(records)
    sizes = _fidelity_sizes(rows)
    policies = _order(r["policy"] for r in rows)
    if against is not None and against not in policies:
        raise ValueError(f"--against {against}: no such policy in the records; policies: {', '.join(policies)}")
    by = {(r["policy"], r["size"]): r for r in rows}
    n_sources = len({r["source"] for r in records})
    tokens = sorted({r["tokens"] for r in records})
    tok = f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
    cfg = config or {}

    def label(s):
        return sizes[s]["label"]

    lines = [f"### Fidelity to the full cache ({n_sources} source{'s' * (n_sources != 1)}, {tok} tokens each)", ""]
    lines += [
        "Means over sources ± their standard error (sample standard deviation / √n; none with one source).",
        "",
    ]
    warnings = [buffer_warning(i["label"], min(i["budgets"]), cfg.get("buffer"), _sinks(cfg)) for i in sizes.values()]
    warnings = [w for w in warnings if w]
    for title, key, fmt, se_fmt in (
        ("mean KL(full ‖ policy), nats per token (lower is better)", "kl", kl_text, kl_text),
        ("top-1 agreement with the full cache, % (higher is better)", "top1", _one, _one),
        ("perplexity change of the continuation vs the full cache, % (lower is better)", "ppl_change", _signed1, _one),
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
                cells.append("—" if r is None else pm(r[key], r[key + "_se"], fmt, se_fmt))
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
        if key == "kl" and warnings:
            for w in warnings:
                lines += [w, ""]

    # paired differences to the reference
    evicting = [p for p in policies if p != "full"]
    refs = {}
    for s in sizes:
        if against is not None:
            refs[s] = against if (against, s) in by else None
        else:
            cands = [by[(p, s)] for p in evicting if (p, s) in by]
            refs[s] = min(cands, key=lambda r: (r["kl"], r["policy"]))["policy"] if cands else None
    how = f"`{against}`" if against is not None else "the evicting policy with the lowest mean KL at each size"
    lines += [
        f"Paired difference of KL to the reference ({how}): policy − reference over the sources both have, mean ± "
        "standard error of the per-source differences, and on how many sources the policy is lower (negative = "
        "closer to the full cache than the reference):",
        "",
        "| policy | " + " | ".join(f"{label(s)} vs `{refs[s] or '—'}`" for s in sizes) + " |",
        "|---" * (len(sizes) + 1) + "|",
    ]
    for p in [p for p in policies if p != "full" or against == "full"]:
        cells = []
        for s in sizes:
            ref = refs[s]
            if ref is None or (p, s) not in by:
                cells.append("—")
            elif p == ref:
                cells.append("reference")
            else:
                diff = paired_diff(by[(p, s)]["kl_by_source"], by[(ref, s)]["kl_by_source"])
                cells.append(paired_text(diff) if diff else "— (under 2 common sources)")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("")

    lines += [
        "Best policy (lowest mean KL, `full` excluded), named only when its paired difference to every other policy "
        "is more than one paired standard error below zero:",
        "",
    ]
    for s in sizes:
        cands = {p: by[(p, s)] for p in evicting if (p, s) in by}
        if cands:
            lines.append(_winner_line(label(s), cands))
    lines.append("")

    # KL per position bucket, at each size
    for s in sizes:
        srows = [by[(p, s)] for p in policies if (p, s) in by and p != "full"]
        if not srows or not srows[0]["buckets"]:
            continue
        buckets = srows[0]["buckets"]
        lines += [
            f"KL by position in the continuation at {label(s)} (mean over sources):",
            "",
            "| policy | " + " | ".join(f"{b['start']}-{b['end']}" for b in buckets) + " |",
            "|---" * (len(buckets) + 1) + "|",
        ]
        for r in sorted(srows, key=lambda r: r["kl"]):
            lines.append(f"| {r['policy']} | " + " | ".join(kl_text(b["kl"]) for b in r["buckets"]) + " |")
        lines.append("")

    if evicting:
        plt = _plt()
        source = cfg.get("source") or "source unknown"
        title = (
            f"{_short_source(source)} · {cfg.get('model') or 'model unknown'} · "
            f"{n_sources} source{'s' * (n_sources != 1)} × {tok} tokens"
        )
        fig = fidelity_figure(rows, sizes, title)
        fig.savefig(out / "fidelity.png", dpi=110)
        plt.close(fig)
        lines += ["![fidelity against compression](fidelity.png)", ""]
    return lines


def _short_source(source: str) -> str:
    """``text:/long/path/tinyshakespeare.txt`` -> ``text:tinyshakespeare.txt`` (for plot titles)."""
    if source.startswith("text:"):
        return "text:" + Path(source[5:]).name
    return Path(source).name if "/" in source else source


def _sizes_text(kind_rows: list[tuple[float | None, int]]) -> str:
    """``4x → 144, 8x → 69`` / ``4x → 83-93``: the budgets replayed per ratio asked (and the budgets given)."""
    per: dict = {}
    for ratio, budget in kind_rows:
        per.setdefault(ratio, set()).add(int(budget))
    parts = []
    for ratio in sorted(per, key=lambda r: (r is None, r or 0)):
        bs = sorted(per[ratio])
        if ratio is None:
            parts += [f"budget {b}" for b in bs]
        else:
            parts.append(f"{ratio:g}x → {bs[0]}" + (f"-{bs[-1]}" if len(bs) > 1 else ""))
    return ", ".join(parts)


def header(results: Path, config: dict | None, evals: list[dict], fid: list[dict]) -> list[str]:
    """The report's header: the results folder, and what decides its numbers: source (fidelity) or tasks (eval),
    model, policies, sizes asked and the budgets (tokens) the records were run at, buffer, sinks, seed(s), tokens;
    from ``config`` (the folder's ``config.json``) and the records."""
    cfg = config or {}
    lines = [f"# vase report: {results.name}", "", f"- results: `{results}`"]
    if config is None:
        lines.append("- config.json: none in the folder; the fields below come from the records alone")
    if fid:
        n = len({r["source"] for r in fid})
        tokens = sorted({r["tokens"] for r in fid})
        prefix = cfg.get("prefix_tokens")
        tok = f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
        what = f"{n} source{'s' * (n != 1)} of {tok} tokens"
        if str(cfg.get("source", "")).startswith("text:") and prefix is not None:
            what += f" after a {prefix}-token prefix"
        lines.append(f"- source: `{cfg.get('source', 'unknown')}` ({what})")
    if evals:
        tasks = cfg.get("tasks") or sorted({r["task"] for r in evals})
        lines.append(f"- tasks: {', '.join(tasks)}")
    if cfg.get("model"):
        lines.append(f"- model: `{cfg['model']}` (dtype {cfg.get('dtype', '?')}, attention {cfg.get('attn', '?')})")
    else:
        lines.append("- model: unknown")
    policies = cfg.get("policies") or _order(r["policy"] for r in evals + fid)
    lines.append(f"- policies: {', '.join(f'`{p}`' for p in policies)}")
    recs = [r for r in evals + fid if r["policy"] != "full"] or evals + fid
    sizes = _sizes_text([(r.get("ratio"), r["budget"]) for r in recs])
    lines.append(f"- budgets (tokens kept per KV head, from the records): {sizes}")
    lines.append(f"- buffer: {cfg['buffer']} tokens" if "buffer" in cfg else "- buffer: unknown (no config.json)")
    lines.append(f"- sinks: {_sinks(config)} tokens")
    if "seed" in cfg:
        lines.append(f"- seed: {cfg['seed']}")
    if "seeds" in cfg:
        lines.append(f"- seeds: {', '.join(str(s) for s in cfg['seeds'])}")
    if evals and "max_new_tokens" in cfg:
        lines.append(f"- max new tokens: {cfg['max_new_tokens']}, temperature {cfg.get('temperature', '?')}")
    if cfg.get("plant_layers") and cfg.get("plant_tokens"):
        lines.append(f"- planted value outliers: layers {cfg['plant_layers']}, {cfg['plant_tokens']} tokens")
    lines.append("")
    return lines


def write_report(results: Path, out: Path, against: str | None = None) -> Path:
    """Write ``REPORT.md`` (and PNGs) for the results directory ``results`` into ``out``; returns its path.
    ``against``: the reference policy of the fidelity paired differences (default: the best by mean at each size).

    Raises:
        ValueError: if ``results`` holds neither eval nor fidelity records, or ``against`` is not one of the fidelity
            records' policies.
    """
    from .evaluate import all_records, read_records
    from .fidelity import RECORDS as FIDELITY_RECORDS

    if not results.is_dir():
        raise ValueError(f"results directory not found: {results}")
    evals = all_records(results)
    fid = read_records(results / FIDELITY_RECORDS)
    if not evals and not fid:
        raise ValueError(f"{results} holds no records (records*.jsonl from `vase eval` or fidelity.jsonl)")
    policies = {r["policy"] for r in fid}
    if against is not None and not fid:
        raise ValueError(f"--against {against}: it picks the reference of fidelity records, and {results} has none")
    if against is not None and against not in policies:
        raise ValueError(
            f"--against {against}: no such policy in {results / FIDELITY_RECORDS}; "
            f"policies: {', '.join(_order(policies))}"
        )
    out.mkdir(parents=True, exist_ok=True)
    config = read_config(results)
    lines = header(results, config, evals, fid)
    if evals:
        lines += eval_section(evals, out, config)
    if fid:
        lines += fidelity_section(fid, out, config, against)
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path

"""What the numbers of ``vase report`` mean: the compression of a summary row, the cache sizes a run was measured at
and their labels (the measured compression beside the ratio asked when they differ by more than 5%), the reference
policy of the paired differences, and the best policy at each size or the tie (:func:`vase.harness.stats.rank`).
"""

from __future__ import annotations

from .stats import kl_text, pm, rank

MEASURED_TOLERANCE = 0.05  # a measured compression this far (relative) from the ratio asked is shown in the label


def policy_order(policies) -> list[str]:
    """The distinct ``policies``, ``full`` first, then by name: the order of every table and legend."""
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


def compression(row: dict) -> float:
    """The compression of a summary row, the one definition used by the tables and the plots: full-cache bytes
    (a dense cache holding every prompt and generated token) over the KV bytes the policy's buffers hold, means
    over the row's completions. The ``full`` policy is the reference: 1.0 by definition (its buffers grow in steps
    of the budget, so they may hold a few % more than the dense bytes; that slack is shown as "KV held", not
    counted as compression below 1)."""
    if row["policy"] == "full":
        return 1.0
    return row["kv_bytes_full"] / row["kv_bytes"] if row["kv_bytes"] else float("nan")


def fidelity_sizes(rows: list[dict]) -> dict[tuple, dict]:
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


def references(by: dict[tuple, dict], sizes, policies: list[str], against: str | None = None) -> dict:
    """The reference policy of the paired KL differences at each size (``by``: (policy, size) -> summary row):
    ``against`` where it has a row at that size, or by default the evicting policy (not ``full``) with the lowest
    mean KL there (ties by name); None where there is none."""
    refs = {}
    for s in sizes:
        if against is not None:
            refs[s] = against if (against, s) in by else None
        else:
            cands = [by[(p, s)] for p in policies if p != "full" and (p, s) in by]
            refs[s] = min(cands, key=lambda r: (r["kl"], r["policy"]))["policy"] if cands else None
    return refs


def winner_line(label: str, cands: dict[str, dict]) -> str:
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

"""Means with their standard errors, and paired differences over sources: the one implementation behind
``vase report`` and ``benchmarks/fidelity_table.py``.

Conventions (docs/RESULTS.md): the standard error of a mean is the sample standard deviation over ``sqrt(n)`` (NaN
below two values); a paired difference ``mine - ref`` is taken source by source over the sources both have, and given
as mean +- standard error of those differences, with on how many sources ``mine`` is lower. A difference is "ahead
by more than its error" when its mean is more than one (paired) standard error below zero.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import NamedTuple


def mean_se(values: Iterable[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)) of ``values``; the standard error is
    NaN for a single value.

    Raises:
        ValueError: for no values.
    """
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_se of no values")
    mean = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return mean, se


class Paired(NamedTuple):
    """A paired difference ``mine - ref`` over ``n`` common sources: ``mean`` +- ``se``, and ``lower``: on how many of
    the ``n`` sources ``mine`` is strictly lower."""

    mean: float
    se: float
    n: int
    lower: int

    @property
    def ahead(self) -> bool:
        """``mine`` is lower by more than its error: the mean difference is more than one standard error below 0."""
        return self.mean + self.se < 0

    @property
    def within(self) -> bool:
        """``mine`` is below ``ref`` or less than one standard error above it (a difference the sources cannot tell
        from zero, or better)."""
        return self.mean <= self.se


def paired_diff(mine: Mapping[str, float], ref: Mapping[str, float]) -> Paired | None:
    """The paired difference ``mine[s] - ref[s]`` over the sources ``s`` both mappings have (source id -> value, e.g.
    mean KL in nats): mean, standard error, count and on how many sources ``mine`` is lower; None below 2 common
    sources (no standard error)."""
    common = sorted(set(mine) & set(ref))
    if len(common) < 2:
        return None
    d = [mine[k] - ref[k] for k in common]
    mean, se = mean_se(d)
    return Paired(mean, se, len(d), sum(x < 0 for x in d))


def kl_text(x: float, signed: bool = False) -> str:
    """A KL (nats) for the tables: 4 decimals, or 2 significant digits below 1e-3 (where 2x differences live); ``—``
    for NaN; below 1e-12 in size, 0 (rounding noise, e.g. the standard error of equal differences)."""
    if x != x:
        return "—"
    if abs(x) < 1e-12:
        x = 0.0
    if x == 0 or abs(x) >= 1e-3:
        return f"{x:+.4f}" if signed else f"{x:.4f}"
    return f"{x:+.1e}" if signed else f"{x:.1e}"


def pct_text(x: float, signed: bool = False) -> str:
    """A percentage for the tables: 1 decimal, or 2 significant digits where 1 decimal would round a nonzero value to
    0.0 (below 0.05, e.g. a standard error of 0.03 %), in scientific notation below 1e-3; ``—`` for NaN; below 1e-12
    in size, 0 (rounding noise)."""
    if x != x:
        return "—"
    if abs(x) < 1e-12:
        x = 0.0
    if x == 0 or abs(x) >= 0.05:
        return f"{x:+.1f}" if signed else f"{x:.1f}"
    if abs(x) < 1e-3:
        return f"{x:+.1e}" if signed else f"{x:.1e}"
    decimals = 1 - math.floor(math.log10(abs(x)))  # 2 significant digits: 0.025, 0.0012
    return f"{x:+.{decimals}f}" if signed else f"{x:.{decimals}f}"


def pm(mean: float, se: float, fmt=kl_text, se_fmt=None) -> str:
    """``mean ± se``, the mean written by ``fmt`` (a function of one float, :func:`kl_text` by default) and the
    standard error by ``se_fmt`` (default ``fmt``); the mean alone when the standard error is NaN (one value)."""
    return fmt(mean) if se != se else f"{fmt(mean)} ± {(se_fmt or fmt)(se)}"


def paired_text(diff: Paired | None, unit: str = "sources") -> str:
    """A paired difference as the tables give it: ``+0.0061 ± 0.0030 (lower on 1 of 4 sources)``; ``—`` for None."""
    if diff is None:
        return "—"
    return f"{kl_text(diff.mean, True)} ± {kl_text(diff.se)} (lower on {diff.lower} of {diff.n} {unit})"


class Ranking(NamedTuple):
    """The verdict on which of several policies has the lowest mean: ``best`` (lowest mean), ``winner`` (``best`` when
    it is ahead of every other policy by more than its paired error, else None), ``tied`` (the policies, ``best``
    first, that ``best`` is not ahead of by more than the error; just ``best`` when there is a winner), ``order``
    (all policies by mean) and ``diffs`` (``best`` minus each other policy, None below 2 common sources)."""

    best: str
    winner: str | None
    tied: list[str]
    order: list[str]
    diffs: dict[str, Paired | None]


def rank(values: Mapping[str, Mapping[str, float]]) -> Ranking:
    """Rank policies by the mean over sources of ``values[policy][source]`` (lower is better) and decide whether the
    lowest is ahead: it is named winner only when its paired difference to every other policy (the runner-up
    included) is more than one paired standard error below zero; a policy it cannot be paired with over 2+ sources
    counts as tied.

    Raises:
        ValueError: for no policies, or a policy without values.
    """
    if not values:
        raise ValueError("rank of no policies")
    means = {p: mean_se(v.values())[0] for p, v in values.items()}
    order = sorted(means, key=lambda p: (means[p], p))
    best = order[0]
    diffs = {p: paired_diff(values[best], values[p]) for p in order[1:]}
    tied = [best] + [p for p in order[1:] if diffs[p] is None or not diffs[p].ahead]
    winner = best if len(tied) == 1 else None
    return Ranking(best, winner, tied, order, diffs)

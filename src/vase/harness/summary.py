"""The summary of an accuracy sweep's records (:mod:`vase.harness.evaluate`): pass@1, loop rates and their
standard errors per (task, policy, budget, ratio)."""

from __future__ import annotations

import math
import statistics


def loop_flags(rec: dict) -> tuple[bool, bool | None]:
    """(loop, paper regex loop) of a record, from :mod:`vase.harness.loops`.

    Recomputed from the record's text by the current detectors when the record holds ``text`` and ``finished`` (so
    a report follows detector changes without generating again); otherwise the stored ``loop`` and ``paper_loop``
    fields (``paper_loop`` None for records written before it existed).
    """
    from .loops import loop_flag, paper_loop

    if isinstance(rec.get("text"), str) and "finished" in rec:
        return loop_flag(rec["text"], bool(rec["finished"])), paper_loop(rec["text"])
    paper = rec.get("paper_loop")
    return bool(rec["loop"]), None if paper is None else bool(paper)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, policy, budget, ratio): pass@1 and its standard error (over problems, in %), loop rate
    (%, :func:`vase.harness.loops.loop_flag`), paper regex loop rate (%, :func:`vase.harness.loops.paper_loop`;
    None when a record predates it), share of completions cut by the token limit (%), mean generated tokens, mean KV
    bytes held and a full cache's, completions and problems counted. Loop flags come from :func:`loop_flags`
    (recomputed from the stored text). ``loop_se``: the loop rate's standard error over problems (%, like pass@1's
    ``se``: of the per-problem loop rates; NaN for one problem). ``score`` / ``score_se``: the synthetic long-context
    tasks' mean share of reference values found (RULER's ``string_match_all``, %) and its standard error over
    problems; None for tasks without a score."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["policy"], r["budget"], r.get("ratio")), []).append(r)
    rows = []
    for (task, policy, budget, ratio), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        per_problem: dict[str, list[bool]] = {}
        for r in recs:
            per_problem.setdefault(r["problem_id"], []).append(bool(r["correct"]))
        means = [sum(v) / len(v) for v in per_problem.values()]
        acc = 100 * sum(means) / len(means)
        se = 100 * statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else float("nan")
        flags = [loop_flags(r) for r in recs]
        papers = [p for _, p in flags]
        loops_of: dict[str, list[bool]] = {}
        for r, (loop, _) in zip(recs, flags):
            loops_of.setdefault(r["problem_id"], []).append(bool(loop))
        loop_means = [sum(v) / len(v) for v in loops_of.values()]
        loop_se = 100 * statistics.stdev(loop_means) / math.sqrt(len(loop_means)) if len(loop_means) > 1 else math.nan
        finished = [r.get("finished") for r in recs]
        rows.append(
            {
                "task": task,
                "policy": policy,
                "budget": budget,
                "ratio": ratio,
                "pass1": acc,
                "se": se,
                "loop_rate": 100 * sum(loop for loop, _ in flags) / len(recs),
                "loop_se": loop_se,
                "paper_loop_rate": None if None in papers else 100 * sum(papers) / len(recs),
                "limit_rate": None if None in finished else 100 * sum(not f for f in finished) / len(recs),
                "mean_tokens": sum(r["new_tokens"] for r in recs) / len(recs),
                "kv_bytes": sum(r["kv_bytes"] for r in recs) / len(recs),
                "kv_bytes_full": sum(r["kv_bytes_full"] for r in recs) / len(recs),
                "completions": len(recs),
                "problems": len(means),
                **_score(recs),
            }
        )
    return rows


def _score(recs: list[dict]) -> dict:
    """Mean score (%) and its standard error over problems, of records that have a ``score`` (synthetic tasks)."""
    if any(r.get("score") is None for r in recs):
        return {"score": None, "score_se": None}
    per: dict[str, list[float]] = {}
    for r in recs:
        per.setdefault(r["problem_id"], []).append(float(r["score"]))
    means = [sum(v) / len(v) for v in per.values()]
    se = 100 * statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else math.nan
    return {"score": 100 * sum(means) / len(means), "score_se": se}

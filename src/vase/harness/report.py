"""``vase report RESULTS_DIR``: markdown tables and PNG plots from ``vase eval`` and ``vase fidelity`` results.

The report opens with a header of what decides the numbers (source or tasks, model, policies, the budgets replayed,
buffer, sinks; from the folder's ``config.json`` and the records), so that two runs that differ only there cannot be
confused. Every mean comes with its standard error over sources (fidelity) or problems (eval); fidelity tables add,
beside a reference policy, the paired difference of each policy's KL over the sources both have
(:mod:`vase.harness.stats`), and a best policy is named only when it is ahead of every other by more than one paired
standard error (:mod:`vase.harness.ranking`). A size whose measured compression differs from the ratio asked by more
than 5% is labelled with both. The plots: :mod:`vase.harness.plots`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..core.sizes import DEFAULT_SINKS
from .plots import eval_figure, fidelity_figure, save
from .ranking import compression, fidelity_sizes, policy_order, references, size_label, winner_line
from .stats import kl_text, paired_diff, paired_text, pct_text, pm

MIB = 2.0**20


def _fmt_size(row: dict) -> str:
    """The cache size of an eval summary row (:func:`~vase.harness.ranking.size_label` with
    :func:`~vase.harness.ranking.compression` as the measure)."""
    if row.get("ratio") is None:
        return f"budget {row['budget']}"
    if row["policy"] == "full":
        return "full cache"
    return size_label(row["ratio"], compression(row), [row["budget"]])


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _signed_pct(x: float) -> str:
    return pct_text(x, signed=True)


def _one(x: float) -> str:
    return f"{x:.1f}"


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


def eval_section(records: list[dict], out: Path, config: dict | None = None) -> list[str]:
    """Accuracy table (compression, pass@1 +- standard error, loop rates, share cut by the token limit, mean length,
    KV memory) and plots, per task. Loop flags are recomputed from the stored text
    (:func:`vase.harness.evaluate.loop_flags`). ``config``: the run's configuration (:func:`read_config`), for the
    plot titles and the buffer warning."""
    from .evaluate import summarize

    rows = summarize(records)
    lines = scores_table(rows)
    buffer = (config or {}).get("buffer")
    for task in sorted({r["task"] for r in rows}):
        trows = [r for r in rows if r["task"] == task]
        lines += accuracy_table(trows) + [""]
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
        name = "eval_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", task) + ".png"  # ruler:niah@4k: no colon in a file name
        save(fig, out / name)
        lines += [f"![{task} accuracy and loop rate]({name})", ""]
    return lines


def accuracy_table(rows: list[dict]) -> list[str]:
    """The accuracy table of one task, as the report gives it: a title, then a row per policy and size (compression,
    pass@1 ± standard error, score ± standard error for synthetic tasks, loop rates, share cut by the token limit,
    mean tokens, KV memory held and a full cache's in MiB, completions). ``rows``: :func:`vase.harness.evaluate.
    summarize`'s rows of that one task."""
    task = rows[0]["task"]
    n_problems = max(r["problems"] for r in rows)
    scored = all(r.get("score") is not None for r in rows)
    lines = [
        f"### {task}: accuracy ({n_problems} problems)",
        "",
        "| policy | cache size | compression | pass@1 (%) |"
        + (" score (%) |" if scored else "")
        + " loop rate (%) | paper regex loop rate (%) | cut at limit (%) | mean tokens | KV held (MiB) "
        "| full cache (MiB) | completions |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if scored else ""),
    ]
    for r in sorted(rows, key=lambda r: (r["policy"] != "full", r["policy"], r.get("ratio") or 0, r["budget"])):
        score = f" {pm(r['score'], r['score_se'], _one)} |" if scored else ""
        lines.append(
            f"| {r['policy']} | {_fmt_size(r)} | {compression(r):.2f}x | {pm(r['pass1'], r['se'], _one)} |{score} "
            f"{pm(r['loop_rate'], r.get('loop_se', math.nan), _one)} | {_pct(r['paper_loop_rate'])} | "
            f"{_pct(r['limit_rate'])} | "
            f"{r['mean_tokens']:.0f} | {r['kv_bytes'] / MIB:.2f} | {r['kv_bytes_full'] / MIB:.2f} | "
            f"{r['completions']} |"
        )
    return lines


def eval_summary(records: list[dict]) -> list[str]:
    """What ``vase eval`` prints when it ends: the tables :func:`eval_section` opens with (the synthetic tasks'
    score table when any task has scores, then each task's accuracy table), without the notes and plots. Empty for
    no records."""
    from .evaluate import summarize

    rows = summarize(records)
    lines = scores_table(rows)
    for task in sorted({r["task"] for r in rows}):
        lines += accuracy_table([r for r in rows if r["task"] == task]) + [""]
    return lines


def scores_table(rows: list[dict]) -> list[str]:
    """The synthetic long-context tasks side by side: score (%, mean share of reference values found ± its standard
    error over problems) per policy and compression ratio (rows) and task (columns), with the mean over tasks. Empty
    when no task has scores."""
    scored = [r for r in rows if r.get("score") is not None]
    tasks = sorted({r["task"] for r in scored})
    if not tasks:
        return []
    cells: dict[tuple, dict] = {}
    for r in scored:
        size = None if r["policy"] == "full" else (r.get("ratio"), None if r.get("ratio") else r["budget"])
        cells.setdefault((r["policy"], size), {})[r["task"]] = r
    lines = [
        "### Long-context tasks: score (%)",
        "",
        "| policy | cache size | " + " | ".join(tasks) + " | mean |",
        "|---|---|" + "---|" * (len(tasks) + 1),
    ]
    for (policy, size), by_task in sorted(cells.items(), key=lambda kv: (kv[0][0] != "full", kv[0][0], kv[0][1])):
        label = "full cache" if size is None else (f"{size[0]:g}x" if size[0] else f"budget {size[1]}")
        got = [by_task[t]["score"] for t in tasks if t in by_task]
        mean = f"{sum(got) / len(got):.1f}" if len(got) == len(tasks) else "-"
        row = [pm(by_task[t]["score"], by_task[t]["score_se"], _one) if t in by_task else "-" for t in tasks]
        lines.append(f"| {policy} | {label} | " + " | ".join(row) + f" | {mean} |")
    lines += [
        "",
        "Score: the share of the reference values found in the answer (RULER's string_match_all), ± its standard "
        "error over problems; pass@1 in the tables below counts an answer correct only when it holds all of them.",
        "",
    ]
    return lines


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
    sizes = fidelity_sizes(rows)
    policies = policy_order(r["policy"] for r in rows)
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
        # percentages near 0 (the standard errors, the perplexity change at low compression) keep 2 significant
        # digits: at 1 decimal, two sources 0.06 % apart read "± 0.0"
        ("top-1 agreement with the full cache, % (higher is better)", "top1", _one, pct_text),
        (
            "perplexity change of the continuation vs the full cache, % (lower is better)",
            "ppl_change",
            _signed_pct,
            pct_text,
        ),
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

    kept_rows = [p for p in policies if any(by.get((p, s), {}).get("kept_share") is not None for s in sizes)]
    if kept_rows:  # confidence step budgets: what the rule kept, against the nominal budget of the size's label
        lines += [
            "Entries kept after each eviction by the confidence step budget, % of the budget (mean over evictions, "
            "layers, KV heads and sources; the budget is what the size's label and compression count):",
            "",
            "| policy | " + " | ".join(label(s) for s in sizes) + " |",
            "|---" * (len(sizes) + 1) + "|",
        ]
        for p in kept_rows:
            cells = [_one(by[(p, s)]["kept_share"]) if by.get((p, s), {}).get("kept_share") is not None else "—"
                     for s in sizes]  # fmt: skip
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")

    # paired differences to the reference
    evicting = [p for p in policies if p != "full"]
    refs = references(by, sizes, policies, against)
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
            lines.append(winner_line(label(s), cands))
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
        source = cfg.get("source") or "source unknown"
        title = (
            f"{_short_source(source)} · {cfg.get('model') or 'model unknown'} · "
            f"{n_sources} source{'s' * (n_sources != 1)} × {tok} tokens"
        )
        fig = fidelity_figure(rows, sizes, title)
        save(fig, out / "fidelity.png")
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
    policies = cfg.get("policies") or policy_order(r["policy"] for r in evals + fid)
    lines.append(f"- policies: {', '.join(f'`{p}`' for p in policies)}")
    if cfg.get("sources"):  # vase analyze: the fidelity run whose sources it replays
        lines.append(f"- sources: those of `{cfg['sources']}`, ratios {', '.join(f'{r:g}x' for r in cfg['ratios'])}")
    recs = [r for r in evals + fid if r["policy"] != "full"] or evals + fid
    if recs:
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
    from .mechanism import RECORDS as MECHANISM_RECORDS

    if not results.is_dir():
        raise ValueError(f"results directory not found: {results}")
    evals = all_records(results)
    fid = read_records(results / FIDELITY_RECORDS)
    mech = read_records(results / MECHANISM_RECORDS)
    if not evals and not fid and not mech:
        raise ValueError(
            f"{results} holds no records (records*.jsonl from `vase eval`, fidelity.jsonl or analysis.jsonl)"
        )
    policies = {r["policy"] for r in fid}
    if against is not None and not fid:
        raise ValueError(f"--against {against}: it picks the reference of fidelity records, and {results} has none")
    if against is not None and against not in policies:
        raise ValueError(
            f"--against {against}: no such policy in {results / FIDELITY_RECORDS}; "
            f"policies: {', '.join(policy_order(policies))}"
        )
    out.mkdir(parents=True, exist_ok=True)
    config = read_config(results)
    lines = header(results, config, evals, fid)
    if evals:
        from .dynamics import dynamics_section

        lines += eval_section(evals, out, config)
        lines += dynamics_section(evals, out)
    if fid:
        lines += fidelity_section(fid, out, config, against)
    if mech:
        from .mechanism_report import analysis_section

        lines += analysis_section(mech, out)
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path

"""`vase report`: standard errors, paired differences and the winner-or-tie sentence; labels with the measured
compression; the header from config.json; plots with error bars, fixed colors, plain ticks and informative titles."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from vase.cli import app
from vase.harness import report
from vase.harness.fidelity import summarize
from vase.harness.plots import POLICY_COLORS, policy_styles
from vase.harness.ranking import size_label
from vase.harness.report import write_report
from vase.harness.stats import kl_text, mean_se, paired_diff, pct_text, pm, rank

# Four sources of 64 + 448 = 512 tokens. At 4x the budget is 128 (compression 4.0); at 8x the floor sinks + buffer + 1
# = 69 gives compression 512 / 69 = 7.42, 7% short of the 8x asked.
SOURCES = ["s0", "s1", "s2", "s3"]
KL = {
    (4.0, "vase"): [0.02, 0.03, 0.04, 0.03],  # mean 0.03, ahead of h2o by 0.0100 ± 0.0020 (4 of 4 sources)
    (4.0, "h2o"): [0.03, 0.045, 0.05, 0.035],
    (4.0, "snapkv"): [0.05, 0.06, 0.08, 0.05],
    (8.0, "vase"): [0.10, 0.12, 0.08, 0.12],  # mean 0.105, below h2o's 0.11 by 0.0050 ± 0.0087: a tie
    (8.0, "h2o"): [0.12, 0.10, 0.09, 0.13],
    (8.0, "snapkv"): [0.20, 0.22, 0.18, 0.22],
}
BUDGET = {4.0: 128, 8.0: 69}


def fid_records(ratios=(4.0, 8.0)) -> list[dict]:
    recs = []
    for ratio in ratios:
        for policy in ("full", "vase", "h2o", "snapkv"):
            for i, src in enumerate(SOURCES):
                kl = 0.0 if policy == "full" else KL[(ratio, policy)][i]
                recs.append(
                    dict(
                        source=src,
                        policy=policy,
                        budget=BUDGET[ratio],
                        ratio=ratio,
                        compression=512 / BUDGET[ratio],
                        prompt_tokens=64,
                        tokens=448,
                        kl_mean=kl,
                        top1=1 - 2 * kl,
                        ppl_change=kl,
                        buckets=[{"start": 0, "end": 448, "kl": kl, "top1": 1 - 2 * kl}],
                    )
                )
    return recs


def fid_dir(tmp_path, records=None, config=True):
    run = tmp_path / "run"
    run.mkdir()
    recs = fid_records() if records is None else records
    (run / "fidelity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if config:
        cfg = dict(
            model="smollm2",
            dtype="auto",
            attn="sdpa",
            policies=["vase", "h2o", "snapkv", "full"],
            buffer=64,
            source="text:/data/book.txt",
            prompts=4,
            tokens=448,
            prefix_tokens=64,
            ratios=[4.0, 8.0],
            budgets=[],
            seed=0,
        )
        (run / "config.json").write_text(json.dumps(cfg))
    return run


# --- the statistics ---------------------------------------------------------------------------------------------


def test_mean_se_and_paired_difference_over_the_common_sources():
    mean, se = mean_se([0.02, 0.03, 0.04, 0.03])
    assert mean == pytest.approx(0.03) and se == pytest.approx(math.sqrt(2e-4 / 3) / 2)
    assert math.isnan(mean_se([0.5])[1])
    with pytest.raises(ValueError):
        mean_se([])
    mine = {"a": 1.0, "b": 2.0, "c": 3.0, "only-mine": -100.0}
    ref = {"a": 2.0, "b": 2.5, "c": 2.0, "only-ref": 100.0}
    d = paired_diff(mine, ref)  # over a, b, c: -1, -0.5, +1
    assert d.n == 3 and d.lower == 2
    assert d.mean == pytest.approx(-0.5 / 3)
    assert d.se == pytest.approx(mean_se([-1.0, -0.5, 1.0])[1])
    assert not d.ahead and d.within
    assert paired_diff({"a": 1.0}, {"a": 2.0, "b": 0.0}) is None  # one common source: no error
    assert kl_text(7.6e-5) == "7.6e-05" and kl_text(-0.0124, True) == "-0.0124" and kl_text(1e-18) == "0.0000"
    assert pm(0.03, 0.0040825) == "0.0300 ± 0.0041" and pm(0.03, math.nan) == "0.0300"


def test_rank_names_a_winner_only_ahead_of_every_policy_by_more_than_the_error():
    by = {p: dict(zip(SOURCES, KL[(4.0, p)])) for p in ("vase", "h2o", "snapkv")}
    r = rank(by)
    assert (r.winner, r.tied, r.order) == ("vase", ["vase"], ["vase", "h2o", "snapkv"])
    assert r.diffs["h2o"].mean == pytest.approx(-0.01) and r.diffs["h2o"].se == pytest.approx(0.0020412, abs=1e-7)
    by = {p: dict(zip(SOURCES, KL[(8.0, p)])) for p in ("vase", "h2o", "snapkv")}
    r = rank(by)
    assert r.winner is None and r.tied == ["vase", "h2o"] and r.best == "vase"
    assert r.diffs["h2o"].lower == 3 and r.diffs["h2o"].se == pytest.approx(0.0086603, abs=1e-7)


def test_fidelity_summary_has_standard_errors_budgets_and_per_source_values():
    rows = {(r["policy"], r["ratio"]): r for r in summarize(fid_records())}
    r = rows[("h2o", 4.0)]
    assert r["kl"] == pytest.approx(0.04) and r["kl_se"] == pytest.approx(0.0045644, abs=1e-7)
    assert r["top1"] == pytest.approx(92.0) and r["top1_se"] == pytest.approx(0.91287, abs=1e-5)
    assert r["ppl_change_se"] == pytest.approx(0.45644, abs=1e-5)
    assert r["kl_by_source"] == dict(zip(SOURCES, KL[(4.0, "h2o")]))
    assert rows[("vase", 8.0)]["budgets"] == [69] and rows[("vase", 8.0)]["compression"] == pytest.approx(512 / 69)


# --- the report -------------------------------------------------------------------------------------------------


def test_report_header_tables_paired_differences_and_verdicts(tmp_path):
    text = write_report(fid_dir(tmp_path), tmp_path / "out").read_text()
    # the header: what decides the numbers, from config.json and the records
    for line in (
        "- source: `text:/data/book.txt` (4 sources of 448 tokens after a 64-token prefix)",
        "- model: `smollm2` (dtype auto, attention sdpa)",
        "- budgets (tokens kept per KV head, from the records): 4x → 128, 8x → 69",
        "- buffer: 64 tokens",
        "- sinks: 4 tokens",
    ):
        assert line + "\n" in text
    # the measured compression where it differs from the ratio asked by more than 5%
    assert "| policy | 4x (budget 128) | 8x asked, 7.4x measured (budget 69) |" in text
    # means ± standard errors over sources
    assert "| vase | 0.0300 ± 0.0041 | 0.1050 ± 0.0096 |" in text
    assert "| h2o | 0.0400 ± 0.0046 | 0.1100 ± 0.0091 |" in text
    assert "| h2o | 92.0 ± 0.9 | 78.0 ± 1.8 |" in text  # top-1 %
    # paired differences to the best by mean at each size, and on how many sources lower
    assert "| policy | 4x (budget 128) vs `vase` | 8x asked, 7.4x measured (budget 69) vs `vase` |" in text
    assert "| h2o | +0.0100 ± 0.0020 (lower on 0 of 4 sources) | +0.0050 ± 0.0087 (lower on 1 of 4 sources) |" in text
    assert "| vase | reference | reference |" in text
    # a winner at 4x, a tie at 8x
    assert (
        "- 4x (budget 128): **vase** (KL 0.0300 ± 0.0041), ahead of every other policy by more than one paired "
        "standard error; next h2o (0.0400 ± 0.0046): vase − h2o = -0.0100 ± 0.0020, lower on 4 of 4 sources"
    ) in text
    assert (
        "- 8x asked, 7.4x measured (budget 69): no single best, tied within one paired standard error: "
        "vase (0.1050 ± 0.0096), h2o (0.1100 ± 0.0091); vase − h2o = -0.0050 ± 0.0087, lower on 3 of 4 sources; "
        "behind them: snapkv (0.2050 ± 0.0096)"
    ) in text
    # the policy chooses 69 - 4 - 64 = 1 token at 8x: warned under the KL table; 128 - 68 = 60 at 4x is not
    assert (
        "**Warning**, 8x asked, 7.4x measured (budget 69): the policy chooses only 1 of the 69 tokens kept (budget − 4 "
        "sinks − 64 buffer), fewer than a quarter: small runs are dominated by the buffer"
    ) in text
    assert "**Warning**, 4x" not in text


def test_perplexity_change_over_two_sources_keeps_its_standard_error(tmp_path):
    """Two sources whose perplexity changes differ (0.01 % and 0.07 %): mean 0.04 %, standard error = sample standard
    deviation / √2 = half their difference, 0.03 %; the table gives both instead of rounding them to 0.0."""
    recs = []
    for src, ppl, top1 in (("s0", 0.0001, 0.9999), ("s1", 0.0007, 0.9995)):
        for policy in ("full", "h2o"):
            change, agree = (0.0, 1.0) if policy == "full" else (ppl, top1)
            bucket = {"start": 0, "end": 448, "kl": 1e-4, "top1": agree}
            recs.append(
                dict(source=src, policy=policy, budget=256, ratio=2.0, compression=2.0, prompt_tokens=64, tokens=448,
                     kl_mean=0.0 if policy == "full" else 1e-4, top1=agree, ppl_change=change, buckets=[bucket])
            )  # fmt: skip
    row = {r["policy"]: r for r in summarize(recs)}["h2o"]
    assert row["ppl_change"] == pytest.approx(0.04) and row["ppl_change_se"] == pytest.approx(0.03)
    assert row["top1_se"] == pytest.approx(0.02)
    text = write_report(fid_dir(tmp_path, recs), tmp_path / "out").read_text()
    assert "| h2o | +0.040 ± 0.030 |" in text and "| full | +0.0 ± 0.0 |" in text  # perplexity change, %
    assert "| h2o | 100.0 ± 0.020 |" in text  # top-1 agreement, %: 99.97
    assert [pct_text(x) for x in (0.9129, 0.03, 0.0012, 5e-4, 0.0, 1e-13, math.nan)] == [
        "0.9", "0.030", "0.0012", "5.0e-04", "0.0", "0.0", "—"
    ]  # fmt: skip
    assert (pct_text(-0.04, signed=True), pct_text(2.44, signed=True)) == ("-0.040", "+2.4")


def test_report_against_a_chosen_reference(tmp_path):
    run = fid_dir(tmp_path)
    text = write_report(run, tmp_path / "out", against="h2o").read_text()
    assert "| policy | 4x (budget 128) vs `h2o` | 8x asked, 7.4x measured (budget 69) vs `h2o` |" in text
    assert "| vase | -0.0100 ± 0.0020 (lower on 4 of 4 sources) | -0.0050 ± 0.0087 (lower on 3 of 4 sources) |" in text
    assert "| h2o | reference | reference |" in text
    with pytest.raises(ValueError, match="--against tova: no such policy.*policies: full, h2o, snapkv, vase"):
        write_report(run, tmp_path / "out", against="tova")
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "cli"), "--against", "snapkv"])
    assert result.exit_code == 0, result.output
    assert "| vase | -0.0300 ± 0.0041 (lower on 4 of 4 sources) |" in (tmp_path / "cli" / "REPORT.md").read_text()


def test_report_shows_what_a_confidence_budget_kept(tmp_path):
    """Records with ``kept_share`` (a confidence step budget's fidelity run) add a table of the entries kept after each
    eviction, % of the budget: the mean over sources."""
    recs = fid_records()
    for i, r in enumerate(r for r in recs if r["policy"] == "vase"):
        r["kept_share"] = [0.5, 0.7, 0.9, 0.7][i % 4] if r["ratio"] == 4.0 else 1.1
        r["kept_mean"] = r["kept_share"] * r["budget"]
    text = write_report(fid_dir(tmp_path, recs), tmp_path / "out").read_text()
    assert "Entries kept after each eviction by the confidence step budget, % of the budget" in text
    assert "| vase | 70.0 | 110.0 |" in text
    assert "| h2o | " in text and "| h2o | 70" not in text  # only the policies that have the field
    assert summarize(recs)[0]["kept_share"] is None  # the others: none


def test_report_header_without_config_and_labels_within_tolerance(tmp_path):
    text = write_report(fid_dir(tmp_path, config=False), tmp_path / "out").read_text()
    assert "- config.json: none in the folder; the fields below come from the records alone" in text
    assert "- buffer: unknown (no config.json)" in text and "**Warning**" not in text
    assert size_label(8.0, 7.7, [70]) == "8x (budget 70)"  # 3.8% short: within 5%
    assert size_label(8.0, 4.64, [69]) == "8x asked, 4.6x measured (budget 69)"
    assert size_label(4.0, 3.9, [83, 93]) == "4x (budget 83-93)"
    assert size_label(None, 4.5, [128]) == "budget 128 (4.5x measured)"


# --- the plots --------------------------------------------------------------------------------------------------


def _capture(monkeypatch, name):
    figs = []
    made = getattr(report, name)

    def keep(*args, **kwargs):
        figs.append(made(*args, **kwargs))
        return figs[-1]

    monkeypatch.setattr(report, name, keep)
    return figs


def _plain_labels(fig, ax) -> list[str]:
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    assert ax.yaxis.get_offset_text().get_text() == "" and ax.xaxis.get_offset_text().get_text() == ""
    assert not any("e" in t or "10^" in t or "×" in t for t in labels), labels
    return labels


def test_fidelity_plot_error_bars_colors_measured_x_title_and_plain_ticks(tmp_path, monkeypatch):
    figs = _capture(monkeypatch, "fidelity_figure")
    write_report(fid_dir(tmp_path), tmp_path / "out")
    assert (tmp_path / "out" / "fidelity.png").stat().st_size > 1000
    (fig,) = figs
    assert fig.get_suptitle() == "text:book.txt · smollm2 · 4 sources × 448 tokens"
    kl_ax, top1_ax = fig.axes[:2]
    series = {c.get_label(): c for c in kl_ax.containers}
    assert set(series) == {"vase", "h2o", "snapkv"}  # full is the reference, not plotted
    vase = series["vase"]
    assert vase.has_yerr
    assert list(vase.lines[0].get_xdata()) == pytest.approx([4.0, 512 / 69])  # the measured compression
    (bars,) = vase.lines[2]
    heights = [seg[1][1] - seg[0][1] for seg in bars.get_segments()]
    assert heights == pytest.approx([2 * 0.0040825, 2 * 0.0095743], abs=1e-6)  # ± one standard error
    colors = {p: c.lines[0].get_color() for p, c in series.items()}
    assert colors == {p: POLICY_COLORS[p] for p in colors} and len(set(colors.values())) == 3
    assert kl_ax.get_xlim() == pytest.approx((0.0, 1.1 * 512 / 69))
    assert kl_ax.get_yscale() == "linear" and kl_ax.get_ylim()[0] == 0.0  # KLs within 20x of each other
    _plain_labels(fig, kl_ax)
    _plain_labels(fig, top1_ax)


def test_fidelity_plot_of_one_ratio_has_a_sensible_x_range(tmp_path, monkeypatch):
    figs = _capture(monkeypatch, "fidelity_figure")
    recs = [dict(r, budget=64, compression=8.0) for r in fid_records(ratios=(8.0,))]
    write_report(fid_dir(tmp_path, records=recs), tmp_path / "out")
    (fig,) = figs
    ax = fig.axes[0]
    assert ax.get_xlim() == pytest.approx((0.0, 8.8))  # not 7.6-8.4 around the one point
    labels = _plain_labels(fig, ax)
    assert "0" in labels and "8" in labels


def test_policy_styles_are_fixed_and_distinguishable():
    one = policy_styles(["h2o", "snapkv", "vase"])
    two = policy_styles(["full", "snapkv", "tova", "vase:recent=32", "h2o:guard=range"])
    assert one["snapkv"] == two["snapkv"]  # the same in every plot
    assert one["h2o"]["color"] != one["snapkv"]["color"] and one["h2o"]["marker"] != one["snapkv"]["marker"]
    colors = [s["color"] for s in two.values()]
    assert len(set(colors)) == len(colors)  # variants get their own colors, dashed
    assert two["vase:recent=32"]["linestyle"] == "--" and two["vase:recent=32"]["color"] != POLICY_COLORS["vase"]


def test_eval_plot_has_error_bars_on_both_panels_and_a_title(tmp_path, monkeypatch):
    from tests.harness.test_evaluate import LOOP_TEXT, PROSE_TEXT, eval_record

    figs = _capture(monkeypatch, "eval_figure")
    run = tmp_path / "run"
    run.mkdir()
    recs = [
        eval_record(p, pid, ok, text=LOOP_TEXT if loop else PROSE_TEXT)
        for p in ("vase", "h2o")
        for pid, ok, loop in (("a", True, False), ("b", False, True), ("c", True, True))
    ]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "config.json").write_text(json.dumps({"model": "smollm2", "buffer": 64, "tasks": ["gsm8k"]}))
    text = write_report(run, tmp_path / "out").read_text()
    assert "- tasks: gsm8k" in text and "- buffer: 64 tokens" in text
    assert "| h2o | budget 128 | 4.00x | 66.7 ± 33.3 | 66.7 ± 33.3 |" in text  # loop rate ± s.e. over problems
    # budget 128 - 4 sinks - 64 buffer = 60 chosen: not under a quarter, no warning
    assert "**Warning**" not in text
    (fig,) = figs
    assert fig.get_suptitle() == "gsm8k · smollm2 · 3 problems"
    for ax in fig.axes[:2]:
        assert {c.get_label() for c in ax.containers} == {"vase", "h2o"}
        assert all(c.has_yerr for c in ax.containers)
        _plain_labels(fig, ax)

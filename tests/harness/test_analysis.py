"""The quantities of the sampling-mechanism analysis (vase.harness.analysis) on hand-made runs, kept sets, attention
and keys: exact values."""

from __future__ import annotations

import math

import pytest
import torch

from vase.harness.analysis import attention_recall, ensemble_kl, hold_stats, kept_overlap, key_diversity, settled_at


def test_ensemble_kl_of_runs_and_of_their_mixture():
    full = torch.tensor([[0.5, 0.5]]).log()
    runs = torch.tensor([[[0.9, 0.1]], [[0.1, 0.9]]]).log()  # each far off, their mixture exact
    out = ensemble_kl(full, runs)
    one = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert out["runs"] == pytest.approx([one, one]) and out["mean_run"] == pytest.approx(one)
    assert out["mixture"] == pytest.approx(0.0, abs=1e-7) and out["gain"] == pytest.approx(0.0, abs=1e-6)
    same = ensemble_kl(full, torch.stack([runs[0], runs[0]]))
    assert same["mixture"] == pytest.approx(one) and same["gain"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"runs must be \[S, T, V\]"):
        ensemble_kl(full, runs[0])


def test_hold_stats_count_survival_age_and_starvation():
    t, f = True, False
    held = [
        torch.tensor([t, t, f, t, t]),  # eviction 0 at 5 positions: position 2 dropped at once
        torch.tensor([t, t, f, t, f, t, t]),  # eviction 1: 4 dropped, 5 and 6 new and kept
        torch.tensor([t, f, f, t, f, f, t, t]),  # eviction 2: 1 and 5 dropped, 7 new
    ]
    out = hold_stats(held, first=1)  # position 0 is a sink
    assert out["survived"].tolist() == [0, 2, 0, 3, 1, 1, 2, 1]
    # ages: eviction 0 keeps 1, 3, 4 (n=5): 4, 2, 1; eviction 1 keeps 1, 3, 5, 6 (n=7): 6, 4, 2, 1; eviction 2
    # keeps 3, 6, 7 (n=8): 5, 2, 1
    assert out["age"] == pytest.approx([7 / 3, 13 / 4, 8 / 3])
    assert out["held_at_end"] == pytest.approx(3 / 7)
    assert out["dropped_first"] == pytest.approx(1 / 7)  # position 2 of 1..7
    # a recent window of 2: positions take part once older than it; the newest two are kept by rule
    windowed = hold_stats(held, first=1, recent=2)
    # eviction 0 decides 1, 2 (kept, dropped); eviction 1 decides 3, 4 (kept, dropped) and keeps 1; eviction 2
    # decides 5 (dropped), drops 1 and keeps 3
    assert windowed["survived"].tolist() == [0, 2, 0, 2, 0, 0, 0, 0]
    assert windowed["dropped_first"] == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="at least as long"):
        hold_stats([held[1], held[0]])


def test_attention_recall_and_overlap():
    attn = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.2, 0.2, 0.2, 0.4]])
    held = torch.tensor([True, False, True, False])
    assert attention_recall(attn, held) == pytest.approx((0.75 + 0.4) / 2)
    assert attention_recall(attn * 2, held) == pytest.approx((0.75 + 0.4) / 2), "renormalized over the positions"
    with pytest.raises(ValueError, match="attention over 4 positions, held set over 3"):
        attention_recall(attn, held[:3])
    after = torch.tensor([True, False, False, False, True])
    assert kept_overlap(held, after) == pytest.approx(0.5)
    assert math.isnan(kept_overlap(torch.zeros(3, dtype=torch.bool), after))
    assert settled_at([0.5, 1.0, 0.9, 1.0, 1.0]) == 3
    assert settled_at([1.0, 1.0]) == 0 and settled_at([1.0, 0.5]) is None


def test_key_diversity():
    ortho = torch.eye(3) * 2
    d = key_diversity(ortho)
    assert d["cosine_distance"] == pytest.approx(1.0) and d["logdet"] == pytest.approx(math.log(1 + 1e-4))
    copies = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    c = key_diversity(copies)
    assert c["cosine_distance"] == pytest.approx(0.0)
    # Gram [[1, 1], [1, 1]] + eps I: determinant (1 + eps)^2 - 1 = 2 eps + eps^2
    assert c["logdet"] == pytest.approx(math.log(2e-4 + 1e-8) / 2)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert key_diversity(opposite)["cosine_distance"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="m >= 2"):
        key_diversity(torch.ones(1, 4))


def test_analyze_run_on_hand_made_sources(tmp_path):
    """`vase analyze` end to end on a tiny model: one record per (source, policy, ratio); a top-k policy runs once, a
    sampled one per seed; each run's KL is the fidelity replay's; the full cache's attention rows sum to one and
    its keys are the model's; a second run resumes with nothing to do; the report has the tables and the plot."""
    import json

    from tests.conftest import random_ids, tiny_lm, tiny_model
    from vase.core.config import VaseConfig
    from vase.harness.fidelity import compare, replay
    from vase.harness.mechanism import AnalyzeConfig, full_reference, held_masks, run_analysis
    from vase.harness.report import write_report
    from vase.hf.models import LoadedModel

    fid = tmp_path / "fid"
    fid.mkdir()
    (fid / "config.json").write_text(json.dumps({"model": "tiny", "policies": ["vase"], "buffer": 16}))
    ids = random_ids(208, seed=3)[0].tolist()
    (fid / "sources.jsonl").write_text(json.dumps({"id": "s0", "prompt": ids[:8], "continuation": ids[8:]}) + "\n")
    lm = tiny_lm()
    eager = LoadedModel(tiny_model(attn="eager"), lm.tokenizer, "tiny", lm.device, lm.dtype)  # the same weights
    cfg = AnalyzeConfig(
        model="tiny", sources=str(fid), policies=["snapkv", "vase"], ratios=[4.0], seeds=[0, 1], buffer=16, ks=[1, 16]
    )
    out = tmp_path / "mech"
    path = run_analysis(cfg, out, progress=False, lm=lm, eager=eager)
    recs = {r["policy"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert recs["snapkv"]["seeds"] == 1 and recs["vase"]["seeds"] == 2 and recs["vase"]["budget"] == 52
    prompt, cont = torch.tensor(ids[:8]), torch.tensor(ids[8:])
    full = replay(lm.model, prompt, cont, "full", budget=300, buffer=16)
    for policy, rec in recs.items():
        c = VaseConfig.resolve(policy, budget=52, buffer=16)
        for seed, kl in zip([0, 1], rec["kl"]):
            assert kl == pytest.approx(
                compare(full, replay(lm.model, prompt, cont, config=c, seed=seed), cont, 64)["kl_mean"]
            )
        assert rec["evictions"] > 5 and 0 < rec["recall"]["1"] <= 1 and 0 <= rec["dropped_first"] <= 1
        assert 0 <= rec["overlap"] <= 1 and rec["held_at_end"] == pytest.approx(60 / 203, rel=0.15)
    attn, keys = full_reference(eager.model, torch.tensor(ids[:-1]))
    assert attn.shape == (2, 2, 207, 207) and torch.allclose(attn.sum(-1), torch.ones(2, 2, 207), atol=1e-5)
    assert keys.shape == (2, 2, 207, 16)
    # what held_masks reads: the live positions of each (layer, KV head)
    _, cache = replay(lm.model, prompt, cont, config=VaseConfig.resolve("snapkv", budget=52, buffer=16), record=True)
    held = held_masks(cache, 207)
    pos = cache.layers[1].positions[0]
    assert held[1].sum(-1).tolist() == (pos >= 0).sum(-1).tolist()
    assert held[1, 0].nonzero().flatten().tolist() == sorted(pos[0][pos[0] >= 0].tolist())
    n = len(path.read_text().splitlines())
    run_analysis(cfg.model_copy(update={"prompts": 1}), out, progress=False, lm=lm, eager=eager)  # same run
    assert len(path.read_text().splitlines()) == n == 2
    report = write_report(out, out).read_text()
    assert "### Mechanism at 4x (1 sources)" in report and "| snapkv | 1 |" in report and "| vase | 2 |" in report
    assert (out / "analysis_recall.png").exists()


def test_analyze_refuses_bad_input_before_loading(tmp_path):
    from typer.testing import CliRunner

    from vase.cli import app

    (tmp_path / "fid").mkdir()
    (tmp_path / "fid" / "config.json").write_text("{}")
    runner = CliRunner()
    for args, message in (
        ([str(tmp_path / "none")], "is not a `vase fidelity` results folder"),
        ([str(tmp_path / "fid")], "holds no sources.jsonl"),
        ([str(tmp_path / "fid"), "--prompts", "0"], "--prompts must be >= 1"),
    ):
        res = runner.invoke(app, ["analyze", *args, "--out", str(tmp_path / "out")])
        assert res.exit_code != 0 and message in res.output, res.output
    assert not (tmp_path / "out").exists()

"""``vase train-scorer`` and the trainer behind it (:mod:`vase.harness.learned`): deterministic with a seed, the
stack it feeds (learned score x value guard x sampling x confidence budget) running in the cache, the command end to
end on the embedded model, bad input refused before the model loads."""

from __future__ import annotations

import json

import torch

import vase
from tests.conftest import random_ids, tiny_lm, tiny_model
from tests.core.test_learned import _generate
from vase.core.learned import FEATURES, LearnedWeights

torch.set_num_threads(1)


def test_training_is_deterministic_and_the_stack_runs(tmp_path):
    """`train_scorer` on hand-made sources with a tiny eager model: the same seed gives the same file, another seed
    another split; the file drives the stack (learned x guard x sampling x confidence budget) in the cache, whose
    scores are the exponential of the linear prediction."""
    from vase.harness.learned import TrainConfig, full_entries, train_scorer
    from vase.hf.models import LoadedModel

    fid = tmp_path / "fid"
    fid.mkdir()
    (fid / "config.json").write_text(json.dumps({"model": "tiny", "policies": ["vase"], "buffer": 16}))
    with (fid / "sources.jsonl").open("w") as fh:
        for i in range(2):
            ids = random_ids(200, seed=10 + i)[0].tolist()
            fh.write(json.dumps({"id": f"s{i}", "prompt": ids[:8], "continuation": ids[8:]}) + "\n")
    lm = tiny_lm()
    eager = LoadedModel(tiny_model(attn="eager"), lm.tokenizer, "tiny", lm.device, lm.dtype)
    cfg = TrainConfig(sources=str(fid), model="tiny", window=16, k=16, stride=16, samples=32, buffer=16, sinks=2)
    one = LearnedWeights.load(train_scorer(cfg, tmp_path / "a.pt", lm=eager, progress=False))
    two = LearnedWeights.load(train_scorer(cfg, tmp_path / "b.pt", lm=eager, progress=False))
    other = LearnedWeights.load(train_scorer(cfg.model_copy(update={"seed": 1}), tmp_path / "c.pt", lm=eager))
    for name in ("mean", "std", "weight", "bias"):
        assert torch.equal(getattr(one, name), getattr(two, name))
    assert not torch.equal(one.weight, other.weight)
    assert one.layer_ids == [0, 1] and one.weight.shape == (2, 2, len(FEATURES)) and one.window == 16
    # 2 sources of 199 tokens x checkpoints t = 32, 48, ..., 176 x 32 draws of the candidates (t - 16 - 2 of them)
    assert one.info["samples_per_head"] == 2 * sum(min(32, t - 18) for t in range(32, 199 - 16 + 1, 16))
    assert -1.0 < one.info["held_out_r2_mean"] <= 1.0
    attn, keys, values = full_entries(eager.model, random_ids(20, seed=1)[0])
    assert attn.shape == (2, 2, 20, 20) and values.shape == keys.shape == (2, 2, 20, 16)

    stack = f"learned:weights={tmp_path / 'a.pt'}:window=16:guard=range:selector=sample:step_budget=confidence"
    pol = vase.make_policy(stack)
    assert "learned score (a.pt" in pol.describe() and "confidence step budgets" in pol.describe()
    tokens, cache = _generate(tiny_model(), stack, random_ids(30, seed=6), n=60)
    assert cache.stats().evictions >= 5 and len(tokens) == 90


def test_train_scorer_command_end_to_end_and_refusals(tmp_path, embedded):
    """`vase train-scorer` on a fidelity folder of the embedded model writes weights the policy loads; bad input is
    one line before the model loads."""
    from typer.testing import CliRunner

    from vase.cli import app

    runner = CliRunner()
    fid = tmp_path / "fid"
    fid.mkdir()
    (fid / "config.json").write_text(json.dumps({"model": "smollm2", "policies": ["vase"], "buffer": 16}))
    ids = embedded.tokenizer("To be, or not to be, that is the question: " * 12)["input_ids"][:150]
    (fid / "sources.jsonl").write_text(json.dumps({"id": "t0", "prompt": ids[:10], "continuation": ids[10:]}) + "\n")
    for args, message in (
        ([str(tmp_path / "none")], "is not a `vase fidelity` results folder"),
        ([str(fid), "--prompts", "0"], "--prompts must be >= 1"),
        ([str(fid), "--out", str(tmp_path)], "is a folder"),
    ):
        full = [*args, "--out", str(tmp_path / "w.pt")] if "--out" not in args else args
        res = runner.invoke(app, ["train-scorer", *full])
        assert res.exit_code != 0 and message in res.output, res.output
    res = runner.invoke(
        app,
        ["train-scorer", str(fid), "--out", str(tmp_path / "w.pt"), "--window", "16", "-k", "16", "--stride", "16"],
    )
    assert res.exit_code == 0, res.output
    assert "samples per (layer, KV head)" in res.output and "learned:weights=" in res.output
    w = LearnedWeights.load(tmp_path / "w.pt")
    assert w.model == "smollm2" and len(w.layer_ids) == embedded.model.config.num_hidden_layers
    spec = f"learned:weights={tmp_path / 'w.pt'}:window=16"
    cache = vase.EvictingCache(embedded.model, policy=spec, budget=64, buffer=16)
    assert cache.policy.scorer.weights is not None

"""The measurement harness as a researcher meets it: every option checked before any work, no folder written by a
run that cannot start, budgets and ratios as expected, run-time warnings for labels and weak settings, clear help."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_lm as _tiny_lm
from tests.harness.test_cli_errors import _error, no_loading, task_file  # noqa: F401  (fixtures)
from tests.harness.test_outliers import CharTokenizer
from vase.cli import app
from vase.harness.fidelity import FidelityConfig, run_fidelity
from vase.harness.notes import VaseWarning

runner = CliRunner()


def tiny_lm():
    """The tiny random model with a character tokenizer, for text sources."""
    lm = _tiny_lm()
    lm.tokenizer = CharTokenizer()
    return lm


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "32", "--ratios", ""], "budget (32) must be larger than sinks + buffer (4 + 64 = 68)"),
        (["--source", "text:nothere.txt"], "text file not found: nothere.txt"),
        (["--source", "nothere.jsonl"], "data file not found: nothere.jsonl"),
        (["--device", "cuda"], "CUDA is not available here"),
        (["--policies", "snapvk"], "unknown policy 'snapvk' (did you mean 'snapkv'?)"),
        (["--prompts", "0"], "--prompts must be >= 1, got 0"),
        (["--tokens", "1"], "--tokens must be >= 2, got 1"),
        (["--ratios", "0.5"], "compression ratio must be > 1"),
        (["--policies", "h2o:recent=200", "--tokens", "256"], "recent (200) + sinks (4) must be below the budget"),
        (["--policies", "vase:preset=paper", "--window", "8"], "No such option"),
        (["--ratios", ""], "--ratios is empty and no --budgets are given: give at least one ratio or budget"),
        (["--source", "gsm9k"], "data file not found: gsm9k (known task names: gsm8k"),
        (["--source", "text:/tmp"], "/tmp is a folder: --source text:PATH takes a plain text file"),
    ],
)
def test_fidelity_checks_every_option_before_any_work(no_loading, tmp_path, task_file, args, message):  # noqa: F811
    """A bad option fails in a second, before the model loads or any trace is generated, and writes nothing."""
    out = tmp_path / "f"
    if message == "No such option":  # typer's own error for an unknown flag
        result = runner.invoke(app, ["fidelity", "--out", str(out), *args])
        assert result.exit_code == 2 and message in result.output
        return
    source = [] if "--source" in args else ["--source", str(task_file)]
    assert message in _error(["fidelity", "--out", str(out), *source, *args], no_loading)
    assert not out.exists()


def test_failed_run_leaves_no_folder_and_the_corrected_command_runs(tmp_path, text_file):
    """A source that fails after the model loaded (too short for the tokens asked) writes nothing, so the corrected
    command starts instead of being refused as 'another configuration'."""
    lm, out = tiny_lm(), tmp_path / "run"
    bad = FidelityConfig(
        model="tiny", source=f"text:{text_file}", policies=["vase"], prompts=1, tokens=5000, ratios=[2.0], buffer=8
    )
    with pytest.raises(ValueError, match="fewer than prefix \\+ tokens = 5064: lower --tokens"):
        run_fidelity(bad, out, progress=False, lm=lm)
    assert not out.exists()
    good = bad.model_copy(update={"tokens": 100})
    records = [json.loads(x) for x in run_fidelity(good, out, progress=False, lm=lm).read_text().splitlines()]
    assert len(records) == 1 and records[0]["policy"] == "vase"


def test_another_configuration_names_every_field_that_differs(tmp_path, text_file):
    lm, out = tiny_lm(), tmp_path / "run"
    first = FidelityConfig(
        model="tiny", source=f"text:{text_file}", policies=["vase"], prompts=1, tokens=60, ratios=[2.0], buffer=8
    )
    run_fidelity(first, out, progress=False, lm=lm)
    other = first.model_copy(update={"prompts": 2, "tokens": 80})
    with pytest.raises(ValueError) as err:
        run_fidelity(other, out, progress=False, lm=lm)
    assert "prompts: 1 there, 2 now; tokens: 60 there, 80 now" in str(err.value)


def test_budgets_replace_the_default_ratios(monkeypatch, tmp_path):
    assert FidelityConfig(policies=["vase"]).ratios == [2.0, 4.0, 8.0]
    assert FidelityConfig(policies=["vase"], budgets=[200]).ratios == []
    assert FidelityConfig(policies=["vase"], budgets=[200], ratios=[4.0]).ratios == [4.0]
    seen = []
    monkeypatch.setattr("vase.harness.fidelity.run_fidelity", lambda config, out, device: seen.append(config) or out)
    result = runner.invoke(app, ["fidelity", "--out", str(tmp_path / "f"), "--budgets", "200"])
    assert result.exit_code == 0, result.output
    assert seen[0].budgets == [200] and seen[0].ratios == []
    help_text = runner.invoke(app, ["fidelity", "--help"], env={"COLUMNS": "300"}).output
    assert "default 2,4,8 when no --budgets are given" in help_text


def test_run_warns_when_a_ratio_cannot_be_met_or_the_buffer_dominates(tmp_path, text_file):
    """8x on 276-token windows with buffer 64: the floor sinks + buffer + 1 = 69 gives 4x; the policy then chooses
    one token of 69. Both are said at run time, and the records keep what was measured."""
    lm = tiny_lm()
    cfg = FidelityConfig(
        model="tiny",
        source=f"text:{text_file}",
        policies=["vase"],
        prompts=1,
        tokens=256,
        prefix_tokens=20,
        ratios=[8.0],
        buffer=64,
    )
    with pytest.warns(VaseWarning) as caught:
        path = run_fidelity(cfg, tmp_path / "run", progress=False, lm=lm)
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("ratio 8x asked, 4.00x measured over 1 source (budget 69") for m in messages)
    assert any("the policy chooses only 1 of the 69 tokens kept" in m for m in messages)
    rec = json.loads(path.read_text().splitlines()[0])
    assert rec["ratio"] == 8.0 and rec["budget"] == 69 and rec["compression"] == pytest.approx(276 / 69)


def test_cli_shows_warnings_and_says_how_to_resume(monkeypatch, tmp_path):
    def interrupted(config, out, device):
        import warnings

        warnings.warn("ratio 8x asked, 4.00x measured", VaseWarning, stacklevel=1)
        raise KeyboardInterrupt

    monkeypatch.setattr("vase.harness.fidelity.run_fidelity", interrupted)
    result = runner.invoke(app, ["fidelity", "--out", str(tmp_path / "f"), "--ratios", "8"])
    assert result.exit_code == 130
    assert "[vase] warning: ratio 8x asked, 4.00x measured" in result.stderr
    assert "interrupted: the traces and records written so far are saved; run the same command again to resume" in (
        result.stderr
    )


def test_help_texts_describe_every_option():
    out = runner.invoke(app, ["report", "--help"], env={"COLUMNS": "300"}).output
    assert "default: the results directory itself" in out and "default: RESULTS" not in out
    out = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "300"}).output
    for text in ("question field of JSONL tasks", "reference answer field", "tokens generated at most per completion"):
        assert text in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--generate", "-1"], "--generate must be >= 0 and --top >= 1, got -1 and 5"),
        (["--top", "0"], "--generate must be >= 0 and --top >= 1, got 0 and 0"),
        (["--device", "cuda"], "CUDA is not available here"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_inspect_checks_its_options_before_loading(no_loading, tmp_path, args, message):  # noqa: F811
    assert message in _error(["inspect", "hello", "--out", str(tmp_path / "i"), *args], no_loading)

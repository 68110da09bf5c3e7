"""Bad input at the command line: every option's range is checked before anything is loaded (one line, exit 2)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vase.cli import app
from vase.cli.generation import _prompt_text

runner = CliRunner()


@pytest.fixture
def no_loading(monkeypatch):
    """Record (and refuse) any model load or benchmark run: the checks must come first."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append((args, kwargs))
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("vase.hf.models.load_model", refuse)
    monkeypatch.setattr("vase.harness.bench.run_bench", refuse)
    return calls


def _error(args, calls, **kw) -> str:
    """Run the CLI in-process; expect exit code 2, no traceback, one ``error:`` line and no model loaded."""
    result = runner.invoke(app, args, **kw)
    assert calls == [], "a model was loaded before the options were checked"
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "2"], "top_p must be in (0, 1] (1 = off), got 2.0"),
        (["--top-p", "0"], "top_p must be in (0, 1] (1 = off), got 0.0"),
        (["--top-k", "-1"], "top_k must be an integer >= 0 (0 = off), got -1"),
        (["--temperature", "-0.5"], "temperature must be >= 0 (0 = greedy), got -0.5"),
        (["--temperature", "nan"], "temperature must be >= 0 (0 = greedy), got nan"),
        (["-n", "0"], "max_new_tokens must be >= 1, got 0"),
        (["-n", "8", "--min-new-tokens", "9"], "min_new_tokens must be in [0, max_new_tokens = 8], got 9"),
        (["--min-new-tokens", "-1"], "min_new_tokens must be in [0, max_new_tokens = 512], got -1"),
        (["--budget", "60"], "budget (60) must be larger than sinks + buffer (4 + 64 = 68)"),
        (["--budget", "40", "--buffer", "16", "--sinks", "30"], "budget (40) must be larger than sinks + buffer"),
        (["--buffer", "2000"], "budget (1024) must be larger than sinks + buffer (4 + 2000 = 2004)"),
        (["--budget", "256", "--ratio", "4"], "give either a budget or a compression ratio, not both"),
        (["--ratio", "1"], "compression ratio must be > 1"),
        (
            ["--policy", "vase:preset=paper", "--budget", "1000"],
            "the published method (vase:preset=paper) needs a budget that is a multiple of the buffer (64); got 1000: "
            "use 960 or 1024",
        ),
        (["--policy", "vase:temperature=0.5"], "the policy option 'temperature' is ambiguous"),
        (["--ratio", "0.5"], "compression ratio must be > 1"),
        (["--buffer", "0"], "buffer must be >= 1 token, got 0"),
        (["--sinks", "-1"], "sinks must be >= 0 tokens, got -1"),
        (["--window", "0"], "window must be a positive number of queries, got 0"),
        (["--protect-share", "1.5"], "protected share must be in [0, 1), got 1.5"),
        (["--policy", "nope"], "unknown policy 'nope'; valid policies: full, streaming_llm"),
        (["--dtype", "float8"], "unknown dtype 'float8'"),
        (["--attn", "flash", "--device", "cpu"], "unknown attention implementation 'flash'"),
        (["--attn", "flash_attention_2", "--device", "cpu"], "flash_attention_2 needs a CUDA device"),
        (["--template", "poem"], "unknown template 'poem'; choose auto, math, mcq or none"),
        (["--policy", "quest", "--compile"], "compiled decoding does not support the selection policy 'quest'"),
    ],
)
def test_generate_option_ranges(no_loading, args, message):
    assert message in _error(["generate", "hi", *args], no_loading)


def test_generate_checks_options_before_reading_stdin(no_loading):
    """A bad option fails at once, even when the prompt would come from stdin."""
    assert "top_p must be in (0, 1]" in _error(["generate", "--top-p", "2"], no_loading, input="a prompt\n")


def test_demo_checks_options_before_loading(no_loading):
    assert "budget (50) must be larger than sinks + buffer (4 + 64 = 68)" in _error(
        ["demo", "--budget", "50"], no_loading
    )
    assert "max_new_tokens must be >= 1, got 0" in _error(["demo", "-n", "0"], no_loading)


def test_prompt_from_closed_stdin(monkeypatch):
    """No stdin at all (sys.stdin is None): a clear error rather than an AttributeError."""
    monkeypatch.setattr(sys, "stdin", None)
    for prompt in (None, "-"):
        with pytest.raises(ValueError, match="no prompt: standard input is closed"):
            _prompt_text(prompt, None, 0, None, "auto")


def test_generate_with_stdin_closed_in_a_shell():
    """`vase generate -n 5 <&-` exits 2 with one line, not a traceback."""
    command = f"{shlex.quote(sys.executable)} -m vase.cli generate -n 5 <&-"
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: no prompt: standard input is closed; pass the prompt as an argument or use --data FILE --index N"
    )


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    return path


def test_eval_out_is_a_file(no_loading, tmp_path, task_file):
    out = tmp_path / "results.txt"
    out.write_text("not a folder\n")
    line = _error(["eval", "--out", str(out), "--tasks", str(task_file), "--budgets", "128"], no_loading)
    assert line == (
        f"error: {out} cannot be a results directory: {out} is a file; give a new folder, or the folder of an "
        "earlier run to resume it"
    )
    inside = out / "sub"  # checked before the task files are read: a missing one is not the error reported
    line = _error(["eval", "--out", str(inside), "--tasks", str(tmp_path / "no.jsonl"), "--budgets", "128"], no_loading)
    assert f"{inside} cannot be a results directory: {out} is a file" in line
    assert out.read_text() == "not a folder\n"


def test_merge_into_a_file(no_loading, tmp_path):
    dest = tmp_path / "merged"
    dest.write_text("x")
    src = tmp_path / "shard"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"policies": ["vase"], "tasks": ["gsm8k"], "budgets": [128]}))
    assert f"{dest} cannot be a results directory: {dest} is a file" in _error(
        ["merge", str(dest), str(src)], no_loading
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "2"], "top_p must be in (0, 1] (1 = off), got 2.0"),
        (["--top-k", "-3"], "top_k must be an integer >= 0 (0 = off), got -3"),
        (["--temperature", "-1"], "temperature must be >= 0 (0 = greedy), got -1.0"),
        (["-n", "0"], "max_new_tokens must be >= 1, got 0"),
        (["--budgets", "64"], "budget (64) must be larger than sinks + buffer (4 + 64 = 68)"),
        (["--budgets", "128", "--buffer", "0"], "buffer must be >= 1 token, got 0"),
        (["--ratios", "0.5"], "compression ratio must be > 1, got 0.5"),
        (["--budgets", "128", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--budgets", "128", "--limit", "0"], "--limit must be >= 1 problem, got 0"),
        (["--budgets", "128", "--seeds", ""], "--seeds is empty: give at least one value"),
        (["--budgets", "128", "--policies", "vase:protect_share=2"], "protected share must be in [0, 1), got 2"),
        (["--budgets", "128", "--dtype", "int3"], "unknown dtype 'int3'"),
        ([], "give at least one budget or compression ratio"),
    ],
)
def test_eval_option_ranges(no_loading, tmp_path, task_file, args, message):
    line = _error(["eval", "--out", str(tmp_path / "out"), "--tasks", str(task_file), *args], no_loading)
    assert message in line
    assert not (tmp_path / "out").exists()  # nothing written either


@pytest.mark.parametrize(
    "args, message",
    [
        (["sweep", "--budgets", "10", "--buffer", "8"], "budget (10) must be larger than sinks + buffer (4 + 8 = 12)"),
        (["sweep", "--lengths", "0,64"], "--lengths must be positive token counts, got '0,64'"),
        (["sweep", "--budgets", ""], "--budgets is empty: give at least one budget"),
        (["sweep", "--policies", "snap"], "unknown policy 'snap'"),
        (["paired", "--budget", "256", "--context", "200"], "--context >= budget + buffer (256 + 64)"),
        (["paired", "--steps", "0"], "vase bench paired needs --steps >= 1"),
        (["profile", "--budget", "50"], "budget (50) must be larger than sinks + buffer (4 + 64 = 68)"),
        (["sweep", "--device", "tpu"], "invalid device 'tpu'"),
        (["compiled", "--contexts", "100"], "vase bench compiled needs --contexts of at least 130 tokens"),
        (["compiled", "--policies", "vase,quest"], "vase bench compiled: the selection policy quest has no compiled"),
        (["compiled", "--budget", "50"], "budget (50) must be larger than sinks + buffer (4 + 64 = 68)"),
    ],
)
def test_bench_option_ranges(no_loading, tmp_path, args, message):
    mode, *rest = args
    out = [] if mode == "profile" else ["--out", str(tmp_path / "b")]  # profile writes nothing
    assert message in _error(["bench", mode, *out, *rest], no_loading)


def test_bench_out_is_a_file(no_loading, tmp_path):
    out = tmp_path / "bench.txt"
    out.write_text("")
    for mode in ("sweep", "paired", "compiled"):
        assert f"--out {out} is a file, not a folder" in _error(["bench", mode, "--out", str(out)], no_loading)


@pytest.mark.parametrize(
    "args, replacement",
    [
        (["--paired"], "vase bench paired"),
        (
            ["--paired", "--policies", "full,vase", "--paired-budget", "512", "--context=4096"],
            "vase bench paired --policies full,vase --budget 512 --context 4096",
        ),
        (
            ["--compile", "--contexts", "1024", "--paired-budget", "300"],
            "vase bench compiled --contexts 1024 --budget 300",
        ),
        (
            ["--profile", "--policies", "vase,h2o", "--profile-budget", "512"],
            "vase bench profile --policies vase,h2o --budget 512",
        ),
        (["--out", "runs/b", "--lengths", "24,48"], "vase bench sweep --out runs/b --lengths 24,48"),
        (["--paired", "--compile"], "vase bench compiled"),  # --compile took precedence
    ],
)
def test_bench_old_flags_name_the_subcommand(no_loading, args, replacement):
    """`vase bench --paired ...` (the modes were flags of one command): one line with the command that replaces it."""
    line = _error(["bench", *args], no_loading)
    assert line == (
        f"error: the modes of vase bench are subcommands now: run `{replacement}`; `vase bench --help` lists the modes"
    )


def test_bench_old_flags_leave_out_what_the_mode_never_used(no_loading):
    line = _error(["bench", "--profile", "--out", "x", "--lengths", "8", "--steps", "3"], no_loading)
    assert line == (
        "error: the modes of vase bench are subcommands now: run `vase bench profile` (left out, not options of "
        "vase bench profile: --out, --lengths, --steps); `vase bench --help` lists the modes"
    )


def test_bench_alone_runs_the_default_sweep(monkeypatch):
    """`vase bench` (`make bench`) is `vase bench sweep` with its defaults."""
    seen = []

    def record(*args, **kwargs):
        seen.append((args, kwargs))
        raise ValueError("recorded")

    monkeypatch.setattr("vase.harness.bench.run_bench", record)
    for args in (["bench"], ["bench", "sweep"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and result.stderr == "error: recorded\n", result.output
    default = (
        (Path("runs/bench"), ["streaming_llm", "snapkv", "rkv", "vase", "vase_dkv"], [256, 512, 1024]),
        [1024, 2048, 4096, 8192],
        {"buffer": 64, "model": None, "device": "auto"},
    )
    assert [(a[:3], a[3], k) for a, k in seen] == [default, default]


@pytest.mark.parametrize(
    "mode, options",
    [
        ("sweep", {"--out", "--lengths", "--policies", "--budgets", "--buffer", "--model", "--device", "--help"}),
        (
            "paired",
            {"--out", "--policies", "--budget", "--context", "--steps", "--buffer", "--model", "--device", "--help"},
        ),
        (
            "compiled",
            {"--out", "--policies", "--budget", "--contexts", "--steps", "--backend", "--buffer", "--model", "--device"}
            | {"--help"},
        ),
        ("profile", {"--policies", "--budget", "--buffer", "--model", "--device", "--help"}),
    ],
)
def test_bench_mode_help_shows_only_its_options(mode, options):
    out = runner.invoke(app, ["bench", mode, "--help"], env={"COLUMNS": "300"}).output
    assert set(re.findall(r"(--[a-z][a-z-]*)", out.split("Options")[1])) == options, out


def test_bench_mode_help_keeps_sentences_whole():
    from vase.cli import bench

    assert [info.name for info in bench.app.registered_commands] == ["sweep", "paired", "compiled", "profile"]
    for info in bench.app.registered_commands:
        assert "\n" not in info.help.replace("\n\n", ""), info.name


def test_top_help_lists_the_commands():
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "300"}).output
    listed = re.findall(r"^│ ([a-z]+) ", out.split("Commands")[1], flags=re.M)
    assert listed == [
        "policies",
        "generate",
        "demo",
        "eval",
        "merge",
        "fidelity",
        "analyze",
        "inspect",
        "report",
        "bench",
        "convert",
    ]
    out = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "300"}).output
    assert re.findall(r"^│ ([a-z]+) ", out.split("Commands")[1], flags=re.M) == [
        "sweep",
        "paired",
        "compiled",
        "profile",
    ]


def test_fidelity_planting_needs_layers_and_tokens(no_loading, tmp_path):
    for extra in (["--plant-layers", "4"], ["--plant-tokens", "3"]):
        msg = _error(["fidelity", "--out", str(tmp_path / "f"), *extra], no_loading)
        assert "planting value outliers needs both --plant-layers and --plant-tokens (> 0)" in msg


def test_command_help_keeps_sentences_whole():
    """typer keeps the line breaks of a docstring's later paragraphs; the help joins them, so a sentence wrapped in
    the source (vase demo, vase fidelity) is not shown broken."""
    runner = CliRunner()
    for info in app.registered_commands:
        assert "\n" not in info.help.replace("\n\n", ""), info.callback.__name__
    out = runner.invoke(app, ["fidelity", "--help"], env={"COLUMNS": "300"}).output
    assert "planted (the same in the reference and the policies) and the records say" in out

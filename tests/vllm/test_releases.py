"""vase on vLLM's previous CPU release too (``.venv-vllm-0.31.0``, ``make vllm-old``): the tested range of
:data:`vase.vllm.seam.TESTED` holds both releases, and on each the same engines give the same tokens.

The ``exact`` scenario's engines (plain vLLM and three configurations that evict: greedy ``snapkv``, sampled ``vase``,
a prompt compressed at prefill, the published preset with its dense prompt) on the embedded model, run in each release's
environment one after the other: every output is the same, token for token, and every engine evicted as often.
Skipped, with the reason, without ``.venv-vllm-0.31.0``.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.vllm.test_vllm import (
    BUDGET,
    BUFFER,
    NEW,
    ROOT,
    SEEDS,
    SINKS,
    VLLM_PY,
    _run_script,
    chat_prompts,
    converted_model,
    needs_vllm,
)

OLD = ROOT / ".venv-vllm-0.31.0" / "bin" / "python"
needs_old = pytest.mark.skipif(
    not OLD.exists(), reason=".venv-vllm-0.31.0 is absent: `make vllm-old` builds it (vLLM's previous CPU release)"
)
pytestmark = [needs_vllm, needs_old, pytest.mark.slow]


def _engines() -> list[dict]:
    sizes = {"budget": BUDGET, "buffer": BUFFER, "sinks": SINKS}
    return [
        {"name": "plain", "vase": None},
        *[{"name": p, "vase": {"policy": p, **sizes}, "seeds": SEEDS} for p in ("snapkv", "vase")],
        {"name": "paper", "vase": {"policy": "vase:preset=paper", **sizes, "budget": 112}, "seeds": SEEDS},
    ]


def test_both_releases_give_the_same_tokens(tmp_path):
    from transformers import AutoTokenizer

    model = converted_model()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model))
    job = {"model": str(model), "prompts": prompts, "max_tokens": NEW, "engines": _engines()}
    runs = {}
    for name, python in (("new", VLLM_PY), ("old", OLD)):
        folder = tmp_path / name
        folder.mkdir()
        runs[name] = _run_script("exact", job, folder, python=python)
    for engine in runs["new"]:
        new, old = runs["new"][engine], runs["old"][engine]
        assert old["outputs"] == new["outputs"], engine
        if engine != "plain":
            assert old["stats"]["worker"]["rows_evicted"] == new["stats"]["worker"]["rows_evicted"] >= 6, engine


def test_the_old_release_is_in_the_tested_range():
    code = "from vase.vllm import seam; print(seam.installed_version()); print(seam.problems())"
    env = {k: v for k, v in os.environ.items() if k != "VASE_ALLOW_UNTESTED_VLLM"}
    out = subprocess.run([str(OLD), "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    version, found = out.stdout.strip().splitlines()[-2:]
    assert version == "0.31.0" and found == "[]", out.stdout

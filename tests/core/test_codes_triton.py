"""The Triton kernel of decode attention over quantized codes equals the torch implementation and the dequantized
reference, on CPU through Triton's interpreter: the cases (tests/core/triton_cases.py) run in a child process started
with ``TRITON_INTERPRET=1``, since Triton reads it when it is first imported. Skipped where triton is not installed
(the ``test`` extra has it on Linux x86-64)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_triton_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/core/triton_cases.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "21 passed" in run.stdout, run.stdout[-2000:]

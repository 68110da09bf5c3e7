"""The seam between vase and vLLM's internals (:mod:`vase.vllm.seam`): every vLLM name vase uses beyond vLLM's
documented extension points is imported through it, and the installed vLLM is checked against what vase was tested
with (its release, the names, the signatures of the methods vase overrides or calls).

The import rule and the check's logic need no vLLM (the module's own source, stand-in targets from the standard
library); the contract itself is checked against the installed vLLM in ``.venv-vllm`` (skipped without it).
"""

from __future__ import annotations

import ast
import logging
import subprocess
from pathlib import Path

import pytest

from tests.vllm.test_vllm import VLLM_PY, needs_vllm
from vase.vllm import seam

PACKAGE = Path(seam.__file__).parent
# vLLM's documented extension points, the only vLLM imports allowed outside the seam: module -> names
EXTENSION_POINTS = {
    "vllm.v1.attention.backends.registry": {"AttentionBackendEnum", "register_backend"},  # the backend registry
    "vllm.v1.sample.logits_processor": {"BatchUpdate", "LogitsProcessor"},  # logits processors
}


def _vllm_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every import from vLLM in ``path`` (a module's source)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"]
    return out


def test_vllm_internals_are_named_in_the_seam_only():
    """Outside ``seam.py`` a module of ``vase.vllm`` imports vLLM only at a documented extension point; what it
    takes from the seam is a name the seam lists (so the contract check covers it)."""
    outside = []
    taken = set()
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "seam.py":
            continue
        for line, module, name in _vllm_imports(path):
            if name not in EXTENSION_POINTS.get(module, ()):
                outside.append(f"{path.name}:{line}: from {module} import {name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "seam" and node.level == 1:
                taken |= {a.name for a in node.names}
    assert not outside, "vLLM internals imported outside vase.vllm.seam:\n" + "\n".join(outside)
    assert taken, "no module imports through the seam"
    own = {n for n, v in vars(seam).items() if callable(v) and getattr(v, "__module__", "") == seam.__name__}
    assert taken <= set(seam.NAMES) | own, sorted(taken - set(seam.NAMES) - own)
    assert not _vllm_imports(PACKAGE / "seam.py")  # the seam resolves its names lazily: importing it imports no vLLM


def test_every_signature_belongs_to_a_listed_name():
    assert all(key.split(".")[0] in seam.NAMES for key in seam.SIGNATURES)


def test_differences_name_what_moved():
    """Stand-in targets from the standard library: a missing module, a missing attribute, a signature that changed
    are each named; what is as recorded is not."""
    names = {"dumps": "json:dumps", "Path": "pathlib:Path", "gone": "no_such_module_here:thing"}
    signatures = {
        "dumps": ("obj", "skipkeys", "ensure_ascii", "check_circular", "allow_nan", "cls", "indent", "separators",
                  "default", "sort_keys", "kw"),
        "Path.with_suffix": ("self", "name"),  # it takes (self, suffix)
        "Path.no_such_method": ("self",),
    }  # fmt: skip
    found = seam.differences(names, signatures)
    assert any("no_such_module_here:thing is missing" in d for d in found)
    assert "pathlib:Path.with_suffix takes (self, suffix), tested with (self, name)" in found
    assert any("pathlib:Path.no_such_method is missing" in d for d in found)
    assert not any(d.startswith("json:dumps") for d in found)
    assert len(found) == 3


def test_release_range():
    assert seam.in_range("0.32.0", ("0.31.0", "0.32.0")) and seam.in_range("0.31.0", ("0.31.0", "0.32.0"))
    assert not seam.in_range("0.33.0", ("0.31.0", "0.32.0")) and not seam.in_range("0.30.2", ("0.31.0", "0.32.0"))
    assert seam.in_range("0.32.0rc1", ("0.32.0", "0.32.0"))


def test_outside_the_range_an_engine_is_refused_unless_opted_in(monkeypatch, caplog):
    """An installed release outside the tested range: one error naming it, the range and the first internal that
    differs; with ``VASE_ALLOW_UNTESTED_VLLM=1`` a warning instead; loading the plugin only warns."""
    from vase.vllm.settings import VaseConfigError

    monkeypatch.setattr(seam, "installed_version", lambda: "0.34.0")
    monkeypatch.setattr(seam, "differences", lambda: ["vllm.x:Scheduler.schedule takes (self), tested with (self, a)"])
    monkeypatch.delenv(seam.ALLOW_ENV, raising=False)
    with pytest.raises(VaseConfigError) as exc:
        seam.check(strict=True)
    text = str(exc.value)
    assert "vLLM 0.34.0 is installed" in text and f"tested with vLLM {seam.TESTED[0]} to {seam.TESTED[1]}" in text
    assert "first internal that differs: vllm.x:Scheduler.schedule takes (self)" in text and seam.ALLOW_ENV in text
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.vase"):
        assert seam.check(strict=False) is False
        monkeypatch.setenv(seam.ALLOW_ENV, "1")
        assert seam.check(strict=True) is False
    assert sum("vLLM 0.34.0 is installed" in r.getMessage() for r in caplog.records) == 2
    monkeypatch.setattr(seam, "installed_version", lambda: seam.TESTED[1])
    monkeypatch.setattr(seam, "differences", lambda: [])
    assert seam.check(strict=True) is True


@needs_vllm
def test_the_installed_vllm_is_as_tested():
    """Against the installed vLLM (``.venv-vllm``): the release is in the tested range, every name resolves and
    every signature is the recorded one."""
    code = (
        "from vase.vllm import seam; print(seam.installed_version()); print(seam.problems()); print(seam.differences())"
    )
    out = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    version, found, diffs = out.stdout.strip().splitlines()[-3:]
    assert seam.in_range(version) and found == "[]" and diffs == "[]", out.stdout

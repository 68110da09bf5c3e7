"""The package's layers and what may import what (docs/ARCHITECTURE.md), checked on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vase"

# layer -> the vase layers its modules may import (besides their own)
ALLOWED = {
    "core": set(),
    "hf": {"core"},
    "vllm": {"core"},
    "harness": {"core", "hf"},
    "cli": {"core", "hf", "harness"},
}
# third-party packages a layer may not import at all
FORBIDDEN = {"core": {"transformers", "vllm"}, "hf": {"vllm"}, "vllm": {"transformers_integration"}}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imports(path: Path):
    """(absolute module name, line) of every import in ``path``, relative imports resolved."""
    package = ["vase", *path.relative_to(SRC).parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: each name may be a module
                    for alias in node.names:
                        yield f"{name}.{alias.name}", node.lineno
                    continue
            else:
                name = node.module or ""
            yield name, node.lineno


def _modules():
    return sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_layers_import_only_what_they_may(path):
    layer = _layer(path)
    assert layer in ALLOWED, f"{path}: a module outside the known layers ({', '.join(ALLOWED)})"
    for name, line in _imports(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN.get(layer, set()), f"{path}:{line} imports {name} ({layer} may not)"
        if top == "vase" and len(name.split(".")) > 1:
            target = name.split(".")[1]
            if target == "__version__":
                continue
            assert target == layer or target in ALLOWED[layer], (
                f"{path}:{line} imports {name}: the {layer} layer may import {sorted(ALLOWED[layer]) or 'no other'}"
            )


BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "vllm"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def test_core_imports_with_torch_alone():
    """The core runs an eviction in a process where transformers cannot be imported; ``import vase`` loads none of
    the layers."""
    code = (
        BLOCK
        + """
import vase
assert "vase.hf" not in sys.modules and "vase.harness" not in sys.modules
import torch
import vase.core
from vase.core import VaseConfig, evict_layer, gather_kept, make_policy
for name in vase.core.POLICY_NAMES:
    make_policy(name)
cfg = VaseConfig.resolve("vase", budget=12, buffer=4, sinks=2)
b, h, s, d = 2, 2, 16, 8
g = torch.Generator().manual_seed(0)
keys, values = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
positions = torch.arange(s).view(1, 1, s).expand(b, h, s).clone()
ev = evict_layer(cfg.policy, keys, values, positions, torch.ones(b, s, dtype=torch.bool), budget=12, slots=12,
                 sinks=2, recent=4, row_keys=torch.tensor([1, 2]), eviction_index=torch.zeros(2, dtype=torch.long),
                 latest_query=torch.full((2,), s - 1), queries=torch.randn(b, 4, 4, d, generator=g),
                 query_positions=torch.arange(12, 16).expand(b, 4), query_valid=torch.ones(b, 4, dtype=torch.bool))
k, v, p, _ = gather_kept(ev.indices, ev.keep, keys, values, positions)
assert ev.indices.shape == (2, 2, 12) and p[..., :2].tolist() == [[[0, 1]] * 2] * 2
assert p[..., -4:].tolist() == [[[12, 13, 14, 15]] * 2] * 2
assert "transformers" not in sys.modules
print("ok")
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# The sequence model (docs/ARCHITECTURE.md) is written once, in the core: what an integration must not define again
SEQUENCE_CLASSES = {"Schedule", "StepSchedule", "RowTables", "QueryRing", "RingWrite", "Sequences"}
SEQUENCE_FUNCTIONS = {
    "first_limit",
    "_first_limit",
    "_limits",
    "_plan_quantization",
    "_quantization_limits",
    "_quantization_room",
    "record_padded",
    "_row_keys_tensor",
    "_held_positions",
    "_held_state",
    "_plan_ring",
}


def _integration_modules():
    return [p for layer in ("hf", "vllm") for p in sorted((SRC / layer).rglob("*.py"))]


@pytest.mark.parametrize("path", _integration_modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_integrations_do_not_redefine_the_sequence_model(path):
    """No integration module defines the schedule arithmetic, the row tables, the query ring or the eviction call
    again: they call the core's (no direct ``evict_layer`` or ``rng.row_key``, no policy memo name hard-coded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert node.name not in SEQUENCE_CLASSES, f"{path}:{node.lineno} defines {node.name} (the core's)"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.name not in SEQUENCE_FUNCTIONS, f"{path}:{node.lineno} defines {node.name} (the core's)"
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            assert name not in ("evict_layer", "row_key"), (
                f"{path}:{node.lineno} calls {name}: use the core's Sequences"
            )
        elif isinstance(node, ast.Constant) and node.value == "acc_upto":
            raise AssertionError(f"{path}:{node.lineno} names H2O's memo: the policy declares it (memo_names)")


@pytest.mark.parametrize("layer", ["hf", "vllm"])
def test_integrations_run_the_cores_sequence_model(layer):
    """Each integration builds on :class:`vase.core.sequence.Sequences`."""
    names = {n for p in (SRC / layer).rglob("*.py") for n, _ in _imports(p)}
    assert "vase.core.sequence" in names, f"vase.{layer} does not use the core's sequence model"


def test_no_file_in_src_exceeds_500_lines():
    """Every file of the package (the harness and the command line included) is at most 500 lines."""
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    long = {path: n for path, n in sizes.items() if n > 500}
    assert not long, f"files above 500 lines: {long}"

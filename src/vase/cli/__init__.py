"""The ``vase`` command line: generate, demo, eval, fidelity, analyze, train-scorer, inspect, report, bench, policies,
convert.

One module per concern: :mod:`~vase.cli.common` (errors, shared options, lists), :mod:`~vase.cli.generation`
(policies, generate, demo), :mod:`~vase.cli.sweeps` (eval, merge, fidelity, report), :mod:`~vase.cli.analysis`
(analyze, train-scorer), :mod:`~vase.cli.models`
(inspect, convert) and :mod:`~vase.cli.bench` (the ``bench`` group and its modes). The console script is
``vase = "vase.cli:app"``.
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from . import bench
from .analysis import analyze, train_scorer
from .common import tidy_help
from .generation import demo, generate, policies
from .models import convert, inspect
from .sweeps import eval_cmd, fidelity, merge, report

ORDER = [
    "policies",
    "generate",
    "demo",
    "eval",
    "merge",
    "fidelity",
    "analyze",
    "train-scorer",
    "inspect",
    "report",
    "bench",
    "convert",
]


class Commands(TyperGroup):
    """The commands in :data:`ORDER` in ``vase --help`` (typer lists groups such as ``bench`` after the commands)."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(self.commands, key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))


app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    help="vase: bounded KV cache for long reasoning generation (VaSE and baselines) on transformers models.",
    pretty_exceptions_enable=False,
)
for command in (policies, generate, demo):
    app.command()(command)
app.command("eval")(eval_cmd)
for command in (merge, fidelity, analyze, inspect, report, convert):
    app.command()(command)
app.command("train-scorer")(train_scorer)
app.add_typer(
    bench.app,
    name="bench",
    short_help="Decode speed, KV bytes, peak RSS and eviction share: full cache vs policies, side by side; modes "
    "sweep (the default), paired, compiled, profile.",
)
tidy_help(app)


def main():  # pragma: no cover - console entry point
    app()

"""``vase bench``: decode speed, KV bytes, peak RSS and eviction cost, the full cache against policies. Four modes,
each a subcommand with its own options (``vase bench`` alone runs the sweep with its defaults):

- ``vase bench sweep``: each (policy, budget) and the full cache in its own process, measured at growing lengths;
- ``vase bench paired``: the policies' decode steps interleaved in one process at one context length;
- ``vase bench compiled``: compiled against uncompiled decode steps, interleaved the same way, at each context;
- ``vase bench profile``: the eviction steps of each policy under the torch profiler, time per component.

Before the modes were subcommands they were flags of one command (``vase bench --paired ...``); such a command line
is refused with the one that replaces it (:class:`BenchGroup`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from typer.core import TyperGroup

from .common import BufferOpt, DeviceOpt, ModelOpt, fail, friendly, parse_csv, set_threads, tidy_help

EVICTING = "streaming_llm,snapkv,rkv,vase,vase_dkv"  # the default policies of every mode but compiled
# the flags that chose a mode when bench was one command, in the order they took precedence
MODE_FLAGS = {"--compile": "compiled", "--paired": "paired", "--profile": "profile"}
RENAMED = {"--paired-budget": "--budget", "--profile-budget": "--budget"}  # the mode's budget is its --budget now


class BenchGroup(TyperGroup):
    """The ``vase bench`` group: options before a subcommand (``vase bench --paired --context 4096``, the single
    command bench was) get a one-line error with the command that replaces them, instead of click's usage error."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in ctx.help_option_names:
            fail(self.replacement(ctx, args))
        return super().parse_args(ctx, args)

    def replacement(self, ctx, args: list[str]) -> str:
        """The error for ``vase bench ARGS`` written for the single command: the mode its flags chose, and its options
        under their new names; options the mode never used are left out and named."""
        names = {a.partition("=")[0] for a in args}
        mode = next((m for flag, m in MODE_FLAGS.items() if flag in names), "sweep")
        known = {opt for p in self.get_command(ctx, mode).params for opt in p.opts} | set(ctx.help_option_names)
        kept, dropped, i = [], [], 0
        while i < len(args):
            name, eq, value = args[i].partition("=")
            takes_value = name not in MODE_FLAGS and name not in ctx.help_option_names
            values = [value] if eq else args[i + 1 : i + 2] if takes_value else []
            i += 1 if eq or not takes_value else 2
            if name in MODE_FLAGS:
                continue
            name = RENAMED.get(name, name) if mode != "sweep" else name
            if name in known:
                kept += [name, *values]
            else:
                dropped.append(name)
        command = " ".join(["vase bench", mode, *([shlex.join(kept)] if kept else [])])
        line = f"the modes of vase bench are subcommands now: run `{command}`"
        if dropped:
            line += f" (left out, not options of vase bench {mode}: {', '.join(dropped)})"
        return line + "; `vase bench --help` lists the modes"


app = typer.Typer(
    cls=BenchGroup,
    invoke_without_command=True,
    help="Decode speed, KV bytes, peak RSS and eviction share: full cache vs policies, side by side, with ratios. "
    "Without a mode, runs `vase bench sweep` with its defaults.",
)

PairedBudgetOpt = typer.Option(1024, "--budget", "-b", help="budget of the evicting policies in tokens")


@app.callback()
def bench(ctx: typer.Context):
    if ctx.invoked_subcommand is None:  # `vase bench` (and `make bench`): the sweep with its defaults, as before
        sweep = ctx.command.get_command(ctx, "sweep")
        with sweep.make_context("sweep", [], parent=ctx) as sub:
            sweep.invoke(sub)


def _check_common(device: str, out: Path | None) -> None:
    from ..hf.models import check_load_options

    check_load_options(device=device)
    if out is not None and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a folder for the results")


def _check_policies(names: list[str], sizes: list[int], buffer: int) -> None:
    from ..harness.generation import check_options

    for name in names:
        for size in sizes:  # the full cache has no budget: only its name is checked
            check_options(policy=name, budget=None if name == "full" else size, buffer=buffer)


def _load(model: str | None, device: str):
    from ..hf.models import load_model

    set_threads()
    return load_model(model, device=device)


@app.command("sweep")
@friendly
def bench_sweep(
    out: Path = typer.Option(Path("runs/bench"), "--out", "-o", help="results folder (bench.json, BENCH.md)"),
    lengths: str = typer.Option("1024,2048,4096,8192", help="marks: new tokens at which to measure"),
    policies: str = typer.Option(EVICTING, help="comma-separated policies besides the full cache"),
    budgets: str = typer.Option("256,512,1024", help="comma-separated budgets in tokens"),
    buffer: int = BufferOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
):
    """Each policy at each budget, and the full cache, in its own process (so its peak RSS is its own): decode speed,
    KV bytes, peak RSS and eviction share at each length, with the goals; resumes from bench.json."""
    from ..harness.bench import run_bench

    _check_common(device, out)
    names, sizes, marks = parse_csv(policies), parse_csv(budgets, int), parse_csv(lengths, int)
    if not marks or min(marks) < 1:
        raise ValueError(f"--lengths must be positive token counts, got {lengths!r}")
    if not sizes:
        raise ValueError("--budgets is empty: give at least one budget")
    _check_policies(names, sizes, buffer)
    set_threads()
    run_bench(out, names, sizes, marks, buffer=buffer, model=model, device=device)
    typer.echo((out / "BENCH.md").read_text())


@app.command("paired")
@friendly
def bench_paired(
    out: Path = typer.Option(Path("runs/bench"), "--out", "-o", help="results folder (paired.json, PAIRED.md)"),
    policies: str = typer.Option(
        EVICTING, help="comma-separated policies (full: the full cache); the first is the reference of the ratios"
    ),
    budget: int = PairedBudgetOpt,
    context: int = typer.Option(8192, help="prompt length in tokens"),
    steps: int = typer.Option(512, help="decode steps per policy"),
    buffer: int = BufferOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
):
    """Decode speed of several caches in one process at one context length: they take turns of one eviction cycle
    (buffer steps) each, so a slow spell of the machine hits every policy alike."""
    from ..harness.bench_markdown import paired_markdown
    from ..harness.measure import paired_speed

    _check_common(device, out)
    names = parse_csv(policies)
    if steps < 1 or context < budget + buffer:
        raise ValueError(
            f"vase bench paired needs --steps >= 1 and --context >= budget + buffer ({budget} + {buffer}); "
            f"got steps {steps}, context {context}"
        )
    _check_policies(names, [budget], buffer)
    lm = _load(model, device)
    res = paired_speed(lm, names, budget=budget, buffer=buffer, context=context, steps=steps)
    _write_results(out, "paired", res, paired_markdown(res), lm)


@app.command("compiled")
@friendly
def bench_compiled(
    out: Path = typer.Option(Path("runs/bench"), "--out", "-o", help="results folder (compiled.json, COMPILED.md)"),
    policies: str = typer.Option(
        "vase", help="comma-separated policies, each run compiled and not (the full cache always is)"
    ),
    budget: int = PairedBudgetOpt,
    contexts: str = typer.Option("1024,8192", help="comma-separated prompt lengths in tokens"),
    steps: int = typer.Option(512, help="decode steps per run"),
    backend: str = typer.Option("inductor", help="torch.compile backend"),
    buffer: int = BufferOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
):
    """Compiled vs uncompiled decode steps, side by side in one process at each context (as `vase bench paired`),
    for the full cache (transformers' StaticCache compiled) and each policy."""
    from ..harness.bench_markdown import compiled_markdown
    from ..harness.measure import compiled_speed

    _check_common(device, out)
    names = parse_csv(policies)
    if "quest" in names:
        raise ValueError("vase bench compiled: the selection policy quest has no compiled decoding; choose others")
    ctx = parse_csv(contexts, int)
    if not ctx or min(ctx) < 2 * buffer + 2 or steps < 1:
        raise ValueError(f"vase bench compiled needs --contexts of at least {2 * buffer + 2} tokens and --steps >= 1")
    names = [n for n in names if n != "full"]
    _check_policies(names, [budget], buffer)
    lm = _load(model, device)
    res = compiled_speed(lm, ["full", *names], contexts=ctx, budget=budget, buffer=buffer, steps=steps, backend=backend)
    _write_results(out, "compiled", res, compiled_markdown(res), lm)


@app.command("profile")
@friendly
def bench_profile(
    policies: str = typer.Option(EVICTING, help="comma-separated policies, each profiled in turn"),
    budget: int = typer.Option(1024, "--budget", "-b", help="cache budget in tokens"),
    buffer: int = BufferOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
):
    """The eviction steps of each policy under the torch profiler: milliseconds per eviction (all layers) of
    scoring, value guard, selection and compaction, and their share of decode time."""
    from ..harness.measure import profile_eviction

    _check_common(device, None)
    names = parse_csv(policies) or ["vase"]
    _check_policies(names, [budget], buffer)
    lm = _load(model, device)
    for policy in names:
        typer.echo(profile_eviction(lm, policy=policy, budget=budget, buffer=buffer))


def _write_results(out: Path, name: str, res, markdown: str, lm) -> None:
    """``out/<name>.json`` (each result tagged with the model, device and threads) and ``out/<NAME>.md``, echoed."""
    import json

    import torch

    for r in res if isinstance(res, list) else [res]:
        r.update(model=lm.name, device=str(lm.device), threads=torch.get_num_threads())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name.upper()}.md").write_text(markdown)
    typer.echo(markdown)
    typer.echo(f"[vase] written {out / f'{name}.json'} and {out / f'{name.upper()}.md'}")


tidy_help(app)

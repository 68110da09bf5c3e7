"""``vase eval``, ``vase merge``, ``vase fidelity`` and ``vase report``: sweeps over policies and sizes, resumable,
and their tables and plots."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import (
    AttnOpt,
    BufferOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    SeedOpt,
    fail,
    friendly,
    parse_csv,
    parse_policies,
    set_threads,
)


@friendly
def eval_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="results directory (resumes if it exists)"),
    tasks: str = typer.Option(
        "gsm8k",
        help="comma-separated task names or JSONL files; synthetic long-context tasks: ruler:NAME@LENGTH (e.g. "
        "ruler:niah_single@4k; names: niah_single, niah_uuid, niah_multikey, niah_multivalue, niah_multiquery, vt, "
        "cwe, fwe, niah_decode; 20 problems each unless --limit)",
    ),
    policies: str = typer.Option("full,streaming_llm,snapkv,rkv,vase", help="comma-separated, or 'all'"),
    budgets: str | None = typer.Option(
        None, help="comma-separated budgets in tokens (give --budgets, --ratios or both: there is no default)"
    ),
    ratios: str | None = typer.Option(
        None, help="comma-separated compression ratios: budget = (median prompt + max new tokens) / ratio"
    ),
    seeds: str = typer.Option("0", help="comma-separated seeds: k seeds = k samples per problem"),
    limit: int | None = typer.Option(None, help="first N problems of each task"),
    max_new_tokens: int = typer.Option(
        512,
        "--max-new-tokens",
        "-n",
        help="tokens generated at most per completion (synthetic tasks: their own answer length; niah_decode: tokens "
        "the model writes before it is asked)",
    ),
    greedy: bool = typer.Option(False, "--greedy", help="greedy decoding (CPU smoke runs)"),
    temperature: float = typer.Option(0.6, help="sampling temperature (reasoning-model default 0.6)"),
    top_p: float = typer.Option(0.95, "--top-p", help="nucleus sampling: keep the smallest set of tokens of this mass"),
    top_k: int = typer.Option(20, "--top-k", help="sample among the k most likely tokens (0 = off)"),
    buffer: int = BufferOpt,
    batch_size: int = typer.Option(4, "--batch-size", help="completions generated together"),
    shard: str | None = typer.Option(None, help="I/N: run every N-th work unit starting at I"),
    question_field: str | None = typer.Option(
        None, "--question-field", help="question field of JSONL tasks (default: problem, question, prompt or input)"
    ),
    answer_field: str = typer.Option("answer", "--answer-field", help="reference answer field of JSONL tasks"),
    kept_dynamics: bool = typer.Option(
        False,
        "--kept-dynamics",
        help="also record how much of each eviction's kept set the next one keeps, and the token where a loop "
        "begins (the report relates the two)",
    ),
    model: str | None = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
):
    """Accuracy sweep: policies x budgets/ratios x tasks x seeds, one JSONL record per completion; resumable."""
    from ..harness.evaluate import EvalConfig, all_records, check_results_dir, parse_shard, run_sweep
    from ..harness.report import eval_summary

    set_threads()
    config = EvalConfig(
        model=model or "smollm2",
        dtype=dtype,
        attn=attn,
        tasks=parse_csv(tasks),
        policies=parse_policies(policies),
        budgets=parse_csv(budgets, int),
        ratios=parse_csv(ratios, float),
        seeds=parse_csv(seeds, int),
        limit=limit,
        max_new_tokens=max_new_tokens,
        temperature=0.0 if greedy else temperature,
        top_p=top_p,
        top_k=top_k,
        buffer=buffer,
        question_field=question_field,
        answer_field=answer_field,
        kept_dynamics=kept_dynamics,
    )
    _check_sweep(config, batch_size, device)
    check_results_dir(out)
    path = run_sweep(config, out, shard=parse_shard(shard), batch_size=batch_size, device=device)
    # the score of every record in the folder (all its shards), as `vase report` counts them
    typer.echo("\n".join(eval_summary(all_records(out))).rstrip())
    typer.echo(f"[vase] records in {path}; notes and plots: vase report {out}")


def _check_sweep(config, batch_size: int, device: str) -> None:
    """The ranges of `vase eval`'s options, checked before any task file or model is loaded."""
    from ..harness.generation import check_options, check_sampling
    from ..hf.models import check_load_options

    check_load_options(config.dtype, device, config.attn)
    check_sampling(config.temperature, config.top_p, config.top_k)
    if config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    for option, values in (("--tasks", config.tasks), ("--policies", config.policies), ("--seeds", config.seeds)):
        if not values:
            raise ValueError(f"{option} is empty: give at least one value")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if config.limit is not None and config.limit < 1:
        raise ValueError(f"--limit must be >= 1 problem, got {config.limit}")
    from ..harness.ruler import is_ruler, parse_task
    from ..hf.models import known_context

    context = known_context(config.model)
    for task in config.tasks:  # a synthetic task's name and length, against the model's context when it is known
        if is_ruler(task):
            parse_task(task, context, written=config.max_new_tokens)
    for kind, size in config.sizes():
        check_options(
            policy=config.policies[0],
            budget=int(size) if kind == "budget" else None,
            compression_ratio=size if kind == "ratio" else None,
            buffer=config.buffer,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            **config.policy_options,
        )


@friendly
def merge(
    dest: Path = typer.Argument(..., help="results directory to write records.jsonl into"),
    sources: list[Path] = typer.Argument(..., help="results directories (shards) of the same configuration"),
):
    """Join the shards of a sweep (run on several machines) into one results directory."""
    from ..harness.evaluate import merge as do_merge

    n, missing = do_merge(dest, sources)
    typer.echo(f"[vase] {n} records in {dest / 'records.jsonl'}; {missing} work units of the grid still missing")


@friendly
def fidelity(
    out: Path = typer.Option(..., "--out", "-o", help="results directory (resumes if it exists)"),
    source: str = typer.Option("gsm8k", help="task name / JSONL (model's own reasoning), or text:PATH"),
    prompts: int = typer.Option(20, help="number of prompts (text windows for text:PATH)"),
    tokens: int = typer.Option(1024, help="continuation length in tokens"),
    policies: str = typer.Option("all", help="comma-separated, or 'all'"),
    ratios: str | None = typer.Option(
        None, help="comma-separated compression ratios (default 2,4,8 when no --budgets are given)"
    ),
    budgets: str | None = typer.Option(
        None, help="comma-separated budgets in tokens (instead of the default ratios; give --ratios too for both)"
    ),
    byte_ratios: str | None = typer.Option(
        None,
        "--byte-ratios",
        help="comma-separated compression ratios in bytes: each policy gets the budget those bytes hold at its kv_bits",
    ),
    buffer: int = BufferOpt,
    bucket: int = typer.Option(256, help="position bucket size for the per-position report"),
    seed: int = SeedOpt,
    plant_layers: str | None = typer.Option(
        None, "--plant-layers", help="plant value outliers in these layers (comma-separated), e.g. 4,12,20"
    ),
    plant_tokens: int = typer.Option(
        0, "--plant-tokens", help="planted tokens, spread over the continuation's 1st half"
    ),
    plant_scale: float = typer.Option(20.0, "--plant-scale", help="planted value range / the head's median range"),
    model: str | None = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
):
    """KL(full || policy), top-1 agreement and perplexity change, replaying the full cache's continuation.

    With --plant-layers and --plant-tokens, value outliers are planted (the same in the reference and the policies)
    and the records say which share of them each policy still holds at the end.

    With --byte-ratios, each policy (quantized ones with kv_bits in their spec, e.g. vase:kv_bits=4) gets the budget
    whose kept bytes are the full cache's over the ratio, in the model's dtype; records add the bytes held."""
    from ..harness.fidelity import FidelityConfig, run_fidelity

    if ratios is not None and not (
        parse_csv(ratios, float) or parse_csv(budgets, int) or parse_csv(byte_ratios, float)
    ):
        raise ValueError("--ratios is empty and no --budgets are given: give at least one ratio or budget")
    set_threads()
    config = FidelityConfig(
        model=model or "smollm2",
        dtype=dtype,
        attn=attn,
        source=source,
        prompts=prompts,
        tokens=tokens,
        policies=parse_policies(policies),
        ratios=parse_csv(ratios, float),
        budgets=parse_csv(budgets, int),
        byte_ratios=parse_csv(byte_ratios, float),
        buffer=buffer,
        bucket=bucket,
        seed=seed,
        plant_layers=parse_csv(plant_layers, int),
        plant_tokens=plant_tokens,
        plant_scale=plant_scale,
    )
    if bool(config.plant_layers) != (plant_tokens > 0):
        fail("planting value outliers needs both --plant-layers and --plant-tokens (> 0)")
    path = run_fidelity(config, out, device=device)
    typer.echo(f"[vase] records in {path}; summary: vase report {out}")


@friendly
def report(
    results: Path = typer.Argument(..., help="results directory of `vase eval` or `vase fidelity`"),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="folder for REPORT.md and the PNGs (default: the results directory itself)"
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        help="reference policy of the fidelity paired differences (default: the lowest mean KL at each size)",
    ),
):
    """Markdown tables and PNG plots from a results directory."""
    from ..harness.report import write_report

    path = write_report(results, out or results, against=against)
    typer.echo(path.read_text())
    typer.echo(f"[vase] written {path}")

"""The ``vase`` command line: generate, demo, eval, fidelity, inspect, report, bench, policies, convert."""

from __future__ import annotations

import functools
import inspect as _inspect
import os
import sys
from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="vase: bounded KV cache for long reasoning generation (VaSE and baselines) on transformers models.",
    pretty_exceptions_enable=False,
)


def _fail(message: str, code: int = 2):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _message(exc: Exception) -> str:
    """One line for an error: pydantic's validation errors reduced to their first message."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return f"{'.'.join(map(str, first['loc']))}: {first['msg'].removeprefix('Value error, ')}"
        except (TypeError, IndexError, KeyError):
            pass
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


RESUMABLE = {"eval_cmd": "records", "fidelity": "traces and records"}


def friendly(fn):
    """Turn the library's clear ValueErrors, file-system errors (a path that is a file where a folder is needed, no
    permission...) and Ctrl-C into one line on stderr and a non-zero exit; show the harness's warnings as
    ``[vase] warning: ...`` lines."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .harness.notes import show_on_stderr

        show_on_stderr()
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, NotImplementedError) as exc:
            _fail(_message(exc))
        except KeyboardInterrupt:
            sys.stderr.write("\n")  # below a progress bar that was being drawn
            saved = RESUMABLE.get(fn.__name__)
            _fail(
                f"interrupted: the {saved} written so far are saved; run the same command again to resume"
                if saved
                else "interrupted",
                130,
            )

    return wrapper


# Options shared by commands -------------------------------------------------------------------------------------
ModelOpt = typer.Option(None, "--model", "-m", help="smollm2 (embedded, default), a local folder / .gguf, or a hub id")
DtypeOpt = typer.Option("auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
DeviceOpt = typer.Option("auto", help="auto (cuda when present), cpu, cuda, cuda:1")
AttnOpt = typer.Option("sdpa", "--attn", help="attention implementation: sdpa, eager, flash_attention_2 (GPU)")
PolicyOpt = typer.Option("vase", "--policy", "-p", help="eviction policy (see `vase policies`)")
BudgetOpt = typer.Option(None, "--budget", "-b", help="cache budget in tokens (default 1024)")
RatioOpt = typer.Option(None, "--ratio", help="compression ratio instead of a budget: budget = (prompt + new) / ratio")
BufferOpt = typer.Option(64, "--buffer", help="recent window in tokens; compaction every `buffer` decode steps")
WindowOpt = typer.Option(None, "--window", help="saved queries for scoring (default: the policy's)")
ShareOpt = typer.Option(None, "--protect-share", help="share of the budget protected by the value guard (vase: 0.25)")
SeedOpt = typer.Option(0, "--seed", help="seed for eviction sampling and token sampling")


def _policy_options(protect_share: float | None) -> dict:
    return {} if protect_share is None else {"protect_share": protect_share}


def _byte_sizes(byte_ratio: float | None, memory_budget: float | None, dtype: str, device: str) -> dict:
    """A size in bytes (``--byte-ratio`` / ``--memory-budget``) with the bytes of the model's dtype it is counted in,
    or nothing."""
    if byte_ratio is None and memory_budget is None:
        return {}
    from .hf.models import check_load_options, resolve_device, resolve_dtype

    check_load_options(dtype, device)
    element = resolve_dtype(dtype, resolve_device(device)).itemsize
    return {"byte_ratio": byte_ratio, "memory_budget": memory_budget, "element_bytes": element}


def _threads():
    import torch

    if os.environ.get("VASE_THREADS"):
        torch.set_num_threads(int(os.environ["VASE_THREADS"]))


@app.command()
@friendly
def policies():
    """List the eviction policies: name, what each keeps, source."""
    from .core.policies import policy_table

    for name, keeps, source in policy_table():
        typer.echo(f"{name:14s} {keeps}\n{'':14s} {source}")
    typer.echo(
        "\nThe published method exactly as the authors' code runs it: vase:preset=paper and vase_dkv:preset=paper "
        "(budget a multiple of the buffer). Options go after colons: snapkv:selector=sample, vase:guard=random."
    )


@app.command()
@friendly
def generate(
    prompt: str | None = typer.Argument(None, help="prompt text; '-' or nothing (with a pipe) reads stdin"),
    data: str | None = typer.Option(None, "--data", help="JSONL file or task name (gsm8k, math500, ...)"),
    index: int = typer.Option(0, "--index", help="problem number in --data (0-based)"),
    question_field: str | None = typer.Option(None, "--question-field", help="question field in --data"),
    template: str = typer.Option("auto", help="auto (task template for --data), math, mcq, none"),
    model: str | None = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    policy: str = PolicyOpt,
    budget: int | None = BudgetOpt,
    ratio: float | None = RatioOpt,
    byte_ratio: float | None = typer.Option(
        None, "--byte-ratio", help="compression ratio in bytes (with kv_bits in --policy: the budget those bytes hold)"
    ),
    memory_budget: float | None = typer.Option(
        None, "--memory-budget", help="KV bytes per layer and KV head, as the tokens they hold in the model's dtype"
    ),
    buffer: int = BufferOpt,
    window: int | None = WindowOpt,
    protect_share: float | None = ShareOpt,
    sinks: int = typer.Option(4, help="attention-sink tokens always kept"),
    dense_prompt: bool = typer.Option(False, "--dense-prompt", help="keep the prompt dense until the first eviction"),
    seed: int = SeedOpt,
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", help="tokens generated at most per completion"),
    min_new_tokens: int = typer.Option(0, "--min-new-tokens", help="suppress end-of-sequence before this many"),
    temperature: float = typer.Option(0.0, help="0 = greedy; reasoning models: 0.6"),
    top_p: float = typer.Option(0.95, "--top-p", help="nucleus sampling: keep the smallest set of tokens of this mass"),
    top_k: int = typer.Option(20, "--top-k", help="sample among the k most likely tokens (0 = off)"),
    system: str | None = typer.Option(None, help="system prompt"),
    no_chat: bool = typer.Option(False, "--no-chat", help="do not apply the chat template"),
    compile: bool = typer.Option(
        False, "--compile", help="compile the decode steps (CUDA graphs on a GPU); the first steps wait for it"
    ),
):
    """Generate from one prompt with an evicting cache, streaming the text, then print a stats line."""
    from .harness.data import TEMPLATES

    options = dict(
        policy=policy,
        budget=budget,
        compression_ratio=ratio,
        **_byte_sizes(byte_ratio, memory_budget, dtype, device),
        buffer=buffer,
        sinks=sinks,
        window=window,
        seed=seed,
        compress_prompt=False if dense_prompt else None,  # else the policy's own (the preset: dense)
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        system=system,
        chat=not no_chat,
        compile=compile,
        **_policy_options(protect_share),
    )
    model_options = dict(name=model, dtype=dtype, device=device, attn=attn)
    _check_options(model_options, options)
    if template not in (*TEMPLATES, "auto", "none"):
        raise ValueError(f"unknown template {template!r}; choose auto, {', '.join(TEMPLATES)} or none")
    text = _prompt_text(prompt, data, index, question_field, template)
    if template in TEMPLATES and data is None:
        text = TEMPLATES[template].format(question=text)
    _run_generation(text, model_options, options)


def _prompt_text(prompt, data, index, question_field, template) -> str:
    from .harness.data import TEMPLATES, pick_problem

    if data is not None:
        if prompt is not None:
            raise ValueError("give a prompt or --data, not both")
        problem = pick_problem(data, index, question_field=question_field)
        if template == "none":
            return problem.question
        kind = problem.kind if template == "auto" else template
        if kind not in TEMPLATES:
            raise ValueError(f"unknown template {template!r}; choose auto, math, mcq or none")
        return TEMPLATES[kind].format(question=problem.question)
    if prompt is None or prompt == "-":
        stdin = sys.stdin
        if stdin is None:  # started with stdin closed (`<&-`), or detached from any input
            raise ValueError(
                "no prompt: standard input is closed; pass the prompt as an argument or use --data FILE --index N"
            )
        if prompt is None and stdin.isatty():
            raise ValueError("no prompt: pass one as an argument, pipe it on stdin, or use --data FILE --index N")
        prompt = stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text")
    return prompt


# Options of vase.generate that are not part of the cache's configuration (seeds, prompt handling)
_RUN_ONLY = ("seed", "system", "chat")
_DECODING = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k")


def _check_options(model_options: dict, options: dict):
    """Every option's range, before the prompt is read or anything is loaded (a bad value fails in a second);
    returns the resolved :class:`vase.VaseConfig`."""
    from .harness.generation import check_options
    from .hf.models import check_load_options

    config = check_options(**{k: v for k, v in options.items() if k not in _RUN_ONLY})
    check_load_options(
        model_options.get("dtype", "auto"), model_options.get("device", "auto"), model_options.get("attn", "sdpa")
    )
    return config


def _run_generation(text: str, model_options: dict, options: dict):
    """Load the model, stream the generation to stdout, end with the stats line. ``options`` go to vase.generate."""
    from transformers import TextStreamer

    from .harness.generation import generate as run
    from .hf.models import load_model

    config = _check_options(model_options, options)  # again for `vase demo`; cheap
    _threads()
    lm = load_model(**model_options)
    typer.echo(f"[vase] model {lm.name} on {lm.device} ({str(lm.dtype).replace('torch.', '')})", err=True)
    streamer = TextStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    rest = {k: v for k, v in options.items() if k in _RUN_ONLY + _DECODING}
    result = run(lm.model, lm.tokenizer, text, streamer=streamer, config=config, **rest)
    sys.stdout.flush()
    typer.echo(result.stats_line())
    return result


@app.command()
@friendly
def demo(
    model: str | None = ModelOpt,
    policy: str = PolicyOpt,
    budget: int = typer.Option(128, "--budget", "-b"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", help="tokens generated at most per completion"),
    device: str = DeviceOpt,
):
    """The main job: ~512 tokens of reasoning on a GSM8K problem with the embedded model, vase, budget 128.

    Reads problem 3 of ../shared/data/reasoning/gsm8k.jsonl (or $VASE_DATA_DIR) when present, else a built-in
    problem. The small model would stop early, so end-of-sequence is suppressed until max_new_tokens: the cache
    then goes through several evictions.
    """
    from .harness.data import BUILTIN_PROMPT, TEMPLATES, pick_problem, resolve_task

    _, path = resolve_task("gsm8k")
    if path.exists():
        problem = pick_problem("gsm8k", 3)
        text, source = problem.prompt(), f"GSM8K problem 3 ({path})"
    else:
        text, source = TEMPLATES["math"].format(question=BUILTIN_PROMPT), "built-in problem (no ../shared/data here)"
    typer.echo(f"[vase] demo: {source}, policy {policy}, budget {budget}, {max_new_tokens} new tokens", err=True)
    typer.echo(text + "\n" + "-" * 80)
    options = dict(
        policy=policy,
        budget=budget,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        seed=0,
    )
    _run_generation(text, dict(name=model, device=device), options)


def _csv(text: str | None, cast=str) -> list:
    if text is None or not str(text).strip():
        return []
    try:
        return [cast(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"could not read {text!r} as a comma-separated list of {cast.__name__}") from None


def _policies(text: str) -> list[str]:
    from .core.policies import POLICY_NAMES

    return list(POLICY_NAMES) if text == "all" else _csv(text)


@app.command("eval")
@friendly
def eval_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="results directory (resumes if it exists)"),
    tasks: str = typer.Option("gsm8k", help="comma-separated task names or JSONL files"),
    policies: str = typer.Option("full,streaming_llm,snapkv,rkv,vase", help="comma-separated, or 'all'"),
    budgets: str | None = typer.Option(
        None, help="comma-separated budgets in tokens (give --budgets, --ratios or both: there is no default)"
    ),
    ratios: str | None = typer.Option(
        None, help="comma-separated compression ratios: budget = (median prompt + max new tokens) / ratio"
    ),
    seeds: str = typer.Option("0", help="comma-separated seeds: k seeds = k samples per problem"),
    limit: int | None = typer.Option(None, help="first N problems of each task"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", help="tokens generated at most per completion"),
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
    model: str | None = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
):
    """Accuracy sweep: policies x budgets/ratios x tasks x seeds, one JSONL record per completion; resumable."""
    from .harness.evaluate import EvalConfig, check_results_dir, parse_shard, run_sweep

    _threads()
    config = EvalConfig(
        model=model or "smollm2",
        dtype=dtype,
        attn=attn,
        tasks=_csv(tasks),
        policies=_policies(policies),
        budgets=_csv(budgets, int),
        ratios=_csv(ratios, float),
        seeds=_csv(seeds, int),
        limit=limit,
        max_new_tokens=max_new_tokens,
        temperature=0.0 if greedy else temperature,
        top_p=top_p,
        top_k=top_k,
        buffer=buffer,
        question_field=question_field,
        answer_field=answer_field,
    )
    _check_sweep(config, batch_size, device)
    check_results_dir(out)
    path = run_sweep(config, out, shard=parse_shard(shard), batch_size=batch_size, device=device)
    typer.echo(f"[vase] records in {path}; summary: vase report {out}")


def _check_sweep(config, batch_size: int, device: str) -> None:
    """The ranges of `vase eval`'s options, checked before any task file or model is loaded."""
    from .harness.generation import check_options, check_sampling
    from .hf.models import check_load_options

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


@app.command()
@friendly
def merge(
    dest: Path = typer.Argument(..., help="results directory to write records.jsonl into"),
    sources: list[Path] = typer.Argument(..., help="results directories (shards) of the same configuration"),
):
    """Join the shards of a sweep (run on several machines) into one results directory."""
    from .harness.evaluate import merge as do_merge

    n, missing = do_merge(dest, sources)
    typer.echo(f"[vase] {n} records in {dest / 'records.jsonl'}; {missing} work units of the grid still missing")


@app.command()
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
    from .harness.fidelity import FidelityConfig, run_fidelity

    if ratios is not None and not (_csv(ratios, float) or _csv(budgets, int) or _csv(byte_ratios, float)):
        raise ValueError("--ratios is empty and no --budgets are given: give at least one ratio or budget")
    _threads()
    config = FidelityConfig(
        model=model or "smollm2",
        dtype=dtype,
        attn=attn,
        source=source,
        prompts=prompts,
        tokens=tokens,
        policies=_policies(policies),
        ratios=_csv(ratios, float),
        budgets=_csv(budgets, int),
        byte_ratios=_csv(byte_ratios, float),
        buffer=buffer,
        bucket=bucket,
        seed=seed,
        plant_layers=_csv(plant_layers, int),
        plant_tokens=plant_tokens,
        plant_scale=plant_scale,
    )
    if bool(config.plant_layers) != (plant_tokens > 0):
        _fail("planting value outliers needs both --plant-layers and --plant-tokens (> 0)")
    path = run_fidelity(config, out, device=device)
    typer.echo(f"[vase] records in {path}; summary: vase report {out}")


@app.command()
@friendly
def inspect(
    prompt: str | None = typer.Argument(None, help="prompt text ('-' reads stdin)"),
    data: str | None = typer.Option(None, "--data", help="JSONL file or task name"),
    index: int = typer.Option(0, "--index"),
    generate_tokens: int = typer.Option(0, "--generate", help="also generate this many tokens (full cache) first"),
    out: Path = typer.Option(
        Path("runs/inspect"), "--out", "-o", help="folder for the PNG heat-map and JSON (default runs/inspect)"
    ),
    top: int = typer.Option(5, help="tokens listed per layer"),
    model: str | None = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
):
    """Value and key magnitudes per layer and KV head: does the model have the large values the guard protects?"""
    from .harness.magnitudes import inspect_model
    from .hf.models import check_load_options, load_model

    check_load_options(dtype, device)
    if generate_tokens < 0 or top < 1:
        raise ValueError(f"--generate must be >= 0 and --top >= 1, got {generate_tokens} and {top}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a folder for the heat-map and JSON")
    text = _prompt_text(prompt, data, index, None, "auto")
    _threads()
    lm = load_model(model, dtype=dtype, device=device)
    report = inspect_model(lm, text, out, generate_tokens=generate_tokens, top=top)
    typer.echo(report)
    typer.echo(f"[vase] written {out / 'magnitudes.json'} and {out / 'value_range_heatmap.png'}")


@app.command()
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
    from .harness.report import write_report

    path = write_report(results, out or results, against=against)
    typer.echo(path.read_text())
    typer.echo(f"[vase] written {path}")


@app.command()
@friendly
def bench(
    out: Path = typer.Option(Path("runs/bench"), "--out", "-o", help="results folder (bench.json, BENCH.md)"),
    lengths: str = typer.Option("1024,2048,4096,8192", help="marks: new tokens at which to measure"),
    policies: str | None = typer.Option(
        None,
        help="policies besides the full cache (default streaming_llm,snapkv,rkv,vase,vase_dkv; vase with --compile)",
    ),
    budgets: str = typer.Option("256,512,1024", help="comma-separated budgets in tokens"),
    buffer: int = BufferOpt,
    profile: bool = typer.Option(False, "--profile", help="only profile the eviction steps of vase and exit"),
    profile_budget: int = typer.Option(1024, "--profile-budget"),
    paired: bool = typer.Option(
        False, "--paired", help="interleave the policies' decode steps in one process at one context length; exit"
    ),
    paired_budget: int = typer.Option(
        1024, "--paired-budget", help="budget of the evicting policies with --paired / --compile"
    ),
    context: int = typer.Option(8192, help="with --paired: prompt length in tokens"),
    steps: int = typer.Option(512, help="with --paired / --compile: decode steps per run"),
    compile: bool = typer.Option(
        False, "--compile", help="compiled vs uncompiled decode, side by side at each of --contexts; exit"
    ),
    contexts: str = typer.Option("1024,8192", help="with --compile: prompt lengths in tokens"),
    backend: str = typer.Option("inductor", help="with --compile: torch.compile backend"),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
):
    """Decode speed, KV bytes, peak RSS and eviction share: full cache vs policies, side by side, with ratios."""
    from .harness.bench import run_bench
    from .harness.bench_markdown import compiled_markdown, paired_markdown
    from .harness.generation import check_options
    from .harness.measure import compiled_speed, paired_speed, profile_eviction
    from .hf.models import check_load_options

    check_load_options(device=device)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a folder for the results")
    if policies is None:
        policies = "vase" if compile else "streaming_llm,snapkv,rkv,vase,vase_dkv"
    names = _csv(policies)
    if compile:
        if "quest" in names:
            raise ValueError("--compile: the selection policy quest has no compiled decoding; choose others")
        ctx = _csv(contexts, int)
        if not ctx or min(ctx) < 2 * buffer + 2 or steps < 1:
            raise ValueError(f"--compile needs --contexts of at least {2 * buffer + 2} tokens and --steps >= 1")
        sizes = [paired_budget]
        names = [n for n in names if n != "full"]
    elif paired:
        sizes = [paired_budget]
        if steps < 1 or context < paired_budget + buffer:
            raise ValueError(
                f"--paired needs --steps >= 1 and --context >= budget + buffer ({paired_budget} + {buffer}); "
                f"got steps {steps}, context {context}"
            )
    elif profile:
        sizes, names = [profile_budget], names or ["vase"]
    else:
        sizes = _csv(budgets, int)
        marks = _csv(lengths, int)
        if not marks or min(marks) < 1:
            raise ValueError(f"--lengths must be positive token counts, got {lengths!r}")
        if not sizes:
            raise ValueError("--budgets is empty: give at least one budget")
    for name in names:
        for size in sizes:  # the full cache has no budget: only its name is checked
            check_options(policy=name, budget=None if name == "full" else size, buffer=buffer)
    _threads()
    if paired or profile or compile:
        from .hf.models import load_model

        lm = load_model(model, device=device)
    if compile:
        res = compiled_speed(
            lm, ["full", *names], contexts=ctx, budget=paired_budget, buffer=buffer, steps=steps, backend=backend
        )
        _write_results(out, "compiled", res, compiled_markdown(res), lm)
        return
    if paired:
        res = paired_speed(lm, _csv(policies), budget=paired_budget, buffer=buffer, context=context, steps=steps)
        _write_results(out, "paired", res, paired_markdown(res), lm)
        return
    if profile:
        for policy in _csv(policies) or ["vase"]:
            typer.echo(profile_eviction(lm, policy=policy, budget=profile_budget, buffer=buffer))
        return
    run_bench(
        out,
        _csv(policies),
        _csv(budgets, int),
        _csv(lengths, int),
        buffer=buffer,
        model=model,
        device=device,
    )
    typer.echo((out / "BENCH.md").read_text())


@app.command()
@friendly
def convert(
    source: str = typer.Argument(..., help="smollm2 (embedded), gemma3-270m, a .gguf file, a model folder or a hub id"),
    out: Path = typer.Argument(..., help="folder to write (created)"),
    dtype: str = typer.Option("float32", help="dtype of the saved weights: float32, bfloat16, float16"),
):
    """Write a model as a folder vLLM loads (for vase inside vLLM, docs/SERVING.md): safetensors weights, the config
    with its architecture named, a tied embedding saved as the embedding, the tokenizer."""
    from .hf.convert import convert_for_vllm

    folder = convert_for_vllm(source, out, dtype=dtype)
    typer.echo(f"[vase] written {folder} (load it with vLLM, e.g. python -m vase.vllm.serve {folder} --vase vase)")


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


def _help_paragraphs(doc: str) -> str:
    """A command's docstring as ``--help`` text: its paragraphs with their lines joined (typer keeps the line breaks
    of the paragraphs after the first, so a wrapped sentence would show broken in the help)."""
    paras = _inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paras)


for _info in app.registered_commands:
    if _info.help is None and _info.callback is not None and _info.callback.__doc__:
        _info.help = _help_paragraphs(_info.callback.__doc__)


def main():  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

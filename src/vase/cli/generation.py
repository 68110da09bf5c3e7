"""``vase policies``, ``vase generate`` and ``vase demo``: one prompt through an evicting cache, streamed."""

from __future__ import annotations

import sys

import typer

from .common import (
    AttnOpt,
    BudgetOpt,
    BufferOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    PolicyOpt,
    RatioOpt,
    SeedOpt,
    ShareOpt,
    WindowOpt,
    byte_sizes,
    friendly,
    policy_options,
    set_threads,
)


@friendly
def policies():
    """List the eviction policies: name, what each keeps, source."""
    from ..core.policies import policy_table

    for name, keeps, source in policy_table():
        typer.echo(f"{name:14s} {keeps}\n{'':14s} {source}")
    typer.echo(
        "\nThe published method exactly as the authors' code runs it: vase:preset=paper and vase_dkv:preset=paper "
        "(budget a multiple of the buffer). Options go after colons: snapkv:selector=sample, vase:guard=random."
    )


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
    from ..harness.data import TEMPLATES

    options = dict(
        policy=policy,
        budget=budget,
        compression_ratio=ratio,
        **byte_sizes(byte_ratio, memory_budget, dtype, device),
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
        **policy_options(protect_share),
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
    from ..harness.data import TEMPLATES, pick_problem

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
    from ..harness.generation import check_options
    from ..hf.models import check_load_options

    config = check_options(**{k: v for k, v in options.items() if k not in _RUN_ONLY})
    check_load_options(
        model_options.get("dtype", "auto"), model_options.get("device", "auto"), model_options.get("attn", "sdpa")
    )
    return config


def _run_generation(text: str, model_options: dict, options: dict):
    """Load the model, stream the generation to stdout, end with the stats line. ``options`` go to vase.generate."""
    from transformers import TextStreamer

    from ..harness.generation import generate as run
    from ..hf.models import load_model

    config = _check_options(model_options, options)  # again for `vase demo`; cheap
    set_threads()
    lm = load_model(**model_options)
    typer.echo(f"[vase] model {lm.name} on {lm.device} ({str(lm.dtype).replace('torch.', '')})", err=True)
    streamer = TextStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    rest = {k: v for k, v in options.items() if k in _RUN_ONLY + _DECODING}
    result = run(lm.model, lm.tokenizer, text, streamer=streamer, config=config, **rest)
    sys.stdout.flush()
    typer.echo(result.stats_line())
    return result


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
    from ..harness.data import BUILTIN_PROMPT, TEMPLATES, pick_problem, resolve_task

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

"""``vase inspect`` and ``vase convert``: a model's value and key magnitudes, and a model as a folder vLLM loads."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import DeviceOpt, DtypeOpt, ModelOpt, friendly, set_threads
from .generation import _prompt_text


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
    from ..harness.magnitudes import inspect_model
    from ..hf.models import check_load_options, load_model

    check_load_options(dtype, device)
    if generate_tokens < 0 or top < 1:
        raise ValueError(f"--generate must be >= 0 and --top >= 1, got {generate_tokens} and {top}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a folder for the heat-map and JSON")
    text = _prompt_text(prompt, data, index, None, "auto")
    set_threads()
    lm = load_model(model, dtype=dtype, device=device)
    report = inspect_model(lm, text, out, generate_tokens=generate_tokens, top=top)
    typer.echo(report)
    typer.echo(f"[vase] written {out / 'magnitudes.json'} and {out / 'value_range_heatmap.png'}")


@friendly
def convert(
    source: str = typer.Argument(..., help="smollm2 (embedded), gemma3-270m, a .gguf file, a model folder or a hub id"),
    out: Path = typer.Argument(..., help="folder to write (created)"),
    dtype: str = typer.Option(
        "bfloat16", help="dtype of the saved weights: bfloat16 (what vLLM serves by default), float32, float16"
    ),
):
    """Write a model as a folder vLLM loads (for vase inside vLLM, docs/SERVING.md): safetensors weights, the config
    with its architecture named, a tied embedding saved as the embedding, the tokenizer."""
    from ..hf.convert import convert_for_vllm

    folder = convert_for_vllm(source, out, dtype=dtype)
    typer.echo(f"[vase] written {folder} (load it with vLLM, e.g. python -m vase.vllm.serve {folder} --vase vase)")

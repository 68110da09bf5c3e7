"""What the commands of ``vase`` share: the one-line error handling (:func:`friendly`), the options several commands
take, the parsing of comma-separated lists, and the help text of docstrings."""

from __future__ import annotations

import functools
import inspect
import os
import sys

import typer


def fail(message: str, code: int = 2):
    """Print ``error: message`` on stderr and exit with ``code`` (2: bad usage)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def one_line(exc: Exception) -> str:
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
        from ..harness.notes import show_on_stderr

        show_on_stderr()
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, NotImplementedError) as exc:
            fail(one_line(exc))
        except KeyboardInterrupt:
            sys.stderr.write("\n")  # below a progress bar that was being drawn
            saved = RESUMABLE.get(fn.__name__)
            fail(
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


def policy_options(protect_share: float | None) -> dict:
    return {} if protect_share is None else {"protect_share": protect_share}


def byte_sizes(byte_ratio: float | None, memory_budget: float | None, dtype: str, device: str) -> dict:
    """A size in bytes (``--byte-ratio`` / ``--memory-budget``) with the bytes of the model's dtype it is counted in,
    or nothing."""
    if byte_ratio is None and memory_budget is None:
        return {}
    from ..hf.models import check_load_options, resolve_device, resolve_dtype

    check_load_options(dtype, device)
    element = resolve_dtype(dtype, resolve_device(device)).itemsize
    return {"byte_ratio": byte_ratio, "memory_budget": memory_budget, "element_bytes": element}


def set_threads():
    """torch's thread count from ``$VASE_THREADS``, when set."""
    import torch

    if os.environ.get("VASE_THREADS"):
        torch.set_num_threads(int(os.environ["VASE_THREADS"]))


def parse_csv(text: str | None, cast=str) -> list:
    """``"a, b,c"`` -> ``["a", "b", "c"]`` with each item cast; nothing or blank -> ``[]``.

    Raises:
        ValueError: an item ``cast`` cannot read.
    """
    if text is None or not str(text).strip():
        return []
    try:
        return [cast(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"could not read {text!r} as a comma-separated list of {cast.__name__}") from None


def parse_policies(text: str) -> list[str]:
    """A comma-separated list of policy specs, or ``all`` for every policy."""
    from ..core.policies import POLICY_NAMES

    return list(POLICY_NAMES) if text == "all" else parse_csv(text)


def help_paragraphs(doc: str) -> str:
    """A command's docstring as ``--help`` text: its paragraphs with their lines joined (typer keeps the line breaks
    of the paragraphs after the first, so a wrapped sentence would show broken in the help)."""
    paras = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paras)


def tidy_help(app: typer.Typer) -> None:
    """Give each command of ``app`` without an explicit help its docstring as :func:`help_paragraphs`."""
    for info in app.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            info.help = help_paragraphs(info.callback.__doc__)

"""Sizes in tokens per (sequence, layer, KV head): the defaults, the rules every size obeys, and the budget a
compression ratio gives (torch-free; the rules that involve a policy are in :mod:`vase.core.config`)."""

from __future__ import annotations

import math

DEFAULT_BUDGET = 1024
DEFAULT_BUFFER = 64
DEFAULT_SINKS = 4


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(budget: int | None, buffer: int, sinks: int, window: int | None = None) -> None:
    """The size rules (tokens; ``budget`` None: not known yet, e.g. from a ratio).

    Raises:
        ValueError: a non-integer size, buffer < 1, sinks < 0, budget not larger than sinks + buffer, window < 1.
    """
    for name, value in (("budget", budget), ("buffer", buffer), ("sinks", sinks)):
        if value is not None and not is_int(value):
            raise ValueError(f"{name} must be an integer number of tokens, got {value!r}")
    if buffer < 1:
        raise ValueError(f"buffer must be >= 1 token, got {buffer}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0 tokens, got {sinks}")
    if budget is not None and budget <= sinks + buffer:
        raise ValueError(
            f"budget ({budget}) must be larger than sinks + buffer ({sinks} + {buffer} = {sinks + buffer}): "
            "raise the budget or lower the buffer"
        )
    if window is not None and (not is_int(window) or window < 1):
        raise ValueError(f"window must be a positive number of queries, got {window!r}")


def check_ratio(ratio) -> None:
    """Raises ValueError unless ``ratio`` is a number > 1 (a 4x smaller cache: 4)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 < ratio < math.inf:
        raise ValueError(f"compression ratio must be > 1 (e.g. 4 for a 4x smaller cache), got {ratio!r}")


def published_budget(budget: int, buffer: int) -> int:
    """``budget`` rounded to the nearest multiple of ``buffer`` (at least two buffers): the budgets the published
    method can take, for budgets derived from a compression ratio."""
    return max(round(budget / buffer), 2) * buffer


def ratio_budget(total_tokens: float, ratio: float, buffer: int, sinks: int = DEFAULT_SINKS, published: bool = False):
    """The budget (tokens per KV head) that compresses ``total_tokens`` (prompt + new tokens) by ``ratio``:
    ``ceil(total / ratio)``, at least ``sinks + buffer + 1`` (room for one candidate); with ``published`` (a run
    holding the published method, ``preset='paper'``) rounded by :func:`published_budget`, for every policy of the
    run alike. Used by ``vase generate --ratio``, the evaluation sweeps and the fidelity replays."""
    budget = max(math.ceil(total_tokens / ratio), sinks + buffer + 1)
    return published_budget(budget, buffer) if published else budget


def ratio_note(total_tokens: int, ratio: float, buffer: int, sinks: int = DEFAULT_SINKS, published: bool = False):
    """A warning when ``total_tokens`` cannot be compressed by ``ratio`` (the floor ``sinks + buffer + 1`` raised its
    budget, or the published preset rounded it, by more than 5%), else None."""
    budget = ratio_budget(total_tokens, ratio, buffer, sinks, published)
    measured = total_tokens / budget
    if measured >= 0.95 * ratio:
        return None
    return (
        f"ratio {ratio:g}x asked, {measured:.2f}x measured for {total_tokens} tokens: the budget is raised to {budget} "
        f"(at least sinks + buffer + 1 = {sinks + buffer + 1}"
        + (", rounded to the buffer for the published preset" if published else "")
        + "); results are labelled with the compression measured"
    )


def check_element_bytes(element_bytes) -> None:
    """Raises ValueError unless ``element_bytes`` (bytes of one element in the model's dtype) is 1, 2, 4 or 8."""
    if isinstance(element_bytes, bool) or element_bytes not in (1, 2, 4, 8):
        raise ValueError(
            f"element_bytes must be the size of the model's dtype in bytes (4 for float32, 2 for bfloat16), got "
            f"{element_bytes!r}"
        )


def compiled_capacity(tokens: int) -> int:
    """Slots allocated per (layer, KV head) by compiled decoding when the slots needed, ``tokens``, follow the prompt
    (the ``full`` policy, a compression ratio, a dense prompt): the next power of two, at least 256.

    A compiled decode step is one graph per buffer shape, so rounding bounds the graphs one process compiles to one per
    power of two, whatever the prompt lengths: capacities up to ``2**k`` give at most ``k - 7`` graphs (8 up to
    32,768 slots) for each batch size. The slots past what a sequence needs are masked and never hold a token.
    """
    return max(256, 1 << max(int(tokens) - 1, 1).bit_length())

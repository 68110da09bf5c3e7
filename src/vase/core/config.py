"""One configuration, resolved once: what a budget, a ratio, a window and a policy spec mean (torch only).

Every entry point (the command line, :func:`vase.generate`, the evaluation and fidelity sweeps, the benchmarks,
:class:`vase.EvictingCache` and the vLLM plugin) builds a :class:`VaseConfig` from the user's options with
:meth:`VaseConfig.resolve`, before any model is loaded. It validates every rule that does not depend on the model
and raises the clear errors below; the integrations then check only what depends on the model (its layer kinds, its
attention kernel).

Sizes are in tokens per (sequence, layer, KV head):

* ``budget``: tokens kept after each eviction (sinks + recent window + the policy's choice);
* ``buffer``: tokens written between two evictions; a sequence holds at most ``budget + buffer`` (static memory);
* ``sinks``: first tokens always kept; ``recent``: newest tokens always kept (the policy option ``recent``, else the
  buffer); ``window``: saved queries the attention-based scorers read.

A compression ratio instead of a budget gives, for each sequence, ``budget = ceil(total / ratio)`` with ``total``
= prompt + new tokens (:func:`ratio_budget`), at least ``sinks + buffer + 1`` (:meth:`VaseConfig.for_length`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import budgets
from .policies import make_policy
from .policy import Policy

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


def recent_window(policy: Policy, budget: int | None, buffer: int, sinks: int) -> int:
    """The newest tokens each eviction keeps: the policy option ``recent``, or ``buffer`` when it is not set.

    ``recent`` below the buffer lets the policy evict some of the tokens written since the last compaction (as
    kvpress does with its own window); above it, protects more than one compaction interval.

    Raises:
        ValueError: ``sinks + recent`` not below the budget (nothing would be left to choose).
    """
    recent = buffer if policy.recent is None else policy.recent
    if budget is not None and sinks + recent >= budget:
        raise ValueError(
            f"recent ({recent}) + sinks ({sinks}) must be below the budget ({budget}): lower recent or raise the budget"
        )
    return recent


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


def check_published(policy: Policy, budget: int, buffer: int, window: int) -> None:
    """The rules the published method's code needs (``preset='paper'``), as clear errors.

    Raises:
        ValueError: a budget that is not a multiple of the buffer (the reference compacts when the cache length is a
            multiple of the buffer, so it only ever holds such budgets), or an observation window other than the
            buffer (the reference keeps the last ``buffer`` queries).
    """
    if budget % buffer:
        lo, hi = (budget // buffer) * buffer, (budget // buffer + 1) * buffer
        hint = f"{lo} or {hi}" if lo > buffer else f"{hi}"
        raise ValueError(
            f"the published method ({policy.name}:preset=paper) needs a budget that is a multiple of the buffer "
            f"({buffer}); got {budget}: use {hint}"
        )
    if policy.window and window != buffer:
        raise ValueError(
            f"the published method ({policy.name}:preset=paper) scores with the last `buffer` queries: window must "
            f"equal the buffer ({buffer}), got {window}"
        )


def check_compileable_policy(policy: Policy) -> None:
    """Raise a clear ValueError for a policy compiled decoding cannot take: the selection policy ``quest``."""
    if policy.sparse is not None:
        raise ValueError(f"compiled decoding does not support the selection policy {policy.name!r}: use another one")


def compiled_capacity(tokens: int) -> int:
    """Slots allocated per (layer, KV head) by compiled decoding when the slots needed, ``tokens``, follow the prompt
    (the ``full`` policy, a compression ratio, a dense prompt): the next power of two, at least 256.

    A compiled decode step is one graph per buffer shape, so rounding bounds the graphs one process compiles to one per
    power of two, whatever the prompt lengths: capacities up to ``2**k`` give at most ``k - 7`` graphs (8 up to
    32,768 slots) for each batch size. The slots past what a sequence needs are masked and never hold a token.
    """
    return max(256, 1 << max(int(tokens) - 1, 1).bit_length())


@dataclass(frozen=True)
class VaseConfig:
    """What an evicting cache does, resolved and validated once (see the module docstring for the sizes).

    Build it with :meth:`resolve`; read ``budget`` (None while a ratio waits for a sequence's length: call
    :meth:`for_length`). Frozen: derive another with :meth:`for_length` or :func:`dataclasses.replace` (which does
    not validate again).

    Attributes:
        policy: the built :class:`vase.Policy` (scorer, guard, selector, options).
        budget: tokens kept per (sequence, layer, KV head), or None with a ratio not yet applied.
        ratio: the compression ratio asked for, or None for a fixed budget.
        buffer, sinks: tokens (see the module docstring).
        window: saved queries per layer for scoring (0 when the policy needs none; the buffer for the published
            preset).
        recent: newest tokens every eviction keeps (the policy option ``recent``, else the buffer).
        compress_prompt: compress a prompt longer than the budget at prefill (False: dense until the first eviction,
            as the published code).
        compile: decode steps as fixed-shape graphs (``torch.compile``).
    """

    policy: Policy
    budget: int | None
    ratio: float | None
    buffer: int
    sinks: int
    window: int
    recent: int
    compress_prompt: bool
    compile: bool = False

    @classmethod
    def resolve(
        cls,
        policy: str | Policy = "vase",
        *,
        budget: int | None = None,
        ratio: float | None = None,
        buffer: int = DEFAULT_BUFFER,
        sinks: int = DEFAULT_SINKS,
        window: int | None = None,
        compress_prompt: bool | None = None,
        compile: bool = False,
        per_sequence: bool = False,
        **policy_options,
    ) -> VaseConfig:
        """Build and validate a configuration from the user's options (the names of the command line and the API).

        Args:
            policy: a policy name or spec (``'snapkv:selector=sample'``) or a built :class:`vase.Policy`.
            budget: tokens kept per (sequence, layer, KV head); default :data:`DEFAULT_BUDGET` when no ratio.
            ratio: a compression ratio instead of a budget (applied per sequence by :meth:`for_length`).
            buffer, sinks, window: tokens / saved queries (see the module docstring); window defaults to the
                policy's, or the buffer for the published preset.
            compress_prompt: default: the policy's option ``prompt`` ('compress' unless 'dense', as the preset).
            compile: compiled decode steps (refused for the selection policy quest).
            per_sequence: no budget and no ratio yet: each sequence's budget is set with :meth:`with_budget` (a sweep
                whose budgets come from elsewhere); otherwise the default budget applies.
            **policy_options: options of the policy (see :func:`vase.make_policy`).

        Raises:
            ValueError: budget and ratio both given; a ratio <= 1; budget not larger than sinks + buffer, buffer
                < 1, sinks < 0, window < 1; an unknown policy or option (the message lists the valid ones);
                ``sinks + recent`` not below the budget; the published preset with a budget that is not a multiple
                of the buffer or a window other than the buffer; quest with a budget below its forced pages;
                adaptive budgets whose ``budget_cap`` is below the first layer's pyramid budget; ``compile`` with
                quest.
        """
        if budget is not None and ratio is not None:
            raise ValueError("give either a budget or a compression ratio, not both")
        if ratio is not None:
            check_ratio(ratio)
            ratio = float(ratio)
        elif budget is None and not per_sequence:
            budget = DEFAULT_BUDGET
        check_sizes(budget, buffer, sinks, window)
        built = make_policy(policy, **policy_options)
        if not built.window:
            window = 0
        elif window is None:
            window = buffer if built.published else built.window
        config = cls(
            policy=built,
            budget=None,
            ratio=ratio,
            buffer=buffer,
            sinks=sinks,
            window=window,
            recent=recent_window(built, None, buffer, sinks),
            compress_prompt=built.compress_prompt if compress_prompt is None else bool(compress_prompt),
            compile=bool(compile),
        )
        if compile:
            check_compileable_policy(built)
        return config.with_budget(budget) if budget is not None else config

    def with_budget(self, budget: int) -> VaseConfig:
        """This configuration at a fixed ``budget`` (tokens), with every budget rule checked.

        Raises:
            ValueError: see :meth:`resolve` (the rules that involve the budget).
        """
        check_sizes(budget, self.buffer, self.sinks)
        recent_window(self.policy, budget, self.buffer, self.sinks)
        if self.policy.published:
            check_published(self.policy, budget, self.buffer, self.window or self.buffer)
        if self.policy.sparse is not None:  # quest: the budget must cover the pages it always attends
            self.policy.sparse.check(budget, self.sinks)
        if self.policy.adaptive_budgets:  # the pyramid's first layer must fit the cap, whatever the depth
            budgets.check_cap(self.policy.options, budget, self.sinks + self.recent)
        return replace(self, budget=int(budget))

    def budget_for(self, total_tokens: int) -> int:
        """The budget of a sequence of ``total_tokens`` (prompt + new tokens): the fixed budget, or
        :func:`ratio_budget` of the ratio (rounded to the buffer for the published preset)."""
        if self.ratio is None:
            return self.budget
        return ratio_budget(total_tokens, self.ratio, self.buffer, self.sinks, self.policy.published)

    def for_length(self, total_tokens: int, published: bool | None = None) -> VaseConfig:
        """This configuration with its budget for a sequence of ``total_tokens`` (itself with a fixed budget).

        ``published`` (default: this policy's preset) rounds a ratio's budget to the buffer, as a run holding the
        published method does for all its policies alike.
        """
        if self.ratio is None:
            return self
        pub = self.policy.published if published is None else published
        return self.with_budget(ratio_budget(total_tokens, self.ratio, self.buffer, self.sinks, pub))

    def effective_ratio(self, total_tokens: int) -> float:
        """The compression ``total_tokens / budget`` a sequence of that length gets (below the ratio asked for when
        the floor ``sinks + buffer + 1`` raised its budget)."""
        return total_tokens / self.budget_for(total_tokens)

    @property
    def chosen(self) -> int | None:
        """Tokens the policy chooses at each eviction: ``budget - sinks - recent`` (None before a ratio is applied)."""
        return None if self.budget is None else self.budget - self.sinks - self.recent

    def buffer_note(self) -> str | None:
        """A warning when the policy chooses fewer than a quarter of the budget (the sinks and the recent window
        keep the rest, so results say more about the buffer than about the policy), else None."""
        if self.budget is None or not self.policy.evicts or self.chosen * 4 >= self.budget:
            return None
        return (
            f"at budget {self.budget} the policy chooses only {self.chosen} of the {self.budget} tokens kept "
            f"({self.sinks} sinks + {self.recent} recent fill the rest): the results say more about the buffer than "
            "about the policy; use longer sequences, a smaller --buffer or a larger budget"
        )

    def ratio_note(self, total_tokens: int, published: bool | None = None) -> str | None:
        """:func:`ratio_note` for a sequence of ``total_tokens`` under this configuration (None with a budget)."""
        if self.ratio is None:
            return None
        pub = self.policy.published if published is None else published
        return ratio_note(total_tokens, self.ratio, self.buffer, self.sinks, pub)

    def layout(self, layers: int) -> tuple[list[int], int]:
        """Per-layer budgets and physical slots per (layer, KV head) for kept tokens (see
        :func:`vase.core.budgets.layout`)."""
        return budgets.layout(self.policy.options, self.budget, layers, self.sinks + self.recent)

    @property
    def published(self) -> bool:
        """Whether the policy is the published method's preset (``preset='paper'``)."""
        return self.policy.published

    def describe(self) -> str:
        """One line: policy, budget (or ratio), buffer, sinks."""
        size = f"budget {self.budget}" if self.budget is not None else f"ratio {self.ratio:g}x"
        return f"{self.policy.name}, {size}, buffer {self.buffer}, sinks {self.sinks}"

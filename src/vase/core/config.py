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

With quantized entries (policy option ``kv_bits``, :mod:`vase.core.quant`) a kept token costs a fraction ``c`` of a
token in the model's dtype (:func:`vase.core.quant.token_cost`), so sizes can be given in bytes: a **byte ratio** ``r``
makes the bytes of what a compaction keeps (the budget's codes, scales and full-precision entries) ``1 / r`` of the
full cache's bytes for the sequence, ``budget = ceil(total / (r * c))`` (a token ratio of ``r * c``; without
``kv_bits`` the same budget as the ratio ``r``); a **memory budget** ``M`` is the bytes of ``M`` tokens in the model's
dtype, ``budget = floor(M / c)``. The recent ``buffer`` (full precision in every configuration) comes on top of both,
as it does for token budgets. A full-precision window of ``R`` tokens (policy option ``kv_window``) is part of what a
compaction keeps, each of its tokens costing ``w`` more (:func:`vase.core.quant.window_cost`): the budgets become
``ceil((total / r - R * w) / c)`` and ``floor((M - R * w) / c)`` (:meth:`VaseConfig.kept_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import budgets, quant
from .policies import make_policy
from .policy import Policy
from .sizes import (
    DEFAULT_BUDGET,
    DEFAULT_BUFFER,
    DEFAULT_SINKS,
    check_element_bytes,
    check_ratio,
    check_sizes,
    ratio_budget,
    ratio_note,
)


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
    """Raise a clear ValueError for a policy compiled decoding cannot take: the selection policy ``quest``, or
    quantized entries (``kv_bits``: dequantized into a workspace before each layer, outside any graph)."""
    if policy.sparse is not None:
        raise ValueError(f"compiled decoding does not support the selection policy {policy.name!r}: use another one")
    if policy.options.get("kv_bits") is not None:
        raise ValueError(
            "compiled decoding does not support quantized entries (kv_bits): they are dequantized before each "
            "layer's attention, outside the graph; decode uncompiled (compile=False) or without kv_bits"
        )


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
        byte_ratio: the compression ratio in bytes asked for (``ratio`` then holds the token ratio it means,
            ``byte_ratio * token_cost``), or None.
        element_bytes: bytes of one element in the model's dtype, for sizes in bytes (None: not needed).
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
    byte_ratio: float | None = None
    element_bytes: int | None = None

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
        byte_ratio: float | None = None,
        memory_budget: float | None = None,
        element_bytes: int | None = None,
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
            byte_ratio: a compression ratio in bytes instead of a budget (see the module docstring), applied per
                sequence by :meth:`for_length`.
            memory_budget: the bytes of this many tokens in the model's dtype, per (sequence, layer, KV head),
                instead of a budget: the budget is as many tokens as fit at the policy's ``kv_bits``.
            element_bytes: bytes of one element in the model's dtype (4 for float32, 2 for bfloat16); needed with a
                byte ratio or a memory budget when the policy has ``kv_bits``.
            **policy_options: options of the policy (see :func:`vase.make_policy`).

        Raises:
            ValueError: budget and ratio both given; a ratio <= 1; budget not larger than sinks + buffer, buffer
                < 1, sinks < 0, window < 1; an unknown policy or option (the message lists the valid ones);
                ``sinks + recent`` not below the budget; the published preset with a budget that is not a multiple
                of the buffer or a window other than the buffer; quest with a budget below its forced pages;
                adaptive budgets whose ``budget_cap`` is below the first layer's pyramid budget; ``compile`` with
                quest or with ``kv_bits``; ``kv_bits`` not one of none, 8, 4, 2, ``protect_precision=guard`` without
                a value guard (see :func:`vase.core.quant.check_options`), ``kv_bits`` with adaptive budgets; more
                than one of budget, ratio, byte ratio and memory budget; a byte ratio <= 1; a memory budget whose
                budget is not larger than sinks + buffer; a size in bytes with ``kv_bits`` but no ``element_bytes``.
        """
        sizes = [n for n, v in (("budget", budget), ("ratio", ratio), ("byte_ratio", byte_ratio)) if v is not None]
        if memory_budget is not None:
            sizes.append("memory_budget")
        if sizes == ["budget", "ratio"]:
            raise ValueError("give either a budget or a compression ratio, not both")
        if len(sizes) > 1:
            raise ValueError(
                f"give one of a budget, a compression ratio, a byte ratio or a memory budget, not {' and '.join(sizes)}"
            )
        if byte_ratio is not None or memory_budget is not None:
            return cls._resolve_bytes(
                policy,
                byte_ratio,
                memory_budget,
                element_bytes,
                buffer=buffer,
                sinks=sinks,
                window=window,
                compress_prompt=compress_prompt,
                compile=compile,
                **policy_options,
            )
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
            element_bytes=element_bytes,
        )
        if element_bytes is not None:
            check_element_bytes(element_bytes)
        if compile:
            check_compileable_policy(built)
        if built.options.get("kv_bits") is not None and built.adaptive_budgets:
            raise ValueError(
                "kv_bits does not combine with adaptive budgets (head_budget / layer_budget / step_budget) yet"
            )
        return config.with_budget(budget) if budget is not None else config

    @classmethod
    def _resolve_bytes(cls, policy, byte_ratio, memory_budget, element_bytes, **options) -> VaseConfig:
        """:meth:`resolve` with a size in bytes (a byte ratio or a memory budget; see the module docstring)."""
        if byte_ratio is not None:
            if (
                isinstance(byte_ratio, bool)
                or not isinstance(byte_ratio, (int, float))
                or not 1 < byte_ratio < math.inf
            ):
                raise ValueError(
                    f"byte compression ratio must be > 1 (e.g. 8 for 8x fewer bytes kept), got {byte_ratio!r}"
                )
        elif isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget > 0:
            raise ValueError(
                f"memory budget must be a positive number of full-precision tokens' bytes, got {memory_budget!r}"
            )
        if element_bytes is not None:
            check_element_bytes(element_bytes)
        base = cls.resolve(policy, per_sequence=True, **options)
        if base.kv_bits is not None and element_bytes is None:
            raise ValueError(
                "a size in bytes with kv_bits needs element_bytes, the size of the model's dtype (4 for float32, 2 for "
                "bfloat16)"
            )
        base = replace(base, element_bytes=element_bytes)
        cost = base.token_cost
        if byte_ratio is not None:
            return replace(base, ratio=float(byte_ratio) * cost, byte_ratio=float(byte_ratio))
        fits = math.floor((memory_budget - base.kept_bytes(0)) / cost + 1e-9)
        if fits <= base.sinks + base.buffer:
            raise ValueError(
                f"a memory budget of {memory_budget:g} tokens' bytes holds {fits} tokens"
                + (f" at kv_bits={base.kv_bits} ({cost:.3f} of a token each)" if base.kv_bits is not None else "")
                + f", not more than sinks + buffer ({base.sinks} + {base.buffer} = {base.sinks + base.buffer}): raise "
                "the memory budget, lower the buffer or the bits"
            )
        return base.with_budget(fits)

    @property
    def kv_bits(self) -> int | None:
        """Bits per stored key/value element of the kept entries (policy option ``kv_bits``), None: the model's
        dtype."""
        return self.policy.options.get("kv_bits")

    @property
    def kv_group(self) -> int:
        """Channels per quantization group (policy option ``kv_group``)."""
        return self.policy.options.get("kv_group", quant.DEFAULT_GROUP)

    @property
    def protect_precision(self) -> str:
        """'guard' when the value guard keeps its entries in full precision, else 'none'."""
        return self.policy.options.get("protect_precision", "none")

    @property
    def kv_attention(self) -> str:
        """How decoding attends over quantized entries (policy option ``kv_attention``): 'codes' or 'dequantize'."""
        return self.policy.options.get("kv_attention", "codes")

    @property
    def token_cost(self) -> float:
        """Bytes of a kept token over those of a token in the model's dtype (:func:`vase.core.quant.token_cost`; 1
        without ``kv_bits``).

        Raises:
            ValueError: with ``kv_bits`` but no ``element_bytes``.
        """
        if self.kv_bits is None:
            return 1.0
        if self.element_bytes is None:
            raise ValueError("the cost of a quantized token needs element_bytes (the size of the model's dtype)")
        share = self.policy.guard.share if self.protect_precision == "guard" and self.policy.guard else 0.0
        return quant.token_cost(self.kv_bits, self.kv_group, self.element_bytes, share)

    @property
    def kv_window(self) -> int:
        """The newest tokens always kept in full precision with quantized entries (policy option ``kv_window``)."""
        return self.policy.options.get("kv_window", 0)

    def kept_bytes(self, kept: float) -> float:
        """The bytes of ``kept`` tokens kept by a compaction, in tokens of the model's dtype: ``kept * token_cost``
        plus the full-precision window's ``kv_window * window_cost`` (:func:`vase.core.quant.window_cost`).

        Raises:
            ValueError: with ``kv_bits`` but no ``element_bytes``.
        """
        window = self.kv_window and self.kv_window * quant.window_cost(self.kv_bits, self.kv_group, self.element_bytes)
        return kept * self.token_cost + window

    def _ratio_total(self, total_tokens: float) -> float:
        """The length whose plain ratio budget is the byte ratio's (``kept_bytes(budget) = total / byte_ratio``)."""
        window = self.kept_bytes(0) if self.byte_ratio is not None and self.kv_window else 0.0
        return total_tokens - (self.byte_ratio or 0.0) * window

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
        if self.kv_window >= budget and self.policy.evicts:
            raise ValueError(
                f"kv_window {self.kv_window} must be below the budget {budget} (the newest kept tokens held in full "
                "precision): lower kv_window or raise the budget"
            )
        return replace(self, budget=int(budget))

    def budget_for(self, total_tokens: int) -> int:
        """The budget of a sequence of ``total_tokens`` (prompt + new tokens): the fixed budget, or
        :func:`ratio_budget` of the ratio (rounded to the buffer for the published preset)."""
        if self.ratio is None:
            return self.budget
        return ratio_budget(self._ratio_total(total_tokens), self.ratio, self.buffer, self.sinks, self.policy.published)

    def for_length(self, total_tokens: int, published: bool | None = None) -> VaseConfig:
        """This configuration with its budget for a sequence of ``total_tokens`` (itself with a fixed budget).

        ``published`` (default: this policy's preset) rounds a ratio's budget to the buffer, as a run holding the
        published method does for all its policies alike.
        """
        if self.ratio is None:
            return self
        pub = self.policy.published if published is None else published
        return self.with_budget(ratio_budget(self._ratio_total(total_tokens), self.ratio, self.buffer, self.sinks, pub))

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
        note = ratio_note(total_tokens, self.ratio, self.buffer, self.sinks, pub)
        if note is None or self.byte_ratio is None:
            return note
        budget = ratio_budget(total_tokens, self.ratio, self.buffer, self.sinks, pub)
        measured = self.byte_ratio * self.ratio_of(total_tokens, budget)
        return (
            f"byte ratio {self.byte_ratio:g}x asked, {measured:.2f}x measured for {total_tokens} tokens: the budget is "
            f"raised to {budget} (at least sinks + buffer + 1 = {self.sinks + self.buffer + 1})"
        )

    def ratio_of(self, total_tokens: int, budget: int) -> float:
        """The compression a budget gives a sequence, relative to the ratio asked (1.0: as asked)."""
        return total_tokens / budget / self.ratio

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
        if self.budget is not None:
            size = f"budget {self.budget}"
        elif self.byte_ratio is not None:
            size = f"byte ratio {self.byte_ratio:g}x"
        else:
            size = f"ratio {self.ratio:g}x"
        return f"{self.policy.name}, {size}, buffer {self.buffer}, sinks {self.sinks}"

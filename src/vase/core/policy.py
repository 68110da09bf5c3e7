"""A policy = scorer + optional value guard + selector, under a standard name.

Every policy module in :mod:`vase.core.policies` builds its :class:`Policy` with :func:`compose` from its own scorer and
defaults. The guard and selector options are open to every evicting policy, so the paper's ablations are
configurations, for example (VaSE, arXiv 2606.03928, Sec. 5)::

    make_policy("snapkv", selector="sample")                      # SnapKV + sampling
    make_policy("snapkv", guard="range", protect_share=0.25)      # SnapKV + value guard
    make_policy("vase", guard="random")                           # protect random slots instead
    make_policy("snapkv", guard="range", guard_mode="evict")      # evict the largest values first

Beyond the paper, also open to every evicting policy: an adaptive guard that protects only value outliers
(``guard_rule='outlier'``, ``outlier_factor``), and a recent window other than the buffer (``recent``); attention-based
scorers also take ``value_weight`` ('l1': VATP, 'output_error': CAOTE), for example::

    make_policy("snapkv", value_weight="output_error")
    make_policy("vase", guard_rule="outlier", outlier_factor=6)
    make_policy("h2o", recent=16)

Adaptive budgets, open to every evicting policy: ``head_budget='adakv'`` shares each layer's budget
between its KV heads by one top-k of the policy's scores over the whole layer (AdaKV, arXiv 2407.11550, Sec. 3),
``layer_budget='pyramid'`` gives the first layers more than the last (PyramidKV, arXiv 2406.02069, Sec. 3); the total
kept stays layers x KV heads x budget (see :mod:`vase.core.budgets` and :class:`vase.EvictingCache`)::

    make_policy("snapkv", head_budget="adakv", layer_budget="pyramid")

A confidence-driven budget per eviction (``step_budget='confidence'``: fewer tokens kept after a stretch the model
was confident about, more after an uncertain one, within the cap; Conf-KV, arXiv 2605.24786; see
:mod:`vase.core.confidence`) composes with all of these::

    make_policy("vase", step_budget="confidence", budget_cap=1.5)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import quant
from .budgets import BUDGET_CAP, FLOOR_SHARE, PYRAMID_BETA
from .confidence import CONFIDENCE_FLOOR, STEP_BUDGETS
from .scoring import VALUE_WEIGHTS, EvictionContext, Scorer
from .selection import (
    GUARD_METRICS,
    GUARD_MODES,
    GUARD_SINKS,
    Sample,
    Selection,
    Selector,
    TopK,
    ValueGuard,
    check_guard_rule,
    select,
)

SELECTORS = ("topk", "sample")
PROMPT_MODES = ("compress", "dense")
HEAD_BUDGETS = ("uniform", "adakv")
LAYER_BUDGETS = ("uniform", "pyramid")
COMMON_OPTIONS = {
    "selector": "topk",
    "sampling_temperature": 1.0,
    "guard": None,
    "protect_share": 0.25,
    "guard_mode": "protect",
    "guard_sinks": "outside",
    "guard_rule": "share",
    "outlier_factor": 6.0,
    "recent": None,
    "prompt": "compress",
    "head_budget": "uniform",
    "layer_budget": "uniform",
    "budget_cap": BUDGET_CAP,
    "head_floor": FLOOR_SHARE,
    "pyramid_beta": PYRAMID_BETA,
    "step_budget": "fixed",
    "confidence_floor": CONFIDENCE_FLOOR,
    **{
        "kv_bits": None,
        "kv_group": quant.DEFAULT_GROUP,
        "protect_precision": "none",
        "kv_attention": "codes",
        "kv_window": 0,
    },
}
# the options of the full cache with quantized storage (policy ``full``: quantization alone, no eviction)
QUANT_OPTIONS = {
    "kv_bits": None,
    "kv_group": quant.DEFAULT_GROUP,
    "protect_precision": "none",
    "kv_attention": "codes",
    "kv_window": 0,
    "guard": None,
    "protect_share": 0.25,
    "guard_rule": "share",
    "outlier_factor": 6.0,
}
AMBIGUOUS_TEMPERATURE = (
    "the policy option 'temperature' is ambiguous: use sampling_temperature (exponent on the scores when sampling "
    "which slots to keep: p ~ score^(1/T)) or attention_temperature (divides the attention logits of the importance "
    "score, what the VaSE reference code calls temperature)"
)


@dataclass(frozen=True)
class Policy:
    """An eviction policy.

    Attributes:
        name: standard name (``vase``, ``snapkv``, ...).
        scorer: importance per cached entry, or None for a policy that never evicts (``full``).
        selector: top-k or sampling.
        guard: optional value-magnitude guard.
        source: the paper (and section) the policy comes from.
        keeps: one line on what the policy keeps.
        options: the resolved options it was built with (``prompt``: 'compress' compresses a prompt longer than the
            budget at prefill, 'dense' keeps it whole until the first eviction; ``preset``: 'paper' for the
            published method; ``recent``: the newest tokens always kept, None = the cache's buffer; ``head_budget``
            'uniform' | 'adakv', ``layer_budget`` 'uniform' | 'pyramid', ``budget_cap``, ``head_floor``,
            ``pyramid_beta``, ``step_budget`` 'fixed' | 'confidence', ``confidence_floor``: adaptive budgets, see
            :attr:`adaptive_budgets`).
        sparse: for a selection policy that never evicts (``quest``), its per-step attention rule
            (:class:`vase.core.pages.PageSelection`): which held entries each query attends to; None otherwise.
    """

    name: str
    scorer: Scorer | None
    selector: Selector
    guard: ValueGuard | None
    source: str
    keeps: str
    options: dict
    sparse: Any = None

    @property
    def evicts(self) -> bool:
        """False for ``full`` and ``quest``, which never evict."""
        return self.scorer is not None

    @property
    def window(self) -> int:
        """Recent queries the scorer needs saved per layer (0: none)."""
        return self.scorer.window if self.scorer is not None else 0

    @property
    def compress_prompt(self) -> bool:
        """Whether a prompt longer than the budget is compressed at prefill (option ``prompt``)."""
        return self.options.get("prompt", "compress") != "dense"

    @property
    def recent(self) -> int | None:
        """The newest tokens always kept (option ``recent``), or None for the cache's buffer."""
        return self.options.get("recent")

    @property
    def published(self) -> bool:
        """Whether this is the published method's preset (``preset='paper'``): the cache then enforces its rules."""
        return self.options.get("preset") == "paper"

    @property
    def state_names(self) -> tuple[str, ...]:
        """Per-slot state tensors the scorer keeps (H2O's accumulated attention, the reference slot order)."""
        return self.scorer.state_names if self.scorer is not None else ()

    @property
    def memo_names(self) -> dict[str, int]:
        """Per-row memo the scorer keeps between evictions, with initial values (H2O: ``acc_upto``, -1)."""
        return dict(self.scorer.memo_names) if self.scorer is not None else {}

    @property
    def adaptive_budgets(self) -> bool:
        """Whether heads, layers or evictions keep different counts (``head_budget='adakv'``,
        ``layer_budget='pyramid'`` or ``step_budget='confidence'``).

        ``head_budget='adakv'``: per layer, each KV head's count comes from one top-k of the policy's scores over all
        the layer's heads, a share ``head_floor`` of the uniform count given to every head first (AdaKV, arXiv
        2407.11550, Sec. 3, Algorithm 1; its alpha = 0.2); ``layer_budget='pyramid'``: the budget decreases linearly
        with depth, ``pyramid_beta`` setting the slope (PyramidKV, arXiv 2406.02069, Sec. 3; beta = 20). No head
        and no layer holds more than ``budget_cap`` x the budget (the physical slots allocated per head for kept
        tokens). ``step_budget='confidence'``: each eviction of a row keeps the budget scaled by the uncertainty of
        the tokens since its previous eviction over its average (at least ``confidence_floor``, at most
        ``budget_cap``; :mod:`vase.core.confidence`, after Conf-KV, arXiv 2605.24786).
        """
        heads, layers = self.options.get("head_budget", "uniform"), self.options.get("layer_budget", "uniform")
        return self.evicts and (heads != "uniform" or layers != "uniform" or self.confidence_budget)

    @property
    def per_kv_head(self) -> bool:
        """Whether every choice of a KV head reads that head alone (its keys, values and GQA group of queries): what
        lets a tensor-parallel worker holding some of a layer's heads choose as one worker holding them all. False
        for a score reduced over the layer's heads (TOVA's mean over every head) and for AdaKV's layer-wide top-k."""
        if not self.evicts:
            return True
        return self.scorer.per_kv_head and self.options.get("head_budget", "uniform") == "uniform"

    @property
    def confidence_budget(self) -> bool:
        """Whether each eviction's count follows the model's confidence (``step_budget='confidence'``)."""
        return self.evicts and self.options.get("step_budget", "fixed") == "confidence"

    def select(self, ctx: EvictionContext, keep, kmax: int, forced, allocate=None) -> Selection:
        """Slots to keep; see :func:`vase.core.selection.select`."""
        return select(self.scorer, self.selector, self.guard, ctx, keep, kmax, forced, allocate)

    def describe(self) -> str:
        """One line: scorer + guard + selector."""
        if not self.evicts:
            kv = f"; {self.quant_text()}" if self.options.get("kv_bits") is not None else ""
            return (
                f"{self.name}: never evicts" + (f"; {self.sparse.describe()}" if self.sparse is not None else "") + kv
            )
        parts = [self.scorer.describe()]
        if self.guard is not None:
            parts.append(self.guard.describe())
        parts.append(self.selector.describe())
        if self.recent is not None:
            parts.append(f"recent window {self.recent}")
        if self.options.get("head_budget", "uniform") != "uniform":
            parts.append(f"AdaKV head budgets (floor {self.options.get('head_floor', FLOOR_SHARE):g})")
        if self.options.get("layer_budget", "uniform") != "uniform":
            parts.append(f"PyramidKV layer budgets (beta {self.options.get('pyramid_beta', PYRAMID_BETA):g})")
        if self.confidence_budget:
            floor = self.options.get("confidence_floor", CONFIDENCE_FLOOR)
            parts.append(f"confidence step budgets (floor {floor:g})")
        if self.adaptive_budgets:
            parts.append(f"cap {self.options.get('budget_cap', BUDGET_CAP):g}x budget")
        if self.options.get("kv_bits") is not None:
            parts.append(self.quant_text())
        return f"{self.name}: " + " + ".join(parts)

    def quant_text(self) -> str:
        """``'4-bit KV (groups of 32)'`` (with the guard's full-precision share when protecting), or ''."""
        o = self.options
        share = self.guard.share if self.guard is not None else None
        return quant.bits_text(
            o.get("kv_bits"),
            o.get("kv_group", quant.DEFAULT_GROUP),
            o.get("protect_precision"),
            share,
            o.get("kv_window", 0),
        )


def compose(
    name: str,
    source: str,
    keeps: str,
    make_scorer: Callable[..., Scorer] | None,
    scorer_defaults: dict[str, Any],
    options: dict[str, Any],
    quantizable: bool = False,
    **common_defaults: Any,
) -> Policy:
    """Build a :class:`Policy` from a scorer factory, its defaults and the user's options.

    ``quantizable``: a policy that never evicts (``make_scorer`` None) but takes the quantization options
    (:data:`QUANT_OPTIONS`: ``full``); evicting policies always take them (``kv_bits``, ``kv_group``,
    ``protect_precision``; see :mod:`vase.core.quant`).

    Raises:
        ValueError: for an option the policy does not take (lists the valid ones) or a bad value (see
            :func:`vase.core.quant.check_options` for the quantization options).
    """
    if "temperature" in options:
        raise ValueError(AMBIGUOUS_TEMPERATURE)
    common = dict(COMMON_OPTIONS, **common_defaults) if make_scorer is not None else {}
    if make_scorer is None and quantizable:
        common = dict(QUANT_OPTIONS)
    allowed = {**scorer_defaults, **common}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        valid = ", ".join(sorted(allowed)) or "none"
        hint = did_you_mean(unknown[0], allowed)
        raise ValueError(f"policy {name!r} does not take option(s) {', '.join(unknown)}{hint}; valid options: {valid}")
    opts = {**allowed, **{k: v for k, v in options.items()}}
    if make_scorer is None:
        return Policy(name, None, TopK(), _quant_guard(opts, options) if quantizable else None, source, keeps, opts)

    for key in ("window", "kernel", "rank"):
        if key in opts and (not isinstance(opts[key], int) or opts[key] < 1):
            raise ValueError(f"{key} must be a positive integer, got {opts[key]!r}")
    if "pool" in opts and opts["pool"] not in ("avg", "max"):
        raise ValueError(f"pool must be 'avg' or 'max', got {opts['pool']!r}")
    if "lam" in opts and not 0.0 <= float(opts["lam"]) <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {opts['lam']}")

    if opts["selector"] not in SELECTORS:
        raise ValueError(f"unknown selector {opts['selector']!r}; choose one of {', '.join(SELECTORS)}")
    temperature = float(opts["sampling_temperature"])
    if not temperature > 0:
        raise ValueError(f"sampling_temperature must be > 0, got {opts['sampling_temperature']}")
    share = float(opts["protect_share"])
    if not 0.0 <= share < 1.0:
        raise ValueError(f"protected share must be in [0, 1), got {opts['protect_share']}")
    guard_metric = opts["guard"]
    if guard_metric is not None and guard_metric not in GUARD_METRICS:
        raise ValueError(f"unknown value-guard metric {guard_metric!r}; choose one of {', '.join(GUARD_METRICS)}")
    if opts["guard_mode"] not in GUARD_MODES:
        raise ValueError(f"unknown guard mode {opts['guard_mode']!r}; choose one of {', '.join(GUARD_MODES)}")
    if opts["guard_sinks"] not in GUARD_SINKS:
        raise ValueError(f"guard_sinks must be one of {', '.join(GUARD_SINKS)}, got {opts['guard_sinks']!r}")
    if opts["prompt"] not in PROMPT_MODES:
        raise ValueError(f"prompt must be one of {', '.join(PROMPT_MODES)}, got {opts['prompt']!r}")
    check_guard_rule(opts["guard_rule"], opts["outlier_factor"], guard_metric)
    if opts["guard_rule"] == "outlier" and guard_metric is None:
        raise ValueError("guard_rule='outlier' needs a value guard: add guard=range (or l2, var)")
    if "outlier_factor" in options and opts["guard_rule"] != "outlier":
        raise ValueError("outlier_factor applies to the adaptive guard only: add guard_rule=outlier")
    recent = opts["recent"]
    if recent is not None and (isinstance(recent, bool) or not isinstance(recent, int) or recent < 0):
        raise ValueError(
            f"recent must be a number of tokens >= 0 (the newest tokens always kept; none = the buffer), got {recent!r}"
        )
    if "value_weight" in opts:
        opts["value_weight"] = "none" if opts["value_weight"] is None else opts["value_weight"]
        if opts["value_weight"] not in VALUE_WEIGHTS:
            raise ValueError(
                f"value_weight must be one of {', '.join(VALUE_WEIGHTS)} (none: attention alone; l1: VATP, attention "
                f"x ||v||_1; output_error: CAOTE), got {opts['value_weight']!r}"
            )

    check_budget_options(opts, options)

    quant.check_options(
        opts["kv_bits"],
        opts["kv_group"],
        opts["protect_precision"],
        guard_of(opts),
        opts["kv_attention"],
        opts["kv_window"],
    )
    scorer = make_scorer(**{k: opts[k] for k in scorer_defaults})
    selector: Selector = Sample(temperature) if opts["selector"] == "sample" else TopK()
    guard = (
        ValueGuard(
            guard_metric,
            share,
            opts["guard_mode"],
            opts["guard_sinks"],
            opts["guard_rule"],
            float(opts["outlier_factor"]),
        )
        if guard_metric is not None and share > 0
        else None
    )
    return Policy(name, scorer, selector, guard, source, keeps, opts)


def guard_of(opts: dict) -> ValueGuard | None:
    """The value guard resolved options describe (None without a metric or with a zero share)."""
    if opts.get("guard") is None or not float(opts["protect_share"]) > 0:
        return None
    return ValueGuard(
        opts["guard"],
        float(opts["protect_share"]),
        opts.get("guard_mode", "protect"),
        opts.get("guard_sinks", "outside"),
        opts.get("guard_rule", "share"),
        float(opts.get("outlier_factor", 6.0)),
    )


def _quant_guard(opts: dict, given: dict) -> ValueGuard | None:
    """The guard of a policy that never evicts but stores its entries quantized (``full``): it only chooses the
    entries kept in full precision (``protect_precision='guard'``).

    Raises:
        ValueError: see :func:`vase.core.quant.check_options`; guard options without ``protect_precision=guard``.
    """
    share = opts["protect_share"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share < 1.0:
        raise ValueError(f"protected share must be in [0, 1), got {share!r}")
    if opts["guard"] is not None and opts["guard"] not in GUARD_METRICS:
        raise ValueError(f"unknown value-guard metric {opts['guard']!r}; choose one of {', '.join(GUARD_METRICS)}")
    check_guard_rule(opts["guard_rule"], opts["outlier_factor"], opts["guard"])
    guard = guard_of(opts)
    quant.check_options(
        opts["kv_bits"], opts["kv_group"], opts["protect_precision"], guard, opts["kv_attention"], opts["kv_window"]
    )
    extra = sorted(k for k in ("guard", "protect_share", "guard_rule", "outlier_factor") if k in given)
    if extra and opts["protect_precision"] != "guard":
        raise ValueError(
            f"{', '.join(extra)}: a policy that never evicts uses a value guard only to keep entries in full "
            "precision: add kv_bits and protect_precision=guard"
        )
    return guard


def did_you_mean(name: str, choices) -> str:
    """``" (did you mean 'snapkv'?)"`` for the closest of ``choices`` to a mistyped ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == value


def check_budget_options(opts: dict, given: dict) -> None:
    """The adaptive-budget options (``head_budget``, ``layer_budget``, ``budget_cap``, ``head_floor``,
    ``pyramid_beta``, ``step_budget``, ``confidence_floor``; see :attr:`Policy.adaptive_budgets`).

    Raises:
        ValueError: an unknown rule, a cap that is not a number >= 1 (a multiple of the budget), a floor outside
            [0, 1] (``confidence_floor``: (0, 1]), a beta below 1, or one of the numbers given without the rule it
            tunes.
    """
    if opts["head_budget"] not in HEAD_BUDGETS:
        raise ValueError(
            f"head_budget must be one of {', '.join(HEAD_BUDGETS)} (adakv: AdaKV, one top-k over the layer's heads), "
            f"got {opts['head_budget']!r}"
        )
    if opts["layer_budget"] not in LAYER_BUDGETS:
        raise ValueError(
            f"layer_budget must be one of {', '.join(LAYER_BUDGETS)} (pyramid: PyramidKV, budgets decreasing with "
            f"depth), got {opts['layer_budget']!r}"
        )
    cap = opts["budget_cap"]
    if not _number(cap) or not 1.0 <= cap < float("inf"):
        raise ValueError(
            f"budget_cap must be a number >= 1 (the most tokens one layer's KV head may hold, as a multiple of the "
            f"budget), got {cap!r}"
        )
    floor = opts["head_floor"]
    if not _number(floor) or not 0.0 <= floor <= 1.0:
        raise ValueError(f"head_floor must be in [0, 1] (share of each head's count given uniformly), got {floor!r}")
    beta = opts["pyramid_beta"]
    if not _number(beta) or not 1.0 <= beta < float("inf"):
        raise ValueError(f"pyramid_beta must be a number >= 1 (1 = uniform layers), got {beta!r}")
    if opts["step_budget"] not in STEP_BUDGETS:
        raise ValueError(
            f"step_budget must be one of {', '.join(STEP_BUDGETS)} (confidence: each eviction keeps more after "
            f"uncertain tokens, fewer after confident ones), got {opts['step_budget']!r}"
        )
    cfloor = opts["confidence_floor"]
    if not _number(cfloor) or not 0.0 < cfloor <= 1.0:
        raise ValueError(
            f"confidence_floor must be in (0, 1] (the least share of the budget an eviction keeps), got {cfloor!r}"
        )
    adakv, pyramid = opts["head_budget"] == "adakv", opts["layer_budget"] == "pyramid"
    confidence = opts["step_budget"] == "confidence"
    for name, needs, ok in (
        (
            "budget_cap",
            "head_budget=adakv, layer_budget=pyramid or step_budget=confidence",
            adakv or pyramid or confidence,
        ),
        ("head_floor", "head_budget=adakv", adakv),
        ("pyramid_beta", "layer_budget=pyramid", pyramid),
        ("confidence_floor", "step_budget=confidence", confidence),
    ):
        if name in given and not ok:
            raise ValueError(f"{name} applies to adaptive budgets only: add {needs}")

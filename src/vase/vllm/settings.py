"""vase's settings inside a vLLM engine: parsed from ``additional_config["vase"]``, validated once at engine start.

The configuration travels in the engine's own configuration surface, ``VllmConfig.additional_config`` (set by
``LLM(..., additional_config={"vase": ...})`` or ``--additional-config '{"vase": ...}'``), which vLLM hands to every
process (front end, engine core, workers). Two forms, with the command line's policy spec syntax:

* a string: the policy spec with the sizes among its options, ``"snapkv:budget=256:buffer=64"``,
  ``"vase:preset=paper:budget=256:buffer=64"``, ``"snapkv:selector=sample:budget=512"``;
* a dict: ``{"policy": "snapkv:selector=sample", "budget": 256, "buffer": 64, "sinks": 4}`` (any other key is a
  policy option).

The sizes (``budget``, ``buffer``, ``sinks``, ``window``, ``compress_prompt``) and the policy go through
:meth:`vase.core.config.VaseConfig.resolve`, so they mean what they mean on the command line and fail with the same
errors. The engine keys are ``admission`` (``"elastic"``, the default: every request is admitted as soon as the pool
holds it at the floor ``min_budget``, with the largest budget the pool allows, the running requests' budgets shrinking
toward that floor when the pool is short, :mod:`vase.vllm.admission`; ``"reserve"``: a request gets all the blocks of
its budget when it is admitted, and waits until they are free; ``"grow"``: blocks are added as it grows, up to the
cap, as vLLM does, so vLLM preempts when the pool runs out), ``min_budget`` (the floor of elastic budgets, tokens;
default: the budget's quarter, rounded up to a budget that fills whole blocks), and the limits of per-request budgets:
``max_budget`` (the largest budget a request may ask for, tokens; default: the budget), ``allow_full`` (whether a
request may ask for the full cache; default false) and ``prefill_first`` (default true: a request whose prefill has just
ended sits out its first decode step when that step admits new prompts, so that their first token waits neither for
its decode nor for its prompt's compression) and ``prefill_priority`` (default true: a step that admits new prompts
carries their prefill alone, the running requests' decodes sitting it out, never two steps in a row;
:class:`vase.vllm.scheduler.VaseScheduler`).

**Per-request fields** (``SamplingParams.extra_args``, the OpenAI server's ``vllm_xargs``; :func:`check_fields`):
``vase_seed`` (the seed of the request's sampled eviction) and ``vase_budget`` (the request's own budget, an integer
within the budget rules and at most ``max_budget``, or ``"full"`` where ``allow_full``: no eviction, blocks as
plain vLLM's). The front end checks them against the limits the engine was started with
(:func:`front_end_settings`: :func:`vase.vllm.engine_args` and ``python -m vase.vllm.serve`` put the configuration
in the environment variable :data:`SPEC_ENV`), so a request over the limit is refused with a 400 before the engine
sees it.

:func:`settings_from` then checks the rules the engine must follow (:mod:`vase.vllm.rules`: block size, prefix
caching, speculative decoding, parallelism, the model's layer kinds, the plugin's scheduler and worker classes) and
raises one :class:`VaseConfigError` naming every broken rule.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field

from ..core.config import VaseConfig
from ..core.policies import make_policy, parse_policy_spec
from ..core.policy import did_you_mean
from ..core.schedule import first_limit
from .rules import BLOCK_MULTIPLE, QUANT_KEYS, QUANTIZED, check_engine, check_policy

REQUEST_FIELDS = "vase.vllm.requests:VaseRequestFields"  # a logits processor that only validates (vase.vllm.requests)
SIZE_KEYS = ("budget", "buffer", "sinks", "window", "compress_prompt")
ENGINE_KEYS = ("admission", "min_budget", "max_budget", "allow_full", "prefill_first", "prefill_priority")
SPEC_ENV = "VASE_ENGINE_SPEC"  # the engine's vase configuration (JSON), for the front end's request check
ADMISSIONS = ("elastic", "reserve", "grow")
# options of other entry points that a serving engine cannot take, with the reason given in the error
REFUSED_KEYS = {
    "ratio": "a compression ratio sets each request's budget from its final length, which the engine does not know "
    "when it allocates blocks: give a budget in tokens",
    "byte_ratio": "a byte ratio sets each request's budget from its final length: give a budget in tokens",
    "memory_budget": "give the budget in tokens",
    "compile": "vLLM decides how the model runs (compile / CUDA graphs are its own options); remove compile",
    "seed": "the eviction seed is per request: SamplingParams(extra_args={'vase_seed': s}) (default: its seed or 0)",
}


REQUEST_FIELD_NAMES = ("vase_seed", "vase_budget")
SEED_LIMIT = 2**63
FULL = "full"  # vase_budget: the full cache for this request


def check_fields(extra_args: dict | None, settings: EngineSettings | None = None) -> None:
    """The vase fields of one request's ``extra_args`` (the OpenAI server's ``vllm_xargs``): ``vase_seed``, an
    integer in ``[0, 2**63)``; ``vase_budget``, an integer or ``"full"``, checked against the engine's limits when
    ``settings`` are known (:meth:`EngineSettings.request_budget`); any other key starting with ``vase_`` is refused
    (a misspelt field would otherwise be ignored silently).

    Raises:
        ValueError: an unknown ``vase_*`` key, a ``vase_seed`` that is not such an integer, a ``vase_budget`` that is
            neither an integer nor ``"full"`` or (with ``settings``) outside the engine's limits.
    """
    extra = extra_args or {}
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("vase_") and k not in REQUEST_FIELD_NAMES)
    if unknown:
        raise ValueError(
            f"unknown vase field(s) {', '.join(unknown)} in extra_args / vllm_xargs; known: "
            f"{', '.join(REQUEST_FIELD_NAMES)}"
        )
    seed = extra.get("vase_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
        raise ValueError(f"vase_seed must be an integer in [0, 2**63), got {seed!r}")
    budget = extra.get("vase_budget")
    if budget is not None and budget != FULL:
        _check_budget_type(budget)
    if settings is not None:
        settings.request_budget(extra)


def _check_budget_type(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"vase_budget must be an integer number of tokens or 'full', got {value!r}")


@functools.lru_cache(maxsize=4)
def _settings_of(raw_json: str) -> EngineSettings:
    config, engine = parse(json.loads(raw_json))
    return EngineSettings(config=config, block_size=BLOCK_MULTIPLE, **engine)


def front_end_settings() -> EngineSettings | None:
    """The engine's settings as the front end knows them (from :data:`SPEC_ENV`), or None when it is not set (an
    engine configured by hand: the engine then falls back to its budget for a request over the limits)."""
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        return None
    try:
        return _settings_of(raw)
    except (ValueError, TypeError):
        return None


class VaseConfigError(ValueError):
    """A vase configuration the engine cannot run; the message names every broken rule."""


@dataclass(frozen=True)
class EngineSettings:
    """A resolved vase configuration plus what the engine derives from it (sizes in tokens per request, layer and
    KV head).

    Attributes:
        config: the :class:`vase.core.config.VaseConfig` (policy, budget, buffer, sinks, window, recent, prompt).
        block_size: tokens per KV block (the engine's ``cache_config.block_size``).
        admission: ``'elastic'``, ``'reserve'`` or ``'grow'`` (see the module docstring).
        min_budget: the floor of elastic budgets (None: :attr:`floor`'s default).
        max_budget: the largest budget a request may ask for (``vase_budget``; None: the budget).
        allow_full: whether a request may ask for the full cache (``vase_budget="full"``).
        prefill_first: a request whose prefill has just ended sits out its first decode step when that step admits
            new prompts (its decode, and its prompt's compression, then run after their prefill, not before it).
        prefill_priority: a step that admits new prompts (elastic admission, no budget shrinking) carries their
            prefill alone: the running requests' decodes sit it out, never two steps in a row, so that a request
            arriving beside many decoding ones waits for its prefill only (vLLM V0's prefill-first order).
        prefix_caching: the engine shares prompt blocks between requests (vLLM's prefix caching; a policy that keeps
            the prompt dense only): a request's full prompt blocks are never rewritten, its compaction writes to the
            blocks after them (:meth:`front_blocks`).
        spec: the configuration as given (for logs).
    """

    config: VaseConfig
    block_size: int
    admission: str = "elastic"
    min_budget: int | None = None
    max_budget: int | None = None
    allow_full: bool = False
    prefill_first: bool = True
    prefill_priority: bool = True
    prefix_caching: bool = False
    spec: str = ""
    _ladders: dict = field(default_factory=dict, compare=False, repr=False)  # (target, floor) -> ladder

    @property
    def evicts(self) -> bool:
        """False for ``full``: the engine then runs exactly as stock vLLM."""
        return self.config.policy.evicts

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def limit(self) -> int:
        """Physical fill at which a request evicts back to ``budget`` (after its first eviction): budget + buffer."""
        return self.config.budget + self.config.buffer

    @property
    def cap_blocks(self) -> int:
        """KV blocks a request holds at most (with a compressed prompt): ``ceil((budget + buffer) / block_size)``."""
        return self.cap_blocks_for(self.config.budget)

    @property
    def cap_tokens(self) -> int:
        """Token slots of :attr:`cap_blocks` blocks."""
        return self.cap_blocks * self.block_size

    @property
    def largest_budget(self) -> int:
        """The largest budget a request may hold: ``max_budget``, else the budget."""
        return self.config.budget if self.max_budget is None else self.max_budget

    @property
    def table_tokens(self) -> int:
        """Width of the per-slot tables: the cap of :attr:`largest_budget` in whole blocks."""
        return self.cap_blocks_for(self.largest_budget) * self.block_size

    def concurrent_rows(self, num_blocks: int) -> int:
        """The most evicting requests a pool of ``num_blocks`` blocks holds at once with every one at its cap (at the
        floor of elastic budgets, else at the budget): the rows a worker makes room for at start-up (short prompts
        not yet at their cap, full-cache requests change the count; more rows grow by doubling)."""
        if not self.evicts:
            return 0
        return num_blocks // self.cap_blocks_for(self.floor if self.elastic else self.config.budget)

    def cap_blocks_for(self, budget: int) -> int:
        """KV blocks a request of budget ``budget`` holds at most: ``ceil((budget + buffer) / block_size)``."""
        return math.ceil((budget + self.config.buffer) / self.block_size)

    @property
    def elastic(self) -> bool:
        """Whether budgets follow the pool (admission ``elastic``)."""
        return self.admission == "elastic" and self.evicts

    @property
    def floor(self) -> int:
        """The floor of elastic budgets: ``min_budget``, else the smallest budget of :meth:`ladder` at least a
        quarter of the budget."""
        if self.min_budget is not None:
            return self.min_budget
        steps = self.ladder(self.config.budget, 1)
        return next((b for b in steps if 4 * b >= self.config.budget), self.config.budget)

    def ladder(self, target: int, floor: int | None = None) -> tuple[int, ...]:
        """The budgets an elastic request of budget ``target`` may hold, ascending, from ``min(floor, target)``
        (default :attr:`floor`) to ``target``: per block count, the largest budget the configuration's rules allow
        whose ``budget + buffer`` fills that many blocks (a budget between two of them would hold as many blocks)."""
        key = (target, self.floor if floor is None else floor)
        if key not in self._ladders:
            self._ladders[key] = _ladder(self.config, self.block_size, *key)
        return self._ladders[key]

    def request_budget(self, extra_args: dict | None) -> int | None:
        """The budget a request asks for (``vase_budget``): the engine's budget when it asks for none, None for the
        full cache (no eviction).

        Raises:
            ValueError: ``vase_budget`` over ``max_budget``, ``"full"`` without ``allow_full``, or a budget the
                configuration's rules refuse (:meth:`vase.core.config.VaseConfig.with_budget`), naming the field.
        """
        value = (extra_args or {}).get("vase_budget")
        if value is None:
            return self.config.budget
        if value == FULL:
            if not self.allow_full:
                raise ValueError("vase_budget 'full' is not allowed by this engine (start it with allow_full=true)")
            return None
        _check_budget_type(value)
        if value > self.largest_budget:
            raise ValueError(
                f"vase_budget {value} is above this engine's max_budget {self.largest_budget} (the blocks it reserved "
                "per request)"
            )
        try:
            self.config.with_budget(value)
        except ValueError as exc:
            raise ValueError(f"vase_budget {value}: {exc}") from None
        return value

    def first_eviction(self, prompt_tokens: int, budget: int | None = None) -> int:
        """Fill at which a request whose prompt has ``prompt_tokens`` tokens first evicts: the sequence model's
        :func:`vase.core.schedule.first_limit` (``budget + buffer``, or with a dense prompt, ``compress_prompt=False``
        as ``vase:preset=paper``, the first multiple of the buffer above the prompt, at least ``budget + buffer``);
        ``budget``: the request's (default: the engine's)."""
        c = self.config
        return first_limit(
            prompt_tokens,
            budget=c.budget if budget is None else budget,
            buffer=c.buffer,
            evicts=c.policy.evicts,
            compress_prompt=c.compress_prompt,
        )

    def front_blocks(self, prompt_tokens: int) -> int:
        """Blocks at the front of a request that eviction never rewrites: with prefix caching, its full prompt blocks
        (``prompt_tokens // block_size``; they may be shared with other requests through their hashes). Its first
        eviction writes what it keeps to the blocks after them and gives them back (to the prefix cache), so that
        after it the request's physical slot 0 is the first slot of block ``front_blocks``. 0 without prefix
        caching: compaction then rewrites the request's first blocks in place."""
        if not self.prefix_caching or self.config.compress_prompt:
            return 0
        return prompt_tokens // self.block_size

    def request_cap_tokens(self, prompt_tokens: int, max_len: int, budget: int | None = None, full=False) -> int:
        """Token slots (whole blocks) a request may hold: the cap of its budget (default: the engine's), or with a
        dense prompt its first limit, or for a request served with the full cache (``full``) its whole length; never
        more than ``max_len`` (its prompt + max_tokens, or the model's length) rounded up to a block. With prefix
        caching, a request that evicts also holds its :meth:`front_blocks` until its first eviction: its cap is
        those blocks plus the cap of its budget (its block list's length; it holds the cap of its budget after)."""
        bs = self.block_size
        whole = math.ceil(max(max_len, 1) / bs)
        if full:
            return whole * bs
        own = self.config.budget if budget is None else budget
        first = self.first_eviction(prompt_tokens, own)
        need = math.ceil(max(own + self.config.buffer, first) / bs)
        front = self.front_blocks(prompt_tokens)
        if front and max_len >= first:
            return max(need, front + self.cap_blocks_for(own)) * bs
        return min(need, whole) * bs

    def describe(self) -> str:
        """One line for the engine log."""
        c = self.config
        prompt = "compressed at prefill" if c.compress_prompt else "dense until the first eviction"
        own = ""
        if self.max_budget is not None or self.allow_full:
            own = f"; a request may ask for a budget up to {self.largest_budget}" + (
                " or full" if self.allow_full else ""
            )
        admission = self.admission
        if self.elastic:
            admission += f" (budgets down to {self.floor} when the pool is short)"
        if not self.prefill_first:
            admission += ", a request decodes in the step after its prefill (prefill_first off)"
        if not self.prefill_priority:
            admission += ", arrivals prefilled beside the running requests' decodes (prefill_priority off)"
        return (
            f"{c.policy.name} (budget {c.budget}, buffer {c.buffer}, sinks {c.sinks}, window {c.window}, prompt "
            f"{prompt}): at most {self.cap_blocks} blocks of {self.block_size} tokens per request, admission "
            f"{admission}{own}"
        )


def _ladder(config: VaseConfig, block_size: int, target: int, floor: int) -> tuple[int, ...]:
    low = min(floor, target)
    out = {target}
    blocks = math.ceil((low + config.buffer) / block_size)
    while True:
        b = blocks * block_size - config.buffer
        if b >= target:
            break
        # the largest budget the rules allow with this many blocks (the published preset: a multiple of the buffer)
        for cand in range(b, max(low, (blocks - 1) * block_size - config.buffer + 1) - 1, -1):
            if cand < low:
                break
            try:
                config.with_budget(cand)
            except ValueError:
                continue
            out.add(cand)
            break
        blocks += 1
    return tuple(sorted(out))


def _as_bool(value, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise VaseConfigError(f"vase: {key} must be true or false, got {value!r}")


def parse(raw) -> tuple[VaseConfig, dict]:
    """The :class:`VaseConfig` and the engine keys of a configuration (string or dict, see the module docstring):
    ``{"admission": ..., "max_budget": ..., "allow_full": ..., "prefill_first": ..., "prefill_priority": ...}`` (and
    ``"min_budget"`` when given).

    Raises:
        VaseConfigError: a value that is neither a string nor a dict, an option a serving engine cannot take (a
            ratio, compile, a seed), an unknown admission mode, a ``max_budget`` below the budget or a
            ``min_budget`` above it or either refused by the budget rules, or any error of
            :meth:`vase.core.config.VaseConfig.resolve` (unknown policy or option, sizes out of range, the published
            preset's rules), prefixed with ``vase:``; a policy vLLM cannot run (:func:`vase.vllm.rules.check_policy`:
            selection, adaptive budgets, quantized entries).
    """
    if isinstance(raw, str):
        name, options = parse_policy_spec(raw)
    elif isinstance(raw, dict):
        options = dict(raw)
        name = options.pop("policy", "vase")
        if not isinstance(name, str):
            raise VaseConfigError(f"vase: 'policy' must be a policy spec string, got {name!r}")
        if ":" in name:
            name, spec_options = parse_policy_spec(name)
            options = {**spec_options, **options}
    else:
        raise VaseConfigError(
            f"additional_config['vase'] must be a policy spec string ('snapkv:budget=256') or a dict, got "
            f"{type(raw).__name__}"
        )
    for key, why in REFUSED_KEYS.items():
        if key in options:
            raise VaseConfigError(f"vase: option {key!r} is not available in vLLM: {why}")
    admission = str(options.pop("admission", "elastic"))
    if admission not in ADMISSIONS:
        raise VaseConfigError(f"vase: admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    max_budget = options.pop("max_budget", None)
    min_budget = options.pop("min_budget", None)
    allow_full = _as_bool(options.pop("allow_full", False), "allow_full")
    prefill_first = _as_bool(options.pop("prefill_first", True), "prefill_first")
    prefill_priority = _as_bool(options.pop("prefill_priority", True), "prefill_priority")
    sizes = {k: options.pop(k) for k in SIZE_KEYS if k in options}
    if "compress_prompt" in sizes:
        sizes["compress_prompt"] = _as_bool(sizes["compress_prompt"], "compress_prompt")
    _check_options(name, options)
    try:
        config = VaseConfig.resolve(name, **sizes, **options)
    except ValueError as exc:
        raise VaseConfigError(f"vase: {exc}") from None
    problems = check_policy(config)  # quest and kv_bits never evict but are refused all the same
    if problems:
        raise VaseConfigError(f"vase cannot run {config.policy.name} in vLLM: " + "; ".join(problems))
    if max_budget is not None:
        if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < config.budget:
            raise VaseConfigError(
                f"vase: max_budget must be an integer number of tokens at least the budget ({config.budget}), got "
                f"{max_budget!r}"
            )
        try:
            config.with_budget(max_budget)
        except ValueError as exc:
            raise VaseConfigError(f"vase: max_budget {max_budget}: {exc}") from None
    if min_budget is not None:
        if isinstance(min_budget, bool) or not isinstance(min_budget, int) or min_budget > config.budget:
            raise VaseConfigError(
                f"vase: min_budget must be an integer number of tokens at most the budget ({config.budget}), got "
                f"{min_budget!r}"
            )
        try:
            config.with_budget(min_budget)
        except ValueError as exc:
            raise VaseConfigError(f"vase: min_budget {min_budget}: {exc}") from None
    engine = {
        "admission": admission,
        "max_budget": max_budget,
        "allow_full": allow_full,
        "prefill_first": prefill_first,
        "prefill_priority": prefill_priority,
    }
    if min_budget is not None:
        engine["min_budget"] = min_budget
    return config, engine


def _check_options(name: str, options: dict) -> None:
    """Refuse the policy options a served engine cannot take (vase's quantized storage) and unknown ones, listing
    only what vLLM takes (:func:`parse` then resolves the rest as everywhere else)."""
    quantized = sorted(k for k in options if k in QUANT_KEYS)
    if quantized:
        raise VaseConfigError(f"vase: option(s) {', '.join(quantized)}: {QUANTIZED}")
    try:
        allowed = set(make_policy(name).options) - set(QUANT_KEYS)
    except ValueError:
        return  # an unknown policy: VaseConfig.resolve names it, with the closest name
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise VaseConfigError(
            f"vase: policy {name!r} does not take option(s) {', '.join(unknown)}{did_you_mean(unknown[0], allowed)}; "
            f"valid options in vLLM: {', '.join(sorted(allowed | set(SIZE_KEYS) | set(ENGINE_KEYS)))}"
        )


def settings_from(vllm_config) -> EngineSettings | None:
    """The vase settings of an engine, or None when ``additional_config`` has no ``"vase"`` key (stock vLLM).

    Called at engine start by the worker, the scheduler and the attention metadata builder, in whichever process
    each runs.

    Raises:
        VaseConfigError: a vLLM release vase was not tested with (:func:`vase.vllm.seam.check`); see :func:`parse`;
            for an evicting policy, every broken rule of :func:`check_engine` in one message (``full`` runs on any
            engine: it is stock vLLM).
    """
    extra = vllm_config.additional_config or {}
    raw = extra.get("vase") if isinstance(extra, dict) else None
    if raw is None:
        return None
    from . import seam

    seam.check(strict=True)  # the installed vLLM as vase was tested with, or one clear error naming what differs
    config, engine = parse(raw)
    settings = EngineSettings(
        config=config,
        block_size=int(vllm_config.cache_config.block_size or 0),
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        spec=str(raw),
        **engine,
    )
    problems = check_engine(vllm_config, config) if settings.evicts else []  # the policy's rules: parse
    if problems:
        raise VaseConfigError("vase cannot run with this engine configuration:\n  - " + "\n  - ".join(problems))
    return settings

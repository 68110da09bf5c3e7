"""The rules a vLLM engine must follow for vase to evict in it: the policy's and the engine's, each broken one named.

:func:`vase.vllm.settings.settings_from` runs them at engine start (in the worker, the scheduler and the attention
builder, whichever process each runs in) and raises one :class:`vase.vllm.settings.VaseConfigError` listing every
broken rule.
"""

from __future__ import annotations

from ..core.config import VaseConfig

SCHEDULER_CLS = "vase.vllm.scheduler.VaseScheduler"
WORKER_CLS = "vase.vllm.worker.VaseCPUWorker"
BLOCK_MULTIPLE = 32  # the CPU attention kernel's block sizes: MultipleOf(32) (cpu_attn.py)


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
        problems.append("quantized entries (kv_bits) are not supported in vLLM: vLLM's own kv_cache_dtype holds them")
    return problems


def check_engine(vllm_config, config: VaseConfig | None = None) -> list[str]:
    """The engine rules for an evicting policy (``config``: its configuration), as a list of broken ones (empty:
    fine)."""
    cc, sc, pc, mc = (
        vllm_config.cache_config,
        vllm_config.scheduler_config,
        vllm_config.parallel_config,
        vllm_config.model_config,
    )
    problems = []
    if cc.block_size is None or cc.block_size % BLOCK_MULTIPLE:
        problems.append(f"block_size {cc.block_size}: the CPU attention kernel needs a multiple of {BLOCK_MULTIPLE}")
    if cc.enable_prefix_caching and (config is None or config.compress_prompt):
        problems.append(
            "prefix caching shares a prompt's blocks between requests, and this policy compresses prompts at prefill "
            "(they are never held whole): use a policy that keeps the prompt dense (prompt=dense, as "
            "vase:preset=paper) or pass enable_prefix_caching=False (--no-enable-prefix-caching)"
        )
    if vllm_config.speculative_config is not None:
        problems.append(
            "speculative decoding is not supported (draft tokens are written past the physical fill and rejected ones "
            "rolled back): remove speculative_config"
        )
    if cc.cache_dtype != "auto":
        problems.append(f"kv_cache_dtype {cc.cache_dtype!r}: only 'auto' (the model's dtype) is supported")
    if getattr(vllm_config, "use_v2_model_runner", False):
        problems.append("Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) is not supported: the hooks are in the V1 runner")
    tp, kv_heads = pc.tensor_parallel_size, mc.get_total_num_kv_heads()
    if tp > 1 and kv_heads < tp and config is not None and config.window:
        problems.append(
            f"tensor parallelism over {tp} workers with {kv_heads} KV head(s): vLLM gives each worker a copy of a KV "
            f"head and part of its query heads, so {config.policy.name}'s query-based scores would differ between the "
            "workers: use at most as many workers as KV heads, or a policy that scores keys and values only "
            "(streaming_llm, knorm, keydiff, random)"
        )
    if pc.pipeline_parallel_size != 1:
        problems.append(
            "pipeline parallelism is not supported: each worker would hold some layers of a request, and the step's "
            "plan is made per worker for all of them (tensor and data parallelism are supported)"
        )
    if mc.is_hybrid or mc.is_attention_free:
        problems.append(
            "models with state-space or linear-attention layers (and attention-free ones) are not supported: vase "
            "evicts full-attention layers and leaves sliding-window layers to vLLM"
        )
    if mc.is_encoder_decoder:
        problems.append("encoder-decoder models are not supported")
    if str(sc.scheduler_cls) != SCHEDULER_CLS:
        problems.append(
            f"scheduler_cls={SCHEDULER_CLS!r} is required (it caps each request's KV blocks); got {sc.scheduler_cls!r}"
            " (vase.vllm.engine_args() fills it in)"
        )
    if str(pc.worker_cls) != WORKER_CLS:
        problems.append(
            f"worker_cls={WORKER_CLS!r} is required (it keeps each request's eviction state); got {pc.worker_cls!r}"
        )
    return problems

"""vase on vLLM's GPU attention backends (FlashAttention, ``flash_attn.py``; Triton, ``triton_attn.py``): the
metadata of a step with vase, the cache write at physical slots, the eviction after attention.

Subclasses of vLLM's classes, each calling the original:

* the builders (:class:`VaseFlashAttentionMetadataBuilder`, :class:`VaseTritonAttentionMetadataBuilder`) put the step
  plan's physical ``seq_lens``, slot mapping and block table into the runner's metadata before vLLM's own ``build``
  (:class:`vase.vllm.plan_metadata.PlanBuilder`, shared with the CPU backend), so FlashAttention's ``seqused_k``,
  ``max_seqlen_k`` and ahead-of-time scheduler metadata, and Triton's ``seq_lens``, are physical; RoPE stays logical;
* the impls (:class:`VaseFlashAttentionImpl`, :class:`VaseTritonAttentionImpl`) write the step's keys and values with
  the backend's own cache write (``reshape_and_cache_flash`` / ``triton_reshape_and_cache_flash``) at the metadata's
  slots, physical with a plan (the backends set ``forward_includes_kv_cache_update``, so vLLM's layer does not write
  them at logical slots), run the backend's kernel, then save the step's queries and evict
  (:mod:`vase.vllm.compact`, through :class:`vase.vllm.layout.SplitKV`: a token's key then value, as these backends
  read ``kv_cache.transpose(1, 2).split(D, -1)``, in any physical order).

Not served yet: vLLM's CPU platform always selects its CPU backend and the CPU build runs no Triton kernel, and vase's
worker is vLLM's CPU worker, so an engine with vase off the CPU platform is refused at start. What these classes do
with a plan is tested on CPU (``tests/vllm/test_gpu_backends.py``): inside a running CPU engine with evictions, the
metadata they build from the same step is handed to vLLM's own FlashAttention and Triton impls, whose kernel calls
are replaced by paged attention computed from exactly the arguments the impls pass, over a token-major copy of the
cache; the outputs equal vLLM's CPU kernel's. Steps with dense rows (a prompt larger than its blocks, attended over
a scratch cache on the CPU backend) are refused here with the reason.
"""

from __future__ import annotations

import time

from . import compact
from .layout import SplitKV
from .plan_metadata import PlanBuilder
from .seam import (
    AttentionType,
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)


class _GpuPlanBuilder(PlanBuilder):
    """A GPU backend's builder with the step plan (mixin, before vLLM's builder in the bases).

    Raises:
        NotImplementedError: a step with dense rows (not supported on these backends yet).
    """

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vase_setup(kv_cache_spec, layer_names, vllm_config)
        if self.vase is not None and self.vase.evicts:
            self.vase_paged = SplitKV()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan, layout = self.vase_plan(common_attn_metadata)
        if plan is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        if plan.dense.any():
            raise NotImplementedError(
                "vase: a prompt larger than its blocks (dense rows) is attended over a scratch cache on vLLM's CPU "
                "backend only; on the GPU backends prefill prompts within budget + buffer per chunk"
            )
        t = time.perf_counter()
        ws = self.vase_state
        cm = self.vase_metadata(common_attn_metadata, plan, layout)
        md = super().build(common_prefix_len, cm, fast_build)
        md.vase_plan, md.vase_state, md.vase_layout, md.vase_paged = plan, ws, layout, self.vase_paged
        ws.stats["t_build"] += time.perf_counter() - t
        return md


class _GpuEvictingImpl:
    """A GPU backend's impl that writes at the metadata's slots, attends, then evicts (mixin, before vLLM's impl).

    Raises:
        ValueError: at the first step with vase, a full-attention layer with a sliding window, ALiBi or a logit
            soft-cap (the eviction scores would not see what the kernel computes).
    """

    _vase_layer: int | None = None

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if attn_metadata is None:  # profiling
            return super().forward(layer, query, key, value, kv_cache, None, output, output_scale, output_block_scale)
        self.vase_attend(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        plan = getattr(attn_metadata, "vase_plan", None)
        if plan is not None:
            t = time.perf_counter()
            self._vase_evict(layer, query[: attn_metadata.num_actual_tokens], kv_cache, plan, attn_metadata)
            attn_metadata.vase_state.stats["t_after"] += time.perf_counter() - t
        return output

    def vase_attend(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        """The step's keys and values written by the backend's own cache write at ``attn_metadata.slot_mapping``
        (physical with a plan, the runner's without), then the backend's kernel; ``output``."""
        n = attn_metadata.num_actual_tokens
        encoder = self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
        if not encoder and key is not None and value is not None:
            self.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, attn_metadata.slot_mapping)
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )

    def _vase_evict(self, layer, q, kv_cache, plan, md) -> None:
        ws = md.vase_state
        if self._vase_layer is None:
            window = tuple(self.sliding_window) if self.sliding_window is not None else (-1, -1)
            plain = window == (-1, -1) and self.alibi_slopes is None and not self.logits_soft_cap
            self._vase_layer = compact.full_attention_layer(ws, layer, plain)
        compact.save_queries(ws, self._vase_layer, q, plan)
        compact.evict_rows(ws, self._vase_layer, layer, kv_cache, plan, md.vase_layout, {}, self.scale, md.vase_paged)


class VaseFlashAttentionMetadataBuilder(_GpuPlanBuilder, FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention builder with the step plan (see the module docstring)."""


class VaseFlashAttentionImpl(_GpuEvictingImpl, FlashAttentionImpl):
    """vLLM's FlashAttention impl with the write at physical slots and the eviction (see the module docstring)."""


class VaseFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend whose impl writes the KV cache itself (at physical slots) and evicts."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return VaseFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return VaseFlashAttentionMetadataBuilder


class VaseTritonAttentionMetadataBuilder(_GpuPlanBuilder, TritonAttentionMetadataBuilder):
    """vLLM's Triton builder with the step plan (see the module docstring)."""


class VaseTritonAttentionImpl(_GpuEvictingImpl, TritonAttentionImpl):
    """vLLM's Triton impl with the write at physical slots and the eviction (see the module docstring)."""


class VaseTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend whose impl writes the KV cache itself (at physical slots) and evicts."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return VaseTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return VaseTritonAttentionMetadataBuilder

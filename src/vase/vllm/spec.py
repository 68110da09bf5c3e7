"""The KV cache spec of a capped full-attention layer.

Same layout as vLLM's ``FullAttentionSpec`` (so the same manager, groups, tensors and kernels apply:
``KVCacheSpecRegistry`` walks the class's MRO and finds ``FullAttentionManager``), but the memory one request may
use is the vase cap, not ``max_model_len``. vLLM's start-up check (``kv_cache_utils._check_enough_kv_cache_memory``:
the pool must hold one request of ``max_model_len``) and its "maximum concurrency" estimate then use the cap, so an
engine may serve a ``max_model_len`` larger than its pool.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .seam import FullAttentionSpec, cdiv


@dataclass(frozen=True, kw_only=True)
class VaseFullAttentionSpec(FullAttentionSpec):
    """A ``FullAttentionSpec`` whose per-request memory bound is ``vase_cap_tokens`` (tokens, a whole number of
    blocks; 0 means no cap)."""

    vase_cap_tokens: int = 0

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """Bytes one request may hold in this layer: ``min(max_model_len, cap)`` tokens in whole blocks."""
        length = vllm_config.model_config.max_model_len
        if self.vase_cap_tokens:
            length = min(length, self.vase_cap_tokens)
        return cdiv(length, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs):
        """The base merge (which builds ``cls(...)`` from the base fields only), with the cap carried over.

        Raises:
            ValueError: layers with different caps in one group (never, with one vase configuration per engine).
        """
        merged = super().merge(specs)
        caps = {getattr(s, "vase_cap_tokens", 0) for s in specs}
        if len(caps) != 1:
            raise ValueError(f"vase: layers of one KV cache group have different caps {sorted(caps)}")
        return replace(merged, vase_cap_tokens=caps.pop())

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, cap_tokens: int) -> VaseFullAttentionSpec:
        """The same spec with the cap ``cap_tokens``."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)}, vase_cap_tokens=cap_tokens)

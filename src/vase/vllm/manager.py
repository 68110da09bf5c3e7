"""The KV cache manager of vase's full-attention groups: vLLM's ``FullAttentionManager`` that never allocates a request
more than its cap, and gives back the blocks past a trim once the step that evicted has been processed.

vLLM builds one per KV cache group of :class:`vase.vllm.spec.VaseFullAttentionSpec`, through its KV cache spec
registry (:func:`register_capped_manager`); :class:`vase.vllm.scheduler.VaseScheduler` then hands it its settings.
"""

from __future__ import annotations

from .seam import FullAttentionManager, FullAttentionSpec, KVCacheSpecRegistry
from .settings import EngineSettings


class CappedFullAttentionManager(FullAttentionManager):
    """A ``FullAttentionManager`` that allocates a request at most its cap (see :mod:`vase.vllm.scheduler`).

    Built by vLLM for the groups of :class:`vase.vllm.spec.VaseFullAttentionSpec` (registered by the scheduler),
    which then sets: ``vase`` (the settings), ``vase_caps`` (request id -> cap in tokens: the length of its block
    list), ``vase_trims`` (request id -> (processed tokens, first, end): once that many tokens are processed, the
    request's blocks outside ``[first, end)`` go back to the pool and its cap becomes ``end``: a dense prompt's first
    eviction, a shrink), ``vase_fronts`` (request id -> its prompt blocks that are never rewritten, with prefix
    caching: only they are cached), ``vase_stats`` and ``vase_release`` (gives a trim's blocks back to the pool:
    now, or with async scheduling once the last step listing them is processed).
    """

    vase: EngineSettings
    vase_caps: dict
    vase_trims: dict
    vase_fronts: dict
    vase_stats: dict
    vase_release: object

    def _vase_tokens(self, request_id: str, num_tokens: int) -> int:
        cap = self.vase_caps.get(request_id, self.vase.cap_tokens)
        if self.vase.admission != "grow":
            return cap  # every block the request may hold, from the start
        return min(num_tokens, cap)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
        return super().get_num_blocks_to_allocate(
            request_id, self._vase_tokens(request_id, num_tokens), *args, **kwargs
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        n = self._vase_tokens(request_id, num_tokens)
        out = super().allocate_new_blocks(request_id, n, min(num_tokens_main_model, n))
        live = self.live_blocks(request_id)
        stats = self.vase_stats
        stats["max_blocks_held"] = max(stats["max_blocks_held"], live)
        cap_blocks = self.vase_caps.get(request_id, self.vase.cap_tokens) // self.block_size
        stats["max_over_cap"] = max(stats["max_over_cap"], live - cap_blocks)
        return out

    def live_blocks(self, request_id: str) -> int:
        """Blocks of the pool a request holds (its block list less the null block)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        """Once a trim's step is processed (a dense prompt's first eviction, a shrink), return the blocks past it."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        trim = self.vase_trims.get(request_id)
        if trim is None or processed_computed_tokens < trim[0]:
            return
        del self.vase_trims[request_id]
        _, first, end = trim
        self.vase_caps[request_id] = end * self.block_size
        blocks = self.req_to_blocks.get(request_id, [])
        freed = []
        for i in [*range(len(blocks) - 1, end - 1, -1), *range(first - 1, -1, -1)]:  # tail first, as vLLM frees
            if not blocks[i].is_null:  # past earlier trims' null blocks too
                freed.append(blocks[i])
                blocks[i] = self._null_block
        if freed:  # prompt blocks keep their hashes: still a prefix-cache hit
            self.vase_release(freed)
        self.vase_stats["trimmed"] += 1

    def cache_blocks(self, request, num_tokens, *args, **kwargs):
        """Only a request's front blocks (its full prompt blocks) are ever named by a hash: the blocks after them are
        rewritten by eviction."""
        front = self.vase_fronts.get(request.request_id)
        if front is not None:
            num_tokens = min(num_tokens, front * self.block_size)
        return super().cache_blocks(request, num_tokens, *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str):
        """vLLM's ``free`` (now) and its deferred free (async scheduling: once the request's last step is processed)
        both take the blocks here: the cap goes with them."""
        for held in (self.vase_caps, self.vase_trims, self.vase_fronts):
            held.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def register_capped_manager() -> None:
    """Register :class:`CappedFullAttentionManager` as the manager of vase's full-attention spec in vLLM's KV cache
    spec registry (idempotent). vLLM's built-in specs are registered first: the registry registers them only while
    it is empty, so an entry of ours alone would keep them out."""
    from .spec import VaseFullAttentionSpec

    KVCacheSpecRegistry.check_kv_cache_spec_registry({})  # the built-in specs, if not yet
    KVCacheSpecRegistry.register(VaseFullAttentionSpec, CappedFullAttentionManager, FullAttentionSpec)

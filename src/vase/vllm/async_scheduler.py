"""vase's scheduler under vLLM's async scheduling (vLLM's ``AsyncScheduler``: step N+1 is scheduled before step N's
output is processed; vLLM turns it on for GPUs, never on its CPU platform).

vLLM instantiates the configured ``scheduler_cls`` (:class:`vase.vllm.scheduler.VaseScheduler`), which builds this
class when ``async_scheduling`` is on: vase's caps, trims and elastic admission over vLLM's async bookkeeping
(output placeholders). What async scheduling changes for vase is when a block may go to another request: while a
step is in flight, the blocks its block table lists may still be read or written by it (the KV write of its new
token, a deferred eviction's compaction). So vLLM's own deferred freeing (``defer_block_free``, which vLLM uses for
KV connectors) is turned on: a finished or aborted request's blocks go back to the pool once its last scheduled
step is processed, and the blocks a trim gives back (a dense prompt's after its first eviction, a shrunk request's
past its new cap) once the last step scheduled before the trim is processed. Trims themselves wait for the step that
evicted to be processed (vLLM hands ``remove_skipped_blocks`` the processed tokens only).
"""

from __future__ import annotations

from .scheduler import VaseScheduler
from .seam import AsyncScheduler


class VaseAsyncScheduler(VaseScheduler, AsyncScheduler):
    """:class:`vase.vllm.scheduler.VaseScheduler` over vLLM's ``AsyncScheduler``, freeing blocks only once no step in
    flight lists them (see the module docstring). Built by ``VaseScheduler(...)`` under async scheduling."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.defer_block_free = True  # vLLM's fence: sched_step_seq / processed_step_seq / deferred_frees

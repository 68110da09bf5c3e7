"""Reused memory for the dense rows' entries a step holds from each layer's dense pass until its deferred eviction.

A step whose prompts are compressed at prefill keeps, per layer, the dense rows' keys, values, positions and state
until its evictions run at the start of a later step (:func:`vase.vllm.compact.evict_rows`). Copied into tensors of
their own, these small allocations, each alive until the next step, sit between the forward's large short-lived
activations on the heap: the allocator can no longer reuse the space a layer's activations freed and takes new
memory for every layer, which it hands back to the system once the entries are freed, and takes again the next step.
Served on the 2-core CPU machine (docs/SERVING.md, "Time to first token in a burst"), a burst's first 2,048-token
prefill step took 6.66 s with the copies and 3.90 s with this store; the server took 359 MiB of new memory in that
burst (134,677 minor page faults) against 61 MiB.

:class:`HeldStore` gives each such step one buffer, sized once from the step's plan, into which every layer's entries
are copied, and takes it back when the step's evictions have run, for the next step to reuse: the entries' memory is
allocated once and stays put (the paper's static memory, Section 3.3, applied to the entries in flight).
"""

from __future__ import annotations

import math

import torch

ALIGN = 64  # bytes: every entry starts on a cache line
KEEP = 2  # spare buffers kept (a step whose evictions wait while the next step holds its own: two at once)


class HeldBuffer:
    """One step's buffer: a ``uint8`` tensor handed out in aligned slices (:meth:`copy`), from the front.

    Args:
        data: the buffer, ``uint8`` ``[bytes]``.
    """

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.used = 0
        self.overflow = 0  # entries that did not fit (copied to tensors of their own)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` (any shape and dtype) in the buffer, or in a tensor of its own when the buffer
        is full (the plan's size is an estimate: a dtype wider than the cache's still gives the right values)."""
        start = -(-self.used // ALIGN) * ALIGN
        n = t.numel() * t.element_size()
        if start + n > self.data.numel():
            self.overflow += 1
            return t.clone(memory_format=torch.contiguous_format)
        self.used = start + n
        return self.data[start : start + n].view(t.dtype).view(t.shape).copy_(t)


class HeldStore:
    """The buffers of the steps holding dense rows' entries (see the module docstring): :meth:`open` one for a step,
    :meth:`close` it when the step's deferred evictions have run (or its requests are gone); closed buffers are reused
    by the next steps, the :data:`KEEP` largest kept.

    ``allocations`` counts the buffers allocated (a served engine settles at one or two).
    """

    def __init__(self):
        self.spare: list[torch.Tensor] = []
        self.allocations = 0

    def open(self, nbytes: int) -> HeldBuffer:
        """A buffer of at least ``nbytes`` bytes: the smallest spare one that is large enough, else a new one (rounded
        up to a MiB, at least the largest spare's size, which it replaces)."""
        fits = [b for b in self.spare if b.numel() >= nbytes]
        if fits:
            data = min(fits, key=lambda b: b.numel())
            self.spare = [b for b in self.spare if b is not data]
        else:
            size = max(nbytes, max((b.numel() for b in self.spare), default=0))
            data = torch.empty(math.ceil(max(size, 1) / (1 << 20)) << 20, dtype=torch.uint8)
            if self.spare:  # outgrown: the largest spare is superseded by this one
                self.spare.remove(max(self.spare, key=lambda b: b.numel()))
            self.allocations += 1
        return HeldBuffer(data)

    def close(self, buf: HeldBuffer | None) -> None:
        """Take ``buf`` back for the next steps (nothing may read the entries it handed out any more)."""
        if buf is None:
            return
        self.spare.append(buf.data)
        self.spare = sorted(self.spare, key=lambda b: b.numel())[-KEEP:]


def entry_bytes(tokens: int, rows: int, heads: int, head_dim: int, itemsize: int, states: int, layers: int) -> int:
    """Bytes of a step's held entries: ``tokens`` (all its evicting dense rows) in ``layers`` layers of ``heads`` KV
    heads, keys and values of ``head_dim`` elements of ``itemsize`` bytes, an int64 position and ``states`` float32
    state values per entry, each of a row's ``3 + states`` tensors per layer aligned to :data:`ALIGN` bytes."""
    per_token = heads * (2 * head_dim * itemsize + 8 + 4 * states)
    return layers * (tokens * per_token + rows * (3 + states) * ALIGN)

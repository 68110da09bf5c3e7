"""Host values to the device without a host-device synchronization.

The decode path plans each step on the host (row lists, slots, positions) and sends small index tensors to the
device. A plain ``torch.tensor(values).to("cuda")`` copies from pageable memory, which blocks the host until the
GPU has caught up, once per call: dozens of stalls per decode step. From pinned memory the copy is asynchronous (the
pinned buffer is kept alive by torch's host allocator until the copy is done).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """A 1-D int64 tensor of ``values`` on ``device``: pinned and non-blocking on CUDA, a plain copy elsewhere."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)

"""Counter-based random numbers for eviction.

Stochastic eviction (VaSE, arXiv 2606.03928, Sec. 3.2) draws fresh noise at every eviction. vase draws it from a
counter-based generator: the noise of a cached token is a hash of (row key, layer, eviction index of that row, KV
head, logical position, stream). Two properties follow that a stateful generator cannot give:

* a row's result does not depend on what else is in the batch, or on its index in the batch, so a ragged batch
  reproduces each of its rows generated alone, and a resumed or sharded sweep reproduces an uninterrupted one;
* the noise does not depend on the slot a token happens to sit in, only on the token.

The row key itself comes from a seeded ``torch.Generator`` (:func:`row_key`), so a seed means the same thing on
every device. Everything here is vectorized torch integer arithmetic and runs on the tensors' device without
host synchronization.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x45D9F3B  # multiplier of a well-mixing 32-bit integer finalizer
_TWO32 = float(2**32)


def row_key(seed: int) -> int:
    """Derive a 31-bit row key from an integer seed with a seeded ``torch.Generator`` (CPU, device independent).

    Raises:
        TypeError: if ``seed`` is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen).item())


def _mix(x: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche mix of an int64 tensor holding values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _C1) & _M32
    x = (((x >> 16) ^ x) * _C1) & _M32
    return (x >> 16) ^ x


def hash32(*parts: torch.Tensor | int) -> torch.Tensor:
    """Hash broadcastable integer tensors (or ints) into uniform 32-bit values, as an int64 tensor in [0, 2**32).

    At least one part must be a tensor; the result has their broadcast shape and the first tensor's device.
    """
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if not tensors:
        raise ValueError("hash32 needs at least one tensor part")
    device = tensors[0].device
    h = torch.full((), 0x9E3779B9, dtype=torch.int64, device=device)
    for p in parts:
        # Python ints stay kernel arguments (no device scalar, so no host-device copy)
        h = _mix(h ^ ((p.to(torch.int64) if isinstance(p, torch.Tensor) else int(p)) & _M32))
    return h


def uniform(*parts: torch.Tensor | int) -> torch.Tensor:
    """Uniform noise in the open interval (0, 1), float64, one value per broadcast element of ``parts``."""
    return (hash32(*parts).to(torch.float64) + 0.5) / _TWO32


def gumbel(*parts: torch.Tensor | int) -> torch.Tensor:
    """Standard Gumbel noise (float32): ``-log(-log(U))`` with ``U = uniform(*parts)``."""
    return (-torch.log(-torch.log(uniform(*parts)))).to(torch.float32)


def normal(*parts: torch.Tensor | int) -> torch.Tensor:
    """Standard normal noise (float32) by the Box-Muller transform of two independent uniform streams."""
    u1 = uniform(*parts, 1)
    u2 = uniform(*parts, 2)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)).to(torch.float32)

"""Attention masks in the forms attention kernels take (torch only)."""

from __future__ import annotations

import torch


def mask_in_kind(m: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask ``m`` (True = attend, any shape) in the form a kernel takes: ``m`` itself for 'bool'
    (sdpa), 0 / ``dtype``'s minimum for 'additive' (eager). 'padding' masks (flash-attention) are built by the caller.
    """
    if kind != "additive":
        return m
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)

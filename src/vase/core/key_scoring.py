"""Scorers that read keys, values and positions only (no saved queries): recency, constant, key diversity, key norm,
projection leverage (one importance score per cached entry, per (batch row, KV head); see
:mod:`vase.core.scoring` for the context they read and the attention-based scorers).

Shapes: ``b`` batch rows, ``H`` KV heads, ``S`` slots, ``D`` head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rng
from .scoring import STREAM_PROJECTION, EvictionContext, Scorer


class Recency(Scorer):
    """Most recent first (score = logical position): with the sinks, StreamingLLM (Xiao et al. 2024, arXiv
    2309.17453, Sec. 3.2)."""

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        return ctx.positions.to(torch.float32)

    def describe(self) -> str:
        return "recency"


class Constant(Scorer):
    """Every entry equally important; with the sampling selector this is uniform random eviction."""

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        return torch.ones(ctx.positions.shape, dtype=torch.float32, device=ctx.positions.device)

    def describe(self) -> str:
        return "constant"


class KeyDiversity(Scorer):
    """KeyDiff (Park et al. 2025, arXiv 2504.15364, Sec. 3): keep keys that differ from the mean key direction.

    Score = 1 - cos(k_i, mean_j k_j / |k_j|), in [0, 2], per (row, KV head); needs no queries.
    """

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        kn = F.normalize(ctx.keys.float(), dim=-1)
        b, s = kn.shape[0], kn.shape[2]
        w = ctx.valid.view(b, -1, s, 1).to(kn.dtype)  # [b,1 or H,S,1]
        anchor = F.normalize((kn * w).sum(2, keepdim=True), dim=-1)  # [b,H,1,D]
        return 1.0 - (kn * anchor).sum(-1)

    def describe(self) -> str:
        return "key diversity (KeyDiff)"


class KeyNorm(Scorer):
    """Low key norm first: Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression", arXiv 2406.11430, Sec. 3-4: keys with a low L2 norm draw high attention, so they are kept.

    Score = ``1 / ||k_i||_2`` (``||k||`` clamped at 1e-6): positive, so it also works with the sampling selector, and
    ordered as "lowest norm first" for top-k. RoPE is a rotation, so the post-RoPE keys in the cache have the
    pre-RoPE norms: the same token at two positions (bit-identical pre-RoPE keys in the first layer) has the same
    norm up to the rounding of the rotation. Norms are therefore rounded to 12 significant bits (relative step
    2.4e-4) before ranking: such ties stay ties, broken by slot index like every tie, instead of by rounding noise
    that differs between batch shapes. Needs no queries.
    """

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        mantissa, exponent = torch.frexp(ctx.keys.float().norm(dim=-1).clamp_min(1e-6))
        return torch.ldexp(torch.round(mantissa * 4096.0) / 4096.0, exponent).reciprocal()

    def describe(self) -> str:
        return "low key norm (1 / ||k||_2)"


class Leverage(Scorer):
    """Approximate leverage of keys and values under a Gaussian projection: score = ||k G||^2 * ||v G||^2, normalised
    to sum to 1 over the valid slots of each (row, KV head).

    G ~ N(0, 1/rank) of shape ``[head_dim, rank]``, one per (row, layer, KV head) with ``projection='head'``, or one
    per (row, layer) shared by the layer's KV heads with ``projection='row'`` (as the reference code of VaSE-DKV
    draws it). ``fresh=False`` draws it once per sequence (CurDKV, Sengupta et al. 2025, arXiv 2509.15038, Sec. 3);
    ``fresh=True`` draws it afresh at every eviction (VaSE-DKV, arXiv 2606.03928, Sec. 3.3).

    Raises:
        ValueError: for a projection other than 'head' or 'row'.
    """

    def __init__(self, rank: int = 20, fresh: bool = True, projection: str = "head"):
        if projection not in ("head", "row"):
            raise ValueError(f"projection must be 'head' (one G per KV head) or 'row' (shared), got {projection!r}")
        self.rank, self.fresh, self.projection = rank, fresh, projection

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        b, h, s, d = ctx.keys.shape
        dev = ctx.keys.device
        ev = ctx.eviction_index if self.fresh else torch.zeros_like(ctx.eviction_index)
        proj = rng.normal(
            ctx.row_keys.view(b, 1, 1, 1),
            ctx.layer(4),
            ev.view(b, 1, 1, 1),
            torch.arange(ctx.head_offset, ctx.head_offset + h, device=dev).view(1, h, 1, 1)
            if self.projection == "head"
            else 0,
            torch.arange(d, device=dev).view(1, 1, d, 1),
            torch.arange(self.rank, device=dev).view(1, 1, 1, self.rank),
            STREAM_PROJECTION,
        ) * (self.rank**-0.5)
        kg = torch.matmul(ctx.keys.float(), proj).pow(2).sum(-1)
        vg = torch.matmul(ctx.values.float(), proj).pow(2).sum(-1)
        lev = (kg * vg) * ctx.valid.view(b, -1, s)
        return lev / lev.sum(-1, keepdim=True).clamp_min(1e-30)

    def describe(self) -> str:
        kind = "fresh at every eviction" if self.fresh else "fixed per sequence"
        shared = "per KV head" if self.projection == "head" else "shared by the KV heads"
        return f"leverage ||KG||^2 ||VG||^2 (rank {self.rank}, projection {kind}, {shared})"

"""A learned retention score: a linear model per (layer, KV head) on features of each held entry, fitted to the
attention the entry receives from future queries (torch only).

The idea is TrimKV's and KVpop's (arXiv 2605.09649, arXiv 2607.05061: a small scorer trained against future
attention instead of a hand-made rule); vase's version is the smallest that can be fitted on a CPU in minutes and
read in one line. For each candidate entry at an eviction, :func:`entry_features` computes

==========================  ==============================================================================
``log_attention``           log of the window attention (mean over the last ``window`` queries, causal, GQA-averaged)
``log_pooled_attention``    the same, average-pooled over 5 neighbouring tokens (SnapKV's score)
``log_key_norm``            log ``||k||_2`` (post-RoPE key)
``log_value_norm``          log ``||v||_2``
``log_value_range``         log ``(max v - min v)`` (the value guard's metric)
``log_age``                 log (1 + tokens since the entry was written)
``relative_position``       position / (newest position + 1)
``key_mean_cosine``         cosine of the key to the head's mean key direction (KeyDiff's signal, negated)
==========================  ==============================================================================

then standardises them with the training set's mean and standard deviation of that (layer, KV head) and predicts
``log(future attention + 1e-6)`` as ``z . w + b``. The score is ``exp`` of the prediction: positive, so that sampled
selection draws in proportion to the predicted attention, and in the same order for top-k.

:func:`fit_ridge` fits ``w, b`` (closed-form ridge regression, float64: deterministic); :class:`LearnedWeights` holds
them with the model shape they were trained for and saves / loads one ``.pt`` file (tensors, lists and strings only,
read with ``weights_only=True``). ``vase train-scorer`` (:mod:`vase.harness.learned`) makes the file from a model's
own traces.

Without a weights file the scorer uses its prior: the log window attention alone (the ranking of SnapKV without
pooling), the same for every layer and head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .scoring import EvictionContext, Scorer, pool_in_order, pool_tokens, window_attention

FEATURES = (
    "log_attention",
    "log_pooled_attention",
    "log_key_norm",
    "log_value_norm",
    "log_value_range",
    "log_age",
    "relative_position",
    "key_mean_cosine",
)
FORMAT = "vase-learned-scorer/1"
EPS = 1e-6
POOL = 5


def entry_features(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    attention: torch.Tensor,
    latest: torch.Tensor,
) -> torch.Tensor:
    """The features of every slot (see the module docstring), float32.

    Args:
        keys, values: ``[b, H, S, D]`` held entries (post-RoPE keys).
        positions: ``[b, H, S]`` int64 logical positions (-1: free or dead).
        valid: ``[b, S]`` or ``[b, H, S]`` bool, slots holding a token (valid slots of a head in position order).
        attention: ``[b, H, S]`` float, the window attention of each slot (mean over the window's queries that can
            see it, GQA-averaged).
        latest: ``[b]`` int64, the newest position of each row.

    Returns:
        ``[b, H, S, F]`` float32 (``F = len(FEATURES)``); invalid slots hold finite values (to be ignored).
    """
    b, h, s, _ = keys.shape
    k, v = keys.float(), values.float()
    valid = valid.view(b, -1, s).expand(b, h, s)
    att = attention.float().clamp_min(0.0)
    if _contiguous(valid):
        pooled = pool_tokens(att * valid, POOL, "avg")
    else:  # dead slots inside a head's slots (adaptive budgets): pool over its live slots in position order
        pooled = pool_in_order(att.unsqueeze(2), valid, positions.float(), POOL, "avg").squeeze(2)
    kn = F.normalize(k, dim=-1)
    anchor = F.normalize((kn * valid.unsqueeze(-1)).sum(2, keepdim=True), dim=-1)
    age = (latest.view(b, 1, 1) - positions).clamp_min(0).float()
    feats = torch.stack(
        [
            torch.log(att + EPS),
            torch.log(pooled.clamp_min(0.0) + EPS),
            torch.log(k.norm(dim=-1) + EPS),
            torch.log(v.norm(dim=-1) + EPS),
            torch.log(v.amax(-1) - v.amin(-1) + EPS),
            torch.log1p(age),
            positions.clamp_min(0).float() / (latest.view(b, 1, 1).float() + 1.0),
            (kn * anchor).sum(-1),
        ],
        dim=-1,
    )
    return feats.masked_fill(~valid.unsqueeze(-1), 0.0)


def _contiguous(valid: torch.Tensor) -> bool:
    """Whether each head's valid slots are one block starting at slot 0 (the usual layout)."""
    n = valid.sum(-1, keepdim=True)
    return bool((valid == (torch.arange(valid.shape[-1], device=valid.device) < n)).all())


def fit_ridge(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-2) -> tuple[torch.Tensor, ...]:
    """Ridge regression of ``y`` on standardised ``x``, closed form in float64 (deterministic).

    Args:
        x: ``[N, F]`` features; y: ``[N]`` targets; ridge: the L2 penalty on the standardised weights (times N).

    Returns:
        ``(mean [F], std [F], weight [F], bias [])`` float32: predictions are ``((x - mean) / std) . weight + bias``.

    Raises:
        ValueError: fewer than 2 samples, or shapes that do not match.
    """
    if x.dim() != 2 or y.shape != (x.shape[0],) or x.shape[0] < 2:
        raise ValueError(f"fit_ridge needs x [N, F] and y [N] with N >= 2, got {tuple(x.shape)} and {tuple(y.shape)}")
    x, y = x.double(), y.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    bias = y.mean()
    n, f = z.shape
    a = z.T @ z + ridge * n * torch.eye(f, dtype=torch.float64)
    w = torch.linalg.solve(a, z.T @ (y - bias))
    return mean.float(), std.float(), w.float(), bias.float()


@dataclass
class LearnedWeights:
    """Per-(layer, KV head) weights of the learned scorer and the model shape they belong to.

    Attributes:
        layer_ids: the model's index of each evicting layer the weights cover (rows of the tensors).
        kv_heads, head_dim: the model's KV heads per layer and head dim.
        mean, std, weight: ``[L, H, F]`` float32; bias: ``[L, H]``.
        model: the name of the model trained on; window: queries of the window attention feature; info: how they
            were trained (sources, k, samples, fit quality), for the record.
    """

    layer_ids: list[int]
    kv_heads: int
    head_dim: int
    mean: torch.Tensor
    std: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    model: str = ""
    window: int = 64
    features: tuple[str, ...] = FEATURES
    info: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write the weights to ``path`` (a ``.pt`` file; parents made)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "format": FORMAT,
                "model": self.model,
                "layer_ids": list(self.layer_ids),
                "kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "window": self.window,
                "features": list(self.features),
                "mean": self.mean,
                "std": self.std,
                "weight": self.weight,
                "bias": self.bias,
                "info": self.info,
            },
            path,
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> LearnedWeights:
        """Read a weights file.

        Raises:
            ValueError: a missing file, or one that is not a vase learned-scorer file of this version.
        """
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(
                f"learned scorer weights {str(path)!r} not found: train them with `vase train-scorer SOURCES --out "
                f"{path}` (or leave weights out for the prior)"
            )
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear error
            raise ValueError(f"{path} is not a learned scorer weights file ({type(exc).__name__})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a learned scorer weights file of format {FORMAT!r}")
        if tuple(data["features"]) != FEATURES:
            raise ValueError(f"{path} was trained on features {data['features']}, this vase computes {list(FEATURES)}")
        return cls(
            layer_ids=list(data["layer_ids"]),
            kv_heads=int(data["kv_heads"]),
            head_dim=int(data["head_dim"]),
            mean=data["mean"],
            std=data["std"],
            weight=data["weight"],
            bias=data["bias"],
            model=str(data.get("model", "")),
            window=int(data.get("window", 64)),
            info=dict(data.get("info", {})),
        )

    def check_model(self, layer_ids: list[int], kv_heads: int, head_dim: int, source: str = "") -> None:
        """Raise a clear ValueError unless these weights cover a model of this shape."""
        mine = (len(self.layer_ids), self.kv_heads, self.head_dim)
        theirs = (len(layer_ids), kv_heads, head_dim)
        if mine != theirs or list(self.layer_ids) != list(layer_ids):
            where = f" {source}" if source else ""
            raise ValueError(
                f"the learned scorer weights{where} were trained for {self.model or 'a model'} with {mine[0]} evicting "
                f"layers x {mine[1]} KV heads x head_dim {mine[2]}; this model has {theirs[0]} x {theirs[1]} x "
                f"{theirs[2]}: train weights on this model (vase train-scorer)"
            )


class LearnedScore(Scorer):
    """Predicted future attention from the entry's features (see the module docstring; after TrimKV, arXiv
    2605.09649, and KVpop, arXiv 2607.05061, which train a retention scorer against future attention).

    Args:
        weights: path of a weights file (``vase train-scorer``), or None for the prior (log window attention).
        window: saved queries for the attention features (the window the weights were trained with).

    Raises:
        ValueError: see :meth:`LearnedWeights.load`; a window other than the weights file's.
    """

    def __init__(self, weights: str | None = None, window: int = 64):
        self.path = None if weights is None else str(weights)
        self.weights = LearnedWeights.load(self.path) if self.path is not None else None
        if self.weights is not None and self.weights.window != window:
            raise ValueError(
                f"the learned scorer weights {self.path} were trained with an attention window of "
                f"{self.weights.window} queries: give window={self.weights.window} (or train with --window {window})"
            )
        self.window = window
        self._rows = {} if self.weights is None else {i: r for r, i in enumerate(self.weights.layer_ids)}

    def check_model(self, layer_ids: list[int], kv_heads: int, head_dim: int) -> None:
        """Raise a clear ValueError if the weights were trained for a model of another shape (no-op for the prior)."""
        if self.weights is not None:
            self.weights.check_model(layer_ids, kv_heads, head_dim, self.path)

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        probs, seen = window_attention(ctx)
        attention = (probs.sum(3) / seen.clamp_min(1).unsqueeze(2)).mean(2)  # [b, H, S]
        if self.weights is None:
            return attention.float().clamp_min(0.0)
        feats = entry_features(ctx.keys, ctx.values, ctx.positions, ctx.valid, attention, ctx.memo["latest_query"])
        layers = ctx.layer_idx.tolist() if isinstance(ctx.layer_idx, torch.Tensor) else [ctx.layer_idx]
        missing = sorted({i for i in layers if i not in self._rows})
        if missing:
            raise ValueError(f"the learned scorer weights {self.path} hold no layer {missing[0]}")
        h = feats.shape[1]
        heads = slice(ctx.head_offset, ctx.head_offset + h)
        wt = self.weights
        dev = feats.device
        rows = torch.tensor([self._rows[i] for i in layers], dtype=torch.long)  # one per row, or one for all

        def per_head(t: torch.Tensor) -> torch.Tensor:  # [L, H_all, F] -> [b or 1, H, 1, F]
            return t[rows][:, heads].to(dev).unsqueeze(2)

        z = (feats - per_head(wt.mean)) / per_head(wt.std)
        pred = (z * per_head(wt.weight)).sum(-1) + wt.bias[rows][:, heads].to(dev).unsqueeze(2)
        return torch.exp(pred.clamp(max=math.log(1e30)))

    def describe(self) -> str:
        if self.weights is None:
            return f"learned score prior (log window attention, window {self.window}; no weights)"
        return f"learned score ({Path(self.path).name}: linear on {len(FEATURES)} features, window {self.window})"

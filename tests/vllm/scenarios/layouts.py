"""The CPU backend's cache layout read off vLLM's own cache write, for each kernel ISA this machine runs.

Job: ``{}``. Per case (ISA, dtype, head dim): whether the probe matches the layout vLLM's source describes for
``vec`` / ``vec16`` (:class:`vase.vllm.layout.HeadMajorKT`), and whether entries written through vLLM's write at
random slots come back exactly, read through the probed layout, and after a compaction in place (kept entries
written to each row's first slots, overlapping the slots they were read from).
"""

from __future__ import annotations

import common  # noqa: F401 - the fast CPU settings
import torch

from vase.vllm.layout import HeadMajorKT
from vase.vllm.paged import cpu_layout


def case(isa: str, dtype: torch.dtype, head_dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    heads, bs, blocks = 3, 32, 6
    layout = cpu_layout(isa, heads, bs, head_dim, dtype)
    out = {"isa": isa, "dtype": str(dtype), "head_dim": head_dim}
    if isa in ("vec", "vec16"):
        ref = HeadMajorKT()
        cache = torch.randn(blocks, heads, bs, 2 * head_dim, generator=g).to(dtype)
        a, b = layout.read(cache, torch.arange(blocks)), ref.read(cache, torch.arange(blocks))
        out["as_documented"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    cache = torch.zeros(blocks, heads, bs, 2 * head_dim, dtype=dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:150]
    keys = torch.randn(150, heads, head_dim, generator=g).to(dtype)
    values = torch.randn(150, heads, head_dim, generator=g).to(dtype)
    layout.write_slots(cache, slots, keys, values)
    k, v = layout.read(cache, torch.arange(blocks))
    k = k.permute(0, 2, 1, 3).reshape(blocks * bs, heads, head_dim)[slots]
    v = v.permute(0, 2, 1, 3).reshape(blocks * bs, heads, head_dim)[slots]
    out["round_trip"] = bool(torch.equal(k, keys) and torch.equal(v, values))
    # a compaction in place: two rows of 3 blocks each keep 40 of their 90 slots (other slots per head), written to
    # their first slots, which overlap the slots read
    rows = torch.tensor([[0, 2, 4], [5, 3, 1]])
    held_k, held_v = layout.gather(cache, rows, 90)
    kept = torch.stack([torch.randperm(90, generator=g)[:40].sort().values for _ in range(2 * heads)])
    kept = kept.view(2, heads, 40)
    want_k = torch.gather(held_k, 2, kept.unsqueeze(-1).expand(-1, -1, -1, head_dim))
    want_v = torch.gather(held_v, 2, kept.unsqueeze(-1).expand(-1, -1, -1, head_dim))
    layout.write_front(cache, rows, want_k, want_v)
    got_k, got_v = layout.gather(cache, rows, 40)
    out["compaction"] = bool(torch.equal(got_k, want_k) and torch.equal(got_v, want_v))
    return out


if __name__ == "__main__":
    job, path = common.job()
    cases = [
        ("vec", torch.float32, 64),
        ("vec16", torch.float32, 48),
        ("vec", torch.bfloat16, 64),
        ("vec", torch.float32, 256),
    ]
    amx = torch.cpu._is_amx_tile_supported()
    if amx:
        cases += [("amx", torch.bfloat16, 64), ("amx", torch.bfloat16, 256)]
    common.write(path, {"amx": amx, "cases": [case(*c) for c in cases]})

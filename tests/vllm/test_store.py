"""The buffers holding dense rows' entries until their deferred eviction (vase.vllm.store): contents, alignment, reuse
at the same address, overflow; no vLLM."""

from __future__ import annotations

import torch

from vase.vllm.store import ALIGN, KEEP, HeldStore, entry_bytes


def _entry(h=3, s=37, d=64, states=("score",), seed=0):
    g = torch.Generator().manual_seed(seed)
    # keys and values as the dense pass gives them: [H, S, D] views of token-major [S, H, D] tensors
    k = torch.randn(s, h, d, generator=g).transpose(0, 1)
    v = torch.randn(s, h, d, generator=g).transpose(0, 1)
    pos = torch.arange(s).expand(h, s)
    return k, v, pos, {n: torch.rand(h, s, generator=g) for n in states}


def test_copies_hold_the_entries_aligned_and_apart_from_the_originals():
    store = HeldStore()
    k, v, pos, st = _entry()
    buf = store.open(entry_bytes(37, 1, 3, 64, 4, 1, layers=1))
    got = [buf.copy(k), buf.copy(v), buf.copy(pos), buf.copy(st["score"])]
    for want, t in zip([k, v, pos, st["score"]], got):
        assert torch.equal(t, want) and t.dtype == want.dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
        assert buf.data.data_ptr() <= t.data_ptr() < buf.data.data_ptr() + buf.data.numel()
    k.add_(1.0)  # the originals change (the step's tensors are reused): the held copies do not
    assert not torch.equal(got[0], k) and buf.overflow == 0


def test_a_closed_buffer_is_reused_at_the_same_address():
    """Step after step the entries land in the same memory: one allocation, while each step closes its buffer."""
    store = HeldStore()
    need = entry_bytes(100, 2, 3, 64, 4, 1, layers=30)
    first = store.open(need)
    addr = first.data.data_ptr()
    store.close(first)
    for step in range(5):
        buf = store.open(need - step)  # a step needing as much or less
        assert buf.data.data_ptr() == addr
        store.close(buf)
    assert store.allocations == 1


def test_two_steps_at_once_then_a_larger_one():
    """A step whose evictions wait (its request sat out a step) holds its buffer while the next step opens another;
    a larger step outgrows the spares and replaces the largest; at most KEEP are kept."""
    store = HeldStore()
    a, b = store.open(1 << 20), store.open(1 << 20)
    assert a.data.data_ptr() != b.data.data_ptr() and store.allocations == 2
    store.close(a)
    store.close(b)
    big = store.open(3 << 20)
    assert big.data.numel() == 3 << 20 and store.allocations == 3 and len(store.spare) == 1
    store.close(big)
    assert len(store.spare) == KEEP and max(s.numel() for s in store.spare) == 3 << 20
    again = store.open(2 << 20)  # the 3 MiB spare serves it
    assert again.data.numel() == 3 << 20 and store.allocations == 3


def test_overflow_copies_out_of_the_buffer():
    """An estimate too small (a wider dtype than the plan counted): the entry still comes back whole, in a tensor
    of its own."""
    store = HeldStore()
    buf = store.open(1)  # rounded up to 1 MiB
    big = torch.randn(3, 2000, 64)  # 1.5 MiB
    got = buf.copy(big)
    assert torch.equal(got, big) and got.data_ptr() != big.data_ptr() and buf.overflow == 1
    small = buf.copy(torch.ones(4))
    assert buf.data.data_ptr() == small.data_ptr() and buf.overflow == 1


def test_entry_bytes_counts_every_tensor_with_its_alignment():
    # 2 rows, 10 tokens in all, 1 layer, 3 heads, head_dim 64, fp32, 1 state value
    per_token = 3 * (2 * 64 * 4 + 8 + 4)
    assert entry_bytes(10, 2, 3, 64, 4, 1, layers=1) == 10 * per_token + 2 * 4 * ALIGN
    store = HeldStore()
    buf = store.open(entry_bytes(80, 2, 3, 64, 4, 1, layers=2))
    for layer in range(2):
        for s in (37, 43):
            k, v, pos, st = _entry(s=s, seed=layer)
            buf.copy(k), buf.copy(v), buf.copy(pos), buf.copy(st["score"])
    assert buf.overflow == 0 and buf.used <= entry_bytes(80, 2, 3, 64, 4, 1, layers=2)

"""Issue 11 piece 3 (stretch): adaptive budgets. Allocation rules on hand-made scores, exact sums, and the per-head
mask against a dense per-head reference in transformers' sdpa and eager attention."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from vase.budgets import check_head_budgets_supported, head_counts, head_mask, pyramid_budgets
from vase.selection import TopK, ValueGuard, select, structural_masks

torch.set_num_threads(1)

HEAD0 = [0.9, 0.8, 0.7, 0.6, 0.05, 0.01]
HEAD1 = [0.5, 0.4, 0.35, 0.3, 0.2, 0.1]


def _scores():
    return torch.tensor([HEAD0, HEAD1]).unsqueeze(0), torch.ones(1, 6, dtype=torch.bool)


def test_head_counts_one_topk_over_the_layer():
    scores, cand = _scores()
    three = torch.tensor([3])
    # layer-wide top 6 of 12: .9 .8 .7 .6 (head 0) and .5 .4 (head 1)
    assert head_counts(scores, cand, three, floor_share=0.0).tolist() == [[4, 2]]
    # floor 1 each, then the best 4 of the rest: .8 .7 .6 (head 0), .4 (head 1)
    assert head_counts(scores, cand, three, floor_share=0.5).tolist() == [[4, 2]]
    # floor 2 each (.9 .8 | .5 .4), then the best 4 of the rest: .7 .6 (head 0), .35 .3 (head 1)
    assert head_counts(scores, cand, torch.tensor([4]), floor_share=0.5).tolist() == [[4, 4]]
    assert head_counts(scores, cand, torch.tensor([2]), floor_share=0.0).tolist() == [[4, 0]]
    assert head_counts(scores, cand, three, floor_share=1.0).tolist() == [[3, 3]]  # uniform
    assert head_counts(scores, cand, three, floor_share=0.0, cap=3).tolist() == [[3, 3]]
    # a candidate mask: slots 0 and 1 are forced elsewhere, head 0's best of the rest are .7 .6
    cand2 = torch.tensor([[False, False, True, True, True, True]])
    assert head_counts(scores, cand2, torch.tensor([2]), floor_share=0.0).tolist() == [[2, 2]]


def test_head_counts_ragged_rows_and_errors():
    scores, cand = _scores()
    scores2 = torch.cat([scores, scores.flip(1)])  # row 1: heads swapped
    counts = head_counts(scores2, cand.expand(2, 6), torch.tensor([3, 1]), floor_share=0.0)
    assert counts.tolist() == [[4, 2], [0, 2]]
    assert (counts.sum(-1) == torch.tensor([6, 2])).all()
    with pytest.raises(ValueError, match="floor_share"):
        head_counts(scores, cand, torch.tensor([3]), floor_share=1.5)
    with pytest.raises(ValueError, match="cannot choose"):
        head_counts(scores, cand, torch.tensor([7]))
    with pytest.raises(ValueError, match="cap"):
        head_counts(scores, cand, torch.tensor([3]), cap=2)


def test_pyramid_budgets_linear_and_exact_total():
    assert pyramid_budgets(100, 5, fixed=20, beta=4) == [160, 130, 100, 70, 40]  # chosen 140 .. 20, mean 80
    # exact values 16.67, 10, 3.33 over fixed 0: floors 16, 10, 3, the missing token to the largest remainder
    assert pyramid_budgets(10, 3, beta=3) == [17, 10, 3]
    assert pyramid_budgets(64, 30, fixed=8) and sum(pyramid_budgets(64, 30, fixed=8)) == 64 * 30
    assert pyramid_budgets(64, 4, fixed=8, beta=1) == [64] * 4
    with pytest.raises(ValueError, match="larger than the tokens every layer keeps"):
        pyramid_budgets(8, 4, fixed=8)


def test_select_with_per_head_keep():
    """keep [b, H]: each head keeps its forced slots plus its own count of best candidates (and the guard's)."""
    scores, _ = _scores()
    valid = torch.ones(1, 8, dtype=torch.bool)
    forced, cand = structural_masks(valid, 1, 1)  # slots 0 and 7 forced; candidates 1..6 hold HEAD0 / HEAD1
    full = torch.cat([torch.zeros(1, 2, 1), scores, torch.zeros(1, 2, 1)], -1)

    class Fixed:
        window = 0
        state_names = ()

        def score(self, ctx):
            return full.clone()

    from .test_value_aware import hand_ctx

    ranges = torch.ones(2, 8)
    ranges[1, 6] = 50.0  # head 1: a large value at its worst-scored slot
    ctx, forced = hand_ctx(torch.zeros(2, 8, 2), torch.stack([ranges, torch.zeros_like(ranges)], -1), budget=6)
    counts = head_counts(full, cand, torch.tensor([3]), floor_share=0.0)
    assert counts.tolist() == [[4, 2]]
    keep = counts + 2
    sel = select(Fixed(), TopK(), None, ctx, keep, int(keep.max()), forced)
    assert sel.indices[0, 0].tolist() == [0, 1, 2, 3, 4, 7]
    assert sel.indices[0, 1, :4].tolist() == [0, 1, 2, 7]  # the rest is padding
    guard = ValueGuard("range", share=1 / 6, rule="outlier", factor=4.0)  # cap 1 slot
    sel = select(Fixed(), TopK(), guard, ctx, keep, int(keep.max()), forced)
    assert sel.protected[0].sum(-1).tolist() == [0, 1]
    assert sel.indices[0, 1, :4].tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_head_mask_equals_dense_attention_per_head(kernel):
    """Heads holding different counts, masked per head: the kernels' output equals attention over each head's own
    slots, computed densely."""
    g = torch.Generator().manual_seed(0)
    b, h, group, s, d = 2, 2, 3, 10, 8
    q = torch.randn(b, h * group, 1, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    fill = torch.tensor([[5, 10], [7, 3]])
    module = types.SimpleNamespace(num_key_value_groups=group, is_causal=True, training=False)
    if kernel == "sdpa":
        out, _ = sdpa_attention_forward(module, q, k, v, head_mask(fill, s, group), scaling=d**-0.5)
    else:
        out, _ = eager_attention_forward(module, q, k, v, head_mask(fill, s, group, "additive"), scaling=d**-0.5)
    ref = torch.zeros(b, 1, h * group, d)
    for r in range(b):
        for hq in range(h * group):
            n = int(fill[r, hq // group])
            a = torch.softmax((k[r, hq // group, :n] @ q[r, hq, 0]) * d**-0.5, 0)
            ref[r, 0, hq] = a @ v[r, hq // group, :n]
    assert torch.allclose(out, ref, atol=1e-5)


def test_flash_attention_refused_clearly():
    check_head_budgets_supported("sdpa")
    check_head_budgets_supported("vase_eager")
    with pytest.raises(ValueError, match="per-head mask"):
        check_head_budgets_supported("flash_attention_2")

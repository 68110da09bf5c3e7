"""The decode path never waits for the device, checked on CPU: every aten op of 40 ragged decode steps (5 evictions
per row) is watched, and none of those that make a CUDA host wait may come from vase's code.

On a GPU (tests/hf/test_cache.py, ``torch.cuda.set_sync_debug_mode``) a synchronization shows itself; CI has no GPU,
so this test looks for the ops that synchronize there: host reads of device values (``item``, ``int(t)``, ``tolist``:
``_local_scalar_dense``), data-dependent shapes (``nonzero``, ``masked_select``, boolean-mask indexing,
``repeat_interleave`` by a tensor) and tensors made from host data (``lift_fresh``: ``torch.tensor(list, device=...)``
copies from pageable memory) other than through :func:`vase.core.transfer.upload` (pinned, asynchronous). What it
cannot see on CPU: a ``.to("cuda")`` of an existing host tensor (the GPU test covers it)."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import vase
from tests.conftest import random_ids, tiny_model
from vase.hf.compat import cache_kwargs

torch.set_num_threads(1)

_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "lift_fresh", "lift_fresh_copy"}


def _note(found: collections.Counter, name: str) -> None:
    frames = [f for f in traceback.extract_stack() if "/vase/" in f.filename.replace("\\", "/")]
    if frames and not frames[-1].filename.endswith("transfer.py"):  # upload(): pinned and asynchronous
        where = frames[-1].filename.replace("\\", "/").split("/vase/")[-1]
        found[(name, f"{where}:{frames[-1].lineno}")] += 1


class SyncWatch(TorchDispatchMode):
    """Counts the ops that would synchronize a CUDA host, by (op, innermost vase frame)."""

    def __init__(self):
        super().__init__()
        self.found: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        syncing = name in _SYNCING
        if name in ("index", "index_put", "index_put_"):
            syncing = any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1] if t is not None)
        elif name == "repeat_interleave":
            syncing = len(args) > 1 and isinstance(args[1], torch.Tensor) and not (kwargs or {}).get("output_size")
        if syncing:
            _note(self.found, name)
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """``Tensor.tolist`` reads the data without an aten op: seen at the Python level."""

    def __init__(self, found: collections.Counter):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            _note(self.found, "tolist")
        return func(*args, **(kwargs or {}))


def _decode(policy: str, feed: bool = False, **kw) -> tuple[collections.Counter, int]:
    """40 decode steps of a ragged batch of 2 (row 1 left-padded), then of one row, watched; the prefill is not."""
    model = tiny_model("llama")
    watch, evictions = SyncWatch(), 0
    for batch in (2, 1):
        ids = random_ids(40, batch=batch)
        mask = torch.ones_like(ids)
        mask[1:, :7] = 0
        cache = vase.EvictingCache(model, policy=policy, budget=32, buffer=8, **kw)
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
        tok = torch.full((batch, 1), 5)
        logits = torch.zeros(batch, model.config.vocab_size)
        with watch, HostReads(watch.found):
            for s in range(40):
                if kw.get("compileable"):
                    cache.prepare_decode()
                if feed:
                    cache.observe_confidence(logits)
                model(input_ids=tok, position_ids=torch.full((batch, 1), 40 + s), **cache_kwargs(cache))
        evictions += cache.stats().evictions
    return watch.found, evictions


@pytest.mark.parametrize(
    "policy, kw",
    [
        ("vase", {}),
        ("vase:preset=paper", {}),
        ("vase_dkv", {}),
        ("snapkv", {}),
        ("h2o", {}),
        ("tova", {}),
        ("rkv", {}),
        ("keydiff", {}),
        ("knorm", {}),
        ("curdkv", {}),
        ("random", {}),
        ("streaming_llm", {}),
        ("learned", {}),
        ("h2o:head_budget=adakv", {}),
        ("vase:head_budget=adakv:layer_budget=pyramid", {}),
        ("vase", {"compileable": True}),
    ],
)
def test_decode_path_has_no_synchronizing_op(policy, kw):
    found, evictions = _decode(policy, **kw)
    assert evictions >= 10
    assert not found, f"ops that synchronize a GPU, by (op, where): {dict(found)}"


def test_the_reads_that_remain_are_one_per_eviction():
    """Two paths read the device on purpose: the quantized store (how many entries to quantize now, once per layer
    and compaction) and the confidence budget (the window's uncertainty: on a GPU folded lazily, one copy per
    eviction; on CPU at each observation, a read of host memory)."""
    found, evictions = _decode("vase", kv_bits=4, kv_group=16)
    [(op, where)] = found
    assert op == "_local_scalar_dense"
    assert where.startswith("hf/quantized.py") and sum(found.values()) <= 2 * evictions  # 2 layers

    found, evictions = _decode("vase:step_budget=confidence", feed=True)
    assert found and all(where.startswith("core/confidence.py") for _, where in found), dict(found)

"""Which deferred evictions a step's flush runs (vase.vllm.state.WorkerState.flush): only the requests the coming step
schedules, each once; the others wait; a step's buffer of held entries goes back when none of its rows waits. The
eviction itself is recorded, not run (its tokens are checked against transformers in test_vllm); no vLLM."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from vase.vllm import settings
from vase.vllm.state import WorkerState


class _Step:
    """The part of a committed step (vase.vllm.state.PagedStep) that the flush reads."""

    def __init__(self, ws, evicting, dense_bytes=1024):
        self.evicting = frozenset(evicting)
        self.gone, self.done = set(), set()
        self.deferred = ["layer"]
        self.cache = {"held": ws.store.open(dense_bytes)}

    def waiting_ids(self):
        return self.evicting - self.gone - self.done


@pytest.fixture
def ws(monkeypatch):
    cfg, _ = settings.parse("vase:budget=64:buffer=16")
    state = WorkerState(settings.EngineSettings(cfg, block_size=16), max_reqs=8)
    state.ran = []
    # the flush imports vase.vllm.compact (which needs vLLM's kernels) when it runs: a recorder in its place
    fake = ModuleType("vase.vllm.compact")
    fake.evict_deferred = lambda w, plan, requests: w.ran.append((plan, set(requests)))
    monkeypatch.setitem(sys.modules, "vase.vllm.compact", fake)
    return state


def test_only_the_scheduled_requests_evictions_run(ws):
    """A prefill step compressed a, b and c; the next step schedules b (its prompt's next chunk) and a new prompt:
    b's eviction runs, a's and c's wait for the steps that schedule them, then the buffer goes back."""
    step = _Step(ws, "abc")
    buf = step.cache["held"]
    ws.pending = [step]
    ws.flush(set(), {"b", "new"})
    assert ws.ran == [(step, {"b"})] and ws.pending == [step] and step.cache["held"] is buf
    assert ws.stats["partial_flushes"] == 1 and ws.stats["flushes_waited"] == 1
    ws.flush(set(), {"new"})  # nothing of it scheduled: nothing runs
    assert len(ws.ran) == 1 and ws.stats["flushes_waited"] == 2
    ws.flush({"c"}, {"a", "new"})  # c finished (or was aborted) meanwhile: never evicted; a runs, the step is done
    assert ws.ran[1] == (step, {"a"}) and ws.pending == [] and step.deferred == []
    # the buffer is reused by the next step (the same memory)
    assert "held" not in step.cache and ws.store.open(1024).data.data_ptr() == buf.data.data_ptr()


def test_oldest_step_first_and_every_request_once(ws):
    first, second = _Step(ws, "ab"), _Step(ws, "cd")
    ws.pending = [first, second]
    ws.flush(set(), {"a", "c", "d"})
    assert ws.ran == [(first, {"a"}), (second, {"c", "d"})] and ws.pending == [first]
    ws.flush()  # counters read: everything still waiting runs
    assert ws.ran[-1] == (first, {"b"}) and ws.pending == [] and ws.stats["partial_flushes"] == 1


def test_a_step_whose_rows_are_all_gone_runs_nothing(ws):
    step = _Step(ws, "ab")
    ws.pending = [step]
    ws.flush({"a", "b"}, {"x"})
    assert ws.ran == [] and ws.pending == [] and "held" not in step.cache and ws.stats["flushes_waited"] == 0


def test_a_plan_knows_its_waiting_requests():
    """PagedStep.waiting_ids: evicting, not done, not gone."""
    from vase.vllm.state import PagedStep

    plan = PagedStep.__new__(PagedStep)
    plan.req_ids, plan.schedule = ["a", "b", "c"], SimpleNamespace(evict=[0, 2])
    plan.gone, plan.done = {"c"}, set()
    assert plan.evicting == {"a", "c"} and plan.waiting_ids() == {"a"}
    plan.done.add("a")
    assert plan.waiting_ids() == frozenset()


def test_reusable_tensors_keep_their_memory_from_step_to_step(ws):
    """The scratch cache and selected queries of a step come from memory the worker keeps: the same address for a
    step of the same or a smaller size, a larger one when a step needs more, apart per key and dtype."""
    a = ws.reusable("scratch", (4, 3, 8), torch.float32)
    a.fill_(1.0)
    b = ws.reusable("scratch", (2, 3, 8), torch.float32)
    assert b.shape == (2, 3, 8) and b.data_ptr() == a.data_ptr() and bool((b == 1.0).all())
    other = ws.reusable("ring_q", (4, 3, 8), torch.float32)
    assert other.data_ptr() != a.data_ptr()
    big = ws.reusable("scratch", (40, 3, 8), torch.float32)
    assert big.shape == (40, 3, 8) and ws.reusable("scratch", (40, 3, 8), torch.float32).data_ptr() == big.data_ptr()
    assert ws.reusable("scratch", (4, 3, 8), torch.float64).dtype == torch.float64

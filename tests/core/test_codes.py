"""Decode attention over quantized codes (vase.core.codes): every implementation equals attention over the
dequantized entries, with the validity rules of the quantized store."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vase.core import codes, quant


def store(bits: int, b=2, h=3, g=3, d=64, lim=300, p=5, r=16, group=32, dtype=torch.float32, seed=0):
    """A random quantized store with dead slots, unused guard entries and rows with different recent counts."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, lim, d, generator=gen) * 2
    v = torch.randn(b, h, lim, d, generator=gen)
    factors = torch.rand(b, h, d, generator=gen) + 0.5
    kq, ks, kz = quant.quantize(k / factors.unsqueeze(2), bits, group)
    vq, vs, vz = quant.quantize(v, bits, group)
    cap = lim + r
    positions = torch.randint(0, 1000, (b, h, cap), generator=gen)
    positions[torch.rand(b, h, cap, generator=gen) < 0.1] = -1
    qlimit = torch.tensor([lim - 10, lim - 3][:b])
    protected = torch.randint(0, lim - 10, (b, h, p), generator=gen)
    if p:
        protected[0, 0, 0] = qlimit[0]  # an unused guard entry
    return dict(
        query=torch.randn(b, h * g, d, generator=gen).to(dtype),
        factors=factors,
        scaling=d**-0.5,
        codes=(kq, ks, kz, vq, vs, vz),
        qmask=torch.rand(b, h, lim, generator=gen) > 0.2,
        positions=positions,
        fp_k=torch.randn(b, h, p + r, d, generator=gen).to(dtype),
        fp_v=torch.randn(b, h, p + r, d, generator=gen).to(dtype),
        protected=protected,
        qlimit=qlimit,
        recent=torch.tensor([r, 7][:b]),
        bits=bits,
        sinks=torch.randn(h * g, generator=gen),
    )


def dequantized_attention(a: dict) -> torch.Tensor:
    """The reference: the store dequantized, the valid entries gathered, softmax attention in float64."""
    kq, ks, kz, vq, vs, vz = a["codes"]
    keys = quant.dequantize(kq, ks, kz, a["bits"]) * a["factors"].unsqueeze(2)
    values = quant.dequantize(vq, vs, vz, a["bits"])
    b, h, lim, d = keys.shape
    p = a["protected"].shape[2]
    r = a["fp_k"].shape[2] - p
    pos = a["positions"]
    ok = torch.cat(
        [
            a["qmask"] & (pos[:, :, :lim] >= 0),
            (a["protected"] < a["qlimit"].view(-1, 1, 1)) & (pos.gather(2, a["protected"]) >= 0),
            (torch.arange(r, device=pos.device).view(1, 1, r) < a["recent"].view(-1, 1, 1)).expand(b, h, r),
        ],
        -1,
    )
    k_all = torch.cat([keys.double(), a["fp_k"].double()], 2)
    v_all = torch.cat([values.double(), a["fp_v"].double()], 2)
    q = a["query"].double().view(b, h, -1, d)
    s = (q @ k_all.transpose(-1, -2) * a["scaling"]).masked_fill(~ok.unsqueeze(2), float("-inf"))
    if a["sinks"] is not None:
        s = torch.cat([s, a["sinks"].double().view(1, h, -1, 1).expand(b, h, -1, 1)], -1)
        v_all = torch.cat([v_all, v_all.new_zeros(b, h, 1, v_all.shape[-1])], 2)
    return (torch.softmax(s, -1) @ v_all).view(b, -1, v_all.shape[-1])


def _backends():
    out = ["torch"]
    if codes.cpp_available():
        out.append("cpp")
    return out


def test_the_cpu_kernel_builds_here():
    """The C++ kernel builds on this machine (CI has a compiler); elsewhere the torch path serves, with a warning."""
    assert codes.cpp_available(), codes._cpp_error


@pytest.mark.parametrize("bits", quant.KV_BITS)
@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("guard", [5, 0])
@pytest.mark.parametrize("backend", _backends())
def test_codes_attention_equals_attention_over_the_dequantized_store(bits, sinks, guard, backend):
    a = store(bits, p=guard)
    if not sinks:
        a["sinks"] = None
    out = codes.decode_attention(**a, backend=backend)
    assert out.shape == a["query"].shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dequantized_attention(a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_blocks_and_chunks_do_not_change_the_result(backend):
    """A long store (several blocks and thread chunks), one row, one query head per KV head, 8 bits."""
    a = store(8, b=1, h=2, g=1, d=32, lim=1500, p=3, r=8, group=16, seed=3)
    torch.testing.assert_close(
        codes.decode_attention(**a, backend=backend).double(), dequantized_attention(a), atol=1e-5, rtol=1e-5
    )
    if backend == "torch":
        small = codes.decode_attention_torch(*[a[n] for n in list(a)[:-1]], sinks=a["sinks"], block=100)
        torch.testing.assert_close(small, codes.decode_attention(**a, backend="torch"), atol=1e-5, rtol=1e-5)


def test_float64_stays_float64_and_an_empty_row_gives_zeros():
    a = store(4, dtype=torch.float64)
    a["sinks"] = None
    out = codes.decode_attention(**a)
    assert out.dtype == torch.float64
    torch.testing.assert_close(
        out, dequantized_attention(a), atol=1e-6, rtol=1e-5
    )  # the reference dequantizes in float32
    a = store(4, b=1)
    a["qmask"][:] = False
    a["recent"][:] = 0
    a["protected"][:] = a["qlimit"][0]
    a["sinks"] = None
    for backend in _backends():
        assert torch.equal(codes.decode_attention(**a, backend=backend), torch.zeros_like(a["query"]))


def test_bad_backend_is_a_clear_error():
    a = store(4, b=1)
    with pytest.raises(ValueError, match="unknown codes-attention backend 'gpu'"):
        codes.decode_attention(**a, backend="gpu")
    a["query"] = a["query"].double()
    with pytest.raises(ValueError, match="cpp backend runs float32 on CPU"):
        codes.decode_attention(**a, backend="cpp")
    with pytest.raises(ValueError, match="triton backend runs on CUDA"):
        codes.decode_attention(**a, backend="triton")


# ------------------------------------------------------------------------------------------------ the kernel's build
_SECOND_CALL = """
import json, time
import torch
from tests.core.test_codes import dequantized_attention, store
from vase.core import codes
t0 = time.monotonic()
a = store(4)
out = codes.decode_attention(**a)
print(json.dumps({"cpp": codes.cpp_available(), "seconds": time.monotonic() - t0,
                  "error": float((out.double() - dequantized_attention(a)).abs().max())}))
"""


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (Linux ``/proc``), stopped first so that none starts another."""
    stopped: set[int] = set()
    while True:
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(stat.parent.name))
        tree, todo = set(), [pid]
        while todo:
            p = todo.pop()
            tree.add(p)
            todo.extend(children.get(p, []))
        if not tree - stopped:
            break
        for p in tree - stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        stopped |= tree
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the build's processes in /proc")
def test_a_build_killed_part_way_does_not_block_the_next(tmp_path):
    """A first build killed once its lock file exists (SIGKILL to it and every process it started, compiler included,
    as an OOM kill or a cancelled CI job does) leaves that lock behind and no library; the next call still builds the
    kernel, in about one build's time (20-40 s here; torch's builder alone waits on the lock for ever, so the bound
    makes that a failure), with the same results as the reference."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    first = subprocess.Popen([sys.executable, "-c", "from vase.core import codes; codes.cpp_available()"], env=env)
    deadline = time.monotonic() + 120
    while not list(tmp_path.rglob("lock")):
        assert first.poll() is None, "the first build ended before it could be killed"
        assert time.monotonic() < deadline, "the first build never created its lock file"
        time.sleep(0.05)
    _kill_tree(first.pid)
    first.wait()
    assert list(tmp_path.rglob("lock")) and not list(tmp_path.rglob("*.so"))  # killed part-way, its lock left
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SECOND_CALL], env=env, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the call after a killed build waited on its lock for 240 s")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cpp"] and result["error"] < 1e-5, result
    libraries = list(tmp_path.glob("vase_codes_*/vase_codes_*.so"))
    assert len(libraries) == 1 and not (libraries[0].parent / "lock").exists()


def test_a_build_past_its_time_falls_back_to_torch_with_one_warning(tmp_path, monkeypatch, caplog):
    """A build that runs past ``$VASE_KERNEL_BUILD_TIMEOUT`` is stopped (compiler included): the torch path serves,
    with one warning line saying how to rebuild; a bad timeout is a clear error."""
    monkeypatch.setattr(codes, "_cpp", None)
    monkeypatch.setattr(codes, "_cpp_error", "")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("VASE_KERNEL_BUILD_TIMEOUT", "0.2")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vase"):
        assert not codes.cpp_available()
    assert time.monotonic() - t0 < 30
    assert "TimeoutError: the build ran past 0.2 s" in codes._cpp_error
    (record,) = [r for r in caplog.records if r.name == "vase"]
    message = record.getMessage()
    assert "\n" not in message and "uses torch" in message
    assert f"to rebuild from scratch delete {tmp_path}" in message and "VASE_KERNEL_BUILD_TIMEOUT above" in message
    assert not list(tmp_path.rglob(".build-*"))  # the stopped build's private folder is removed
    a = store(4)
    torch.testing.assert_close(codes.decode_attention(**a).double(), dequantized_attention(a), atol=1e-5, rtol=1e-5)
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("VASE_KERNEL_BUILD_TIMEOUT", bad)
        with pytest.raises(ValueError, match="VASE_KERNEL_BUILD_TIMEOUT must be a positive number of seconds"):
            codes.build_timeout()

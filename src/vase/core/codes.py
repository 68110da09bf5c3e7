"""Decode attention read straight from the quantized store (policy option ``kv_bits``): no dequantized copy.

One new token per row attends over what an evicting layer stores with ``kv_bits`` (:mod:`vase.hf.quantized`): the
quantized slots, whose keys were divided by per-channel factors ``f`` and then quantized per token in groups of
channels (step ``s``, minimum ``z`` per group, :mod:`vase.core.quant`), and the full-precision store (the value
guard's entries, then the recent tokens). Per group ``g`` of channels the score and the output factor as

    q . k_t = sum_g s_tg * ((q * f)_g . code_tg) + z_tg * sum((q * f)_g)
    sum_t p_t v_t = sum_g [ sum_t (p_t s_tg) code_tg + sum_t p_t z_tg ]

(the key form of KIVI's attention over quantized keys, arXiv 2402.02750, Sec. 3.3, with ZipCache's channel factors,
arXiv 2405.14256, Sec. 4.2), and both parts share one softmax. The store is read in blocks with an online softmax
(flash-decoding), so no buffer grows with the cache.

Three implementations, one meaning (:func:`decode_attention` picks one):

* ``cpp``: a C++ kernel for float32 on CPU (``kernels/codes_attention.cpp``), built once per machine with the
  compiler PyTorch's extensions use (about 20 s, cached in PyTorch's extension folder: ``$TORCH_EXTENSIONS_DIR``, by
  default ``~/.cache/torch_extensions/py<version>_cpu``, one subfolder per kernel version). The build runs in a
  separate process, in a private folder, and its library is moved into place only once complete, so a build killed
  part-way never blocks a later one; one that runs past ``$VASE_KERNEL_BUILD_TIMEOUT`` seconds (default 300) is
  stopped and the torch path serves, with one warning;
* ``triton``: the Triton kernel for CUDA (:mod:`vase.core.kernels.codes_triton`), one launch per layer for every row;
* ``torch``: the same arithmetic in torch operations, block by block (any device and dtype; the fallback when no
  compiler is available, and the reference the kernels are tested against).

Which entries count (the validity rules every implementation applies): quantized slot ``t`` of (row ``b``, KV head
``h``) when ``qmask[b, h, t]`` and ``positions[b, h, t] >= 0``; guard entry ``j`` when its logical slot
``protected[b, h, j]`` is below ``qlimit[b]`` and holds a token; recent entry ``j`` when ``j < recent[b]``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from . import quant

BACKENDS = ("auto", "cpp", "triton", "torch")
_NEG = -1e30
_log = logging.getLogger("vase")
_lock = threading.Lock()
_cpp = None  # the built extension, False once a build failed
_cpp_error = ""
BUILD_TIMEOUT_S = 300.0
"""Default of ``$VASE_KERNEL_BUILD_TIMEOUT``: seconds the C++ kernel's build may take (it takes about 20 s)."""

# Run by the build process (python -c): torch's builder in a private folder, then the library moved into place in one
# rename. Its own `lock` file is in the private folder, where no other build waits on it.
_BUILD_SCRIPT = """
import json, os, sys
from torch.utils.cpp_extension import load
a = json.loads(sys.argv[1])
module = load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_ldflags=a["ldflags"],
              build_directory=a["private"], verbose=False)
os.replace(module.__file__, a["library"])
"""


def decode_attention(
    query: torch.Tensor,
    factors: torch.Tensor,
    scaling: float,
    codes: tuple[torch.Tensor, ...],
    qmask: torch.Tensor,
    positions: torch.Tensor,
    fp_k: torch.Tensor,
    fp_v: torch.Tensor,
    protected: torch.Tensor,
    qlimit: torch.Tensor,
    recent: torch.Tensor,
    bits: int,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of one new token per row over a quantized store and its full-precision entries.

    Args:
        query: ``[B, q_heads, D]`` post-RoPE queries (``q_heads`` = KV heads x GQA group).
        factors: ``[B, H, D]`` float32 key channel factors (keys were divided by them before quantization).
        scaling: the attention logits' scale (``D ** -0.5`` for most models).
        codes: ``(kq, ks, kz, vq, vs, vz)``: packed key/value codes ``[B, H, L, D * bits / 8]`` uint8, their steps and
            minima ``[B, H, L, D / group]`` float16.
        qmask: ``[B, H, L]`` bool, slots stored quantized.
        positions: ``[B, H, capacity]`` int64 logical position of each slot (-1: free or dead); ``capacity >= L``.
        fp_k, fp_v: ``[B, H, P + R, D]`` the full-precision store: ``P`` guard entries, then ``R`` recent slots.
        protected: ``[B, H, P]`` int64 logical slot of each guard entry.
        qlimit: ``[B]`` int64, each row's quantization limit (guard entries at or past it are unused).
        recent: ``[B]`` int64, how many recent slots hold a token (the new one included).
        bits: 8, 4 or 2.
        sinks: ``[q_heads]`` attention-sink logits added to each head's softmax denominator (gpt-oss), or None.
        backend: one of :data:`BACKENDS` (``auto``: ``triton`` on CUDA when Triton is installed, ``cpp`` for float32
            on CPU when the kernel builds, else ``torch``).

    Returns:
        ``[B, q_heads, D]`` in the query's dtype.

    Raises:
        ValueError: an unknown backend, or one that cannot run these tensors (``cpp`` off CPU or not float32,
            ``triton`` off CUDA or without Triton).
    """
    name = _choose(backend, query)
    if name == "cpp":
        ext = _extension()
        out = ext.codes_attention(
            query.contiguous().float(),
            factors.contiguous(),
            float(scaling),
            *(t.contiguous() for t in codes),
            qmask.contiguous(),
            positions.contiguous(),
            fp_k.contiguous().float(),
            fp_v.contiguous().float(),
            protected.contiguous(),
            qlimit,
            recent,
            torch.empty(0) if sinks is None else sinks.detach().float().contiguous(),
            int(bits),
        )
        return out.to(query.dtype)
    args = (query, factors, scaling, codes, qmask, positions, fp_k, fp_v, protected, qlimit, recent, bits, sinks)
    if name == "triton":
        from .kernels.codes_triton import decode_attention_triton

        return decode_attention_triton(*args)
    return decode_attention_torch(*args)


def _choose(backend: str, query: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown codes-attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    cuda = query.device.type == "cuda"
    if backend == "cpp":
        if query.device.type != "cpu" or query.dtype != torch.float32:
            raise ValueError("the cpp backend runs float32 on CPU; use backend='torch' (or 'triton' on CUDA)")
        if _extension() is None:
            raise ValueError(f"the cpp backend could not be built here: {_cpp_error}")
        return "cpp"
    if backend == "triton":
        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
        if not triton_available():
            raise ValueError("the triton backend needs the triton package: pip install triton")
        return "triton"
    if backend == "torch":
        return "torch"
    if cuda and triton_available():
        return "triton"
    if query.device.type == "cpu" and query.dtype == torch.float32 and _extension() is not None:
        return "cpp"
    return "torch"


def triton_available() -> bool:
    """Whether the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cpp_available() -> bool:
    """Whether the CPU kernel is built (building it on the first call; False if it cannot be built here)."""
    return _extension() is not None


def _cpu_tag() -> str:
    """What the kernel's build depends on besides its source: it is compiled for this CPU (``-march=native``)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return platform.machine() + flags


def _extension():
    """The CPU kernel, built on first use (once per machine: the build is cached), or None if it cannot be."""
    global _cpp, _cpp_error
    if _cpp is not None:
        return _cpp or None
    with _lock:
        if _cpp is not None:
            return _cpp or None
        source = Path(__file__).parent / "kernels" / "codes_attention.cpp"
        digest = hashlib.sha1(source.read_bytes() + _cpu_tag().encode() + torch.__version__.encode()).hexdigest()
        name = f"vase_codes_{digest[:12]}"
        timeout = build_timeout()
        folder = None
        try:
            from torch.utils import cpp_extension

            folder = Path(cpp_extension._get_build_directory(name, verbose=False))
            _cpp = _load_or_build(name, source, folder, timeout)
        except Exception as exc:  # no compiler, no headers, a build past its time: the torch path serves instead
            _cpp = False
            text = str(exc).strip()
            _cpp_error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
            where = folder if folder is not None else "$TORCH_EXTENSIONS_DIR's vase_codes_* folder"
            _log.warning(
                "vase's CPU kernel could not be built (%s); attention over codes uses torch. The next run builds it "
                "again; to rebuild from scratch delete %s, or set VASE_KERNEL_BUILD_TIMEOUT above %g s or "
                "TORCH_EXTENSIONS_DIR to another folder",
                _cpp_error,
                where,
                timeout,
            )
    return _cpp or None


def build_timeout() -> float:
    """Seconds the C++ kernel's build may take: ``$VASE_KERNEL_BUILD_TIMEOUT``, else :data:`BUILD_TIMEOUT_S`.

    Raises:
        ValueError: a value that is not a positive number of seconds.
    """
    raw = os.environ.get("VASE_KERNEL_BUILD_TIMEOUT", "").strip()
    if not raw:
        return BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"VASE_KERNEL_BUILD_TIMEOUT must be a positive number of seconds, got {raw!r}")
    return value


def _load_or_build(name: str, source: Path, folder: Path, timeout: float):
    """The kernel's module from ``folder/<name>.so``, built there first when it is missing or does not load.

    The build runs in a separate process (its own session, so that a timeout stops the compiler too) in a private
    folder inside ``folder``; the finished library is renamed into place, so ``folder`` never holds a partial one nor
    a ``lock`` a killed build left behind (torch's builder waits on such a lock for ever).

    Raises:
        TimeoutError: the build ran past ``timeout`` seconds. RuntimeError: the build failed (its last error line).
    """
    from torch.utils import cpp_extension

    library = folder / f"{name}{getattr(cpp_extension, 'LIB_EXT', '.so')}"
    if library.is_file():
        try:
            return _import(name, library)
        except ImportError:  # a library an older build left incomplete: built again below
            pass
    _remove_stale_builds(folder, timeout)
    _log.info("building vase's CPU kernel for attention over quantized codes (once per machine)")
    flags = ["-O3", "-fopenmp", "-ffast-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    private = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    args = {
        "name": name,
        "sources": [str(source)],
        "cflags": flags,
        "ldflags": ["-fopenmp"],
        "private": str(private),
        "library": str(library),
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise TimeoutError(f"the build ran past {timeout:g} s") from None
        if proc.returncode:
            lines = [line for line in err.strip().splitlines() if line.strip()]
            raise RuntimeError(lines[-1] if lines else f"the build exited with status {proc.returncode}")
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return _import(name, library)


def _import(name: str, library: Path):
    """The extension module in ``library`` (as torch's builder imports it)."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a build process and the compiler it started (its process group), and reap it."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except OSError:  # already gone
        pass
    proc.communicate()


def _remove_stale_builds(folder: Path, timeout: float) -> None:
    """Remove the private folders of builds that were killed (older than twice the build timeout: a live build is
    stopped at its timeout)."""
    limit = time.time() - 2 * timeout
    for old in folder.glob(".build-*"):
        try:
            if old.stat().st_mtime < limit:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            pass


def decode_attention_torch(
    query,
    factors,
    scaling,
    codes,
    qmask,
    positions,
    fp_k,
    fp_v,
    protected,
    qlimit,
    recent,
    bits,
    sinks=None,
    block: int = 1024,
) -> torch.Tensor:
    """:func:`decode_attention` in torch operations, ``block`` quantized slots at a time (float64 for a float64
    query, else float32). Same arguments; returns ``[B, q_heads, D]`` in the query's dtype."""
    kq, ks, kz, vq, vs, vz = codes
    b, hq, d = query.shape
    h, lim = kq.shape[1], kq.shape[2]
    g, ng, dv = hq // h, ks.shape[-1], fp_v.shape[-1]
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    q_fp = query.view(b, h, g, d).to(dt) * scaling  # the full-precision keys are the keys themselves
    q = q_fp * factors.to(dt).unsqueeze(2)  # the quantized ones were divided by the channel factors
    qg = q.view(b, h, g, ng, d // ng)
    qsum = qg.sum(-1)  # [b, h, g, ng]
    m = torch.full((b, h, g), _NEG, dtype=dt, device=query.device)
    den = torch.zeros((b, h, g), dtype=dt, device=query.device)
    acc = torch.zeros((b, h, g, dv), dtype=dt, device=query.device)

    def merge(s: torch.Tensor, ok: torch.Tensor, values) -> None:
        """One block: scores ``s`` [b, h, g, n], validity ``ok`` [b, h, 1, n]; ``values(p)`` -> [b, h, g, dv]."""
        nonlocal m, den, acc
        s = s.masked_fill(~ok, _NEG)
        new = torch.maximum(m, s.amax(-1))
        scale = torch.exp(m - new)
        p = torch.exp(s - new.unsqueeze(-1)) * ok
        den = den * scale + p.sum(-1)
        acc = acc * scale.unsqueeze(-1) + values(p)
        m = new

    valid = (qmask & (positions[:, :, :lim] >= 0)).unsqueeze(2)
    for t0 in range(0, lim, block):
        t1 = min(lim, t0 + block)
        n = t1 - t0
        ck = quant.unpack(kq[:, :, t0:t1], bits).view(b, h, n, ng, d // ng).to(dt)
        s = torch.einsum("bhjgc,bhtgc->bhjtg", qg, ck)
        s = (s * ks[:, :, t0:t1].to(dt).unsqueeze(2)).sum(-1) + torch.einsum(
            "bhjg,bhtg->bhjt", qsum, kz[:, :, t0:t1].to(dt)
        )

        def values(p, t0=t0, t1=t1, n=n):
            cv = quant.unpack(vq[:, :, t0:t1], bits).view(b, h, n, ng, dv // ng).to(dt)
            w = p.unsqueeze(-1) * vs[:, :, t0:t1].to(dt).unsqueeze(2)  # [b, h, g, n, ng]
            out = torch.einsum("bhjtg,bhtgc->bhjgc", w, cv)
            out = out + torch.einsum("bhjt,bhtg->bhjg", p, vz[:, :, t0:t1].to(dt)).unsqueeze(-1)
            return out.reshape(b, h, g, dv)

        merge(s, valid[..., t0:t1], values)
    p_slots = protected.shape[2]
    slot = protected.clamp(max=positions.shape[2] - 1)
    ok_guard = (protected < qlimit.view(b, 1, 1)) & (positions.gather(2, slot) >= 0)
    r = fp_k.shape[2] - p_slots
    ok_recent = (torch.arange(r, device=query.device).view(1, 1, r) < recent.view(b, 1, 1)).expand(b, h, r)
    ok = torch.cat([ok_guard, ok_recent], -1).unsqueeze(2)
    s = torch.matmul(q_fp, fp_k.to(dt).transpose(-1, -2))
    merge(s, ok, lambda p: torch.matmul(p, fp_v.to(dt)))
    if sinks is not None:
        den = den + torch.exp(sinks.to(dt).view(1, h, g) - m)
    out = acc / den.clamp_min(torch.finfo(dt).tiny).unsqueeze(-1)
    return out.reshape(b, hq, dv).to(query.dtype)

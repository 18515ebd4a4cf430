"""Every bench suite's --quick mode runs (in-process) and writes results.json, report.md and
its PNGs; one CLI smoke test runs the real command. No assertion depends on elapsed time."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.procs import run_cli
from torchgpu.bench.runner import run_suite
from torchgpu.bench.suites import SUITES

CPU = [torch.device("cpu")]


def needs(module: str) -> Any:
    """Skip a suite whose dependency module has not landed in this tree."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return pytest.mark.skipif(not found, reason=f"{module} is not available")


def run_quick(name: str, out: Path) -> dict[str, Any]:
    _, doc = run_suite(name, quick=True, out=out, devices=CPU)
    assert (out / "report.md").read_text().startswith(f"# torchgpu bench {name} (quick)")
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert on_disk["suite"] == name and on_disk["quick"] is True
    assert on_disk["schema"] == "torchgpu.bench/1"
    assert on_disk["devices"][0]["spec"] == "cpu"
    assert on_disk["threads"] == torch.get_num_threads()
    assert on_disk["plots"], "every suite draws at least one plot"
    for plot in on_disk["plots"]:
        assert (out / plot["filename"]).read_bytes()[:4] == b"\x89PNG"
    for m in on_disk["measurements"]:
        assert m["n"] == len(m["samples"]) >= 1
        assert m["min"] <= m["median"] <= m["max"]
        assert math.isfinite(m["median"])
    assert not torch.cuda.is_initialized()
    return on_disk


def rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in doc["measurements"]}


def test_matmul_quick(tmp_path: Path) -> None:
    doc = run_quick("matmul", tmp_path)
    found = rows(doc)
    assert set(found) == {"cpu n=64 float32", "cpu n=128 float32"}
    for m in found.values():
        assert m["unit"] == "TFLOP/s" and m["median"] > 0 and m["n"] == 2
    assert doc["ratios"] == []  # no GPU: nothing to compare the CPU with
    assert any("GPU rows need" in note for note in doc["notes"])


def test_summarize_renders_tables_from_result_files(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "summarize", Path(__file__).resolve().parents[2] / "benchmarks" / "summarize.py")
    assert spec is not None and spec.loader is not None
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    results = tmp_path / "results"
    doc = run_quick("matmul", results / "cpu-box" / "matmul")
    text = summarize.render(results)
    assert text.startswith("### matmul")
    assert "cpu-box (quick)" in text and "(results/cpu-box/matmul/results.json)" in text
    first = doc["measurements"][0]
    assert f"| {first['name']} | {first['median']:.4g} TFLOP/s |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{summarize.BEGIN}\nold\n{summarize.END}\noutro\n")
    summarize.write(readme, results)
    written = readme.read_text()
    assert "old" not in written and "### matmul" in written and written.endswith("outro\n")


def test_transfer_quick(tmp_path: Path) -> None:
    doc = run_quick("transfer", tmp_path)
    found = rows(doc)
    assert "host memcpy pageable 4 MiB" in found
    assert found["host memcpy pageable 4 MiB"]["unit"] == "GB/s"
    if not torch.cuda.is_available():
        assert any("pinned host memory skipped" in n for n in doc["notes"])
        assert not any(name.startswith("H2D") for name in found)


@needs("torchgpu.parallel.pipeline")
@pytest.mark.slow
def test_parallel_quick(tmp_path: Path) -> None:
    doc = run_quick("parallel", tmp_path)
    found = rows(doc)
    assert {"single device", "model parallel", "pipeline (split 4)"} <= set(found)
    assert "pipeline, 2 processes (gloo)" in found
    assert doc["config"]["chunks"] == 2 and doc["config"]["placement"] == "CPU twice"
    names = {r["name"] for r in doc["ratios"]}
    assert "model parallel/single device" in names
    assert "single device/pipeline (split 4)" in names


@needs("torchgpu.parallel.pipeline")
@pytest.mark.slow
def test_split_sweep_quick(tmp_path: Path) -> None:
    doc = run_quick("split-sweep", tmp_path)
    found = rows(doc)
    assert list(found) == ["split 2 (4 chunks)", "split 4 (2 chunks)"]
    assert doc["config"]["best_split_size"] in (2, 4)
    assert doc["plots"][0]["kind"] == "line" and doc["plots"][0]["best"] == "min"


@needs("torchgpu.memory")
@pytest.mark.slow
def test_checkpointing_quick_saves_memory(tmp_path: Path) -> None:
    doc = run_quick("checkpointing", tmp_path)
    found = rows(doc)
    plain = found["no checkpointing"]["extra"]["saved_bytes"]
    two = found["2 segments"]["extra"]["saved_bytes"]
    sqrt = found["sqrt segments"]["extra"]["saved_bytes"]
    assert plain > two > sqrt > 0  # more segments, fewer activations kept
    assert found["sqrt segments"]["extra"]["segments"] == 4  # ceil(sqrt(16 layers))


@needs("torchgpu.accumulate")
@pytest.mark.slow
def test_accumulation_quick_memory_follows_micro_batch(tmp_path: Path) -> None:
    doc = run_quick("accumulation", tmp_path)
    found = rows(doc)
    whole = found["micro-batch 32 x 1"]["extra"]
    small = found["micro-batch 8 x 4"]["extra"]
    assert small["steps"] == 4 and whole["steps"] == 1
    assert small["saved_bytes"] < whole["saved_bytes"]
    assert not any("missing" in note for note in doc["notes"])


@needs("torchgpu.parallel.data")
@pytest.mark.slow
def test_dp_ddp_quick_cpu_processes(tmp_path: Path) -> None:
    doc = run_quick("dp-ddp", tmp_path)
    found = rows(doc)
    assert "one process" in found and "DDP 2 processes (gloo)" in found
    memory = [m for m in found.values() if m["unit"] == "bytes"]
    assert [m["name"] for m in memory] == ["DDP rank 0 cpu", "DDP rank 1 cpu"]
    assert all(m["median"] > 0 for m in memory)
    assert any("DataParallel rows need" in note for note in doc["notes"])


@needs("torchgpu.train.loop")
def test_overhead_quick(tmp_path: Path) -> None:
    doc = run_quick("overhead", tmp_path)
    found = rows(doc)
    for size in ("tiny", "medium"):
        assert f"raw loop ({size})" in found and f"torchgpu loop ({size})" in found
    names = {r["name"] for r in doc["ratios"]}
    assert "torchgpu loop (tiny)/raw loop (tiny)" in names


def test_unknown_suite_exits_2_listing_suites(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    from torchgpu.cli.main import main

    assert main(["bench", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and all(name in err for name in SUITES)
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_cli_smoke_json(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(["bench", "matmul", "--quick", "--json", "--out", str(out),
                    "--device", "cpu"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed == json.loads((out / "results.json").read_text())
    assert printed["suite"] == "matmul"


@pytest.mark.gpu
def test_gpu_rows_quick(tmp_path: Path) -> None:
    gpu = [torch.device("cuda", 0)]
    _, matmul = run_suite("matmul", quick=True, out=tmp_path / "m", devices=gpu)
    names = {m["name"] for m in matmul["measurements"]}
    assert "cuda:0 n=1024 float32" in names and "cpu n=64 float32" in names
    _, transfer = run_suite("transfer", quick=True, out=tmp_path / "t", devices=gpu)
    found = rows(transfer)
    assert "H2D pinned cuda:0 4 MiB" in found and "copy hidden by Prefetcher" in found
    assert 0.0 <= found["copy hidden by Prefetcher"]["median"] <= 1.0
    assert any(r["name"].startswith("H2D pinned") for r in transfer["ratios"])

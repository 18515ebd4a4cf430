"""Every bench suite's --quick mode runs (in-process) and writes results.json, report.md and
its PNGs; the CLI checks its flags before running anything. No assertion depends on
elapsed time."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.procs import run_cli
from torchgpu.bench.runner import run_suite
from torchgpu.bench.suites import SUITES

CPU = [torch.device("cpu")]
REPO = Path(__file__).resolve().parents[2]


def needs(module: str) -> Any:
    """Skip a suite whose dependency module has not landed in this tree."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return pytest.mark.skipif(not found, reason=f"{module} is not available")


def run_quick(name: str, out: Path) -> dict[str, Any]:
    before = torch.get_num_threads()
    _, doc = run_suite(name, quick=True, out=out, devices=CPU, argv=["torchgpu", "bench", name])
    assert torch.get_num_threads() == before  # the suite's thread count does not leak
    assert (out / "report.md").read_text().startswith(f"# torchgpu bench {name} (quick)")
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert on_disk["suite"] == name and on_disk["quick"] is True
    assert on_disk["schema"] == "torchgpu.bench/2"
    assert on_disk["devices"][0]["spec"] == "cpu"
    assert on_disk["threads"] == 1  # the default: every CPU variant at 1 thread per process
    assert on_disk["argv"] == ["torchgpu", "bench", name] and on_disk["torchgpu"]
    assert on_disk["verdicts"], "every suite states a verdict per claim"
    assert on_disk["plots"], "every suite draws at least one plot"
    for plot in on_disk["plots"]:
        assert (out / plot["filename"]).read_bytes()[:4] == b"\x89PNG"
    for m in on_disk["measurements"]:
        assert m["n"] == len(m["samples"]) >= 1
        assert m["min"] <= m["median"] <= m["max"]
        assert math.isfinite(m["median"])
        assert m["threads"] == 1
    assert not torch.cuda.is_initialized()
    return on_disk


def rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in doc["measurements"]}


def ratio_names(doc: dict[str, Any]) -> set[str]:
    return {r["name"] for r in doc["ratios"]}


def load_summarize() -> ModuleType:
    spec = importlib.util.spec_from_file_location("summarize", REPO / "benchmarks" / "summarize.py")
    assert spec is not None and spec.loader is not None
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    return summarize


def test_matmul_quick(tmp_path: Path) -> None:
    doc = run_quick("matmul", tmp_path)
    found = rows(doc)
    assert set(found) == {"cpu n=64 float32", "cpu n=256 float32"}
    for m in found.values():
        assert m["unit"] == "TFLOP/s" and m["median"] > 0 and m["n"] == 2
    assert doc["ratios"] == []  # no GPU: nothing to compare the CPU with
    assert any("GPU rows need" in note for note in doc["notes"])
    (plot,) = doc["plots"]  # one chart, a line per device
    assert plot["xscale"] == "log2" and plot["yscale"] == "log"
    assert [s["label"] for s in plot["series"]] == ["cpu float32"]


def test_summarize_renders_tables_from_result_files(tmp_path: Path) -> None:
    summarize = load_summarize()
    results = tmp_path / "results"
    doc = run_quick("matmul", results / "cpu-box" / "matmul")
    text = summarize.render(results)
    assert text.startswith("### matmul")
    assert "cpu-box (quick)" in text and "(results/cpu-box/matmul/results.json)" in text
    assert "[tflops.png](results/cpu-box/matmul/tflops.png)" in text
    assert "[report.md](results/cpu-box/matmul/report.md)" in text
    assert "| cpu n=256 float32 (TFLOP/s) |" in text  # CPU: relative, not absolute
    for m in doc["measurements"]:
        assert f"{m['median']:.4g} TFLOP/s" not in text  # no absolute CPU figure
    assert "- GPUs are faster at matrix work: not checked here" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{summarize.BEGIN}\nOLD-TABLE\n{summarize.END}\noutro\n")
    summarize.write(readme, results)
    written = readme.read_text()
    assert "OLD-TABLE" not in written and "### matmul" in written and written.endswith("outro\n")


def _ratio(num: str, den: str, samples: list[float]) -> dict[str, Any]:
    return {"name": f"{num}/{den}", "numerator": num, "denominator": den,
            "median": sorted(samples)[len(samples) // 2], "min": min(samples),
            "max": max(samples), "samples": samples}


def _measurement(name: str, value: float, unit: str = "s", **extra: Any) -> dict[str, Any]:
    return {"name": name, "unit": unit, "n": 1, "median": value, "min": value, "max": value,
            "mean": value, "stdev": 0.0, "threads": 1, "samples": [value], "extra": extra}


def test_summarize_cpu_ratios_memory_best_split_noise_and_gpu_absolutes(tmp_path: Path) -> None:
    summarize = load_summarize()
    root = tmp_path / "results"
    base = {"schema": "torchgpu.bench/2", "quick": False, "torch": "2.x", "threads": 1,
            "device_names": ["Some CPU"], "devices": [{"spec": "cpu", "name": "Some CPU"}],
            "notes": [], "plots": [], "config": {}}
    sweep = {**base, "suite": "split-sweep", "verdicts": ["best split (4) vs single: x"],
             "cpu_pressure": {"stalled_fraction": 0.9}, "noisy": True, "noisy_threshold": 0.2,
             "measurements": [_measurement("single device", 2.0),
                              _measurement("split 2 (4 chunks)", 3.0, split_size=2),
                              _measurement("split 4 (2 chunks)", 2.5, split_size=4, best=True)],
             "ratios": [_ratio("split 2 (4 chunks)", "single device", [1.5, 1.4, 1.6]),
                        _ratio("split 4 (2 chunks)", "single device", [1.2, 1.3, 1.25])]}
    ckpt = {**base, "suite": "checkpointing", "verdicts": [], "cpu_pressure": None,
            "measurements": [_measurement("no checkpointing", 0.1, saved_bytes=4 * 2**20),
                             _measurement("2 segments", 0.12, saved_bytes=2**20)],
            "ratios": [_ratio("2 segments", "no checkpointing", [1.2])]}
    gpu = {**base, "suite": "dp-ddp", "verdicts": ["DDP vs DP: 1.3x faster"],
           "device_names": ["NVIDIA H100"], "cpu_pressure": None,
           "devices": [{"spec": "cuda:0", "name": "NVIDIA H100"}],
           "measurements": [_measurement("one process", 0.05),
                            _measurement("DataParallel cuda:0", 3 * 2**30, "bytes",
                                         kind="peak_allocated_bytes"),
                            _measurement("DataParallel cuda:1", 2 * 2**30, "bytes",
                                         kind="peak_allocated_bytes")],
           "ratios": []}
    for machine, doc in (("cpu-box", sweep), ("cpu-box", ckpt), ("gpu-box", gpu)):
        folder = root / machine / doc["suite"]
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(doc))
    text = summarize.render(root)
    sweep_part = text.split("### split-sweep")[1].split("###")[0]
    assert "| split 4 (2 chunks)/single device ★ best | 1.250 |" in sweep_part
    assert "2.000 s" not in sweep_part  # CPU: no absolute times
    assert "Timings unreliable" in sweep_part and "90%" in sweep_part
    ckpt_part = text.split("### checkpointing")[1].split("###")[0]
    assert "| 2 segments | 1.0 MiB | 0.25x |" in ckpt_part
    assert "| 2 segments/no checkpointing | 1.200 |" in ckpt_part
    gpu_part = text.split("### dp-ddp")[1]
    assert "| one process | 50.00 ms |" in gpu_part  # GPU machines: absolute figures
    assert "| memory (peak_allocated_bytes) | value | vs DataParallel cuda:0 |" in gpu_part
    assert "| DataParallel cuda:1 | 2.0 GiB | 0.67x |" in gpu_part
    assert "- DDP vs DP: 1.3x faster" in gpu_part


def test_summarize_renders_the_extra_cpu_benchmarks(tmp_path: Path) -> None:
    summarize = load_summarize()
    extra = tmp_path / "results" / "cpu-box" / "extra"
    extra.mkdir(parents=True)
    wrap = {"schema": "torchgpu.bench-extra/1", "cpu": "Some CPU", "torch": "2.x",
            "cpu_pressure": {"stalled_fraction": 0.05}, "noisy": False}
    (extra / "ddp_cpu.json").write_text(json.dumps({  # as the script writes it, unwrapped
        "processes": 2, "threads": 1, "steps": 100, "rounds": 9,
        "weak_scaling_efficiency": {"raw_ddp": 0.8, "torchgpu_ddp": 0.79},
        "torchgpu_vs_raw_ddp": 0.99}))
    (extra / "pipeline_cpu.json").write_text(json.dumps({**wrap, "benchmark": "pipeline_cpu",
        "result": {"times": {"single": {"samples": [1.0, 1.0]},
                             "naive": {"samples": [1.02, 1.04]},
                             "auto": {"samples": [0.68, 0.65]}},
                   "ranks": [{"rank": 0, "peak_rss_bytes": 300 * 2**20, "memory": {
                       "auto": {"param_bytes": 2**20, "activation_bytes": 2 * 2**20}}}]}}))
    text = summarize.render(tmp_path / "results")
    assert "| weak-scaling efficiency, torchgpu_ddp (1.0 = perfect) | 0.790 |" in text
    assert "[ddp_cpu.json](results/cpu-box/extra/ddp_cpu.json)" in text
    assert "| auto | 1.550 | 1.500 .. 1.600 |" in text  # naive/auto per round: 1.5, 1.6
    assert "naive model parallel vs one process, one thread: 1.030x" in text
    assert "auto-chosen pipeline vs naive model parallel: 1.550x the speed" in text
    assert "| 0 | 300.0 MiB | auto 1.0 MiB + 2.0 MiB |" in text


def test_extra_wrapper_keeps_the_scripts_json_with_provenance(tmp_path: Path) -> None:
    from torchgpu.bench.extra import main, run_extra

    script = tmp_path / "fake_bench.py"
    script.write_text("import json, sys\n"
                      "path = sys.argv[sys.argv.index('--json') + 1]\n"
                      "json.dump({'args': sys.argv[1:], 'ok': True}, open(path, 'w'))\n")
    out = tmp_path / "out" / "fake_bench.json"
    doc = run_extra(script, out, ["--quick"])
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert on_disk["benchmark"] == "fake_bench" and on_disk["result"]["ok"] is True
    assert on_disk["result"]["args"][-1] == "--quick" and on_disk["torchgpu"]
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    assert main([str(failing), str(tmp_path / "never.json")]) == 1
    assert not (tmp_path / "never.json").exists()
    assert main([str(tmp_path / "missing.py"), str(out)]) == 2


def test_transfer_quick(tmp_path: Path) -> None:
    doc = run_quick("transfer", tmp_path)
    found = rows(doc)
    assert "host memcpy pageable 64 MiB" in found  # at least 64 MiB: out of cache
    assert found["host memcpy pageable 64 MiB"]["unit"] == "GB/s"
    if not torch.cuda.is_available():
        assert any("pinned host memory skipped" in n for n in doc["notes"])
        assert not any(name.startswith("H2D") for name in found)


@needs("torchgpu.parallel.pipeline")
@pytest.mark.slow
def test_parallel_quick(tmp_path: Path) -> None:
    doc = run_quick("parallel", tmp_path)
    found = rows(doc)
    assert {"single device", "model parallel", "pipeline (split 4)"} <= set(found)
    workers = found["pipeline, 2 processes (gloo)"]
    assert workers["threads"] == doc["threads"] == 1  # the workers' own count
    assert workers["extra"]["processes"] == 2 and workers["extra"]["threads_total"] == 2
    assert doc["config"]["chunks"] == 2 and doc["config"]["placement"] == "CPU twice"
    assert ratio_names(doc) == {"model parallel/single device",
                                "pipeline (split 4)/single device",
                                "pipeline, 2 processes (gloo)/single device"}
    assert doc["verdicts"][0].startswith("model parallel vs single device: ")
    assert any("thread budget" in note for note in doc["notes"])


def test_parallel_keeps_cpu_processes_away_from_gpu_rows() -> None:
    from torchgpu.bench.suites.parallel import wants_stage_processes

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert wants_stage_processes([cpu, cpu])
    assert not wants_stage_processes([gpu, gpu]) and not wants_stage_processes([gpu, cpu])


@needs("torchgpu.parallel.pipeline")
@pytest.mark.slow
def test_split_sweep_quick(tmp_path: Path) -> None:
    doc = run_quick("split-sweep", tmp_path)
    found = rows(doc)
    assert list(found) == ["single device", "split 2 (4 chunks)", "split 4 (2 chunks)"]
    assert ratio_names(doc) == {"split 2 (4 chunks)/single device",
                                "split 4 (2 chunks)/single device"}
    best = [m for m in found.values() if m["extra"].get("best")]
    assert len(best) == 1 and best[0]["extra"]["split_size"] == doc["config"]["best_split_size"]
    assert best[0]["mean"] == min(m["mean"] for m in found.values() if "split_size" in m["extra"])
    plot = doc["plots"][0]
    assert plot["kind"] == "line" and plot["best"] == "min"
    assert plot["reference"] == "single device" and plot["xscale"] == "log"


@needs("torchgpu.memory.activation_checkpointing")
@pytest.mark.slow
def test_checkpointing_quick_saves_memory(tmp_path: Path) -> None:
    doc = run_quick("checkpointing", tmp_path)
    found = rows(doc)
    plain = found["no checkpointing"]["extra"]["saved_bytes"]
    two = found["2 segments"]["extra"]["saved_bytes"]
    sqrt = found["sqrt segments"]["extra"]["saved_bytes"]
    assert plain > two > sqrt > 0  # more segments, fewer activations kept
    assert found["sqrt segments"]["extra"]["segments"] == 4  # ceil(sqrt(16 layers))
    verdict = next(v for v in doc["verdicts"] if v.startswith("2 segments vs no checkpointing"))
    assert f"{two / plain:.2f}x the saved-activation bytes" in verdict and "holds" in verdict


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
    for name, processes in (("one process", 1), ("DDP 2 processes (gloo)", 2)):
        assert found[name]["threads"] == 1 and found[name]["extra"]["processes"] == processes
        assert found[name]["extra"]["in_worker"] is True  # both measured the same way
        rate = found[f"{name} throughput"]
        assert rate["unit"] == "samples/s" and rate["min"] <= rate["max"]
    memory = [m for m in found.values() if m["unit"] == "bytes"]
    assert [m["name"] for m in memory] == ["one process cpu", "DDP rank 0 cpu", "DDP rank 1 cpu"]
    assert {m["extra"]["kind"] for m in memory} == {"max_rss_bytes"}  # one kind per chart
    assert all(m["median"] > 0 for m in memory)
    assert ratio_names(doc) == {"DDP 2 processes (gloo)/one process"}
    assert any("DataParallel rows need" in note for note in doc["notes"])
    assert doc["config"]["memory"] == "max_rss_bytes"


def test_dp_ddp_plans_like_for_like() -> None:
    from torchgpu.bench.suites.dp_ddp import plan_for

    cpu_plan = plan_for([])
    assert (cpu_plan.kind, cpu_plan.ddp_devices, cpu_plan.data_parallel) == (
        "cpu", ("cpu", "cpu"), False)
    one_gpu = plan_for([torch.device("cuda", 0)])  # DDP on CPU, so the baseline is too
    assert one_gpu.kind == "cpu" and one_gpu.one_device == "cpu" and "one GPU" in one_gpu.reason
    two = plan_for([torch.device("cuda", 0), torch.device("cuda", 1)])
    assert (two.kind, two.one_device, two.backend, two.memory_key) == (
        "gpu", "cuda:0", "nccl", "peak_allocated_bytes")
    assert two.ddp_name == "DDP 2 processes (nccl)"
    assert not torch.cuda.is_initialized()


@needs("torchgpu.train.loop.epoch")
def test_overhead_quick(tmp_path: Path) -> None:
    doc = run_quick("overhead", tmp_path)
    found = rows(doc)
    for size in ("tiny", "medium"):
        assert f"raw loop ({size})" in found and f"torchgpu loop ({size})" in found
    assert "torchgpu loop (tiny)/raw loop (tiny)" in ratio_names(doc)
    assert any("design target" in v for v in doc["verdicts"])


@needs("torchgpu.train.runner")
def test_overhead_loop_is_the_loop_torchgpu_train_runs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's parts and run_epoch arguments match what a real train() passes."""
    from torchgpu.bench.suites.train_step import TrainEpoch
    from torchgpu.train import runner
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.loop.parts import LoopParts

    seen: list[tuple[Any, dict[str, Any]]] = []
    real = runner.run_epoch

    def spy(parts: Any, batches: Any, state: Any, **kwargs: Any) -> Any:
        seen.append((parts, kwargs))
        return real(parts, batches, state, **kwargs)

    monkeypatch.setattr(runner, "run_epoch", spy)
    runner.train(TrainConfig(example="housing", data_size=40, epochs=1, batch_size=16,
                             device="cpu", progress="off", out=str(tmp_path / "run")))
    theirs, their_kwargs = seen[0]
    from torchgpu.models import HousingNet

    batches = [(torch.randn(16, 13), torch.randn(16, 1)) for _ in range(3)]
    ours = TrainEpoch(HousingNet(), torch.device("cpu"), batches, batch_size=16, lr=1e-3)
    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr("torchgpu.train.loop.epoch.run_epoch",
                        lambda parts, b, state, **kw: calls.append((parts, kw)) or real(
                            parts, b, state, **kw))
    ours()
    mine, my_kwargs = calls[0]
    assert mine is ours.parts and ours.state.step == 3
    for field in dataclasses.fields(LoopParts):
        a, b = getattr(theirs, field.name), getattr(mine, field.name)
        if field.name == "model":
            continue
        if a is None or isinstance(a, bool | int | str | float | torch.device):
            assert a == b, field.name
        else:
            assert type(a) is type(b), field.name
    assert theirs.backoff is not None  # train arms the OOM back-off per step: so does the suite
    assert type(theirs.accumulator.optimizer) is type(mine.accumulator.optimizer)
    assert theirs.accumulator.precision.mode == mine.accumulator.precision.mode
    assert set(their_kwargs) == set(my_kwargs)
    for key, value in their_kwargs.items():
        if callable(value) and not isinstance(value, type):  # a hook: a method or function
            assert callable(my_kwargs[key]), key
        else:
            assert type(value) is type(my_kwargs[key]), key


def test_unknown_suite_exits_2_listing_suites(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    from torchgpu.cli.main import main

    assert main(["bench", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and all(name in err for name in SUITES)
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_out_file_non_empty_dir_and_threads_exit_2_in_one_paragraph(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from torchgpu.cli.main import main

    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["bench", "matmul", "--quick", "--out", str(afile)]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "Traceback" not in err
    assert err.count("\n") == 1 and afile.read_text() == ""
    old = tmp_path / "old"
    old.mkdir()
    (old / "peak.png").write_bytes(b"stale")
    assert main(["bench", "matmul", "--quick", "--out", str(old)]) == 2
    assert "--force" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's range check (cli.common.int_in)
        main(["bench", "matmul", "--quick", "--threads", "0", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1
    assert "--threads: 0 is out of range" in err and not (tmp_path / "t").exists()
    assert main(["bench", "matmul", "--quick", "--json", "--force", "--out", str(old)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not (old / "peak.png").exists()  # the earlier run's plot is gone
    assert doc["argv"][:3] == ["torchgpu", "bench", "matmul"] and "--force" in doc["argv"]


def test_cli_smoke_json(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(["bench", "matmul", "--quick", "--json", "--out", str(out),
                    "--device", "cpu", "--threads", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed == json.loads((out / "results.json").read_text())
    assert printed["suite"] == "matmul" and printed["threads"] == 1
    assert "--threads" in printed["argv"]


@pytest.mark.gpu
def test_gpu_rows_quick(tmp_path: Path) -> None:
    gpu = [torch.device("cuda", 0)]
    _, matmul = run_suite("matmul", quick=True, out=tmp_path / "m", devices=gpu)
    names = {m["name"] for m in matmul["measurements"]}
    assert "cuda:0 n=1024 float32" in names and "cpu n=64 float32" in names
    (speedup,) = matmul["ratios"]  # n=256 on both
    assert speedup["name"] == "cuda:0 n=256 float32/cpu n=256 float32"
    found = rows(matmul)
    tflops = found["cuda:0 n=256 float32"]["median"] / found["cpu n=256 float32"]["median"]
    assert speedup["min"] <= tflops * 1.5 and speedup["max"] >= tflops / 1.5  # same scale
    _, transfer = run_suite("transfer", quick=True, out=tmp_path / "t", devices=gpu)
    found = rows(transfer)
    assert "H2D pinned cuda:0 64 MiB" in found and "copy hidden by Prefetcher cuda:0" in found
    assert 0.0 <= found["copy hidden by Prefetcher cuda:0"]["median"] <= 1.0
    assert any(r["name"].startswith("H2D pinned") for r in transfer["ratios"])
    _, parallel = run_suite("parallel", quick=True, out=tmp_path / "p", devices=gpu)
    assert not any("processes" in m["name"] for m in parallel["measurements"])



def test_size_medium_is_checked_before_anything_runs(tmp_path: Path, capsys: Any) -> None:
    from torchgpu.bench.suites.common import rounds_for
    from torchgpu.bench.suites.resnet_run import run_for
    from torchgpu.cli.main import main

    assert main(["bench", "matmul", "--size", "medium", "--out", str(tmp_path / "m")]) == 2
    assert "--size medium applies to parallel and split-sweep" in capsys.readouterr().err
    assert main(["bench", "parallel", "--size", "huge", "--out", str(tmp_path / "h")]) == 2
    assert "is not a size" in capsys.readouterr().err
    assert main(["bench", "parallel", "--quick", "--size", "medium",
                 "--out", str(tmp_path / "q")]) == 2
    assert not (tmp_path / "m").exists() and not (tmp_path / "h").exists()
    medium = run_for(False, "medium")
    assert (medium.batch_size, medium.image_px, medium.num_batches) == (120, 64, 1)
    assert run_for(False).image_px == 128 and run_for(True).image_px == 32
    assert rounds_for(False, "medium").rounds == 5 and rounds_for(False).rounds == 10

"""The GPU check's GPT-2 step (benchmarks/gpu/gpt2_step.py) and the default part's imports,
exercised on the CPU: a tiny GPT-2 end to end, the host-sync count with CPU stand-ins for
the CUDA calls, and every command of the default part working without torchdata and
datasets (the GPU machines have neither)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(KIT))

import gpt2_step  # noqa: E402
import steps  # noqa: E402
import summary  # noqa: E402

pytest.importorskip("transformers")

# Run first in every child below: an import of either now raises ImportError.
BLOCK = "import sys\nfor _name in ('torchdata', 'datasets'):\n    sys.modules[_name] = None\n"


def run_blocked(code: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(KIT), str(REPO / "src")])}
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_gpt2_step_runs_tiny_on_the_cpu_without_torchdata_or_datasets(tmp_path: Path
                                                                      ) -> None:
    out = tmp_path / "gpt2-step"
    done = run_blocked("import gpt2_step\nsys.exit(gpt2_step.main(['--device', 'cpu', "
                       f"'--tiny', '--modes', 'eager', '--out', {str(out)!r}]))")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((out / "results.json").read_text())
    names = [m["name"] for m in doc["measurements"]]
    assert names == ["raw loop (eager)", "raw loop, second copy (eager)",
                     "torchgpu loop (eager)"]
    assert all(m["extra"]["step_ms"] > 0 and len(m["samples"]) == 2
               for m in doc["measurements"])
    assert {(r["numerator"], r["denominator"]) for r in doc["ratios"]} == {
        ("torchgpu loop (eager)", "raw loop (eager)"),
        ("raw loop, second copy (eager)", "raw loop (eager)")}
    assert doc["config"]["layers"] == 2 and doc["config"]["seq"] == 64
    # the kit's summary reads it; the compiled mode was not asked for
    figures = {f["key"]: f for f in summary.build(tmp_path)["figures"]}
    assert figures["loop_overhead_gpt2_eager"]["value"] is not None
    assert figures["loop_overhead_gpt2_compile"]["missing"] == "run PART=lm (gpt2-step)"


def test_the_compiled_mode_is_skipped_when_the_time_limit_is_short(tmp_path: Path) -> None:
    assert gpt2_step.main(["--device", "cpu", "--tiny", "--steps", "2", "--rounds", "1",
                           "--warmup", "0", "--time-limit", "5", "--compile-needs", "100",
                           "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["config"]["modes"]) == ["eager"]
    assert "compile" in doc["config"]["skipped"]
    assert any("mode compile skipped" in note for note in doc["notes"])


def test_a_mode_that_fails_keeps_the_others_rows_and_exits_1(tmp_path: Path,
                                                             monkeypatch: Any) -> None:
    real = gpt2_step.run_mode

    def run_mode(mode: str, *args: Any) -> Any:
        if mode == "compile":
            raise RuntimeError("inductor: no C++ compiler")
        return real(mode, *args)

    monkeypatch.setattr(gpt2_step, "run_mode", run_mode)
    assert gpt2_step.main(["--device", "cpu", "--tiny", "--steps", "2", "--rounds", "1",
                           "--warmup", "0", "--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [m["extra"]["mode"] for m in doc["measurements"]] == ["eager"] * 3
    assert "no C++ compiler" in doc["config"]["skipped"]["compile"]


@pytest.mark.parametrize("engine", [False, True], ids=["raw", "torchgpu"])
def test_host_syncs_are_counted_per_optimizer_step(monkeypatch: Any, engine: bool) -> None:
    """count_syncs with CPU stand-ins for CUDA's synchronize and sync debug mode: one
    "synchronizing" warning per loss computed, counted per step between step ends, and
    the step hooks put back after."""
    modes: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    plain = gpt2_step.lm_loss

    def syncing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        return plain(logits, targets)

    monkeypatch.setattr(gpt2_step, "lm_loss", syncing_loss)
    cpu = torch.device("cpu")
    size = gpt2_step.TINY
    batches = gpt2_step.make_batches(size, 4, cpu)
    model = gpt2_step.make_model(size, cpu)
    variant: Any = (gpt2_step.engine_loop(model, batches, cpu, "fp32") if engine
                    else gpt2_step.RawLoop(model, batches, cpu, None, log_every=4))
    hook = variant.on_step
    counted = gpt2_step.count_syncs(variant, cpu, 4)
    assert modes == ["warn", 0]  # on for the call, off after
    assert counted["syncs_per_call"] == 4 and counted["step_marks"] == 4
    assert counted["syncs_per_step"] == 1.0
    assert list(counted["where"].values()) == [4]
    assert variant.on_step is hook


@pytest.mark.slow
def test_default_part_commands_work_without_torchdata_or_datasets() -> None:
    """Every script and torchgpu command of the default part imports and parses its
    arguments with torchdata and datasets unimportable, and so do the modules its
    training runs and benchmarks load (the pytest step's collection was checked the same
    way by hand: it imports neither)."""
    code = """
import steps, parsecheck
from pathlib import Path
ctx = steps.Ctx(repo=Path('.'))
checked = []
for step in steps.make_plan('default').steps:
    argv = step.command(ctx)
    if argv[1:3] == ['-m', 'pytest']:
        continue  # pytest runs in a child of its own (parsecheck.check_pytest)
    checked.append(parsecheck.check_command(Path('.'), argv, step.environment(ctx)))
import importlib
for name in ('torchgpu.train.runner', 'torchgpu.train.strategies.placing',
             'torchgpu.examples.resnet50', 'torchgpu.bench.suites.transfer',
             'torchgpu.bench.suites.train_step',
             'torchgpu.train.recipe.compiling', 'transformers.models.gpt2.modeling_gpt2'):
    importlib.import_module(name)
assert sys.modules['torchdata'] is None and sys.modules['datasets'] is None
print('checked', checked)
"""
    done = run_blocked(code)
    assert done.returncode == 0, done.stdout + done.stderr
    checked = done.stdout.split("checked", 1)[1]
    for script in ("gpt2_step.py", "resnet_step.py", "memory_check.py", "torchgpu bench",
                   "torchgpu train"):
        assert script in checked
    assert len(steps.make_plan("default").steps) > 5
